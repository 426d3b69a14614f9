"""multiworld_rs.compat: the older library's names and signatures on our
runtime. In-process pairs (two compat managers in one event loop) for the
operations and the name lifecycle; real processes for fault isolation and the
example."""

from __future__ import annotations

import asyncio
import inspect
import os
import pickle
import re
import signal
import subprocess
import sys
from typing import Any, List

import numpy as np
import pytest

import multiworld_rs as mw
from multiworld_rs.compat import ReduceOp
from multiworld_rs.compat.communicator import BrokenWorldException, WorldCommunicator
from multiworld_rs.compat.manager import WorldManager

from conftest import free_port, unique

pytestmark = pytest.mark.timeout(120)

EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "compat_send_recv.py")


def run(coro: Any, timeout: float = 60.0) -> Any:
    async def bounded() -> Any:
        return await asyncio.wait_for(coro, timeout)
    return asyncio.run(bounded())


async def pair(name: str, port: int, a: WorldManager, b: WorldManager, **kw: Any) -> None:
    """Initializes ``name`` with a as rank 0 (hosting on port) and b as rank
    1; rank 1 starts first (it must wait for the store to come up)."""
    t1 = asyncio.create_task(b.initialize_world(name, 1, 2, port=port, timeout=30, **kw))
    await asyncio.sleep(0.3)
    await a.initialize_world(name, 0, 2, port=port, timeout=30, **kw)
    await t1


# -- names, signatures, exception -------------------------------------------------

def test_import_paths_and_signatures():
    import multiworld_rs.compat as compat

    assert compat.WorldManager is WorldManager and compat.BrokenWorldException is BrokenWorldException
    params = list(inspect.signature(WorldManager.initialize_world).parameters)
    assert params[:9] == ["self", "world_name", "rank", "world_size", "backend", "addr", "port",
                          "timeout", "device"]
    sig = inspect.signature(WorldManager.initialize_world).parameters
    assert sig["backend"].default == "gloo" and sig["addr"].default == "127.0.0.1" and sig["port"].default == -1
    assert list(inspect.signature(WorldManager.remove_world).parameters) == ["self", "world_name"]
    expected = {
        "send": ["tensor", "dst", "world_name"],
        "recv": ["tensor", "src", "world_name"],
        "broadcast": ["tensor", "src", "world_name"],
        "all_reduce": ["tensor", "op", "world_name"],
        "reduce": ["tensor", "dst", "op", "world_name"],
        "all_gather": ["tensors", "tensor", "world_name"],
        "gather": ["tensor", "gather_list", "dst", "world_name"],
        "scatter": ["tensor", "scatter_list", "src", "world_name"],
    }
    for meth, names in expected.items():
        fn = getattr(WorldCommunicator, meth)
        assert inspect.iscoroutinefunction(fn), meth
        assert list(inspect.signature(fn).parameters)[1:] == names, meth
    assert not inspect.iscoroutinefunction(WorldCommunicator.is_broken)
    assert inspect.iscoroutinefunction(WorldManager.initialize_world)
    for obj in (compat, WorldManager, WorldCommunicator, BrokenWorldException, WorldManager.initialize_world,
                WorldManager.remove_world, WorldManager.cleanup, WorldCommunicator.is_broken):
        assert obj.__doc__, obj


def test_broken_world_exception():
    e = BrokenWorldException("w1", "rank 1 lost", generation=7, cause="peer_lost", rank=1)
    assert isinstance(e, mw.BrokenWorldError) and isinstance(e, mw.MultiworldError)
    assert str(e) == "w1 broken: rank 1 lost"
    assert (e.world, e.world_name, e.generation, e.cause, e.rank, e.detail) == \
        ("w1", "w1", 7, "peer_lost", 1, "rank 1 lost")
    old_style = BrokenWorldException("w2", "exception raised by watchdog")
    assert old_style.cause == "unknown" and str(old_style) == "w2 broken: exception raised by watchdog"
    again = pickle.loads(pickle.dumps(e))
    assert type(again) is BrokenWorldException and str(again) == str(e)
    assert (again.generation, again.cause, again.rank) == (7, "peer_lost", 1)
    ours = mw.BrokenWorldError("world 'x' is broken", world="x", generation=3, cause="heartbeat_timeout", rank=2)
    conv = BrokenWorldException.from_error(ours)
    assert (conv.world, conv.generation, conv.cause, conv.rank) == ("x", 3, "heartbeat_timeout", 2)
    assert BrokenWorldException.from_error(conv) is conv


