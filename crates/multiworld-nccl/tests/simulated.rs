//! The communicator's state machine against a *fake* CUDA driver and NCCL
//! (`fake/fake_cuda_nccl.c` of the test kit, compiled at test time with `cc`
//! into `libcuda.so.1` and `libnccl.so.2`; `multiworld_testkit::fake_nccl`). Device memory is host memory, so these
//! tests run on any machine and exercise what a GPU-less CI could not
//! otherwise reach: the real `dlopen`/`dlsym` path, non-blocking init
//! polling, the `ncclConfig_t` and unique-id ABI (the fake rejects a wrong
//! layout), completion events, asynchronous errors, deadlines, abort, an
//! abort that hangs (quarantine) while another world keeps working,
//! graceful close, version-gated revoke/shrink, and that teardown releases
//! every stream, event, allocation and context reference.
//!
//! The fake keeps global state, so the tests take a lock and run one at a
//! time; each compares resource counts before and after rather than to zero.

// Test code: a failed unwrap is a failed test. The unsafe code loads a
// library by name to see whether a real NCCL is installed.
#![allow(clippy::unwrap_used, clippy::expect_used, unsafe_code)]

mod device_checks;

use multiworld_testkit::fake_nccl as fake;

use fake::{fake, fake_with};

use std::path::PathBuf;
use std::time::{Duration, Instant};

use multiworld_nccl::{
    AbortOutcome, CloseOutcome, CommConfig, CommState, CudaDriver, DeviceContext, LibraryKind, LibrarySearch,
    NcclComm, NcclError, NcclRuntime, NcclVersion, ShrinkMode,
};
use multiworld_types::{DType, ReduceOp, Tensor};

const T: Duration = Duration::from_secs(10);

