"""Exceptions raised by multiworld_rs.

Every exception of the package derives from :class:`MultiworldError`; each
also derives from the builtin that fits (``TimeoutError``, ``ValueError``,
``LookupError``), so code written against the builtins keeps working. Fields
that do not apply are ``None``.
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = [
    "MultiworldError",
    "BrokenWorldError",
    "WorldTimeoutError",
    "MismatchError",
    "InvalidArgumentError",
    "ConfigError",
    "NotJoinedError",
    "AlreadyJoinedError",
    "JoinError",
    "JoinTimeoutError",
    "TransportError",
    "DeviceError",
    "ShutDownError",
    "ForkedProcessError",
    "CAUSES",
]

#: The kinds a :attr:`BrokenWorldError.cause` (and a ``"broken"`` event's
#: ``cause``) can take.
CAUSES = (
    "peer_lost",
    "heartbeat_timeout",
    "op_deadline",
    "store_lost",
    "reported_by_peer",
    "device",
    "aborted",
    "unknown",
)


class MultiworldError(Exception):
    """Base class of every multiworld_rs error.

    Attributes:
        world: the world's name, when the error is about one.
        detail: a human-readable detail, when there is one.
    """

    def __init__(self, message: str = "", *, world: Optional[str] = None,
                 detail: Optional[str] = None, **fields: Any) -> None:
        super().__init__(message)
        self.world = world
        self.detail = detail
        for key, value in fields.items():
            setattr(self, key, value)


class BrokenWorldError(MultiworldError):
    """The world is broken (or was torn down after a break): the operation
    did not run, or was failed. Retrying on this world cannot succeed; join a
    new generation instead. Other worlds are not affected.

    Attributes:
        world: the world's name.
        generation: the generation that broke (``None`` if unknown).
        cause: the kind of the first failure seen, one of :data:`CAUSES`
            (``"peer_lost"``, ``"heartbeat_timeout"``, ...).
        rank: the member the cause is about, if any.
        detail: the cause in words.
    """

    def __init__(self, message: str = "", *, world: Optional[str] = None,
                 generation: Optional[int] = None, cause: str = "unknown",
                 rank: Optional[int] = None, detail: Optional[str] = None) -> None:
        super().__init__(message, world=world, detail=detail)
        self.generation = generation
        self.cause = cause
        self.rank = rank


class WorldTimeoutError(MultiworldError, TimeoutError):
    """An operation (or a wait on a handle) did not finish in time; the world
    is not necessarily broken.

    Attributes:
        op: the operation.
        after: the deadline, in seconds.
    """

    def __init__(self, message: str = "", *, world: Optional[str] = None,
                 op: Optional[str] = None, after: Optional[float] = None) -> None:
        super().__init__(message, world=world)
        self.op = op
        self.after = after


class MismatchError(MultiworldError, ValueError):
    """Members disagreed on a message's or a collective's dtype or size; the
    message names both. Nothing was written into the receiving array."""


class InvalidArgumentError(MultiworldError, ValueError):
    """The runtime refused the call's arguments (a rank out of range, a tag in
    the reserved range, a bad shape, an op undefined for the dtype...)."""


class ConfigError(MultiworldError, ValueError):
    """A world configuration cannot be used (a bad name, rank, size or
    address, or a missing environment variable for ``join_from_env``)."""


class NotJoinedError(MultiworldError, LookupError):
    """This process is not a member of that world (or has left it)."""


class AlreadyJoinedError(MultiworldError):
    """This process is already a member of a world of that name.

    Attributes:
        state: the existing membership's state.
    """


class JoinError(MultiworldError):
    """Joining failed (the store could not be reached or hosted, not every
    member arrived in time, the secret did not match...)."""


class JoinTimeoutError(JoinError, WorldTimeoutError):
    """A join that ran out of time: not every member arrived (the message
    names what was waited for), the store did not answer, or the previous
    generation of the name was still being torn down. Both a
    :class:`JoinError` and a ``TimeoutError``; joining again may succeed.

    Attributes:
        op: ``"join"``.
        after: the join's timeout, in seconds.
    """

    def __init__(self, message: str = "", *, world: Optional[str] = None,
                 detail: Optional[str] = None, after: Optional[float] = None) -> None:
        WorldTimeoutError.__init__(self, message, world=world, op="join", after=after)
        self.detail = detail


class TransportError(MultiworldError):
    """A call failed in the transport without breaking the world (a local I/O
    error, a refused handshake)."""


class DeviceError(MultiworldError):
    """A device (NCCL) call failed without breaking the world."""


class ShutDownError(MultiworldError):
    """The manager was shut down."""


class ForkedProcessError(MultiworldError, RuntimeError):
    """This process is a ``fork()`` of one that had started the multiworld
    runtime; the runtime cannot be used here. Use the ``spawn`` start method.

    Attributes:
        parent_pid: the process that started the runtime.
    """
