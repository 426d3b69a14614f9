//! The collectives benchmark, as a library function so that both
//! `cargo bench --bench collectives` and a CLI can run it. For each world size, the
//! ranks of one world run in this process over loopback, **each on its own OS
//! thread with its own Tokio runtime** (current-thread by default, like separate
//! single-threaded processes). For each operation and buffer size every rank runs
//! warm-up calls, then `repeats` measurements of `iters` back-to-back calls
//! started after a barrier; a measurement's time is the slowest rank's (agreed
//! with an all-reduce of the elapsed times), and the reported time per call is the
//! median measurement divided by `iters`.
//!
//! Bandwidths follow the nccl-tests conventions: *algorithm bandwidth* is the
//! buffer size divided by the time, *bus bandwidth* multiplies it by the traffic
//! factor of the operation (`2(n-1)/n` for all-reduce, `(n-1)/n` for all-gather,
//! reduce-scatter and all-to-all, `1` for broadcast and reduce), which makes
//! figures comparable with a link's bandwidth. The buffer size is: the tensor of
//! all-reduce, broadcast and reduce; the gathered output of all-gather; the
//! scattered input of reduce-scatter; each rank's input of all-to-all. Data are
//! `float32`.

use crate::p2p::human;
use std::fmt;
use std::sync::Arc;
use std::time::Instant;

use crate::p2p::RankRuntime;
use multiworld_collectives::{CollectiveConfig, CollectiveKind as Kind, Group};
use multiworld_tcp::{CommConfig, Communicator, Error, MemoryRendezvous, Result};
use multiworld_types::ReduceOp;
use multiworld_types::Tensor;
use multiworld_types::{Generation, Rank, WorldName};

/// An operation the benchmark can run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum BenchOp {
    /// `all_reduce` (sum).
    AllReduce,
    /// `broadcast` from rank 0.
    Broadcast,
    /// `reduce` (sum) to rank 0.
    Reduce,
    /// `all_gather_into_tensor`.
    AllGather,
    /// `reduce_scatter_tensor` (sum).
    ReduceScatter,
    /// `all_to_all_single` with even splits.
    AllToAll,
}

impl BenchOp {
    /// Every operation.
    pub const ALL: [BenchOp; 6] = [
        BenchOp::AllReduce,
        BenchOp::Broadcast,
        BenchOp::Reduce,
        BenchOp::AllGather,
        BenchOp::ReduceScatter,
        BenchOp::AllToAll,
    ];

    /// The name used in reports and by [`BenchOp::parse`].
    pub fn name(self) -> &'static str {
        match self {
            BenchOp::AllReduce => "all_reduce",
            BenchOp::Broadcast => "broadcast",
            BenchOp::Reduce => "reduce",
            BenchOp::AllGather => "all_gather",
            BenchOp::ReduceScatter => "reduce_scatter",
            BenchOp::AllToAll => "all_to_all",
        }
    }

    /// The operation called `name`.
    pub fn parse(name: &str) -> Option<BenchOp> {
        BenchOp::ALL.into_iter().find(|o| o.name() == name)
    }

    fn bus_factor(self, n: u32) -> f64 {
        let n = f64::from(n);
        match self {
            BenchOp::AllReduce => 2.0 * (n - 1.0) / n,
            BenchOp::Broadcast | BenchOp::Reduce => 1.0,
            BenchOp::AllGather | BenchOp::ReduceScatter | BenchOp::AllToAll => (n - 1.0) / n,
        }
    }
}

