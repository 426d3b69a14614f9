"""The leader/workers example runs, with and without a killed worker."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "leader_workers.py")


@pytest.mark.parametrize("kill", [False, True])
def test_leader_workers_example(kill):
    args = [sys.executable, EXAMPLE, "--workers", "3", "--messages", "100"] + (["--kill"] if kill else [])
    r = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK" in r.stdout
    if kill:
        assert "worker-1:" in r.stdout and "broken (peer_lost" in r.stdout
        assert r.stdout.count("finished") == 2
    else:
        assert r.stdout.count("100/100 messages, finished") == 3