def test_no_event_loop_needed_and_argument_checks():
    m = WorldManager()  # the older one needed a running loop; this one does not
    try:
        assert m.communicator.is_broken("nothing-here")  # unknown counts as broken, as before
        assert m.is_broken("nothing-here")
        with pytest.raises(ValueError, match="does not exist"):
            m.remove_world("nothing-here")
        with pytest.raises(ValueError, match="port"):
            run(m.initialize_world("w", 0, 2))  # the older default port=-1: none given
        with pytest.raises(TypeError):
            run(m.initialize_world("w", 0, 2, port="1234"))

        async def ops_on_unknown() -> List[str]:
            c = m.communicator
            t = np.zeros(2, dtype=np.float32)
            calls = [c.send(t, 1, "ghost"), c.recv(t, 1, "ghost"), c.broadcast(t, 0, "ghost"),
                     c.all_reduce(t, ReduceOp.SUM, "ghost"), c.reduce(t, 0, world_name="ghost"),
                     c.all_gather([t, t], t, "ghost"), c.gather(t, [t, t], 0, "ghost"),
                     c.scatter(t, [t, t], 0, "ghost"), c.send(t, 1)]  # default world name
            out = []
            for call in calls:
                try:
                    await call
                except BrokenWorldException as e:
                    out.append(e.world)
            return out

        assert run(ops_on_unknown()) == ["ghost"] * 8 + [""]
    finally:
        m.cleanup()


# -- in-process pairs --------------------------------------------------------------

def test_send_recv_collectives_in_process():
    a, b = WorldManager(), WorldManager()
    name, port = unique("compat"), free_port()

    async def main() -> None:
        await pair(name, port, a, b)
        ca, cb = a.communicator, b.communicator
        assert not ca.is_broken(name) and not cb.is_broken(name)
        # send / recv in place
        got = np.zeros(4, dtype=np.float32)
        await asyncio.gather(ca.send(np.arange(4, dtype=np.float32), 1, name), cb.recv(got, 0, name))
        assert got.tolist() == [0, 1, 2, 3]
        got2 = np.zeros((2, 2), dtype=np.int64)
        await asyncio.gather(cb.send(np.full((2, 2), 9, dtype=np.int64), 0, world_name=name),
                             ca.recv(got2, 1, world_name=name))
        assert (got2 == 9).all()
        # broadcast
        x0, x1 = np.full(3, 5.0), np.zeros(3)
        await asyncio.gather(ca.broadcast(x0, 0, name), cb.broadcast(x1, 0, name))
        assert x1.tolist() == [5.0] * 3
        # all_reduce (enum, name and default op)
        r0, r1 = np.array([1, 2], dtype=np.int32), np.array([10, 20], dtype=np.int32)
        await asyncio.gather(ca.all_reduce(r0, ReduceOp.SUM, name), cb.all_reduce(r1, "sum", name))
        assert r0.tolist() == r1.tolist() == [11, 22]
        await asyncio.gather(ca.all_reduce(r0, world_name=name), cb.all_reduce(r1, world_name=name))
        assert r0.tolist() == [22, 44]
        m0, m1 = np.array([3.0, 1.0]), np.array([2.0, 4.0])
        await asyncio.gather(ca.all_reduce(m0, ReduceOp.MAX, name), cb.all_reduce(m1, ReduceOp.MAX, name))
        assert m0.tolist() == m1.tolist() == [3.0, 4.0]
        # reduce into rank 1
        d0, d1 = np.array([1.0, 2.0]), np.array([3.0, 4.0])
        await asyncio.gather(ca.reduce(d0, 1, ReduceOp.SUM, name), cb.reduce(d1, 1, ReduceOp.SUM, name))
        assert d1.tolist() == [4.0, 6.0] and d0.tolist() == [1.0, 2.0]
        # all_gather
        g0 = [np.zeros(2, dtype=np.int64) for _ in range(2)]
        g1 = [np.zeros(2, dtype=np.int64) for _ in range(2)]
        await asyncio.gather(ca.all_gather(g0, np.array([0, 1]), name), cb.all_gather(g1, np.array([2, 3]), name))
        assert [t.tolist() for t in g0] == [t.tolist() for t in g1] == [[0, 1], [2, 3]]
        # gather into rank 0
        gl = [np.zeros(1, dtype=np.float32) for _ in range(2)]
        await asyncio.gather(ca.gather(np.array([7.0], dtype=np.float32), gl, 0, name),
                             cb.gather(np.array([8.0], dtype=np.float32), None, 0, name))
        assert [t[0] for t in gl] == [7.0, 8.0]
        # scatter from rank 1
        s0, s1 = np.zeros(2, dtype=np.int16), np.zeros(2, dtype=np.int16)
        parts = [np.array([1, 1], dtype=np.int16), np.array([2, 2], dtype=np.int16)]
        await asyncio.gather(ca.scatter(s0, None, 1, name), cb.scatter(s1, parts, 1, name))
        assert s0.tolist() == [1, 1] and s1.tolist() == [2, 2]
        # a second initialize of a live name is refused, as before
        with pytest.raises(ValueError, match="already exists"):
            await a.initialize_world(name, 0, 2, port=port, timeout=5)

    try:
        run(main())
    finally:
        a.cleanup()
        b.cleanup()


