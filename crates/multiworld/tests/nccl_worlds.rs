//! NCCL worlds driven by the world manager, against the fake CUDA driver and
//! NCCL of the test kit (`multiworld_testkit::fake_nccl`; device
//! memory is host memory, one device): device collectives on worlds of one,
//! each written out of place into a poisoned buffer; an asynchronous NCCL
//! error, a device operation past its deadline and an abort that hangs, each
//! breaking (or quarantining) only its own world while another NCCL world
//! keeps working; an enqueue stuck in `ncclInProgress` that stalls neither
//! the runtime's other tasks nor another world; rank 0 without NCCL failing
//! every rank's join with its reason; and device tensors staged through
//! pinned host memory over a TCP world between two members sharing one
//! device, also with only the CUDA driver (no NCCL).
//!
//! The fakes keep global state: every test holds the harness lock. Runs with
//! the `nccl` feature (`cargo test --workspace --all-features`).
#![cfg(feature = "nccl")]
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]
// The harness lock serialises whole tests (each on its own runtime), so it is
// held across their awaits on purpose.
#![allow(clippy::await_holding_lock)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use multiworld::nccl::{DeviceBuffer, DeviceContext};
use multiworld::{
    Backend, BreakCause, Rank, Tag, WorldConfig, WorldError, WorldEvent, WorldManager, WorldState,
};
use multiworld::{DType, ReduceOp};
use multiworld::{DeviceOp, NcclWorld};
use multiworld_testkit::facade::next_event_for;
use multiworld_testkit::fake_nccl as fake;
use multiworld_testkit::process;

const T: Duration = Duration::from_secs(10);

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

fn nccl_cfg(name: &str, rank: u32, size: u32, store: &str) -> WorldConfig {
    let mut c = WorldConfig::new(name, rank, size, store).unwrap();
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

/// The byte every result buffer is filled with before an operation writes
/// it: no input of these tests contains it, so an operation that writes
/// nothing (or too little) cannot pass for the identity of a world of one.
const POISON: u8 = 0xA5;

/// Non-trivial f32 values: distinct, fractional, both signs, no poison.
fn ramp(n: usize, k: f32) -> Vec<f32> {
    (0..n).map(|i| (i % 251) as f32 * k - 31.75).collect()
}

/// Runs `op` into a fresh `len`-element f32 buffer full of [`POISON`] and
/// returns what the buffer holds afterwards.
async fn into_poisoned(
    nccl: &NcclWorld,
    len: usize,
    op: impl FnOnce(&mut DeviceBuffer) -> Result<DeviceOp, WorldError>,
) -> Vec<u8> {
    let mut out = nccl.upload(DType::F32, &vec![POISON; len * 4]).unwrap();
    assert!(nccl.download(&out).unwrap().iter().all(|b| *b == POISON));
    op(&mut out).unwrap().wait().await.unwrap();
    nccl.download(&out).unwrap()
}

/// An out-of-place all-reduce on `world`'s device into a poisoned buffer
/// (a world of one: the result is the only rank's input).
async fn all_reduce_works(world: &multiworld::World) {
    let nccl = world.nccl().unwrap();
    let x = ramp(1000, 0.25);
    let send = nccl.upload(DType::F32, &f32_bytes(&x)).unwrap();
    let got = into_poisoned(&nccl, x.len(), |out| {
        nccl.all_reduce_into(&send, out, ReduceOp::Sum)
    })
    .await;
    assert_eq!(got, f32_bytes(&x));
}

/// With `check_device_calls`, members that disagree on a device collective
/// (its size, dtype, kind or root) all fail with the same `Mismatch` naming
/// both calls, before anything reaches NCCL, and the world goes on; calls
/// that agree reach NCCL. Off by default.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disagreeing_device_collectives_fail_on_every_member_when_checked() {
    let (_g, f) = fake::fake();
    assert!(
        !WorldConfig::new("w", 0, 1, "127.0.0.1:1")
            .unwrap()
            .check_device_calls
    );
    let (m0, store) = manager(&f).await;
    let m1 = WorldManager::default();
    m1.use_nccl_runtime(f.runtime().unwrap());
    let cfg = |rank| {
        let mut c = nccl_cfg("checked", rank, 2, &store);
        c.check_device_calls = true;
        c.op_timeout = Some(Duration::from_secs(2));
        c
    };
    let (a, b) = tokio::join!(m0.join(cfg(0)), m1.join(cfg(1)));
    let (a, b) = (a.unwrap(), b.unwrap());

    // Each member's call on a thread of its own (the check waits for the
    // others' descriptions on the calling thread), then its wait.
    async fn both(
        a: &multiworld::World,
        b: &multiworld::World,
        calls: [(usize, Option<ReduceOp>, u32); 2],
    ) -> [Result<(), WorldError>; 2] {
        let run = |w: &multiworld::World, (len, op, root): (usize, Option<ReduceOp>, u32)| {
            let nccl = w.nccl().unwrap();
            tokio::task::spawn_blocking(move || {
                let send = nccl.upload(DType::F32, &f32_bytes(&ramp(len, 0.5))).unwrap();
                let mut out = nccl.upload(DType::F32, &vec![POISON; len * 4]).unwrap();
                let op = match op {
                    Some(op) => nccl.all_reduce_into(&send, &mut out, op),
                    None => nccl.broadcast_into(Some(&send), &mut out, Rank(root)),
                }?;
                tokio::runtime::Handle::current().block_on(op.wait())
            })
        };
        let (ra, rb) = tokio::join!(run(a, calls[0]), run(b, calls[1]));
        [ra.unwrap(), rb.unwrap()]
    }

    let sum = Some(ReduceOp::Sum);
    let disagreements = [
        (
            [(4, sum, 0), (5, sum, 0)],
            "rank 0 calls all_reduce of 4 × float32 (sum), rank 1 calls all_reduce of 5 × float32 (sum)",
        ),
        (
            [(4, sum, 0), (4, Some(ReduceOp::Max), 0)],
            "rank 1 calls all_reduce of 4 × float32 (max)",
        ),
        (
            [(4, sum, 0), (4, None, 0)],
            "rank 1 calls broadcast of 4 × float32 with root 0",
        ),
        (
            [(4, None, 0), (4, None, 1)],
            "rank 0 calls broadcast of 4 × float32 with root 0, rank 1 calls broadcast of 4 × float32 with root 1",
        ),
    ];
    for (calls, named) in disagreements {
        for r in both(&a, &b, calls).await {
            match r {
                Err(WorldError::Mismatch { world, detail }) => {
                    assert_eq!(world.as_str(), "checked");
                    assert!(detail.contains(named), "{detail}");
                }
                other => panic!("{calls:?}: expected a mismatch, got {other:?}"),
            }
        }
        assert_eq!((a.state(), b.state()), (WorldState::Ready, WorldState::Ready));
    }
    // Calls that agree pass the check and reach NCCL: the fake never
    // completes a collective of two ranks (real NCCL would wait for the
    // peer's kernel), so they end at the world's deadline, which breaks it
    // (the member that breaks second may see the first one go first).
    let ends = both(&a, &b, [(4, sum, 0), (4, sum, 0)]).await;
    let deadline = |r: &Result<(), WorldError>| {
        matches!(
            r,
            Err(WorldError::Broken {
                cause: BreakCause::OpDeadline { .. },
                ..
            })
        )
    };
    assert!(
        ends.iter().any(deadline),
        "the agreed call did not reach NCCL: {ends:?}"
    );
    for r in &ends {
        assert!(
            deadline(r) || matches!(r, Err(WorldError::Broken { .. })),
            "{ends:?}"
        );
    }
    m0.shutdown().await;
    m1.shutdown().await;
}

