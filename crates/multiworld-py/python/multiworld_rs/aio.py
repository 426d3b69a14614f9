"""asyncio twin of the synchronous API.

Every operation starts in the runtime at once (as with ``isend``/``irecv``
or ``async_op=True``) and is awaited through the event loop itself: when an
operation ends, the runtime writes a wake-up byte to a socket the loop
watches (one per event loop, ``loop.add_reader``), and the loop resolves the
futures of every operation that ended. No thread waits per operation, the
loop is never blocked, and Rust never calls into Python.

Cancelling a task that awaits a receive (``recv``, ``recv_into``,
``recv_any``) withdraws the receive: a message that arrives later goes to
the next receive. A receive whose message had already arrived when the
cancellation came returns it instead of raising (the cancellation lost the
race; nothing is dropped). A send or a collective that has started cannot be cut off
without breaking its world, so cancelling its task only stops the waiting;
the operation finishes in the background (its error, if any, is dropped).
An in-place collective (``all_reduce``, ``broadcast``, ``reduce``, the
output of ``all_gather_into_tensor``, ``reduce_scatter_tensor`` and
``all_to_all_single``) cancelled that way keeps working in
the caller's array until it ends: another call on that array meanwhile
raises ``ValueError`` ("in use by another call"), and the array gets the
result whenever the collective finishes.

A leader awaiting many worlds::

    async with aio.AsyncWorldManager() as m:
        worlds = [await m.join(f"w{i}", 0, 2, store) for i in ...]
        arrays = await asyncio.gather(*(w.recv(1, dtype="float32", shape=n) for w in worlds))

Differences from the synchronous API: ``send`` copies its input (the
operation outlives the call's borrow); blocking housekeeping (``join``,
``finish``, ``leave``, ``shutdown``) runs in a small thread pool.
"""

from __future__ import annotations

import asyncio
import os
import threading
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import _api, _native
from ._api import ReduceOp, Work, World, WorldInfo, WorldManager, _lendable, _seconds
from ._device import is_cuda as _is_cuda

__all__ = ["AsyncWorldManager", "AsyncWorld", "AsyncGroup"]

#: How many operations in a row one AsyncWorld completes at once (receives
#: of messages already here, sends that fit the socket's buffer) before it
#: lets the event loop run other tasks.
_BURST = 16

#: Longest a housekeeping wait holds a pool thread at once (seconds).
_WAIT_SLICE = 0.1

#: The housekeeping pool: for the calls that block by nature (join, finish,
#: leave, ...), not for operations, which are awaited through the loop's
#: notifier (see ``_api._ProcessPool`` for a forked child).
_POOL = _api._ProcessPool(32, "multiworld-aio")


