"""What an all-reduce in the background costs from Python: N rank processes
(one world, rank 0 hosts its store), each running ITERS float32 sum
all-reduces of SIZE bytes after 2 warm-up calls, either as coroutines
(``asyncio``: ``await AsyncWorld.all_reduce(t)``) or as handles
(``work``: ``World.all_reduce(t, async_op=True).wait()``); prints rank 0's
median ms per call. Each rank checks every result.

    target/py-venv/bin/python bench/async_all_reduce.py N SIZE ITERS asyncio|work
"""
import asyncio
import statistics
import sys
import time

import numpy as np

import multiworld_rs as mw
from multiworld_rs import aio

from _common import rank0_output

MODES = ("asyncio", "work")


def _rank(r: int, n: int, store: str, size: int, iters: int, mode: str) -> None:
    m = mw.WorldManager()
    w = m.join("async-all-reduce", r, n, store, timeout=60)
    t = np.empty(size // 4, np.float32)
    want = n * (n + 1) / 2  # every rank contributes rank + 1
    times = []

    def check(i: int) -> None:
        if not (t == want).all():
            raise SystemExit(f"rank {r}: call {i} gave a wrong result")

    if mode == "asyncio":
        aw = aio.AsyncWorld(w)

        async def go() -> None:
            for i in range(iters + 2):
                t[:] = r + 1
                t0 = time.perf_counter()
                await aw.all_reduce(t)
                if i >= 2:
                    times.append(time.perf_counter() - t0)
                check(i)

        asyncio.run(go())
    else:
        for i in range(iters + 2):
            t[:] = r + 1
            t0 = time.perf_counter()
            w.all_reduce(t, async_op=True).wait()
            if i >= 2:
                times.append(time.perf_counter() - t0)
            check(i)
    w.finish(30)
    m.shutdown()
    if r == 0:
        print(f"{statistics.median(times) * 1e3:.3f}", flush=True)


def measure(n: int, size: int, iters: int, mode: str) -> float:
    """Rank 0's median ms per call, the ranks run as processes of their own."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    out = rank0_output(__file__, n, [size, iters, mode])
    return float(out.strip())


def main(argv: list) -> int:
    if argv[:1] == ["_rank"]:
        _rank(int(argv[1]), int(argv[2]), argv[3], int(argv[4]), int(argv[5]), argv[6])
        return 0
    if len(argv) != 4 or argv[3] not in MODES:
        print(__doc__, file=sys.stderr)
        return 2
    print(f"{measure(int(argv[0]), int(argv[1]), int(argv[2]), argv[3]):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