def test_remove_world_frees_the_name_for_a_new_generation():
    a, b = WorldManager(), WorldManager()
    name, port = unique("gen"), free_port()

    async def main() -> None:
        generations = []
        for round_ in range(3):
            await pair(name, port, a, b)
            assert not a.communicator.is_broken(name) and not b.communicator.is_broken(name)
            ga, gb = a.world_generation(name), b.world_generation(name)
            assert ga == gb and ga is not None
            generations.append(ga)
            got = np.zeros(1, dtype=np.int64)
            await asyncio.gather(a.communicator.send(np.array([round_]), 1, name), b.communicator.recv(got, 0, name))
            assert got[0] == round_
            # rank 0 removes the world: rank 1's side breaks (peer lost), and
            # rank 0's own operations on the name now fail as broken.
            a.remove_world(name)
            assert a.communicator.is_broken(name)
            with pytest.raises(BrokenWorldException) as info:
                await b.communicator.recv(got, 0, name)
            # The leaver's goodbye reaches rank 1 as its connection closing or
            # as its announcement in the store, whichever comes first.
            assert info.value.world == name and info.value.cause in ("peer_lost", "reported_by_peer")
            assert info.value.generation == ga
            assert isinstance(info.value, mw.BrokenWorldError)
            with pytest.raises(BrokenWorldException):
                await a.communicator.send(got, 1, name)
            for _ in range(200):  # rank 1's teardown is asynchronous
                if b.communicator.is_broken(name):
                    break
                await asyncio.sleep(0.05)
            assert b.communicator.is_broken(name)
            b.remove_world(name)  # after a break: a no-op, never an error
            a.remove_world(name)  # twice: a no-op too
        assert len(set(generations)) == 3 and generations == sorted(generations)

    try:
        run(main(), timeout=100)
    finally:
        a.cleanup()
        b.cleanup()


def test_a_break_is_still_reported_after_thousands_of_joins_and_removals():
    """An operation on a world torn down after its break names the break's
    cause, even when more joins and removals than the manager's event
    stream keeps (4,096 events) came after it."""
    a, b = WorldManager(), WorldManager()
    name, port, solo_port = unique("kept"), free_port(), free_port()

    async def main() -> None:
        await pair(name, port, a, b)
        a.remove_world(name)  # rank 1's side breaks, then is torn down
        for _ in range(200):
            if name not in b.worlds():
                break
            await asyncio.sleep(0.05)
        assert name not in b.worlds()
        # Two events (joined, removed) per world, 50 worlds at a time.
        for batch in range(42):
            solos = [f"{name}-solo-{batch}-{i}" for i in range(50)]
            await asyncio.gather(*(b.initialize_world(s, 0, 1, port=solo_port, timeout=30) for s in solos))
            for s in solos:
                b.remove_world(s)
        with pytest.raises(BrokenWorldException) as info:
            await b.communicator.recv(np.zeros(1), 0, name)
        assert info.value.cause in ("peer_lost", "reported_by_peer"), str(info.value)

    try:
        run(main(), timeout=120)
    finally:
        a.cleanup()
        b.cleanup()


