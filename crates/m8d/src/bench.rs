//! `m8d bench`: benchmarks that print a table, compare with the targets of
//! docs/benchmarks.md and can write JSON.
//!
//! `m8d bench store` runs a real `m8d store` child process on loopback and
//! measures, from this process:
//! - set+get round trips with 1 and 64 concurrent clients (one connection
//!   each): median and p99 of one set followed by one get;
//! - one set releasing N clients waiting on one key: time from the set until
//!   the last waiter has its value;
//! - the store host's death: SIGKILL the server while calls are in flight and
//!   time until every one of them has failed.

use std::{
    io::{BufRead, BufReader},
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use clap::{Args, Subcommand};
use multiworld_store::{ClientConfig, OpenOptions, StoreClient, WorldStore};
use serde::Serialize;

/// The benchmarks.
#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Store round trips, wake-ups and host-death detection.
    Store(StoreBenchArgs),
    /// Detection time and the healthy worlds' throughput around a killed and
    /// a frozen worker.
    Failover(FailoverArgs),
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
    /// Seconds of throughput measured before and after each fault.
    #[arg(long, default_value_t = 2.0)]
    pub window: f64,
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
    /// Clients waiting on one key for the wake-up measurement.
    #[arg(long, default_value_t = 256)]
    pub waiters: usize,
    /// Rounds of the wake-up and host-death measurements.
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    /// Write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// Runs a benchmark.
pub async fn run(cmd: BenchCommand) -> anyhow::Result<()> {
    match cmd {
        BenchCommand::Store(args) => store(args).await,
        BenchCommand::Failover(args) => failover(args).await,
    }
}

#[derive(Serialize)]
struct RoundTrip {
    clients: usize,
    pairs: usize,
    median_us: f64,
    p99_us: f64,
    pairs_per_s: f64,
}

#[derive(Serialize)]
struct StoreReport {
    raw_tcp_rtt_median_us: f64,
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
    child: Child,
    addr: String,
}

impl StoreProcess {
    fn start() -> anyhow::Result<StoreProcess> {
        let exe = std::env::current_exe().context("finding m8d's own path")?;
        let mut child = Command::new(exe)
            .args(["store", "--bind", "127.0.0.1:0"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .context("starting m8d store")?;
        let stdout = child.stdout.take().context("store stdout")?;
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line)?;
        let Some(addr) = line.trim().strip_prefix("listening on ") else {
            let _ = child.kill();
            bail!("m8d store said {line:?} instead of its address");
        };
        Ok(StoreProcess {
            addr: addr.to_string(),
            child,
        })
    }

    /// SIGKILLs the server and reaps it.
    fn kill(&mut self) -> anyhow::Result<()> {
        self.child.kill()?;
        self.child.wait()?;
        Ok(())
    }
}

impl Drop for StoreProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn open(addr: &str, world: &str) -> anyhow::Result<WorldStore> {
    let client = StoreClient::connect(addr, ClientConfig::default()).await?;
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
/// round trip is compared against in the same run.
fn raw_tcp_rtt(iterations: usize) -> anyhow::Result<Duration> {
    use std::{
        io::{Read, Write},
        net::{TcpListener, TcpStream},
    };
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let echo = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = listener.accept()?;
        s.set_nodelay(true)?;
        let mut buf = [0u8; 64];
        while s.read_exact(&mut buf).is_ok() {
            s.write_all(&buf)?;
        }
        Ok(())
    });
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

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

async fn round_trips(addr: &str, clients: usize, iterations: usize) -> anyhow::Result<RoundTrip> {
    let mut stores = Vec::with_capacity(clients);
    for _ in 0..clients {
        stores.push(open(addr, "bench-rtt").await?);
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
    while setter.try_get("ready").await?.as_deref() != Some(expected.as_bytes()) {
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
    let raw = tokio::task::spawn_blocking(move || raw_tcp_rtt(iterations)).await??;
    let raw_us = raw.as_secs_f64() * 1e6;
    println!("raw TCP ping-pong round trip (reference): median {raw_us:.1} µs");
    let mut round_trips_out = Vec::new();
    println!(
        "\nset+get round trip     clients   pairs   median µs   p99 µs   pairs/s   median / (2 × raw RTT)"
    );
    for &c in &args.clients {
        let r = round_trips(&server.addr, c, args.iterations).await?;
        println!(
            "                       {:>7} {:>7} {:>11.1} {:>8.1} {:>9.0} {:>10.2}",
            r.clients,
            r.pairs,
            r.median_us,
            r.p99_us,
            r.pairs_per_s,
            r.median_us / (2.0 * raw_us)
        );
        round_trips_out.push(r);
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
         (a set+get is two round trips: compare the ratio column where loopback is slower), \
         256 waiters released ≤ {} ms, host death reported ≤ {} ms",
        report.targets.median_set_get_us, report.targets.wake_256_ms, report.targets.host_death_ms
    );
    if let Some(path) = args.json {
        std::fs::write(&path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
        println!("wrote {}", path.display());
    }
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
    let mut fleet = m8d::fleet::Fleet::start(config).await?;
    let victim = 1;
    let healthy: Vec<usize> = (0..args.workers).filter(|&i| i != victim).collect();
    let window = Duration::from_secs_f64(args.window);
    println!(
        "failover benchmark: a leader in {} worlds, one `m8d worker` process each, {} B messages; victim w{}",
        args.workers,
        args.bytes,
        victim + 1
    );
    println!("\nfault              detected after   healthy worlds after/before   longest healthy pause");
    let mut rounds = Vec::new();
    for _ in 0..args.rounds {
        for freeze in [false, true] {
            let r = fault_round(&mut fleet, victim, &healthy, window, freeze).await?;
            println!(
                "{:<18} {:>11.1} ms {:>24.1} % {:>18.1} ms",
                r.fault,
                r.detect_ms,
                r.healthy_ratio_min * 100.0,
                r.healthy_max_pause_ms
            );
            rounds.push(r);
        }
    }
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
    if let Some(path) = args.json {
        std::fs::write(&path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