/// What to measure.
#[derive(Debug, Clone)]
pub struct CollectivesBenchConfig {
    /// Buffer sizes in bytes (see the module docs for what "buffer" means per op).
    pub sizes: Vec<usize>,
    /// World sizes to run.
    pub world_sizes: Vec<u32>,
    /// Operations to run.
    pub ops: Vec<BenchOp>,
    /// The groups' settings (algorithm choice, chunk size, ...).
    pub collective: CollectiveConfig,
    /// Measurements per point; the median is reported.
    pub repeats: usize,
    /// Bytes of buffer processed per measurement; the call count is derived from
    /// it and clamped to `min_iters..=max_iters`.
    pub bytes_per_point: usize,
    /// Fewest calls per measurement.
    pub min_iters: usize,
    /// Most calls per measurement.
    pub max_iters: usize,
    /// Runtime of each rank.
    pub runtime: RankRuntime,
}

impl Default for CollectivesBenchConfig {
    /// 1 KiB to 64 MiB in steps of 4x, 2 and 4 ranks, every op, median of 3,
    /// 256 MiB per point (3 to 1000 calls), a current-thread runtime per rank.
    fn default() -> Self {
        CollectivesBenchConfig {
            sizes: (0..=8).map(|i| 1024usize << (2 * i)).collect(),
            world_sizes: vec![2, 4],
            ops: BenchOp::ALL.to_vec(),
            collective: CollectiveConfig::default(),
            repeats: 3,
            bytes_per_point: 256 << 20,
            min_iters: 3,
            max_iters: 1000,
            runtime: RankRuntime::CurrentThread,
        }
    }
}

impl CollectivesBenchConfig {
    /// A small, quick configuration (for smoke tests).
    pub fn quick() -> Self {
        CollectivesBenchConfig {
            sizes: vec![1024, 1 << 20, 16 << 20],
            repeats: 1,
            bytes_per_point: 32 << 20,
            min_iters: 2,
            max_iters: 100,
            ..CollectivesBenchConfig::default()
        }
    }

    fn iters(&self, size: usize) -> usize {
        (self.bytes_per_point / size.max(1))
            .clamp(self.min_iters.max(1), self.max_iters.max(self.min_iters.max(1)))
    }
}

/// One measured point.
#[derive(Debug, Clone, PartialEq)]
pub struct BenchRow {
    /// The operation.
    pub op: BenchOp,
    /// World size.
    pub ranks: u32,
    /// Buffer size in bytes.
    pub bytes: usize,
    /// The algorithm the group chose (`direct` or `ring`).
    pub algorithm: &'static str,
    /// Calls per measurement.
    pub iters: usize,
    /// Median time per call, µs.
    pub time_us: f64,
    /// Algorithm bandwidth, GB/s (10^9 bytes/s).
    pub algbw_gbps: f64,
    /// Bus bandwidth, GB/s.
    pub busbw_gbps: f64,
}

/// The physical reference for one world size, measured in the same run: the
/// traffic of a ring all-reduce of `bytes` (each rank sends `2(n-1)/n × bytes` to
/// its ring successor while receiving as much from its predecessor; with two ranks
/// that is both directions of one connection) over plain blocking TCP sockets
/// between threads, 256 KiB writes, with no reduction and no copies: a floor for
/// any TCP all-reduce on this machine.
#[derive(Debug, Clone, PartialEq)]
pub struct RawRingRow {
    /// World size.
    pub ranks: u32,
    /// All-reduce buffer size the traffic corresponds to.
    pub bytes: usize,
    /// Best time over the repeats, µs.
    pub time_us: f64,
}

/// The memory reference for one world size, measured in the same run: as many
/// threads as ranks each copy `bytes` between two buffers of their own (already
/// touched), all at once. A large all-reduce touches memory several times per
/// byte on every rank (the kernel's copies into and out of the sockets, the
/// reduction, the copy out of the receive scratch), so this rate bounds it from
/// below as much as the raw TCP floor does.
#[derive(Debug, Clone, PartialEq)]
pub struct MemCopyRow {
    /// Threads copying at once (the world size).
    pub threads: u32,
    /// Bytes each thread copies.
    pub bytes: usize,
    /// Best time over the repeats for all of them to finish, µs.
    pub time_us: f64,
}

