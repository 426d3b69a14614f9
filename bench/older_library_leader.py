"""A leader receiving from K workers, one world per worker: the older Python
library (PyPI `multiworld`, torch 2.4.0 patched) against this project, one
process per rank, on the same machine in the same run.

    python bench/older_library_leader.py [--install | --old-python PATH]
        [--sizes 65536,16777216] [--workers 3] [--seconds 3] [--repeats 2] [--json FILE]

Three implementations per size, interleaved, each repeat:

- `old`: this file's leader and workers written against the older library's
  API (`WorldManager.initialize_world`, `communicator.send`/`recv`, gloo),
  run by `--old-python` (a Python with `torch==2.4.0` and `multiworld`
  installed; default `target/oldmw/venv/bin/python`, which `--install`
  creates from the package registry, about 3 GB with torch's CUDA wheels;
  the library patches torch on first import, which this script triggers
  once);
- `compat`: the same code with only the import switched to
  `multiworld_rs.compat` (run by this Python);
- `rust`: the Rust leader, `mw-rank-bench run leader` (the `multiworld`
  crate, one process per rank).

Each runs with its own defaults, as its users would: the compat leader reads
messages of up to 256 KiB ahead (the Python package's default), the Rust
leader 16 KiB (the crate's).

The leader receives every world's messages concurrently (one asyncio task per
world for the Python ones); after a warm-up of 0.5 s it counts the messages
that arrive during `--seconds` and prints messages per second. `--install`
sets up the older library as:

    python3 -m venv target/oldmw/venv
    target/oldmw/venv/bin/pip install torch==2.4.0 multiworld "numpy<2"
"""

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_rust_bin, free_port, rust_bin  # noqa: E402

WARM_S = 0.5
OLD_VENV = Path(__file__).resolve().parents[1] / "target" / "oldmw" / "venv"


def _manager(impl: str):
    if impl == "old":
        from multiworld.manager import WorldManager
    else:
        from multiworld_rs.compat.manager import WorldManager
    return WorldManager()


