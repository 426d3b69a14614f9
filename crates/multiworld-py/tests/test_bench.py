"""``python -m multiworld_rs.bench`` runs and its output is well formed.

A benchmark is not a timed test: this runs the quick settings against the
built Rust reference binary (mw-rank-bench) and checks only that every row
parses and has positive figures, never the ratios or the targets."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import multiworld_rs as mw
from multiworld_rs import bench


def _binary():
    try:
        return bench.find_rust_bin()
    except bench.BenchError as e:
        pytest.skip(f"no Rust reference binary: {e}")


@pytest.mark.timeout(600)
def test_quick_bench_runs_and_is_well_formed(tmp_path):
    binary = _binary()
    out_json = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, "-m", "multiworld_rs.bench", "--quick", "--rust-bin", str(binary),
         "--json", str(out_json)],
        capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr
    data = json.loads(out_json.read_text())
    rows = data["rows"]
    kinds = {(r["scenario"], r["detail"].split(", ")[-1]) for r in rows}
    assert {k[0] for k in kinds} == {"stream", "pingpong", "leader", "all_reduce"}
    assert ("leader", "threads") in kinds and ("leader", "asyncio") in kinds
    for r in rows:
        assert r["rust"] > 0 and r["python"] > 0, r
        assert isinstance(r["met"], bool) and r["target"], r
    assert {ref["scenario"] for ref in data["references"]} == {"tcp_stream", "tcp_pingpong"}
    for m in data["raw"]:
        assert m["impl"] in ("rust", "python") and m["size"] > 0, m
    # The printed table: a header, then one line per row, then the references.
    lines = done.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("scenario"))
    body = lines[header + 2:header + 2 + len(rows)]
    assert [line.split()[0] for line in body] == [r["scenario"] for r in rows]
    assert all(line.rstrip().endswith(("met", "MISSED")) for line in body)


def test_missing_binary_is_named_with_how_to_build_it(tmp_path):
    missing = tmp_path / "nope"
    done = subprocess.run([sys.executable, "-m", "multiworld_rs.bench", "--rust-bin", str(missing)],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "MULTIWORLD_BENCH_BIN": ""})
    assert done.returncode == 2
    assert "cargo build --release -p multiworld-bench --bin mw-rank-bench" in done.stderr
    assert str(missing) in done.stderr


def test_repeated_runs_show_the_median_run_and_every_ratio():
    def row(ratio, met):
        return bench.Row("leader", 65536, "2 workers, threads", "GB/s", 1.0, ratio, ">= 0.8x", met, ratio)

    runs = [[row(0.7, False)], [row(0.9, True)], [row(0.85, True)]]
    (r,) = bench.median_rows(runs)
    assert (r.ratio, r.met, r.python) == (0.85, True, 0.85)
    assert r.ratios == [0.7, 0.9, 0.85]
    (single,) = bench.median_rows([[row(0.5, False)]])
    assert (single.ratio, single.ratios) == (0.5, [0.5])
    assert "0.70x .. 0.90x" in bench.format_table([r], [])


def test_the_older_library_comparison_runs_its_compat_side():
    """``bench/older_library_leader.py`` (the older library itself is not
    installed here): its leader and workers on ``multiworld_rs.compat``
    run and report a rate; the older library's side is the same code."""
    pytest.importorskip("torch", reason="the script's tensors are torch tensors")
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    sys.path.insert(0, str(root / "bench"))
    try:
        import older_library_leader as script
    finally:
        sys.path.pop(0)
    r = script._run_python(sys.executable, "compat", 2, 64 << 10, 0.3)
    assert r["impl"] == "compat" and r["workers"] == 2 and r["messages"] > 0 and r["msgs_per_s"] > 0, r


def test_the_asyncio_paths_benchmark_runs():
    """``bench/asyncio_paths.py`` with tiny counts: every figure is there and
    positive (no timing is checked)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    sys.path.insert(0, str(root / "bench"))  # also for the spawned peer, which imports the script
    try:
        import asyncio_paths as script

        out = script.measure(rounds=50, stream=5)
    finally:
        sys.path.pop(0)
    assert len(out) == 7 and all(v > 0 for v in out.values()), out


@pytest.mark.parametrize("mode", ["asyncio", "threads"])
def test_the_leader_process_cpu_benchmark_runs(mode):
    """``bench/leader_process_cpu.py`` with the quick load: the leader
    received every message, and its rate and CPU figures are positive (no
    timing is checked; ``perf`` is not needed without ``--perf``)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    sys.path.insert(0, str(root / "bench"))
    try:
        import leader_process_cpu as script

        import multiworld_rs as mw

        setting = mw.loop_leaves_held()
        r = script.one_run(mode, 2, 64 << 10, bench.Load.quick(), read_ahead=16 << 10,
                           leaves_held=not setting)
        assert mw.loop_leaves_held() is setting, "the run's setting was put back"
    finally:
        sys.path.pop(0)
    assert r["mode"] == mode and r["messages"] > 0, r
    assert r["gb_per_s"] > 0 and r["user_us"] >= 0 and r["system_us"] >= 0, r
    assert r["user_us"] + r["system_us"] > 0, r
    # Clock ticks (10 ms): a quick run may see none.
    assert r["machine_busy_us"] >= 0 and r["machine_idle_us"] >= 0, r
    assert "GB/s" in script.describe(r) and "machine per message" in script.describe(r)


