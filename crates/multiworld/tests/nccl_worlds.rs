//! NCCL worlds driven by the world manager, against the fake CUDA driver and
//! NCCL of `multiworld-nccl` (`crates/multiworld-nccl/tests/fake`; device
//! memory is host memory, one device): device collectives on worlds of one,
//! an asynchronous NCCL error, a device operation past its deadline and an
//! abort that hangs, each breaking (or quarantining) only its own world
//! while another NCCL world keeps working; rank 0 without NCCL failing every
//! rank's join with its reason; and device tensors staged through pinned
//! host memory over a TCP world between two members sharing one device.
//!
//! The fakes keep global state: every test holds the harness lock. Runs with
//! the `nccl` feature (`cargo test --workspace --all-features`).
#![cfg(feature = "nccl")]
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]
// The harness lock serialises whole tests (each on its own runtime), so it is
// held across their awaits on purpose.
#![allow(clippy::await_holding_lock)]

#[path = "../../multiworld-nccl/tests/fake/mod.rs"]
mod fake;

use std::time::{Duration, Instant};

use multiworld::nccl::{DType, DeviceBuffer, DeviceContext, ReduceOp};
use multiworld::{
    Backend, BreakCause, Rank, Tag, WorldConfig, WorldError, WorldEvent, WorldManager, WorldState,
};
use tokio::sync::broadcast;

const T: Duration = Duration::from_secs(10);

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

fn nccl_cfg(name: &str, rank: u32, size: u32, store: &str) -> WorldConfig {
    let mut c = WorldConfig::new(name, rank, size, store);
    c.backend = Backend::Nccl;
    c.join_timeout = T;
    c
}

/// A manager using the fake NCCL, with a store server for its worlds.
async fn manager(f: &fake::Fake) -> (WorldManager, String) {
    let m = WorldManager::default();
    m.use_nccl_runtime(f.runtime().unwrap());
    let store = m.serve_store("127.0.0.1:0").await.unwrap().to_string();
    (m, store)
}

async fn next_event_for(
    rx: &mut broadcast::Receiver<WorldEvent>,
    world: &str,
    limit: Duration,
) -> WorldEvent {
    let deadline = Instant::now() + limit;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, rx.recv()).await {
            Ok(Ok(e)) if e.world() == world => return e,
            Ok(Ok(_)) => continue,
            Ok(Err(e)) => panic!("event channel: {e}"),
            Err(_) => panic!("no event for {world} within {limit:?}"),
        }
    }
}

