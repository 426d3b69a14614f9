//! Quick runs of every benchmark command, each checked for the series and
//! fields its output must contain: `m8d bench p2p` and `m8d bench
//! collectives` write their plots (SVG; any other file name is refused before
//! running) and JSON, `m8d bench join` its quantiles, `m8d bench worlds` both
//! rates and their ratio, `m8d bench failover` a kill and a freeze with their
//! detection times, `m8d bench store` round trips, wake-ups and host deaths.
//! Piped, none of them draws a progress bar or colour.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::process::Command;

use multiworld_testkit::process;

/// Runs `m8d ARGS` with its output piped, as CI and scripts do: no progress
/// bar and no colour may reach either stream then. Benchmarks without a
/// fault (all but `failover`) end their worlds in an orderly way, which logs
/// no warning.
fn m8d(args: &[&str]) -> String {
    let out = process::run(Command::new(env!("CARGO_BIN_EXE_m8d")).args(args));
    assert!(out.success(), "m8d {args:?}:\n{}\n{}", out.stdout, out.stderr);
    for (name, text) in [("stdout", &out.stdout), ("stderr", &out.stderr)] {
        assert!(
            !text.contains('\u{1b}') && !text.contains("[00:"),
            "m8d {args:?} drew a progress bar or colour on a piped {name}:\n{text}"
        );
    }
    if !args.contains(&"failover") {
        assert!(
            !out.stderr.contains(" WARN ") && !out.stderr.contains(" ERROR "),
            "m8d {args:?} warned without a fault:\n{}",
            out.stderr
        );
    }
    out.stdout
}

