//! `cargo bench -p multiworld-bench --bench collectives`: runs
//! [`multiworld_bench::collectives::collectives_bench_blocking`] and prints
//! the table. Options (environment): `MW_BENCH_QUICK=1` for a short run,
//! `MW_BENCH_RANKS=2,4` (world sizes), `MW_BENCH_OPS=all_reduce,broadcast,...`,
//! `MW_BENCH_SIZES=1024,...` (bytes), `MW_BENCH_REPEATS=N`,
//! `MW_BENCH_ALGO=auto|direct|ring|shm`, `MW_BENCH_SHM_PIECE=bytes`,
//! `MW_BENCH_SHM=0` (this process declines shared memory), `MW_BENCH_CHUNK=bytes`, `MW_BENCH_DEPTH=N`,
//! `MW_BENCH_RUNTIME=current|multi:N` (default: a current-thread runtime per rank).

use multiworld_bench::collectives::{BenchOp, CollectivesBenchConfig, collectives_bench_blocking};
use multiworld_bench::p2p::RankRuntime;
use multiworld_collectives::Algorithm;

fn list<T: std::str::FromStr>(s: &str) -> anyhow::Result<Vec<T>>
where
    T::Err: std::error::Error + Send + Sync + 'static,
{
    Ok(s.split(',').map(|x| x.trim().parse()).collect::<Result<_, _>>()?)
}

fn main() -> anyhow::Result<()> {
    let mut cfg = if std::env::var_os("MW_BENCH_QUICK").is_some() {
        CollectivesBenchConfig::quick()
    } else {
        CollectivesBenchConfig::default()
    };
    if let Ok(s) = std::env::var("MW_BENCH_RANKS") {
        cfg.world_sizes = list(&s)?;
    }
    if let Ok(s) = std::env::var("MW_BENCH_SIZES") {
        cfg.sizes = list(&s)?;
    }
    if let Ok(s) = std::env::var("MW_BENCH_REPEATS") {
        cfg.repeats = s.parse()?;
    }
    if let Ok(s) = std::env::var("MW_BENCH_OPS") {
        cfg.ops = s
            .split(',')
            .map(|o| BenchOp::parse(o.trim()).ok_or_else(|| anyhow::anyhow!("unknown op {o}")))
            .collect::<anyhow::Result<_>>()?;
    }
    if let Ok(s) = std::env::var("MW_BENCH_ALGO") {
        cfg.collective.algorithm = match s.as_str() {
            "auto" => Algorithm::Auto,
            "direct" => Algorithm::Direct,
            "ring" => Algorithm::Ring,
            "shm" => Algorithm::SharedMemory,
            _ => anyhow::bail!("MW_BENCH_ALGO must be auto, direct, ring or shm"),
        };
    }
    if let Ok(s) = std::env::var("MW_BENCH_SHM_PIECE") {
        cfg.collective.shm_piece_bytes = s.parse()?;
    }
    if let Ok(s) = std::env::var("MW_BENCH_SHM") {
        cfg.collective.shared_memory = s != "0";
    }
    if let Ok(s) = std::env::var("MW_BENCH_CHUNK") {
        cfg.collective.chunk_bytes = s.parse()?;
    }
    if let Ok(s) = std::env::var("MW_BENCH_DEPTH") {
        cfg.collective.pipeline_depth = s.parse()?;
    }
    if let Ok(rt) = std::env::var("MW_BENCH_RUNTIME") {
        cfg.runtime = match rt.strip_prefix("multi:") {
            Some(n) => RankRuntime::MultiThread(n.parse()?),
            None if rt == "current" => RankRuntime::CurrentThread,
            None => anyhow::bail!("MW_BENCH_RUNTIME must be `current` or `multi:N`"),
        };
    }
    // `cargo bench` passes `--bench`; no other arguments are understood.
    let report = collectives_bench_blocking(&cfg)?;
    println!("{report}");
    Ok(())
}
