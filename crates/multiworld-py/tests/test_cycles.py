"""Join/leave cycles release everything: file descriptors come back to their
level, and the name is joined again with a new generation each time."""

from __future__ import annotations

import time

import numpy as np

import multiworld_rs as mw

from conftest import both, fd_count, unique

CYCLES = 50


def settle(baseline: int, deadline: float = 5.0) -> int:
    end = time.monotonic() + deadline
    n = fd_count()
    while n > baseline and time.monotonic() < end:
        time.sleep(0.02)
        n = fd_count()
    return n


def test_join_leave_cycles_release_fds():
    a, b = mw.WorldManager(), mw.WorldManager()
    store = a.serve_store("127.0.0.1:0")
    name = unique("cycle")

    def cycle(i: int) -> int:
        w0, w1 = both(lambda: a.join(name, 0, 2, store, timeout=10),
                      lambda: b.join(name, 1, 2, store, timeout=10))
        x = np.full(4, i, dtype=np.int32)
        _, got = both(lambda: w1.send(x, 0), lambda: w0.recv(1, dtype="int32", shape=4))
        assert (got == i).all()
        if i % 2:
            both(lambda: w0.finish(10), lambda: w1.finish(10))
        else:  # abort instead: a broken world is torn down just as well
            w1.abort()
        assert w0.wait_removed(10) and w1.wait_removed(10)
        return w0.generation

    cycle(0)  # warm up: the first cycle opens long-lived fds (runtime, store)
    baseline = settle(fd_count())
    generations = {cycle(i) for i in range(1, CYCLES + 1)}
    assert len(generations) == CYCLES
    after = settle(baseline)
    assert after <= baseline, f"fds: {baseline} before, {after} after {CYCLES} cycles"
    assert a.worlds() == [] and b.worlds() == []
    a.shutdown()
    b.shutdown()
