//! A leader and its worker processes: the leader (this process) is rank 0 of
//! one world per worker, hosts all their stores on one port, and receives a
//! checksummed stream from each worker (`m8d worker`, a real process). Faults
//! are real: SIGKILL, SIGSTOP/SIGCONT. Used by the failover benchmark, the
//! demo, and the fault-injection tests.

use std::{
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use multiworld::{Rank, World, WorldConfig, WorldError, WorldManager, WorldState};
use nix::{
    sys::signal::{Signal, kill},
    unistd::Pid,
};
use tokio::task::JoinHandle;

use crate::stream::{StreamStats, receive_stream, request_end};

/// The environment variable through which this crate asks each `m8d`
/// process it starts (the fleet's workers, the benchmarks' workers and
/// store) to end with it: set to the starting process's pid (see
/// [`ends_with_this_process`] and [`die_with_parent`]). Without it, a leader
/// killed outright would leave its workers running, and a frozen one
/// stopped for good.
pub const DIE_WITH_PARENT_ENV: &str = "M8D_DIE_WITH_PARENT";

/// Marks `cmd`, an `m8d worker` or `m8d store` this process starts, to end
/// with it ([`DIE_WITH_PARENT_ENV`]). The kernel ties the child to the
/// thread that starts it, not the process: start it from the main thread
/// (as `m8d` does, inside `block_on`) or from a `std::thread` of your own
/// that outlives the child. Not from a tokio task or a runtime's worker
/// thread: a worker thread may hand its place to another and end
/// (`block_in_place`), and a blocking pool's threads end when idle; the
/// child would be killed with it. `cmd` must run `m8d` itself, not a
/// wrapper that forks it (`timeout`, a shell without `exec`): the child
/// checks that its parent is the process that marked it.
pub fn ends_with_this_process(cmd: &mut Command) -> &mut Command {
    cmd.env(DIE_WITH_PARENT_ENV, std::process::id().to_string())
}

/// In an `m8d` process started with [`DIE_WITH_PARENT_ENV`]: asks the
/// kernel to SIGKILL this process when the one that started it ends (when
/// the thread that started it does), however it ends, which also ends a
/// frozen (SIGSTOPped) process, as no other signal would. A starting
/// process already gone when this runs is checked for: it is an error (the
/// caller exits). Without the variable it does nothing.
pub fn die_with_parent() -> anyhow::Result<()> {
    let Ok(parent) = std::env::var(DIE_WITH_PARENT_ENV) else {
        return Ok(());
    };
    nix::sys::prctl::set_pdeathsig(Signal::SIGKILL)
        .context("asking to end with the process that started this one")?;
    let now = nix::unistd::getppid().as_raw().to_string();
    anyhow::ensure!(
        now == parent,
        "the process that started this one ({parent}) is gone (parent now {now})"
    );
    Ok(())
}

/// Where a worker reaches its world's store: called with the world's name
/// (`w1`, ...) and the address of the leader's store, it returns the address
/// to give that worker as `--store` (e.g. a fault-injecting proxy in front of
/// the store, so that the worker's traffic with the leader can be faulted).
/// Called at every spawn, re-spawns included.
#[derive(Clone)]
pub struct WorkerStore(pub Arc<WorkerStoreFn>);

/// The function of a [`WorkerStore`]: `(world name, leader's store address)`
/// to the worker's store address.
pub type WorkerStoreFn = dyn Fn(&str, &str) -> String + Send + Sync;

impl std::fmt::Debug for WorkerStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WorkerStore(..)")
    }
}

/// How to run a fleet.
#[derive(Debug, Clone)]
pub struct FleetConfig {
    /// The `m8d` executable that runs `m8d worker` (itself: not a wrapper
    /// that forks it, see [`ends_with_this_process`]).
    pub exe: PathBuf,
    /// Number of workers (one world each).
    pub workers: usize,
    /// Bytes per message.
    pub bytes: usize,
    /// How long a join may take.
    pub join_timeout: Duration,
    /// Let the workers' stderr through (otherwise it is discarded).
    pub worker_logs: bool,
    /// The store address each worker is given; `None`: the leader's store
    /// itself. The leader always joins through its own store directly.
    pub worker_store: Option<WorkerStore>,
    /// Serve the leader's metrics at this address (see
    /// `ManagerConfig::metrics_addr`); `None`: the environment decides.
    pub metrics_addr: Option<std::net::SocketAddr>,
}

