"""dtype conversion, zero-copy paths, array rules."""

from __future__ import annotations

import functools
import time

import numpy as np
import pytest

import multiworld_rs as mw
from multiworld_rs import _tensors as T

from conftest import both

ALL = list(mw.DTYPES)
try:
    import ml_dtypes  # noqa: F401
except ImportError:  # pragma: no cover
    ALL.remove("bfloat16")


def sample(name: str, n: int = 7) -> np.ndarray:
    d = T.np_dtype(name)
    if name == "bool":
        return np.arange(n) % 3 == 0
    if name.startswith(("float", "bfloat")):
        return (np.arange(n) - 2.5).astype(d)
    info = np.iinfo(d)
    return np.array([info.min, info.max] + list(range(n - 2)), dtype=d)


@pytest.mark.parametrize("name", mw.DTYPES)
def test_np_dtype_names(name):
    if name == "bfloat16" and T.BFLOAT16 is None:
        pytest.skip("ml_dtypes not installed")
    assert T.np_dtype(name).name == name
    assert T.np_dtype("torch." + name).name == name


def test_np_dtype_refuses_unsupported():
    for bad in ("complex64", "object", "U4", "float128" if hasattr(np, "float128") else "complex128"):
        with pytest.raises(TypeError, match="unsupported dtype|not a dtype"):
            T.np_dtype(bad)
    with pytest.raises(TypeError, match="not a dtype"):
        T.np_dtype("no-such-type")


def test_send_view_is_zero_copy_for_contiguous():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    flat, name, shape = T.send_view(a)
    assert name == "float32" and shape == (3, 4)
    assert flat.dtype == np.uint8 and flat.nbytes == a.nbytes
    assert np.shares_memory(flat, a)


def test_send_view_copies_non_contiguous_and_byteswapped():
    a = np.arange(12, dtype=np.int32).reshape(3, 4)[:, ::2]
    flat, _, shape = T.send_view(a)
    assert shape == (3, 2) and not np.shares_memory(flat, a)
    assert (flat.view(np.int32) == a.reshape(-1)).all()
    b = np.arange(4, dtype=">f8")
    flat, name, _ = T.send_view(b)
    assert name == "float64" and (flat.view("<f8") == b).all()


def test_as_array_refuses_other_types():
    with pytest.raises(TypeError, match="list"):
        T.as_array([1, 2, 3])


def test_out_spec_refuses_read_only():
    a = np.zeros(3)
    a.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        T.out_spec(a)


def test_dlpack_objects_are_accepted():
    class Holder:  # an object that only speaks DLPack
        def __init__(self, a):
            self.a = a

        def __dlpack__(self, **kw):
            return self.a.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self.a.__dlpack_device__()

    a = np.arange(5, dtype=np.int16)
    arr = T.as_array(Holder(a))
    assert np.shares_memory(arr, a)


@pytest.mark.parametrize("name", ALL)
def test_every_dtype_roundtrips(pair, name):
    w0, w1 = pair
    x = sample(name).reshape(7, 1)
    _, got = both(lambda: w1.send(x, 0, tag=3), lambda: w0.recv(1, 3, dtype=name, shape=(7, 1)))
    assert got.dtype == x.dtype and got.shape == (7, 1)
    assert (got == x).all()
    # recv_into fills the caller's array (here a non-contiguous one).
    big = np.zeros((7, 2), dtype=x.dtype)
    _, src = both(lambda: w1.send(x, 0), lambda: w0.recv_into(big[:, 1:], 1))
    assert src == 1 and (big[:, 1:] == x).all() and not big[:, 0].any()


def test_received_array_owns_runtime_buffer(pair):
    w0, w1 = pair
    x = np.arange(1 << 16, dtype=np.float64)
    _, got = both(lambda: w1.send(x, 0), lambda: w0.recv(1, dtype=np.float64, shape=x.shape))
    # The result is a view of the flat array that took over the runtime's
    # buffer: nothing else holds it, and it is writeable.
    assert got.base is not None and got.base.flags.owndata is False
    # ... and that buffer is the runtime's Vec, kept alive by rust-numpy's
    # container object, not a numpy allocation a copy would have made.
    assert type(got.base.base).__name__ == "PySliceContainer"
    assert got.flags.writeable and got.flags.c_contiguous
    got[0] = 42.0
    assert (got[1:] == x[1:]).all()


def test_scalar_and_empty(pair):
    w0, w1 = pair
    s = np.float32(2.5)
    _, got = both(lambda: w1.send(s, 0), lambda: w0.recv(1, dtype="float32", shape=()))
    assert got.shape == () and got == 2.5
    e = np.zeros((0, 3), dtype=np.int8)
    _, got = both(lambda: w1.send(e, 0), lambda: w0.recv(1, dtype="int8", shape=(0, 3)))
    assert got.shape == (0, 3)


def test_torch_cpu_tensors(pair):
    torch = pytest.importorskip("torch", reason="torch is not installed in this venv (optional)")
    w0, w1 = pair
    t = torch.arange(6, dtype=torch.float32)
    out = torch.zeros(6)
    both(lambda: w1.send(t, 0), lambda: w0.recv_into(out, 1))
    assert torch.equal(out, t)


def test_recv_into_and_in_place_collectives_write_the_array_itself(pair):
    """recv_into, all_reduce and broadcast lend a C-contiguous array to the
    runtime for the call: every size and dtype gives exact results, a
    mismatched receive leaves the array untouched, and non-contiguous
    arrays take the copying path."""
    w0, w1 = pair
    for n, dtype in [(8, np.float32), (8, np.float32), (3, np.int64), (1000, np.float32), (5, np.bool_)]:
        x = (np.arange(n) % 2).astype(dtype) if dtype == np.bool_ else np.arange(n, dtype=dtype)
        out = np.zeros(n, dtype)
        _, src = both(lambda: w1.send(x, 0), lambda: w0.recv_into(out, 1))
        assert src == 1 and (out == x).all()
        a, b = x.copy(), x.copy()
        both(lambda: w0.all_reduce(a, "max"), lambda: w1.all_reduce(b, "max"))
        assert (a == x).all() and (b == x).all()
    keep = np.full(4, 7, np.int32)
    with pytest.raises(mw.MismatchError):
        both(lambda: w1.send(np.ones(5, np.int32), 0), lambda: w0.recv_into(keep, 1))
    assert (keep == 7).all()
    strided = np.zeros((4, 2), np.float64)[:, 0]  # not contiguous
    both(lambda: w1.send(np.arange(4.0), 0), lambda: w0.recv_into(strided, 1))
    assert (strided == np.arange(4.0)).all()
    base = np.arange(8.0).reshape(4, 2)
    s0, s1 = base[:, 0].copy(), base.copy()[:, 0]  # contiguous, and a strided view
    both(lambda: w0.all_reduce(s0), lambda: w1.all_reduce(s1))
    assert (s0 == 2 * base[:, 0]).all() and (s1 == 2 * base[:, 0]).all()
    for dtype in (np.float16, np.uint64, np.bool_):
        root, other = np.ones(6, dtype), np.zeros(6, dtype)
        both(lambda: w0.broadcast(root, 0), lambda: w1.broadcast(other, 0))
        assert (other == root).all() and other.dtype == dtype