def test_worlds_share_one_port_when_one_process_hosts_them():
    a, b, c = WorldManager(), WorldManager(), WorldManager()
    port = free_port()
    names = [unique("shared"), unique("shared")]

    async def main() -> None:
        await pair(names[0], port, a, b)
        await pair(names[1], port, a, c)
        assert a.worlds() >= set(names)
        x, y = np.zeros(1), np.zeros(1)
        await asyncio.gather(b.communicator.send(np.array([1.0]), 0, names[0]),
                             c.communicator.send(np.array([2.0]), 0, names[1]),
                             a.communicator.recv(x, 1, names[0]), a.communicator.recv(y, 1, names[1]))
        assert (x[0], y[0]) == (1.0, 2.0)
        a.remove_world(names[0])  # the other world on the same store is untouched
        z = np.zeros(1)
        await asyncio.gather(c.communicator.send(np.array([3.0]), 0, names[1]), a.communicator.recv(z, 1, names[1]))
        assert z[0] == 3.0 and not a.communicator.is_broken(names[1])

    try:
        run(main())
    finally:
        for m in (a, b, c):
            m.cleanup()


# -- real processes ----------------------------------------------------------------

# A worker: initializes its world as rank 1, streams COUNT int64 messages
# (value i) to rank 0, then waits on a receive until the leader removes the
# world, and prints how that ended.
WORKER = r"""
import asyncio, sys, time
import numpy as np
from multiworld_rs.compat.manager import WorldManager
from multiworld_rs.compat.communicator import BrokenWorldException

async def main(name, port, count, interval):
    wm = WorldManager()
    await wm.initialize_world(name, 1, 2, addr="127.0.0.1", port=port, timeout=60)
    c = wm.communicator
    try:
        for i in range(count):
            await c.send(np.array([i], dtype=np.int64), 0, name)
            await asyncio.sleep(interval)
        await c.recv(np.zeros(1, dtype=np.int64), 0, name)
        print("unexpected: received", flush=True)
    except BrokenWorldException as e:
        print(f"ended: {e.cause}: {e}", flush=True)
    wm.cleanup()

asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])))
"""

COUNT = 200
INTERVAL = 0.005


