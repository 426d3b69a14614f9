//! `m8d bench`: benchmarks that print a table, compare with the targets of
//! docs/benchmarks.md and can write JSON (`--json FILE`).
//!
//! - `store` runs a real `m8d store` child process on loopback and measures,
//!   from this process: set+get round trips with 1 and 64 concurrent clients
//!   (one connection each), median and p99 of one set followed by one get;
//!   one set releasing N clients waiting on one key (time from the set until
//!   the last waiter has its value); the store host's death (SIGKILL the
//!   server while calls are in flight, time until every one of them failed).
//! - `failover`: a leader in one world per `m8d worker` process; one worker
//!   is SIGKILLed, then frozen (SIGSTOP), in rounds: detection time and the
//!   healthy worlds' throughput and longest pause around each fault.
//! - `p2p` and `collectives`: streaming and every collective against raw TCP
//!   references measured in the same run; `--plot FILE.svg` draws them.
//! - `worlds`: a leader receiving from K workers in K worlds against the same
//!   traffic in one world of K + 1.
//! - `join`: joining a world of 2 on loopback.
//!
//! Every size, count and duration has a flag, so the tests run each one in
//! seconds (`crates/m8d/tests/bench_plots.rs`); the defaults are the full
//! benchmarks of docs/benchmarks.md.

use std::{
    io::{BufRead, BufReader},
    path::PathBuf,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use clap::{Args, Subcommand};
use multiworld_store::{ClientConfig, OpenOptions, StoreClient, WireProtocol, WorldStore};
use serde::Serialize;

/// The benchmarks.
#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Store round trips, wake-ups and host-death detection.
    Store(StoreBenchArgs),
    /// Detection time and the healthy worlds' throughput around a killed and
    /// a frozen worker.
    Failover(FailoverArgs),
    /// Point-to-point streaming (4 B to 256 MiB) and ping-pong against raw
    /// TCP references measured in the same run.
    P2p(P2pArgs),
    /// A leader's aggregate receive rate over K worlds (one worker each)
    /// against the same traffic over one world of K + 1 members.
    Worlds(WorldsArgs),
    /// Every collective, 1 KiB to 64 MiB, over 2 and 4 ranks: time,
    /// algorithm bandwidth and bus bandwidth.
    Collectives(CollectivesArgs),
    /// Joining a world of 2 on loopback: store, rendezvous, connections and
    /// handshake, both members in this process.
    Join(JoinArgs),
}

/// Flags of `m8d bench join`.
#[derive(Args, Debug)]
pub struct JoinArgs {
    /// Worlds joined (one after another, each finished before the next).
    #[arg(long, default_value_t = 200)]
    pub rounds: usize,
    /// Write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// Flags of `m8d bench collectives`.
#[derive(Args, Debug)]
pub struct CollectivesArgs {
    /// A quicker, smaller run.
    #[arg(long)]
    pub quick: bool,
    /// Only these operations (comma separated, e.g. all_reduce,broadcast).
    #[arg(long, value_delimiter = ',')]
    pub ops: Vec<String>,
    /// World sizes (comma separated).
    #[arg(long, value_delimiter = ',')]
    pub ranks: Vec<u32>,
    /// Write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Draw bus bandwidth against size, per operation and world size, with
    /// the raw TCP floor, as an SVG file (the name must end in `.svg`).
    #[arg(long, value_parser = svg_path)]
    pub plot: Option<PathBuf>,
}

/// Flags of `m8d bench p2p`.
#[derive(Args, Debug)]
pub struct P2pArgs {
    /// A quicker, smaller run (fewer bytes per size, one repeat).
    #[arg(long)]
    pub quick: bool,
    /// Write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Draw bandwidth against message size, with the raw TCP reference, as
    /// an SVG file (the name must end in `.svg`).
    #[arg(long, value_parser = svg_path)]
    pub plot: Option<PathBuf>,
}

/// Flags of `m8d bench worlds`.
#[derive(Args, Debug)]
pub struct WorldsArgs {
    /// Numbers of workers to compare (comma separated).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    pub workers: Vec<usize>,
    /// Message sizes in bytes (comma separated).
    #[arg(long, value_delimiter = ',', default_value = "65536,1048576")]
    pub bytes: Vec<usize>,
    /// Seconds measured per point.
    #[arg(long, value_parser = crate::args::seconds, allow_negative_numbers = true, default_value = "3")]
    pub seconds: Duration,
    /// Measurements per point, alternating the two setups; medians are
    /// reported (message rates on this VM are bimodal from run to run).
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// Flags of `m8d bench failover`.
#[derive(Args, Debug)]
pub struct FailoverArgs {
    /// Worker processes (one world each); the second one is the victim.
    #[arg(long, default_value_t = 3)]
    pub workers: usize,
    /// Bytes per message.
    #[arg(long, default_value_t = 65536)]
    pub bytes: usize,
    /// Kill-and-freeze rounds.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Serve the leader's metrics at this address (`GET /metrics`; watch
    /// with `m8d status ADDR --watch`).
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<std::net::SocketAddr>,
    /// Seconds of throughput measured before and after each fault.
    #[arg(long, value_parser = crate::args::seconds, allow_negative_numbers = true, default_value = "2")]
    pub window: Duration,
    /// Write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// Flags of `m8d bench store`.
#[derive(Args, Debug)]
pub struct StoreBenchArgs {
    /// Concurrent clients for the round-trip measurement (comma separated).
    #[arg(long, value_delimiter = ',', default_value = "1,64")]
    pub clients: Vec<usize>,
    /// set+get pairs per client.
    #[arg(long, default_value_t = 2000)]
    pub iterations: usize,
    /// Wire protocols of the round-trip measurement, each measured in turn
    /// (comma separated; the other measurements use the default, framed).
    #[arg(long, value_delimiter = ',', default_value = "framed,grpc")]
    pub protocols: Vec<BenchProtocol>,
    /// Clients waiting on one key for the wake-up measurement (at least 1).
    #[arg(long, default_value_t = 256, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub waiters: usize,
    /// Rounds of the wake-up and host-death measurements.
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    /// Write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// A store client's wire protocol, as the command line names it.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum BenchProtocol {
    /// The store's own framing (the default of every client).
    Framed,
    /// gRPC over HTTP/2.
    Grpc,
}

impl BenchProtocol {
    fn wire(self) -> WireProtocol {
        match self {
            BenchProtocol::Framed => WireProtocol::Framed,
            BenchProtocol::Grpc => WireProtocol::Grpc,
        }
    }

