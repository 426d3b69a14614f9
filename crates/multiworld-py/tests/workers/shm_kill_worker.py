"""A member of a world of 3 that runs 8 MiB all-reduces (through the
members' shared-memory segment) until one fails, then prints
``broken <unix time> <cause> <completed calls>``. Rank 1 is also rank 1 of a
second world of 2 with the test process: after the first world broke, it
echoes one message there (twice its values) to show that world untouched."""

import sys
import time

import numpy as np

import multiworld_rs as mw

rank, store, name, other = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
m = mw.WorldManager()
w = m.join(name, rank, 3, store, timeout=60)
o = m.join(other, 1, 2, store, timeout=60) if rank == 1 else None
t = np.empty(1 << 21, np.float32)
calls = 0
while True:
    t[:] = rank + 1
    try:
        w.all_reduce(t, "sum")
    except mw.BrokenWorldError as e:
        print(f"broken {time.time():.6f} {e.cause} {calls}", flush=True)
        break
    if not (t == 6).all():
        raise SystemExit(f"rank {rank}: call {calls} returned a wrong result")
    calls += 1
    if calls == 3:
        print("ready", flush=True)
if o is not None:
    x = o.recv(0, dtype=np.int64, shape=4)
    o.send(x * 2, 0)
    o.finish(10)
m.shutdown()
print("OK", flush=True)
