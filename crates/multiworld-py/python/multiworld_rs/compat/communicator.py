"""The older library's ``multiworld.communicator`` on multiworld_rs.

:class:`WorldCommunicator` has the older library's coroutine methods, each
taking the world by name as its last argument (``send(tensor, dst,
world_name)``); :class:`BrokenWorldException` is what they raise when the
world is broken. Get the communicator from
:attr:`multiworld_rs.compat.manager.WorldManager.communicator`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, List, NoReturn, Optional

from .. import aio
from .._api import ReduceOp
from ..errors import BrokenWorldError, NotJoinedError

if TYPE_CHECKING:  # pragma: no cover
    from .manager import WorldManager

__all__ = ["BrokenWorldException", "WorldCommunicator", "DEFAULT_WORLD_NAME"]

#: The world name used when none is given (the older library's default, the
#: empty name; no world can be joined under it here, so an operation that
#: leaves ``world_name`` out raises :class:`BrokenWorldException`).
DEFAULT_WORLD_NAME = ""


def _rebuild(cls: type, world_name: str, msg: str, fields: dict) -> "BrokenWorldException":
    return cls(world_name, msg, **fields)


class BrokenWorldException(BrokenWorldError):
    """Raised by the communicator's operations when the world is broken (a
    member died, froze or was cut off, an operation passed its deadline) or
    is no longer (or never was) a world of this process.

    The older library's exception (``BrokenWorldException(world_name,
    msg)``, printed as ``"<world_name> broken: <msg>"``). It is also a
    :class:`multiworld_rs.BrokenWorldError`, with its fields filled in when
    the runtime reported the break: ``world``, ``generation``, ``cause``
    (``"peer_lost"``, ``"heartbeat_timeout"``, ...; ``"unknown"`` when the
    world is not there at all), ``rank`` and ``detail``.
    """

    def __init__(self, world_name: str, msg: str = "", *, generation: Optional[int] = None,
                 cause: str = "unknown", rank: Optional[int] = None,
                 detail: Optional[str] = None) -> None:
        super().__init__(f"{world_name} broken: {msg}", world=world_name, generation=generation,
                         cause=cause, rank=rank, detail=msg if detail is None else detail)
        self._world_name = world_name
        self._msg = msg

    @property
    def world_name(self) -> str:
        """The world's name (as ``world``)."""
        return self._world_name

    @property
    def msg(self) -> str:
        """The reason, in words."""
        return self._msg

    def __str__(self) -> str:
        return f"{self._world_name} broken: {self._msg}"

    def __reduce__(self) -> Any:
        fields = {"generation": self.generation, "cause": self.cause, "rank": self.rank,
                  "detail": self.detail}
        return _rebuild, (type(self), self._world_name, self._msg, fields)

    @classmethod
    def from_error(cls, err: BrokenWorldError, world_name: Optional[str] = None) -> "BrokenWorldException":
        """The compat form of one of multiworld_rs's ``BrokenWorldError``
        (the same fields; ``err`` itself if it already is one)."""
        if isinstance(err, cls):
            return err
        name = err.world if err.world is not None else (world_name or "")
        return cls(name, err.detail or str(err), generation=err.generation, cause=err.cause,
                   rank=err.rank, detail=err.detail)


def _not_there(manager: "WorldManager", world_name: str) -> BrokenWorldException:
    ev = manager._last_break(world_name) if isinstance(world_name, str) else None
    if ev is not None:  # it broke, and was torn down since
        return BrokenWorldException(world_name, ev.detail or ev.cause or "broken", generation=ev.generation,
                                    cause=ev.cause or "unknown", rank=ev.rank)
    return BrokenWorldException(
        str(world_name), "not a world of this process (never initialized, or removed)")


