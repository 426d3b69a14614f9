"""A leader receiving from workers, each in its own world.

    python leader_workers.py [--workers 3] [--messages 200] [--kill]

The leader starts the workers (separate processes), joins one world per
worker and receives a stream of tensors from each. With ``--kill`` it kills
worker 1 partway: only world ``worker-1`` breaks (the leader sees
``BrokenWorldError`` with cause ``peer_lost``), and every other world keeps
delivering every message. Prints one line per world and exits 0 when the
outcome is the expected one.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import threading
import time

import numpy as np

import multiworld_rs as mw


def worker(name: str, store: str, messages: int) -> None:
    with mw.WorldManager() as m:
        w = m.join(name, 1, 2, store)
        for i in range(messages):
            w.send(np.full(1024, i, dtype=np.float32), 0)
            time.sleep(0.002)
        w.recv(0, tag=1, dtype=np.int8, shape=1)  # the leader's go-ahead to finish
        w.finish(30)


def leader(workers: int, messages: int, kill: bool) -> int:
    m = mw.WorldManager()
    store = m.serve_store("127.0.0.1:0")
    names = [f"worker-{i}" for i in range(workers)]
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", n, "--store", store,
                               "--messages", str(messages)]) for n in names]
    worlds = [m.join(n, 0, 2, store, timeout=60) for n in names]
    received = {n: 0 for n in names}
    outcome = {}

    def serve(w: mw.World) -> None:
        try:
            for i in range(messages):
                t = w.recv(1, dtype=np.float32, shape=1024)
                assert t[0] == i, (w.name, t[0], i)
                received[w.name] += 1
                if kill and w.name == "worker-1" and i == messages // 4:
                    procs[1].send_signal(signal.SIGKILL)
            w.send(np.ones(1, dtype=np.int8), 1, tag=1)
            w.finish(30)
            outcome[w.name] = "finished"
        except mw.BrokenWorldError as e:
            outcome[w.name] = f"broken ({e.cause}, rank {e.rank})"

    threads = [threading.Thread(target=serve, args=(w,)) for w in worlds]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for p in procs:
        p.wait(timeout=60)
    m.shutdown()
    ok = True
    for n in names:
        print(f"{n}: {received[n]}/{messages} messages, {outcome.get(n)}", flush=True)
        expected_broken = kill and n == "worker-1"
        if expected_broken:
            ok &= outcome.get(n, "").startswith("broken (peer_lost")
        else:
            ok &= outcome.get(n) == "finished" and received[n] == messages
    print("OK" if ok else "UNEXPECTED", flush=True)
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--messages", type=int, default=200)
    ap.add_argument("--kill", action="store_true", help="kill worker 1 partway")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.store, args.messages)
        return 0
    return leader(args.workers, args.messages, args.kill)


if __name__ == "__main__":
    sys.exit(main())