impl FleetConfig {
    /// `workers` workers of the given executable, 64 KiB messages.
    pub fn new(exe: impl Into<PathBuf>, workers: usize) -> FleetConfig {
        FleetConfig {
            exe: exe.into(),
            workers,
            bytes: 64 * 1024,
            join_timeout: Duration::from_secs(30),
            worker_logs: false,
            worker_store: None,
            metrics_addr: None,
        }
    }
}

/// A child process, killed and reaped when dropped.
#[derive(Debug)]
pub struct ChildProcess {
    child: Child,
    /// Set once the process has been reaped: its pid may then belong to
    /// another process, so it is never signalled again.
    reaped: bool,
}

impl ChildProcess {
    /// Takes ownership of a started child.
    pub fn new(child: Child) -> ChildProcess {
        ChildProcess { child, reaped: false }
    }

    /// Sends `sig` to the process; an error once it has been reaped.
    pub fn signal(&self, sig: Signal) -> anyhow::Result<()> {
        let pid = i32::try_from(self.child.id()).context("pid out of range")?;
        if self.reaped {
            bail!("worker {pid} has exited and been reaped; not sending {sig}");
        }
        kill(Pid::from_raw(pid), sig).with_context(|| format!("sending {sig} to worker {pid}"))
    }

    /// SIGKILLs and reaps the process.
    pub fn kill(&mut self) -> anyhow::Result<()> {
        if self.reaped {
            return Ok(());
        }
        self.child.kill()?;
        self.child.wait()?;
        self.reaped = true;
        Ok(())
    }

    /// Whether it has exited, and how (reaping it if so).
    pub fn try_wait(&mut self) -> anyhow::Result<Option<std::process::ExitStatus>> {
        let status = self.child.try_wait()?;
        self.reaped |= status.is_some();
        Ok(status)
    }
}