def test_the_asyncio_leader_loop_benchmark_runs():
    """``bench/asyncio_leader_loop.py`` with the quick load and two workers:
    every message is counted once, taken at once or through the loop, and
    the figures are positive (no timing is checked)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    sys.path.insert(0, str(root / "bench"))
    try:
        import asyncio_leader_loop as script

        r = script.one_run(2, 64 << 10, bench.Load.quick())
    finally:
        sys.path.pop(0)
    assert r["at_once"] + r["through_loop"] == r["messages"] > 0, r
    assert 0 <= r["done_posting"] <= r["through_loop"], r
    assert r["gb_per_s"] > 0 and r["loop_busy_us"] > 0, r
    assert "GB/s" in script.describe(r)


def test_the_async_all_reduce_benchmark_runs():
    """``bench/async_all_reduce.py`` with two small runs: its ranks check
    every result; a positive median comes back (no timing is checked)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    sys.path.insert(0, str(root / "bench"))
    try:
        import async_all_reduce as script

        for mode in script.MODES:
            assert script.measure(2, 1 << 16, 5, mode) > 0
        with pytest.raises(ValueError, match="mode must be"):
            script.measure(2, 1 << 16, 5, "threads")
    finally:
        sys.path.pop(0)


def test_the_list_collectives_benchmark_runs():
    """``bench/list_collectives.py``: every collective of lists, each in one
    of the three modes, with small runs; the ranks check every result and a
    positive median comes back (no timing is checked)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    sys.path.insert(0, str(root / "bench"))
    try:
        import list_collectives as script

        for i, op in enumerate(script.OPS):
            assert script.measure(2, op, 1 << 16, 3, script.MODES[i % len(script.MODES)]) > 0
        with pytest.raises(ValueError, match="op must be"):
            script.measure(2, "all_reduce", 1 << 16, 3, "work")
        with pytest.raises(ValueError, match="mode must be"):
            script.measure(2, "gather", 1 << 16, 3, "threads")
    finally:
        sys.path.pop(0)


def test_the_fake_nccl_call_cost_benchmark_runs():
    """``bench/fake_nccl_call_cost.py`` with a small run: both forms of the
    call come back with a positive cost (no timing is checked)."""
    import shutil
    from pathlib import Path

    if not mw.NCCL_BUILT:
        pytest.skip("this multiworld_rs was built without the nccl feature")
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("needs a C compiler for the fake CUDA driver and NCCL")
    root = Path(__file__).resolve().parents[3]
    sys.path.insert(0, str(root / "bench"))
    try:
        import fake_nccl_call_cost as script

        got = script.measure(200)
        assert set(got) == set(script.MODES) and all(us > 0 for us in got.values()), got
    finally:
        sys.path.pop(0)


@pytest.mark.timeout(120)
def test_the_single_copy_reference_builds_and_runs(tmp_path):
    """``bench/cma_copy.c`` (the cost of one copy between processes against
    the segment's copies) compiles and prints five rounds of positive
    figures for every way of copying (no timing is checked)."""
    import re
    import shutil
    from pathlib import Path

    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        pytest.skip("needs a C compiler")
    if os.uname().machine != "x86_64":
        pytest.skip("the reference uses AVX2 stores")
    root = Path(__file__).resolve().parents[3]
    exe = tmp_path / "cma_copy"
    subprocess.run([cc, "-O2", "-mavx2", "-o", str(exe), str(root / "bench" / "cma_copy.c")], check=True)
    done = subprocess.run([str(exe), "64"], capture_output=True, text=True, timeout=100)
    if done.returncode != 0 and "ptrace" in done.stderr:
        pytest.skip(f"process_vm_readv is not allowed here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 5, done.stdout
    for line in lines:
        figures = [float(x) for x in re.findall(r"([0-9.]+) ms", line)]
        assert len(figures) == 5 and all(f > 0 for f in figures), line
        assert "(64 KiB)" in line, line