fn cfg(rank: usize, size: usize) -> CommConfig {
    CommConfig::new(rank, size)
        .with_init_timeout(T)
        .with_op_timeout(T)
        .with_abort_deadline(Duration::from_secs(2))
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

#[test]
fn loads_through_dlopen_and_reads_the_version() {
    let (_g, f) = fake();
    let rt = f.runtime().unwrap();
    assert_eq!(rt.version(), NcclVersion::new(2, 27, 3));
    assert!(rt.supports_shrink());
    assert!(!rt.supports_revoke());
    assert_eq!(rt.device_count().unwrap(), 1);
    assert_eq!(rt.cuda_driver_version().unwrap(), (12, 4));
    assert!(rt.nccl_library().ends_with("libnccl.so.2"));
    let id = rt.unique_id().unwrap();
    assert_eq!(multiworld_nccl::UniqueId::from_bytes(&id.to_bytes()).unwrap(), id);
}

/// NCCL installed as the pip wheel in a venv that is not activated, found
/// through the venv's `python3` on `PATH` (a Python 3.12 layout):
/// `<venv>/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2`.
#[test]
fn nccl_is_loaded_from_the_pip_wheel_of_a_venv_python_on_path() {
    let (_g, _f) = fake();
    // SAFETY: probing for a system NCCL, which would be found first by name.
    if unsafe { libloading::Library::new("libnccl.so.2") }.is_ok() {
        println!("skipped: a system libnccl.so.2 is found before any wheel here");
        return;
    }
    let (nccl, cuda) = fake::fake_libs();
    let root = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("venv-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let wheel = root.join("venv/lib/python3.12/site-packages/nvidia/nccl/lib");
    std::fs::create_dir_all(&wheel).unwrap();
    std::fs::copy(nccl, wheel.join("libnccl.so.2")).unwrap();
    let bin = root.join("venv/bin");
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::write(bin.join("python3"), b"").unwrap();
    let search = LibrarySearch {
        path: vec![root.join("no-python-here"), bin],
        cuda_driver_library: Some(cuda.clone()),
        ..LibrarySearch::default()
    };
    let rt = NcclRuntime::load_with(&search).unwrap();
    assert_eq!(
        rt.nccl_library(),
        wheel.join("libnccl.so.2").display().to_string()
    );
    assert_eq!(rt.version(), NcclVersion::new(2, 27, 3));
    // The library stays mapped (never unloaded); its file can go.
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn too_old_an_nccl_is_refused() {
    let (_g, f) = fake_with(21_305, 1);
    match f.runtime() {
        Err(NcclError::VersionTooOld { found, required, .. }) => {
            assert_eq!(found, NcclVersion::new(2, 13, 5));
            assert_eq!(required, NcclVersion::MINIMUM);
        }
        other => panic!("expected VersionTooOld, got {other:?}"),
    }
}

#[test]
fn no_device_is_a_clear_error() {
    let (_g, f) = fake_with(22_703, 0);
    let rt = f.runtime().unwrap();
    assert_eq!(rt.device_count().unwrap(), 0);
    let id = rt.unique_id().unwrap();
    let e = NcclComm::init(&rt, &cfg(0, 1), &id).unwrap_err();
    assert!(matches!(e, NcclError::NoDevice { .. }), "{e:?}");
    assert!(e.is_unavailable());
    // cuInit's answer is per process (cached by the runtime, as by CUDA), so
    // a machine with a device means a new runtime here.
    f.reset(22_703, 1);
    let rt = f.runtime().unwrap();
    let e = NcclComm::init(&rt, &cfg(0, 1).with_device(3), &id).unwrap_err();
    assert!(
        e.to_string().contains("device 3 requested but only 1 visible"),
        "{e}"
    );
}

#[test]
fn operations_run_and_teardown_releases_everything() {
    let (_g, f) = fake();
    let before = f.live();
    let rt = f.runtime().unwrap();
    let id = rt.unique_id().unwrap();
    let comm = NcclComm::init(&rt, &cfg(0, 1), &id).unwrap();
    assert_eq!(comm.state(), CommState::Live);
    {
        // Every buffer and handle of this block is dropped before close.
        let x: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5).collect();
        let send = comm.upload(DType::F32, &f32_bytes(&x)).unwrap();
        let mut recv = comm.alloc(DType::F32, x.len()).unwrap();
        assert!(recv.to_host_vec(T).unwrap().iter().all(|b| *b == 0));
        let h = comm.all_reduce(&send, &mut recv, ReduceOp::Sum).unwrap();
        h.wait().unwrap();
        assert!(h.is_completed().unwrap());
        assert_eq!(recv.to_host_vec(T).unwrap(), f32_bytes(&x));

        let mut out = comm.alloc(DType::F32, x.len()).unwrap();
        comm.all_to_all(&send, &mut out).unwrap().wait().unwrap();
        assert_eq!(
            out.to_host_vec(T).unwrap(),
            f32_bytes(&x),
            "grouped self send/recv"
        );
        let mut out = comm.alloc(DType::F32, x.len()).unwrap();
        comm.gather(&send, Some(&mut out), 0).unwrap().wait().unwrap();
        assert_eq!(out.to_host_vec(T).unwrap(), f32_bytes(&x));
        let mut out = comm.alloc(DType::F32, x.len()).unwrap();
        comm.scatter(Some(&send), &mut out, 0).unwrap().wait().unwrap();
        assert_eq!(out.to_host_vec(T).unwrap(), f32_bytes(&x));
        let mut out = comm.alloc(DType::F32, x.len()).unwrap();
        comm.all_gather(&send, &mut out).unwrap().wait().unwrap();
        comm.reduce_scatter(&send, &mut out, ReduceOp::Max)
            .unwrap()
            .wait()
            .unwrap();
        comm.reduce(&send, &mut out, ReduceOp::Min, 0)
            .unwrap()
            .wait()
            .unwrap();
        let shorts: Vec<u8> = (0..10i16).flat_map(|v| v.to_ne_bytes()).collect();
        let mut s = comm.upload(DType::I16, &shorts).unwrap();
        comm.broadcast(&mut s, 0).unwrap().wait().unwrap();
        assert_eq!(s.to_host_vec(T).unwrap(), shorts);
        comm.barrier().unwrap().wait().unwrap();
        // Ordered behind another stream (here the legacy default one), on
        // the device: the event it records is released again (counted below).
        // SAFETY: 0 is the legacy default stream.
        unsafe { comm.order_after_stream(0) }.unwrap();
        comm.all_reduce(&send, &mut recv, ReduceOp::Sum)
            .unwrap()
            .wait()
            .unwrap();
        assert_eq!(recv.to_host_vec(T).unwrap(), f32_bytes(&x));
        assert!(comm.poll_error().is_none());
    }
    match comm.close(T) {
        CloseOutcome::Destroyed { .. } => {}
        other => panic!("close: {other:?}"),
    }
    drop(rt);
    assert_eq!(
        f.live(),
        before,
        "comms, allocations, streams, events, ctx refs, pools"
    );
}

/// The result checks of `tests/gpu.rs` (`tests/device_checks`), against
/// the fake: they pass with operations that move data, and fail against a
/// broken NCCL whose operations complete without writing anything (which
/// an in-place "result == input" check on a world of one cannot see).
#[test]
fn the_gpu_result_checks_pass_here_and_catch_an_nccl_that_writes_nothing() {
    let (_g, f) = fake();
    let before = f.live();
    let rt = f.runtime().unwrap();
    let comm = NcclComm::init(&rt, &cfg(0, 1), &rt.unique_id().unwrap()).unwrap();
    device_checks::every_result_is_written(&comm);

    f.noop(true);
    let x = f32_bytes(&device_checks::ramp(100, 0.5));
    let mut b = comm.upload(DType::F32, &x).unwrap();
    comm.all_reduce_in_place(&mut b, ReduceOp::Sum)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(b.to_host_vec(T).unwrap(), x, "the weak check is fooled");
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        device_checks::every_result_is_written(&comm)
    }));
    f.noop(false);
    let message = caught.expect_err("the checks passed against an NCCL that writes nothing");
    let message = message
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| message.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default();
    assert!(message.contains("wrong result"), "{message}");
    drop(b);
    assert!(matches!(comm.close(T), CloseOutcome::Destroyed { .. }));
    drop(rt);
    assert_eq!(f.live(), before);
}

