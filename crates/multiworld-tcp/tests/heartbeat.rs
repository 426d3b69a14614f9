//! Heartbeats: an idle connection still shows its peer alive, and a peer that
//! sends nothing (what a frozen or cut-off member looks like from here, while
//! its connection stays open) goes stale, which is what a watchdog's heartbeat
//! timeout acts on.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::time::{Duration, Instant};

use multiworld_tcp::{Rank, Tag, Tensor};
use multiworld_testkit::*;

fn age(comm: &multiworld_tcp::Communicator, rank: u32) -> Duration {
    let live = comm.liveness();
    let p = live.iter().find(|p| p.rank == Rank(rank)).expect("peer listed");
    assert!(p.lost.is_none(), "peer {rank} lost: {:?}", p.lost);
    Instant::now().saturating_duration_since(p.last_heard)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_stay_heard_and_a_silent_peer_goes_stale() {
    let every = Duration::from_millis(50);
    // Rank 1 sends no heartbeats: it looks frozen to rank 0 while its
    // connection stays open. Rank 2 behaves.
    let comms = mesh_with("hb", 3, |mut c| {
        c.heartbeat_interval = if c.rank == Rank(1) { None } else { Some(every) };
        c
    })
    .await;
    // Let everything go quiet for many heartbeat intervals.
    tokio::time::sleep(Duration::from_millis(600)).await;

    // Healthy directions: heard within a few intervals (generous for a busy
    // machine, still far below the 600 ms of silence).
    let bound = Duration::from_millis(400);
    assert!(
        age(&comms[0], 2) < bound,
        "rank 0 hears rank 2: {:?}",
        age(&comms[0], 2)
    );
    assert!(
        age(&comms[1], 0) < bound,
        "rank 1 hears rank 0: {:?}",
        age(&comms[1], 0)
    );
    assert!(age(&comms[2], 0) < bound);
    // The silent peer is stale at everyone else.
    assert!(
        age(&comms[0], 1) >= Duration::from_millis(550),
        "{:?}",
        age(&comms[0], 1)
    );
    assert!(age(&comms[2], 1) >= Duration::from_millis(550));

    // Data counts as a sign of life: one message from rank 1 refreshes it.
    let send = comms[1].send(Rank(0), Tag(7), &[1u32, 2, 3][..]);
    let mut buf = Tensor::from_vec(vec![0u32; 3], [3]).unwrap();
    let recv = comms[0].recv(Rank(1), Tag(7), &mut buf);
    let (s, r) = tokio::join!(send, recv);
    s.unwrap();
    r.unwrap();
    assert!(age(&comms[0], 1) < bound);
    // And heartbeats never disturb data: the message arrived intact.
    assert_eq!(buf.as_slice::<u32>().unwrap(), &[1, 2, 3]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeats_interleave_with_traffic_without_breaking_the_stream() {
    let comms = mesh_with("hb-traffic", 2, |mut c| {
        c.heartbeat_interval = Some(Duration::from_millis(1));
        c
    })
    .await;
    let (a, b) = (&comms[0], &comms[1]);
    let n = 300;
    let sender = async {
        for i in 0..n {
            let v = vec![i as u64; 1 + (i % 5) * 1000];
            a.send(Rank(1), Tag(1), &v[..]).await.unwrap();
            if i % 50 == 0 {
                tokio::time::sleep(Duration::from_millis(3)).await;
            }
        }
    };
    let receiver = async {
        for i in 0..n {
            let mut t = Tensor::from_vec(vec![0u64; 1 + (i % 5) * 1000], [1 + (i % 5) * 1000]).unwrap();
            b.recv(Rank(0), Tag(1), &mut t).await.unwrap();
            assert!(t.as_slice::<u64>().unwrap().iter().all(|&x| x == i as u64));
        }
    };
    tokio::join!(sender, receiver);
    assert!(a.health().is_healthy() && b.health().is_healthy());
}