def test_native_fast_paths_agree_with_the_general_ones(pair):
    """Plain numpy arrays go through send/recv_into natively; everything
    else (and every bad argument) through the Python layer, with the same
    results and the same errors."""
    w0, w1 = pair
    x = np.arange(12, dtype=np.int32).reshape(3, 4)
    # numpy integers as ranks and tags; src=None receives from anyone.
    out = np.zeros((3, 4), np.int32)
    _, src = both(lambda: w1.send(x, np.int64(0), tag=np.uint8(5)), lambda: w0.recv_into(out, None, 5))
    assert src == 1 and (out == x).all()
    # A byte-swapped array is converted (general path); so is a 0-d one.
    be = np.arange(5, dtype=">f8")
    got = np.zeros(5)
    both(lambda: w1.send(be, 0), lambda: w0.recv_into(got, 1))
    assert (got == np.arange(5.0)).all()
    scalar = np.zeros((), np.float32)
    both(lambda: w1.send(np.float32(1.5), 0), lambda: w0.recv_into(scalar, 1))
    assert scalar == 1.5
    empty = np.zeros((0, 2), np.int8)
    both(lambda: w1.send(np.zeros((0, 2), np.int8), 0), lambda: w0.recv_into(empty, 1))
    # A misaligned array (a float64 view one byte into a buffer) is copied into.
    raw = bytearray(8 * 3 + 1)
    odd = np.frombuffer(raw, dtype=np.float64, offset=1)
    assert not odd.flags.aligned
    both(lambda: w1.send(odd * 0 + 2.5, 0), lambda: w0.recv_into(odd, 1))
    assert (odd == 2.5).all()
    # Bad arguments raise the general path's errors, before anything is sent.
    with pytest.raises(TypeError, match="dst must be an int"):
        w1.send(x, True)
    with pytest.raises(ValueError, match="tag must be in"):
        w1.send(x, 0, tag=-1)
    with pytest.raises(TypeError, match="src must be an int"):
        w0.recv_into(out, 1.0)
    ro = np.zeros(4, np.int32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        w0.recv_into(ro, 1)
    # Nothing above left a message behind: the next one is the right one.
    _, src = both(lambda: w1.send(np.full(4, 9, np.int32), 0), lambda: w0.recv_into(out.reshape(-1)[:4], 1))
    assert src == 1 and (out.reshape(-1)[:4] == 9).all()


def test_a_lent_array_is_refused_to_a_second_call_until_it_is_given_back(pair):
    import threading

    w0, w1 = pair
    arr = np.zeros(1024, np.float32)
    got = []
    t = threading.Thread(target=lambda: got.append(w0.recv_into(arr, 1, tag=5)))
    t.start()
    deadline = time.monotonic() + 10
    # Wait until the receive holds the array: a probe for an (absent)
    # message on another tag is then refused its loan.
    while True:
        try:
            w0._w.recv_into_now(arr, 1, 6)
        except ValueError as e:
            assert "in use by another call" in str(e)
            break
        assert time.monotonic() < deadline, "the receive never took the array"
        time.sleep(0.001)
    with pytest.raises(ValueError, match="in use by another call"):
        w0.all_reduce(arr)
    with pytest.raises(ValueError, match="in use by another call"):
        w0.send(arr, 1, tag=7)
    with pytest.raises(ValueError, match="in use by another call"):
        w0.send(arr[10:20], 1, tag=7)  # any overlap
    w1.send(np.ones(1024, np.float32), 0, tag=5)
    t.join(10)
    assert got == [1] and (arr == 1).all()
    # Given back: usable again by any call.
    both(lambda: w1.send(np.full(1024, 3, np.float32), 0), lambda: w0.recv_into(arr, 1))
    assert (arr == 3).all()


def test_bool_arrays_with_any_bytes_can_be_received_into(pair):
    w0, w1 = pair
    junk = np.frombuffer(bytearray([7, 0, 255, 1]), dtype=np.bool_).copy()  # bytes numpy allows
    x = np.array([True, False, True, False])
    both(lambda: w1.send(x, 0), lambda: w0.recv_into(junk, 1))
    assert (junk == x).all() and junk.view(np.uint8).tolist() == [1, 0, 1, 0]


def test_irecv_into_a_plain_array_lends_it_until_the_operation_ends(pair):
    import sys

    w0, w1 = pair
    out = np.zeros(1 << 16, np.float32)
    before = sys.getrefcount(out)
    work = w0.irecv(out, 1)
    assert sys.getrefcount(out) > before  # the runtime holds the array meanwhile
    with pytest.raises(ValueError, match="in use by another call"):
        w0.recv_into(out, 1, tag=3)
    with pytest.raises(ValueError, match="in use by another call"):
        w0.send(out, 1, tag=3)
    x = np.arange(1 << 16, dtype=np.float32)
    w1.send(x, 0)
    assert work.wait(10) is out and work.source == 1 and (out == x).all()
    assert work.wait() is out  # again: the same result
    # Withdrawn before its message: the array is let go (usable at once),
    # not written, and the message goes to the next receive.
    keep = np.full(4, 5, np.int64)
    work = w0.irecv(keep, 1, tag=7)
    work._w.cancel()
    both(lambda: w1.send(np.arange(4, dtype=np.int64), 0, tag=7), lambda: w0.recv_into(keep, 1, tag=7))
    assert (keep == np.arange(4)).all()
    # A mismatch fails the handle, leaves the array as it was and lets it go.
    keep = np.full(3, 5, np.int16)
    work = w0.irecv(keep, 1, tag=8)
    w1.send(np.zeros(4, np.int16), 0, tag=8)
    with pytest.raises(mw.MismatchError):
        work.wait(10)
    assert (keep == 5).all()
    both(lambda: w1.send(np.ones(3, np.int16), 0), lambda: w0.recv_into(keep, 1))
    assert (keep == 1).all()


def test_an_irecv_handle_runs_without_a_task_and_a_cancel_reaches_its_waiter(pair):
    """A receive's handle is polled by whoever asks, not run by a task:
    ``is_completed`` turns true once the message is in, with no ``wait``;
    ``cancel`` from another thread ends a ``wait`` in progress at once, and
    the message sent after goes to the next receive."""
    import threading

    w0, w1 = pair
    for lent in (True, False):
        out = np.zeros(8, np.int32)
        work = w0.irecv(out, 1, tag=11) if lent else w0.irecv(None, 1, tag=11, dtype=np.int32, shape=8)
        assert not work.is_completed()
        w1.send(np.arange(8, dtype=np.int32), 0, tag=11)
        deadline = time.monotonic() + 10
        while not work.is_completed():
            assert time.monotonic() < deadline, "the handle never saw its message"
            time.sleep(0.001)
        assert (work.wait(0) == np.arange(8)).all() and work.source == 1
        # A wait in progress, cancelled from this thread.
        work = w0.irecv(out, 1, tag=12) if lent else w0.irecv(None, 1, tag=12, dtype=np.int32, shape=8)
        raised = []
        waiter = threading.Thread(target=lambda: raised.append(pytest.raises(RuntimeError, work.wait, 30)))
        waiter.start()
        time.sleep(0.05)  # the waiter is in wait() by now (if not, cancel ends it before)
        t0 = time.monotonic()
        work._w.cancel()
        waiter.join(10)
        assert not waiter.is_alive() and time.monotonic() - t0 < 5, "cancel did not reach the waiter"
        assert "cancelled" in str(raised[0].value)
        got = np.zeros(8, np.int32)
        both(lambda: w1.send(np.full(8, 3, np.int32), 0, tag=12), lambda: w0.recv_into(got, 1, tag=12))
        assert (got == 3).all(), "the message after the cancel was lost"


def test_dropping_an_irecv_handle_withdraws_its_receive_without_the_cycle_collector(pair):
    """Dropping a handle before its message withdraws the receive at once on
    every path: a lent plain array, a new array (``dtype``/``shape``) and a
    tensor that cannot be lent (strided). With the cycle collector off, a
    handle caught in a reference cycle would live on and its receive would
    take the next message; here the next receive gets it."""
    import gc

    w0, w1 = pair
    strided = np.zeros(16, np.int32)[::2]
    starts = {
        "lent": lambda tag: w0.irecv(np.zeros(8, np.int32), 1, tag=tag),
        "new array": lambda tag: w0.irecv(None, 1, tag=tag, dtype=np.int32, shape=8),
        "strided": lambda tag: w0.irecv(strided, 1, tag=tag),
    }
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for tag, (what, start) in enumerate(starts.items(), start=20):
            handle = start(tag)
            del handle
            got = np.zeros(8, np.int32)
            after = w0.irecv(got, 1, tag=tag)
            w1.send(np.full(8, tag, np.int32), 0, tag=tag)
            try:
                after.wait(10)
            except mw.WorldTimeoutError:
                pytest.fail(f"{what}: the dropped handle's receive took the message")
            assert (got == tag).all(), what
    finally:
        if was_enabled:
            gc.enable()


def test_a_received_irecv_left_unwaited_does_not_break_a_world_with_an_op_timeout():
    """With ``op_timeout``, a receive counts as done for its deadline when
    its message is in, whether or not anyone has waited on the handle yet."""
    from conftest import unique

    a, b = mw.WorldManager(), mw.WorldManager()
    store = a.serve_store("127.0.0.1:0")
    name = unique("op-timeout")
    try:
        w0, w1 = both(lambda: a.join(name, 0, 2, store, timeout=10, op_timeout=0.3),
                      lambda: b.join(name, 1, 2, store, timeout=10, op_timeout=0.3))
        for lent in (True, False):
            out = np.zeros(4, np.int32)
            work = w0.irecv(out, 1, tag=5) if lent else w0.irecv(None, 1, tag=5, dtype=np.int32, shape=4)
            w1.send(np.arange(4, dtype=np.int32), 0, tag=5)
            time.sleep(1.0)  # three deadlines' worth, the handle untouched
            assert w0.state == "ready", w0.cause
            assert (work.wait(5) == np.arange(4)).all()
    finally:
        a.shutdown()
        b.shutdown()


@pytest.mark.parametrize("name", ALL)
def test_aligned_arrays_start_on_64_bytes_and_are_received_into_in_place(pair, name):
    """zeros/empty give C-contiguous arrays on a 64-byte boundary (numpy puts
    large arrays 16 bytes into a page, where socket copies are slow); they
    are lent to the runtime like any plain array."""
    w0, w1 = pair
    for shape in [(0,), 5, (3, 7), (1 << 20,)]:
        z = mw.zeros(shape, name)
        e = mw.empty(shape, name)
        for a in (z, e):
            assert a.size == 0 or a.ctypes.data % mw.ALIGNMENT == 0
            assert a.flags.c_contiguous and type(a) is np.ndarray
            assert a.dtype == T.np_dtype(name)
            assert a.shape == ((shape,) if isinstance(shape, int) else shape)
        assert not z.astype(bool).any()
    x = np.resize(sample(name), 1 << 18)
    out = mw.zeros(x.shape, name)
    where = out.ctypes.data
    _, src = both(lambda: w1.send(x, 0), lambda: w0.recv_into(out, 1))
    assert src == 1 and out.ctypes.data == where
    assert out.tobytes() == x.tobytes()
    with pytest.raises(ValueError):
        mw.zeros((2, -1))
    with pytest.raises(TypeError):
        mw.empty(3, "complex64")


@pytest.mark.parametrize("name", ALL)
def test_large_results_come_back_aligned_without_a_copy(pair, name):
    """A large received or reduced result is the runtime's aligned buffer,
    handed to numpy as is: 64-byte aligned, exact, of the asked dtype and
    shape, writable, and alive after the call's other objects are gone."""
    w0, w1 = pair
    x = np.resize(sample(name), (64, 1 << 10))
    _, got = both(lambda: w1.send(x, 0), lambda: w0.recv(1, dtype=name, shape=x.shape))
    assert got.ctypes.data % mw.ALIGNMENT == 0
    assert got.dtype == x.dtype and got.shape == x.shape and got.tobytes() == x.tobytes()
    got[0, 0] = got[0, 1]  # writable, like any returned array
    small = np.resize(sample(name), 3)
    _, s = both(lambda: w1.send(small, 0), lambda: w0.recv(1, dtype=name, shape=(3,)))
    assert s.tobytes() == small.tobytes()
    if name != "bool":
        xa, xb = x.copy(), x.copy()
        a, b = both(lambda: w0.all_reduce(xa, "max", async_op=True).wait(),
                    lambda: w1.all_reduce(xb, "max", async_op=True).wait())
        assert a is xa and b is xb  # in place, as in the blocking form
        for r in (a, b):
            assert r.tobytes() == x.tobytes() and r.dtype == x.dtype


def test_in_place_collectives_in_the_background_work_on_the_array_itself(pair):
    """all_reduce, broadcast and reduce with async_op=True lend a plain
    array to the runtime until they end (no copy in or out): the runtime
    holds a reference meanwhile, another call is refused the array, wait()
    returns the array itself with the result in it; a reduce leaves the
    non-root's array as it was (blocking too); a strided or bool array
    takes the copying path with the same results."""
    import sys

    w0, w1 = pair
    n = 1 << 16
    a, b = np.arange(n, dtype=np.float32), np.full(n, 2, np.float32)
    before = sys.getrefcount(a)
    native = w0._w.all_reduce_lent(a, "sum")
    assert sys.getrefcount(a) > before  # the runtime holds the array until the call ends
    with pytest.raises(ValueError, match="in use by another call"):
        w0.send(a, 1, tag=3)
    with pytest.raises(ValueError, match="in use by another call"):
        w0.isend(a, 1, tag=3)  # a copy reads it too
    wb = w1.all_reduce(b, "sum", async_op=True)
    assert native.wait(10) is None and wb.wait(10) is b
    want = np.arange(n, dtype=np.float32) + 2
    assert (a == want).all() and (b == want).all()
    a[:] = 1
    wa = w0.all_reduce(a, "sum", async_op=True)
    b[:] = 2
    wb = w1.all_reduce(b, "sum", async_op=True)
    assert wa.wait(10) is a and wb.wait(10) is b and (a == 3).all()
    assert wa.wait() is a  # again: the same result
    w0.send(a, 1, tag=3)  # given back: usable by any call
    assert (w1.recv(0, dtype=np.float32, shape=n, tag=3) == 3).all()

    root, other = np.arange(10, dtype=np.int64), np.zeros(10, np.int64)
    works = both(lambda: w0.broadcast(root, 0, async_op=True), lambda: w1.broadcast(other, 0, async_op=True))
    assert works[0].wait(10) is root and works[1].wait(10) is other
    assert (other == np.arange(10)).all() and (root == np.arange(10)).all()

    for async_op in (True, False):
        r, x = np.full(6, 3, np.int32), np.full(6, 4, np.int32)
        works = both(lambda: w0.reduce(r, 1, "product", async_op=async_op),
                     lambda: w1.reduce(x, 1, "product", async_op=async_op))
        if async_op:
            assert works[0].wait(10) is r and works[1].wait(10) is x
        assert (x == 12).all(), (async_op, x)  # the root's: the result
        assert (r == 3).all(), (async_op, r)  # the other's: as it was

    # Not lendable: copied in and out, same results.
    src, strided = np.ones(4, np.float64), np.zeros((4, 2), np.float64)[:, 0]
    flags = np.array([True, False, True, False])
    works = both(lambda: w0.broadcast(src, 0, async_op=True), lambda: w1.broadcast(strided, 0, async_op=True))
    assert works[0].wait(10) is src and works[1].wait(10) is strided and (strided == 1).all()
    mine, theirs = flags.copy(), ~flags
    works = both(lambda: w0.all_reduce(mine, "max", async_op=True),
                 lambda: w1.all_reduce(theirs, "max", async_op=True))
    assert [w.wait(10) is t for w, t in zip(works, (mine, theirs))] == [True, True]
    assert mine.all() and theirs.all()


def test_all_gather_into_tensor_writes_the_output_array_itself(pair):
    """all_gather_into_tensor lends its output (blocking, and with async_op
    until the handle's operation ends): the result lands in the caller's
    array; the input may be a part of that same array (copied first)."""
    w0, w1 = pair
    n = 1 << 12
    outs = [np.zeros((2, n), np.float64) for _ in range(2)]
    for r, o in enumerate(outs):
        o[r] = np.arange(n) + 1000 * r
    both(lambda: w0.all_gather_into_tensor(outs[0], outs[0][0]),
         lambda: w1.all_gather_into_tensor(outs[1], outs[1][1]))
    want = np.stack([np.arange(n) + 1000 * r for r in range(2)])
    assert (outs[0] == want).all() and (outs[1] == want).all()

    o0, o1 = np.zeros(2 * n, np.int32), np.zeros((2, n), np.int32)
    w_0 = w0.all_gather_into_tensor(o0, np.full(n, 3, np.int32), async_op=True)
    with pytest.raises(ValueError, match="in use by another call"):
        w0.send(o0, 1, tag=4)
    w_1 = w1.all_gather_into_tensor(o1, np.full(n, 4, np.int32), async_op=True)
    assert w_0.wait(10) is o0 and w_1.wait(10) is o1
    assert (o0 == np.repeat([3, 4], n)).all() and (o1.reshape(-1) == o0).all()
    # An output of the wrong size: that member's call fails with
    # InvalidArgumentError (the other's matching call fails too), the arrays
    # are given back untouched, and the group stays in step.
    bad, good = np.zeros(3, np.int32), np.zeros(2 * n, np.int32)

    def call(w, out):
        try:
            w.all_gather_into_tensor(out, np.ones(n, np.int32))
        except mw.MultiworldError as e:
            return e

    e0, e1 = both(lambda: call(w0, bad), lambda: call(w1, good))
    assert isinstance(e0, mw.InvalidArgumentError) and isinstance(e1, mw.MultiworldError), (e0, e1)
    assert (bad == 0).all() and (good == 0).all()
    w0.send(bad, 1, tag=4)  # not lent any more
    assert w1.recv(0, dtype=np.int32, shape=3, tag=4).tolist() == [0, 0, 0]
    both(lambda: w0.all_gather_into_tensor(o0, np.full(n, 5, np.int32)),
         lambda: w1.all_gather_into_tensor(o1, np.full(n, 6, np.int32)))
    assert (o0 == np.repeat([5, 6], n)).all()


def test_reduce_scatter_tensor_and_all_gather_into_tensor_take_any_input_in_place(pair):
    """The blocking reduce_scatter_tensor and all_gather_into_tensor write
    the caller's output and read the caller's input where they can (read-only,
    misaligned, bool and overlapping inputs included), exactly."""
    w0, w1 = pair
    n = 1 << 10
    ro = np.arange(2 * n, dtype=np.int64)
    ro.flags.writeable = False
    raw = bytearray(8 * 2 * n + 1)
    odd = np.frombuffer(raw, dtype=np.int64, offset=1)  # misaligned, copied
    odd[:] = 1
    o0, o1 = np.zeros(n, np.int64), np.zeros(n, np.int64)
    both(lambda: w0.reduce_scatter_tensor(o0, ro, "sum"), lambda: w1.reduce_scatter_tensor(o1, odd, "sum"))
    assert (o0 == np.arange(n) + 1).all() and (o1 == np.arange(n, 2 * n) + 1).all()
    # The output is a part of the input: the input is read as it was.
    b0, b1 = np.arange(2 * n, dtype=np.float32), np.ones(2 * n, np.float32)
    both(lambda: w0.reduce_scatter_tensor(b0[:n], b0, "max"), lambda: w1.reduce_scatter_tensor(b1[n:], b1, "max"))
    assert (b0[:n] == np.maximum(np.arange(n), 1)).all() and (b1[n:] == np.arange(n, 2 * n)).all()
    # all_gather_into_tensor from a read-only input.
    g0, g1 = np.zeros(4 * n, np.int64), np.zeros(4 * n, np.int64)
    both(lambda: w0.all_gather_into_tensor(g0, ro), lambda: w1.all_gather_into_tensor(g1, ro))
    assert (g0 == np.tile(np.arange(2 * n), 2)).all() and (g1 == g0).all()


def test_all_to_all_single_writes_the_output_and_reads_the_input_in_place(pair):
    """The blocking all_to_all_single lends its output and its input (a
    read-only one too), even and uneven splits; an output that is the
    input itself gets what the input held before."""
    w0, w1 = pair
    ro = np.array([[0, 0], [1, 1], [2, 2]], np.int32)
    ro.flags.writeable = False
    mine = np.array([[10, 10], [11, 11], [12, 12], [13, 13]], np.int32)
    o0, o1 = np.zeros((2, 2), np.int32), np.zeros((5, 2), np.int32)
    # Rank 0 sends 1 row to itself and 2 to rank 1; rank 1 sends 1 to rank 0 and 3 to itself.
    both(lambda: w0.all_to_all_single(o0, ro, [1, 1], [1, 2]),
         lambda: w1.all_to_all_single(o1, mine, [2, 3], [1, 3]))
    assert o0.tolist() == [[0, 0], [10, 10]]
    assert o1.tolist() == [[1, 1], [2, 2], [11, 11], [12, 12], [13, 13]]
    a, b = np.arange(4, dtype=np.float64), np.arange(4, 8, dtype=np.float64)
    both(lambda: w0.all_to_all_single(a, a), lambda: w1.all_to_all_single(b, b))
    assert a.tolist() == [0.0, 1.0, 4.0, 5.0] and b.tolist() == [2.0, 3.0, 6.0, 7.0]


def test_an_empty_view_of_a_lent_array_is_not_in_use(pair):
    """No byte, nothing to race over: an empty view of an array lent to a
    background collective may be sent meanwhile, and lent itself."""
    w0, w1 = pair
    a, b = np.ones(1 << 12, np.float32), np.ones(1 << 12, np.float32)
    wa = w0.all_reduce(a, "sum", async_op=True)
    w0.send(a[5:5], 1, tag=6)  # an empty message, not a ValueError
    assert w1.recv(0, dtype=np.float32, shape=0, tag=6).size == 0
    with pytest.raises(ValueError, match="in use by another call"):
        w0.send(a[5:6], 1, tag=6)  # one byte in is in use
    wb = w1.all_reduce(b, "sum", async_op=True)
    assert wa.wait(10) is a and wb.wait(10) is b and (a == 2).all()


def test_background_all_to_all_single_and_reduce_scatter_tensor_write_the_output_in_place(pair):
    """With async_op=True, all_to_all_single and reduce_scatter_tensor copy
    their input at the call (the caller may change it at once) and write
    the caller's output itself, lent until the operation ends."""
    w0, w1 = pair
    a, b = np.arange(4, dtype=np.float64), np.arange(4, 8, dtype=np.float64)
    wa = w0.all_to_all_single(a, a, async_op=True)  # the output is the input itself
    with pytest.raises(ValueError, match="in use by another call"):
        w0.send(a, 1, tag=8)
    wb = w1.all_to_all_single(b, b, async_op=True)
    assert wa.wait(10) is a and wb.wait(10) is b
    assert a.tolist() == [0.0, 1.0, 4.0, 5.0] and b.tolist() == [2.0, 3.0, 6.0, 7.0]
    i0, i1 = np.arange(6, dtype=np.int32), np.full(6, 10, np.int32)
    o0, o1 = np.zeros(3, np.int32), np.zeros(3, np.int32)
    works = both(lambda: w0.reduce_scatter_tensor(o0, i0, "sum", async_op=True),
                 lambda: w1.reduce_scatter_tensor(o1, i1, "sum", async_op=True))
    i0[:] = -1  # copied at the call: changing it now changes nothing
    assert works[0].wait(10) is o0 and works[1].wait(10) is o1
    assert o0.tolist() == [10, 11, 12] and o1.tolist() == [13, 14, 15]


def _in_use(w, arr) -> bool:
    """Whether ``arr`` is lent to a call of ``w``'s member: a probe that
    would write it (a receive of a message on tag 6, of which there is
    none) is refused."""
    try:
        assert w._w.recv_into_now(arr, 1, 6) is None
        return False
    except ValueError as e:
        assert "in use by another call" in str(e)
        return True


@pytest.mark.parametrize("op", ["all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"])
def test_blocking_tensor_collectives_lend_their_output_and_their_input(pair, op):
    """While rank 0's blocking call waits for rank 1, its output is lent for
    writing and its input for reading: a receive into either is refused
    (a probe that would write them); both are given back when the call
    returns. bool arrays are never lent to a background collective."""
    import threading

    w0, w1 = pair
    n = 1 << 10
    in_n, out_n = {"all_gather_into_tensor": (n, 2 * n), "reduce_scatter_tensor": (2 * n, n),
                   "all_to_all_single": (2 * n, 2 * n)}[op]
    ins = [np.full(in_n, r + 1, np.float32) for r in range(2)]
    outs = [np.zeros(out_n, np.float32) for _ in range(2)]
    t = threading.Thread(target=lambda: getattr(w0, op)(outs[0], ins[0]))
    t.start()

    in_use = functools.partial(_in_use, w0)

    deadline = time.monotonic() + 10
    while not in_use(outs[0]):
        assert time.monotonic() < deadline, "the call never took its output"
        time.sleep(0.001)
    assert in_use(ins[0]), "the input is lent for reading"
    getattr(w1, op)(outs[1], ins[1])
    t.join(10)
    assert not in_use(outs[0]) and not in_use(ins[0])
    if op == "reduce_scatter_tensor":
        assert (outs[0] == 3).all() and (outs[1] == 3).all()
    else:
        assert (outs[0].reshape(2, -1) == [[1], [2]]).all() and (outs[1] == outs[0]).all()
    assert w0._w.all_reduce_lent(np.zeros(4, np.bool_), "max") is None
    assert w0._w.all_to_all_single_lent(np.zeros(4, np.bool_), (np.zeros(4, np.uint8), "bool", [4]),
                                        (None, None)) is None


def test_all_gather_into_a_list_lends_every_array(pair):
    """The blocking all_gather writes every array of the list in place and
    reads the input where it lies: while rank 0's call waits for rank 1,
    a probe that would write any of them is refused. Views of one buffer
    work (disjoint ones lent, overlapping ones copied)."""
    import threading

    w0, w1 = pair
    n = 1 << 10
    ins = [np.full(n, r + 1, np.int64) for r in range(2)]
    outs = [[np.zeros(n, np.int64) for _ in range(2)] for _ in range(2)]
    t = threading.Thread(target=lambda: w0.all_gather(outs[0], ins[0]))
    t.start()

    in_use = functools.partial(_in_use, w0)

    deadline = time.monotonic() + 10
    while not in_use(outs[0][1]):
        assert time.monotonic() < deadline, "the call never took its outputs"
        time.sleep(0.001)
    assert in_use(outs[0][0]) and in_use(ins[0])
    w1.all_gather(outs[1], ins[1])
    t.join(10)
    assert not any(in_use(a) for a in outs[0] + [ins[0]])
    for o in outs:
        assert (o[0] == 1).all() and (o[1] == 2).all()
    # Disjoint views of one buffer (lent), and overlapping ones (copied).
    base, other = np.zeros(2 * n, np.int64), np.zeros(n + 1, np.int64)
    both(lambda: w0.all_gather([base[:n], base[n:]], ins[0]),
         lambda: w1.all_gather([other[:n], other[1:]], ins[1]))
    assert (base == np.repeat([1, 2], n)).all()
    assert other[0] == 1 and (other[1:] == 2).all()


def test_gather_and_scatter_lend_their_arrays(pair):
    """The blocking gather and scatter write the root's list (gather) or
    each member's output (scatter) in place and read the inputs where they
    lie: while the root's call waits for the other member, a probe that
    would write any of its arrays is refused; the results are exact."""
    import threading

    w0, w1 = pair
    n = 1 << 10
    in_use = functools.partial(_in_use, w0)
    for op in ("gather", "scatter"):
        mine = [np.full(n, 1, np.int32), np.full(n, 2, np.int32)]  # rank 0's list
        single = np.full(n, 7, np.int32) if op == "gather" else np.zeros(n, np.int32)
        if op == "gather":
            t = threading.Thread(target=lambda: w0.gather(single, mine, dst=0))
        else:
            t = threading.Thread(target=lambda: w0.scatter(single, mine, src=0))
        t.start()
        deadline = time.monotonic() + 10
        while not in_use(single):
            assert time.monotonic() < deadline, f"{op} never took its arrays"
            time.sleep(0.001)
        assert in_use(mine[0]) and in_use(mine[1])
        other = np.full(n, 8, np.int32) if op == "gather" else np.zeros(n, np.int32)
        if op == "gather":
            w1.gather(other, None, dst=0)
        else:
            w1.scatter(other, None, src=0)
        t.join(10)
        assert not any(in_use(a) for a in mine + [single])
        if op == "gather":
            assert (mine[0] == 7).all() and (mine[1] == 8).all() and (other == 8).all()
        else:
            assert (single == 1).all() and (other == 2).all()


def test_reduce_scatter_and_all_to_all_of_lists_lend_their_arrays(pair):
    """The blocking reduce_scatter and all_to_all of lists write the
    output(s) in place and read the inputs where they lie: while rank 0's
    call waits for rank 1, a probe that would write any of its arrays is
    refused; the results are exact. Overlapping arrays (an input that is a
    view of the output) take the copying path, with the same results."""
    import threading

    w0, w1 = pair
    n = 1 << 10
    in_use = functools.partial(_in_use, w0)
    for op in ("reduce_scatter", "all_to_all"):
        ins = [[np.full(n, 10 * r + q, np.int64) for q in range(2)] for r in range(2)]
        if op == "reduce_scatter":
            outs = [np.zeros(n, np.int64) for _ in range(2)]
            mine = [outs[0]]
        else:
            outs = [[np.zeros(n, np.int64) for _ in range(2)] for _ in range(2)]
            mine = outs[0]
        t = threading.Thread(target=lambda: getattr(w0, op)(outs[0], ins[0]))
        t.start()
        deadline = time.monotonic() + 10
        while not in_use(mine[-1]):
            assert time.monotonic() < deadline, f"{op} never took its arrays"
            time.sleep(0.001)
        assert all(in_use(a) for a in mine + ins[0]), op
        getattr(w1, op)(outs[1], ins[1])
        t.join(10)
        assert not t.is_alive(), op
        assert not any(in_use(a) for a in mine + ins[0]), op
        if op == "reduce_scatter":
            assert (outs[0] == 0 + 10).all() and (outs[1] == 1 + 11).all()
        else:
            for r in range(2):
                assert [int(o[0]) for o in outs[r]] == [r, 10 + r] and all((o == o[0]).all() for o in outs[r])
    # An input that is a view of the output: copied, exact.
    buf0, buf1 = np.arange(2 * n, dtype=np.int64), np.arange(2 * n, dtype=np.int64)
    both(lambda: w0.reduce_scatter(buf0[:n], [buf0[:n], buf0[n:]]),
         lambda: w1.reduce_scatter(buf1[n:], [buf1[:n], buf1[n:]]))
    assert (buf0[:n] == 2 * np.arange(n)).all() and (buf1[n:] == 2 * np.arange(n, 2 * n)).all()


@pytest.mark.parametrize("op", ["all_gather", "gather", "scatter", "reduce_scatter", "all_to_all"])
def test_list_collectives_in_the_background_write_their_outputs_in_place(pair, op):
    """With async_op=True, the collectives of lists copy their inputs at the
    call (the caller may change them at once) and write the caller's own
    output arrays, lent until the operation ends: meanwhile a probe that
    would write an output is refused; wait() returns the caller's list (or
    array) with the result in it. Outputs that share memory, and bool
    outputs, take the copying path with the same results."""
    w0, w1 = pair
    n = 1 << 10
    in_use = functools.partial(_in_use, w0)

    k = 1 if op in ("scatter", "reduce_scatter") else 2  # outputs per member

    def run(dtype, outs_of):
        """Starts rank 0's call, then rank 1's; returns both handles, the
        outputs, what they should hold, and whether rank 0's outputs were
        in use between the two calls (rank 0's cannot end before rank 1's
        has started)."""
        ins = [[np.full(n, 10 * r + q, dtype) for q in range(2)] for r in range(2)]
        one = [np.full(n, 5 + r, dtype) for r in range(2)]
        outs = [outs_of(r) for r in range(2)]
        call = {
            "all_gather": lambda w, r: w.all_gather(outs[r], one[r], async_op=True),
            "gather": lambda w, r: w.gather(one[r], outs[r] if r == 0 else None, 0, async_op=True),
            "scatter": lambda w, r: w.scatter(outs[r][0], ins[r] if r == 0 else None, 0, async_op=True),
            "reduce_scatter": lambda w, r: w.reduce_scatter(outs[r][0], ins[r], async_op=True),
            "all_to_all": lambda w, r: w.all_to_all(outs[r], ins[r], async_op=True),
        }[op]
        works = [call(w0, 0)]
        held = [in_use(a) for a in outs[0][:k]]
        # Copied at the call: changing them now changes nothing.
        saved = [a.copy() for a in ins[0] + [one[0]]]
        for a in ins[0] + [one[0]]:
            a[:] = 0 if dtype == np.bool_ else 99
        works.append(call(w1, 1))
        for a, s in zip(ins[0] + [one[0]], saved):
            a[:] = s
        want = {
            "all_gather": lambda r: [one[0], one[1]],
            "gather": lambda r: [one[0], one[1]] if r == 0 else [np.zeros(n, dtype)] * 2,
            "scatter": lambda r: [ins[0][r]],
            "reduce_scatter": lambda r: [ins[0][r] + ins[1][r]],
            "all_to_all": lambda r: [ins[0][r], ins[1][r]],
        }[op]
        return works, outs, want, held

    # Separate int32 arrays: lent.
    works, outs, want, held = run(np.int32, lambda r: [np.zeros(n, np.int32) for _ in range(2)])
    assert held == [True] * k, "the outputs are the call's until it ends"
    got = [w.wait(10) for w in works]
    assert not any(in_use(a) for a in outs[0][:k])
    for r in range(2):
        if op in ("scatter", "reduce_scatter"):
            assert got[r] is outs[r][0]
        elif op != "gather" or r == 0:
            assert got[r] is outs[r]
        for o, w in zip(outs[r][:k], want(r)):
            assert np.array_equal(o, w), (op, r, o[:4], w[:4])

    # Views of one buffer that overlap (copied), and bool arrays (copied).
    if op in ("all_gather", "gather", "all_to_all"):
        def overlapping(r):
            b = np.zeros(n + 1, np.int32)
            return [b[:n], b[1:]]
        works, outs, want, held = run(np.int32, overlapping)
        assert held == [False, False]
        got = [w.wait(10) for w in works]
        assert got[0] is outs[0] and np.array_equal(outs[0][1], want(0)[1])
    works, outs, want, held = run(np.bool_, lambda r: [np.zeros(n, np.bool_) for _ in range(2)])
    assert held == [False] * k
    got = [w.wait(10) for w in works]
    for o, w in zip(outs[0][:k], want(0)):
        assert np.array_equal(o, w.astype(np.bool_)), op


def test_an_array_held_by_a_blocking_collective_is_refused_to_other_threads_with_value_error(pair):
    """While a blocking in-place collective holds an array (rank 0's
    all_reduce waits for rank 1), another thread's call that would read or
    write it, by any path (copied, lent, in a list), gets the registry's
    ValueError naming the conflict, not a TypeError of the array library."""
    import threading

    w0, w1 = pair
    n = 1024
    arr = np.ones(n, np.float32)
    t = threading.Thread(target=lambda: w0.all_reduce(arr))
    t.start()
    deadline = time.monotonic() + 10
    while not _in_use(w0, arr):
        assert time.monotonic() < deadline, "the all_reduce never took the array"
        time.sleep(0.001)
    other = np.zeros(n, np.float32)
    calls = {
        "isend (copies)": lambda: w0.isend(arr, 1, tag=5),
        "blocking broadcast": lambda: w0.broadcast(arr, 0),
        "background broadcast": lambda: w0.broadcast(arr, 0, async_op=True),
        "all_gather input": lambda: w0.all_gather([other, other.copy()], arr),
        "all_gather output": lambda: w0.all_gather([arr, other], other.copy()),
        "reduce_scatter input": lambda: w0.reduce_scatter(other, [arr, other.copy()]),
        "scatter output": lambda: w0.scatter(arr, [other, other.copy()], 0),
    }
    for what, call in calls.items():
        # On a thread of its own: a probe wrongly let through would wait for
        # rank 1 instead of failing.
        got = []

        def probe():
            try:
                call()
                got.append(None)
            except Exception as e:  # noqa: BLE001 - reported below
                got.append(e)

        p = threading.Thread(target=probe, daemon=True)
        p.start()
        p.join(10)
        assert got, f"{what} took the array and waits"
        assert isinstance(got[0], ValueError) and "in use by another call" in str(got[0]), (what, got[0])
    w1.all_reduce(np.ones(n, np.float32))
    t.join(10)
    assert not t.is_alive() and (arr == 2).all()


def test_a_blocking_send_holds_its_array_for_reading_until_it_returns(pair):
    """A blocking send reads the caller's array with the GIL released: while
    it runs (rank 1 not receiving yet, 64 MiB: more than the sockets hold),
    calls that would write the array from another thread (a receive into
    it, a collective in the background) are refused, and it arrives
    intact."""
    import threading

    w0, w1 = pair
    arr = np.arange(16 << 20, dtype=np.float32)
    t = threading.Thread(target=lambda: w0.send(arr, 1, tag=3))
    t.start()
    deadline = time.monotonic() + 10
    while not _in_use(w0, arr):
        assert time.monotonic() < deadline, "the send never registered its array"
        time.sleep(0.001)
    with pytest.raises(ValueError, match="in use by another call"):
        w0.all_reduce(arr, async_op=True)
    with pytest.raises(ValueError, match="in use by another call"):
        w0.all_gather([arr[:8], np.zeros(8, np.float32)], np.zeros(8, np.float32), async_op=True)
    got = w1.recv(0, tag=3, dtype=np.float32, shape=arr.shape)
    t.join(10)
    assert not t.is_alive() and np.array_equal(got, arr)
    assert not _in_use(w0, arr)


def test_any_overlap_of_long_lists_agrees_with_every_pair():
    """Lists of more than 8 arrays (a collective of many members) are checked
    by sorted byte bounds instead of every pair: the same answer as the
    pairwise check, on views of one buffer (strided, empty, overlapping or
    not) mixed with separate arrays."""
    import random

    from multiworld_rs._api import _any_overlap, _may_overlap

    rng = random.Random(7)
    base = np.zeros(4096, np.uint8)
    seen = set()
    for _ in range(2000):
        arrays = []
        for _ in range(rng.randint(9, 20)):
            lo, n, step = rng.randrange(0, 4000), rng.randint(0, 60), rng.choice([1, 1, 2, 3])
            arrays.append(base[lo:lo + n:step] if rng.random() < 0.9 else np.zeros(n + 1, np.uint8))
        want = any(_may_overlap(a, b) for i, a in enumerate(arrays) for b in arrays[i + 1:])
        assert _any_overlap(arrays) == want
        seen.add(want)
    assert seen == {True, False}
    apart = [np.zeros(8, np.float32) for _ in range(64)]
    assert not _any_overlap(apart) and _any_overlap(apart + [apart[5][2:4]])


@pytest.mark.parametrize("op", ["all_gather", "all_to_all", "reduce_scatter"])
def test_a_lent_background_collective_whose_peer_breaks_raises_and_gives_its_arrays_back(pair, op):
    """Rank 0 starts a list collective with async_op=True (its outputs lent
    to the runtime), then rank 1 aborts instead of joining the call: rank
    0's wait() raises BrokenWorldError within the transport's bound, not a
    hang, and the arrays are given back (usable by any call again)."""
    w0, w1 = pair
    n = 1 << 12
    outs = [np.zeros(n, np.int32) for _ in range(2)]
    ins = [np.ones(n, np.int32) for _ in range(2)]
    if op == "all_gather":
        work = w0.all_gather(outs, ins[0], async_op=True)
    elif op == "all_to_all":
        work = w0.all_to_all(outs, ins, async_op=True)
    else:
        work = w0.reduce_scatter(outs[0], ins, async_op=True)
    lent = outs if op != "reduce_scatter" else outs[:1]
    assert all(_in_use(w0, a) for a in lent)
    start = time.monotonic()
    w1.abort()
    with pytest.raises(mw.BrokenWorldError) as info:
        work.wait(10)
    assert time.monotonic() - start < 5, "the broken call took too long to fail"
    assert info.value.cause in ("peer_lost", "reported_by_peer"), info.value
    for a in lent:
        # Given back: a receive may lend it again (the world is broken, so
        # the probe's call itself fails, but not for the array).
        with pytest.raises(mw.BrokenWorldError):
            w0._w.recv_into_now(a, 1, 6)


def test_a_handle_whose_wait_raised_is_collected_with_what_it_holds(pair):
    """A Work keeps its outcome for later waits; when that outcome is an
    error, the error's traceback holds the frames that hold the handle, a
    reference cycle through the native handle. The garbage collector sees
    it: once the handle is dropped, the array it lent is free again (no
    reference left), whichever way the wait failed."""
    import gc
    import sys

    w0, w1 = pair
    arrays = [np.zeros(1000, np.float32) for _ in range(2)]
    held = [sys.getrefcount(a) for a in arrays]
    works = [w0.all_reduce(arrays[0], async_op=True), w0.irecv(arrays[1], 1, tag=9)]
    w1.abort()
    for work in works:
        for _ in range(2):  # the kept outcome, raised again
            with pytest.raises(mw.BrokenWorldError):
                work.wait(10)
    del works, work
    gc.collect()
    assert [sys.getrefcount(a) for a in arrays] == held


def test_half_floats_of_the_other_byte_order_arrive_as_sent(pair):
    """float16 in big-endian order (``>f2``): received into, reduced in place
    and received as a new array, every value arrives as sent (the runtime's
    native-order bits are converted, not reinterpreted)."""
    w0, w1 = pair
    x = np.array([1.5, 2.0, -3.25], np.float16)
    out = np.zeros(3, ">f2")
    both(lambda: w1.send(x, 0), lambda: w0.recv_into(out, 1))
    assert out.dtype == np.dtype(">f2") and out.tolist() == [1.5, 2.0, -3.25]
    got = both(lambda: w1.send(x, 0, tag=1), lambda: w0.recv(1, tag=1, dtype=">f2", shape=3))[1]
    assert got.dtype == np.dtype(">f2") and got.tolist() == [1.5, 2.0, -3.25]
    a, b = np.array([1.0, 2.0], ">f2"), np.array([1.0, 2.0], np.float16)
    both(lambda: w0.all_reduce(a), lambda: w1.all_reduce(b))
    assert a.tolist() == [2.0, 4.0] and b.tolist() == [2.0, 4.0]


def test_an_output_whose_elements_share_memory_is_refused(pair):
    """An output with a stride of 0 (torch's ``expand`` gives writeable ones)
    has one place for several elements: refused with ``ValueError`` before
    anything runs, as torch refuses in-place writes to it, rather than left
    holding the last element everywhere."""
    w0, _ = pair
    shared = np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), shape=(3,), strides=(0,),
                                             writeable=True)
    with pytest.raises(ValueError, match="share memory"):
        w0.recv_into(shared, 1)
    with pytest.raises(ValueError, match="share memory"):
        w0.all_reduce(shared)


