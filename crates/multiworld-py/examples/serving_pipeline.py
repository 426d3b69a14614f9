"""A serving pipeline: a leader dispatches requests to workers, one world each,
and fails over when a worker dies.

    python serving_pipeline.py [--workers 3] [--requests 300] [--kill]

The leader starts the workers (separate processes: this script again, with
``--worker``), joins one world per worker (``worker-0``, ``worker-1``, ...)
and dispatches requests from one queue, keeping up to ``--window`` requests
in flight per worker. Each worker runs a small numpy "model" (a two-layer
MLP, the same weights as the leader's) and sends each answer back; the
leader checks every answer against its own computation.

With ``--kill`` the leader SIGKILLs worker 1 once a third of the requests are
answered. Only world ``worker-1`` breaks (``BrokenWorldError``, cause
``peer_lost``); the leader puts that worker's in-flight requests back at the
head of the queue, the surviving workers answer them, and every request ends
with exactly one correct answer. Prints what happened and a summary; exits 0
only when nothing was lost, duplicated or wrong and no other world broke.
"""

from __future__ import annotations

import argparse
import collections
import signal
import subprocess
import sys
import threading
import time
from typing import Deque, List, Optional, Tuple

import numpy as np

import multiworld_rs as mw

# Tags of the protocol: a request is its id (int64, -1 ends the service)
# followed by its input; an answer is the id followed by the output.
REQ_ID, REQ, ANS_ID, ANS = 1, 2, 3, 4
ROWS, INPUTS, HIDDEN, OUTPUTS = 8, 64, 32, 16


class Model:
    """A two-layer MLP with fixed weights (the leader and every worker build
    the same one from the same seed)."""

    def __init__(self, seed: int = 7) -> None:
        rng = np.random.default_rng(seed)
        self.w1 = rng.standard_normal((INPUTS, HIDDEN)).astype(np.float32) / np.float32(8)
        self.w2 = rng.standard_normal((HIDDEN, OUTPUTS)).astype(np.float32) / np.float32(6)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return np.maximum(x @ self.w1, np.float32(0)) @ self.w2


def request_input(rid: int) -> np.ndarray:
    """Request ``rid``'s input: a batch of ROWS rows, different per request."""
    return np.random.default_rng(1000 + rid).standard_normal((ROWS, INPUTS)).astype(np.float32)


# -- the worker -------------------------------------------------------------

def worker(name: str, store: str, work_ms: float) -> int:
    model = Model()
    with mw.WorldManager() as m:
        w = m.join(name, 1, 2, store, timeout=60)
        try:
            while True:
                rid = w.recv(0, tag=REQ_ID, dtype=np.int64, shape=1)
                if rid[0] < 0:  # the leader's end of service
                    break
                x = w.recv(0, tag=REQ, dtype=np.float32, shape=(ROWS, INPUTS))
                if work_ms:
                    time.sleep(work_ms / 1000)  # the model's "latency"
                w.send(rid, 0, tag=ANS_ID)
                w.send(model(x), 0, tag=ANS)
            w.finish(30)
        except mw.BrokenWorldError:
            pass  # the leader is gone: the service is over
    return 0


# -- the leader ---------------------------------------------------------------

class Service:
    """The leader's shared state: the request queue and the tally."""

    def __init__(self, requests: int) -> None:
        self.total = requests
        self.queue: Deque[int] = collections.deque(range(requests))
        self.cond = threading.Condition()
        self.answers: List[Tuple[int, str, bool]] = []  # (request, world, correct)
        self.answered = 0
        self.redispatched: List[int] = []

    def take(self, block: bool) -> Optional[int]:
        """The next request; with ``block``, waits while the queue is empty
        but requests are still unanswered (a broken world may give some
        back). ``None`` when there is nothing (more) to do."""
        with self.cond:
            while not self.queue:
                if not block or self.answered >= self.total:
                    return None
                self.cond.wait(0.1)
            return self.queue.popleft()

    def give_back(self, ids: List[int]) -> None:
        with self.cond:
            self.queue.extendleft(reversed(ids))  # the head of the queue, in order
            self.redispatched.extend(ids)
            self.cond.notify_all()

    def record(self, rid: int, world: str, correct: bool) -> None:
        with self.cond:
            self.answers.append((rid, world, correct))
            self.answered += 1
            self.cond.notify_all()


class Outcome:
    def __init__(self) -> None:
        self.state = "running"
        self.cause: Optional[str] = None
        self.rank: Optional[int] = None
        self.detected_at: Optional[float] = None
        self.lost_in_flight: List[int] = []
        self.error: Optional[str] = None