class _Bridge:
    """One event loop's notifier and the futures waiting on it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._notifier = _native.Notifier()
        self._pending: Dict[int, Tuple["asyncio.Future[Any]", Work]] = {}
        self._next = 0
        loop.add_reader(self._notifier.fileno(), self._ready)

    def watch(self, work: Work, loop: asyncio.AbstractEventLoop) -> Tuple[int, "asyncio.Future[Any]"]:
        fut = loop.create_future()
        token = self._next
        self._next += 1
        self._pending[token] = (fut, work)
        work._w.notify(self._notifier, token)
        return token, fut

    def forget(self, token: int) -> None:
        entry = self._pending.pop(token, None)
        if entry is not None:
            entry[1]._w.unwatch()

    def let_go(self) -> None:
        """Forgets every watched operation, once the loop has closed: no one
        can be told their outcome any more. The operations themselves go on
        in the runtime (a send or a collective cannot be cut off); their
        futures held the closed loop, which may now be freed."""
        pending, self._pending = self._pending, {}
        for _, work in pending.values():
            work._w.unwatch()

    def _ready(self) -> None:
        for token in self._notifier.drain():
            entry = self._pending.pop(token, None)
            if entry is None:
                continue
            fut, work = entry
            if not work._w.settled():
                # A wake-up before the end (a receive the loop polls itself
                # rather than through a task): keep waiting for its token.
                self._pending[token] = entry
                continue
            # The operation has ended: wait() returns at once (at most the
            # microseconds until its task hands over the outcome). It runs
            # even when the awaiting task was cancelled meanwhile: for an
            # operation that copies its result into the caller's array,
            # wait() is what writes it there.
            try:
                result = work.wait()
            except Exception as e:  # the operation's error, for the awaiting task
                if not fut.done():
                    fut.set_exception(e)
                continue
            if not fut.done():
                fut.set_result(result)


_BRIDGES: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Bridge]" = weakref.WeakKeyDictionary()
_BRIDGES_LOCK = threading.Lock()


def _fresh_bridges_lock() -> None:
    # A forked child may inherit the lock held by a parent's thread that is
    # not in the child; the child's loops get bridges of their own anyway.
    global _BRIDGES_LOCK
    _BRIDGES_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_fresh_bridges_lock)


#: The bridge found last, and a weak reference to its loop: a leader's loop
#: finds its own without the dictionary's lookup (one loop per thread, and
#: most programs have one).
_LAST: Optional[Tuple["weakref.ref[asyncio.AbstractEventLoop]", _Bridge]] = None


def _bridge(loop: asyncio.AbstractEventLoop) -> _Bridge:
    global _LAST
    last = _LAST
    if last is not None and last[0]() is loop:
        return last[1]
    b = _BRIDGES.get(loop)
    if b is not None:
        _LAST = (weakref.ref(loop), b)
        return b
    # Loops of other threads may make their bridges meanwhile: one at a time,
    # since the sweep below walks the dictionary.
    with _BRIDGES_LOCK:
        b = _BRIDGES.get(loop)
        if b is None:
            # A loop closed with operations still watched (a send or
            # collective whose task was cancelled) is held by their futures,
            # so its weak key never goes: let go of such bridges whenever a
            # new loop starts one (each ``asyncio.run`` makes a new loop).
            for old, stale in list(_BRIDGES.items()):
                if old.is_closed():
                    _BRIDGES.pop(old, None)
                    stale.let_go()
            b = _BRIDGES[loop] = _Bridge(loop)
    _LAST = (weakref.ref(loop), b)
    return b


async def _wait(work: Optional[Work], withdraw_on_cancel: bool = False) -> Any:
    if work is None:  # a call with async_op=True always returns its handle
        raise RuntimeError("multiworld_rs: an operation started in the background returned no handle")
    loop = asyncio.get_running_loop()
    bridge = _bridge(loop)
    token, fut = bridge.watch(work, loop)
    try:
        return await fut
    except asyncio.CancelledError:
        if not withdraw_on_cancel:
            # The operation goes on (a send or a collective cannot be cut
            # off): its token stays watched, so that the loop still ends it
            # with wait(), which writes the result of a collective that
            # copies into the caller's array.
            raise
        bridge.forget(token)
        # Withdraws the receive. If the message had already been received,
        # the cancellation lost the race: deliver the message rather than
        # drop it, and take the cancellation back.
        if isinstance(work, _api._LentRecv):
            # The cancel returns once the runtime has let go of the caller's
            # array, which, for a message arriving into it, is when the
            # message has arrived (or its world broke): waited for in the
            # pool, so the loop goes on meanwhile. The array is the caller's
            # again before this coroutine ends, however often it is
            # cancelled meanwhile.
            letting_go = loop.run_in_executor(_POOL.get(), work._w.cancel)
            while True:
                try:
                    await asyncio.shield(letting_go)
                    break
                except asyncio.CancelledError:
                    if letting_go.done():
                        letting_go.result()
                        break
        else:
            work._w.cancel()
        try:
            # Returns at once: the task has ended (received) or the abort
            # ends it within microseconds (it then raises).
            result = work.wait()
        except Exception:
            raise asyncio.CancelledError from None
        task = asyncio.current_task()
        if task is not None and hasattr(task, "uncancel"):
            task.uncancel()
        return result


async def _call(fn: Any, *args: Any, **kw: Any) -> Any:
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_POOL.get(), lambda: fn(*args, **kw))


#: The thread that starts the checked device calls of each membership
#: (name, generation, rank), in call order (see
#: :meth:`AsyncWorld._start_checked`), with a weak reference to the
#: membership's world: one thread per membership of an NCCL world checking
#: its device calls, let go once its world is removed or no longer
#: referenced (:func:`_let_starters_go`).
_STARTERS: Dict[Tuple[str, int, int], Tuple["_api._ProcessPool", "weakref.ref[Any]"]] = {}
_STARTERS_LOCK = threading.Lock()


def _let_starters_go() -> None:
    """Lets the starter threads of memberships whose world was removed (left,
    shut down) or is no longer referenced go: calls already handed to one
    still run (and fail as calls on a removed world do; a queued call holds
    its world), then its thread ends. Run when an
    :class:`AsyncWorldManager` leaves a world or shuts down, and whenever a
    membership gets its starter."""
    with _STARTERS_LOCK:
        _sweep_starters()


def _sweep_starters() -> None:
    """:func:`_let_starters_go`'s work, under ``_STARTERS_LOCK``."""
    for key, (pool, ref) in list(_STARTERS.items()):
        world = ref()
        if world is None or getattr(world, "state", "ready") == "removed":
            del _STARTERS[key]
            pool.shutdown()


