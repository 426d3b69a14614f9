"""multiworld_rs: one process, many independent communication worlds.

A process joins any number of *worlds* through one :class:`WorldManager`;
each world has its own store, connections and watchdog and is its own fault
domain: when a member of one world dies, freezes or is cut off, that world
breaks (its operations raise :class:`BrokenWorldError`) and is torn down,
while every other world keeps running.

    >>> import numpy as np, multiworld_rs as mw
    >>> m = mw.WorldManager()
    >>> store = m.serve_store("127.0.0.1:0")
    >>> w = m.join("solo", 0, 1, store)
    >>> t = np.arange(3, dtype=np.float32)
    >>> w.all_reduce(t, mw.ReduceOp.SUM)
    >>> m.shutdown()

Torch CUDA tensors work in World methods: through NCCL in worlds joined with
``backend="nccl"`` (a build with the ``nccl`` feature: :data:`NCCL_BUILT`),
staged through host memory otherwise.

See ``docs/python.md`` for the API, the tensor and GIL rules and the error
mapping.
"""

from typing import Optional

from . import _native, errors
from ._device import NCCL_BUILT
from ._api import DEFAULT_READ_AHEAD, Event, EventStream, Group, ReduceOp, Work, World, WorldInfo, WorldManager
from ._tensors import ALIGNMENT, DTYPES, empty, zeros
from .errors import (
    AlreadyJoinedError,
    BrokenWorldError,
    ConfigError,
    DeviceError,
    ForkedProcessError,
    InvalidArgumentError,
    JoinError,
    JoinTimeoutError,
    MismatchError,
    MultiworldError,
    NotJoinedError,
    ShutDownError,
    TransportError,
    WorldTimeoutError,
)



def wait_spin(seconds: Optional[float] = None) -> float:
    """How long every blocking call of this process (send, recv, a
    collective, ``Work.wait``) keeps polling its operation, with the GIL
    released, before its thread sleeps; returns the setting in effect and,
    given ``seconds``, sets it first. Zero by default (or
    ``MULTIWORLD_PY_SPIN_US`` microseconds from the environment). A result
    that arrives within the spin is taken without waking a sleeping thread,
    which saves a few microseconds per call on a busy machine (for example
    the half round trip of a 4-byte ping-pong), at the price of up to that
    much CPU per blocking call; the polling thread yields to other runnable
    threads between polls. A ``ValueError`` for a negative or non-finite
    value."""
    return float(_native.spin(seconds))


def loop_copy_max(nbytes: Optional[int] = None) -> int:
    """The most bytes an asyncio receive (:mod:`multiworld_rs.aio`) copies
    on the event loop's thread; returns the setting in effect and, given
    ``nbytes``, sets it first. A larger message is received by a task of
    the runtime, on one of its threads, while the loop runs other tasks,
    and the loop only learns that it is in. The default is 256 KiB on a
    machine with more than two CPUs (the runtime's threads copy beside the
    loop) and no limit (``2**64 - 1``) on one with two or fewer (a copy off
    the loop's thread there waits for a core, and costs two hand-offs
    between threads); ``MULTIWORLD_PY_LOOP_COPY_MAX`` in the environment
    sets it too. A ``ValueError`` for a negative value, a ``TypeError``
    for a non-integer."""
    if nbytes is not None:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int):
            raise TypeError(f"nbytes must be an int, got {nbytes!r}")
        if nbytes < 0:
            raise ValueError(f"nbytes must be at least 0, got {nbytes}")
        nbytes = min(nbytes, 2**64 - 1)
    return int(_native.loop_copy_max(nbytes))


def loop_leaves_held(on: Optional[bool] = None) -> bool:
    """Whether an asyncio receive (:mod:`multiworld_rs.aio`) that finds the
    message it wants held back by its connection's reader (small enough to
    be read ahead, at most the world's ``read_ahead``, but not read yet)
    leaves it to that reader, which it wakes, rather than reading it from
    the socket on the event loop's thread; returns the setting in effect
    and, given ``on``, sets it first. On by default on a machine with more
    than two CPUs, where the loop's one thread is what a leader runs short
    of; off on one with two or fewer, where the wake-up and the hand-off
    back to the loop cost the machine more than the read saves the loop.
    ``MULTIWORLD_PY_LOOP_LEAVES_HELD=0`` or ``1`` in the environment sets
    it too. Either way every message arrives, in order. A ``TypeError`` for
    anything but a bool or ``None``."""
    if on is not None and not isinstance(on, bool):
        raise TypeError(f"on must be a bool, got {on!r}")
    return bool(_native.loop_leaves_held(on))


__all__ = [
    "wait_spin", "loop_copy_max", "loop_leaves_held", "zeros", "empty", "ALIGNMENT", "DEFAULT_READ_AHEAD", "WorldManager", "World", "Group", "Work", "Event", "EventStream", "WorldInfo", "ReduceOp", "DTYPES", "NCCL_BUILT",
    "errors", "MultiworldError", "BrokenWorldError", "WorldTimeoutError", "MismatchError",
    "InvalidArgumentError", "ConfigError", "NotJoinedError", "AlreadyJoinedError", "JoinError",
    "JoinTimeoutError", "TransportError", "DeviceError", "ShutDownError", "ForkedProcessError",
]