/// Runs an all-reduce on `world`'s device and checks the result (a world of
/// one: the input itself).
async fn all_reduce_works(world: &multiworld::World) {
    let nccl = world.nccl().unwrap();
    let x: Vec<f32> = (0..1000).map(|i| i as f32 * 0.25).collect();
    let mut buf = nccl.upload(DType::F32, &f32_bytes(&x)).unwrap();
    nccl.all_reduce(&mut buf, ReduceOp::Sum)
        .unwrap()
        .wait()
        .await
        .unwrap();
    assert_eq!(nccl.download(&buf).unwrap(), f32_bytes(&x));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nccl_worlds_run_device_operations_and_an_nccl_error_breaks_only_its_world() {
    let (_g, f) = fake::fake();
    let before = f.live();
    let (m, store) = manager(&f).await;
    let a = m.join(nccl_cfg("a", 0, 1, &store)).await.unwrap();
    // Joined last, so the fake's "last communicator" is b's.
    let b = m.join(nccl_cfg("b", 0, 1, &store)).await.unwrap();
    let mut events = m.events();
    assert_eq!(f.live()[0], before[0] + 2, "one NCCL communicator per world");

    for w in [&a, &b] {
        all_reduce_works(w).await;
        let nccl = w.nccl().unwrap();
        let x: Vec<f32> = vec![1.5; 64];
        let send = nccl.upload(DType::F32, &f32_bytes(&x)).unwrap();
        let mut out = nccl.alloc(DType::F32, 64).unwrap();
        for op in [
            nccl.all_gather(&send, &mut out).unwrap(),
            nccl.reduce_scatter(&send, &mut out, ReduceOp::Max).unwrap(),
            nccl.all_to_all(&send, &mut out).unwrap(),
            nccl.gather(&send, Some(&mut out), Rank(0)).unwrap(),
            nccl.scatter(Some(&send), &mut out, Rank(0)).unwrap(),
            nccl.barrier().unwrap(),
        ] {
            op.wait().await.unwrap();
        }
        assert_eq!(nccl.download(&out).unwrap(), f32_bytes(&x));
        let mut s = nccl.upload(DType::F32, &f32_bytes(&x)).unwrap();
        nccl.broadcast(&mut s, Rank(0)).unwrap().wait().await.unwrap();
        nccl.reduce(&mut s, ReduceOp::Min, Rank(0))
            .unwrap()
            .wait()
            .await
            .unwrap();
        assert_eq!(nccl.download(&s).unwrap(), f32_bytes(&x));
        // A call error is the caller's, not the world's.
        let short = nccl.alloc(DType::F32, 3).unwrap();
        let e = nccl.all_gather(&short, &mut out).unwrap_err();
        assert!(matches!(e, WorldError::InvalidArgument { .. }), "{e}");
        // Host tensors go to the device and back with dtype and shape.
        let t = multiworld::Tensor::from_vec((0..6i64).collect::<Vec<_>>(), [2, 3]).unwrap();
        let mut d = nccl.upload_tensor(&t).unwrap();
        assert_eq!((d.dtype(), d.shape()), (DType::I64, &[2usize, 3][..]));
        nccl.all_reduce(&mut d, ReduceOp::Sum)
            .unwrap()
            .wait()
            .await
            .unwrap();
        let back = nccl.download_tensor(&d).unwrap();
        assert_eq!(back.shape(), &[2, 3]);
        assert_eq!(back.as_slice::<i64>().unwrap(), &[0, 1, 2, 3, 4, 5]);
        assert_eq!(w.state(), WorldState::Ready);
    }

    // NCCL reports an asynchronous error on b's communicator.
    let broke = Instant::now();
    f.fail_last(5); // ncclInternalError
    match next_event_for(&mut events, "b", T).await {
        WorldEvent::Broken {
            cause: BreakCause::Device { reason },
            ..
        } => assert!(reason.to_lowercase().contains("nccl"), "{reason}"),
        other => panic!("expected b broken by its device: {other:?}"),
    }
    let detected = broke.elapsed();
    eprintln!("NCCL async error -> world b broken after {detected:?}");
    assert!(detected < Duration::from_secs(2), "detected after {detected:?}");
    let e = b.nccl().unwrap_err();
    assert!(e.is_world_broken(), "{e}");
    assert!(matches!(
        next_event_for(&mut events, "b", T).await,
        WorldEvent::Removed { .. }
    ));
    assert_eq!(
        f.live()[0],
        before[0] + 1,
        "b's communicator was aborted and freed"
    );

    // a never noticed.
    assert_eq!(a.state(), WorldState::Ready);
    all_reduce_works(&a).await;
    m.leave("a").await.unwrap();
    assert_eq!(f.live()[0], before[0], "leaving releases a's communicator");
    m.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_operation_past_its_deadline_breaks_only_its_world() {
    let (_g, f) = fake::fake();
    let (m, store) = manager(&f).await;
    let ok = m.join(nccl_cfg("ok", 0, 1, &store)).await.unwrap();
    let mut slow_cfg = nccl_cfg("slow", 0, 1, &store);
    slow_cfg.op_timeout = Some(Duration::from_millis(300));
    let slow = m.join(slow_cfg).await.unwrap();
    let mut events = m.events();

    // The next operation never completes (its stream stays hung).
    let nccl = slow.nccl().unwrap();
    let mut buf = nccl.alloc(DType::F32, 16).unwrap();
    f.set(false, true, false);
    let issued = Instant::now();
    let op = nccl.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
    f.set(false, false, false);
    let e = op.wait().await.unwrap_err();
    let failed_after = issued.elapsed();
    eprintln!("device op with a 300 ms deadline failed after {failed_after:?}");
    match &e {
        WorldError::Broken {
            cause: BreakCause::OpDeadline { op, after },
            ..
        } => {
            assert!(op.contains("all_reduce"), "{op}");
            assert_eq!(*after, Duration::from_millis(300));
        }
        other => panic!("expected the deadline to break the world: {other}"),
    }
    assert!(
        failed_after >= Duration::from_millis(300) && failed_after < Duration::from_secs(3),
        "failed after {failed_after:?}"
    );
    assert!(matches!(
        next_event_for(&mut events, "slow", T).await,
        WorldEvent::Broken { .. }
    ));
    assert!(matches!(
        next_event_for(&mut events, "slow", T).await,
        WorldEvent::Removed { .. }
    ));
    assert_eq!(ok.state(), WorldState::Ready);
    all_reduce_works(&ok).await;
    m.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abort_that_hangs_quarantines_only_that_world() {
    let (_g, f) = fake::fake();
    let (m, store) = manager(&f).await;
    let ok = m.join(nccl_cfg("fine", 0, 1, &store)).await.unwrap();
    let mut stuck_cfg = nccl_cfg("stuck", 0, 1, &store);
    stuck_cfg.nccl_abort_deadline = Duration::from_millis(300);
    let stuck = m.join(stuck_cfg).await.unwrap();
    let mut events = m.events();
    all_reduce_works(&stuck).await;

    // ncclCommAbort will never return (its thread is leaked for good).
    f.set(false, false, true);
    let started = Instant::now();
    stuck.abort();
    assert!(matches!(
        next_event_for(&mut events, "stuck", T).await,
        WorldEvent::Broken {
            cause: BreakCause::Aborted,
            ..
        }
    ));
    match next_event_for(&mut events, "stuck", T).await {
        WorldEvent::Quarantined { reason, .. } => assert!(reason.contains("Quarantined"), "{reason}"),
        other => panic!("expected a quarantine: {other:?}"),
    }
    assert!(matches!(
        next_event_for(&mut events, "stuck", T).await,
        WorldEvent::Removed { .. }
    ));
    let took = started.elapsed();
    eprintln!("abort that hangs (300 ms deadline) -> quarantined and removed after {took:?}");
    assert!(took < Duration::from_secs(3), "teardown took {took:?}");
    f.set(false, false, false);

    // The other world's communicator is untouched.
    assert_eq!(ok.state(), WorldState::Ready);
    all_reduce_works(&ok).await;
    m.leave("fine").await.unwrap();
    m.shutdown().await;
}

#[test]
fn rank_0_without_nccl_fails_every_ranks_join_with_its_reason() {
    // A child process, so NCCL_LIBRARY can point nowhere for the whole run.
    let exe = std::env::current_exe().unwrap();
    let out = std::process::Command::new(exe)
        .args(["--exact", "child_rank_0_without_nccl", "--ignored", "--nocapture"])
        .env("NCCL_LIBRARY", "/nonexistent/libnccl.so.2")
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    assert!(text.contains("1 passed"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run by rank_0_without_nccl_fails_every_ranks_join_with_its_reason"]
async fn child_rank_0_without_nccl() {
    let (leader, worker) = (WorldManager::default(), WorldManager::default());
    let store = leader.serve_store("127.0.0.1:0").await.unwrap().to_string();
    let started = Instant::now();
    let (a, b) = tokio::join!(
        leader.join(nccl_cfg("gpu", 0, 2, &store)),
        worker.join(nccl_cfg("gpu", 1, 2, &store)),
    );
    let (a, b) = (a.unwrap_err(), b.unwrap_err());
    let a = a.to_string();
    let b = b.to_string();
    assert!(a.contains("/nonexistent/libnccl.so.2"), "{a}");
    assert!(b.contains("rank 0 could not set up NCCL"), "{b}");
    assert!(b.contains("/nonexistent/libnccl.so.2"), "{b}");
    // Told through the store, not left to the join timeout.
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert!(leader.worlds().is_empty() && worker.worlds().is_empty());
    // The name is free again: a TCP world of that name joins.
    let (a, b) = tokio::join!(
        leader.join(WorldConfig::new("gpu", 0, 2, &store)),
        worker.join(WorldConfig::new("gpu", 1, 2, &store)),
    );
    a.unwrap();
    b.unwrap();
    leader.shutdown().await;
    worker.shutdown().await;
}

/// Bytes over two pinned staging chunks and an odd tail, as f32.
fn pattern(n: usize, seed: f32) -> Vec<f32> {
    (0..n).map(|i| seed + i as f32).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_tensors_travel_host_staged_over_a_tcp_world() {
    let (_g, f) = fake::fake();
    let before = f.live();
    let rt = f.runtime().unwrap();
    let (leader, worker) = (WorldManager::default(), WorldManager::default());
    let store = leader.serve_store("127.0.0.1:0").await.unwrap().to_string();
    let (a, b) = tokio::join!(
        leader.join(WorldConfig::new("staged", 0, 2, &store)),
        worker.join(WorldConfig::new("staged", 1, 2, &store)),
    );
    let (a, b) = (a.unwrap(), b.unwrap());
    let e = a.nccl().unwrap_err();
    assert!(e.to_string().contains("not an NCCL world"), "{e}");

    // Two members, one device: each has its own context (stream, pool,
    // pinned staging) on device 0.
    let (ctx_a, ctx_b) = (
        DeviceContext::open(&rt, 0).unwrap(),
        DeviceContext::open(&rt, 0).unwrap(),
    );
    let n = (9 << 20) / 4 + 3; // over two 4 MiB staging chunks
    let x = pattern(n, 0.5);
    let src = ctx_a.upload(DType::F32, &f32_bytes(&x), T).unwrap();
    let mut dst: DeviceBuffer = ctx_b.alloc(DType::F32, n).unwrap();
    let (sent, received) = tokio::join!(
        a.send_device(Rank(1), Tag(7), &src),
        b.recv_device(Rank(0), Tag(7), &mut dst)
    );
    sent.unwrap();
    received.unwrap();
    assert!(
        dst.to_host_vec(T).unwrap() == f32_bytes(&x),
        "device data differs"
    );

    // A receive of the wrong length is a mismatch: nothing is written and
    // the world stays up.
    let mut wrong = ctx_b.alloc(DType::F32, 10).unwrap();
    let small = ctx_a.upload(DType::F32, &f32_bytes(&[1.0; 11]), T).unwrap();
    let (sent, received) = tokio::join!(
        a.send_device(Rank(1), Tag(8), &small),
        b.recv_device(Rank(0), Tag(8), &mut wrong)
    );
    let e = received.unwrap_err();
    assert!(matches!(e, WorldError::Mismatch { .. }), "{e}");
    let _ = sent;
    assert!(wrong.to_host_vec(T).unwrap().iter().all(|b| *b == 0));
    // Wrong dtype too (i32 into f32).
    let ints = ctx_a.upload(DType::I32, &[0u8; 40], T).unwrap();
    let (sent, received) = tokio::join!(
        a.send_device(Rank(1), Tag(9), &ints),
        b.recv_device(Rank(0), Tag(9), &mut wrong)
    );
    assert!(matches!(received.unwrap_err(), WorldError::Mismatch { .. }));
    let _ = sent;

    // The world still carries traffic both ways.
    let back = ctx_b.upload(DType::F32, &f32_bytes(&[2.0, 4.0]), T).unwrap();
    let mut got = ctx_a.alloc(DType::F32, 2).unwrap();
    let (sent, received) = tokio::join!(
        b.send_device(Rank(0), Tag(1), &back),
        a.recv_device(Rank(1), Tag(1), &mut got)
    );
    sent.unwrap();
    received.unwrap();
    assert_eq!(got.to_host_vec(T).unwrap(), f32_bytes(&[2.0, 4.0]));
    assert_eq!(a.state(), WorldState::Ready);
    assert_eq!(b.state(), WorldState::Ready);

    drop((src, dst, wrong, small, ints, back, got, ctx_a, ctx_b, rt));
    assert_eq!(f.live(), before, "contexts, pinned staging and memory released");
    leader.shutdown().await;
    worker.shutdown().await;
}
