//! The point-to-point benchmark, as a library function so that both
//! `cargo bench --bench p2p` and a CLI (`m8d bench p2p`) can run it. Two ranks of a
//! world run in this process over loopback, each on its own OS thread with its own
//! Tokio runtime (like two processes), and stream messages of each size from rank
//! 0 to rank 1, then play small-message ping-pong. In the same run, the same
//! traffic goes over a raw TCP stream between two blocking threads (the physical
//! reference) and a raw Tokio socket ping-pong, and the report gives the ratios.

use std::fmt;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use multiworld_tcp::DEFAULT_RECV_SPIN;
use multiworld_tcp::{CommConfig, Communicator, Error, MemoryRendezvous, Result};
use multiworld_types::{DType, Tensor};
use multiworld_types::{Generation, Rank, Tag, WorldName};

/// How each rank's Tokio runtime is built.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RankRuntime {
    /// A current-thread runtime on the rank's own thread.
    CurrentThread,
    /// A multi-thread runtime with this many workers per rank.
    MultiThread(usize),
}

impl fmt::Display for RankRuntime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RankRuntime::CurrentThread => f.write_str("current-thread runtime per rank"),
            RankRuntime::MultiThread(n) => write!(f, "multi-thread runtime ({n} workers) per rank"),
        }
    }
}

/// What to measure.
#[derive(Debug, Clone)]
pub struct P2pBenchConfig {
    /// Message sizes to stream, in bytes.
    pub sizes: Vec<usize>,
    /// Bytes to stream per size and measurement (the message count is derived
    /// from it and clamped to `min_messages..=max_messages`).
    pub bytes_per_size: usize,
    /// Fewest messages per measurement.
    pub min_messages: usize,
    /// Most messages per measurement.
    pub max_messages: usize,
    /// Round trips per ping-pong measurement.
    pub pingpong_rounds: usize,
    /// Ping-pong message size in bytes.
    pub pingpong_bytes: usize,
    /// Measurements per point; the median is reported.
    pub repeats: usize,
    /// Runtime of each rank.
    pub runtime: RankRuntime,
    /// Overrides [`CommConfig::recv_spin`] for the ranks (`None`: the default).
    pub recv_spin: Option<Duration>,
}

impl Default for P2pBenchConfig {
    /// 4 B to 256 MiB in steps of 4x, 512 MiB per point, 20k round trips of 4 B,
    /// median of 3, a current-thread runtime per rank.
    fn default() -> Self {
        P2pBenchConfig {
            sizes: (0..=13).map(|i| 4usize << (2 * i)).collect(),
            bytes_per_size: 512 << 20,
            min_messages: 3,
            max_messages: 20_000,
            pingpong_rounds: 20_000,
            pingpong_bytes: 4,
            repeats: 3,
            runtime: RankRuntime::CurrentThread,
            recv_spin: None,
        }
    }
}

impl P2pBenchConfig {
    /// A small, quick configuration (for smoke tests).
    pub fn quick() -> Self {
        P2pBenchConfig {
            sizes: vec![4, 64 << 10, 4 << 20],
            bytes_per_size: 16 << 20,
            min_messages: 2,
            max_messages: 500,
            pingpong_rounds: 200,
            pingpong_bytes: 4,
            repeats: 1,
            runtime: RankRuntime::CurrentThread,
            recv_spin: None,
        }
    }

    fn messages(&self, size: usize) -> usize {
        (self.bytes_per_size / size.max(1)).clamp(self.min_messages, self.max_messages.max(self.min_messages))
    }
}

/// Streaming results for one message size.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StreamRow {
    /// Message size in bytes.
    pub bytes: usize,
    /// Messages per measurement.
    pub messages: usize,
    /// Communicator throughput, GB/s (10^9 bytes per second).
    pub comm_gbps: f64,
    /// Raw TCP stream throughput, GB/s.
    pub raw_gbps: f64,
}

impl StreamRow {
    /// Communicator throughput as a fraction of the raw stream.
    pub fn ratio(&self) -> f64 {
        self.comm_gbps / self.raw_gbps
    }
}

