//! `m8d`: multiworld's command-line tool.
//!
//! Module map:
//! - [`demo`]: `m8d demo`, the leader/worker demo with a live table and a
//!   real fault (the README's first command).
//! - [`store`]: `m8d store`, the standalone store server.
//! - [`kv`]: `m8d kv`, one store operation from the shell (debugging,
//!   scripts, tests).
//! - [`bench`]: `m8d bench`, the benchmarks (store round trips, wake-ups and
//!   host-death detection).
//! - [`secret`]: reading a world secret from a file or the environment.
//! - [`worker`]: `m8d worker`, one streaming member of one world as a real
//!   process (used by the demo and the fault-injection tests).

mod bench;
mod demo;
mod kv;
mod secret;
mod store;
mod worker;

use clap::{Parser, Subcommand};
use tracing_subscriber::EnvFilter;

/// multiworld: one process, many independent communication worlds.
#[derive(Parser)]
#[command(name = "m8d", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the leader/worker demo: worlds streaming on loopback, one worker
    /// killed or frozen, the others untouched, a replacement re-joining.
    Demo(demo::DemoArgs),
    /// Run a standalone store server that hosts the stores of many worlds.
    Store(store::StoreArgs),
    /// Run one operation against a world's store.
    Kv(kv::KvArgs),
    /// Join one world as a worker and stream to rank 0 until the world ends.
    #[command(hide = true)]
    Worker(worker::WorkerArgs),
    /// Run a benchmark and print its figures.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_from_env("RUST_LOG").unwrap_or_else(|_| EnvFilter::new("warn")))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async move {
        match cli.command {
            Command::Demo(args) => demo::run(args).await,
            Command::Store(args) => store::run(args).await,
            Command::Kv(args) => kv::run(args).await,
            Command::Bench(cmd) => bench::run(cmd).await,
            Command::Worker(args) => worker::run(args).await,
        }
    })
}
