"""asyncio twin of the synchronous API (first version).

Every operation is started in the runtime at once (as with ``isend`` /
``irecv`` / ``async_op=True``) and awaited through a waiting thread of a
dedicated pool, so the event loop is never blocked. Cancelling the awaiting
task withdraws a receive; a send or a collective already started goes on in
the background (only the waiting stops).

Differences from the synchronous API: ``send`` copies its input (the
operation outlives the call's borrow), and the collectives offered here are
``all_reduce``, ``broadcast``, ``all_gather_into_tensor`` and ``barrier``;
use :attr:`AsyncWorld.sync` with ``asyncio.to_thread`` for the others.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any, List, Optional, Tuple

import numpy as np

from . import _api
from ._api import ReduceOp, Work, World, WorldInfo, WorldManager

__all__ = ["AsyncWorldManager", "AsyncWorld"]

# One waiting thread per operation in flight (they sleep in Rust, without the
# GIL); large enough for a leader awaiting many worlds at once.
_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=256, thread_name_prefix="multiworld-aio")


def _consume(fut: "asyncio.Future[Any]") -> None:
    if not fut.cancelled():
        fut.exception()  # retrieved: a cancelled operation's error is expected


async def _wait(work: Work) -> Any:
    loop = asyncio.get_running_loop()
    fut = loop.run_in_executor(_POOL, work.wait)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        work._w.cancel()
        fut.add_done_callback(_consume)
        raise


async def _call(fn: Any, *args: Any, **kw: Any) -> Any:
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_POOL, lambda: fn(*args, **kw))


class AsyncWorld:
    """The coroutine form of :class:`multiworld_rs.World`."""

    def __init__(self, world: World) -> None:
        self.sync = world
        """The synchronous world (same membership)."""

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
        """Number of members."""
        return self.sync.size

    @property
    def generation(self) -> int:
        """This membership's generation."""
        return self.sync.generation

    @property
    def state(self) -> str:
        """``"ready"``, ``"broken"`` or ``"removed"``."""
        return self.sync.state

    async def send(self, tensor: Any, dst: int, tag: int = 0) -> None:
        """Sends a copy of ``tensor`` to ``dst``."""
        await _wait(self.sync.isend(tensor, dst, tag))

    async def recv(self, src: Optional[int] = None, tag: int = 0, *, dtype: Any, shape: Any) -> np.ndarray:
        """Receives a new array from ``src`` (``None``: any member)."""
        return await _wait(self.sync.irecv(None, src, tag, dtype=dtype, shape=shape))

    async def recv_any(self, tag: int = 0, *, dtype: Any, shape: Any) -> Tuple[int, np.ndarray]:
        """Receives from any member; returns ``(sender, array)``."""
        work = self.sync.irecv(None, None, tag, dtype=dtype, shape=shape)
        arr = await _wait(work)
        return work.source, arr  # type: ignore[attr-defined]

    async def recv_into(self, tensor: Any, src: Optional[int] = None, tag: int = 0) -> int:
        """Receives into ``tensor``; returns the sender's rank."""
        work = self.sync.irecv(tensor, src, tag)
        await _wait(work)
        return work.source  # type: ignore[attr-defined]

    async def all_reduce(self, tensor: Any, op: Any = ReduceOp.SUM) -> None:
        """In-place all-reduce (see :meth:`World.all_reduce`)."""
        await _wait(self.sync.all_reduce(tensor, op, async_op=True))

    async def broadcast(self, tensor: Any, src: int) -> None:
        """In-place broadcast from ``src``."""
        await _wait(self.sync.broadcast(tensor, src, async_op=True))

    async def all_gather_into_tensor(self, output_tensor: Any, input_tensor: Any) -> None:
        """All-gather into one tensor."""
        await _wait(self.sync.all_gather_into_tensor(output_tensor, input_tensor, async_op=True))

    async def barrier(self) -> None:
        """Waits until every member has called it."""
        await _wait(self.sync.barrier(async_op=True))

    async def finish(self, timeout: float = 30.0) -> None:
        """Orderly end for every member (see :meth:`World.finish`)."""
        await _call(self.sync.finish, timeout)

    def abort(self) -> None:
        """Breaks the world now."""
        self.sync.abort()


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

    def world(self, name: str) -> Optional[AsyncWorld]:
        """The world of that name, if this process is a member."""
        w = self.sync.world(name)
        return None if w is None else AsyncWorld(w)

    def worlds(self) -> List[WorldInfo]:
        """Every world of this process."""
        return self.sync.worlds()

    async def leave(self, name: str) -> None:
        """Leaves a world at once."""
        await _call(self.sync.leave, name)

    async def shutdown(self) -> None:
        """Leaves every world and stops the hosted stores."""
        await _call(self.sync.shutdown)

    async def next_event(self, stream: "_api.EventStream", timeout: Optional[float] = None) -> Any:
        """The next event of ``stream`` (from ``self.sync.events()``), or
        ``None`` after ``timeout`` seconds."""
        return await _call(stream.next, timeout)
