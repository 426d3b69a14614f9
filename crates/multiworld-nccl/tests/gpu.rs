//! GPU tests: real NCCL on a real device. Each test first loads the runtime
//! and looks for a device; where there is none it prints `skipped: <reason>`
//! and returns, so the suite passes on machines without a GPU. Set
//! `MULTIWORLD_NCCL_REQUIRE_GPU=1` to turn a skip into a failure (do this on
//! the GPU machine, so a broken install cannot pass silently).
//!
//! Every test runs on one GPU, in worlds of one: results are checked out of
//! place in buffers poisoned beforehand (`tests/device_checks`), so an
//! operation that writes nothing fails, but values combined *across* ranks
//! cannot be checked; that needs 2+ GPUs. The same checks run against the
//! fake CUDA driver and NCCL in `tests/simulated.rs`.
//!
//! Run on a GPU machine (see the crate README):
//! `MULTIWORLD_NCCL_REQUIRE_GPU=1 cargo test -p multiworld-nccl --test gpu -- --nocapture --test-threads=1`

// Helpers below are test code too: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod device_checks;

use std::time::{Duration, Instant};

use device_checks::{POISON, every_result_is_written, into_poisoned, ramp};

use multiworld_nccl::{
    AbortOutcome, CloseOutcome, CommConfig, CommState, DeviceBuffer, NcclComm, NcclError, NcclRuntime,
};
use multiworld_types::{DType, ReduceOp};

const T: Duration = Duration::from_secs(30);

/// The runtime, or `None` after printing why the test is skipped.
fn gpu(test: &str) -> Option<NcclRuntime> {
    let require = std::env::var_os("MULTIWORLD_NCCL_REQUIRE_GPU").is_some_and(|v| v == "1");
    let reason = match NcclRuntime::load() {
        Err(e) => format!("{e}"),
        Ok(rt) => match rt.device_count() {
            Ok(0) => "the CUDA driver reports no device".to_owned(),
            Err(e) => format!("{e}"),
            Ok(n) => {
                println!(
                    "{test}: NCCL {} ({}), {n} device(s), shrink={} revoke={}",
                    rt.version(),
                    rt.nccl_library(),
                    rt.supports_shrink(),
                    rt.supports_revoke()
                );
                return Some(rt);
            }
        },
    };
    assert!(!require, "{test}: MULTIWORLD_NCCL_REQUIRE_GPU=1 but: {reason}");
    println!("skipped: {test}: {reason}");
    None
}

