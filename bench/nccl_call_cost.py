"""What one NCCL collective costs through the Python package, against
torch.distributed's own NCCL process group in the same process and run
(docs/benchmarks.md, "GPU").

    python bench/nccl_call_cost.py [--iters 200]

NCCL refuses two ranks on one GPU, so both sides are worlds of one on
cuda:0: no bytes cross a link, and what is measured is each API's own cost
per call (argument checks, synchronising with torch's stream, the enqueue,
waiting for completion). Per size it prints µs per in-place `all_reduce`
for multiworld (blocking, and `async_op=True` + `wait()`) and for
`torch.distributed.all_reduce` (blocking, then `torch.cuda.synchronize()`,
which multiworld's blocking call includes), and the ratios; then the same
for an out-of-place `all_gather_into_tensor`, which NCCL runs as a device
copy that lasts (up to about a millisecond at 1 GiB), so how promptly a
wait sees the end shows.

Needs torch with CUDA and the package built with the nccl feature
(`crates/multiworld-py/scripts/gpu-test.sh build`, installed there by
`gpu-test.sh run`).
"""

import argparse
import os
import socket
import sys
import time
from pathlib import Path

try:
    import multiworld_rs as mw
except ImportError:  # a checkout: the package beside this folder
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "crates" / "multiworld-py" / "python"))
    import multiworld_rs as mw

import torch
import torch.distributed as dist


def per_call(f, iters: int) -> float:
    """µs per call of `f`, the GPU idle before and after."""
    for _ in range(5):
        f()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        f()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e6


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--sizes", default="4,1048576,67108864", help="bytes, comma-separated")
    ap.add_argument("--copy-sizes", default="67108864,268435456,1073741824",
                    help="bytes of the out-of-place all_gather_into_tensor, comma-separated")
    a = ap.parse_args()
    if not mw.NCCL_BUILT:
        sys.exit("this multiworld_rs was built without the nccl feature")
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=dev)
    with mw.WorldManager() as m:
        store = m.serve_store("127.0.0.1:0")
        w = m.join("nccl-call-cost", 0, 1, store, backend="nccl", device=dev, timeout=60, op_timeout=60)
        print(f"torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
              f"{torch.cuda.get_device_name(0)}; µs per in-place all_reduce, world of one")
        print(f"{'bytes':>10} {'multiworld':>11} {'mw async':>9} {'torch.dist':>11} {'mw / torch':>11}")
        for nbytes in (int(x) for x in a.sizes.split(",")):
            t = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=dev)
            mw_us = per_call(lambda: w.all_reduce(t), a.iters)
            mw_async_us = per_call(lambda: w.all_reduce(t, async_op=True).wait(60), a.iters)

            def torch_call() -> None:
                dist.all_reduce(t)
                torch.cuda.synchronize()

            torch_us = per_call(torch_call, a.iters)
            assert bool((t == 1).all())  # a sum over one rank leaves it as it was
            print(f"{nbytes:>10} {mw_us:>11.1f} {mw_async_us:>9.1f} {torch_us:>11.1f} {mw_us / torch_us:>11.2f}")
        # Out of place: NCCL copies the input into the output, an operation
        # that lasts (a device copy of this size), so the wait's granularity
        # shows.
        print(f"{'bytes':>10} {'multiworld':>11} {'mw async':>9} {'torch.dist':>11} {'mw / torch':>11}"
              "   (all_gather_into_tensor, out of place)")
        for nbytes in (int(x) for x in a.copy_sizes.split(",")):
            src = torch.ones(nbytes // 4, dtype=torch.float32, device=dev)
            out = torch.empty_like(src)
            mw_us = per_call(lambda: w.all_gather_into_tensor(out, src), a.iters)
            mw_async_us = per_call(lambda: w.all_gather_into_tensor(out, src, async_op=True).wait(60), a.iters)

            def torch_gather() -> None:
                dist.all_gather_into_tensor(out, src)
                torch.cuda.synchronize()

            torch_us = per_call(torch_gather, a.iters)
            assert bool((out == 1).all())
            print(f"{nbytes:>10} {mw_us:>11.1f} {mw_async_us:>9.1f} {torch_us:>11.1f} {mw_us / torch_us:>11.2f}")
        w.finish(30)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
