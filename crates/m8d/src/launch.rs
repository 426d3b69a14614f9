//! The launcher style of starting a world: run a program N times, once per
//! rank, with torchrun's environment contract (`RANK`, `LOCAL_RANK`,
//! `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `GROUP_RANK`, `MASTER_ADDR`,
//! `MASTER_PORT`: what `WorldConfig::from_env` reads), on one machine or as
//! one node of several (one launcher per node, each with its `--node-rank`,
//! ranks numbered as torchrun numbers them: [`Nodes`]). Every line a rank
//! prints is prefixed with `[rank R]` (its rank in the whole world). When a
//! rank fails, the others of this node are asked to stop (SIGTERM, then
//! SIGKILL after a grace period) and the launcher exits with the first
//! failing rank's exit code; the ranks on other nodes see their world break
//! and fail in turn, which ends their launchers. Ctrl-C (SIGINT), SIGTERM,
//! SIGHUP and SIGQUIT sent to the launcher are forwarded to every rank's
//! process group (each rank leads its own, so nothing else reaches them);
//! the launcher then exits with 128 + the signal (130, 143, 129, 131),
//! whatever the ranks' own codes, after the same grace period and SIGKILL as
//! above. The grace period and SIGKILL cover everything in the ranks' process
//! groups, also what outlives its rank.
//!
//! The pure part ([`Nodes`]: the rank arithmetic, the checks, every rank's
//! environment) is apart from the driver that starts the processes
//! ([`launch_nodes`], [`launch`]).

use std::{
    ffi::OsString,
    net::{IpAddr, TcpListener},
    process::{ExitStatus, Stdio},
    time::Duration,
};

use anyhow::Context;
use nix::{
    sys::signal::{Signal, kill},
    unistd::Pid,
};
use tokio::{
    io::{AsyncBufReadExt, AsyncRead, BufReader},
    process::{Child, Command},
    signal::unix::{SignalKind, signal},
    sync::mpsc,
};

/// What to launch on this machine.
#[derive(Debug, Clone)]
pub struct LaunchConfig {
    /// Number of ranks on this machine (`--nproc-per-node`; all of them in a
    /// single-node launch).
    pub nproc: u32,
    /// `MASTER_ADDR` for every rank.
    pub master_addr: String,
    /// `MASTER_PORT` for every rank (`None`: a free port is picked, on a
    /// single node only: across nodes it must be given).
    pub master_port: Option<u16>,
    /// The program.
    pub program: OsString,
    /// Its arguments.
    pub args: Vec<OsString>,
    /// How long ranks get to stop after SIGTERM before SIGKILL.
    pub grace: Duration,
}

/// How the launch ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchOutcome {
    /// The exit code to leave with: 0 if every rank succeeded, else the first
    /// failing rank's code (128 + signal for a rank killed by a signal); 130
    /// after Ctrl-C (SIGINT) and 143 after SIGTERM, forwarded to the ranks.
    pub code: i32,
    /// The first rank that failed, if any (its rank in the whole world).
    pub first_failure: Option<u32>,
}

/// Where this launcher sits among the nodes of a launch: torchrun's
/// `--nnodes`, `--node-rank`, and the address its ranks listen on.
///
/// Ranks are numbered as torchrun numbers them: with `P` ranks per node,
/// local rank `L` of node `I` is rank `I * P + L` of a world of
/// `nnodes * P`, so node 0 runs rank 0, which hosts the world's store at
/// `MASTER_ADDR:MASTER_PORT`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Nodes {
    /// Number of nodes (machines), each running one launcher.
    pub nnodes: u32,
    /// This node's index, `0..nnodes`.
    pub node_rank: u32,
    /// The address of this node that its ranks listen on and publish to the
    /// others (set as `MULTIWORLD_LISTEN_HOST`); `None` leaves each rank its
    /// default, the address of the interface that reaches the store.
    pub node_addr: Option<IpAddr>,
}

impl Nodes {
    /// A single-node launch: one node, node 0, default addresses.
    pub const SINGLE: Nodes = Nodes {
        nnodes: 1,
        node_rank: 0,
        node_addr: None,
    };

