//! GPU tests: real NCCL on a real device. Each test first loads the runtime
//! and looks for a device; where there is none it prints `skipped: <reason>`
//! and returns, so the suite passes on machines without a GPU. Set
//! `MULTIWORLD_NCCL_REQUIRE_GPU=1` to turn a skip into a failure (do this on
//! the GPU machine, so a broken install cannot pass silently).
//!
//! Run on a GPU machine (see the crate README):
//! `MULTIWORLD_NCCL_REQUIRE_GPU=1 cargo test -p multiworld-nccl --test gpu -- --nocapture --test-threads=1`

// Helpers below are test code too: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use multiworld_nccl::{
    AbortOutcome, CloseOutcome, CommConfig, CommState, DType, DeviceBuffer, NcclComm, NcclError, NcclRuntime,
    ReduceOp,
};

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
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn read_f32(buf: &DeviceBuffer) -> Vec<f32> {
    f32s(&buf.to_host_vec(T).unwrap())
}

fn ramp(n: usize, k: f32) -> Vec<f32> {
    (0..n).map(|i| i as f32 * k + 1.0).collect()
}

#[test]
fn device_all_reduce_and_broadcast_are_correct() {
    let Some(rt) = gpu("device_all_reduce_and_broadcast_are_correct") else {
        return;
    };
    let comm = world_of_one(&rt);
    assert_eq!((comm.rank(), comm.size(), comm.state()), (0, 1, CommState::Live));
    let input = ramp(1 << 20, 0.5);
    let send = comm.upload(DType::F32, &f32_bytes(&input)).unwrap();
    assert_eq!(read_f32(&send), input, "host -> device -> host round trip");

    let mut recv = comm.alloc(DType::F32, input.len()).unwrap();
    assert!(read_f32(&recv).iter().all(|x| *x == 0.0), "alloc zeroes");
    comm.all_reduce(&send, &mut recv, ReduceOp::Sum)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(read_f32(&recv), input, "sum over one rank is the identity");

    for op in [ReduceOp::Max, ReduceOp::Min, ReduceOp::Product, ReduceOp::Avg] {
        let mut b = comm.upload(DType::F32, &f32_bytes(&input)).unwrap();
        comm.all_reduce_in_place(&mut b, op).unwrap().wait().unwrap();
        assert_eq!(read_f32(&b), input, "{op} over one rank");
    }

    let mut b = comm.upload(DType::F32, &f32_bytes(&input)).unwrap();
    comm.broadcast(&mut b, 0).unwrap().wait().unwrap();
    assert_eq!(read_f32(&b), input, "broadcast from the only rank");

    let mut r = comm.alloc(DType::F32, input.len()).unwrap();
    comm.reduce(&send, &mut r, ReduceOp::Sum, 0)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(read_f32(&r), input, "reduce to root 0");

    // Types NCCL lacks travel as bytes; integer and bool reductions.
    let shorts: Vec<u8> = (0..1000i16).flat_map(|x| (x * 3).to_ne_bytes()).collect();
    let mut s = comm.upload(DType::I16, &shorts).unwrap();
    comm.broadcast(&mut s, 0).unwrap().wait().unwrap();
    assert_eq!(s.to_host_vec(T).unwrap(), shorts);
    let longs: Vec<u8> = (0..1000i64).flat_map(|x| (x - 500).to_ne_bytes()).collect();
    let mut l = comm.upload(DType::I64, &longs).unwrap();
    comm.all_reduce_in_place(&mut l, ReduceOp::Sum)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(l.to_host_vec(T).unwrap(), longs);
    let bools = vec![0u8, 1, 1, 0, 1];
    let mut bb = comm.upload(DType::Bool, &bools).unwrap();
    comm.all_reduce_in_place(&mut bb, ReduceOp::Sum)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(bb.to_host_vec(T).unwrap(), bools);
    assert!(matches!(
        comm.all_reduce_in_place(&mut s, ReduceOp::Sum),
        Err(NcclError::Unsupported { .. })
    ));

    assert!(comm.poll_error().is_none());
    match comm.close(T) {
        CloseOutcome::Destroyed { elapsed } => println!("closed in {elapsed:?}"),
        other => panic!("close: {other:?}"),
    }
}

