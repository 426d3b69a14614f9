"""Torch CUDA tensors in a TCP world, two processes on one GPU (host
staging; docs/benchmarks.md, "GPU"): what a round trip costs against the
same bytes as host arrays in the same world, and against torch's own
device-host copies measured in the same run.

    python bench/cuda_staging.py [--mib 64] [--iters 10]

Rank 0 measures; rank 1 (a second process, spawn start method) echoes
every message back. Per size it prints GB/s counting both directions,
from the median call:

- `cuda echo`: `send(cuda tensor)` + `recv_into(cuda tensor)` (each end
  copies device -> host, sends, receives, copies host -> device);
- `host echo`: the same with numpy arrays (the TCP path alone);
- torch's copies of the same tensor: to a new pageable host tensor
  (`.cpu()`, what staging did before it used pinned memory), into a
  pinned one (what it does now), and back from each.

Needs torch with CUDA and the package (installed, or built here with
`bash crates/multiworld-py/scripts/test.sh`).
"""

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

try:
    import multiworld_rs as mw
except ImportError:  # a checkout: the package beside this folder
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "crates" / "multiworld-py" / "python"))
    import multiworld_rs as mw

import numpy as np
import torch


def echo_side(addr: str, sizes: list, iters: int) -> None:
    dev = torch.device("cuda", 0)
    with mw.WorldManager() as m:
        w = m.join("cuda-staging", 1, 2, addr, timeout=60)
        for n in sizes:
            t = torch.empty(n, dtype=torch.float32, device=dev)
            for _ in range(iters + 1):
                w.recv_into(t, 0)
                w.send(t, 0)
            a = np.empty(n, dtype=np.float32)
            for _ in range(iters + 1):
                w.recv_into(a, 0)
                w.send(a, 0)
        w.finish(30)


def echo(w: "mw.World", out, into) -> None:
    """One round trip: `out` to rank 1, its echo into `into`."""
    w.send(out, 1)
    w.recv_into(into, 1)


def timed(f, iters: int) -> float:
    """Median seconds of one call of `f` over `iters` calls after a warm-up
    (the median: one stall of the shared machine, tens of milliseconds,
    would otherwise dominate the mean of a few short calls)."""
    f()  # warm-up
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        f()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", default="1,64", help="message sizes in MiB, comma-separated")
    ap.add_argument("--iters", type=int, default=10)
    a = ap.parse_args()
    sizes = [int(float(x) * (1 << 20)) // 4 for x in a.mib.split(",")]
    m = mw.WorldManager()
    addr = m.serve_store("127.0.0.1:0")
    p = mp.get_context("spawn").Process(target=echo_side, args=(addr, sizes, a.iters))
    p.start()
    try:
        w = m.join("cuda-staging", 0, 2, addr, timeout=60)
        measure(w, sizes, a.iters)
        w.finish(30)
        p.join(60)
    finally:
        if p.is_alive():  # this side failed: the echo would wait for ever
            p.terminate()
            p.join(10)
        m.shutdown()
    if p.exitcode != 0:
        sys.exit(f"the echo process exited with {p.exitcode}")


def measure(w: "mw.World", sizes: list, iters: int) -> None:
    dev = torch.device("cuda", 0)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}; GB/s counting both directions")
    print(f"{'size':>8} {'cuda echo':>10} {'host echo':>10} {'ratio':>6} | torch: "
          f"{'to new':>7} {'to pinned':>9} {'from new':>8} {'from pinned':>11}")
    for n in sizes:
        nbytes = 4 * n
        src = torch.arange(n, dtype=torch.float32, device=dev)
        back = torch.empty_like(src)
        cuda_s = timed(lambda: echo(w, src, back), iters)
        assert torch.equal(back, src)
        h = src.cpu().numpy()
        hb = np.empty_like(h)
        host_s = timed(lambda: echo(w, h, hb), iters)
        assert np.array_equal(h, hb)
        pinned = torch.empty(n, dtype=torch.float32, pin_memory=True)
        pageable = src.cpu()
        to_new = timed(lambda: src.cpu(), iters)
        to_pinned = timed(lambda: pinned.copy_(src), iters)
        from_new = timed(lambda: back.copy_(pageable), iters)
        from_pinned = timed(lambda: back.copy_(pinned), iters)
        gb = nbytes / 1e9
        label = f"{nbytes >> 20}Mi" if nbytes >= 1 << 20 else f"{nbytes >> 10}Ki"
        print(f"{label:>8} {2 * gb / cuda_s:>10.2f} {2 * gb / host_s:>10.2f} "
              f"{host_s / cuda_s:>6.2f} | torch: {gb / to_new:>7.2f} {gb / to_pinned:>9.2f} "
              f"{gb / from_new:>8.2f} {gb / from_pinned:>11.2f}")


if __name__ == "__main__":
    main()