class WorldCommunicator:
    """The older library's communicator: coroutine operations on a world
    named by ``world_name``, run by multiworld_rs (every operation starts in
    the runtime at once and is awaited without blocking the event loop).

    Tensors are numpy arrays, CPU torch tensors or ``__dlpack__`` objects;
    outputs are written in place, as in the older library. Every operation
    raises :class:`BrokenWorldException` when its world is broken or is not a
    world of this process; other worlds are not affected."""

    def __init__(self, world_manager: "WorldManager") -> None:
        self._world_manager = world_manager

    def _world(self, world_name: str) -> aio.AsyncWorld:
        w = self._world_manager._aio.world(world_name) if isinstance(world_name, str) else None
        if w is None:
            raise _not_there(self._world_manager, world_name)
        return w

    def _raise(self, err: BaseException, world_name: str) -> NoReturn:
        if isinstance(err, BrokenWorldError):
            raise BrokenWorldException.from_error(err, world_name) from err
        if isinstance(err, NotJoinedError):
            raise _not_there(self._world_manager, world_name) from err
        raise err

    async def _run(self, world_name: str, op: Callable[[aio.AsyncWorld], Any]) -> None:
        w = self._world(world_name)
        try:
            await op(w)
        except (BrokenWorldError, NotJoinedError) as e:
            self._raise(e, world_name)

    def is_broken(self, world_name: str) -> bool:
        """Whether the world is broken; as in the older library, a name that
        is not a world of this process (never initialized, removed, torn down
        after a break) counts as broken."""
        w = self._world_manager._aio.sync.world(world_name) if isinstance(world_name, str) else None
        return w is None or w.state in ("broken", "removed")

    async def send(self, tensor: Any, dst: int, world_name: str = DEFAULT_WORLD_NAME) -> None:
        """Sends ``tensor`` to rank ``dst`` of the world from its own memory
        when it is C-contiguous and writeable (as the original sends it; see
        ``AsyncWorld.send(copy=False)``: cancelling leaves the send running),
        else a copy.

        Raises:
            BrokenWorldException: the world is broken or not there.
        """
        await self._run(world_name, lambda w: w.send(tensor, dst, copy=False))

    async def recv(self, tensor: Any, src: int, world_name: str = DEFAULT_WORLD_NAME) -> None:
        """Receives a message from rank ``src`` of the world into ``tensor``
        (same dtype and number of elements as the message, else
        :class:`multiworld_rs.MismatchError` and ``tensor`` is untouched).

        Raises:
            BrokenWorldException: the world is broken or not there.
        """
        await self._run(world_name, lambda w: w.recv_into(tensor, src))

    async def broadcast(self, tensor: Any, src: int, world_name: str = DEFAULT_WORLD_NAME) -> None:
        """Copies rank ``src``'s ``tensor`` into every member's ``tensor``.

        Raises:
            BrokenWorldException: the world is broken or not there.
        """
        await self._run(world_name, lambda w: w.broadcast(tensor, src))

    async def all_reduce(self, tensor: Any, op: Any = ReduceOp.SUM,
                         world_name: str = DEFAULT_WORLD_NAME) -> None:
        """Reduces ``tensor`` over every member with ``op`` (a
        ``multiworld_rs.ReduceOp``, ``torch.distributed.ReduceOp`` or a name
        such as ``"sum"``); every member gets the result in ``tensor``.

        Raises:
            BrokenWorldException: the world is broken or not there.
        """
        await self._run(world_name, lambda w: w.all_reduce(tensor, op))

    async def reduce(self, tensor: Any, dst: int, op: Any = ReduceOp.SUM,
                     world_name: str = DEFAULT_WORLD_NAME) -> None:
        """Reduces ``tensor`` over every member with ``op`` into rank
        ``dst``'s ``tensor`` (the others' are left as they were).

        Raises:
            BrokenWorldException: the world is broken or not there.
        """
        await self._run(world_name, lambda w: w.reduce(tensor, dst, op))

    async def all_gather(self, tensors: List[Any], tensor: Any,
                         world_name: str = DEFAULT_WORLD_NAME) -> None:
        """Gathers every member's ``tensor`` into ``tensors`` (one
        correctly-sized tensor per member, in rank order).

        Raises:
            BrokenWorldException: the world is broken or not there.
        """
        await self._run(world_name, lambda w: w.all_gather(tensors, tensor))

    async def gather(self, tensor: Any, gather_list: Optional[List[Any]] = None, dst: int = 0,
                     world_name: str = DEFAULT_WORLD_NAME) -> None:
        """Gathers every member's ``tensor`` into rank ``dst``'s
        ``gather_list`` (required there, ignored elsewhere).

        Raises:
            BrokenWorldException: the world is broken or not there.
        """
        await self._run(world_name, lambda w: w.gather(tensor, gather_list, dst))

    async def scatter(self, tensor: Any, scatter_list: Optional[List[Any]] = None, src: int = 0,
                      world_name: str = DEFAULT_WORLD_NAME) -> None:
        """Puts rank ``src``'s ``scatter_list[i]`` into rank i's ``tensor``
        (``scatter_list`` required on ``src``, ignored elsewhere).

        Raises:
            BrokenWorldException: the world is broken or not there.
        """
        await self._run(world_name, lambda w: w.scatter(tensor, scatter_list, src))
