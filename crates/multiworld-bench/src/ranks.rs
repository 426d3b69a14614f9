//! One process per rank: the benchmark as users run it, through the
//! `multiworld` facade (`WorldManager`, `World`), with each rank a process of
//! its own (threads of one process hide costs: one runtime, one allocator, no
//! scheduling between processes). The `mw-rank-bench` binary is this module's
//! command line; `python -m multiworld_rs.bench` runs it as the Rust
//! reference of the Python API and drives its own Python ranks with the same
//! protocol and the same scenarios.
//!
//! The parent ([`run`]) re-executes its own binary once per rank (`rank`
//! subcommand). Rank 0 starts first, hosts the store (or, for the raw-TCP
//! references, listens) on a free loopback port and prints
//! `{"addr": "127.0.0.1:PORT"}` on its first stdout line; the parent then
//! starts the other ranks with that address. Rank 0 (the receiver, the leader)
//! measures and prints one JSON object per measurement; the parent passes
//! them on, one per line, with the implementation and scenario named. Every
//! rank exits by itself after [`RankArgs::deadline_s`] at the latest.
//!
//! Scenarios ([`Scenario`]):
//! - `stream`: rank 1 sends `count` messages of `size` bytes to rank 0
//!   (bandwidth, messages per second);
//! - `pingpong`: rank 0 sends `size` bytes, rank 1 echoes (half round trip:
//!   median and 99th percentile in µs);
//! - `leader`: rank 0 joins `workers` separate worlds of two, one worker
//!   process per world; every worker streams to the leader at once (total
//!   messages per second and bandwidth);
//! - `all-reduce`: `procs` processes all-reduce a float32 tensor of `size`
//!   bytes (median time per call, after as many untimed calls:
//!   [`Load::all_reduce_warmup`]; also `ms_min`, `first_ms`, the first,
//!   untimed call, which sets up the group's shared memory if it uses it,
//!   and `shared_memory`, the group's segment after the calls);
//! - `broadcast`, `reduce`, `all-gather`, `reduce-scatter`, `all-to-all`,
//!   `gather`, `scatter`: the other collectives over `procs` processes, timed
//!   like `all-reduce` (`size` bytes per rank; see [`Scenario`] for each);
//!   `bench/collectives_side_by_side.py` runs them against gloo;
//! - `tcp-stream`, `tcp-pingpong`: the same traffic as `stream`/`pingpong`
//!   over a raw blocking TCP socket between two processes (the physical
//!   reference);
//! - `memcpy`: one copy of `size` bytes in one process; `copy-floor`:
//!   `procs` processes each copying `size` bytes at once, with no
//!   communication (the physical references of the collectives: see
//!   [`Scenario::CopyFloor`]).
//!
//! Tensors are float32 (a 4-byte ping-pong is one element).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use multiworld::{DType, Rank, ReduceOp, Tag, Tensor, World, WorldConfig, WorldManager};
use serde_json::{Value, json};

/// Data messages travel on this tag.
const DATA: Tag = Tag(0);
/// The leader's "go" message (start streaming) travels on this tag.
const GO: Tag = Tag(1);

/// The collectives' algorithm (`--algorithm`; the collective scenarios
/// only).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum AlgorithmArg {
    /// `Algorithm::Auto`, what users get.
    #[default]
    Auto,
    /// `Algorithm::Direct`.
    Direct,
    /// `Algorithm::Ring`.
    Ring,
    /// `Algorithm::SharedMemory` (at every size; the first call sets the
    /// segment up, and later calls also agree through it).
    Shm,
}

impl AlgorithmArg {
    fn algorithm(self) -> multiworld_collectives::Algorithm {
        use multiworld_collectives::Algorithm;
        match self {
            AlgorithmArg::Auto => Algorithm::Auto,
            AlgorithmArg::Direct => Algorithm::Direct,
            AlgorithmArg::Ring => Algorithm::Ring,
            AlgorithmArg::Shm => Algorithm::SharedMemory,
        }
    }

    fn name(self) -> &'static str {
        match self {
            AlgorithmArg::Auto => "auto",
            AlgorithmArg::Direct => "direct",
            AlgorithmArg::Ring => "ring",
            AlgorithmArg::Shm => "shm",
        }
    }
}

/// The scenarios of the one-process-per-rank benchmark.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Scenario {
    /// Rank 1 streams messages to rank 0.
    Stream,
    /// Rank 0 and rank 1 bounce one message.
    Pingpong,
    /// A leader receives from workers, each in its own world of two.
    Leader,
    /// All-reduce (sum) of a float32 tensor over every process.
    AllReduce,
    /// `stream` over a raw TCP socket (physical reference).
    TcpStream,
    /// `pingpong` over a raw TCP socket (physical reference).
    TcpPingpong,
    /// Broadcast of a float32 tensor of `size` bytes from rank 0.
    Broadcast,
    /// Reduce (sum) of a float32 tensor of `size` bytes to rank 0.
    Reduce,
    /// All-gather of every rank's `size` bytes into one tensor of `procs × size`.
    AllGather,
    /// Reduce-scatter (sum) of `size` bytes per rank: each keeps `size / procs`.
    ReduceScatter,
    /// All-to-all of `size` bytes per rank (`size / procs` to each).
    AllToAll,
    /// Gather of every rank's `size` bytes to rank 0.
    Gather,
    /// Scatter of `size` bytes to each rank from rank 0.
    Scatter,
    /// A copy of `size` bytes between two 64-byte aligned buffers in one
    /// process (physical reference for the collectives: what one copy in or
    /// out of shared memory costs at best).
    Memcpy,
    /// Every one of `procs` processes copies `size` bytes between its own
    /// buffers, all at once, with no communication (physical reference for
    /// the collectives whose processes together read and write at least
    /// `procs × size` bytes, e.g. an all-reduce, an all-to-all, a scatter or
    /// a gather: what moving those bytes once costs in the same minutes; the
    /// faster of a plain copy and the runtime's large copy).
    CopyFloor,
}

