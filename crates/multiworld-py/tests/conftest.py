"""Shared fixtures: an in-process pair of members (two managers, threads) and
helpers to run real worker processes."""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, List

import pytest

import multiworld_rs as mw

HERE = os.path.dirname(os.path.abspath(__file__))
_names = itertools.count()


def unique(prefix: str) -> str:
    return f"{prefix}-{os.getpid()}-{next(_names)}"


def both(*calls: Callable[[], Any], timeout: float = 30.0) -> List[Any]:
    """Runs the calls concurrently (one thread each); returns their results,
    re-raising the first exception."""
    with ThreadPoolExecutor(len(calls)) as ex:
        futures = [ex.submit(c) for c in calls]
        return [f.result(timeout=timeout) for f in futures]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(script: str, *args: Any, **kw: Any) -> subprocess.Popen:
    """Starts tests/workers/<script> with this interpreter."""
    return subprocess.Popen(
        [sys.executable, os.path.join(HERE, "workers", script), *map(str, args)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def run_ranks(script: str, size: int, timeout: float = 120.0) -> None:
    """Runs tests/workers/<script> as ranks 0..size of one world (rank 0
    hosts the store on a free port) and asserts every rank printed OK and
    exited 0; kills whatever is left."""
    store = f"127.0.0.1:{free_port()}"
    procs = [spawn(script, r, size, store) for r in range(size)]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            results.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for r, (code, out, err) in enumerate(results):
        assert code == 0 and "OK" in out, f"rank {r} (exit {code}):\n{out}\n{err}"


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def pair():
    """(world of rank 0, world of rank 1): two managers in this process."""
    a, b = mw.WorldManager(), mw.WorldManager()
    store = a.serve_store("127.0.0.1:0")
    name = unique("pair")
    w0, w1 = both(lambda: a.join(name, 0, 2, store, timeout=10),
                  lambda: b.join(name, 1, 2, store, timeout=10))
    yield w0, w1
    a.shutdown()
    b.shutdown()
