//! `multiworld-testkit` (tests only, never published): the helpers the
//! integration tests of the workspace share, in one place instead of copied
//! between test files (or shared between crates' test directories through
//! `#[path]`).
//!
//! Map of the modules:
//!
//! | module | what |
//! |---|---|
//! | crate root | joining in-process worlds ([`mesh`], [`pair`]), a file-based rendezvous for ranks in several processes ([`FileRendezvous`]), test data patterns, [`eventually`] |
//! | [`coll`] | in-process worlds of collective groups, one closure per rank with a hang guard, exact per-rank inputs and the sequential reference they are checked against |
//! | [`logs`] | capturing what the code under test logs ([`logs::with_captured_logs`]) |
//! | [`memory`] | worlds built in memory (the transport's `memory` feature): communicators and collective groups over pipes, no sockets |
//! | [`process`] | child processes: the one kill-on-drop guard ([`process::Guard`]: a process group of its own, SIGKILLed and reaped on drop), runs to completion with a deadline and captured output ([`process::run`]), re-executing the test binary as a peer ([`process::self_test_command`]), pids a child reported ([`process::KillOnPanic`], [`process::gone`]) |
//! | `facade` (feature `facade`) | helpers that need the facade `multiworld`: `next_event_for`, the next world event about one world |
//! | `fake_nccl` (feature `nccl`) | the fake CUDA driver and NCCL (`fake/fake_cuda_nccl.c`), compiled at test time and loaded through `multiworld-nccl`, with their control functions and the lock that serialises the tests using them |
//! | [`proxy`] | a fault-injecting TCP proxy (partition, one-way loss, half-open, latency, bandwidth, resets, closes) and [`proxy::WorldProxy`], which puts proxies between the members of a facade world |
//!
//! The features exist so that the transport's and the collectives' tests do
//! not build the facade or the NCCL backend; a crate's tests enable what
//! they use in their `[dev-dependencies]` (the facade's tests depend on the
//! test kit, which depends on the facade: a cycle cargo allows for
//! integration tests).
//!
//! Helpers panic on failure (they are test code): a failed setup is a failed
//! test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

pub mod coll;
#[cfg(feature = "facade")]
pub mod facade;
#[cfg(feature = "nccl")]
pub mod fake_nccl;
pub mod logs;
pub mod memory;
pub mod process;
pub mod proxy;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use multiworld_tcp::BoxFuture;
use multiworld_tcp::{
    CommConfig, Communicator, DType, Generation, MemoryRendezvous, Rank, Rendezvous, RendezvousError, Tensor,
    WorldName,
};

/// The secret every test world uses.
pub const SECRET: &[u8] = b"correct horse battery staple";

/// Logs to the test output when RUST_LOG is set.
pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

/// The runtime a test process (or a child rank it re-executes) runs on:
/// two worker threads, as on the project's machine.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// A runtime of `workers` worker threads whose blocking pool has a single
/// thread, for [`hold_blocking_pool`].
pub fn runtime_with_one_blocking_thread(workers: usize) -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .max_blocking_threads(1)
        .enable_all()
        .build()
        .unwrap()
}

/// Occupies the only blocking-pool thread of `rt` (made by
/// [`runtime_with_one_blocking_thread`]) until the returned sender is sent
/// to or dropped: a wait that hands its sleeping to the pool cannot end
/// meanwhile. Returns once the thread is taken.
pub fn hold_blocking_pool(rt: &tokio::runtime::Runtime) -> std::sync::mpsc::Sender<()> {
    let (release, held) = std::sync::mpsc::channel::<()>();
    let (started_tx, started) = std::sync::mpsc::channel::<()>();
    drop(rt.spawn_blocking(move || {
        started_tx.send(()).unwrap();
        let _ = held.recv();
    }));
    started.recv().unwrap();
    release
}

/// A world name (panics on an invalid one).
pub fn world(name: &str) -> WorldName {
    WorldName::new(name).unwrap()
}

/// The config of `rank` of a world of `size` named `name`, generation 1, with [`SECRET`].
pub fn config(name: &str, rank: u32, size: u32) -> CommConfig {
    CommConfig::new(world(name), Generation(1), Rank(rank), size).with_secret(SECRET)
}

/// Joins `size` ranks of one world in this process; `tweak` adjusts each config.
pub async fn mesh_with(name: &str, size: u32, tweak: impl Fn(CommConfig) -> CommConfig) -> Vec<Communicator> {
    init_tracing();
    let rdv = MemoryRendezvous::new();
    let mut joins = Vec::new();
    for r in 0..size {
        let cfg = tweak(config(name, r, size));
        let rdv = rdv.clone();
        joins.push(tokio::spawn(async move { Communicator::join(cfg, &rdv).await }));
    }
    let mut out = Vec::new();
    for j in joins {
        out.push(j.await.unwrap().expect("join"));
    }
    out
}

/// Joins `size` ranks of one world in this process.
pub async fn mesh(name: &str, size: u32) -> Vec<Communicator> {
    mesh_with(name, size, |c| c).await
}

/// Joins a world of two in this process.
pub async fn pair(name: &str) -> (Communicator, Communicator) {
    let mut v = mesh(name, 2).await;
    let b = v.pop().unwrap();
    let a = v.pop().unwrap();
    (a, b)
}

/// A deterministic byte pattern (valid for every dtype, bool included when `bool`).
pub fn pattern(len: usize, seed: u8, bool_like: bool) -> Vec<u8> {
    (0..len)
        .map(|i| {
            let x = (i as u32).wrapping_mul(2_654_435_761).rotate_left(7) as u8 ^ seed;
            if bool_like { x & 1 } else { x }
        })
        .collect()
}

/// A tensor of `numel` elements of `dtype` filled with a pattern.
pub fn patterned(dtype: DType, numel: usize, seed: u8) -> Tensor {
    let bytes = pattern(numel * dtype.size(), seed, dtype == DType::Bool);
    Tensor::from_bytes(dtype, [numel], &bytes).unwrap()
}

/// Polls `cond` every millisecond for at most `limit`.
pub async fn eventually(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        if cond() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    cond()
}

/// A rendezvous through files in a directory, for ranks in different processes.
pub struct FileRendezvous {
    /// The directory holding one file per published key.
    pub dir: PathBuf,
}

impl FileRendezvous {
    fn path(&self, key: &str) -> PathBuf {
        self.dir.join(key.replace(['/', '#'], "_"))
    }
}

impl Rendezvous for FileRendezvous {
    fn set<'a>(&'a self, key: &'a str, value: Vec<u8>) -> BoxFuture<'a, Result<(), RendezvousError>> {
        Box::pin(async move {
            let path = self.path(key);
            let tmp = path.with_extension(format!("tmp{}", std::process::id()));
            std::fs::write(&tmp, &value)
                .and_then(|()| std::fs::rename(&tmp, &path))
                .map_err(|e| RendezvousError::Unavailable(e.to_string().into()))
        })
    }

    fn get<'a>(&'a self, key: &'a str, timeout: Duration) -> BoxFuture<'a, Result<Vec<u8>, RendezvousError>> {
        Box::pin(async move {
            let path = self.path(key);
            let start = Instant::now();
            loop {
                if let Ok(v) = std::fs::read(&path) {
                    return Ok(v);
                }
                if start.elapsed() >= timeout {
                    return Err(RendezvousError::Timeout {
                        key: key.to_owned(),
                        after: timeout,
                    });
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    }
}

/// A fresh, unique temporary directory (removed by the caller).
pub fn temp_dir(tag: &str) -> PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let dir = std::env::temp_dir().join(format!("mw-tcp-{tag}-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
