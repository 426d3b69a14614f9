//! Failure handling over loopback: strangers and impostors at the listener, a
//! forged peer that sends bad frames, a peer that goes away, `abort()` with
//! operations pending, and joins that must fail.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use multiworld_tcp::frame::{FrameHeader, FrameKind};
use multiworld_tcp::handshake::{self, Hello, MSG_REJECT, NONCE_LEN, RejectCode};
use multiworld_tcp::mesh::{addr_key, client_handshake};
use multiworld_tcp::{
    CommConfig, Communicator, DType, Error, Generation, HealthEvent, Identity, MemoryRendezvous, Rank,
    Rendezvous, Side, Tag, Tensor,
};
use multiworld_testkit::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Bound used in assertions about failure detection. The design target is 50 ms
/// (10 ms for abort); tests allow far more so a busy 2-core machine never flakes,
/// and print what they measured.
const DETECT: Duration = Duration::from_secs(2);

/// Reads until EOF or error; returns what was read. Fails the test if the other
/// side keeps the connection open longer than `limit`.
async fn read_until_closed(s: &mut TcpStream, limit: Duration) -> Vec<u8> {
    let mut out = Vec::new();
    let r = tokio::time::timeout(limit, async {
        let mut buf = [0u8; 512];
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => out.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    assert!(r.is_ok(), "listener kept a bad connection open for {limit:?}");
    out
}

fn ident(world: &str, generation: u64, rank: u32) -> Identity {
    Identity {
        world: multiworld_testkit::world(world),
        generation: Generation(generation),
        rank: Rank(rank),
        size: 2,
    }
}

async fn assert_pair_works(a: &Communicator, b: &Communicator, tag: u32) {
    let data = [tag; 4];
    let (s, r) = tokio::join!(a.send(Rank(1), Tag(tag), &data), async {
        let mut buf = Tensor::zeros(DType::U32, [4]).unwrap();
        b.recv(Rank(0), Tag(tag), &mut buf).await.map(|()| buf)
    });
    s.unwrap();
    assert_eq!(r.unwrap().as_slice::<u32>().unwrap(), &[tag; 4]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strangers_are_refused_without_harming_the_world() {
    let mut v = mesh_with("guarded", 2, |mut c| {
        c.handshake_timeout = Duration::from_millis(300);
        c
    })
    .await;
    let b = v.pop().unwrap();
    let a = v.pop().unwrap();
    let mut events = a.health_events();
    let addr = a.local_addr();
    let mut refused = 0;

    // Keep a transfer going across all the attacks.
    let (s, r) = tokio::join!(a.send(Rank(1), Tag(1), &[1u8; 3]), async {
        let mut buf = Tensor::zeros(DType::U8, [3]).unwrap();
        b.recv(Rank(0), Tag(1), &mut buf).await
    });
    s.unwrap();
    r.unwrap();

    // 0. A connection closed before its first byte (a member's check that
    // this one is alive, a port scan): counted, but not warned about.
    drop(TcpStream::connect(addr).await.unwrap());
    refused += 1;
    assert!(
        eventually(DETECT, || a.rejected_connections() >= refused).await,
        "a connection closed before its first byte was not counted"
    );

    // 1. Random bytes (and an HTTP request): answered with a reject, closed.
    for junk in [
        pattern(300, 0x5a, false),
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(),
    ] {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(&junk).await.unwrap();
        let reply = read_until_closed(&mut s, DETECT).await;
        assert_eq!(reply.first(), Some(&MSG_REJECT), "{reply:?}");
        refused += 1;
    }

    // 2. Half a hello, then silence: dropped after the handshake timeout.
    let mut s = TcpStream::connect(addr).await.unwrap();
    let hello = Hello::new(&ident("guarded", 1, 1), Rank(0), [0; NONCE_LEN]).encode();
    s.write_all(&hello[..10]).await.unwrap();
    let start = Instant::now();
    read_until_closed(&mut s, DETECT).await;
    assert!(
        start.elapsed() >= Duration::from_millis(250),
        "waited for the timeout"
    );
    refused += 1;

    // 3. A huge declared name length: refused before reading the name.
    let mut bad = hello.clone();
    let at = handshake::HELLO_FIXED_LEN - 2;
    bad[at..at + 2].copy_from_slice(&u16::MAX.to_le_bytes());
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(&bad[..handshake::HELLO_FIXED_LEN]).await.unwrap();
    let reply = read_until_closed(&mut s, DETECT).await;
    assert_eq!(
        reply.get(..2),
        Some(&[MSG_REJECT, RejectCode::Malformed.code()][..])
    );
    refused += 1;

    // 4. Wrong secret. The honest client notices the server's proof is wrong and
    // refuses (and tells the server)...
    let mut s = TcpStream::connect(addr).await.unwrap();
    let e = client_handshake(&mut s, &ident("guarded", 1, 1), Rank(0), b"wrong", addr)
        .await
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::Refused {
                side: Side::Local,
                code: RejectCode::Auth,
                ..
            }
        ),
        "{e}"
    );
    read_until_closed(&mut s, DETECT).await;
    refused += 1;
    // ...and an impostor that ignores the server's proof and guesses its own is
    // refused by the server.
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(&hello).await.unwrap();
    let mut challenge = [0u8; 1 + handshake::CHALLENGE_BODY_LEN];
    s.read_exact(&mut challenge).await.unwrap();
    assert_eq!(challenge[0], handshake::MSG_CHALLENGE);
    s.write_all(&handshake::encode_proof(&[0xab; handshake::MAC_LEN]))
        .await
        .unwrap();
    let reply = read_until_closed(&mut s, DETECT).await;
    assert_eq!(reply.get(..2), Some(&[MSG_REJECT, RejectCode::Auth.code()][..]));
    refused += 1;

    // 5. Wrong world, wrong generation, wrong size, duplicate rank (right secret).
    let cases: [(Identity, RejectCode); 4] = [
        (ident("other", 1, 1), RejectCode::World),
        (ident("guarded", 2, 1), RejectCode::Generation),
        (
            Identity {
                size: 3,
                ..ident("guarded", 1, 1)
            },
            RejectCode::Size,
        ),
        (ident("guarded", 1, 1), RejectCode::Duplicate),
    ];
    for (id, code) in cases {
        let mut s = TcpStream::connect(addr).await.unwrap();
        let e = client_handshake(&mut s, &id, Rank(0), SECRET, addr)
            .await
            .unwrap_err();
        match e {
            Error::Refused {
                side: Side::Remote,
                code: c,
                ref detail,
                ..
            } => {
                assert_eq!(c, code, "{detail}");
                // The code only: nothing of the listener's world reaches a
                // peer that has not proven the secret.
                for secret_fact in ["guarded", "generation 1", "size 2", "rank 0"] {
                    assert!(!detail.contains(secret_fact), "{detail}");
                }
            }
            other => panic!("expected a refusal with {code}, got {other}"),
        }
        refused += 1;
    }

    assert!(
        eventually(DETECT, || a.rejected_connections() >= refused).await,
        "listener counted {} refusals, expected {refused}",
        a.rejected_connections()
    );
    assert_pair_works(&a, &b, 2).await;
    assert!(a.health().is_healthy() && b.health().is_healthy());
    assert!(events.try_recv().is_err(), "no health event for strangers");
}

/// Rank 0 is a real communicator; "rank 1" is this test speaking the protocol by
/// hand over a raw socket, so it can send any frame it likes.
async fn forged_pair(name: &str) -> (Communicator, TcpStream) {
    init_tracing();
    let rdv = MemoryRendezvous::new();
    let cfg = config(name, 0, 2);
    let rdv2 = rdv.clone();
    let join = tokio::spawn(async move { Communicator::join(cfg, &rdv2).await });
    let raw = rdv
        .get(&addr_key(&world(name), Generation(1), Rank(0)), DETECT)
        .await
        .unwrap();
    let addr: SocketAddr = std::str::from_utf8(&raw).unwrap().parse().unwrap();
    let mut s = TcpStream::connect(addr).await.unwrap();
    // Else Nagle holds the bad frame back ~40 ms behind the good one.
    s.set_nodelay(true).unwrap();
    let me = Identity {
        world: world(name),
        generation: Generation(1),
        rank: Rank(1),
        size: 2,
    };
    client_handshake(&mut s, &me, Rank(0), SECRET, addr)
        .await
        .unwrap();
    (join.await.unwrap().unwrap(), s)
}

fn data_header(seq: u32, generation: u64, dtype: DType, tag: u32, len: u64) -> [u8; 32] {
    FrameHeader {
        kind: FrameKind::Data {
            dtype,
            tag: Tag(tag),
            len,
        },
        seq,
        generation: Generation(generation),
    }
    .encode()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_frames_from_a_member_fail_that_peer() {
    let bad_frames: Vec<(&str, Vec<u8>, &str)> = vec![
        (
            "huge length",
            data_header(0, 1, DType::U8, 1, 1 << 62).to_vec(),
            "exceeds the limit",
        ),
        (
            "bad magic",
            {
                let mut h = data_header(0, 1, DType::U8, 1, 4);
                h[0] = b'Z';
                h.to_vec()
            },
            "magic",
        ),
        (
            "old generation",
            data_header(0, 0, DType::U8, 1, 4).to_vec(),
            "generation",
        ),
        (
            "skipped sequence number",
            data_header(5, 1, DType::U8, 1, 4).to_vec(),
            "sequence",
        ),
        (
            "invalid bool",
            [data_header(0, 1, DType::Bool, 1, 4).as_slice(), &[0, 1, 2, 1]].concat(),
            "bool",
        ),
        (
            "half a header, then close",
            data_header(0, 1, DType::U8, 1, 4)[..12].to_vec(),
            "closed",
        ),
        (
            "half a payload, then close",
            [data_header(0, 1, DType::U8, 1, 4).as_slice(), &[1, 2]].concat(),
            "closed",
        ),
    ];
    for (i, (what, bytes, cause_has)) in bad_frames.into_iter().enumerate() {
        let (a, mut s) = forged_pair(&format!("forged{i}")).await;
        // A well-formed message first: the frame layout really is what we think.
        let ok = [data_header(0, 1, DType::U8, 9, 3).as_slice(), &[7, 8, 9]].concat();
        // Every following frame then starts at sequence 1.
        let mut bytes = bytes;
        if bytes.len() >= 16 && bytes[..4] == *b"MWF1" {
            let seq = u32::from_le_bytes(bytes[12..16].try_into().unwrap());
            bytes[12..16].copy_from_slice(&(seq + 1).to_le_bytes());
        }
        s.write_all(&ok).await.unwrap();
        let mut buf = Tensor::zeros(DType::U8, [3]).unwrap();
        a.recv(Rank(1), Tag(9), &mut buf).await.unwrap();
        assert_eq!(buf.as_slice::<u8>().unwrap(), &[7, 8, 9]);

        let h = a.irecv(
            Rank(1),
            Tag(1),
            Tensor::zeros(DType::from_code(bytes[5]).unwrap_or(DType::U8), [4]).unwrap(),
        );
        let mut events = a.health_events();
        s.write_all(&bytes).await.unwrap();
        if what.contains("close") {
            s.shutdown().await.unwrap();
        }
        let start = Instant::now();
        let e = tokio::time::timeout(DETECT, h).await.expect(what).unwrap_err();
        match &e {
            Error::PeerLost { rank, cause } => {
                assert_eq!(*rank, Rank(1), "{what}");
                assert!(cause.contains(cause_has), "{what}: cause {cause:?}");
            }
            other => panic!("{what}: expected PeerLost, got {other}"),
        }
        println!("{what}: receive failed after {:?}: {e}", start.elapsed());
        match events.recv().await.unwrap() {
            HealthEvent::PeerLost { rank, .. } => assert_eq!(rank, Rank(1)),
            other => panic!("unexpected event {other:?}"),
        }
        // The connection is closed from rank 0's side too.
        read_until_closed(&mut s, DETECT).await;
    }
}

/// A message that does not fit the receive it is routed to fails that
/// receive as soon as its header is read, before its payload is skipped: a
/// slow (or stalled) payload does not hold the error back, so a deadline of
/// the caller's cannot pass first and hide it. The stream stays in step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mismatch_is_reported_before_its_payload_is_skipped() {
    let (a, mut s) = forged_pair("mismatch-first").await;
    let h = a.irecv(Rank(1), Tag(5), Tensor::zeros(DType::U8, [4]).unwrap());
    // A 1 MiB message, of which only 100 bytes come for now.
    let len = 1u64 << 20;
    s.write_all(&data_header(0, 1, DType::U8, 5, len)).await.unwrap();
    s.write_all(&[3u8; 100]).await.unwrap();
    let failed = tokio::time::timeout(DETECT, h.wait_timeout(Duration::from_secs(60)))
        .await
        .expect("the mismatch waited for the payload")
        .unwrap_err();
    assert!(matches!(failed.error, Error::Mismatch { .. }), "{}", failed.error);
    assert_eq!(failed.buffer.shape(), &[4], "the caller's buffer comes back");
    assert_eq!(failed.buffer.as_slice::<u8>().unwrap(), &[0; 4], "untouched");
    // The rest of the payload, then a message that fits: the stream is in step.
    s.write_all(&vec![3u8; (len - 100) as usize]).await.unwrap();
    s.write_all(&[data_header(1, 1, DType::U8, 5, 4).as_slice(), &[1, 2, 3, 4]].concat())
        .await
        .unwrap();
    let mut buf = Tensor::zeros(DType::U8, [4]).unwrap();
    tokio::time::timeout(DETECT, a.recv(Rank(1), Tag(5), &mut buf))
        .await
        .expect("the next message")
        .unwrap();
    assert_eq!(buf.as_slice::<u8>().unwrap(), &[1, 2, 3, 4]);
}

/// Lent memory that records which threads write it.
struct Watched {
    mem: Vec<u8>,
    writers: Arc<std::sync::Mutex<Vec<std::thread::ThreadId>>>,
}

impl multiworld_types::ExternalMemory for Watched {
    fn bytes(&self) -> &[u8] {
        &self.mem
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        self.writers.lock().unwrap().push(std::thread::current().id());
        &mut self.mem
    }
}

/// A large message read whole into a receive that was cancelled while it
/// arrived goes to the next receive; when that one's memory is lent, the
/// copy into it is made off the runtime's threads (here the runtime is the
/// test's one thread), so other worlds' readers and heartbeats on that
/// thread do not wait for it.
#[tokio::test]
async fn a_large_message_handed_to_the_next_receive_is_copied_off_the_runtime() {
    let runtime_thread = std::thread::current().id();
    let (a, mut s) = forged_pair("off-runtime").await;
    const N: usize = 4 << 20;
    let first = a.irecv(Rank(1), Tag(7), Tensor::zeros(DType::U8, [N]).unwrap());
    let payload: Vec<u8> = (0..N).map(|i| (i % 251) as u8).collect();
    s.write_all(&data_header(0, 1, DType::U8, 7, N as u64))
        .await
        .unwrap();
    s.write_all(&payload[..64 << 10]).await.unwrap();
    // The reader has begun to read it into the first receive.
    let t0 = Instant::now();
    while a.peer_stats(Rank(1)).unwrap().bytes_received < (64 << 10) {
        assert!(t0.elapsed() < DETECT, "the reader never read the start");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let writers = Arc::new(std::sync::Mutex::new(Vec::new()));
    let lent = Tensor::from_external(
        DType::U8,
        [N],
        Box::new(Watched {
            mem: vec![0; N],
            writers: Arc::clone(&writers),
        }),
    )
    .unwrap();
    let second = a.irecv(Rank(1), Tag(7), lent);
    drop(first);
    s.write_all(&payload[64 << 10..]).await.unwrap();
    let got = tokio::time::timeout(DETECT, second)
        .await
        .expect("the message")
        .unwrap();
    assert_eq!(got.tensor.as_bytes(), &payload[..]);
    let writers = writers.lock().unwrap();
    assert!(!writers.is_empty(), "the lent memory was never written");
    assert!(
        writers.iter().all(|&t| t != runtime_thread),
        "the copy into lent memory ran on the runtime's thread"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_goes_away_fails_pending_operations() {
    let comms = mesh("departure", 3).await;
    let mut it = comms.into_iter();
    let (a, b, c) = (it.next().unwrap(), it.next().unwrap(), it.next().unwrap());
    let mut events = a.health_events();
    let from_b = a.irecv(Rank(1), Tag(1), Tensor::zeros(DType::F32, [1 << 20]).unwrap());
    let from_any = a.irecv(
        multiworld_tcp::Source::Any,
        Tag(2),
        Tensor::zeros(DType::U8, [1]).unwrap(),
    );
    let from_c = a.irecv(Rank(2), Tag(3), Tensor::zeros(DType::U8, [1]).unwrap());
    tokio::time::sleep(Duration::from_millis(20)).await;
    let start = Instant::now();
    drop(b); // aborts rank 1: its sockets close
    let e = tokio::time::timeout(DETECT, from_b).await.unwrap().unwrap_err();
    let took = start.elapsed();
    println!("pending receive failed {took:?} after the peer went away: {e}");
    assert!(matches!(&e, Error::PeerLost { rank: Rank(1), .. }), "{e}");
    assert!(e.is_world_fatal());
    let e = tokio::time::timeout(DETECT, from_any).await.unwrap().unwrap_err();
    assert!(
        matches!(&e, Error::PeerLost { rank: Rank(1), .. }),
        "any-source fails too: {e}"
    );
    assert_eq!(
        events.recv().await.unwrap(),
        HealthEvent::PeerLost {
            rank: Rank(1),
            cause: a.health().lost[0].1.clone()
        }
    );
    // New operations with the lost peer fail at once; the others still work.
    let e = a.send(Rank(1), Tag(0), &[1u8]).await.unwrap_err();
    assert!(matches!(e, Error::PeerLost { rank: Rank(1), .. }), "{e}");
    let mut buf = Tensor::zeros(DType::U8, [1]).unwrap();
    let e = a.recv(Rank(1), Tag(0), &mut buf).await.unwrap_err();
    assert!(matches!(e, Error::PeerLost { rank: Rank(1), .. }), "{e}");
    c.send(Rank(0), Tag(3), &[4u8]).await.unwrap();
    assert_eq!(from_c.await.unwrap().tensor.as_slice::<u8>().unwrap(), &[4]);
    // An orderly close is reported as such.
    let mut events = a.health_events();
    c.close().await;
    match tokio::time::timeout(DETECT, events.recv())
        .await
        .unwrap()
        .unwrap()
    {
        HealthEvent::PeerLost { rank, cause } => {
            assert_eq!(rank, Rank(2));
            assert!(cause.contains("orderly"), "{cause}");
        }
        other => panic!("unexpected {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_fails_everything_pending_and_releases_resources() {
    let (a, b) = pair("abort").await;
    let a = Arc::new(a);
    let mut events = a.health_events();
    let addr = a.local_addr();
    // Pending: an irecv, a blocking recv, a send stuck on a full socket (rank 1
    // never posts a receive for it), and an isend queued behind that send.
    let posted = a.irecv(Rank(1), Tag(1), Tensor::zeros(DType::U8, [16]).unwrap());
    let a2 = Arc::clone(&a);
    let blocking_recv = tokio::spawn(async move {
        let mut buf = Tensor::zeros(DType::U8, [16]).unwrap();
        a2.recv_any(Tag(2), &mut buf).await.map(|_| buf)
    });
    let a3 = Arc::clone(&a);
    let stuck_send = tokio::spawn(async move {
        let big = Tensor::zeros(DType::U8, [64 << 20]).unwrap();
        a3.send(Rank(1), Tag(3), &big).await
    });
    // Let the big send fill the socket buffers and block.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let queued = a.isend(Rank(1), Tag(4), Tensor::from(vec![1u8; 8]));
    assert!(!stuck_send.is_finished(), "the big send is blocked");
    assert!(!queued.is_completed());

    let start = Instant::now();
    a.abort();
    let e1 = posted.await.unwrap_err();
    let e2 = blocking_recv.await.unwrap().unwrap_err();
    let e3 = stuck_send.await.unwrap().unwrap_err();
    let e4 = queued.await.unwrap_err();
    let took = start.elapsed();
    println!("abort failed 4 pending operations in {took:?}");
    for e in [&e1, &e2, &e3, &e4] {
        assert!(matches!(e, Error::Aborted { .. }), "{e}");
        assert!(e.is_world_fatal());
    }
    assert!(took < DETECT, "abort took {took:?}");
    assert!(matches!(
        events.recv().await.unwrap(),
        HealthEvent::Aborted { .. }
    ));
    // Tasks finish, sockets and the listener close.
    tokio::time::timeout(DETECT, a.wait_closed())
        .await
        .expect("tasks finish after abort");
    assert!(TcpStream::connect(addr).await.is_err(), "listener closed");
    let mut ev_b = b.health_events();
    let lost = if b.health().lost.is_empty() {
        matches!(
            tokio::time::timeout(DETECT, ev_b.recv()).await.unwrap().unwrap(),
            HealthEvent::PeerLost { rank: Rank(0), .. }
        )
    } else {
        b.health().lost[0].0 == Rank(0)
    };
    assert!(lost, "the peer sees the connection close");
    // Everything after abort fails at once.
    let e = a.send(Rank(1), Tag(0), &[1u8]).await.unwrap_err();
    assert!(matches!(e, Error::Aborted { .. }), "{e}");
    let mut buf = Tensor::zeros(DType::U8, [1]).unwrap();
    let e = a.recv(Rank(1), Tag(0), &mut buf).await.unwrap_err();
    assert!(matches!(e, Error::Aborted { .. }), "{e}");
    assert!(a.is_aborted());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn joins_that_must_fail() {
    init_tracing();
    // Wrong secret on one side: the connecting rank refuses the accepting rank's
    // proof; the accepting rank never completes, and at its deadline it says
    // which connection was refused and why, not just that it timed out.
    let rdv = MemoryRendezvous::new();
    let mut c0 = config("badsecret", 0, 2);
    c0.join_timeout = Duration::from_millis(500);
    let c1 = config("badsecret", 1, 2).with_secret("not the secret");
    let (r0, r1) = tokio::join!(Communicator::join(c0, &rdv), Communicator::join(c1, &rdv));
    let e1 = r1.unwrap_err();
    assert!(
        matches!(
            e1,
            Error::Refused {
                code: RejectCode::Auth,
                ..
            }
        ),
        "{e1}"
    );
    let e0 = r0.unwrap_err();
    match &e0 {
        Error::Refused {
            side: Side::Remote,
            code: RejectCode::Auth,
            detail,
            ..
        } => assert!(detail.contains("[1] did not connect"), "{e0}"),
        other => panic!("{other}"),
    }

    // A peer that never shows up.
    let mut c = config("alone", 1, 2);
    c.join_timeout = Duration::from_millis(100);
    let e = Communicator::join(c, &rdv).await.unwrap_err();
    assert!(matches!(e, Error::Rendezvous(_)), "{e}");

    // Bad configuration.
    let e = Communicator::join(config("x", 2, 2), &rdv).await.unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    let c = CommConfig::new(world("x"), Generation(1), Rank(0), 1);
    // A world of one is fine.
    let solo = Communicator::join(c, &rdv).await.unwrap();
    assert_eq!(solo.size(), 1);
}

/// Rank 0 of a world `name` of `size` (generation 1) joining alone within
/// `join_timeout`, and the listener address it published.
async fn rank0_waiting(
    name: &str,
    size: u32,
    join_timeout: Duration,
) -> (
    tokio::task::JoinHandle<multiworld_tcp::Result<Communicator>>,
    SocketAddr,
) {
    let rdv = MemoryRendezvous::new();
    let mut c0 = config(name, 0, size);
    c0.join_timeout = join_timeout;
    let joining = tokio::spawn({
        let rdv = rdv.clone();
        async move { Communicator::join(c0, &rdv).await }
    });
    let key = addr_key(&world(name), Generation(1), Rank(0));
    let raw = rdv.get(&key, Duration::from_secs(10)).await.unwrap();
    (joining, multiworld_tcp::published_addr(&raw).unwrap())
}

/// A connection that closes before its first byte (another member's check
/// that this one is alive, a port scan) is counted, but a join that then
/// times out reports the timeout, not that connection as the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_join_that_times_out_does_not_blame_a_connection_that_said_nothing() {
    init_tracing();
    let (joining, addr) = rank0_waiting("probed", 2, Duration::from_millis(800)).await;
    drop(TcpStream::connect(addr).await.unwrap());
    match joining.await.unwrap() {
        Err(Error::Timeout { op: "join", .. }) => {}
        Err(other) => panic!("expected the join's timeout, got {other}"),
        Ok(_) => panic!("joined without rank 1"),
    }
}

/// While a join builds its mesh, a second connection claiming a rank that is
/// already connected is refused as a duplicate as long as the first one is
/// open, and takes its place once it is closed (a member that retries its
/// join in the same generation after a failed attempt).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claimed_rank_is_refused_while_its_connection_lives_and_replaced_once_it_closed() {
    init_tracing();
    let (joining, addr) = rank0_waiting("rebuilt", 3, Duration::from_secs(10)).await;
    let me = Identity {
        size: 3,
        ..ident("rebuilt", 1, 1)
    };
    let connect = || async {
        let mut s = TcpStream::connect(addr).await.unwrap();
        client_handshake(&mut s, &me, Rank(0), SECRET, addr)
            .await
            .map(|()| s)
    };
    let first = connect().await.expect("the first claim of rank 1");
    // The first connection is open: another one for rank 1 is a duplicate.
    match connect().await {
        Err(Error::Refused {
            code: RejectCode::Duplicate,
            ..
        }) => {}
        other => panic!("expected a duplicate refusal, got {:?}", other.map(|_| ())),
    }
    drop(first);
    // Once rank 0 sees it closed, a new connection takes its place.
    let deadline = Instant::now() + DETECT;
    let _second = loop {
        match connect().await {
            Ok(s) => break s,
            Err(Error::Refused {
                code: RejectCode::Duplicate,
                ..
            }) if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(10)).await,
            Err(e) => panic!("the closed connection was not replaced: {e}"),
        }
    };
    joining.abort();
}

/// A store that never answers (a hung server, a dead link with no reset).
struct HungStore;

impl Rendezvous for HungStore {
    fn set<'a>(
        &'a self,
        _key: &'a str,
        _value: Vec<u8>,
    ) -> futures::future::BoxFuture<'a, Result<(), multiworld_tcp::RendezvousError>> {
        Box::pin(futures::future::pending())
    }
    fn get<'a>(
        &'a self,
        _key: &'a str,
        _timeout: Duration,
    ) -> futures::future::BoxFuture<'a, Result<Vec<u8>, multiworld_tcp::RendezvousError>> {
        Box::pin(futures::future::pending())
    }
}

/// The join's store calls are bounded like the rest of the join: a store
/// that never answers fails it at `join_timeout` with `Timeout { op: "join" }`,
/// and cancelling the join's token ends it at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_never_answers_fails_the_join_at_its_deadline() {
    let mut c = config("hung-store", 1, 2);
    c.join_timeout = Duration::from_millis(200);
    let e = tokio::time::timeout(DETECT, Communicator::join(c, &HungStore))
        .await
        .expect("the join waited on the store past its deadline")
        .unwrap_err();
    assert!(matches!(e, Error::Timeout { op: "join", .. }), "{e}");

    let token = tokio_util::sync::CancellationToken::new();
    let join = tokio::spawn({
        let token = token.clone();
        async move { Communicator::join_with_token(config("hung-store-2", 0, 2), &HungStore, token).await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    token.cancel();
    let e = tokio::time::timeout(DETECT, join)
        .await
        .expect("cancelling the token did not end the join")
        .unwrap()
        .unwrap_err();
    assert!(matches!(e, Error::Aborted { .. }), "{e}");
}

/// Sends pending towards a peer that goes away (a big one stuck on a full
/// socket because the peer never receives it, and one queued behind it)
/// fail with `PeerLost` naming that peer, promptly, and the sender's
/// connections to its other peers keep working.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_sends_to_a_peer_that_goes_away_fail_naming_it() {
    let mut ranks = mesh("sendloss", 3).await;
    let c = ranks.pop().unwrap();
    let b = ranks.pop().unwrap();
    let a = Arc::new(ranks.pop().unwrap());
    let a2 = Arc::clone(&a);
    let stuck_send = tokio::spawn(async move {
        let big = Tensor::zeros(DType::U8, [64 << 20]).unwrap();
        a2.send(Rank(1), Tag(3), &big).await
    });
    // Give the big send time to fill the socket buffers: rank 1 never posts
    // a receive, so it cannot finish (asserted, not assumed).
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!stuck_send.is_finished(), "the big send is blocked");
    let queued = a.isend(Rank(1), Tag(4), Tensor::from(vec![1u8; 8]));
    assert!(!queued.is_completed());

    let start = Instant::now();
    b.abort();
    let e1 = tokio::time::timeout(DETECT, stuck_send)
        .await
        .unwrap()
        .unwrap()
        .unwrap_err();
    let e2 = tokio::time::timeout(DETECT, queued).await.unwrap().unwrap_err();
    let took = start.elapsed();
    println!("the peer's loss failed 2 pending sends in {took:?}");
    for e in [&e1, &e2] {
        assert!(matches!(e, Error::PeerLost { rank: Rank(1), .. }), "{e}");
        assert!(e.to_string().contains("rank 1"), "{e}");
    }
    // Rank 2 is still reachable both ways.
    let mut got = Tensor::zeros(DType::U8, [3]).unwrap();
    let (s, r) = tokio::join!(
        a.send(Rank(2), Tag(5), &[7u8, 8, 9][..]),
        c.recv(Rank(0), Tag(5), &mut got)
    );
    s.unwrap();
    r.unwrap();
    assert_eq!(got.as_slice::<u8>().unwrap(), &[7, 8, 9]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_the_world_token_aborts() {
    init_tracing();
    let rdv = MemoryRendezvous::new();
    let root = tokio_util::sync::CancellationToken::new();
    let (a, b) = tokio::join!(
        Communicator::join_with_token(config("token", 0, 2), &rdv, root.child_token()),
        Communicator::join(config("token", 1, 2), &rdv)
    );
    let (a, b) = (a.unwrap(), b.unwrap());
    let pending = a.irecv(Rank(1), Tag(1), Tensor::zeros(DType::U8, [4]).unwrap());
    root.cancel();
    let e = tokio::time::timeout(DETECT, pending).await.unwrap().unwrap_err();
    assert!(matches!(e, Error::Aborted { .. }), "{e}");
    assert!(a.is_aborted());
    tokio::time::timeout(DETECT, a.wait_closed()).await.unwrap();
    let mut ev = b.health_events();
    if b.health().is_healthy() {
        let ev = tokio::time::timeout(DETECT, ev.recv()).await.unwrap().unwrap();
        assert!(
            matches!(ev, HealthEvent::PeerLost { rank: Rank(0), .. }),
            "{ev:?}"
        );
    }
}
