//! A real rank process is SIGKILLed in the middle of a collective; every
//! surviving rank's call must fail (never return a partial result as success)
//! within a bound. World of 4: this test is rank 0 and re-executes its own binary
//! for ranks 1..=3 (see `collectives_kill_child`); they rendezvous through files in
//! a temporary directory, all run 16 MiB all-reduces back to back, and rank 2 is
//! killed while rank 0's call is under way. Each survivor records when its call
//! failed; the test reports the delays from the kill. Two routes: the default
//! settings (the four processes share a host, so the data go through shared
//! memory and TCP only orders the phases) and the TCP ring (`Algorithm::Ring`);
//! the test checks that each run really took its route.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use multiworld_collectives::{Algorithm, CallEnd, CallObserver, CollectiveConfig, Group, SharedMemory};
use multiworld_tcp::{Communicator, Error, Rank, Tensor};
use multiworld_testkit::process::{Guard, Signal, self_test_command};
use multiworld_testkit::*;
use multiworld_types::ReduceOp;

const DIR_ENV: &str = "MW_COLL_KILL_DIR";
const RANK_ENV: &str = "MW_COLL_KILL_RANK";
/// Which route the children take: [`Route::env`].
const ROUTE_ENV: &str = "MW_COLL_KILL_ROUTE";
const CHILD_TEST: &str = "collectives_kill_child";
const WORLD: u32 = 4;
const VICTIM: u32 = 2;
const LEN: usize = 4 << 20; // 16 MiB of f32: shared memory, or the ring

/// The route the all-reduces take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    /// Default settings: on one host, through shared memory.
    SharedMemory,
    /// As [`Route::SharedMemory`], but the surviving children wait at the
    /// segment's barriers on their own threads, as a Python thread in a
    /// blocking call does (`multiworld_tcp::as_blocking_caller`).
    SharedMemoryBlockingCaller,
    /// `Algorithm::Ring`: the data over TCP.
    Ring,
}

impl Route {
    fn env(self) -> &'static str {
        match self {
            Route::SharedMemory => "shm",
            Route::SharedMemoryBlockingCaller => "shm-blocking-caller",
            Route::Ring => "ring",
        }
    }

    fn from_env(s: &str) -> Route {
        match s {
            "shm" => Route::SharedMemory,
            "shm-blocking-caller" => Route::SharedMemoryBlockingCaller,
            "ring" => Route::Ring,
            other => panic!("{ROUTE_ENV}={other:?}"),
        }
    }

    fn config(self) -> CollectiveConfig {
        match self {
            Route::SharedMemory | Route::SharedMemoryBlockingCaller => CollectiveConfig::default(),
            Route::Ring => CollectiveConfig::default().with_algorithm(Algorithm::Ring),
        }
    }
}

/// Counts the calls that have started running on rank 0 (past their turn and
/// their local checks).
#[derive(Default)]
struct Started(std::sync::atomic::AtomicUsize);

struct Ends;

impl CallEnd for Ends {
    fn ended(self: Box<Self>, _error: Option<&Error>) {}
}

impl CallObserver for Started {
    fn call_started(&self, _op: &'static str) -> Box<dyn CallEnd> {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Box::new(Ends)
    }
}

/// Rank `rank`'s input: every element `rank + 1`, so every complete all-reduce
/// gives 1 + 2 + 3 + 4 everywhere.
fn input(rank: u32) -> Tensor {
    Tensor::from(vec![(rank + 1) as f32; LEN])
}

fn is_complete_result(t: &Tensor) -> bool {
    let want = (1..=WORLD).sum::<u32>() as f32;
    t.as_slice::<f32>().unwrap().iter().all(|&x| x == want)
}

fn now_nanos() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos()
}

