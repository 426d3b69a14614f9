"""The NCCL path of the nccl build without a GPU (test_cuda.py): a world of
one joined with backend="nccl" on the test kit's fake CUDA driver and NCCL
(NCCL_LIBRARY / CUDA_DRIVER_LIBRARY point at them; their "device memory" is
host memory), driven with stand-in CUDA tensors over numpy arrays whose
data_ptr() is the array's address. Prints "ok" when every check passed.

The fake completes collectives of a world of one only, so results are
checked out of place (into poisoned outputs) where that tells a written
result from an untouched buffer; values combined across ranks are the GPU
test's (cuda_nccl_worker.py)."""

import sys

import numpy as np

import multiworld_rs as mw
from multiworld_rs import _device as D
from multiworld_rs import aio

POISON = -12345.0


class Dev:
    type = "cuda"

    def __init__(self, index: int) -> None:
        self.index = index

    def __str__(self) -> str:
        return f"cuda:{self.index}"


class DType:
    def __init__(self, np_dtype: np.dtype) -> None:
        self.np = np.dtype(np_dtype)

    def __str__(self) -> str:
        return "torch." + self.np.name


class Fake:
    """A CUDA tensor as the package sees one (module "torch...")."""

    def __init__(self, a, dtype=np.float32, index: int = 0) -> None:
        self.a = np.asarray(a, dtype=dtype)
        self.device = Dev(index)
        self.dtype = DType(self.a.dtype)

    shape = property(lambda self: self.a.shape)

    def data_ptr(self) -> int:
        return self.a.ctypes.data

    def numel(self) -> int:
        return self.a.size

    def is_contiguous(self) -> bool:
        return self.a.flags.c_contiguous

    def contiguous(self) -> "Fake":
        return Fake(np.ascontiguousarray(self.a), self.a.dtype, self.device.index)

    def detach(self) -> "Fake":
        return self

    def element_size(self) -> int:
        return self.a.itemsize

    def new_empty(self, shape, device=None, pin_memory=False):
        if device is None:  # on this tensor's device: the list forms' flat tensors
            return Fake(np.full(shape, POISON, self.a.dtype), self.a.dtype, self.device.index)
        staged.append(self)
        return Host(np.empty(shape, self.a.dtype))

    def narrow(self, dim: int, start: int, length: int) -> "Fake":
        assert dim == 0 and self.a.ndim == 1
        return Fake(self.a[start:start + length], self.a.dtype, self.device.index)  # a view

    def view(self, shape) -> "Fake":
        v = self.a.view()
        v.shape = tuple(shape)  # raises rather than copy
        return Fake(v, self.a.dtype, self.device.index)

    def copy_(self, other) -> "Fake":
        np.copyto(self.a, other.a)  # from a host tensor, or another Fake
        return self


class Cpu:
    type = "cpu"


class Host:
    """A host tensor of host staging: a CPU "torch" tensor over a numpy
    array (``detach().numpy()`` is a plain array); copies from a Fake."""

    def __init__(self, a) -> None:
        self.a = a
        self.device = Cpu()
        self.dtype = a.dtype

    def detach(self) -> "Host":
        return self

    def numpy(self):
        return self.a

    def copy_(self, src: Fake) -> "Host":
        np.copyto(self.a, src.a)
        return self


Host.__module__ = "torch.fake_host"


Fake.__module__ = "torch.fake"
syncs = []
staged = []  # the tensors host staging was asked to copy
# No torch here: record the ordering, and order after the legacy default
# stream (0) through the native call.
D._order = lambda nccl, t: (syncs.append(t), nccl.after_stream(0))


def refused(exc, f) -> None:
    try:
        f()
    except exc:
        return
    raise AssertionError(f"{f} was not refused with {exc.__name__}")


assert mw.NCCL_BUILT