def test_object_lists_follow_torch(pair):
    """``broadcast_object_list`` leaves the source's list and objects as
    they are and fills the others' (a list of another length is a
    ``ValueError`` there, once every member took part, and is left as it
    was); ``gather_object`` needs its list on the destination, like
    ``gather``."""
    w0, w1 = pair
    obj = {"k": 1}
    l0, l1 = [obj, "x"], [None, None]
    both(lambda: w0.broadcast_object_list(l0, 0), lambda: w1.broadcast_object_list(l1, 0))
    assert l0[0] is obj and l0 == [{"k": 1}, "x"]
    assert l1 == [{"k": 1}, "x"]

    def caught(call):
        try:
            call()
        except ValueError as e:
            return e
        return None

    longer = [None, None, None]
    got = both(lambda: caught(lambda: w0.broadcast_object_list(l0, 0)),
               lambda: caught(lambda: w1.broadcast_object_list(longer, 0)))
    assert got[0] is None and "holds 3" in str(got[1]), got
    assert longer == [None, None, None]
    with pytest.raises(ValueError, match="object_gather_list is required"):
        w0.gather_object("x", None, 0)


def test_a_scalar_output_is_refused_not_written_and_lost(pair):
    # A numpy scalar has no memory of its own: a result "written" into it
    # would be lost, so it is refused as an output, naming it.
    w0, w1 = pair
    with pytest.raises(TypeError, match="scalar"):
        w0.recv_into(np.float32(0), 1)
    with pytest.raises(TypeError, match="scalar"):
        w0.all_reduce(np.float32(3))
    # The world is fine: a message still goes through.
    out = np.zeros(1, np.float32)
    both(lambda: w1.send(np.ones(1, np.float32), 0), lambda: w0.recv_into(out, 1))
    assert out[0] == 1


