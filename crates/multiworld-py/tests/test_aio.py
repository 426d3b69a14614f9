"""The asyncio twin over an in-process pair."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
import time

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


class Ticker:
    """A task that counts its turns on the event loop until stopped."""

    def __init__(self) -> None:
        self.turns = 0
        self._stop = False
        self._task: "asyncio.Future[None]"

    @classmethod
    async def start(cls) -> "Ticker":
        t = cls()
        t._task = asyncio.ensure_future(t._run())
        await asyncio.sleep(0)
        return t

    async def _run(self) -> None:
        while not self._stop:
            self.turns += 1
            await asyncio.sleep(0)

    async def stop(self) -> int:
        self._stop = True
        await self._task
        return self.turns


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
        # Small collectives go over TCP; a large one sets up shared memory.
        assert await w0.shared_memory() == ("untried", None)
        big = [np.full(1 << 18, r + 1, np.float32) for r in range(2)]  # 1 MiB each
        await asyncio.gather(w0.all_reduce(big[0]), w1.all_reduce(big[1]))
        assert (big[0] == 3).all() and (big[1] == 3).all()
        states = await asyncio.gather(w0.shared_memory(), w1.shared_memory())
        assert states[0] == states[1] and states[0][0] in ("active", "unavailable"), states
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


def test_many_pending_receives_need_no_threads_and_cancel_cleanly():
    """200 receives awaited at once: no thread per receive (the loop is woken
    through one notifier), cancelling them all withdraws every one, and the
    world then delivers the next messages to new receives."""

    async def main():
        a, b, w0, w1 = await pair()
        threads_before = threading.active_count()
        tasks = [asyncio.ensure_future(w0.recv(1, 100 + i, dtype="int32", shape=1)) for i in range(200)]
        await asyncio.sleep(0.1)
        assert not any(t.done() for t in tasks)
        assert threading.active_count() <= threads_before + 2
        # Half of them get their message; the others are cancelled.
        await asyncio.gather(*(w1.send(np.array([i], np.int32), 0, 100 + i) for i in range(0, 200, 2)))
        got = await asyncio.gather(*tasks[0::2])
        assert [int(x[0]) for x in got] == list(range(0, 200, 2))
        for t in tasks[1::2]:
            t.cancel()
        results = await asyncio.gather(*tasks[1::2], return_exceptions=True)
        assert all(isinstance(r, asyncio.CancelledError) for r in results)
        # Withdrawn: messages on those tags now reach new receives, in order.
        _, again = await asyncio.gather(w1.send(np.array([-7], np.int32), 0, 101),
                                        w0.recv(1, 101, dtype="int32", shape=1))
        assert int(again[0]) == -7
        assert w0.state == "ready" and w1.state == "ready"
        await asyncio.gather(w0.finish(10), w1.finish(10))
        await a.shutdown()
        await b.shutdown()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_leader_awaits_many_worlds_and_a_broken_one_fails_alone():
    """A leader in 4 worlds awaits receives from all of them with one
    asyncio.gather; one worker aborts: only its receive fails, the others
    deliver."""

    async def main():
        leader = aio.AsyncWorldManager()
        store = await leader.serve_store()
        workers = [aio.AsyncWorldManager() for _ in range(4)]
        names = [unique("lead") for _ in range(4)]
        joined = await asyncio.gather(
            *(leader.join(n, 0, 2, store, timeout=10) for n in names),
            *(m.join(n, 1, 2, store, timeout=10) for m, n in zip(workers, names)))
        lws, wws = joined[:4], joined[4:]
        for _ in range(3):
            sends = [w.send(np.full(1024, i, np.float32), 0) for i, w in enumerate(wws)]
            got = await asyncio.gather(*(lw.recv(1, dtype="float32", shape=1024) for lw in lws), *sends)
            assert [float(g[0]) for g in got[:4]] == [0.0, 1.0, 2.0, 3.0]
        wws[2].abort()
        sends = [w.send(np.full(4, i, np.float32), 0) for i, w in enumerate(wws) if i != 2]
        got = await asyncio.gather(*(lw.recv(1, dtype="float32", shape=4) for lw in lws), *sends,
                                   return_exceptions=True)
        assert isinstance(got[2], mw.BrokenWorldError) and got[2].world == names[2]
        assert [float(got[i][0]) for i in (0, 1, 3)] == [0.0, 1.0, 3.0]
        assert [lw.state for lw in lws] == ["ready", "ready", "broken", "ready"] or lws[2].state == "removed"
        await leader.shutdown()
        for m in workers:
            await m.shutdown()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_events_as_an_async_iterator():
    async def main():
        a, b, w0, w1 = await pair()
        events = a.events(timeout=10)
        w1.abort()
        kinds = []
        async for ev in events:
            kinds.append((ev.kind, ev.world))
            if ev.kind == "removed":
                break
        assert kinds[0] == ("broken", w0.name) and kinds[-1] == ("removed", w0.name)
        # A cancelled wait loses nothing: the event that comes later is kept.
        waiting = asyncio.ensure_future(a.next_event(events, 5))
        await asyncio.sleep(0.05)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        # The cancelled wait's thread may still take the next event: it is
        # kept for the next call, not dropped.
        name = unique("aio-ev")
        await asyncio.gather(a.join(name, 0, 2, w0.sync.store_addr, timeout=10),
                             b.join(name, 1, 2, w0.sync.store_addr, timeout=10))
        ev = await a.next_event(events, 5)
        assert ev is not None and (ev.kind, ev.world) == ("joined", name)
        await a.shutdown()
        await b.shutdown()

    asyncio.run(asyncio.wait_for(main(), 60))


class FakeEvents:
    """A native event stream's stand-in: waiters take events in the order
    they came."""

    def __init__(self):
        self.cond = threading.Condition()
        self.items = []

    def next(self, timeout):
        with self.cond:
            self.cond.wait_for(lambda: self.items, timeout)
            return self.items.pop(0) if self.items else None

    def push(self, *evs):
        with self.cond:
            self.items.extend(evs)
            self.cond.notify_all()


async def leave_a_wait_in_flight(stream) -> None:
    """Starts an ``anext`` on ``stream`` and cancels it while its thread
    waits: the wait stays in flight for the next call."""
    first = asyncio.ensure_future(stream.anext())
    await asyncio.sleep(0.02)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first


def test_a_cancelled_wait_for_an_event_keeps_the_order_of_events():
    # A fake stream whose waiters take events in the order they came. An
    # anext cancelled while its thread waits leaves that wait in flight; the
    # next anext must take the event it gets, not start a wait of its own
    # that could take the second event first.
    from multiworld_rs._api import EventStream

    async def main():
        for _ in range(5):
            fake = FakeEvents()
            s = EventStream(fake, None)
            await leave_a_wait_in_flight(s)
            second = asyncio.ensure_future(s.anext())
            await asyncio.sleep(0.02)
            fake.push("E1", "E2")
            got = [await second, await s.anext()]
            assert got == ["E1", "E2"], got
            # The synchronous form takes what a cancelled wait got too.
            await leave_a_wait_in_flight(s)
            fake.push("E3")
            assert s.next(2) == "E3"

    asyncio.run(asyncio.wait_for(main(), 60))


def test_two_waits_for_one_stream_take_different_events():
    # Two tasks await the next event of one stream (and a thread waits on
    # it too) while a cancelled wait is in flight: each event goes to
    # exactly one of them.
    from multiworld_rs._api import EventStream

    async def main():
        for _ in range(5):
            fake = FakeEvents()
            s = EventStream(fake, None)
            await leave_a_wait_in_flight(s)
            loop = asyncio.get_running_loop()
            waits = [asyncio.ensure_future(s.anext(5)), asyncio.ensure_future(s.anext(5)),
                     loop.run_in_executor(None, s.next, 5)]
            await asyncio.sleep(0.02)
            fake.push("E1", "E2", "E3")
            got = await asyncio.gather(*waits)
            assert sorted(got) == ["E1", "E2", "E3"], got

    asyncio.run(asyncio.wait_for(main(), 60))


def test_cancelling_a_receive_into_a_lent_array_does_not_block_the_loop():
    # Cancelling an asyncio receive into a lent array waits until the
    # runtime lets go of the array (a message arriving into it must land
    # first): the waiting runs in the pool, the loop keeps turning, and the
    # coroutine ends only after it. A fake native handle stands in for a
    # message that takes 0.5 s to land.
    from multiworld_rs._api import _LentRecv

    class Arriving:
        let_go = None

        def notify(self, notifier, token):
            pass

        def unwatch(self):
            pass

        def settled(self):
            return False

        def cancel(self):
            time.sleep(0.5)
            Arriving.let_go = time.monotonic()

        def wait(self, timeout=None):
            raise RuntimeError("the operation was cancelled")

    async def main():
        ticks = []

        async def ticker():
            while True:
                ticks.append(time.monotonic())
                await asyncio.sleep(0.01)

        tick = asyncio.ensure_future(ticker())
        work = _LentRecv(Arriving(), np.zeros(4))
        receiving = asyncio.ensure_future(aio._wait(work, withdraw_on_cancel=True))
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        receiving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await receiving
        ended = time.monotonic()
        tick.cancel()
        assert Arriving.let_go is not None and ended >= Arriving.let_go, "ended before the array was let go"
        during = [t for t in ticks if t0 <= t <= ended]
        assert len(during) >= 10, f"the loop turned {len(during)} times in {ended - t0:.2f} s"

    asyncio.run(asyncio.wait_for(main(), 30))


def test_messages_already_here_are_taken_at_once_and_the_loop_still_turns():
    async def main():
        a, b, w0, w1 = await pair()
        n = 64
        for i in range(n):  # all of them here before the first receive
            await w1.send(np.full(4, i, np.int32), 0, 3)
        out = np.zeros(4, np.int32)
        await w0.recv_into(out, 1, 3)  # waits for the first one if need be
        assert (out == 0).all()
        ticker = await Ticker.start()
        seen = []
        for _ in range(n - 1):
            src = await w0.recv_into(out, 1, 3)
            assert src == 1
            seen.append(int(out[0]))
        turns = await ticker.stop()
        assert seen == list(range(1, n)), seen  # in order, none lost
        # Other tasks ran in between: the shortcut yields after a burst.
        assert turns >= (n - 1) // aio._BURST, turns
        # A world error raises from the shortcut too.
        with pytest.raises(mw.MismatchError):
            await asyncio.gather(w1.send(np.zeros(5, np.int32), 0, 4), w0.recv_into(out, 1, 4))
        await asyncio.gather(w0.finish(10), w1.finish(10))
        await a.shutdown()
        await b.shutdown()

    asyncio.run(asyncio.wait_for(main(), 60))


def count_loop_wakeups(monkeypatch) -> list:
    """Counts the event loop's wake-ups by the notifier (calls of
    ``aio._Bridge._ready``) from now on, in a one-element list. Call it
    before the loop's bridge exists."""
    count = [0]
    ready = aio._Bridge._ready

    def counting(self):
        count[0] += 1
        ready(self)

    monkeypatch.setattr(aio._Bridge, "_ready", counting)
    return count