async def _leader(impl: str, workers: int, size: int, seconds: float, base_port: int) -> dict:
    import torch

    wm = _manager(impl)
    for i in range(1, workers + 1):
        await wm.initialize_world(f"w{i}", 0, 2, backend="gloo", addr="127.0.0.1", port=base_port + i)
    comm = wm.communicator
    counts = [0] * workers
    stop = False

    async def receive(i: int) -> None:
        buf = torch.zeros(size // 4)
        while not stop:
            await comm.recv(buf, 1, f"w{i + 1}")
            counts[i] += 1

    tasks = [asyncio.ensure_future(receive(i)) for i in range(workers)]
    await asyncio.sleep(WARM_S)
    c0, t0 = sum(counts), time.perf_counter()
    await asyncio.sleep(seconds)
    c1, t1 = sum(counts), time.perf_counter()
    stop = True
    for i in range(workers):
        wm.remove_world(f"w{i + 1}")
    await asyncio.wait(tasks, timeout=5)
    n = c1 - c0
    return {"impl": impl, "size": size, "workers": workers, "messages": n,
            "msgs_per_s": n / (t1 - t0), "gb_per_s": n * size / (t1 - t0) / 1e9}


async def _worker(impl: str, index: int, size: int, base_port: int) -> None:
    import torch

    wm = _manager(impl)
    world = f"w{index}"
    await wm.initialize_world(world, 1, 2, backend="gloo", addr="127.0.0.1", port=base_port + index)
    data = torch.ones(size // 4)
    try:
        while True:
            await wm.communicator.send(data, 0, world)
    except Exception:  # the leader removed the world: done
        pass


def _free_base(workers: int) -> int:
    """A port P with P+1 .. P+workers free right now (one world each)."""
    for _ in range(100):
        base = free_port()
        try:
            for i in range(1, workers + 1):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
    raise SystemExit(f"no run of {workers} free ports found")


def _run_python(python: str, impl: str, workers: int, size: int, seconds: float) -> dict:
    base = _free_base(workers)
    me = [python, __file__, "--role"]
    common = ["--impl", impl, "--size", str(size), "--base-port", str(base)]
    procs = [subprocess.Popen(me + ["worker", "--index", str(i)] + common,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              stdin=subprocess.DEVNULL)
             for i in range(1, workers + 1)]
    try:
        done = subprocess.run(me + ["leader", "--workers", str(workers), "--seconds", str(seconds)] + common,
                              capture_output=True, text=True, timeout=seconds + 120)
    finally:
        deadline = time.time() + 10
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    if done.returncode != 0:
        raise SystemExit(f"{impl} leader failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _run_rust(binary: Path, workers: int, size: int, seconds: float) -> dict:
    # As many bytes as the Python leaders move in `seconds` at ~5 GB/s, at
    # least 100 messages.
    load = ["--bytes", str(int(5e9 * seconds)), "--min-messages", "100"]
    done = subprocess.run([str(binary), "run", "leader", "--sizes", str(size), "--n", str(workers), *load],
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"mw-rank-bench failed: {done.stderr[-2000:]}")
    r = json.loads(done.stdout.strip().splitlines()[-1])
    return {"impl": "rust", "size": size, "workers": workers, "messages": r["messages"],
            "msgs_per_s": r["msgs_per_s"], "gb_per_s": r["gb_per_s"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--role", choices=("leader", "worker"))
    p.add_argument("--impl", choices=("old", "compat"), default="compat")
    p.add_argument("--index", type=int, default=1)
    p.add_argument("--size", type=int, default=16 << 20)
    p.add_argument("--base-port", type=int, default=0)
    p.add_argument("--old-python", default=str(OLD_VENV / "bin" / "python"),
                   help="a Python with torch 2.4.0 and the older multiworld installed (default: %(default)s)")
    p.add_argument("--install", action="store_true",
                   help=f"first create {OLD_VENV} with torch 2.4.0 and the older multiworld (about 3 GB)")
    p.add_argument("--sizes", default=f"{64 << 10},{16 << 20}")
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--repeats", type=int, default=2)
    add_rust_bin(p)
    a = p.parse_args()
    if a.role == "leader":
        print(json.dumps(asyncio.run(_leader(a.impl, a.workers, a.size, a.seconds, a.base_port))))
        return
    if a.role == "worker":
        asyncio.run(_worker(a.impl, a.index, a.size, a.base_port))
        return
    if a.install:
        subprocess.run([sys.executable, "-m", "venv", str(OLD_VENV)], check=True)
        subprocess.run([str(OLD_VENV / "bin" / "pip"), "install", "torch==2.4.0", "multiworld", "numpy<2"],
                       check=True)
    if not Path(a.old_python).is_file():
        p.error(f"{a.old_python} not found: pass --install to create it, or --old-python PATH")
    binary = rust_bin(a)
    # The older library patches torch on its first import and exits; do that once here.
    subprocess.run([a.old_python, "-c", "import multiworld.manager"], capture_output=True, timeout=300)
    check = subprocess.run([a.old_python, "-c", "import multiworld.manager, torch; print(torch.__version__)"],
                           capture_output=True, text=True, timeout=300)
    if check.returncode != 0:
        raise SystemExit(f"the older library does not import: {check.stderr[-2000:]}")
    results = []
    for size in (int(s) for s in a.sizes.split(",")):
        for r in range(a.repeats):
            row = {}
            for impl in ("old", "compat", "rust"):
                if impl == "rust":
                    m = _run_rust(binary, a.workers, size, a.seconds)
                else:
                    python = a.old_python if impl == "old" else sys.executable
                    m = _run_python(python, impl, a.workers, size, a.seconds)
                m["repeat"] = r
                results.append(m)
                row[impl] = m["msgs_per_s"]
            old = max(row["old"], 1e-9)
            print(f"{size:>9} B  {a.workers} workers  repeat {r + 1}:  older library {row['old']:9.1f} msg/s"
                  f"   multiworld_rs.compat {row['compat']:9.1f} msg/s ({row['compat'] / old:.2f}x)"
                  f"   Rust {row['rust']:9.1f} msg/s ({row['rust'] / old:.2f}x)", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"torch_old": check.stdout.strip(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
