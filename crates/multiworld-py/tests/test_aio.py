"""The asyncio twin over an in-process pair."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import multiworld_rs as mw
from multiworld_rs import aio

from conftest import unique


async def pair():
    a, b = aio.AsyncWorldManager(), aio.AsyncWorldManager()
    store = await a.serve_store()
    name = unique("aio")
    w0, w1 = await asyncio.gather(a.join(name, 0, 2, store, timeout=10), b.join(name, 1, 2, store, timeout=10))
    return a, b, w0, w1


def test_p2p_and_collectives():
    async def main():
        a, b, w0, w1 = await pair()
        x = np.arange(5, dtype=np.float32)
        _, got = await asyncio.gather(w1.send(x, 0, 2), w0.recv(1, 2, dtype="float32", shape=5))
        assert (got == x).all()
        out = np.zeros(5, np.float32)
        _, src = await asyncio.gather(w0.send(x, 1), w1.recv_into(out, 0))
        assert src == 0 and (out == x).all()
        t0, t1 = np.array([1, 2], np.int64), np.array([10, 20], np.int64)
        await asyncio.gather(w0.all_reduce(t0), w1.all_reduce(t1, "sum"))
        assert (t0 == [11, 22]).all() and (t1 == [11, 22]).all()
        await asyncio.gather(w0.barrier(), w1.barrier())
        # The loop stays responsive while a receive waits.
        ticks = 0

        async def tick():
            nonlocal ticks
            for _ in range(10):
                await asyncio.sleep(0.01)
                ticks += 1

        pending = asyncio.ensure_future(w0.recv(1, 7, dtype="int8", shape=1))
        await tick()
        assert ticks == 10 and not pending.done()
        pending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pending
        # The cancelled receive was withdrawn: the next message goes to a new one.
        _, got = await asyncio.gather(w1.send(np.ones(1, np.int8), 0, 7), w0.recv(1, 7, dtype="int8", shape=1))
        assert got[0] == 1
        await asyncio.gather(w0.finish(10), w1.finish(10))
        await a.shutdown()
        await b.shutdown()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_broken_world_raises_in_coroutines():
    async def main():
        a, b, w0, w1 = await pair()
        w1.abort()
        with pytest.raises(mw.BrokenWorldError) as info:
            await w0.recv(1, dtype="float32", shape=1)
        assert info.value.rank == 1
        await a.shutdown()
        await b.shutdown()

    asyncio.run(asyncio.wait_for(main(), 60))
