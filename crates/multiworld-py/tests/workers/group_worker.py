"""One rank of the sub-group and async-collective test (a world of 3 through
STORE; rank 0 hosts it): every collective's ``async_op=True`` form, sub-groups
made with ``new_group`` (members and a non-member), and every collective of
the asyncio API, each checked exactly."""

import asyncio
import sys

import numpy as np

import multiworld_rs as mw
from multiworld_rs import aio

rank, size, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
assert size == 3
m = mw.WorldManager()
w = m.join("groups", rank, size, store, timeout=60)


def check(what, ok):
    if not ok:
        raise SystemExit(f"rank {rank}: {what} is wrong")


def full(v, n=4, dtype=np.int64):
    return np.full(n, v, dtype)


# -- every collective's async_op form: start them all, then wait in order ----
t_b = full(rank)
t_ar = full(rank + 1)
t_r = full(rank + 1)
ag = [full(-1) for _ in range(size)]
agt = np.zeros(size * 4, np.int64)
gl = [full(-1) for _ in range(size)] if rank == 1 else None
sc = full(-1)
rs = full(-1)
rst = full(-1)
a2a = [full(-1) for _ in range(size)]
a2as = np.zeros(size, np.int64)
objs = ["x"] if rank else ["from 0"]
works = [
    w.broadcast(t_b, 2, async_op=True),
    w.all_reduce(t_ar, "sum", async_op=True),
    w.reduce(t_r, 0, "max", async_op=True),
    w.all_gather(ag, full(10 + rank), async_op=True),
    w.all_gather_into_tensor(agt, full(20 + rank), async_op=True),
    w.gather(full(30 + rank), gl, 1, async_op=True),
    w.scatter(sc, [full(40 + r) for r in range(size)] if rank == 2 else None, 2, async_op=True),
    w.reduce_scatter(rs, [full(rank + 10 * p) for p in range(size)], "sum", async_op=True),
    w.reduce_scatter_tensor(rst, np.concatenate([full(rank + p) for p in range(size)]), "sum", async_op=True),
    w.all_to_all(a2a, [full(10 * rank + p) for p in range(size)], async_op=True),
    w.all_to_all_single(a2as, np.array([10 * rank + p for p in range(size)], np.int64), async_op=True),
    w.barrier(async_op=True),
    w.broadcast_object_list(objs, 0, async_op=True),
]
for work in works:
    work.wait(60)
    check("is_completed after wait", work.is_completed())
check("broadcast async", (t_b == 2).all())
check("all_reduce async", (t_ar == 6).all())
check("reduce async", (t_r == 3).all() if rank == 0 else (t_r == rank + 1).all())
check("all_gather async", all((ag[r] == 10 + r).all() for r in range(size)))
check("all_gather_into_tensor async", (agt == np.repeat([20, 21, 22], 4)).all())
if rank == 1:
    check("gather async", all((gl[r] == 30 + r).all() for r in range(size)))
check("scatter async", (sc == 40 + rank).all())
check("reduce_scatter async", (rs == sum(r + 10 * rank for r in range(size))).all())
check("reduce_scatter_tensor async", (rst == sum(r + rank for r in range(size))).all())
check("all_to_all async", all((a2a[q] == 10 * q + rank).all() for q in range(size)))
check("all_to_all_single async", (a2as == [10 * q + rank for q in range(size)]).all())
check("broadcast_object_list async", objs == ["from 0"])

# -- sub-groups --------------------------------------------------------------
g02 = w.new_group([2, 0])  # any order; every rank calls it, members or not
g12 = w.new_group([1, 2])
check("group ranks", g02.ranks == [0, 2] and g12.ranks == [1, 2])
check("group membership", g02.is_member == (rank != 1) and g12.is_member == (rank != 0))
check("group size", g02.size == 2 and w.size == 3)
if g02.is_member:
    t = full(rank + 1)
    g02.all_reduce(t, "sum")
    check("g02 all_reduce", (t == 4).all())  # ranks 0 and 2: 1 + 3
    outs = [full(-1), full(-1)]
    g02.all_gather(outs, full(rank))
    check("g02 all_gather (one entry per member, in ranks order)", (outs[0] == 0).all() and (outs[1] == 2).all())
    t = full(rank)
    g02.broadcast(t, src=2)  # roots are world ranks
    check("g02 broadcast", (t == 2).all())