/// An enqueue that NCCL answers with `ncclInProgress` is polled (holding the
/// issue lock) until the communicator is ready, and at most `op_timeout`:
/// then the operation fails with a timeout and the communicator is failed.
/// A call that blocks inside NCCL makes the issue take as long.
#[test]
fn an_enqueue_in_progress_is_polled_until_ready_or_its_deadline() {
    let (_g, f) = fake();
    let before = f.live();
    let rt = f.runtime().unwrap();
    let op_timeout = Duration::from_millis(400);
    let comm = NcclComm::init(
        &rt,
        &cfg(0, 1).with_op_timeout(op_timeout),
        &rt.unique_id().unwrap(),
    )
    .unwrap();
    let x = f32_bytes(&device_checks::ramp(256, 0.25));
    let send = comm.upload(DType::F32, &x).unwrap();

    // In progress for 50 polls, then done.
    f.stall_last(50, 0);
    let got = device_checks::into_poisoned(&comm, DType::F32, 256, |o| {
        comm.all_reduce(&send, o, ReduceOp::Sum)
    });
    assert_eq!(got, x);
    // The NCCL call itself takes 150 ms.
    f.stall_last(0, 150);
    let started = Instant::now();
    let h = comm.all_reduce(&send, &mut comm.alloc(DType::F32, 256).unwrap(), ReduceOp::Sum);
    let took = started.elapsed();
    h.unwrap().wait().unwrap();
    assert!(took >= Duration::from_millis(150), "{took:?}");
    assert_eq!(comm.state(), CommState::Live);

    // Never ready: the issue gives up at op_timeout.
    f.stall_last(i32::MAX, 0);
    let mut out = comm.alloc(DType::F32, 256).unwrap();
    let started = Instant::now();
    let e = comm.all_reduce(&send, &mut out, ReduceOp::Sum).unwrap_err();
    let took = started.elapsed();
    assert!(
        matches!(e, NcclError::Timeout { op: "ncclAllReduce", after } if after == op_timeout),
        "{e:?}"
    );
    assert!(took >= op_timeout && took < op_timeout * 5, "{took:?}");
    assert!(e.is_world_fatal());
    assert_eq!(comm.state(), CommState::Failed);
    assert!(matches!(comm.poll_error(), Some(NcclError::Timeout { .. })));
    f.stall_last(0, 0);
    assert!(matches!(comm.abort(T), AbortOutcome::Aborted { .. }));
    drop((send, out, comm, rt));
    assert_eq!(f.live(), before);
}

#[test]
fn dropping_a_live_communicator_aborts_it() {
    let (_g, f) = fake();
    let before = f.live();
    let rt = f.runtime().unwrap();
    let comm = NcclComm::init(&rt, &cfg(0, 1), &rt.unique_id().unwrap()).unwrap();
    let _buf = comm.alloc(DType::U8, 16).unwrap();
    drop(comm);
    drop(_buf);
    assert_eq!(f.live(), before);
}

#[test]
fn an_async_error_fails_the_world_and_abort_releases_it() {
    let (_g, f) = fake();
    let before = f.live();
    let rt = f.runtime().unwrap();
    let comm = NcclComm::init(&rt, &cfg(0, 1), &rt.unique_id().unwrap()).unwrap();
    let mut buf = comm.alloc(DType::F32, 8).unwrap();
    f.fail_last(6); // ncclRemoteError: a peer died
    let e = comm.poll_error().expect("the injected error");
    assert!(matches!(e, NcclError::Nccl { code: 6, .. }), "{e:?}");
    assert!(e.is_world_fatal());
    assert!(e.to_string().contains("remote process exited"), "{e}");
    assert_eq!(comm.state(), CommState::Failed);
    assert!(
        matches!(comm.poll_error(), Some(NcclError::Nccl { code: 6, .. })),
        "sticky"
    );
    assert!(matches!(
        comm.all_reduce_in_place(&mut buf, ReduceOp::Sum),
        Err(NcclError::Aborted {
            state: CommState::Failed,
            ..
        })
    ));
    assert!(matches!(comm.abort(T), AbortOutcome::Aborted { .. }));
    assert_eq!(comm.state(), CommState::Aborted);
    drop((comm, buf));
    assert_eq!(f.live(), before);
}