/// Ping-pong results.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PingPongRow {
    /// Message size in bytes.
    pub bytes: usize,
    /// Round trips per measurement.
    pub rounds: usize,
    /// Communicator half round-trip, µs.
    pub comm_us: f64,
    /// Raw socket half round-trip between two blocking threads, µs.
    pub raw_us: f64,
    /// Raw Tokio socket half round-trip (same runtime setup as the ranks), µs.
    pub raw_tokio_us: f64,
}

impl PingPongRow {
    /// Communicator half round-trip divided by the raw blocking one.
    pub fn ratio(&self) -> f64 {
        self.comm_us / self.raw_us
    }
}

/// The benchmark's results.
#[derive(Debug, Clone, PartialEq)]
pub struct P2pReport {
    /// Runtime of each rank.
    pub runtime: RankRuntime,
    /// Receive spin of the ranks.
    pub recv_spin: Duration,
    /// One row per message size.
    pub stream: Vec<StreamRow>,
    /// Small-message ping-pong.
    pub pingpong: PingPongRow,
}

/// A byte count as `4 KiB`, `16 MiB` or `7 B` (shared by the benchmarks).
pub(crate) fn human(bytes: usize) -> String {
    if bytes >= 1 << 20 && bytes % (1 << 20) == 0 {
        format!("{} MiB", bytes >> 20)
    } else if bytes >= 1 << 10 && bytes % (1 << 10) == 0 {
        format!("{} KiB", bytes >> 10)
    } else {
        format!("{bytes} B")
    }
}

impl fmt::Display for P2pReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "p2p streaming, rank 0 -> rank 1 over loopback ({}, recv_spin {:?})",
            self.runtime, self.recv_spin
        )?;
        writeln!(
            f,
            "{:>10} {:>9} {:>12} {:>12} {:>8}",
            "size", "messages", "comm GB/s", "raw GB/s", "ratio"
        )?;
        for r in &self.stream {
            writeln!(
                f,
                "{:>10} {:>9} {:>12.3} {:>12.3} {:>7.1}%",
                human(r.bytes),
                r.messages,
                r.comm_gbps,
                r.raw_gbps,
                100.0 * r.ratio()
            )?;
        }
        let p = &self.pingpong;
        writeln!(
            f,
            "ping-pong, {} round trips of {}: half round-trip comm {:.1} µs, raw socket {:.1} µs, raw tokio {:.1} µs; comm/raw = {:.2}x",
            p.rounds,
            human(p.bytes),
            p.comm_us,
            p.raw_us,
            p.raw_tokio_us,
            p.ratio()
        )
    }
}

/// Runs a blocking benchmark from async code on the blocking pool, passing
/// its panic on (shared by the benchmarks of this crate).
pub(crate) async fn run_blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    match tokio::task::spawn_blocking(f).await {
        Ok(r) => r,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(_) => Err(Error::Aborted {
            reason: Arc::from("benchmark task cancelled"),
        }),
    }
}

/// Runs the benchmark from async code (it runs on its own threads).
pub async fn p2p(cfg: P2pBenchConfig) -> Result<P2pReport> {
    run_blocking(move || p2p_blocking(&cfg)).await
}

