"""Fault isolation with real processes: a leader in one world per worker;
killing or freezing one worker breaks that world only."""

from __future__ import annotations

import signal
import threading
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


def test_a_member_killed_mid_shared_memory_all_reduce_fails_the_others_blocking_calls():
    """Three processes run 8 MiB all-reduces, whose data go through their
    shared-memory segment and whose blocking calls wait at its barriers on
    the calling thread. SIGKILL of one: every survivor's call fails with
    BrokenWorldError within the bound (never a partial result as success),
    and a second world between two survivors still delivers."""
    m = mw.WorldManager()
    store = m.serve_store("127.0.0.1:0")
    name, other = unique("shm-kill"), unique("shm-kill-other")
    procs = {r: spawn("shm_kill_worker.py", r, store, name, other) for r in (1, 2)}
    try:
        w = m.join(name, 0, 3, store, timeout=60)
        o = m.join(other, 0, 2, store, timeout=60)
        failed = {}

        def calls():
            t = np.empty(1 << 21, np.float32)
            n = 0
            while True:
                t[:] = 1
                try:
                    w.all_reduce(t, "sum")
                except mw.BrokenWorldError as e:
                    failed.update(at=time.time(), error=e, calls=n)
                    return
                assert (t == 6).all(), f"call {n}: wrong result"
                n += 1

        th = threading.Thread(target=calls, daemon=True)
        th.start()
        for r, p in procs.items():
            assert p.stdout.readline().strip() == "ready", f"rank {r} never got going"
        # The calls go through the members' shared memory (waits for a turn
        # between two of rank 0's calls), unless this system keeps the
        # processes from mapping each other's memory.
        shm = w.shared_memory()
        if shm[0] == "unavailable":
            pytest.skip(f"shared memory is unavailable here: {shm[1]}")
        assert shm == ("active", None), shm
        procs[2].send_signal(signal.SIGKILL)
        killed = time.time()
        th.join(10)
        assert not th.is_alive(), "rank 0's call hung after the kill"
        e = failed["error"]
        assert e.world == name and e.cause in ("peer_lost", "reported_by_peer"), e
        assert failed["at"] - killed < 2.0, f"rank 0 failed {failed['at'] - killed:.3f} s after the kill"
        line = procs[1].stdout.readline().split()
        assert line[:1] == ["broken"], line
        assert line[2] in ("peer_lost", "reported_by_peer"), line
        assert float(line[1]) - killed < 2.0, f"rank 1 failed {float(line[1]) - killed:.3f} s after the kill"
        # The other world, between the two survivors, is untouched.
        o.send(np.arange(4, dtype=np.int64), 1)
        assert o.recv(1, dtype=np.int64, shape=4).tolist() == [0, 2, 4, 6]
        o.finish(10)
        out, err = procs[1].communicate(timeout=30)
        assert procs[1].returncode == 0 and "OK" in out, err
        print(f"rank 0 failed {failed['at'] - killed:.4f} s, rank 1 {float(line[1]) - killed:.4f} s "
              f"after the kill ({failed['calls']} calls before)")
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
            p.communicate()
        m.shutdown()
