#!/usr/bin/env bash
# The CUDA tests of the Python package (tests/test_cuda.py) on a GPU machine
# that has Python, torch (CUDA) and NCCL (the nvidia-nccl-cu12 wheel torch
# installs) but no Rust and no network. Two steps:
#
#   1. here, with Rust:     crates/multiworld-py/scripts/gpu-test.sh build
#      builds the wheel with the nccl feature (release, stripped) and
#      downloads pytest's wheels and numpy's for CPython
#      MW_GPU_PYTHON_VERSION (default 3.12: torch there may come without
#      numpy), into target/gpu-wheel/ at the repository root (a folder git
#      ignores). Needs maturin (the test venv has it: MW_PY_VENV,
#      default target/py-venv, made by scripts/test.sh) and the package
#      registry for pytest.
#   2. there, in a copy of the checkout that has target/gpu-wheel/:
#                           crates/multiworld-py/scripts/gpu-test.sh run [pytest args]
#      installs the wheel, and pytest and numpy where the interpreter
#      lacks them, from target/gpu-wheel/ only (no network) into a folder
#      put on PYTHONPATH, shows the GPUs and NCCL, and runs tests/test_cuda.py with
#      -rs (every skip and its reason). MW_GPU_SITE picks that folder
#      (default /tmp/mw-gpu-site, emptied first); PYTHON the interpreter
#      with torch (default python3).
#
# With the session's device tool, step 2 is one call from the repository
# root, carrying the ignored folder:
#   run(command="bash crates/multiworld-py/scripts/gpu-test.sh run", carry=["target/gpu-wheel"])
# The NCCL test needs 2 GPUs (NCCL refuses two ranks on one GPU; it is
# skipped with that reason on one); the TCP-staging tests need one.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
crate="$(cd "$here/.." && pwd)"
root="$(cd "$crate/../.." && pwd)"
out="$root/target/gpu-wheel"
step="${1:-}"
shift || true

case "$step" in
build)
    venv="${MW_PY_VENV:-$root/target/py-venv}"
    maturin="$venv/bin/maturin"
    [ -x "$maturin" ] || maturin="$(command -v maturin)" || {
        echo "no maturin: run scripts/test.sh once (it makes $venv) or pip install maturin" >&2
        exit 1
    }
    gpu_py="${MW_GPU_PYTHON_VERSION:-3.12}"
    rm -rf "$out" && mkdir -p "$out"
    export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$root/target}"
    echo "== building the nccl wheel into $out"
    (cd "$crate" && "$maturin" build --release --strip --features nccl --out "$out" 2>&1 | tail -n 5)
    echo "== numpy for CPython $gpu_py (the GPU machine's torch may come without it)"
    "$venv/bin/python" -m pip download --disable-pip-version-check -q --only-binary=:all: \
        --python-version "$gpu_py" --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$out" 'numpy>=1.23'
    echo "== pytest wheels"
    # Pure-Python wheels, with the backports pytest needs on CPython 3.10
    # (tomli, exceptiongroup; unused on newer ones).
    "$venv/bin/python" -m pip download --disable-pip-version-check -q --only-binary=:all: \
        --implementation py --python-version 3.10 \
        -d "$out" 'pytest>=7' 'pytest-timeout>=2' tomli exceptiongroup
    ls -l "$out"
    ;;
run)
    [ -d "$out" ] && ls "$out"/multiworld_rs-*.whl >/dev/null 2>&1 || {
        echo "no wheel in $out: run '$0 build' on a machine with Rust first" >&2
        exit 1
    }
    python="${PYTHON:-python3}"
    # Installed into a folder on PYTHONPATH rather than a venv: the
    # interpreter that holds torch is often a venv itself, whose packages a
    # venv made from it (even with --system-site-packages) does not see.
    # The test's worker processes inherit PYTHONPATH.
    site="${MW_GPU_SITE:-/tmp/mw-gpu-site}"
    rm -rf "$site"
    pip_in() { "$python" -m pip install --disable-pip-version-check -q --no-index --find-links "$out" --target "$site" "$@"; }
    pip_in --no-deps "$(ls "$out"/multiworld_rs-*.whl | head -n 1)"
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    py="$python"
    "$py" -c 'import numpy' 2>/dev/null || pip_in numpy || {
        echo "numpy is missing from $python's environment and $out has no wheel for it" \
             "(build with MW_GPU_PYTHON_VERSION=<its X.Y>)" >&2
        exit 1
    }
    "$py" -c 'import pytest, pytest_timeout' 2>/dev/null || pip_in pytest pytest-timeout
    echo "== environment"
    nvidia-smi -L 2>/dev/null || echo "(no nvidia-smi)"
    "$py" - <<'PY'
import multiworld_rs as mw
print("multiworld_rs NCCL_BUILT", mw.NCCL_BUILT)
try:
    import torch
    print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
          "devices", torch.cuda.device_count())
except ImportError:
    print("no torch: the CUDA tests will be skipped")
try:
    import nvidia.nccl, os
    print("nccl wheel", os.path.join(list(nvidia.nccl.__path__)[0], "lib"))
except ImportError:
    print("no nvidia.nccl wheel (NCCL_LIBRARY or the loader path must find libnccl.so.2)")
PY
    echo "== pytest tests/test_cuda.py"
    cd "$crate"
    exec "$py" -m pytest -q -rs -p no:cacheprovider tests/test_cuda.py "$@"
    ;;
*)
    echo "usage: $0 build | run [pytest args]" >&2
    exit 2
    ;;
esac
