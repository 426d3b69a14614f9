"""torch CPU tensors through the package: every dtype, in-place receives and
collectives, no-copy hand-over to torch, torch's ReduceOp, refusals of
non-CPU tensors, the asyncio and compat APIs. Skipped when torch is not
importable (it is optional; the README says how to install it)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import multiworld_rs as mw
from multiworld_rs import aio

from conftest import both, unique

torch = pytest.importorskip("torch", reason="torch is not installed in this venv (optional)")

DTYPES = [torch.bool, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
          torch.float16, torch.bfloat16, torch.float32, torch.float64]


def sample(dtype: "torch.dtype", n: int = 7) -> "torch.Tensor":
    if dtype == torch.bool:
        return torch.arange(n) % 2 == 0
    return (torch.arange(n) * 3 - 5).to(dtype) if dtype.is_signed else torch.arange(n).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_round_trips_into_a_torch_tensor(pair, dtype):
    w0, w1 = pair
    t = sample(dtype)
    out = torch.zeros(7, dtype=dtype)
    _, src = both(lambda: w1.send(t, 0), lambda: w0.recv_into(out, 1))
    assert src == 1 and out.dtype == dtype and torch.equal(out, t)


def test_received_arrays_become_tensors_without_a_copy(pair):
    w0, w1 = pair
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    _, got = both(lambda: w1.send(t, 0), lambda: w0.recv(1, dtype=torch.float32, shape=(3, 4)))
    as_torch = torch.from_numpy(got)
    assert torch.equal(as_torch, t)
    got[0, 0] = 99.0  # one buffer: the tensor sees it
    assert as_torch[0, 0].item() == 99.0


def test_non_contiguous_and_wrong_size_tensors(pair):
    w0, w1 = pair
    t = torch.arange(12, dtype=torch.int32).reshape(3, 4).t()  # a transposed view
    out = torch.zeros(4, 3, dtype=torch.int32)
    both(lambda: w1.send(t, 0), lambda: w0.recv_into(out, 1))
    assert torch.equal(out, t)
    small = torch.zeros(5, dtype=torch.int32)
    with pytest.raises(mw.MismatchError):
        both(lambda: w1.send(torch.ones(6, dtype=torch.int32), 0), lambda: w0.recv_into(small, 1))
    assert torch.equal(small, torch.zeros(5, dtype=torch.int32))  # untouched


def test_collectives_in_place_on_torch_tensors_with_torch_reduce_ops(pair):
    import torch.distributed as dist

    w0, w1 = pair
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([10.0, 20.0])
    both(lambda: w0.all_reduce(a, dist.ReduceOp.SUM), lambda: w1.all_reduce(b, dist.ReduceOp.SUM))
    assert torch.equal(a, torch.tensor([11.0, 22.0])) and torch.equal(b, a)
    a, b = torch.tensor([3, 9]), torch.tensor([7, 1])
    both(lambda: w0.all_reduce(a, dist.ReduceOp.MAX), lambda: w1.all_reduce(b, dist.ReduceOp.MAX))
    assert a.tolist() == [7, 9] == b.tolist()
    a, b = torch.zeros(3, dtype=torch.bfloat16), torch.full((3,), 1.5, dtype=torch.bfloat16)
    both(lambda: w0.broadcast(a, 1), lambda: w1.broadcast(b, 1))
    assert torch.equal(a, b)
    outs0 = [torch.zeros(2, dtype=torch.int64) for _ in range(2)]
    outs1 = [torch.zeros(2, dtype=torch.int64) for _ in range(2)]
    both(lambda: w0.all_gather(outs0, torch.tensor([0, 0])), lambda: w1.all_gather(outs1, torch.tensor([1, 1])))
    assert [o.tolist() for o in outs0] == [[0, 0], [1, 1]] == [o.tolist() for o in outs1]
    o0, o1 = torch.zeros(2, 3), torch.zeros(2, 3)
    both(lambda: w0.all_gather_into_tensor(o0, torch.full((3,), 4.0)),
         lambda: w1.all_gather_into_tensor(o1, torch.full((3,), 5.0)))
    assert o0.tolist() == [[4.0] * 3, [5.0] * 3] and torch.equal(o0, o1)
    r0, r1 = torch.zeros(2), torch.zeros(2)
    both(lambda: w0.reduce_scatter_tensor(r0, torch.tensor([1.0, 1.0, 2.0, 2.0])),
         lambda: w1.reduce_scatter_tensor(r1, torch.tensor([10.0, 10.0, 20.0, 20.0])))
    assert r0.tolist() == [11.0, 11.0] and r1.tolist() == [22.0, 22.0]
    s0, s1 = torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
    both(lambda: w0.all_to_all_single(s0, torch.tensor([0, 1], dtype=torch.int32)),
         lambda: w1.all_to_all_single(s1, torch.tensor([10, 11], dtype=torch.int32)))
    assert s0.tolist() == [0, 10] and s1.tolist() == [1, 11]
    work = w0.all_reduce(torch.ones(2), async_op=True)
    t1 = torch.ones(2)
    w1.all_reduce(t1)
    assert torch.equal(work.wait(30), torch.full((2,), 2.0)) and torch.equal(t1, torch.full((2,), 2.0))
    # In the background, in place on the tensor's own memory (lent through
    # its numpy view: refused to another call until the collective ends).
    a, b = torch.arange(4.0), torch.full((4,), 1.0)
    wa = w0.all_reduce(a, dist.ReduceOp.SUM, async_op=True)
    with pytest.raises(ValueError, match="in use by another call"):
        w0.send(a, 1, tag=9)
    wb = w1.all_reduce(b, dist.ReduceOp.SUM, async_op=True)
    assert wa.wait(30) is a and wb.wait(30) is b
    assert a.tolist() == [1.0, 2.0, 3.0, 4.0] and torch.equal(a, b)
    r, x = torch.full((3,), 2, dtype=torch.int64), torch.full((3,), 5, dtype=torch.int64)
    works = both(lambda: w0.reduce(r, 0, dist.ReduceOp.SUM, async_op=True),
                 lambda: w1.reduce(x, 0, dist.ReduceOp.SUM, async_op=True))
    assert works[0].wait(30) is r and works[1].wait(30) is x
    assert r.tolist() == [7, 7, 7] and x.tolist() == [5, 5, 5]


def test_tensors_not_on_the_cpu_are_refused_clearly(pair):
    w0, w1 = pair
    with pytest.raises(TypeError, match="only CPU tensors"):
        w0.send(torch.empty(3, device="meta"), 1)
    with pytest.raises(TypeError, match="only CPU tensors"):
        w0.recv_into(torch.empty(3, device="meta"), 1)
    # A tensor that requires grad is sent from its data (detached).
    t = torch.arange(3, dtype=torch.float32).requires_grad_(True)
    out = torch.zeros(3)
    both(lambda: w1.send(t, 0), lambda: w0.recv_into(out, 1))
    assert torch.equal(out, t.detach())


def test_asyncio_and_compat_with_torch_tensors():
    from multiworld_rs.compat.manager import WorldManager as CompatManager

    async def main():
        a, b = aio.AsyncWorldManager(), aio.AsyncWorldManager()
        store = await a.serve_store()
        name = unique("torch-aio")
        w0, w1 = await asyncio.gather(a.join(name, 0, 2, store, timeout=10), b.join(name, 1, 2, store, timeout=10))
        out = torch.zeros(4, dtype=torch.float64)
        await asyncio.gather(w1.send(torch.arange(4, dtype=torch.float64), 0), w0.recv_into(out, 1))
        assert out.tolist() == [0.0, 1.0, 2.0, 3.0]
        x0, x1 = torch.tensor([1, 2]), torch.tensor([3, 4])
        await asyncio.gather(w0.all_reduce(x0), w1.all_reduce(x1))
        assert x0.tolist() == [4, 6] == x1.tolist()
        await a.shutdown()
        await b.shutdown()

        # The older library's API, with torch tensors as its users hold them.
        port = int(store.rsplit(":", 1)[1])
        m0, m1 = CompatManager(), CompatManager()
        cname = unique("torch-compat")
        await asyncio.gather(m0.initialize_world(cname, 0, 2, addr="127.0.0.1", port=port),
                             m1.initialize_world(cname, 1, 2, addr="127.0.0.1", port=port))
        got = torch.zeros(3, dtype=torch.int64)
        await asyncio.gather(m1.communicator.send(torch.tensor([7, 8, 9]), 0, cname),
                             m0.communicator.recv(got, 1, cname))
        assert got.tolist() == [7, 8, 9]
        m0.cleanup()
        m1.cleanup()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_irecv_and_async_receives_write_a_torch_tensor_in_place(pair):
    """A CPU torch tensor is lent to a background receive through its numpy
    view (no buffer of the runtime's, no copy): while the receive waits, the
    tensor's memory is in use (a second receive into it is refused), and the
    message lands in the tensor's own storage."""
    w0, w1 = pair
    out = torch.zeros(1 << 16, dtype=torch.float32)
    ptr = out.data_ptr()
    work = w0.irecv(out, 1, 4)
    with pytest.raises(ValueError, match="in use"):
        w0.recv_into(out, 1, 5)
    w1.send(torch.full((1 << 16,), 2.5), 0, 4)
    assert work.wait(timeout=30) is out and work.source == 1
    assert out.data_ptr() == ptr and bool((out == 2.5).all())

    async def main():
        a0, a1 = aio.AsyncWorld(w0), aio.AsyncWorld(w1)
        got = torch.zeros(5, dtype=torch.int64)
        await asyncio.gather(a1.send(torch.arange(5), 0, 6, copy=False), a0.recv_into(got, 1, 6))
        assert got.tolist() == [0, 1, 2, 3, 4]

    asyncio.run(asyncio.wait_for(main(), 60))
