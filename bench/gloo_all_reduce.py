"""Reference figures: torch.distributed's gloo backend on this machine.

Times all_reduce (sum, float32) of 1 KiB and 64 MiB over 2 and 4 ranks on
loopback, the way `m8d bench collectives` times multiworld, so the two can be
compared on the same machine in the same hour:

    python3 -m venv /tmp/torchenv && /tmp/torchenv/bin/pip install torch
    /tmp/torchenv/bin/python bench/gloo_all_reduce.py [--repeats 20]

Prints one line per (ranks, size): median and best time in ms and the bus
bandwidth (2(n-1)/n x bytes / time), the same definitions as multiworld's
benchmark. Not part of the tests; needs PyTorch, nothing else.
"""

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank: int, world: int, port: int, sizes, repeats: int, out) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    for nbytes in sizes:
        t = torch.ones(nbytes // 4, dtype=torch.float32)
        for _ in range(3):  # warm-up
            dist.all_reduce(t)
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - start)
        if rank == 0:
            out.put((world, nbytes, statistics.median(times), min(times)))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    sizes = [1024, 64 << 20]
    ctx = mp.get_context("spawn")
    print(f"torch {torch.__version__}, gloo, all_reduce sum float32, median/best of {args.repeats}")
    for world in (2, 4):
        out = ctx.Queue()
        port = free_port()
        procs = [
            ctx.Process(target=rank_main, args=(r, world, port, sizes, args.repeats, out))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        for _ in sizes:
            w, nbytes, median, best = out.get()
            busbw = 2 * (w - 1) / w * nbytes / median / 1e9
            print(
                f"ranks {w}  size {nbytes:>9} B  median {median * 1e3:8.3f} ms  "
                f"best {best * 1e3:8.3f} ms  busbw {busbw:5.2f} GB/s"
            )


if __name__ == "__main__":
    main()
