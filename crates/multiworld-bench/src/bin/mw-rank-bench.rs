//! `mw-rank-bench`: the one-process-per-rank benchmark through the
//! `multiworld` facade, the Rust reference of `python -m multiworld_rs.bench`
//! (see the `ranks` module of `multiworld-bench`).
//!
//! ```text
//! mw-rank-bench run stream [--sizes 65536,1048576] [--quick]
//! mw-rank-bench run pingpong | leader [--n 2,4] | all-reduce [--n 2,4] | tcp-stream | tcp-pingpong
//! mw-rank-bench all [--quick]        # every scenario with its default sizes
//! ```
//!
//! Prints one JSON object per measurement on stdout.

use clap::{Parser, Subcommand};
use multiworld_bench::ranks::{self, Load, RankArgs, RunArgs, Scenario};

#[derive(Parser)]
#[command(
    name = "mw-rank-bench",
    about = "multiworld benchmark, one process per rank (JSON lines on stdout)"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run one scenario for each size (and each worker/process count).
    Run(RunArgs),
    /// Run every scenario with its default sizes.
    All {
        /// Small counts and sizes (the tests' setting); overrides the load.
        #[arg(long)]
        quick: bool,
        /// Every rank exits after this many seconds whatever happens.
        #[arg(long, default_value_t = 300)]
        deadline_s: u64,
        /// How much to move.
        #[command(flatten)]
        load: Load,
    },
    /// One rank of a scenario (started by `run`; not for direct use).
    #[command(hide = true)]
    Rank(RankArgs),
}

fn print(v: serde_json::Value) {
    println!("{v}");
}

fn main() {
    let cli = Cli::parse();
    let out = match cli.cmd {
        Cmd::Run(a) => ranks::run(&a, print),
        Cmd::All {
            quick,
            deadline_s,
            load,
        } => [
            Scenario::TcpStream,
            Scenario::Stream,
            Scenario::TcpPingpong,
            Scenario::Pingpong,
            Scenario::Leader,
            Scenario::AllReduce,
        ]
        .into_iter()
        .try_for_each(|scenario| {
            let a = RunArgs {
                scenario,
                sizes: Vec::new(),
                n: vec![2, 4],
                quick,
                deadline_s,
                read_ahead: multiworld::DEFAULT_READ_AHEAD,
                algorithm: ranks::AlgorithmArg::Auto,
                after_large: false,
                shm: ranks::ShmTuning::default(),
                load: load.clone(),
            };
            ranks::run(&a, print)
        }),
        Cmd::Rank(a) => ranks::rank_main(&a),
    };
    if let Err(e) = out {
        eprintln!("mw-rank-bench: {e}");
        std::process::exit(1);
    }
}
