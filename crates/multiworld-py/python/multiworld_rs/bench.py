"""The Python API against the Rust API, one process per rank, in one run.

    python -m multiworld_rs.bench [--quick] [--repeats N] [--json FILE] [--rust-bin PATH]

Runs each scenario with Python processes (this package, numpy arrays,
``World.send`` and ``World.recv_into`` into preallocated arrays) and with the
Rust reference binary ``mw-rank-bench`` (the ``multiworld`` crate's API, crate
``multiworld-bench``) on the same machine, interleaved, and prints one table:
scenario, size, Rust figure, Python figure, ratio, target, met or missed. The
raw-TCP stream and ping-pong between two processes are measured in the same
run as the physical reference.

Scenarios (every rank a process of its own, started with ``subprocess``):

- ``stream``: rank 1 streams float32 messages to rank 0 (GB/s);
- ``pingpong``: a 4-byte message bounced between two ranks (half round trip,
  median µs);
- ``leader``: one leader process joins 2 or 4 separate worlds of two, one
  worker process per world, and receives from every worker at once; the
  leader runs one thread per world (``threads``) or one asyncio task per
  world through :mod:`multiworld_rs.aio` (``asyncio``) (total GB/s);
- ``all_reduce``: a float32 tensor summed over 2 or 4 processes (median ms
  per call; 1 GiB in all, between 5 and 400 calls, after as many untimed
  ones: see :meth:`Load.all_reduce_warmup`).

The Rust binary is found through ``--rust-bin``, then ``$MULTIWORLD_BENCH_BIN``,
then ``$CARGO_TARGET_DIR/release/mw-rank-bench`` and the repository's
``target/release/mw-rank-bench``; build it with
``cargo build --release -p multiworld-bench --bin mw-rank-bench``.

This is a benchmark, not a test: its figures depend on the machine and on
whatever else runs on it. One measurement of a cell moves by tens of per cent
from run to run on a busy 2-core machine, so the whole plan runs ``--repeats``
times (default 3), Rust and Python side by side each time; a row shows the
run whose ratio is the median of that cell's ratios, and the range of the
ratios. ``--quick`` runs tiny settings once (for the tests).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

#: Tags: data, and the leader's "go".
_DATA, _GO = 0, 1
_FINISH = 60.0


# ---------------------------------------------------------------- settings --
@dataclass
class Load:
    """How much each measurement moves (the Rust binary's flags of the same
    names take the same values)."""

    bytes: int = 1 << 30
    min_messages: int = 100
    rounds: int = 20_000
    # Calls of the 1 MiB all-reduce (a fraction of a millisecond each): with
    # 50 the median moved by 0.2x between runs.
    max_iters: int = 400
    min_iters: int = 5

    @staticmethod
    def quick() -> "Load":
        return Load(bytes=4 << 20, min_messages=10, rounds=200, max_iters=3, min_iters=2)

    def messages(self, size: int, senders: int = 1) -> int:
        return max(self.bytes // max(senders, 1) // max(size, 1), self.min_messages)

    def iters(self, size: int) -> int:
        return min(max(self.bytes // max(size, 1), self.min_iters), max(self.max_iters, self.min_iters))

    @staticmethod
    def warmup(count: int) -> int:
        return min(max(count // 20, 2), 200)

    @staticmethod
    def all_reduce_warmup(iters: int) -> int:
        """Untimed all-reduce calls before the ``iters`` timed ones (the
        Rust binary makes as many): as many, at least two. The first calls
        after the processes start can run slower for a while: on the 2-core
        VM, in some runs the first ~200 all-reduces of 1 MiB over two
        processes took 80–110 µs each against 42 µs after, and a measurement
        of 400 calls (about 20 ms) then took its median there."""
        return max(iters, 2)

    def flags(self) -> List[str]:
        return ["--bytes", str(self.bytes), "--min-messages", str(self.min_messages),
                "--rounds", str(self.rounds), "--max-iters", str(self.max_iters),
                "--min-iters", str(self.min_iters)]


@dataclass
class Plan:
    """What one run measures."""

    stream_sizes: Sequence[int] = (64 << 10, 1 << 20)
    pingpong_size: int = 4
    leader_sizes: Sequence[int] = (64 << 10, 1 << 20)
    leader_workers: Sequence[int] = (2, 4)
    reduce_sizes: Sequence[int] = (1 << 20, 64 << 20)
    reduce_procs: Sequence[int] = (2, 4)
    load: Load = field(default_factory=Load)
    deadline_s: int = 300

    @staticmethod
    def quick() -> "Plan":
        return Plan(stream_sizes=(64 << 10,), leader_sizes=(64 << 10,), leader_workers=(2,),
                    reduce_sizes=(64 << 10,), reduce_procs=(2,), load=Load.quick(), deadline_s=60)


# ------------------------------------------------------------------ ranks --
def _say(obj: Dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _zeros(n: int) -> Any:
    """float32 zeros laid out like the Rust ranks' buffers (64-byte aligned,
    see ``multiworld_rs.zeros``), so both sides pay the kernel's copies alike."""
    from ._tensors import zeros
    return zeros(n, "float32")