/// The benchmark's results.
#[derive(Debug, Clone, PartialEq)]
pub struct CollectivesReport {
    /// Runtime of each rank.
    pub runtime: RankRuntime,
    /// Chunk size of the pipelined algorithms.
    pub chunk_bytes: usize,
    /// One row per (world size, op, size).
    pub rows: Vec<BenchRow>,
    /// Raw-TCP references (largest size, when all-reduce was measured).
    pub raw: Vec<RawRingRow>,
    /// Memory-copy references (largest size, when all-reduce was measured).
    pub memory: Vec<MemCopyRow>,
}

impl CollectivesReport {
    /// The row for `op` over `ranks` at `bytes`, if measured.
    pub fn row(&self, op: BenchOp, ranks: u32, bytes: usize) -> Option<&BenchRow> {
        self.rows
            .iter()
            .find(|r| r.op == op && r.ranks == ranks && r.bytes == bytes)
    }
}

impl fmt::Display for CollectivesReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "collectives over loopback, float32 ({}, one thread per rank, chunk {})",
            self.runtime,
            human(self.chunk_bytes)
        )?;
        writeln!(
            f,
            "{:>15} {:>5} {:>9} {:>7} {:>6} {:>12} {:>11} {:>11}",
            "op", "ranks", "size", "algo", "iters", "time", "algbw GB/s", "busbw GB/s"
        )?;
        for r in &self.rows {
            let time = duration_text(r.time_us);
            writeln!(
                f,
                "{:>15} {:>5} {:>9} {:>7} {:>6} {:>12} {:>11.3} {:>11.3}",
                r.op.name(),
                r.ranks,
                human(r.bytes),
                r.algorithm,
                r.iters,
                time,
                r.algbw_gbps,
                r.busbw_gbps
            )?;
        }
        for raw in &self.raw {
            let ours = self
                .row(BenchOp::AllReduce, raw.ranks, raw.bytes)
                .map(|r| r.time_us);
            write!(
                f,
                "raw TCP floor, ring all-reduce traffic of {} over {} ranks (blocking sockets, no reduction): {}",
                human(raw.bytes),
                raw.ranks,
                duration_text(raw.time_us)
            )?;
            match ours {
                Some(t) => writeln!(f, "; all_reduce / floor = {:.2}x", t / raw.time_us)?,
                None => writeln!(f)?,
            }
        }
        for m in &self.memory {
            let secs = m.time_us / 1e6;
            writeln!(
                f,
                "memory copy reference: {} threads each copying {} at once: {} ({:.1} GB/s per thread)",
                m.threads,
                human(m.bytes),
                duration_text(m.time_us),
                m.bytes as f64 / secs / 1e9
            )?;
        }
        Ok(())
    }
}

/// A time in microseconds as text: milliseconds from 10 ms up, microseconds
/// below (so that small sizes do not print as "0.00 ms").
fn duration_text(us: f64) -> String {
    if us >= 10_000.0 {
        format!("{:.2} ms", us / 1000.0)
    } else {
        format!("{us:.1} µs")
    }
}

/// Runs the benchmark from async code (it runs on its own threads).
pub async fn collectives_bench(cfg: CollectivesBenchConfig) -> Result<CollectivesReport> {
    crate::p2p::run_blocking(move || collectives_bench_blocking(&cfg)).await
}