impl Scenario {
    /// The scenario's name in the JSON output (`all_reduce`, `tcp_stream`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Scenario::Stream => "stream",
            Scenario::Pingpong => "pingpong",
            Scenario::Leader => "leader",
            Scenario::AllReduce => "all_reduce",
            Scenario::TcpStream => "tcp_stream",
            Scenario::TcpPingpong => "tcp_pingpong",
            Scenario::Broadcast => "broadcast",
            Scenario::Reduce => "reduce",
            Scenario::AllGather => "all_gather",
            Scenario::ReduceScatter => "reduce_scatter",
            Scenario::AllToAll => "all_to_all",
            Scenario::Gather => "gather",
            Scenario::Scatter => "scatter",
            Scenario::Memcpy => "memcpy",
            Scenario::CopyFloor => "copy_floor",
        }
    }

    /// Whether this is a collective over every process (`--n` of them).
    pub fn is_collective(self) -> bool {
        matches!(
            self,
            Scenario::AllReduce
                | Scenario::Broadcast
                | Scenario::Reduce
                | Scenario::AllGather
                | Scenario::ReduceScatter
                | Scenario::AllToAll
                | Scenario::Gather
                | Scenario::Scatter
        )
    }

    /// How many processes run it, given the `workers`/`procs` setting.
    pub fn processes(self, n: u32) -> u32 {
        match self {
            Scenario::Leader => n + 1,
            Scenario::Memcpy => 1,
            Scenario::CopyFloor => n,
            s if s.is_collective() => n,
            _ => 2,
        }
    }
}

/// How much each measurement moves (shared by the parent and the ranks).
#[derive(Debug, Clone, clap::Args)]
pub struct Load {
    /// Bytes streamed per measurement (`stream`, `leader`: split among the
    /// workers); the message count is derived from it.
    #[arg(long, default_value_t = 1 << 30)]
    pub bytes: usize,
    /// Fewest messages per streaming measurement.
    #[arg(long, default_value_t = 100)]
    pub min_messages: usize,
    /// Round trips of a ping-pong measurement.
    #[arg(long, default_value_t = 20_000)]
    pub rounds: usize,
    /// All-reduce calls per measurement: at most this many...
    #[arg(long, default_value_t = 50)]
    pub max_iters: usize,
    /// ... and at least this many; between the two, as many as move
    /// `--bytes` (plus untimed warm-up calls: two for the other
    /// collectives, as many again for `all-reduce`).
    #[arg(long, default_value_t = 5)]
    pub min_iters: usize,
}

impl Load {
    /// The quick settings (for tests: it runs, nothing more).
    pub fn quick() -> Load {
        Load {
            bytes: 4 << 20,
            min_messages: 10,
            rounds: 200,
            max_iters: 3,
            min_iters: 2,
        }
    }

    /// Messages per streaming measurement of `size`-byte messages, split over `senders`.
    pub fn messages(&self, size: usize, senders: usize) -> usize {
        (self.bytes / senders.max(1) / size.max(1)).max(self.min_messages)
    }

    /// All-reduce calls per measurement of `size` bytes.
    pub fn iters(&self, size: usize) -> usize {
        (self.bytes / size.max(1)).clamp(self.min_iters, self.max_iters.max(self.min_iters))
    }

    fn warmup(&self, count: usize) -> usize {
        (count / 20).clamp(2, 200)
    }

    /// Untimed all-reduce calls before the `iters` timed ones (the Python
    /// package's benchmark makes as many): as many, at least two. The first
    /// calls after the processes start can run slower for a while: on the
    /// 2-core VM, in some runs the first ~200 all-reduces of 1 MiB over two
    /// processes took 80–110 µs each against 42 µs after, and a measurement
    /// of 400 calls (about 20 ms) then took its median there.
    pub fn all_reduce_warmup(iters: usize) -> usize {
        iters.max(2)
    }
}

/// One rank of a scenario (the hidden `rank` subcommand).
#[derive(Debug, Clone, clap::Args)]
pub struct RankArgs {
    /// What to run.
    #[arg(value_enum)]
    pub scenario: Scenario,
    /// This process's rank (0: receiver, leader, reporter).
    #[arg(long)]
    pub rank: u32,
    /// Workers (`leader`) or processes (`all-reduce`).
    #[arg(long, default_value_t = 2)]
    pub n: u32,
    /// Message or tensor size in bytes (a multiple of 4).
    #[arg(long)]
    pub size: usize,
    /// Where rank 0 hosts the store or listens (rank 0: `127.0.0.1:0`).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub addr: String,
    /// Exit (status 3) after this many seconds whatever happens.
    #[arg(long, default_value_t = 300)]
    pub deadline_s: u64,
    /// The worlds' `WorldConfig::read_ahead` in bytes.
    #[arg(long, default_value_t = multiworld::DEFAULT_READ_AHEAD)]
    pub read_ahead: usize,
    /// The collectives' algorithm.
    #[arg(long, value_enum, default_value_t)]
    pub algorithm: AlgorithmArg,
    /// One untimed large all-reduce first (see [`RunArgs::after_large`]).
    #[arg(long)]
    pub after_large: bool,
    /// The shared-memory settings to compare (default: the crate's).
    #[command(flatten)]
    pub shm: ShmTuning,
    /// How much to move.
    #[command(flatten)]
    pub load: Load,
}

