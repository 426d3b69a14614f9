//! The one-process-per-rank benchmark runs and prints well-formed results
//! (quick settings; no timing is checked: a benchmark is not a timed test).

use std::process::Command;

fn positive(v: &serde_json::Value, key: &str) -> bool {
    v[key].as_f64().is_some_and(|x| x.is_finite() && x > 0.0)
}

#[test]
fn every_scenario_runs_and_prints_json_lines() -> anyhow::Result<()> {
    let out = Command::new(env!("CARGO_BIN_EXE_mw-rank-bench"))
        .args(["all", "--quick", "--deadline-s", "120"])
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "mw-rank-bench all --quick failed: {stderr}");
    let lines: Vec<serde_json::Value> = String::from_utf8(out.stdout)?
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?;
    let scenarios: Vec<&str> = lines.iter().filter_map(|v| v["scenario"].as_str()).collect();
    for s in [
        "tcp_stream",
        "stream",
        "tcp_pingpong",
        "pingpong",
        "leader",
        "all_reduce",
    ] {
        assert!(scenarios.contains(&s), "no {s} result in {scenarios:?}");
    }
    // Leader and all-reduce: 2 and 4 processes each.
    assert_eq!(scenarios.iter().filter(|s| **s == "leader").count(), 2);
    assert_eq!(scenarios.iter().filter(|s| **s == "all_reduce").count(), 2);
    for v in &lines {
        assert_eq!(v["impl"], "rust", "{v}");
        assert!(positive(v, "size"), "{v}");
        let figures: &[&str] = match v["scenario"].as_str() {
            Some("pingpong" | "tcp_pingpong") => &["half_rtt_us", "half_rtt_us_p99", "rounds"],
            Some("all_reduce") => &["ms", "ms_min", "gb_per_s", "iters", "procs"],
            _ => &["gb_per_s", "msgs_per_s", "secs", "messages"],
        };
        for f in figures {
            assert!(positive(v, f), "{f} is not a positive number in {v}");
        }
    }
    Ok(())
}

#[test]
fn one_scenario_with_explicit_sizes() -> anyhow::Result<()> {
    let out = Command::new(env!("CARGO_BIN_EXE_mw-rank-bench"))
        .args(["run", "stream", "--quick", "--sizes", "4096,65536"])
        .output()?;
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let sizes: Vec<u64> = String::from_utf8(out.stdout)?
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).map(|v| v["size"].as_u64().unwrap_or(0)))
        .collect::<Result<_, _>>()?;
    assert_eq!(sizes, [4096, 65536]);
    Ok(())
}

/// `mw-rank-bench run ARGS --quick` (60-second deadline): its JSON lines,
/// after checking that it succeeded.
fn quick_run(args: &[&str]) -> anyhow::Result<Vec<serde_json::Value>> {
    let out = Command::new(env!("CARGO_BIN_EXE_mw-rank-bench"))
        .arg("run")
        .args(args)
        .args(["--quick", "--deadline-s", "60"])
        .output()?;
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8(out.stdout)?
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?)
}

/// The collectives' physical reference: one copy in one process.
#[test]
fn the_memory_copy_reference_runs_once_per_size() -> anyhow::Result<()> {
    let lines = quick_run(&["memcpy", "--sizes", "4096,65536"])?;
    assert_eq!(lines.len(), 2, "{lines:?}");
    for (v, size) in lines.iter().zip([4096, 65536]) {
        assert_eq!(v["scenario"], "memcpy", "{v}");
        assert_eq!(v["procs"], 1, "{v}");
        assert_eq!(v["size"], size, "{v}");
        assert!(v["iters"].as_u64() >= Some(20), "{v}");
        for f in ["ms", "ms_min", "gb_per_s"] {
            assert!(positive(v, f), "{f} is not a positive number in {v}");
        }
    }
    Ok(())
}

