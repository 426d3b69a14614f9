"""Every collective, side by side, one process per rank: torch.distributed's
gloo backend against multiworld (`mw-rank-bench <collective>`, the facade),
on this machine in the same minutes.

For each process count, gloo runs every collective and size in one process
group, then multiworld runs each (one set of processes per measurement);
with `--repeats` above 1 the two alternate. Both time back-to-back calls on
rank 0 (two untimed calls first; for all_reduce as many as the timed ones)
and report the median time per call, with
the same tensors (float32, `size` bytes per rank):

- broadcast, reduce (sum, to rank 0), all_reduce (sum): one tensor of `size`;
- all_gather: every rank's `size` into one tensor of `procs x size`;
- reduce_scatter (sum): `size` in, `size / procs` out;
- all_to_all: `size` in and out, `size / procs` to each rank;
- gather (to rank 0), scatter (from rank 0): `size` per rank.

The physical references, measured in the same run:

- one copy of `size` bytes between two aligned buffers in one process
  (`mw-rank-bench run memcpy`), the least one copy into or out of shared
  memory costs;
- the copy floor: every one of the `procs` processes copying `size` bytes
  at once, with no communication (`mw-rank-bench run copy-floor`, the
  faster of a plain copy and the runtime's large copy). A collective
  whose processes together must read at least `procs x size` bytes and
  write at least as many (all_reduce, all_gather, all_to_all, gather,
  scatter) moves at least that much, so `gloo ms / floor ms` is about the
  highest ratio to gloo any implementation could reach in that cell on
  this machine: the "ceiling" column, with "(below 5x)" where even that
  is under issue 18's target. It is a reference, not a strict bound: it
  is measured minutes apart from each cell, and a noisy machine moves it.

    python3 -m venv target/py-venv && target/py-venv/bin/pip install torch   # once
    cargo build --release -p multiworld-bench --bin mw-rank-bench
    target/py-venv/bin/python bench/collectives_side_by_side.py [--procs 2,4]
        [--sizes 1024,1048576,67108864] [--repeats 1] [--json FILE] [--also ARGS]
        [--collectives all_reduce,reduce]

`--also '--shm-spin-us=0'` measures a second multiworld setting beside the
default in every cell (a before/after against the same gloo figures).

A collective gloo does not implement shows as "n/a". Not part of the tests;
needs PyTorch and the release `mw-rank-bench`.
"""

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _common import add_rust_bin, free_port, rust_bin

