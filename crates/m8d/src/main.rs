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
    /// Run PROGRAM once per rank of this node with torchrun's variables
    /// (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
    /// MASTER_ADDR, MASTER_PORT); across machines, one launcher per node with
    /// --nnodes, --node-rank and --master-port. Exit with the first failing
    /// rank's code. Ctrl-C, SIGTERM, SIGHUP and SIGQUIT are forwarded to every
    /// rank (exit 128 + the signal: 130, 143, 129, 131).
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

/// Flags of `m8d launch` (torchrun's names; their underscore spellings,
/// `--nproc_per_node` and so on, are accepted too).
#[derive(clap::Args, Debug)]
struct LaunchArgs {
    /// Number of ranks to start on this node (`--nproc` is the same flag).
    #[arg(
        long = "nproc-per-node",
        visible_alias = "nproc",
        alias = "nproc_per_node",
        value_name = "P"
    )]
    nproc_per_node: u32,
    /// Number of nodes, each running one `m8d launch` with the same flags
    /// but its own --node-rank; the world has NNODES * P ranks.
    #[arg(long, default_value_t = 1)]
    nnodes: u32,
    /// This node's index, 0 to NNODES - 1: its ranks are NODE_RANK * P to
    /// NODE_RANK * P + P - 1. Node 0 runs rank 0, which hosts the world's
    /// store at MASTER_ADDR:MASTER_PORT.
    #[arg(long, alias = "node_rank", default_value_t = 0)]
    node_rank: u32,
    /// MASTER_ADDR for every rank: an address of node 0 (where rank 0 hosts
    /// the world's store) that every node reaches.
    #[arg(long, alias = "master_addr", default_value = "127.0.0.1")]
    master_addr: String,
    /// MASTER_PORT for every rank (default on a single node: a free port;
    /// required with more than one node).
    #[arg(long, alias = "master_port", value_parser = clap::value_parser!(u16).range(1..))]
    master_port: Option<u16>,
    /// The address of this node that its ranks listen on and publish to the
    /// others (MULTIWORLD_LISTEN_HOST). Default: each rank uses the address
    /// of its interface that reaches MASTER_ADDR; set it on a machine with
    /// several networks.
    #[arg(long, value_name = "IP")]
    node_addr: Option<std::net::IpAddr>,
    /// Seconds ranks (and what they started) get to stop, once asked
    /// (SIGTERM after a rank failed, or a forwarded signal), before SIGKILL.
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
/// For the commands that print results: restores the default action of
/// SIGPIPE, so that `m8d flight FILE | head` ends quietly when `head` has
/// what it wants, as other command-line tools do (Rust ignores SIGPIPE, and
/// `println!` then panics on the closed pipe). Not for `launch`, `store` and
/// `worker`, which must outlive a closed output (a launcher dying of it would
/// leave its ranks running).
fn end_quietly_on_a_closed_pipe() {
    use nix::sys::signal::{SigHandler, Signal, signal};
    // SAFETY: installs the default action, not a handler of ours, so no code
    // of ours can run in signal context.
    #[allow(unsafe_code)]
    let _ = unsafe { signal(Signal::SIGPIPE, SigHandler::SigDfl) };
}

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

impl LaunchArgs {
    /// Where this launcher sits among the nodes.
    fn nodes(&self) -> m8d::launch::Nodes {
        m8d::launch::Nodes {
            nnodes: self.nnodes,
            node_rank: self.node_rank,
            node_addr: self.node_addr,
        }
    }
}

fn main() -> anyhow::Result<()> {
    init_logging();
    let cli = Cli::parse();
    if matches!(
        cli.command,
        Command::Flight(_) | Command::Status(_) | Command::Kv(_) | Command::Bench(_) | Command::Demo(_)
    ) {
        end_quietly_on_a_closed_pipe();
    }
    if let Command::Launch(args) = &cli.command {
        // An impossible launch is a usage error (exit 2), like a bad value.
        if let Err(e) = args.nodes().check(args.nproc_per_node, args.master_port) {
            use clap::{CommandFactory, error::ErrorKind};
            let mut cmd = Cli::command();
            // Built, the subcommand knows its full name for the usage line.
            cmd.build();
            if let Some(launch) = cmd.find_subcommand_mut("launch") {
                launch.error(ErrorKind::ArgumentConflict, &e).exit();
            }
            cmd.error(ErrorKind::ArgumentConflict, e).exit();
        }
    }
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let code = runtime.block_on(async move {
        match cli.command {
            Command::Launch(args) => {
                let nodes = args.nodes();
                let mut command = args.command.into_iter();
                let program = command
                    .next()
                    .ok_or_else(|| anyhow::anyhow!("no program given"))?;
                let config = m8d::launch::LaunchConfig {
                    nproc: args.nproc_per_node,
                    master_addr: args.master_addr,
                    master_port: args.master_port,
                    program,
                    args: command.collect(),
                    grace: args.grace,
                };
                let outcome = m8d::launch::launch_nodes(config, nodes).await?;
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