def _tensors_in(args: Any) -> Any:
    """The tensors among call arguments (lists of them included)."""
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from _tensors_in(a)
        else:
            yield a


def _stream_of(args: Any) -> Any:
    """Torch's current stream (on this thread) of the first CUDA tensor among
    ``args``, or ``None``: a device call started on another thread must be
    ordered behind the caller's stream, not that thread's."""
    for t in _tensors_in(args):
        if _is_cuda(t):
            import torch  # type: ignore[import-not-found, import-untyped, unused-ignore]

            return torch.cuda.current_stream(t.device)
    return None


class AsyncWorld:
    """The coroutine form of :class:`multiworld_rs.World`: the same methods,
    awaited. Collectives write their results in place, as in the
    synchronous API, and return what ``Work.wait()`` returns."""

    def __init__(self, world: World) -> None:
        self.sync = world
        """The synchronous world (same membership)."""
        self._in_a_row = 0

    def __repr__(self) -> str:
        return f"Async{self.sync!r}"

    @property
    def name(self) -> str:
        """The world's name."""
        return self.sync.name

    @property
    def rank(self) -> int:
        """This process's rank."""
        return self.sync.rank

    @property
    def size(self) -> int:
        """Number of members (of the group, for an :class:`AsyncGroup`)."""
        return self.sync.size

    @property
    def generation(self) -> int:
        """This membership's generation."""
        return self.sync.generation

    @property
    def state(self) -> str:
        """``"ready"``, ``"broken"`` or ``"removed"``."""
        return self.sync.state

    @property
    def cause(self) -> Optional[str]:
        """The break cause's kind while the world is broken, else ``None``."""
        return self.sync.cause

    # -- point to point -----------------------------------------------------
    async def send(self, tensor: Any, dst: int, tag: int = 0, *, copy: bool = True) -> None:
        """Sends ``tensor`` to ``dst``. By default a copy is sent, so a
        cancelled send leaves nothing behind that refers to the array. With
        ``copy=False`` a C-contiguous, writeable array (a numpy array, a CPU
        torch tensor) is sent from its own memory, lent to the runtime until
        the send ends: no copy, but a send cannot be withdrawn once started,
        so cancelling the ``await`` leaves it running; the array stays lent
        (calls that would write it refuse) and must not be modified until the
        message is out. Other sends may read the same array at once; an array
        a receive or in-place collective is writing raises ``ValueError``;
        other arrays (read-only, strided) are copied. A send that fits the
        socket's buffer is written in the call and returns without a round
        through the event loop (at most :data:`_BURST` in a row, then the
        loop gets a turn)."""
        await self._take_turn()
        work = None
        if not copy:
            native = self.sync._w.isend_plain(_lendable(tensor), dst, tag)
            if native is not None:
                work = Work(native)
        if work is None:
            if self._device_checked((tensor,)):
                work = await self._start_checked(self.sync.isend, tensor, dst, tag)
            else:
                work = self.sync.isend(tensor, dst, tag)
        await self._finish(work)

    async def _finish(self, work: Work, withdraw_on_cancel: bool = False) -> Any:
        """The outcome of ``work``: at once, without a round through the
        event loop, when it finished in the call that started it (a send
        that fit the socket's buffer, a receive whose message was here);
        else awaited through the loop's notifier."""
        if work.is_completed():
            # wait() returns at once (or raises).
            self._in_a_row += 1
            return work.wait()
        self._in_a_row = 0
        return await _wait(work, withdraw_on_cancel)

    async def _take_turn(self) -> None:
        """Lets the event loop run other tasks once every :data:`_BURST`
        operations in a row that ended without waiting. Called before an
        operation starts, so a cancellation here drops nothing."""
        if self._in_a_row >= _BURST:
            self._in_a_row = 0
            await asyncio.sleep(0)

    async def recv(self, src: Optional[int] = None, tag: int = 0, *, dtype: Any, shape: Any) -> np.ndarray:
        """Receives a new array from ``src`` (``None``: any member)."""
        await self._take_turn()
        return await self._finish(self.sync.irecv(None, src, tag, dtype=dtype, shape=shape, _off_loop=True), True)

    async def recv_any(self, tag: int = 0, *, dtype: Any, shape: Any) -> Tuple[int, np.ndarray]:
        """Receives from any member; returns ``(sender, array)``."""
        work = self.sync.irecv(None, None, tag, dtype=dtype, shape=shape, _off_loop=True)
        arr = await _wait(work, True)
        return work.source, arr  # type: ignore[attr-defined]

    async def recv_into(self, tensor: Any, src: Optional[int] = None, tag: int = 0) -> int:
        """Receives into ``tensor``; returns the sender's rank. A message
        already here is taken at once, without a round through the event
        loop (at most :data:`_BURST` in a row, then the loop gets a turn):
        one read ahead is copied, and one too large to read ahead (at most
        4 MiB) that waits whole in the socket is read into ``tensor`` in the
        call. A ``tensor`` larger than
        :func:`multiworld_rs.loop_copy_max` is received by a task of the
        runtime instead, so that its copy runs beside the loop."""
        # The per-message path of a leader: the turn check, the lending and
        # the native calls inline (no coroutine but this one on the way).
        if self._in_a_row >= _BURST:
            self._in_a_row = 0
            await asyncio.sleep(0)
        lent = _lendable(tensor)
        native = self.sync._w
        got = native.recv_into_now(lent, src, tag)
        if got is not None:
            self._in_a_row += 1
            return got
        posted = native.irecv_plain(lent, src, tag, True)
        if posted is not None and posted.is_completed():
            # Read from the socket in the call (a message its reader held
            # back): the runtime has let go of the array; no handle needed.
            self._in_a_row += 1
            return int(posted.wait(None))
        if posted is not None:
            work: Work = _api._LentRecv(posted, tensor)
        elif self._device_checked((tensor,)):
            # Its start waits for the sender's description of the message.
            work = await self._start_checked(self.sync.irecv, tensor, src, tag, _off_loop=True)
        else:
            work = self.sync.irecv(tensor, src, tag, _off_loop=True)
        await self._finish(work, True)
        return work.source  # type: ignore[attr-defined]

    # -- collectives (see the synchronous methods for the semantics) ---------
    async def _collective(self, start: Any, *args: Any) -> Any:
        """Starts a collective (``start(*args, async_op=True)``) and awaits
        its end (see :meth:`_start_checked` for an NCCL world that checks
        its device calls)."""
        if self._device_checked(args):
            work = await self._start_checked(start, *args, async_op=True)
        else:
            work = start(*args, async_op=True)
        return await _wait(work)

    def _device_checked(self, tensors: Any) -> bool:
        """Whether a call on ``tensors`` is a device call that this world
        checks (``check_device_calls``): its start then waits for the other
        members' descriptions."""
        if isinstance(self, AsyncGroup) or not getattr(self.sync, "checks_device_calls", False):
            return False
        return any(_is_cuda(t) for t in _tensors_in(tensors))

    async def _start_checked(self, start: Any, *args: Any, **kw: Any) -> Work:
        """Starts a checked device call: its start may wait, on the calling
        thread, for the other members (a collective for their descriptions
        of it, a receive for its sender's), so it runs on a thread of its
        world's own (one per membership, whatever wrapper calls), which
        keeps the world's device calls in the order they were called, as the
        loop's thread would; under the caller's torch stream. Cancelled
        meanwhile, the call goes on (a device call cannot be withdrawn once
        started) and is watched like a cancelled collective."""
        stream = _stream_of(args)

        def run() -> Work:
            if stream is None:
                return start(*args, **kw)
            import torch  # type: ignore[import-not-found, import-untyped, unused-ignore]

            with torch.cuda.stream(stream):
                return start(*args, **kw)

        key = (self.sync.name, self.sync.generation, self.sync.rank)
        loop = asyncio.get_running_loop()
        # Found and handed the call under the lock, so that no sweep on
        # another thread shuts the starter down in between.
        with _STARTERS_LOCK:
            entry = _STARTERS.get(key)
            if entry is None:
                _sweep_starters()
            if entry is None or entry[1]() is not self.sync:
                # The world object of the latest call: the calls queued
                # before it end first, so while it lives none is lost.
                pool = _api._ProcessPool(1, "multiworld-checked") if entry is None else entry[0]
                entry = _STARTERS[key] = (pool, weakref.ref(self.sync))
            starting = loop.run_in_executor(entry[0].get(), run)
        try:
            return await asyncio.shield(starting)
        except asyncio.CancelledError:
            def watch(f: "asyncio.Future[Any]") -> None:
                if not f.cancelled() and f.exception() is None and f.result() is not None:
                    _bridge(loop).watch(f.result(), loop)

            starting.add_done_callback(watch)
            raise

    async def broadcast(self, tensor: Any, src: int) -> Any:
        """In-place broadcast from ``src``."""
        return await self._collective(self.sync.broadcast, tensor, src)

    async def all_reduce(self, tensor: Any, op: Any = ReduceOp.SUM) -> Any:
        """In-place all-reduce."""
        return await self._collective(self.sync.all_reduce, tensor, op)

    async def reduce(self, tensor: Any, dst: int, op: Any = ReduceOp.SUM) -> Any:
        """Reduce into rank ``dst``'s ``tensor``."""
        return await self._collective(self.sync.reduce, tensor, dst, op)

    async def all_gather(self, tensor_list: List[Any], tensor: Any) -> Any:
        """All-gather into a list of arrays."""
        return await self._collective(self.sync.all_gather, tensor_list, tensor)

    async def all_gather_into_tensor(self, output_tensor: Any, input_tensor: Any) -> Any:
        """All-gather into one tensor."""
        return await self._collective(self.sync.all_gather_into_tensor, output_tensor, input_tensor)

    async def gather(self, tensor: Any, gather_list: Optional[List[Any]] = None, dst: int = 0) -> Any:
        """Gather into rank ``dst``'s ``gather_list``."""
        return await self._collective(self.sync.gather, tensor, gather_list, dst)

    async def scatter(self, tensor: Any, scatter_list: Optional[List[Any]] = None, src: int = 0) -> Any:
        """Scatter rank ``src``'s ``scatter_list``."""
        return await self._collective(self.sync.scatter, tensor, scatter_list, src)

    async def reduce_scatter(self, output: Any, input_list: List[Any], op: Any = ReduceOp.SUM) -> Any:
        """Reduce-scatter of a list."""
        return await self._collective(self.sync.reduce_scatter, output, input_list, op)

    async def reduce_scatter_tensor(self, output: Any, input: Any, op: Any = ReduceOp.SUM) -> Any:
        """Reduce-scatter of one tensor."""
        return await self._collective(self.sync.reduce_scatter_tensor, output, input, op)

    async def all_to_all(self, output_tensor_list: List[Any], input_tensor_list: List[Any]) -> Any:
        """All-to-all of lists."""
        return await self._collective(self.sync.all_to_all, output_tensor_list, input_tensor_list)

    async def all_to_all_single(self, output: Any, input: Any,
                                output_split_sizes: Optional[Sequence[int]] = None,
                                input_split_sizes: Optional[Sequence[int]] = None) -> Any:
        """All-to-all of one tensor (even or uneven splits)."""
        return await self._collective(self.sync.all_to_all_single, output, input, output_split_sizes,
                                      input_split_sizes)

    async def barrier(self) -> None:
        """Waits until every member has called it."""
        await _wait(self.sync.barrier(async_op=True))

    async def broadcast_object_list(self, object_list: List[Any], src: int = 0) -> Any:
        """Object broadcast (pickled)."""
        return await _wait(self.sync.broadcast_object_list(object_list, src, async_op=True))

    async def all_gather_object(self, object_list: List[Any], obj: Any) -> Any:
        """Object all-gather (pickled)."""
        return await _wait(self.sync.all_gather_object(object_list, obj, async_op=True))

    async def gather_object(self, obj: Any, object_gather_list: Optional[List[Any]] = None, dst: int = 0) -> Any:
        """Object gather (pickled)."""
        return await _wait(self.sync.gather_object(obj, object_gather_list, dst, async_op=True))

    async def scatter_object_list(self, scatter_object_output_list: List[Any],
                                  scatter_object_input_list: Optional[List[Any]] = None, src: int = 0) -> Any:
        """Object scatter (pickled)."""
        return await _wait(self.sync.scatter_object_list(scatter_object_output_list, scatter_object_input_list,
                                                         src, async_op=True))

    async def new_group(self, ranks: Sequence[int]) -> "AsyncGroup":
        """A sub-group (see :meth:`multiworld_rs.World.new_group`)."""
        return AsyncGroup(await _call(self.sync.new_group, ranks))

    async def shared_memory(self) -> Tuple[str, Optional[str]]:
        """See :meth:`World.shared_memory` (it waits for a collective running
        now, off the event loop)."""
        return await _call(self.sync.shared_memory)

    # -- end ----------------------------------------------------------------
    async def finish(self, timeout: float = 30.0) -> None:
        """Orderly end for every member (see :meth:`World.finish`)."""
        await _call(self.sync.finish, timeout)

    def abort(self) -> None:
        """Breaks the world now."""
        self.sync.abort()

    async def wait_removed(self, timeout: Optional[float] = None) -> bool:
        """Waits until the world is torn down (see :meth:`World.wait_removed`).

        Waits in slices of at most :data:`_WAIT_SLICE` seconds on the
        housekeeping pool, so that a cancelled wait frees its thread within
        a slice and any number of waits cannot hold the pool (``leave`` and
        ``shutdown``, which would end them, run there too)."""
        loop = asyncio.get_running_loop()
        limit = _seconds("timeout", timeout)
        deadline = None if limit is None else loop.time() + limit
        while True:
            left = _WAIT_SLICE if deadline is None else min(_WAIT_SLICE, max(0.0, deadline - loop.time()))
            if await _call(self.sync.wait_removed, left):
                return True
            if deadline is not None and loop.time() >= deadline:
                return False


