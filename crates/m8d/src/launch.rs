//! The launcher style of starting a world: run a program N times, once per
//! rank, with `RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `MASTER_ADDR` and
//! `MASTER_PORT` set (what `WorldConfig::from_env` reads). Every line a rank
//! prints is prefixed with `[rank R]`. When a rank fails, the others are asked
//! to stop (SIGTERM, then SIGKILL after a grace period) and the launcher exits
//! with the first failing rank's exit code. Ctrl-C (SIGINT) and SIGTERM sent
//! to the launcher are forwarded to every rank's process group (each rank
//! leads its own, so nothing else reaches them); the launcher then exits with
//! 130 or 143 (128 + the signal), whatever the ranks' own codes, after the
//! same grace period and SIGKILL as above.

use std::{
    ffi::OsString,
    net::TcpListener,
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

/// What to launch.
#[derive(Debug, Clone)]
pub struct LaunchConfig {
    /// Number of ranks.
    pub nproc: u32,
    /// `MASTER_ADDR` for every rank.
    pub master_addr: String,
    /// `MASTER_PORT` for every rank (`None`: a free port is picked).
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
    /// The first rank that failed, if any.
    pub first_failure: Option<u32>,
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

async fn forward_lines(rank: u32, stream: impl AsyncRead + Unpin, to_stderr: bool) {
    let mut lines = BufReader::new(stream).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        if to_stderr {
            eprintln!("[rank {rank}] {line}");
        } else {
            println!("[rank {rank}] {line}");
        }
    }
}

/// Runs the ranks to completion.
///
/// From the first call on, this process handles SIGINT and SIGTERM itself
/// (forwarding them to the ranks while they run): the handlers are
/// installed before any rank starts, so a signal can never end the launcher
/// and leave its ranks running, and, as with any tokio signal handler, they
/// stay installed for the rest of the process's life.
pub async fn launch(config: LaunchConfig) -> anyhow::Result<LaunchOutcome> {
    anyhow::ensure!(config.nproc >= 1, "--nproc must be at least 1");
    let port = match config.master_port {
        Some(p) => p,
        None => free_port(&config.master_addr)?,
    };
    let mut sigint = signal(SignalKind::interrupt()).context("handling SIGINT")?;
    let mut sigterm = signal(SignalKind::terminate()).context("handling SIGTERM")?;
    let (exit_tx, mut exit_rx) = mpsc::unbounded_channel::<(u32, ExitStatus)>();
    let mut children: Vec<Child> = Vec::new();
    let mut printers = Vec::new();
    for rank in 0..config.nproc {
        let mut child = Command::new(&config.program)
            .args(&config.args)
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("WORLD_SIZE", config.nproc.to_string())
            .env("LOCAL_WORLD_SIZE", config.nproc.to_string())
            .env("MASTER_ADDR", &config.master_addr)
            .env("MASTER_PORT", port.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            // Each rank leads its own process group, so a signal reaches the
            // rank and everything it started (a shell's children too).
            .process_group(0)
            .spawn()
            .with_context(|| format!("starting rank {rank}: {:?}", config.program))?;
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
    for (rank, mut child) in children.into_iter().enumerate() {
        pids.extend(child.id());
        let tx = exit_tx.clone();
        waiters.push(tokio::spawn(async move {
            if let Ok(status) = child.wait().await {
                let _ = tx.send((rank as u32, status));
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
    let signal_pids = |sig: Signal| {
        for pid in &pids {
            if let Ok(pid) = i32::try_from(*pid) {
                // The negative pid addresses the rank's process group.
                let _ = kill(Pid::from_raw(-pid), sig);
            }
        }
    };
    let grace = tokio::time::sleep(Duration::MAX);
    tokio::pin!(grace);
    let mut interrupted = false;
    while finished < config.nproc {
        tokio::select! {
            exit = exit_rx.recv() => {
                let Some((rank, status)) = exit else { break };
                finished += 1;
                if !status.success() && outcome.first_failure.is_none() && !interrupted {
                    outcome.first_failure = Some(rank);
                    outcome.code = status_code(status);
                    eprintln!("m8d launch: rank {rank} failed ({status}); stopping the other ranks");
                }
                if outcome.first_failure.is_some() && !stopping && finished < config.nproc {
                    stopping = true;
                    signal_pids(Signal::SIGTERM);
                    grace.as_mut().reset(tokio::time::Instant::now() + config.grace);
                }
            }
            _ = sigint.recv(), if !interrupted => {
                interrupted = true;
                outcome.code = 128 + Signal::SIGINT as i32;
                eprintln!("m8d launch: interrupted; forwarding to every rank");
                signal_pids(Signal::SIGINT);
                grace.as_mut().reset(tokio::time::Instant::now() + config.grace);
            }
            _ = sigterm.recv(), if !interrupted => {
                interrupted = true;
                outcome.code = 128 + Signal::SIGTERM as i32;
                eprintln!("m8d launch: terminated (SIGTERM); forwarding to every rank");
                signal_pids(Signal::SIGTERM);
                grace.as_mut().reset(tokio::time::Instant::now() + config.grace);
            }
            _ = &mut grace => {
                eprintln!("m8d launch: ranks still running after {:?}; killing them", config.grace);
                signal_pids(Signal::SIGKILL);
                grace.as_mut().reset(tokio::time::Instant::now() + Duration::from_secs(3600));
            }
        }
    }
    for w in waiters {
        let _ = w.await;
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