/// A rank process: runs all-reduces until one fails (or one that succeeds has
/// a wrong result), then writes `<unix nanos of the failure> <completed calls>
/// <error>` to `result-<rank>`. Does nothing unless started by the tests below.
#[test]
#[ignore = "helper process for the a_rank_killed_mid_collective_* tests"]
fn collectives_kill_child() {
    let (Ok(dir), Ok(rank), Ok(route)) = (
        std::env::var(DIR_ENV),
        std::env::var(RANK_ENV),
        std::env::var(ROUTE_ENV),
    ) else {
        eprintln!("{CHILD_TEST}: not started by the parent test; nothing to do");
        return;
    };
    let rank: u32 = rank.parse().unwrap();
    let route = Route::from_env(&route);
    let rt = runtime();
    let run = || {
        rt.block_on(async {
            let rdv = FileRendezvous {
                dir: dir.clone().into(),
            };
            let comm = Arc::new(
                Communicator::join(config("collkill", rank, WORLD), &rdv)
                    .await
                    .unwrap(),
            );
            let g = Group::world(&comm).with_config(route.config());
            let mine = input(rank);
            let mut done = 0u64;
            let err = loop {
                let mut t = mine.clone();
                match g.all_reduce(&mut t, ReduceOp::Sum).await {
                    Ok(()) if is_complete_result(&t) => done += 1,
                    Ok(()) => break format!("call {done} succeeded with a wrong result"),
                    Err(e) => break e.to_string(),
                }
            };
            let line = format!("{} {done} {err}", now_nanos());
            let path = Path::new(&dir).join(format!("result-{rank}"));
            std::fs::write(path.with_extension("tmp"), line).unwrap();
            std::fs::rename(path.with_extension("tmp"), path).unwrap();
        })
    };
    match route {
        Route::SharedMemoryBlockingCaller => multiworld_tcp::as_blocking_caller(run),
        Route::SharedMemory | Route::Ring => run(),
    }
}

#[test]
fn a_rank_killed_mid_collective_fails_every_survivor_shared_memory() {
    killed_mid_collective(Route::SharedMemory);
}

#[test]
fn a_rank_killed_mid_collective_fails_every_survivor_waiting_on_their_own_threads() {
    killed_mid_collective(Route::SharedMemoryBlockingCaller);
}

#[test]
fn a_rank_killed_mid_collective_fails_every_survivor_ring() {
    killed_mid_collective(Route::Ring);
}