#[test]
fn every_operation_works_on_a_world_of_one() {
    let Some(rt) = gpu("every_operation_works_on_a_world_of_one") else {
        return;
    };
    let comm = world_of_one(&rt);
    let input = ramp(4096, 2.0);
    let send = comm.upload(DType::F32, &f32_bytes(&input)).unwrap();

    let mut out = comm.alloc(DType::F32, input.len()).unwrap();
    comm.all_gather(&send, &mut out).unwrap().wait().unwrap();
    assert_eq!(read_f32(&out), input, "all_gather");

    let mut out = comm.alloc(DType::F32, input.len()).unwrap();
    comm.reduce_scatter(&send, &mut out, ReduceOp::Sum)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(read_f32(&out), input, "reduce_scatter");

    // Grouped send/recv to self.
    let mut out = comm.alloc(DType::F32, input.len()).unwrap();
    comm.all_to_all(&send, &mut out).unwrap().wait().unwrap();
    assert_eq!(read_f32(&out), input, "all_to_all");

    let mut out = comm.alloc(DType::F32, input.len()).unwrap();
    let n = [input.len()];
    comm.all_to_all_uneven(&send, &n, &mut out, &n)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(read_f32(&out), input, "all_to_all_uneven");

    let mut out = comm.alloc(DType::F32, input.len()).unwrap();
    comm.gather(&send, Some(&mut out), 0).unwrap().wait().unwrap();
    assert_eq!(read_f32(&out), input, "gather");

    let mut out = comm.alloc(DType::F32, input.len()).unwrap();
    comm.scatter(Some(&send), &mut out, 0).unwrap().wait().unwrap();
    assert_eq!(read_f32(&out), input, "scatter");

    comm.barrier().unwrap().wait().unwrap();

    // Zero-length buffers and operations.
    let empty = comm.alloc(DType::F32, 0).unwrap();
    let mut empty2 = comm.alloc(DType::F32, 0).unwrap();
    comm.all_reduce(&empty, &mut empty2, ReduceOp::Sum)
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
}

#[test]
fn two_worlds_in_one_process_are_independent() {
    let Some(rt) = gpu("two_worlds_in_one_process_are_independent") else {
        return;
    };
    let a = world_of_one(&rt);
    let b = world_of_one(&rt);
    let xa = ramp(1 << 16, 1.0);
    let xb = ramp(1 << 16, -3.0);
    let mut ba = a.upload(DType::F32, &f32_bytes(&xa)).unwrap();
    let mut bb = b.upload(DType::F32, &f32_bytes(&xb)).unwrap();
    for _ in 0..10 {
        let ha = a.all_reduce_in_place(&mut ba, ReduceOp::Sum).unwrap();
        let hb = b.all_reduce_in_place(&mut bb, ReduceOp::Max).unwrap();
        hb.wait().unwrap();
        ha.wait().unwrap();
    }
    assert_eq!(read_f32(&ba), xa);
    assert_eq!(read_f32(&bb), xb);
    // Both worlds driven from two threads at once.
    std::thread::scope(|s| {
        s.spawn(|| {
            for _ in 0..50 {
                a.all_reduce_in_place(&mut ba, ReduceOp::Sum)
                    .unwrap()
                    .wait()
                    .unwrap();
            }
        });
        s.spawn(|| {
            for _ in 0..50 {
                b.barrier().unwrap().wait().unwrap();
            }
        });
    });
    assert_eq!(read_f32(&ba), xa);
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
    let mut h = healthy.upload(DType::F32, &f32_bytes(&x)).unwrap();
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
    healthy
        .all_reduce_in_place(&mut h, ReduceOp::Sum)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(read_f32(&h), x);
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
    let mut h = healthy.upload(DType::F32, &f32_bytes(&x)).unwrap();
    healthy
        .all_reduce_in_place(&mut h, ReduceOp::Sum)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(read_f32(&h), x);
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
