//! Leaks after breaks that leave the sockets open: 10 cycles of join, a
//! 64 MiB message in flight (its sender's writer blocked on full socket
//! buffers), the link stalled (half-open: nothing read, nothing reset), the
//! heartbeat break on both sides and teardown leave this
//! process's file descriptors, threads and memory where they were. Alone in
//! its test binary so that no other test's sockets are counted.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::time::{Duration, Instant};

use multiworld::{DType, Rank, Secret, Tag, Tensor, WatchdogConfig, WorldConfig, WorldManager};
use multiworld_testkit::process::{assert_resources_back, own_resources as resources};
use multiworld_testkit::proxy::{Mode, WorldProxy};

fn cfg(rank: u32, store: &str) -> WorldConfig {
    let mut c = WorldConfig::new("stalled", rank, 2, store).unwrap();
    c.join_timeout = Duration::from_secs(10);
    c.secret = Some(Secret::new("leaks"));
    c.watchdog = WatchdogConfig {
        heartbeat_interval: Duration::from_millis(100),
        heartbeat_timeout: Duration::from_millis(300),
        store_grace: Duration::from_secs(2),
    };
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_breaks_on_a_stalled_link_with_a_blocked_writer_leak_nothing() {
    multiworld_testkit::init_tracing();
    let (leader, worker) = (WorldManager::default(), WorldManager::default());
    let store = leader.serve_store("127.0.0.1:0").await.unwrap();
    // Rank 1 reaches the store, and rank 0's listener, through proxies.
    let net = WorldProxy::new(store);
    let cycle = async |i: usize| {
        let (a, b) = tokio::join!(
            leader.join(cfg(0, &store.to_string())),
            worker.join(cfg(1, &net.store_addr()))
        );
        let (a, b) = (a.unwrap(), b.unwrap());
        // A 64 MiB message in flight, received (so that its receiver, whose
        // reads stop with the link, notices the silence); the sender's
        // writer blocks once the stalled link's buffers are full.
        let sending = tokio::spawn({
            let a = a.clone();
            async move { a.send(Rank(1), Tag(1), &vec![1u8; 64 << 20][..]).await }
        });
        let receiving = tokio::spawn({
            let b = b.clone();
            async move {
                let mut buf = Tensor::zeros(DType::U8, [64 << 20]).unwrap();
                b.recv(Rank(0), Tag(1), &mut buf).await
            }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        net.set_mode(Mode::Stall);
        for w in [&a, &b] {
            tokio::time::timeout(Duration::from_secs(10), w.removed())
                .await
                .unwrap_or_else(|_| panic!("cycle {i}: the stalled world was not removed"));
        }
        let received = tokio::time::timeout(Duration::from_secs(5), receiving)
            .await
            .unwrap_or_else(|_| panic!("cycle {i}: the stuck receive never ended"))
            .unwrap();
        assert!(received.unwrap_err().is_world_broken(), "cycle {i}");
        let sent = tokio::time::timeout(Duration::from_secs(5), sending)
            .await
            .unwrap_or_else(|_| panic!("cycle {i}: the blocked send never ended"))
            .unwrap();
        assert!(sent.unwrap_err().is_world_broken(), "cycle {i}");
        net.heal();
    };
    // Warm up lazily created things (runtime threads, pools) first.
    for i in 0..3 {
        cycle(i).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let proxies_before = net.mesh().len();
    let before = resources();
    let started = Instant::now();
    for i in 0..10 {
        cycle(i).await;
    }
    let took = started.elapsed();
    // Each new generation's listener gets a proxy of its own (the test's,
    // one listening socket each, kept by `net`).
    let proxy_fds = net.mesh().len() - proxies_before;
    let settle = Instant::now();
    while resources().0 > before.0 + proxy_fds && settle.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let after = resources();
    eprintln!(
        "10 stalled breaks in {took:?}: fds {} -> {} ({proxy_fds} new proxies), threads {} -> {}, RSS {} KiB -> {} KiB",
        before.0, after.0, before.1, after.1, before.2, after.2
    );
    assert_resources_back(before, after, proxy_fds, 64 * 1024);
}