/// What the parent runs.
#[derive(Debug, Clone, clap::Args)]
pub struct RunArgs {
    /// What to run.
    #[arg(value_enum)]
    pub scenario: Scenario,
    /// Sizes in bytes, comma-separated (defaults: 65536,1048576 for streams
    /// and the leader, 4 for ping-pong, 1048576,67108864 for all-reduce).
    #[arg(long, value_delimiter = ',')]
    pub sizes: Vec<usize>,
    /// Workers of the leader / processes of the all-reduce, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [2u32, 4])]
    pub n: Vec<u32>,
    /// Small counts and sizes (the tests' setting); overrides the load.
    #[arg(long)]
    pub quick: bool,
    /// Every rank exits after this many seconds whatever happens.
    #[arg(long, default_value_t = 300)]
    pub deadline_s: u64,
    /// The worlds' `WorldConfig::read_ahead` in bytes (the Python
    /// benchmark passes its package's default, to compare like with like).
    #[arg(long, default_value_t = multiworld::DEFAULT_READ_AHEAD)]
    pub read_ahead: usize,
    /// The collectives' algorithm (the collective scenarios; default: what
    /// users get).
    #[arg(long, value_enum, default_value_t)]
    pub algorithm: AlgorithmArg,
    /// The collective scenarios: one untimed all-reduce of
    /// [`AFTER_LARGE_BYTES`] before the timed calls, so that a group whose
    /// members share a host has its shared-memory segment set up, as in a
    /// program that also makes large calls (the result's `shared_memory`
    /// says whether it has).
    #[arg(long)]
    pub after_large: bool,
    /// The shared-memory settings to compare (default: the crate's).
    #[command(flatten)]
    pub shm: ShmTuning,
    /// How much to move.
    #[command(flatten)]
    pub load: Load,
}

/// The collectives' shared-memory settings a comparison may change
/// (shared by the parent and the ranks; `None`: the crate's default).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ShmTuning {
    /// The collectives' `CollectiveConfig::shm_spin` in µs, how long a
    /// member waiting at a shared-memory barrier checks between yields
    /// before it sleeps.
    #[arg(long)]
    pub shm_spin_us: Option<u64>,
    /// The collectives' `CollectiveConfig::shm_min_bytes`.
    #[arg(long)]
    pub shm_min_bytes: Option<usize>,
    /// The collectives' `CollectiveConfig::shm_piece_bytes`.
    #[arg(long)]
    pub shm_piece_bytes: Option<usize>,
    /// Threads that copy one large range through shared memory together,
    /// given to the ranks as `MULTIWORLD_SHM_COPY_THREADS` (the crate's
    /// default: a quarter of the CPUs, 1 to 4).
    #[arg(long)]
    pub copy_threads: Option<usize>,
}

impl ShmTuning {
    /// The settings given, as `(result field, value)`.
    fn given(&self) -> Vec<(&'static str, u64)> {
        [
            ("shm_spin_us", self.shm_spin_us),
            ("shm_min_bytes", self.shm_min_bytes.map(|b| b as u64)),
            ("shm_piece_bytes", self.shm_piece_bytes.map(|b| b as u64)),
            ("copy_threads", self.copy_threads.map(|k| k as u64)),
        ]
        .into_iter()
        .filter_map(|(name, v)| Some((name, v?)))
        .collect()
    }

    /// Whether a setting of the group's `CollectiveConfig` is given (the
    /// copy threads are the process's, not the group's).
    fn changes_config(&self) -> bool {
        self.shm_spin_us.is_some() || self.shm_min_bytes.is_some() || self.shm_piece_bytes.is_some()
    }

    /// `cfg` with the settings given applied.
    fn apply(
        &self,
        mut cfg: multiworld_collectives::CollectiveConfig,
    ) -> multiworld_collectives::CollectiveConfig {
        if let Some(us) = self.shm_spin_us {
            cfg = cfg.with_shm_spin(std::time::Duration::from_micros(us));
        }
        if let Some(b) = self.shm_min_bytes {
            cfg.shm_min_bytes = b;
        }
        if let Some(b) = self.shm_piece_bytes {
            cfg.shm_piece_bytes = b;
        }
        cfg
    }
}

/// The all-reduce of `--after-large`: above `CollectiveConfig::shm_min_bytes`
/// for any group size.
pub const AFTER_LARGE_BYTES: usize = 16 << 20;

/// The default sizes of a scenario.
pub fn default_sizes(scenario: Scenario, quick: bool) -> Vec<usize> {
    match (scenario, quick) {
        (Scenario::Pingpong | Scenario::TcpPingpong, _) => vec![4],
        (s, quick) if s.is_collective() || matches!(s, Scenario::Memcpy | Scenario::CopyFloor) => {
            if quick {
                vec![1 << 20]
            } else {
                vec![1 << 20, 64 << 20]
            }
        }
        (_, false) => vec![64 << 10, 1 << 20],
        (_, true) => vec![64 << 10],
    }
}

/// A benchmark error (a message for the user).
#[derive(Debug)]
pub struct BenchError(pub String);

impl std::fmt::Display for BenchError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for BenchError {}

fn err(e: impl std::fmt::Display) -> BenchError {
    BenchError(e.to_string())
}

