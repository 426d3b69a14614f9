//! `cargo bench -p multiworld-bench --bench p2p`: runs [`multiworld_bench::p2p::p2p`]
//! and prints the table. Options (environment): `MW_BENCH_QUICK=1` for a short run,
//! `MW_BENCH_RUNTIME=multi:N` for an N-worker multi-thread runtime per rank
//! (default: a current-thread runtime per rank), `MW_BENCH_REPEATS=N`,
//! `MW_BENCH_SPIN_US=N` to set the ranks' `recv_spin` (0 disables spinning),
//! `MW_BENCH_SIZES=4,1024,...` for other message sizes (bytes).

use multiworld_bench::p2p::{P2pBenchConfig, RankRuntime, p2p_blocking};

fn main() -> anyhow::Result<()> {
    let mut cfg = if std::env::var_os("MW_BENCH_QUICK").is_some() {
        P2pBenchConfig::quick()
    } else {
        P2pBenchConfig::default()
    };
    if let Ok(rt) = std::env::var("MW_BENCH_RUNTIME") {
        cfg.runtime = match rt.strip_prefix("multi:") {
            Some(n) => RankRuntime::MultiThread(n.parse()?),
            None if rt == "current" => RankRuntime::CurrentThread,
            None => anyhow::bail!("MW_BENCH_RUNTIME must be `current` or `multi:N`"),
        };
    }
    if let Ok(us) = std::env::var("MW_BENCH_SPIN_US") {
        cfg.recv_spin = Some(std::time::Duration::from_micros(us.parse()?));
    }
    if let Ok(list) = std::env::var("MW_BENCH_SIZES") {
        cfg.sizes = list
            .split(',')
            .map(|s| s.trim().parse())
            .collect::<Result<_, _>>()?;
    }
    if let Ok(n) = std::env::var("MW_BENCH_REPEATS") {
        cfg.repeats = n.parse()?;
    }
    // `cargo bench` passes `--bench`; no other arguments are understood.
    let report = p2p_blocking(&cfg)?;
    println!("{report}");
    Ok(())
}
