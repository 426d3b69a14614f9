//! Bad command-line values are usage errors: the built `m8d` exits 2 at once
//! with a message that names the flag and what is wrong, never a panic (exit
//! 101, "cannot convert float seconds to Duration") and never a connect that
//! retries a malformed address for the whole timeout.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;
use std::time::{Duration, Instant};

use multiworld_testkit::process;

/// How long one rejected command line may take (it should take milliseconds).
const LIMIT: Duration = Duration::from_secs(2);

/// Runs m8d with `args`, killing it (and failing the test) after [`LIMIT`];
/// returns exit code, stderr and how long it ran.
fn run(args: &[&str]) -> (Option<i32>, String, Duration) {
    let start = Instant::now();
    let out = process::run_within(Command::new(env!("CARGO_BIN_EXE_m8d")).args(args), LIMIT);
    let took = start.elapsed();
    (out.status.code(), out.stderr, took)
}

/// Asserts that `args` is refused as a usage error mentioning `flag` and `why`.
fn refused(args: &[&str], flag: &str, why: &str) {
    let (code, err, took) = run(args);
    println!(
        "m8d {args:?}: exit {code:?} in {took:?}: {}",
        err.lines().next().unwrap_or("")
    );
    assert!(!err.contains("panicked"), "m8d {args:?} panicked: {err}");
    assert_eq!(
        code,
        Some(2),
        "m8d {args:?}: expected a usage error, got {code:?}: {err}"
    );
    assert!(
        err.contains(flag),
        "m8d {args:?}: stderr does not name {flag}: {err}"
    );
    assert!(
        err.contains(why),
        "m8d {args:?}: stderr does not say {why:?}: {err}"
    );
}

#[test]
fn durations_out_of_range_are_usage_errors() {
    refused(
        &["kv", "--world", "w", "get", "k", "--timeout", "1e30"],
        "--timeout",
        "too long",
    );
    refused(
        &["kv", "--world", "w", "wait", "k", "--timeout", "inf"],
        "--timeout",
        "finite",
    );
    refused(
        &["kv", "--connect-timeout", "1e30", "--world", "w", "ping"],
        "--connect-timeout",
        "too long",
    );
    refused(&["demo", "--after=-1"], "--after", "negative");
    refused(&["demo", "--after", "nan"], "--after", "finite");
    refused(&["demo", "--after", "-1"], "--after", "negative");
    refused(&["demo", "--then", "soon"], "--then", "not a number");
    refused(
        &["launch", "--nproc", "1", "--grace=-1", "--", "true"],
        "--grace",
        "negative",
    );
    refused(
        &["launch", "--nproc", "2", "--master-port", "0", "--", "true"],
        "--master-port",
        "0 is not in 1..=65535",
    );
    refused(
        &["bench", "worlds", "--seconds", "1e300"],
        "--seconds",
        "too long",
    );
    refused(&["bench", "failover", "--window", "-2"], "--window", "negative");
}

#[test]
fn malformed_addresses_are_usage_errors() {
    for (addr, why) in [
        ("127.0.0.1", "no port"),
        ("127.0.0.1:abc", "bad port"),
        ("127.0.0.1:99999", "bad port"),
        ("127.0.0.1:0", "bad port"),
        ("::1:29400", "brackets"),
    ] {
        refused(&["kv", "--addr", addr, "--world", "w", "ping"], "--addr", why);
    }
    refused(
        &["worker", "--world", "w", "--store", "127.0.0.1:abc"],
        "--store",
        "bad port",
    );
    // A positional address too (`m8d status ADDR`), and its interval.
    refused(&["status", "127.0.0.1:70000"], "<ADDR>", "bad port");
    refused(&["status", "metrics.example"], "<ADDR>", "no port");
    refused(
        &["status", "127.0.0.1:9", "--interval", "-1"],
        "--interval",
        "negative",
    );
}

/// A command that prints results ends quietly when its output is closed
/// early (`m8d ... | head`), instead of panicking on the closed pipe.
#[test]
fn a_closed_output_ends_a_printing_command_quietly() {
    use std::io::Read;
    use std::process::Stdio;
    let ops: Vec<String> = (0..256)
        .map(|i| {
            format!(
                r#"{{"seq":{i},"kind":"send","peer":1,"tag":0,"bytes":4,"start_us":{i},"end_us":{},"outcome":"done"}}"#,
                i + 1
            )
        })
        .collect();
    let record = format!(
        r#"{{"world":"w","generation":1,"rank":0,"began_unix_ms":0,"taken_us":300,"reason":"test","dropped":0,"ops":[{}]}}"#,
        ops.join(",")
    );
    let file = std::env::temp_dir().join(format!("m8d-closed-pipe-{}.json", std::process::id()));
    std::fs::write(&file, record).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_m8d"))
        .arg("flight")
        .arg(&file)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Closed before anything is read.
    drop(child.stdout.take());
    let mut err = String::new();
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    let status = child.wait().unwrap();
    let _ = std::fs::remove_file(&file);
    assert!(!err.contains("panicked"), "{err}");
    assert_ne!(status.code(), Some(101), "{status:?}: {err}");
}

/// `m8d status` gives up on an endpoint that sends its answer's headers and
/// then stalls (a process frozen mid-answer): the bound covers the body too.
#[test]
fn status_gives_up_on_an_answer_that_stalls() {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    // The first scrape gets the headers and 9 of 100 bytes, then nothing
    // (the connection is held open until the test process ends).
    std::thread::spawn(move || {
        if let Ok((mut s, _)) = listener.accept() {
            let mut buf = [0u8; 1024];
            let _ = s.read(&mut buf);
            let _ = s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n# partial");
            std::thread::sleep(Duration::from_secs(60));
        }
    });
    let start = Instant::now();
    let out = process::run_within(
        Command::new(env!("CARGO_BIN_EXE_m8d")).args(["status", &addr.to_string()]),
        Duration::from_secs(18),
    );
    let took = start.elapsed();
    assert!(!out.status.success(), "{out:?}");
    assert!(out.stderr.contains("did not answer"), "{}", out.stderr);
    assert!(took < Duration::from_secs(16), "took {took:?}");
}
