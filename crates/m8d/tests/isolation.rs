//! The world as the fault domain, proven with real processes: a leader (this
//! test process) is rank 0 of three worlds, each streaming checksummed
//! tensors from its own `m8d worker` process (see `m8d::fleet`). One worker
//! is SIGKILLed or SIGSTOPped, or the process hosting a world's store is
//! killed, and the tests assert that only that world breaks, how fast, and
//! that the other worlds keep flowing, intact and without losses.
//!
//! Bounds here are generous so a busy 2-core machine never makes them flake;
//! each test prints what it measured. The targets are measured by
//! `m8d bench failover` (docs/benchmarks.md).
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::{
    process::{Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use m8d::{
    fleet::{Fleet, FleetConfig},
    stream::{StreamStats, receive_stream},
};
use multiworld::{BreakCause, Rank, WorldConfig, WorldEvent};
use multiworld_testkit::process::Guard;
use tokio::sync::broadcast;

const M8D: &str = env!("CARGO_BIN_EXE_m8d");

async fn fleet(workers: usize) -> Fleet {
    multiworld_testkit::init_tracing();
    Fleet::start(FleetConfig::new(M8D, workers)).await.unwrap()
}

async fn broken_event(
    events: &mut broadcast::Receiver<WorldEvent>,
    world: &str,
    limit: Duration,
) -> (BreakCause, Instant) {
    let deadline = Instant::now() + limit;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, events.recv()).await {
            Ok(Ok(WorldEvent::Broken { world: w, cause, .. })) if w == world => {
                return (cause, Instant::now());
            }
            Ok(Ok(_)) => {}
            Ok(Err(e)) => panic!("events: {e}"),
            Err(_) => panic!("{world} did not break within {limit:?}"),
        }
    }
}

fn assert_intact(f: &Fleet, which: &[usize]) {
    for &i in which {
        let s = &f.members[i].stats;
        assert_eq!(
            s.corrupted.load(Ordering::Relaxed),
            0,
            "{} corrupted",
            f.members[i].name
        );
        assert_eq!(
            s.lost.load(Ordering::Relaxed),
            0,
            "{} lost messages",
            f.members[i].name
        );
    }
}

