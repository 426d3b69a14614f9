"""The serving pipeline and the collectives cheatsheet examples run, as one
command each, and print what they should."""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
from typing import Dict, List, Tuple

import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples")
PIPELINE = os.path.join(EXAMPLES, "serving_pipeline.py")
CHEATSHEET = os.path.join(EXAMPLES, "collectives_cheatsheet.py")


def run_example(script: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """Runs an example in its own process group; whatever happens, no process
    of that group outlives the call (and one still there after the example
    exited fails the test: the example must reap its workers)."""
    p = subprocess.Popen([sys.executable, script, *args], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    leftover = False
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"{os.path.basename(script)} {' '.join(args)} ran past {timeout} s\n{out}\n{err}")
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
            leftover = p.returncode is not None
        except ProcessLookupError:
            pass
    assert not leftover, f"processes of {os.path.basename(script)} were still running after it exited"
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


# -- the serving pipeline -----------------------------------------------------

@pytest.mark.timeout(300)
def test_serving_pipeline_answers_every_request():
    r = run_example(PIPELINE, "--workers", "3", "--requests", "200")
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    assert "summary: 200 requests, 200 answered exactly once, 0 more than once, 0 wrong, 0 lost, " \
           "0 re-dispatched" in out, out
    for i in range(3):
        assert re.search(rf"^worker-{i}: answered \d+ requests, finished$", out, re.M), out
    assert "broke" not in out and "broken" not in out, out
    assert out.rstrip().endswith("OK"), out


@pytest.mark.timeout(300)
def test_serving_pipeline_fails_over_a_killed_worker():
    r = run_example(PIPELINE, "--workers", "3", "--requests", "200", "--kill")
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    # Only worker-1's world broke, because its peer was lost.
    broke = re.findall(r"^leader: world (\S+) broke \(BrokenWorldError, cause (\w+), rank (\d+)\) "
                       r"[\d.]+ ms after the kill; (\d+) in-flight requests re-dispatched", out, re.M)
    assert len(broke) == 1, out
    world, cause, rank, redispatched = broke[0]
    assert (world, cause, rank) == ("worker-1", "peer_lost", "1"), out
    assert int(redispatched) >= 1, out  # it had requests in flight (up to --window)
    assert re.search(r"^worker-1: answered \d+ requests, broken \(peer_lost, rank 1\)$", out, re.M), out
    for i in (0, 2):
        assert re.search(rf"^worker-{i}: answered \d+ requests, finished$", out, re.M), out
    # Every request answered exactly once and correctly; the re-dispatched
    # ones by the survivors.
    assert "summary: 200 requests, 200 answered exactly once, 0 more than once, 0 wrong, 0 lost, " \
           f"{redispatched} re-dispatched" in out, out
    by = re.search(r"^re-dispatched requests answered by: (.*)$", out, re.M)
    assert by, out
    answerers = re.findall(r"\d+ -> (\S+?)(?:,|$)", by.group(1))
    assert len(answerers) == int(redispatched) and set(answerers) <= {"worker-0", "worker-2"}, out
    assert out.rstrip().endswith("OK"), out


# -- the collectives cheatsheet -------------------------------------------------

def sections(out: str) -> Dict[str, List[Tuple[int, str, str]]]:
    """{title: [(rank, before, after), ...]} from the cheatsheet's output."""
    found: Dict[str, List[Tuple[int, str, str]]] = {}
    title = None
    for line in out.splitlines():
        m = re.match(r"^=== (.*) ===", line)
        if m:
            title = m.group(1)
            found[title] = []
            continue
        m = re.match(r"^  rank (\d+): before (.*?)\s+after (.*)$", line)
        if m and title is not None:
            found[title].append((int(m.group(1)), m.group(2), m.group(3)))
        elif not line.startswith("  "):
            title = None
    return found


def afters(sec: List[Tuple[int, str, str]]) -> List[str]:
    return [a for _, _, a in sec]


def ints(values) -> str:
    return "[" + ", ".join(str(v) for v in values) + "]"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [2, 4])
