"""One rank of the collectives test: runs every collective over a world of
SIZE through STORE (rank 0 hosts it) and checks each result against numpy
references computed from every rank's (deterministic) inputs."""

import functools
import sys

import numpy as np

import multiworld_rs as mw
from multiworld_rs._tensors import np_dtype

rank, size, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
m = mw.WorldManager()
w = m.join("coll", rank, size, store, timeout=60)
N = 10
if w.shared_memory() != ("untried", None):
    raise SystemExit(f"rank {rank}: shared memory {w.shared_memory()} before any collective")


def inp(r, dtype, n=N):
    d = np_dtype(dtype)
    if d == np.bool_:
        return (np.arange(n) + r) % 3 == 0
    return (np.arange(n) % 5 + 1 + r).astype(d)


def ref(dtype, op, n=N):
    xs = [inp(r, dtype, n) for r in range(size)]
    if op == "avg":
        return (sum(x.astype(np.float64) for x in xs) / size).astype(xs[0].dtype)
    f = {"sum": np.add, "product": np.multiply, "min": np.minimum, "max": np.maximum,
         "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}[op]
    if xs[0].dtype == np.bool_ and op in ("sum", "max"):
        f = np.logical_or
    if xs[0].dtype == np.bool_ and op in ("product", "min"):
        f = np.logical_and
    return functools.reduce(f, xs)


def check(what, got, want):
    got, want = np.asarray(got), np.asarray(want)
    ok = got.dtype == want.dtype and got.shape == want.shape
    if ok:
        ok = np.allclose(got.astype(np.float64), want.astype(np.float64), rtol=1e-2) \
            if got.dtype.kind == "f" or got.dtype.name == "bfloat16" else (got == want).all()
    if not ok:
        raise SystemExit(f"rank {rank}: {what}: got {got!r}, want {want!r}")


cases = [("int32", op) for op in ("sum", "product", "min", "max", "band", "bor", "bxor")]
cases += [("float64", op) for op in ("sum", "product", "min", "max", "avg")]
cases += [("bool", op) for op in ("sum", "min", "max", "band", "bor", "bxor")]
cases += [("float16", "sum"), ("float32", "avg"), ("uint8", "max"), ("int64", "bxor")]
try:
    import ml_dtypes  # noqa: F401
    cases.append(("bfloat16", "sum"))
except ImportError:
    pass
for dtype, op in cases:
    t = inp(rank, dtype)
    w.all_reduce(t, op if rank % 2 else mw.ReduceOp(op))
    check(f"all_reduce {dtype} {op}", t, ref(dtype, op))

t = inp(rank, "float32").reshape(2, 5)
w.broadcast(t, src=1)
check("broadcast", t, inp(1, "float32").reshape(2, 5))

t = inp(rank, "int64")
w.reduce(t, dst=2, op="max")
check("reduce", t, ref("int64", "max") if rank == 2 else inp(rank, "int64"))

outs = [np.zeros(N, np.int16) for _ in range(size)]
w.all_gather(outs, inp(rank, "int16"))
for r in range(size):
    check(f"all_gather[{r}]", outs[r], inp(r, "int16"))

out = np.zeros((size, N), np.float64)
w.all_gather_into_tensor(out, inp(rank, "float64"))
check("all_gather_into_tensor", out, np.stack([inp(r, "float64") for r in range(size)]))

gl = [np.zeros(N, np.uint32) for _ in range(size)] if rank == 0 else None
w.gather(inp(rank, "uint32"), gl, dst=0)
if rank == 0:
    for r in range(size):
        check(f"gather[{r}]", gl[r], inp(r, "uint32"))

t = np.zeros(N, np.int8)
w.scatter(t, [inp(100 + r, "int8") for r in range(size)] if rank == 2 else None, src=2)
check("scatter", t, inp(100 + rank, "int8"))

out = np.zeros(N, np.float32)
w.reduce_scatter(out, [inp(rank + 10 * p, "float32") for p in range(size)], op="sum")
check("reduce_scatter", out, sum(inp(r + 10 * rank, "float32") for r in range(size)))

out = np.zeros(N, np.int32)
w.reduce_scatter_tensor(out, np.concatenate([inp(rank + p, "int32") for p in range(size)]), op="sum")
check("reduce_scatter_tensor", out, sum(inp(r + rank, "int32") for r in range(size)))

outs = [np.zeros(3, np.int64) for _ in range(size)]
w.all_to_all(outs, [np.full(3, 10 * rank + p, np.int64) for p in range(size)])
for q in range(size):
    check(f"all_to_all[{q}]", outs[q], np.full(3, 10 * q + rank, np.int64))

out = np.zeros((size, 2), np.float64)
w.all_to_all_single(out, np.array([[10 * rank + p] * 2 for p in range(size)], np.float64))
check("all_to_all_single even", out, np.array([[10 * q + rank] * 2 for q in range(size)], np.float64))

# Uneven: rank r sends p + 1 rows to rank p; receives r + 1 rows from each.
rows = [[100 * rank + 10 * p + k, -1] for p in range(size) for k in range(p + 1)]
out = np.zeros((size * (rank + 1), 2), np.int64)
w.all_to_all_single(out, np.array(rows, np.int64), output_split_sizes=[rank + 1] * size,
                    input_split_sizes=[p + 1 for p in range(size)])
want = [[100 * q + 10 * rank + k, -1] for q in range(size) for k in range(rank + 1)]
check("all_to_all_single uneven", out, np.array(want, np.int64))

t = inp(rank, "float64")
work = w.all_reduce(t, "sum", async_op=True)
assert work.wait(30) is t
check("all_reduce async", t, ref("float64", "sum"))
w.barrier()
w.barrier(async_op=True).wait(30)

objs = [None, None] if rank else [{"a": 1}, "two"]
w.broadcast_object_list(objs, src=0)
check("broadcast_object_list", np.array([objs == [{"a": 1}, "two"]]), np.array([True]))
got = [None] * size
w.all_gather_object(got, ("rank", rank))
check("all_gather_object", np.array([got == [("rank", r) for r in range(size)]]), np.array([True]))
gl = [None] * size if rank == 1 else None
w.gather_object({"r": rank}, gl, dst=1)
if rank == 1:
    check("gather_object", np.array([gl == [{"r": r} for r in range(size)]]), np.array([True]))
out = [None]
w.scatter_object_list(out, [f"for {r}" for r in range(size)] if rank == 0 else None, src=0)
check("scatter_object_list", np.array([out[0] == f"for {rank}"]), np.array([True]))

# Large tensors go through the members' shared-memory segment (one host), in
# 1 MiB pieces with a barrier per piece; a blocking call waits at those
# barriers on the caller's own thread. Small integers keep the sums exact.
BIG = 3 << 18  # 3 MiB of float32
for i in range(4):
    t = inp(rank + i, "float32", BIG)
    w.all_reduce(t, "sum")
    check(f"large all_reduce {i}", t, sum(inp(r + i, "float32", BIG) for r in range(size)))
t = inp(rank, "int32", BIG) if rank == 1 else np.zeros(BIG, np.int32)
w.broadcast(t, src=1)
check("large broadcast", t, inp(1, "int32", BIG))
out = np.zeros((size, BIG // 2), np.float32)
w.all_gather_into_tensor(out, inp(rank, "float32", BIG // 2))
check("large all_gather_into_tensor", out, np.stack([inp(r, "float32", BIG // 2) for r in range(size)]))
t = inp(rank, "float32", BIG)
w.all_reduce(t, "max", async_op=True).wait(30)
check("large all_reduce async", t, ref("float32", "max", BIG))
# Active on one host; unavailable where the processes cannot map each
# other's memory (another user, no /proc access): the TCP paths ran then.
if w.shared_memory()[0] not in ("active", "unavailable"):
    raise SystemExit(f"rank {rank}: the large collectives left shared memory {w.shared_memory()}")

# A mismatch is an error on every rank, never garbage.
try:
    w.all_reduce(np.zeros(N + rank, np.float32), "sum")
except (mw.MismatchError, mw.InvalidArgumentError) as e:
    pass
else:
    raise SystemExit(f"rank {rank}: mismatched all_reduce did not fail")

w.finish(30)
m.shutdown()
print("OK", flush=True)
