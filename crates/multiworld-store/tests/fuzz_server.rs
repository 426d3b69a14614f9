//! Fuzzing a live store server over loopback (127.0.0.1, port 0): raw HTTP/2
//! requests with arbitrary header sets (method, `mw-world`, `mw-auth`) and
//! arbitrary bodies (valid, mutated or arbitrary request messages behind a
//! right, wrong, compressed or lying 5-byte gRPC prefix, or no prefix at
//! all). Every request is answered with a gRPC status; afterwards the server
//! holds no request memory and no waiter, and a legitimate client still sets
//! and gets. `MULTIWORLD_FUZZ_CASES=N` sends `N / 100` requests (default 200).
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use h2::client::SendRequest;
use multiworld_proto::store::v1 as pb;
use multiworld_store::{
    ClientConfig, Limits, OpenOptions, Secret, ServerConfig, StoreClient, StoreProof, StoreServer,
    WorldOptions,
};
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::TestRunner;
use prost::Message;
use tokio::net::TcpStream;

const SECRET: &str = "right";

fn cases(default: u32, divisor: u32) -> u32 {
    std::env::var("MULTIWORLD_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse::<u32>().ok())
        .map_or(default, |n| (n / divisor).max(1))
}

const METHODS: [&str; 16] = [
    "Open",
    "Close",
    "Set",
    "Get",
    "TryGet",
    "Add",
    "CompareAndSet",
    "Wait",
    "Check",
    "Delete",
    "MultiGet",
    "MultiSet",
    "Append",
    "NumKeys",
    "Ping",
    "Bogus",
];

/// One hostile request.
#[derive(Debug, Clone)]
struct Case {
    method: String,
    world: Option<Vec<u8>>,
    auth: u8,
    body: Vec<u8>,
}

/// A request message for `method` naming world `name` of `generation`.
fn message(method: &str, name: &str, generation: u64, key: Vec<u8>, value: Vec<u8>, n: u64) -> Vec<u8> {
    let world = Some(pb::WorldRef {
        name: name.to_owned(),
        generation,
    });
    let key = Bytes::from(key);
    let value = Bytes::from(value);
    let timeout_ms = n % 200;
    match method {
        "Open" => pb::OpenRequest {
            name: name.to_owned(),
            create: n % 2 == 0,
        }
        .encode_to_vec(),
        "Close" => pb::CloseRequest { world }.encode_to_vec(),
        "Set" => pb::SetRequest { world, key, value }.encode_to_vec(),
        "Get" => pb::GetRequest {
            world,
            key,
            timeout_ms,
        }
        .encode_to_vec(),
        "TryGet" => pb::TryGetRequest { world, key }.encode_to_vec(),
        "Add" => pb::AddRequest {
            world,
            key,
            delta: n as i64,
        }
        .encode_to_vec(),
        "CompareAndSet" => pb::CompareAndSetRequest {
            world,
            key,
            expected: (n % 2 == 0).then(|| value.clone()),
            desired: value,
        }
        .encode_to_vec(),
        "Wait" => pb::WaitRequest {
            world,
            keys: vec![key; (n % 5) as usize],
            timeout_ms,
        }
        .encode_to_vec(),
        "Check" => pb::CheckRequest {
            world,
            keys: vec![key; (n % 5) as usize],
        }
        .encode_to_vec(),
        "Delete" => pb::DeleteRequest { world, key }.encode_to_vec(),
        "MultiGet" => pb::MultiGetRequest {
            world,
            keys: vec![key; (n % 5) as usize],
            timeout_ms,
        }
        .encode_to_vec(),
        "MultiSet" => pb::MultiSetRequest {
            world,
            entries: vec![pb::KeyValue { key, value }; (n % 4) as usize],
        }
        .encode_to_vec(),
        "Append" => pb::AppendRequest { world, key, value }.encode_to_vec(),
        "NumKeys" => pb::NumKeysRequest { world }.encode_to_vec(),
        _ => pb::PingRequest { world }.encode_to_vec(),
    }
}

fn case(generations: (u64, u64)) -> impl Strategy<Value = Case> {
    let method = prop_oneof![
        8 => proptest::sample::select(METHODS.to_vec()).prop_map(String::from),
        1 => "[A-Za-z]{0,12}",
    ];
    let world = proptest::option::of(prop_oneof![
        3 => proptest::sample::select(vec!["pub", "sec", "nope"]).prop_map(|w| hex::encode(w).into_bytes()),
        1 => proptest::collection::vec(any::<u8>(), 1..40).prop_map(|b| hex::encode(b).into_bytes()),
        1 => "[0-9a-zA-Z]{0,700}".prop_map(String::into_bytes),
    ]);
    let msg = (
        proptest::sample::select(vec!["pub", "sec", "nope", ""]),
        any::<bool>(),
        proptest::collection::vec(any::<u8>(), 0..8),
        proptest::collection::vec(any::<u8>(), 0..64),
        any::<u64>(),
        proptest::collection::vec((any::<usize>(), any::<u8>()), 0..3),
    );
    let body = prop_oneof![
        // A message behind a right prefix, maybe with bytes changed.
        4 => msg.prop_map(|(name, right_gen, key, value, n, edits)| (name, right_gen, key, value, n, edits, 0u8)),
        // The same behind a lying prefix (compressed, or a wrong length).
        1 => (
            proptest::sample::select(vec!["pub", "sec"]),
            Just(true),
            proptest::collection::vec(any::<u8>(), 0..8),
            proptest::collection::vec(any::<u8>(), 0..64),
            any::<u64>(),
            Just(Vec::new()),
            1u8..4,
        ),
    ];
    (
        method,
        world,
        0u8..3,
        body,
        proptest::collection::vec(any::<u8>(), 0..80),
        0u8..8,
    )
        .prop_map(
            move |(method, world, auth, (name, right_gen, key, value, n, edits, lie), raw, shape)| {
                let body = if shape == 0 {
                    // No prefix at all: arbitrary bytes.
                    raw
                } else {
                    let generation = match (name, right_gen) {
                        ("pub", true) => generations.0,
                        ("sec", true) => generations.1,
                        _ => n % 3,
                    };
                    let mut m = message(&method, name, generation, key, value, n);
                    for (at, v) in edits {
                        if !m.is_empty() {
                            let i = at % m.len();
                            m[i] = v;
                        }
                    }
                    let (flag, len) = match lie {
                        0 => (0u8, m.len() as u32),
                        1 => (1, m.len() as u32),
                        2 => (0, m.len() as u32 + 1 + (n % 1000) as u32),
                        _ => (0, u32::MAX),
                    };
                    let mut b = vec![flag];
                    b.extend_from_slice(&len.to_be_bytes());
                    b.extend_from_slice(&m);
                    b
                };
                Case {
                    method,
                    world,
                    auth,
                    body,
                }
            },
        )
}

async fn h2_connection(addr: SocketAddr) -> SendRequest<Bytes> {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (send, conn) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(async move {
        let _ = conn.await;
    });
    send
}

/// Sends one case; returns its grpc-status, or `None` when the connection
/// itself went away (the caller reconnects).
async fn send(conn: &SendRequest<Bytes>, addr: SocketAddr, c: &Case) -> Option<u32> {
    let mut b = http::Request::builder()
        .method("POST")
        .uri(format!("http://{addr}/multiworld.store.v1.Store/{}", c.method))
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    if let Some(w) = &c.world {
        b = b.header("mw-world", w.as_slice());
    }
    let world = c
        .world
        .as_ref()
        .and_then(|w| hex::decode(w).ok())
        .and_then(|w| String::from_utf8(w).ok())
        .unwrap_or_default();
    match c.auth {
        0 => {}
        1 => b = b.header("mw-auth", Secret::new(SECRET).proof(&world)),
        _ => b = b.header("mw-auth", Secret::new("wrong").proof(&world)),
    }
    let req = b.body(()).unwrap();
    let mut sender = conn.clone().ready().await.ok()?;
    let (response, mut stream) = sender.send_request(req, false).ok()?;
    // A request refused from its headers may be reset before its body goes.
    let _ = stream.send_data(Bytes::from(c.body.clone()), true);
    let response = tokio::time::timeout(Duration::from_secs(10), response)
        .await
        .expect("the server answered within 10 s")
        .ok()?;
    assert_eq!(response.status(), http::StatusCode::OK, "{c:?}");
    let code = |h: &http::HeaderMap| -> Option<u32> { h.get("grpc-status")?.to_str().ok()?.parse().ok() };
    if let Some(s) = code(response.headers()) {
        return Some(s);
    }
    let mut body = response.into_body();
    while let Some(chunk) = body.data().await {
        let chunk = chunk.ok()?;
        let _ = body.flow_control().release_capacity(chunk.len());
    }
    let trailers = body.trailers().await.ok()?;
    let s = trailers.as_ref().and_then(code);
    assert!(s.is_some(), "no grpc-status in the trailers: {c:?}");
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn arbitrary_requests_at_a_live_server() {
    let n = cases(200, 100);
    let limits = Limits {
        default_timeout: Duration::from_millis(50),
        max_timeout: Duration::from_millis(100),
        ..Limits::default()
    };
    let config = ServerConfig {
        raise_fd_limit: false,
        ..ServerConfig::default()
    };
    let server = StoreServer::bind("127.0.0.1:0".parse().unwrap(), config)
        .await
        .unwrap();
    let addr = server.local_addr();
    let g_pub = server
        .open_world(
            "pub",
            WorldOptions {
                secret: None,
                limits: Some(limits.clone()),
            },
        )
        .unwrap();
    let g_sec = server
        .open_world(
            "sec",
            WorldOptions {
                secret: Some(Secret::new(SECRET)),
                limits: Some(limits),
            },
        )
        .unwrap();

    let mut runner = TestRunner::new(ProptestConfig {
        cases: n,
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    let strategy = case((g_pub, g_sec));
    let mut conn = h2_connection(addr).await;
    let mut codes = [0u32; 17];
    let mut reconnects = 0;
    for _ in 0..n {
        let c = strategy.new_tree(&mut runner).unwrap().current();
        match send(&conn, addr, &c).await {
            Some(code) => {
                assert!(code <= 16, "grpc-status {code} for {c:?}");
                codes[code as usize] += 1;
            }
            None => {
                reconnects += 1;
                conn = h2_connection(addr).await;
            }
        }
    }
    println!("{n} requests; grpc-status counts {codes:?}; {reconnects} reconnects");
    assert!(
        reconnects <= n / 4,
        "the server dropped {reconnects} of {n} connections"
    );

    // Nothing is held afterwards (a world closed by a Close is opened again).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let s = server.stats();
        if s.buffered_request_bytes == 0 && s.waiters == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "the server still holds {s:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    if !server.worlds().contains(&"sec".to_owned()) {
        server
            .open_world(
                "sec",
                WorldOptions {
                    secret: Some(Secret::new(SECRET)),
                    limits: None,
                },
            )
            .unwrap();
    }
    let client = StoreClient::connect(&addr.to_string(), ClientConfig::default())
        .await
        .unwrap();
    let w = client
        .open(
            "sec",
            OpenOptions {
                secret: Some(Secret::new(SECRET)),
                ..OpenOptions::default()
            },
        )
        .await
        .unwrap();
    w.set("after", "fuzz").await.unwrap();
    assert_eq!(
        &w.get("after", Duration::from_secs(5)).await.unwrap()[..],
        b"fuzz"
    );
}
