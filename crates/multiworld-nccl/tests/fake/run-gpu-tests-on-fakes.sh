#!/usr/bin/env bash
# Runs both GPU test binaries (multiworld-nccl's tests/gpu.rs and the
# facade's tests/gpu_worlds.rs) against the fake CUDA driver and NCCL of
# the test kit (crates/multiworld-testkit/fake/fake_cuda_nccl.c), which then
# look like a machine with one GPU.
# This checks the GPU tests' own logic on a machine without a GPU; it says
# nothing about real NCCL.
#
#   crates/multiworld-nccl/tests/fake/run-gpu-tests-on-fakes.sh
#       every test must pass;
#   FAKE_NCCL_NOOP=1 crates/multiworld-nccl/tests/fake/run-gpu-tests-on-fakes.sh
#       the fake NCCL completes every operation without moving any data:
#       both binaries must fail (their result checks catch it).
#
# Skipped: gpu.rs's init_times_out_when_peers_never_come (the fake completes
# a multi-rank init without any peer, real NCCL waits for them).
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../../.." && pwd)"
libs="$(mktemp -d)"
trap 'rm -rf "$libs"' EXIT
for what in NCCL:libnccl.so.2 CUDA:libcuda.so.1; do
    "${CC:-cc}" -shared -fPIC -O1 "-DFAKE_${what%%:*}" -o "$libs/${what#*:}" \
        "$root/crates/multiworld-testkit/fake/fake_cuda_nccl.c"
done
export NCCL_LIBRARY="$libs/libnccl.so.2" CUDA_DRIVER_LIBRARY="$libs/libcuda.so.1"
export MULTIWORLD_NCCL_REQUIRE_GPU=1
cd "$root"

runs=(
    "cargo test -p multiworld-nccl --test gpu -- --test-threads=1 --skip init_times_out_when_peers_never_come"
    "cargo test -p multiworld --features nccl --test gpu_worlds -- --test-threads=1"
)
if [ "${FAKE_NCCL_NOOP:-0}" != 1 ]; then
    for run in "${runs[@]}"; do $run; done
    echo "run-gpu-tests-on-fakes: every GPU test passed against the fakes"
    exit 0
fi
status=0
for run in "${runs[@]}"; do
    if $run; then
        echo "run-gpu-tests-on-fakes: PASSED against an NCCL that moves no data: $run" >&2
        status=1
    else
        echo "run-gpu-tests-on-fakes: failed as it must against an NCCL that moves no data: $run"
    fi
done
exit "$status"
