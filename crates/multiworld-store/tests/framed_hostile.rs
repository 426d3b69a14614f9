//! The framed protocol's front under hostile and broken peers, over loopback
//! with raw sockets (no client library): strangers refused from a request's
//! head without their message being kept, the memory budget and the body
//! deadline, malformed frames closing only their own connection, frozen
//! clients closed by keepalive with their waits released, cancels, the cap
//! on requests in flight per connection, and arbitrary frames from a fuzzer.
//! Bounds are generous (a busy 2-core machine must never make them flake).
//! `MULTIWORLD_FUZZ_CASES=N` sends `N / 100` fuzzed requests (default 300).
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use bytes::Bytes;
use multiworld_proto::store::v1 as pb;
use multiworld_store::{
    ClientConfig, Limit, Limits, OpenOptions, Secret, ServerConfig, StoreClient, StoreError, StoreProof,
    StoreServer, WorldOptions, WorldStore,
};
use proptest::{prelude::*, strategy::ValueTree, test_runner::TestRunner};
use prost::Message;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};

const SECRET: &str = "right";
const PREFACE: &[u8; 8] = b"MWSTORE\x01";
const REQUEST: u8 = 1;
const REPLY: u8 = 2;
const ERROR: u8 = 3;
const CANCEL: u8 = 4;
const PING: u8 = 5;
const PONG: u8 = 6;
const GO_AWAY: u8 = 7;
/// The Ping method's code in a request frame.
const PING_METHOD: u8 = 15;
const SET: u8 = 3;
const GET: u8 = 4;

async fn server(config: ServerConfig) -> StoreServer {
    StoreServer::bind("127.0.0.1:0".parse().unwrap(), config)
        .await
        .unwrap()
}

async fn member(addr: SocketAddr, name: &str, secret: Option<&str>) -> WorldStore {
    StoreClient::connect(&addr.to_string(), ClientConfig::default())
        .await
        .unwrap()
        .open(
            name,
            OpenOptions {
                secret: secret.map(Secret::new),
                ..OpenOptions::default()
            },
        )
        .await
        .unwrap()
}

fn secure() -> WorldOptions {
    WorldOptions {
        secret: Some(Secret::new(SECRET)),
        limits: None,
    }
}

async fn set_get(w: &WorldStore) -> Duration {
    let t = Instant::now();
    w.set("probe", "v").await.unwrap();
    w.get("probe", Duration::from_secs(10)).await.unwrap();
    t.elapsed()
}

/// A server with a fast keepalive (200 ms, 1 s) and `max_streams` waits per
/// connection, and a member of its world "w" holding a 3 MiB value "big".
async fn a_big_value(max_streams: u32) -> (StoreServer, WorldStore) {
    let s = server(ServerConfig {
        max_streams_per_connection: max_streams,
        keepalive_interval: Duration::from_millis(200),
        keepalive_timeout: Duration::from_secs(1),
        ..ServerConfig::default()
    })
    .await;
    s.open_world("w", WorldOptions::default()).unwrap();
    let w = member(s.local_addr(), "w", None).await;
    w.set("big", vec![1u8; 3 << 20]).await.unwrap();
    (s, w)
}

/// This process's resident memory in MiB (the server runs in it).
fn rss_mib() -> f64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: f64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0.0);
    pages * 4096.0 / (1024.0 * 1024.0)
}

/// Polls `cond` every few milliseconds until it holds or `limit` passes.
async fn eventually(limit: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < limit, "not within {limit:?}: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn header(kind: u8, id: u32, len: usize) -> Vec<u8> {
    let mut b = (len as u32).to_be_bytes().to_vec();
    b.push(kind);
    b.extend_from_slice(&id.to_be_bytes());
    b
}

/// A request frame's head and message, declared as `declared` bytes of body
/// (`None`: the true length).
fn request(
    id: u32,
    method: u8,
    world: &[u8],
    proof: &[u8],
    message: &[u8],
    declared: Option<usize>,
) -> Vec<u8> {
    let mut body = vec![method];
    body.extend_from_slice(&(world.len() as u16).to_be_bytes());
    body.extend_from_slice(world);
    body.extend_from_slice(&(proof.len() as u16).to_be_bytes());
    body.extend_from_slice(proof);
    body.extend_from_slice(message);
    let mut f = header(REQUEST, id, declared.unwrap_or(body.len()));
    f.extend_from_slice(&body);
    f
}

fn get_message(world: &str, generation: u64, key: &str, timeout_ms: u64) -> Vec<u8> {
    pb::GetRequest {
        world: Some(pb::WorldRef {
            name: world.into(),
            generation,
        }),
        key: Bytes::copy_from_slice(key.as_bytes()),
        timeout_ms,
    }
    .encode_to_vec()
}

/// A `Get` of `key` in world "w" of generation `g`, as request `id`.
fn get_frame(id: u32, g: u64, key: &str, timeout_ms: u64) -> Vec<u8> {
    request(id, GET, b"w", b"", &get_message("w", g, key, timeout_ms), None)
}

/// A raw framed connection, and the `GoAway` the server sent on it (how
/// many requests it read), if it did.
struct Raw(TcpStream, Option<u32>);

impl Raw {
    async fn open(addr: SocketAddr) -> Raw {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(PREFACE).await.unwrap();
        Raw(s, None)
    }