/// Runs the benchmark on the calling thread (plus one thread per rank).
pub fn collectives_bench_blocking(cfg: &CollectivesBenchConfig) -> Result<CollectivesReport> {
    if cfg.sizes.contains(&0) || cfg.repeats == 0 || cfg.world_sizes.contains(&0) {
        return Err(Error::invalid(
            "sizes and world sizes must be non-zero, repeats at least 1",
        ));
    }
    let mut rows = Vec::new();
    let mut raw = Vec::new();
    let mut memory = Vec::new();
    let largest = cfg.sizes.iter().copied().max().unwrap_or(0);
    for &n in &cfg.world_sizes {
        rows.extend(run_world(cfg, n)?);
        if n > 1 && cfg.ops.contains(&BenchOp::AllReduce) {
            let mut best = f64::INFINITY;
            for _ in 0..cfg.repeats {
                best = best.min(raw_ring(n as usize, largest)?);
            }
            raw.push(RawRingRow {
                ranks: n,
                bytes: largest,
                time_us: best * 1e6,
            });
            memory.push(MemCopyRow {
                threads: n,
                bytes: largest,
                time_us: mem_copy(n as usize, largest, cfg.repeats)? * 1e6,
            });
        }
    }
    Ok(CollectivesReport {
        runtime: cfg.runtime,
        chunk_bytes: cfg.collective.chunk_bytes,
        rows,
        raw,
        memory,
    })
}

/// Best seconds, over `repeats`, for `threads` threads to each copy `bytes`
/// between two buffers of their own at the same time (see [`MemCopyRow`]).
fn mem_copy(threads: usize, bytes: usize, repeats: usize) -> Result<f64> {
    let start = Arc::new(std::sync::Barrier::new(threads + 1));
    let done = Arc::new(std::sync::Barrier::new(threads + 1));
    let workers: Vec<_> = (0..threads)
        .map(|_| {
            let (start, done) = (Arc::clone(&start), Arc::clone(&done));
            std::thread::spawn(move || {
                // Non-zero contents, so every page is really backed before timing.
                let src = vec![1u8; bytes];
                let mut dst = vec![2u8; bytes];
                for _ in 0..repeats {
                    start.wait();
                    dst.copy_from_slice(&src);
                    std::hint::black_box(&mut dst);
                    done.wait();
                }
            })
        })
        .collect();
    let mut best = f64::INFINITY;
    for _ in 0..repeats {
        start.wait();
        let t0 = Instant::now();
        done.wait();
        best = best.min(t0.elapsed().as_secs_f64());
    }
    for w in workers {
        if let Err(p) = w.join() {
            std::panic::resume_unwind(p);
        }
    }
    Ok(best)
}

/// Seconds to move a ring all-reduce's traffic for `bytes` over `n` ranks with
/// blocking sockets (see [`RawRingRow`]).
fn raw_ring(n: usize, bytes: usize) -> Result<f64> {
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    const WRITE: usize = 256 << 10;
    let io = |e| Error::io("raw TCP reference", e);
    let per_rank = bytes / n * 2 * (n - 1);
    // Edge i connects rank i to rank i+1; with two ranks one connection serves
    // both directions, as in the communicator.
    let edges = if n == 2 { 1 } else { n };
    let mut ends: Vec<(TcpStream, TcpStream)> = Vec::new();
    for _ in 0..edges {
        let l = TcpListener::bind("127.0.0.1:0").map_err(io)?;
        let a = TcpStream::connect(l.local_addr().map_err(io)?).map_err(io)?;
        let (b, _) = l.accept().map_err(io)?;
        a.set_nodelay(true).map_err(io)?;
        b.set_nodelay(true).map_err(io)?;
        ends.push((a, b));
    }
    let start = Arc::new(std::sync::Barrier::new(2 * n + 1));
    let mut threads = Vec::new();
    for r in 0..n {
        // Rank r writes on its end of edge r and reads from its end of edge r-1.
        let (mut tx, mut rx) = if n == 2 {
            let s = if r == 0 { &ends[0].0 } else { &ends[0].1 };
            (s.try_clone().map_err(io)?, s.try_clone().map_err(io)?)
        } else {
            (
                ends[r].0.try_clone().map_err(io)?,
                ends[(r + n - 1) % n].1.try_clone().map_err(io)?,
            )
        };
        let (s1, s2) = (Arc::clone(&start), Arc::clone(&start));
        threads.push(std::thread::spawn(move || -> std::io::Result<()> {
            let buf = vec![1u8; WRITE];
            s1.wait();
            let mut left = per_rank;
            while left > 0 {
                let k = left.min(WRITE);
                tx.write_all(&buf[..k])?;
                left -= k;
            }
            Ok(())
        }));
        threads.push(std::thread::spawn(move || -> std::io::Result<()> {
            let mut buf = vec![0u8; WRITE];
            s2.wait();
            let mut left = per_rank;
            while left > 0 {
                let k = left.min(WRITE);
                rx.read_exact(&mut buf[..k])?;
                left -= k;
            }
            Ok(())
        }));
    }
    start.wait();
    let t0 = Instant::now();
    for t in threads {
        match t.join() {
            Ok(r) => r.map_err(io)?,
            Err(p) => std::panic::resume_unwind(p),
        }
    }
    Ok(t0.elapsed().as_secs_f64())
}

