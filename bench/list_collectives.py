"""What a collective on lists of arrays costs from Python: N rank processes
(one world, rank 0 hosts its store), each running ITERS calls of OP on
float32 lists whose arrays hold SIZE bytes in all per rank (SIZE / N per
array), after 2 warm-up calls, as blocking calls (``blocking``), as
handles (``work``: ``async_op=True`` then ``wait()``) or as coroutines
(``asyncio``); prints rank 0's median ms per call. Each rank checks every
result. The arrays are separate (not views of one buffer), as a caller's
list usually is.

    target/py-venv/bin/python bench/list_collectives.py N OP SIZE ITERS MODE

OP: all_gather, gather, scatter, reduce_scatter, all_to_all.
MODE: blocking, work, asyncio.
"""
import asyncio
import statistics
import sys
import time

import numpy as np

import multiworld_rs as mw
from multiworld_rs import aio

from _common import rank0_output

OPS = ("all_gather", "gather", "scatter", "reduce_scatter", "all_to_all")
MODES = ("blocking", "work", "asyncio")


def _call(w, op: str, r: int, n: int, outs: list, ins: list, one: np.ndarray, async_op: bool):
    """Starts (or runs) one call of `op`; what `wait()` needs, or None."""
    if op == "all_gather":
        return w.all_gather(outs, one, async_op=async_op)
    if op == "gather":
        return w.gather(one, outs if r == 0 else None, 0, async_op=async_op)
    if op == "scatter":
        return w.scatter(one, ins if r == 0 else None, 0, async_op=async_op)
    if op == "reduce_scatter":
        return w.reduce_scatter(one, ins, async_op=async_op)
    return w.all_to_all(outs, ins, async_op=async_op)


async def _acall(aw, op: str, r: int, n: int, outs: list, ins: list, one: np.ndarray) -> None:
    if op == "all_gather":
        await aw.all_gather(outs, one)
    elif op == "gather":
        await aw.gather(one, outs if r == 0 else None, 0)
    elif op == "scatter":
        await aw.scatter(one, ins if r == 0 else None, 0)
    elif op == "reduce_scatter":
        await aw.reduce_scatter(one, ins)
    else:
        await aw.all_to_all(outs, ins)


def _check(op: str, r: int, n: int, outs: list, one: np.ndarray, i: int) -> None:
    """Every rank sends value `10 * sender + receiver` (or `sender` where the
    payload is the same for every receiver)."""
    ok = True
    if op in ("all_gather", "gather") and (op == "all_gather" or r == 0):
        ok = all((outs[p] == p).all() for p in range(n))
    elif op == "scatter":
        ok = bool((one == 10 * 0 + r).all())
    elif op == "reduce_scatter":
        ok = bool((one == sum(10 * p + r for p in range(n))).all())
    elif op == "all_to_all":
        ok = all((outs[p] == 10 * p + r).all() for p in range(n))
    if not ok:
        raise SystemExit(f"rank {r}: call {i} of {op} gave a wrong result")


def _rank(r: int, n: int, store: str, op: str, size: int, iters: int, mode: str) -> None:
    m = mw.WorldManager()
    w = m.join("list-collectives", r, n, store, timeout=60)
    part = max(size // n // 4, 1)
    outs = [np.empty(part, np.float32) for _ in range(n)]
    ins = [np.full(part, 10 * r + q, np.float32) for q in range(n)]
    one = np.empty(part, np.float32)
    times = []

    def prepare() -> None:
        for o in outs:
            o[:] = -1
        one[:] = r if op in ("all_gather", "gather") else -1

    if mode == "asyncio":
        aw = aio.AsyncWorld(w)

        async def go() -> None:
            for i in range(iters + 2):
                prepare()
                t0 = time.perf_counter()
                await _acall(aw, op, r, n, outs, ins, one)
                if i >= 2:
                    times.append(time.perf_counter() - t0)
                _check(op, r, n, outs, one, i)

        asyncio.run(go())
    else:
        for i in range(iters + 2):
            prepare()
            t0 = time.perf_counter()
            work = _call(w, op, r, n, outs, ins, one, mode == "work")
            if work is not None:
                work.wait()
            if i >= 2:
                times.append(time.perf_counter() - t0)
            _check(op, r, n, outs, one, i)
    w.finish(30)
    m.shutdown()
    if r == 0:
        print(f"{statistics.median(times) * 1e3:.3f}", flush=True)


def measure(n: int, op: str, size: int, iters: int, mode: str) -> float:
    """Rank 0's median ms per call, the ranks run as processes of their own."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    out = rank0_output(__file__, n, [op, size, iters, mode])
    return float(out.strip())


def main(argv: list) -> int:
    if argv[:1] == ["_rank"]:
        _rank(int(argv[1]), int(argv[2]), argv[3], argv[4], int(argv[5]), int(argv[6]), argv[7])
        return 0
    if len(argv) != 5 or argv[1] not in OPS or argv[4] not in MODES:
        print(__doc__, file=sys.stderr)
        return 2
    print(f"{measure(int(argv[0]), argv[1], int(argv[2]), int(argv[3]), argv[4]):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
