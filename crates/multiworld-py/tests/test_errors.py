"""Exceptions: hierarchy, fields, bad arguments, interrupts, fork."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import multiworld_rs as mw
from multiworld_rs import errors as E

from conftest import both, unique


def test_hierarchy():
    assert issubclass(E.BrokenWorldError, E.MultiworldError)
    assert issubclass(E.WorldTimeoutError, TimeoutError)
    assert issubclass(E.MismatchError, ValueError)
    assert issubclass(E.InvalidArgumentError, ValueError)
    assert issubclass(E.ConfigError, ValueError)
    assert issubclass(E.NotJoinedError, LookupError)
    assert issubclass(E.ForkedProcessError, RuntimeError)
    assert issubclass(E.JoinTimeoutError, E.JoinError)
    assert issubclass(E.JoinTimeoutError, E.WorldTimeoutError)
    e = E.WorldTimeoutError("x", world="w", op="recv", after=1.5)
    assert (e.world, e.op, e.after, str(e)) == ("w", "recv", 1.5, "x")


def test_recv_into_mismatch_names_both_and_leaves_array(pair):
    w0, w1 = pair
    x = np.arange(6, dtype=np.float32)
    out = np.full(5, 7, dtype=np.int32)

    def recv():
        with pytest.raises(mw.MismatchError) as info:
            w0.recv_into(out, 1)
        return str(info.value)

    _, msg = both(lambda: w1.send(x, 0), recv)
    assert "int32" in msg and "float32" in msg and "20 bytes" in msg and "24 bytes" in msg, msg
    assert (out == 7).all()


def test_bad_arguments(pair):
    w0, _ = pair
    x = np.zeros(2, dtype=np.float32)
    with pytest.raises(ValueError, match="-1"):
        w0.send(x, -1)
    with pytest.raises(TypeError, match="'1'"):
        w0.send(x, "1")
    with pytest.raises(mw.InvalidArgumentError, match="7"):
        w0.send(x, 7)  # no such rank
    with pytest.raises(TypeError, match="complex"):
        w0.send(np.zeros(2, dtype=np.complex64), 1)
    with pytest.raises(TypeError, match="list"):
        w0.send([1.0, 2.0], 1)
    with pytest.raises(ValueError, match="nope"):
        w0.all_reduce(x, "nope")
    with pytest.raises(TypeError, match="dtype"):
        w0.recv(1, dtype="complex128", shape=2)
    with pytest.raises(ValueError, match="-3"):
        w0.recv(1, dtype="float32", shape=(-3,))
    with pytest.raises(ValueError, match="-1"):
        w0.irecv(src=1, dtype="float32", shape=2).wait(timeout=-1)
    m = mw.WorldManager()
    with pytest.raises(mw.ConfigError, match="rank"):
        m.join("w", 3, 2, "127.0.0.1:1")
    with pytest.raises(mw.ConfigError, match="name"):
        m.join("", 0, 1, "127.0.0.1:1")
    with pytest.raises(ValueError, match="backend"):
        m.join("w", 0, 1, "127.0.0.1:1", backend="carrier-pigeon")
    with pytest.raises(mw.JoinError, match="nonsense"):
        m.serve_store("nonsense")
    with pytest.raises(TypeError, match="check_device_calls"):
        m.join("w", 0, 1, "127.0.0.1:1", check_device_calls="yes")
    m.shutdown()


def test_join_times_out_when_a_member_is_missing():
    m = mw.WorldManager()
    store = m.serve_store("127.0.0.1:0")
    name = unique("lonely")
    t0 = time.monotonic()
    with pytest.raises(mw.JoinError) as info:
        m.join(name, 0, 2, store, timeout=0.5)
    assert time.monotonic() - t0 < 5
    # A timeout, and said so: code catching the builtin catches it too.
    e = info.value
    assert isinstance(e, mw.JoinTimeoutError) and isinstance(e, TimeoutError), repr(e)
    assert (e.world, e.op, e.after) == (name, "join", 0.5), (e.world, e.op, e.after)
    assert e.detail and e.detail in str(e), (e.detail, str(e))
    m.shutdown()


def test_a_member_whose_store_never_comes_up_times_out():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    m = mw.WorldManager()
    t0 = time.monotonic()
    # Rank 0 would host the store; it never starts.
    with pytest.raises(mw.JoinTimeoutError) as info:
        m.join(unique("no-store"), 1, 2, f"127.0.0.1:{port}", timeout=0.5)
    assert time.monotonic() - t0 < 5
    assert isinstance(info.value, TimeoutError) and info.value.after == 0.5
    m.shutdown()


def test_a_join_that_fails_for_another_reason_is_no_timeout():
    m = mw.WorldManager()
    store = m.serve_store("127.0.0.1:0")
    name = unique("secret")
    first = m.join(name, 0, 1, store, secret="one", timeout=5)
    other = mw.WorldManager()
    # A wrong secret is refused at once: a JoinError, not a timeout.
    with pytest.raises(mw.JoinError, match="secret") as info:
        other.join(name, 0, 1, store, secret="two", timeout=5, host_store=False)
    assert not isinstance(info.value, TimeoutError), repr(info.value)
    first.finish(5)
    other.shutdown()
    m.shutdown()


def test_join_from_env_reports_missing_variables(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    m = mw.WorldManager()
    with pytest.raises(mw.ConfigError, match="RANK"):
        m.join_from_env("w")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "0")
    w = m.join_from_env(unique("env"), timeout=10)
    assert (w.rank, w.size) == (0, 1)
    m.shutdown()


def test_broken_world_error_fields_and_events(pair):
    w0, w1 = pair
    w1.abort()
    with pytest.raises(mw.BrokenWorldError) as info:
        w0.recv(1, dtype="float32", shape=1)
    e = info.value
    assert e.world == w0.name and e.generation == w0.generation
    assert e.cause in E.CAUSES and e.cause in ("peer_lost", "reported_by_peer")
    assert e.rank == 1 and e.detail
    with pytest.raises(mw.BrokenWorldError) as info:
        w1.send(np.zeros(1), 0)
    assert info.value.cause == "aborted"


def test_events_and_worlds():
    a, b = mw.WorldManager(), mw.WorldManager()
    store = a.serve_store("127.0.0.1:0")
    events = a.events(timeout=5)
    name = unique("ev")
    w0, w1 = both(lambda: a.join(name, 0, 2, store), lambda: b.join(name, 1, 2, store))
    assert [(i.name, i.rank, i.size, i.state) for i in a.worlds()] == [(name, 0, 2, "ready")]
    assert a.world(name).generation == w0.generation and a.world("nope") is None
    b.shutdown()
    kinds = []
    for ev in events:
        kinds.append((ev.kind, ev.world, ev.cause))
        if ev.kind == "removed":
            break
    assert kinds[0] == ("joined", name, None)
    # A peer that shuts down tells the others it left before its connections
    # close; whichever reaches this member first names the cause.
    assert kinds[1][0] == "broken" and kinds[1][2] in ("peer_lost", "reported_by_peer"), kinds
    assert kinds[-1][0] == "removed"
    assert events.next(0.05) is None
    assert w0.wait_removed(5)
    with pytest.raises(mw.BrokenWorldError):
        w0.barrier()
    a.shutdown()


def test_work_wait_timeout_then_result(pair):
    w0, w1 = pair
    work = w0.irecv(src=1, tag=9, dtype="int64", shape=3)
    assert not work.is_completed()
    with pytest.raises(mw.WorldTimeoutError):
        work.wait(timeout=0.05)
    w1.send(np.array([1, 2, 3]), 0, tag=9)
    got = work.wait(timeout=10)
    assert (got == [1, 2, 3]).all() and work.source == 1 and work.is_completed()
    assert work.wait() is got
    s = w1.isend(np.ones(2), 0)
    assert s.wait(10) is None
    out = np.zeros(2)
    w0.irecv(out, 1).wait(10)
    assert (out == 1).all()


def test_not_joined_after_leave():
    a = mw.WorldManager()
    store = a.serve_store("127.0.0.1:0")
    name = unique("solo")
    w = a.join(name, 0, 1, store)
    a.leave(name)
    with pytest.raises(mw.NotJoinedError):
        w.barrier()
    with pytest.raises(mw.NotJoinedError):
        a.leave(name)
    a.shutdown()
    with pytest.raises(mw.ShutDownError):
        a.join(name, 0, 1, store)


def run_py(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout)


#: Defines ``report_child(pid)`` in a script that forks: prints the child's
#: exit code as ``CHILD <code>``, or kills a child still running after 15 s
#: and prints ``CHILD hung`` (a hung child is not left behind).
_REPORT_CHILD = """
def report_child(pid, limit=15):
    import os, time
    until = time.monotonic() + limit
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            print("CHILD", os.waitstatus_to_exitcode(status))
            return
        if time.monotonic() > until:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            print("CHILD hung")
            return
        time.sleep(0.01)
