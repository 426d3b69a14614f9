"""What the Python package itself costs per NCCL call, without a GPU: a
world of one with backend="nccl" on the test kit's fake CUDA driver and
NCCL (compiled here from crates/multiworld-testkit/fake/fake_cuda_nccl.c),
where every operation has completed when first asked. ITERS in-place
`all_reduce` calls of a stand-in CUDA tensor of 1,024 float32 elements,
blocking and as `async_op=True` + `wait()`; prints the best of 3 runs in µs
per call for each. On a GPU, `bench/nccl_call_cost.py` measures the real
thing against torch.distributed.

    target/py-venv/bin/python bench/fake_nccl_call_cost.py [ITERS]

Needs the package built with the nccl feature (the test script's default)
and a C compiler (`cc`, or `$CC`).
"""

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FAKE_SRC = Path(__file__).resolve().parents[1] / "crates/multiworld-testkit/fake/fake_cuda_nccl.c"
MODES = ("blocking", "work")


def _child(iters: int) -> None:
    import numpy as np

    import multiworld_rs as mw
    from multiworld_rs import _device as D

    class Dev:
        type = "cuda"
        index = 0

    class DType:
        def __str__(self) -> str:
            return "torch.float32"

    class Fake:
        """A CUDA tensor as the package sees one (its module is torch's)."""

        def __init__(self, n: int) -> None:
            self.a = np.ones(n, np.float32)
            self.device, self.dtype = Dev(), DType()

        shape = property(lambda self: self.a.shape)

        def data_ptr(self) -> int:
            return self.a.ctypes.data

        def numel(self) -> int:
            return self.a.size

        def is_contiguous(self) -> bool:
            return True

    Fake.__module__ = "torch.fake"
    # No torch here: order after the legacy default stream through the native call.
    D._order = lambda nccl, t: nccl.after_stream(0)
    with mw.WorldManager() as m:
        store = m.serve_store("127.0.0.1:0")
        w = m.join("fake-call-cost", 0, 1, store, backend="nccl", device=0, timeout=20)
        t = Fake(1024)
        for mode in MODES:
            runs = []
            for _ in range(3):
                start = time.perf_counter()
                for _ in range(iters):
                    if mode == "blocking":
                        w.all_reduce(t)
                    else:
                        w.all_reduce(t, async_op=True).wait()
                runs.append((time.perf_counter() - start) / iters * 1e6)
            print(f"{mode} {min(runs):.2f}", flush=True)
        w.finish(20)


def measure(iters: int) -> dict:
    """µs per call for each of MODES (best of 3 runs of `iters` calls)."""
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        raise RuntimeError("needs a C compiler (cc or $CC) for the fake CUDA driver and NCCL")
    with tempfile.TemporaryDirectory() as tmp:
        libs = {}
        for define, name in (("-DFAKE_NCCL", "libnccl.so.2"), ("-DFAKE_CUDA", "libcuda.so.1")):
            libs[name] = os.path.join(tmp, name)
            subprocess.run([cc, "-shared", "-fPIC", "-O1", define, "-o", libs[name], str(FAKE_SRC)], check=True)
        env = dict(os.environ, NCCL_LIBRARY=libs["libnccl.so.2"], CUDA_DRIVER_LIBRARY=libs["libcuda.so.1"])
        done = subprocess.run([sys.executable, __file__, "_child", str(iters)], env=env,
                              capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"the measuring process failed: {done.stderr[-2000:]}")
    out = dict(line.split() for line in done.stdout.splitlines() if line.strip())
    return {mode: float(out[mode]) for mode in MODES}


def main(argv: list) -> int:
    if argv[:1] == ["_child"]:
        _child(int(argv[1]))
        return 0
    iters = int(argv[0]) if argv else 20000
    for mode, us in measure(iters).items():
        print(f"{mode}: {us:.1f} µs per call")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