def test_sends_that_fit_end_in_the_call_and_the_loop_still_turns(monkeypatch):
    """A small send is written in the call: its handle is finished when
    returned (no task, no round through the event loop) and a lent array is
    free again at once; a coroutine sending many still lets other tasks run;
    nothing is lost or reordered."""
    wakeups = count_loop_wakeups(monkeypatch)

    async def main():
        a, b, w0, w1 = await pair()
        x = np.zeros(4, np.int32)
        # The sync handle of a small send: finished before any wait (the
        # heartbeats share the writer, so count rather than require each).
        inline = sum(w1.sync.isend(np.full(4, -1, np.int32), 0, 7).is_completed() for _ in range(32))
        assert inline >= 16, inline
        got = np.zeros(4, np.int32)
        for _ in range(32):
            await w0.recv_into(got, 1, 7)
        n = 64
        ticker = await Ticker.start()
        before = wakeups[0]
        for i in range(n):
            x[:] = i
            await w1.send(x, 0, 3, copy=bool(i % 2))
            # The lent array is free again: a receive into it is not refused
            # (none is waiting on tag 99, so nothing is taken).
            assert w1.sync._w.recv_into_now(x, 0, 99) is None
        woke = wakeups[0] - before
        turns = await ticker.stop()
        assert turns >= n // aio._BURST - 1, turns
        # Both forms skip the loop's wake-up (a send that waited for the
        # writer, which the heartbeats share, would take one).
        assert woke <= 4, f"{woke} wake-ups of the loop for {n} small sends"
        seen = []
        for _ in range(n):
            await w0.recv_into(got, 1, 3)
            seen.append(int(got[0]))
        assert seen == list(range(n)), seen
        await asyncio.gather(w0.finish(10), w1.finish(10))
        await a.shutdown()
        await b.shutdown()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_each_receive_that_waits_wakes_the_loop_once(monkeypatch):
    """A receive that waits for its message wakes the event loop once when
    the message is in (a send that fits the socket's buffer, not at all):
    50 round trips of an asyncio ping-pong take at most a few more than 50
    wake-ups of the loop's notifier."""
    wakeups = count_loop_wakeups(monkeypatch)

    async def main():
        a, b, w0, w1 = await pair()
        n = 50

        def echo():
            buf = np.zeros(2, np.int64)
            for _ in range(n):
                w1.sync.recv_into(buf, 0, 6)
                w1.sync.send(buf, 0, 6)

        t = threading.Thread(target=echo, daemon=True)
        t.start()
        x = np.zeros(2, np.int64)
        before = wakeups[0]
        for i in range(n):
            x[:] = i
            await w0.send(x, 1, 6, copy=False)
            await w0.recv_into(x, 1, 6)
            assert int(x[0]) == i
        woke = wakeups[0] - before
        t.join(10)
        assert woke <= n + 5, f"{woke} wake-ups of the loop for {n} round trips"
        await asyncio.gather(w0.finish(10), w1.finish(10))
        await a.shutdown()
        await b.shutdown()

    asyncio.run(asyncio.wait_for(main(), 60))


