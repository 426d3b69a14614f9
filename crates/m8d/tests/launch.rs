//! `m8d launch`: the launcher environment, per-rank output prefixes (also of
//! output that is not UTF-8), the first failing rank's exit code, and
//! Ctrl-C, SIGTERM and SIGHUP forwarded to every rank (and everything it
//! started, which is killed after the grace period if it outlives its rank).
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::{
    process::{Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use multiworld_testkit::process::{self, Guard, KillOnPanic, all_gone, gone};
use nix::sys::signal::Signal;

const M8D: &str = env!("CARGO_BIN_EXE_m8d");

#[test]
fn every_rank_gets_the_launcher_environment_and_a_prefix() {
    let out = process::run(
        Command::new(M8D)
            .args(["launch", "--nproc", "3", "--master-port", "29555", "--"])
            .args([
                "sh",
                "-c",
                "echo rank=$RANK local=$LOCAL_RANK size=$WORLD_SIZE at=$MASTER_ADDR:$MASTER_PORT; echo oops >&2",
            ]),
    );
    assert!(out.success(), "{out:?}");
    let (stdout, stderr) = (&out.stdout, &out.stderr);
    for r in 0..3 {
        assert!(
            stdout.contains(&format!(
                "[rank {r}] rank={r} local={r} size=3 at=127.0.0.1:29555"
            )),
            "{stdout}"
        );
        assert!(stderr.contains(&format!("[rank {r}] oops")), "{stderr}");
    }
}

#[test]
fn the_first_failing_rank_decides_the_exit_code_and_stops_the_others() {
    let started = Instant::now();
    let out = process::run(
        Command::new(M8D)
            .args(["launch", "--nproc", "3", "--grace", "2", "--"])
            .args(["sh", "-c", "if [ $RANK = 1 ]; then exit 7; fi; sleep 60"]),
    );
    assert_eq!(out.status.code(), Some(7), "{out:?}");
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "the other ranks were not stopped"
    );
}

/// A rank whose output is not UTF-8 keeps running and printing: its lines
/// come through with U+FFFD for the bytes, and nothing is cut off.
#[test]
fn output_that_is_not_utf8_is_printed_and_the_rank_is_not_cut_off() {
    // About 110 KB after the bad line: more than a pipe holds, so a launcher
    // that stopped reading would kill the rank with SIGPIPE.
    let out = process::run(
        Command::new(M8D)
            .args(["launch", "--nproc", "1", "--"])
            .args([
                "sh",
                "-c",
                r#"printf 'bad \377 byte\n'; printf 'err \376\n' >&2; i=0; while [ $i -lt 20000 ]; do echo $i; i=$((i+1)); done; echo done"#,
            ]),
    );
    assert!(out.success(), "{:?} {}", out.status, out.stderr);
    assert!(
        out.stdout.contains("[rank 0] bad \u{fffd} byte"),
        "{}",
        &out.stdout[..200.min(out.stdout.len())]
    );
    assert!(out.stderr.contains("[rank 0] err \u{fffd}"), "{}", out.stderr);
    assert!(
        out.stdout.contains("[rank 0] 19999\n[rank 0] done"),
        "the output was cut off"
    );
}

/// Starts the launcher with 2 ranks running `script`, its stdout read line
/// by line on a thread into the returned channel.
fn launch_two(script: &str) -> (Guard, mpsc::Receiver<String>) {
    let mut launcher = Guard::spawn(
        Command::new(M8D)
            .args(["launch", "--nproc", "2", "--grace", "5", "--", "sh", "-c", script])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null()),
    );
    let rx = launcher.stdout_lines();
    (launcher, rx)
}

/// Receives lines until `n` of them end with `marker`.
fn wait_for_lines(rx: &mpsc::Receiver<String>, lines: &mut Vec<String>, marker: &str, n: usize) {
    while lines.iter().filter(|l| l.contains(marker)).count() < n {
        match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(line) => lines.push(line),
            Err(e) => panic!("waiting for {n} {marker:?} lines ({e}): {lines:?}"),
        }
    }
}

#[test]
fn ctrl_c_is_forwarded_to_every_rank() {
    let (mut launcher, rx) =
        launch_two("trap 'echo got-int; exit 3' INT; echo ready; while :; do sleep 0.05; done");
    // Both ranks are up once their "ready" lines came through.
    let mut lines = Vec::new();
    wait_for_lines(&rx, &mut lines, "ready", 2);
    launcher.signal(Signal::SIGINT);
    let status = launcher.wait_within(process::DEADLINE, || format!("{lines:?}"));
    // The reader ends when the launcher's stdout closes.
    while let Ok(line) = rx.recv_timeout(Duration::from_secs(10)) {
        lines.push(line);
    }
    assert_eq!(status.code(), Some(130), "{lines:?}");
    assert_eq!(
        lines.iter().filter(|l| l.ends_with("got-int")).count(),
        2,
        "{lines:?}"
    );
}