@pytest.mark.parametrize("shape", [(2.7,), "12", (True, 2), 2.0, None, np.array(2.5)])
def test_a_shape_that_is_not_ints_is_refused_naming_it(pair, shape):
    w0, _ = pair
    with pytest.raises(TypeError, match="shape"):
        w0.recv(1, dtype="float32", shape=shape)
    with pytest.raises(TypeError, match="shape"):
        mw.zeros(shape, "float32")


def test_a_0d_integer_array_is_a_shape_of_one_dimension(pair):
    w0, _ = pair
    assert mw.zeros(np.array(3), "float32").shape == (3,)


def test_all_to_all_single_takes_empty_split_lists_as_even_splits(pair):
    # torch passes "no splits" as empty lists.
    w0, w1 = pair
    inputs = [np.arange(4, dtype=np.float32) + 10 * r for r in range(2)]
    outs = [np.zeros(4, np.float32) for _ in range(2)]
    both(lambda: w0.all_to_all_single(outs[0], inputs[0], [], []),
         lambda: w1.all_to_all_single(outs[1], inputs[1], [], []))
    assert outs[0].tolist() == [0, 1, 10, 11] and outs[1].tolist() == [2, 3, 12, 13]


def test_a_dlpack_output_that_numpy_makes_read_only_is_refused_saying_why(pair):
    # A producer without versioned DLPack: numpy makes its view read-only, so
    # it cannot be an output; the error says so instead of a bare read-only.
    w0, w1 = pair

    class Old:
        def __init__(self, a):
            self.a = a

        def __dlpack__(self, stream=None):
            return self.a.__dlpack__()

        def __dlpack_device__(self):
            return self.a.__dlpack_device__()

    buf = np.zeros(3, np.float32)
    if T.as_array(Old(buf)).flags.writeable:
        pytest.skip("this numpy gives a writeable view of an unversioned producer")
    with pytest.raises(ValueError, match="__dlpack__"):
        w0.recv_into(Old(buf), 1)
