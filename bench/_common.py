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
