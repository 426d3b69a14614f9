//! A listener whose process is out of file descriptors (EMFILE) fails every
//! accept while a connection waits in its backlog. The accept loop must back
//! off (20 ms) rather than spin, write at most one WARN line per second about
//! it, and serve the waiting connection once descriptors free up. The test
//! lowers this process's `RLIMIT_NOFILE` and fills the descriptor table with
//! `/dev/null`, so it lives alone in its own test binary (no other test shares
//! the process) and restores the limit before it ends.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use multiworld_tcp::handshake::{HELLO_FIXED_LEN, MSG_REJECT};
use multiworld_tcp::{Communicator, MemoryRendezvous};
use multiworld_testkit::*;
use nix::sys::resource::{Resource, UsageWho, getrlimit, getrusage, setrlimit};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// How long the listener is kept out of descriptors.
const WINDOW: Duration = Duration::from_secs(1);

/// CPU time (user + system) this process has used.
fn cpu() -> Duration {
    let u = getrusage(UsageWho::RUSAGE_SELF).unwrap();
    let d = |t: nix::sys::time::TimeVal| {
        Duration::from_secs(t.tv_sec() as u64) + Duration::from_micros(t.tv_usec() as u64)
    };
    d(u.user_time()) + d(u.system_time())
}

fn open_fds() -> u64 {
    std::fs::read_dir("/proc/self/fd").unwrap().count() as u64
}

struct Outcome {
    cpu: Duration,
    window: Duration,
    recovered: Duration,
}

async fn starve_the_listener() -> Outcome {
    let mut cfg = config("emfile", 0, 1);
    // Nothing but the descriptors may free a slot: no deadline or eviction
    // closes a connection during the test.
    cfg.hello_timeout = Duration::from_secs(60);
    cfg.handshake_timeout = Duration::from_secs(60);
    let comm = Communicator::join(cfg, &MemoryRendezvous::new()).await.unwrap();
    let addr = comm.local_addr();

    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
    setrlimit(Resource::RLIMIT_NOFILE, open_fds() + 64, hard).unwrap();
    let mut filler = Vec::new();
    loop {
        match std::fs::File::open("/dev/null") {
            Ok(f) => filler.push(f),
            Err(e) if e.raw_os_error() == Some(nix::libc::EMFILE) => break,
            Err(e) => panic!("{e}"),
        }
        assert!(filler.len() < 10_000, "the lowered limit did not hold");
    }
    // One descriptor for the client: its connection then waits in the
    // listener's backlog, and the listener has none left to accept it.
    filler.pop();
    let mut client = TcpStream::connect(addr).await.unwrap();
    client.write_all(&[0xEE; HELLO_FIXED_LEN]).await.unwrap();

    let (cpu0, t0) = (cpu(), Instant::now());
    tokio::time::sleep(WINDOW).await;
    let (used, window) = (cpu() - cpu0, t0.elapsed());
    let rejected_while_starved = comm.rejected_connections();

    drop(filler);
    setrlimit(Resource::RLIMIT_NOFILE, soft, hard).unwrap();
    let t1 = Instant::now();
    let mut ty = [0u8; 1];
    tokio::time::timeout(Duration::from_secs(10), client.read_exact(&mut ty))
        .await
        .expect("the waiting connection is served once descriptors free up")
        .unwrap();
    let recovered = t1.elapsed();
    assert_eq!(ty[0], MSG_REJECT, "the garbage is refused");
    assert_eq!(rejected_while_starved, 0, "nothing was accepted while starved");
    assert_eq!(comm.rejected_connections(), 1);
    comm.close().await;
    Outcome {
        cpu: used,
        window,
        recovered,
    }
}

#[test]
fn accept_failures_back_off_log_once_per_second_and_recover() {
    let (out, capture) = multiworld_testkit::logs::with_captured_logs(|_| starve_the_listener());
    let text = capture.text();
    let failures: Vec<&str> = text.lines().filter(|l| l.contains("accept failed")).collect();
    let warns: Vec<&str> = text
        .lines()
        .filter(|l| l.contains(" WARN ") && (l.contains("accept failed") || l.contains("accepting again")))
        .collect();
    println!(
        "starved {:?}: {:?} CPU, {} failed accepts ({} WARN lines), served {:?} after descriptors freed",
        out.window,
        out.cpu,
        failures.len(),
        warns.len(),
        out.recovered
    );
    for w in &warns {
        println!("  {w}");
    }
    assert!(!failures.is_empty(), "accept did fail with EMFILE");
    // A spinning loop would use a whole core; the 20 ms backoff allows about
    // 50 failed accepts per second.
    assert!(out.cpu < out.window / 4, "{:?} CPU in {:?}", out.cpu, out.window);
    let most = (out.window + out.recovered).as_millis() as usize / 20 + 5;
    assert!(
        failures.len() <= most,
        "{} failed accepts (at most {most})",
        failures.len()
    );
    let bound = (out.window + out.recovered).as_secs() as usize + 2;
    assert!(warns.len() <= bound, "{} WARN lines (bound {bound})", warns.len());
}
