"""A worker of the fault tests: joins world NAME as rank 1 of 2 through
STORE, sends COUNT int64 messages (0, 1, ...) to rank 0 every INTERVAL
seconds, waits for an acknowledgement on tag 1, then finishes the world."""

import sys
import time

import numpy as np

import multiworld_rs as mw

name, store, count, interval = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
m = mw.WorldManager()
w = m.join(name, 1, 2, store, timeout=30, heartbeat_interval=0.1, heartbeat_timeout=1.0)
for i in range(count):
    w.send(np.array([i], dtype=np.int64), 0)
    if interval:
        time.sleep(interval)
w.recv(0, tag=1, dtype=np.int64, shape=1)
w.finish(10)
m.shutdown()
print("done", flush=True)
