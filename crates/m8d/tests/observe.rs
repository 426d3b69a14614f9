//! Operating a process, with real worker processes: its metrics endpoint
//! scraped over HTTP during traffic, after a SIGKILL and after the broken
//! world's removal; and the flight record a rank killed mid-collective
//! leaves on every survivor (the event, the file, `m8d flight`).
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpStream},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use m8d::fleet::{Fleet, FleetConfig};
use multiworld::{FlightRecord, ManagerConfig, OpOutcome, WorldConfig, WorldEvent, WorldManager};
use multiworld_testkit::process::Guard;
use tokio::sync::broadcast;

const M8D: &str = env!("CARGO_BIN_EXE_m8d");

/// `GET /metrics` over a plain socket; the body.
fn scrape(addr: SocketAddr) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let (head, body) = out.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: application/openmetrics-text"),
        "{head}"
    );
    body.to_string()
}

/// The value of the series `name` whose labels include every `k="v"` of
/// `labels` (`None`: no such series).
fn value(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
        .find(|l| labels.iter().all(|(k, v)| l.contains(&format!("{k}=\"{v}\""))))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

async fn wait_for(
    events: &mut broadcast::Receiver<WorldEvent>,
    what: impl Fn(&WorldEvent) -> bool,
) -> WorldEvent {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, events.recv()).await {
            Ok(Ok(e)) if what(&e) => return e,
            Ok(Ok(_)) => {}
            other => panic!("event not seen within 10 s: {other:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metrics_endpoint_follows_traffic_a_kill_and_the_removal() {
    multiworld_testkit::init_tracing();
    let mut config = FleetConfig::new(M8D, 2);
    config.metrics_addr = Some("127.0.0.1:0".parse().unwrap());
    let mut f = Fleet::start(config).await.unwrap();
    let addr = f.leader.metrics_addr().expect("the endpoint is served");
    let mut events = f.leader.events();

    let first = scrape(addr);
    let w1 = [("world", "w1"), ("peer", "1")];
    let bytes_1 = value(&first, "multiworld_received_bytes_total", &w1).expect("w1's traffic series");
    let msgs_1 = value(&first, "multiworld_received_messages_total", &w1).unwrap();
    assert!(bytes_1 > 0.0 && msgs_1 > 0.0, "{first}");
    assert_eq!(
        value(
            &first,
            "multiworld_world_state",
            &[("world", "w2"), ("state", "ready")]
        ),
        Some(1.0)
    );
    assert_eq!(
        value(&first, "multiworld_worlds", &[("state", "ready")]),
        Some(2.0)
    );
    assert_eq!(value(&first, "multiworld_joins_total", &[]), Some(2.0));
    let heard = value(&first, "multiworld_peer_last_heard_seconds", &[("world", "w1")]).unwrap();
    assert!(heard < 5.0, "w1's worker streams: heard {heard} s ago");
    let recvs_1 = value(
        &first,
        "multiworld_op_duration_seconds_count",
        &[("world", "w1"), ("op", "recv")],
    )
    .unwrap();

    f.wait_flowing(0, 20, Duration::from_secs(10)).await.unwrap();
    let second = scrape(addr);
    assert!(
        value(&second, "multiworld_received_bytes_total", &w1).unwrap() > bytes_1,
        "counters grow"
    );
    assert!(value(&second, "multiworld_received_messages_total", &w1).unwrap() >= msgs_1 + 20.0);
    assert!(
        value(
            &second,
            "multiworld_op_duration_seconds_count",
            &[("world", "w1"), ("op", "recv")]
        )
        .unwrap()
            > recvs_1
    );

    // `m8d status` shows both worlds live, with rates from two scrapes.
    let status = tokio::task::spawn_blocking(move || {
        multiworld_testkit::process::run(Command::new(M8D).args([
            "status",
            &addr.to_string(),
            "--interval",
            "0.3",
        ]))
    })
    .await
    .unwrap();
    assert!(status.success(), "{}", status.stderr);
    let rows: Vec<&str> = status.stdout.lines().filter(|l| l.starts_with('w')).collect();
    assert!(
        status
            .stdout
            .starts_with(&format!("worlds of the process at {addr}")),
        "{}",
        status.stdout
    );
    assert!(
        rows.iter()
            .any(|r| r.starts_with("w1 ") && r.contains("ready") && r.contains("B/s")),
        "{}",
        status.stdout
    );
    assert!(
        rows.iter().any(|r| r.starts_with("w2 ") && r.contains("ready")),
        "{}",
        status.stdout
    );
    assert!(status.stdout.contains("breaks: none"), "{}", status.stdout);

    // SIGKILL w2's worker: its world breaks (peer_lost), is removed, and its
    // series go; w1's keep growing.
    f.kill(1).unwrap();
    wait_for(
        &mut events,
        |e| matches!(e, WorldEvent::Removed { world, .. } if world.as_str() == "w2"),
    )
    .await;
    let third = scrape(addr);
    assert_eq!(
        value(&third, "multiworld_breaks_total", &[("cause", "peer_lost")]),
        Some(1.0),
        "the broken world's cause is counted:\n{third}"
    );
    // A removed world's series are dropped; only the process's "last break"
    // series (one, whatever the number of breaks) still names it.
    let left: Vec<&str> = third
        .lines()
        .filter(|l| l.contains("world=\"w2\"") && !l.starts_with("multiworld_last_break_timestamp_seconds"))
        .collect();
    assert!(left.is_empty(), "a removed world's series are dropped: {left:#?}");
    assert!(
        value(
            &third,
            "multiworld_last_break_timestamp_seconds",
            &[("world", "w2"), ("cause", "peer_lost")]
        )
        .is_some()
    );
    assert_eq!(
        value(&third, "multiworld_worlds", &[("state", "ready")]),
        Some(1.0)
    );
    assert_eq!(
        value(&third, "multiworld_teardown_duration_seconds_count", &[]),
        Some(1.0),
        "{third}"
    );
    let status = tokio::task::spawn_blocking(move || {
        multiworld_testkit::process::run(Command::new(M8D).args([
            "status",
            &addr.to_string(),
            "--interval",
            "0.2",
        ]))
    })
    .await
    .unwrap();
    assert!(status.stdout.contains("breaks: peer_lost 1"), "{}", status.stdout);
    assert!(
        status.stdout.contains("last break: w2 generation"),
        "{}",
        status.stdout
    );
    assert!(
        !status.stdout.lines().any(|l| l.starts_with("w2 ")),
        "{}",
        status.stdout
    );
    let bytes_3 = value(&third, "multiworld_received_bytes_total", &w1).unwrap();
    f.wait_flowing(0, 20, Duration::from_secs(10)).await.unwrap();
    assert!(value(&scrape(addr), "multiworld_received_bytes_total", &w1).unwrap() > bytes_3);

    // Anything but /metrics is a 404 that says where to look.
    let mut s = TcpStream::connect(addr).unwrap();
    write!(s, "GET /nope HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    assert!(
        out.starts_with("HTTP/1.1 404") && out.contains("/metrics"),
        "{out}"
    );

    f.end_streams(Duration::from_secs(30)).await;
    f.shutdown().await;
}

/// The rank a record's break cause names (`"... rank N lost ..."`).
fn cause_rank(record: &FlightRecord) -> Option<u32> {
    let after = record.reason.split("rank ").nth(1)?;
    after.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
}

/// The record shows the all_reduce the survivor was in when the world broke:
/// still pending at the break, or failed by it.
fn assert_shows_the_collective(record: &FlightRecord, who: &str) {
    let op = record
        .ops
        .iter()
        .rev()
        .find(|o| o.kind == "all_reduce")
        .unwrap_or_else(|| panic!("{who}: no all_reduce in the record:\n{}", record.timeline()));
    assert!(
        matches!(op.outcome, OpOutcome::Pending | OpOutcome::Failed(_)),
        "{who}: the last all_reduce is {:?}:\n{}",
        op.outcome,
        record.timeline()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_killed_mid_collective_leaves_a_flight_record_on_every_survivor() {
    multiworld_testkit::init_tracing();
    let dir = std::env::temp_dir().join(format!("mw-flight-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let leader = WorldManager::new(ManagerConfig {
        flight_recorder_dir: Some(dir.clone()),
        ..ManagerConfig::default()
    });
    let mut events = leader.events();
    let store = leader.serve_store("127.0.0.1:0").await.unwrap().to_string();
    let elements = 64 * 1024;
    let spawn = |rank: &str, extra: &[&str]| {
        Guard::spawn(
            Command::new(M8D)
                .args([
                    "worker", "--world", "coll", "--store", &store, "--rank", rank, "--size", "3",
                ])
                .args(["--mode", "all-reduce", "--elements", &elements.to_string()])
                .args(extra)
                .env("MULTIWORLD_FLIGHT_RECORDER_DIR", &dir)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null()),
        )
    };
    // Rank 2 stops answering at round 3: the survivors wait for it inside
    // their round-3 all_reduce until it is killed.
    let (mut one, mut two) = (spawn("1", &[]), spawn("2", &["--stall-at-round", "3"]));
    let world = leader
        .join(WorldConfig::new("coll", 0, 3, &store).unwrap())
        .await
        .unwrap();
    let generation = world.generation().0;
    let group = world.collectives();
    let mut failed = None;
    for round in 0u64..4 {
        let t = multiworld::Tensor::from_vec(
            vec![m8d::stream::all_reduce_value(0, round); elements],
            [elements],
        )
        .unwrap();
        let call = group.all_reduce_handle(t, multiworld::ReduceOp::Sum);
        if round == 3 {
            tokio::time::sleep(Duration::from_millis(300)).await;
            assert!(!call.is_completed(), "round 3 completed without rank 2");
            two.kill();
        }
        if let Err(e) = call.wait().await {
            failed = Some((round, e));
            break;
        }
    }
    let (round, err) = failed.expect("the all_reduce never failed");
    assert_eq!(round, 3, "{err}");
    // This survivor: the record rides on the Broken event and in a file.
    let record = match wait_for(&mut events, |e| matches!(e, WorldEvent::Broken { .. })).await {
        WorldEvent::Broken { record, .. } => record,
        _ => unreachable!(),
    };
    eprintln!("rank 0's flight record:\n{}", record.timeline());
    assert_shows_the_collective(&record, "rank 0");
    assert!(
        record
            .ops
            .iter()
            .filter(|o| o.kind == "all_reduce" && o.outcome == OpOutcome::Done)
            .count()
            >= 3
    );
    // The file is written by the teardown, before the world is removed.
    wait_for(&mut events, |e| matches!(e, WorldEvent::Removed { .. })).await;
    let file = dir.join(format!("coll-g{generation}-r0.json"));
    let from_file: FlightRecord = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
    assert_eq!(&from_file, &*record);

    // The other survivor, a separate process, wrote its own before exiting.
    let start = Instant::now();
    while one.try_wait().is_none() {
        assert!(start.elapsed() < Duration::from_secs(20), "rank 1 did not end");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let file_1 = dir.join(format!("coll-g{generation}-r1.json"));
    let record_1: FlightRecord = serde_json::from_slice(&std::fs::read(&file_1).unwrap()).unwrap();
    assert_eq!(record_1.rank, 1);
    eprintln!("rank 1's flight record:\n{}", record_1.timeline());
    assert_shows_the_collective(&record_1, "rank 1");
    // Each record names the peer whose loss broke the world there: rank 2,
    // the one that never answered, or, when the other survivor broke first
    // and its teardown closed its connections before rank 2's close was
    // read (a race on a loaded machine), that survivor — whose own record
    // then names rank 2. So rank 2 is always named, by one of them at least.
    let (c0, c1) = (cause_rank(&record), cause_rank(&record_1));
    assert!(
        matches!(c0, Some(2 | 1)) && matches!(c1, Some(2 | 0)),
        "{c0:?} {c1:?}"
    );
    assert!(
        c0 == Some(2) || c1 == Some(2),
        "neither record names rank 2: {c0:?} {c1:?}"
    );

    // `m8d flight FILE` prints it as a timeline.
    let out = Command::new(M8D).arg("flight").arg(&file_1).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.starts_with("world coll generation") && text.contains("all_reduce"),
        "{text}"
    );
    assert_eq!(text, record_1.timeline());
    leader.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}