class AsyncGroup(AsyncWorld):
    """The coroutine form of :class:`multiworld_rs.Group`."""

    @property
    def ranks(self) -> List[int]:
        """The group's members (world ranks)."""
        return self.sync.ranks  # type: ignore[attr-defined,no-any-return]

    @property
    def group_rank(self) -> Optional[int]:
        """This process's position in :attr:`ranks` (``None``: not a member)."""
        return self.sync.group_rank  # type: ignore[attr-defined,no-any-return]


class AsyncWorldManager:
    """The coroutine form of :class:`multiworld_rs.WorldManager`."""

    def __init__(self) -> None:
        self.sync = WorldManager()
        """The synchronous manager (same worlds)."""

    async def __aenter__(self) -> "AsyncWorldManager":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.shutdown()

    async def serve_store(self, bind: str = "127.0.0.1:0") -> str:
        """Hosts a store; returns its address."""
        return await _call(self.sync.serve_store, bind)

    async def join(self, name: str, rank: int, size: int, store: str, **options: Any) -> AsyncWorld:
        """Joins a world (same options as :meth:`WorldManager.join`)."""
        return AsyncWorld(await _call(self.sync.join, name, rank, size, store, **options))

    async def join_from_env(self, name: str = "world", **options: Any) -> AsyncWorld:
        """Joins the world the launcher describes (see :meth:`WorldManager.join_from_env`)."""
        return AsyncWorld(await _call(self.sync.join_from_env, name, **options))

    def world(self, name: str) -> Optional[AsyncWorld]:
        """The world of that name, if this process is a member."""
        w = self.sync.world(name)
        return None if w is None else AsyncWorld(w)

    def worlds(self) -> List[WorldInfo]:
        """Every world of this process."""
        return self.sync.worlds()

    async def leave(self, name: str) -> None:
        """Leaves a world at once."""
        try:
            await _call(self.sync.leave, name)
        finally:
            _let_starters_go()

    async def shutdown(self) -> None:
        """Leaves every world and stops the hosted stores."""
        try:
            await _call(self.sync.shutdown)
        finally:
            _let_starters_go()

    def events(self, timeout: Optional[float] = None) -> "_api.EventStream":
        """The manager's events, to iterate with ``async for`` (or ``for``);
        see :meth:`WorldManager.events`."""
        return self.sync.events(timeout)

    async def next_event(self, stream: "_api.EventStream", timeout: Optional[float] = None) -> Any:
        """The next event of ``stream``, or ``None`` after ``timeout`` seconds."""
        return await stream.anext(timeout)