/// Result of this module's functions.
pub type Result<T> = std::result::Result<T, BenchError>;

/// The parent: runs `args.scenario` for every size (and every `n`), one
/// process per rank, and calls `emit` with each measurement (a JSON object
/// naming `impl` = `"rust"`, the scenario, the size and the figures).
pub fn run(args: &RunArgs, mut emit: impl FnMut(Value)) -> Result<()> {
    let load = if args.quick {
        Load::quick()
    } else {
        args.load.clone()
    };
    let sizes = if args.sizes.is_empty() {
        default_sizes(args.scenario, args.quick)
    } else {
        args.sizes.clone()
    };
    let ns: Vec<u32> = match args.scenario {
        Scenario::Memcpy => vec![1],
        s if s == Scenario::Leader || s == Scenario::CopyFloor || s.is_collective() => args.n.clone(),
        _ => vec![2],
    };
    let exe = std::env::current_exe().map_err(|e| err(format!("cannot find this binary: {e}")))?;
    for &n in &ns {
        for &size in &sizes {
            let rank = RankArgs {
                scenario: args.scenario,
                rank: 0,
                n,
                size,
                addr: "127.0.0.1:0".into(),
                deadline_s: args.deadline_s,
                read_ahead: args.read_ahead,
                algorithm: args.algorithm,
                after_large: args.after_large,
                shm: args.shm.clone(),
                load: load.clone(),
            };
            let mut v = run_ranks(&exe, &rank)?;
            if let Value::Object(m) = &mut v {
                m.insert("impl".into(), json!("rust"));
                if args.scenario.is_collective() {
                    m.insert("algorithm".into(), json!(args.algorithm.name()));
                    m.insert("after_large".into(), json!(args.after_large));
                    for (name, v) in args.shm.given() {
                        m.insert(name.into(), json!(v));
                    }
                }
            }
            emit(v);
        }
    }
    Ok(())
}

fn rank_command(exe: &std::path::Path, a: &RankArgs, rank: u32, addr: &str) -> Command {
    let mut c = Command::new(exe);
    c.arg("rank")
        .arg(
            clap::ValueEnum::to_possible_value(&a.scenario)
                // Every variant has a name (none is skipped).
                .map(|v| v.get_name().to_string())
                .unwrap_or_default(),
        )
        .args(["--rank", &rank.to_string(), "--n", &a.n.to_string()])
        .args(["--size", &a.size.to_string(), "--addr", addr])
        .args(["--deadline-s", &a.deadline_s.to_string()])
        .args(["--read-ahead", &a.read_ahead.to_string()])
        .args(["--algorithm", a.algorithm.name()])
        .args(a.after_large.then_some("--after-large"))
        .args(
            a.shm
                .given()
                .into_iter()
                .map(|(name, v)| format!("--{}={v}", name.replace('_', "-"))),
        )
        .args(["--bytes", &a.load.bytes.to_string()])
        .args(["--min-messages", &a.load.min_messages.to_string()])
        .args(["--rounds", &a.load.rounds.to_string()])
        .args(["--max-iters", &a.load.max_iters.to_string()])
        .args(["--min-iters", &a.load.min_iters.to_string()])
        .stdin(Stdio::null());
    if let Some(k) = a.shm.copy_threads {
        c.env("MULTIWORLD_SHM_COPY_THREADS", k.to_string());
    }
    c
}

/// Kills (and reaps) the children still running when dropped.
struct Children(Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            if let Ok(None) = c.try_wait() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

/// Runs one measurement: rank 0 first, then the others once rank 0 has
/// printed its address; returns rank 0's result.
fn run_ranks(exe: &std::path::Path, a: &RankArgs) -> Result<Value> {
    let procs = a.scenario.processes(a.n);
    let mut children = Children(Vec::new());
    let mut first = rank_command(exe, a, 0, "127.0.0.1:0")
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| err(format!("cannot start rank 0 ({}): {e}", exe.display())))?;
    let out = first.stdout.take();
    children.0.push(first);
    let mut lines = BufReader::new(out.ok_or_else(|| err("rank 0 has no stdout"))?).lines();
    let mut next_json = |what: &str| -> Result<Value> {
        let line = lines
            .next()
            .ok_or_else(|| {
                err(format!(
                    "rank 0 of {} exited before printing {what}",
                    a.scenario.name()
                ))
            })?
            .map_err(err)?;
        serde_json::from_str(&line).map_err(|e| err(format!("rank 0 printed {line:?}: {e}")))
    };
    let hello = next_json("its address")?;
    let addr = hello["addr"]
        .as_str()
        .ok_or_else(|| err(format!("rank 0 printed {hello} instead of its address")))?
        .to_string();
    for r in 1..procs {
        let child = rank_command(exe, a, r, &addr)
            .stdout(Stdio::null())
            .spawn()
            .map_err(|e| err(format!("cannot start rank {r}: {e}")))?;
        children.0.push(child);
    }
    let result = next_json("its result")?;
    for (r, c) in children.0.iter_mut().enumerate() {
        let status = c.wait().map_err(err)?;
        if !status.success() {
            return Err(err(format!(
                "rank {r} of {} exited with {status}",
                a.scenario.name()
            )));
        }
    }
    Ok(result)
}

