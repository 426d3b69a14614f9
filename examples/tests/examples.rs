//! Every example runs, in both launch styles where it has them, and prints
//! what it should.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::process::{Command, Stdio};

fn run(bin: &str, args: &[&str]) -> String {
    let out = Command::new(bin)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{bin} {args:?} failed:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

#[test]
fn ring_spawns_its_own_ranks() {
    let out = run(env!("CARGO_BIN_EXE_ring"), &["--nproc", "3"]);
    for (rank, prev) in [(0, 2), (1, 0), (2, 1)] {
        assert!(
            out.contains(&format!(
                "[rank {rank}] rank {rank} of 3: received [{prev}.0, {prev}.0, {prev}.0, {prev}.0] from rank {prev}"
            )),
            "{out}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ring_runs_under_the_launcher() {
    let outcome = m8d::launch::launch(m8d::launch::LaunchConfig {
        nproc: 2,
        master_addr: "127.0.0.1".into(),
        master_port: None,
        program: env!("CARGO_BIN_EXE_ring").into(),
        args: vec![],
        grace: std::time::Duration::from_secs(5),
    })
    .await
    .unwrap();
    assert_eq!(outcome.code, 0);
    assert_eq!(outcome.first_failure, None);
}

#[test]
fn multi_world_without_and_with_a_kill() {
    let out = run(env!("CARGO_BIN_EXE_multi_world"), &[]);
    assert!(
        out.contains("w1 delivered 50 messages, w2 delivered 50 messages"),
        "{out}"
    );
    let out = run(env!("CARGO_BIN_EXE_multi_world"), &["--kill", "w1"]);
    assert!(out.contains("w1 broke after"), "{out}");
    assert!(out.contains("w2 delivered 50 messages"), "{out}");
    assert!(out.contains("w1's failure did not touch w2"), "{out}");
}

#[test]
fn single_world_shows_one_failure_breaking_the_group() {
    let out = run(env!("CARGO_BIN_EXE_single_world"), &[]);
    assert!(out.contains("one failure broke the whole group"), "{out}");
}

#[test]
fn serving_fails_over_and_takes_in_a_replacement() {
    let out = run(
        env!("CARGO_BIN_EXE_serving"),
        &["--requests", "200", "--kill-after", "60"],
    );
    assert!(out.contains("fails over"), "{out}");
    assert!(
        out.contains("a replacement joined worker-2 as generation"),
        "{out}"
    );
    assert!(out.contains("all 200 requests answered correctly"), "{out}");
    let out = run(env!("CARGO_BIN_EXE_serving"), &["--requests", "100"]);
    assert!(out.contains("all 100 requests answered correctly"), "{out}");
    assert!(!out.contains("fails over"), "{out}");
}
