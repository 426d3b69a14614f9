"""Sub-groups, every collective's ``async_op=True`` form and every collective
of the asyncio API, over 3 real processes (the checks run in the workers:
tests/workers/group_worker.py)."""

from __future__ import annotations

from conftest import free_port, spawn

SIZE = 3


def test_groups_and_async_collectives_over_three_processes():
    store = f"127.0.0.1:{free_port()}"
    procs = [spawn("group_worker.py", r, SIZE, store) for r in range(SIZE)]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=120)
            results.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for r, (code, out, err) in enumerate(results):
        assert code == 0 and "OK" in out, f"rank {r} (exit {code}):\n{out}\n{err}"