fn tmp(name: &str) -> std::path::PathBuf {
    let dir =
        std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("plots-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

#[test]
fn the_collectives_benchmark_plots_bus_bandwidth_with_the_raw_floor() {
    let (svg, json) = (tmp("collectives.svg"), tmp("collectives.json"));
    let out = m8d(&[
        "bench",
        "collectives",
        "--quick",
        "--ops",
        "all_reduce,broadcast",
        "--ranks",
        "2",
        "--plot",
        svg.to_str().unwrap(),
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(out.contains(&format!("wrote {}", svg.display())), "{out}");
    let svg = std::fs::read_to_string(&svg).unwrap();
    assert!(svg.starts_with("<svg"), "not an SVG");
    for label in ["all_reduce x2", "broadcast x2", "raw TCP floor x2", "busbw GB/s"] {
        assert!(svg.contains(label), "no {label:?} in the plot");
    }
    let rows: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert!(rows.iter().any(|r| r["op"] == "all_reduce" && r["ranks"] == 2));
    assert!(
        rows.iter().all(|r| r["busbw_gbps"].as_f64().unwrap() > 0.0),
        "{rows:?}"
    );
}

#[test]
fn the_p2p_benchmark_plots_against_raw_tcp() {
    let svg = tmp("p2p.svg");
    let out = m8d(&["bench", "p2p", "--quick", "--plot", svg.to_str().unwrap()]);
    assert!(out.contains(&format!("wrote {}", svg.display())), "{out}");
    let svg = std::fs::read_to_string(&svg).unwrap();
    for label in ["multiworld", "raw TCP (same run)", "GB/s"] {
        assert!(svg.contains(label), "no {label:?} in the plot");
    }
}

#[test]
fn the_join_benchmark_reports_quantiles() {
    let json = tmp("join.json");
    let out = m8d(&["bench", "join", "--rounds", "5", "--json", json.to_str().unwrap()]);
    assert!(
        out.contains("joining a world of 2 on loopback (5 rounds): median"),
        "{out}"
    );
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(v["rounds"], 5);
    let (median, max) = (v["median_us"].as_f64().unwrap(), v["max_us"].as_f64().unwrap());
    assert!(median > 0.0 && median <= max, "{v}");
}

#[test]
fn a_plot_that_is_not_svg_is_refused_before_the_benchmark_runs() {
    for bench in ["p2p", "collectives"] {
        let png = tmp(&format!("{bench}.png"));
        let out = process::run(Command::new(env!("CARGO_BIN_EXE_m8d")).args([
            "bench",
            bench,
            "--quick",
            "--plot",
            png.to_str().unwrap(),
        ]));
        assert!(!out.success(), "{bench}: {out:?}");
        assert!(
            out.stderr.contains("plots are written as SVG only") && out.stderr.contains(".png"),
            "{bench}: {}",
            out.stderr
        );
        assert!(out.stdout.is_empty(), "{bench} ran anyway: {}", out.stdout);
        assert!(!png.exists(), "{bench} wrote {}", png.display());
    }
}

fn read_json(path: &std::path::Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn num(v: &serde_json::Value, field: &str) -> f64 {
    v[field]
        .as_f64()
        .unwrap_or_else(|| panic!("no number {field:?} in {v}"))
}

#[test]
fn a_quick_worlds_benchmark_reports_both_rates_and_their_ratio() {
    let json = tmp("worlds.json");
    let out = m8d(&[
        "bench",
        "worlds",
        "--workers",
        "2",
        "--bytes",
        "4096",
        "--seconds",
        "0.5",
        "--repeats",
        "1",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(out.contains("K worlds ≥ 97 %"), "{out}");
    let v = read_json(&json);
    let rows = v.as_array().unwrap();
    assert_eq!(rows.len(), 1, "{v}");
    let row = &rows[0];
    assert_eq!(row["workers"], 2, "{v}");
    assert_eq!(row["bytes"], 4096, "{v}");
    let (multi, single, ratio) = (
        num(row, "multi_world_msgs_s"),
        num(row, "single_world_msgs_s"),
        num(row, "ratio"),
    );
    assert!(multi > 0.0 && single > 0.0, "{v}");
    assert!((ratio - multi / single).abs() < 1e-6 * ratio, "{v}");
    // Both setups move the same traffic on the same machine: a ratio far
    // from 1 means one of them did not run. Generous: a busy machine swings.
    assert!(ratio > 0.05 && ratio < 20.0, "{v}");
}

#[test]
fn a_quick_failover_benchmark_reports_a_kill_and_a_freeze() {
    let json = tmp("failover.json");
    let out = m8d(&[
        "bench",
        "failover",
        "--workers",
        "2",
        "--bytes",
        "4096",
        "--rounds",
        "1",
        "--window",
        "0.5",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(
        out.contains("workers' exit codes at the end: [Some(0), Some(0)]"),
        "{out}"
    );
    let v = read_json(&json);
    assert_eq!(v["workers"], 2, "{v}");
    assert_eq!(v["bytes"], 4096, "{v}");
    let rounds = v["rounds"].as_array().unwrap();
    let faults: Vec<&str> = rounds.iter().map(|r| r["fault"].as_str().unwrap()).collect();
    assert_eq!(faults, ["kill (SIGKILL)", "freeze (SIGSTOP)"], "{v}");
    for r in rounds {
        let detect = num(r, "detect_ms");
        // Targets: 50 ms (kill), 1.25 s (freeze); bounds for a busy machine.
        assert!(detect > 0.0 && detect < 5_000.0, "{r}");
        for field in ["healthy_before_msgs_s", "healthy_after_msgs_s"] {
            let rates = r[field].as_array().unwrap();
            assert_eq!(rates.len(), 1, "one healthy world: {r}");
            assert!(rates[0].as_f64().unwrap() > 0.0, "{r}");
        }
        assert!(num(r, "healthy_ratio_min") > 0.0, "{r}");
        let pause = num(r, "healthy_max_pause_ms");
        assert!((0.0..5_000.0).contains(&pause), "{r}");
        assert!(r["cause"].as_str().unwrap().contains("w2"), "{r}");
    }
    // A frozen worker is only noticed when its heartbeats are overdue (1 s).
    assert!(num(&rounds[1], "detect_ms") >= 500.0, "{v}");
}

#[test]
fn a_quick_store_benchmark_reports_round_trips_wake_ups_and_host_death() {
    let json = tmp("store.json");
    let out = m8d(&[
        "bench",
        "store",
        "--clients",
        "1,4",
        "--iterations",
        "50",
        "--waiters",
        "16",
        "--rounds",
        "2",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(out.contains("one set releases 16 waiters"), "{out}");
    let v = read_json(&json);
    assert!(num(&v, "raw_tcp_rtt_median_us") > 0.0, "{v}");
    assert!(num(&v, "raw_tcp_rtt_one_core_median_us") > 0.0, "{v}");
    let trips = v["round_trips"].as_array().unwrap();
    // Each client count with each protocol, framed (the default) first.
    assert_eq!(trips.len(), 4, "{v}");
    let expected = [(1, "framed"), (1, "grpc"), (4, "framed"), (4, "grpc")];
    for (t, (clients, protocol)) in trips.iter().zip(expected) {
        assert_eq!(t["clients"], clients, "{v}");
        assert_eq!(t["protocol"], protocol, "{v}");
        assert_eq!(t["pairs"], clients * 50, "{v}");
        let (median, p99) = (num(t, "median_us"), num(t, "p99_us"));
        assert!(median > 0.0 && median <= p99 && p99 < 1e6, "{t}");
        assert!(num(t, "pairs_per_s") > 0.0, "{t}");
    }
    assert_eq!(v["wake_waiters"], 16, "{v}");
    for field in ["wake_last_ms", "host_death_ms"] {
        let times = v[field].as_array().unwrap();
        assert_eq!(times.len(), 2, "{field}: {v}");
        for t in times {
            let t = t.as_f64().unwrap();
            // Targets 50 and 100 ms; bounds for a busy machine.
            assert!((0.0..5_000.0).contains(&t), "{field}: {v}");
        }
    }
    assert!(num(&v["targets"], "host_death_ms") > 0.0, "{v}");
}