COLLECTIVES = ["broadcast", "reduce", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"]
BYTES = 1 << 30


def iters(size: int) -> int:
    """Timed calls per measurement: the Rust ranks' rule (`Load::iters`)."""
    return min(max(BYTES // size, 5), 50)


def warmup(name: str, size: int) -> int:
    """Untimed calls before the timed ones: the Rust ranks' rule, two, and
    for all_reduce as many as the timed ones (`Load::all_reduce_warmup`)."""
    return max(iters(size), 2) if name == "all_reduce" else 2


def gloo_call(name: str, rank: int, n: int, size: int):
    """A zero-argument callable doing one `name` call, tensors allocated once."""
    elems = max(1, size // 4)
    part = max(1, elems // n)
    t = torch.ones(elems)
    if name == "broadcast":
        return lambda: dist.broadcast(t, 0)
    if name == "reduce":
        return lambda: dist.reduce(t, 0)
    if name == "all_reduce":
        return lambda: dist.all_reduce(t)
    if name == "all_gather":
        big = torch.zeros(n * elems)
        return lambda: dist.all_gather_into_tensor(big, t)
    if name == "reduce_scatter":
        src, out = torch.ones(part * n), torch.zeros(part)
        return lambda: dist.reduce_scatter_tensor(out, src)
    if name == "all_to_all":
        src, out = torch.ones(part * n), torch.zeros(part * n)
        return lambda: dist.all_to_all_single(out, src)
    if name == "gather":
        lst = [torch.zeros(elems) for _ in range(n)] if rank == 0 else None
        return lambda: dist.gather(t, lst, dst=0)
    if name == "scatter":
        lst = [torch.ones(elems) for _ in range(n)] if rank == 0 else None
        return lambda: dist.scatter(t, lst, src=0)
    raise ValueError(name)


def gloo_rank(rank: int, n: int, port: int, sizes, out, names=COLLECTIVES) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=n)
    for size in sizes:
        for name in names:
            call = gloo_call(name, rank, n, size)
            try:
                for _ in range(warmup(name, size)):
                    call()
            except (RuntimeError, NotImplementedError, ValueError) as e:
                # Unsupported by gloo: every rank raises the same, at once.
                if rank == 0:
                    out.put((name, size, None, str(e).splitlines()[0][:80]))
                dist.barrier()
                continue
            times = []
            for _ in range(iters(size)):
                start = time.perf_counter()
                call()
                times.append(time.perf_counter() - start)
            if rank == 0:
                out.put((name, size, statistics.median(times) * 1e3, ""))
    dist.destroy_process_group()


def gloo(n: int, sizes, names=COLLECTIVES) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=gloo_rank, args=(r, n, port, sizes, out, names)) for r in range(n)]
    for p in procs:
        p.start()
    got = {}
    for _ in range(len(sizes) * len(names)):
        name, size, ms, why = out.get(timeout=1800)
        got[(name, size)] = (ms, why)
    for p in procs:
        p.join(60)
    return got


def multiworld(binary: Path, name: str, n: int, size: int, extra=()) -> float:
    cmd = [str(binary), "run", name.replace("_", "-"), "--sizes", str(size), "--n", str(n),
           "--bytes", str(BYTES), *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["ms"]


def memcpy_ms(binary: Path, size: int) -> float:
    """The median time of one copy of `size` bytes (the physical reference)."""
    cmd = [str(binary), "run", "memcpy", "--sizes", str(size), "--bytes", str(BYTES)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["ms"]


# The collectives whose processes together read and write at least
# `procs x size` bytes each way: the copy floor bounds them from below.
FLOORED = {"all_reduce", "all_gather", "all_to_all", "gather", "scatter"}


def copy_floor_ms(binary: Path, n: int, size: int) -> float:
    """The copy floor: `n` processes each copying `size` bytes at once."""
    cmd = [str(binary), "run", "copy-floor", "--sizes", str(size), "--n", str(n), "--bytes", str(BYTES)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["ms"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--procs", default="2,4")
    p.add_argument("--sizes", default=f"1024,{1 << 20},{64 << 20}")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--also", default="",
                   help="extra mw-rank-bench arguments of a second multiworld setting measured beside "
                        "the default in each cell, e.g. '--shm-spin-us=0' (a before/after in one run)")
    p.add_argument("--collectives", default=",".join(COLLECTIVES),
                   help="the collectives to run, comma-separated (default: all of them)")
    add_rust_bin(p)
    a = p.parse_args()
    names = [c.strip() for c in a.collectives.split(",") if c.strip()]
    unknown = [c for c in names if c not in COLLECTIVES]
    if unknown or not names:
        p.error(f"--collectives: unknown {unknown}, choose from {COLLECTIVES}")
    binary = rust_bin(a)
    sizes = [int(s) for s in a.sizes.split(",")]
    also = a.also.split()
    rows = []
    print(f"torch {torch.__version__} gloo vs multiworld (mw-rank-bench), one process per rank, "
          f"median ms per call, {a.repeats} repeat(s)", flush=True)
    print(f"{'collective':15} {'procs':>5} {'size':>10}  {'gloo ms':>10} {'multiworld ms':>14}  ratio", flush=True)
    for n in [int(x) for x in a.procs.split(",")]:
        results = {(c, s): ([], [], []) for c in names for s in sizes}
        copies = {s: [] for s in sizes}
        floors = {s: [] for s in sizes}
        notes = {}
        for _ in range(a.repeats):
            for (c, s), (ms, why) in gloo(n, sizes, names).items():
                if ms is not None:
                    results[(c, s)][0].append(ms)
                else:
                    notes[(c, s)] = why
            for s in sizes:
                copies[s].append(memcpy_ms(binary, s))
                floors[s].append(copy_floor_ms(binary, n, s))
                for c in names:
                    results[(c, s)][1].append(multiworld(binary, c, n, s))
                    if also:
                        results[(c, s)][2].append(multiworld(binary, c, n, s, also))
        for s in sizes:
            print(f"{'(memcpy)':15} {1:>5} {s:>10}  {'':>10} "
                  f"{' / '.join(f'{x:.3f}' for x in copies[s]):>14}  one copy, the reference", flush=True)
            print(f"{'(copy floor)':15} {n:>5} {s:>10}  {'':>10} "
                  f"{' / '.join(f'{x:.3f}' for x in floors[s]):>14}  every process copies at once", flush=True)
            for c in names:
                g, m, m2 = results[(c, s)]
                ratios = [gi / mi for gi, mi in zip(g, m)]
                rows.append({"collective": c, "procs": n, "size": s, "gloo_ms": g, "multiworld_ms": m,
                             "ratios": ratios, "gloo_note": notes.get((c, s), ""),
                             "memcpy_ms": list(copies[s]), "copy_floor_ms": list(floors[s])})
                ceilings = [gi / fi for gi, fi in zip(g, floors[s])] if c in FLOORED else []
                if ceilings:
                    rows[-1]["ceilings"] = ceilings
                if also:
                    rows[-1].update({"also": a.also, "also_ms": m2,
                                     "also_ratios": [gi / mi for gi, mi in zip(g, m2)]})
                gs = " / ".join(f"{x:.3f}" for x in g) if g else "n/a"
                ms_ = " / ".join(f"{x:.3f}" for x in m)
                rs = " / ".join(f"{x:.2f}x" for x in ratios) if ratios else notes.get((c, s), "")
                more = ""
                if also:
                    more = ("   with " + a.also + ": " + " / ".join(f"{x:.3f}" for x in m2) + " ms, "
                            + " / ".join(f"{gi / mi:.2f}x" for gi, mi in zip(g, m2)))
                if ceilings:
                    more += ("   ceiling " + " / ".join(f"{x:.2f}x" for x in ceilings)
                             + (" (below 5x)" if min(ceilings) < 5 else ""))
                print(f"{c:15} {n:>5} {s:>10}  {gs:>10} {ms_:>14}  {rs}{more}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