/// An asynchronous error whose code would be a caller's mistake from a
/// call (`ncclInvalidUsage`) still fails the communicator when the
/// communicator reports it as its state: NCCL keeps it and fails every later
/// call, so nothing is left to retry.
#[test]
fn any_async_error_fails_the_communicator() {
    let (_g, f) = fake();
    let rt = f.runtime().unwrap();
    let comm = NcclComm::init(&rt, &cfg(0, 1), &rt.unique_id().unwrap()).unwrap();
    let mut buf = comm.alloc(DType::F32, 8).unwrap();
    f.fail_last(5); // ncclInvalidUsage, set as the communicator's async error
    assert!(comm.poll_error().is_some());
    assert_eq!(comm.state(), CommState::Failed);
    assert!(matches!(
        comm.all_reduce_in_place(&mut buf, ReduceOp::Sum),
        Err(NcclError::Aborted {
            state: CommState::Failed,
            ..
        })
    ));
    assert!(matches!(comm.abort(T), AbortOutcome::Aborted { .. }));
    drop((comm, buf));
}

/// An operation that meets the communicator's asynchronous error (a code
/// that, from a single call, would only be a caller's mistake) fails with an
/// error that says the world is dead, as the communicator now is.
#[test]
fn an_operation_that_meets_an_async_error_fails_world_fatal() {
    let (_g, f) = fake();
    let rt = f.runtime().unwrap();
    let comm = NcclComm::init(&rt, &cfg(0, 1), &rt.unique_id().unwrap()).unwrap();
    let mut buf = comm.alloc(DType::F32, 8).unwrap();
    f.fail_last(5); // ncclInvalidUsage, found by the operation itself
    let e = comm
        .all_reduce_in_place(&mut buf, ReduceOp::Sum)
        .and_then(|h| h.wait_timeout(T))
        .unwrap_err();
    assert_eq!(comm.state(), CommState::Failed);
    assert!(e.is_world_fatal(), "{e:?}");
    assert!(e.to_string().contains("failed"), "{e}");
    let kept = comm.poll_error().expect("the failure is kept");
    assert!(kept.is_world_fatal(), "{kept:?}");
    assert!(matches!(comm.abort(T), AbortOutcome::Aborted { .. }));
    drop((comm, buf));
}

/// A failure to query whether an enqueued operation has ended (here
/// `CUDA_ERROR_NOT_SUPPORTED`, which from a single call would only be a
/// caller's mistake) fails the communicator: the operation's fate is
/// unknown, so the error says the world is dead.
#[test]
fn a_failed_query_of_an_enqueued_operation_fails_world_fatal() {
    let (_g, f) = fake();
    let rt = f.runtime().unwrap();
    let comm = NcclComm::init(&rt, &cfg(0, 1), &rt.unique_id().unwrap()).unwrap();
    let mut buf = comm.alloc(DType::F32, 8).unwrap();
    let h = comm.all_reduce_in_place(&mut buf, ReduceOp::Sum).unwrap();
    f.event_query_fails(801);
    let e = h.is_completed().unwrap_err();
    f.event_query_fails(0);
    assert!(e.is_world_fatal(), "{e:?}");
    assert_eq!(comm.state(), CommState::Failed);
    drop(h);
    assert!(matches!(comm.abort(T), AbortOutcome::Aborted { .. }));
    drop((comm, buf));
}

/// A world's device that can no longer be made current when it is dropped
/// leaves its stream and pool to the context, but gives the context
/// reference it holds back.
#[test]
fn a_device_that_cannot_be_made_current_at_drop_gives_its_context_back() {
    let (_g, f) = fake();
    let rt = f.runtime().unwrap();
    let before = f.live()[4];
    let comm = NcclComm::init(&rt, &cfg(0, 1), &rt.unique_id().unwrap()).unwrap();
    assert!(f.live()[4] > before, "the world holds no context reference");
    f.no_set_current(true);
    drop(comm);
    f.no_set_current(false);
    assert_eq!(f.live()[4], before, "context references left");
}

