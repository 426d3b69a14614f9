//! Hostile clients of the store over loopback (127.0.0.1, port 0): each
//! test provokes one attack for real, with raw HTTP/2 or TCP clients or
//! tonic clients with a wrong secret, asserts the bound that stops it, and
//! asserts that a legitimate client keeps working during the attack within
//! 10× its quiet latency (with a 25 ms floor, so scheduling noise on a busy
//! 2-core machine does not flake). Limits are scaled down through the
//! configuration so every test takes a few seconds and little memory.
//!
//! `measure_attacks` (ignored; run with `--ignored --nocapture`) prints the
//! figures of docs/failure-model.md.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use bytes::Bytes;
use h2::client::{ResponseFuture, SendRequest};
use multiworld_store::{
    ClientConfig, Limit, Limits, OpenOptions, Secret, ServerConfig, StoreClient, StoreError, StoreProof,
    StoreServer, WorldOptions, WorldStore,
};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};

const SECRET: &str = "right";

async fn server(config: ServerConfig) -> StoreServer {
    StoreServer::bind("127.0.0.1:0".parse().unwrap(), config)
        .await
        .unwrap()
}

fn secure() -> WorldOptions {
    WorldOptions {
        secret: Some(Secret::new(SECRET)),
        limits: None,
    }
}

