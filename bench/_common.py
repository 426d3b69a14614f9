"""What the side-by-side scripts in this folder share: a free loopback port
and the release `mw-rank-bench` binary they drive."""

import argparse
import socket
import sys
from pathlib import Path

DEFAULT_BIN = Path(__file__).resolve().parents[1] / "target/release/mw-rank-bench"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def add_rust_bin(p: argparse.ArgumentParser) -> None:
    """The `--rust-bin` and `--json` options."""
    p.add_argument("--rust-bin", default=str(DEFAULT_BIN))
    p.add_argument("--json")


def rust_bin(a: argparse.Namespace) -> Path:
    """The binary named by `--rust-bin`; exits saying how to build it if absent."""
    binary = Path(a.rust_bin)
    if not binary.is_file():
        sys.exit(f"{binary} not found: cargo build --release -p multiworld-bench --bin mw-rank-bench")
    return binary


def rank0_output(script: str, n: int, args: list, timeout: float = 300) -> str:
    """Runs `python SCRIPT _rank R N STORE *ARGS` for ranks 0..n-1, each a
    process of its own (rank 0 hosts the world's store on a free port);
    returns rank 0's standard output. Raises `RuntimeError` naming the ranks
    that failed, with the end of their errors; kills every rank it started
    if anything goes wrong."""
    import subprocess

    store = f"127.0.0.1:{free_port()}"
    ps = [subprocess.Popen([sys.executable, script, "_rank", str(r), str(n), store, *map(str, args)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(n)]
    try:
        outs = [p.communicate(timeout=timeout) for p in ps]
    finally:
        for p in ps:
            if p.poll() is None:
                p.kill()
                p.communicate()
    failed = [(r, p.returncode, outs[r][1][-2000:]) for r, p in enumerate(ps) if p.returncode != 0]
    if failed:
        raise RuntimeError(f"ranks failed: {failed}")
    return outs[0][0]


class LeaderRun:
    """A leader in this process and the package benchmark's own worker
    ranks (`python -m multiworld_rs.bench _rank leader`), one world of two
    each, as `python -m multiworld_rs.bench` runs its leader scenario.
    Entered, the workers have started, the leader has joined every world
    (`join_options` go to each join) and received the warm-up; `worlds`,
    `bufs` (one receive array per world), `count` (messages per worker in
    the timed part) and `go` (the message that starts the workers) are set.
    On exit the worlds finish, the workers are reaped and the manager shuts
    down."""

    def __init__(self, workers: int, size: int, load=None, **join_options) -> None:
        self.workers, self.size, self.join_options = workers, size, join_options
        self.load = load

    def __enter__(self) -> "LeaderRun":
        import subprocess

        import numpy as np
        from multiworld_rs import bench as b
        from multiworld_rs._api import WorldManager

        load = self.load or b.Load()
        self.count = load.messages(self.size, self.workers)
        warm = load.warmup(self.count)
        self.m = WorldManager()
        addr = self.m.serve_store("127.0.0.1:0")
        cmd = lambda k: [sys.executable, "-m", "multiworld_rs.bench", "_rank", "leader", "--rank", str(k),  # noqa: E731
                         "--n", str(self.workers), "--size", str(self.size), "--addr", addr, *load.flags()]
        self.procs = [subprocess.Popen(cmd(k), stdout=subprocess.DEVNULL) for k in range(1, self.workers + 1)]
        try:
            self.worlds = [self.m.join(f"leader-{i}", 0, 2, addr, **self.join_options)
                           for i in range(1, self.workers + 1)]
            self.bufs = [b._zeros(self.size // 4) for _ in self.worlds]
            for w, buf in zip(self.worlds, self.bufs):
                for _ in range(warm):
                    w.recv_into(buf, 1, b._DATA)
        except BaseException:
            self._end(finish=False)
            raise
        self.go = np.zeros(1, dtype=np.float32)
        return self

    def __exit__(self, *exc) -> None:
        self._end(finish=exc[0] is None)

    def _end(self, finish: bool) -> None:
        from multiworld_rs import bench as b

        try:
            if finish:
                for w in self.worlds:
                    w.finish(b._FINISH)
        finally:
            for p in self.procs:
                if not finish and p.poll() is None:
                    p.kill()
                p.wait(60)
            self.m.shutdown()