/// One rank: runs its part of the scenario; rank 0 prints its address, then
/// its result, as JSON lines on stdout.
pub fn rank_main(a: &RankArgs) -> Result<()> {
    if a.size == 0 || a.size % 4 != 0 {
        return Err(err(format!(
            "--size must be a positive multiple of 4, got {}",
            a.size
        )));
    }
    let deadline = Duration::from_secs(a.deadline_s);
    std::thread::spawn(move || {
        std::thread::sleep(deadline);
        eprintln!(
            "mw-rank-bench: a rank ran past its {}-second deadline; exiting",
            deadline.as_secs()
        );
        std::process::exit(3);
    });
    let result = match a.scenario {
        Scenario::TcpStream => tcp_stream(a)?,
        Scenario::TcpPingpong => tcp_pingpong(a)?,
        Scenario::Memcpy => memcpy(a),
        Scenario::CopyFloor => copy_floor(a)?,
        _ => {
            // The same runtime as the Python package's (2 to 8 workers).
            let threads = std::thread::available_parallelism().map_or(2, |n| n.get().clamp(2, 8));
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(threads)
                .enable_all()
                .build()
                .map_err(err)?;
            rt.block_on(world_rank(a))?
        }
    };
    if let Some(v) = result {
        say(&v);
    }
    Ok(())
}

fn say(v: &Value) {
    let mut out = std::io::stdout().lock();
    // A closed stdout (the parent gone) leaves nothing to report to.
    let _ = writeln!(out, "{v}");
    let _ = out.flush();
}

fn elements(size: usize) -> usize {
    size / 4
}

/// A receive buffer: float32 zeros (its pages are first touched by the
/// first message or call written into it, an untimed one).
fn buffer(size: usize) -> Result<Tensor> {
    Tensor::zeros(DType::F32, [elements(size)]).map_err(err)
}

/// What a rank sends or gives a collective: float32 ones, every page
/// written, as gloo's `torch.ones` are (why: [`crate::raw_ones`]).
fn ones(size: usize) -> Result<Tensor> {
    let mut t = buffer(size)?;
    t.as_mut_slice::<f32>().map_err(err)?.fill(1.0);
    Ok(t)
}

const FINISH: Duration = Duration::from_secs(60);

async fn world_rank(a: &RankArgs) -> Result<Option<Value>> {
    let m = WorldManager::default();
    let addr = if a.rank == 0 {
        let addr = m.serve_store(&a.addr).await.map_err(err)?.to_string();
        say(&json!({ "addr": addr }));
        addr
    } else {
        a.addr.clone()
    };
    let out = match a.scenario {
        Scenario::Stream => stream(&m, a, &addr).await,
        Scenario::Pingpong => pingpong(&m, a, &addr).await,
        Scenario::Leader => leader(&m, a, &addr).await,
        Scenario::AllReduce => all_reduce(&m, a, &addr).await,
        s if s.is_collective() => collective(&m, a, &addr).await,
        _ => Err(err("not a world scenario")),
    };
    m.shutdown().await;
    out
}

async fn join(m: &WorldManager, a: &RankArgs, name: &str, rank: u32, size: u32, addr: &str) -> Result<World> {
    let mut config = WorldConfig::new(name, rank, size, addr).map_err(err)?;
    config.read_ahead = a.read_ahead;
    m.join(config).await.map_err(err)
}

/// Rank 1's side of a stream to rank 0: `warm` untimed messages, then, on
/// rank 0's "go", the `count` measured ones.
async fn send_stream(w: &World, size: usize, warm: usize, count: usize) -> Result<()> {
    let data = ones(size)?;
    let mut go = buffer(4)?;
    for _ in 0..warm {
        w.send(Rank(0), DATA, &data).await.map_err(err)?;
    }
    w.recv(Rank(0), GO, &mut go).await.map_err(err)?;
    for _ in 0..count {
        w.send(Rank(0), DATA, &data).await.map_err(err)?;
    }
    Ok(())
}

/// Rank 0 receives the `warm` untimed messages of a stream.
async fn recv_warm(w: &World, buf: &mut Tensor, warm: usize) -> Result<()> {
    for _ in 0..warm {
        w.recv(Rank(1), DATA, buf).await.map_err(err)?;
    }
    Ok(())
}

async fn recv_count(w: &World, buf: &mut Tensor, count: usize) -> Result<()> {
    for _ in 0..count {
        w.recv(Rank(1), DATA, buf).await.map_err(err)?;
    }
    Ok(())
}

fn streamed(scenario: &str, size: usize, senders: u32, count: usize, secs: f64) -> Value {
    let total = count as u64 * u64::from(senders);
    json!({
        "scenario": scenario,
        "size": size,
        "senders": senders,
        "messages": total,
        "secs": secs,
        "msgs_per_s": total as f64 / secs,
        "gb_per_s": (total as f64) * size as f64 / secs / 1e9,
    })
}

async fn stream(m: &WorldManager, a: &RankArgs, addr: &str) -> Result<Option<Value>> {
    let (count, warm) = (
        a.load.messages(a.size, 1),
        a.load.warmup(a.load.messages(a.size, 1)),
    );
    let w = join(m, a, "stream", a.rank, 2, addr).await?;
    if a.rank == 1 {
        send_stream(&w, a.size, warm, count).await?;
        w.finish(FINISH).await.map_err(err)?;
        return Ok(None);
    }
    let mut buf = buffer(a.size)?;
    recv_warm(&w, &mut buf, warm).await?;
    let t0 = Instant::now();
    w.send(Rank(1), GO, &buffer(4)?).await.map_err(err)?;
    recv_count(&w, &mut buf, count).await?;
    let secs = t0.elapsed().as_secs_f64();
    w.finish(FINISH).await.map_err(err)?;
    Ok(Some(streamed("stream", a.size, 1, count, secs)))
}