def _ones(n: int) -> Any:
    """What a rank sends or reduces: ``_zeros`` filled with ones, every page
    written, as the Rust ranks' (a zeroed buffer that is only read maps the
    kernel's shared zero page, which stays in the caches)."""
    t = _zeros(n)
    t.fill(1)
    return t


def _streamed(scenario: str, size: int, senders: int, count: int, secs: float) -> Dict[str, Any]:
    total = count * senders
    return {"scenario": scenario, "size": size, "senders": senders, "messages": total,
            "secs": secs, "msgs_per_s": total / secs, "gb_per_s": total * size / secs / 1e9}


def _median_p99(v: List[float]) -> tuple:
    v = sorted(v)
    at = lambda q: v[round((len(v) - 1) * q)]  # noqa: E731 - same rule as the Rust side
    return at(0.5), at(0.99)


def _send_stream(w: Any, size: int, warm: int, count: int) -> None:
    import numpy as np

    data = _ones(size // 4)
    go = np.zeros(1, dtype=np.float32)
    for _ in range(warm):
        w.send(data, 0, _DATA)
    w.recv_into(go, 0, _GO)
    for _ in range(count):
        w.send(data, 0, _DATA)


def _rank_stream(m: Any, a: argparse.Namespace, addr: str, load: Load) -> Optional[Dict[str, Any]]:
    import numpy as np

    count = load.messages(a.size)
    warm = load.warmup(count)
    w = m.join("stream", a.rank, 2, addr)
    if a.rank == 1:
        _send_stream(w, a.size, warm, count)
        w.finish(_FINISH)
        return None
    buf = _zeros(a.size // 4)
    for _ in range(warm):
        w.recv_into(buf, 1, _DATA)
    t0 = time.perf_counter()
    w.send(np.zeros(1, dtype=np.float32), 1, _GO)
    for _ in range(count):
        w.recv_into(buf, 1, _DATA)
    secs = time.perf_counter() - t0
    w.finish(_FINISH)
    return _streamed("stream", a.size, 1, count, secs)


def _rank_pingpong(m: Any, a: argparse.Namespace, addr: str, load: Load) -> Optional[Dict[str, Any]]:
    import numpy as np

    rounds = load.rounds
    warm = load.warmup(rounds)
    w = m.join("pingpong", a.rank, 2, addr)
    buf = _zeros(a.size // 4)
    send, recv_into = w.send, w.recv_into
    if a.rank == 1:
        for _ in range(warm + rounds):
            recv_into(buf, 0, _DATA)
            send(buf, 0, _DATA)
        w.finish(_FINISH)
        return None
    data = _ones(a.size // 4)
    rtts = []
    clock = time.perf_counter
    for i in range(warm + rounds):
        t0 = clock()
        send(data, 1, _DATA)
        recv_into(buf, 1, _DATA)
        if i >= warm:
            rtts.append(clock() - t0)
    w.finish(_FINISH)
    med, p99 = _median_p99(rtts)
    return {"scenario": "pingpong", "size": a.size, "rounds": len(rtts),
            "half_rtt_us": med / 2 * 1e6, "half_rtt_us_p99": p99 / 2 * 1e6}


def _rank_leader(m: Any, a: argparse.Namespace, addr: str, load: Load) -> Optional[Dict[str, Any]]:
    import numpy as np

    count = load.messages(a.size, a.n)
    warm = load.warmup(count)
    if a.rank > 0:
        w = m.join(f"leader-{a.rank}", 1, 2, addr)
        _send_stream(w, a.size, warm, count)
        w.finish(_FINISH)
        return None
    worlds = [m.join(f"leader-{i}", 0, 2, addr) for i in range(1, a.n + 1)]
    bufs = [_zeros(a.size // 4) for _ in worlds]
    for w, buf in zip(worlds, bufs):
        for _ in range(warm):
            w.recv_into(buf, 1, _DATA)
    go = np.zeros(1, dtype=np.float32)
    mode = a.mode
    if mode == "threads":
        errors: List[BaseException] = []

        def receive(w: Any, buf: Any) -> None:
            try:
                for _ in range(count):
                    w.recv_into(buf, 1, _DATA)
            except BaseException as e:  # reported by the leader below
                errors.append(e)

        # The threads wait in their first receive until "go" reaches the workers.
        threads = [threading.Thread(target=receive, args=(w, b)) for w, b in zip(worlds, bufs)]
        for t in threads:
            t.start()
        t0 = time.perf_counter()
        for w in worlds:
            w.send(go, 1, _GO)
        for t in threads:
            t.join()
        secs = time.perf_counter() - t0
        if errors:
            raise errors[0]
    else:
        import asyncio

        from .aio import AsyncWorld

        async def receive_all() -> float:
            aws = [AsyncWorld(w) for w in worlds]

            async def receive(aw: Any, buf: Any) -> None:
                for _ in range(count):
                    await aw.recv_into(buf, 1, _DATA)

            t0 = time.perf_counter()
            for aw in aws:
                await aw.send(go, 1, _GO)
            await asyncio.gather(*(receive(aw, b) for aw, b in zip(aws, bufs)))
            return time.perf_counter() - t0

        secs = asyncio.run(receive_all())
    for w in worlds:
        w.finish(_FINISH)
    out = _streamed("leader", a.size, a.n, count, secs)
    out.update(workers=a.n, mode=mode)
    return out


def _rank_all_reduce(m: Any, a: argparse.Namespace, addr: str, load: Load) -> Optional[Dict[str, Any]]:
    import numpy as np

    iters = load.iters(a.size)
    warm = Load.all_reduce_warmup(iters)
    w = m.join("all-reduce", a.rank, a.n, addr)
    t = _ones(a.size // 4)
    times = []
    for i in range(warm + iters):
        t0 = time.perf_counter()
        w.all_reduce(t)
        if i >= warm:
            times.append(time.perf_counter() - t0)
    w.finish(_FINISH)
    if a.rank != 0:
        return None
    med, _ = _median_p99(times)
    return {"scenario": "all_reduce", "size": a.size, "procs": a.n, "iters": len(times),
            "ms": med * 1e3, "ms_min": min(times) * 1e3, "gb_per_s": a.size / med / 1e9}


_RANKS: Dict[str, Callable[..., Optional[Dict[str, Any]]]] = {
    "stream": _rank_stream, "pingpong": _rank_pingpong, "leader": _rank_leader,
    "all-reduce": _rank_all_reduce,
}


def _rank_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="multiworld_rs.bench _rank")
    p.add_argument("scenario", choices=sorted(_RANKS))
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--n", type=int, default=2)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--addr", default="127.0.0.1:0")
    p.add_argument("--mode", choices=("threads", "asyncio"), default="threads")
    p.add_argument("--deadline-s", type=float, default=300)
    for name, default in vars(Load()).items():
        p.add_argument("--" + name.replace("_", "-"), type=int, default=default)
    a = p.parse_args(argv)
    load = Load(**{k: getattr(a, k) for k in vars(Load())})
    if a.size <= 0 or a.size % 4:
        p.error(f"--size must be a positive multiple of 4, got {a.size}")

    def expire() -> None:
        time.sleep(a.deadline_s)
        sys.stderr.write(f"multiworld_rs.bench: a rank ran past its {a.deadline_s:g}-second deadline; exiting\n")
        os._exit(3)

    threading.Thread(target=expire, daemon=True).start()
    from ._api import WorldManager

    m = WorldManager()
    try:
        addr = a.addr
        if a.rank == 0:
            addr = m.serve_store(a.addr)
            _say({"addr": addr})
        out = _RANKS[a.scenario](m, a, addr, load)
    finally:
        m.shutdown()
    if out is not None:
        _say(out)
    return 0


# ----------------------------------------------------------------- parent --
class BenchError(RuntimeError):
    """A run that could not measure (a rank failed, the binary is missing)."""


def _run_ranks(command: Callable[[int, str], List[str]], procs: int, deadline: float) -> Dict[str, Any]:
    """Starts rank 0, reads its address, starts the others with it; returns
    rank 0's result. Kills every rank it started if anything goes wrong."""
    children: List[subprocess.Popen] = []
    try:
        first = subprocess.Popen(command(0, "127.0.0.1:0"), stdin=subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, text=True)
        children.append(first)
        assert first.stdout is not None  # stdout=PIPE

        def next_json(what: str) -> Dict[str, Any]:
            line = first.stdout.readline()  # type: ignore[union-attr]
            if not line:
                raise BenchError(f"rank 0 ({' '.join(command(0, '127.0.0.1:0')[:4])} ...) exited "
                                 f"before printing {what} (status {first.wait(5)})")
            try:
                return json.loads(line)
            except ValueError as e:
                raise BenchError(f"rank 0 printed {line!r}: {e}") from None

        addr = next_json("its address")["addr"]
        for r in range(1, procs):
            children.append(subprocess.Popen(command(r, addr), stdin=subprocess.DEVNULL,
                                             stdout=subprocess.DEVNULL))
        result = next_json("its result")
        for r, c in enumerate(children):
            status = c.wait(deadline)
            if status != 0:
                raise BenchError(f"rank {r} exited with status {status}")
        return result
    finally:
        for c in children:
            if c.poll() is None:
                c.kill()
                c.wait()
        if children and children[0].stdout is not None:
            children[0].stdout.close()


def _python_run(scenario: str, size: int, n: int, plan: Plan, mode: str = "threads") -> Dict[str, Any]:
    procs = {"leader": n + 1, "all-reduce": n}.get(scenario, 2)

    def command(rank: int, addr: str) -> List[str]:
        return [sys.executable, "-m", "multiworld_rs.bench", "_rank", scenario, "--rank", str(rank),
                "--n", str(n), "--size", str(size), "--addr", addr, "--mode", mode,
                "--deadline-s", str(plan.deadline_s), *plan.load.flags()]

    out = _run_ranks(command, procs, plan.deadline_s)
    out["impl"] = "python"
    return out


def _rust_run(binary: Path, scenario: str, size: int, n: int, plan: Plan) -> Dict[str, Any]:
    # The Rust ranks read as far ahead as this package's worlds do, so the
    # two sides differ only in the API.
    from ._api import DEFAULT_READ_AHEAD

    cmd = [str(binary), "run", scenario, "--sizes", str(size), "--n", str(n),
           "--deadline-s", str(plan.deadline_s), "--read-ahead", str(DEFAULT_READ_AHEAD),
           *plan.load.flags()]
    done = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=plan.deadline_s + 30)
    if done.returncode != 0:
        raise BenchError(f"{' '.join(cmd)} failed (status {done.returncode}): {done.stderr.strip()}")
    lines = [json.loads(s) for s in done.stdout.splitlines() if s.strip()]
    if len(lines) != 1:
        raise BenchError(f"{' '.join(cmd)} printed {len(lines)} results, expected 1: {done.stdout!r}")
    return lines[0]


def find_rust_bin(given: Optional[str] = None) -> Path:
    """The reference binary: ``given``, ``$MULTIWORLD_BENCH_BIN``,
    ``$CARGO_TARGET_DIR/release/mw-rank-bench``, or the repository's
    ``target/release/mw-rank-bench``; BenchError naming how to build it."""
    name = "mw-rank-bench"
    candidates: List[Path] = []
    if given:
        candidates.append(Path(given))
    elif os.environ.get("MULTIWORLD_BENCH_BIN"):
        candidates.append(Path(os.environ["MULTIWORLD_BENCH_BIN"]))
    else:
        if os.environ.get("CARGO_TARGET_DIR"):
            candidates.append(Path(os.environ["CARGO_TARGET_DIR"]) / "release" / name)
        for parent in Path(__file__).resolve().parents:
            if (parent / "Cargo.lock").is_file():
                candidates.append(parent / "target" / "release" / name)
                break
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return c
    looked = ", ".join(str(c) for c in candidates) or "nowhere (no repository found)"
    raise BenchError(
        f"the Rust reference binary {name} was not found (looked at {looked}). Build it with "
        f"`cargo build --release -p multiworld-bench --bin {name}` in the repository and pass "
        f"--rust-bin PATH or set MULTIWORLD_BENCH_BIN if its target directory is elsewhere.")


@dataclass
class Row:
    """One line of the table: one figure of each implementation."""

    scenario: str
    size: int
    detail: str
    unit: str
    rust: float
    python: float
    target: str
    met: bool
    ratio: float  # python/rust for throughputs; python - rust (µs) for latencies
    #: Every run's ratio of this cell, in run order (one per repeat).
    ratios: List[float] = field(default_factory=list)

    def as_dict(self) -> Dict[str, Any]:
        return dict(vars(self))


def median_rows(runs: List[List[Row]]) -> List[Row]:
    """One row per cell from several runs of the same plan: the run whose
    ratio is the median (the upper one of an even count), carrying every
    run's ratio."""
    out: List[Row] = []
    if any(len(run) != len(runs[0]) for run in runs):
        raise BenchError("runs of one plan measured different cells")
    for cells in zip(*runs):
        if len({(c.scenario, c.size, c.detail) for c in cells}) != 1:
            raise BenchError(f"runs of one plan measured different cells: {cells!r}")
        ranked = sorted(cells, key=lambda r: r.ratio)
        pick = ranked[len(ranked) // 2]
        out.append(Row(pick.scenario, pick.size, pick.detail, pick.unit, pick.rust, pick.python,
                       pick.target, pick.met, pick.ratio, [c.ratio for c in cells]))
    return out


def _size(n: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def _measure(plan: Plan, binary: Path, log: Callable[[str], None]) -> Iterator[tuple]:
    """Yields ``(kind, rust result, python result or None)``; Rust first,
    Python right after on the same setting."""
    for size in plan.stream_sizes:
        log(f"tcp_stream {_size(size)}")
        yield "tcp_stream", _rust_run(binary, "tcp-stream", size, 2, plan), None
        log(f"stream {_size(size)}")
        yield "stream", _rust_run(binary, "stream", size, 2, plan), _python_run("stream", size, 2, plan)
    log("tcp_pingpong")
    yield "tcp_pingpong", _rust_run(binary, "tcp-pingpong", plan.pingpong_size, 2, plan), None
    log("pingpong")
    yield ("pingpong", _rust_run(binary, "pingpong", plan.pingpong_size, 2, plan),
           _python_run("pingpong", plan.pingpong_size, 2, plan))
    for n in plan.leader_workers:
        for size in plan.leader_sizes:
            log(f"leader {n} workers {_size(size)}")
            rust = _rust_run(binary, "leader", size, n, plan)
            yield "leader threads", rust, _python_run("leader", size, n, plan, "threads")
            yield "leader asyncio", rust, _python_run("leader", size, n, plan, "asyncio")
    for n in plan.reduce_procs:
        for size in plan.reduce_sizes:
            log(f"all_reduce {n} processes {_size(size)}")
            yield ("all_reduce", _rust_run(binary, "all-reduce", size, n, plan),
                   _python_run("all-reduce", size, n, plan))


def _row(kind: str, rust: Dict[str, Any], py: Dict[str, Any]) -> Row:
    size = int(rust["size"])
    if kind == "stream":
        r, p = rust["gb_per_s"], py["gb_per_s"]
        return Row("stream", size, "1 -> 0", "GB/s", r, p, ">= 0.9x", p >= 0.9 * r, p / r)
    if kind == "pingpong":
        r, p = rust["half_rtt_us"], py["half_rtt_us"]
        return Row("pingpong", size, "half RTT median", "us", r, p, "<= +15 us", p <= r + 15, p - r)
    if kind.startswith("leader"):
        r, p = rust["gb_per_s"], py["gb_per_s"]
        detail = f"{rust['workers']} workers, {py['mode']}"
        return Row("leader", size, detail, "GB/s", r, p, ">= 0.8x", p >= 0.8 * r, p / r)
    r, p = rust["ms"], py["ms"]
    return Row("all_reduce", size, f"{rust['procs']} processes, median", "ms", r, p, ">= 0.9x",
               r / p >= 0.9, r / p)


def format_table(rows: List[Row], refs: List[Dict[str, Any]]) -> str:
    """The table as text (one header, one line per row, then the references)."""
    head = ("scenario", "size", "setting", "rust", "python", "ratio", "runs", "target", "result")
    lines = [head]
    for r in rows:
        def fmt(x: float) -> str:
            return f"{x:+.1f} us" if r.unit == "us" else f"{x:.2f}x"

        spread = f"{fmt(min(r.ratios))} .. {fmt(max(r.ratios))}" if len(r.ratios) > 1 else "-"
        lines.append((r.scenario, _size(r.size), r.detail, f"{r.rust:.3f} {r.unit}",
                      f"{r.python:.3f} {r.unit}", fmt(r.ratio), spread, r.target,
                      "met" if r.met else "MISSED"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    groups: Dict[tuple, List[Dict[str, Any]]] = {}
    for ref in refs:
        groups.setdefault((ref["scenario"], ref["size"]), []).append(ref)

    def figures(key: str, fmt: str) -> str:
        return " / ".join(format(g[key], fmt) for g in group)

    for (scenario, size), group in groups.items():
        if scenario == "tcp_stream":
            out.append(f"reference: raw TCP stream {_size(size)} between two processes: "
                       f"{figures('gb_per_s', '.3f')} GB/s")
        else:
            out.append(f"reference: raw TCP ping-pong {size} B between two processes: "
                       f"half RTT {figures('half_rtt_us', '.2f')} us median, "
                       f"{figures('half_rtt_us_p99', '.2f')} us p99")
    if any(len(g) > 1 for g in groups.values()):
        out.append("(references: one figure per run, in run order)")
    return "\n".join(out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_rank"]:
        return _rank_main(argv[1:])
    p = argparse.ArgumentParser(prog="python -m multiworld_rs.bench",
                                description="The Python API against the Rust API, one process per rank.")
    p.add_argument("--quick", action="store_true", help="tiny settings (checks that it runs; no figures to trust)")
    p.add_argument("--repeats", type=int, metavar="N",
                   help="runs of the whole plan; each row is the median run (default 3, 1 with --quick)")
    p.add_argument("--json", metavar="FILE", help="also write the rows and every raw measurement to FILE")
    p.add_argument("--rust-bin", metavar="PATH", help="the mw-rank-bench binary (default: see the module docs)")
    a = p.parse_args(argv)
    try:
        binary = find_rust_bin(a.rust_bin)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    plan = Plan.quick() if a.quick else Plan()
    repeats = a.repeats if a.repeats is not None else (1 if a.quick else 3)
    if repeats < 1:
        print(f"error: --repeats must be at least 1, got {repeats}", file=sys.stderr)
        return 2

    def log(what: str) -> None:
        print(f"... {what}", file=sys.stderr, flush=True)

    runs: List[List[Row]] = []
    refs: List[Dict[str, Any]] = []
    raw: List[Dict[str, Any]] = []
    started = time.time()
    try:
        for run in range(repeats):
            if repeats > 1:
                log(f"run {run + 1} of {repeats}")
            rows: List[Row] = []
            for kind, rust, py in _measure(plan, binary, log):
                raw.extend(x for x in (rust, py) if x is not None and x not in raw)
                if py is None:
                    refs.append(rust)
                else:
                    rows.append(_row(kind, rust, py))
            runs.append(rows)
        rows = median_rows(runs)
    except (BenchError, subprocess.TimeoutExpired) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"multiworld_rs.bench: Python API vs Rust API, one process per rank "
          f"({os.cpu_count()} CPUs, Python {platform.python_version()}, {binary}; "
          f"{repeats} run{'s' if repeats > 1 else ''}, median shown; "
          f"{time.time() - started:.0f} s{', quick' if a.quick else ''})")
    print(format_table(rows, refs))
    missed = [r for r in rows if not r.met]
    print(f"{len(rows) - len(missed)} of {len(rows)} targets met")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"quick": a.quick, "repeats": repeats, "cpus": os.cpu_count(), "python": platform.python_version(),
                       "rust_bin": str(binary), "rows": [r.as_dict() for r in rows],
                       "references": refs, "raw": raw}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
