"""Join/leave cycles release everything: file descriptors come back to their
level, resident memory does not grow with the cycles, and the name is joined
again with a new generation each time."""

from __future__ import annotations

import os
import time

import numpy as np

import multiworld_rs as mw

from conftest import both, fd_count, unique

CYCLES = 100
#: Resident memory may move a little between cycles (allocator caches, the
#: runtime's thread stacks; ~0.5 MiB over 100 cycles measured here); a leak
#: of the world's buffers, connections or tasks grows it with every cycle:
#: keeping just the 64 KiB message of each cycle would add 6.4 MiB.
RSS_SLACK = 4 << 20


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def settle(baseline: int, deadline: float = 5.0) -> int:
    end = time.monotonic() + deadline
    n = fd_count()
    while n > baseline and time.monotonic() < end:
        time.sleep(0.02)
        n = fd_count()
    return n


def test_join_leave_cycles_release_fds_and_memory():
    a, b = mw.WorldManager(), mw.WorldManager()
    store = a.serve_store("127.0.0.1:0")
    name = unique("cycle")

    def cycle(i: int) -> int:
        w0, w1 = both(lambda: a.join(name, 0, 2, store, timeout=10),
                      lambda: b.join(name, 1, 2, store, timeout=10))
        x = np.full(16384, i, dtype=np.int32)  # 64 KiB
        _, got = both(lambda: w1.send(x, 0), lambda: w0.recv(1, dtype="int32", shape=16384))
        assert (got == i).all()
        if i % 2:
            both(lambda: w0.finish(10), lambda: w1.finish(10))
        else:  # abort instead: a broken world is torn down just as well
            w1.abort()
        assert w0.wait_removed(10) and w1.wait_removed(10)
        return w0.generation

    # Warm up: the first cycles open long-lived fds (runtime, store) and
    # fill the allocator's caches.
    for i in range(5):
        cycle(-1 - i)
    baseline = settle(fd_count())
    rss_before = rss()
    generations = {cycle(i) for i in range(1, CYCLES + 1)}
    assert len(generations) == CYCLES
    after = settle(baseline)
    assert after <= baseline, f"fds: {baseline} before, {after} after {CYCLES} cycles"
    grown = rss() - rss_before
    print(f"rss: {rss_before >> 10} KiB before, grown by {grown >> 10} KiB over {CYCLES} cycles")
    assert grown <= RSS_SLACK, f"resident memory grew by {grown >> 10} KiB over {CYCLES} cycles"
    assert a.worlds() == [] and b.worlds() == []
    a.shutdown()
    b.shutdown()
