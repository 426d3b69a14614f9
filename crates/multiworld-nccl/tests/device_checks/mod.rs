//! Device-side result checks shared by `tests/gpu.rs` (a real GPU) and
//! `tests/simulated.rs` (the fake CUDA driver and NCCL, whose operations
//! on a world of one copy each input to its output, as real NCCL does).
//!
//! On a world of one every reduction's result is the rank's own input, so
//! an in-place check ("the buffer still holds the input") passes even if
//! the operation did nothing. Here every result goes **out of place into a
//! buffer filled with [`POISON`]**, checked to hold the poison first, and is
//! compared byte for byte after: an operation that writes nothing, writes
//! the wrong buffer or too few elements, or maps the dtype wrongly fails.
//! The inputs are non-trivial (distinct, fractional, both signs; no element
//! is the poison) and are checked unchanged afterwards.
//!
//! What one GPU cannot show: that values from *different* ranks are
//! combined (sum of two inputs, avg dividing by the size, a non-root
//! receiving the root's data). Cross-rank correctness needs 2+ GPUs.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used, dead_code)]

use std::time::Duration;

use multiworld_nccl::{DeviceBuffer, NcclComm, NcclError, OpHandle, nccl_reduction};
use multiworld_types::{DType, ReduceOp};

/// The byte every result buffer holds before the operation writes it.
pub const POISON: u8 = 0xA5;

/// Host copies' timeout.
const T: Duration = Duration::from_secs(30);

/// Distinct, fractional f32 values of both signs (exact in f32).
pub fn ramp(n: usize, k: f32) -> Vec<f32> {
    (0..n).map(|i| (i % 4093) as f32 * k - 517.25).collect()
}

/// Native-endian bytes of values.
pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

/// A `len`-element buffer of `dtype` full of [`POISON`] (checked).
pub fn poisoned(comm: &NcclComm, dtype: DType, len: usize) -> DeviceBuffer {
    let b = comm.upload(dtype, &vec![POISON; len * dtype.size()]).unwrap();
    assert!(
        b.to_host_vec(T).unwrap().iter().all(|x| *x == POISON),
        "the poisoned buffer does not hold the poison"
    );
    b
}

/// Runs `op` into a fresh poisoned buffer and returns its bytes afterwards.
pub fn into_poisoned(
    comm: &NcclComm,
    dtype: DType,
    len: usize,
    op: impl FnOnce(&mut DeviceBuffer) -> Result<OpHandle, NcclError>,
) -> Vec<u8> {
    let mut out = poisoned(comm, dtype, len);
    op(&mut out).unwrap().wait().unwrap();
    out.to_host_vec(T).unwrap()
}

/// Whether `op` reduces `dtype` with this runtime's NCCL; if not, checks
/// that the communicator refuses it with `Unsupported`.
fn reduces(comm: &NcclComm, dtype: DType, op: ReduceOp, send: &DeviceBuffer) -> bool {
    if nccl_reduction(dtype, op, comm.runtime().version()).is_ok() {
        return true;
    }
    let mut out = comm.alloc(dtype, send.len()).unwrap();
    let e = comm.all_reduce(send, &mut out, op).unwrap_err();
    assert!(matches!(e, NcclError::Unsupported { .. }), "{dtype} {op}: {e:?}");
    println!("{dtype} {op}: unsupported by this NCCL ({e})");
    false
}

/// Every reduction of `dtype` in `ops`, out of place: all_reduce and reduce
/// to root 0 must each write exactly `want` (a world of one).
fn reductions(comm: &NcclComm, dtype: DType, ops: &[ReduceOp], input: &[u8], want: &[u8]) {
    let send = comm.upload(dtype, input).unwrap();
    let n = send.len();
    for &op in ops {
        if !reduces(comm, dtype, op, &send) {
            continue;
        }
        let got = into_poisoned(comm, dtype, n, |o| comm.all_reduce(&send, o, op));
        assert!(got == want, "all_reduce {dtype} {op}: wrong result");
        let got = into_poisoned(comm, dtype, n, |o| comm.reduce(&send, o, op, 0));
        assert!(got == want, "reduce {dtype} {op} to root 0: wrong result");
    }
    assert!(
        send.to_host_vec(T).unwrap() == input,
        "{dtype}: the input changed"
    );
}