def test_collectives_cheatsheet(n):
    r = run_example(CHEATSHEET, "--nproc", str(n))
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    assert "WRONG" not in out, out
    s = sections(out)
    expected_titles = [
        "broadcast(t, src=0)", "all_reduce(t, SUM)", "all_reduce(t, PRODUCT)", "all_reduce(t, MIN)",
        "all_reduce(t, MAX)", "all_reduce(t, AVG)", "all_reduce(t, BAND)", "all_reduce(t, BOR)",
        "all_reduce(t, BXOR)", "all_reduce(t, SUM, async_op=True)", "reduce(t, dst=0, SUM)",
        "all_gather(list, t)", "all_gather_into_tensor(out, t)", "gather(t, list, dst=0)",
        "scatter(t, list, src=0)", "reduce_scatter(t, list, SUM)", "reduce_scatter_tensor(t, t_in, SUM)",
        "all_to_all(outs, ins)", "all_to_all_single(out, t)",
        "all_to_all_single(out, t, out_splits, in_splits)", "barrier()",
        "broadcast_object_list(list, src=0)", "all_gather_object(list, obj)",
        "gather_object(obj, list, dst=0)", "scatter_object_list(out, in, src=0)",
    ]
    assert list(s) == expected_titles, out
    for title, lines in s.items():  # every rank's line, in rank order
        assert [rank for rank, _, _ in lines] == list(range(n)), (title, out)

    total = n * (n + 1) // 2
    ranks = range(n)
    assert afters(s["broadcast(t, src=0)"]) == ["[42, 43, 44]"] * n
    assert s["broadcast(t, src=0)"][n - 1][1] == "[0, 0, 0]"
    assert afters(s["all_reduce(t, SUM)"]) == [ints([total, 10 * total])] * n
    assert afters(s["all_reduce(t, PRODUCT)"]) == [ints([math.factorial(n), 10**n * math.factorial(n)])] * n
    assert afters(s["all_reduce(t, MIN)"]) == ["[1, 10]"] * n
    assert afters(s["all_reduce(t, MAX)"]) == [ints([n, 10 * n])] * n
    assert afters(s["all_reduce(t, AVG)"]) == [f"[{(n + 1) / 2:g}, {10 * (n + 1) / 2:g}]"] * n
    assert afters(s["all_reduce(t, BOR)"]) == [ints([(1 << n) - 1])] * n
    assert afters(s["all_reduce(t, SUM, async_op=True)"]) == [ints([total])] * n
    assert afters(s["reduce(t, dst=0, SUM)"]) == [ints([total])] + [ints([j + 1]) for j in ranks][1:]
    assert afters(s["all_gather(list, t)"]) == [" ".join(f"[{j + 1}]" for j in ranks)] * n
    assert afters(s["gather(t, list, dst=0)"]) == [" ".join(f"[{j + 1}]" for j in ranks)] + ["-"] * (n - 1)
    assert afters(s["scatter(t, list, src=0)"]) == [ints([10 * j, 10 * j + 1]) for j in ranks]
    assert afters(s["reduce_scatter(t, list, SUM)"]) == [ints([total * (j + 1)]) for j in ranks]
    assert afters(s["reduce_scatter_tensor(t, t_in, SUM)"]) == [ints([total * (j + 1)]) for j in ranks]
    assert afters(s["all_to_all(outs, ins)"]) == [" ".join(f"[{10 * j + r}]" for j in ranks) for r in ranks]
    assert afters(s["all_to_all_single(out, t)"]) == [ints([10 * j + r for j in ranks]) for r in ranks]
    assert afters(s["all_to_all_single(out, t, out_splits, in_splits)"]) == [
        ints([10 * j + r for j in ranks for _ in range(r + 1)]) for r in ranks]
    assert afters(s["barrier()"]) == ["left after the last arrival"] * n
    assert afters(s["all_gather_object(list, obj)"]) == [repr([f"r{j}" for j in ranks])] * n
    assert afters(s["scatter_object_list(out, in, src=0)"]) == [repr(f"shard-{j}") for j in ranks]

    assert "| all_to_all " in out and "Quick reference" in out, out
    assert f"25 collective calls on {n} ranks: {25 * n}/{25 * n} results as expected" in out, out
    assert out.rstrip().endswith("OK"), out


@pytest.mark.timeout(300)
def test_collectives_cheatsheet_fails_on_a_wrong_result():
    # --expect-wrong makes the last rank expect a wrong broadcast value: the
    # check must catch it and the command must fail.
    r = run_example(CHEATSHEET, "--nproc", "2", "--expect-wrong")
    assert r.returncode != 0, r.stdout + r.stderr
    assert "rank 1: before [0, 0, 0]     after [42, 43, 44]   <-- WRONG, expected [42, 43, 45]" in r.stdout
    assert "49/50 results as expected" in r.stdout and "WRONG RESULTS" in r.stdout
