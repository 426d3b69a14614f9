"""The collectives cheatsheet: every collective of the Python API on one
world, each shown with every rank's data before and after, then a
quick-reference table.

    python collectives_cheatsheet.py [--nproc 4]

The script starts ``nproc - 1`` more processes (this script again, with
``--rank``); together they form one world of ``nproc`` ranks and run, in
order: broadcast, all_reduce with every ReduceOp (and once with
``async_op=True``), reduce, all_gather, all_gather_into_tensor, gather,
scatter, reduce_scatter, reduce_scatter_tensor, all_to_all,
all_to_all_single (even and uneven splits), barrier, broadcast_object_list,
all_gather_object, gather_object and scatter_object_list. Every rank checks
its own result against the value it must have and sends its line to rank 0
(with ``gather_object``), which prints the lines in rank order, so the output
is the same every run. Exits non-zero if any result is wrong.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import time
from typing import Any, Callable, List, Optional, Tuple

import numpy as np

import multiworld_rs as mw

F = np.float32
I = np.int64


class Text(str):
    """Words shown as they are (not as a Python string's repr)."""


def fmt(x: Any) -> str:
    """A tensor (or a list of tensors, or any object) as a short string."""
    if x is None:
        return "-"
    if isinstance(x, Text):
        return str(x)
    if isinstance(x, np.ndarray):
        return "[" + ", ".join(f"{v:g}" if x.dtype.kind == "f" else str(v) for v in x.tolist()) + "]"
    if isinstance(x, list) and x and all(isinstance(v, np.ndarray) for v in x):
        return " ".join(fmt(v) for v in x)
    return repr(x)


def same(got: Any, want: Any) -> bool:
    if isinstance(want, np.ndarray):
        return isinstance(got, np.ndarray) and got.dtype == want.dtype and np.array_equal(got, want)
    if isinstance(want, list) and want and isinstance(want[0], np.ndarray):
        return isinstance(got, list) and len(got) == len(want) and all(same(g, w) for g, w in zip(got, want))
    return bool(got == want)


class Sheet:
    """Runs each collective, checks this rank's result and reports the line
    to rank 0, which prints every rank's line in rank order."""

    def __init__(self, w: mw.World) -> None:
        self.w = w
        self.r, self.n = w.rank, w.size
        self.failures = 0
        self.names: List[str] = []

    def show(self, title: str, what: str, before: Any, run: Callable[[], Any], want: Any) -> None:
        b = fmt(before)  # formatted before the call: collectives write in place
        after = run()
        ok = same(after, want)
        line = (self.r, b, fmt(after), ok, None if ok else fmt(want))
        lines: List[Any] = []
        self.w.gather_object(line, lines if self.r == 0 else None, dst=0)
        if self.r == 0:
            print(f"\n=== {title} ===  {what}")
            width = max(len(x[1]) for x in lines)
            for rank, bs, a, good, expected in lines:
                mark = "" if good else f"   <-- WRONG, expected {expected}"
                print(f"  rank {rank}: before {bs:<{width}}  after {a}{mark}")
                self.failures += not good
        self.names.append(title)


def run_sheet(w: mw.World, expect_wrong: bool = False) -> int:
    s = Sheet(w)
    r, n = s.r, s.n
    total = n * (n + 1) // 2  # 1 + 2 + ... + n
    ranks = range(n)

    # BROADCAST: rank 0's tensor is copied into everyone's.
    x = np.array([42, 43, 44], F) if r == 0 else np.zeros(3, F)
    # (--expect-wrong, for the tests: the last rank expects a wrong value here.)
    want = np.array([42, 43, 44 + (expect_wrong and r == n - 1)], F)
    s.show("broadcast(t, src=0)", "rank 0's tensor lands in every rank's", x,
           lambda: (w.broadcast(x, src=0), x)[1], want)

    # ALL_REDUCE with every op: rank r contributes r + 1 (bit ops: bit masks).
    fact = math.factorial(n)
    for op, want in [(mw.ReduceOp.SUM, [total, 10 * total]), (mw.ReduceOp.PRODUCT, [fact, 10**n * fact]),
                     (mw.ReduceOp.MIN, [1, 10]), (mw.ReduceOp.MAX, [n, 10 * n]),
                     (mw.ReduceOp.AVG, [(n + 1) / 2, 10 * (n + 1) / 2])]:
        x = np.array([r + 1, 10 * (r + 1)], F)
        s.show(f"all_reduce(t, {op.name})", "every rank gets the reduction of all",
               x, lambda x=x, op=op: (w.all_reduce(x, op), x)[1], np.array(want, F))
    mask = (1 << n) - 1
    xor_all = 0
    for v in range(1, n + 1):
        xor_all ^= v
    for op, mine, want in [(mw.ReduceOp.BAND, 0xFF ^ (1 << r), 0xFF ^ mask), (mw.ReduceOp.BOR, 1 << r, mask),
                           (mw.ReduceOp.BXOR, r + 1, xor_all)]:
        x = np.array([mine], I)
        s.show(f"all_reduce(t, {op.name})", "bitwise, on int64", x,
               lambda x=x, op=op: (w.all_reduce(x, op), x)[1], np.array([want], I))
    x = np.array([r + 1], F)
    s.show("all_reduce(t, SUM, async_op=True)", "returns a Work; wait() gives the result", x,
           lambda: w.all_reduce(x, mw.ReduceOp.SUM, async_op=True).wait(timeout=60), np.array([total], F))

    # REDUCE: the sum lands on rank 0 only; the others keep their input.
    x = np.array([r + 1], F)
    s.show("reduce(t, dst=0, SUM)", "only rank 0 gets the sum", x,
           lambda: (w.reduce(x, 0, mw.ReduceOp.SUM), x)[1], np.array([total if r == 0 else r + 1], F))

    # ALL_GATHER: everyone gets everyone's tensor, in rank order.
    x = np.array([r + 1], F)
    outs = [np.zeros(1, F) for _ in ranks]
    s.show("all_gather(list, t)", "every rank gets every rank's tensor", x,
           lambda: (w.all_gather(outs, x), outs)[1], [np.array([j + 1], F) for j in ranks])
    x = np.array([10 * r, 10 * r + 1], F)
    out = np.zeros(2 * n, F)
    s.show("all_gather_into_tensor(out, t)", "the same, concatenated into one tensor", x,
           lambda: (w.all_gather_into_tensor(out, x), out)[1],
           np.array([v for j in ranks for v in (10 * j, 10 * j + 1)], F))

    # GATHER: rank 0 collects everyone's tensor.
    x = np.array([r + 1], F)
    glist: Optional[List[np.ndarray]] = [np.zeros(1, F) for _ in ranks] if r == 0 else None
    s.show("gather(t, list, dst=0)", "rank 0 collects every rank's tensor (after: its list)", x,
           lambda: (w.gather(x, glist, dst=0), glist)[1],
           [np.array([j + 1], F) for j in ranks] if r == 0 else None)

    # SCATTER: rank 0 hands chunk j to rank j.
    chunks = [np.array([10 * j, 10 * j + 1], F) for j in ranks] if r == 0 else None
    x = np.zeros(2, F)
    s.show("scatter(t, list, src=0)", "rank 0's chunk j goes to rank j (before: rank 0's list)",
           chunks if r == 0 else x, lambda: (w.scatter(x, chunks, src=0), x)[1],
           np.array([10 * r, 10 * r + 1], F))

    # REDUCE_SCATTER: chunk j of every rank is summed into rank j.
    inputs = [np.array([(r + 1) * (j + 1)], F) for j in ranks]
    x = np.zeros(1, F)
    s.show("reduce_scatter(t, list, SUM)", "chunk j of every rank, summed, lands on rank j", inputs,
           lambda: (w.reduce_scatter(x, inputs, mw.ReduceOp.SUM), x)[1], np.array([total * (r + 1)], F))
    flat = np.array([(r + 1) * (j + 1) for j in ranks], F)
    x = np.zeros(1, F)
    s.show("reduce_scatter_tensor(t, t_in, SUM)", "the same, from one tensor of n segments", flat,
           lambda: (w.reduce_scatter_tensor(x, flat, mw.ReduceOp.SUM), x)[1], np.array([total * (r + 1)], F))

    # ALL_TO_ALL: rank r sends [10r + j] to rank j, so it receives [10j + r].
    inputs = [np.array([10 * r + j], F) for j in ranks]
    outs = [np.zeros(1, F) for _ in ranks]
    s.show("all_to_all(outs, ins)", "input j goes to rank j (a transpose)", inputs,
           lambda: (w.all_to_all(outs, inputs), outs)[1], [np.array([10 * j + r], F) for j in ranks])
    x = np.array([10 * r + j for j in ranks], F)
    out = np.zeros(n, F)
    s.show("all_to_all_single(out, t)", "the same on one tensor, even splits", x,
           lambda: (w.all_to_all_single(out, x), out)[1], np.array([10 * j + r for j in ranks], F))
    # Uneven: rank r sends j + 1 copies of 10r + j to rank j, so it receives
    # r + 1 copies of 10j + r from each rank j.
    x = np.array([10 * r + j for j in ranks for _ in range(j + 1)], F)
    out = np.zeros(n * (r + 1), F)
    s.show("all_to_all_single(out, t, out_splits, in_splits)",
           f"uneven: in_splits [1..{n}], out_splits [r+1]*{n}", x,
           lambda: (w.all_to_all_single(out, x, output_split_sizes=[r + 1] * n,
                                        input_split_sizes=[j + 1 for j in ranks]), out)[1],
           np.array([10 * j + r for j in ranks for _ in range(r + 1)], F))

    # BARRIER: rank r arrives after 50r ms; nobody leaves before the last arrives.
    def barrier() -> str:
        time.sleep(0.05 * r)
        arrived = time.monotonic()
        w.barrier()
        left = time.monotonic()
        arrivals: List[float] = []
        w.all_gather_object(arrivals, arrived)
        return Text("left after the last arrival" if left >= max(arrivals) else "left too early")

    s.show("barrier()", "rank r arrives 50*r ms late; all leave together", Text(f"arrives at +{50 * r} ms"),
           barrier, Text("left after the last arrival"))

    # OBJECT COLLECTIVES (pickled).
    objs: List[Any] = [{"lr": 0.1}, "config", 3] if r == 0 else [None, None, None]
    s.show("broadcast_object_list(list, src=0)", "rank 0's objects replace everyone's", list(objs),
           lambda: (w.broadcast_object_list(objs, src=0), objs)[1], [{"lr": 0.1}, "config", 3])
    got: List[Any] = []
    s.show("all_gather_object(list, obj)", "every rank gets every rank's object", f"r{r}",
           lambda: (w.all_gather_object(got, f"r{r}"), got)[1], [f"r{j}" for j in ranks])
    glist_obj: Optional[List[Any]] = [] if r == 0 else None
    s.show("gather_object(obj, list, dst=0)", "rank 0 collects every rank's object", {"rank": r},
           lambda: (w.gather_object({"rank": r}, glist_obj, dst=0), glist_obj)[1],
           [{"rank": j} for j in ranks] if r == 0 else None)
    shards = [f"shard-{j}" for j in ranks] if r == 0 else None
    out_obj: List[Any] = [None]
    s.show("scatter_object_list(out, in, src=0)", "rank 0's object j goes to rank j",
           shards if r == 0 else out_obj[0],
           lambda: (w.scatter_object_list(out_obj, shards, src=0), out_obj[0])[1], f"shard-{r}")

    if r == 0:
        print_table(n)
        total_lines = len(s.names) * n
        print(f"\n{len(s.names)} collective calls on {n} ranks: {total_lines - s.failures}/{total_lines} "
              f"results as expected")
    # Every rank learns whether rank 0 saw a failure.
    verdict = [s.failures]
    w.broadcast_object_list(verdict, src=0)
    return verdict[0]


def print_table(n: int) -> None:
    """The quick-reference table, with one letter per rank's data."""
    L = [chr(ord("A") + j) for j in range(n)]
    blank = " ".join("[_]" for _ in range(n - 1))
    each = " ".join(f"[{c}]" for c in L)
    every = "".join(L)
    chunks = lambda c: "".join(f"{c}{j}" for j in range(n))  # noqa: E731
    rows: List[Tuple[str, str, str]] = [
        ("broadcast", f"[A] {blank}", " ".join("[A]" for _ in L)),
        ("scatter", f"[{every}] {blank}", each),
        ("gather", each, f"[{every}] {blank}"),
        ("all_gather", each, " ".join(f"[{every}]" for _ in L)),
        ("reduce", each, f"[Σ] {' '.join(f'[{c}]' for c in L[1:])}"),
        ("all_reduce", each, " ".join("[Σ]" for _ in L)),
        ("reduce_scatter", " ".join(f"[{chunks(c)}]" for c in L), " ".join(f"[Σ{j}]" for j in range(n))),
        ("all_to_all", " ".join(f"[{chunks(c)}]" for c in L),
         " ".join("[" + "".join(f"{c}{j}" for c in L) + "]" for j in range(n))),
        ("barrier", "arrive at any time", "leave together"),
    ]
    w0 = max(len(x[0]) for x in rows)
    w1 = max(len(x[1]) for x in rows)
    w2 = max(len(x[2]) for x in rows)
    print(f"\nQuick reference ({n} ranks, rank 0 first; Σ = the reduction of every rank's, "
          f"Σj = of every rank's chunk j)")
    print(f"| {'operation':<{w0}} | {'before':<{w1}} | {'after':<{w2}} |")
    print(f"|{'-' * (w0 + 2)}|{'-' * (w1 + 2)}|{'-' * (w2 + 2)}|")
    for name, before, after in rows:
        print(f"| {name:<{w0}} | {before:<{w1}} | {after:<{w2}} |")
    print("The *_object variants move any picklable objects the same way; all_gather_into_tensor, "
          "reduce_scatter_tensor\nand all_to_all_single are the one-tensor forms (all_to_all_single "
          "also takes uneven splits).")


def rank_main(rank: int, size: int, store: str, expect_wrong: bool) -> int:
    with mw.WorldManager() as m:
        w = m.join("cheatsheet", rank, size, store, timeout=60)
        failures = run_sheet(w, expect_wrong)
        w.finish(30)
    return 1 if failures else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=4, help="number of ranks (2 to 16)")
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    ap.add_argument("--expect-wrong", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not 2 <= args.nproc <= 16:
        ap.error("--nproc must be between 2 and 16")
    if args.rank is not None:
        return rank_main(args.rank, args.nproc, args.store, args.expect_wrong)

    m = mw.WorldManager()
    procs: List[subprocess.Popen] = []
    code = 1
    try:
        store = m.serve_store("127.0.0.1:0")
        procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--nproc", str(args.nproc),
                                   "--store", store] + ["--expect-wrong"] * args.expect_wrong)
                 for r in range(1, args.nproc)]
        print(f"cheatsheet: {args.nproc} ranks in one world (rank 0 is this process, "
              f"ranks 1..{args.nproc - 1} are processes {[p.pid for p in procs]})")
        w = m.join("cheatsheet", 0, args.nproc, store, timeout=60)
        failures = run_sheet(w, args.expect_wrong)
        w.finish(30)
        codes = [p.wait(timeout=60) for p in procs]
        code = 1 if failures or any(codes) else 0
        if any(codes):
            print(f"cheatsheet: rank processes exited with {codes}")
    finally:
        m.shutdown()  # if rank 0 failed, the other ranks see their world break and exit
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    print("OK" if code == 0 else "WRONG RESULTS")
    return code


if __name__ == "__main__":
    sys.exit(main())