fn run_world(cfg: &CollectivesBenchConfig, n: u32) -> Result<Vec<BenchRow>> {
    let rdv = MemoryRendezvous::new();
    let world = WorldName::new(format!("bench-collectives-{n}"))?;
    // Every rank finishes before any closes: a member that leaves while another
    // is still inside a call makes that call fail (see `Group`).
    let done = Arc::new(std::sync::Barrier::new(n as usize));
    let mut threads = Vec::new();
    for r in 0..n {
        let (cfg, rdv, done) = (cfg.clone(), rdv.clone(), Arc::clone(&done));
        let ccfg = CommConfig::new(world.clone(), Generation(1), Rank(r), n);
        threads.push(std::thread::spawn(move || -> Result<Vec<BenchRow>> {
            cfg.runtime.build()?.block_on(async move {
                let comm = Arc::new(Communicator::join(ccfg, &rdv).await?);
                let g = Group::world(&comm).with_config(cfg.collective.clone());
                let out = rank_main(&g, &cfg).await;
                drop(g);
                // Blocks this rank's thread, which is all it has left to do.
                done.wait();
                comm.close().await;
                out
            })
        }));
    }
    let mut rows = Vec::new();
    let mut first_err = None;
    for (r, t) in threads.into_iter().enumerate() {
        match t.join() {
            Ok(Ok(v)) if r == 0 => rows = v,
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                first_err.get_or_insert(e);
            }
            Err(p) => std::panic::resume_unwind(p),
        }
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok(rows),
    }
}

/// The buffers of one operation at one size.
struct Buffers {
    op: BenchOp,
    a: Tensor,
    b: Tensor,
}

impl Buffers {
    fn new(op: BenchOp, bytes: usize, n: usize) -> Result<Buffers> {
        let elems = bytes / 4;
        let per = elems / n;
        // Ones, not zeros: this kernel merges all-zero pages back into the shared
        // zero page, and every call would then pay copy-on-write faults (sums of
        // ones overflow to infinity after a while, which costs nothing extra).
        let z = |k: usize| Ok::<_, Error>(Tensor::from(vec![1.0f32; k]));
        let (a, b) = match op {
            BenchOp::AllReduce | BenchOp::Broadcast | BenchOp::Reduce => (z(elems)?, z(0)?),
            BenchOp::AllGather => (z(per)?, z(per * n)?),
            BenchOp::ReduceScatter => (z(per * n)?, z(per)?),
            BenchOp::AllToAll => (z(per * n)?, z(per * n)?),
        };
        Ok(Buffers { op, a, b })
    }

    async fn run(&mut self, g: &Group) -> Result<()> {
        match self.op {
            BenchOp::AllReduce => g.all_reduce(&mut self.a, ReduceOp::Sum).await,
            BenchOp::Broadcast => g.broadcast(&mut self.a, Rank(0)).await,
            BenchOp::Reduce => g.reduce(&mut self.a, Rank(0), ReduceOp::Sum).await,
            BenchOp::AllGather => g.all_gather_into_tensor(&mut self.b, &self.a).await,
            BenchOp::ReduceScatter => g.reduce_scatter_tensor(&mut self.b, &self.a, ReduceOp::Sum).await,
            BenchOp::AllToAll => g.all_to_all_single(&mut self.b, &self.a, None, None).await,
        }
    }