/// Checks that every operation of a world of one writes its result: see
/// the module docs. `comm` must be a world of size 1.
pub fn every_result_is_written(comm: &NcclComm) {
    assert_eq!(comm.size(), 1, "these checks are for a world of one");
    // Odd, and over 4096 elements: a wrong count leaves a poisoned tail.
    let n = 4099;
    let x = ramp(n, 0.75);
    let xb = f32_bytes(&x);
    assert!(xb.chunks_exact(4).all(|c| c != [POISON; 4]));

    // Reductions: every op on f32; f64, integers and bool too.
    let all = [
        ReduceOp::Sum,
        ReduceOp::Product,
        ReduceOp::Max,
        ReduceOp::Min,
        ReduceOp::Avg,
    ];
    reductions(comm, DType::F32, &all, &xb, &xb);
    let d: Vec<u8> = (0..257)
        .flat_map(|i| (f64::from(i) * -1.125 + 3.5).to_ne_bytes())
        .collect();
    reductions(comm, DType::F64, &all, &d, &d);
    let l: Vec<u8> = (0..1000i64)
        .flat_map(|i| (i * 7919 - 3_000_000).to_ne_bytes())
        .collect();
    reductions(
        comm,
        DType::I64,
        &[ReduceOp::Sum, ReduceOp::Product, ReduceOp::Max],
        &l,
        &l,
    );
    let w: Vec<u8> = (0..999i32).flat_map(|i| (i * -31 + 77).to_ne_bytes()).collect();
    reductions(comm, DType::I32, &[ReduceOp::Min, ReduceOp::Sum], &w, &w);
    // bool: sum is logical or, product logical and; over one rank, itself.
    let bools: Vec<u8> = (0..101).map(|i| u8::from(i % 3 == 0)).collect();
    reductions(
        comm,
        DType::Bool,
        &[ReduceOp::Sum, ReduceOp::Product],
        &bools,
        &bools,
    );
    // i16 has no NCCL type: reductions are refused, data movement works.
    let shorts: Vec<u8> = (0..1001i16).flat_map(|i| (i * 3 - 1500).to_ne_bytes()).collect();
    let s16 = comm.upload(DType::I16, &shorts).unwrap();
    assert!(!reduces(comm, DType::I16, ReduceOp::Sum, &s16));
    let got = into_poisoned(comm, DType::I16, 1001, |o| comm.broadcast_into(Some(&s16), o, 0));
    assert!(got == shorts, "broadcast_into i16 (as bytes)");

    // Data movement, f32.
    let send = comm.upload(DType::F32, &xb).unwrap();
    let got = into_poisoned(comm, DType::F32, n, |o| comm.broadcast_into(Some(&send), o, 0));
    assert!(got == xb, "broadcast_into from root 0");
    let got = into_poisoned(comm, DType::F32, n, |o| comm.all_gather(&send, o));
    assert!(got == xb, "all_gather");
    let got = into_poisoned(comm, DType::F32, n, |o| {
        comm.reduce_scatter(&send, o, ReduceOp::Sum)
    });
    assert!(got == xb, "reduce_scatter");
    let got = into_poisoned(comm, DType::F32, n, |o| comm.all_to_all(&send, o));
    assert!(got == xb, "all_to_all");
    let got = into_poisoned(comm, DType::F32, n, |o| {
        comm.all_to_all_uneven(&send, &[n], o, &[n])
    });
    assert!(got == xb, "all_to_all_uneven");
    let got = into_poisoned(comm, DType::F32, n, |o| comm.gather(&send, Some(o), 0));
    assert!(got == xb, "gather");
    let got = into_poisoned(comm, DType::F32, n, |o| comm.scatter(Some(&send), o, 0));
    assert!(got == xb, "scatter");
    assert!(send.to_host_vec(T).unwrap() == xb, "the input changed");

    // In place: on a world of one these can only show that nothing is
    // corrupted (the out-of-place checks above show that data moves).
    let mut b = comm.upload(DType::F32, &xb).unwrap();
    comm.all_reduce_in_place(&mut b, ReduceOp::Sum)
        .unwrap()
        .wait()
        .unwrap();
    comm.broadcast(&mut b, 0).unwrap().wait().unwrap();
    comm.reduce_in_place(&mut b, ReduceOp::Max, 0)
        .unwrap()
        .wait()
        .unwrap();
    assert!(
        b.to_host_vec(T).unwrap() == xb,
        "in-place operations changed the data"
    );
    comm.barrier().unwrap().wait().unwrap();

    // The root must pass a send buffer like its receive buffer.
    let mut out = comm.alloc(DType::F32, n).unwrap();
    assert!(matches!(
        comm.broadcast_into(None, &mut out, 0),
        Err(NcclError::InvalidArgument { .. })
    ));
    let mut short = comm.alloc(DType::F32, 3).unwrap();
    assert!(matches!(
        comm.broadcast_into(Some(&send), &mut short, 0),
        Err(NcclError::InvalidArgument { .. })
    ));
    let mut ints = comm.alloc(DType::I32, n).unwrap();
    assert!(matches!(
        comm.broadcast_into(Some(&send), &mut ints, 0),
        Err(NcclError::InvalidArgument { .. })
    ));
    assert!(comm.poll_error().is_none());
}