/// Median and 99th percentile of `v` (sorted in place).
pub fn median_p99(v: &mut [f64]) -> (f64, f64) {
    if v.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    v.sort_by(f64::total_cmp);
    let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    (at(0.5), at(0.99))
}

fn bounced(scenario: &str, size: usize, rtts: &mut [f64]) -> Value {
    let (med, p99) = median_p99(rtts);
    json!({
        "scenario": scenario,
        "size": size,
        "rounds": rtts.len(),
        "half_rtt_us": med / 2.0 * 1e6,
        "half_rtt_us_p99": p99 / 2.0 * 1e6,
    })
}

async fn pingpong(m: &WorldManager, a: &RankArgs, addr: &str) -> Result<Option<Value>> {
    let rounds = a.load.rounds;
    let warm = a.load.warmup(rounds);
    let w = join(m, a, "pingpong", a.rank, 2, addr).await?;
    let mut buf = buffer(a.size)?;
    if a.rank == 1 {
        for _ in 0..warm + rounds {
            w.recv(Rank(0), DATA, &mut buf).await.map_err(err)?;
            w.send(Rank(0), DATA, &buf).await.map_err(err)?;
        }
        w.finish(FINISH).await.map_err(err)?;
        return Ok(None);
    }
    let data = ones(a.size)?;
    let mut rtts = Vec::with_capacity(rounds);
    for i in 0..warm + rounds {
        let t0 = Instant::now();
        w.send(Rank(1), DATA, &data).await.map_err(err)?;
        w.recv(Rank(1), DATA, &mut buf).await.map_err(err)?;
        if i >= warm {
            rtts.push(t0.elapsed().as_secs_f64());
        }
    }
    w.finish(FINISH).await.map_err(err)?;
    Ok(Some(bounced("pingpong", a.size, &mut rtts)))
}

async fn leader(m: &WorldManager, a: &RankArgs, addr: &str) -> Result<Option<Value>> {
    let count = a.load.messages(a.size, a.n as usize);
    let warm = a.load.warmup(count);
    if a.rank > 0 {
        let w = join(m, a, &format!("leader-{}", a.rank), 1, 2, addr).await?;
        send_stream(&w, a.size, warm, count).await?;
        w.finish(FINISH).await.map_err(err)?;
        return Ok(None);
    }
    let mut worlds = Vec::new();
    for i in 1..=a.n {
        worlds.push(join(m, a, &format!("leader-{i}"), 0, 2, addr).await?);
    }
    // Warm every world up, then give every worker "go" at once and receive
    // from all of them concurrently, one task per world.
    let mut bufs = Vec::new();
    for w in &worlds {
        let mut buf = buffer(a.size)?;
        recv_warm(w, &mut buf, warm).await?;
        bufs.push(buf);
    }
    let go = buffer(4)?;
    let t0 = Instant::now();
    for w in &worlds {
        w.send(Rank(1), GO, &go).await.map_err(err)?;
    }
    let mut tasks = Vec::new();
    for (w, mut buf) in worlds.iter().cloned().zip(bufs) {
        tasks.push(tokio::spawn(async move { recv_count(&w, &mut buf, count).await }));
    }
    for t in tasks {
        t.await.map_err(err)??;
    }
    let secs = t0.elapsed().as_secs_f64();
    for w in &worlds {
        w.finish(FINISH).await.map_err(err)?;
    }
    let mut v = streamed("leader", a.size, a.n, count, secs);
    v["workers"] = json!(a.n);
    Ok(Some(v))
}

/// The world's collectives with the algorithm of `--algorithm`, after the
/// untimed all-reduce of `--after-large`.
async fn group(w: &World, a: &RankArgs) -> Result<multiworld::Group> {
    let g = if a.algorithm == AlgorithmArg::Auto && !a.shm.changes_config() {
        w.collectives().clone()
    } else {
        let cfg = multiworld_collectives::CollectiveConfig::default().with_algorithm(a.algorithm.algorithm());
        w.collectives().with_config(a.shm.apply(cfg))
    };
    if a.after_large {
        g.all_reduce(&mut buffer(AFTER_LARGE_BYTES)?, ReduceOp::Sum)
            .await
            .map_err(err)?;
    }
    Ok(g)
}

/// The group's shared-memory state, for a timed collective's result
/// (`untried`, `active` or `unavailable`).
async fn segment_state(g: &multiworld::Group) -> &'static str {
    match g.shared_memory().await {
        multiworld::SharedMemory::Untried => "untried",
        multiworld::SharedMemory::Active { .. } => "active",
        _ => "unavailable",
    }
}

async fn all_reduce(m: &WorldManager, a: &RankArgs, addr: &str) -> Result<Option<Value>> {
    let iters = a.load.iters(a.size);
    let warm = Load::all_reduce_warmup(iters);
    let w = join(m, a, "all-reduce", a.rank, a.n, addr).await?;
    let g = group(&w, a).await?;
    let mut t = ones(a.size)?;
    let (mut times, mut first) = (Vec::with_capacity(iters), 0.0);
    for i in 0..warm + iters {
        let t0 = Instant::now();
        g.all_reduce(&mut t, ReduceOp::Sum).await.map_err(err)?;
        if i == 0 {
            first = t0.elapsed().as_secs_f64();
        } else if i >= warm {
            times.push(t0.elapsed().as_secs_f64());
        }
    }
    let segment = segment_state(&g).await;
    w.finish(FINISH).await.map_err(err)?;
    Ok((a.rank == 0).then(|| {
        let mut v = reduced(a.size, a.n, &mut times);
        v["shared_memory"] = json!(segment);
        v["first_ms"] = json!(first * 1e3);
        v
    }))
}