#[test]
fn sigterm_is_forwarded_to_every_rank_and_what_it_started() {
    // Each rank starts a grandchild and waits for it; neither handles
    // SIGTERM, so both die of it if it reaches the rank's process group.
    let (mut launcher, rx) = launch_two("sleep 300 & echo pids $$ $!; wait");
    let mut lines = Vec::new();
    let pids = pids_of(&rx, &mut lines);
    let _cleanup = KillOnPanic(pids.clone());
    assert!(pids.iter().all(|&p| !gone(p)), "a rank ended early: {lines:?}");

    launcher.signal(Signal::SIGTERM);
    let status = launcher.wait_within(process::DEADLINE, || format!("{lines:?}"));
    assert_eq!(
        status.code(),
        Some(143),
        "the launcher must exit 128 + SIGTERM after forwarding it ({status:?}): {lines:?}"
    );
    // The launcher reaped its ranks before exiting; the grandchildren die of
    // the same signal. Poll: an orphan's exit can take a moment to show.
    all_gone(&pids, Duration::from_secs(30), "after the launcher exited");
}

/// Reads the "pids" lines of both ranks (each rank's shell and the
/// background job it started).
fn pids_of(rx: &mpsc::Receiver<String>, lines: &mut Vec<String>) -> Vec<i32> {
    wait_for_lines(rx, lines, "pids ", 2);
    let pids: Vec<i32> = lines
        .iter()
        .filter_map(|l| l.split_once("pids "))
        .flat_map(|(_, p)| p.split_whitespace().map(|p| p.parse::<i32>().unwrap()))
        .collect();
    assert_eq!(pids.len(), 4, "{lines:?}");
    pids
}

/// Launches 2 ranks that each start a background job, sends the launcher
/// `sig`, and checks its exit code and that every rank and job is gone.
fn signal_ends_ranks_and_what_they_started(sig: Signal, code: i32) {
    let (mut launcher, rx) = launch_two("sleep 300 & echo pids $$ $!; wait");
    let mut lines = Vec::new();
    let pids = pids_of(&rx, &mut lines);
    let _cleanup = KillOnPanic(pids.clone());
    launcher.signal(sig);
    let status = launcher.wait_within(process::DEADLINE, || format!("{lines:?}"));
    assert_eq!(status.code(), Some(code), "{sig}: {lines:?}");
    // The launcher exits only once its ranks' process groups are empty.
    all_gone(&pids, Duration::from_secs(10), "after the launcher exited");
}

/// Ctrl-C ends each rank's shell, but its background job ignores SIGINT (a
/// shell starts `&` jobs so): the launcher kills it once the grace period
/// (5 s) is over, instead of leaving it running.
#[test]
fn what_a_rank_started_and_outlives_it_is_killed_after_the_grace_period() {
    signal_ends_ranks_and_what_they_started(Signal::SIGINT, 130);
}

/// A hangup (the terminal or ssh session gone) is forwarded like SIGTERM.
#[test]
fn sighup_is_forwarded_to_every_rank() {
    signal_ends_ranks_and_what_they_started(Signal::SIGHUP, 129);
}

/// The deadline every test here (and in demo.rs, bench_plots.rs,
/// store_process.rs and the examples' tests) puts on its child processes: a
/// hung child is killed, with what it started, and the test fails with the
/// output so far.
#[test]
fn a_hung_child_is_killed_at_its_deadline_and_its_test_fails_with_its_output() {
    let failed = std::panic::catch_unwind(|| {
        process::run_within(
            Command::new("sh").args(["-c", "sleep 300 & echo started $$ $!; wait"]),
            Duration::from_secs(2),
        )
    });
    let message = match failed {
        Ok(ran) => panic!("a child sleeping 300 s finished within 2 s: {ran:?}"),
        Err(e) => e.downcast::<String>().map(|s| *s).unwrap_or_default(),
    };
    assert!(message.contains("still running after 2s"), "{message}");
    let pids: Vec<i32> = message
        .lines()
        .find_map(|l| l.strip_prefix("started "))
        .unwrap_or_else(|| panic!("no output in the failure: {message}"))
        .split_whitespace()
        .map(|p| p.parse().unwrap())
        .collect();
    assert_eq!(pids.len(), 2, "{message}");
    let _cleanup = KillOnPanic(pids.clone());
    all_gone(&pids, Duration::from_secs(30), "after the test binary failed");
}