    fn name(self) -> &'static str {
        match self {
            BenchProtocol::Framed => "framed",
            BenchProtocol::Grpc => "grpc",
        }
    }
}

/// A `--plot` file name: plots are drawn as SVG only (plotters' bitmap
/// backend is not built in), so any other extension is refused while the
/// command line is parsed, before a benchmark runs, rather than writing SVG
/// into a file whose name says otherwise.
fn svg_path(s: &str) -> Result<PathBuf, String> {
    let path = PathBuf::from(s);
    match path.extension() {
        Some(ext) if ext.eq_ignore_ascii_case("svg") => Ok(path),
        _ => Err(format!(
            "plots are written as SVG only: give a file name ending in .svg (not '{s}')"
        )),
    }
}

/// Writes `value` as pretty JSON to `path`, if one was given, and says so.
fn write_json(path: Option<&std::path::Path>, value: &impl Serialize) -> anyhow::Result<()> {
    if let Some(path) = path {
        std::fs::write(path, serde_json::to_string_pretty(value)?)
            .with_context(|| format!("writing {}", path.display()))?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

/// Runs a benchmark.
pub async fn run(cmd: BenchCommand) -> anyhow::Result<()> {
    match cmd {
        BenchCommand::Store(args) => store(args).await,
        BenchCommand::Failover(args) => failover(args).await,
        BenchCommand::P2p(args) => p2p(args).await,
        BenchCommand::Worlds(args) => worlds(args).await,
        BenchCommand::Collectives(args) => collectives(args).await,
        BenchCommand::Join(args) => join(args).await,
    }
}

#[derive(Serialize)]
struct RoundTrip {
    protocol: &'static str,
    clients: usize,
    pairs: usize,
    median_us: f64,
    p99_us: f64,
    pairs_per_s: f64,
}

#[derive(Serialize)]
struct StoreReport {
    raw_tcp_rtt_median_us: f64,
    /// The same with both threads on one core.
    raw_tcp_rtt_one_core_median_us: f64,
    round_trips: Vec<RoundTrip>,
    wake_waiters: usize,
    wake_last_ms: Vec<f64>,
    host_death_ms: Vec<f64>,
    targets: Targets,
}

#[derive(Serialize)]
struct Targets {
    median_set_get_us: f64,
    wake_256_ms: f64,
    host_death_ms: f64,
}

/// A `m8d store` child process, killed when dropped.
struct StoreProcess {
    child: m8d::fleet::ChildProcess,
    addr: String,
}

impl StoreProcess {
    fn start() -> anyhow::Result<StoreProcess> {
        let exe = std::env::current_exe().context("finding m8d's own path")?;
        let mut child = m8d::fleet::ends_with_this_process(&mut Command::new(exe))
            .args(["store", "--bind", "127.0.0.1:0"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .context("starting m8d store")?;
        let stdout = child.stdout.take().context("store stdout")?;
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line)?;
        let child = m8d::fleet::ChildProcess::new(child);
        let Some(addr) = line.trim().strip_prefix("listening on ") else {
            bail!("m8d store said {line:?} instead of its address");
        };
        Ok(StoreProcess {
            addr: addr.to_string(),
            child,
        })
    }

    /// SIGKILLs the server and reaps it.
    fn kill(&mut self) -> anyhow::Result<()> {
        self.child.kill()
    }
}

async fn open(addr: &str, world: &str) -> anyhow::Result<WorldStore> {
    open_with(addr, world, WireProtocol::default()).await
}

async fn open_with(addr: &str, world: &str, protocol: WireProtocol) -> anyhow::Result<WorldStore> {
    let config = ClientConfig {
        protocol,
        ..ClientConfig::default()
    };
    let client = StoreClient::connect(addr, config).await?;
    let options = OpenOptions {
        create: true,
        ..OpenOptions::default()
    };
    Ok(client.open(world, options).await?)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let idx = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

/// Median round trip of 64-byte ping-pongs over one loopback TCP connection
/// between two threads with blocking sockets: the physical floor a store
/// round trip is compared against in the same run. With `one_core`, both
/// threads run on the first CPU the process may use (a wake-up there is a
/// switch on one core, which on a VM can cost a fraction of waking the other
/// core); otherwise the scheduler places them (usually on two cores).
fn raw_tcp_rtt(iterations: usize, one_core: bool) -> anyhow::Result<Duration> {
    use std::{
        io::{Read, Write},
        net::{TcpListener, TcpStream},
    };
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let cpu = if one_core { Some(first_cpu()?) } else { None };
    let echo = std::thread::spawn(move || -> std::io::Result<()> {
        if let Some(cpu) = &cpu {
            pin_to(cpu)?;
        }
        let (mut s, _) = listener.accept()?;
        s.set_nodelay(true)?;
        let mut buf = [0u8; 64];
        while s.read_exact(&mut buf).is_ok() {
            s.write_all(&buf)?;
        }
        Ok(())
    });
    if let Some(cpu) = &cpu {
        pin_to(cpu)?;
    }
    let mut s = TcpStream::connect(addr)?;
    s.set_nodelay(true)?;
    let mut buf = [7u8; 64];
    let mut samples = Vec::with_capacity(iterations);
    for _ in 0..iterations {
        let t = Instant::now();
        s.write_all(&buf)?;
        s.read_exact(&mut buf)?;
        samples.push(t.elapsed());
    }
    drop(s);
    echo.join()
        .map_err(|_| anyhow::anyhow!("echo thread panicked"))??;
    samples.sort();
    Ok(percentile(&samples, 0.5))
}

/// A set of one CPU: the first this process may run on.
fn first_cpu() -> std::io::Result<nix::sched::CpuSet> {
    use nix::{sched, unistd::Pid};
    let allowed = sched::sched_getaffinity(Pid::from_raw(0)).map_err(std::io::Error::from)?;
    let first = (0..nix::sched::CpuSet::count())
        .find(|&c| allowed.is_set(c).unwrap_or(false))
        .ok_or_else(|| std::io::Error::other("no CPU in this process's affinity mask"))?;
    let mut one = sched::CpuSet::new();
    one.set(first).map_err(std::io::Error::from)?;
    Ok(one)
}

/// Pins the calling thread to `cpu`.
fn pin_to(cpu: &nix::sched::CpuSet) -> std::io::Result<()> {
    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), cpu).map_err(std::io::Error::from)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

async fn round_trips(
    addr: &str,
    protocol: BenchProtocol,
    clients: usize,
    iterations: usize,
) -> anyhow::Result<RoundTrip> {
    let mut stores = Vec::with_capacity(clients);
    for _ in 0..clients {
        stores.push(open_with(addr, "bench-rtt", protocol.wire()).await?);
    }
    let started = Instant::now();
    let mut tasks = Vec::with_capacity(clients);
    for (c, w) in stores.into_iter().enumerate() {
        tasks.push(tokio::spawn(async move {
            let mut samples = Vec::with_capacity(iterations);
            let value = bytes::Bytes::from_static(&[7u8; 64]);
            for i in 0..iterations {
                let key = format!("c{c}-k{}", i % 64);
                let t = Instant::now();
                w.set(&key, value.clone()).await?;
                w.get(&key, Duration::from_secs(10)).await?;
                samples.push(t.elapsed());
            }
            anyhow::Ok(samples)
        }));
    }
    let mut all = Vec::with_capacity(clients * iterations);
    for t in tasks {
        all.extend(t.await??);
    }
    let wall = started.elapsed();
    all.sort();
    Ok(RoundTrip {
        protocol: protocol.name(),
        clients,
        pairs: all.len(),
        median_us: percentile(&all, 0.5).as_secs_f64() * 1e6,
        p99_us: percentile(&all, 0.99).as_secs_f64() * 1e6,
        pairs_per_s: all.len() as f64 / wall.as_secs_f64(),
    })
}

async fn wake(addr: &str, waiters: usize, round: usize) -> anyhow::Result<Duration> {
    let world = format!("bench-wake-{round}");
    let mut handles = Vec::with_capacity(waiters);
    for _ in 0..waiters {
        handles.push(open(addr, &world).await?);
    }
    let setter = open(addr, &world).await?;
    let mut tasks = Vec::with_capacity(waiters);
    for w in handles {
        tasks.push(tokio::spawn(async move {
            w.add("ready", 1).await?;
            w.get("go", Duration::from_secs(60)).await?;
            anyhow::Ok(Instant::now())
        }));
    }
    // Every waiter counts itself in just before its get. Then give the gets
    // a moment to reach the server: a get arriving after the set would find
    // the key and return at once, which could only flatter the figure, so the
    // pause makes the measurement honest rather than hiding anything.
    let expected = waiters.to_string();
    let give_up = Instant::now() + Duration::from_secs(60);
    while setter.try_get("ready").await?.as_deref() != Some(expected.as_bytes()) {
        // A waiter whose count failed ended its task: report why.
        if let Some(i) = tasks.iter().position(|t| t.is_finished()) {
            let ended = tasks.swap_remove(i).await?;
            anyhow::bail!("a waiter ended before the wake-up: {:?}", ended.err());
        }
        anyhow::ensure!(
            Instant::now() < give_up,
            "the waiters did not all count in within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let set_at = Instant::now();
    setter.set("go", "1").await?;
    let mut last = Duration::ZERO;
    for t in tasks {
        last = last.max(t.await??.saturating_duration_since(set_at));
    }
    setter.close().await?;
    Ok(last)
}

async fn host_death() -> anyhow::Result<Duration> {
    let mut server = StoreProcess::start()?;
    let mut tasks = Vec::new();
    for i in 0..8 {
        let w = open(&server.addr, "bench-death").await?;
        // Half the calls share one connection, half have their own.
        let shared = if i % 2 == 0 { Some(w.clone()) } else { None };
        for w in [Some(w), shared].into_iter().flatten() {
            tasks.push(tokio::spawn(async move {
                let r = w.get("never", Duration::from_secs(60)).await;
                (r.is_err(), Instant::now())
            }));
        }
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let killed_at = Instant::now();
    server.kill()?;
    let mut last = Duration::ZERO;
    for t in tasks {
        let (failed, at) = t.await?;
        anyhow::ensure!(failed, "a call survived the store host's death");
        last = last.max(at.saturating_duration_since(killed_at));
    }
    Ok(last)
}

async fn store(args: StoreBenchArgs) -> anyhow::Result<()> {
    let server = StoreProcess::start()?;
    println!(
        "store benchmark: server {} (a child process), loopback",
        server.addr
    );
    let iterations = args.iterations.max(1000);
    let raw = tokio::task::spawn_blocking(move || raw_tcp_rtt(iterations, false)).await??;
    let raw_us = raw.as_secs_f64() * 1e6;
    let one_core = tokio::task::spawn_blocking(move || raw_tcp_rtt(iterations, true)).await??;
    let one_core_us = one_core.as_secs_f64() * 1e6;
    println!(
        "raw TCP ping-pong round trip (reference): median {raw_us:.1} µs as the scheduler places \
         the two threads, {one_core_us:.1} µs with both on one core"
    );
    // The floor of a set+get: two round trips of the faster placement.
    let floor_us = 2.0 * raw_us.min(one_core_us);
    let mut round_trips_out = Vec::new();
    println!(
        "\nset+get round trip   protocol   clients   pairs   median µs   p99 µs   pairs/s   median / (2 × faster raw RTT)"
    );
    for &c in &args.clients {
        for &p in &args.protocols {
            let r = round_trips(&server.addr, p, c, args.iterations).await?;
            println!(
                "                     {:>8} {:>9} {:>7} {:>11.1} {:>8.1} {:>9.0} {:>10.2}",
                r.protocol,
                r.clients,
                r.pairs,
                r.median_us,
                r.p99_us,
                r.pairs_per_s,
                r.median_us / floor_us
            );
            round_trips_out.push(r);
        }
    }
    let mut wake_last = Vec::new();
    for round in 0..args.rounds {
        wake_last.push(ms(wake(&server.addr, args.waiters, round).await?));
    }
    println!(
        "\none set releases {} waiters: last released after (ms) {:?}",
        args.waiters,
        wake_last.iter().map(|v| format!("{v:.2}")).collect::<Vec<_>>()
    );
    drop(server);
    let mut death = Vec::new();
    for _ in 0..args.rounds {
        death.push(ms(host_death().await?));
    }
    println!(
        "store host SIGKILLed: every in-flight call failed after (ms) {:?}",
        death.iter().map(|v| format!("{v:.2}")).collect::<Vec<_>>()
    );
    let report = StoreReport {
        raw_tcp_rtt_median_us: raw_us,
        raw_tcp_rtt_one_core_median_us: one_core_us,
        round_trips: round_trips_out,
        wake_waiters: args.waiters,
        wake_last_ms: wake_last,
        host_death_ms: death,
        targets: Targets {
            median_set_get_us: 150.0,
            wake_256_ms: 50.0,
            host_death_ms: 100.0,
        },
    };
    println!(
        "\ntargets: median set+get ≤ {} µs on a machine whose raw TCP round trip is ~22 µs \
         (a set+get is two round trips: compare the ratio column where loopback is slower; \
         torch's TCPStore in the same minutes: bench/tcpstore.py), \
         256 waiters released ≤ {} ms, host death reported ≤ {} ms",
        report.targets.median_set_get_us, report.targets.wake_256_ms, report.targets.host_death_ms
    );
    write_json(args.json.as_deref(), &report)?;
    Ok(())
}

#[derive(Serialize)]
struct FaultRound {
    fault: &'static str,
    detect_ms: f64,
    healthy_before_msgs_s: Vec<f64>,
    healthy_after_msgs_s: Vec<f64>,
    healthy_ratio_min: f64,
    healthy_max_pause_ms: f64,
    cause: String,
}

#[derive(Serialize)]
struct FailoverReport {
    workers: usize,
    bytes: usize,
    rounds: Vec<FaultRound>,
}

async fn fault_round(
    fleet: &mut m8d::fleet::Fleet,
    victim: usize,
    healthy: &[usize],
    window: Duration,
    freeze: bool,
) -> anyhow::Result<FaultRound> {
    let before = fleet.rates(healthy, window).await;
    for &i in healthy {
        fleet.members[i].stats.take_max_gap();
    }
    let at = if freeze {
        fleet.freeze(victim)?
    } else {
        fleet.kill(victim)?
    };
    let (err, failed_at) = fleet.wait_failed(victim, Duration::from_secs(10)).await?;
    let detect = failed_at.saturating_duration_since(at);
    // Measure the healthy worlds over a window that starts at the fault.
    let rest = window.saturating_sub(at.elapsed());
    let after = fleet.rates(healthy, rest.max(Duration::from_millis(500))).await;
    let pause = healthy
        .iter()
        .map(|&i| fleet.members[i].stats.take_max_gap())
        .max()
        .unwrap_or_default();
    if freeze {
        fleet.thaw(victim)?;
    }
    let ratio = before
        .iter()
        .zip(&after)
        .map(|(b, a)| if *b > 0.0 { a / b } else { 0.0 })
        .fold(f64::INFINITY, f64::min);
    fleet.respawn(victim).await?;
    Ok(FaultRound {
        fault: if freeze {
            "freeze (SIGSTOP)"
        } else {
            "kill (SIGKILL)"
        },
        detect_ms: ms(detect),
        healthy_before_msgs_s: before,
        healthy_after_msgs_s: after,
        healthy_ratio_min: ratio,
        healthy_max_pause_ms: ms(pause),
        cause: err.to_string(),
    })
}

async fn failover(args: FailoverArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.workers >= 2,
        "need at least 2 workers: one victim and one healthy world"
    );
    let exe = std::env::current_exe().context("finding m8d's own path")?;
    let mut config = m8d::fleet::FleetConfig::new(exe, args.workers);
    config.bytes = args.bytes;
    config.metrics_addr = args.metrics;
    let mut fleet = m8d::fleet::Fleet::start(config).await?;
    if let Some(addr) = fleet.leader.metrics_addr() {
        eprintln!("the leader's metrics: http://{addr}/metrics");
    }
    let victim = 1;
    let healthy: Vec<usize> = (0..args.workers).filter(|&i| i != victim).collect();
    let window = args.window;
    println!(
        "failover benchmark: a leader in {} worlds, one `m8d worker` process each, {} B messages; victim w{}",
        args.workers,
        args.bytes,
        victim + 1
    );
    println!("\nfault              detected after   healthy worlds after/before   longest healthy pause");
    let mut rounds = Vec::new();
    let progress = m8d::progress::bar(2 * args.rounds as u64, "faults");
    for _ in 0..args.rounds {
        for freeze in [false, true] {
            let r = fault_round(&mut fleet, victim, &healthy, window, freeze).await?;
            progress.suspend(|| {
                println!(
                    "{:<18} {:>11.1} ms {:>24.1} % {:>18.1} ms",
                    r.fault,
                    r.detect_ms,
                    r.healthy_ratio_min * 100.0,
                    r.healthy_max_pause_ms
                )
            });
            progress.inc(1);
            rounds.push(r);
        }
    }
    progress.finish_and_clear();
    let exits = fleet.shutdown().await;
    println!(
        "\ntargets: kill reported ≤ 50 ms; freeze reported ≤ heartbeat timeout (1 s) + 250 ms; \
         healthy worlds ≥ 95 % of their throughput; healthy receptions never pause > 50 ms"
    );
    println!("workers' exit codes at the end: {exits:?}");
    let report = FailoverReport {
        workers: args.workers,
        bytes: args.bytes,
        rounds,
    };
    write_json(args.json.as_deref(), &report)?;
    Ok(())
}

#[derive(Serialize)]
struct P2pRowOut {
    bytes: usize,
    messages: usize,
    comm_gbps: f64,
    raw_gbps: f64,
    ratio: f64,
}

#[derive(Serialize)]
struct P2pOut {
    stream: Vec<P2pRowOut>,
    half_round_trip_us: f64,
    raw_half_round_trip_us: f64,
}

async fn p2p(args: P2pArgs) -> anyhow::Result<()> {
    let mut cfg = multiworld_bench::p2p::P2pBenchConfig::default();
    if args.quick {
        cfg.bytes_per_size = 64 << 20;
        cfg.max_messages = 2000;
        cfg.pingpong_rounds = 2000;
        cfg.repeats = 1;
    }
    let progress = m8d::progress::spinner("p2p: streaming and ping-pong, every size");
    let report = multiworld_bench::p2p::p2p(cfg).await;
    progress.finish_and_clear();
    let report = report?;
    println!("{report}");
    let out = P2pOut {
        stream: report
            .stream
            .iter()
            .map(|r| P2pRowOut {
                bytes: r.bytes,
                messages: r.messages,
                comm_gbps: r.comm_gbps,
                raw_gbps: r.raw_gbps,
                ratio: r.ratio(),
            })
            .collect(),
        half_round_trip_us: report.pingpong.comm_us,
        raw_half_round_trip_us: report.pingpong.raw_us,
    };
    println!(
        "targets: ≥ 90 % of the raw stream for messages ≥ 16 MiB; half round trip ≤ 2 × the raw ping-pong"
    );
    if let Some(path) = &args.plot {
        plot_p2p(path, &out.stream)?;
        println!("wrote {}", path.display());
    }
    write_json(args.json.as_deref(), &out)?;
    Ok(())
}

/// Bandwidth against message size (log scale), communicator and raw TCP.
fn plot_p2p(path: &std::path::Path, rows: &[P2pRowOut]) -> anyhow::Result<()> {
    let series = vec![
        Series {
            name: "multiworld".into(),
            points: rows.iter().map(|r| (r.bytes, r.comm_gbps)).collect(),
        },
        Series {
            name: "raw TCP (same run)".into(),
            points: rows.iter().map(|r| (r.bytes, r.raw_gbps)).collect(),
        },
    ];
    plot_bandwidth(path, "multiworld p2p streaming over loopback", "GB/s", &series)
}

/// One line of a bandwidth plot: (bytes, GB/s) points.
struct Series {
    name: String,
    points: Vec<(usize, f64)>,
}

/// Draws each series as a line with markers (a one-point series is a
/// marker), bandwidth against size on a log2 axis, as an SVG file.
fn plot_bandwidth(
    path: &std::path::Path,
    caption: &str,
    y_desc: &str,
    series: &[Series],
) -> anyhow::Result<()> {
    use plotters::prelude::*;
    let all = || series.iter().flat_map(|s| s.points.iter().copied());
    anyhow::ensure!(all().next().is_some(), "nothing to plot");
    let top = all().map(|(_, v)| v).fold(0.0f64, f64::max) * 1.1;
    let x = |b: usize| (b.max(1) as f64).log2();
    let x0 = all().map(|(b, _)| x(b)).fold(f64::INFINITY, f64::min);
    let x1 = all()
        .map(|(b, _)| x(b))
        .fold(f64::NEG_INFINITY, f64::max)
        .max(x0 + 1.0);
    let root = SVGBackend::new(path, (900, 540)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(caption, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(56)
        .build_cartesian_2d(x0..x1, 0.0..top.max(0.1))
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    chart
        .configure_mesh()
        .x_desc("size")
        .y_desc(y_desc)
        .x_label_formatter(&|v| {
            let b = 2f64.powf(*v).round() as usize;
            if b >= 1 << 20 {
                format!("{} MiB", b >> 20)
            } else if b >= 1 << 10 {
                format!("{} KiB", b >> 10)
            } else {
                format!("{b} B")
            }
        })
        .draw()
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    for (i, s) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let pts: Vec<(f64, f64)> = s.points.iter().map(|&(b, v)| (x(b), v)).collect();
        chart
            .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .label(s.name.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
        chart
            .draw_series(pts.into_iter().map(|p| Circle::new(p, 3, color.filled())))
            .map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .border_style(BLACK)
        .background_style(WHITE)
        .draw()
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    root.present().map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(())
}

/// Bus bandwidth against size, one line per (operation, world size), and
/// the raw TCP floor of the largest all-reduce as a marker per world size.
fn plot_collectives(
    path: &std::path::Path,
    report: &multiworld_bench::collectives::CollectivesReport,
) -> anyhow::Result<()> {
    let mut series: Vec<Series> = Vec::new();
    for r in &report.rows {
        let name = format!("{} x{}", r.op.name(), r.ranks);
        match series.iter_mut().find(|s| s.name == name) {
            Some(s) => s.points.push((r.bytes, r.busbw_gbps)),
            None => series.push(Series {
                name,
                points: vec![(r.bytes, r.busbw_gbps)],
            }),
        }
    }
    for raw in &report.raw {
        // The floor moves the ring's bytes: report it as the bus bandwidth
        // an all-reduce of that size would have at that time.
        let n = f64::from(raw.ranks);
        let busbw = 2.0 * (n - 1.0) / n * raw.bytes as f64 / (raw.time_us * 1e3);
        series.push(Series {
            name: format!("raw TCP floor x{}", raw.ranks),
            points: vec![(raw.bytes, busbw)],
        });
    }
    plot_bandwidth(
        path,
        "multiworld collectives over loopback (bus bandwidth)",
        "busbw GB/s",
        &series,
    )
}

#[derive(Serialize)]
struct WorldsRow {
    workers: usize,
    bytes: usize,
    multi_world_msgs_s: f64,
    single_world_msgs_s: f64,
    ratio: f64,
}

/// Aggregate messages/s a leader receives from `k` workers sharing one world
/// of `k + 1` members.
async fn single_world_rate(
    exe: &std::path::Path,
    k: usize,
    bytes: usize,
    window: Duration,
) -> anyhow::Result<f64> {
    use m8d::stream::{StreamStats, receive_stream};
    use std::sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    };
    let leader = multiworld::WorldManager::default();
    let store = leader.serve_store("127.0.0.1:0").await?.to_string();
    let size = (k + 1) as u32;
    let mut children = Vec::new();
    for r in 1..=k {
        let child = m8d::fleet::ends_with_this_process(&mut std::process::Command::new(exe))
            .args(["worker", "--world", "single", "--store", &store])
            .args([
                "--rank",
                &r.to_string(),
                "--size",
                &size.to_string(),
                "--bytes",
                &bytes.to_string(),
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        children.push(m8d::fleet::ChildProcess::new(child));
    }
    let world = leader
        .join(multiworld::WorldConfig::new("single", 0, size, &store)?)
        .await?;
    let stop = Arc::new(AtomicBool::new(false));
    let stats: Vec<Arc<StreamStats>> = (0..k).map(|_| Arc::new(StreamStats::default())).collect();
    let mut tasks = Vec::new();
    for (i, st) in stats.iter().enumerate() {
        let (world, st, stop) = (world.clone(), Arc::clone(st), Arc::clone(&stop));
        tasks.push(tokio::spawn(async move {
            receive_stream(&world, multiworld::Rank(i as u32 + 1), bytes, st, move || {
                stop.load(Ordering::Relaxed)
            })
            .await
        }));
    }
    let total = || stats.iter().map(|s| s.count()).sum::<u64>();
    // Warm up until every sender flows.
    let start = Instant::now();
    while stats.iter().any(|s| s.count() < 5) {
        anyhow::ensure!(
            start.elapsed() < Duration::from_secs(30),
            "the single world never flowed"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let before = total();
    let t = Instant::now();
    tokio::time::sleep(window).await;
    let rate = (total() - before) as f64 / t.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    leader.shutdown().await;
    for t in tasks {
        let _ = tokio::time::timeout(Duration::from_secs(5), t).await;
    }
    drop(children);
    Ok(rate)
}

async fn worlds(args: WorldsArgs) -> anyhow::Result<()> {
    let exe = std::env::current_exe().context("finding m8d's own path")?;
    let window = args.seconds;
    println!(
        "worlds benchmark: a leader receiving from K worker processes, in K worlds of 2 vs one world of K + 1"
    );
    println!("\n   bytes  workers   K worlds msgs/s   1 world msgs/s   ratio");
    let mut rows = Vec::new();
    let progress = m8d::progress::bar(
        (args.bytes.len() * args.workers.len() * args.repeats.max(1)) as u64,
        "runs",
    );
    for &bytes in &args.bytes {
        for &k in &args.workers {
            let (mut multis, mut singles) = (Vec::new(), Vec::new());
            for _ in 0..args.repeats.max(1) {
                progress.inc(1);
                let mut config = m8d::fleet::FleetConfig::new(&exe, k);
                config.bytes = bytes;
                let fleet = m8d::fleet::Fleet::start(config).await?;
                let all: Vec<usize> = (0..k).collect();
                multis.push(fleet.rates(&all, window).await.iter().sum::<f64>());
                fleet.shutdown().await;
                singles.push(single_world_rate(&exe, k, bytes, window).await?);
            }
            let median = |v: &mut Vec<f64>| {
                v.sort_by(f64::total_cmp);
                v[v.len() / 2]
            };
            let (multi, single) = (median(&mut multis), median(&mut singles));
            let row = WorldsRow {
                workers: k,
                bytes,
                multi_world_msgs_s: multi,
                single_world_msgs_s: single,
                ratio: multi / single.max(1e-9),
            };
            progress.suspend(|| {
                println!(
                    "{:>8} {:>8} {:>17.0} {:>16.0} {:>7.1} %",
                    bytes,
                    k,
                    multi,
                    single,
                    row.ratio * 100.0
                )
            });
            rows.push(row);
        }
    }
    progress.finish_and_clear();
    println!("\ntarget: K worlds ≥ 97 % of the same traffic over one world");
    write_json(args.json.as_deref(), &rows)?;
    Ok(())
}

#[derive(Serialize)]
struct CollectiveRowOut {
    op: &'static str,
    ranks: u32,
    bytes: usize,
    algorithm: &'static str,
    time_us: f64,
    algbw_gbps: f64,
    busbw_gbps: f64,
}

async fn collectives(args: CollectivesArgs) -> anyhow::Result<()> {
    use multiworld_bench::collectives::{BenchOp, CollectivesBenchConfig, collectives_bench};
    let mut cfg = if args.quick {
        CollectivesBenchConfig::quick()
    } else {
        CollectivesBenchConfig::default()
    };
    if !args.ops.is_empty() {
        cfg.ops = args
            .ops
            .iter()
            .map(|name| BenchOp::parse(name).ok_or_else(|| anyhow::anyhow!("unknown operation '{name}'")))
            .collect::<anyhow::Result<_>>()?;
    }
    if !args.ranks.is_empty() {
        cfg.world_sizes = args.ranks.clone();
    }
    let progress = m8d::progress::spinner("collectives: every operation, size and world size");
    let report = collectives_bench(cfg).await;
    progress.finish_and_clear();
    let report = report?;
    println!("{report}");
    println!(
        "targets: all_reduce of 64 MiB f32 ≤ 25 ms over 2 ranks, ≤ 60 ms over 4 ranks (gloo here, bench/gloo_all_reduce.py, 2026-11-22, medians: 48-56 and 104-122 ms)"
    );
    let rows: Vec<CollectiveRowOut> = report
        .rows
        .iter()
        .map(|r| CollectiveRowOut {
            op: r.op.name(),
            ranks: r.ranks,
            bytes: r.bytes,
            algorithm: r.algorithm,
            time_us: r.time_us,
            algbw_gbps: r.algbw_gbps,
            busbw_gbps: r.busbw_gbps,
        })
        .collect();
    if let Some(path) = &args.plot {
        plot_collectives(path, &report)?;
        println!("wrote {}", path.display());
    }
    write_json(args.json.as_deref(), &rows)?;
    Ok(())
}

#[derive(Serialize)]
struct JoinOut {
    rounds: usize,
    median_us: f64,
    p90_us: f64,
    p99_us: f64,
    max_us: f64,
}

/// Joins worlds of 2 (leader hosting the store, worker connecting), one
/// after another, timing from the two `join` calls until both return.
async fn join(args: JoinArgs) -> anyhow::Result<()> {
    use multiworld::{WorldConfig, WorldManager};
    anyhow::ensure!(args.rounds > 0, "--rounds must be at least 1");
    let (leader, worker) = (WorldManager::default(), WorldManager::default());
    let store = leader.serve_store("127.0.0.1:0").await?.to_string();
    let mut times = Vec::with_capacity(args.rounds);
    // Two unmeasured rounds warm up the store connections' code paths.
    let progress = m8d::progress::bar(args.rounds as u64 + 2, "joins");
    for i in 0..args.rounds + 2 {
        progress.inc(1);
        let name = format!("join-{i}");
        let started = Instant::now();
        let (a, b) = tokio::join!(
            leader.join(WorldConfig::new(&name, 0, 2, &store)?),
            worker.join(WorldConfig::new(&name, 1, 2, &store)?),
        );
        let took = started.elapsed();
        let (a, b) = (a?, b?);
        if i >= 2 {
            times.push(took.as_secs_f64() * 1e6);
        }
        let (x, y) = tokio::join!(
            a.finish(Duration::from_secs(10)),
            b.finish(Duration::from_secs(10))
        );
        x?;
        y?;
    }
    progress.finish_and_clear();
    times.sort_by(f64::total_cmp);
    let at = |q: f64| times[((times.len() - 1) as f64 * q).round() as usize];
    let out = JoinOut {
        rounds: times.len(),
        median_us: at(0.5),
        p90_us: at(0.9),
        p99_us: at(0.99),
        max_us: at(1.0),
    };
    println!(
        "joining a world of 2 on loopback ({} rounds): median {:.2} ms, p90 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
        out.rounds,
        out.median_us / 1e3,
        out.p90_us / 1e3,
        out.p99_us / 1e3,
        out.max_us / 1e3
    );
    println!("target: ≤ 5 ms (torch.distributed gloo on the design's machine: 2.6–3.7 ms)");
    leader.shutdown().await;
    worker.shutdown().await;
    write_json(args.json.as_deref(), &out)?;
    Ok(())
}
