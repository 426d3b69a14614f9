//! Scale: one process is a member of 256 worlds at once (both members of each
//! world live in this process, as two managers), every world carries traffic,
//! and tearing them all down returns file descriptors to where they were.
//! Prints the join time per world and the memory per idle world.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::time::{Duration, Instant};

use multiworld::{DType, Rank, Tag, Tensor, WorldConfig, WorldManager};

const WORLDS: usize = 256;

fn fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0)
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Each world needs about 8 descriptors here (both members' listeners,
/// connections and store connections); lift the soft limit to the hard one
/// so a default of 1,024 does not fail the test.
fn raise_fd_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE)
        && soft < hard
    {
        let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_process_joins_uses_and_tears_down_256_worlds() {
    raise_fd_limit();
    let leader = WorldManager::default();
    let worker = WorldManager::default();
    let store = leader.serve_store("127.0.0.1:0").await.unwrap().to_string();
    let fds_before = fds();
    let rss_before = rss_kib();

    let started = Instant::now();
    let mut worlds = Vec::with_capacity(WORLDS);
    let mut slowest = Duration::ZERO;
    for i in 0..WORLDS {
        let name = format!("world-{i:03}");
        let t = Instant::now();
        let (a, b) = tokio::join!(
            leader.join(WorldConfig::new(&name, 0, 2, &store).unwrap()),
            worker.join(WorldConfig::new(&name, 1, 2, &store).unwrap())
        );
        slowest = slowest.max(t.elapsed());
        worlds.push((a.unwrap(), b.unwrap()));
    }
    let join_total = started.elapsed();
    // Let the heartbeats and watchdogs of all worlds run for a while.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let rss_joined = rss_kib();
    let fds_joined = fds();

    // Every world carries a message, both ways round.
    for (i, (a, b)) in worlds.iter().enumerate() {
        let value = i as u32;
        let data = [value; 16];
        let mut got = Tensor::zeros(DType::U32, [16]).unwrap();
        let (s, r) = tokio::join!(
            b.send(Rank(0), Tag(1), &data[..]),
            a.recv(Rank(1), Tag(1), &mut got)
        );
        s.unwrap();
        r.unwrap();
        assert!(got.as_slice::<u32>().unwrap().iter().all(|&x| x == value));
    }
    assert_eq!(leader.worlds().len(), WORLDS);
    assert!(
        leader.stalled_watchdogs().is_empty(),
        "{:?}",
        leader.stalled_watchdogs()
    );

    let t = Instant::now();
    for (a, _) in &worlds {
        leader.leave(a.name()).await.unwrap();
    }
    for (_, b) in &worlds {
        b.removed().await;
    }
    let teardown = t.elapsed();
    assert!(leader.worlds().is_empty() && worker.worlds().is_empty());
    drop(worlds);
    // Connections close asynchronously once their last handle is gone (the
    // store clients' HTTP/2 workers, the server's side of them): allow a
    // bounded moment for that, and report it.
    let t = Instant::now();
    while fds() > fds_before && t.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let settle = t.elapsed();
    let fds_after = fds();
    eprintln!(
        "{WORLDS} worlds: joined in {join_total:?} ({:?} per world, slowest {slowest:?}); \
         {} KiB RSS per idle world (both members); {} fds while joined; torn down in {teardown:?}; \
         fds {fds_before} -> {fds_joined} -> {fds_after} (settled after {settle:?})",
        join_total / WORLDS as u32,
        (rss_joined.saturating_sub(rss_before)) / WORLDS as u64,
        fds_joined
    );
    assert_eq!(fds_after, fds_before, "descriptors left behind after teardown");
}
