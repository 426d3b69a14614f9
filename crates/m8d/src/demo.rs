//! `m8d demo`: the main job in one command. A leader (this process) and K
//! worker processes on loopback, one world each, streaming checksummed
//! tensors to the leader. A live per-world table (redrawn on a terminal,
//! plain lines otherwise) shows messages/s, MB/s and state. After `--after`
//! seconds one worker is killed or frozen; the leader's detection is shown
//! with its measured time while the other worlds keep flowing; a replacement
//! then joins a new generation of that world. It ends by itself with a
//! summary, and exits 0 only if everything behaved. Killed outright (SIGKILL)
//! it leaves no worker behind, a frozen one included: each worker has the
//! kernel SIGKILL it when the demo's process ends
//! ([`m8d::fleet::die_with_parent`]).

use std::{
    io::{IsTerminal, Write},
    sync::atomic::Ordering,
    time::{Duration, Instant},
};

use anyhow::Context;
use clap::{Args, ValueEnum};
use m8d::fleet::{Fleet, FleetConfig};
use multiworld::{Generation, WorldState};

/// Which fault the demo injects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Fault {
    /// SIGKILL the worker.
    Kill,
    /// SIGSTOP the worker (detected by heartbeats).
    Freeze,
    /// No fault.
    None,
}

/// Flags of `m8d demo`.
#[derive(Args, Debug)]
pub struct DemoArgs {
    /// Worker processes (one world each).
    #[arg(long, default_value_t = 3)]
    pub workers: usize,
    /// The fault to inject into the second worker.
    #[arg(long, value_enum, default_value_t = Fault::Kill)]
    pub fault: Fault,
    /// Seconds of streaming before the fault.
    #[arg(long, value_parser = crate::args::seconds, allow_negative_numbers = true, default_value = "3")]
    pub after: Duration,
    /// Start a replacement worker in a new generation of the broken world.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub respawn: bool,
    /// Seconds to keep streaming after the fault was handled.
    #[arg(long, value_parser = crate::args::seconds, allow_negative_numbers = true, default_value = "3")]
    pub then: Duration,
    /// Bytes per message.
    #[arg(long, default_value_t = 65536)]
    pub bytes: usize,
    /// Serve the leader's metrics at this address (`GET /metrics`), so that
    /// `m8d status ADDR` can watch it from a second terminal.
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<std::net::SocketAddr>,
}

struct Table {
    tty: bool,
    drawn: usize,
    /// Per member: generation, messages and bytes at the previous draw.
    last: Vec<(Generation, u64, u64)>,
    at: Instant,
}

impl Table {
    fn draw(&mut self, fleet: &Fleet, elapsed: Duration) -> std::io::Result<()> {
        let secs = self.at.elapsed().as_secs_f64().max(1e-3);
        self.at = Instant::now();
        let mut out = std::io::stdout().lock();
        if self.tty && self.drawn > 0 {
            write!(out, "\x1b[{}F\x1b[J", self.drawn)?;
        }
        let mut lines = Vec::new();
        for (i, m) in fleet.members.iter().enumerate() {
            let (msgs, bytes) = (m.stats.count(), m.stats.bytes.load(Ordering::Relaxed));
            // A new generation starts counting from zero.
            let (pm, pb) = match self.last.get(i) {
                Some(&(generation, pm, pb)) if generation == m.world.generation() => (pm, pb),
                _ => (0, 0),
            };
            let state = match m.world.state() {
                WorldState::Broken(_) => "BROKEN",
                s => s.label(),
            };
            lines.push(format!(
                "  {:<4} gen {:>20}  {:<8} {:>8.0} msg/s {:>9.1} MB/s {:>10} msgs",
                m.name,
                m.world.generation(),
                state,
                msgs.saturating_sub(pm) as f64 / secs,
                bytes.saturating_sub(pb) as f64 / secs / 1e6,
                msgs
            ));
        }
        self.last = fleet
            .members
            .iter()
            .map(|m| {
                (
                    m.world.generation(),
                    m.stats.count(),
                    m.stats.bytes.load(Ordering::Relaxed),
                )
            })
            .collect();
        writeln!(out, "t = {:>5.1} s", elapsed.as_secs_f64())?;
        for l in &lines {
            writeln!(out, "{l}")?;
        }
        // On a terminal the next draw moves back up over these lines.
        self.drawn = if self.tty { lines.len() + 1 } else { 0 };
        out.flush()
    }

    /// Prints a message between redraws (it scrolls above the table).
    fn say(&mut self, text: &str) {
        println!("{text}");
        self.drawn = 0;
    }
}

async fn stream_for(
    fleet: &Fleet,
    table: &mut Table,
    started: Instant,
    how_long: Duration,
) -> anyhow::Result<()> {
    let end = Instant::now() + how_long;
    while Instant::now() < end {
        let step = end
            .saturating_duration_since(Instant::now())
            .min(Duration::from_millis(500));
        tokio::time::sleep(step).await;
        table.draw(fleet, started.elapsed())?;
    }
    Ok(())
}

