"""The synchronous API: WorldManager, World, Work, events (see docs/python.md)."""

from __future__ import annotations

import concurrent.futures
import enum
import os
import sys
import threading

import pickle
import time
from typing import Any, Iterator, List, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np

from . import _device as D
from . import _native
from . import _tensors as T

__all__ = ["ReduceOp", "WorldManager", "World", "Group", "Work", "Event", "EventStream", "WorldInfo"]

Event = _native.Event


def _torch_current_device() -> Optional[int]:
    """torch's current CUDA device if torch is imported and has CUDA."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return int(torch.cuda.current_device())
    return None


class ReduceOp(str, enum.Enum):
    """A reduction, as ``torch.distributed.ReduceOp``. Anywhere an op is
    taken, its name as a string (``"sum"``, ``"SUM"``, ``"prod"``...) works too."""

    SUM = "sum"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"
    AVG = "avg"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"


def _op(op: Any) -> str:
    if isinstance(op, ReduceOp):
        return op.value
    if isinstance(op, str):
        return op.lower()
    name = getattr(op, "name", None)  # e.g. torch.distributed.ReduceOp.SUM
    if isinstance(name, str):
        return name.lower()
    raise TypeError(f"op must be a ReduceOp or its name, got {op!r}")


#: Largest message (bytes) a world of this package reads off its socket
#: before the receive is posted: 256 KiB, against the Rust default of 16 KiB
#: (``multiworld::DEFAULT_READ_AHEAD``). A receive of a message read ahead
#: completes without waiting, which in Rust lets a task that computes per
#: message keep a runtime thread (and the heartbeats behind it) for up to 16
#: messages; here no Python code runs on a runtime thread, so the faster
#: stream of messages of tens of KiB costs nothing of the kind.
DEFAULT_READ_AHEAD = 256 << 10


def _u32(what: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{what} must be an int, got {value!r}")
    if not 0 <= int(value) < 2**32:
        raise ValueError(f"{what} must be in 0..2**32, got {value!r}")
    return int(value)


def _flag(what: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{what} must be True or False, got {value!r}")
    return bool(value)


def _opt_rank(what: str, value: Any) -> Optional[int]:
    return None if value is None else _u32(what, value)


def _seconds(what: str, value: Any) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a number of seconds, got {value!r}")
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"{what} must be a finite, non-negative number of seconds, got {value!r}")
    return float(value)


class WorldInfo(NamedTuple):
    """One world of a manager, as listed by :meth:`WorldManager.worlds`."""

    name: str
    generation: int
    rank: int
    size: int
    state: str
    #: The break cause's kind when ``state == "broken"``.
    cause: Optional[str]


class _ProcessPool:
    """A thread pool of this process, made on first use. A forked child
    inherits the parent's pool without its threads (an executor that
    believes it has idle workers starts none, so a call would never run):
    the child gets a pool of its own, and the calls it runs raise
    ``ForkedProcessError`` as every inherited handle does."""

    def __init__(self, workers: int, name: str) -> None:
        self._workers = workers
        self._name = name
        self._pool: "Optional[concurrent.futures.ThreadPoolExecutor]" = None
        self._pid = 0

    def get(self) -> "concurrent.futures.ThreadPoolExecutor":
        if self._pool is None or self._pid != os.getpid():
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=self._workers,
                                                               thread_name_prefix=self._name)
            self._pid = os.getpid()
        return self._pool

    def shutdown(self) -> None:
        """Lets this process's threads go once the calls handed to them have
        run (without waiting for that); a later :meth:`get` makes new ones."""
        pool, self._pool = self._pool, None
        if pool is not None and self._pid == os.getpid():
            pool.shutdown(wait=False)


#: The threads that wait for events for :meth:`EventStream.anext`.
_EVENTS_POOL = _ProcessPool(8, "multiworld-events")


class EventStream:
    """Events of a manager from the moment of subscription
    (:meth:`WorldManager.events`). Iterating (``for`` or ``async for``)
    waits for the next event and stops after ``timeout`` seconds without one
    (never, with ``None``); :meth:`next` and :meth:`anext` return ``None``
    instead of stopping. No event is lost when an ``async for`` is
    cancelled: an event that arrives meanwhile is kept for the next call."""

    #: How long one waiting slice of :meth:`anext` lasts (a cancelled
    #: ``async for`` lets its waiting thread go within this).
    _SLICE = 0.2

    def __init__(self, native: Any, timeout: Optional[float]) -> None:
        self._s = native
        self._timeout = timeout
        # The slice of waiting an ``anext`` started and its caller gave up on
        # (cancelled): the next call takes its event first, so events keep
        # their order whichever call gets them. Several calls at once (two
        # tasks, a thread and a task) may wait on it; the one that settles
        # it takes its event, the others wait again.
        self._inflight: "Optional[concurrent.futures.Future[Optional[Event]]]" = None
        self._lock_ = threading.Lock()
        self._pid = os.getpid()

    @property
    def _lock(self) -> threading.Lock:
        """The stream's lock, this process's own. A forked child starts
        afresh: it may have inherited the lock held by a parent's thread
        that is not in the child, and the slice in flight has no thread left
        to end it (the child's own calls then raise ``ForkedProcessError``,
        as every inherited handle does)."""
        pid = os.getpid()
        if self._pid != pid:
            self._lock_, self._inflight, self._pid = threading.Lock(), None, pid
        return self._lock_

    def _pending(self) -> "Optional[concurrent.futures.Future[Optional[Event]]]":
        """The slice in flight (this process's)."""
        with self._lock:
            return self._inflight

    def _settle(self, fut: "concurrent.futures.Future[Optional[Event]]") -> bool:
        """Whether this caller takes ``fut``'s event (no other did)."""
        with self._lock:
            if self._inflight is fut:
                self._inflight = None
                return True
            return False

    def next(self, timeout: Optional[float] = None) -> Optional[Event]:
        """The next event, or ``None`` after ``timeout`` seconds without one."""
        limit = _seconds("timeout", timeout)
        deadline = None if limit is None else time.monotonic() + limit
        fut = self._pending()
        if fut is not None:
            # At most one slice (0.2 s) of waiting is left in it.
            try:
                ev = fut.result(limit)
            except concurrent.futures.TimeoutError:
                return None
            if self._settle(fut) and ev is not None:
                return ev
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        return self._s.next(left)

    async def anext(self, timeout: Optional[float] = None) -> Optional[Event]:
        """The coroutine form of :meth:`next` (the event loop keeps running)."""
        import asyncio

        limit = _seconds("timeout", timeout)
        deadline = None if limit is None else time.monotonic() + limit
        while True:
            fut = self._pending()
            if fut is None:
                left = self._SLICE if deadline is None else max(0.0, min(self._SLICE, deadline - time.monotonic()))
                with self._lock:
                    if self._inflight is None:
                        self._inflight = _EVENTS_POOL.get().submit(self._s.next, left)
                    fut = self._inflight
            # A cancellation leaves `fut` in flight for the next call.
            ev = await asyncio.shield(asyncio.wrap_future(fut))
            if self._settle(fut) and ev is not None:
                return ev
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def __iter__(self) -> Iterator[Event]:
        return self

    def __next__(self) -> Event:
        ev = self.next(self._timeout)
        if ev is None:
            raise StopIteration
        return ev

    def __aiter__(self) -> "EventStream":
        return self

    async def __anext__(self) -> Event:
        ev = await self.anext(self._timeout)
        if ev is None:
            raise StopAsyncIteration
        return ev


class Work:
    """A handle on an operation running in the background (``isend``,
    ``irecv``, a collective with ``async_op=True``), like torch's ``Work``."""

    def __init__(self, native: Any, finish: Any = None) -> None:
        self._w = native
        self._finish = finish
        self._done = False
        self._result: Any = None

    def is_completed(self) -> bool:
        """Whether the operation has finished (successfully or not)."""
        return self._done or self._w.is_completed()

    def wait(self, timeout: Optional[float] = None) -> Any:
        """Waits for the operation (at most ``timeout`` seconds, raising
        :class:`~multiworld_rs.errors.WorldTimeoutError`; the operation goes
        on) and returns its result: ``None`` for a send, the received array
        for a receive, the output for a collective. Raises the operation's
        error. Can be called again; returns the same result. A handle that
        holds the caller's array (``irecv(tensor)``, an in-place collective)
        returns only once the runtime has let go of it, which ``timeout``
        does not bound (see docs/python.md, "holds the array")."""
        raw = self._w.wait(_seconds("timeout", timeout))
        if not self._done:
            self._result = self._finish(raw) if self._finish is not None else raw
            self._done = True
        return self._result


class _LentRecv(Work):
    """An ``irecv`` into a lent plain array: ``wait()`` sets ``source`` and
    returns the array (no reference cycle: nothing here refers back to the
    handle, so dropping it withdraws the receive at once)."""

    def __init__(self, native: Any, tensor: Any) -> None:
        super().__init__(native)
        self._tensor = tensor

    def wait(self, timeout: Optional[float] = None) -> Any:
        src = self._w.wait(_seconds("timeout", timeout))
        if not self._done:
            self.source = src
            # A finisher (set by the device path) gets the array, not the rank.
            self._result = self._finish(self._tensor) if self._finish is not None else self._tensor
            self._done = True
        return self._result


class _Recv(Work):
    """An ``irecv`` on the general path (a new array, or a tensor that cannot
    be lent): ``wait()`` sets ``source`` and gives the received data to the
    finisher. Nothing here refers back to the handle, so dropping it cancels
    the receive at once; a finisher closing over the handle would make a
    reference cycle, and until the cycle collector ran, the orphaned receive
    would take the next message."""

    def wait(self, timeout: Optional[float] = None) -> Any:
        raw = self._w.wait(_seconds("timeout", timeout))
        if not self._done:
            got, flat = raw
            self.source = got
            self._result = self._finish(flat) if self._finish is not None else flat
            self._done = True
        return self._result


def _lendable(tensor: Any) -> Any:
    """What the native fast paths may be lent for ``tensor``: a numpy array
    as it is; for a CPU torch tensor or a ``__dlpack__`` object, the numpy
    view of its own memory (the view holds a reference to it); anything else
    as it is (the fast path then declines and the general path takes it)."""
    if type(tensor) is np.ndarray or isinstance(tensor, np.generic):
        # A scalar as it is: it has no memory of its own to lend.
        return tensor
    try:
        return T.as_array(tensor)
    except TypeError:  # a CUDA tensor (DeviceTensor) or an unsupported type
        return tensor


def _may_overlap(out: np.ndarray, inp: np.ndarray) -> bool:
    """Whether a call that lends ``out`` for writing and ``inp`` for reading
    must copy ``inp`` first: they may share memory (the native side would
    refuse two borrows of it), or one is empty (numpy's borrow tracking
    counts an empty view inside the other array as overlapping)."""
    return out.size == 0 or inp.size == 0 or bool(np.may_share_memory(out, inp))


def _apart(out: np.ndarray, inp: np.ndarray) -> np.ndarray:
    """``inp``, or a copy of it where a call lending ``out`` for writing and
    ``inp`` for reading must not get it as it is (see :func:`_may_overlap`)."""
    return inp.copy() if _may_overlap(out, inp) else inp


try:
    from numpy.lib.array_utils import byte_bounds as _byte_bounds
except ImportError:  # numpy < 2
    _byte_bounds = np.byte_bounds  # type: ignore[attr-defined]


def _any_overlap(arrays: List[np.ndarray]) -> bool:
    """Whether any two of ``arrays`` may share memory, or one is empty (see
    :func:`_may_overlap`): a call that lends them all must not get them.
    Longer lists (a collective of many members) compare the arrays' byte
    bounds, sorted, instead of every pair: the same answer as
    ``np.may_share_memory``'s bounds check, in n log n."""
    if len(arrays) <= 8:
        return any(_may_overlap(a, b) for i, a in enumerate(arrays) for b in arrays[i + 1:])
    if any(a.size == 0 for a in arrays):
        return True
    spans = sorted(_byte_bounds(a) for a in arrays)
    return any(nxt[0] < cur[1] for cur, nxt in zip(spans, spans[1:]))


def _lent_outputs(outs: List[Tuple[np.ndarray, Any]], reads: List[np.ndarray]) -> Optional[List[Tuple[Any, ...]]]:
    """``(bytes, dtype, shape)`` of every output of ``outs`` (as
    ``T.out_spec`` gives them) for a blocking call that lends them, or
    ``None`` when one cannot be lent or they and the inputs the call reads
    (``reads``) may share memory: the call then copies."""
    raws = [r for r in (T.writable_bytes(arr) for arr, _ in outs) if r is not None]
    if len(raws) < len(outs) or _any_overlap(raws + reads):
        return None
    return [(r, s[0], list(s[1])) for r, (_, s) in zip(raws, outs)]


def _writer(arr: np.ndarray, tensor: Any) -> Any:
    """A finisher that writes a flat result into ``arr`` and returns ``tensor``."""

    def finish(flat: np.ndarray) -> Any:
        T.write(arr, flat)
        return tensor

    return finish


def _list_writer(outs: List[Tuple[np.ndarray, Any]], tensors: List[Any]) -> Any:
    """A finisher that writes flat results into each of ``outs`` and returns ``tensors``."""

    def finish(flats: List[np.ndarray]) -> Any:
        for (arr, _), flat in zip(outs, flats):
            T.write(arr, flat)
        return tensors

    return finish


class World:
    """One membership of a world: its point-to-point operations and
    collectives. Made by :meth:`WorldManager.join`.

    Tensors are numpy arrays (CPU torch tensors and ``__dlpack__`` objects are
    accepted through numpy, see :mod:`multiworld_rs` docs). Torch CUDA tensors
    are accepted too: through NCCL in an NCCL world, staged through host
    memory otherwise (see docs/python.md, "Device tensors"). Collectives follow
    ``torch.distributed``: same argument order, results written in place into
    the caller's arrays. Every member must call the same collectives in the
    same order. Every blocking call releases the GIL and can be interrupted
    with Ctrl-C."""

    __slots__ = ("_w", "_nccl", "__weakref__")

    def __init__(self, native: Any) -> None:
        self._w = native
        #: The native NCCL side: None (not looked up yet), False (none).
        self._nccl: Any = None

    def _device(self, name: str, args: dict) -> Any:
        """The device path of a method given a torch CUDA tensor: NCCL on an
        NCCL world, host staging otherwise (see ``_device.py``)."""
        return D.run(self, name, args)

    def __repr__(self) -> str:
        return repr(self._w)

    # -- identity -------------------------------------------------------
    @property
    def name(self) -> str:
        """The world's name."""
        return self._w.name

    @property
    def rank(self) -> int:
        """This process's rank."""
        return self._w.rank

    @property
    def size(self) -> int:
        """Number of members."""
        return self._w.size

    @property
    def generation(self) -> int:
        """This membership's generation (a world is ``(name, generation)``)."""
        return self._w.generation

    @property
    def checks_device_calls(self) -> bool:
        """Whether its device calls are first checked against the other
        members, waiting on the calling thread (a collective for every
        member's description of it, a receive for its sender's description
        of the message), and raise
        :class:`~multiworld_rs.errors.MismatchError` if they differ
        (``join(..., check_device_calls=True)`` on an NCCL world)."""
        return bool(self._w.checks_device_calls)

    @property
    def store_addr(self) -> str:
        """The address of the world's store."""
        return self._w.store_addr

    @property
    def state(self) -> str:
        """``"joining"``, ``"ready"``, ``"broken"`` or ``"removed"``."""
        return self._w.state()[0]

    @property
    def cause(self) -> Optional[str]:
        """The break cause's kind while the world is broken, else ``None``."""
        return self._w.state()[1]

    def shared_memory(self) -> Tuple[str, Optional[str]]:
        """Whether this world's collectives move their data through memory
        shared by its members on one host: ``("untried", None)`` until the
        first call that would use it, then ``("active", None)``, or
        ``("unavailable", reason)`` (members on other hosts, or shared
        memory turned off), the same on every member. Waits for a
        collective running now to end."""
        return self._w.shared_memory()

    # -- point to point -----------------------------------------------------
    def send(self, tensor: Any, dst: int, tag: int = 0) -> None:
        """Sends ``tensor`` to rank ``dst`` on ``tag``. Blocks until the data
        is handed to the connection. A C-contiguous array is sent from its
        own memory (no copy; do not modify it from another thread meanwhile);
        any other array is copied first."""
        if self._w.send_plain(tensor, dst, tag):  # a plain numpy array, all checked natively
            return None
        try:
            flat, dtype, _ = T.send_view(tensor)
            self._w.send(flat, dtype, _u32("dst", dst), _u32("tag", tag))
        except T.DeviceTensor:
            return self._device("send", {"tensor": tensor, "dst": dst, "tag": tag})

    def recv(self, src: Optional[int] = None, tag: int = 0, *, dtype: Any, shape: Any) -> np.ndarray:
        """Receives a message of ``dtype`` and ``shape`` from ``src`` (``None``:
        any member) and returns it as a new array that owns the runtime's
        buffer (no copy). A message of another dtype or size raises
        :class:`~multiworld_rs.errors.MismatchError`."""
        d, shp = T.np_dtype(dtype), T.dims(shape)
        _, flat = self._w.recv(_opt_rank("src", src), _u32("tag", tag), d.name, list(shp))
        return T.from_flat(flat, d, shp)

    def recv_any(self, tag: int = 0, *, dtype: Any, shape: Any) -> Tuple[int, np.ndarray]:
        """Receives from any member; returns ``(sender rank, array)``."""
        d, shp = T.np_dtype(dtype), T.dims(shape)
        src, flat = self._w.recv(None, _u32("tag", tag), d.name, list(shp))
        return src, T.from_flat(flat, d, shp)

    def recv_into(self, tensor: Any, src: Optional[int] = None, tag: int = 0) -> int:
        """Receives into the caller's array (its dtype and size must match the
        message's, else :class:`~multiworld_rs.errors.MismatchError` naming
        both, and the array is untouched); returns the sender's rank. A
        C-contiguous writeable array is written in place, with no copy; if the
        receive fails otherwise (the world broke, a timeout, Ctrl-C), the
        array may hold part of the message."""
        got = self._w.recv_into_plain(tensor, src, tag)  # a plain numpy array, lent natively
        if got is not None:
            return got
        try:
            arr, (dtype, shp) = T.out_spec(tensor, "tensor")
            raw = T.writable_bytes(arr)
            if raw is not None:  # straight into the array's memory, lent for the call
                return self._w.recv_into(raw, dtype, list(shp), _opt_rank("src", src), _u32("tag", tag))
            got, flat = self._w.recv(_opt_rank("src", src), _u32("tag", tag), dtype, list(shp))
            T.write(arr, flat)
            return got
        except T.DeviceTensor:
            return self._device("recv_into", {"tensor": tensor, "src": src, "tag": tag})

    def isend(self, tensor: Any, dst: int, tag: int = 0) -> Work:
        """Starts sending a copy of ``tensor`` (the caller may reuse its array
        at once); ``wait()`` returns ``None``. Dropping the handle does not
        cancel the send."""
        try:
            flat, dtype, shp = T.send_view(tensor)
            return Work(self._w.isend((flat, dtype, list(shp)), _u32("dst", dst), _u32("tag", tag)))
        except T.DeviceTensor:
            return self._device("isend", {"tensor": tensor, "dst": dst, "tag": tag})

    def irecv(self, tensor: Any = None, src: Optional[int] = None, tag: int = 0, *,
              dtype: Any = None, shape: Any = None, _off_loop: bool = False) -> Work:
        """Starts a receive from ``src`` (``None``: any member). With
        ``tensor``, ``wait()`` fills it and returns it; otherwise give
        ``dtype`` and ``shape`` and ``wait()`` returns a new array. The
        sender's rank is ``work.source`` after ``wait()``. Dropping the handle
        before completion cancels the receive. A plain numpy ``tensor``
        (C-contiguous, writeable) is written by the runtime itself, no copy:
        do not use it until ``wait()`` returns (after a failure too: it
        returns once the runtime has let go of the array)."""
        # ``_off_loop`` (the asyncio API's receives): a message larger than
        # ``loop_copy_max()`` is received by a task of the runtime, not in
        # this call.
        if tensor is not None:
            # A plain numpy array, lent natively; a CPU torch tensor (or a
            # __dlpack__ object) through its numpy view of the same memory.
            native = self._w.irecv_plain(_lendable(tensor), src, tag, _off_loop)
            if native is not None:
                return _LentRecv(native, tensor)
        try:
            if tensor is not None:
                arr, (dname, shp) = T.out_spec(tensor, "tensor")
                d = arr.dtype
            else:
                if dtype is None or shape is None:
                    raise TypeError("irecv needs either tensor or both dtype and shape")
                arr, d, shp = None, T.np_dtype(dtype), T.dims(shape)
                dname = d.name
            native = self._w.irecv(_opt_rank("src", src), _u32("tag", tag), (dname, list(shp)), _off_loop)

            def finish(flat: Any) -> np.ndarray:
                if arr is not None:
                    T.write(arr, flat)
                    return tensor
                return T.from_flat(flat, d, shp)

            return _Recv(native, finish)
        except T.DeviceTensor:
            return self._device("irecv", {
                "tensor": tensor, "src": src, "tag": tag, "dtype": dtype, "shape": shape})

    # -- collectives --------------------------------------------------------
    # Each takes ``async_op``: False runs the call and writes its result in
    # place; True starts it and returns a :class:`Work`, after whose
    # ``wait()`` the outputs hold the result. In-place collectives, and the
    # outputs of the *_tensor / *_single forms, work in the caller's array
    # until then (do not touch it before); other inputs are copied at the
    # start, so the caller may reuse those at once.
    def _run(self, name: str, args: Tuple[Any, ...], finish: Any, async_op: bool) -> Optional[Work]:
        if async_op:
            return Work(getattr(self._w, name + "_async")(*args), finish)
        finish(getattr(self._w, name)(*args))
        return None

    def _lent(self, name: str, tensor: Any, *args: Any) -> Optional[Work]:
        """An in-place collective with ``async_op=True`` on ``tensor``'s own
        memory (a plain numpy array, or a CPU torch tensor through its numpy
        view), lent to the runtime until it ends: no copy in or out. ``None``
        when the memory cannot be lent; the caller then copies."""
        if isinstance(tensor, np.generic):  # a scalar: no memory of its own to write
            return None
        native = getattr(self._w, name + "_lent")(_lendable(tensor), *args)
        return None if native is None else Work(native, lambda _: tensor)

    @staticmethod
    def _lent_list(tensors: List[Any], start: Any) -> Optional[Work]:
        """A collective with ``async_op=True`` whose outputs, ``tensors``,
        are written in their own memory (plain numpy arrays or CPU torch
        tensors through their numpy views, sharing no memory), lent to the
        runtime until it ends: ``start(arrays)`` calls the native
        ``*_lent``. ``None`` when they cannot all be lent; the caller then
        copies."""
        arrays = [_lendable(t) for t in tensors]
        if not arrays or any(type(a) is not np.ndarray for a in arrays) or _any_overlap(arrays):
            return None
        native = start(arrays)
        return None if native is None else Work(native, lambda _: tensors)

    def broadcast(self, tensor: Any, src: int, async_op: bool = False) -> Optional[Work]:
        """Copies rank ``src``'s ``tensor`` into every member's ``tensor``."""
        if async_op:
            work = self._lent("broadcast", tensor, _u32("src", src))
            if work is not None:
                return work
        elif self._w.broadcast_plain(tensor, src):  # a plain numpy array, lent natively
            return None
        try:
            arr, (dtype, shp) = T.out_spec(tensor)
            raw = None if async_op else T.writable_bytes(arr)
            if raw is not None:  # in place, the array's memory lent for the call
                self._w.broadcast_into(raw, dtype, list(shp), _u32("src", src))
                return None
            return self._run("broadcast", (T.send_view(arr), _u32("src", src)),
                             _writer(arr, tensor), async_op)
        except T.DeviceTensor:
            return self._device("broadcast", {"tensor": tensor, "src": src, "async_op": async_op})

    def all_reduce(self, tensor: Any, op: Any = ReduceOp.SUM, async_op: bool = False) -> Optional[Work]:
        """Reduces ``tensor`` over every member with ``op``; every member gets
        the result in ``tensor``."""
        if async_op:
            work = self._lent("all_reduce", tensor, _op(op))
            if work is not None:
                return work
        elif self._w.all_reduce_plain(tensor, _op(op)):  # a plain numpy array, lent natively
            return None
        try:
            arr, (dtype, shp) = T.out_spec(tensor)
            raw = None if async_op else T.writable_bytes(arr)
            if raw is not None:  # in place, the array's memory lent for the call
                self._w.all_reduce_into(raw, dtype, list(shp), _op(op))
                return None
            return self._run("all_reduce", (T.send_view(arr), _op(op)), _writer(arr, tensor), async_op)
        except T.DeviceTensor:
            return self._device("all_reduce", {"tensor": tensor, "op": op, "async_op": async_op})

    def reduce(self, tensor: Any, dst: int, op: Any = ReduceOp.SUM, async_op: bool = False) -> Optional[Work]:
        """Reduces ``tensor`` over every member with ``op`` into rank
        ``dst``'s ``tensor`` (the others' are left as they were)."""
        if async_op:
            work = self._lent("reduce", tensor, _u32("dst", dst), _op(op))
            if work is not None:
                return work
        elif self._w.reduce_plain(tensor, dst, _op(op)):  # a plain numpy array, lent natively
            return None
        try:
            arr, (dtype, shp) = T.out_spec(tensor)
            dst = _u32("dst", dst)
            raw = None if async_op else T.writable_bytes(arr)
            if raw is not None:  # in place, the array's memory lent for the call
                self._w.reduce_into(raw, dtype, list(shp), dst, _op(op))
                return None
            mine = self.rank == dst

            def finish(flat: np.ndarray) -> Any:
                if mine:
                    T.write(arr, flat)
                return tensor

            return self._run("reduce", (T.send_view(arr), dst, _op(op)), finish, async_op)
        except T.DeviceTensor:
            return self._device("reduce", {
                "tensor": tensor, "dst": dst, "op": op, "async_op": async_op})

    def all_gather(self, tensor_list: List[Any], tensor: Any, async_op: bool = False) -> Optional[Work]:
        """Gathers every member's ``tensor`` into ``tensor_list`` (one array
        per member, in rank order; sizes may differ by member)."""
        try:
            outs = [T.out_spec(t, f"tensor_list[{i}]") for i, t in enumerate(tensor_list)]
            view = T.send_view(tensor)
            if async_op:
                work = self._lent_list(tensor_list, lambda arrays: self._w.all_gather_lent(arrays, view))
                if work is not None:
                    return work
            lent = _lent_outputs(outs, [view[0]]) if outs and not async_op else None
            if lent is not None:  # written in place, every array lent for the call
                self._w.all_gather_into_list(lent, view)
                return None
            return self._run("all_gather", ([s for _, s in outs], view), _list_writer(outs, tensor_list), async_op)
        except T.DeviceTensor:
            return self._device("all_gather", {
                "tensor_list": tensor_list, "tensor": tensor, "async_op": async_op})

    def all_gather_into_tensor(self, output_tensor: Any, input_tensor: Any,
                               async_op: bool = False) -> Optional[Work]:
        """Gathers every member's ``input_tensor`` into ``output_tensor``
        (``size`` times as many elements), concatenated in rank order."""
        if not async_op and self._w.all_gather_into_tensor_plain(output_tensor, input_tensor):
            return None  # plain numpy arrays, lent natively
        try:
            view = T.send_view(input_tensor, "input_tensor")
            if async_op:
                work = self._lent("all_gather_into_tensor", output_tensor, view)
                if work is not None:
                    return work
            arr, spec = T.out_spec(output_tensor, "output_tensor")
            raw = None if async_op else T.writable_bytes(arr)
            if raw is not None:  # written in place, the array's memory lent for the call
                view = (_apart(raw, view[0]), view[1], view[2])  # e.g. the input is a part of the output
                self._w.all_gather_into_tensor_into(raw, spec[0], list(spec[1]), view)
                return None
            return self._run("all_gather_into_tensor", (spec, view), _writer(arr, output_tensor), async_op)
        except T.DeviceTensor:
            return self._device("all_gather_into_tensor", {
                "output_tensor": output_tensor, "input_tensor": input_tensor, "async_op": async_op})

    def gather(self, tensor: Any, gather_list: Optional[List[Any]] = None, dst: int = 0,
               async_op: bool = False) -> Optional[Work]:
        """Gathers every member's ``tensor`` into rank ``dst``'s
        ``gather_list`` (required there, ignored elsewhere)."""
        try:
            dst = _u32("dst", dst)
            outs = None
            if self.rank == dst:
                if gather_list is None:
                    raise ValueError("gather: gather_list is required on the destination rank")
                outs = [T.out_spec(t, f"gather_list[{i}]") for i, t in enumerate(gather_list)]

            def finish(flats: Optional[List[np.ndarray]]) -> Any:
                if outs is not None and flats is not None:
                    for (arr, _), flat in zip(outs, flats):
                        T.write(arr, flat)
                return gather_list

            view = T.send_view(tensor)
            if async_op and outs is not None and gather_list is not None:
                work = self._lent_list(gather_list, lambda arrays: self._w.gather_lent(view, arrays, dst))
                if work is not None:
                    return work
            if not async_op:
                lent = None if outs is None else _lent_outputs(outs, [view[0]])
                if outs is None or lent is not None:  # every array lent for the call
                    self._w.gather_into_list(view, lent, dst)
                    return None
            return self._run("gather", (view, None if outs is None else [s for _, s in outs], dst),
                             finish, async_op)
        except T.DeviceTensor:
            return self._device("gather", {
                "tensor": tensor, "gather_list": gather_list, "dst": dst, "async_op": async_op})

    def scatter(self, tensor: Any, scatter_list: Optional[List[Any]] = None, src: int = 0,
                async_op: bool = False) -> Optional[Work]:
        """Sends ``scatter_list[i]`` of rank ``src`` into rank i's ``tensor``
        (``scatter_list`` required on ``src``, ignored elsewhere)."""
        try:
            src = _u32("src", src)
            arr, spec = T.out_spec(tensor)
            ins = None
            if self.rank == src:
                if scatter_list is None:
                    raise ValueError("scatter: scatter_list is required on the source rank")
                ins = [T.send_view(t, f"scatter_list[{i}]") for i, t in enumerate(scatter_list)]
            if async_op:
                work = self._lent("scatter", tensor, ins, src)
                if work is not None:
                    return work
            raw = None if async_op else T.writable_bytes(arr)
            if raw is not None and not _any_overlap([raw] + [v[0] for v in ins or []]):
                # Written in place, every array lent for the call.
                self._w.scatter_into(raw, spec[0], list(spec[1]), ins, src)
                return None
            return self._run("scatter", (spec, ins, src), _writer(arr, tensor), async_op)
        except T.DeviceTensor:
            return self._device("scatter", {
                "tensor": tensor, "scatter_list": scatter_list, "src": src, "async_op": async_op})

    def reduce_scatter(self, output: Any, input_list: List[Any], op: Any = ReduceOp.SUM,
                       async_op: bool = False) -> Optional[Work]:
        """Reduces ``input_list[i]`` over every member into rank i's ``output``."""
        try:
            arr, spec = T.out_spec(output, "output")
            ins = [T.send_view(t, f"input_list[{i}]") for i, t in enumerate(input_list)]
            if async_op:
                work = self._lent("reduce_scatter", output, ins, _op(op))
                if work is not None:
                    return work
            raw = None if async_op else T.writable_bytes(arr)
            if raw is not None and not _any_overlap([raw] + [v[0] for v in ins]):
                # Written in place, every array lent for the call.
                self._w.reduce_scatter_into(raw, spec[0], list(spec[1]), ins, _op(op))
                return None
            return self._run("reduce_scatter", (spec, ins, _op(op)), _writer(arr, output), async_op)
        except T.DeviceTensor:
            return self._device("reduce_scatter", {
                "output": output, "input_list": input_list, "op": op, "async_op": async_op})

    def reduce_scatter_tensor(self, output: Any, input: Any, op: Any = ReduceOp.SUM,
                              async_op: bool = False) -> Optional[Work]:
        """Reduces ``input`` (``size`` segments) over every member; rank i gets
        segment i in ``output``."""
        if not async_op and self._w.reduce_scatter_tensor_plain(output, input, _op(op)):
            return None  # plain numpy arrays, lent natively
        try:
            arr, spec = T.out_spec(output, "output")
            view = T.send_view(input, "input")
            if async_op:
                work = self._lent("reduce_scatter_tensor", output, view, _op(op))
                if work is not None:
                    return work
            raw = None if async_op else T.writable_bytes(arr)
            if raw is not None:  # written in place, both arrays lent for the call
                view = (_apart(raw, view[0]), view[1], view[2])
                self._w.reduce_scatter_tensor_into(raw, spec[0], list(spec[1]), view, _op(op))
                return None
            return self._run("reduce_scatter_tensor", (spec, view, _op(op)), _writer(arr, output), async_op)
        except T.DeviceTensor:
            return self._device("reduce_scatter_tensor", {
                "output": output, "input": input, "op": op, "async_op": async_op})

    def all_to_all(self, output_tensor_list: List[Any], input_tensor_list: List[Any],
                   async_op: bool = False) -> Optional[Work]:
        """Sends ``input_tensor_list[i]`` to rank i, which receives it in its
        ``output_tensor_list[me]``."""
        try:
            outs = [T.out_spec(t, f"output_tensor_list[{i}]") for i, t in enumerate(output_tensor_list)]
            ins = [T.send_view(t, f"input_tensor_list[{i}]") for i, t in enumerate(input_tensor_list)]
            if async_op:
                work = self._lent_list(output_tensor_list, lambda arrays: self._w.all_to_all_lent(arrays, ins))
                if work is not None:
                    return work
            lent = _lent_outputs(outs, [v[0] for v in ins]) if outs and not async_op else None
            if lent is not None:  # written in place, every array lent for the call
                self._w.all_to_all_into_list(lent, ins)
                return None
            return self._run("all_to_all", ([s for _, s in outs], ins),
                             _list_writer(outs, output_tensor_list), async_op)
        except T.DeviceTensor:
            return self._device("all_to_all", {
                "output_tensor_list": output_tensor_list, "input_tensor_list": input_tensor_list,
                "async_op": async_op})

    def all_to_all_single(self, output: Any, input: Any,
                          output_split_sizes: Optional[Sequence[int]] = None,
                          input_split_sizes: Optional[Sequence[int]] = None,
                          async_op: bool = False) -> Optional[Work]:
        """All-to-all of one tensor split along its first dimension: rank i
        gets ``input_split_sizes[i]`` rows (even splits when ``None``), and
        ``output`` receives ``output_split_sizes[j]`` rows from rank j. An
        empty list means even splits, as in torch."""
        # torch passes no splits as empty lists.
        if output_split_sizes is not None and len(output_split_sizes) == 0:
            output_split_sizes = None
        if input_split_sizes is not None and len(input_split_sizes) == 0:
            input_split_sizes = None
        if not async_op and self._w.all_to_all_single_plain(output, input, output_split_sizes,
                                                            input_split_sizes):
            return None  # plain numpy arrays, lent natively
        try:
            arr, spec = T.out_spec(output, "output")
            flat_in, dname, in_shape = T.send_view(input, "input")

            def elements(splits: Optional[Sequence[int]], shape: Tuple[int, ...], what: str) -> Optional[List[int]]:
                if splits is None:
                    return None
                row = int(np.prod(shape[1:])) if len(shape) > 1 else 1
                return [_u32(what, s) * row for s in splits]

            out_splits = elements(output_split_sizes, arr.shape, "output_split_sizes")
            in_splits = elements(input_split_sizes, in_shape, "input_split_sizes")
            if async_op:
                work = self._lent("all_to_all_single", output, (flat_in, dname, list(in_shape)),
                                  (out_splits, in_splits))
                if work is not None:
                    return work
            raw = None if async_op else T.writable_bytes(arr)
            if raw is not None:  # written in place, both arrays lent for the call
                flat_in = _apart(raw, flat_in)
                self._w.all_to_all_single_into(raw, spec[0], list(spec[1]), (flat_in, dname, list(in_shape)),
                                               (out_splits, in_splits))
                return None
            args = (spec, (flat_in, dname, list(in_shape)), out_splits, in_splits)
            return self._run("all_to_all_single", args, _writer(arr, output), async_op)
        except T.DeviceTensor:
            return self._device("all_to_all_single", {
                "output": output, "input": input, "output_split_sizes": output_split_sizes,
                "input_split_sizes": input_split_sizes, "async_op": async_op})

    def barrier(self, async_op: bool = False) -> Optional[Work]:
        """Waits until every member has called it."""
        return self._run("barrier", (), lambda _: None, async_op)

    # -- object collectives (pickled) -----------------------------------------
    # ``async_op`` is an extension of torch's signatures (the asyncio API
    # uses it); the lists are filled by ``wait()``.
    def broadcast_object_list(self, object_list: List[Any], src: int = 0,
                              async_op: bool = False) -> Optional[Work]:
        """Replaces every other member's ``object_list`` items with rank
        ``src``'s (pickled; the lists must be as long everywhere), like torch:
        ``src``'s own list and objects are left as they are. A list of
        another length raises ``ValueError`` once the call has ended (every
        member took part), and is left as it was."""
        src = _u32("src", src)
        data = pickle.dumps(list(object_list)) if self.rank == src else None
        mine = self.rank == src

        def finish(raw: bytes) -> Any:
            if mine:
                return object_list
            got = pickle.loads(raw)
            if len(got) != len(object_list):
                raise ValueError(f"broadcast_object_list: rank {src} sent {len(got)} objects, "
                                 f"this rank's object_list holds {len(object_list)}")
            object_list[:] = got
            return object_list

        return self._run("broadcast_object", (data, src), finish, async_op)

    def all_gather_object(self, object_list: List[Any], obj: Any, async_op: bool = False) -> Optional[Work]:
        """Fills ``object_list`` (one slot per member) with every member's ``obj``."""

        def finish(raw: List[bytes]) -> Any:
            object_list[:] = [pickle.loads(b) for b in raw]
            return object_list

        return self._run("all_gather_object", (pickle.dumps(obj),), finish, async_op)

    def gather_object(self, obj: Any, object_gather_list: Optional[List[Any]] = None, dst: int = 0,
                      async_op: bool = False) -> Optional[Work]:
        """Fills rank ``dst``'s ``object_gather_list`` with every member's ``obj``
        (required there, ignored elsewhere, as ``gather``'s ``gather_list``)."""
        if self.rank == _u32("dst", dst) and object_gather_list is None:
            raise ValueError("gather_object: object_gather_list is required on the destination rank")

        def finish(raw: Optional[List[bytes]]) -> Any:
            if raw is not None and object_gather_list is not None:
                object_gather_list[:] = [pickle.loads(b) for b in raw]
            return object_gather_list

        return self._run("gather_object", (pickle.dumps(obj), _u32("dst", dst)), finish, async_op)

    def scatter_object_list(self, scatter_object_output_list: List[Any],
                            scatter_object_input_list: Optional[List[Any]] = None, src: int = 0,
                            async_op: bool = False) -> Optional[Work]:
        """Puts rank ``src``'s ``scatter_object_input_list[i]`` into rank i's
        ``scatter_object_output_list[0]``."""
        src = _u32("src", src)
        data = None
        if self.rank == src:
            if scatter_object_input_list is None:
                raise ValueError("scatter_object_list: the input list is required on the source rank")
            data = [pickle.dumps(o) for o in scatter_object_input_list]

        def finish(raw: bytes) -> Any:
            got = pickle.loads(raw)
            if scatter_object_output_list:
                scatter_object_output_list[0] = got
            else:
                scatter_object_output_list.append(got)
            return scatter_object_output_list

        return self._run("scatter_object", (data, src), finish, async_op)

    # -- sub-groups -----------------------------------------------------------
    def new_group(self, ranks: Sequence[int]) -> "Group":
        """Creates a sub-group of the world ranks ``ranks``, like torch's
        ``new_group``: **every member of this world (or group) calls it**, in
        the same order as its other collectives, members of the new group or
        not, with the same list. Returns a :class:`Group`: the same membership
        whose collectives run among ``ranks`` only (roots are world ranks;
        lists are indexed by position in ``group.ranks``). On a rank outside
        ``ranks`` every collective of the group raises
        :class:`~multiworld_rs.errors.InvalidArgumentError`."""
        if isinstance(ranks, (str, bytes)) or not hasattr(ranks, "__iter__"):
            raise TypeError(f"new_group: ranks must be a sequence of ranks, got {ranks!r}")
        return Group(self._w.new_group([_u32("ranks[]", r) for r in ranks]))

    # -- end ----------------------------------------------------------------
    def finish(self, timeout: float = 30.0) -> None:
        """Ends the world for every member (each must call it): exchanges a
        goodbye with every member, then leaves. Raises WorldTimeoutError if
        not every member finished within ``timeout`` seconds (the world is
        left anyway)."""
        self._w.finish(_seconds("timeout", timeout))

    def abort(self) -> None:
        """Breaks the world now (cause ``"aborted"``): pending and future
        operations fail, peers are told, the world is torn down."""
        self._w.abort()

    def wait_removed(self, timeout: Optional[float] = None) -> bool:
        """Waits until the world is torn down (after a break, a leave or a
        finish); returns False if it was not within ``timeout`` seconds."""
        return self._w.wait_removed(_seconds("timeout", timeout))


class Group(World):
    """A sub-group of a world, made by :meth:`World.new_group`: the same
    membership (point-to-point operations, ``rank``, ``generation`` and the
    world's fault domain are the world's) whose collectives run among
    :attr:`ranks` only. Roots (``src``/``dst``) are world ranks; lists
    (``all_gather``'s outputs, ``scatter``'s inputs, ...) hold one entry per
    group member, in the order of :attr:`ranks`. Sub-groups of a group are
    made with its own :meth:`new_group`."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"Group(world={self.name!r}, ranks={self.ranks}, rank={self.rank})"

    @property
    def ranks(self) -> List[int]:
        """The group's members (world ranks, ascending)."""
        return list(self._w.group_ranks)

    @property
    def size(self) -> int:
        """Number of group members."""
        return len(self._w.group_ranks)

    @property
    def group_rank(self) -> Optional[int]:
        """This process's position in :attr:`ranks` (``None``: not a member)."""
        return self._w.group_rank

    @property
    def is_member(self) -> bool:
        """Whether this process is a member of the group."""
        return self._w.group_rank is not None


class WorldManager:
    """Owns every world of this process. Each world is its own fault domain:
    a member of one dying, freezing or being cut off breaks that world only.

    Use as a context manager (``with WorldManager() as m:``) or call
    :meth:`shutdown`. Create it in the process that uses it: a forked child
    cannot use its parent's runtime (use the ``spawn`` start method)."""

    def __init__(self) -> None:
        self._m = _native.Manager()

    def __enter__(self) -> "WorldManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def serve_store(self, bind: str = "127.0.0.1:0") -> str:
        """Hosts a store at ``bind`` (port 0: any free port) and returns the
        ``host:port`` it listens on. Worlds joined with that address and
        ``host_store`` (rank 0 by default) are hosted there."""
        if not isinstance(bind, str):
            raise TypeError(f"bind must be a 'host:port' string, got {bind!r}")
        return self._m.serve_store(bind)

    @staticmethod
    def _options(secret: Union[str, bytes, None], timeout: float, op_timeout: Optional[float],
                 backend: Optional[str], host_store: Optional[bool], heartbeat_interval: Optional[float],
                 heartbeat_timeout: Optional[float], device: Any = None,
                 read_ahead: Optional[int] = None, check_device_calls: bool = False) -> dict:
        if isinstance(secret, str):
            secret = secret.encode()
        if secret is not None and not isinstance(secret, (bytes, bytearray)):
            raise TypeError(f"secret must be str or bytes, got {type(secret).__name__}")
        if backend is not None and not isinstance(backend, str):
            raise TypeError(f"backend must be a string, got {backend!r}")
        effective = backend if backend is not None else os.environ.get("MULTIWORLD_BACKEND", "")
        if effective.strip().lower() == "nccl" and not D.NCCL_BUILT:
            from .errors import ConfigError

            raise ConfigError("backend 'nccl' needs a multiworld_rs built with the nccl feature "
                              "(maturin build --release --features nccl); this build has none "
                              "(multiworld_rs.NCCL_BUILT is False)")
        index = D.device_index(device)
        return {
            "device": None if index is None else _u32("device", index),
            "secret": None if secret is None else bytes(secret),
            "timeout": _seconds("timeout", timeout),
            "op_timeout": _seconds("op_timeout", op_timeout),
            "backend": backend,
            "host_store": host_store,
            "heartbeat_interval": _seconds("heartbeat_interval", heartbeat_interval),
            "heartbeat_timeout": _seconds("heartbeat_timeout", heartbeat_timeout),
            "read_ahead": _u32("read_ahead", DEFAULT_READ_AHEAD if read_ahead is None else read_ahead),
            "check_device_calls": _flag("check_device_calls", check_device_calls),
        }

    def join(self, name: str, rank: int, size: int, store: str, *,
             secret: Union[str, bytes, None] = None, timeout: float = 30.0,
             op_timeout: Optional[float] = None, backend: str = "tcp",
             host_store: Optional[bool] = None, heartbeat_interval: Optional[float] = None,
             heartbeat_timeout: Optional[float] = None, device: Any = None,
             read_ahead: Optional[int] = None, check_device_calls: bool = False) -> World:
        """Joins world ``name`` as ``rank`` of ``size`` through the store at
        ``store`` (``host:port``; rank 0 hosts it unless ``host_store`` says
        otherwise). Blocks until every member has joined (at most ``timeout``
        seconds, then :class:`~multiworld_rs.errors.JoinTimeoutError`, a
        :class:`~multiworld_rs.errors.JoinError` and a ``TimeoutError``).

        ``secret``: the world's shared secret (every member must give the
        same). ``op_timeout``: deadline of every operation; one still pending
        then breaks the world (cause ``"op_deadline"``). ``heartbeat_interval``
        / ``heartbeat_timeout`` (seconds; defaults 0.2 / 1.0): how fast a
        frozen member is detected (cause ``"heartbeat_timeout"``).
        ``read_ahead``: largest message (bytes) read off the socket before
        its receive is posted (default :data:`DEFAULT_READ_AHEAD`, 256 KiB;
        larger ones land in the receive's array without a copy; above 1 MiB
        it acts as 1 MiB).
        ``device``: an NCCL world's CUDA device (an int, ``"cuda:N"`` or a
        ``torch.device``); by default torch's current device when torch is
        imported and has CUDA, else device 0.
        ``check_device_calls``: an NCCL world checks each device call
        against the other members over TCP before it reaches NCCL (every
        member's description of a collective; a message against its
        receive), so that a disagreement (dtype, size, root, op) raises
        :class:`~multiworld_rs.errors.MismatchError` instead of hanging or
        computing garbage; a small exchange per call, so off by default.
        Every member must pass the same setting."""
        if not isinstance(name, str):
            raise TypeError(f"name must be a string, got {name!r}")
        if not isinstance(store, str):
            raise TypeError(f"store must be a 'host:port' string, got {store!r}")
        if device is None and str(backend).strip().lower() == "nccl":
            device = _torch_current_device()
        opts = self._options(secret, timeout, op_timeout, backend, host_store,
                             heartbeat_interval, heartbeat_timeout, device, read_ahead, check_device_calls)
        return World(self._m.join(name, _u32("rank", rank), _u32("size", size), store, opts))

    def join_from_env(self, name: str = "world", *, secret: Union[str, bytes, None] = None,
                      timeout: float = 30.0, op_timeout: Optional[float] = None,
                      backend: Optional[str] = None, host_store: Optional[bool] = None,
                      heartbeat_interval: Optional[float] = None,
                      heartbeat_timeout: Optional[float] = None, device: Any = None,
                      read_ahead: Optional[int] = None, check_device_calls: bool = False) -> World:
        """Joins world ``name`` as a launcher describes it: ``RANK``,
        ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` (required),
        ``MULTIWORLD_SECRET`` and ``MULTIWORLD_BACKEND`` (optional; explicit
        ``secret``/``backend`` arguments win; the backend defaults to tcp). A missing or bad variable raises
        :class:`~multiworld_rs.errors.ConfigError` naming it. An NCCL world's
        device is ``device`` if given, else ``LOCAL_RANK`` (default 0)."""
        opts = self._options(secret, timeout, op_timeout, backend, host_store,
                             heartbeat_interval, heartbeat_timeout, device, read_ahead, check_device_calls)
        return World(self._m.join_env(name, opts))

    def world(self, name: str) -> Optional[World]:
        """The world of that name if this process is a member, else ``None``."""
        w = self._m.world(name)
        return None if w is None else World(w)

    def worlds(self) -> List[WorldInfo]:
        """Every world of this process (including ones being torn down)."""
        return [WorldInfo(*t) for t in self._m.worlds()]

    def leave(self, name: str) -> None:
        """Leaves a world at once (no goodbye: the other members see this
        process as lost; prefer :meth:`World.finish` for an orderly end)."""
        self._m.leave(name)

    def shutdown(self) -> None:
        """Leaves every world and stops the stores this process hosts."""
        self._m.shutdown()

    def events(self, timeout: Optional[float] = None) -> EventStream:
        """Subscribes to this manager's events (``joined``, ``broken``,
        ``removed``, ...) from now on. Iterating the stream stops after
        ``timeout`` seconds without an event (``None``: waits forever). A
        ``broken`` event's ``flight_record`` is the world's timeline at the
        break (its last operations and those pending)."""
        return EventStream(self._m.events(), _seconds("timeout", timeout))

    # -- operating --------------------------------------------------------------
    def metrics_text(self) -> str:
        """Every metric of this process and its worlds now, in Prometheus'
        text format (what the endpoint serves; see ``docs/operations.md``)."""
        return self._m.metrics_text()

    @property
    def metrics_addr(self) -> Optional[str]:
        """``host:port`` of the metrics endpoint (``GET /metrics``), served
        when ``MULTIWORLD_METRICS_ADDR`` is set; ``None`` otherwise."""
        return self._m.metrics_addr()

    def flight_record(self, name: str) -> Optional[dict]:
        """The flight record of world ``name`` now, as a dict (``world``,
        ``generation``, ``rank``, ``reason``, ``ops``: each with ``kind``,
        ``peer``, ``tag``, ``bytes``, ``start_us``, ``end_us``, ``outcome``)
        plus ``timeline``, the readable rendering; ``None`` if this process
        is not a member."""
        got = self._m.flight_record(name)
        if got is None:
            return None
        import json

        record = json.loads(got[0])
        record["timeline"] = got[1]
        return record


