//! An orderly close over loopback: a member that closes its communicator while
//! its peer is still busy (streaming at it, sending heartbeats, or closing at
//! the same moment) is seen by that peer as an orderly departure, never as a
//! lost connection: the closing side reads until the peer has stopped before
//! it lets its socket go, so no reset ever overtakes its goodbye.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use multiworld_tcp::{CLOSE_LIMIT, Communicator, DType, Error, HealthEvent, Rank, Tag, Tensor};
use multiworld_testkit::*;

/// Bound on how long a close and the peer's noticing it may take; the real
/// figures are milliseconds (printed), the bound is for a busy 2-core machine.
const BOUND: Duration = Duration::from_secs(5);

/// The peer rank-1 saw of rank 0, once it has seen anything.
async fn cause_seen(c: &Communicator, peer: Rank) -> String {
    assert!(
        eventually(BOUND, || c.health().lost.iter().any(|(r, _)| *r == peer)).await,
        "the peer never noticed the close"
    );
    let health = c.health();
    let (_, cause) = health.lost.iter().find(|(r, _)| *r == peer).unwrap();
    cause.to_string()
}

/// A world of `n` over loopback whose members heartbeat every millisecond,
/// so that a heartbeat is nearly always in flight when a member closes.
async fn chatty_mesh(name: &str, n: u32) -> Vec<Communicator> {
    mesh_with(name, n, |mut c| {
        c.heartbeat_interval = Some(Duration::from_millis(1));
        c
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closing_while_the_peer_streams_at_us_is_an_orderly_close_for_it() {
    for round in 0..8 {
        let mut v = chatty_mesh(&format!("close-stream-{round}"), 2).await;
        let b = Arc::new(v.pop().unwrap());
        let a = v.pop().unwrap();
        // Rank 1 streams 64 KiB messages at rank 0 until its sends fail.
        let streamer = {
            let b = Arc::clone(&b);
            tokio::spawn(async move {
                let data = vec![7u8; 64 << 10];
                let mut sent = 0u64;
                loop {
                    match b.send(Rank(0), Tag(1), &data[..]).await {
                        Ok(()) => sent += 1,
                        Err(e) => return (sent, e),
                    }
                }
            })
        };
        let mut buf = Tensor::zeros(DType::U8, [64 << 10]).unwrap();
        for _ in 0..4 {
            a.recv(Rank(1), Tag(1), &mut buf).await.unwrap();
        }
        let start = Instant::now();
        tokio::time::timeout(BOUND, a.close()).await.expect("close hung");
        let closed = start.elapsed();
        let cause = cause_seen(&b, Rank(0)).await;
        let (sent, err) = tokio::time::timeout(BOUND, streamer).await.unwrap().unwrap();
        println!(
            "round {round}: closed in {closed:?} after {sent} messages; the streamer saw: {cause}; {err}"
        );
        assert!(cause.contains("orderly"), "round {round}: the peer saw {cause:?}");
        assert!(
            matches!(&err, Error::PeerLost { rank: Rank(0), .. }) && err.to_string().contains("orderly"),
            "round {round}: the stream ended with {err}"
        );
        assert!(b.liveness()[0].departed);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_sides_closing_at_once_part_in_order() {
    for round in 0..8 {
        let mut v = chatty_mesh(&format!("close-both-{round}"), 3).await;
        let c = v.pop().unwrap();
        let b = v.pop().unwrap();
        let a = v.pop().unwrap();
        // Some traffic first, so every connection has carried data.
        let (s, r) = tokio::join!(a.send(Rank(1), Tag(2), &[1u8; 4096][..]), async {
            let mut buf = Tensor::zeros(DType::U8, [4096]).unwrap();
            b.recv(Rank(0), Tag(2), &mut buf).await
        });
        s.unwrap();
        r.unwrap();
        // Ranks 0 and 1 close together; rank 2 stays and must see both leave
        // in order, whatever the interleaving of their goodbyes.
        let (mut ea, mut eb) = (a.health_events(), b.health_events());
        let start = Instant::now();
        let (x, y) = tokio::join!(
            tokio::time::timeout(BOUND, a.close()),
            tokio::time::timeout(BOUND, b.close())
        );
        x.expect("rank 0's close hung");
        y.expect("rank 1's close hung");
        let took = start.elapsed();
        let from_a = cause_seen(&c, Rank(0)).await;
        let from_b = cause_seen(&c, Rank(1)).await;
        println!("round {round}: both closed in {took:?}; rank 2 saw {from_a:?} and {from_b:?}");
        assert!(from_a.contains("orderly") && from_b.contains("orderly"));
        // Neither closing side reported a loss: a side that heard the other's
        // goodbye before its own close began reports that orderly departure,
        // and then its own close; nothing else.
        for (who, events) in [(0, &mut ea), (1, &mut eb)] {
            let mut seen = Vec::new();
            while let Ok(e) = events.try_recv() {
                seen.push(e);
            }
            assert!(
                seen.iter().all(|e| match e {
                    HealthEvent::PeerLost { cause, .. } => cause.contains("orderly"),
                    HealthEvent::Aborted { reason } => &**reason == "closed",
                    _ => false,
                }) && matches!(seen.last(), Some(HealthEvent::Aborted { .. })),
                "round {round}: rank {who} reported {seen:?}"
            );
        }
        c.close().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_close_does_not_wait_long_for_a_peer_that_never_answers() {
    // A peer that is alive but never reads (its reader is stuck behind a full
    // stash): the goodbye cannot be answered, and the close gives up after
    // its bound instead of hanging.
    let mut v = mesh_with("close-silent", 2, |mut c| {
        c.unexpected_budget = 0;
        c.eager_limit = 0;
        c
    })
    .await;
    let b = v.pop().unwrap();
    let a = v.pop().unwrap();
    // b fills a's socket with a message a never receives, so a's reader holds
    // (TCP backpressure) and b's writer stays busy.
    let big = vec![1u8; 32 << 20];
    let pending = b.isend(Rank(0), Tag(9), Tensor::from(big));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let start = Instant::now();
    tokio::time::timeout(BOUND, b.close()).await.expect("close hung");
    let took = start.elapsed();
    println!("close with a peer that cannot answer took {took:?}");
    assert!(
        took >= CLOSE_LIMIT,
        "the close gave up before its limit: {took:?}"
    );
    // The cut-off is a reset: the peer learns of it at once, not at its
    // next heartbeat timeout.
    let cause = cause_seen(&a, Rank(1)).await;
    println!("the peer saw: {cause}");
    drop(pending);
    drop(a);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operations_started_once_the_close_has_begun_fail_as_closed() {
    let (a, b) = pair("close-begun").await;
    let pending = a.irecv(Rank(1), Tag(4), Tensor::zeros(DType::U8, [8]).unwrap());
    let mut close = Box::pin(a.close());
    // One poll starts the close (its goodbyes are on their way).
    assert!(futures::poll!(&mut close).is_pending());
    // The health snapshot says so at once, before any peer has answered (a
    // peer that answers shows as lost, which must not read as the cause).
    assert_eq!(a.health().aborted.as_deref(), Some("closed"));
    let e = a.send(Rank(1), Tag(4), &[1u8; 8][..]).await.unwrap_err();
    assert!(
        matches!(&e, Error::Aborted { reason } if &**reason == "closed"),
        "{e}"
    );
    let mut buf = Tensor::zeros(DType::U8, [8]).unwrap();
    let e = a.recv(Rank(1), Tag(4), &mut buf).await.unwrap_err();
    assert!(
        matches!(&e, Error::Aborted { reason } if &**reason == "closed"),
        "{e}"
    );
    tokio::time::timeout(BOUND, close).await.expect("close hung");
    let e = pending.await.unwrap_err();
    assert!(
        matches!(&e, Error::Aborted { reason } if &**reason == "closed"),
        "{e:?}"
    );
    assert!(cause_seen(&b, Rank(0)).await.contains("orderly"));
}

/// A close whose future is dropped before it ends (a timeout around it, a
/// `select!` that lost) aborts the communicator: its tasks end and
/// `wait_closed` returns, instead of a communicator that refuses every
/// operation as closed while its sockets and tasks stay up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_close_dropped_part_way_aborts() {
    let (a, b) = pair("close-dropped").await;
    {
        let mut close = Box::pin(a.close());
        assert!(futures::poll!(&mut close).is_pending());
    }
    assert!(a.is_aborted(), "the dropped close left the communicator up");
    tokio::time::timeout(BOUND, a.wait_closed())
        .await
        .expect("the tasks of a communicator whose close was dropped never ended");
    // The peer sees it go (a goodbye or a reset, either way promptly).
    cause_seen(&b, Rank(0)).await;
}
