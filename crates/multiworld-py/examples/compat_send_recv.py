"""The older multiworld library's send/recv example, on multiworld_rs.compat.

A port of ``examples/send_recv/m8d.py`` of the older library
(github.com/cisco-open/pymultiworld): a leader is rank 0 of two worlds,
``world1`` and ``world2``, and receives tensors from one worker per world
(rank 1 of its world). It uses the older API unchanged; the import line is
the only change the API needs:

    from multiworld.manager import WorldManager              # the older library
    from multiworld_rs.compat.manager import WorldManager    # this port

One command starts the leader and both workers and checks the outcome:

    python compat_send_recv.py [--messages 5] [--kill]

With ``--kill`` the worker of world2 SIGKILLs itself after two messages: the
leader's receive in world2 raises ``BrokenWorldException`` (cause
``peer_lost``) and only world2 is dropped; world1 keeps delivering. The
processes can also be started by hand, as in the original (each in its own
terminal; ``--messages 0`` sends for ever, as the original does):

    python compat_send_recv.py --worldinfo 1,0 --worldinfo 2,0   # the leader
    python compat_send_recv.py --worldinfo 1,1                   # world1's worker
    python compat_send_recv.py --worldinfo 2,1                   # world2's worker

Differences from the original, besides the import line: tensors are torch
tensors when torch is installed and numpy arrays otherwise; the number of
messages is bounded (``--messages``) and, when it is, the leader removes each
world after its last message and the worker waits for that (a receive that
ends in ``BrokenWorldException``) instead of exiting at once, so no message
is lost to the teardown; ``--base-port`` replaces the fixed 29500; the
one-command launcher and ``--kill`` are new.
"""

import argparse
import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import time

import numpy as np

try:  # the original uses torch; the port works without it
    import torch
except ImportError:
    torch = None

from multiworld_rs.compat.manager import WorldManager


async def init_world(world_name, rank, size, backend="gloo", addr="127.0.0.1", port=-1):
    """Initializes ``world_name`` as ``rank`` of ``size`` (rank 0 hosts the
    world's store on ``addr:port``; the other rank connects there)."""
    dev_str = f"cuda:{rank}" if backend == "nccl" else "cpu"
    device = torch.device(dev_str) if torch is not None else dev_str

    await world_manager.initialize_world(
        world_name,
        rank,
        size,
        backend=backend,
        addr=addr,
        port=port,
        device=device,
    )


def _device_no(world_index, rank):
    return world_index * (world_index - 1) + rank


def _prepare_tensor(rank, backend):
    """A tensor of one 1.0 (the original: ``torch.ones(1)``, moved to
    ``cuda:<rank>`` for nccl)."""
    if torch is None:
        return np.ones(1, dtype=np.float32)
    tensor = torch.ones(1)
    return tensor.to(f"cuda:{rank}") if backend == "nccl" else tensor


def _check_rank(rank):
    assert rank <= 1, "rank error: rank should be 0 or 1."


async def send_data(world_name, rank, size, backend, device_no, messages, interval, die_after):
    """Sends tensors to the other rank of the world, every ``interval``
    seconds, until ``messages`` were sent (0: for ever) or the world breaks."""
    world_communicator = world_manager.communicator
    rank_to_send = 1 if rank == 0 else 0

    sent = 0
    broken = False
    while messages == 0 or sent < messages:
        # Data exchange
        print(f"world: {world_name}, my rank: {rank}, world size: {size}", flush=True)

        await asyncio.sleep(interval)  # the original: time.sleep(1)

        tensor = _prepare_tensor(device_no, backend)

        try:
            await world_communicator.send(tensor, rank_to_send, world_name)
        except Exception as e:
            print(f"caught an exception: {e}", flush=True)
            print("terminate sending", flush=True)
            broken = True
            break

        sent += 1
        print(f"world: {world_name}, my rank: {rank}, tensor: {tensor}", flush=True)
        if sent == die_after:  # --kill: this worker dies partway
            os.kill(os.getpid(), signal.SIGKILL)

    if not broken:
        # Added: wait until the leader removes the world (its last message is
        # delivered by then); the receive ends in BrokenWorldException.
        try:
            await world_communicator.recv(_prepare_tensor(device_no, backend), rank_to_send, world_name)
        except Exception as e:
            print(f"caught an exception: {e}", flush=True)

    print("got out of the loop", flush=True)


world_manager = None


async def receive_data(world_communicator, backend, worlds_ranks, device_no, messages):
    """Receives from the worker of every world in turn. A world that breaks
    is dropped (the others go on); with ``messages`` > 0, a world is removed
    after that many messages. Returns one line per world."""
    received = {world: 0 for world in worlds_ranks}
    outcome = {}

    while len(worlds_ranks):
        for world, rank in list(worlds_ranks.items()):
            rank_to_recv = 1 if rank == 0 else 0

            tensor = _prepare_tensor(device_no, backend)

            try:
                await world_communicator.recv(tensor, rank_to_recv, world)
            except Exception as e:
                print(f"caught an exception: {e}", flush=True)
                del worlds_ranks[world]
                outcome[world] = f"broken ({getattr(e, 'cause', '?')}, rank {getattr(e, 'rank', '?')})"
                continue

            print(f"received {tensor} from rank 1 in {world}", flush=True)
            received[world] += 1
            if messages and received[world] == messages:
                world_manager.remove_world(world)  # the name is free again
                del worlds_ranks[world]
                outcome[world] = "removed"

    return [f"{world}: {received[world]}/{messages} messages, {outcome[world]}" for world in sorted(received)]


