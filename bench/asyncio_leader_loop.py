"""Where an asyncio leader's event loop spends its time: a leader receiving
from N workers, each in its own world of two (the workers are the package
benchmark's own rank processes, `python -m multiworld_rs.bench _rank
leader`), as `python -m multiworld_rs.bench` runs it with `--mode asyncio`,
but with the loop instrumented.

    target/py-venv/bin/python bench/asyncio_leader_loop.py [--workers 4] [--size 65536] [--repeats 3]

Each repeat prints the leader's GB/s and, per message received:
- µs of the loop's thread busy (the run's time less the time the loop
  spent waiting in its selector);
- how many messages a `recv_into` found read ahead and took at once, how
  many went through the loop, and how many of those the posting call
  completed itself (read from the socket in the call);
- the mean µs of the native calls that take a message at once and that
  post a receive.

Needs the package (`MW_PY_RELEASE=1 bash crates/multiworld-py/scripts/test.sh`
builds and installs it into `target/py-venv`).
"""

import argparse
import asyncio
import selectors
import time

import numpy as np

from _common import LeaderRun
from multiworld_rs import bench as b
from multiworld_rs._api import _LentRecv
from multiworld_rs.aio import AsyncWorld


def one_run(workers: int, size: int, load: "b.Load | None" = None) -> dict:
    """One run: the leader's figures (see the module docs) as a dict."""
    select = selectors.EpollSelector.select
    waited = [0.0]

    def timed_select(self, timeout=None):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        try:
            return select(self, timeout)
        finally:
            waited[0] += time.perf_counter() - t

    n = {"at_once": 0, "through_loop": 0, "done_posting": 0}
    spent = {"take": 0.0, "post": 0.0}
    with LeaderRun(workers, size, load) as run:
        count = run.count

        async def main() -> float:
            aws = [AsyncWorld(w) for w in run.worlds]

            # AsyncWorld.recv_into, step by step, counted.
            async def receive(aw: AsyncWorld, buf: np.ndarray) -> None:
                take = aw.sync._w.recv_into_now
                for _ in range(count):
                    await aw._take_turn()
                    t = time.perf_counter()
                    got = take(buf, 1, b._DATA)
                    spent["take"] += time.perf_counter() - t
                    if got is not None:
                        aw._in_a_row += 1
                        n["at_once"] += 1
                        continue
                    n["through_loop"] += 1
                    t = time.perf_counter()
                    work = _LentRecv(aw.sync._w.irecv_plain(buf, 1, b._DATA, True), buf)
                    spent["post"] += time.perf_counter() - t
                    if work.is_completed():
                        n["done_posting"] += 1
                    await aw._finish(work, True)

            t0 = time.perf_counter()
            for aw in aws:
                await aw.send(run.go, 1, b._GO)
            await asyncio.gather(*(receive(aw, x) for aw, x in zip(aws, run.bufs)))
            return time.perf_counter() - t0

        selectors.EpollSelector.select = timed_select  # type: ignore[method-assign]
        try:
            secs = asyncio.run(main())
        finally:
            selectors.EpollSelector.select = select  # type: ignore[method-assign]
    total = count * workers
    busy = max(secs - waited[0], 0.0)
    return {"workers": workers, "size": size, "messages": total, "gb_per_s": total * size / secs / 1e9,
            "loop_busy_us": busy / total * 1e6, "loop_busy_share": busy / secs, **n,
            "take_us": spent["take"] / max(total, 1) * 1e6,
            "post_us": spent["post"] / max(n["through_loop"], 1) * 1e6}


def describe(r: dict) -> str:
    return (f"{r['workers']} workers, {r['size']} B: {r['gb_per_s']:.2f} GB/s; loop busy "
            f"{r['loop_busy_us']:.1f} us/message ({r['loop_busy_share']:.0%} of the run); taken at once "
            f"{r['at_once']}, through the loop {r['through_loop']} (completed in the posting call "
            f"{r['done_posting']}); native take {r['take_us']:.1f} us/call, post {r['post_us']:.1f} us/call")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--size", type=int, default=64 << 10)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    for r in range(a.repeats):
        print(f"run {r + 1}: {describe(one_run(a.workers, a.size))}", flush=True)


if __name__ == "__main__":
    main()