#[test]
fn a_hung_operation_times_out_and_abort_frees_it() {
    let (_g, f) = fake();
    let before = f.live();
    let rt = f.runtime().unwrap();
    let comm = NcclComm::init(&rt, &cfg(0, 1), &rt.unique_id().unwrap()).unwrap();
    let mut buf = comm.alloc(DType::F32, 8).unwrap();
    f.set(false, true, false);
    let h = comm.all_reduce_in_place(&mut buf, ReduceOp::Sum).unwrap();
    f.set(false, false, false);
    assert!(!h.is_completed().unwrap());
    let start = Instant::now();
    let e = h.wait_timeout(Duration::from_millis(100)).unwrap_err();
    assert!(matches!(e, NcclError::Timeout { op: "all_reduce", .. }), "{e:?}");
    assert!(start.elapsed() < Duration::from_secs(2));
    // A host copy waits for the hung operation, bounded by its deadline.
    let e = buf
        .copy_to_host(&mut [0u8; 32], Duration::from_millis(50))
        .unwrap_err();
    assert!(
        matches!(
            e,
            NcclError::Timeout {
                op: "copy_to_host",
                ..
            }
        ),
        "{e:?}"
    );
    assert!(matches!(comm.abort(T), AbortOutcome::Aborted { .. }));
    assert!(matches!(h.wait(), Err(NcclError::Aborted { .. })));
    assert!(matches!(h.is_completed(), Err(NcclError::Aborted { .. })));
    drop((h, buf, comm));
    assert_eq!(f.live(), before);
}

#[test]
fn an_abort_that_hangs_quarantines_only_that_world() {
    let (_g, f) = fake();
    let before = f.live();
    let rt = f.runtime().unwrap();
    let stuck = NcclComm::init(&rt, &cfg(0, 1), &rt.unique_id().unwrap()).unwrap();
    let healthy = NcclComm::init(&rt, &cfg(0, 1), &rt.unique_id().unwrap()).unwrap();
    let mut sb = stuck.alloc(DType::F32, 4).unwrap();
    let pinned = sb.pinned_host_tensor().unwrap();
    f.set(false, true, false);
    let pending = stuck.all_reduce_in_place(&mut sb, ReduceOp::Sum).unwrap();
    f.set(false, false, true);
    let start = Instant::now();
    let outcome = stuck.abort(Duration::from_millis(200));
    let took = start.elapsed();
    f.set(false, false, false);
    assert!(matches!(outcome, AbortOutcome::Quarantined { .. }), "{outcome:?}");
    assert!(outcome.is_quarantined());
    assert!(
        took >= Duration::from_millis(200) && took < Duration::from_secs(2),
        "{took:?}"
    );
    assert_eq!(stuck.state(), CommState::Quarantined);
    assert!(matches!(pending.wait(), Err(NcclError::Aborted { .. })));
    assert!(matches!(
        stuck.abort(T),
        AbortOutcome::AlreadyClosed {
            state: CommState::Quarantined
        }
    ));
    assert!(matches!(
        stuck.alloc(DType::F32, 1),
        Err(NcclError::Aborted { .. })
    ));

    // The other world is untouched.
    let x = f32_bytes(&[1.0, 2.0, 3.0]);
    let mut hb = healthy.upload(DType::F32, &x).unwrap();
    healthy
        .all_reduce_in_place(&mut hb, ReduceOp::Sum)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(hb.to_host_vec(T).unwrap(), x);
    assert!(healthy.poll_error().is_none());
    drop(hb);
    assert!(matches!(healthy.close(T), CloseOutcome::Destroyed { .. }));

    // Dropping the quarantined world neither aborts again nor frees
    // anything: its communicator, stream, pool, buffer, pinned host memory
    // and context refs leak.
    drop((pending, sb, stuck, pinned));
    let after = f.live();
    assert_eq!(after[0], before[0] + 1, "the quarantined communicator is leaked");
    assert_eq!(after[1], before[1] + 2, "its buffer and barrier scratch");
    assert_eq!(after[2], before[2] + 1, "its stream");
    assert_eq!(
        after[4],
        before[4] + 2,
        "its and its pinned tensor's context references"
    );
    assert_eq!(after[5], before[5] + 1, "its pool");
    assert_eq!(after[6], before[6] + 1, "its pinned tensor's memory");
}

#[test]
fn init_timeout_aborts_the_half_made_communicator() {
    let (_g, f) = fake();
    let before = f.live();
    let rt = f.runtime().unwrap();
    f.set(true, false, false);
    let start = Instant::now();
    let e = NcclComm::init(
        &rt,
        &cfg(0, 2).with_init_timeout(Duration::from_millis(150)),
        &rt.unique_id().unwrap(),
    )
    .unwrap_err();
    f.set(false, false, false);
    assert!(
        matches!(e, NcclError::Timeout { op: "ncclCommInitRankConfig", after } if after == Duration::from_millis(150)),
        "{e:?}"
    );
    assert!(start.elapsed() < Duration::from_secs(2));
    assert_eq!(f.live(), before);
}

