//! `m8d demo` runs to completion non-interactively and says everything
//! behaved: with a killed worker, a frozen one, and no fault.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::process::Command;

use multiworld_testkit::process;

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
