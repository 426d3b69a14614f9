//! Every example runs, in both launch styles where it has them, and prints
//! what it should.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::process::{Command, Stdio};

fn run(bin: &str, args: &[&str]) -> (bool, String) {
    let out = Command::new(bin)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        eprintln!("{text}\n{}", String::from_utf8_lossy(&out.stderr));
    }
    (out.status.success(), text)
}

#[test]
fn ring_spawns_its_own_ranks() {
    let (ok, out) = run(env!("CARGO_BIN_EXE_ring"), &["--nproc", "3"]);
    assert!(ok);
    for (rank, prev) in [(0, 2), (1, 0), (2, 1)] {
        assert!(
            out.contains(&format!("[rank {rank}] rank {rank} of 3: received [{prev}.0, {prev}.0, {prev}.0, {prev}.0] from rank {prev}")),
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
