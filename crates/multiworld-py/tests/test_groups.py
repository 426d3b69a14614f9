"""Sub-groups, every collective's ``async_op=True`` form and every collective
of the asyncio API, over 3 real processes (the checks run in the workers:
tests/workers/group_worker.py)."""

from __future__ import annotations

from conftest import run_ranks


def test_groups_and_async_collectives_over_three_processes():
    run_ranks("group_worker.py", 3)
