//! The metrics text of a manager (in-process members): what a world's
//! traffic and break do to it, and that every series the docs' catalogue and
//! the Grafana dashboard use exists. The HTTP endpoint with real processes
//! is tested in `crates/m8d/tests/observe.rs`.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::{collections::BTreeSet, time::Duration};

use multiworld::{Rank, Tag, Tensor, WorldConfig, WorldEvent, WorldManager};
use multiworld_testkit::facade::next_event_for;

fn names(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_string)
        .collect()
}

/// Every `multiworld_*` name in `text`, with histogram suffixes removed.
fn mentioned(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = text;
    while let Some(i) = rest.find("multiworld_") {
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        let name = &tail[..end];
        let name = ["_bucket", "_count", "_sum"]
            .iter()
            .fold(name, |n, s| n.strip_suffix(s).unwrap_or(n));
        if name.len() > "multiworld_".len() {
            out.insert(name.to_string());
        }
        rest = &tail[end..];
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn traffic_and_a_break_move_the_metrics_and_the_docs_name_only_real_series() {
    multiworld_testkit::init_tracing();
    let (a, b) = (WorldManager::default(), WorldManager::default());
    let store = a.serve_store("127.0.0.1:0").await.unwrap().to_string();
    let (w0, w1) = tokio::join!(
        a.join(WorldConfig::new("m", 0, 2, &store).unwrap()),
        b.join(WorldConfig::new("m", 1, 2, &store).unwrap())
    );
    let (w0, w1) = (w0.unwrap(), w1.unwrap());
    let mut events = a.events();
    for i in 0..10u32 {
        let mut got = Tensor::zeros(multiworld::DType::F32, [256]).unwrap();
        let data = vec![i as f32; 256];
        let (s, r) = tokio::join!(
            w1.send(Rank(0), Tag(1), &data[..]),
            w0.recv(Rank(1), Tag(1), &mut got)
        );
        s.unwrap();
        r.unwrap();
    }
    let mut t = Tensor::from_vec(vec![1.0f32; 8], [8]).unwrap();
    let mut u = Tensor::from_vec(vec![2.0f32; 8], [8]).unwrap();
    let (x, y) = tokio::join!(
        w0.collectives().all_reduce(&mut t, multiworld::ReduceOp::Sum),
        w1.collectives().all_reduce(&mut u, multiworld::ReduceOp::Sum)
    );
    x.unwrap();
    y.unwrap();

    // Heartbeats (every 200 ms by default) echo each other: a round trip
    // is measured within a few intervals.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let live = loop {
        let text = a.metrics_text();
        if text.contains("multiworld_heartbeat_rtt_seconds{") {
            break text;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no heartbeat round trip measured:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let rtt = w0.communicator().liveness()[0].heartbeat_rtt.unwrap();
    assert!(rtt > Duration::ZERO && rtt < Duration::from_secs(2), "{rtt:?}");
    let line = |text: &str, start: &str| {
        text.lines()
            .find(|l| l.starts_with(start))
            .unwrap_or_else(|| panic!("no {start}… in\n{text}"))
            .rsplit(' ')
            .next()
            .unwrap()
            .parse::<f64>()
            .unwrap()
    };
    let labels = format!("world=\"m\",generation=\"{}\",rank=\"0\"", w0.generation().0);
    // The 10 messages of 1 KiB, and the all_reduce's own traffic.
    let bytes = line(
        &live,
        &format!("multiworld_received_bytes_total{{{labels},peer=\"1\"}}"),
    );
    assert!(
        (10.0 * 1024.0..10.0 * 1024.0 + 4096.0).contains(&bytes),
        "{bytes}"
    );
    // The 10 messages, and the all_reduce's own traffic.
    assert!(
        line(
            &live,
            &format!("multiworld_received_messages_total{{{labels},peer=\"1\"}}")
        ) >= 10.0
    );
    assert_eq!(
        line(
            &live,
            &format!("multiworld_op_duration_seconds_count{{{labels},op=\"recv\"}}")
        ),
        10.0
    );
    assert_eq!(
        line(
            &live,
            &format!("multiworld_op_duration_seconds_count{{{labels},op=\"all_reduce\"}}")
        ),
        1.0
    );
    assert_eq!(line(&live, "multiworld_joins_total"), 1.0);
    assert_eq!(line(&live, "multiworld_worlds{state=\"ready\"}"), 1.0);

    // The record of this world so far: 10 receives and an all_reduce, done.
    let record = a.flight_record("m").unwrap();
    assert_eq!(record.ops.iter().filter(|o| o.kind == "recv").count(), 10);
    assert!(
        record
            .ops
            .iter()
            .all(|o| o.outcome == multiworld::OpOutcome::Done),
        "{}",
        record.timeline()
    );

    // A receive pending when the peer aborts: the break counts its cause
    // and the event carries the record with that receive pending.
    let pending = {
        let w0 = w0.clone();
        tokio::spawn(async move {
            let mut got = Tensor::zeros(multiworld::DType::F32, [4]).unwrap();
            w0.recv(Rank(1), Tag(9), &mut got).await
        })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    w1.abort();
    let record = match next_event_for(&mut events, "m", Duration::from_secs(10)).await {
        WorldEvent::Broken { record, .. } => record,
        other => panic!("{other:?}"),
    };
    assert!(pending.await.unwrap().is_err());
    let stuck: Vec<_> = record.pending().collect();
    assert_eq!(stuck.len(), 1, "{}", record.timeline());
    assert_eq!(
        (stuck[0].kind.as_str(), stuck[0].peer, stuck[0].tag),
        ("recv", Some(1), Some(9))
    );
    w0.removed().await;
    let after = a.metrics_text();
    let cause = line(&after, "multiworld_breaks_total{cause=\"");
    assert_eq!(cause, 1.0);
    let stale: Vec<&str> = after
        .lines()
        .filter(|l| l.contains("world=\"m\"") && !l.starts_with("multiworld_last_break_timestamp_seconds"))
        .collect();
    assert!(stale.is_empty(), "a removed world's series stay: {stale:#?}");

    // Every series the docs and the dashboard name is one the code exports.
    let exported: BTreeSet<String> = names(&live)
        .union(&names(&after))
        .map(|n| {
            ["_bucket", "_count", "_sum", "_total"]
                .iter()
                .fold(n.as_str(), |n, s| n.strip_suffix(s).unwrap_or(n))
                .to_string()
        })
        .collect();
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    for doc in ["docs/operations.md", "docs/grafana-dashboard.json"] {
        let text = std::fs::read_to_string(root.join(doc)).unwrap();
        let named = mentioned(&text);
        assert!(!named.is_empty(), "{doc} names no series");
        for n in named {
            let base = n.strip_suffix("_total").unwrap_or(&n);
            assert!(
                exported.contains(base),
                "{doc} names {n}, which is not exported: {exported:?}"
            );
        }
    }
    a.shutdown().await;
    b.shutdown().await;
}

/// A world's name may hold a double quote or a backslash: its label value is
/// escaped, so the page still parses (unescaped, one such name broke every
/// series of the page for a scraper).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_world_name_with_quotes_and_backslashes_is_escaped_in_labels() {
    let m = WorldManager::default();
    let store = m.serve_store("127.0.0.1:0").await.unwrap().to_string();
    let name = r#"q"uote\slash"#;
    let _w = m
        .join(WorldConfig::new(name, 0, 1, &store).unwrap())
        .await
        .unwrap();
    let text = m.metrics_text();
    let escaped = r#"world="q\"uote\\slash""#;
    assert!(text.contains(escaped), "no escaped label {escaped} in:\n{text}");
    // Every label value on the page is a well-formed quoted string.
    for line in text.lines().filter(|l| !l.starts_with('#') && l.contains('{')) {
        let labels = &line[line.find('{').unwrap() + 1..line.rfind('}').unwrap()];
        let mut chars = labels.chars();
        let mut quoted = false;
        while let Some(c) = chars.next() {
            match (quoted, c) {
                (true, '\\') => assert!(
                    matches!(chars.next(), Some('\\' | '"' | 'n')),
                    "a bad escape in {line}"
                ),
                (_, '"') => quoted = !quoted,
                _ => {}
            }
        }
        assert!(!quoted, "an unterminated label value in {line}");
    }
}

/// The endpoint closes a connection that sends no complete request head
/// (a stalled client holds no slot for long).
#[tokio::test(start_paused = true)]
async fn the_endpoint_closes_a_stalled_connection() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let m = WorldManager::new(multiworld::ManagerConfig {
        metrics_addr: Some("127.0.0.1:0".parse().unwrap()),
        ..multiworld::ManagerConfig::default()
    });
    let addr = m.metrics_addr().expect("the endpoint is served");
    let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
    c.write_all(b"GET /metrics HTTP/1.1\r\n").await.unwrap();
    let t0 = tokio::time::Instant::now();
    let mut buf = [0u8; 1024];
    let closed = tokio::time::timeout(Duration::from_secs(120), async {
        loop {
            match c.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await;
    assert!(closed.is_ok(), "a stalled connection stayed open");
    assert!(
        t0.elapsed() <= Duration::from_secs(61),
        "closed after {:?}",
        t0.elapsed()
    );
}

/// A manager made outside a Tokio runtime runs without the endpoint
/// instead of panicking.
#[test]
fn a_manager_made_outside_a_runtime_runs_without_the_endpoint() {
    let m = WorldManager::new(multiworld::ManagerConfig {
        metrics_addr: Some("127.0.0.1:0".parse().unwrap()),
        ..multiworld::ManagerConfig::default()
    });
    assert_eq!(m.metrics_addr(), None);
}