/// Runs the benchmark on the calling thread (plus the threads it starts).
pub fn p2p_blocking(cfg: &P2pBenchConfig) -> Result<P2pReport> {
    if cfg.sizes.contains(&0) || cfg.repeats == 0 || cfg.pingpong_rounds == 0 {
        return Err(Error::invalid(
            "sizes must be non-zero, repeats and rounds at least 1",
        ));
    }
    let mut stream = Vec::new();
    let mut comm_runs: Vec<Vec<f64>> = vec![Vec::new(); cfg.sizes.len()];
    let mut raw_runs: Vec<Vec<f64>> = vec![Vec::new(); cfg.sizes.len()];
    let (mut pp_comm, mut pp_raw, mut pp_tokio) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..cfg.repeats {
        // Interleave so that comm and raw see the same machine conditions.
        let comm = comm_run(cfg)?;
        for (i, &size) in cfg.sizes.iter().enumerate() {
            raw_runs[i].push(raw_stream(size, cfg.messages(size))?);
            comm_runs[i].push(comm.stream[i]);
        }
        pp_comm.push(comm.pingpong_us);
        pp_raw.push(raw_pingpong(cfg.pingpong_bytes, cfg.pingpong_rounds)?);
        pp_tokio.push(raw_tokio_pingpong(cfg)?);
    }
    for (i, &size) in cfg.sizes.iter().enumerate() {
        stream.push(StreamRow {
            bytes: size,
            messages: cfg.messages(size),
            comm_gbps: median(&mut comm_runs[i]),
            raw_gbps: median(&mut raw_runs[i]),
        });
    }
    Ok(P2pReport {
        runtime: cfg.runtime,
        recv_spin: cfg.recv_spin.unwrap_or(DEFAULT_RECV_SPIN),
        stream,
        pingpong: PingPongRow {
            bytes: cfg.pingpong_bytes,
            rounds: cfg.pingpong_rounds,
            comm_us: median(&mut pp_comm),
            raw_us: median(&mut pp_raw),
            raw_tokio_us: median(&mut pp_tokio),
        },
    })
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn gbps(bytes: usize, t: Duration) -> f64 {
    bytes as f64 / t.as_secs_f64() / 1e9
}

fn half_rtt_us(rounds: usize, t: Duration) -> f64 {
    t.as_secs_f64() * 1e6 / (2.0 * rounds as f64)
}

impl RankRuntime {
    /// Builds the runtime one rank runs on (shared by every benchmark here).
    pub(crate) fn build(self) -> Result<tokio::runtime::Runtime> {
        let mut b = match self {
            RankRuntime::CurrentThread => tokio::runtime::Builder::new_current_thread(),
            RankRuntime::MultiThread(n) => {
                let mut b = tokio::runtime::Builder::new_multi_thread();
                b.worker_threads(n.max(1));
                b
            }
        };
        b.enable_all()
            .build()
            .map_err(|e| Error::io("building a runtime", e))
    }
}

fn join_thread<T>(h: std::thread::JoinHandle<Result<T>>) -> Result<T> {
    match h.join() {
        Ok(r) => r,
        Err(p) => std::panic::resume_unwind(p),
    }
}

struct CommRun {
    stream: Vec<f64>,
    pingpong_us: f64,
}

const READY: Tag = Tag(u32::MAX);
const DATA: Tag = Tag(1);

/// One world of two ranks on two threads; rank 1 measures streaming, rank 0 ping-pong.
fn comm_run(cfg: &P2pBenchConfig) -> Result<CommRun> {
    let rdv = MemoryRendezvous::new();
    let world = WorldName::new("bench-p2p")?;
    let mut handles = Vec::new();
    for r in 0..2u32 {
        let cfg = cfg.clone();
        let rdv = rdv.clone();
        let mut ccfg = CommConfig::new(world.clone(), Generation(1), Rank(r), 2);
        if let Some(spin) = cfg.recv_spin {
            ccfg.recv_spin = spin;
        }
        handles.push(std::thread::spawn(move || -> Result<CommRun> {
            cfg.runtime.build()?.block_on(async move {
                let comm = Communicator::join(ccfg, &rdv).await?;
                let out = if r == 0 {
                    rank0(&comm, &cfg).await
                } else {
                    rank1(&comm, &cfg).await
                };
                comm.close().await;
                out
            })
        }));
    }
    let mut it = handles.into_iter();
    let (h0, h1) = match (it.next(), it.next()) {
        (Some(a), Some(b)) => (a, b),
        _ => return Err(Error::invalid("benchmark threads")),
    };
    let r0 = join_thread(h0)?;
    let r1 = join_thread(h1)?;
    Ok(CommRun {
        stream: r1.stream,
        pingpong_us: r0.pingpong_us,
    })
}

async fn rank0(comm: &Communicator, cfg: &P2pBenchConfig) -> Result<CommRun> {
    let peer = Rank(1);
    let mut token = Tensor::zeros(DType::U8, [1])?;
    for &size in &cfg.sizes {
        // Written, as a user's data is (see `crate::raw_ones`).
        let buf = crate::raw_ones(size);
        let warm = cfg.messages(size).min(8);
        for _ in 0..warm {
            comm.send(peer, DATA, &buf).await?;
        }
        comm.recv(peer, READY, &mut token).await?;
        for _ in 0..cfg.messages(size) {
            comm.send(peer, DATA, &buf).await?;
        }
    }
    let mut buf = Tensor::zeros(DType::U8, [cfg.pingpong_bytes])?;
    let warm = cfg.pingpong_rounds.min(200);
    for _ in 0..warm {
        comm.send(peer, DATA, &buf).await?;
        comm.recv(peer, DATA, &mut buf).await?;
    }
    let start = Instant::now();
    for _ in 0..cfg.pingpong_rounds {
        comm.send(peer, DATA, &buf).await?;
        comm.recv(peer, DATA, &mut buf).await?;
    }
    Ok(CommRun {
        stream: Vec::new(),
        pingpong_us: half_rtt_us(cfg.pingpong_rounds, start.elapsed()),
    })
}

async fn rank1(comm: &Communicator, cfg: &P2pBenchConfig) -> Result<CommRun> {
    let peer = Rank(0);
    let token = Tensor::zeros(DType::U8, [1])?;
    let mut stream = Vec::new();
    for &size in &cfg.sizes {
        let mut buf = Tensor::zeros(DType::U8, [size])?;
        let warm = cfg.messages(size).min(8);
        for _ in 0..warm {
            comm.recv(peer, DATA, &mut buf).await?;
        }
        let n = cfg.messages(size);
        comm.send(peer, READY, &token).await?;
        let start = Instant::now();
        for _ in 0..n {
            comm.recv(peer, DATA, &mut buf).await?;
        }
        stream.push(gbps(size * n, start.elapsed()));
    }
    let mut buf = Tensor::zeros(DType::U8, [cfg.pingpong_bytes])?;
    let warm = cfg.pingpong_rounds.min(200);
    for _ in 0..warm + cfg.pingpong_rounds {
        comm.recv(peer, DATA, &mut buf).await?;
        comm.send(peer, DATA, &buf).await?;
    }
    Ok(CommRun {
        stream,
        pingpong_us: 0.0,
    })
}

fn raw_pair() -> Result<(TcpStream, TcpStream)> {
    let io = |c| move |e| Error::io(c, e);
    let l = TcpListener::bind("127.0.0.1:0").map_err(io("raw bind"))?;
    let addr = l.local_addr().map_err(io("raw addr"))?;
    let a = TcpStream::connect(addr).map_err(io("raw connect"))?;
    let (b, _) = l.accept().map_err(io("raw accept"))?;
    for s in [&a, &b] {
        s.set_nodelay(true).map_err(io("raw nodelay"))?;
    }
    Ok((a, b))
}

/// One raw TCP stream between two blocking threads; same protocol as the ranks.
fn raw_stream(size: usize, n: usize) -> Result<f64> {
    let io = |c| move |e| Error::io(c, e);
    let (mut tx, mut rx) = raw_pair()?;
    let warm = n.min(8);
    let sender = std::thread::spawn(move || -> Result<()> {
        let buf = crate::raw_ones(size);
        for _ in 0..warm {
            tx.write_all(buf.as_bytes()).map_err(io("raw write"))?;
        }
        let mut t = [0u8; 1];
        tx.read_exact(&mut t).map_err(io("raw read"))?;
        for _ in 0..n {
            tx.write_all(buf.as_bytes()).map_err(io("raw write"))?;
        }
        Ok(())
    });
    let mut buf = crate::raw_buffer(size);
    for _ in 0..warm {
        rx.read_exact(buf.bytes_mut()).map_err(io("raw read"))?;
    }
    rx.write_all(&[1]).map_err(io("raw write"))?;
    let start = Instant::now();
    for _ in 0..n {
        rx.read_exact(buf.bytes_mut()).map_err(io("raw read"))?;
    }
    let t = start.elapsed();
    join_thread(sender)?;
    Ok(gbps(size * n, t))
}

/// Raw socket ping-pong between two blocking threads.
fn raw_pingpong(bytes: usize, rounds: usize) -> Result<f64> {
    let io = |c| move |e| Error::io(c, e);
    let (mut a, mut b) = raw_pair()?;
    let warm = rounds.min(200);
    let echo = std::thread::spawn(move || -> Result<()> {
        let mut buf = crate::raw_buffer(bytes);
        for _ in 0..warm + rounds {
            b.read_exact(buf.bytes_mut()).map_err(io("raw read"))?;
            b.write_all(buf.as_bytes()).map_err(io("raw write"))?;
        }
        Ok(())
    });
    let mut buf = crate::raw_buffer(bytes);
    let mut start = Instant::now();
    for i in 0..warm + rounds {
        if i == warm {
            start = Instant::now();
        }
        a.write_all(buf.as_bytes()).map_err(io("raw write"))?;
        a.read_exact(buf.bytes_mut()).map_err(io("raw read"))?;
    }
    let t = start.elapsed();
    join_thread(echo)?;
    Ok(half_rtt_us(rounds, t))
}

/// Raw Tokio socket ping-pong, each side on its own thread and runtime like the
/// ranks: what the async runtime itself costs.
fn raw_tokio_pingpong(cfg: &P2pBenchConfig) -> Result<f64> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let io = |c| move |e| Error::io(c, e);
    let (a, b) = raw_pair()?;
    for s in [&a, &b] {
        s.set_nonblocking(true).map_err(io("raw nonblocking"))?;
    }
    let (bytes, rounds, kind) = (cfg.pingpong_bytes, cfg.pingpong_rounds, cfg.runtime);
    let warm = rounds.min(200);
    let echo = std::thread::spawn(move || -> Result<f64> {
        kind.build()?.block_on(async move {
            let mut b = tokio::net::TcpStream::from_std(b).map_err(io("raw tokio"))?;
            let mut buf = crate::raw_buffer(bytes);
            for _ in 0..warm + rounds {
                b.read_exact(buf.bytes_mut()).await.map_err(io("raw read"))?;
                b.write_all(buf.as_bytes()).await.map_err(io("raw write"))?;
            }
            Ok(0.0)
        })
    });
    let us = kind.build()?.block_on(async move {
        let mut a = tokio::net::TcpStream::from_std(a).map_err(io("raw tokio"))?;
        let mut buf = crate::raw_buffer(bytes);
        let mut start = Instant::now();
        for i in 0..warm + rounds {
            if i == warm {
                start = Instant::now();
            }
            a.write_all(buf.as_bytes()).await.map_err(io("raw write"))?;
            a.read_exact(buf.bytes_mut()).await.map_err(io("raw read"))?;
        }
        Ok::<_, Error>(half_rtt_us(rounds, start.elapsed()))
    })?;
    join_thread(echo)?;
    Ok(us)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn message_counts_and_formatting() {
        let c = P2pBenchConfig::default();
        assert_eq!(c.sizes.first(), Some(&4));
        assert_eq!(c.sizes.last(), Some(&(256 << 20)));
        assert_eq!(c.messages(4), c.max_messages);
        assert_eq!(c.messages(256 << 20), 3);
        assert_eq!(human(256 << 20), "256 MiB");
        assert_eq!(human(64 << 10), "64 KiB");
        assert_eq!(human(4), "4 B");
        let mut v = vec![3.0, 1.0, 2.0];
        assert_eq!(median(&mut v), 2.0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn quick_run_produces_a_report() {
        let r = p2p(P2pBenchConfig::quick()).await.unwrap();
        assert_eq!(r.stream.len(), 3);
        for row in &r.stream {
            assert!(row.comm_gbps > 0.0 && row.raw_gbps > 0.0, "{row:?}");
        }
        assert!(r.pingpong.comm_us > 0.0 && r.pingpong.raw_us > 0.0);
        let text = r.to_string();
        assert!(
            text.contains("4 MiB") && text.contains("half round-trip"),
            "{text}"
        );
    }
}