@contextlib.contextmanager
def loop_copy_max(nbytes: int):
    """``mw.loop_copy_max(nbytes)`` for the block, then the setting before."""
    before = mw.loop_copy_max()
    mw.loop_copy_max(nbytes)
    try:
        yield
    finally:
        mw.loop_copy_max(before)


def test_a_large_message_waiting_in_the_socket_is_received_in_the_call(monkeypatch):
    """A slow asyncio receiver of 1 MiB messages (too large to read ahead):
    each message waits whole in the socket, held back by the connection's
    reader, when its receive is posted, and the posting call reads it into
    the caller's array: no round through the event loop for most of them
    (counted by the loop's wake-ups and by the runtime's metric); every
    message arrives intact and in order. (With no limit on what the loop
    copies, the default on two CPUs: with more, 1 MiB messages go to a
    task, see the next tests.)"""
    wakeups = count_loop_wakeups(monkeypatch)

    async def main():
        a, b, w0, w1 = await pair()
        n, size = 30, 1 << 18

        def send_all():
            for i in range(n):
                w1.sync.send(np.full(size, i, np.float32), 0, 5)

        t = threading.Thread(target=send_all, daemon=True)
        t.start()
        out = np.zeros(size, np.float32)
        before = wakeups[0]
        for i in range(n):
            # Slow: the sender is ahead, its next message held back.
            await asyncio.sleep(0.003)
            assert await w0.recv_into(out, 1, 5) == 1
            assert out[0] == i and out[-1] == i and (out == i).all()
        woke = wakeups[0] - before
        t.join(10)
        read_in_call = sum(
            float(line.split()[-1])
            for line in a.sync.metrics_text().splitlines()
            if line.startswith("multiworld_received_in_call_messages_total")
        )
        # Timing decides for each message whether it waited whole in the
        # socket; most do, and none may be lost either way.
        print("read in call", read_in_call, "wake-ups", woke)
        assert read_in_call >= n // 2, (read_in_call, woke)
        assert woke <= n - read_in_call + 2, (read_in_call, woke)
        await asyncio.gather(w0.finish(10), w1.finish(10))
        await a.shutdown()
        await b.shutdown()

    with loop_copy_max(2**64 - 1):
        asyncio.run(asyncio.wait_for(main(), 60))


