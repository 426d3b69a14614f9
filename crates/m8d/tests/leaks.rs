//! Leaks: 100 cycles of join, SIGKILL and teardown of a world with a real
//! worker process leave this process's file descriptors, threads and memory
//! where they were. Alone in its test binary so that no other test's sockets
//! are counted.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::time::{Duration, Instant};

use m8d::fleet::{Fleet, FleetConfig};
use multiworld_testkit::process::{assert_resources_back, own_resources as resources};

const M8D: &str = env!("CARGO_BIN_EXE_m8d");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_join_kill_teardown_cycles_leak_nothing() {
    let mut f = Fleet::start(FleetConfig::new(M8D, 1)).await.unwrap();
    let cycle = async |f: &mut Fleet, i: usize| {
        f.kill(0).unwrap();
        let (err, _) = f
            .wait_failed(0, Duration::from_secs(5))
            .await
            .unwrap_or_else(|e| panic!("cycle {i}: {e}"));
        assert!(err.is_world_broken(), "cycle {i}: {err}");
        f.respawn(0).await.unwrap_or_else(|e| panic!("cycle {i}: {e}"));
    };
    // Warm up lazily created things (runtime threads, pools) first.
    for i in 0..5 {
        cycle(&mut f, i).await;
    }
    // Connections of the previous generation close asynchronously; measure
    // from a settled state.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let before = resources();
    let started = Instant::now();
    for i in 0..100 {
        cycle(&mut f, i).await;
    }
    let took = started.elapsed();
    let settle = Instant::now();
    while resources().0 > before.0 && settle.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let after = resources();
    eprintln!(
        "100 cycles in {took:?}: fds {} -> {}, threads {} -> {}, RSS {} KiB -> {} KiB",
        before.0, after.0, before.1, after.1, before.2, after.2
    );
    // Nothing else runs in this test binary, so the process's descriptors are
    // this test's alone. A leak grows them by at least one per cycle.
    assert_resources_back(before, after, 0, 32 * 1024);
    let exits = f.shutdown().await;
    assert_eq!(
        exits,
        vec![Some(0)],
        "the last worker must exit 0 when the leader leaves"
    );
}