impl Drop for ChildProcess {
    fn drop(&mut self) {
        if !self.reaped {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The outcome of a member's receiving task: the error that ended it and
/// when, or `None` if it was stopped.
pub type StreamEnd = Option<(WorldError, Instant)>;

/// One worker and the leader's side of its world.
pub struct Member {
    /// The world's name (`w1`, `w2`, ...).
    pub name: String,
    /// The worker process.
    pub process: Option<ChildProcess>,
    /// The leader's membership.
    pub world: World,
    /// What the leader has received.
    pub stats: Arc<StreamStats>,
    task: Option<JoinHandle<StreamEnd>>,
}

/// A leader and its workers.
pub struct Fleet {
    /// The leader's manager.
    pub leader: WorldManager,
    /// The address hosting every world's store.
    pub store: String,
    /// One per worker, in order.
    pub members: Vec<Member>,
    config: FleetConfig,
    stop: Arc<AtomicBool>,
}

impl Fleet {
    /// Starts the leader's store, the workers and their worlds, and waits
    /// until every stream flows.
    pub async fn start(config: FleetConfig) -> anyhow::Result<Fleet> {
        let mut manager_config = multiworld::ManagerConfig::default();
        if config.metrics_addr.is_some() {
            manager_config.metrics_addr = config.metrics_addr;
        }
        let leader = WorldManager::new(manager_config);
        let store = leader.serve_store("127.0.0.1:0").await?.to_string();
        let mut fleet = Fleet {
            leader,
            store,
            members: Vec::with_capacity(config.workers),
            config,
            stop: Arc::new(AtomicBool::new(false)),
        };
        let mut pending = Vec::new();
        for i in 0..fleet.config.workers {
            let name = format!("w{}", i + 1);
            let process = fleet.spawn_worker(&name)?;
            let (leader, cfg) = (fleet.leader.clone(), fleet.world_config(&name)?);
            pending.push((name, process, tokio::spawn(async move { leader.join(cfg).await })));
        }
        for (name, process, join) in pending {
            let world = join.await?.with_context(|| format!("joining {name}"))?;
            let member = fleet.member(name, process, world);
            fleet.members.push(member);
        }
        for i in 0..fleet.members.len() {
            fleet.wait_flowing(i, 5, Duration::from_secs(30)).await?;
        }
        Ok(fleet)
    }

    fn world_config(&self, name: &str) -> anyhow::Result<WorldConfig> {
        let mut c = WorldConfig::new(name, 0, 2, &self.store)?;
        c.join_timeout = self.config.join_timeout;
        Ok(c)
    }

    fn spawn_worker(&self, name: &str) -> anyhow::Result<ChildProcess> {
        let stderr = if self.config.worker_logs {
            Stdio::inherit()
        } else {
            Stdio::null()
        };
        let store = match &self.config.worker_store {
            Some(WorkerStore(route)) => route(name, &self.store),
            None => self.store.clone(),
        };
        let child = ends_with_this_process(&mut Command::new(&self.config.exe))
            .args(["worker", "--world", name, "--store", &store])
            .args(["--bytes", &self.config.bytes.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .with_context(|| format!("starting {} worker", self.config.exe.display()))?;
        Ok(ChildProcess::new(child))
    }

    fn member(&self, name: String, process: ChildProcess, world: World) -> Member {
        let stats = Arc::new(StreamStats::default());
        let task = {
            let (world, stats, stop) = (world.clone(), Arc::clone(&stats), Arc::clone(&self.stop));
            let bytes = self.config.bytes;
            tokio::spawn(async move {
                receive_stream(&world, Rank(1), bytes, stats, move || {
                    stop.load(Ordering::Relaxed)
                })
                .await
            })
        };
        Member {
            name,
            process: Some(process),
            world,
            stats,
            task: Some(task),
        }
    }

    /// Waits until member `i` has received `n` more messages.
    pub async fn wait_flowing(&self, i: usize, n: u64, limit: Duration) -> anyhow::Result<()> {
        let stats = &self.members[i].stats;
        let target = stats.count() + n;
        let start = Instant::now();
        while stats.count() < target {
            if start.elapsed() > limit {
                bail!("{} did not flow within {limit:?}", self.members[i].name);
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        Ok(())
    }

    /// SIGKILLs worker `i`; returns when.
    pub fn kill(&mut self, i: usize) -> anyhow::Result<Instant> {
        let p = self.members[i].process.as_mut().context("no process")?;
        let at = Instant::now();
        p.kill()?;
        Ok(at)
    }

    /// SIGSTOPs worker `i`; returns when.
    pub fn freeze(&self, i: usize) -> anyhow::Result<Instant> {
        let p = self.members[i].process.as_ref().context("no process")?;
        let at = Instant::now();
        p.signal(Signal::SIGSTOP)?;
        Ok(at)
    }

    /// SIGCONTs worker `i`.
    pub fn thaw(&self, i: usize) -> anyhow::Result<()> {
        let p = self.members[i].process.as_ref().context("no process")?;
        p.signal(Signal::SIGCONT)
    }

    /// Waits (at most `limit`) for member `i`'s stream to end with an error.
    pub async fn wait_failed(&mut self, i: usize, limit: Duration) -> anyhow::Result<(WorldError, Instant)> {
        let task = self.members[i].task.take().context("stream already awaited")?;
        match tokio::time::timeout(limit, task).await {
            Ok(end) => end?.context("the stream was stopped, not failed"),
            Err(_) => bail!("{}'s stream did not fail within {limit:?}", self.members[i].name),
        }
    }

    /// Replaces worker `i` (after its world was torn down) with a new process
    /// in a new generation of the same world, and waits until it flows.
    pub async fn respawn(&mut self, i: usize) -> anyhow::Result<()> {
        let name = self.members[i].name.clone();
        self.members[i].world.removed().await;
        if let Some(mut old) = self.members[i].process.take() {
            old.kill()?;
        }
        let process = self.spawn_worker(&name)?;
        let world = self
            .leader
            .join(self.world_config(&name)?)
            .await
            .with_context(|| format!("re-joining {name}"))?;
        self.members[i] = self.member(name, process, world);
        self.wait_flowing(i, 5, Duration::from_secs(30)).await
    }

    /// Messages per second of the given members over `window`.
    pub async fn rates(&self, which: &[usize], window: Duration) -> Vec<f64> {
        let before: Vec<u64> = which.iter().map(|&i| self.members[i].stats.count()).collect();
        let t = Instant::now();
        tokio::time::sleep(window).await;
        let secs = t.elapsed().as_secs_f64();
        which
            .iter()
            .zip(before)
            .map(|(&i, b)| (self.members[i].stats.count() - b) as f64 / secs)
            .collect()
    }

    /// Ends every stream still flowing cleanly: asks its worker to stop
    /// ([`request_end`]), receives until its end-of-stream message (so
    /// [`StreamStats::sent`] is known and every message sent was counted),
    /// then finishes the world together with the worker. Each step is
    /// bounded by `limit`; a member whose stream already ended, whose world
    /// is not ready, or that misses a step is left as it is (the shutdown
    /// that follows ends it). Returns the members whose streams ended cleanly.
    pub async fn end_streams(&mut self, limit: Duration) -> Vec<usize> {
        let mut asked = Vec::new();
        for (i, m) in self.members.iter().enumerate() {
            let live = m.task.as_ref().is_some_and(|t| !t.is_finished());
            if live && matches!(m.world.state(), WorldState::Ready) {
                if let Ok(Ok(())) = tokio::time::timeout(limit, request_end(&m.world, Rank(1))).await {
                    asked.push(i);
                }
            }
        }
        let mut ended = Vec::new();
        for i in asked {
            let m = &mut self.members[i];
            let Some(mut task) = m.task.take() else { continue };
            match tokio::time::timeout(limit, &mut task).await {
                Ok(Ok(None)) if m.stats.sent().is_some() => {
                    if m.world.finish(limit).await.is_ok() {
                        ended.push(i);
                    }
                }
                // Ended otherwise (the world broke meanwhile): nothing to wait for.
                Ok(_) => {}
                // Still receiving: the shutdown stops it.
                Err(_) => m.task = Some(task),
            }
        }
        ended
    }

    /// Ends every stream still flowing cleanly ([`end_streams`](Self::end_streams)),
    /// stops receiving, leaves every world and waits (bounded) for the
    /// workers to exit. Returns each worker's exit: `Some(code)`, or `None`
    /// for one that was killed or had to be.
    pub async fn shutdown(mut self) -> Vec<Option<i32>> {
        self.end_streams(Duration::from_secs(10)).await;
        self.stop.store(true, Ordering::Relaxed);
        self.leader.shutdown().await;
        let mut exits = Vec::new();
        for m in &mut self.members {
            if let Some(task) = m.task.take() {
                let _ = tokio::time::timeout(Duration::from_secs(10), task).await;
            }
            let Some(p) = m.process.as_mut() else {
                exits.push(None);
                continue;
            };
            let start = Instant::now();
            let code = loop {
                match p.try_wait() {
                    Ok(Some(status)) => break status.code(),
                    Ok(None) if start.elapsed() < Duration::from_secs(15) => {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    _ => break None,
                }
            };
            exits.push(code);
        }
        exits
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// A reaped worker's pid may be another process's by now: it is never
    /// signalled again, and killing it twice is harmless.
    #[test]
    fn a_reaped_worker_is_not_signalled() {
        let child = Command::new("sleep").arg("30").spawn().unwrap();
        let mut p = ChildProcess::new(child);
        p.signal(Signal::SIGSTOP).unwrap();
        p.signal(Signal::SIGCONT).unwrap();
        p.kill().unwrap();
        let e = p.signal(Signal::SIGSTOP).unwrap_err();
        assert!(e.to_string().contains("reaped"), "{e}");
        p.kill().unwrap();
        let child = Command::new("true").spawn().unwrap();
        let mut q = ChildProcess::new(child);
        let start = Instant::now();
        while q.try_wait().unwrap().is_none() {
            assert!(start.elapsed() < Duration::from_secs(30));
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(q.signal(Signal::SIGCONT).is_err());
    }
}
