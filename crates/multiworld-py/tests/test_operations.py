"""What operators see from Python: the metrics text and endpoint, a world's
flight record, the record on a ``broken`` event; and the wait-spin setting."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import multiworld_rs as mw

from conftest import both


def test_metrics_text_and_flight_record():
    # The pair's managers belong to the fixture; a manager of our own here.
    m = mw.WorldManager()
    store = m.serve_store("127.0.0.1:0")
    solo = m.join("ops-solo", 0, 1, store)
    solo.all_reduce(np.ones(4, np.float32))
    text = m.metrics_text()
    assert "multiworld_joins_total 1" in text
    assert 'multiworld_op_duration_seconds_count{world="ops-solo"' in text
    rec = m.flight_record("ops-solo")
    assert rec is not None and rec["world"] == "ops-solo" and rec["rank"] == 0
    assert [o["kind"] for o in rec["ops"]] == ["all_reduce"] and rec["ops"][0]["outcome"] == "done"
    assert rec["timeline"].startswith("world ops-solo generation")
    assert m.flight_record("nope") is None
    assert m.metrics_addr is None  # not served unless asked
    m.shutdown()


def test_a_broken_event_carries_the_flight_record():
    a, b = mw.WorldManager(), mw.WorldManager()
    store = a.serve_store("127.0.0.1:0")
    w0, w1 = both(lambda: a.join("ops-brk", 0, 2, store, timeout=10), lambda: b.join("ops-brk", 1, 2, store, timeout=10))
    events = a.events(timeout=10)
    failed = []
    t = threading.Thread(target=lambda: failed.append(_recv_error(w0)))
    t.start()
    time.sleep(0.1)
    w1.abort()
    t.join(10)
    ev = next(e for e in events if e.kind == "broken")
    assert ev.flight_record is not None
    pending = [line for line in ev.flight_record.splitlines() if "PENDING" in line]
    assert len(pending) == 1 and "recv" in pending[0] and "tag 5" in pending[0], ev.flight_record
    assert failed and isinstance(failed[0], mw.BrokenWorldError)
    a.shutdown()
    b.shutdown()


def _recv_error(w):
    try:
        w.recv(1, 5, dtype="int32", shape=1)
    except mw.BrokenWorldError as e:
        return e
    return None


def test_the_metrics_endpoint_from_the_environment():
    script = textwrap.dedent("""
        import urllib.request, multiworld_rs as mw
        m = mw.WorldManager()
        addr = m.metrics_addr
        assert addr and not addr.endswith(":0"), addr
        store = m.serve_store("127.0.0.1:0")
        m.join("ops-env", 0, 1, store).barrier()
        with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as r:
            body = r.read().decode()
            assert r.status == 200 and "openmetrics" in r.headers["Content-Type"], r.headers
        assert 'multiworld_world_state{world="ops-env"' in body, body
        m.shutdown()
        print("OK")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                         env={**__import__("os").environ, "MULTIWORLD_METRICS_ADDR": "127.0.0.1:0"})
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr


def test_wait_spin_setting(pair):
    w0, w1 = pair
    before = mw.wait_spin()
    try:
        assert mw.wait_spin(50e-6) == pytest.approx(50e-6)
        assert mw.wait_spin() == pytest.approx(50e-6)
        # Calls work the same while spinning: results that arrive within the
        # spin and long after it.
        for delay in (0.0, 0.05):
            x = np.arange(4, dtype=np.float32)
            out = np.zeros(4, np.float32)

            def late_send():
                time.sleep(delay)
                w1.send(x, 0)

            both(late_send, lambda: w0.recv_into(out, 1))
            assert (out == x).all()
        with pytest.raises(ValueError, match="spin"):
            mw.wait_spin(-1.0)
        with pytest.raises(ValueError, match="spin"):
            mw.wait_spin(float("nan"))
        assert mw.wait_spin(0) == 0.0
    finally:
        mw.wait_spin(before)


def test_wait_spin_is_bounded():
    with pytest.raises(ValueError, match="at most 0.05"):
        mw.wait_spin(1.0)


