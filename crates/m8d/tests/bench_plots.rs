//! Quick runs of the benchmark commands' outputs: `m8d bench p2p` and `m8d
//! bench collectives` write their plots (SVG) and JSON, `m8d bench join` its
//! quantiles; each checked for the series and fields it must contain.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::process::{Command, Stdio};

fn m8d(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_m8d"))
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "m8d {args:?}:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
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
