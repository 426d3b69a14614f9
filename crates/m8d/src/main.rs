//! `m8d`: multiworld's command-line tool.
//!
//! Module map:
//! - [`demo`]: `m8d demo`, the leader/worker demo with a live table and a
//!   real fault (the README's first command).
//! - [`store`]: `m8d store`, the standalone store server.
//! - [`kv`]: `m8d kv`, one store operation from the shell (debugging,
//!   scripts, tests).
//! - [`bench`]: `m8d bench`, the benchmarks: `store` (round trips, wake-ups,
//!   host-death detection), `failover` (detection of a killed and a frozen
//!   worker, the healthy worlds meanwhile), `p2p` and `collectives` (against
//!   raw TCP in the same run; `--plot FILE.svg`), `worlds` (K worlds against
//!   one), `join` (joining a world of 2).
//! - [`args`]: the value parsers every duration and address flag uses.
//! - [`secret`]: reading a world secret from a file or the environment.
//! - [`worker`]: `m8d worker`, one streaming member of one world as a real
//!   process (used by the demo and the fault-injection tests).
//!
//! `m8d launch` lives in the library ([`m8d::launch`]), with the fleet and
//! the checksummed streams the demo, the benchmarks and the tests share.

mod args;
mod bench;
mod demo;
mod kv;
mod observe;
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
    /// Run PROGRAM once per rank with RANK, LOCAL_RANK, WORLD_SIZE,
    /// MASTER_ADDR and MASTER_PORT set; exit with the first failing rank's
    /// code. Ctrl-C and SIGTERM are forwarded to every rank (exit 130 / 143).
    Launch(LaunchArgs),
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
    /// Print a flight record (what a world was doing when it broke, written
    /// to MULTIWORLD_FLIGHT_RECORDER_DIR) as a timeline.
    Flight(observe::FlightArgs),
    /// Show a process's worlds live from its metrics endpoint: state,
    /// generation, peers, rates, breaks and their causes.
    Status(observe::StatusArgs),
}

/// Flags of `m8d launch`.
#[derive(clap::Args, Debug)]
struct LaunchArgs {
    /// Number of ranks to start.
    #[arg(long)]
    nproc: u32,
    /// MASTER_ADDR for every rank (where rank 0 hosts the world's store).
    #[arg(long, default_value = "127.0.0.1")]
    master_addr: String,
    /// MASTER_PORT for every rank (default: a free port).
    #[arg(long)]
    master_port: Option<u16>,
    /// Seconds ranks get to stop, once asked (SIGTERM after a rank failed,
    /// or the forwarded Ctrl-C / SIGTERM), before SIGKILL.
    #[arg(long, value_parser = args::seconds, allow_negative_numbers = true, default_value = "5")]
    grace: std::time::Duration,
    /// The program and its arguments (after `--`).
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
    command: Vec<std::ffi::OsString>,
}

/// Logs go to stderr: human-readable, coloured only when stderr is a
/// terminal; `MULTIWORLD_LOG_FORMAT=json` writes one JSON object per line
/// instead (with the span fields: world, generation, rank). `RUST_LOG`
/// filters (default `warn`).
fn init_logging() {
    use std::io::IsTerminal;
    let filter = EnvFilter::try_from_env("RUST_LOG").unwrap_or_else(|_| EnvFilter::new("warn"));
    let json = std::env::var("MULTIWORLD_LOG_FORMAT").is_ok_and(|f| f.eq_ignore_ascii_case("json"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if json {
        builder
            .json()
            .with_current_span(true)
            .with_span_list(false)
            .init();
    } else {
        builder.with_ansi(std::io::stderr().is_terminal()).init();
    }
}

fn main() -> anyhow::Result<()> {
    init_logging();
    let cli = Cli::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let code = runtime.block_on(async move {
        match cli.command {
            Command::Launch(args) => {
                let mut command = args.command.into_iter();
                let program = command
                    .next()
                    .ok_or_else(|| anyhow::anyhow!("no program given"))?;
                let outcome = m8d::launch::launch(m8d::launch::LaunchConfig {
                    nproc: args.nproc,
                    master_addr: args.master_addr,
                    master_port: args.master_port,
                    program,
                    args: command.collect(),
                    grace: args.grace,
                })
                .await?;
                return Ok(outcome.code);
            }
            Command::Demo(args) => demo::run(args).await,
            Command::Store(args) => store::run(args).await,
            Command::Kv(args) => kv::run(args).await,
            Command::Bench(cmd) => bench::run(cmd).await,
            Command::Worker(args) => worker::run(args).await,
            Command::Flight(args) => observe::flight(&args),
            Command::Status(args) => observe::status(args).await,
        }
        .map(|()| 0)
    })?;
    drop(runtime);
    if code != 0 {
        std::process::exit(code);
    }
    Ok(())
}
