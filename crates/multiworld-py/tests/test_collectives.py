"""Every collective over 3 real processes, checked against numpy references
(the checks run in the workers: tests/workers/coll_worker.py)."""

from __future__ import annotations

from conftest import run_ranks


def test_collectives_over_three_processes():
    run_ranks("coll_worker.py", 3)