/// A checked receive waiting for its sender's announcement stops when its
/// caller's interruption hook says so (the Python package's Ctrl-C), within
/// a slice, and leaves the world as it was: nothing was enqueued, and the
/// next message meets its receive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_check_stops_within_a_slice_and_the_world_goes_on() {
    static STOP: AtomicBool = AtomicBool::new(false);
    let (_g, f) = fake::fake();
    let (m0, store) = manager(&f).await;
    let m1 = WorldManager::default();
    m1.use_nccl_runtime(f.runtime().unwrap());
    let cfg = |rank| {
        let mut c = nccl_cfg("interrupted", rank, 2, &store);
        c.check_device_calls = true;
        c
    };
    let (a, b) = tokio::join!(m0.join(cfg(0)), m1.join(cfg(1)));
    let (a, b) = (a.unwrap(), b.unwrap());
    let (na, nb) = (a.nccl().unwrap(), b.nccl().unwrap());
    let send_buf = na.upload(DType::F32, &f32_bytes(&ramp(4, 1.0))).unwrap();
    let mut recv_buf = nb.upload(DType::F32, &[POISON; 16]).unwrap();
    let waiting = tokio::task::spawn_blocking(move || {
        let started = Instant::now();
        let r = multiworld::interruptible(
            || STOP.load(Ordering::Relaxed),
            || nb.recv(&mut recv_buf, Rank(0)).map(drop),
        );
        (r, started.elapsed(), nb, recv_buf)
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let stopped_at = Instant::now();
    STOP.store(true, Ordering::Relaxed);
    let (r, took, nb, mut recv_buf) = waiting.await.unwrap();
    let after_stop = stopped_at.elapsed();
    match r {
        Err(WorldError::Timeout { op, .. }) => assert_eq!(op, "device_check (interrupted)"),
        other => panic!("{other:?}"),
    }
    assert!(took >= Duration::from_millis(250), "{took:?}");
    assert!(after_stop < Duration::from_secs(2), "{after_stop:?}");
    assert_eq!((a.state(), b.state()), (WorldState::Ready, WorldState::Ready));
    // The next message meets its receive (the withdrawn wait consumed no
    // announcement).
    STOP.store(false, Ordering::Relaxed);
    let send = tokio::task::spawn_blocking(move || {
        let r = na.send(&send_buf, Rank(1)).map(drop);
        std::mem::forget(send_buf);
        r
    });
    let recv = tokio::task::spawn_blocking(move || {
        let r = nb.recv(&mut recv_buf, Rank(0)).map(drop);
        std::mem::forget(recv_buf);
        r
    });
    send.await.unwrap().unwrap();
    recv.await.unwrap().unwrap();
    m0.shutdown().await;
    m1.shutdown().await;
}

/// The check is bounded like the call it guards: a member that never makes
/// the call breaks the world at the deadline instead of holding the caller.
/// And members must set the check alike: a join whose setting differs from
/// rank 0's fails, saying so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checked_call_no_member_answers_ends_at_the_deadline_and_members_set_the_check_alike() {
    let (_g, f) = fake::fake();
    let (m0, store) = manager(&f).await;
    let m1 = WorldManager::default();
    m1.use_nccl_runtime(f.runtime().unwrap());
    let cfg = |name: &str, rank, checks| {
        let mut c = nccl_cfg(name, rank, 2, &store);
        c.check_device_calls = checks;
        c.op_timeout = Some(Duration::from_millis(600));
        c.join_timeout = Duration::from_secs(3);
        c
    };
    let (a, b) = tokio::join!(m0.join(cfg("lone", 0, true)), m1.join(cfg("lone", 1, true)));
    let (a, _b) = (a.unwrap(), b.unwrap());
    let nccl = a.nccl().unwrap();
    let started = Instant::now();
    let r = tokio::task::spawn_blocking(move || {
        let mut buf = nccl.upload(DType::F32, &f32_bytes(&ramp(4, 1.0))).unwrap();
        nccl.all_reduce(&mut buf, ReduceOp::Sum).map(drop)
    })
    .await
    .unwrap();
    let took = started.elapsed();
    assert!(
        matches!(
            r,
            Err(WorldError::Broken {
                cause: BreakCause::OpDeadline { .. },
                ..
            })
        ),
        "{r:?}"
    );
    assert!(
        took >= Duration::from_millis(500) && took < Duration::from_secs(5),
        "{took:?}"
    );

    let (a, b) = tokio::join!(m0.join(cfg("apart", 0, true)), m1.join(cfg("apart", 1, false)));
    match b {
        Err(e @ WorldError::JoinFailed { .. }) => assert!(
            e.to_string()
                .contains("members disagree on check_device_calls: rank 0 has it on, rank 1 off"),
            "{e}"
        ),
        other => panic!("{other:?}"),
    }
    drop(a);
    m0.shutdown().await;
    m1.shutdown().await;
}