#[test]
fn collectives_without_peers_hit_their_deadline() {
    let (_g, f) = fake();
    let rt = f.runtime().unwrap();
    let comm = NcclComm::init(
        &rt,
        &cfg(1, 2).with_op_timeout(Duration::from_millis(100)),
        &rt.unique_id().unwrap(),
    )
    .unwrap();
    let mut b = comm.alloc(DType::F64, 2).unwrap();
    let h = comm.all_reduce_in_place(&mut b, ReduceOp::Sum).unwrap();
    assert!(matches!(h.wait(), Err(NcclError::Timeout { .. })));
    assert!(h.is_overdue(Instant::now()));
    // Argument checks against the world size.
    assert!(matches!(
        comm.broadcast(&mut b, 2),
        Err(NcclError::InvalidArgument { .. })
    ));
    assert!(matches!(comm.send(&b, 5), Err(NcclError::InvalidArgument { .. })));
    assert!(matches!(comm.abort(T), AbortOutcome::Aborted { .. }));
}

#[test]
fn buffers_belong_to_one_world() {
    let (_g, f) = fake();
    let rt = f.runtime().unwrap();
    let a = NcclComm::init(&rt, &cfg(0, 1), &rt.unique_id().unwrap()).unwrap();
    let b = NcclComm::init(&rt, &cfg(0, 1), &rt.unique_id().unwrap()).unwrap();
    let foreign = b.alloc(DType::F32, 4).unwrap();
    let mut mine = a.alloc(DType::F32, 4).unwrap();
    let e = a.all_reduce(&foreign, &mut mine, ReduceOp::Sum).unwrap_err();
    assert!(e.to_string().contains("another communicator"), "{e}");
    assert!(!e.is_world_fatal());
    assert_eq!(a.state(), CommState::Live);
    let e = a.all_reduce_in_place(&mut mine, ReduceOp::BXor).unwrap_err();
    assert!(matches!(e, NcclError::Unsupported { .. }), "{e:?}");
}

#[test]
fn revoke_and_shrink_follow_the_runtime_version() {
    // 2.27: shrink yes, revoke no.
    let (g, f) = fake();
    let rt = f.runtime().unwrap();
    let comm = NcclComm::init(&rt, &cfg(1, 3), &rt.unique_id().unwrap()).unwrap();
    assert!(matches!(comm.revoke(T), Err(NcclError::Unsupported { .. })));
    assert!(matches!(
        comm.shrink(&[1], ShrinkMode::Default, T),
        Err(NcclError::InvalidArgument { .. })
    ));
    let child = comm.shrink(&[0], ShrinkMode::Default, T).unwrap();
    assert_eq!((child.rank(), child.size()), (0, 2));
    assert_eq!(comm.state(), CommState::Live);
    let child2 = comm.shrink(&[2], ShrinkMode::Abort, T).unwrap();
    assert_eq!((child2.rank(), child2.size()), (1, 2));
    assert_eq!(
        comm.state(),
        CommState::Failed,
        "shrink(abort) terminates the parent's work"
    );
    drop((child, child2, comm, rt));
    drop((g, f));

    // 2.26: no shrink.
    let (g, f) = fake_with(22_605, 1);
    let rt = f.runtime().unwrap();
    assert!(!rt.supports_shrink());
    let comm = NcclComm::init(&rt, &cfg(0, 2), &rt.unique_id().unwrap()).unwrap();
    assert!(matches!(
        comm.shrink(&[1], ShrinkMode::Default, T),
        Err(NcclError::Unsupported { .. })
    ));
    drop((comm, rt));
    drop((g, f));

    // 2.29: revoke, then close destroys without finalizing.
    let (_g, f) = fake_with(22_903, 1);
    let before = f.live();
    let rt = f.runtime().unwrap();
    assert!(rt.supports_revoke());
    let comm = NcclComm::init(&rt, &cfg(0, 1), &rt.unique_id().unwrap()).unwrap();
    comm.revoke(T).unwrap();
    assert_eq!(comm.state(), CommState::Revoked);
    let mut b = comm.alloc(DType::F32, 1).unwrap();
    assert!(matches!(
        comm.all_reduce_in_place(&mut b, ReduceOp::Sum),
        Err(NcclError::Aborted {
            state: CommState::Revoked,
            ..
        })
    ));
    drop(b);
    assert!(matches!(comm.close(T), CloseOutcome::Destroyed { .. }));
    drop(rt);
    assert_eq!(f.live(), before);
}

