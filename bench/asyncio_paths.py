"""The asyncio API's own costs, against the blocking API and a raw socket,
two processes on one machine (the figures of docs/benchmarks.md's fifth
session, "What a leader's message costs, and sends written in the call").

    target/py-venv/bin/python bench/asyncio_paths.py [--rounds 5000] [--stream 1000] [--repeats 2]

Rank 0 runs the measured side; rank 1 (a second process, started with the
spawn method) answers with the blocking API. Each repeat prints:

- `send`: µs per `await w.send(4 bytes)` of an asyncio sender to a blocking
  receiver, `copy=False` and `copy=True`;
- `ping-pong`: half round trip of 4 bytes, blocking (`send` + `recv_into`),
  blocking through a handle (`irecv(...).wait()`), asyncio (`await send`,
  `await recv_into`), and the raw reference: a TCP socket pair between the
  same two processes (`TCP_NODELAY`, blocking `send`/`recv_into`);
- `stream`: GB/s of 1 MiB messages received by an asyncio receiver from a
  blocking sender.

Needs the package (`bash crates/multiworld-py/scripts/test.sh`, with
`MW_PY_RELEASE=1` for an optimized build).
"""

import argparse
import asyncio
import multiprocessing as mp
import socket
import sys
import time
from pathlib import Path

import numpy as np

try:
    import multiworld_rs as mw
except ImportError:  # a checkout: the package beside this folder (built there by scripts/test.sh)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "crates" / "multiworld-py" / "python"))
    import multiworld_rs as mw
from multiworld_rs.aio import AsyncWorld  # noqa: E402

BIG = 1 << 20


def echo_side(addr: str, tcp_port: int, rounds: int, stream: int) -> None:
    m = mw.WorldManager()
    w = m.join("asyncio-paths", 1, 2, addr, timeout=30)
    a = np.zeros(1, np.float32)
    for _ in range(2 * rounds):  # the two send measurements
        w.recv_into(a, 0, 1)
    for _ in range(3 * rounds):  # three ping-pongs
        w.recv_into(a, 0, 2)
        w.send(a, 0, 2)
    big = mw.zeros(BIG // 4, "float32")
    for _ in range(stream):
        w.send(big, 0, 3)
    s = socket.create_connection(("127.0.0.1", tcp_port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(4)
    for _ in range(rounds):
        s.recv_into(buf, 4, socket.MSG_WAITALL)
        s.sendall(buf)
    s.close()
    w.finish(30)
    m.shutdown()


def measure(rounds: int, stream: int) -> dict:
    """One run: the figures by name."""
    m = mw.WorldManager()
    addr = m.serve_store("127.0.0.1:0")
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(1)
    peer = mp.get_context("spawn").Process(target=echo_side, args=(addr, lsock.getsockname()[1], rounds, stream))
    peer.start()
    out = {}
    try:
        w = m.join("asyncio-paths", 0, 2, addr, timeout=30)
        aw = AsyncWorld(w)
        a = np.zeros(1, np.float32)

        async def sends(copy: bool) -> float:
            t0 = time.perf_counter()
            for _ in range(rounds):
                await aw.send(a, 1, 1, copy=copy)
            return (time.perf_counter() - t0) / rounds * 1e6

        out["send copy=False (us)"] = asyncio.run(sends(False))
        out["send copy=True (us)"] = asyncio.run(sends(True))

        t0 = time.perf_counter()
        for _ in range(rounds):
            w.send(a, 1, 2)
            w.recv_into(a, 1, 2)
        out["ping-pong blocking (us)"] = (time.perf_counter() - t0) / rounds / 2 * 1e6
        t0 = time.perf_counter()
        for _ in range(rounds):
            w.send(a, 1, 2)
            w.irecv(a, 1, 2).wait()
        out["ping-pong irecv+wait (us)"] = (time.perf_counter() - t0) / rounds / 2 * 1e6

        async def pingpong() -> float:
            t0 = time.perf_counter()
            for _ in range(rounds):
                await aw.send(a, 1, 2, copy=False)
                await aw.recv_into(a, 1, 2)
            return (time.perf_counter() - t0) / rounds / 2 * 1e6

        out["ping-pong asyncio (us)"] = asyncio.run(pingpong())

        big = mw.zeros(BIG // 4, "float32")

        async def receive_stream() -> float:
            t0 = time.perf_counter()
            for _ in range(stream):
                await aw.recv_into(big, 1, 3)
            return stream * BIG / (time.perf_counter() - t0) / 1e9

        out["stream 1 MiB asyncio (GB/s)"] = asyncio.run(receive_stream())

        conn, _ = lsock.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray(4)
        t0 = time.perf_counter()
        for _ in range(rounds):
            conn.sendall(buf)
            conn.recv_into(buf, 4, socket.MSG_WAITALL)
        out["ping-pong raw TCP (us)"] = (time.perf_counter() - t0) / rounds / 2 * 1e6
        conn.close()
        w.finish(30)
    finally:
        peer.join(60)
        if peer.is_alive():
            peer.kill()
        lsock.close()
        m.shutdown()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5000)
    p.add_argument("--stream", type=int, default=1000, help="1 MiB messages streamed")
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()
    for i in range(a.repeats):
        for k, v in measure(a.rounds, a.stream).items():
            print(f"run {i + 1}  {k:30} {v:8.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