fn killed_mid_collective(route: Route) {
    // One scenario at a time: each runs four processes on the host.
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    init_tracing();
    let dir = temp_dir(&format!("collkill-{}", route.env()));
    // Each killed with its process group if the test fails before it ends.
    let mut children: Vec<(u32, Guard)> = Vec::new();
    for r in 1..WORLD {
        let child = Guard::spawn(
            self_test_command(CHILD_TEST)
                .env(DIR_ENV, &dir)
                .env(RANK_ENV, r.to_string())
                .env(ROUTE_ENV, route.env())
                .stdin(Stdio::null())
                .stdout(Stdio::null()),
        );
        children.push((r, child));
    }
    let (killed_at, parent_took, parent_err) = runtime().block_on(async {
        let rdv = FileRendezvous { dir: dir.clone() };
        let comm = Arc::new(
            Communicator::join(config("collkill", 0, WORLD), &rdv)
                .await
                .unwrap(),
        );
        let started_calls = Arc::new(Started::default());
        let g = Group::world(&comm)
            .with_config(route.config())
            .with_observer(Arc::clone(&started_calls) as Arc<dyn CallObserver>);
        let mine = input(0);
        let received = || comm.peer_stats(Rank(WORLD - 1)).unwrap().bytes_received;
        let at_start = received();
        let t_calls = Instant::now();
        for _ in 0..3 {
            let mut t = mine.clone();
            g.all_reduce(&mut t, ReduceOp::Sum).await.unwrap();
            assert!(is_complete_result(&t), "a complete call's result");
        }
        // Each run took its route: the ring moves the data over TCP and never
        // tries shared memory; the shared-memory path moves only small control
        // messages over TCP.
        let moved = received() - at_start;
        let state = g.shared_memory().await;
        println!(
            "{route:?}: 3 calls took {:?} and received {moved} bytes from rank {}; shared memory {state}",
            t_calls.elapsed(),
            WORLD - 1
        );
        match route {
            Route::SharedMemory | Route::SharedMemoryBlockingCaller => {
                assert!(
                    matches!(state, SharedMemory::Active { .. }),
                    "shared memory: {state}"
                );
                assert!(moved < 1 << 20, "{moved} bytes over TCP: not shared memory");
            }
            Route::Ring => {
                assert_eq!(state, SharedMemory::Untried);
                assert!(moved >= 3 * (LEN as u64 * 4) / 2, "only {moved} bytes over TCP");
            }
        }
        // Start a call and wait until it is under way, then kill rank 2. The
        // ring: data are flowing in it. Shared memory: the call has started
        // running (it agrees through the segment, and the data move there,
        // where rank 0's progress cannot be seen from here); rank 2 cannot
        // finish its part of the call before rank 0 has done nearly all of
        // its own, so the call must fail.
        let before = received();
        let started = Instant::now();
        let handle = g.all_reduce_handle(mine.clone(), ReduceOp::Sum);
        let flowing = eventually(Duration::from_secs(30), || match route {
            Route::Ring => received() >= before + (1 << 20),
            Route::SharedMemory | Route::SharedMemoryBlockingCaller => {
                started_calls.0.load(std::sync::atomic::Ordering::SeqCst) == 4
            }
        })
        .await;
        assert!(flowing, "the call never got under way");
        assert!(
            !handle.is_completed(),
            "the call must still be running when the rank is killed"
        );
        let victim = &mut children.iter_mut().find(|(r, _)| *r == VICTIM).unwrap().1;
        assert!(victim.try_wait().is_none(), "victim still running");
        victim.signal(Signal::SIGKILL);
        let killed_at = now_nanos();
        println!(
            "{route:?}: rank {VICTIM} killed {:?} into rank 0's call",
            started.elapsed()
        );
        let t0 = Instant::now();
        let r = tokio::time::timeout(Duration::from_secs(10), handle)
            .await
            .expect("rank 0's call must fail, not hang");
        let took = t0.elapsed();
        let e = r.expect_err("rank 0's call must not succeed with a partial result");
        (killed_at, took, e)
    });
    println!("{route:?}: rank 0: call failed {parent_took:?} after the SIGKILL: {parent_err}");
    assert!(parent_err.is_world_fatal(), "{parent_err}");
    assert!(
        matches!(&parent_err, Error::PeerLost { .. }),
        "expected PeerLost, got {parent_err}"
    );
    assert!(
        parent_took < Duration::from_secs(2),
        "rank 0 took {parent_took:?}"
    );
    // The surviving children report when their calls failed.
    let deadline = Instant::now() + Duration::from_secs(20);
    for (r, child) in children.iter_mut().filter(|(r, _)| *r != VICTIM) {
        loop {
            if child.try_wait().is_some() {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "rank {r} did not finish: its call hung"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        let line = std::fs::read_to_string(dir.join(format!("result-{r}")))
            .unwrap_or_else(|e| panic!("rank {r} wrote no result ({e}); it crashed"));
        let mut parts = line.splitn(3, ' ');
        let at: u128 = parts.next().unwrap().parse().unwrap();
        let calls: u64 = parts.next().unwrap().parse().unwrap();
        let err = parts.next().unwrap_or_default();
        let took = Duration::from_nanos(at.saturating_sub(killed_at) as u64);
        println!(
            "{route:?}: rank {r}: call failed {took:?} after the SIGKILL (after {calls} completed calls): {err}"
        );
        assert!(
            err.contains("lost"),
            "rank {r}: expected a lost peer, got {err:?}"
        );
        assert!(took < Duration::from_secs(2), "rank {r} took {took:?}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