/// One of the other collectives (see [`Scenario`] for what `size` means
/// for each): two untimed calls, then `iters` timed ones.
async fn collective(m: &WorldManager, a: &RankArgs, addr: &str) -> Result<Option<Value>> {
    let iters = a.load.iters(a.size);
    let n = a.n as usize;
    let w = join(m, a, a.scenario.name(), a.rank, a.n, addr).await?;
    let g = group(&w, a).await?;
    let root = Rank(0);
    let is_root = a.rank == 0;
    let elems = elements(a.size);
    let part = (elems / n).max(1);
    // Inputs hold data (ones), outputs are zeros (see `ones`); each buffer
    // is allocated only for the scenarios that use it, so none is filled
    // in vain.
    let uses = |s: &[Scenario]| s.contains(&a.scenario);
    let zeros = |k: usize| Tensor::zeros(DType::F32, [k]).map_err(err);
    let per_rank = [
        Scenario::Broadcast,
        Scenario::Reduce,
        Scenario::AllGather,
        Scenario::Gather,
        Scenario::Scatter,
    ];
    let mut t = if uses(&per_rank) { ones(a.size)? } else { zeros(0)? };
    let mut big = zeros(if uses(&[Scenario::AllGather]) {
        n * elems
    } else {
        0
    })?;
    let mut small = zeros(if uses(&[Scenario::ReduceScatter]) { part } else { 0 })?;
    let evenly = uses(&[Scenario::ReduceScatter, Scenario::AllToAll]);
    let even_in = if evenly { ones(part * n * 4)? } else { zeros(0)? };
    let mut even_out = zeros(if uses(&[Scenario::AllToAll]) { part * n } else { 0 })?;
    // The root's outputs of a gather, its inputs of a scatter.
    let mut list = match a.scenario {
        Scenario::Scatter if is_root => (0..n).map(|_| ones(a.size)).collect::<Result<Vec<_>>>()?,
        Scenario::Gather if is_root => (0..n).map(|_| zeros(elems)).collect::<Result<Vec<_>>>()?,
        _ => Vec::new(),
    };
    let (mut times, mut first) = (Vec::with_capacity(iters), 0.0);
    for i in 0..2 + iters {
        let t0 = Instant::now();
        let r = match a.scenario {
            Scenario::Broadcast => g.broadcast(&mut t, root).await,
            Scenario::Reduce => g.reduce(&mut t, root, ReduceOp::Sum).await,
            Scenario::AllGather => g.all_gather_into_tensor(&mut big, &t).await,
            Scenario::ReduceScatter => g.reduce_scatter_tensor(&mut small, &even_in, ReduceOp::Sum).await,
            Scenario::AllToAll => g.all_to_all_single(&mut even_out, &even_in, None, None).await,
            Scenario::Gather => g.gather(&t, is_root.then_some(&mut list[..]), root).await,
            Scenario::Scatter => g.scatter(&mut t, is_root.then_some(&list[..]), root).await,
            _ => return Err(err("not a collective")),
        };
        r.map_err(err)?;
        if i == 0 {
            first = t0.elapsed().as_secs_f64();
        } else if i >= 2 {
            times.push(t0.elapsed().as_secs_f64());
        }
    }
    let segment = segment_state(&g).await;
    w.finish(FINISH).await.map_err(err)?;
    Ok(is_root.then(|| {
        let mut v = reduced(a.size, a.n, &mut times);
        v["scenario"] = json!(a.scenario.name());
        v["shared_memory"] = json!(segment);
        v["first_ms"] = json!(first * 1e3);
        v
    }))
}

fn reduced(size: usize, procs: u32, times: &mut [f64]) -> Value {
    let iters = times.len();
    let min = times.iter().copied().fold(f64::INFINITY, f64::min);
    let (med, _) = median_p99(times);
    json!({
        "scenario": "all_reduce",
        "size": size,
        "procs": procs,
        "iters": iters,
        "ms": med * 1e3,
        "ms_min": min * 1e3,
        "gb_per_s": size as f64 / med / 1e9,
    })
}

/// The two buffers of the copy references: a source holding a pattern
/// (every page written) and a destination.
fn copy_buffers(size: usize) -> (multiworld::Tensor, multiworld::Tensor) {
    let mut src = crate::raw_buffer(size);
    for (i, b) in src.bytes_mut().iter_mut().enumerate() {
        *b = (i % 251) as u8;
    }
    (src, crate::raw_buffer(size))
}

/// [`Scenario::Memcpy`]: timed like a collective (two untimed copies, then
/// at least 20), the median.
fn memcpy(a: &RankArgs) -> Option<Value> {
    say(&json!({ "addr": "" }));
    let iters = a.load.iters(a.size).max(20);
    let (src, mut dst) = copy_buffers(a.size);
    let mut times = Vec::with_capacity(iters);
    for i in 0..2 + iters {
        let t0 = Instant::now();
        dst.bytes_mut().copy_from_slice(src.as_bytes());
        std::hint::black_box(dst.as_bytes());
        if i >= 2 {
            times.push(t0.elapsed().as_secs_f64());
        }
    }
    let mut v = reduced(a.size, 1, &mut times);
    v["scenario"] = json!("memcpy");
    Some(v)
}

