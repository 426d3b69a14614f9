//! The communicator over in-memory pipes (feature `memory`): point-to-point
//! operations, heartbeats and an orderly close work as over TCP, and a member
//! that is aborted or dropped fails its peers' pending operations with
//! `PeerLost`, whether their readers were waiting, holding a message back or
//! their writers blocked on a full pipe.
#![cfg(feature = "memory")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use multiworld_tcp::{
    CommConfig, Communicator, DType, Error, HealthEvent, MemoryWorld, Rank, Source, Tag, Tensor, WorldName,
};
use multiworld_testkit::memory::{memory_mesh, memory_mesh_with};
use multiworld_testkit::*;

/// A lost peer is noticed well within this (the reader sees the pipe end at
/// once; a reader holding a message back polls every 10 ms).
const DETECT: Duration = Duration::from_secs(5);

#[track_caller]
fn assert_peer_lost(e: &Error, rank: u32, what: &str) {
    assert!(
        matches!(e, Error::PeerLost { rank: r, .. } if *r == Rank(rank)),
        "{what}: expected PeerLost of rank {rank}, got {e}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_recv_isend_irecv_and_recv_any_over_memory() {
    let c = memory_mesh("mem-p2p", 3);
    assert_eq!(c.len(), 3);
    for (i, m) in c.iter().enumerate() {
        assert_eq!(m.rank(), Rank(i as u32));
        assert_eq!(m.size(), 3);
        assert_eq!(m.world().as_str(), "mem-p2p");
        assert!(m.local_addr().ip().is_unspecified(), "no listener");
        assert_eq!(m.rejected_connections(), 0);
        assert!(m.health().is_healthy());
    }

    // send/recv, every dtype, 0 → 1.
    for (i, d) in DType::ALL.into_iter().enumerate() {
        let t = patterned(d, 37, i as u8);
        let tag = Tag(d.code().into());
        let (s, r) = tokio::join!(c[0].send(Rank(1), tag, &t), async {
            let mut buf = Tensor::zeros(d, [37]).unwrap();
            c[1].recv(Rank(0), tag, &mut buf).await.map(|()| buf)
        });
        s.unwrap();
        assert_eq!(r.unwrap().as_bytes(), t.as_bytes(), "{d}");
    }

    // isend/irecv of messages far larger than a pipe (read straight into the
    // posted buffer), both directions at once, and an empty one.
    let big = patterned(DType::U8, 3 << 20, 9);
    let back = patterned(DType::F32, 1 << 19, 3);
    let s1 = c[1].isend(Rank(2), Tag(7), big.clone());
    let s2 = c[2].isend(Rank(1), Tag(8), back.clone());
    let r2 = c[2].irecv(Rank(1), Tag(7), Tensor::zeros(DType::U8, [3 << 20]).unwrap());
    let r1 = c[1].irecv(Rank(2), Tag(8), Tensor::zeros(DType::F32, [1 << 19]).unwrap());
    let e = c[2].isend(Rank(0), Tag(9), Tensor::zeros(DType::I64, [0]).unwrap());
    let got = r2.wait().await.unwrap();
    assert_eq!(got.src, Rank(1));
    assert_eq!(got.tensor.as_bytes(), big.as_bytes());
    assert_eq!(r1.wait().await.unwrap().tensor.as_bytes(), back.as_bytes());
    assert_eq!(
        s1.wait().await.unwrap().as_bytes(),
        big.as_bytes(),
        "the tensor comes back"
    );
    s2.wait().await.unwrap();
    e.wait().await.unwrap();
    let mut empty = Tensor::zeros(DType::I64, [0]).unwrap();
    c[0].recv(Rank(2), Tag(9), &mut empty).await.unwrap();

    // recv_any: one message from each other member, in whatever order.
    let (a, b, got) = tokio::join!(
        c[1].send(Rank(0), Tag(20), &[1u32]),
        c[2].send(Rank(0), Tag(20), &[2u32]),
        async {
            let mut seen = Vec::new();
            for _ in 0..2 {
                let mut buf = Tensor::zeros(DType::U32, [1]).unwrap();
                let from = c[0].recv_any(Tag(20), &mut buf).await.unwrap();
                assert_eq!(buf.as_slice::<u32>().unwrap(), &[from.0]);
                seen.push(from);
            }
            seen.sort();
            seen
        }
    );
    a.unwrap();
    b.unwrap();
    assert_eq!(got, [Rank(1), Rank(2)]);
    // And through irecv with Source::Any.
    let h = c[2].irecv(Source::Any, Tag(21), Tensor::zeros(DType::U32, [1]).unwrap());
    c[0].send(Rank(2), Tag(21), &[5u32]).await.unwrap();
    assert_eq!(h.await.unwrap().src, Rank(0));

    // Mismatches are reported as over TCP, and the stream stays in step.
    let (s, r) = tokio::join!(c[0].send(Rank(1), Tag(30), &[1.0f64, 2.0]), async {
        let mut buf = Tensor::zeros(DType::F32, [2]).unwrap();
        c[1].recv(Rank(0), Tag(30), &mut buf).await
    });
    s.unwrap();
    assert!(matches!(r.unwrap_err(), Error::Mismatch { .. }));
    let (s, r) = tokio::join!(c[0].send(Rank(1), Tag(31), &[4i16]), async {
        let mut buf = Tensor::zeros(DType::I16, [1]).unwrap();
        c[1].recv(Rank(0), Tag(31), &mut buf).await.map(|()| buf)
    });
    s.unwrap();
    assert_eq!(r.unwrap().as_slice::<i16>().unwrap(), &[4]);

    let st = c[1].peer_stats(Rank(2)).unwrap();
    assert_eq!(st.bytes_sent, (3 << 20) as u64);
    assert_eq!(st.bytes_received, (1 << 21) as u64);
    for m in &c {
        assert!(m.health().is_healthy(), "{:?}", m.health());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aborting_a_member_fails_the_others_pending_recv_with_peer_lost() {
    let c = memory_mesh("mem-abort", 3);
    let mut events = c[1].health_events();
    let pending = c[1].irecv(Rank(0), Tag(1), Tensor::zeros(DType::F32, [4]).unwrap());
    let any = c[2].irecv(Source::Any, Tag(1), Tensor::zeros(DType::F32, [4]).unwrap());
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(!pending.is_completed());
    c[0].abort();

    let e = tokio::time::timeout(DETECT, pending)
        .await
        .expect("recv hung")
        .unwrap_err();
    assert_peer_lost(&e, 0, "pending recv");
    assert!(e.is_world_fatal());
    let e = tokio::time::timeout(DETECT, any)
        .await
        .expect("recv_any hung")
        .unwrap_err();
    assert_peer_lost(&e, 0, "pending any-source recv");
    match tokio::time::timeout(DETECT, events.recv())
        .await
        .unwrap()
        .unwrap()
    {
        HealthEvent::PeerLost { rank, cause } => {
            assert_eq!(rank, Rank(0));
            assert!(cause.contains("closed"), "{cause}");
        }
        other => panic!("expected PeerLost, got {other:?}"),
    }
    // New operations with the lost member fail at once; the others still work.
    let e = c[1].send(Rank(0), Tag(2), &[1u8]).await.unwrap_err();
    assert_peer_lost(&e, 0, "send after the loss");
    let (s, r) = tokio::join!(c[1].send(Rank(2), Tag(3), &[7u8]), async {
        let mut b = Tensor::zeros(DType::U8, [1]).unwrap();
        c[2].recv(Rank(1), Tag(3), &mut b).await.map(|()| b)
    });
    s.unwrap();
    assert_eq!(r.unwrap().as_bytes(), &[7]);
    assert_eq!(c[1].health().lost.len(), 1);
    assert!(c[0].health().aborted.is_some());
    c[0].wait_closed().await;
}

/// Dropping a member is its death: a peer whose writer is blocked on a full
/// pipe fails naming it, and so does a peer whose reader holds back a large
/// message nobody asked for yet (it reads nothing, so it must notice the
/// pipe's end on its own, as a TCP reader notices a FIN or reset).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_member_fails_blocked_writers_and_holding_readers() {
    let mut c = memory_mesh("mem-drop", 3);
    // 1 → 0: a message far larger than the pipe, which 0 never receives, so
    // the send blocks on the full pipe.
    let stuck_send = c[1].isend(Rank(0), Tag(1), Tensor::zeros(DType::U8, [4 << 20]).unwrap());
    // 0 → 2: a message above the eager limit on a tag 2 does not receive, and
    // no receive behind it: 2's reader holds it back in the pipe.
    let held = c[0].isend(Rank(2), Tag(5), Tensor::zeros(DType::U8, [1 << 20]).unwrap());
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!stuck_send.is_completed(), "the pipe should be full");
    assert!(!held.is_completed(), "the message should be held back");
    assert_eq!(c[2].peer_stats(Rank(0)).unwrap().bytes_received, 0);

    let zero = c.remove(0);
    drop(zero);

    let e = tokio::time::timeout(DETECT, stuck_send.wait())
        .await
        .expect("blocked send hung")
        .unwrap_err();
    assert_peer_lost(&e, 0, "blocked send");
    assert!(
        eventually(DETECT, || !c[1].health().lost.is_empty()).await,
        "holding reader never noticed"
    );
    let lost = c[1].health().lost;
    assert_eq!(lost.len(), 1, "{lost:?}");
    assert_eq!(lost[0].0, Rank(0));
    // Now a receive that rank 0 could satisfy fails at once.
    let mut buf = Tensor::zeros(DType::U8, [1]).unwrap();
    let e = c[1].recv_any(Tag(5), &mut buf).await.unwrap_err();
    assert_peer_lost(&e, 0, "any-source recv after the loss");
    // The dropped member's own send ended with its abort.
    let e = held.await.unwrap_err();
    assert!(matches!(e, Error::Aborted { .. }), "{e}");
    // The survivors still talk.
    let (s, r) = tokio::join!(c[0].send(Rank(2), Tag(9), &[3u8]), async {
        let mut b = Tensor::zeros(DType::U8, [1]).unwrap();
        c[1].recv(Rank(1), Tag(9), &mut b).await.map(|()| b)
    });
    s.unwrap();
    assert_eq!(r.unwrap().as_bytes(), &[3]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeats_and_an_orderly_close_over_memory() {
    let c = memory_mesh_with("mem-hb", 2, |mut cfg| {
        cfg.heartbeat_interval = Some(Duration::from_millis(20));
        cfg
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let l = &c[1].liveness()[0];
    assert_eq!(l.rank, Rank(0));
    assert!(
        l.last_heard.elapsed() < Duration::from_millis(200),
        "idle peer not heard for {:?}",
        l.last_heard.elapsed()
    );
    c[0].close().await;
    assert!(
        eventually(DETECT, || c[1].liveness()[0].departed).await,
        "the goodbye was not seen"
    );
    let l = &c[1].liveness()[0];
    assert!(l.lost.as_deref().unwrap_or("").contains("orderly"), "{l:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_memory_worlds_are_refused() {
    let w = WorldName::new("mem-bad").unwrap();
    let e = Communicator::memory_world(&MemoryWorld::new(w.clone(), 0)).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    let e = Communicator::memory_world(&MemoryWorld::new(w.clone(), 2).with_pipe_capacity(0)).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    // A world of one works (nobody to talk to).
    let one = Communicator::memory_world(&MemoryWorld::new(w, 1)).unwrap();
    assert_eq!(one.len(), 1);
    assert!(one[0].health().is_healthy());
}

#[test]
fn a_memory_world_needs_a_runtime() {
    let w = WorldName::new("mem-rt").unwrap();
    let e = Communicator::memory_world(&MemoryWorld::new(w, 2)).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
}

/// A receiver that only takes what was read ahead (`try_recv`, as an event
/// loop's receive does before it posts one) keeps a stream longer than the
/// read-ahead window coming: when it has taken half the window, the reader,
/// which holds the next frame back for lack of room, is woken to read on.
/// The clock is paused and the receiver never lets the runtime idle, so the
/// reader's own 10 ms check on a held-back frame never fires: without that
/// wake-up, the stream stops at the window (16 messages of 64 KiB).
#[tokio::test(start_paused = true)]
async fn a_receiver_taking_only_read_ahead_messages_keeps_a_long_stream_coming() {
    const MSG: usize = 64 << 10;
    const N: usize = 48;
    let mut c = memory_mesh_with("reopen", 2, |mut cfg: CommConfig| {
        cfg.eager_limit = 256 << 10;
        cfg
    });
    let b = c.pop().unwrap();
    let a = c.pop().unwrap();
    let sender = tokio::spawn(async move {
        for i in 0..N {
            let t = patterned(DType::U8, MSG, i as u8);
            a.send(Rank(1), Tag(1), &t).await.unwrap();
        }
        a
    });
    let mut buf = Tensor::zeros(DType::U8, [MSG]).unwrap();
    let (mut got, mut empty_turns) = (0, 0u32);
    while got < N && empty_turns < 100_000 {
        match b.try_recv(Rank(0), Tag(1), &mut buf) {
            Some(r) => {
                assert_eq!(r.unwrap(), Rank(0));
                let want = patterned(DType::U8, MSG, got as u8);
                assert_eq!(buf.as_bytes(), want.as_bytes(), "message {got}");
                got += 1;
                empty_turns = 0;
            }
            None => {
                empty_turns += 1;
                tokio::task::yield_now().await;
            }
        }
    }
    assert_eq!(got, N, "the stream stopped: the reader was left holding back");
    let _a = sender.await.unwrap();
}
