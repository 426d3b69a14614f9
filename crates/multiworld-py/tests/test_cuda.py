"""Torch CUDA tensors (docs/python.md, "Device tensors").

Runs everywhere:
- how a tensor's device is classified (host / cuda / other), "meta" tensors
  still refused, ``device=`` parsing, ``backend="nccl"`` refused with the
  build instructions by a build without the nccl feature;
- the host-staging path of TCP worlds, driven by a stand-in "CUDA tensor"
  (``FakeCuda``: a numpy array behind the few torch methods staging uses,
  reporting ``device.type == "cuda"``), so the decisions (what is copied to
  the host, what is copied back, when: at once or in ``Work.wait()``) are
  checked without a GPU.

Runs only with a CUDA GPU and torch (skipped here, with the reason):
- TCP worlds with real CUDA tensors (two members in this process, one GPU);
- CUDA tensors between processes on one GPU (TCP worlds, host staging), and
  a SIGKILLed worker breaking only its world;
- an NCCL world of one on one GPU (a build with the nccl feature);
- an NCCL world of two processes, one GPU each (NCCL refuses two ranks on
  one GPU, so this needs two GPUs).
``crates/multiworld-py/scripts/gpu-test.sh`` runs them on a GPU machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

import multiworld_rs as mw
from multiworld_rs import _device as D
from multiworld_rs import _tensors as T
from multiworld_rs import aio

from conftest import HERE, both, free_port, unique

try:
    import torch
except ImportError:  # pragma: no cover - depends on the environment
    torch = None

HAS_CUDA = torch is not None and torch.cuda.is_available()
GPU_COUNT = torch.cuda.device_count() if HAS_CUDA else 0
needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed in this venv (optional)")
needs_cuda = pytest.mark.skipif(
    not HAS_CUDA, reason="no CUDA GPU (torch.cuda.is_available() is False): run scripts/gpu-test.sh on a GPU machine")
needs_nccl = pytest.mark.skipif(
    not mw.NCCL_BUILT, reason="this multiworld_rs was built without the nccl feature (MW_PY_FEATURES=nccl)")
needs_2_gpus = pytest.mark.skipif(
    GPU_COUNT < 2, reason=f"an NCCL world of 2 ranks needs 2 GPUs (NCCL refuses two ranks on one GPU); "
                          f"{GPU_COUNT} visible")


# -- a stand-in CUDA tensor (host staging without a GPU) -------------------------
class _Dev:
    type = "cuda"
    index = 0

    def __str__(self) -> str:
        return "cuda:0"


class FakeCuda:
    """What host staging uses of a torch CUDA tensor, over a numpy array:
    ``device``, ``shape``, ``dtype``, ``numel()``, ``element_size()``,
    ``detach()``, ``new_empty(shape, device="cpu", pin_memory=...)`` (a
    FakeHost, whose ``copy_(cuda)`` copies to the host) and
    ``copy_(host)``. It counts the copies each way."""

    def __init__(self, a: np.ndarray) -> None:
        self.a = a
        self.device = _Dev()
        self.to_host = 0
        self.to_device = 0
        self.hosts: list = []  # every FakeHost staging asked for
        self.refuse_pinning = False

    @property
    def shape(self) -> Any:
        return self.a.shape

    @property
    def dtype(self) -> Any:
        return self.a.dtype

    def detach(self) -> "FakeCuda":
        return self

    def numel(self) -> int:
        return self.a.size

    def element_size(self) -> int:
        return self.a.itemsize

    def new_empty(self, shape: Any, device: str, pin_memory: bool = False) -> "FakeHost":
        assert device == "cpu"
        if pin_memory and self.refuse_pinning:
            raise RuntimeError("CUDA error: out of memory (pinned)")
        self.hosts.append(FakeHost(np.empty(shape, self.a.dtype), pin_memory))
        return self.hosts[-1]

    def copy_(self, host: "FakeHost") -> "FakeCuda":
        self.to_device += 1
        np.copyto(self.a, host.a)
        return self


class _Cpu:
    type = "cpu"


class FakeHost:
    """The host tensor staging gets from ``FakeCuda.new_empty``: a CPU
    "torch" tensor over a numpy array (so the World methods lend its memory
    as they would a real one's: ``detach().numpy()`` is a plain array);
    ``copy_`` from a FakeCuda counts a copy to the host."""

    def __init__(self, a: np.ndarray, pinned: bool) -> None:
        self.a = a
        self.pinned = pinned
        self.device = _Cpu()

    @property
    def dtype(self) -> Any:
        return self.a.dtype

    def detach(self) -> "FakeHost":
        return self

    def numpy(self) -> np.ndarray:
        return self.a

    def copy_(self, src: FakeCuda) -> "FakeHost":
        src.to_host += 1
        np.copyto(self.a, src.a)
        return self


FakeCuda.__module__ = "torch.fake_cuda"  # what device_kind looks at
FakeHost.__module__ = "torch.fake_host"  # a CPU tensor, as as_array sees it


def fc(values: Any, dtype: Any = np.float32) -> FakeCuda:
    return FakeCuda(np.asarray(values, dtype=dtype))


# -- classification and refusals (no GPU) ------------------------------------
def test_device_kind_classifies_tensors():
    assert T.device_kind(np.zeros(3)) == "host"
    assert T.device_kind([1, 2]) == "host"
    assert T.device_kind(fc([1.0])) == "cuda"
    with pytest.raises(T.DeviceTensor) as e:  # caught by World methods
        T.as_array(fc([1.0]), "tensor")
    assert isinstance(e.value, TypeError) and "cuda:0" in str(e.value)


@needs_torch
def test_torch_cpu_meta_tensors_are_classified_and_meta_still_refused(pair):
    w0, w1 = pair
    assert T.device_kind(torch.zeros(2)) == "host"
    meta = torch.empty(3, device="meta")
    assert T.device_kind(meta) == "other"
    with pytest.raises(TypeError, match="only CPU tensors") as e:
        w0.send(meta, 1)
    assert not isinstance(e.value, T.DeviceTensor)
    with pytest.raises(TypeError, match="only CPU tensors"):
        w0.all_reduce(meta)


def test_device_option_is_parsed():
    assert D.device_index(None) is None
    assert D.device_index(1) == 1
    assert D.device_index("cuda:3") == 3
    for bad in ("cpu", "cuda:x", -1, True, 1.5):
        with pytest.raises((TypeError, ValueError)):
            D.device_index(bad)
    if torch is not None:
        assert D.device_index(torch.device("cuda", 2)) == 2
        with pytest.raises(ValueError):
            D.device_index(torch.device("cpu"))


@pytest.mark.skipif(mw.NCCL_BUILT, reason="this build has the nccl feature")
def test_nccl_backend_without_the_nccl_build_says_how_to_get_it():
    with mw.WorldManager() as m:
        with pytest.raises(mw.ConfigError, match="--features nccl"):
            m.join(unique("n"), 0, 1, "127.0.0.1:1", backend="nccl")


def test_tcp_worlds_have_no_nccl_side(pair):
    w0, _ = pair
    assert D.nccl_of(w0) is None
    assert w0._nccl is False  # looked up once, cached


# -- host staging with stand-in CUDA tensors (no GPU) ---------------------------
def test_p2p_is_staged_through_the_host(pair):
    w0, w1 = pair
    src = fc(np.arange(6).reshape(2, 3))
    dst = fc(np.zeros((2, 3)))
    _, got = both(lambda: w1.send(src, 0, tag=4), lambda: w0.recv_into(dst, 1, tag=4))
    assert got == 1 and np.array_equal(dst.a, src.a)
    assert (src.to_host, src.to_device) == (1, 0)  # an input: copied out only
    assert (dst.to_host, dst.to_device) == (0, 1)  # an output: copied back only
    # A mismatch leaves the device tensor untouched.
    small = fc(np.full(2, 7.0))
    with pytest.raises(mw.MismatchError):
        both(lambda: w1.send(fc(np.ones(3)), 0), lambda: w0.recv_into(small, 1))
    assert np.array_equal(small.a, [7.0, 7.0]) and small.to_device == 0


def test_staging_uses_pinned_memory_up_to_its_cap(pair, monkeypatch):
    w0, w1 = pair

    def trip(n: int, refuse: bool = False) -> list:
        src = fc(np.arange(n, dtype=np.float32))
        dst = fc(np.zeros(n, np.float32))
        src.refuse_pinning = dst.refuse_pinning = refuse
        both(lambda: w1.send(src, 0), lambda: w0.recv_into(dst, 1))
        assert np.array_equal(dst.a, src.a)
        return [h.pinned for h in src.hosts + dst.hosts]

    assert trip(4) == [True, True]
    monkeypatch.setattr(D, "PINNED_MAX", 15)  # bytes
    assert trip(4) == [False, False]  # 16 bytes: over the cap
    assert trip(3) == [True, True]
    # Where pinning fails, staging goes on in pageable memory, and stops
    # asking for pinned memory.
    monkeypatch.setattr(D, "_pinning_failed", False)
    assert trip(3, refuse=True) == [False, False]
    assert D._pinning_failed is True
    assert trip(3) == [False, False]


def test_isend_irecv_copy_back_in_wait(pair):
    w0, w1 = pair
    dst = fc(np.zeros(4, np.int64))
    work = w0.irecv(dst, 1)
    w1.isend(fc(np.arange(4, dtype=np.int64)), 0).wait()
    assert work.wait(10) is dst
    assert work.source == 1 and np.array_equal(dst.a, np.arange(4))


def test_collectives_are_staged_in_place(pair):
    w0, w1 = pair
    a, b = fc([1.0, 2.0]), fc([10.0, 20.0])
    both(lambda: w0.all_reduce(a), lambda: w1.all_reduce(b))
    assert a.a.tolist() == [11.0, 22.0] == b.a.tolist()
    assert (a.to_host, a.to_device) == (1, 1)
    # A CUDA tensor next to a host one; outputs in a list.
    outs0, outs1 = [fc([0.0]), np.zeros(1, np.float32)], [fc([0.0]), fc([0.0])]
    both(lambda: w0.all_gather(outs0, fc([5.0])), lambda: w1.all_gather(outs1, np.array([6.0], np.float32)))
    assert [float(o.a[0]) if isinstance(o, FakeCuda) else float(o[0]) for o in outs0] == [5.0, 6.0]
    assert [float(o.a[0]) for o in outs1] == [5.0, 6.0]
    # gather leaves a non-destination's list alone.
    left = [fc([-1.0]), fc([-1.0])]
    got = [fc([0.0]), fc([0.0])]
    both(lambda: w0.gather(fc([1.0]), got, dst=0), lambda: w1.gather(fc([2.0]), left, dst=0))
    assert [float(g.a[0]) for g in got] == [1.0, 2.0]
    assert [float(g.a[0]) for g in left] == [-1.0, -1.0] and left[0].to_device == 0
    out0, out1 = fc(np.zeros(4), np.float64), fc(np.zeros(4), np.float64)
    both(lambda: w0.all_gather_into_tensor(out0, fc([1.0, 2.0], np.float64)),
         lambda: w1.all_gather_into_tensor(out1, fc([3.0, 4.0], np.float64)))
    assert out0.a.tolist() == [1.0, 2.0, 3.0, 4.0] == out1.a.tolist()


def test_async_collectives_copy_back_in_wait(pair):
    w0, w1 = pair
    a, b = fc([1, 2], np.int32), fc([3, 4], np.int32)
    k0, k1 = w0.all_reduce(a, async_op=True), w1.all_reduce(b, async_op=True)
    assert k0.wait(10) is a and k1.wait(10) is b
    assert a.a.tolist() == [4, 6] == b.a.tolist()
    assert a.to_device == 1
    assert k0.wait() is a and a.to_device == 1  # a second wait copies nothing again

    async def go(w: mw.World, t: FakeCuda) -> Any:
        return await aio.AsyncWorld(w).broadcast(t, 1)

    x, y = fc([0.0, 0.0]), fc([8.0, 9.0])
    both(lambda: asyncio_run(go(w0, x)), lambda: asyncio_run(go(w1, y)))
    assert x.a.tolist() == [8.0, 9.0]


def asyncio_run(coro: Any) -> Any:
    import asyncio

    return asyncio.run(coro)


# -- real CUDA tensors (GPU) --------------------------------------------------------
@needs_torch
@needs_cuda
def test_cuda_tensors_in_a_tcp_world(pair):
    w0, w1 = pair
    dev = torch.device("cuda", 0)
    t = torch.arange(10, dtype=torch.float32, device=dev) * 1.5
    out = torch.zeros(10, dtype=torch.float32, device=dev)
    _, src = both(lambda: w1.send(t, 0), lambda: w0.recv_into(out, 1))
    assert src == 1 and out.device == dev and torch.equal(out, t)
    a = torch.full((3, 4), 2.0, device=dev, dtype=torch.float16)
    b = torch.full((3, 4), 5.0, device=dev, dtype=torch.float16)
    both(lambda: w0.all_reduce(a), lambda: w1.all_reduce(b))
    assert torch.equal(a, torch.full((3, 4), 7.0, device=dev, dtype=torch.float16)) and torch.equal(a, b)
    x = torch.ones(5, dtype=torch.int64, device=dev)
    y = torch.full((5,), 3, dtype=torch.int64, device=dev)
    k0, k1 = w0.all_reduce(x, mw.ReduceOp.MAX, async_op=True), w1.all_reduce(y, "max", async_op=True)
    assert k0.wait(30) is x and k1.wait(30) is y
    assert x.tolist() == [3] * 5 == y.tolist()
    # Non-contiguous device output, a kernel's result as input.
    o = torch.zeros(4, 3, device=dev).t()
    both(lambda: w1.send(torch.arange(12.0, device=dev).reshape(3, 4) * 2, 0), lambda: w0.recv_into(o, 1))
    assert torch.equal(o, torch.arange(12.0, device=dev).reshape(3, 4) * 2)


@needs_torch
@needs_cuda
@needs_nccl
def test_cuda_tensors_in_an_nccl_world_of_one():
    """Real torch memory through NCCL on one GPU: out-of-place results into
    poisoned outputs (a world of one: the result is the input), inputs made
    by kernels just before (torch's stream is synchronised first)."""
    dev = torch.device("cuda", 0)
    with mw.WorldManager() as m:
        store = m.serve_store("127.0.0.1:0")
        w = m.join(unique("nccl1"), 0, 1, store, backend="nccl", device=dev, timeout=60, op_timeout=60)
        assert D.nccl_of(w) is not None and D.nccl_of(w).device == 0
        for _ in range(3):
            src = torch.randn(1 << 20, device=dev) * 3 + 1  # a kernel just before
            for op in (w.all_gather_into_tensor, w.reduce_scatter_tensor, w.all_to_all_single):
                out = torch.full_like(src, -12345.0)
                assert op(out, src) is None
                assert torch.equal(out, src), op.__name__
        t = torch.arange(10, device=dev, dtype=torch.int64) * 7
        before = t.clone()
        w.all_reduce(t)
        w.broadcast(t, 0)
        w.reduce(t, 0, op="max")
        assert torch.equal(t, before)
        out = torch.full((10,), -1, device=dev, dtype=torch.int64)
        work = w.all_gather_into_tensor(out, t * 1, async_op=True)
        assert work.wait(60) is out and torch.equal(out, before)
        # The list forms, over NCCL through one flat tensor: nothing staged.
        staged, D.staged = D.staged, None
        try:
            x = torch.randn(4, 5, device=dev)  # a kernel just before
            lst = [torch.full((5, 4), -7.0, device=dev).t()]  # a non-contiguous output
            w.all_gather(lst, x)
            assert torch.equal(lst[0], x)
            gl = [torch.full_like(x, -7.0)]
            w.gather(x, gl, 0)
            assert torch.equal(gl[0], x)
            for call in (lambda o: w.scatter(o, [x], 0), lambda o: w.reduce_scatter(o, [x])):
                o = torch.full_like(x, -7.0)
                call(o)
                assert torch.equal(o, x)
            outs = [torch.full_like(x, -7.0)]
            work = w.all_to_all(outs, [x * 2], async_op=True)
            assert work.wait(60) is outs and torch.equal(outs[0], x * 2)
        finally:
            D.staged = staged
        with pytest.raises(ValueError, match="no tags"):
            w.send(t, 0, tag=1)
        w.finish(30)


@needs_torch
@needs_cuda
def test_cuda_tensors_between_processes_on_one_gpu_and_a_killed_worker_breaks_only_its_world():
    """A leader with its tensors on cuda:0 in two TCP worlds, one worker
    process each on the same GPU (host staging): CUDA tensors stream in
    from both; SIGKILL of one worker breaks its world (peer lost, within
    5 s) while the other delivers every message in order and echoes a
    64 MiB CUDA tensor both ways. Prints the staged rate each way."""
    import signal
    import time

    from conftest import spawn

    count = 40
    dev = torch.device("cuda", 0)
    m = mw.WorldManager()
    store = m.serve_store("127.0.0.1:0")
    names = [unique("gpu-a"), unique("gpu-b")]
    procs: list = []
    try:
        procs.extend(spawn("cuda_tcp_worker.py", n, store, count) for n in names)
        healthy, broken = (m.join(n, 0, 2, store, timeout=60, heartbeat_interval=0.1, heartbeat_timeout=1.0)
                           for n in names)
        buf = torch.empty(256 * 1024, dtype=torch.float32, device=dev)

        def take(w: mw.World, i: int) -> None:
            buf.fill_(-1.0)
            assert w.recv_into(buf, 1) == 1
            assert bool((buf == float(i)).all()), (w.name, i, buf[:4].tolist())

        for w in (healthy, broken):  # both streams are flowing
            for i in range(5):
                take(w, i)
        t0 = time.monotonic()
        procs[1].send_signal(signal.SIGKILL)
        err = None
        for i in range(5, count + 1):
            try:
                take(broken, i)
            except mw.BrokenWorldError as e:
                err = e
                break
        took = time.monotonic() - t0
        assert err is not None and err.cause == "peer_lost" and err.world == broken.name, err
        assert took < 5.0, f"took {took:.2f} s"
        # The other world: every message, in order, then 64 MiB each way.
        for i in range(5, count):
            take(healthy, i)
        big = torch.arange(16 << 20, dtype=torch.float32, device=dev) * 0.5
        back = torch.full_like(big, -1.0)
        torch.cuda.synchronize()
        t1 = time.monotonic()
        healthy.send(np.array([big.numel()], dtype=np.int64), 1, tag=1)
        healthy.send(big, 1, tag=1)
        t2 = time.monotonic()
        assert healthy.recv_into(back, 1, tag=2) == 1
        torch.cuda.synchronize()
        t3 = time.monotonic()
        assert torch.equal(back, big)
        # A physical reference in the same run: torch's own copies of the
        # same tensor to pageable host memory and back.
        t4 = time.monotonic()
        host = big.cpu()
        t5 = time.monotonic()
        back.copy_(host)
        torch.cuda.synchronize()
        t6 = time.monotonic()
        gb = big.numel() * 4 / 1e9
        print(f"\n64 MiB cuda:0 -> host -> TCP -> host -> cuda:0 between two processes: sent in "
              f"{(t2 - t1) * 1e3:.1f} ms, echo received {(t3 - t2) * 1e3:.1f} ms later "
              f"({2 * gb / (t3 - t1):.2f} GB/s over the round trip); torch's own copies: "
              f"to host {(t5 - t4) * 1e3:.1f} ms, back {(t6 - t5) * 1e3:.1f} ms; "
              f"the break seen in {took * 1e3:.0f} ms")
        healthy.finish(30)
        out, errs = procs[0].communicate(timeout=60)
        assert procs[0].returncode == 0 and "ok" in out.split(), errs
        assert broken.wait_removed(10)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate(timeout=30)
        m.shutdown()


@needs_torch
@needs_cuda
def test_the_cuda_staging_benchmark_runs():
    """``bench/cuda_staging.py`` with one small size: it checks its own
    echoes (an assertion in the script) and prints one row of positive
    figures (no timing is checked)."""
    script = os.path.join(HERE, "..", "..", "..", "bench", "cuda_staging.py")
    p = subprocess.run([sys.executable, script, "--mib", "0.25", "--iters", "2"],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = [ln.replace("|", " ").replace("torch:", " ").split() for ln in p.stdout.splitlines()]
    rows = [r for r in rows if r and r[0] == "256Ki"]
    assert len(rows) == 1 and len(rows[0]) == 8 and all(float(x) > 0 for x in rows[0][1:]), p.stdout


@needs_torch
@needs_cuda
@needs_nccl
def test_the_nccl_call_cost_benchmark_runs():
    """``bench/nccl_call_cost.py`` with small sizes and few calls: it checks
    its own results (assertions in the script) and prints positive figures
    for both tables (no timing is checked)."""
    script = os.path.join(HERE, "..", "..", "..", "bench", "nccl_call_cost.py")
    p = subprocess.run([sys.executable, script, "--iters", "3", "--sizes", "4,4096", "--copy-sizes", "65536"],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = [ln.split() for ln in p.stdout.splitlines()]
    rows = [r for r in rows if r and r[0] in ("4", "4096", "65536")]
    assert [r[0] for r in rows] == ["4", "4096", "65536"], p.stdout
    assert all(len(r) == 5 and all(float(x) > 0 for x in r[1:]) for r in rows), p.stdout


@needs_torch
@needs_cuda
@needs_nccl
def test_an_nccl_call_is_ordered_after_torchs_stream_without_the_host_waiting():
    """The input is written on torch's stream behind a kernel that keeps it
    busy for about half a second (``torch.cuda._sleep``): the async call
    returns long before that (the host does not wait for torch's stream),
    and its result is what that stream wrote (NCCL waited for it on the
    device)."""
    import time

    dev = torch.device("cuda", 0)
    with mw.WorldManager() as m:
        store = m.serve_store("127.0.0.1:0")
        w = m.join(unique("order"), 0, 1, store, backend="nccl", device=dev, timeout=60, op_timeout=60)
        src = torch.zeros(1 << 20, device=dev)
        out = torch.full_like(src, -1.0)
        torch.cuda.synchronize()
        t0 = time.monotonic()
        torch.cuda._sleep(10 ** 8)
        torch.cuda.synchronize()
        cycles_per_s = 10 ** 8 / (time.monotonic() - t0)
        torch.cuda._sleep(int(0.5 * cycles_per_s))  # torch's stream: busy
        src.fill_(7.0)  # ... then the input
        t1 = time.monotonic()
        work = w.all_gather_into_tensor(out, src, async_op=True)
        issued = time.monotonic() - t1
        assert work.wait(60) is out
        done = time.monotonic() - t1
        assert bool((out == 7.0).all()), out[:4].tolist()
        assert issued < 0.2 < done, (issued, done)
        w.finish(30)


NCCL_WORKER = os.path.join(HERE, "workers", "cuda_nccl_worker.py")


@needs_torch
@needs_cuda
@needs_nccl
@needs_2_gpus
def test_cuda_tensors_in_an_nccl_world_of_two_processes():
    port = free_port()
    procs = [subprocess.Popen([sys.executable, NCCL_WORKER, str(r), str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r} failed:\n{out}"
        assert "ok" in out.split(), out


# -- the nccl build on the fake CUDA/NCCL (no GPU) ------------------------------------
FAKE_SRC = os.path.join(HERE, "..", "..", "multiworld-testkit", "fake", "fake_cuda_nccl.c")


@needs_nccl
def test_the_nccl_path_on_the_fake_cuda_and_nccl(tmp_path):
    """The NCCL path of World methods (borrowed memory, Work, async, aio,
    refusals, staging of what NCCL does not offer) in a world of one on the
    Rust tests' fake CUDA driver and NCCL, compiled here."""
    import shutil

    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None or not os.path.exists(FAKE_SRC):
        pytest.skip("needs a C compiler and the test kit's fake_cuda_nccl.c (a checkout)")
    libs = {}
    for define, name in (("-DFAKE_NCCL", "libnccl.so.2"), ("-DFAKE_CUDA", "libcuda.so.1")):
        libs[name] = str(tmp_path / name)
        subprocess.run([cc, "-shared", "-fPIC", "-O1", define, "-o", libs[name], FAKE_SRC], check=True)
    env = dict(os.environ, NCCL_LIBRARY=libs["libnccl.so.2"], CUDA_DRIVER_LIBRARY=libs["libcuda.so.1"])
    p = subprocess.run([sys.executable, os.path.join(HERE, "workers", "fake_nccl_worker.py")],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, timeout=120)
    assert p.returncode == 0 and p.stdout.split()[-1:] == ["ok"], p.stdout