def test_in_place_fast_paths(pair):
    """A blocking all_reduce, broadcast or reduce of a plain, writeable numpy
    array is lent to the runtime natively (`all_reduce_plain`,
    `broadcast_plain`, `reduce_plain`), and so are the two arrays of an
    all_gather_into_tensor or reduce_scatter_tensor that share no memory;
    anything else (a view with strides, a read-only array, a root that is
    not an int) is left to the general path, which gives the same results
    and words the errors."""
    w0, w1 = pair
    a = [np.arange(6, dtype=np.float32) + r for r in range(2)]
    assert both(lambda: w0._w.all_reduce_plain(a[0], "sum"),
                lambda: w1._w.all_reduce_plain(a[1], "sum")) == [True, True]
    assert (a[0] == np.arange(6) * 2 + 1).all() and (a[1] == a[0]).all()
    b = [np.full(3, 7 * r, np.int64) for r in range(2)]
    assert both(lambda: w0._w.broadcast_plain(b[0], 1), lambda: w1._w.broadcast_plain(b[1], 1)) == [True, True]
    assert (b[0] == 7).all()
    c = [np.arange(5, dtype=np.int32) * (r + 2) for r in range(2)]
    assert both(lambda: w0._w.reduce_plain(c[0], 0, "prod"),
                lambda: w1._w.reduce_plain(c[1], 0, "prod")) == [True, True]
    assert (c[0] == np.arange(5) ** 2 * 6).all()  # the root: 2x * 3x
    assert (c[1] == np.arange(5) * 3).all()  # the other: as it was
    # Two arrays: the output written, the input only read (read-only is fine).
    ins = [np.arange(3, dtype=np.float32) + 10 * r for r in range(2)]
    ins[1].flags.writeable = False
    outs = [np.zeros(6, np.float32) for _ in range(2)]
    assert both(lambda: w0._w.all_gather_into_tensor_plain(outs[0], ins[0]),
                lambda: w1._w.all_gather_into_tensor_plain(outs[1], ins[1])) == [True, True]
    for o in outs:
        assert (o == np.concatenate(ins)).all()
    rs_in = [np.arange(4, dtype=np.int64) * (r + 1) for r in range(2)]
    rs_out = [np.zeros(2, np.int64) for _ in range(2)]
    assert both(lambda: w0._w.reduce_scatter_tensor_plain(rs_out[0], rs_in[0], "sum"),
                lambda: w1._w.reduce_scatter_tensor_plain(rs_out[1], rs_in[1], "sum")) == [True, True]
    assert (rs_out[0] == [0, 3]).all() and (rs_out[1] == [6, 9]).all()
    # Declined: an input inside the output, another dtype, a read-only or
    # strided output, bool arrays.
    whole = np.zeros(6, np.float32)
    ro_out = np.zeros(6, np.float32)
    ro_out.flags.writeable = False
    for out, inp in ((whole, whole[:3]), (whole, np.zeros(3, np.float64)), (ro_out, np.zeros(3, np.float32)),
                     (np.zeros(12, np.float32)[::2], np.zeros(3, np.float32)),
                     (np.zeros(6, bool), np.zeros(3, bool))):
        assert w0._w.all_gather_into_tensor_plain(out, inp) is False
        assert w0._w.reduce_scatter_tensor_plain(out, inp, "sum") is False
    # Not plain: nothing done here, so nothing to pair with on the other side.
    strided = np.arange(8, dtype=np.float32)[::2]
    read_only = np.arange(4, dtype=np.float32)
    read_only.flags.writeable = False
    for x in (strided, read_only, [1.0, 2.0]):
        assert w0._w.all_reduce_plain(x, "max") is False
        assert w0._w.broadcast_plain(x, 0) is False
        assert w0._w.reduce_plain(x, 0, "sum") is False
    assert w0._w.broadcast_plain(np.zeros(2, np.float32), "0") is False
    assert w0._w.reduce_plain(np.zeros(2, np.float32), "0", "sum") is False
    assert w0._w.reduce_plain(np.zeros(2, np.float32), -1, "sum") is False
    # The public calls: the fast path for plain arrays, the general one for
    # a strided view, the same results.
    s = [np.arange(8, dtype=np.float64)[::2] * (r + 1) for r in range(2)]
    p = [np.arange(4, dtype=np.float64) * (r + 1) for r in range(2)]
    both(lambda: (w0.all_reduce(s[0], "max"), w0.all_reduce(p[0], "max")),
         lambda: (w1.all_reduce(s[1], "max"), w1.all_reduce(p[1], "max")))
    assert (s[0] == np.arange(0, 8, 2) * 2).all() and (p[0] == np.arange(4) * 2).all()
    s = [np.arange(8, dtype=np.float64)[::2] * (r + 1) for r in range(2)]
    p = [np.arange(4, dtype=np.float64) * (r + 1) for r in range(2)]
    both(lambda: (w0.reduce(s[0], 1), w0.reduce(p[0], 1)),
         lambda: (w1.reduce(s[1], 1), w1.reduce(p[1], 1)))
    assert (s[1] == np.arange(0, 8, 2) * 3).all() and (p[1] == np.arange(4) * 3).all()
    assert (s[0] == np.arange(0, 8, 2)).all() and (p[0] == np.arange(4)).all()
    # An all-gather whose input lies in its output (declined by the fast
    # path, copied by the general one) and one of plain arrays agree.
    ag = [np.zeros(4, np.float32) for _ in range(2)]
    for r in range(2):
        ag[r][2 * r:2 * r + 2] = [r + 1, r + 2]
    plain_out = [np.zeros(4, np.float32) for _ in range(2)]
    plain_in = [np.array([r + 1, r + 2], np.float32) for r in range(2)]
    both(lambda: (w0.all_gather_into_tensor(ag[0], ag[0][0:2]), w0.all_gather_into_tensor(plain_out[0], plain_in[0])),
         lambda: (w1.all_gather_into_tensor(ag[1], ag[1][2:4]), w1.all_gather_into_tensor(plain_out[1], plain_in[1])))
    for r in range(2):
        assert (ag[r] == [1, 2, 2, 3]).all() and (plain_out[r] == [1, 2, 2, 3]).all()
    rs = [np.arange(4, dtype=np.float64) * (r + 1) for r in range(2)]
    rs_o = [np.zeros(2, np.float64) for _ in range(2)]
    both(lambda: w0.reduce_scatter_tensor(rs_o[0], rs[0], "max"), lambda: w1.reduce_scatter_tensor(rs_o[1], rs[1], "max"))
    assert (rs_o[0] == [0, 2]).all() and (rs_o[1] == [4, 6]).all()
    # Errors are the general path's: an unknown op, a root out of range.
    with pytest.raises(ValueError, match="op"):
        w0.all_reduce(np.zeros(2, np.float32), "median")
    with pytest.raises(ValueError):
        w0.broadcast(np.zeros(2, np.float32), 5)
    with pytest.raises(ValueError):
        w0.reduce(np.zeros(2, np.float32), 5)
    with pytest.raises(ValueError, match="op"):
        w0.reduce(np.zeros(2, np.float32), 0, "median")
    with pytest.raises(ValueError, match="op"):
        w0.reduce_scatter_tensor(np.zeros(1, np.float32), np.zeros(2, np.float32), "median")


