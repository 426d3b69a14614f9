#!/usr/bin/env bash
# Builds the multiworld_rs Python package into a virtual environment and runs
# its pytest suite. Works from any directory, non-interactively (CI=true).
#
#   crates/multiworld-py/scripts/test.sh [pytest args...]
#
# The venv is target/py-venv at the repository root (or $MW_PY_VENV), made on
# first use and reused after; maturin, pytest, pytest-timeout, numpy,
# ml_dtypes and mypy (for tests/test_types.py) come from the package
# registry when missing. The extension is
# built with `maturin develop` (debug; MW_PY_RELEASE=1 for an optimized
# build) into $CARGO_TARGET_DIR (default: the repository's target/).
# The extension is built with the `nccl` feature by default (it builds
# without CUDA or NCCL installed), so the NCCL path runs against the test
# kit's fake CUDA driver and NCCL, as the Rust tests' does; tests that need
# a GPU skip without one. MW_PY_FEATURES names other features; set it empty
# (MW_PY_FEATURES=) for the default wheel's build, without NCCL.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
crate="$(cd "$here/.." && pwd)"
root="$(cd "$crate/../.." && pwd)"
venv="${MW_PY_VENV:-$root/target/py-venv}"
python="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
    echo "== creating $venv"
    "$python" -m venv "$venv"
fi
py="$venv/bin/python"
if ! "$py" -c 'import maturin, pytest, pytest_timeout, numpy, ml_dtypes, mypy.version as v
assert (2, 4) <= tuple(map(int, v.__version__.split("+")[0].split(".")[:2])) < (3, 0)' 2>/dev/null; then
    echo "== installing the build and test requirements"
    "$py" -m pip install --disable-pip-version-check -q --upgrade pip
    "$py" -m pip install --disable-pip-version-check -q \
        'maturin>=1.5,<2' 'pytest>=7' 'pytest-timeout>=2' 'numpy>=1.22' 'ml_dtypes>=0.2' 'mypy>=2.4,<3'
fi

echo "== building multiworld_rs"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$root/target}"
release=()
if [ "${MW_PY_RELEASE:-0}" = 1 ]; then release=(--release); fi
features="${MW_PY_FEATURES-nccl}"
if [ -n "$features" ]; then release+=(--features "$features"); fi
(cd "$crate" && VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH" \
    "$venv/bin/maturin" develop --quiet ${release[@]+"${release[@]}"} 2>&1 | tail -n 20) || {
    echo "maturin develop failed" >&2
    exit 1
}

echo "== pytest"
cd "$crate"
exec "$py" -m pytest -q -rs -p no:cacheprovider "$@" tests
