"""Fault isolation with real processes: a leader in one world per worker;
killing or freezing one worker breaks that world only."""

from __future__ import annotations

import signal
import time

import numpy as np
import pytest

import multiworld_rs as mw

from conftest import spawn, unique

COUNT = 300
INTERVAL = 0.002


def leader_with_two_workers(prefix: str):
    m = mw.WorldManager()
    store = m.serve_store("127.0.0.1:0")
    names = [unique(prefix + "-a"), unique(prefix + "-b")]
    procs = [spawn("stream_worker.py", n, store, COUNT, INTERVAL) for n in names]
    worlds = [m.join(n, 0, 2, store, timeout=30, heartbeat_interval=0.1, heartbeat_timeout=1.0)
              for n in names]
    for w in worlds:  # both streams are flowing
        for i in range(5):
            assert w.recv(1, dtype=np.int64, shape=1)[0] == i
    return m, procs, worlds


def drain_until_broken(w: mw.World, first: int) -> mw.BrokenWorldError:
    for i in range(first, COUNT + 1):
        try:
            got = w.recv(1, dtype=np.int64, shape=1)
        except mw.BrokenWorldError as e:
            return e
        assert got[0] == i
    raise AssertionError("the world never broke")


def finish_healthy(m, proc, w):
    for i in range(5, COUNT):
        assert w.recv(1, dtype=np.int64, shape=1)[0] == i
    w.send(np.zeros(1, dtype=np.int64), 1, tag=1)
    w.finish(10)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "done" in out


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_one_worker_fails_only_its_world_breaks(how):
    m, procs, (broken, healthy) = leader_with_two_workers(how)
    victim = procs[0]
    try:
        t0 = time.monotonic()
        victim.send_signal(signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        err = drain_until_broken(broken, 5)
        took = time.monotonic() - t0
        expected = "peer_lost" if how == "kill" else "heartbeat_timeout"
        assert err.cause == expected, err
        assert err.world == broken.name and err.rank == 1 and err.generation == broken.generation
        assert took < 5.0, f"{how}: took {took:.2f} s"
        # The other world delivers every message, in order.
        finish_healthy(m, procs[1], healthy)
        assert broken.wait_removed(10)
        assert [i.name for i in m.worlds()] == []
    finally:
        if how == "stop":
            victim.send_signal(signal.SIGCONT)
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate(timeout=30)
        m.shutdown()
