//! `m8d launch`: the launcher environment, per-rank output prefixes, the
//! first failing rank's exit code, and Ctrl-C forwarded to every rank.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::{
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use nix::{
    sys::signal::{Signal, kill},
    unistd::Pid,
};

const M8D: &str = env!("CARGO_BIN_EXE_m8d");

#[test]
fn every_rank_gets_the_launcher_environment_and_a_prefix() {
    let out = Command::new(M8D)
        .args(["launch", "--nproc", "3", "--master-port", "29555", "--"])
        .args([
            "sh",
            "-c",
            "echo rank=$RANK local=$LOCAL_RANK size=$WORLD_SIZE at=$MASTER_ADDR:$MASTER_PORT; echo oops >&2",
        ])
        .output()
        .unwrap();
    assert!(out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
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
    let status = Command::new(M8D)
        .args(["launch", "--nproc", "3", "--grace", "2", "--"])
        .args(["sh", "-c", "if [ $RANK = 1 ]; then exit 7; fi; sleep 60"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert_eq!(status.code(), Some(7));
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "the other ranks were not stopped"
    );
}

#[test]
fn ctrl_c_is_forwarded_to_every_rank() {
    let mut launcher = Command::new(M8D)
        .args(["launch", "--nproc", "2", "--grace", "5", "--"])
        .args([
            "sh",
            "-c",
            "trap 'echo got-int; exit 3' INT; echo ready; while :; do sleep 0.05; done",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = launcher.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        use std::io::{BufRead, BufReader};
        for line in BufReader::new(stdout).lines() {
            if tx.send(line.unwrap()).is_err() {
                break;
            }
        }
    });
    // Both ranks are up once their "ready" lines came through.
    let mut lines = Vec::new();
    while lines.iter().filter(|l: &&String| l.ends_with("ready")).count() < 2 {
        lines.push(
            rx.recv_timeout(Duration::from_secs(20))
                .expect("ranks never became ready"),
        );
    }
    kill(Pid::from_raw(launcher.id() as i32), Signal::SIGINT).unwrap();
    let status = launcher.wait().unwrap();
    reader.join().unwrap();
    lines.extend(rx.try_iter());
    assert_eq!(status.code(), Some(130), "{lines:?}");
    assert_eq!(
        lines.iter().filter(|l| l.ends_with("got-int")).count(),
        2,
        "{lines:?}"
    );
}
