//! Every example runs, in both launch styles where it has them, and prints
//! what it should. Each runs with a deadline (a hung example fails its test
//! with its output so far) and is killed, with everything it started, if its
//! test fails.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::process::Command;

use multiworld_testkit::process;

fn run(bin: &str, args: &[&str]) -> String {
    let out = process::run(Command::new(bin).args(args));
    assert!(
        out.success(),
        "{bin} {args:?} failed:\n{}\n{}",
        out.stdout,
        out.stderr
    );
    out.stdout
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
    let launch = m8d::launch::launch(m8d::launch::LaunchConfig {
        nproc: 2,
        master_addr: "127.0.0.1".into(),
        master_port: None,
        program: env!("CARGO_BIN_EXE_ring").into(),
        args: vec![],
        grace: std::time::Duration::from_secs(5),
    });
    // On expiry the launch is dropped and the runtime with it, which kills
    // the ranks (each is killed when its handle is dropped).
    let outcome = tokio::time::timeout(process::DEADLINE, launch)
        .await
        .unwrap_or_else(|_| {
            panic!(
                "the ring under the launcher still running after {:?}",
                process::DEADLINE
            )
        })
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

#[test]
fn the_cheatsheet_shows_every_collective_with_correct_values() {
    let out = run(env!("CARGO_BIN_EXE_cheatsheet"), &["--nproc", "4"]);
    for needle in [
        "[rank 3] BROADCAST (src=0)      rank 3: before [0.0, 0.0, 0.0]",
        "after [42.0, 43.0, 44.0]",
        "[rank 2] SCATTER (src=0)        rank 2: before [0.0, 0.0]                 after [20.0, 21.0]",
        "[rank 0] GATHER (dst=0)         rank 0: before [1.0]                      after [1.0, 2.0, 3.0, 4.0]",
        "[rank 0] REDUCE SUM (dst=0)     rank 0: before [1.0]                      after [10.0]",
        "[rank 1] ALL_REDUCE SUM         rank 1: before [2.0, 4.0]                 after [10.0, 20.0]",
        "[rank 3] REDUCE_SCATTER SUM     rank 3: before [4.0, 8.0, 12.0, 16.0]     after [40.0]",
        "[rank 1] ALL_TO_ALL             rank 1: before [10.0, 11.0, 12.0, 13.0]   after [1.0, 11.0, 21.0, 31.0]",
        "[rank 2] BARRIER                rank 2: passed",
    ] {
        assert!(out.contains(needle), "missing {needle:?} in:\n{out}");
    }
    assert!(!out.contains("WRONG"), "{out}");
}

#[test]
fn all_in_one_runs_every_operation_correctly() {
    let out = run(env!("CARGO_BIN_EXE_all_in_one"), &["--nproc", "3"]);
    for op in [
        "broadcast ",
        "broadcast_object",
        "all_reduce sum",
        "all_reduce Product",
        "all_reduce Min",
        "all_reduce Avg",
        "reduce sum (dst 0)",
        "all_gather ",
        "all_gather_into_tensor",
        "all_gather_object",
        "gather (dst 0)",
        "gather_object (dst 0)",
        "scatter (src 0)",
        "scatter_object (src 0)",
        "reduce_scatter (list)",
        "reduce_scatter_tensor",
        "all_to_all (list)",
        "all_to_all_single (uneven)",
        "barrier",
        "async all_reduce (handle)",
        "isend/irecv",
        "sub-group broadcast",
        "finish (world removed)",
    ] {
        assert!(out.contains(op), "no {op:?} in:\n{out}");
    }
    assert!(
        out.contains("[rank 1] reduce_scatter_tensor        rank 1: [18.0, 24.0]"),
        "{out}"
    );
    assert!(out.contains("[rank 2] all_to_all_single (uneven)   rank 2: [2.0, 2.0, 2.0, 102.0, 102.0, 102.0, 202.0, 202.0, 202.0]"), "{out}");
    assert!(!out.contains("WRONG"), "{out}");
}

#[test]
fn per_world_collectives_complete_and_a_lost_member_fails_only_its_world() {
    let out = run(env!("CARGO_BIN_EXE_per_world_collectives"), &[]);
    assert!(
        out.contains("world A: all 6 collectives completed with the right results"),
        "{out}"
    );
    assert!(
        out.contains("world B: all 6 collectives completed with the right results"),
        "{out}"
    );
    let out = run(env!("CARGO_BIN_EXE_per_world_collectives"), &["--kill", "B2"]);
    assert!(
        out.contains("world A: all 6 collectives completed with the right results"),
        "{out}"
    );
    // The leader's error names a lost member of world B: the killed rank 2, or
    // rank 1 when rank 1 noticed first and tore its side down. It comes from
    // the collective itself ("peer rank N lost") or from the world's watchdog
    // that aborted the world first ("world 'B' broken: rank N lost").
    let failure = out
        .lines()
        .find(|l| l.contains("world B: collectives failed:"))
        .unwrap_or_else(|| panic!("world B did not fail:\n{out}"));
    assert!(
        failure.contains("rank 2 lost") || failure.contains("rank 1 lost"),
        "{out}"
    );
    assert!(out.contains("only the world that lost a member failed"), "{out}");
}

/// The GPU example against the fake CUDA driver and NCCL of the test kit
/// (device memory is host memory), so it runs everywhere; on a GPU machine
/// it runs bare.
#[cfg(feature = "nccl")]
use multiworld_testkit::fake_nccl as fake;

#[cfg(feature = "nccl")]
fn run_gpu_example(env: &[(&str, &std::ffi::OsStr)], args: &[&str]) -> process::Ran {
    process::run(
        Command::new(env!("CARGO_BIN_EXE_gpu_worlds"))
            .args(args)
            .envs(env.iter().copied()),
    )
}

#[cfg(feature = "nccl")]
#[test]
fn gpu_worlds_runs_nccl_worlds_and_host_staged_tensors_and_an_abort_stays_in_its_world() {
    let (nccl, cuda) = fake::fake_libs();
    let env = [
        ("NCCL_LIBRARY", nccl.as_os_str()),
        ("CUDA_DRIVER_LIBRARY", cuda.as_os_str()),
    ];
    let out = run_gpu_example(&env, &["--abort", "gpu-a"]);
    let text = &out.stdout;
    assert!(out.success(), "{text}\n{}", out.stderr);
    for line in [
        "leader: gpu-a: device all_reduce correct",
        "leader: gpu-b: device all_reduce correct",
        "leader: staged: 4 MiB device tensor to the worker and its double back",
        "leader: gpu-a aborted and removed: world 'gpu-a' is broken: aborted by this process",
        "leader: gpu-b: its all_reduce completed correctly; only gpu-a is gone",
        "leader: done",
    ] {
        assert!(text.contains(line), "no {line:?} in:\n{text}");
    }
}

#[cfg(feature = "nccl")]
#[test]
fn gpu_worlds_without_nccl_says_why_and_exits_2() {
    let nowhere = std::ffi::OsStr::new("/nonexistent/libnccl.so.2");
    let out = run_gpu_example(&[("NCCL_LIBRARY", nowhere)], &[]);
    let err = &out.stderr;
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("NCCL is not available here") && err.contains("/nonexistent/libnccl.so.2"),
        "{err}"
    );
}