def start_worker(name: str, port: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", WORKER, name, str(port), str(COUNT), str(INTERVAL)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def stop(procs: List[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.communicate(timeout=30)


def test_processes_kill_breaks_only_that_world_then_reinitialize():
    wm = WorldManager()
    names = [unique("victim"), unique("healthy")]
    ports = [free_port(), free_port()]
    procs = [start_worker(n, p) for n, p in zip(names, ports)]
    later: List[subprocess.Popen] = []
    victim, healthy = names
    c = wm.communicator

    async def recv_one(world: str) -> int:
        t = np.zeros(1, dtype=np.int64)
        await c.recv(t, 1, world)
        return int(t[0])

    async def main() -> None:
        for n, p in zip(names, ports):
            await wm.initialize_world(n, 0, 2, addr="127.0.0.1", port=p, timeout=60)
        for i in range(5):  # both streams flow
            for n in names:
                assert await recv_one(n) == i
        procs[0].send_signal(signal.SIGKILL)
        with pytest.raises(BrokenWorldException) as info:
            for i in range(5, COUNT):
                assert await recv_one(victim) == i
        err = info.value
        assert err.world == victim and err.cause == "peer_lost" and err.rank == 1, err
        assert str(err).startswith(f"{victim} broken: ")
        assert c.is_broken(victim) and not c.is_broken(healthy)
        for _ in range(200):  # the teardown is asynchronous
            if wm.world_generation(victim) is None:
                break
            await asyncio.sleep(0.05)
        assert wm.world_generation(victim) is None and victim not in wm.worlds()
        # Torn down: an operation still reports the break's cause.
        with pytest.raises(BrokenWorldException) as again:
            await recv_one(victim)
        assert (again.value.cause, again.value.rank, again.value.generation) == ("peer_lost", 1, err.generation)
        # The other world delivers every message, in order.
        for i in range(5, COUNT):
            assert await recv_one(healthy) == i
        assert not c.is_broken(healthy)
        wm.remove_world(healthy)
        assert c.is_broken(healthy)
        out, errout = procs[1].communicate(timeout=60)
        assert procs[1].returncode == 0, errout
        assert "ended: peer_lost" in out, out
        # The broken world's name can be initialized again on the same port:
        # a new generation with a new worker.
        old_generation = err.generation
        wm.remove_world(victim)  # already torn down: a no-op
        later.append(start_worker(victim, ports[0]))
        await wm.initialize_world(victim, 0, 2, addr="127.0.0.1", port=ports[0], timeout=60)
        assert not c.is_broken(victim)
        assert wm.world_generation(victim) != old_generation
        for i in range(3):
            assert await recv_one(victim) == i
        wm.remove_world(victim)
        out, errout = later[0].communicate(timeout=60)
        assert later[0].returncode == 0, errout
        assert "ended: peer_lost" in out, out

    try:
        run(main(), timeout=100)
    finally:
        stop(procs + later)
        wm.cleanup()


@pytest.mark.parametrize("kill", [False, True])
def test_compat_example(kill):
    args = [sys.executable, EXAMPLE] + (["--kill"] if kill else [])
    r = subprocess.run(args, capture_output=True, text=True, timeout=110)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK" in r.stdout, r.stdout + r.stderr
    if kill:
        assert "world1: 5/5 messages, removed" in r.stdout, r.stdout
        assert re.search(r"world2: [0-2]/5 messages, broken \(peer_lost, rank 1\)", r.stdout), r.stdout
    else:
        assert "world1: 5/5 messages, removed" in r.stdout, r.stdout
        assert "world2: 5/5 messages, removed" in r.stdout, r.stdout


def test_a_cancelled_initialize_world_can_still_be_removed():
    """Cancelling ``initialize_world`` (a timeout around it) does not stop a
    join already running in the background; if that join makes this process
    a member after all, ``remove_world`` leaves it and frees the name, so
    ``initialize_world`` can join the name again."""
    port = free_port()
    name = unique("cancelled-init")
    a, b = WorldManager(), WorldManager()

    async def main() -> None:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(a.initialize_world(name, 0, 2, port=port, timeout=20), 0.3)
        # The join went on: rank 1 arrives and both become members.
        await b.initialize_world(name, 1, 2, port=port, timeout=20)
        for _ in range(500):
            w = a._aio.sync.world(name)
            if w is not None and w.state == "ready":
                break
            await asyncio.sleep(0.01)
        assert a._aio.sync.world(name) is not None, "the background join never finished"
        a.remove_world(name)
        assert a._aio.sync.world(name) is None
        b.remove_world(name)
        await pair(name, port, a, b)
        assert not a.is_broken(name) and not b.is_broken(name)

    try:
        run(main())
    finally:
        a.cleanup()
        b.cleanup()


def test_initialize_world_gives_an_nccl_world_its_device():
    # The older API chose an NCCL world's GPU with `device`; a TCP world
    # has no use for it.
    wm = WorldManager()
    seen = []

    async def fake_join(name, rank, size, store, **kw):
        seen.append(kw)

    wm._aio.join = fake_join  # type: ignore[method-assign]
    try:
        run(wm.initialize_world("g", 1, 2, backend="nccl", port=free_port(), device=1))
        run(wm.initialize_world("t", 1, 2, backend="gloo", port=free_port(), device=1))
    finally:
        wm.cleanup()
    assert seen[0].get("device") == 1 and seen[0]["backend"] == "nccl", seen[0]
    assert "device" not in seen[1], seen[1]