fn world_of_one(rt: &NcclRuntime) -> NcclComm {
    let id = rt.unique_id().unwrap();
    let cfg = CommConfig::new(0, 1)
        .with_init_timeout(T)
        .with_op_timeout(T)
        .with_abort_deadline(Duration::from_secs(10));
    NcclComm::init(rt, &cfg, &id).unwrap()
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    device_checks::f32_bytes(v)
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn read_f32(buf: &DeviceBuffer) -> Vec<f32> {
    f32s(&buf.to_host_vec(T).unwrap())
}

/// `comm.all_reduce(send → a poisoned buffer, op)`, waited; the result.
fn all_reduce_into_poisoned(comm: &NcclComm, send: &DeviceBuffer, op: ReduceOp) -> Vec<f32> {
    f32s(&into_poisoned(comm, DType::F32, send.len(), |o| {
        comm.all_reduce(send, o, op)
    }))
}

/// Every operation on a world of one writes its result out of place into
/// a poisoned buffer, for every reduce op and several dtypes (see
/// `tests/device_checks`): a no-op or a wrong buffer fails. Cross-rank
/// correctness (values from different ranks combined) needs 2+ GPUs and is
/// not tested here.
#[test]
fn every_operation_writes_its_result_on_a_world_of_one() {
    let Some(rt) = gpu("every_operation_writes_its_result_on_a_world_of_one") else {
        return;
    };
    let comm = world_of_one(&rt);
    assert_eq!((comm.rank(), comm.size(), comm.state()), (0, 1, CommState::Live));
    let input = ramp(1 << 20, 0.5);
    let send = comm.upload(DType::F32, &f32_bytes(&input)).unwrap();
    assert_eq!(read_f32(&send), input, "host -> device -> host round trip");
    let recv = comm.alloc(DType::F32, input.len()).unwrap();
    assert!(read_f32(&recv).iter().all(|x| *x == 0.0), "alloc zeroes");
    // 4 MiB through every reduce op.
    for op in [
        ReduceOp::Sum,
        ReduceOp::Product,
        ReduceOp::Max,
        ReduceOp::Min,
        ReduceOp::Avg,
    ] {
        assert_eq!(
            all_reduce_into_poisoned(&comm, &send, op),
            input,
            "{op} over one rank"
        );
    }
    every_result_is_written(&comm);
    match comm.close(T) {
        CloseOutcome::Destroyed { elapsed } => println!("closed in {elapsed:?}"),
        other => panic!("close: {other:?}"),
    }
}

#[test]
fn zero_lengths_and_argument_checks() {
    let Some(rt) = gpu("zero_lengths_and_argument_checks") else {
        return;
    };
    let comm = world_of_one(&rt);
    let input = ramp(4096, 2.0);
    let send = comm.upload(DType::F32, &f32_bytes(&input)).unwrap();

    // Zero-length buffers and operations.
    let empty = comm.alloc(DType::F32, 0).unwrap();
    let mut empty2 = comm.alloc(DType::F32, 0).unwrap();
    comm.all_reduce(&empty, &mut empty2, ReduceOp::Sum)
        .unwrap()
        .wait()
        .unwrap();
    comm.broadcast_into(Some(&empty), &mut empty2, 0)
        .unwrap()
        .wait()
        .unwrap();
    assert!(empty.to_host_vec(T).unwrap().is_empty());

    // Argument checks.
    let mut short = comm.alloc(DType::F32, 3).unwrap();
    assert!(matches!(
        comm.all_reduce(&send, &mut short, ReduceOp::Sum),
        Err(NcclError::InvalidArgument { .. })
    ));
    assert!(matches!(
        comm.broadcast(&mut short, 1),
        Err(NcclError::InvalidArgument { .. })
    ));
    assert!(matches!(
        comm.broadcast_into(Some(&send), &mut short, 0),
        Err(NcclError::InvalidArgument { .. })
    ));
    assert!(matches!(
        short.copy_from_host(&[0u8; 5], T),
        Err(NcclError::InvalidArgument { .. })
    ));
    let other = world_of_one(&rt);
    let foreign = other.alloc(DType::F32, input.len()).unwrap();
    let mut out = comm.alloc(DType::F32, input.len()).unwrap();
    assert!(matches!(
        comm.all_reduce(&foreign, &mut out, ReduceOp::Sum),
        Err(NcclError::InvalidArgument { .. })
    ));
    let mut b = comm.alloc(DType::BF16, 4).unwrap();
    assert!(matches!(
        comm.all_reduce_in_place(&mut b, ReduceOp::BXor),
        Err(NcclError::Unsupported { .. })
    ));
}

#[test]
fn two_worlds_in_one_process_are_independent() {
    let Some(rt) = gpu("two_worlds_in_one_process_are_independent") else {
        return;
    };
    let a = world_of_one(&rt);
    let b = world_of_one(&rt);
    let n = 1 << 16;
    let xa = ramp(n, 1.0);
    let xb = ramp(n, -3.0);
    let sa = a.upload(DType::F32, &f32_bytes(&xa)).unwrap();
    let sb = b.upload(DType::F32, &f32_bytes(&xb)).unwrap();
    let poison = vec![POISON; n * 4];
    let mut ra = a.alloc(DType::F32, n).unwrap();
    let mut rb = b.alloc(DType::F32, n).unwrap();
    // Out of place into re-poisoned buffers, so every round must write.
    for _ in 0..10 {
        ra.copy_from_host(&poison, T).unwrap();
        rb.copy_from_host(&poison, T).unwrap();
        let ha = a.all_reduce(&sa, &mut ra, ReduceOp::Sum).unwrap();
        let hb = b.all_reduce(&sb, &mut rb, ReduceOp::Max).unwrap();
        hb.wait().unwrap();
        ha.wait().unwrap();
        assert_eq!(read_f32(&ra), xa);
        assert_eq!(read_f32(&rb), xb);
    }
    // Both worlds driven from two threads at once.
    std::thread::scope(|s| {
        s.spawn(|| {
            for _ in 0..50 {
                ra.copy_from_host(&poison, T).unwrap();
                a.all_reduce(&sa, &mut ra, ReduceOp::Sum).unwrap().wait().unwrap();
                assert_eq!(read_f32(&ra), xa);
            }
        });
        s.spawn(|| {
            for i in 0..50 {
                b.barrier().unwrap().wait().unwrap();
                if i % 10 == 0 {
                    assert_eq!(all_reduce_into_poisoned(&b, &sb, ReduceOp::Min), xb);
                }
            }
        });
    });
}

#[test]
fn aborting_one_world_leaves_the_other_running() {
    let Some(rt) = gpu("aborting_one_world_leaves_the_other_running") else {
        return;
    };
    let doomed = world_of_one(&rt);
    let healthy = world_of_one(&rt);
    let x = ramp(1 << 18, 0.25);
    let mut d = doomed.upload(DType::F32, &f32_bytes(&x)).unwrap();
    let h = healthy.upload(DType::F32, &f32_bytes(&x)).unwrap();
    let pending = doomed.all_reduce_in_place(&mut d, ReduceOp::Sum).unwrap();

    let outcome = doomed.abort(Duration::from_secs(10));
    println!("abort: {outcome:?}");
    assert!(matches!(outcome, AbortOutcome::Aborted { .. }), "{outcome:?}");
    assert_eq!(doomed.state(), CommState::Aborted);
    assert!(matches!(
        doomed.abort(Duration::from_secs(1)),
        AbortOutcome::AlreadyClosed {
            state: CommState::Aborted
        }
    ));
    assert!(matches!(
        doomed.all_reduce_in_place(&mut d, ReduceOp::Sum),
        Err(NcclError::Aborted { .. })
    ));
    assert!(matches!(pending.wait(), Err(NcclError::Aborted { .. })));
    assert!(matches!(doomed.poll_error(), Some(NcclError::Aborted { .. })));

    // The other world keeps working, and the aborted one's buffers drop fine.
    assert_eq!(all_reduce_into_poisoned(&healthy, &h, ReduceOp::Sum), x);
    drop(d);
    drop(doomed);
    healthy.barrier().unwrap().wait().unwrap();
    assert!(healthy.poll_error().is_none());
}

#[test]
fn an_operation_carries_its_deadline() {
    let Some(rt) = gpu("an_operation_carries_its_deadline") else {
        return;
    };
    let id = rt.unique_id().unwrap();
    let op_timeout = Duration::from_secs(7);
    let comm = NcclComm::init(&rt, &CommConfig::new(0, 1).with_op_timeout(op_timeout), &id).unwrap();
    let mut b = comm.upload(DType::F32, &f32_bytes(&ramp(1024, 1.0))).unwrap();
    let before = Instant::now();
    let h = comm.all_reduce_in_place(&mut b, ReduceOp::Sum).unwrap();
    assert!(h.deadline() >= before + op_timeout);
    assert!(h.deadline() <= Instant::now() + op_timeout);
    assert!(!h.is_overdue(Instant::now()));
    assert!(h.is_overdue(h.deadline()));
    h.wait_timeout(Duration::from_secs(10)).unwrap();
    assert!(h.is_completed().unwrap());
    assert_eq!(h.op(), "all_reduce");
}

#[test]
fn init_times_out_when_peers_never_come() {
    let Some(rt) = gpu("init_times_out_when_peers_never_come") else {
        return;
    };
    let id = rt.unique_id().unwrap();
    let cfg = CommConfig::new(0, 2)
        .with_init_timeout(Duration::from_secs(3))
        .with_abort_deadline(Duration::from_secs(10));
    let start = Instant::now();
    let e = NcclComm::init(&rt, &cfg, &id).unwrap_err();
    let took = start.elapsed();
    println!("init without peers: {e} after {took:?}");
    assert!(matches!(e, NcclError::Timeout { .. }), "{e:?}");
    assert!(e.is_world_fatal());
    assert!(took < Duration::from_secs(15), "{took:?}");
    // The process can still make worlds.
    let ok = world_of_one(&rt);
    ok.barrier().unwrap().wait().unwrap();
}

#[test]
fn a_hung_operation_times_out_and_abort_is_bounded() {
    let Some(rt) = gpu("a_hung_operation_times_out_and_abort_is_bounded") else {
        return;
    };
    let hung = world_of_one(&rt);
    let healthy = world_of_one(&rt);
    // A receive from self with no matching send never completes.
    let mut b = hung.alloc(DType::F32, 1024).unwrap();
    match hung.recv(&mut b, 0) {
        Ok(h) => {
            let e = h.wait_timeout(Duration::from_millis(500)).unwrap_err();
            println!("hung recv: {e}");
            assert!(matches!(e, NcclError::Timeout { .. }), "{e:?}");
            assert!(!h.is_completed().unwrap_or(true) || hung.state() != CommState::Live);
        }
        Err(e) => println!("NCCL refused the unmatched recv up front ({e}); still testing abort"),
    }
    let start = Instant::now();
    let outcome = hung.abort(Duration::from_secs(10));
    println!("abort of the hung world: {outcome:?} in {:?}", start.elapsed());
    assert!(start.elapsed() < Duration::from_secs(12));
    assert!(matches!(
        outcome,
        AbortOutcome::Aborted { .. } | AbortOutcome::Quarantined { .. }
    ));
    // Whatever happened to it, the other world is unaffected.
    let x = ramp(1000, 1.0);
    let h = healthy.upload(DType::F32, &f32_bytes(&x)).unwrap();
    assert_eq!(all_reduce_into_poisoned(&healthy, &h, ReduceOp::Sum), x);
}

#[test]
fn optional_calls_follow_the_runtime_version() {
    let Some(rt) = gpu("optional_calls_follow_the_runtime_version") else {
        return;
    };
    assert_eq!(rt.supports_shrink(), rt.version().has_shrink());
    assert_eq!(rt.supports_revoke(), rt.version().has_revoke());
    let comm = world_of_one(&rt);
    match comm.revoke(T) {
        Ok(()) => {
            assert!(rt.supports_revoke());
            assert_eq!(comm.state(), CommState::Revoked);
            let mut b = comm.alloc(DType::F32, 4).unwrap();
            assert!(matches!(
                comm.all_reduce_in_place(&mut b, ReduceOp::Sum),
                Err(NcclError::Aborted { .. })
            ));
            println!("revoke: ok; close: {:?}", comm.close(T));
        }
        Err(NcclError::Unsupported { what }) => {
            assert!(!rt.supports_revoke());
            println!("revoke unsupported: {what}");
        }
        Err(e) => panic!("revoke: {e}"),
    }
}