    /// Checks a launch of `nproc_per_node` ranks on each node, and returns
    /// the world's size. Refuses no ranks or no nodes, a node rank not below
    /// the number of nodes, a world larger than `u32::MAX` ranks, and a
    /// launch across nodes without a `master_port` (a free port picked on
    /// one node means nothing on the others).
    pub fn check(&self, nproc_per_node: u32, master_port: Option<u16>) -> anyhow::Result<u32> {
        anyhow::ensure!(nproc_per_node >= 1, "--nproc-per-node must be at least 1");
        anyhow::ensure!(self.nnodes >= 1, "--nnodes must be at least 1");
        anyhow::ensure!(
            self.node_rank < self.nnodes,
            "--node-rank {} is out of range: with --nnodes {} it must be from 0 to {}",
            self.node_rank,
            self.nnodes,
            self.nnodes - 1
        );
        let size = self.nnodes.checked_mul(nproc_per_node).ok_or_else(|| {
            anyhow::anyhow!(
                "--nnodes {} times --nproc-per-node {nproc_per_node} is more ranks than a world can have ({})",
                self.nnodes,
                u32::MAX
            )
        })?;
        anyhow::ensure!(
            self.nnodes == 1 || master_port.is_some(),
            "--master-port is required with --nnodes {} (more than one node): every node's \
             ranks must name the same port, open between the machines (e.g. 29500), and a \
             free port picked on one node means nothing on the others",
            self.nnodes
        );
        Ok(size)
    }

    /// The world rank of local rank `local_rank` of this node.
    pub fn rank(&self, nproc_per_node: u32, local_rank: u32) -> u32 {
        self.node_rank * nproc_per_node + local_rank
    }

    /// The environment of local rank `local_rank` of this node: `RANK`,
    /// `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `GROUP_RANK` (the
    /// node's rank), `MASTER_ADDR`, `MASTER_PORT`, and
    /// `MULTIWORLD_LISTEN_HOST` when [`node_addr`](Self::node_addr) is set.
    /// Call [`check`](Self::check) first: the arithmetic assumes a world
    /// that fits.
    pub fn rank_env(
        &self,
        nproc_per_node: u32,
        local_rank: u32,
        master_addr: &str,
        master_port: u16,
    ) -> Vec<(&'static str, String)> {
        let mut env = vec![
            ("RANK", self.rank(nproc_per_node, local_rank).to_string()),
            ("LOCAL_RANK", local_rank.to_string()),
            ("WORLD_SIZE", (self.nnodes * nproc_per_node).to_string()),
            ("LOCAL_WORLD_SIZE", nproc_per_node.to_string()),
            ("GROUP_RANK", self.node_rank.to_string()),
            ("MASTER_ADDR", master_addr.to_string()),
            ("MASTER_PORT", master_port.to_string()),
        ];
        if let Some(ip) = self.node_addr {
            env.push(("MULTIWORLD_LISTEN_HOST", ip.to_string()));
        }
        env
    }
}

impl Default for Nodes {
    fn default() -> Self {
        Nodes::SINGLE
    }
}

fn status_code(status: ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    status
        .code()
        .unwrap_or_else(|| 128 + status.signal().unwrap_or(0))
}

fn free_port(addr: &str) -> anyhow::Result<u16> {
    let listener = TcpListener::bind((addr, 0)).with_context(|| format!("finding a free port on {addr}"))?;
    Ok(listener.local_addr()?.port())
}

/// Prints every line of a rank's output with its prefix. Bytes that are not
/// UTF-8 are printed as U+FFFD, and the pipe is read to its end whatever
/// happens to the launcher's own output (closed, full disk): a rank is
/// never cut off from its output, which would kill it with SIGPIPE.
async fn forward_lines(rank: u32, stream: impl AsyncRead + Unpin, to_stderr: bool) {
    use std::io::Write;
    let mut stream = BufReader::new(stream);
    let mut line = Vec::new();
    loop {
        line.clear();
        match stream.read_until(b'\n', &mut line).await {
            Ok(0) => return,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => return,
        }
        let text = String::from_utf8_lossy(line.strip_suffix(b"\n").unwrap_or(&line));
        let text = text.strip_suffix('\r').unwrap_or(&text);
        let _ = if to_stderr {
            writeln!(std::io::stderr().lock(), "[rank {rank}] {text}")
        } else {
            writeln!(std::io::stdout().lock(), "[rank {rank}] {text}")
        };
    }
}

