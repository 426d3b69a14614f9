"""The older library's ``multiworld.manager`` on multiworld_rs.

    from multiworld_rs.compat.manager import WorldManager

    world_manager = WorldManager()
    await world_manager.initialize_world("world1", rank, 2, addr="127.0.0.1", port=30500)
    await world_manager.communicator.send(tensor, 1, "world1")
    world_manager.remove_world("world1")    # the name can be initialized again

Differences from the older library are listed in docs/python.md
("Compatibility with the older library").
"""

from __future__ import annotations

import asyncio

import sys
from typing import Any, Dict, Optional, Set

from .. import aio as _aiomod
from ..errors import AlreadyJoinedError, BrokenWorldError, NotJoinedError
from .communicator import WorldCommunicator

__all__ = ["WorldManager"]

# The older library's backend names -> multiworld_rs's.
_BACKENDS = {"gloo": "tcp", "tcp": "tcp", "nccl": "nccl"}


def _store_address(addr: str, port: Any) -> str:
    if not isinstance(addr, str) or not addr:
        raise TypeError(f"addr must be a host name or IP address, got {addr!r}")
    if isinstance(port, bool) or not isinstance(port, int):
        raise TypeError(f"port must be an int, got {port!r}")
    if not 0 < port < 65536:
        raise ValueError(f"port must be in 1..65535, got {port} (the store is hosted by rank 0 on "
                         f"addr:port and every other rank connects there, so a port must be given)")
    if ":" in addr and not addr.startswith("["):  # IPv6 literal
        addr = f"[{addr}]"
    return f"{addr}:{port}"


class WorldManager:
    """The older library's world manager: initializes and removes worlds by
    name and hands out the :attr:`communicator` that runs operations on them.

    Each world is its own fault domain (a member of one dying, freezing or
    being cut off breaks that world only), monitored by multiworld_rs's
    per-world watchdog whatever ``enable_monitor`` says; no torch patch and no
    running event loop are needed to create it. Underneath is one
    :class:`multiworld_rs.aio.AsyncWorldManager` (:attr:`aio`), whose
    ``.sync`` is the synchronous :class:`multiworld_rs.WorldManager`.
    """

    def __init__(self, enable_monitor: bool = True) -> None:
        self._aio = _aiomod.AsyncWorldManager()
        self._names: Set[str] = set()
        # The last break of each world name (from the manager's events), so
        # that an operation on a world already torn down after a break still
        # reports its cause.
        self._events = self._aio.sync.events()
        self._breaks: Dict[str, Any] = {}
        self._communicator = WorldCommunicator(self)
        self.enable_monitor = enable_monitor
        """Kept for the older signature; failure detection is always on."""

    @property
    def aio(self) -> _aiomod.AsyncWorldManager:
        """The multiworld_rs asyncio manager underneath (same worlds)."""
        return self._aio

    @property
    def communicator(self) -> WorldCommunicator:
        """The communicator that runs operations on this manager's worlds."""
        return self._communicator

    async def initialize_world(self, world_name: str, rank: int, world_size: int,
                               backend: str = "gloo", addr: str = "127.0.0.1", port: int = -1,
                               timeout: float = 30, device: Any = None, **options: Any) -> None:
        """Joins world ``world_name`` as ``rank`` of ``world_size`` and
        returns when every member has joined (at most ``timeout`` seconds,
        then :class:`multiworld_rs.JoinTimeoutError`, a
        :class:`multiworld_rs.JoinError` and a ``TimeoutError``).

        Rank 0 hosts the world's store on ``addr:port`` (several worlds may
        share one address); every other rank connects there, retrying until
        the store is up, so members may start in any order. ``backend``:
        ``"gloo"`` (the older default) runs on multiworld_rs's TCP backend;
        ``"nccl"`` needs a build with NCCL. ``device`` chooses an NCCL
        world's GPU (a ``torch.device``, ``"cuda:N"`` or an ordinal; default:
        torch's current device); a TCP world ignores it (tensors say where
        they live). Extra keyword ``options`` go to
        :meth:`multiworld_rs.WorldManager.join` (``secret``, ``op_timeout``,
        ``heartbeat_interval``, ``heartbeat_timeout``, ``host_store``).

        Raises:
            ValueError: this process is already a member of a world of that
                name (remove it first), or the port is missing/out of range.
        """
        store = _store_address(addr, port)
        self._note_events()
        if not isinstance(backend, str):
            raise TypeError(f"backend must be a string, got {backend!r}")
        be = _BACKENDS.get(backend.lower(), backend)
        existing = self._aio.sync.world(world_name) if isinstance(world_name, str) else None
        if existing is not None and existing.state in ("joining", "ready"):
            raise ValueError(f"World {world_name} already exists.")
        # Known before the join ends: cancelling this coroutine does not stop
        # a join already running in the background, which may still make this
        # process a member, and remove_world must then be able to leave it.
        known = world_name in self._names
        self._names.add(world_name)
        if be == "nccl" and device is not None and "device" not in options:
            # The GPU of this rank's NCCL world, as the older API chose it.
            options["device"] = device
        try:
            await self._aio.join(world_name, rank, world_size, store, timeout=timeout,
                                 backend=be, **options)
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            if not known:
                self._names.discard(world_name)
            if isinstance(e, AlreadyJoinedError):
                raise ValueError(f"World {world_name} already exists.") from e
            raise

    def remove_world(self, world_name: str) -> None:
        """Leaves the world at once (the other members see this process as
        lost and their side breaks) and frees its name: ``initialize_world``
        with the same name then joins a new generation. Removing a world that
        already broke (and was torn down) is a no-op.

        Raises:
            ValueError: no world of that name was ever initialized here.
        """
        self._note_events()
        if world_name not in self._names:
            raise ValueError(f"World {world_name} does not exist.")
        if self._aio.sync.world(world_name) is None:
            return
        try:
            self._aio.sync.leave(world_name)
        except (NotJoinedError, BrokenWorldError):
            pass  # torn down meanwhile (a break)

    def _note_events(self) -> None:
        """Takes the manager's events so far into :attr:`_breaks`. Called on
        every initialize and remove as well as on errors: the stream keeps
        only the latest 4,096 events, and a break must not be pushed out by
        the joins and removals of a long-running process."""
        while True:
            ev = self._events.next(0)
            if ev is None:
                break
            if ev.kind == "broken":
                self._breaks[ev.world] = ev
            elif ev.kind == "joined":
                self._breaks.pop(ev.world, None)

    def _last_break(self, world_name: str) -> Optional[Any]:
        """The ``"broken"`` event of the latest generation of ``world_name``
        if it broke (``None`` if it did not, or was joined again since)."""
        self._note_events()
        return self._breaks.get(world_name)

    def is_broken(self, world_name: str) -> bool:
        """Same as ``self.communicator.is_broken(world_name)``."""
        return self._communicator.is_broken(world_name)

    def cleanup(self) -> None:
        """Flushes stdout and leaves every world (the stores hosted here
        stop). Unlike the older library it does not end the process with
        ``os._exit(0)`` (that was a workaround for a hang this runtime does
        not have); code after it runs, but the manager cannot be used again.
        """
        sys.stdout.flush()
        self._aio.sync.shutdown()

    def worlds(self) -> Set[str]:
        """The names of this manager's worlds that are not torn down."""
        return {i.name for i in self._aio.sync.worlds() if i.state != "removed"}

    def world_generation(self, world_name: str) -> Optional[int]:
        """The generation of this process's world of that name, or ``None``."""
        w = self._aio.sync.world(world_name)
        return None if w is None else w.generation