/// [`Scenario::CopyFloor`]: rank 0 listens, the others connect. Two passes,
/// a plain copy (`copy_from_slice`) and then the runtime's large copy
/// ([`multiworld_collectives::copy_large`]: non-temporal stores from 8 MiB
/// on, and split with the copy pool's threads on machines that have one,
/// 8 CPUs or more); each rank makes `iters` untimed copies, reports, waits
/// for rank 0's "go", makes `iters` timed copies and reports again. A
/// pass's time runs from rank 0's "go" to the last rank's report; the
/// result is the faster pass's time divided by `iters`: what one call
/// costs when every process copies at once.
fn copy_floor(a: &RankArgs) -> Result<Option<Value>> {
    let iters = a.load.iters(a.size).max(20);
    let (src, mut dst) = copy_buffers(a.size);
    let mut pass = |streaming: bool| {
        for _ in 0..iters {
            if streaming {
                multiworld_collectives::copy_large(dst.bytes_mut(), src.as_bytes());
            } else {
                dst.bytes_mut().copy_from_slice(src.as_bytes());
            }
            std::hint::black_box(dst.as_bytes());
        }
    };
    if a.rank != 0 {
        let mut s = TcpStream::connect(&a.addr).map_err(err)?;
        s.set_nodelay(true).map_err(err)?;
        for streaming in [false, true] {
            pass(streaming);
            let mut go = [0u8; 1];
            s.write_all(&[1]).map_err(err)?;
            s.read_exact(&mut go).map_err(err)?;
            pass(streaming);
            s.write_all(&[2]).map_err(err)?;
        }
        return Ok(None);
    }
    let l = TcpListener::bind(&a.addr).map_err(err)?;
    say(&json!({ "addr": l.local_addr().map_err(err)?.to_string() }));
    let mut peers = Vec::new();
    for _ in 1..a.n {
        let s = l.accept().map_err(err)?.0;
        s.set_nodelay(true).map_err(err)?;
        peers.push(s);
    }
    let mut per_call = [0.0f64; 2];
    for (k, streaming) in [false, true].into_iter().enumerate() {
        pass(streaming);
        let mut byte = [0u8; 1];
        for p in &mut peers {
            p.read_exact(&mut byte).map_err(err)?;
        }
        let t0 = Instant::now();
        for p in &mut peers {
            p.write_all(&[1]).map_err(err)?;
        }
        pass(streaming);
        for p in &mut peers {
            p.read_exact(&mut byte).map_err(err)?;
        }
        per_call[k] = t0.elapsed().as_secs_f64() / iters as f64;
    }
    let best = per_call[0].min(per_call[1]);
    Ok(Some(json!({
        "scenario": "copy_floor",
        "size": a.size,
        "procs": a.n,
        "iters": iters,
        "ms": best * 1e3,
        "ms_plain": per_call[0] * 1e3,
        "ms_streaming": per_call[1] * 1e3,
    })))
}

fn tcp_pair(a: &RankArgs) -> Result<TcpStream> {
    let s = if a.rank == 0 {
        let l = TcpListener::bind(&a.addr).map_err(err)?;
        say(&json!({ "addr": l.local_addr().map_err(err)?.to_string() }));
        l.accept().map_err(err)?.0
    } else {
        TcpStream::connect(&a.addr).map_err(err)?
    };
    s.set_nodelay(true).map_err(err)?;
    Ok(s)
}

fn tcp_stream(a: &RankArgs) -> Result<Option<Value>> {
    let (count, warm) = (
        a.load.messages(a.size, 1),
        a.load.warmup(a.load.messages(a.size, 1)),
    );
    let mut s = tcp_pair(a)?;
    // The sender's bytes hold data (see `ones`); the receiver's are zeros.
    let mut buf = if a.rank == 1 {
        crate::raw_ones(a.size)
    } else {
        crate::raw_buffer(a.size)
    };
    let mut go = [0u8; 1];
    if a.rank == 1 {
        for _ in 0..warm {
            s.write_all(buf.as_bytes()).map_err(err)?;
        }
        s.read_exact(&mut go).map_err(err)?;
        for _ in 0..count {
            s.write_all(buf.as_bytes()).map_err(err)?;
        }
        s.read_exact(&mut go).map_err(err)?;
        return Ok(None);
    }
    for _ in 0..warm {
        s.read_exact(buf.bytes_mut()).map_err(err)?;
    }
    let t0 = Instant::now();
    s.write_all(&go).map_err(err)?;
    for _ in 0..count {
        s.read_exact(buf.bytes_mut()).map_err(err)?;
    }
    let secs = t0.elapsed().as_secs_f64();
    s.write_all(&go).map_err(err)?;
    Ok(Some(streamed("tcp_stream", a.size, 1, count, secs)))
}

fn tcp_pingpong(a: &RankArgs) -> Result<Option<Value>> {
    let rounds = a.load.rounds;
    let warm = a.load.warmup(rounds);
    let mut s = tcp_pair(a)?;
    let mut buf = crate::raw_buffer(a.size);
    if a.rank == 1 {
        for _ in 0..warm + rounds {
            s.read_exact(buf.bytes_mut()).map_err(err)?;
            s.write_all(buf.as_bytes()).map_err(err)?;
        }
        return Ok(None);
    }
    let mut rtts = Vec::with_capacity(rounds);
    for i in 0..warm + rounds {
        let t0 = Instant::now();
        s.write_all(buf.as_bytes()).map_err(err)?;
        s.read_exact(buf.bytes_mut()).map_err(err)?;
        if i >= warm {
            rtts.push(t0.elapsed().as_secs_f64());
        }
    }
    Ok(Some(bounced("tcp_pingpong", a.size, &mut rtts)))
}