/// With `check_device_calls`, a device receive that disagrees with the
/// message its peer sends fails at once with `Mismatch` naming both (the
/// sender's message is drained into scratch memory, so the world goes on),
/// and one that agrees is enqueued; a send refused for its arguments is
/// refused before its announcement; a message too large to drain breaks
/// the world. (The fake NCCL never moves a message between two
/// communicators, so neither the drain nor the agreed message completes
/// here.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checked_device_receive_that_disagrees_with_its_message_fails_and_the_world_goes_on() {
    let (_g, f) = fake::fake();
    let (m0, store) = manager(&f).await;
    let m1 = WorldManager::default();
    m1.use_nccl_runtime(f.runtime().unwrap());
    let cfg = |rank| {
        let mut c = nccl_cfg("checked-p2p", rank, 2, &store);
        c.check_device_calls = true;
        // The fake never completes a message between two communicators:
        // long enough that nothing here ends at the deadline.
        c.op_timeout = Some(Duration::from_secs(30));
        c
    };
    let (a, b) = tokio::join!(m0.join(cfg(0)), m1.join(cfg(1)));
    let (a, b) = (a.unwrap(), b.unwrap());
    let (na, nb) = (a.nccl().unwrap(), b.nccl().unwrap());
    // Every buffer made before anything is enqueued: the fake's stream
    // stays busy with the messages it never moves, and a copy would wait
    // behind them.
    let sends: Vec<_> = [5, 4, 4]
        .map(|n| na.upload(DType::F32, &f32_bytes(&ramp(n, 1.0))).unwrap())
        .into();
    let recvs: Vec<_> = [4, 4, 4]
        .map(|n| nb.upload(DType::F32, &vec![POISON; n * 4]).unwrap())
        .into();
    // Memory of the other member's communicator: a send of it is refused.
    let foreign = nb.upload(DType::F32, &f32_bytes(&ramp(7, 1.0))).unwrap();
    let (mut sends, mut recvs) = (sends.into_iter(), recvs.into_iter());
    let mut exchange = || {
        let (na, nb) = (na.clone(), nb.clone());
        let (send_buf, mut recv_buf) = (sends.next().unwrap(), recvs.next().unwrap());
        async move {
            let send = tokio::task::spawn_blocking(move || {
                let op = na.send(&send_buf, Rank(1)).map(drop);
                // The fake never reads it: kept for the rest of the test.
                std::mem::forget(send_buf);
                op
            });
            let recv = tokio::task::spawn_blocking(move || {
                let r = nb.recv(&mut recv_buf, Rank(0)).map(drop);
                std::mem::forget(recv_buf);
                r
            });
            (send.await.unwrap(), recv.await.unwrap())
        }
    };
    let started = Instant::now();
    let (sent, received) = exchange().await;
    sent.unwrap();
    match received {
        Err(WorldError::Mismatch { world, detail }) => {
            assert_eq!(world.as_str(), "checked-p2p");
            assert_eq!(
                detail,
                "the device message disagrees with its receive: rank 0 sends 5 × float32, rank 1 receives 4 × float32"
            );
        }
        other => panic!("{other:?}"),
    }
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    assert_eq!((a.state(), b.state()), (WorldState::Ready, WorldState::Ready));
    // The next message agrees with its receive: it passes and is enqueued.
    let (sent, received) = exchange().await;
    sent.unwrap();
    received.unwrap();
    // A send refused for its arguments (7 floats, in memory of the other
    // member's communicator) is refused before its announcement: the next
    // receive meets the next message.
    let na2 = na.clone();
    let failed = tokio::task::spawn_blocking(move || {
        let r = na2.send(&foreign, Rank(1)).map(drop);
        std::mem::forget(foreign);
        r
    })
    .await
    .unwrap();
    assert!(
        matches!(failed, Err(WorldError::InvalidArgument { .. })),
        "{failed:?}"
    );
    let (sent, received) = exchange().await;
    sent.unwrap();
    received.unwrap();

    // A message the receiver cannot hold (announced by hand here: 2^50
    // floats) cannot be drained either: the messages and their
    // descriptions would be apart for good, so the world breaks.
    let words: Vec<u64> = vec![0x4d57_4445_5600_0009, 3, 1 << 50, u64::MAX, 0];
    a.communicator()
        .send(Rank(1), multiworld_types::runtime_tag(1), &words[..])
        .await
        .unwrap();
    let nb2 = nb.clone();
    let r = tokio::task::spawn_blocking(move || {
        let mut buf = nb2.alloc(DType::F32, 4).unwrap();
        let r = nb2.recv(&mut buf, Rank(0)).map(drop);
        std::mem::forget(buf);
        r
    })
    .await
    .unwrap();
    match r {
        Err(WorldError::Broken {
            cause: BreakCause::Device { reason },
            ..
        }) => assert!(
            reason.contains("could not be received")
                && reason.contains("rank 0 sends 1125899906842624 × float32")
                && reason.contains("cuMemAllocFromPoolAsync failed with error 2"),
            "{reason}"
        ),
        other => panic!("{other:?}"),
    }
    m0.shutdown().await;
    m1.shutdown().await;
}