async fn member(addr: SocketAddr, name: &str, secret: Option<&str>) -> WorldStore {
    let config = ClientConfig {
        connect_timeout: Duration::from_secs(10),
        ..ClientConfig::default()
    };
    StoreClient::connect(&addr.to_string(), config)
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

/// One legitimate set + get.
async fn set_get(w: &WorldStore) -> Duration {
    let started = Instant::now();
    w.set("latency", "x").await.unwrap();
    w.get("latency", Duration::from_secs(5)).await.unwrap();
    started.elapsed()
}

/// Median of `n` set + get round trips.
async fn latency(w: &WorldStore, n: usize) -> Duration {
    let mut times = Vec::with_capacity(n);
    for _ in 0..n {
        times.push(set_get(w).await);
    }
    times.sort();
    times[n / 2]
}

/// A legitimate round trip during an attack stays within 10x its quiet time,
/// with a floor of 500 ms: far below what starving it would cost (the attacks
/// hold budget for a second or more), far above the scheduling noise of a busy
/// 2-core machine (25 ms flaked there while builds ran).
fn assert_within_10x(quiet: Duration, during: Duration, what: &str) {
    let bound = (quiet * 10).max(Duration::from_millis(500));
    assert!(
        during <= bound,
        "{what}: {during:?} during the attack, {quiet:?} quiet"
    );
}

/// A raw HTTP/2 connection (no tonic), driven in the background.
async fn h2_connection(addr: SocketAddr) -> SendRequest<Bytes> {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (send, conn) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(async move {
        let _ = conn.await;
    });
    send
}

/// A gRPC request header for `method`, naming `world` with `proof`.
fn grpc_request(
    addr: SocketAddr,
    method: &str,
    world: Option<&str>,
    proof: Option<&str>,
) -> http::Request<()> {
    let mut b = http::Request::builder()
        .method("POST")
        .uri(format!("http://{addr}/multiworld.store.v1.Store/{method}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    if let Some(w) = world {
        b = b.header("mw-world", hex::encode(w));
    }
    if let Some(p) = proof {
        b = b.header("mw-auth", p);
    }
    b.body(()).unwrap()
}

/// Starts a request declaring a `declared`-byte message and sends only
/// `sent` bytes of it; the stream stays open as long as its handle lives.
async fn partial_request(
    conn: &SendRequest<Bytes>,
    req: http::Request<()>,
    declared: usize,
    sent: usize,
) -> (ResponseFuture, h2::SendStream<Bytes>) {
    let mut send = conn.clone().ready().await.unwrap();
    let (response, mut stream) = send.send_request(req, false).unwrap();
    let mut body = vec![0u8; 5 + sent];
    body[1..5].copy_from_slice(&(declared as u32).to_be_bytes());
    // A request refused from its headers may be reset before its data goes.
    let _ = stream.send_data(Bytes::from(body), false);
    (response, stream)
}

/// The grpc-status of a response (trailers-only or in the trailers).
async fn grpc_status(response: ResponseFuture) -> Option<u32> {
    let response = tokio::time::timeout(Duration::from_secs(10), response)
        .await
        .ok()?
        .ok()?;
    let code = |h: &http::HeaderMap| h.get("grpc-status").and_then(|v| v.to_str().ok()?.parse().ok());
    if let Some(c) = code(response.headers()) {
        return Some(c);
    }
    let mut body = response.into_body();
    while let Some(chunk) = body.data().await {
        let Ok(chunk) = chunk else { return None };
        let _ = body.flow_control().release_capacity(chunk.len());
    }
    body.trailers().await.ok()?.as_ref().and_then(code)
}

const UNAUTHENTICATED: u32 = 16;
const RESOURCE_EXHAUSTED: u32 = 8;
const DEADLINE_EXCEEDED: u32 = 4;

/// World-less Pings (allowed before any proof) stalled in the middle of
/// their message cannot take the request-memory budget that members'
/// requests need: such a Ping carries next to nothing, so a larger one is
/// refused before anything is reserved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_worldless_pings_cannot_take_the_request_memory() {
    let s = server(ServerConfig {
        // One connection's worth of 4 KiB pre-authentication requests.
        max_buffered_request_bytes: 16 * (2 * 4096 + 5),
        ..ServerConfig::default()
    })
    .await;
    s.open_world("w", secure()).unwrap();
    let addr = s.local_addr();
    let first = member(addr, "w", Some(SECRET)).await;
    let conn = h2_connection(addr).await;
    let mut held = Vec::new();
    for _ in 0..16 {
        held.push(partial_request(&conn, grpc_request(addr, "Ping", None, None), 4096, 0).await);
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let took = tokio::time::timeout(Duration::from_secs(5), async {
        let t = set_get(&first).await;
        let second = member(addr, "w", Some(SECRET)).await;
        t + set_get(&second).await
    })
    .await
    .expect("members were starved of request memory");
    assert!(took < Duration::from_secs(1), "{took:?}");
    drop(held);
}

// Item 1: a stranger holding incomplete maximum-size requests.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stranger_cannot_make_the_store_buffer_request_bodies() {
    let s = server(ServerConfig::default()).await;
    s.open_world("w", secure()).unwrap();
    let addr = s.local_addr();
    let w = member(addr, "w", Some(SECRET)).await;
    let quiet = latency(&w, 20).await;

    // Two connections, 200 streams each (the measured attack used ~1,088),
    // each declaring a maximum-size Set and sending all but the last byte of
    // its first 32 KiB, with a wrong proof.
    let max = ServerConfig::default().max_message_bytes;
    let wrong = Secret::new("wrong").proof("w");
    let mut held = Vec::new();
    for _ in 0..2 {
        let conn = h2_connection(addr).await;
        for _ in 0..200 {
            let req = grpc_request(addr, "Set", Some("w"), Some(&wrong));
            held.push(partial_request(&conn, req, max, 32 * 1024 - 1).await);
        }
    }
    let during = latency(&w, 20).await;
    let stats = s.stats();
    assert_eq!(
        stats.buffered_request_bytes, 0,
        "a stranger's body was buffered: {stats:?}"
    );
    assert_within_10x(quiet, during, "set+get");
    // Every one of them was refused from its headers.
    let mut refused = 0;
    for (response, _stream) in held {
        assert_eq!(grpc_status(response).await, Some(UNAUTHENTICATED));
        refused += 1;
    }
    assert_eq!(refused, 400);
    assert!(s.stats().refused_requests >= 400);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admitted_client_is_bounded_by_the_memory_budget_and_the_body_timeout() {
    // A public world: anyone is admitted, so the budget is what binds.
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
    let quiet = latency(&w, 20).await;

    // Ten streams on each of four connections, each declaring a 1 MiB Set
    // (a reservation of 2 MiB) and sending 16 KiB of it.
    let mut held = Vec::new();
    for _ in 0..4 {
        let conn = h2_connection(addr).await;
        for _ in 0..10 {
            let req = grpc_request(addr, "Set", Some("w"), None);
            held.push(partial_request(&conn, req, 1 << 20, 16 * 1024).await);
        }
    }
    let started = Instant::now();
    let mut peak = 0;
    let mut during = Duration::ZERO;
    while started.elapsed() < Duration::from_millis(400) {
        peak = peak.max(s.stats().buffered_request_bytes);
        during = during.max(set_get(&w).await);
    }
    assert!(
        peak > 0 && peak <= budget,
        "reserved {peak} of a {budget}-byte budget"
    );
    assert_within_10x(quiet, during, "set+get");
    let mut codes = Vec::new();
    for (response, _stream) in held {
        codes.push(grpc_status(response).await);
    }
    // Those that got no budget in time are refused RESOURCE_EXHAUSTED; those
    // that did, and then never finished, time out.
    assert!(codes.contains(&Some(RESOURCE_EXHAUSTED)), "{codes:?}");
    assert!(codes.contains(&Some(DEADLINE_EXCEEDED)), "{codes:?}");
    assert!(
        codes
            .iter()
            .all(|c| [Some(RESOURCE_EXHAUSTED), Some(DEADLINE_EXCEEDED)].contains(c)),
        "{codes:?}"
    );
    assert_eq!(s.stats().buffered_request_bytes, 0, "the budget came back");
    // A typed error for the client library too: a request larger than the
    // whole budget is refused at once.
    let tight = server(ServerConfig {
        max_buffered_request_bytes: 64 << 10,
        ..ServerConfig::default()
    })
    .await;
    tight.open_world("w", WorldOptions::default()).unwrap();
    let t = member(tight.local_addr(), "w", None).await;
    let err = t.set("k", vec![0u8; 64 << 10]).await.unwrap_err();
    assert!(
        matches!(
            err,
            StoreError::LimitExceeded {
                limit: Limit::RequestMemory,
                ..
            }
        ),
        "{err}"
    );
    t.set("k", "small").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_poll_outlives_the_body_timeout_and_holds_no_budget() {
    let config = ServerConfig {
        request_body_timeout: Duration::from_millis(200),
        ..ServerConfig::default()
    };
    let s = server(config).await;
    s.open_world("w", WorldOptions::default()).unwrap();
    let w = member(s.local_addr(), "w", None).await;
    let getter = {
        let w = w.clone();
        tokio::spawn(async move { w.get("late", Duration::from_secs(10)).await })
    };
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(s.stats().buffered_request_bytes, 0);
    assert_eq!(s.stats().waiters, 1);
    w.set("late", "v").await.unwrap();
    assert_eq!(getter.await.unwrap().unwrap(), Bytes::from("v"));
}

// Item 2: a small request asking for a huge reply.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_multi_get_naming_a_big_key_a_thousand_times_is_refused_before_the_reply_is_built() {
    let s = server(ServerConfig::default()).await;
    s.open_world("w", WorldOptions::default()).unwrap();
    let w = member(s.local_addr(), "w", None).await;
    let quiet = latency(&w, 20).await;
    w.set("big", vec![1u8; 1 << 20]).await.unwrap();
    let keys = vec!["big"; 1024];
    let attacker = w.clone();
    let attack = tokio::spawn(async move {
        let mut errors = Vec::new();
        for _ in 0..20 {
            errors.push(
                attacker
                    .multi_get(&keys, Duration::from_secs(1))
                    .await
                    .unwrap_err(),
            );
        }
        errors
    });
    let during = latency(&w, 20).await;
    for err in attack.await.unwrap() {
        assert!(
            matches!(err, StoreError::LimitExceeded { limit: Limit::ReplyBytes, max, .. } if max == 8 << 20),
            "{err}"
        );
    }
    assert_within_10x(quiet, during, "set+get");
    // Within the bound it works.
    assert_eq!(
        w.multi_get(&["big"; 7], Duration::from_secs(1))
            .await
            .unwrap()
            .len(),
        7
    );
}

// Item 3: idle, slowloris and too many connections.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_and_slowloris_connections_are_closed_and_capped() {
    let config = ServerConfig {
        max_connections: 40,
        first_request_timeout: Duration::from_millis(300),
        idle_timeout: Duration::from_millis(600),
        ..ServerConfig::default()
    };
    let s = server(config).await;
    s.open_world("w", WorldOptions::default()).unwrap();
    let addr = s.local_addr();
    let w = member(addr, "w", None).await;
    let quiet = latency(&w, 20).await;

    // 100 idle connections and 20 that send the preface one byte per 100 ms.
    let started = Instant::now();
    let mut idle = Vec::new();
    for _ in 0..100 {
        idle.push(TcpStream::connect(addr).await.unwrap());
    }
    let mut slow = Vec::new();
    for _ in 0..20 {
        let mut sock = TcpStream::connect(addr).await.unwrap();
        slow.push(tokio::spawn(async move {
            let opened = Instant::now();
            for byte in b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".iter().cycle() {
                if sock.write_all(&[*byte]).await.is_err() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                if opened.elapsed() > Duration::from_secs(5) {
                    break;
                }
            }
            opened.elapsed()
        }));
    }
    assert!(s.stats().connections <= 40, "{:?}", s.stats());
    let during = latency(&w, 20).await;
    assert_within_10x(quiet, during, "set+get on a connection opened before");
    // A new client still gets in (it evicts a connection that never spoke).
    let fresh = member(addr, "w", None).await;
    set_get(&fresh).await;

    // Every attacker connection is closed by the server within a second or so.
    for mut sock in idle {
        let mut buf = [0u8; 64];
        let read = tokio::time::timeout(Duration::from_secs(3), async {
            loop {
                match sock.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
        })
        .await;
        assert!(read.is_ok(), "an idle connection was kept");
    }
    for t in slow {
        let lasted = t.await.unwrap();
        assert!(
            lasted < Duration::from_secs(3),
            "a slowloris connection lasted {lasted:?}"
        );
    }
    assert!(started.elapsed() < Duration::from_secs(5));
    let stats = s.stats();
    assert!(
        stats.evicted_connections + stats.refused_connections >= 80,
        "{stats:?}"
    );
    // The legitimate clients were idle too and may have been closed: they
    // reconnect by themselves.
    set_get(&w).await;
    set_get(&fresh).await;
}

// Item 4: waiters parked through many connections.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_are_bounded_per_world_and_per_server() {
    let limits = Limits {
        max_waiters_per_client: 100,
        max_waiters_per_world: 150,
        ..Limits::default()
    };
    let config = ServerConfig {
        limits,
        max_waiters: 250,
        ..ServerConfig::default()
    };
    let s = server(config).await;
    s.open_world("a", WorldOptions::default()).unwrap();
    s.open_world("b", WorldOptions::default()).unwrap();
    let addr = s.local_addr();
    let legit = member(addr, "b", None).await;
    let quiet = latency(&legit, 20).await;

    // Four connections try to park 100 waits each in world "a".
    let mut parked = Vec::new();
    for _ in 0..4 {
        let w = member(addr, "a", None).await;
        for _ in 0..100 {
            let w = w.clone();
            parked.push(tokio::spawn(
                async move { w.get("go", Duration::from_secs(20)).await },
            ));
        }
    }
    let started = Instant::now();
    while s.world_stats("a").unwrap().table.waiters < 150 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "waits not registered"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // World "b" may still park up to the server's bound.
    let mut other = Vec::new();
    for _ in 0..100 {
        let w = legit.clone();
        other.push(tokio::spawn(async move {
            w.get("never", Duration::from_secs(20)).await
        }));
    }
    let started = Instant::now();
    while s.stats().waiters < 250 {
        assert!(started.elapsed() < Duration::from_secs(10), "{:?}", s.stats());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let during = latency(&legit, 20).await;
    assert_within_10x(quiet, during, "set+get");
    assert_eq!(s.world_stats("a").unwrap().table.waiters, 150);
    assert_eq!(s.stats().waiters, 250);

    let opener = member(addr, "a", None).await;
    let started = Instant::now();
    opener.set("go", "1").await.unwrap();
    let (mut woken, mut per_world, mut per_server) = (0, 0, 0);
    for p in parked {
        match p.await.unwrap() {
            Ok(_) => woken += 1,
            Err(StoreError::LimitExceeded {
                limit: Limit::WaitersPerWorld,
                ..
            }) => per_world += 1,
            Err(StoreError::LimitExceeded {
                limit: Limit::Waiters,
                ..
            }) => per_server += 1,
            Err(e) => panic!("{e}"),
        }
    }
    let released = started.elapsed();
    assert_eq!(woken, 150);
    assert_eq!(per_world + per_server, 250);
    assert!(released < Duration::from_secs(5), "{released:?}");
    for o in other {
        o.abort();
    }
}

// Item 5: enumeration of world names, and the log flood.

/// A server whose remote creation needs the secret, hosting the secret
/// world "exists".
async fn guarded_server_with_a_secret_world() -> StoreServer {
    let config = ServerConfig {
        allow_remote_create: true,
        remote_create_secret: Some(Secret::new(SECRET)),
        ..ServerConfig::default()
    };
    let s = server(config).await;
    s.open_world("exists", secure()).unwrap();
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stranger_cannot_tell_a_secret_world_from_a_missing_one() {
    let s = guarded_server_with_a_secret_world().await;
    let addr = s.local_addr();
    let c = StoreClient::connect(&addr.to_string(), ClientConfig::default())
        .await
        .unwrap();
    let quick = |secret: Option<&str>| OpenOptions {
        secret: secret.map(Secret::new),
        timeout: Duration::from_millis(100),
        ..OpenOptions::default()
    };
    let answer = |e: StoreError, name: &str| format!("{}: {}", e.kind(), e.to_string().replace(name, "NAME"));
    for secret in [None, Some("wrong")] {
        let a = answer(c.open("exists", quick(secret)).await.unwrap_err(), "exists");
        let b = answer(c.open("missing", quick(secret)).await.unwrap_err(), "missing");
        assert!(a.starts_with("unauthenticated"), "{a}");
        assert_eq!(a, b, "secret {secret:?}");
    }
    // On the raw wire too, for a data-path request, byte for byte.
    let conn = h2_connection(addr).await;
    let wrong = Secret::new("wrong");
    let mut answers = Vec::new();
    for name in ["exists", "missing"] {
        let mut send = conn.clone().ready().await.unwrap();
        let req = grpc_request(addr, "Set", Some(name), Some(&wrong.proof(name)));
        let (response, _) = send.send_request(req, true).unwrap();
        let r = response.await.unwrap();
        let h = r.headers();
        answers.push((
            h.get("grpc-status").cloned(),
            h.get("mw-error").cloned(),
            h.get("grpc-message")
                .map(|v| v.to_str().unwrap().replace(name, "NAME")),
        ));
    }
    assert_eq!(answers[0], answers[1]);
    // The right secret learns that the world is missing (open retries
    // until its timeout), and can create it.
    let err = c.open("missing", quick(Some(SECRET))).await.unwrap_err();
    assert!(matches!(err, StoreError::Timeout { .. }), "{err}");
    let created = c
        .open(
            "missing",
            OpenOptions {
                create: true,
                ..quick(Some(SECRET))
            },
        )
        .await
        .unwrap();
    created.set("k", "v").await.unwrap();

    // A flood of refusals leaves the server answering legitimate clients.
    let w = member(addr, "exists", Some(SECRET)).await;
    let quiet = latency(&w, 20).await;
    let flood = tokio::spawn(async move {
        let conn = h2_connection(addr).await;
        for i in 0..2000 {
            let mut send = conn.clone().ready().await.unwrap();
            let req = grpc_request(addr, "Get", Some(&format!("guess-{i}")), None);
            let (response, _) = send.send_request(req, true).unwrap();
            let _ = response.await;
        }
    });
    let during = latency(&w, 20).await;
    flood.await.unwrap();
    assert_within_10x(quiet, during, "set+get");
    assert!(s.stats().refused_requests >= 2000);
}

// Figures for docs/failure-model.md (opt-in: `--ignored --nocapture`).

fn rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: f64 = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap();
    kb / 1024.0
}

fn fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// Samples peak RSS and fd count in the background until dropped.
struct Sampler {
    peak: std::sync::Arc<std::sync::Mutex<(f64, usize)>>,
    task: tokio::task::JoinHandle<()>,
}

impl Sampler {
    fn start() -> Sampler {
        let peak = std::sync::Arc::new(std::sync::Mutex::new((rss_mib(), fds())));
        let p = peak.clone();
        let task = tokio::spawn(async move {
            loop {
                let (r, f) = (rss_mib(), fds());
                {
                    let mut g = p.lock().unwrap();
                    g.0 = g.0.max(r);
                    g.1 = g.1.max(f);
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        });
        Sampler { peak, task }
    }

    fn peak(&self) -> (f64, usize) {
        *self.peak.lock().unwrap()
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        self.task.abort();
    }
}

struct Figures {
    name: &'static str,
    rss0: f64,
    fds0: usize,
    quiet: Duration,
    sampler: Sampler,
}

impl Figures {
    async fn start(name: &'static str, w: &WorldStore) -> Figures {
        let quiet = latency(w, 50).await;
        Figures {
            name,
            rss0: rss_mib(),
            fds0: fds(),
            quiet,
            sampler: Sampler::start(),
        }
    }

    fn report(&self, during: Duration, recovered: Duration, s: &StoreServer, extra: &str) {
        let (rss, fds) = self.sampler.peak();
        println!(
            "FIGURE {}: RSS +{:.1} MiB peak (from {:.1}), fds {} -> {} peak, set+get {:.2} ms quiet / {:.2} ms during, recovered in {:.2} s; {:?}; {extra}",
            self.name,
            rss - self.rss0,
            self.rss0,
            self.fds0,
            fds,
            self.quiet.as_secs_f64() * 1e3,
            during.as_secs_f64() * 1e3,
            recovered.as_secs_f64(),
            s.stats(),
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "measurement: run with --ignored --nocapture"]
async fn measure_attacks() {
    let s = server(ServerConfig::default()).await;
    s.open_world("w", secure()).unwrap();
    s.open_world("pub", WorldOptions::default()).unwrap();
    let addr = s.local_addr();
    let w = member(addr, "w", Some(SECRET)).await;
    let max = ServerConfig::default().max_message_bytes;

    // 1. A stranger: 2 connections × 1,000 incomplete maximum-size Sets.
    let f = Figures::start(
        "stranger body flood (2 conns x 1000 max-size Sets, wrong proof)",
        &w,
    )
    .await;
    let wrong = Secret::new("wrong").proof("w");
    let mut held = Vec::new();
    for _ in 0..2 {
        let conn = h2_connection(addr).await;
        for _ in 0..1000 {
            let req = grpc_request(addr, "Set", Some("w"), Some(&wrong));
            held.push(partial_request(&conn, req, max, 64 * 1024 - 1).await);
        }
    }
    let during = latency(&w, 50).await;
    let t = Instant::now();
    let mut refused = 0;
    for (r, _s) in held.drain(..) {
        refused += usize::from(grpc_status(r).await == Some(UNAUTHENTICATED));
    }
    f.report(
        during,
        t.elapsed(),
        &s,
        &format!("{refused} of 2000 refused UNAUTHENTICATED"),
    );

    // 2. An admitted client (public world): the same, against the budget.
    let p = member(addr, "pub", None).await;
    let f = Figures::start(
        "admitted body flood (public world, 2 conns x 1000 max-size Sets)",
        &w,
    )
    .await;
    let mut peak_budget = 0;
    for _ in 0..2 {
        let conn = h2_connection(addr).await;
        for _ in 0..1000 {
            let req = grpc_request(addr, "Set", Some("pub"), None);
            held.push(partial_request(&conn, req, max, 64 * 1024 - 1).await);
            peak_budget = peak_budget.max(s.stats().buffered_request_bytes);
        }
    }
    let during = latency(&w, 50).await;
    let during_pub = latency(&p, 20).await;
    let t = Instant::now();
    let mut codes = std::collections::BTreeMap::new();
    for (r, _s) in held.drain(..) {
        *codes.entry(grpc_status(r).await).or_insert(0) += 1;
    }
    f.report(
        during,
        t.elapsed(),
        &s,
        &format!(
            "budget peak {peak_budget} B; answers {codes:?}; public-world set+get during {during_pub:?}"
        ),
    );

    // 3. MultiGet naming a 1 MiB key 1,024 times, 20 times.
    p.set("big", vec![1u8; 1 << 20]).await.unwrap();
    let f = Figures::start("multi-get 1024 x 1 MiB key (20 requests)", &w).await;
    let keys = vec!["big"; 1024];
    let t = Instant::now();
    let mut errs = 0;
    for _ in 0..20 {
        errs += usize::from(p.multi_get(&keys, Duration::from_secs(1)).await.is_err());
    }
    let during = latency(&w, 50).await;
    f.report(
        during,
        t.elapsed(),
        &s,
        &format!("{errs} of 20 refused ReplyBytes"),
    );
    p.delete("big").await.unwrap();

    // 4. 2,000 idle connections and 500 slowloris connections.
    let f = Figures::start("2000 idle + 500 slowloris connections", &w).await;
    let t = Instant::now();
    let mut idle = Vec::new();
    for _ in 0..2000 {
        if let Ok(sock) = TcpStream::connect(addr).await {
            idle.push(sock);
        }
    }
    let mut slow = Vec::new();
    for _ in 0..500 {
        let Ok(mut sock) = TcpStream::connect(addr).await else {
            continue;
        };
        slow.push(tokio::spawn(async move {
            let opened = Instant::now();
            for byte in b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".iter().cycle() {
                if sock.write_all(&[*byte]).await.is_err() || opened.elapsed() > Duration::from_secs(30) {
                    break;
                }
                tokio::time::sleep(Duration::from_secs(3)).await;
            }
            opened.elapsed()
        }));
    }
    let peak_conns = s.stats().connections;
    let during = latency(&w, 50).await;
    let mut closed = 0;
    for mut sock in idle {
        let mut buf = [0u8; 256];
        // The server speaks first (its SETTINGS); closed means EOF or reset.
        let eof = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                match sock.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
        });
        closed += usize::from(eof.await.is_ok());
    }
    let mut slow_closed = 0;
    for t in slow {
        slow_closed += usize::from(t.await.unwrap() < Duration::from_secs(30));
    }
    f.report(
        during,
        t.elapsed(),
        &s,
        &format!(
            "connections at peak {peak_conns}; idle closed {closed}/2000, slowloris closed {slow_closed}/500"
        ),
    );

    // 5. 40 connections × 1,024 waits on one world, then one Set.
    let f = Figures::start("40 conns x 1024 waits, then one Set", &w).await;
    let mut parked = Vec::new();
    for _ in 0..40 {
        let c = member(addr, "pub", None).await;
        for _ in 0..1024 {
            let c = c.clone();
            parked.push(tokio::spawn(
                async move { c.get("go", Duration::from_secs(60)).await },
            ));
        }
    }
    let t0 = Instant::now();
    while s.world_stats("pub").unwrap().table.waiters < 4096 && t0.elapsed() < Duration::from_secs(30) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let during = latency(&w, 50).await;
    let registered = s.world_stats("pub").unwrap().table.waiters;
    let t = Instant::now();
    p.set("go", "1").await.unwrap();
    let set_took = t.elapsed();
    let (mut ok, mut refused) = (0, 0);
    for j in parked {
        match j.await.unwrap() {
            Ok(_) => ok += 1,
            Err(_) => refused += 1,
        }
    }
    f.report(
        during,
        t.elapsed(),
        &s,
        &format!(
            "{registered} registered, {ok} woken, {refused} refused; the releasing Set took {set_took:?}"
        ),
    );

    // 6. and 7. The body floods through the framed protocol: a framed
    // connection carries one request at a time, so the attacker opens 1,000
    // of them, each declaring a maximum-size Set and sending 64 KiB of it.
    for (what, world, proof) in [
        (
            "framed stranger flood (1000 conns x 1 max-size Set, wrong proof)",
            &b"w"[..],
            wrong.as_bytes(),
        ),
        (
            "framed admitted flood (public world, 1000 conns x 1 max-size Set)",
            &b"pub"[..],
            &b""[..],
        ),
    ] {
        let f = Figures::start(what, &w).await;
        let mut socks = Vec::new();
        let mut peak_budget = 0;
        for _ in 0..1000 {
            let mut sock = TcpStream::connect(addr).await.unwrap();
            let _ = sock
                .write_all(&framed_partial_set(world, proof, max, 64 * 1024))
                .await;
            socks.push(sock);
            peak_budget = peak_budget.max(s.stats().buffered_request_bytes);
        }
        let during = latency(&w, 50).await;
        let t = Instant::now();
        let mut kinds = std::collections::BTreeMap::new();
        for mut sock in socks {
            let answer = async {
                loop {
                    let mut h = [0u8; 9];
                    if sock.read_exact(&mut h).await.is_err() {
                        return "closed without an answer".to_string();
                    }
                    let mut body =
                        vec![0u8; u32::from_be_bytes([h[0], h[1], h[2], h[3]]).min(1 << 16) as usize];
                    if sock.read_exact(&mut body).await.is_err() {
                        return "closed in the middle of a frame".to_string();
                    }
                    match h[4] {
                        // The server's keepalive pings: not an answer.
                        5 => continue,
                        3 => {
                            let n = usize::from(body.get(1).copied().unwrap_or(0));
                            return String::from_utf8_lossy(body.get(2..2 + n).unwrap_or(&[])).into_owned();
                        }
                        k => return format!("frame kind {k}"),
                    }
                }
            };
            let kind = tokio::time::timeout(Duration::from_secs(15), answer)
                .await
                .unwrap_or_else(|_| "no answer in 15 s".into());
            *kinds.entry(kind).or_insert(0) += 1;
        }
        f.report(
            during,
            t.elapsed(),
            &s,
            &format!("budget peak {peak_budget} B; answers {kinds:?}"),
        );
    }
}

/// The framed preface and the head of a `Set` in `world` with `proof`,
/// declaring a `declared`-byte message of which `sent` bytes follow.
fn framed_partial_set(world: &[u8], proof: &[u8], declared: usize, sent: usize) -> Vec<u8> {
    let mut f = b"MWSTORE\x01".to_vec();
    let body = 5 + world.len() + proof.len() + declared;
    f.extend_from_slice(&(body as u32).to_be_bytes());
    f.push(1);
    f.extend_from_slice(&1u32.to_be_bytes());
    f.push(3);
    f.extend_from_slice(&(world.len() as u16).to_be_bytes());
    f.extend_from_slice(world);
    f.extend_from_slice(&(proof.len() as u16).to_be_bytes());
    f.extend_from_slice(proof);
    f.extend(std::iter::repeat_n(0u8, sent));
    f
}

/// The gate refuses on the request's headers alone, so the server may answer
/// (and close the stream) before the client has handed over the body: the
/// client must report the server's answer (unauthenticated), never the
/// failed body send ("inactive stream"). Many refusals in a row, to meet
/// that race.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_answered_before_the_body_is_sent_are_reported_as_refusals() {
    let s = guarded_server_with_a_secret_world().await;
    let addr = s.local_addr().to_string();
    let c = StoreClient::connect(&addr, ClientConfig::default())
        .await
        .unwrap();
    let opts = || OpenOptions {
        timeout: Duration::from_millis(100),
        ..OpenOptions::default()
    };
    for i in 0..1000 {
        let err = c.open("exists", opts()).await.unwrap_err();
        assert!(
            matches!(err, StoreError::Unauthenticated { .. }),
            "call {i}: {err}"
        );
    }
    // The first call on a fresh connection, as a command-line client makes it.
    for i in 0..200 {
        let fresh = StoreClient::connect(&addr, ClientConfig::default())
            .await
            .unwrap();
        let err = fresh.open("exists", opts()).await.unwrap_err();
        assert!(
            matches!(err, StoreError::Unauthenticated { .. }),
            "fresh call {i}: {err}"
        );
    }
}