    /// The next reply or error frame (answering pings, noting a `GoAway`):
    /// kind, id, body; `None` when the server closed the connection.
    async fn answer(&mut self) -> Option<(u8, u32, Vec<u8>)> {
        loop {
            let mut h = [0u8; 9];
            self.0.read_exact(&mut h).await.ok()?;
            let len = u32::from_be_bytes([h[0], h[1], h[2], h[3]]) as usize;
            let id = u32::from_be_bytes([h[5], h[6], h[7], h[8]]);
            assert!(len < 1 << 20, "a {len}-byte answer");
            let mut body = vec![0u8; len];
            self.0.read_exact(&mut body).await.ok()?;
            match h[4] {
                PING => {
                    self.0.write_all(&header(PONG, id, 0)).await.ok()?;
                }
                GO_AWAY => {
                    assert!(self.1.is_none(), "a second GoAway");
                    self.1 = Some(id);
                }
                REPLY | ERROR => return Some((h[4], id, body)),
                k => panic!("the server sent a frame of kind {k}"),
            }
        }
    }

    /// Whether the server closes the connection within `limit`.
    async fn closed_within(&mut self, limit: Duration) -> bool {
        let mut sink = [0u8; 4096];
        tokio::time::timeout(limit, async {
            loop {
                match self.0.read(&mut sink).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
        })
        .await
        .is_ok()
    }
}

/// The `mw-error` kind of an error frame's body.
fn error_kind(body: &[u8]) -> String {
    let n = body[1] as usize;
    String::from_utf8(body[2..2 + n].to_vec()).unwrap()
}

/// The `mw-limit` detail of an error frame's body.
fn error_detail(body: &[u8]) -> String {
    let n = body[1] as usize;
    let d = body[2 + n] as usize;
    String::from_utf8(body[3 + n..3 + n + d].to_vec()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stranger_is_refused_from_the_head_and_its_message_is_never_kept() {
    let s = server(ServerConfig {
        request_body_timeout: Duration::from_millis(600),
        ..ServerConfig::default()
    })
    .await;
    s.open_world("w", secure()).unwrap();
    let addr = s.local_addr();
    let w = member(addr, "w", Some(SECRET)).await;
    let g = w.generation();
    let quiet = set_get(&w).await;

    // 50 connections, each declaring a maximum-size Set with a wrong proof
    // (or none) and sending 32 KiB of it.
    let max = ServerConfig::default().max_message_bytes;
    let wrong = Secret::new("wrong").proof("w");
    let mut held = Vec::new();
    for i in 0..50 {
        let mut raw = Raw::open(addr).await;
        let proof: &[u8] = if i % 2 == 0 { wrong.as_bytes() } else { b"" };
        let msg = pb::SetRequest {
            world: Some(pb::WorldRef {
                name: "w".into(),
                generation: g,
            }),
            key: Bytes::from_static(b"k"),
            value: Bytes::from(vec![7u8; 32 << 10]),
        }
        .encode_to_vec();
        let f = request(1, SET, b"w", proof, &msg, Some(5 + 1 + proof.len() + max));
        raw.0.write_all(&f).await.unwrap();
        held.push(raw);
    }
    let mut during = Duration::ZERO;
    for _ in 0..5 {
        during = during.max(set_get(&w).await);
    }
    assert_eq!(s.stats().buffered_request_bytes, 0, "{:?}", s.stats());
    assert!(
        during < (quiet * 10).max(Duration::from_millis(500)),
        "set+get {during:?} during the attack, {quiet:?} before"
    );
    // Every one was answered `unauthenticated` from its head, then closed (a
    // stranger's large message is not read through).
    for raw in &mut held {
        let (kind, id, body) = raw.answer().await.unwrap();
        assert_eq!((kind, id), (ERROR, 1));
        assert_eq!(error_kind(&body), "unauthenticated");
        assert!(raw.closed_within(Duration::from_secs(5)).await);
    }
    assert!(s.stats().refused_requests >= 50);
    assert_eq!(w.try_get("k").await.unwrap(), None, "a stranger wrote a key");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admitted_client_is_bounded_by_the_memory_budget_and_the_body_deadline() {
    let config = ServerConfig {
        max_buffered_request_bytes: 4 << 20,
        request_memory_wait: Duration::from_millis(200),
        request_body_timeout: Duration::from_millis(800),
        ..ServerConfig::default()
    };
    let budget = config.max_buffered_request_bytes;
    let s = server(config).await;
    s.open_world("w", WorldOptions::default()).unwrap();
    let addr = s.local_addr();
    let w = member(addr, "w", None).await;
    let g = w.generation();

    // 20 connections, each declaring a Set of a little over 1 MiB (a
    // reservation of over 2 MiB: one fits in the budget, with room left for
    // small requests) and sending its head and 16 KiB.
    let mut held = Vec::new();
    for _ in 0..20 {
        let mut raw = Raw::open(addr).await;
        let msg = pb::SetRequest {
            world: Some(pb::WorldRef {
                name: "w".into(),
                generation: g,
            }),
            key: Bytes::from_static(b"k"),
            value: Bytes::from(vec![7u8; 16 << 10]),
        }
        .encode_to_vec();
        let f = request(9, SET, b"w", b"", &msg, Some(5 + 1 + (1 << 20) + 64));
        raw.0.write_all(&f).await.unwrap();
        held.push(raw);
    }
    let started = Instant::now();
    let mut peak = 0;
    while started.elapsed() < Duration::from_millis(400) {
        peak = peak.max(s.stats().buffered_request_bytes);
        set_get(&w).await;
    }
    assert!(peak > 0 && peak <= budget, "reserved {peak} of {budget}");
    let mut kinds = Vec::new();
    for raw in &mut held {
        let (kind, id, body) = raw.answer().await.unwrap();
        assert_eq!((kind, id), (ERROR, 9));
        kinds.push(error_kind(&body));
        assert!(raw.closed_within(Duration::from_secs(5)).await);
    }
    // Refused for memory (no budget in time) or timed out (budget, but the
    // message never finished); the budget comes back either way.
    assert!(kinds.iter().any(|k| k == "limit-exceeded"), "{kinds:?}");
    assert!(kinds.iter().any(|k| k == "timeout"), "{kinds:?}");
    assert!(
        kinds.iter().all(|k| k == "limit-exceeded" || k == "timeout"),
        "{kinds:?}"
    );
    eventually(Duration::from_secs(5), "the budget came back", || {
        s.stats().buffered_request_bytes == 0
    })
    .await;
    assert_eq!(&w.get("probe", Duration::from_secs(1)).await.unwrap()[..], b"v");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_frames_close_only_their_own_connection() {
    let s = server(ServerConfig {
        first_request_timeout: Duration::from_millis(500),
        ..ServerConfig::default()
    })
    .await;
    s.open_world("w", WorldOptions::default()).unwrap();
    let addr = s.local_addr();
    let w = member(addr, "w", None).await;
    w.set("k", "v").await.unwrap();
    let waiter = {
        let w = w.clone();
        tokio::spawn(async move { w.get("after", Duration::from_secs(30)).await })
    };

    let huge = header(REQUEST, 1, u32::MAX as usize);
    let head_past_frame = request(1, SET, b"world", b"", b"", Some(4));
    let mut control_with_body = header(PING, 1, 4);
    control_with_body.extend_from_slice(b"abcd");
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("an unknown kind", header(9, 1, 0)),
        ("a 4 GiB request", huge),
        ("a reply from a client", header(REPLY, 1, 0)),
        ("a head longer than its frame", head_past_frame),
        ("a control frame with a body", control_with_body),
    ];
    for (what, frame) in cases {
        let mut raw = Raw::open(addr).await;
        raw.0.write_all(&frame).await.unwrap();
        assert!(
            raw.closed_within(Duration::from_secs(5)).await,
            "{what}: kept open"
        );
    }
    // A wrong preface, and a preface cut short then nothing.
    for bytes in [&b"MWSTORE\x02"[..], &b"MWS"[..]] {
        let mut sock = TcpStream::connect(addr).await.unwrap();
        sock.write_all(bytes).await.unwrap();
        let mut raw = Raw(sock, None);
        assert!(
            raw.closed_within(Duration::from_secs(5)).await,
            "{bytes:?}: kept open"
        );
    }
    // Random bytes after the preface.
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    for _ in 0..20 {
        let noise: Vec<u8> = (0..4096)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                seed as u8
            })
            .collect();
        let mut raw = Raw::open(addr).await;
        let _ = raw.0.write_all(&noise).await;
        let _ = raw.0.shutdown().await;
        assert!(raw.closed_within(Duration::from_secs(12)).await);
    }
    // An unknown method is answered, and the connection goes on.
    let mut raw = Raw::open(addr).await;
    raw.0
        .write_all(&request(3, 99, b"w", b"", b"", None))
        .await
        .unwrap();
    let (kind, id, body) = raw.answer().await.unwrap();
    assert_eq!(
        (kind, id, error_kind(&body).as_str()),
        (ERROR, 3, "invalid-argument")
    );
    let g = w.generation();
    raw.0.write_all(&get_frame(4, g, "k", 1000)).await.unwrap();
    let (kind, id, body) = raw.answer().await.unwrap();
    assert_eq!((kind, id), (REPLY, 4));
    assert_eq!(
        pb::GetResponse::decode(&body[..]).unwrap().value,
        Bytes::from("v")
    );

    // The healthy connection and its wait were untouched.
    assert_eq!(w.try_get("k").await.unwrap(), Some(Bytes::from("v")));
    member(addr, "w", None).await.set("after", "1").await.unwrap();
    assert_eq!(waiter.await.unwrap().unwrap(), Bytes::from("1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waits_end_with_a_cancel_a_closed_connection_or_a_frozen_client() {
    let s = server(ServerConfig::default()).await;
    s.open_world("w", WorldOptions::default()).unwrap();
    let addr = s.local_addr();
    let w = member(addr, "w", None).await;
    w.set("k", "v").await.unwrap();
    let g = w.generation();
    let get = |id: u32, key: &str| get_frame(id, g, key, 60_000);
    let limit = Duration::from_secs(5);

    // A cancel.
    let mut raw = Raw::open(addr).await;
    raw.0.write_all(&get(7, "never")).await.unwrap();
    eventually(limit, "the wait registered", || s.stats().waiters == 1).await;
    // A second wait under a live id is refused, the first one kept.
    raw.0.write_all(&get(7, "never")).await.unwrap();
    let (kind, id, body) = raw.answer().await.unwrap();
    assert_eq!(
        (kind, id, error_kind(&body).as_str()),
        (ERROR, 7, "invalid-argument")
    );
    assert_eq!(s.stats().waiters, 1);
    raw.0.write_all(&header(CANCEL, 7, 0)).await.unwrap();
    eventually(limit, "the cancel released the wait", || s.stats().waiters == 0).await;
    // The connection goes on, and the cancelled wait never answers.
    raw.0.write_all(&get(8, "k")).await.unwrap();
    let (kind, id, _) = raw.answer().await.unwrap();
    assert_eq!((kind, id), (REPLY, 8));

    // A connection that closes.
    raw.0.write_all(&get(9, "never")).await.unwrap();
    eventually(limit, "the wait registered", || s.stats().waiters == 1).await;
    drop(raw);
    eventually(limit, "the close released the wait", || s.stats().waiters == 0).await;

    // A client that froze: it never reads again, so never answers a ping.
    let f = server(ServerConfig {
        keepalive_interval: Duration::from_millis(200),
        keepalive_timeout: Duration::from_millis(400),
        ..ServerConfig::default()
    })
    .await;
    f.open_world("w", WorldOptions::default()).unwrap();
    let g = member(f.local_addr(), "w", None).await.generation();
    let mut raw = Raw::open(f.local_addr()).await;
    raw.0.write_all(&get_frame(1, g, "never", 60_000)).await.unwrap();
    eventually(limit, "the wait registered", || f.stats().waiters == 1).await;
    let frozen_at = Instant::now();
    eventually(limit, "keepalive released the frozen client's wait", || {
        f.stats().waiters == 0
    })
    .await;
    // Pings every 200 ms, each given 400 ms.
    assert!(
        frozen_at.elapsed() < Duration::from_secs(3),
        "{:?}",
        frozen_at.elapsed()
    );
    assert!(raw.closed_within(limit).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_in_flight_on_one_connection_are_capped() {
    let s = server(ServerConfig {
        max_streams_per_connection: 4,
        ..ServerConfig::default()
    })
    .await;
    s.open_world("w", WorldOptions::default()).unwrap();
    let addr = s.local_addr();
    let w = member(addr, "w", None).await;
    let waits: Vec<_> = (0..4)
        .map(|i| {
            let w = w.clone();
            tokio::spawn(async move { w.get(format!("k{i}"), Duration::from_secs(30)).await })
        })
        .collect();
    eventually(Duration::from_secs(5), "four waits", || s.stats().waiters == 4).await;
    let err = w.get("k9", Duration::from_secs(30)).await.unwrap_err();
    assert!(
        matches!(
            err,
            StoreError::LimitExceeded {
                limit: Limit::ConnectionRequests,
                max: 4,
                ..
            }
        ),
        "{err}"
    );
    // Calls that do not wait still go through (they run one at a time on
    // the connection's reader), and the waits end normally.
    for i in 0..4 {
        w.set(format!("k{i}"), "v").await.unwrap();
    }
    for t in waits {
        assert_eq!(t.await.unwrap().unwrap(), Bytes::from("v"));
    }
    // The same cap, seen on the raw wire.
    let mut raw = Raw::open(addr).await;
    let g = w.generation();
    for id in 0..5 {
        raw.0.write_all(&get_frame(id, g, "never", 30_000)).await.unwrap();
    }
    let (kind, id, body) = raw.answer().await.unwrap();
    assert_eq!((kind, id), (ERROR, 4));
    assert!(
        error_detail(&body).starts_with("connection-requests 4 "),
        "{}",
        error_detail(&body)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_never_sends_a_request_is_closed() {
    let s = server(ServerConfig {
        first_request_timeout: Duration::from_millis(300),
        ..ServerConfig::default()
    })
    .await;
    let addr = s.local_addr();
    // The preface alone, and the preface sent one byte per 100 ms.
    let mut idle = Raw::open(addr).await;
    let slow = tokio::spawn(async move {
        let mut sock = TcpStream::connect(addr).await.unwrap();
        let opened = Instant::now();
        for byte in PREFACE.iter().cycle() {
            if sock.write_all(&[*byte]).await.is_err() || opened.elapsed() > Duration::from_secs(5) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        opened.elapsed()
    });
    assert!(idle.closed_within(Duration::from_secs(3)).await);
    let lasted = slow.await.unwrap();
    assert!(
        lasted < Duration::from_secs(3),
        "a slowloris connection lasted {lasted:?}"
    );
}

/// A server of `places` connections with the secret world "w" open.
async fn capped_with_a_secure_world(places: usize) -> StoreServer {
    let s = server(ServerConfig {
        max_connections: places,
        ..ServerConfig::default()
    })
    .await;
    s.open_world("w", secure()).unwrap();
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strangers_holding_stalled_pings_on_every_place_do_not_lock_members_out() {
    // Every connection place taken by a stranger whose connection keeps a
    // world-less Ping (allowed before any proof) stalled in the middle of
    // its message: a member's new connection evicts one of them rather than
    // being refused, and its world works. A member's own busy connection is
    // never evicted for a stranger's.
    const PLACES: usize = 4;
    let s = capped_with_a_secure_world(PLACES).await;
    let addr = s.local_addr();
    let first = member(addr, "w", Some(SECRET)).await;
    // The member's connection is busy: a wait in flight.
    let waiting = {
        let w = first.clone();
        tokio::spawn(async move { w.get("later", Duration::from_secs(20)).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let ping = pb::PingRequest { world: None }.encode_to_vec();
    let mut strangers = Vec::new();
    for id in 0..PLACES as u32 * 2 {
        // The preface, the head and the start of the message, 100 more bytes
        // declared (a connection refused at the cap just fails its write).
        let mut sock = TcpStream::connect(addr).await.unwrap();
        let frame = request(id + 1, PING_METHOD, b"", b"", &ping, Some(5 + ping.len() + 100));
        let _ = sock.write_all(&[&PREFACE[..], &frame].concat()).await;
        strangers.push(sock);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A member arrives while every place is a stranger's or the first
    // member's: it gets in, and both members' calls work.
    // (Refused, its client would retry until a stranger's stalled message
    // timed out, request_body_timeout = 10 s later.)
    let second = tokio::time::timeout(Duration::from_secs(5), member(addr, "w", Some(SECRET)))
        .await
        .expect("the member was kept out");
    assert!(set_get(&second).await < Duration::from_secs(10));
    second.set("later", "v").await.unwrap();
    let got = waiting.await.unwrap().unwrap();
    assert_eq!(&got[..], b"v", "the first member's busy connection was evicted");
    assert!(s.stats().evicted_connections > 0, "{:?}", s.stats());
}

/// One fuzzed request frame: a method (known or not), a world (open, secret,
/// missing or arbitrary bytes), a proof (right, wrong, none or arbitrary)
/// and a message (valid for the method and maybe mutated, or arbitrary).
fn fuzz_case(g_pub: u64, g_sec: u64) -> impl Strategy<Value = Vec<u8>> {
    (
        0u8..18,
        prop_oneof![
            3 => proptest::sample::select(vec![&b"pub"[..], &b"sec"[..], &b"nope"[..], &b""[..]]).prop_map(<[u8]>::to_vec),
            1 => "[ -~]{0,300}".prop_map(String::into_bytes),
        ],
        0u8..4,
        proptest::collection::vec(any::<u8>(), 0..64),
        any::<u64>(),
        proptest::collection::vec((any::<usize>(), any::<u8>()), 0..3),
        any::<bool>(),
    )
        .prop_map(move |(method, world, auth, raw, n, edits, valid)| {
            let name = String::from_utf8_lossy(&world).into_owned();
            let generation = match name.as_str() {
                "pub" if n % 4 != 0 => g_pub,
                "sec" if n % 4 != 0 => g_sec,
                _ => n % 3,
            };
            let world_ref = Some(pb::WorldRef {
                name: name.clone(),
                generation,
            });
            let key = Bytes::copy_from_slice(&raw[..raw.len().min(8)]);
            let mut message = if valid {
                match method {
                    4 => get_message(&name, generation, "k", n % 200),
                    3 => pb::SetRequest {
                        world: world_ref,
                        key,
                        value: Bytes::from(raw.clone()),
                    }
                    .encode_to_vec(),
                    1 => pb::OpenRequest {
                        name: name.clone(),
                        create: n % 2 == 0,
                    }
                    .encode_to_vec(),
                    6 => pb::AddRequest {
                        world: world_ref,
                        key,
                        delta: n as i64,
                    }
                    .encode_to_vec(),
                    11 => pb::MultiGetRequest {
                        world: world_ref,
                        keys: vec![key; (n % 4) as usize],
                        timeout_ms: n % 100,
                    }
                    .encode_to_vec(),
                    2 if n % 16 == 0 => pb::CloseRequest { world: world_ref }.encode_to_vec(),
                    _ => pb::PingRequest { world: world_ref }.encode_to_vec(),
                }
            } else {
                raw
            };
            for (at, v) in edits {
                if !message.is_empty() {
                    let i = at % message.len();
                    message[i] = v;
                }
            }
            let proof = match auth {
                0 => Vec::new(),
                1 => Secret::new(SECRET).proof(&name).into_bytes(),
                2 => Secret::new("wrong").proof(&name).into_bytes(),
                _ => b"v1.zz.zz".to_vec(),
            };
            request(n as u32, method, &world, &proof, &message, None)
        })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn arbitrary_framed_requests_at_a_live_server() {
    let n = std::env::var("MULTIWORLD_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse::<u32>().ok())
        .map_or(300, |n| (n / 100).max(1));
    let limits = Limits {
        default_timeout: Duration::from_millis(50),
        max_timeout: Duration::from_millis(100),
        ..Limits::default()
    };
    let s = server(ServerConfig {
        raise_fd_limit: false,
        ..ServerConfig::default()
    })
    .await;
    let addr = s.local_addr();
    let open = |name: &str, secret: Option<Secret>| {
        s.open_world(
            name,
            WorldOptions {
                secret,
                limits: Some(limits.clone()),
            },
        )
        .unwrap()
    };
    let g_pub = open("pub", None);
    let g_sec = open("sec", Some(Secret::new(SECRET)));
    let mut runner = TestRunner::new(ProptestConfig {
        cases: n,
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    let strategy = fuzz_case(g_pub, g_sec);
    let mut raw = Raw::open(addr).await;
    let (mut replies, mut errors, mut reconnects, mut pings) = (0, 0, 0, 0);
    for i in 0..n {
        if i % 10 == 9 {
            // A valid request among the hostile ones is answered. (Fuzzed
            // requests that are valid are too rare to count on: 1 to 7 of
            // 300 get a reply.)
            let ping = request(
                u32::MAX - i,
                PING_METHOD,
                b"",
                b"",
                &pb::PingRequest { world: None }.encode_to_vec(),
                None,
            );
            let mut got = None;
            for _ in 0..2 {
                let answered = async {
                    raw.0.write_all(&ping).await.ok()?;
                    raw.answer().await
                };
                got = tokio::time::timeout(Duration::from_secs(10), answered)
                    .await
                    .expect("answered or closed within 10 s");
                if got.is_some() {
                    break;
                }
                // The last fuzzed frame made the server close the connection.
                raw = Raw::open(addr).await;
            }
            let (kind, id, _) = got.expect("a ping on a fresh connection is answered");
            assert_eq!(
                (kind, id),
                (REPLY, u32::MAX - i),
                "a valid ping after {i} fuzzed requests"
            );
            pings += 1;
        }
        let frame = strategy.new_tree(&mut runner).unwrap().current();
        let id = u32::from_be_bytes([frame[5], frame[6], frame[7], frame[8]]);
        let answered = async {
            raw.0.write_all(&frame).await.ok()?;
            raw.answer().await
        };
        match tokio::time::timeout(Duration::from_secs(10), answered)
            .await
            .expect("answered or closed within 10 s")
        {
            Some((kind, got, _)) => {
                assert_eq!(got, id);
                if kind == REPLY {
                    replies += 1;
                } else {
                    errors += 1;
                }
            }
            None => {
                reconnects += 1;
                raw = Raw::open(addr).await;
            }
        }
    }
    println!(
        "{n} framed requests: {replies} replies, {errors} errors, {reconnects} reconnects; {pings} valid pings among them answered"
    );
    assert!(
        reconnects <= n / 4,
        "the server dropped {reconnects} of {n} connections"
    );
    if n >= 50 {
        assert!(errors > 0, "{replies} replies, {errors} errors");
    }
    drop(raw);
    eventually(Duration::from_secs(10), "nothing held", || {
        let st = s.stats();
        st.buffered_request_bytes == 0 && st.waiters == 0
    })
    .await;
    if !s.worlds().contains(&"sec".to_owned()) {
        open("sec", Some(Secret::new(SECRET)));
    }
    let w = member(addr, "sec", Some(SECRET)).await;
    set_get(&w).await;
}

/// Reads one frame and returns its id bytes.
async fn next_request_id(sock: &mut TcpStream) -> Option<[u8; 4]> {
    let mut h = [0u8; 9];
    sock.read_exact(&mut h).await.ok()?;
    let mut body = vec![0u8; u32::from_be_bytes([h[0], h[1], h[2], h[3]]) as usize];
    sock.read_exact(&mut body).await.ok()?;
    Some([h[5], h[6], h[7], h[8]])
}

/// A fake server: it reads the preface and answers the first request (the
/// client's ping on connecting) properly, then answers the next request with
/// `answer` (its id patched in) and keeps the connection open.
async fn fake_server(answer: Vec<u8>) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            let mut answer = answer.clone();
            tokio::spawn(async move {
                let mut preface = [0u8; 8];
                sock.read_exact(&mut preface).await.ok()?;
                let id = next_request_id(&mut sock).await?;
                let reply = pb::PingResponse { server_time_us: 1 }.encode_to_vec();
                let mut f = header(REPLY, u32::from_be_bytes(id), reply.len());
                f.extend_from_slice(&reply);
                sock.write_all(&f).await.ok()?;
                let id = next_request_id(&mut sock).await?;
                answer[5..9].copy_from_slice(&id);
                sock.write_all(&answer).await.ok()?;
                tokio::time::sleep(Duration::from_secs(30)).await;
                Some(())
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_server_cannot_make_the_client_allocate_or_hang() {
    let config = ClientConfig {
        op_timeout: Duration::from_secs(20),
        ..ClientConfig::default()
    };
    let mut huge = header(REPLY, 0, u32::MAX as usize);
    huge.extend_from_slice(&[0u8; 64]);
    let mut bad_error = header(ERROR, 0, 3);
    bad_error.extend_from_slice(&[14, 200, 1]);
    let mut undecodable = header(REPLY, 0, 3);
    undecodable.extend_from_slice(&[0xff, 0xff, 0xff]);
    type Expected = fn(&StoreError) -> bool;
    let answers: Vec<(&str, Vec<u8>, Expected)> = vec![
        (
            "a 4 GiB reply",
            huge,
            |e| matches!(e, StoreError::LimitExceeded { limit: Limit::MessageBytes, requested, .. } if *requested == u64::from(u32::MAX)),
        ),
        ("a request frame", header(REQUEST, 0, 0), |e| {
            matches!(e, StoreError::Unavailable { .. })
        }),
        ("an unknown kind", header(42, 0, 0), |e| {
            matches!(e, StoreError::Unavailable { .. })
        }),
        ("a truncated error frame", bad_error, |e| {
            matches!(e, StoreError::Unavailable { .. })
        }),
        ("a reply that does not decode", undecodable, |e| {
            matches!(e, StoreError::Protocol(_))
        }),
    ];
    for (what, answer, expected) in answers {
        let addr = fake_server(answer).await;
        let client = StoreClient::connect(&addr.to_string(), config.clone())
            .await
            .unwrap();
        let started = Instant::now();
        let err = client.ping().await.unwrap_err();
        assert!(expected(&err), "{what}: {err:?}");
        // At once, not at the 20 s deadline of the call.
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{what}: {:?}",
            started.elapsed()
        );
    }
}

/// A server of an earlier version speaks only HTTP/2: a proxy that answers a
/// framed preface as an HTTP/2 server does (h2's handshake, which sends its
/// SETTINGS and then fails on the preface) and passes HTTP/2 connections to
/// a real server.
async fn http2_only_proxy(to: SocketAddr) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut inbound, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut first = [0u8; 1];
                if inbound.peek(&mut first).await.unwrap_or(0) == 0 {
                    return;
                }
                if first[0] == b'M' {
                    let _ = h2::server::handshake(inbound).await;
                    return;
                }
                let mut outbound = TcpStream::connect(to).await.unwrap();
                let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_speaks_grpc_to_a_server_that_answers_only_http2() {
    let s = server(ServerConfig::default()).await;
    s.open_world("w", WorldOptions::default()).unwrap();
    let proxy = http2_only_proxy(s.local_addr()).await;
    let started = Instant::now();
    let client = StoreClient::connect(&proxy.to_string(), ClientConfig::default())
        .await
        .unwrap();
    // Recognised at the first answer, not after the connect deadline.
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(client.protocol(), multiworld_store::WireProtocol::Grpc);
    let w = client.open("w", OpenOptions::default()).await.unwrap();
    set_get(&w).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_a_client_never_reads_are_bounded_and_its_connection_closed() {
    let (s, w) = a_big_value(8).await;
    let (addr, g) = (s.local_addr(), w.generation());
    // A client that asks for the 3 MiB value 200 times and never reads:
    // only the cap on waits until their answers are written stops the
    // server from reading (and holding an answer for) every request. The
    // requests come a few milliseconds apart, so each wait has its answer
    // ready before the next request arrives: a cap that stopped counting a
    // wait once its answer was made (not written) would admit all 200 and
    // hold 600 MiB of answers.
    let before = rss_mib();
    let sampling = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let sampler = {
        let sampling = sampling.clone();
        tokio::spawn(async move {
            let mut peak = rss_mib();
            while sampling.load(std::sync::atomic::Ordering::Relaxed) {
                peak = peak.max(rss_mib());
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            peak
        })
    };
    let mut raw = Raw::open(addr).await;
    let flood = tokio::spawn(async move {
        let requests = async {
            for id in 0..200 {
                raw.0.write_all(&get_frame(id, g, "big", 10_000)).await?;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            std::io::Result::Ok(())
        };
        // Once the server stops reading, the writes block: given up here.
        let _ = tokio::time::timeout(Duration::from_secs(15), requests).await;
        raw
    });
    eventually(Duration::from_secs(5), "the flood's connection", || {
        s.stats().connections == 2
    })
    .await;
    eventually(Duration::from_secs(10), "the flood's connection closed", || {
        s.stats().connections == 1
    })
    .await;
    sampling.store(false, std::sync::atomic::Ordering::Relaxed);
    assert_eq!(s.stats().waiters, 0);
    set_get(&w).await;
    flood.abort();
    let peak = sampler.await.unwrap();
    // Eight answers of 3 MiB at most (waits count against the cap until
    // their answers are written), and socket buffers: well under the bound.
    assert!(
        peak - before < 300.0,
        "RSS grew {:.0} MiB during the flood",
        peak - before
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_large_answers_is_closed_and_forgotten() {
    let (s, w) = a_big_value(ServerConfig::default().max_streams_per_connection).await;
    let (addr, g) = (s.local_addr(), w.generation());
    // Twenty waiting requests for 3 MiB each, never read: the answers fill
    // the socket's buffers and their writes block.
    let mut raw = Raw::open(addr).await;
    for id in 0..20 {
        raw.0.write_all(&get_frame(id, g, "big", 10_000)).await.unwrap();
    }
    eventually(Duration::from_secs(5), "two connections", || {
        s.stats().connections == 2
    })
    .await;
    // Keepalive closes it, the blocked answers are given up, and the
    // connection's task ends (it waits for every answer's task).
    eventually(Duration::from_secs(8), "the stuck connection freed", || {
        s.stats().connections == 1
    })
    .await;
    assert_eq!(s.stats().waiters, 0);
    set_get(&w).await;
    drop(raw);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_closing_an_idle_connection_says_how_many_requests_it_read() {
    let s = server(ServerConfig {
        idle_timeout: Duration::from_millis(300),
        ..ServerConfig::default()
    })
    .await;
    s.open_world("w", WorldOptions::default()).unwrap();
    let w = member(s.local_addr(), "w", None).await;
    w.set("k", "v").await.unwrap();
    let g = w.generation();
    let mut raw = Raw::open(s.local_addr()).await;
    raw.0.write_all(&get_frame(7, g, "k", 1000)).await.unwrap();
    raw.0.write_all(&get_frame(8, g, "k", 1000)).await.unwrap();
    // Gets may answer in either order.
    let mut ids = Vec::new();
    for _ in 0..2 {
        let (kind, id, _) = raw.answer().await.unwrap();
        assert_eq!(kind, REPLY);
        ids.push(id);
    }
    ids.sort_unstable();
    assert_eq!(ids, [7, 8]);
    // Idle from here: the server says it read two requests, then closes.
    let started = Instant::now();
    assert!(raw.answer().await.is_none(), "only the GoAway and the end come");
    assert_eq!(raw.1, Some(2));
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_server_answers_the_requests_it_read_and_says_how_many() {
    let s = server(ServerConfig::default()).await;
    s.open_world("w", WorldOptions::default()).unwrap();
    let w = member(s.local_addr(), "w", None).await;
    w.set("k", "v").await.unwrap();
    let g = w.generation();
    let mut raw = Raw::open(s.local_addr()).await;
    // A wait that stays in flight, then a request answered at once.
    raw.0
        .write_all(&get_frame(1, g, "missing", 30_000))
        .await
        .unwrap();
    raw.0.write_all(&get_frame(2, g, "k", 1000)).await.unwrap();
    let (kind, id, _) = raw.answer().await.unwrap();
    assert_eq!((kind, id), (REPLY, 2));
    let stopping = tokio::spawn(async move { s.shutdown(Duration::from_secs(5)).await });
    // The wait ends with its closed world, answered before the end.
    let (kind, id, body) = raw.answer().await.unwrap();
    assert_eq!((kind, id), (ERROR, 1));
    assert_eq!(error_kind(&body), "closed");
    assert!(raw.answer().await.is_none());
    assert_eq!(raw.1, Some(2), "the server read both requests");
    stopping.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_stopping_amid_pipelined_requests_answers_exactly_those_it_counts() {
    let s = server(ServerConfig::default()).await;
    s.open_world("w", WorldOptions::default()).unwrap();
    let w = member(s.local_addr(), "w", None).await;
    let g = w.generation();
    let raw = Raw::open(s.local_addr()).await;
    // Thousands of small sets in one write, and the server's stop right
    // behind them: it stops reading at a frame boundary somewhere.
    let frames: Vec<u8> = (1..=20_000u32)
        .flat_map(|id| {
            let msg = pb::SetRequest {
                world: Some(pb::WorldRef {
                    name: "w".into(),
                    generation: g,
                }),
                key: Bytes::from(format!("k{id}")),
                value: Bytes::from_static(b"v"),
            }
            .encode_to_vec();
            request(id, SET, b"w", b"", &msg, None)
        })
        .collect();
    let (mut rd, mut wr) = raw.0.into_split();
    let writer = tokio::spawn(async move {
        // Refused or reset once the server has gone: that is fine here.
        let _ = wr.write_all(&frames).await;
        wr
    });
    tokio::time::sleep(Duration::from_millis(5)).await;
    let stopping = tokio::spawn(async move { s.shutdown(Duration::from_secs(5)).await });
    // Every answer (a reply, or `closed` once the world is), in order, then
    // the GoAway's count, then the end: exactly the first `count` requests.
    let mut answered = Vec::new();
    let mut went_away = None;
    let mut h = [0u8; 9];
    while rd.read_exact(&mut h).await.is_ok() {
        let len = u32::from_be_bytes([h[0], h[1], h[2], h[3]]) as usize;
        let id = u32::from_be_bytes([h[5], h[6], h[7], h[8]]);
        let mut body = vec![0u8; len];
        rd.read_exact(&mut body)
            .await
            .expect("reset in the middle of a frame (a close with input unread resets)");
        match h[4] {
            REPLY | ERROR => {
                assert!(went_away.is_none(), "an answer after the GoAway");
                answered.push(id);
            }
            GO_AWAY => went_away = Some(id),
            PING => {}
            k => panic!("a frame of kind {k}"),
        }
    }
    let count = went_away.expect("no GoAway before the end");
    assert_eq!(answered.len(), count as usize, "answers vs the GoAway's count");
    assert!(
        answered.iter().copied().eq(1..=count),
        "not the first {count} requests in order"
    );
    println!("the server read {count} of 20000 pipelined requests before it went away");
    stopping.await.unwrap();
    drop(writer.await.unwrap());
}

/// How a fake server goes away after the client's second request (its
/// first is the ping on connecting).
#[derive(Clone, Copy, PartialEq, Debug)]
enum Leaving {
    /// Says it read one request (not the second), closes; later
    /// connections answer.
    Unread,
    /// Says it read both, answers the second, closes.
    ReadAndAnswered,
    /// Says it read both, closes without answering.
    ReadNotAnswered,
    /// Every connection says it read none of its requests after the ping.
    NeverReads,
}

/// A fake server that goes away as `how` says; counts its connections.
async fn leaving_server(how: Leaving) -> (SocketAddr, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use std::sync::atomic::Ordering;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let conns = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = conns.clone();
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            let nth = counted.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let reply = |id: [u8; 4]| {
                    let body = pb::PingResponse { server_time_us: 1 }.encode_to_vec();
                    let mut f = header(REPLY, u32::from_be_bytes(id), body.len());
                    f.extend_from_slice(&body);
                    f
                };
                let mut preface = [0u8; 8];
                sock.read_exact(&mut preface).await.ok()?;
                if nth == 0 {
                    let id = next_request_id(&mut sock).await?;
                    sock.write_all(&reply(id)).await.ok()?;
                }
                let id = next_request_id(&mut sock).await?;
                let read_before = u32::from(nth == 0);
                match how {
                    Leaving::NeverReads => {
                        sock.write_all(&header(GO_AWAY, read_before, 0)).await.ok()?;
                    }
                    Leaving::Unread if nth == 0 => {
                        sock.write_all(&header(GO_AWAY, read_before, 0)).await.ok()?;
                    }
                    Leaving::Unread => {
                        sock.write_all(&reply(id)).await.ok()?;
                        tokio::time::sleep(Duration::from_secs(30)).await;
                    }
                    Leaving::ReadAndAnswered => {
                        sock.write_all(&header(GO_AWAY, read_before + 1, 0)).await.ok()?;
                        sock.write_all(&reply(id)).await.ok()?;
                    }
                    Leaving::ReadNotAnswered => {
                        sock.write_all(&header(GO_AWAY, read_before + 1, 0)).await.ok()?;
                    }
                }
                // Then the connection closes.
                Some(())
            });
        }
    });
    (addr, conns)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_the_server_went_away_without_reading_is_sent_again() {
    use std::sync::atomic::Ordering;
    let config = ClientConfig {
        op_timeout: Duration::from_secs(10),
        ..ClientConfig::default()
    };
    for how in [
        Leaving::Unread,
        Leaving::ReadAndAnswered,
        Leaving::ReadNotAnswered,
        Leaving::NeverReads,
    ] {
        let (addr, conns) = leaving_server(how).await;
        let client = StoreClient::connect(&addr.to_string(), config.clone())
            .await
            .unwrap();
        let started = Instant::now();
        let r = client.ping().await;
        let took = started.elapsed();
        let dialed = conns.load(Ordering::SeqCst);
        match how {
            // Never read: sent again on a new connection, answered there.
            Leaving::Unread => assert!(r.is_ok() && dialed == 2, "{how:?}: {r:?}, {dialed} connections"),
            // Read: answered on its own connection, nothing sent again.
            Leaving::ReadAndAnswered => {
                assert!(r.is_ok() && dialed == 1, "{how:?}: {r:?}, {dialed} connections");
            }
            // Read but never answered: it may have run, so it is not sent
            // again; the call fails as on any lost connection.
            Leaving::ReadNotAnswered => assert!(
                matches!(r, Err(StoreError::Unavailable { .. })) && dialed == 1,
                "{how:?}: {r:?}, {dialed} connections"
            ),
            // Sent again a bounded number of times, then a clear error.
            Leaving::NeverReads => assert!(
                matches!(&r, Err(StoreError::Unavailable { .. }))
                    && format!("{r:?}").contains("without reading")
                    && dialed == 4,
                "{how:?}: {r:?}, {dialed} connections"
            ),
        }
        assert!(took < Duration::from_secs(5), "{how:?} took {took:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strangers_stalled_in_a_request_head_do_not_lock_members_out() {
    // Every place taken by a stranger that sent a request's first bytes (a
    // frame header declaring 100 bytes, and one byte of its head) and
    // nothing more: until its head is read, a request is a stranger's, so
    // its connection can make room for a member's.
    const PLACES: usize = 4;
    let s = capped_with_a_secure_world(PLACES).await;
    let addr = s.local_addr();
    let mut strangers = Vec::new();
    for id in 0..PLACES as u32 * 2 {
        let mut sock = TcpStream::connect(addr).await.unwrap();
        let start = [&PREFACE[..], &header(REQUEST, id + 1, 100), &[PING_METHOD]].concat();
        let _ = sock.write_all(&start).await;
        strangers.push(sock);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let m = tokio::time::timeout(Duration::from_secs(5), member(addr, "w", Some(SECRET)))
        .await
        .expect("the member was kept out by strangers stalled in a head");
    assert!(set_get(&m).await < Duration::from_secs(10));
    assert!(s.stats().evicted_connections > 0, "{:?}", s.stats());
}