    /// The algorithm the calls used (after they ran: whether shared memory is
    /// available is only known then).
    async fn algorithm(&self, g: &Group) -> &'static str {
        let (kind, size) = match self.op {
            BenchOp::AllReduce => (Kind::AllReduce, self.a.nbytes()),
            BenchOp::Broadcast => (Kind::Broadcast, self.a.nbytes()),
            BenchOp::Reduce => (Kind::Reduce, self.a.nbytes()),
            BenchOp::AllGather => (Kind::AllGatherInto, self.a.nbytes()),
            BenchOp::ReduceScatter => (Kind::ReduceScatterTensor, self.b.nbytes()),
            BenchOp::AllToAll => (Kind::AllToAllSingle, 0),
        };
        g.algorithm_name(kind, size as u64).await
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

async fn rank_main(g: &Group, cfg: &CollectivesBenchConfig) -> Result<Vec<BenchRow>> {
    let n = g.size();
    let mut rows = Vec::new();
    for &op in &cfg.ops {
        for &size in &cfg.sizes {
            let mut bufs = Buffers::new(op, size, n)?;
            let iters = cfg.iters(size);
            for _ in 0..iters.min(2) {
                bufs.run(g).await?;
            }
            let mut times = Vec::with_capacity(cfg.repeats);
            for _ in 0..cfg.repeats {
                g.barrier().await?;
                let t0 = Instant::now();
                for _ in 0..iters {
                    bufs.run(g).await?;
                }
                let mut slowest = Tensor::from(vec![t0.elapsed().as_secs_f64()]);
                g.all_reduce(&mut slowest, ReduceOp::Max).await?;
                times.push(slowest.as_slice::<f64>()?.first().copied().unwrap_or(f64::NAN));
            }
            let per_call = median(&mut times) / iters as f64;
            let algbw = size as f64 / per_call / 1e9;
            rows.push(BenchRow {
                op,
                ranks: n as u32,
                bytes: size,
                algorithm: bufs.algorithm(g).await,
                iters,
                time_us: per_call * 1e6,
                algbw_gbps: algbw,
                busbw_gbps: algbw * op.bus_factor(n as u32),
            });
        }
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn quick_run_reports_every_point() {
        let mut cfg = CollectivesBenchConfig::quick();
        cfg.sizes = vec![4096, 1 << 20];
        cfg.world_sizes = vec![2, 3];
        cfg.bytes_per_point = 4 << 20;
        cfg.max_iters = 4;
        let report = collectives_bench_blocking(&cfg).unwrap();
        assert_eq!(report.rows.len(), 2 * 2 * BenchOp::ALL.len());
        for r in &report.rows {
            assert!(r.time_us > 0.0 && r.algbw_gbps > 0.0, "{r:?}");
        }
        let r = report.row(BenchOp::AllReduce, 2, 1 << 20).unwrap();
        assert_eq!(r.algorithm, "shm", "ranks of one process share memory");
        assert_eq!(
            report.row(BenchOp::AllReduce, 3, 4096).unwrap().algorithm,
            "direct"
        );
        let text = report.to_string();
        assert!(text.contains("all_to_all") && text.contains("busbw"), "{text}");
        assert_eq!(report.raw.len(), 2);
        assert!(report.raw.iter().all(|r| r.time_us > 0.0 && r.bytes == 1 << 20));
        assert!(text.contains("raw TCP floor"), "{text}");
        assert_eq!(report.memory.len(), 2);
        assert!(
            report
                .memory
                .iter()
                .all(|m| m.time_us > 0.0 && m.bytes == 1 << 20)
        );
        assert!(text.contains("memory copy reference"), "{text}");
        assert_eq!(BenchOp::parse("reduce_scatter"), Some(BenchOp::ReduceScatter));
    }
}
