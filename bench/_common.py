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