/// An operation that completes long after the runtime's eager polls (held
/// here until released) is seen by the blocking poller, promptly; a wait
/// dropped while its operation hangs stops polling and leaves the world
/// working.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_operation_that_completes_late_ends_its_wait() {
    let (_g, f) = fake::fake();
    let (m, store) = manager(&f).await;
    let w = m.join(nccl_cfg("late", 0, 1, &store)).await.unwrap();
    let nccl = w.nccl().unwrap();
    let mut buf = nccl.upload(DType::F32, &f32_bytes(&ramp(64, 0.5))).unwrap();

    f.set(false, true, false); // the next operations never complete...
    let op = nccl.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
    let dropped = nccl.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
    f.set(false, false, false);
    let waiting = tokio::spawn(op.wait());
    // A wait dropped while its operation hangs.
    assert!(
        tokio::time::timeout(Duration::from_millis(20), dropped.wait())
            .await
            .is_err()
    );
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!waiting.is_finished(), "ended before the operation did");
    f.release_last(); // ...until now
    let released = Instant::now();
    tokio::time::timeout(T, waiting).await.unwrap().unwrap().unwrap();
    println!(
        "a late operation's wait ended {:?} after it completed",
        released.elapsed()
    );
    assert_eq!(w.state(), WorldState::Ready);
    all_reduce_works(&w).await;
    m.shutdown().await;
}