with mw.WorldManager() as m:
    store = m.serve_store("127.0.0.1:0")
    w = m.join("fake-nccl", 0, 1, store, backend="nccl", device=0, timeout=20, op_timeout=20)
    n = D.nccl_of(w)
    assert n is not None and n.device == 0 and D.nccl_of(w) is n

    # In-place collectives of a world of one: the input is the result.
    t = Fake([1.5, -2.0, 3.25])
    assert w.all_reduce(t) is None and t.a.tolist() == [1.5, -2.0, 3.25], t.a
    assert syncs and syncs[-1] is t
    w.broadcast(t, 0)
    w.reduce(t, 0, op=mw.ReduceOp.MAX)
    assert t.a.tolist() == [1.5, -2.0, 3.25]

    # Out of place into poisoned outputs: the device wrote them.
    src = Fake(np.arange(6) * 0.5 - 1.0)
    out = Fake(np.full(6, POISON))
    w.all_gather_into_tensor(out, src)
    assert out.a.tolist() == src.a.tolist()
    out = Fake(np.full(6, POISON))
    w.reduce_scatter_tensor(out, src)
    assert out.a.tolist() == src.a.tolist()
    out = Fake(np.full(6, POISON))
    w.all_to_all_single(out, src)
    assert out.a.tolist() == src.a.tolist()
    # int64 and a non-contiguous input (made contiguous).
    ints = Fake(np.arange(12).reshape(3, 4).T, np.int64)
    assert not ints.is_contiguous()
    got = Fake(np.zeros((4, 3)), np.int64)
    w.all_gather_into_tensor(got, ints)
    assert got.a.tolist() == np.arange(12).reshape(3, 4).T.tolist()

    # async_op: the Work completes with the operation and returns the tensor.
    out = Fake(np.full(6, POISON))
    work = w.all_gather_into_tensor(out, src, async_op=True)
    assert work.wait(20) is out and out.a.tolist() == src.a.tolist()
    assert work.is_completed()

    # asyncio.
    import asyncio

    out = Fake(np.full(6, POISON))
    asyncio.run(aio.AsyncWorld(w).all_to_all_single(out, src))
    assert out.a.tolist() == src.a.tolist()

    # The list forms run over NCCL through one flat device tensor: results
    # land in poisoned outputs (non-contiguous ones too), nothing is staged.
    staged.clear()
    two_d = Fake(np.arange(6).reshape(2, 3) * 1.5)
    lst = [Fake(np.full((3, 2), POISON).T)]  # non-contiguous, (2, 3)
    assert not lst[0].is_contiguous()
    w.all_gather(lst, two_d)
    assert lst[0].a.tolist() == two_d.a.tolist()
    gl = [Fake(np.full((2, 3), POISON))]
    w.gather(two_d, gl, 0)
    assert gl[0].a.tolist() == two_d.a.tolist()
    out = Fake(np.full((2, 3), POISON))
    w.scatter(out, [two_d], 0)
    assert out.a.tolist() == two_d.a.tolist()
    out = Fake(np.full((2, 3), POISON))
    w.reduce_scatter(out, [two_d], op=mw.ReduceOp.SUM)
    assert out.a.tolist() == two_d.a.tolist()
    outs = [Fake(np.full((2, 3), POISON))]
    w.all_to_all(outs, [two_d])
    assert outs[0].a.tolist() == two_d.a.tolist()
    ilst = [Fake(np.full((2, 3), POISON), np.int64)]
    work = w.all_gather(ilst, Fake(np.arange(6).reshape(2, 3), np.int64), async_op=True)
    assert work.wait(20) is ilst and ilst[0].a.tolist() == np.arange(6).reshape(2, 3).tolist()
    assert staged == [], staged
    # Lists that one flat operation cannot serve are staged: sizes that differ.
    lst = [Fake(np.full(5, POISON))]
    refused(mw.MultiworldError, lambda: w.all_gather(lst, src))
    assert staged, "an uneven all_gather was not staged"
    staged.clear()
    lst = [Fake(np.full(6, POISON))]
    w.all_gather(lst, src)
    assert lst[0].a.tolist() == src.a.tolist()
    g = w.new_group([0])
    assert D.nccl_of(g) is None
    t2 = Fake([4.0])
    g.all_reduce(t2)
    assert t2.a.tolist() == [4.0]

    # Refusals, before anything is issued.
    refused(ValueError, lambda: w.send(Fake([1.0]), 0, tag=2))
    refused(ValueError, lambda: w.recv_into(Fake([1.0]), None))
    refused(ValueError, lambda: w.all_reduce(Fake([1.0], index=1)))
    refused(ValueError, lambda: w.all_reduce(Fake(np.zeros((2, 2)).T)))  # a non-contiguous output
    refused(TypeError, lambda: w.all_gather_into_tensor(np.zeros(2, np.float32), Fake([1.0, 2.0])))
    refused(mw.InvalidArgumentError, lambda: w.all_gather_into_tensor(Fake(np.zeros(5)), src))
    refused(mw.DeviceError, lambda: w.all_reduce(Fake([1, 2], np.int16), "sum"))  # no int16 in NCCL
    refused(TypeError, lambda: w.all_reduce(Fake([1.0], np.complex64)))

    # Host tensors in an NCCL world still travel over TCP.
    h = np.array([2.0], np.float32)
    w.all_reduce(h)
    assert h.tolist() == [2.0]
    w.barrier()

    # A blocking NCCL call waits on this thread; interrupted by Ctrl-C while
    # the operation hangs on the device, it raises KeyboardInterrupt within
    # the package's 100 ms, and the operation keeps its tensor alive until
    # it completes; then the world goes on.
    import ctypes
    import gc
    import os
    import signal
    import threading
    import time

    fake = ctypes.CDLL(os.environ["NCCL_LIBRARY"])  # the library the runtime loaded
    signal.signal(signal.SIGINT, signal.default_int_handler)
    D._order = lambda nccl, t: nccl.after_stream(0)  # holds no reference
    t = Fake([1.0, 2.0])
    held = sys.getrefcount(t)
    fake.fake_nccl_set(0, 1, 0)  # operations hang on the device
    timer = threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    start = time.monotonic()
    try:
        w.all_reduce(t)
        raise AssertionError("an all_reduce hanging on the device returned")
    except KeyboardInterrupt:
        waited = time.monotonic() - start
    timer.join()
    assert 0.25 < waited < 0.3 + 2.0, waited
    w.state  # a native call: releases references dropped off the GIL, if any
    assert sys.getrefcount(t) > held, "the interrupted operation let go of its tensor"
    fake.fake_nccl_set(0, 0, 0)
    fake.fake_nccl_release_last()
    deadline = time.monotonic() + 10
    while sys.getrefcount(t) > held:
        assert time.monotonic() < deadline, "the completed operation never let go of its tensor"
        time.sleep(0.01)
        w.state  # a native call: releases references dropped off the GIL
    t2 = Fake([3.0])
    w.all_reduce(t2)
    assert t2.a.tolist() == [3.0] and w.state == "ready"

    # An async_op=True call whose operation hangs: wait() with a timeout
    # raises WorldTimeoutError and leaves it running (the thread polls the
    # device itself, the task keeps the tensor); once the device is done, a
    # second wait() returns the tensor, and the task lets go of it.
    t3 = Fake([5.0, 6.0])
    held = sys.getrefcount(t3)
    fake.fake_nccl_set(0, 1, 0)
    work = w.all_reduce(t3, async_op=True)
    fake.fake_nccl_set(0, 0, 0)
    start = time.monotonic()
    refused(mw.WorldTimeoutError, lambda: work.wait(0.2))
    assert 0.15 < time.monotonic() - start < 5
    assert not work.is_completed() and sys.getrefcount(t3) > held
    fake.fake_nccl_release_last()
    assert work.wait(10) is t3 and t3.a.tolist() == [5.0, 6.0]
    del work  # its result holds the tensor too
    deadline = time.monotonic() + 10
    while sys.getrefcount(t3) > held:
        assert time.monotonic() < deadline, "the completed operation's task never let go of its tensor"
        time.sleep(0.01)
        w.state  # a native call: releases references dropped off the GIL
    # Cancelled while it hangs: wait() says so, and the tensor stays held
    # until the device has finished with it.
    fake.fake_nccl_set(0, 1, 0)
    work = w.all_reduce(t3, async_op=True)
    fake.fake_nccl_set(0, 0, 0)
    work._w.cancel()
    try:
        work.wait(5)
        raise AssertionError("a cancelled operation's wait returned")
    except RuntimeError as e:
        assert "cancelled" in str(e), e
    del work
    gc.collect()  # the raised error's traceback and the handle form a cycle
    w.state
    assert sys.getrefcount(t3) > held, "a cancelled operation let go of its tensor before the device"
    fake.fake_nccl_release_last()
    deadline = time.monotonic() + 10
    while sys.getrefcount(t3) > held:
        assert time.monotonic() < deadline, "the cancelled operation never let go of its tensor"
        time.sleep(0.01)
        w.state
    w.all_reduce(t2)
    assert w.state == "ready"
    w.finish(20)
print("ok", flush=True)