def test_all_to_all_single_fast_path(pair):
    """A blocking all_to_all_single of two plain numpy arrays that share no
    memory is lent natively (`all_to_all_single_plain`), its split sizes
    counted in rows of each array's first dimension; splits that are not
    lists or tuples of ints, and arrays the pair fast path declines, are
    left to the general path, which gives the same results and words the
    errors."""
    w0, w1 = pair
    # Rows of 2 elements; rank 0 sends 1 row to itself and 2 to rank 1;
    # rank 1 sends 3 rows to rank 0 and 1 to itself.
    ins = [np.arange(6, dtype=np.int32).reshape(3, 2), 100 + np.arange(8, dtype=np.int32).reshape(4, 2)]
    outs = [np.zeros((4, 2), np.int32), np.zeros((3, 2), np.int32)]
    assert both(lambda: w0._w.all_to_all_single_plain(outs[0], ins[0], [1, 3], (1, 2)),
                lambda: w1._w.all_to_all_single_plain(outs[1], ins[1], (2, 1), [3, 1])) == [True, True]
    assert (outs[0] == np.concatenate([ins[0][:1], ins[1][:3]])).all()
    assert (outs[1] == np.concatenate([ins[0][1:], ins[1][3:]])).all()
    # Even splits (None), through the public call.
    even_in = [np.arange(4, dtype=np.float64) + 10 * r for r in range(2)]
    even_out = [np.zeros(4, np.float64) for _ in range(2)]
    both(lambda: w0.all_to_all_single(even_out[0], even_in[0]), lambda: w1.all_to_all_single(even_out[1], even_in[1]))
    assert (even_out[0] == [0, 1, 10, 11]).all() and (even_out[1] == [2, 3, 12, 13]).all()
    # Declined, nothing done: splits of another type or out of range, an
    # input inside the output, mixed dtypes, a strided output.
    x, y = np.zeros(4, np.float32), np.zeros(4, np.float32)
    for o, i, so, si in ((x, y, [2, 2.0], None), (x, y, None, [-1, 5]), (x, y, "22", None),
                         (x, y, np.array([2, 2]), None), (x, y, None, [2, 1 << 40]),
                         (x, x, None, None), (x, np.zeros(4, np.float64), None, None),
                         (np.zeros(8, np.float32)[::2], y, None, None), (x, y, [True, 3], None),
                         (np.zeros(4, bool), np.zeros(4, bool), None, None)):
        assert w0._w.all_to_all_single_plain(o, i, so, si) is False
    # The public call with declined splits (numpy ints) takes the general
    # path and agrees; a negative split is the general path's ValueError.
    gen = [np.zeros((4, 2), np.int32), np.zeros((3, 2), np.int32)]
    both(lambda: w0.all_to_all_single(gen[0], ins[0], np.array([1, 3]), np.array([1, 2])),
         lambda: w1.all_to_all_single(gen[1], ins[1], np.array([2, 1]), np.array([3, 1])))
    assert (gen[0] == outs[0]).all() and (gen[1] == outs[1]).all()
    with pytest.raises(ValueError, match="input_split_sizes"):
        w0.all_to_all_single(x, y, None, [-1, 5])