async def main(args):
    """Runs the leader (two ``--worldinfo``) or a worker (one)."""
    size = 2
    global world_manager

    world_manager = WorldManager()

    assert len(args.worldinfo) <= 2, "the number of worldinfo arguments must be <= 2"

    device_no = 0
    if len(args.worldinfo) > 1:
        worlds_ranks = {}

        for item in args.worldinfo:
            world_index, rank = item.split(",")
            rank = int(rank)
            world_index = int(world_index)
            device_no = _device_no(world_index, rank)

            _check_rank(rank)

            port = args.base_port + world_index * 1000
            world_name = f"world{world_index}"
            worlds_ranks[world_name] = rank

            await init_world(world_name, rank, size, args.backend, args.addr, port)

        summary = await receive_data(
            world_manager.communicator, args.backend, worlds_ranks, device_no, args.messages
        )
        for line in summary:
            print(line, flush=True)

    else:
        world_index, rank = args.worldinfo[0].split(",")
        rank = int(rank)
        world_index = int(world_index)
        device_no = _device_no(world_index, rank)

        _check_rank(rank)

        port = args.base_port + world_index * 1000
        world_name = f"world{world_index}"

        await init_world(world_name, rank, size, args.backend, args.addr, port)
        await send_data(world_name, rank, size, args.backend, device_no, args.messages,
                        args.interval, args.die_after)

    world_manager.cleanup()


def _free_base_port():
    """A base port whose +1000 and +2000 are free (below the ephemeral range)."""
    for _ in range(200):
        base = random.randrange(10000, 27000)
        try:
            for world_index in (1, 2):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", base + world_index * 1000))
            return base
        except OSError:
            continue
    raise RuntimeError("no free ports found")


def launch(args):
    """Starts both workers, then the leader; checks the leader's summary."""
    base = args.base_port if args.base_port is not None else _free_base_port()
    common = ["--backend", args.backend, "--addr", args.addr, "--base-port", str(base),
              "--messages", str(args.messages), "--interval", str(args.interval)]
    me = [sys.executable, os.path.abspath(__file__)]
    # Workers first: their initialize_world waits for the leader's stores.
    workers = [subprocess.Popen(me + common + ["--worldinfo", "1,1"]),
               subprocess.Popen(me + common + ["--worldinfo", "2,1"]
                                + (["--die-after", "2"] if args.kill else []))]
    leader = subprocess.Popen(me + common + ["--worldinfo", "1,0", "--worldinfo", "2,0"],
                              stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90
    summary = {}
    try:
        for line in leader.stdout:
            print(f"leader| {line}", end="", flush=True)
            head, sep, rest = line.partition(": ")
            if sep and head in ("world1", "world2") and "messages" in rest:
                summary[head] = rest.strip()
        leader.wait(timeout=max(1.0, deadline - time.monotonic()))
        codes = [w.wait(timeout=max(1.0, deadline - time.monotonic())) for w in workers]
    finally:
        for p in workers + [leader]:
            if p.poll() is None:
                p.kill()
                p.wait()
    n = args.messages
    ok = leader.returncode == 0 and summary.get("world1") == f"{n}/{n} messages, removed" and codes[0] == 0
    if args.kill:
        ok &= summary.get("world2", "").split(", ", 1)[-1].startswith("broken (peer_lost")
        ok &= codes[1] == -signal.SIGKILL
    else:
        ok &= summary.get("world2") == f"{n}/{n} messages, removed" and codes[1] == 0
    for world in ("world1", "world2"):
        print(f"{world}: {summary.get(world)}", flush=True)
    print("OK" if ok else "UNEXPECTED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--addr", default="127.0.0.1")
    # --worldinfo is the world index and this process's rank in that world:
    # "--worldinfo 1,0" is rank 0 of world1. None: start all three processes.
    parser.add_argument("--worldinfo", type=str, action="append")
    parser.add_argument("--base-port", type=int, default=None,
                        help="world i's store is on base + i * 1000 (default 29500, as in the "
                             "original; with one command: a free base)")
    parser.add_argument("--messages", type=int, default=None,
                        help="messages per world (0: for ever; default 5 with one command, else 0)")
    parser.add_argument("--interval", type=float, default=None,
                        help="seconds between sends (default 0.2 with one command, else 1)")
    parser.add_argument("--kill", action="store_true", help="world2's worker dies after two messages")
    parser.add_argument("--die-after", type=int, default=0, help=argparse.SUPPRESS)

    args = parser.parse_args()
    if not args.worldinfo:
        args.messages = 5 if args.messages is None else args.messages
        args.interval = 0.2 if args.interval is None else args.interval
        if args.messages <= 0:
            parser.error("one command needs --messages > 0")
        sys.exit(launch(args))
    args.messages = 0 if args.messages is None else args.messages
    args.interval = 1.0 if args.interval is None else args.interval
    args.base_port = 29500 if args.base_port is None else args.base_port

    asyncio.run(main(args))