"""


def assert_child_ok(code: str) -> None:
    """Runs a script that forks and calls ``report_child(pid)``; asserts
    the child exited 0."""
    r = run_py(_REPORT_CHILD + textwrap.dedent(code))
    assert r.returncode == 0, r.stderr
    assert "CHILD 0" in r.stdout, r.stdout + r.stderr


def test_ctrl_c_interrupts_a_blocked_receive_quickly():
    # A process started in the background by a non-interactive shell (as CI
    # may run this suite) inherits SIGINT ignored, and Python then installs
    # no KeyboardInterrupt handler: the script installs it itself (without
    # it, the SIGINT below was ignored and the receive waited for ever). If
    # it ever hangs anyway, faulthandler prints every thread's stack.
    r = run_py("""
        import faulthandler, signal
        faulthandler.dump_traceback_later(45, exit=True)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        import os, threading, time
        import multiworld_rs as mw
        a, b = mw.WorldManager(), mw.WorldManager()
        store = a.serve_store("127.0.0.1:0")
        out = {}
        t = threading.Thread(target=lambda: out.setdefault(1, b.join("w", 1, 2, store)))
        t.start()
        w = a.join("w", 0, 2, store)
        t.join()
        took = []
        for _ in range(3):
            sent = []
            def fire():
                time.sleep(0.3)
                sent.append(time.monotonic())
                os.kill(os.getpid(), signal.SIGINT)
            threading.Thread(target=fire).start()
            try:
                w.recv(1, dtype="float32", shape=1)
            except KeyboardInterrupt:
                took.append(time.monotonic() - sent[0])
            else:
                raise SystemExit("recv returned")
        # The world is still usable after an interrupted receive.
        threading.Thread(target=lambda: out[1].send(__import__("numpy").ones(1, "float32"), 0)).start()
        assert w.recv(1, dtype="float32", shape=1)[0] == 1.0
        took.sort()
        print(f"MEDIAN {took[1]:.4f} WORST {took[2]:.4f}")
        a.shutdown(); b.shutdown()
    """)
    assert r.returncode == 0, r.stderr
    median = float(r.stdout.split("MEDIAN")[1].split()[0])
    worst = float(r.stdout.split("WORST")[1])
    # Slices of 50 ms: typically ~25 ms; the worst case is bounded loosely so
    # that a busy machine's scheduling noise cannot make this flaky.
    assert median < 0.1, f"Ctrl-C took {median:.3f} s (median of 3)"
    assert worst < 0.3, f"Ctrl-C took {worst:.3f} s (worst of 3)"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_gets_a_clear_error():
    assert_child_ok("""
        import os
        import multiworld_rs as mw
        import numpy as np
        m = mw.WorldManager()          # starts the runtime in the parent
        store = m.serve_store("127.0.0.1:0")
        w = m.join("solo", 0, 1, store)
        work = w.all_reduce(np.ones(4, np.float32), async_op=True)  # not waited on
        pid = os.fork()
        if pid == 0:
            try:
                mw.WorldManager()
            except mw.ForkedProcessError as e:
                ok = "spawn" in str(e) and e.parent_pid == os.getppid()
                arr = np.ones(4, np.float32)
                for read in (work.is_completed, lambda: w.state, lambda: m.world("solo"), m.worlds,
                             lambda: w.send(arr, 0), lambda: w.recv_into(arr, 0),
                             lambda: w.isend(arr, 0), lambda: w.all_reduce(arr)):
                    try:
                        read()                       # inherited handles
                        os._exit(6)
                    except mw.ForkedProcessError:
                        pass
                try:
                    m.serve_store("127.0.0.1:0")   # an inherited manager too
                except mw.ForkedProcessError:
                    os._exit(0 if ok else 3)
                os._exit(4)
            os._exit(5)
        report_child(pid)
        m.shutdown()
    """)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_gets_a_clear_error_from_an_event_stream_waiting_in_the_parent():
    # The parent's event stream has a wait in flight (an anext cancelled
    # meanwhile): a forked child inherits it without the thread that would
    # end it. The child's next() and anext() must raise ForkedProcessError,
    # not wait for ever (or return None).
    assert_child_ok("""
        import asyncio, faulthandler, os
        faulthandler.dump_traceback_later(30, exit=True)
        import multiworld_rs as mw
        m = mw.WorldManager()
        s = m.events()

        async def leave_one_in_flight():
            t = asyncio.ensure_future(s.anext())
            await asyncio.sleep(0.05)
            t.cancel()

        asyncio.run(leave_one_in_flight())
        pid = os.fork()
        if pid == 0:
            codes = []
            try:
                s.next(1)
                codes.append(3)
            except mw.ForkedProcessError:
                codes.append(0)
            try:
                asyncio.run(asyncio.wait_for(s.anext(1), 5))
                codes.append(4)
            except mw.ForkedProcessError:
                codes.append(0)
            except asyncio.TimeoutError:
                codes.append(5)
            os._exit(max(codes))
        report_child(pid)
        m.shutdown()
    """)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_is_not_stuck_on_locks_a_parents_thread_held_at_the_fork():
    # Another thread of the parent holds the event stream's lock and the
    # asyncio bridges' lock at the moment of the fork (as it does for a
    # moment while it starts a wait or a loop's bridge): the child's calls
    # must not wait for ever on locks nobody in the child will release (the
    # stream raises ForkedProcessError, a new loop gets its bridge).
    assert_child_ok("""
        import asyncio, faulthandler, os, threading
        faulthandler.dump_traceback_later(30, exit=True)
        import multiworld_rs as mw
        from multiworld_rs import aio
        m = mw.WorldManager()
        s = m.events()
        held, release = threading.Event(), threading.Event()

        def hold():
            with s._lock, aio._BRIDGES_LOCK:
                held.set()
                release.wait()

        t = threading.Thread(target=hold)
        t.start()
        held.wait()
        pid = os.fork()
        if pid == 0:
            codes = [3, 4]
            try:
                try:
                    s.next(0.05)
                except mw.ForkedProcessError:
                    codes[0] = 0

                async def one_bridge():
                    return aio._bridge(asyncio.get_running_loop()) is not None

                if asyncio.run(one_bridge()):
                    codes[1] = 0
            finally:
                os._exit(max(codes))
        release.set()
        t.join()
        report_child(pid)
        m.shutdown()
    """)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_gets_a_clear_error_from_asyncio_housekeeping():
    # The parent used the asyncio housekeeping pool; a forked child inherits
    # it without its threads. An awaited housekeeping call of an inherited
    # manager must raise ForkedProcessError, not wait for ever.
    assert_child_ok("""
        import asyncio, os
        import multiworld_rs as mw
        from multiworld_rs import aio

        async def parent():
            m = aio.AsyncWorldManager()
            await m.serve_store("127.0.0.1:0")
            return m

        m = asyncio.run(parent())
        pid = os.fork()
        if pid == 0:
            async def child():
                await asyncio.wait_for(m.shutdown(), 10)
            try:
                asyncio.run(child())
                os._exit(3)
            except mw.ForkedProcessError:
                os._exit(0)
            except asyncio.TimeoutError:
                os._exit(4)
            os._exit(5)
        report_child(pid)
        asyncio.run(m.shutdown())
    """)


def test_a_cancel_from_a_signal_handler_on_the_waiting_thread_ends_the_wait():
    # A handle's cancel called from a signal handler that interrupts this
    # very thread's wait on it (a receive into a lent array from a silent
    # peer): the handler must return at once and the wait end with the
    # cancellation, not both wait for each other.
    r = run_py("""
        import faulthandler, signal, threading
        faulthandler.dump_traceback_later(60, exit=True)
        import numpy as np
        import multiworld_rs as mw
        a, b = mw.WorldManager(), mw.WorldManager()
        store = a.serve_store("127.0.0.1:0")
        out = {}
        t = threading.Thread(target=lambda: out.setdefault(1, b.join("sig", 1, 2, store)))
        t.start()
        w = a.join("sig", 0, 2, store)
        t.join()
        arr = np.zeros(4, np.float32)
        h = w.irecv(arr, 1)
        signal.signal(signal.SIGALRM, lambda *_: h._w.cancel())
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        import time
        t0 = time.monotonic()
        try:
            h.wait(timeout=20)
            print("WAITED")
        except RuntimeError as e:
            print("CANCELLED", "cancelled" in str(e), round(time.monotonic() - t0, 1))
        # The array is the caller's again: a new receive may use it.
        out[1].send(np.full(4, 7, np.float32), 0)
        w.recv_into(arr, 1)
        print("AGAIN", arr.tolist())
        a.shutdown(); b.shutdown()
    """)
    assert r.returncode == 0, r.stderr
    assert "CANCELLED True" in r.stdout, r.stdout + r.stderr
    took = float(r.stdout.split("CANCELLED True ")[1].split()[0])
    assert took < 5, r.stdout
    assert "AGAIN [7.0, 7.0, 7.0, 7.0]" in r.stdout, r.stdout


def _pair_script(name: str, body: str) -> str:
    """A script for :func:`run_py`: SIGINT raises KeyboardInterrupt (a
    faulthandler dump after 100 s), two managers ``a`` and ``b`` in world
    ``name`` (``w`` is rank 0, ``out[1]`` rank 1), a 512 MiB ``msg`` and
    ``received()``, the bytes rank 0 has read from rank 1; then ``body``."""
    prelude = textwrap.dedent(r"""
        import faulthandler, signal
        faulthandler.dump_traceback_later(100, exit=True)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        import os, re, threading, time
        import numpy as np
        import multiworld_rs as mw
        a, b = mw.WorldManager(), mw.WorldManager()
        store = a.serve_store("127.0.0.1:0")
        out = {}
        t = threading.Thread(target=lambda: out.setdefault(1, b.join("NAME", 1, 2, store)))
        t.start()
        w = a.join("NAME", 0, 2, store)
        t.join()
        msg = np.arange(64 << 20, dtype=np.int64)  # 512 MiB
        pat = re.compile(r'multiworld_received_bytes_total\{[^}]*world="NAME"[^}]*peer="1"[^}]*\} (\d+)')

        def received():
            m = pat.search(a.metrics_text())
            return int(m.group(1)) if m else 0
    """).replace("NAME", name)
    return prelude + textwrap.dedent(body)


def test_an_interrupted_recv_into_never_writes_the_array_after_it_returns():
    # recv_into lends the caller's array to the runtime (no copy). Ctrl-C in
    # the middle of a large message: the transport finishes reading that
    # message (it goes to the next receive), so the call must not return
    # while the runtime still writes the array. The interrupt fires once
    # rank 0 has read the first bytes of a 512 MiB message; when the
    # KeyboardInterrupt reaches the caller the message must be read (the
    # array holds it), the array must not change any more, and the next
    # receive gets the whole message (nothing lost).
    r = run_py(_pair_script("lend", """
        mid = 0
        for attempt in range(3):
            base = received()
            def fire():
                while received() == base:
                    time.sleep(0.0002)
                os.kill(os.getpid(), signal.SIGINT)
            threading.Thread(target=lambda: out[1].send(msg, 0)).start()
            firing = threading.Thread(target=fire)
            firing.start()
            first = np.zeros_like(msg)
            try:
                w.recv_into(first, 1)
                try:  # complete before the interrupt: it fires here; again
                    firing.join()
                    time.sleep(0.2)
                except KeyboardInterrupt:
                    pass
            except KeyboardInterrupt:
                # The runtime finished with the array before the call
                # returned: the whole message is read, and in it.
                last, at_return = first[-1], received() - base
                snap = first.copy()
                firing.join()
                second = np.zeros_like(msg)
                w.recv_into(second, 1)
                assert np.array_equal(second, msg), "the interrupted message was lost"
                assert np.array_equal(first, snap), "the array changed after recv_into returned"
                assert at_return >= msg.nbytes, (at_return, msg.nbytes)
                assert last == msg[-1], last
                mid += 1
                break
        print(f"MID {mid}")
        a.shutdown(); b.shutdown()
    """), timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "MID 1" in r.stdout, r.stdout + r.stderr


def _two_members(prefix: str):
    """Two managers of this process in a new world of two: ``(a, b, w0,
    w1, received)``, ``received()`` being how many bytes rank 0 has read
    from rank 1 (from the metrics)."""
    import re
    import threading

    a, b = mw.WorldManager(), mw.WorldManager()
    store = a.serve_store("127.0.0.1:0")
    name = unique(prefix)
    out = {}
    t = threading.Thread(target=lambda: out.setdefault(1, b.join(name, 1, 2, store, timeout=10)))
    t.start()
    w0 = a.join(name, 0, 2, store, timeout=10)
    t.join()
    pat = re.compile(r'multiworld_received_bytes_total\{[^}]*world="%s"[^}]*peer="1"[^}]*\} (\d+)'
                     % re.escape(name))

    def received() -> int:
        m = pat.search(a.metrics_text())
        return int(m.group(1)) if m else 0

    return a, b, w0, out[1], received


def test_a_lent_irecv_cancelled_mid_message_lets_go_only_once_the_message_is_in():
    # irecv into a plain array lends it to the operation. Cancelled while a
    # 256 MiB message is arriving into it, cancel() returns only once the
    # runtime has let go of the array: the message was read to its end (into
    # the array), the array no longer changes, and the next receive gets the
    # message (nothing lost); unless the receive had ended first, and the
    # message is the irecv's.
    import threading

    a, b, w, w1, received = _two_members("lend-cancel")
    out = {1: w1}
    try:
        msg = np.arange(32 << 20, dtype=np.int64)  # 256 MiB
        first = np.zeros_like(msg)
        work = w.irecv(first, 1)
        sender = threading.Thread(target=lambda: out[1].send(msg, 0))
        sender.start()
        deadline = time.monotonic() + 30
        while received() == 0:
            assert time.monotonic() < deadline, "the message never started arriving"
            time.sleep(0.0002)
        work._w.cancel()
        last, at_return = first[-1], received()
        snap = first.copy()
        sender.join(30)
        if at_return < msg.nbytes:
            pytest.fail(f"cancel returned after {at_return} of {msg.nbytes} bytes")
        assert last == msg[-1]
        # Withdrawn mid-message, the message goes to the next receive; unless
        # the receive had ended before the cancellation came (the whole
        # message can land between two looks at the byte counter): then the
        # cancellation lost the race and the message is the irecv's.
        second = np.zeros_like(msg)
        try:
            assert w.irecv(second, 1).wait(10) is second
            assert np.array_equal(second, msg), "the next receive got something else"
        except mw.WorldTimeoutError:
            assert work.wait(1) is first, "the message was lost"
            assert np.array_equal(first, msg)
        assert np.array_equal(first, snap), "the array changed after cancel returned"
    finally:
        a.shutdown()
        b.shutdown()


def test_read_ahead_option():
    """``read_ahead`` defaults to the package's 256 KiB, is checked, and
    worlds with any setting deliver messages below and above it intact."""
    assert mw.DEFAULT_READ_AHEAD == 256 << 10
    opts = mw.WorldManager._options(None, 30.0, None, None, None, None, None)
    assert opts["read_ahead"] == mw.DEFAULT_READ_AHEAD
    m = mw.WorldManager()
    with pytest.raises(TypeError, match="'big'"):
        m.join("w", 0, 1, "127.0.0.1:1", read_ahead="big")
    with pytest.raises(ValueError, match="-1"):
        m.join("w", 0, 1, "127.0.0.1:1", read_ahead=-1)
    m.shutdown()
    a, b = mw.WorldManager(), mw.WorldManager()
    store = a.serve_store("127.0.0.1:0")
    try:
        for read_ahead in (0, 16 << 10, None):
            name = unique("ra")
            w0, w1 = both(lambda: a.join(name, 0, 2, store, timeout=10, read_ahead=read_ahead),
                          lambda: b.join(name, 1, 2, store, timeout=10, read_ahead=read_ahead))
            sizes = (4, 64 << 10, 512 << 10)
            msgs = [np.full(n, i + 1, dtype=np.uint8) for i, n in enumerate(sizes)]

            def send():
                for x in msgs:
                    w1.send(x, 0)

            def recv():
                return [w0.recv(1, dtype="uint8", shape=n) for n in sizes]

            _, got = both(send, recv)
            for x, y in zip(msgs, got):
                assert np.array_equal(x, y), (read_ahead, x.size)
            both(lambda: w0.finish(10), lambda: w1.finish(10))
    finally:
        a.shutdown()
        b.shutdown()


def test_a_cancel_from_another_thread_returns_once_the_waiters_array_is_let_go():
    # One thread waits on a receive into a lent array (a polled handle: no
    # operation deadline); another cancels it while a 256 MiB message is
    # arriving into the array. The waiting thread applies the cancel, and
    # the cancelling call returns only once the runtime has let go of the
    # array: it no longer changes, and it can be lent again at once.
    import threading

    a, b, w, w1, received = _two_members("cancel-other")
    out = {1: w1}
    try:
        msg = np.arange(32 << 20, dtype=np.int64)  # 256 MiB
        first = np.zeros_like(msg)
        work = w.irecv(first, 1)
        waited = {}

        def waiter():
            try:
                waited["result"] = work.wait(30)
            except Exception as e:  # the cancellation, for the main thread
                waited["error"] = e

        waiting = threading.Thread(target=waiter)
        waiting.start()
        sender = threading.Thread(target=lambda: out[1].send(msg, 0))
        sender.start()
        deadline = time.monotonic() + 30
        while received() == 0:
            assert time.monotonic() < deadline, "the message never started arriving"
            time.sleep(0.0002)
        work._w.cancel()
        at_return = received()
        snap = first.copy()
        waiting.join(30)
        sender.join(30)
        assert at_return >= msg.nbytes, f"cancel returned after {at_return} of {msg.nbytes} bytes"
        assert np.array_equal(first, snap), "the array changed after cancel returned"
        # The array is the caller's: a new receive may lend it.
        again = w.irecv(first, 1)
        again._w.cancel()
        assert "error" in waited or waited.get("result") is first, waited
    finally:
        a.shutdown()
        b.shutdown()


def test_every_waiter_of_a_cancelled_receive_returns_once_the_array_is_let_go():
    # Two threads wait on one receive into a lent array; a third cancels it
    # while a 256 MiB message is arriving into the array. The wait that
    # applies the cancel waits for the runtime to let go of the array; the
    # other wait, which finds that outcome kept, must wait for it too (it
    # returned at once, while the message was still being written).
    import threading

    a, b, w, w1, received = _two_members("cancel-two-waiters")
    out = {1: w1}
    try:
        msg = np.arange(32 << 20, dtype=np.int64)  # 256 MiB
        first = np.zeros_like(msg)
        work = w.irecv(first, 1)
        seen = []

        def waiter():
            try:
                work.wait(30)
            except Exception:  # the cancellation
                pass
            seen.append(received())

        waiters = [threading.Thread(target=waiter) for _ in range(2)]
        for t in waiters:
            t.start()
        sender = threading.Thread(target=lambda: out[1].send(msg, 0))
        sender.start()
        deadline = time.monotonic() + 30
        while received() == 0:
            assert time.monotonic() < deadline, "the message never started arriving"
            time.sleep(0.0002)
        work._w.cancel()
        for t in waiters:
            t.join(30)
        sender.join(30)
        assert len(seen) == 2, seen
        for got in seen:
            assert got >= msg.nbytes, f"a waiter returned after {got} of {msg.nbytes} bytes"
    finally:
        a.shutdown()
        b.shutdown()


def test_a_signal_handler_that_cancels_and_raises_gets_the_array_back_let_go():
    # Ctrl-C's handler cancels the receive its thread waits on, then raises:
    # the KeyboardInterrupt reaches the caller only once the runtime has let
    # go of the array (the message arriving into it has been read), so the
    # caller's except clause may use the array at once.
    r = run_py(_pair_script("sigcancel", """
        first = np.zeros_like(msg)
        h = w.irecv(first, 1)

        def cancel_and_raise(signum, frame):
            h._w.cancel()
            raise KeyboardInterrupt

        signal.signal(signal.SIGINT, cancel_and_raise)

        def interrupt():
            while received() == 0:
                time.sleep(0.0002)
            # The main thread is in wait() by now (it entered it before the
            # sender started); a 512 MiB message takes far longer than this.
            time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGINT)

        threading.Thread(target=interrupt).start()
        sender = threading.Thread(target=lambda: out[1].send(msg, 0))
        threading.Timer(0.2, sender.start).start()
        try:
            h.wait(60)
            print("ENDED")
        except KeyboardInterrupt:
            at = received()
            snap = first.copy()
            time.sleep(0.5)
            print("INTERRUPTED", at >= msg.nbytes, np.array_equal(first, snap), at)
        a.shutdown(); b.shutdown()
    """), timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "INTERRUPTED True True" in r.stdout or "ENDED" in r.stdout, r.stdout


def test_ctrl_c_while_a_wait_lets_go_of_the_array_keeps_the_outcome():
    # A wait applies a cancel that came from another thread, then waits for
    # the runtime to let go of the array (its message was arriving): Ctrl-C
    # then interrupts that wait. The outcome (the cancellation) is kept: the
    # next wait raises it, not a lost outcome.
    r = run_py(_pair_script("kept", """
        first = np.zeros_like(msg)
        h = w.irecv(first, 1)

        def cancel_then_interrupt():
            while received() == 0:
                time.sleep(0.0002)
            threading.Thread(target=h._w.cancel).start()
            time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGINT)

        threading.Thread(target=lambda: out[1].send(msg, 0)).start()
        threading.Thread(target=cancel_then_interrupt).start()
        try:
            h.wait(60)
            print("ENDED")
        except KeyboardInterrupt:
            print("INTERRUPTED")
        except RuntimeError as e:
            print("FIRST", e)
        try:
            h.wait(5)
            print("AGAIN done")
        except RuntimeError as e:
            print("AGAIN", e)
        a.shutdown(); b.shutdown()
    """), timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "another thread" not in r.stdout, r.stdout
    assert "AGAIN the operation was cancelled" in r.stdout or "AGAIN done" in r.stdout, r.stdout