/// Runs the demo; `Err` (exit code 1) if anything misbehaved.
pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.workers >= 1, "need at least one worker");
    let exe = std::env::current_exe().context("finding m8d's own path")?;
    let mut config = FleetConfig::new(exe, args.workers);
    config.bytes = args.bytes;
    config.metrics_addr = args.metrics;
    let started = Instant::now();
    println!(
        "m8d demo: a leader and {} worker processes on loopback, one world each, {} B checksummed messages",
        args.workers, args.bytes
    );
    let mut fleet = Fleet::start(config).await?;
    if let Some(addr) = fleet.leader.metrics_addr() {
        println!("the leader's metrics: http://{addr}/metrics (watch with `m8d status {addr} --watch`)");
    }
    println!(
        "all {} worlds joined in {:?} (stores hosted by the leader at {})",
        args.workers,
        started.elapsed(),
        fleet.store
    );
    let mut table = Table {
        tty: std::io::stdout().is_terminal(),
        drawn: 0,
        last: Vec::new(),
        at: Instant::now(),
    };
    let mut problems: Vec<String> = Vec::new();
    stream_for(&fleet, &mut table, started, args.after).await?;

    let victim = if args.workers > 1 { 1 } else { 0 };
    let healthy: Vec<usize> = (0..args.workers).filter(|&i| i != victim).collect();
    let mut detection = None;
    if args.fault != Fault::None {
        let name = fleet.members[victim].name.clone();
        let before = fleet.rates(&healthy, Duration::from_millis(500)).await;
        // From here on, the other worlds' longest pause between messages.
        for &i in &healthy {
            fleet.members[i].stats.take_max_gap();
        }
        let at = match args.fault {
            Fault::Kill => fleet.kill(victim)?,
            _ => fleet.freeze(victim)?,
        };
        table.say(&format!(
            ">>> {} the worker of {name}",
            if args.fault == Fault::Kill {
                "SIGKILLed"
            } else {
                "SIGSTOPped (froze)"
            }
        ));
        let (err, failed_at) = fleet.wait_failed(victim, Duration::from_secs(10)).await?;
        let took = failed_at.saturating_duration_since(at);
        detection = Some(took);
        table.say(&format!(">>> the leader detected it after {took:.1?}: {err}"));
        let bound = match args.fault {
            Fault::Kill => Duration::from_secs(1),
            _ => Duration::from_secs(3),
        };
        if took > bound {
            problems.push(format!("detection took {took:?} (more than {bound:?})"));
        }
        // While the fault lasted. A world that waited for a frozen one
        // (detected after the 1 s heartbeat timeout) would have paused that
        // long; a killed one is detected at once, so there it is shown only.
        let pause = healthy
            .iter()
            .map(|&i| fleet.members[i].stats.take_max_gap())
            .max()
            .unwrap_or_default();
        table.say(&format!(
            ">>> meanwhile the other worlds' longest pause between messages: {pause:.1?}"
        ));
        if args.fault == Fault::Freeze && pause > Duration::from_millis(900) {
            problems.push(format!(
                "a healthy world paused for {pause:?} while a worker was frozen"
            ));
        }
        let after = fleet.rates(&healthy, Duration::from_secs(1)).await;
        let ratio = before
            .iter()
            .zip(&after)
            .map(|(b, a)| if *b > 0.0 { a / b } else { 0.0 })
            .fold(f64::INFINITY, f64::min);
        table.say(&format!(
            ">>> the other worlds kept flowing: {:.0} % of their earlier rate (slowest world)",
            ratio * 100.0
        ));
        if ratio < 0.5 {
            problems.push(format!("healthy worlds dropped to {:.0} %", ratio * 100.0));
        }
        if args.fault == Fault::Freeze {
            fleet.thaw(victim)?;
        }
        if args.respawn {
            let old = fleet.members[victim].world.generation();
            fleet.respawn(victim).await?;
            let new = fleet.members[victim].world.generation();
            table.say(&format!(
                ">>> a replacement worker joined {name} as generation {new} (was {old}); traffic resumed"
            ));
        }
    }
    stream_for(&fleet, &mut table, started, args.then).await?;

    for m in &fleet.members {
        if args.respawn && !matches!(m.world.state(), WorldState::Ready) {
            problems.push(format!("{} ended {}", m.name, m.world.state().label()));
        }
    }
    // Every worker still streaming ends its stream with how many messages it
    // sent, and the leader must have received exactly those.
    let expected = |i: usize| !(args.fault != Fault::None && !args.respawn && i == victim);
    fleet.end_streams(Duration::from_secs(10)).await;
    let (mut total, mut sent_total) = (0u64, 0u64);
    for (i, m) in fleet.members.iter().enumerate() {
        let s = &m.stats;
        total += s.count();
        let (corrupted, lost) = (
            s.corrupted.load(Ordering::Relaxed),
            s.lost.load(Ordering::Relaxed),
        );
        if corrupted > 0 || lost > 0 {
            problems.push(format!("{}: {corrupted} corrupted, {lost} lost", m.name));
        }
        match s.sent() {
            Some(sent) => {
                sent_total += sent;
                if sent != s.count() {
                    problems.push(format!(
                        "{}: its worker sent {sent} messages, the leader received {}",
                        m.name,
                        s.count()
                    ));
                }
            }
            None if expected(i) => problems.push(format!("{}: its stream did not end cleanly", m.name)),
            None => {}
        }
    }
    let exits = fleet.shutdown().await;
    for (i, code) in exits.iter().enumerate() {
        if expected(i) && *code != Some(0) {
            problems.push(format!("worker {} exited with {code:?}", i + 1));
        }
    }
    println!(
        "\nsummary: {total} messages received intact by the leader in {:?}; \
         the workers that ended their streams cleanly said they sent {sent_total}",
        started.elapsed()
    );
    if let Some(d) = detection {
        println!("         fault detected after {d:.1?}; only the victim's world broke");
    }
    if problems.is_empty() {
        println!("         everything behaved");
        Ok(())
    } else {
        anyhow::bail!("the demo misbehaved: {}", problems.join("; "))
    }
}
