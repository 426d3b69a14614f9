//! The world as the fault domain, proven with real processes: a leader (this
//! test process) is rank 0 of three worlds, each streaming checksummed
//! tensors from its own `m8d worker` process. One worker is SIGKILLed or
//! SIGSTOPped, or the process hosting a world's store is killed, and the test
//! asserts that only that world breaks, how fast, and that the other worlds
//! keep flowing, intact and without losses.
//!
//! Bounds here are generous so a busy 2-core machine never makes them flake;
//! each test prints what it measured, and the benchmark targets are in
//! docs/benchmarks.md.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::{
    io::{BufRead, BufReader},
    process::{Child, Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use m8d::stream::{StreamStats, receive_stream};
use multiworld::{BreakCause, Rank, World, WorldConfig, WorldError, WorldEvent, WorldManager};
use nix::{
    sys::signal::{Signal, kill},
    unistd::Pid,
};
use tokio::{sync::broadcast, task::JoinHandle};

const M8D: &str = env!("CARGO_BIN_EXE_m8d");
const BYTES: usize = 64 * 1024;

/// A child process, killed and reaped when dropped.
struct Proc(Child);

impl Proc {
    fn signal(&self, sig: Signal) {
        kill(Pid::from_raw(self.0.id() as i32), sig).unwrap();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

fn worker(world: &str, store: &str) -> Proc {
    let child = Command::new(M8D)
        .args([
            "worker",
            "--world",
            world,
            "--store",
            store,
            "--bytes",
            &BYTES.to_string(),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    Proc(child)
}

fn config(world: &str, store: &str) -> WorldConfig {
    let mut c = WorldConfig::new(world, 0, 2, store);
    c.join_timeout = Duration::from_secs(30);
    c
}

/// One of the leader's worlds with its receiving task.
struct Stream {
    world: World,
    stats: Arc<StreamStats>,
    task: JoinHandle<Option<(WorldError, Instant)>>,
}

fn receive(world: World, stop: Arc<AtomicBool>) -> Stream {
    let stats = Arc::new(StreamStats::default());
    let task = {
        let (world, stats) = (world.clone(), Arc::clone(&stats));
        tokio::spawn(async move {
            receive_stream(&world, Rank(1), BYTES, stats, move || {
                stop.load(Ordering::Relaxed)
            })
            .await
        })
    };
    Stream { world, stats, task }
}

async fn wait_for(limit: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < limit, "not within {limit:?}: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Messages per second of each stream over `window`.
async fn rates(streams: &[&Stream], window: Duration) -> Vec<f64> {
    let before: Vec<u64> = streams.iter().map(|s| s.stats.count()).collect();
    let t = Instant::now();
    tokio::time::sleep(window).await;
    let secs = t.elapsed().as_secs_f64();
    streams
        .iter()
        .zip(before)
        .map(|(s, b)| (s.stats.count() - b) as f64 / secs)
        .collect()
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

/// A leader with three streaming worlds, w1..w3, each fed by a worker process.
struct Setup {
    leader: WorldManager,
    store: String,
    workers: Vec<Proc>,
    streams: Vec<Stream>,
    stop: Arc<AtomicBool>,
}

async fn three_worlds() -> Setup {
    init_tracing();
    let leader = WorldManager::default();
    let store = leader.serve_store("127.0.0.1:0").await.unwrap().to_string();
    let stop = Arc::new(AtomicBool::new(false));
    let mut workers = Vec::new();
    let mut joins = Vec::new();
    for i in 1..=3 {
        let name = format!("w{i}");
        workers.push(worker(&name, &store));
        let (leader, cfg) = (leader.clone(), config(&name, &store));
        joins.push(tokio::spawn(async move { leader.join(cfg).await }));
    }
    let mut streams = Vec::new();
    for j in joins {
        streams.push(receive(j.await.unwrap().unwrap(), Arc::clone(&stop)));
    }
    wait_for(Duration::from_secs(20), "every stream flowing", || {
        streams.iter().all(|s| s.stats.count() >= 20)
    })
    .await;
    Setup {
        leader,
        store,
        workers,
        streams,
        stop,
    }
}

impl Setup {
    fn assert_intact(&self, which: &[usize]) {
        for &i in which {
            let s = &self.streams[i].stats;
            assert_eq!(s.corrupted.load(Ordering::Relaxed), 0, "w{} corrupted", i + 1);
            assert_eq!(s.lost.load(Ordering::Relaxed), 0, "w{} lost messages", i + 1);
        }
    }

    async fn finish(self) {
        self.stop.store(true, Ordering::Relaxed);
        self.leader.shutdown().await;
        for s in self.streams {
            let _ = tokio::time::timeout(Duration::from_secs(10), s.task).await;
        }
        // Healthy workers see the leader leave and exit 0 by themselves.
        for mut w in self.workers {
            let start = Instant::now();
            loop {
                if let Some(status) = w.0.try_wait().unwrap() {
                    // A SIGKILLed worker has no exit code; the others exit 0.
                    assert!(
                        status.success() || status.code().is_none(),
                        "worker exited with {status}"
                    );
                    break;
                }
                assert!(
                    start.elapsed() < Duration::from_secs(15),
                    "a worker did not exit after the leader left"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_worker_breaks_only_its_world_and_a_replacement_rejoins() {
    let mut s = three_worlds().await;
    let mut events = s.leader.events();
    let healthy = [&s.streams[0], &s.streams[2]];
    let before = rates(&healthy, Duration::from_secs(1)).await;

    let killed_at = Instant::now();
    s.workers[1].0.kill().unwrap();
    let (cause, _) = broken_event(&mut events, "w2", Duration::from_secs(5)).await;
    assert!(matches!(cause, BreakCause::PeerLost { rank: 1, .. }), "{cause:?}");
    // The leader's receive on w2 failed, naming the world and the cause.
    let (err, failed_at) = (&mut s.streams[1].task)
        .await
        .unwrap()
        .expect("w2's receive ended");
    let detected = failed_at.saturating_duration_since(killed_at);
    assert!(err.is_world_broken(), "{err}");
    assert!(err.to_string().contains("w2"), "{err}");
    assert!(
        detected < Duration::from_secs(2),
        "detected after {detected:?} (target 50 ms)"
    );

    let healthy = [&s.streams[0], &s.streams[2]];
    let after = rates(&healthy, Duration::from_secs(2)).await;
    eprintln!("SIGKILL: w2 failed after {detected:?}; msgs/s before {before:.0?}, after {after:.0?}");
    for (b, a) in before.iter().zip(&after) {
        assert!(
            *a >= 0.7 * b,
            "a healthy world slowed down: {b:.0} -> {a:.0} msgs/s (target ≥ 95 %)"
        );
    }
    s.assert_intact(&[0, 2]);

    // A replacement worker joins w2 again: a new generation, traffic resumes.
    let old = s.streams[1].world.generation();
    s.streams[1].world.removed().await;
    s.workers[1] = worker("w2", &s.store);
    let world = s.leader.join(config("w2", &s.store)).await.unwrap();
    assert!(world.generation() > old);
    s.streams[1] = receive(world, Arc::clone(&s.stop));
    let replacement = &s.streams[1];
    wait_for(Duration::from_secs(10), "the replacement streams", || {
        replacement.stats.count() >= 20
    })
    .await;
    s.assert_intact(&[0, 1, 2]);
    s.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_worker_is_detected_by_heartbeats_while_the_others_never_pause() {
    let s = three_worlds().await;
    let mut events = s.leader.events();
    for st in &s.streams {
        st.stats.take_max_gap();
    }
    let stopped_at = Instant::now();
    s.workers[1].signal(Signal::SIGSTOP);
    let (cause, at) = broken_event(&mut events, "w2", Duration::from_secs(10)).await;
    let detected = at.saturating_duration_since(stopped_at);
    assert!(
        matches!(cause, BreakCause::HeartbeatTimeout { rank: 1, .. }),
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
    // Keep watching the healthy worlds a little longer.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let gaps: Vec<Duration> = [0, 2]
        .iter()
        .map(|&i| s.streams[i].stats.take_max_gap())
        .collect();
    eprintln!("SIGSTOP: w2 broke after {detected:?}; longest pause on w1/w3 meanwhile {gaps:?}");
    for g in &gaps {
        assert!(
            *g < Duration::from_secs(1),
            "a healthy world paused for {g:?} (target 50 ms)"
        );
    }
    s.assert_intact(&[0, 2]);
    s.workers[1].signal(Signal::SIGCONT);
    s.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_a_worlds_store_host_breaks_only_that_world() {
    let s = three_worlds().await;
    // A fourth world whose store lives in a separate `m8d store` process.
    let mut store_proc = {
        let mut child = Command::new(M8D)
            .args(["store", "--bind", "127.0.0.1:0"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let addr = line.trim().strip_prefix("listening on ").unwrap().to_string();
        (Proc(child), addr)
    };
    let mut cfg = config("ws", &store_proc.1);
    cfg.host_store = false;
    let ws_worker = worker("ws", &store_proc.1);
    let ws = receive(s.leader.join(cfg).await.unwrap(), Arc::clone(&s.stop));
    wait_for(Duration::from_secs(10), "ws flowing", || ws.stats.count() >= 20).await;
    let mut events = s.leader.events();

    let killed_at = Instant::now();
    store_proc.0.0.kill().unwrap();
    store_proc.0.0.wait().unwrap();
    let (cause, at) = broken_event(&mut events, "ws", Duration::from_secs(10)).await;
    // Both members notice the lost store after the same grace period; when
    // the worker notices first, it aborts its side and the leader sees that
    // as the worker's connection going away. Either way only "ws" breaks.
    assert!(
        matches!(
            cause,
            BreakCause::StoreLost { .. } | BreakCause::PeerLost { rank: 1, .. }
        ),
        "{cause:?}"
    );
    let detected = at.saturating_duration_since(killed_at);
    eprintln!("store host killed: ws broke after {detected:?}");
    // The store grace period is 1 s by default.
    assert!(detected < Duration::from_secs(5), "{detected:?}");
    // The other three worlds keep flowing.
    let counts: Vec<u64> = s.streams.iter().map(|st| st.stats.count()).collect();
    let streams = &s.streams;
    wait_for(Duration::from_secs(5), "w1..w3 still flowing", || {
        streams
            .iter()
            .zip(&counts)
            .all(|(st, c)| st.stats.count() >= c + 20)
    })
    .await;
    s.assert_intact(&[0, 1, 2]);
    drop(ws_worker);
    s.finish().await;
}

/// Open file descriptors, threads and resident memory of this process.
fn resources() -> (usize, usize, u64) {
    let fds = std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0);
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| -> u64 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (fds, field("Threads:") as usize, field("VmRSS:"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_join_kill_teardown_cycles_leak_nothing() {
    init_tracing();
    let leader = WorldManager::default();
    let store = leader.serve_store("127.0.0.1:0").await.unwrap().to_string();
    let stop = Arc::new(AtomicBool::new(false));
    let cycle = async |i: usize| {
        let mut w = worker("cycle", &store);
        let world = leader.join(config("cycle", &store)).await.unwrap();
        let s = receive(world.clone(), Arc::clone(&stop));
        wait_for(Duration::from_secs(10), "the cycle's stream flows", || {
            s.stats.count() >= 2
        })
        .await;
        w.0.kill().unwrap();
        let (err, _) = tokio::time::timeout(Duration::from_secs(5), s.task)
            .await
            .unwrap_or_else(|_| panic!("cycle {i}: the kill went unnoticed"))
            .unwrap()
            .expect("the receive ended with an error");
        assert!(err.is_world_broken(), "cycle {i}: {err}");
        world.removed().await;
        assert!(leader.world("cycle").is_none());
    };
    // Warm up lazily created things (runtime threads, pools) first.
    for i in 0..5 {
        cycle(i).await;
    }
    let before = resources();
    let started = Instant::now();
    for i in 0..100 {
        cycle(i).await;
    }
    let took = started.elapsed();
    // Let the runtime's idle blocking threads (10 s keep-alive) not count:
    // compare file descriptors exactly and threads/memory with slack.
    let after = resources();
    eprintln!(
        "100 cycles in {took:?}: fds {} -> {}, threads {} -> {}, RSS {} KiB -> {} KiB",
        before.0, after.0, before.1, after.1, before.2, after.2
    );
    assert_eq!(after.0, before.0, "file descriptors leaked");
    assert!(
        after.1 <= before.1 + 4,
        "threads grew from {} to {}",
        before.1,
        after.1
    );
    assert!(
        after.2 <= before.2 + 32 * 1024,
        "RSS grew from {} KiB to {} KiB",
        before.2,
        after.2
    );
    leader.shutdown().await;
}