else:
    try:
        g02.all_reduce(full(0), "sum")
    except mw.InvalidArgumentError:
        pass
    else:
        raise SystemExit(f"rank {rank}: a collective on a group without this rank did not fail")
if g12.is_member:
    got = [None, None]
    g12.all_gather_object(got, rank)
    check("g12 all_gather_object", got == [1, 2])
    sub = g12.new_group([2])  # a sub-group of a sub-group: its members call it
    if sub.is_member:
        t = full(7)
        sub.all_reduce(t, "sum")
        check("sub-sub-group all_reduce", (t == 7).all())
# The world's own collectives go on after (and beside) its sub-groups.
t = full(1)
w.all_reduce(t, "sum")
check("world all_reduce after sub-groups", (t == 3).all())


# -- the asyncio API: every collective awaited -----------------------------
async def main():
    aw = aio.AsyncWorld(w)
    t = full(rank)
    await aw.broadcast(t, 1)
    check("aio broadcast", (t == 1).all())
    t = full(rank + 1)
    await aw.all_reduce(t, mw.ReduceOp.PRODUCT)
    check("aio all_reduce", (t == 6).all())
    t = full(rank)
    await aw.reduce(t, 2, "sum")
    check("aio reduce", (t == 3).all() if rank == 2 else (t == rank).all())
    outs = [full(-1) for _ in range(size)]
    await aw.all_gather(outs, full(rank * 2))
    check("aio all_gather", all((outs[r] == 2 * r).all() for r in range(size)))
    out = np.zeros(size * 4, np.int64)
    await aw.all_gather_into_tensor(out, full(rank))
    check("aio all_gather_into_tensor", (out == np.repeat([0, 1, 2], 4)).all())
    gl = [full(-1) for _ in range(size)] if rank == 0 else None
    await aw.gather(full(rank + 5), gl, 0)
    if rank == 0:
        check("aio gather", all((gl[r] == r + 5).all() for r in range(size)))
    t = full(-1)
    await aw.scatter(t, [full(r * 3) for r in range(size)] if rank == 0 else None, 0)
    check("aio scatter", (t == rank * 3).all())
    t = full(-1)
    await aw.reduce_scatter(t, [full(p) for p in range(size)], "sum")
    check("aio reduce_scatter", (t == 3 * rank).all())
    t = full(-1)
    await aw.reduce_scatter_tensor(t, np.concatenate([full(1) for _ in range(size)]), "sum")
    check("aio reduce_scatter_tensor", (t == 3).all())
    outs = [full(-1) for _ in range(size)]
    await aw.all_to_all(outs, [full(100 * rank + p) for p in range(size)])
    check("aio all_to_all", all((outs[q] == 100 * q + rank).all() for q in range(size)))
    out = np.zeros(size, np.int64)
    await aw.all_to_all_single(out, np.array([100 * rank + p for p in range(size)], np.int64))
    check("aio all_to_all_single", (out == [100 * q + rank for q in range(size)]).all())
    await aw.barrier()
    objs = [None] if rank else [{"k": "v"}]
    await aw.broadcast_object_list(objs, 0)
    check("aio broadcast_object_list", objs == [{"k": "v"}])
    got = [None] * size
    await aw.all_gather_object(got, f"r{rank}")
    check("aio all_gather_object", got == ["r0", "r1", "r2"])
    gl = [None] * size if rank == 2 else None
    await aw.gather_object(rank * rank, gl, 2)
    if rank == 2:
        check("aio gather_object", gl == [0, 1, 4])
    out = []
    await aw.scatter_object_list(out, [f"to {r}" for r in range(size)] if rank == 1 else None, 1)
    check("aio scatter_object_list", out == [f"to {rank}"])
    sub = await aw.new_group([0, 1])
    if sub.group_rank is not None:
        t = full(rank + 1)
        await sub.all_reduce(t, "sum")
        check("aio sub-group all_reduce", (t == 3).all())
    # Collectives of two worlds' worth of work awaited together: the second
    # starts before the first ends (each keeps its place in the order).
    a, b = full(1), full(2)
    await asyncio.gather(aw.all_reduce(a, "sum"), aw.all_reduce(b, "sum"))
    check("aio concurrent all_reduces", (a == 3).all() and (b == 6).all())


asyncio.run(asyncio.wait_for(main(), 60))
w.finish(30)
m.shutdown()
print("OK", flush=True)
