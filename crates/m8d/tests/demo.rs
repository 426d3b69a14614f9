//! `m8d demo` runs to completion non-interactively and says everything
//! behaved: with a killed worker, a frozen one, and no fault; killed
//! outright, it leaves no worker behind, and neither does `m8d bench store`
//! when the reader of its output goes.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::{
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use multiworld_testkit::process::{self, Guard, KillOnPanic, Signal, all_gone, children_of};
use nix::{sys::signal::kill, unistd::Pid};

const M8D: &str = env!("CARGO_BIN_EXE_m8d");

fn demo(fault: &str) -> (bool, String) {
    let out = process::run(Command::new(M8D).args(["demo", "--after", "1", "--then", "1", "--fault", fault]));
    if !out.success() {
        eprintln!("stdout:\n{}\nstderr:\n{}", out.stdout, out.stderr);
    }
    (out.success(), out.stdout)
}

#[test]
fn the_demo_with_a_killed_worker() {
    let (ok, out) = demo("kill");
    assert!(ok);
    assert!(out.contains("SIGKILLed the worker of w2"), "{out}");
    assert!(out.contains("the leader detected it after"), "{out}");
    assert!(out.contains("a replacement worker joined w2"), "{out}");
    assert!(out.contains("everything behaved"), "{out}");
    // Not a terminal: plain lines, no cursor movement.
    assert!(!out.contains('\x1b'), "escape codes in plain output");
}

#[test]
fn the_demo_with_a_frozen_worker() {
    let (ok, out) = demo("freeze");
    assert!(ok);
    assert!(out.contains("SIGSTOPped"), "{out}");
    assert!(
        out.contains("silent for"),
        "the cause names the heartbeat timeout: {out}"
    );
    assert!(out.contains("everything behaved"), "{out}");
}

#[test]
fn the_demo_without_a_fault() {
    let (ok, out) = demo("none");
    assert!(ok);
    assert!(!out.contains(">>>"), "{out}");
    assert!(out.contains("everything behaved"), "{out}");
}

#[test]
fn a_demo_killed_outright_leaves_no_worker_behind_not_even_a_frozen_one() {
    // Run by a script that goes on (the process group stays alive, so the
    // kernel does not hang up and continue its stopped members, as it does
    // when the demo's own group is orphaned).
    let script = format!("'{M8D}' demo --after 1 --then 60 --fault freeze & echo demo $!; wait; sleep 30");
    let mut shell = Guard::spawn(
        Command::new("sh")
            .args(["-c", &script])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null()),
    );
    let rx = shell.stdout_lines();
    let mut lines = Vec::new();
    while !lines.iter().any(|l: &String| l.contains("SIGSTOPped")) {
        match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(line) => lines.push(line),
            Err(e) => panic!("waiting for the freeze ({e}): {lines:?}"),
        }
    }
    let demo: i32 = lines
        .iter()
        .find_map(|l| l.strip_prefix("demo "))
        .and_then(|p| p.trim().parse().ok())
        .unwrap_or_else(|| panic!("no pid of the demo: {lines:?}"));
    // The stop reaches every thread of the worker within moments of the
    // line (the demo thaws it about a second after the leader's detection).
    let deadline = Instant::now() + Duration::from_secs(2);
    let workers = loop {
        let workers = children_of(demo);
        if workers.iter().any(|&(_, state)| state == 'T') || Instant::now() > deadline {
            break workers;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let pids: Vec<i32> = workers.iter().map(|&(p, _)| p).collect();
    let _cleanup = KillOnPanic(pids.clone());
    assert!(
        workers.iter().any(|&(_, state)| state == 'T'),
        "no stopped worker among the demo's children: {workers:?}"
    );
    kill(Pid::from_raw(demo), Signal::SIGKILL).unwrap();
    all_gone(&pids, Duration::from_secs(10), "after the demo was SIGKILLed");
}

#[test]
fn a_benchmark_whose_output_is_cut_leaves_no_store_behind() {
    // `m8d bench store | head -1`: the benchmark dies of SIGPIPE at its
    // next line, with the `m8d store` it started still running.
    let mut bench = Guard::spawn(
        Command::new(M8D)
            .args(["bench", "store", "--iterations", "1000", "--clients", "1"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null()),
    );
    let out = bench.child().stdout.take().unwrap();
    let mut first = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(out), &mut first).unwrap();
    assert!(first.contains("store benchmark"), "{first}");
    let children: Vec<i32> = children_of(bench.pid().as_raw())
        .iter()
        .map(|&(p, _)| p)
        .collect();
    let _cleanup = KillOnPanic(children.clone());
    assert!(!children.is_empty(), "the benchmark's store is not its child");
    let status = bench.wait_within(process::DEADLINE, || first.clone());
    assert!(!status.success(), "the benchmark outlived its reader: {status:?}");
    all_gone(
        &children,
        Duration::from_secs(10),
        "after the benchmark died of SIGPIPE",
    );
}