def _read_in_call(manager) -> float:
    """The manager's ``multiworld_received_in_call_messages_total``: messages
    whose payload a receiving call read from the socket itself."""
    return sum(
        float(line.split()[-1])
        for line in manager.sync.metrics_text().splitlines()
        if line.startswith("multiworld_received_in_call_messages_total")
    )


@contextlib.contextmanager
def loop_leaves_held(on: bool):
    """``mw.loop_leaves_held(on)`` for the block, then the setting before."""
    before = mw.loop_leaves_held()
    mw.loop_leaves_held(on)
    try:
        yield
    finally:
        mw.loop_leaves_held(before)


@pytest.mark.parametrize("mode", ["blocking", "asyncio, read in the call", "asyncio, left to the reader"])
def test_a_small_message_held_back_is_read_in_the_call_or_left_to_the_reader(mode):
    """The sender fills the reader's 1 MiB read-ahead window with sixteen
    64 KiB messages on one tag, then sends one on another tag, which the
    reader holds back (no receive for it, no room). A receive for that one
    finds it held back. A blocking receive reads it from the socket in its
    call, and so does an asyncio receive while ``loop_leaves_held()`` is
    off (the default with two CPUs or fewer). With it on, the asyncio
    receive leaves it to the reader, which it wakes, so that the event
    loop's thread never spends a socket read on a message the reader would
    read: the runtime's count of messages read in the call tells which (in
    that mode, blocking rounds after the asyncio ones show, in the same
    run, that the situation arose). Every message arrives intact and in
    order either way."""
    # Rounds of each kind: a read in the call needs the held-back message in
    # one of them (the reader has about 0.15 s to fill its window each time).
    rounds, size, window = 4, 16 << 10, 16  # float32: 64 KiB messages
    if mode == "blocking":
        kinds = ["blocking"] * rounds
    elif mode.endswith("call"):
        kinds = ["asyncio"] * rounds
    else:
        kinds = ["asyncio"] * rounds + ["blocking"] * rounds

    async def run() -> "list[float]":
        a, b, w0, w1 = await pair()
        go = [threading.Event() for _ in kinds]

        def send_all():
            for r in range(len(kinds)):
                go[r].wait(10)
                for i in range(window):
                    w1.sync.send(np.full(size, r * window + i, np.float32), 0, 6)
                w1.sync.send(np.full(size, -r, np.float32), 0, 7)

        t = threading.Thread(target=send_all, daemon=True)
        t.start()
        out = np.zeros(size, np.float32)
        counts = []
        for r, kind in enumerate(kinds):
            go[r].set()
            # The window fills and the message on tag 7 is held back.
            await asyncio.sleep(0.15)
            for i in [-1, *range(window)]:
                tag, k = (7, -r) if i < 0 else (6, r * window + i)
                if kind == "blocking":
                    assert w0.sync.recv_into(out, 1, tag) == 1
                else:
                    assert await w0.recv_into(out, 1, tag) == 1
                assert out[0] == k and out[-1] == k and (out == k).all(), (k, out[0])
            counts.append(_read_in_call(a))
        t.join(10)
        await asyncio.gather(w0.finish(10), w1.finish(10))
        await a.shutdown()
        await b.shutdown()
        return counts

    with loop_copy_max(2**64 - 1), loop_leaves_held(mode.endswith("reader")):
        counts = asyncio.run(asyncio.wait_for(run(), 60))
    print(mode, "read in the call after each round:", counts)
    if mode.endswith("reader"):
        assert counts[rounds - 1] == 0, counts
    assert counts[-1] >= 1, f"no receive found its message held back: {counts}"


def test_loop_leaves_held_is_a_setting_of_the_process():
    """The setting is returned, set, and refuses what is not a bool."""
    before = mw.loop_leaves_held()
    assert isinstance(before, bool)
    with loop_leaves_held(not before):
        assert mw.loop_leaves_held() is (not before)
    assert mw.loop_leaves_held() is before
    with pytest.raises(TypeError, match="bool"):
        mw.loop_leaves_held(1)  # type: ignore[arg-type]
    assert mw.loop_leaves_held() is before


