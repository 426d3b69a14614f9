//! `m8d worker`: one member of one world, as a real process, for the demo and
//! the fault-injection tests. It joins the world and streams checksummed
//! messages to rank 0 until the world ends (the leader left or broke it),
//! then exits 0. When the leader asks it to end its stream
//! ([`m8d::stream::request_end`]), or after `--seconds`, it stops, sends the
//! end-of-stream message carrying how many messages it sent (so the leader
//! can check it received every one), finishes the world together with the
//! leader (only when asked), and exits 0. Any other failure exits non-zero.
//! It prints how many it sent on stderr in every case.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::Context;
use clap::Args;
use m8d::stream::{end_requested, send_end, send_stream};
use multiworld::{Rank, WorldConfig, WorldError, WorldManager};

use crate::secret::SecretArgs;

/// Flags of `m8d worker`.
#[derive(Args, Debug)]
pub struct WorkerArgs {
    /// The world to join.
    #[arg(long)]
    pub world: String,
    /// This worker's rank (not 0: rank 0 is the leader).
    #[arg(long, default_value_t = 1)]
    pub rank: u32,
    /// Members of the world.
    #[arg(long, default_value_t = 2)]
    pub size: u32,
    /// The world's store, host:port.
    #[arg(long, value_parser = crate::args::host_port)]
    pub store: String,
    /// Bytes per message.
    #[arg(long, default_value_t = 65536)]
    pub bytes: usize,
    /// Stop after this many seconds (default: when the world ends).
    #[arg(long, value_parser = crate::args::seconds, allow_negative_numbers = true)]
    pub seconds: Option<Duration>,
    /// What to do: stream to rank 0, or all-reduce with every member forever.
    #[arg(long, value_enum, default_value_t = Mode::Stream)]
    pub mode: Mode,
    /// Elements (f32) per all-reduce in `--mode all-reduce`.
    #[arg(long, default_value_t = 1 << 20)]
    pub elements: usize,
    /// In `--mode all-reduce`, stop taking part at this round and hang (a
    /// rank that never answers, for fault-injection tests).
    #[arg(long)]
    pub stall_at_round: Option<u64>,
    /// How long joining may take, in seconds.
    #[arg(long, value_parser = crate::args::seconds, allow_negative_numbers = true, default_value = "30")]
    pub join_timeout: Duration,
    #[command(flatten)]
    pub secret: SecretArgs,
}

/// What a worker does once joined.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// Stream checksummed messages to rank 0.
    Stream,
    /// All-reduce (sum) with every member, checking every result exactly.
    AllReduce,
}

/// Joins and streams until the world ends.
pub async fn run(args: WorkerArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.rank != 0,
        "rank 0 is the leader; a worker needs another rank"
    );
    m8d::fleet::die_with_parent()?;
    let manager = WorldManager::default();
    let mut config = WorldConfig::new(&args.world, args.rank, args.size, &args.store)?;
    config.join_timeout = args.join_timeout;
    config.secret = args.secret.load()?;
    let world = manager.join(config).await.context("joining")?;
    eprintln!(
        "worker {} of {}: joined generation {}",
        args.rank,
        args.world,
        world.generation()
    );
    if args.mode == Mode::AllReduce {
        return all_reduce_forever(&world, args.elements, args.stall_at_round).await;
    }
    let asked = Arc::new(AtomicBool::new(false));
    let listener = {
        let (world, asked) = (world.clone(), Arc::clone(&asked));
        tokio::spawn(async move {
            if end_requested(&world, Rank(0)).await.is_ok() {
                asked.store(true, Ordering::Relaxed);
            }
        })
    };
    let until = args.seconds.map(|s| Instant::now() + s);
    let (sent, err) = send_stream(&world, Rank(0), args.bytes, || {
        asked.load(Ordering::Relaxed) || until.is_some_and(|u| Instant::now() >= u)
    })
    .await;
    let who = format!("worker {} of {}", args.rank, args.world);
    let err = match err {
        None => send_end(&world, Rank(0), args.bytes, sent).await.err(),
        Some(e) => Some(e),
    };
    let result = match err {
        None => {
            if asked.load(Ordering::Relaxed) {
                // The leader ends the world with us once it has the end.
                world
                    .finish(Duration::from_secs(30))
                    .await
                    .context("finishing the world with the leader")?;
            }
            eprintln!("{who}: sent {sent} messages, done");
            Ok(())
        }
        Some(WorldError::Broken { cause, .. }) => {
            eprintln!("{who}: sent {sent} messages; world ended: {cause}");
            Ok(())
        }
        Some(e) => {
            eprintln!("{who}: sent {sent} messages; failed: {e}");
            Err(e).context("streaming")
        }
    };
    listener.abort();
    manager.shutdown().await;
    result
}

/// All-reduces forever; returns when the world ends. A result that is not
/// exactly the expected sum is an error (exit code 1): a survivor must never
/// take a partial result for a complete one.
async fn all_reduce_forever(
    world: &multiworld::World,
    elements: usize,
    stall_at: Option<u64>,
) -> anyhow::Result<()> {
    let group = world.collectives();
    let size = world.size();
    let me = world.rank().0;
    for round in 0u64.. {
        if stall_at == Some(round) {
            eprintln!("worker {me} of {}: hanging at round {round}", world.name());
            std::future::pending::<()>().await;
        }
        let mut t = multiworld::Tensor::from_vec(
            vec![m8d::stream::all_reduce_value(me, round); elements],
            [elements],
        )?;
        match group.all_reduce(&mut t, multiworld::ReduceOp::Sum).await {
            Ok(()) => {
                let want = m8d::stream::all_reduce_sum(size, round);
                anyhow::ensure!(
                    t.as_slice::<f32>()?.iter().all(|&v| v == want),
                    "round {round}: a wrong all-reduce result (expected {want} everywhere)"
                );
            }
            Err(e) => {
                eprintln!(
                    "worker {me} of {}: all-reduce round {round} failed: {e}",
                    world.name()
                );
                // Let the world's break run its course (flight record
                // written, store told) before the process ends.
                let _ = tokio::time::timeout(Duration::from_secs(10), world.removed()).await;
                return Ok(());
            }
        }
    }
    Ok(())
}
