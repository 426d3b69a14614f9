"""One rank of test_cuda.py's NCCL world: `cuda_nccl_worker.py RANK PORT`.
Rank r uses cuda:r; rank 0 hosts the store. Prints "ok" when every check
passed (an assertion error exits non-zero)."""

import sys

import torch

import multiworld_rs as mw

rank, port = int(sys.argv[1]), int(sys.argv[2])
torch.cuda.set_device(rank)
dev = torch.device("cuda", rank)
with mw.WorldManager() as m:
    if rank == 0:
        m.serve_store(f"127.0.0.1:{port}")
    w = m.join("nccl-cuda", rank, 2, f"127.0.0.1:{port}", backend="nccl", timeout=60, op_timeout=60)
    assert mw._device.nccl_of(w) is not None and mw._device.nccl_of(w).device == rank

    # p2p (a kernel's output as input: torch's stream is synchronised first)
    if rank == 0:
        w.send(torch.arange(8, dtype=torch.float32, device=dev) * 2, 1)
        got = torch.zeros(3, dtype=torch.int64, device=dev)
        assert w.recv_into(got, 1) == 1 and got.tolist() == [7, 8, 9]
    else:
        got = torch.zeros(8, dtype=torch.float32, device=dev)
        assert w.recv_into(got, 0) == 0
        assert torch.equal(got, torch.arange(8, dtype=torch.float32, device=dev) * 2)
        w.isend(torch.tensor([7, 8, 9], device=dev), 0).wait(60)

    # all_reduce in place, blocking and async
    t = torch.full((1000,), float(rank + 1), device=dev)
    w.all_reduce(t)
    assert torch.equal(t, torch.full((1000,), 3.0, device=dev))
    t = torch.tensor([rank, 10 - rank], device=dev, dtype=torch.int32)
    work = w.all_reduce(t, mw.ReduceOp.MAX, async_op=True)
    assert work.wait(60) is t and t.tolist() == [1, 10]

    # broadcast, reduce
    b = torch.arange(5.0, device=dev) if rank == 1 else torch.zeros(5, device=dev)
    w.broadcast(b, src=1)
    assert torch.equal(b, torch.arange(5.0, device=dev))
    r = torch.full((4,), float(rank + 2), device=dev, dtype=torch.float64)
    w.reduce(r, dst=0, op="product")
    assert r.tolist() == ([6.0] * 4 if rank == 0 else [3.0] * 4)

    # all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single
    out = torch.zeros(6, device=dev, dtype=torch.bfloat16)
    w.all_gather_into_tensor(out, torch.full((3,), float(rank), device=dev, dtype=torch.bfloat16))
    assert out.tolist() == [0, 0, 0, 1, 1, 1]
    rs = torch.zeros(2, device=dev)
    w.reduce_scatter_tensor(rs, torch.arange(4.0, device=dev) + rank)
    assert rs.tolist() == ([1.0, 3.0] if rank == 0 else [5.0, 7.0])
    a2a = torch.zeros(4, device=dev, dtype=torch.int64)
    w.all_to_all_single(a2a, torch.arange(4, device=dev) + 10 * rank)
    assert a2a.tolist() == ([0, 1, 10, 11] if rank == 0 else [2, 3, 12, 13])

    # The list forms, over NCCL through one flat tensor (staging would fail).
    staged, mw._device.staged = mw._device.staged, None
    lst = [torch.zeros(2, device=dev) for _ in range(2)]
    w.all_gather(lst, torch.full((2,), float(rank), device=dev))
    assert [x.tolist() for x in lst] == [[0.0, 0.0], [1.0, 1.0]]
    gl = [torch.zeros(2, 2, device=dev, dtype=torch.int32) for _ in range(2)] if rank == 1 else None
    w.gather(torch.full((2, 2), rank + 5, device=dev, dtype=torch.int32), gl, dst=1)
    assert rank == 0 or [x.tolist() for x in gl] == [[[5, 5], [5, 5]], [[6, 6], [6, 6]]]
    sc = torch.zeros(3, device=dev)
    w.scatter(sc, [torch.arange(3.0, device=dev) + 10 * i for i in range(2)] if rank == 0 else None, src=0)
    assert sc.tolist() == [10.0 * rank, 10.0 * rank + 1, 10.0 * rank + 2]
    rso = torch.zeros(2, device=dev)
    w.reduce_scatter(rso, [torch.full((2,), float(rank + 1 + 10 * i), device=dev) for i in range(2)])
    assert rso.tolist() == ([3.0, 3.0] if rank == 0 else [23.0, 23.0])
    outs = [torch.zeros(2, device=dev, dtype=torch.int64) for _ in range(2)]
    work = w.all_to_all(outs, [torch.full((2,), 10 * rank + i, device=dev) for i in range(2)], async_op=True)
    assert work.wait(60) is outs and [x.tolist() for x in outs] == [[rank, rank], [10 + rank, 10 + rank]]
    mw._device.staged = staged

    # What NCCL does not offer here is staged over the world's TCP mesh.
    uneven = torch.zeros(3 if rank == 0 else 1, device=dev)
    w.all_to_all_single(uneven, torch.arange(2.0, device=dev) + 10 * rank,
                        output_split_sizes=[2, 1] if rank == 0 else [0, 1],
                        input_split_sizes=[2, 0] if rank == 0 else [1, 1])
    assert uneven.tolist() == ([0.0, 1.0, 10.0] if rank == 0 else [11.0])

    # Refusals: a tag, a receive from any rank, a tensor on another device.
    for bad in (lambda: w.send(torch.ones(1, device=dev), 1 - rank, tag=3),
                lambda: w.recv_into(torch.ones(1, device=dev), None)):
        try:
            bad()
        except ValueError:
            pass
        else:
            raise AssertionError("not refused")
    w.barrier()
    w.finish(30)
print("ok", flush=True)
