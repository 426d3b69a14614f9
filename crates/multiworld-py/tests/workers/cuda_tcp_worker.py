"""A worker of test_cuda.py's test between processes on one GPU:
`cuda_tcp_worker.py NAME STORE COUNT`. Joins TCP world NAME as rank 1 of 2
through STORE with its tensors on cuda:0, sends COUNT CUDA tensors of
256 Ki float32 (message i holds i everywhere, made by a kernel just before),
then echoes one CUDA tensor of any size back to rank 0 (received on tag 1
into a tensor it allocates from the announced length, sent back on tag 2),
finishes the world and prints "ok"."""

import sys

import numpy as np
import torch

import multiworld_rs as mw

name, store, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
dev = torch.device("cuda", 0)
with mw.WorldManager() as m:
    w = m.join(name, 1, 2, store, timeout=60, heartbeat_interval=0.1, heartbeat_timeout=1.0)
    for i in range(count):
        w.send(torch.full((256 * 1024,), float(i), device=dev), 0)
    n = int(w.recv(0, tag=1, dtype=np.int64, shape=1)[0])
    back = torch.empty(n, dtype=torch.float32, device=dev)
    w.recv_into(back, 0, tag=1)
    w.send(back, 0, tag=2)
    w.finish(30)
print("ok", flush=True)
