"""Point-to-point between two processes, side by side: torch.distributed's
gloo backend against multiworld (`mw-rank-bench`, the facade, one process
per rank), with a raw TCP socket as the physical reference, all in one run.

For each size, interleaved (gloo, then multiworld, then raw TCP, for each
repeat), as the machine is noisy and only same-run ratios count:

- stream: rank 1 sends `bytes_total` (at least `min_messages` messages) of
  that size to rank 0, blocking sends, after a warm-up; GB/s at rank 0;
- ping-pong: rank 0 and rank 1 bounce one message; median half round trip.

    python3 -m venv target/py-venv && target/py-venv/bin/pip install torch   # once
    cargo build --release -p multiworld-bench --bin mw-rank-bench
    target/py-venv/bin/python bench/p2p_side_by_side.py [--repeats 3] [--json out.json]

Not part of the tests; needs PyTorch (gloo) and the release `mw-rank-bench`.
"""

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _common import add_rust_bin, free_port, rust_bin

STREAM_SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]
PINGPONG_SIZES = [4, 64 << 10, 1 << 20]
BYTES_TOTAL = 1 << 30
MIN_MESSAGES = 100


def messages(size: int) -> int:
    return max(MIN_MESSAGES, BYTES_TOTAL // size)


def rounds(size: int) -> int:
    return 20_000 if size <= 4096 else (2_000 if size <= (1 << 20) else 200)


def gloo_rank(rank: int, port: int, kind: str, size: int, out) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    t = torch.zeros(max(1, size // 4), dtype=torch.float32)
    if kind == "stream":
        n = messages(size)
        warm = max(2, n // 20)
        for _ in range(warm):
            (dist.send if rank == 1 else dist.recv)(t, 1 - rank)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(n):
            (dist.send if rank == 1 else dist.recv)(t, 1 - rank)
        secs = time.perf_counter() - start
        if rank == 0:
            out.put({"gb_per_s": n * size / secs / 1e9})
    else:
        n = rounds(size)
        times = []
        for i in range(n + n // 10):
            start = time.perf_counter()
            if rank == 0:
                dist.send(t, 1)
                dist.recv(t, 1)
            else:
                dist.recv(t, 0)
                dist.send(t, 0)
            if i >= n // 10:
                times.append(time.perf_counter() - start)
        if rank == 0:
            out.put({"half_rtt_us": statistics.median(times) / 2 * 1e6})
    dist.destroy_process_group()


def gloo(kind: str, size: int) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=gloo_rank, args=(r, port, kind, size, out)) for r in range(2)]
    for p in procs:
        p.start()
    result = out.get(timeout=600)
    for p in procs:
        p.join(60)
    return result


def rank_bench(binary: Path, scenario: str, size: int) -> dict:
    cmd = [str(binary), "run", scenario, "--sizes", str(size), "--bytes", str(BYTES_TOTAL),
           "--min-messages", str(MIN_MESSAGES), "--rounds", str(rounds(size))]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    add_rust_bin(p)
    a = p.parse_args()
    binary = rust_bin(a)
    rows = []
    print(f"torch {torch.__version__} gloo vs multiworld (mw-rank-bench), one process per rank, "
          f"{a.repeats} interleaved repeats", flush=True)
    for kind, sizes, key, unit in (("stream", STREAM_SIZES, "gb_per_s", "GB/s"),
                                  ("pingpong", PINGPONG_SIZES, "half_rtt_us", "us")):
        for size in sizes:
            g, m, r = [], [], []
            for _ in range(a.repeats):
                g.append(gloo(kind, size)[key])
                m.append(rank_bench(binary, kind, size)[key])
                r.append(rank_bench(binary, "tcp-" + kind, size)[key])
            if kind == "stream":
                ratios = [mi / gi for mi, gi in zip(m, g)]
            else:
                ratios = [gi / mi for mi, gi in zip(m, g)]  # > 1: multiworld faster
            row = {"kind": kind, "size": size, "unit": unit, "gloo": g, "multiworld": m, "raw_tcp": r,
                   "ratios": ratios}
            rows.append(row)
            fmt = (lambda v: f"{v:.2f}") if unit == "GB/s" else (lambda v: f"{v:.1f}")
            print(f"{kind:8} {size:>9} B  gloo {' / '.join(map(fmt, g))} {unit}  "
                  f"multiworld {' / '.join(map(fmt, m))}  raw TCP {' / '.join(map(fmt, r))}  "
                  f"multiworld vs gloo {' / '.join(f'{x:.2f}x' for x in ratios)}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