/// Bytes over two pinned staging chunks (4 MiB each) plus an odd tail.
fn big_pattern() -> Vec<u8> {
    (0..(8 << 20) + 13).map(|i: usize| (i % 251) as u8).collect()
}

#[test]
fn host_copies_stage_through_pinned_memory_in_chunks_and_release_it() {
    let (_g, f) = fake();
    let before = f.live();
    let rt = f.runtime().unwrap();
    let ctx = DeviceContext::open(&rt, 0).unwrap();
    assert_eq!(ctx.device(), 0);
    let data = big_pattern();
    let buf = ctx.upload(DType::U8, &data, T).unwrap();
    assert_eq!(f.live()[6], before[6] + 1, "one pinned staging buffer, reused");
    let mut back = vec![0u8; data.len()];
    buf.copy_to_host(&mut back, T).unwrap();
    assert!(back == data, "chunked round trip differs");
    assert_eq!(f.live()[6], before[6] + 1, "still one pinned staging buffer");
    // A length that is not the buffer's is refused before any copy.
    let e = buf.copy_to_host(&mut back[..10], T).unwrap_err();
    assert!(e.to_string().contains("host slice is 10 bytes"), "{e}");
    ctx.synchronize(T).unwrap();
    let mut buf = buf;
    assert_eq!(buf.shape(), &[data.len()]);
    let e = buf.reshape([3, 5]).unwrap_err();
    assert!(e.to_string().contains("does not hold"), "{e}");
    buf.reshape([1, data.len()]).unwrap();
    assert_eq!(buf.shape(), &[1, data.len()]);
    drop(buf);
    drop(ctx);
    drop(rt);
    assert_eq!(f.live(), before, "pinned staging and the context are released");
}

/// A host tensor in page-locked memory is copied to and from in one direct
/// copy (no staging buffer is taken), a pageable one through staging, and
/// the pinned memory is freed with its tensor.
#[test]
fn pinned_host_tensors_are_copied_directly_and_freed_with_the_tensor() {
    let (_g, f) = fake();
    let before = f.live();
    let pinned = |f: &fake::Fake| f.live()[6] - before[6];
    let rt = f.runtime().unwrap();
    let ctx = DeviceContext::open(&rt, 0).unwrap();
    let data = big_pattern();
    let mut buf = ctx.alloc(DType::U8, data.len()).unwrap();
    let mut host = buf.pinned_host_tensor().unwrap();
    assert!(host.is_page_locked());
    assert_eq!((host.dtype(), host.numel()), (DType::U8, data.len()));
    assert!(host.as_bytes().iter().all(|&b| b == 0), "zeroed");
    assert_eq!(pinned(&f), 1, "the tensor's own pinned memory");
    host.bytes_mut().copy_from_slice(&data);
    buf.copy_from_host_tensor(&mut host, T).unwrap();
    let mut back = buf.pinned_host_tensor().unwrap();
    buf.copy_to_host_tensor(&mut back, T).unwrap();
    assert!(back.as_bytes() == &data[..], "direct round trip differs");
    assert_eq!(pinned(&f), 2, "no staging buffer was taken");
    // A pageable tensor goes through the world's staging buffer.
    let mut plain = Tensor::zeros(DType::U8, [data.len()]).unwrap();
    assert!(!plain.is_page_locked());
    buf.copy_to_host_tensor(&mut plain, T).unwrap();
    assert!(plain.as_bytes() == &data[..], "staged copy differs");
    assert_eq!(pinned(&f), 3, "one staging buffer for the pageable tensor");
    let mut short = Tensor::zeros(DType::U8, [10]).unwrap();
    let e = buf.copy_to_host_tensor(&mut short, T).unwrap_err();
    assert!(e.to_string().contains("host slice is 10 bytes"), "{e}");
    // An empty buffer has no pinned tensor to give.
    let e = ctx.alloc(DType::U8, 0).unwrap().pinned_host_tensor().unwrap_err();
    assert!(e.to_string().contains("0 bytes"), "{e}");
    drop((host, back));
    assert_eq!(
        pinned(&f),
        1,
        "pinned tensors free their memory; the staging buffer stays"
    );
    drop((buf, ctx, rt));
    assert_eq!(f.live(), before);
}