/// On a blocking caller's thread (`multiworld::as_blocking_caller`: a Python
/// thread in a blocking call) a device operation is polled on that thread,
/// not handed to the blocking pool: a late operation's wait ends promptly
/// although the runtime's only pool thread is held. The same wait from a
/// thread that is not a blocking caller does not end while the pool is held
/// (the premise of the first half).
#[test]
fn a_blocking_callers_device_wait_polls_on_its_own_thread() {
    let (_g, f) = fake::fake();
    let rt = multiworld_testkit::runtime_with_one_blocking_thread(2);
    let (m, w) = rt.block_on(async {
        let (m, store) = manager(&f).await;
        let w = m.join(nccl_cfg("caller", 0, 1, &store)).await.unwrap();
        (m, w)
    });
    let nccl = w.nccl().unwrap();
    let mut buf = nccl.upload(DType::F32, &f32_bytes(&ramp(64, 0.5))).unwrap();
    // Hold the runtime's only blocking-pool thread.
    let release_pool = multiworld_testkit::hold_blocking_pool(&rt);

    // Each operation hangs until released 100 ms later, by another thread.
    let late_op = |nccl: &NcclWorld, buf: &mut DeviceBuffer| {
        f.set(false, true, false);
        let op = nccl.all_reduce(buf, ReduceOp::Sum).unwrap();
        f.set(false, false, false);
        op
    };
    std::thread::scope(|s| {
        let op = late_op(&nccl, &mut buf);
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(100));
            f.release_last();
        });
        let t0 = Instant::now();
        let r = multiworld::as_blocking_caller(|| {
            rt.block_on(async { tokio::time::timeout(T, op.wait()).await })
        });
        let took = t0.elapsed();
        assert!(matches!(r, Ok(Ok(()))), "{r:?}");
        assert!(
            took >= Duration::from_millis(100),
            "ended before the operation: {took:?}"
        );
        assert!(took < Duration::from_secs(5), "took {took:?}");
    });
    std::thread::scope(|s| {
        let op = late_op(&nccl, &mut buf);
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(100));
            f.release_last();
        });
        let r = rt.block_on(async { tokio::time::timeout(Duration::from_secs(1), op.wait()).await });
        assert!(r.is_err(), "the wait ended while the pool was held: {r:?}");
    });
    release_pool.send(()).unwrap();
    assert_eq!(w.state(), WorldState::Ready);
    rt.block_on(async {
        all_reduce_works(&w).await;
        m.shutdown().await;
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_wait_dropped_before_the_end_leaves_the_operation_to_wait_for_again() {
    let (_g, f) = fake::fake();
    let (m, store) = manager(&f).await;
    let w = m.join(nccl_cfg("again", 0, 1, &store)).await.unwrap();
    let nccl = w.nccl().unwrap();
    let mut buf = nccl.upload(DType::F32, &f32_bytes(&ramp(64, 0.5))).unwrap();
    f.set(false, true, false);
    let mut op = nccl.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
    f.set(false, false, false);
    // The operation hangs on the device: an interrupted wait changes nothing.
    let r = tokio::time::timeout(Duration::from_millis(200), op.completed()).await;
    assert!(r.is_err(), "a hanging operation completed: {r:?}");
    assert!(!op.is_completed().unwrap());
    // A probe sees the same operation without owning it.
    let probe = op.probe();
    let r = tokio::time::timeout(Duration::from_millis(100), probe.completed()).await;
    assert!(r.is_err(), "a probe of a hanging operation completed: {r:?}");
    f.release_last();
    let r = tokio::time::timeout(T, probe.completed()).await;
    assert!(matches!(r, Ok(Ok(()))), "{r:?}");
    let r = tokio::time::timeout(T, op.completed()).await;
    assert!(matches!(r, Ok(Ok(()))), "{r:?}");
    drop(op);
    assert!(probe.is_completed().unwrap(), "the probe outlives the operation");
    assert_eq!(w.state(), WorldState::Ready);
    all_reduce_works(&w).await;
    m.shutdown().await;
    // After the world is gone, a probe says so at once.
    assert!(probe.is_completed().is_err());
    let r = tokio::time::timeout(T, probe.completed()).await;
    assert!(matches!(r, Ok(Err(_))), "{r:?}");
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
        // Every operation writes a poisoned buffer (on a world of one each
        // result is the input itself; cross-rank results need 2+ ranks).
        let nccl = w.nccl().unwrap();
        let x = ramp(64, 1.5);
        let want = f32_bytes(&x);
        let send = nccl.upload(DType::F32, &want).unwrap();
        for op in [
            ReduceOp::Sum,
            ReduceOp::Product,
            ReduceOp::Max,
            ReduceOp::Min,
            ReduceOp::Avg,
        ] {
            let got = into_poisoned(&nccl, 64, |o| nccl.all_reduce_into(&send, o, op)).await;
            assert_eq!(got, want, "all_reduce_into {op}");
            let got = into_poisoned(&nccl, 64, |o| nccl.reduce_into(&send, o, op, Rank(0))).await;
            assert_eq!(got, want, "reduce_into {op}");
        }
        let got = into_poisoned(&nccl, 64, |o| nccl.broadcast_into(Some(&send), o, Rank(0))).await;
        assert_eq!(got, want, "broadcast_into");
        let got = into_poisoned(&nccl, 64, |o| nccl.all_gather(&send, o)).await;
        assert_eq!(got, want, "all_gather");
        let got = into_poisoned(&nccl, 64, |o| nccl.reduce_scatter(&send, o, ReduceOp::Max)).await;
        assert_eq!(got, want, "reduce_scatter");
        let got = into_poisoned(&nccl, 64, |o| nccl.all_to_all(&send, o)).await;
        assert_eq!(got, want, "all_to_all");
        let got = into_poisoned(&nccl, 64, |o| nccl.gather(&send, Some(o), Rank(0))).await;
        assert_eq!(got, want, "gather");
        let got = into_poisoned(&nccl, 64, |o| nccl.scatter(Some(&send), o, Rank(0))).await;
        assert_eq!(got, want, "scatter");
        assert_eq!(
            nccl.download(&send).unwrap(),
            want,
            "inputs are left as they were"
        );
        nccl.barrier().unwrap().wait().await.unwrap();
        // In place (a world of one leaves the data as it was).
        let mut s = nccl.upload(DType::F32, &want).unwrap();
        nccl.broadcast(&mut s, Rank(0)).unwrap().wait().await.unwrap();
        nccl.reduce(&mut s, ReduceOp::Min, Rank(0))
            .unwrap()
            .wait()
            .await
            .unwrap();
        assert_eq!(nccl.download(&s).unwrap(), want);
        let mut out = nccl.alloc(DType::F32, 64).unwrap();
        // A call error is the caller's, not the world's.
        let short = nccl.alloc(DType::F32, 3).unwrap();
        let e = nccl.all_gather(&short, &mut out).unwrap_err();
        assert!(matches!(e, WorldError::InvalidArgument { .. }), "{e}");
        let e = nccl.broadcast_into(None, &mut out, Rank(0)).unwrap_err();
        assert!(e.to_string().contains("root must pass a send buffer"), "{e}");
        let e = nccl.all_reduce_into(&short, &mut out, ReduceOp::Sum).unwrap_err();
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
    f.fail_last(3); // ncclInternalError
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

/// An enqueue that NCCL keeps "in progress" (the world polls it until the
/// operation deadline, 1.5 s here) runs off the async worker: on a runtime
/// with a single worker thread, another task keeps ticking and another NCCL
/// world keeps completing device operations the whole time, and only the
/// stuck world breaks. (Issued inline, the enqueue would hold the only
/// worker for the full 1.5 s.)
/// A multi-threaded runtime with one worker: a task that blocks it stalls
/// every other task.
fn one_worker_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap()
}

/// Making an NCCL world's unique id (NCCL's own first initialisation, slow)
/// runs on a blocking thread: on a one-worker runtime another world's tasks
/// keep running while it takes its time.
#[test]
fn a_slow_nccl_initialisation_does_not_stall_other_tasks_on_the_runtime() {
    let (_g, f) = fake::fake();
    one_worker_runtime().block_on(async {
        let (m, store) = manager(&f).await;
        let steady = m.join(nccl_cfg("steady", 0, 1, &store)).await.unwrap();
        f.slow_unique_id(800);
        let joining = Arc::new(AtomicBool::new(true));
        let ticker = tokio::spawn({
            let joining = Arc::clone(&joining);
            async move {
                let (mut max_gap, mut last) = (Duration::ZERO, Instant::now());
                while joining.load(Ordering::SeqCst) {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    let now = Instant::now();
                    max_gap = max_gap.max(now - last);
                    last = now;
                }
                max_gap
            }
        });
        tokio::time::sleep(Duration::from_millis(30)).await;
        let started = Instant::now();
        // A task, so that it runs on the runtime's one worker (the future
        // `block_on` drives runs on this thread instead).
        let slow = tokio::spawn({
            let (m, cfg) = (m.clone(), nccl_cfg("slow", 0, 1, &store));
            async move { m.join(cfg).await }
        })
        .await
        .unwrap()
        .unwrap();
        let took = started.elapsed();
        joining.store(false, Ordering::SeqCst);
        let max_gap = ticker.await.unwrap();
        f.slow_unique_id(0);
        eprintln!("join with a slow unique id took {took:?}; the ticker's longest gap {max_gap:?}");
        assert!(
            took >= Duration::from_millis(800),
            "the fake was not slow: {took:?}"
        );
        assert!(
            max_gap < Duration::from_millis(400),
            "the runtime stalled for {max_gap:?}"
        );
        all_reduce_works(&steady).await;
        drop(slow);
    });
}

#[test]
fn a_hanging_enqueue_does_not_stall_other_tasks_on_the_runtime() {
    let (_g, f) = fake::fake();
    one_worker_runtime().block_on(async {
        let (m, store) = manager(&f).await;
        let steady = m.join(nccl_cfg("steady", 0, 1, &store)).await.unwrap();
        let deadline = Duration::from_millis(1500);
        let mut cfg = nccl_cfg("wedged", 0, 1, &store);
        cfg.op_timeout = Some(deadline);
        let wedged = m.join(cfg).await.unwrap();
        let mut events = m.events();
        // Joined last, so the fake's "last communicator" is wedged's: each of
        // its enqueues stays ncclInProgress forever.
        f.stall_last(i32::MAX, 0);

        let issuing = Arc::new(AtomicBool::new(false));
        let issued = Arc::new(AtomicBool::new(false));
        let ticker = tokio::spawn({
            let (issuing, issued) = (Arc::clone(&issuing), Arc::clone(&issued));
            async move {
                while !issuing.load(Ordering::SeqCst) {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                let (mut ticks, mut reduces, mut max_gap) = (0u32, 0u32, Duration::ZERO);
                let mut last = Instant::now();
                while !issued.load(Ordering::SeqCst) {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    if ticks % 10 == 0 {
                        all_reduce_works(&steady).await;
                        reduces += 1;
                    }
                    let now = Instant::now();
                    max_gap = max_gap.max(now - last);
                    last = now;
                    ticks += 1;
                }
                (ticks, reduces, max_gap, steady)
            }
        });
        let issuer = tokio::spawn({
            let (issuing, issued) = (Arc::clone(&issuing), Arc::clone(&issued));
            async move {
                let nccl = wedged.nccl().unwrap();
                let mut buf = nccl.alloc(DType::F32, 16).unwrap();
                // Let the ticker reach its loop first.
                tokio::time::sleep(Duration::from_millis(50)).await;
                issuing.store(true, Ordering::SeqCst);
                let started = Instant::now();
                let result = nccl.all_reduce(&mut buf, ReduceOp::Sum).map(|_| ());
                let took = started.elapsed();
                issued.store(true, Ordering::SeqCst);
                (result, took)
            }
        });
        let (result, took) = issuer.await.unwrap();
        let (ticks, reduces, max_gap, steady) = ticker.await.unwrap();
        eprintln!(
            "enqueue stuck in progress for {took:?}: meanwhile {ticks} ticks, {reduces} all-reduces on \
             another world, longest gap {max_gap:?}"
        );
        // The enqueue really was stuck until its deadline...
        let e = result.unwrap_err();
        assert!(e.is_world_broken(), "{e}");
        assert!(took >= deadline && took < deadline * 4, "{took:?}");
        // ...and the runtime's only worker kept running everything else.
        assert!(ticks >= 20, "only {ticks} ticks while the enqueue was stuck");
        assert!(reduces >= 2, "only {reduces} all-reduces on the other world");
        assert!(
            max_gap < Duration::from_millis(750),
            "a tick was late by {max_gap:?}"
        );
        // Broken for its deadline, whether the enqueue's own poll or the
        // watchdog saw it first (both give the same cause).
        match next_event_for(&mut events, "wedged", T).await {
            WorldEvent::Broken {
                cause: BreakCause::OpDeadline { op, after },
                ..
            } => {
                assert!(op.to_lowercase().replace('_', "").contains("allreduce"), "{op}");
                assert_eq!(after, deadline);
            }
            other => panic!("expected wedged broken by its deadline: {other:?}"),
        }
        assert!(matches!(
            next_event_for(&mut events, "wedged", T).await,
            WorldEvent::Removed { .. }
        ));
        assert_eq!(steady.state(), WorldState::Ready);
        all_reduce_works(&steady).await;
        m.shutdown().await;
    });
}

#[test]
fn rank_0_without_nccl_fails_every_ranks_join_with_its_reason() {
    // A child process, so NCCL_LIBRARY can point nowhere for the whole run.
    run_child_without_nccl("child_rank_0_without_nccl", &[]);
}

/// Runs the ignored test `name` of this binary in a child process whose
/// `NCCL_LIBRARY` points nowhere (plus `env`), and asserts that it passed.
fn run_child_without_nccl(name: &str, env: &[(&str, &std::path::Path)]) {
    let mut child = process::self_test_command(name);
    child.env("NCCL_LIBRARY", "/nonexistent/libnccl.so.2");
    for (key, value) in env {
        child.env(key, value);
    }
    let out = process::run(&mut child);
    let text = format!("{}{}", out.stdout, out.stderr);
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
        leader.join(WorldConfig::new("gpu", 0, 2, &store).unwrap()),
        worker.join(WorldConfig::new("gpu", 1, 2, &store).unwrap()),
    );
    a.unwrap();
    b.unwrap();
    leader.shutdown().await;
    worker.shutdown().await;
}

/// Host-staged device tensors need only the CUDA driver: a child process
/// with `NCCL_LIBRARY` pointing nowhere (and `CUDA_DRIVER_LIBRARY` at the
/// fake driver) moves device data over a TCP world.
#[test]
fn host_staged_device_tensors_need_only_the_cuda_driver() {
    let (_, cuda) = fake::fake_libs();
    run_child_without_nccl(
        "child_host_staged_without_nccl",
        &[("CUDA_DRIVER_LIBRARY", cuda.as_path())],
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run by host_staged_device_tensors_need_only_the_cuda_driver"]
async fn child_host_staged_without_nccl() {
    let e = multiworld::nccl::NcclRuntime::load().unwrap_err();
    assert!(e.to_string().contains("/nonexistent/libnccl.so.2"), "{e}");
    let driver = multiworld::nccl::CudaDriver::load().unwrap();
    let (ctx_a, ctx_b) = (
        DeviceContext::open(&driver, 0).unwrap(),
        DeviceContext::open(&driver, 0).unwrap(),
    );
    let (leader, worker) = (WorldManager::default(), WorldManager::default());
    let store = leader.serve_store("127.0.0.1:0").await.unwrap().to_string();
    let (a, b) = tokio::join!(
        leader.join(WorldConfig::new("cuda-only", 0, 2, &store).unwrap()),
        worker.join(WorldConfig::new("cuda-only", 1, 2, &store).unwrap()),
    );
    let (a, b) = (a.unwrap(), b.unwrap());
    let x = f32_bytes(&ramp(100_003, 0.5));
    let src = ctx_a.upload(DType::F32, &x, T).unwrap();
    let mut dst = ctx_b.upload(DType::F32, &vec![POISON; x.len()], T).unwrap();
    let (sent, received) = tokio::join!(
        a.send_device(Rank(1), Tag(3), &src),
        b.recv_device(Rank(0), Tag(3), &mut dst)
    );
    sent.unwrap();
    received.unwrap();
    assert!(dst.to_host_vec(T).unwrap() == x, "device data differs");
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
        leader.join(WorldConfig::new("staged", 0, 2, &store).unwrap()),
        worker.join(WorldConfig::new("staged", 1, 2, &store).unwrap()),
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

    // A bool buffer holding a byte other than 0 or 1 is refused at the
    // sender (the receiver's reader would take it for a protocol violation
    // and break the world); a valid one goes through.
    let bad = ctx_a.upload(DType::Bool, &[1, 2, 0], T).unwrap();
    let e = a.send_device(Rank(1), Tag(10), &bad).await.unwrap_err();
    assert!(
        matches!(&e, WorldError::InvalidArgument { detail, .. } if detail.contains("bool")),
        "{e}"
    );
    let good = ctx_a.upload(DType::Bool, &[1, 0, 1], T).unwrap();
    let mut flags = ctx_b.alloc(DType::Bool, 3).unwrap();
    let (sent, received) = tokio::join!(
        a.send_device(Rank(1), Tag(10), &good),
        b.recv_device(Rank(0), Tag(10), &mut flags)
    );
    sent.unwrap();
    received.unwrap();
    assert_eq!(flags.to_host_vec(T).unwrap(), [1, 0, 1]);

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

    drop((
        src, dst, wrong, small, ints, bad, good, flags, back, got, ctx_a, ctx_b, rt,
    ));
    // Each world keeps the pinned host tensors of its last transfers (and
    // a context reference for them), nothing else, until it ends.
    let live = f.live();
    assert!(live[6] > before[6], "kept staging tensors are pinned: {live:?}");
    assert_eq!(
        (live[1], live[2], live[5]),
        (before[1], before[2], before[5]),
        "memory, streams, pools"
    );
    drop((a, b));
    leader.shutdown().await;
    worker.shutdown().await;
    assert_eq!(f.live(), before, "contexts, pinned staging and memory released");
}