def serve(w: mw.World, svc: Service, model: Model, window: int, out: Outcome) -> None:
    """Dispatches requests to one world's worker, ``window`` at a time, until
    every request is answered or the world breaks."""
    in_flight: Deque[int] = collections.deque()
    try:
        while True:
            while len(in_flight) < window:
                rid = svc.take(block=not in_flight)
                if rid is None:
                    break
                in_flight.append(rid)  # before sending: a failed send gives it back too
                w.send(np.array([rid], dtype=np.int64), 1, tag=REQ_ID)
                w.send(request_input(rid), 1, tag=REQ)
            if not in_flight:
                break
            got = int(w.recv(1, tag=ANS_ID, dtype=np.int64, shape=1)[0])
            y = w.recv(1, tag=ANS, dtype=np.float32, shape=(ROWS, OUTPUTS))
            rid = in_flight.popleft()
            if got != rid:
                raise RuntimeError(f"{w.name}: answer for request {got}, expected {rid}")
            correct = np.allclose(y, model(request_input(rid)), rtol=1e-5, atol=1e-6)
            svc.record(rid, w.name, bool(correct))
        w.send(np.array([-1], dtype=np.int64), 1, tag=REQ_ID)
        w.finish(30)
        out.state = "finished"
    except mw.BrokenWorldError as e:
        out.detected_at = time.monotonic()
        out.state, out.cause, out.rank = "broken", e.cause, e.rank
        out.lost_in_flight = list(in_flight)
        svc.give_back(list(in_flight))
    except Exception as e:  # noqa: BLE001 - reported, and the run fails
        out.state, out.error = "error", f"{type(e).__name__}: {e}"
        svc.give_back(list(in_flight))


def leader(workers: int, requests: int, window: int, work_ms: float, kill: bool) -> int:
    if kill and workers < 2:
        print("--kill needs at least 2 workers (one to kill, one to fail over to)", file=sys.stderr)
        return 2
    started = time.monotonic()
    model = Model()
    svc = Service(requests)
    names = [f"worker-{i}" for i in range(workers)]
    outcomes = {n: Outcome() for n in names}
    procs: List[subprocess.Popen] = []
    m = mw.WorldManager()
    try:
        store = m.serve_store("127.0.0.1:0")
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", n, "--store", store,
                                   "--work-ms", str(work_ms)]) for n in names]
        worlds = [m.join(n, 0, 2, store, timeout=60) for n in names]
        print(f"leader: {workers} workers joined, one world each ({', '.join(names)}); "
              f"dispatching {requests} requests, up to {window} in flight per worker", flush=True)
        threads = [threading.Thread(target=serve, args=(w, svc, model, window, outcomes[w.name]))
                   for w in worlds]
        for t in threads:
            t.start()

        killed_at: Optional[float] = None
        victim = "worker-1"
        if kill:
            deadline = time.monotonic() + 120
            while svc.answered < requests // 3 and time.monotonic() < deadline:
                time.sleep(0.001)
            print(f"leader: {svc.answered}/{requests} answered; SIGKILL to {victim} "
                  f"(pid {procs[1].pid})", flush=True)
            killed_at = time.monotonic()
            procs[1].send_signal(signal.SIGKILL)
            procs[1].wait(timeout=60)
            while outcomes[victim].state == "running" and time.monotonic() < deadline:
                time.sleep(0.001)
            o = outcomes[victim]
            if o.state == "broken" and o.detected_at is not None:
                print(f"leader: world {victim} broke (BrokenWorldError, cause {o.cause}, rank {o.rank}) "
                      f"{(o.detected_at - killed_at) * 1000:.1f} ms after the kill; "
                      f"{len(o.lost_in_flight)} in-flight requests re-dispatched to the survivors: "
                      f"{o.lost_in_flight}", flush=True)

        for t in threads:
            t.join(timeout=120)
        hung = [t.name for t in threads if t.is_alive()]
    finally:
        m.shutdown()  # every world left; workers still serving see it and exit
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    # -- the verdict --------------------------------------------------------
    ok = not hung
    per_world = collections.Counter(w for _, w, _ in svc.answers)
    for n in names:
        o = outcomes[n]
        state = o.state if o.state != "broken" else f"broken ({o.cause}, rank {o.rank})"
        if o.error:
            state += f": {o.error}"
        print(f"{n}: answered {per_world[n]} requests, {state}", flush=True)
        if kill and n == victim:
            ok &= o.state == "broken" and o.cause == "peer_lost"
        else:
            ok &= o.state == "finished"
    ids = collections.Counter(rid for rid, _, _ in svc.answers)
    lost = [rid for rid in range(requests) if ids[rid] == 0]
    duplicated = [rid for rid, c in ids.items() if c > 1]
    wrong = [rid for rid, _, correct in svc.answers if not correct]
    ok &= not lost and not duplicated and not wrong
    once = sum(1 for c in ids.values() if c == 1)
    print(f"summary: {requests} requests, {once} answered exactly once, "
          f"{len(duplicated)} more than once, {len(wrong)} wrong, {len(lost)} lost, "
          f"{len(svc.redispatched)} re-dispatched; {time.monotonic() - started:.2f} s", flush=True)
    if svc.redispatched:
        by = {rid: w for rid, w, _ in svc.answers}
        print("re-dispatched requests answered by: "
              + ", ".join(f"{rid} -> {by.get(rid, 'nobody')}" for rid in svc.redispatched), flush=True)
    if lost:
        print(f"lost: {lost[:20]}", flush=True)
    if hung:
        print(f"threads still running: {hung}", flush=True)
    print("OK" if ok else "UNEXPECTED", flush=True)
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--window", type=int, default=4, help="requests in flight per worker")
    ap.add_argument("--work-ms", type=float, default=2.0, help="each worker's time per request")
    ap.add_argument("--kill", action="store_true", help="SIGKILL worker 1 a third of the way")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.store, args.work_ms)
    if args.workers < 1 or args.requests < 1 or args.window < 1:
        ap.error("--workers, --requests and --window must be at least 1")
    return leader(args.workers, args.requests, args.window, args.work_ms, args.kill)


if __name__ == "__main__":
    sys.exit(main())