/// A direct copy that times out (it never completes) may still run: the
/// tensor gives up its memory, which is leaked rather than freed under the
/// copy. One whose stream is stuck behind earlier work times out before it
/// is enqueued: its tensor keeps its memory.
#[test]
fn a_direct_copy_that_times_out_leaks_the_tensor_memory() {
    let (_g, f) = fake();
    let rt = f.runtime().unwrap();
    let ctx = DeviceContext::open(&rt, 0).unwrap();
    let buf = ctx.alloc(DType::F32, 8).unwrap();
    let mut host = buf.pinned_host_tensor().unwrap();
    f.copies_hang(true);
    let start = Instant::now();
    let e = buf
        .copy_to_host_tensor(&mut host, Duration::from_millis(50))
        .unwrap_err();
    f.copies_hang(false);
    assert!(
        matches!(
            e,
            NcclError::Timeout {
                op: "copy_to_host_tensor",
                ..
            }
        ),
        "{e:?}"
    );
    assert!(start.elapsed() < Duration::from_secs(2));
    assert_eq!(host.numel(), 0, "the tensor gave up its memory");
    let pinned = f.live()[6];
    drop(host);
    assert_eq!(f.live()[6], pinned, "the memory under the copy was never freed");
    // The stream is stuck now: a second copy times out waiting for the
    // first, before it is enqueued, and its tensor keeps its memory.
    let other = ctx.alloc(DType::F32, 8).unwrap();
    let mut kept = other.pinned_host_tensor().unwrap();
    let e = buf
        .copy_to_host_tensor(&mut kept, Duration::from_millis(50))
        .unwrap_err();
    assert!(matches!(e, NcclError::Timeout { .. }), "{e:?}");
    assert_eq!(kept.numel(), 8, "nothing was enqueued: the tensor is whole");
    let pinned = f.live()[6];
    drop(kept);
    assert_eq!(f.live()[6], pinned - 1, "and its memory is freed with it");
    drop((buf, other, ctx, rt));
}

#[test]
fn without_pinned_memory_copies_stage_through_ordinary_memory() {
    let (_g, f) = fake();
    f.no_pinned(true);
    let before = f.live();
    let rt = f.runtime().unwrap();
    let ctx = DeviceContext::open(&rt, 0).unwrap();
    let data = big_pattern();
    let buf = ctx.upload(DType::U8, &data, T).unwrap();
    let mut back = vec![0u8; data.len()];
    buf.copy_to_host(&mut back, T).unwrap();
    assert!(back == data, "round trip differs");
    let e = buf.pinned_host_tensor().unwrap_err();
    assert!(e.to_string().contains("cuMemHostAlloc"), "{e}");
    assert_eq!(f.live()[6], before[6], "no pinned memory was taken");
    drop((buf, ctx, rt));
    assert_eq!(f.live(), before);
}

/// Device memory and host copies need only the CUDA driver: with NCCL
/// missing (`NCCL_LIBRARY` pointing nowhere) the NCCL runtime cannot load,
/// but a `CudaDriver` does, and a `DeviceContext` on it works.
#[test]
fn a_device_context_needs_only_the_cuda_driver() {
    let (_g, f) = fake();
    let before = f.live();
    let (_, cuda) = fake::fake_libs();
    let search = LibrarySearch {
        nccl_library: Some(PathBuf::from("/nonexistent/libnccl.so.2")),
        cuda_driver_library: Some(cuda.clone()),
        ..LibrarySearch::default()
    };
    assert!(matches!(
        NcclRuntime::load_with(&search),
        Err(NcclError::LibraryNotFound {
            library: LibraryKind::Nccl,
            ..
        })
    ));
    let driver = CudaDriver::load_with(&search).unwrap();
    assert_eq!(driver.library(), cuda.display().to_string());
    assert_eq!(driver.version().unwrap(), (12, 4));
    assert_eq!(driver.device_count().unwrap(), 1);
    let ctx = DeviceContext::open(&driver, 0).unwrap();
    let data = big_pattern();
    let buf = ctx.upload(DType::U8, &data, T).unwrap();
    let mut back = vec![device_checks::POISON; data.len()];
    buf.copy_to_host(&mut back, T).unwrap();
    assert!(back == data, "round trip differs");
    ctx.synchronize(T).unwrap();
    let e = DeviceContext::open(&driver, 1).unwrap_err();
    assert!(matches!(e, NcclError::NoDevice { .. }), "{e:?}");
    drop((buf, ctx, driver));
    assert_eq!(f.live(), before, "the context and its memory are released");
}

#[test]
fn a_device_context_for_a_missing_device_is_a_clear_error() {
    let (_g, f) = fake();
    let rt = f.runtime().unwrap();
    let e = DeviceContext::open(&rt, 5).unwrap_err();
    assert!(
        e.to_string().contains("device 5 requested but only 1 visible"),
        "{e}"
    );
}
