#!/usr/bin/env python3
"""set+get round trips through torch.distributed.TCPStore, for comparison
with `m8d bench store` run in the same minutes.

The server is a TCPStore master in a separate child process (like
`m8d bench store`, whose server is an `m8d store` child process); the client
is one non-master TCPStore in this process. Each sample is one `set` followed
by one `get` of the same key (64-byte value, 64 keys cycled, as in
`m8d bench store`), timed with time.perf_counter_ns. A raw TCP ping-pong
(64 bytes, two threads, blocking sockets, TCP_NODELAY) is measured in the
same run as the physical reference.

    python bench/tcpstore.py [--iterations 2000] [--warmup 200] [--json out.json]
"""

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import threading
import time
from datetime import timedelta


def percentile(sorted_values, p):
    if not sorted_values:
        return 0.0
    idx = round((len(sorted_values) - 1) * p)
    return sorted_values[min(idx, len(sorted_values) - 1)]


def serve(port_queue, stop):
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, world_size=None, is_master=True,
                     timeout=timedelta(seconds=60), wait_for_workers=False)
    port_queue.put(store.port)
    stop.wait()


def raw_tcp_rtt(iterations):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    addr = listener.getsockname()

    def echo():
        s, _ = listener.accept()
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            buf = b""
            while len(buf) < 64:
                chunk = s.recv(64 - len(buf))
                if not chunk:
                    return
                buf += chunk
            s.sendall(buf)

    t = threading.Thread(target=echo, daemon=True)
    t.start()
    c = socket.create_connection(addr)
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    msg = b"\x07" * 64
    samples = []
    for _ in range(iterations):
        t0 = time.perf_counter_ns()
        c.sendall(msg)
        got = 0
        while got < 64:
            got += len(c.recv(64 - got))
        samples.append((time.perf_counter_ns() - t0) / 1e3)
    c.close()
    t.join(timeout=5)
    samples.sort()
    return percentile(samples, 0.5)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--json")
    args = ap.parse_args()

    from torch.distributed import TCPStore
    import torch

    ctx = mp.get_context("spawn")
    port_queue, stop = ctx.Queue(), ctx.Event()
    server = ctx.Process(target=serve, args=(port_queue, stop), daemon=True)
    server.start()
    port = port_queue.get(timeout=60)
    try:
        client = TCPStore("127.0.0.1", port, world_size=None, is_master=False,
                          timeout=timedelta(seconds=60))
        value = b"\x07" * 64
        for i in range(args.warmup):
            key = f"c0-k{i % 64}"
            client.set(key, value)
            client.get(key)
        samples = []
        for i in range(args.iterations):
            key = f"c0-k{i % 64}"
            t0 = time.perf_counter_ns()
            client.set(key, value)
            client.get(key)
            samples.append((time.perf_counter_ns() - t0) / 1e3)
        del client
    finally:
        stop.set()
        server.join(timeout=10)
        if server.is_alive():
            server.kill()
    raw = raw_tcp_rtt(max(args.iterations, 1000))
    samples.sort()
    median, p99 = percentile(samples, 0.5), percentile(samples, 0.99)
    print(f"torch {torch.__version__} TCPStore, server in a child process, one client, loopback")
    print(f"raw TCP ping-pong round trip (python, reference): median {raw:.1f} µs")
    print(f"set+get round trip: pairs {len(samples)} median {median:.1f} µs p99 {p99:.1f} µs "
          f"mean {statistics.fmean(samples):.1f} µs  median / (2 × raw RTT) {median / (2 * raw):.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "raw_tcp_rtt_median_us": raw,
                       "pairs": len(samples), "median_us": median, "p99_us": p99}, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
