//! A flood of strangers refused by a member's listener writes a few WARN lines,
//! not one per refusal: at most one per second (each saying how many refusals
//! were held back, at DEBUG, since the previous one), while
//! `rejected_connections()` counts every refusal and a member still joins.
//! The test captures the tracing output of a current-thread runtime that runs
//! both the listener and the strangers. Two waves: a burst, then a quiet spell
//! (the held-back count must be reported within the interval, without waiting
//! for another refusal), then strangers paced over about two seconds (one WARN
//! line per second).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use multiworld_tcp::handshake::HELLO_FIXED_LEN;
use multiworld_tcp::mesh::addr_key;
use multiworld_tcp::{Communicator, Generation, MemoryRendezvous, Rank, Rendezvous};
use multiworld_testkit::logs::{LogCapture, with_captured_logs};
use multiworld_testkit::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::task::JoinSet;

/// Strangers refused, one connection each, in each of the two waves.
const WAVE: usize = 250;
/// Strangers connected at once in the first wave.
const AT_ONCE: usize = 25;
/// The pause between two strangers of the second wave.
const PACE: Duration = Duration::from_millis(8);
/// The quiet spell between the waves: longer than the 1 s log interval.
const QUIET: Duration = Duration::from_millis(1500);

/// One stranger: connects, sends a Hello-sized run of garbage, and waits until
/// the listener has refused and closed the connection.
async fn stranger(addr: SocketAddr) {
    let mut s = TcpStream::connect(addr).await.expect("stranger connects");
    let _ = s.write_all(&[0xEE; HELLO_FIXED_LEN]).await;
    let mut buf = [0u8; 512];
    let closed = tokio::time::timeout(Duration::from_secs(30), async {
        while let Ok(n) = s.read(&mut buf).await {
            if n == 0 {
                break;
            }
        }
    })
    .await;
    closed.expect("the listener closes a stranger's connection");
}

/// What the flood left: refusals counted, and how long it all took.
struct Outcome {
    rejected: u64,
    flood: Duration,
    total: Duration,
}

/// The WARN lines about refusals, and the refusals they account for: one for
/// each naming its peer, plus each line's count of refusals held back.
fn warn_lines(text: &str) -> (Vec<String>, u64) {
    let warns: Vec<String> = text
        .lines()
        .filter(|l| l.contains("refused inbound connection") && l.contains(" WARN "))
        .map(String::from)
        .collect();
    let named = warns.iter().filter(|l| l.contains(" peer=")).count() as u64;
    let held: u64 = warns.iter().map(|l| field(l, "suppressed").unwrap_or(0)).sum();
    (warns, named + held)
}

async fn flood_then_join(capture: LogCapture) -> Outcome {
    let rdv = MemoryRendezvous::new();
    let join = |r: u32| {
        let rdv = rdv.clone();
        let mut cfg = config("flooded", r, 2);
        cfg.join_timeout = Duration::from_secs(120);
        tokio::spawn(async move { Communicator::join(cfg, &rdv).await })
    };
    let first = join(0);
    let raw = rdv
        .get(
            &addr_key(&world("flooded"), Generation(1), Rank(0)),
            Duration::from_secs(10),
        )
        .await
        .unwrap();
    let addr: SocketAddr = std::str::from_utf8(&raw).unwrap().parse().unwrap();

    let start = Instant::now();
    let mut crowd = JoinSet::new();
    for i in 0..WAVE {
        if i >= AT_ONCE {
            crowd.join_next().await.unwrap().unwrap();
        }
        crowd.spawn(stranger(addr));
    }
    while let Some(r) = crowd.join_next().await {
        r.unwrap();
    }
    let burst = start.elapsed();
    tokio::time::sleep(QUIET).await;
    let (warns, counted) = warn_lines(&capture.text());
    println!(
        "first wave: {WAVE} refused in {burst:?}; {} WARN line(s) after a {QUIET:?} quiet spell",
        warns.len()
    );
    assert_eq!(
        counted, WAVE as u64,
        "the held-back refusals are reported once the interval is over: {warns:#?}"
    );

    for _ in 0..WAVE {
        crowd.spawn(stranger(addr));
        tokio::time::sleep(PACE).await;
    }
    while let Some(r) = crowd.join_next().await {
        r.unwrap();
    }
    let flood = start.elapsed();

    // A member still joins through the same listener.
    let second = join(1).await.unwrap().expect("a member joins after the flood");
    let first = first.await.unwrap().expect("rank 0 joins");
    let rejected = first.rejected_connections();
    // Closing drops the listener, which reports what it held back.
    first.close().await;
    second.close().await;
    Outcome {
        rejected,
        flood,
        total: start.elapsed(),
    }
}

/// The value of `field=` in a log line.
fn field(line: &str, name: &str) -> Option<u64> {
    let at = line.find(&format!(" {name}="))? + name.len() + 2;
    line[at..]
        .split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()
}

#[test]
fn a_flood_of_refused_strangers_writes_one_warn_line_per_second() {
    let (out, capture) = with_captured_logs(flood_then_join);
    let text = capture.text();
    let debugs = text
        .lines()
        .filter(|l| l.contains("refused inbound connection") && l.contains("DEBUG "))
        .count() as u64;
    // Every refusal is either a WARN line naming its peer, or held back (at
    // DEBUG) and counted in the `suppressed` of a later WARN line.
    let (warns, counted) = warn_lines(&text);
    let named = warns.iter().filter(|l| l.contains(" peer=")).count() as u64;
    println!(
        "{} strangers refused in {:?} ({:?} with the join and close): {} counted, {} WARN lines \
         ({named} naming a peer), {debugs} DEBUG lines",
        2 * WAVE,
        out.flood,
        out.total,
        out.rejected,
        warns.len()
    );
    for w in &warns {
        println!("  {w}");
    }
    assert_eq!(out.rejected, 2 * WAVE as u64, "every refusal counted");
    assert_eq!(counted, out.rejected, "every refusal in a WARN line's count");
    assert_eq!(debugs, counted - named, "the held-back refusals are at DEBUG");
    // At most one line per started second, plus the summary when the listener
    // closes.
    let bound = out.total.as_secs() as usize + 2;
    assert!(
        warns.len() <= bound,
        "{} WARN lines in {:?} (bound {bound})",
        warns.len(),
        out.total
    );
    assert!(
        !text.contains("connection refused by peer"),
        "the member was not refused"
    );
}