/// Ends the streams of the workers still running, checks that the leader
/// received every message each of them sent, then shuts down and checks
/// that each one exited 0 by itself.
async fn finish(mut f: Fleet, killed: &[usize]) {
    let ended = f.end_streams(Duration::from_secs(30)).await;
    for (i, m) in f.members.iter().enumerate() {
        if killed.contains(&i) {
            continue;
        }
        assert!(ended.contains(&i), "{}'s stream did not end cleanly", m.name);
        assert_eq!(
            m.stats.sent(),
            Some(m.stats.count()),
            "{}: messages sent by its worker vs received",
            m.name
        );
    }
    let exits = f.shutdown().await;
    for (i, code) in exits.iter().enumerate() {
        if !killed.contains(&i) {
            assert_eq!(*code, Some(0), "worker {} exited with {code:?}", i + 1);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_worker_breaks_only_its_world_and_a_replacement_rejoins() {
    let mut f = fleet(3).await;
    let mut events = f.leader.events();
    let before = f.rates(&[0, 2], Duration::from_secs(1)).await;

    let killed_at = f.kill(1).unwrap();
    let (cause, _) = broken_event(&mut events, "w2", Duration::from_secs(5)).await;
    assert!(
        matches!(cause, BreakCause::PeerLost { rank: Rank(1), .. }),
        "{cause:?}"
    );
    // The leader's receive on w2 failed, naming the world and the cause.
    let (err, failed_at) = f.wait_failed(1, Duration::from_secs(5)).await.unwrap();
    let detected = failed_at.saturating_duration_since(killed_at);
    assert!(err.is_world_broken(), "{err}");
    assert!(err.to_string().contains("w2"), "{err}");
    assert!(
        detected < Duration::from_secs(2),
        "detected after {detected:?} (target 50 ms)"
    );

    let after = f.rates(&[0, 2], Duration::from_secs(2)).await;
    eprintln!("SIGKILL: w2 failed after {detected:?}; msgs/s before {before:.0?}, after {after:.0?}");
    for (b, a) in before.iter().zip(&after) {
        assert!(
            *a >= 0.7 * b,
            "a healthy world slowed down: {b:.0} -> {a:.0} msgs/s (target ≥ 95 %)"
        );
    }
    assert_intact(&f, &[0, 2]);

    // A replacement worker joins w2 again: a new generation, traffic resumes.
    let old = f.members[1].world.generation();
    f.respawn(1).await.unwrap();
    assert!(f.members[1].world.generation() > old);
    f.wait_flowing(1, 20, Duration::from_secs(10)).await.unwrap();
    assert_intact(&f, &[0, 1, 2]);
    finish(f, &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_worker_is_detected_by_heartbeats_while_the_others_never_pause() {
    let mut f = fleet(3).await;
    let mut events = f.leader.events();
    for m in &f.members {
        m.stats.take_max_gap();
    }
    let stopped_at = f.freeze(1).unwrap();
    let (cause, at) = broken_event(&mut events, "w2", Duration::from_secs(10)).await;
    let detected = at.saturating_duration_since(stopped_at);
    assert!(
        matches!(cause, BreakCause::HeartbeatTimeout { rank: Rank(1), .. }),
        "{cause:?}"
    );
    // Default heartbeat timeout 1 s; the target is within 1 s + 250 ms.
    assert!(
        detected >= Duration::from_millis(900),
        "broke before the timeout: {detected:?}"
    );
    assert!(
        detected < Duration::from_secs(4),
        "detected after {detected:?} (target 1.25 s)"
    );
    let (err, _) = f.wait_failed(1, Duration::from_secs(5)).await.unwrap();
    assert!(err.is_world_broken(), "{err}");
    // Keep watching the healthy worlds a little longer.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let gaps: Vec<Duration> = [0, 2]
        .iter()
        .map(|&i| f.members[i].stats.take_max_gap())
        .collect();
    eprintln!("SIGSTOP: w2 broke after {detected:?}; longest pause on w1/w3 meanwhile {gaps:?}");
    // Under the frozen world's heartbeat timeout (1 s): a healthy world that
    // waited for the frozen one to break would pause at least that long.
    for g in &gaps {
        assert!(
            *g < Duration::from_millis(600),
            "a healthy world paused for {g:?} (target 50 ms)"
        );
    }
    assert_intact(&f, &[0, 2]);
    f.thaw(1).unwrap();
    finish(f, &[1]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_a_worlds_store_host_breaks_only_that_world() {
    let f = fleet(3).await;
    // A fourth world whose store lives in a separate `m8d store` process.
    let mut store = Guard::spawn(
        Command::new(M8D)
            .args(["store", "--bind", "127.0.0.1:0"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped()),
    );
    let line = store.first_line();
    let store_addr = line.trim().strip_prefix("listening on ").unwrap().to_string();
    let mut ws_worker = Guard::spawn(
        Command::new(M8D)
            .args(["worker", "--world", "ws", "--store", &store_addr])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
    );
    let mut cfg = WorldConfig::new("ws", 0, 2, &store_addr).unwrap();
    cfg.host_store = false;
    let ws = f.leader.join(cfg).await.unwrap();
    let stats = Arc::new(StreamStats::default());
    let stop = Arc::new(AtomicBool::new(false));
    let receiving = {
        let (ws, stats, stop) = (ws.clone(), Arc::clone(&stats), Arc::clone(&stop));
        tokio::spawn(async move {
            receive_stream(&ws, Rank(1), 64 * 1024, stats, move || {
                stop.load(Ordering::Relaxed)
            })
            .await
        })
    };
    let start = Instant::now();
    while stats.count() < 20 {
        assert!(start.elapsed() < Duration::from_secs(10), "ws never flowed");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut events = f.leader.events();

    let killed_at = Instant::now();
    store.kill();
    let (cause, at) = broken_event(&mut events, "ws", Duration::from_secs(10)).await;
    // Both members notice the lost store after the same grace period; when
    // the worker notices first, it aborts its side and the leader sees that
    // as the worker's connection going away. Either way only "ws" breaks.
    assert!(
        matches!(
            cause,
            BreakCause::StoreLost { .. } | BreakCause::PeerLost { rank: Rank(1), .. }
        ),
        "{cause:?}"
    );
    let detected = at.saturating_duration_since(killed_at);
    eprintln!("store host killed: ws broke after {detected:?} ({cause})");
    // The store grace period is 1 s by default.
    assert!(detected < Duration::from_secs(5), "{detected:?}");
    assert!(
        receiving.await.unwrap().is_some(),
        "ws's stream must end with an error"
    );
    // The other three worlds keep flowing.
    for i in 0..3 {
        f.wait_flowing(i, 20, Duration::from_secs(5)).await.unwrap();
    }
    assert_intact(&f, &[0, 1, 2]);
    ws_worker.kill();
    finish(f, &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_killed_mid_collective_fails_every_survivor_without_partial_results() {
    multiworld_testkit::init_tracing();
    let leader = multiworld::WorldManager::default();
    let store = leader.serve_store("127.0.0.1:0").await.unwrap().to_string();
    let elements = 256 * 1024;
    let spawn = |rank: &str| {
        Guard::spawn(
            Command::new(M8D)
                .args([
                    "worker", "--world", "coll", "--store", &store, "--rank", rank, "--size", "3",
                ])
                .args(["--mode", "all-reduce", "--elements", &elements.to_string()])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null()),
        )
    };
    let (mut one, mut two) = (spawn("1"), spawn("2"));
    let world = leader
        .join(WorldConfig::new("coll", 0, 3, &store).unwrap())
        .await
        .unwrap();
    // Another world of the leader's, with a member of its own.
    let peer = multiworld::WorldManager::default();
    let (calm, calm_peer) = tokio::join!(
        leader.join(WorldConfig::new("calm", 0, 2, &store).unwrap()),
        peer.join(WorldConfig::new("calm", 1, 2, &store).unwrap())
    );
    let (calm, calm_peer) = (calm.unwrap(), calm_peer.unwrap());
    let group = world.collectives();
    let mut verified = 0u64;
    let mut outcome = None;
    for round in 0u64..10_000 {
        let t = multiworld::Tensor::from_vec(
            vec![m8d::stream::all_reduce_value(0, round); elements],
            [elements],
        )
        .unwrap();
        // Rank 2 dies inside its round-5 call (its loop starts every call at
        // once, so it is waiting in it for this rank). Killed before this
        // rank's call starts, not after: a call started first can finish on a
        // fast machine before the signal lands, with rank 2's full (correct)
        // contribution, which would test nothing.
        let killed_at = (round == 5).then(|| {
            let at = Instant::now();
            two.kill();
            at
        });
        let handle = group.all_reduce_handle(t, multiworld::ReduceOp::Sum);
        match handle.wait().await {
            Ok(t) => {
                let want = m8d::stream::all_reduce_sum(3, round);
                assert!(
                    t.as_slice::<f32>().unwrap().iter().all(|&v| v == want),
                    "round {round}: a partial or wrong result was returned as a success"
                );
                verified += 1;
                assert!(
                    killed_at.is_none() && round < 5,
                    "a collective succeeded without rank 2"
                );
            }
            Err(e) => {
                assert!(round >= 5, "round {round} failed before any fault: {e}");
                outcome = Some((e, killed_at.unwrap_or_else(Instant::now)));
                break;
            }
        }
    }
    let (err, killed_at) = outcome.expect("the collectives never failed after the kill");
    let took = killed_at.elapsed();
    eprintln!("rank 2 killed mid-collective: the leader's all-reduce failed after {took:?}: {err}");
    assert!(
        took < Duration::from_secs(2),
        "survivor failed after {took:?} (target 100 ms)"
    );
    assert_eq!(verified, 5);
    // The group's own error (it names the lost peer, not the world: the
    // world's state below does).
    assert!(err.is_world_fatal(), "{err:?}");
    // The world then breaks as for any lost member.
    let start = Instant::now();
    while !matches!(
        world.state(),
        multiworld::WorldState::Broken(_) | multiworld::WorldState::Removed
    ) {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the world did not break"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    match world.state() {
        multiworld::WorldState::Broken(
            multiworld::BreakCause::PeerLost { .. } | multiworld::BreakCause::ReportedByPeer { .. },
        )
        | multiworld::WorldState::Removed => {}
        other => panic!("broke for another reason: {other:?}"),
    }
    // As the world's error, the group's names the world and its cause.
    match world.collective_error(err.clone()) {
        e @ multiworld::WorldError::Broken {
            cause: multiworld::BreakCause::PeerLost { .. } | multiworld::BreakCause::ReportedByPeer { .. },
            ..
        } => assert!(e.to_string().contains("'coll'"), "{e}"),
        other => panic!("the world's error for the collective's: {other:?}"),
    }
    // The leader's other world is untouched.
    assert_eq!(calm.state(), multiworld::WorldState::Ready);
    let mut got = multiworld::Tensor::zeros(multiworld::DType::F32, [4]).unwrap();
    let (sent, received) = tokio::join!(
        calm.send(multiworld::Rank(1), multiworld::Tag(0), &[2.5f32; 4][..]),
        calm_peer.recv(multiworld::Rank(0), multiworld::Tag(0), &mut got)
    );
    sent.unwrap();
    received.unwrap();
    assert_eq!(got.as_slice::<f32>().unwrap(), &[2.5f32; 4]);
    // The other survivor, rank 1, also failed rather than accept a partial
    // result: it exits 0 only after a failed call, 1 after a wrong result.
    let start = Instant::now();
    let code = loop {
        if let Some(status) = one.try_wait() {
            break status.code();
        }
        assert!(start.elapsed() < Duration::from_secs(10), "rank 1 never noticed");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert_eq!(
        code,
        Some(0),
        "rank 1 must fail its collective, never return a wrong result"
    );
    leader.shutdown().await;
}