/// The collectives' copy floor: every process copies at once, for each
/// process count; the result is the faster of its two passes.
#[test]
fn the_copy_floor_runs_every_process_count() -> anyhow::Result<()> {
    let lines = quick_run(&["copy-floor", "--n", "1,3", "--sizes", "65536"])?;
    assert_eq!(lines.len(), 2, "{lines:?}");
    for (v, procs) in lines.iter().zip([1, 3]) {
        assert_eq!(v["scenario"], "copy_floor", "{v}");
        assert_eq!(v["procs"], procs, "{v}");
        assert_eq!(v["size"], 65536, "{v}");
        assert!(v["iters"].as_u64() >= Some(20), "{v}");
        for f in ["ms", "ms_plain", "ms_streaming"] {
            assert!(positive(v, f), "{f} is not a positive number in {v}");
        }
        let (plain, streaming) = (v["ms_plain"].as_f64(), v["ms_streaming"].as_f64());
        let best = plain.zip(streaming).map(|(p, s)| p.min(s));
        assert_eq!(v["ms"].as_f64(), best, "{v}");
    }
    Ok(())
}

#[test]
fn every_other_collective_runs_one_process_per_rank() -> anyhow::Result<()> {
    for (arg, name) in [
        ("broadcast", "broadcast"),
        ("reduce", "reduce"),
        ("all-gather", "all_gather"),
        ("reduce-scatter", "reduce_scatter"),
        ("all-to-all", "all_to_all"),
        ("gather", "gather"),
        ("scatter", "scatter"),
    ] {
        // 3 processes: uneven splits of the size are rounded as documented.
        let out = Command::new(env!("CARGO_BIN_EXE_mw-rank-bench"))
            .args([
                "run",
                arg,
                "--quick",
                "--n",
                "3",
                "--sizes",
                "4096",
                "--deadline-s",
                "120",
            ])
            .output()?;
        assert!(
            out.status.success(),
            "{arg}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_str(String::from_utf8(out.stdout)?.trim())?;
        assert_eq!(v["scenario"], name, "{v}");
        assert_eq!(v["procs"], 3, "{v}");
        assert_eq!(v["size"], 4096, "{v}");
        for f in ["ms", "ms_min", "gb_per_s", "iters"] {
            assert!(positive(&v, f), "{arg}: {f} is not a positive number in {v}");
        }
    }
    Ok(())
}

/// `--algorithm` picks the collectives' algorithm; the result says which.
/// `--after-large` sets the group's shared-memory segment up first.
#[test]
fn the_collectives_algorithm_can_be_chosen() -> anyhow::Result<()> {
    for algo in ["auto", "direct", "ring", "shm"] {
        let out = Command::new(env!("CARGO_BIN_EXE_mw-rank-bench"))
            .args(["run", "broadcast", "--quick", "--sizes", "4096", "--n", "2"])
            .args(["--algorithm", algo, "--deadline-s", "60"])
            .output()?;
        assert!(
            out.status.success(),
            "{algo}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_str(String::from_utf8(out.stdout)?.trim())?;
        assert_eq!(v["algorithm"], algo, "{v}");
        assert!(positive(&v, "ms"), "{v}");
    }
    // After one large all-reduce the group has its segment, and under Auto
    // the small calls use it; without, it is never set up.
    for (after_large, want) in [(true, "active"), (false, "untried")] {
        let out = Command::new(env!("CARGO_BIN_EXE_mw-rank-bench"))
            .args([
                "run",
                "all-reduce",
                "--quick",
                "--sizes",
                "4096",
                "--n",
                "2",
                "--deadline-s",
                "60",
            ])
            .args(after_large.then_some("--after-large"))
            .output()?;
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_str(String::from_utf8(out.stdout)?.trim())?;
        assert_eq!(v["shared_memory"], want, "after_large {after_large}: {v}");
        assert!(positive(&v, "ms"), "{v}");
    }
    let bad = Command::new(env!("CARGO_BIN_EXE_mw-rank-bench"))
        .args(["run", "broadcast", "--quick", "--algorithm", "fastest"])
        .output()?;
    assert!(!bad.status.success(), "an unknown algorithm must be refused");
    Ok(())
}