/// How often a launch looks for its ranks' process groups that emptied.
const GROUP_CHECK: Duration = Duration::from_millis(100);

/// Runs the ranks of a single-node launch to completion:
/// [`launch_nodes`] with [`Nodes::SINGLE`].
pub async fn launch(config: LaunchConfig) -> anyhow::Result<LaunchOutcome> {
    launch_nodes(config, Nodes::SINGLE).await
}

/// Runs this node's ranks to completion: `config.nproc` of them, numbered
/// and given their environment by `nodes` ([`Nodes::rank_env`]).
///
/// From the first call on, this process handles SIGINT, SIGTERM, SIGHUP and
/// SIGQUIT itself (forwarding them to the ranks while they run): the
/// handlers are installed before any rank starts, so none of these signals
/// can end the launcher and leave its ranks running, and, as with any tokio
/// signal handler, they stay installed for the rest of the process's life.
/// SIGKILL cannot be handled: a launcher killed by it leaves its ranks
/// running (they get SIGPIPE at their next line of output).
pub async fn launch_nodes(config: LaunchConfig, nodes: Nodes) -> anyhow::Result<LaunchOutcome> {
    nodes.check(config.nproc, config.master_port)?;
    let port = match config.master_port {
        Some(p) => p,
        None => free_port(&config.master_addr)?,
    };
    let mut sigint = signal(SignalKind::interrupt()).context("handling SIGINT")?;
    let mut sigterm = signal(SignalKind::terminate()).context("handling SIGTERM")?;
    let mut sighup = signal(SignalKind::hangup()).context("handling SIGHUP")?;
    let mut sigquit = signal(SignalKind::quit()).context("handling SIGQUIT")?;
    let (exit_tx, mut exit_rx) = mpsc::unbounded_channel::<(u32, ExitStatus)>();
    let mut children: Vec<Child> = Vec::new();
    let mut printers = Vec::new();
    for local_rank in 0..config.nproc {
        let rank = nodes.rank(config.nproc, local_rank);
        let child = Command::new(&config.program)
            .args(&config.args)
            .envs(nodes.rank_env(config.nproc, local_rank, &config.master_addr, port))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            // Each rank leads its own process group, so a signal reaches the
            // rank and everything it started (a shell's children too).
            .process_group(0)
            .spawn();
        let mut child = match child {
            Ok(c) => c,
            Err(e) => {
                // The ranks already started go, with what they started
                // (their process groups), before the error is reported.
                for c in &children {
                    if let Some(pid) = c.id().and_then(|p| i32::try_from(p).ok()) {
                        let _ = kill(Pid::from_raw(-pid), Signal::SIGKILL);
                    }
                }
                return Err(
                    anyhow::Error::new(e).context(format!("starting rank {rank}: {:?}", config.program))
                );
            }
        };
        if let Some(out) = child.stdout.take() {
            printers.push(tokio::spawn(forward_lines(rank, out, false)));
        }
        if let Some(err) = child.stderr.take() {
            printers.push(tokio::spawn(forward_lines(rank, err, true)));
        }
        children.push(child);
    }
    // One waiter task per rank owns its child and reports its exit; the pids
    // stay here for signalling.
    let mut pids = Vec::new();
    let mut waiters = Vec::new();
    for (local_rank, mut child) in (0..config.nproc).zip(children) {
        pids.extend(child.id());
        let tx = exit_tx.clone();
        let rank = nodes.rank(config.nproc, local_rank);
        waiters.push(tokio::spawn(async move {
            if let Ok(status) = child.wait().await {
                let _ = tx.send((rank, status));
            }
        }));
    }
    drop(exit_tx);

    let mut outcome = LaunchOutcome {
        code: 0,
        first_failure: None,
    };
    let mut finished = 0u32;
    let mut stopping = false;
    // The ranks' process groups (each rank leads its own), until seen empty:
    // an empty group's number may be reused, so it is never signalled again.
    // A group empties when its last process ends, which may be a job its
    // rank left behind, at any time: the groups are looked at whenever a
    // rank is reaped and every GROUP_CHECK besides, so a number is let go
    // within that of its group emptying (its reuse needs the system's pids
    // to wrap around meanwhile).
    let mut groups: Vec<Option<Pid>> = pids
        .iter()
        .map(|&pid| i32::try_from(pid).ok().map(Pid::from_raw))
        .collect();
    let signal_pids = |groups: &mut Vec<Option<Pid>>, sig: Option<Signal>| {
        for g in groups.iter_mut() {
            if let Some(pgid) = *g {
                // The negative pid addresses the whole process group.
                if kill(Pid::from_raw(-pgid.as_raw()), sig) == Err(nix::errno::Errno::ESRCH) {
                    *g = None;
                }
            }
        }
    };
    let grace = tokio::time::sleep(Duration::MAX);
    tokio::pin!(grace);
    let mut group_check = tokio::time::interval(GROUP_CHECK);
    group_check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut interrupted = false;
    let mut killed = false;
    while finished < config.nproc {
        tokio::select! {
            exit = exit_rx.recv() => {
                let Some((rank, status)) = exit else { break };
                finished += 1;
                // A rank is reaped: its group, if it was the last of it,
                // is seen empty now.
                signal_pids(&mut groups, None);
                if !status.success() && outcome.first_failure.is_none() && !interrupted {
                    outcome.first_failure = Some(rank);
                    outcome.code = status_code(status);
                    eprintln!("m8d launch: rank {rank} failed ({status}); stopping the other ranks");
                }
                if outcome.first_failure.is_some() && !stopping && finished < config.nproc {
                    stopping = true;
                    signal_pids(&mut groups, Some(Signal::SIGTERM));
                    grace.as_mut().reset(tokio::time::Instant::now() + config.grace);
                }
            }
            sig = async {
                tokio::select! {
                    _ = sigint.recv() => Signal::SIGINT,
                    _ = sigterm.recv() => Signal::SIGTERM,
                    _ = sighup.recv() => Signal::SIGHUP,
                    _ = sigquit.recv() => Signal::SIGQUIT,
                }
            }, if !interrupted => {
                interrupted = true;
                outcome.code = 128 + sig as i32;
                if sig == Signal::SIGINT {
                    eprintln!("m8d launch: interrupted; forwarding to every rank");
                } else {
                    eprintln!("m8d launch: terminated ({sig}); forwarding to every rank");
                }
                signal_pids(&mut groups, Some(sig));
                grace.as_mut().reset(tokio::time::Instant::now() + config.grace);
            }
            _ = group_check.tick() => signal_pids(&mut groups, None),
            _ = &mut grace => {
                killed = true;
                eprintln!("m8d launch: ranks still running after {:?}; killing them", config.grace);
                signal_pids(&mut groups, Some(Signal::SIGKILL));
                grace.as_mut().reset(tokio::time::Instant::now() + Duration::from_secs(3600));
            }
        }
    }
    for w in waiters {
        let _ = w.await;
    }
    if stopping || interrupted {
        // The ranks are gone, but what they started may not be (a child that
        // ignores the signal, or a shell's background job, which ignores
        // SIGINT): it gets the rest of the grace period, then SIGKILL.
        let deadline = if killed {
            tokio::time::Instant::now()
        } else {
            grace.deadline()
        };
        loop {
            signal_pids(&mut groups, None);
            if groups.iter().all(Option::is_none) {
                break;
            }
            if tokio::time::Instant::now() >= deadline {
                eprintln!(
                    "m8d launch: processes the ranks started still run after {:?}; killing them",
                    config.grace
                );
                signal_pids(&mut groups, Some(Signal::SIGKILL));
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    // Output still buffered is printed; a grandchild that outlived its rank
    // and holds the pipe open is not waited for.
    for p in printers {
        if tokio::time::timeout(Duration::from_secs(1), p).await.is_err() {
            eprintln!("m8d launch: a rank's output is still open after it exited; not waiting for it");
        }
    }
    Ok(outcome)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::collections::HashMap;

    use super::*;

    fn env_of(nodes: &Nodes, nproc: u32, local_rank: u32) -> HashMap<&'static str, String> {
        nodes
            .rank_env(nproc, local_rank, "10.0.0.1", 29500)
            .into_iter()
            .collect()
    }

    #[test]
    fn ranks_are_numbered_as_torchrun_numbers_them() {
        // 3 nodes of 4: node 1's local rank 2 is rank 6 of 12.
        let node = Nodes {
            nnodes: 3,
            node_rank: 1,
            node_addr: None,
        };
        assert_eq!(node.check(4, Some(29500)).unwrap(), 12);
        let env = env_of(&node, 4, 2);
        let expected: HashMap<&str, String> = [
            ("RANK", "6"),
            ("LOCAL_RANK", "2"),
            ("WORLD_SIZE", "12"),
            ("LOCAL_WORLD_SIZE", "4"),
            ("GROUP_RANK", "1"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29500"),
        ]
        .into_iter()
        .map(|(k, v)| (k, v.to_string()))
        .collect();
        assert_eq!(env, expected);
        // Every rank of the world exactly once, node by node.
        let mut ranks = Vec::new();
        for node_rank in 0..3 {
            let node = Nodes { node_rank, ..node };
            for local in 0..4 {
                ranks.push(env_of(&node, 4, local)["RANK"].parse::<u32>().unwrap());
            }
        }
        assert_eq!(ranks, (0..12).collect::<Vec<_>>());
    }

    #[test]
    fn a_single_node_is_the_old_launcher() {
        assert_eq!(Nodes::default(), Nodes::SINGLE);
        assert_eq!(Nodes::SINGLE.check(3, None).unwrap(), 3);
        let env = env_of(&Nodes::SINGLE, 3, 2);
        assert_eq!(
            (
                &*env["RANK"],
                &*env["LOCAL_RANK"],
                &*env["WORLD_SIZE"],
                &*env["GROUP_RANK"]
            ),
            ("2", "2", "3", "0")
        );
        assert!(!env.contains_key("MULTIWORLD_LISTEN_HOST"));
    }

    #[test]
    fn the_node_address_becomes_the_ranks_listen_host() {
        let node = Nodes {
            nnodes: 2,
            node_rank: 1,
            node_addr: Some("127.0.0.2".parse().unwrap()),
        };
        assert_eq!(env_of(&node, 2, 0)["MULTIWORLD_LISTEN_HOST"], "127.0.0.2");
        let v6 = Nodes {
            node_addr: Some("::1".parse().unwrap()),
            ..node
        };
        assert_eq!(env_of(&v6, 2, 0)["MULTIWORLD_LISTEN_HOST"], "::1");
    }

    #[test]
    fn impossible_launches_are_refused_with_the_flag_to_fix() {
        let nodes = |nnodes, node_rank| Nodes {
            nnodes,
            node_rank,
            node_addr: None,
        };
        let refused = |n: Nodes, nproc: u32, port: Option<u16>, says: &str| {
            let e = n.check(nproc, port).unwrap_err().to_string();
            assert!(e.contains(says), "{says}: {e}");
        };
        refused(nodes(1, 0), 0, None, "--nproc-per-node must be at least 1");
        refused(nodes(0, 0), 1, Some(1), "--nnodes must be at least 1");
        refused(nodes(2, 2), 1, Some(1), "--node-rank 2 is out of range");
        refused(nodes(2, 5), 1, Some(1), "from 0 to 1");
        refused(nodes(u32::MAX, 0), 2, Some(1), "more ranks than a world can have");
        // Across nodes the port must be given.
        refused(nodes(2, 0), 1, None, "--master-port is required with --nnodes 2");
        assert_eq!(nodes(2, 1).check(4, Some(29500)).unwrap(), 8);
    }
}
