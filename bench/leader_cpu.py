"""What a message costs in CPU: the leader scenario of `python -m
multiworld_rs.bench` (one leader process, one worker process per world),
Rust against Python, measured as CPU time per message summed over every
rank process.

    python bench/leader_cpu.py [--sizes 65536,1048576] [--workers 2]
        [--modes threads,asyncio] [--gib 1,5] [--repeats 2]

Each configuration runs twice, moving `--gib` gibibytes in all (the small
and the large amount); the CPU of the rank processes comes from
`getrusage(RUSAGE_CHILDREN)` around each run. Process start-up, joining and
finishing cost the same in both runs, so the difference of the two CPU
totals divided by the difference of the message counts is the CPU one
message costs while streaming (user and system time of the leader and the
workers together, the kernel's copies included). Context switches per
message are taken the same way. On a machine with fewer cores than busy
threads, throughput is bound by this cost: two cores divided by it.

Needs the release build of the Rust reference
(`cargo build --release -p multiworld-bench --bin mw-rank-bench`) and the
package (`bash crates/multiworld-py/scripts/test.sh`, `MW_PY_RELEASE=1` for
an optimized build); run it with `target/py-venv/bin/python`.
"""

import argparse
import resource
import sys
from pathlib import Path

try:
    from multiworld_rs import bench as B
except ImportError:  # a checkout: the package beside this folder (built there by scripts/test.sh)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "crates" / "multiworld-py" / "python"))
    from multiworld_rs import bench as B


def children() -> tuple:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime, r.ru_nvcsw + r.ru_nivcsw


def run(impl: str, size: int, workers: int, mode: str, gib: int) -> dict:
    plan = B.Plan()
    plan.load.bytes = gib << 30
    cpu0, csw0 = children()
    if impl == "rust":
        out = B._rust_run(B.find_rust_bin(), "leader", size, workers, plan)
    else:
        out = B._python_run("leader", size, workers, plan, mode)
    cpu1, csw1 = children()
    return {"messages": out["messages"], "gb_per_s": out["gb_per_s"], "cpu": cpu1 - cpu0, "csw": csw1 - csw0}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="65536,1048576")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--modes", default="threads,asyncio", help="the Python leader's modes")
    p.add_argument("--gib", default="1,5", help="the small and the large amount, GiB")
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()
    small, large = (int(x) for x in a.gib.split(","))
    if not 0 < small < large:
        p.error("--gib needs two amounts, the first smaller")
    print(f"{'impl':14} {'size':>8} {'GB/s (large run)':>17} {'CPU us/msg':>11} {'switches/msg':>13}")
    for _ in range(a.repeats):
        for size in (int(s) for s in a.sizes.split(",")):
            impls = [("rust", "")] + [("python", m) for m in a.modes.split(",")]
            for impl, mode in impls:
                lo, hi = run(impl, size, a.workers, mode, small), run(impl, size, a.workers, mode, large)
                msgs = hi["messages"] - lo["messages"]
                cpu = (hi["cpu"] - lo["cpu"]) / msgs * 1e6
                csw = (hi["csw"] - lo["csw"]) / msgs
                name = impl + (f" {mode}" if mode else "")
                print(f"{name:14} {size >> 10:>5} KiB {hi['gb_per_s']:>17.2f} {cpu:>11.1f} {csw:>13.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