def test_the_loop_copy_limit_decides_what_the_loop_takes_itself():
    """A message larger than ``loop_copy_max`` is never copied on the event
    loop's thread, even when it is here: the shortcut does not take it (it
    returns ``None`` however long the message has waited) until the limit
    allows it. The setting is checked and returned."""
    async def main():
        a, b, w0, w1 = await pair()
        size = 64 << 10
        await w1.send(np.full(size // 4, 7, np.float32), 0, 6)
        out = np.zeros(size // 4, np.float32)
        with loop_copy_max(size - 1):
            for _ in range(20):  # the message arrives meanwhile; it is never taken here
                await asyncio.sleep(0.01)
                assert w0.sync._w.recv_into_now(out, 1, 6) is None
            assert (out == 0).all()
        with loop_copy_max(size):
            deadline = time.monotonic() + 10
            while w0.sync._w.recv_into_now(out, 1, 6) is None:
                assert time.monotonic() < deadline, "the message never came"
                await asyncio.sleep(0.01)
        assert (out == 7).all()
        await asyncio.gather(w0.finish(10), w1.finish(10))
        await a.shutdown()
        await b.shutdown()

    asyncio.run(asyncio.wait_for(main(), 60))
    before = mw.loop_copy_max()
    with loop_copy_max(12345):
        assert mw.loop_copy_max() == 12345
    assert mw.loop_copy_max() == before
    with pytest.raises(ValueError, match="-1"):
        mw.loop_copy_max(-1)
    with pytest.raises(TypeError):
        mw.loop_copy_max(1.5)  # type: ignore[arg-type]
    assert mw.loop_copy_max() == before


def test_receives_off_the_loop_deliver_everything_cancel_and_break_cleanly():
    """With ``loop_copy_max(0)`` every asyncio receive runs in a task of the
    runtime: messages read ahead (64 KiB) and held back in the socket
    (1 MiB), from two worlds at once, arrive intact and in order, into the
    caller's arrays or new ones (``recv``, ``recv_any``); a
    receive cancelled by a timeout gives
    its array back and loses nothing; a peer's abort fails a waiting one
    with ``BrokenWorldError`` naming the peer."""
    async def main():
        pairs = [await pair() for _ in range(2)]
        n, small, large = 60, 64 << 10, 1 << 20

        def stream(w, seed):
            for i in range(n):
                size = large if i % 3 == 0 else small
                w.sync.send(np.full(size // 4, seed + i, np.float32), 0, 5)

        senders = [threading.Thread(target=stream, args=(p[3], 1000 * k), daemon=True)
                   for k, p in enumerate(pairs)]
        for t in senders:
            t.start()

        async def receive(w, seed):
            bufs = {small: np.zeros(small // 4, np.float32), large: np.zeros(large // 4, np.float32)}
            for i in range(n):
                out = bufs[large if i % 3 == 0 else small]
                assert await w.recv_into(out, 1, 5) == 1
                assert out[0] == seed + i and out[-1] == seed + i and (out == seed + i).all(), i

        await asyncio.gather(*(receive(p[2], 1000 * k) for k, p in enumerate(pairs)))
        for t in senders:
            t.join(10)

        a, b, w0, w1 = pairs[0]
        # recv and recv_any (new arrays) go through a task too.
        await w1.send(np.full(small // 4, 5, np.float32), 0, 7)
        got = await w0.recv(1, 7, dtype=np.float32, shape=small // 4)
        assert (got == 5).all()
        await w1.send(np.full(large // 4, 6, np.float32), 0, 7)
        src, got = await w0.recv_any(7, dtype=np.float32, shape=large // 4)
        assert src == 1 and (got == 6).all()
        out = np.zeros(large // 4, np.float32)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(w0.recv_into(out, 1, 8), 0.05)
        # The array is free again (a lent array would be refused), and the
        # withdrawn receive took nothing: the next message reaches the next one.
        await asyncio.gather(w1.send(np.full(large // 4, 3, np.float32), 0, 8), w0.recv_into(out, 1, 8))
        assert (out == 3).all()
        waiting = asyncio.ensure_future(w0.recv_into(out, 1, 9))
        await asyncio.sleep(0.05)
        w1.abort()
        with pytest.raises(mw.BrokenWorldError) as info:
            await asyncio.wait_for(waiting, 10)
        assert info.value.rank == 1
        a2, b2, w2, w3 = pairs[1]
        assert w2.state == "ready"  # the other world is untouched
        await asyncio.gather(w2.finish(10), w3.finish(10))
        for m in (a, b, a2, b2):
            await m.shutdown()

    with loop_copy_max(0):
        asyncio.run(asyncio.wait_for(main(), 120))


def test_a_handle_the_loop_awaits_and_a_thread_waits_on_still_resolves():
    """A receive's handle is polled by whoever waits: when a thread's wait
    on it times out, or ends it, or a thread cancels it, the event loop
    awaiting the same handle still resolves."""
    async def main():
        a, b, w0, w1 = await pair()
        loop = asyncio.get_running_loop()
        out = np.zeros(4, np.int32)
        work = w0.sync.irecv(out, 1, 13)
        awaiting = asyncio.ensure_future(aio._wait(work))
        await asyncio.sleep(0.01)  # the loop watches the handle
        with pytest.raises(TimeoutError):  # a thread's wait gives up ...
            await loop.run_in_executor(None, work.wait, 0.05)
        await w1.send(np.arange(4, dtype=np.int32), 0, 13)  # ... then the message comes
        await asyncio.wait_for(awaiting, 10)
        assert out.tolist() == [0, 1, 2, 3] and work.source == 1
        work = w0.sync.irecv(out, 1, 14)
        awaiting = asyncio.ensure_future(aio._wait(work))
        await asyncio.sleep(0.01)
        waiting = loop.run_in_executor(None, work.wait, 10)  # the thread ends it
        await asyncio.sleep(0.05)
        await w1.send(np.full(4, 7, np.int32), 0, 14)
        assert await asyncio.wait_for(waiting, 10) is out
        assert await asyncio.wait_for(awaiting, 10) is out
        assert (out == 7).all()
        # Cancelled from a thread while the loop awaits it: the loop learns.
        work = w0.sync.irecv(out, 1, 15)
        awaiting = asyncio.ensure_future(aio._wait(work))
        await asyncio.sleep(0.01)
        await loop.run_in_executor(None, work._w.cancel)
        with pytest.raises(RuntimeError, match="cancelled"):
            await asyncio.wait_for(awaiting, 10)
        # Nothing lost: the next message goes to the next receive.
        await w1.send(np.full(4, 9, np.int32), 0, 15)
        await w0.recv_into(out, 1, 15)
        assert (out == 9).all()
        await asyncio.gather(w0.finish(10), w1.finish(10))
        await a.shutdown()
        await b.shutdown()

    asyncio.run(asyncio.wait_for(main(), 60))


@pytest.mark.parametrize("copy_max", [None, 0], ids=["default", "off-loop"])
def test_receives_cancelled_by_timeouts_while_messages_stream_lose_nothing(copy_max):
    # A leader's pattern: wait_for(recv, short timeout) in a loop while a
    # worker streams. A cancellation that races with the message's arrival
    # must either withdraw the receive (the message goes to the next one) or
    # deliver the message: none is lost, the order holds. Also with every
    # recv_into in a task of the runtime (loop_copy_max 0).
    async def main():
        a, b, w0, w1 = await pair()
        n = 3000

        def stream():
            for i in range(n):
                w1.sync.send(np.full(2, i, np.int64), 0, 5)
                if i % 10 == 0:
                    time.sleep(0.003)  # now and then the receiver waits, and times out

        sender = threading.Thread(target=stream)
        sender.start()
        got, timeouts = [], 0
        lent = np.zeros(2, np.int64)
        seen, last = 0, time.monotonic()
        while len(got) < n:
            if len(got) != seen:
                seen, last = len(got), time.monotonic()
            assert time.monotonic() - last < 10, f"message {len(got)} never came: lost"
            try:
                if len(got) % 2:
                    arr = await asyncio.wait_for(w0.recv(1, 5, dtype=np.int64, shape=2), 0.001)
                    got.append(int(arr[0]))
                else:
                    await asyncio.wait_for(w0.recv_into(lent, 1, 5), 0.001)
                    got.append(int(lent[0]))
            except asyncio.TimeoutError:
                timeouts += 1
        sender.join()
        assert got == list(range(n)), "lost or reordered"
        await asyncio.gather(w0.finish(10), w1.finish(10))
        await a.shutdown()
        await b.shutdown()
        return timeouts

    with loop_copy_max(mw.loop_copy_max() if copy_max is None else copy_max):
        timeouts = asyncio.run(asyncio.wait_for(main(), 120))
    assert timeouts > 0, "no receive was ever cancelled: the test proved nothing"


def test_a_send_without_a_copy_lends_the_array_until_the_message_is_out():
    """``send(copy=False)`` sends from the array's own memory: while a large
    message waits for its receiver, the array is lent (a receive into it is
    refused); a second send of the same array may read it too; a cancelled
    send still delivers the whole message, intact; an array a receive is
    writing is refused; arrays that cannot be lent (read-only) are copied."""
    async def main():
        a, b, w0, w1 = await pair()
        n = 8 << 20  # 32 MiB of float32: more than the sockets buffer
        x = np.full(n, 3.0, np.float32)
        first = asyncio.ensure_future(w1.send(x, 0, 1, copy=False))
        await asyncio.sleep(0.2)
        assert not first.done(), "the receiver has not posted a receive yet"
        with pytest.raises(ValueError, match="in use"):
            await w1.recv_into(x, 0, 9)
        second = asyncio.ensure_future(w1.send(x, 0, 1, copy=False))  # also lent: both only read
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        out = np.zeros(n, np.float32)
        for _ in range(2):
            await w0.recv_into(out, 1, 1)
            assert (out == 3.0).all()
            out[:] = 0
        await second
        # An array that a pending receive writes cannot be sent from.
        y = np.zeros(4, np.int32)
        receiving = asyncio.ensure_future(w0.recv_into(y, 1, 3))
        await asyncio.sleep(0.05)
        with pytest.raises(ValueError, match="in use"):
            await w1.send(y, 0, 5, copy=False)
        await w1.send(np.arange(4, dtype=np.int32), 0, 3)
        await receiving
        assert y.tolist() == [0, 1, 2, 3]
        ro = np.arange(4, dtype=np.int32)
        ro.flags.writeable = False
        got = np.zeros(4, np.int32)
        await asyncio.gather(w1.send(ro, 0, 2, copy=False), w0.recv_into(got, 1, 2))
        assert (got == ro).all()
        await asyncio.gather(w0.finish(10), w1.finish(10))
        await a.shutdown()
        await b.shutdown()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_cancelled_in_place_collective_on_an_array_that_is_copied_still_gets_its_result():
    """An in-place collective whose array the runtime cannot borrow (bool,
    strided) works on a copy and writes the result back when it ends: a
    cancelled awaiting task does not stop that write (the collective goes on
    on every member, and the array gets the result as documented)."""

    async def main():
        a, b, w0, w1 = await pair()
        loop = asyncio.get_running_loop()
        for make, op, want in [
            (lambda r: np.array([r == 0, r == 1, False]), "max", [True, True, False]),
            (lambda r: np.full((4, 2), r + 1.0, np.float32)[:, 0], "sum", [3.0] * 4),
        ]:
            x0, x1 = make(0), make(1)
            task = asyncio.ensure_future(w0.all_reduce(x0, op))
            await asyncio.sleep(0)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            # Rank 1 makes its call after rank 0's task was cancelled.
            await loop.run_in_executor(None, lambda: w1.sync.all_reduce(x1, op))
            assert list(x1) == want
            deadline = time.monotonic() + 10
            while list(x0) != want:
                assert time.monotonic() < deadline, f"rank 0's array never got the result: {x0}"
                await asyncio.sleep(0.01)
        await a.shutdown()
        await b.shutdown()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_many_removal_waits_never_hold_the_housekeeping_pool():
    """More ``wait_removed`` waits than the housekeeping pool has threads,
    some cancelled: ``leave`` (which runs on that pool) still runs at once,
    and the waits still standing see the removal."""

    async def main():
        m = aio.AsyncWorldManager()
        store = await m.serve_store()
        name = unique("waits")
        w = await m.join(name, 0, 1, store, timeout=10)
        cancelled = [asyncio.ensure_future(w.wait_removed()) for _ in range(40)]
        standing = [asyncio.ensure_future(w.wait_removed()) for _ in range(40)]
        await asyncio.sleep(0.2)
        for t in cancelled:
            t.cancel()
        await asyncio.wait_for(m.leave(name), 5)
        assert await asyncio.wait_for(asyncio.gather(*standing), 5) == [True] * 40
        assert await w.wait_removed(0) is True
        await m.shutdown()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_loops_closed_with_a_send_still_going_are_freed_and_the_sends_still_arrive():
    """Each ``asyncio.run`` that ends while a cancelled send is still going
    (the peer has not taken it) left its closed loop held by the send's
    future: a new loop lets go of them. The sends themselves go on and
    arrive whole."""
    import gc
    import weakref

    m0, m1 = mw.WorldManager(), mw.WorldManager()
    store = m0.serve_store("127.0.0.1:0")
    name = unique("closed-loops")
    joined = {}
    t = threading.Thread(target=lambda: joined.update(w1=m1.join(name, 1, 2, store, timeout=10)))
    t.start()
    w0 = m0.join(name, 0, 2, store, timeout=10)
    t.join()
    w1 = joined["w1"]
    loops = []
    # 16 MiB: more than the socket buffers and the peer's read-ahead hold,
    # so the send is still going when its loop closes.
    n = 4 << 20

    async def send_and_cancel(k: int) -> None:
        loops.append(weakref.ref(asyncio.get_running_loop()))
        task = asyncio.ensure_future(aio.AsyncWorld(w0).send(np.full(n, k, np.float32), 1, 5))
        deadline = time.monotonic() + 10
        while not task.done() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
            if len(aio._BRIDGES) and any(b._pending for b in aio._BRIDGES.values()):
                break
        assert not task.done(), "the send ended before its loop closed; the test needs it going"
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    try:
        for k in range(3):
            asyncio.run(send_and_cancel(k))
        gc.collect()
        alive = [r for r in loops if r() is not None]
        assert len(alive) <= 1, f"{len(alive)} closed loops still held"
        assert len(aio._BRIDGES) <= 1
        for k in range(3):
            got = w1.recv(0, 5, dtype="float32", shape=n)
            assert got.shape == (n,) and (got == k).all(), f"send {k} arrived wrong"
    finally:
        m0.shutdown()
        m1.shutdown()


def test_checked_device_calls_start_off_the_event_loop_in_call_order(monkeypatch):
    """On an NCCL world that checks its device calls
    (``checks_device_calls``), a device collective's start waits for every
    member's description of the call, and a device receive's for its
    sender's: the asyncio API starts them (and the world's device sends) on
    a thread of the membership's own, so the loop goes on and they start in
    the order they were called. Host calls, and every
    call of a world that does not check, start on the loop as before. A TCP
    world never checks, whatever ``check_device_calls`` says. (No GPU here:
    numpy arrays stand in for CUDA tensors.)"""
    monkeypatch.setattr(aio, "_is_cuda", lambda t: isinstance(t, np.ndarray))
    monkeypatch.setattr(aio, "_stream_of", lambda args: None)
    m = mw.WorldManager()
    store = m.serve_store("127.0.0.1:0")
    w = m.join(unique("one"), 0, 1, store, check_device_calls=True)
    assert w.checks_device_calls is False
    started_on = []
    ended = []

    class Done:
        """A receive that has ended (from rank 0)."""

        source = 0

        def is_completed(self):
            return True

        def wait(self, timeout=None):
            return None

    class Declines:
        """The native fast paths, declining (as for a CUDA tensor)."""

        def recv_into_now(self, *args):
            return None

        def irecv_plain(self, *args):
            return None

    class Checked:
        checks_device_calls = True
        _w = Declines()
        name, generation, rank = unique("proxy"), 1, 0

        def all_reduce(self, *args, **kw):
            started_on.append(threading.get_ident())
            return w.all_reduce(*args, **kw)

        def isend(self, tensor, *args, **kw):
            started_on.append(threading.get_ident())
            ended.append(-tensor.size)
            return Done()

        def irecv(self, tensor, *args, **kw):
            started_on.append(threading.get_ident())
            if tensor.size == 2:
                time.sleep(0.05)  # the first waits for its sender
            ended.append(tensor.size)
            return Done()

    class Unchecked(Checked):
        checks_device_calls = False

    async def main():
        loop_thread = threading.get_ident()
        x = np.arange(4, dtype=np.float32)
        checked, unchecked = aio.AsyncWorld(Checked()), aio.AsyncWorld(Unchecked())
        await checked.all_reduce(x)
        await unchecked.all_reduce(x)
        assert await checked.recv_into(x, 0) == 0
        assert await unchecked.recv_into(x, 0) == 0
        first = [t == loop_thread for t in started_on]
        ended.clear()
        # A receive that waits for its sender, a send and a receive from
        # another source, through another wrapper of the same membership:
        # they start in call order.
        await asyncio.gather(checked.recv_into(np.zeros(2, dtype=np.float32), 0),
                             aio.AsyncWorld(Checked()).send(np.zeros(5, dtype=np.float32), 0),
                             checked.recv_into(np.zeros(3, dtype=np.float32), 1))
        return first, x

    on_loop, x = asyncio.run(main())
    assert on_loop == [False, True, False, True], on_loop
    assert ended == [2, -5, 3], f"the device calls started out of order: {ended}"
    assert (x == np.arange(4, dtype=np.float32)).all()
    m.shutdown()


def test_checked_device_calls_start_on_the_loop_elsewhere(monkeypatch):
    """The same proxies without the check, and host arrays on a checking
    world: every start is on the loop's thread."""
    monkeypatch.setattr(aio, "_is_cuda", lambda t: False)
    m = mw.WorldManager()
    store = m.serve_store("127.0.0.1:0")
    w = m.join(unique("one"), 0, 1, store)
    started_on = []

    class Checked:
        checks_device_calls = True

        def all_reduce(self, *args, **kw):
            started_on.append(threading.get_ident())
            return w.all_reduce(*args, **kw)

    async def main():
        await aio.AsyncWorld(Checked()).all_reduce(np.arange(4, dtype=np.float32))
        return threading.get_ident()

    loop_thread = asyncio.run(main())
    assert started_on == [loop_thread], (started_on, loop_thread)
    m.shutdown()


def test_a_membership_lets_its_checked_call_thread_go_when_its_world_is_left(monkeypatch):
    """The thread that starts a checking world's device calls (one per
    membership) is let go when the asyncio manager leaves that world: its
    entry goes and the thread ends. A membership still joined keeps its
    own while its world object lives, and loses it at the next sweep once
    none does. (No GPU here: numpy arrays stand in for CUDA tensors, and proxies
    that check stand in for NCCL worlds.)"""
    monkeypatch.setattr(aio, "_is_cuda", lambda t: isinstance(t, np.ndarray))
    monkeypatch.setattr(aio, "_stream_of", lambda args: None)

    def starters() -> "set[threading.Thread]":
        return {t for t in threading.enumerate() if t.name.startswith("multiworld-checked")}

    async def main():
        am = aio.AsyncWorldManager()
        store = await am.serve_store()
        names = [unique("left"), unique("kept")]
        worlds = [await am.join(n, 0, 1, store) for n in names]

        def checking(w: "aio.AsyncWorld"):
            class Checked:
                checks_device_calls = True
                name, generation, rank = w.name, w.generation, w.rank

                @property
                def state(self):
                    return w.state

                def all_reduce(self, *args, **kw):
                    return w.sync.all_reduce(*args, **kw)

            return aio.AsyncWorld(Checked())

        before = starters()
        wrappers = [checking(w) for w in worlds]
        for i in range(len(wrappers)):
            await wrappers[i].all_reduce(np.arange(4, dtype=np.float32))
        keys = [(w.name, w.generation, w.rank) for w in worlds]
        assert all(k in aio._STARTERS for k in keys)
        threads = starters() - before
        assert len(threads) == 2, threads
        await am.leave(names[0])
        assert keys[0] not in aio._STARTERS and keys[1] in aio._STARTERS
        deadline = time.monotonic() + 10
        while len(starters() - before) > 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert len(starters() - before) == 1, starters() - before
        # A membership whose world objects are all gone has nothing queued:
        # the next sweep lets its thread go too.
        wrappers.clear()
        gc.collect()
        aio._let_starters_go()
        assert keys[1] not in aio._STARTERS
        await am.shutdown()

    asyncio.run(main())
