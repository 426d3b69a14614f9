//! The watchdog's decisions, as pure functions of `(now, observations,
//! config)` that return a verdict **and a human-readable reason**, tested with
//! a fake clock. The async watchdog task of each world only gathers
//! observations, calls [`decide`], logs the reason when it changes
//! ([`ReasonLog`]) and acts on the verdict.
//!
//! Before deciding, `evidence` filters the observations: while the member is
//! closing the world (`finish`), orderly departures, the store's end and
//! members' reports are expected and weigh nothing (a crash still breaks
//! it); the deadline to watch is the earlier of the host's and the device's.
//!
//! `decide`'s layers, strongest evidence first (the same numbers label them in
//! the code):
//! 1. transport errors (a closed or reset connection): immediate, the lowest
//!    rank reported;
//! 2. a member reporting the world broken (through the store): immediate;
//! 3. the device communicator's error (NCCL's asynchronous error or a failed
//!    device operation): definitive;
//! 4. the store saying this generation is closed or replaced: as good as a
//!    report;
//! 5. per-operation deadlines (host or device, whichever is earlier);
//! 6. heartbeats: a member silent for longer than `heartbeat_timeout` is
//!    frozen or cut off;
//! 7. the world's store unreachable for longer than `store_grace`.
//!
//! A healthy decision carries its suspicions (half a timeout of silence, a
//! failing store) in its reason and the instant by which to decide again.
//!
//! [`stalled`] is the process-level monitor's decision: which watchdogs have
//! not ticked for too long (a stuck watchdog is itself a failure to report).

use std::time::{Duration, Instant};

use multiworld_types::Rank;

use crate::lifecycle::BreakCause;

/// Timeouts of one world's failure detection. `Default` gives the documented
/// defaults; see docs/failure-model.md for how they must relate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchdogConfig {
    /// How often members send heartbeats (default 200 ms).
    pub heartbeat_interval: Duration,
    /// How long a member may be silent before the world breaks (default 1 s;
    /// must be several heartbeat intervals).
    pub heartbeat_timeout: Duration,
    /// How long the world's store may be unreachable before the world breaks
    /// (default 1 s). An outage that ends sooner breaks nothing: the store
    /// watcher probes the store while it fails and sees it answer again.
    pub store_grace: Duration,
}

impl Default for WatchdogConfig {
    fn default() -> Self {
        WatchdogConfig {
            heartbeat_interval: Duration::from_millis(200),
            heartbeat_timeout: Duration::from_secs(1),
            store_grace: Duration::from_secs(1),
        }
    }
}

impl WatchdogConfig {
    /// Refuses settings that cannot work: a timeout that is not comfortably
    /// longer than the interval would break healthy worlds.
    pub fn validate(&self) -> Result<(), String> {
        if self.heartbeat_interval.is_zero() {
            return Err("heartbeat interval must be positive".into());
        }
        if self.heartbeat_timeout < self.heartbeat_interval * 3 {
            return Err(format!(
                "heartbeat timeout {:?} must be at least 3 heartbeat intervals ({:?})",
                self.heartbeat_timeout,
                self.heartbeat_interval * 3
            ));
        }
        Ok(())
    }
}

/// What the watchdog knows of one other member.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerObservation {
    /// The member.
    pub rank: u32,
    /// When anything (data or heartbeat) last arrived from it.
    pub last_heard: Instant,
    /// The transport error its connection failed with, if it did.
    pub transport_error: Option<String>,
    /// It left in an orderly way (said goodbye). Expected while the world is
    /// closing, so then neither its silence nor its closed connection count.
    pub departed: bool,
}

/// An operation in flight with a deadline.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingOp {
    /// What it is (e.g. "recv from rank 2").
    pub op: String,
    /// When it must have completed.
    pub deadline: Instant,
    /// Its timeout, for the report.
    pub timeout: Duration,
}

/// Everything the watchdog gathered for one decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Observations {
    /// The other members.
    pub peers: Vec<PeerObservation>,
    /// The host operation whose deadline comes first, if any is pending.
    pub earliest_op: Option<PendingOp>,
    /// The device operation whose deadline comes first, if any is pending
    /// (the earlier of the two is the one that counts).
    pub device_op: Option<PendingOp>,
    /// This member is finishing the world: orderly departures, and the store
    /// closing, announcing or failing as its host goes away, are expected and
    /// are not evidence of a break (a crash still is).
    pub closing: bool,
    /// When the world's store last answered.
    pub store_last_ok: Instant,
    /// The store's last error, if its last call failed.
    pub store_error: Option<String>,
    /// Set when the store said this world's generation is closed or replaced:
    /// definitive, so no grace period applies.
    pub store_gone: Option<String>,
    /// A member that declared the world broken, and why.
    pub reported_broken: Option<(u32, String)>,
    /// The world's device communicator reported this error (NCCL's
    /// asynchronous error, or a failed device operation).
    pub device_error: Option<String>,
}

/// The verdict of one decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Nothing is wrong (possibly with a suspicion in the reason).
    Healthy,
    /// The world must be broken for this cause.
    Broken(BreakCause),
}

/// A decision: the verdict, why, and when to look again at the latest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    /// What to do.
    pub verdict: Verdict,
    /// Why, in words that stay the same while the situation does (so logging
    /// only changes is meaningful).
    pub reason: String,
    /// The latest instant at which the verdict could change without new
    /// observations (a silence turning into a timeout, a deadline).
    pub next_check: Instant,
}

/// The observations that count as evidence: while closing, departed members
/// and the store's end are dropped; the earlier of the host and device
/// deadlines is the one to watch.
fn evidence(obs: &Observations) -> Observations {
    let closing = obs.closing;
    let keep = |v: &Option<String>| if closing { None } else { v.clone() };
    let earliest_op = match (&obs.earliest_op, &obs.device_op) {
        (Some(host), Some(dev)) => Some(if dev.deadline < host.deadline { dev } else { host }.clone()),
        (host, dev) => host.clone().or_else(|| dev.clone()),
    };
    Observations {
        peers: obs
            .peers
            .iter()
            .filter(|p| !(closing && p.departed))
            .cloned()
            .collect(),
        earliest_op,
        device_op: None,
        store_last_ok: obs.store_last_ok,
        store_error: keep(&obs.store_error),
        store_gone: keep(&obs.store_gone),
        reported_broken: if closing {
            None
        } else {
            obs.reported_broken.clone()
        },
        device_error: obs.device_error.clone(),
        closing,
    }
}

/// Decides whether a world is healthy.
pub fn decide(now: Instant, obs: &Observations, cfg: &WatchdogConfig) -> Decision {
    let obs = &evidence(obs);
    let broken = |cause: BreakCause| Decision {
        reason: format!("broken: {cause}"),
        verdict: Verdict::Broken(cause),
        next_check: now,
    };

    // 1. Transport errors: the lowest rank first, for a deterministic report.
    if let Some(p) = obs
        .peers
        .iter()
        .filter(|p| p.transport_error.is_some())
        .min_by_key(|p| p.rank)
    {
        return broken(BreakCause::PeerLost {
            rank: Rank(p.rank),
            reason: p.transport_error.clone().unwrap_or_default(),
        });
    }
    // 2. A member said so.
    if let Some((rank, reason)) = &obs.reported_broken {
        return broken(BreakCause::ReportedByPeer {
            rank: Rank(*rank),
            reason: reason.clone(),
        });
    }
    // 3. The device communicator failed: NCCL's error is definitive.
    if let Some(reason) = &obs.device_error {
        return broken(BreakCause::Device {
            reason: reason.clone(),
        });
    }
    // 4. The store closed or replaced this generation: as good as a report.
    if let Some(reason) = &obs.store_gone {
        return broken(BreakCause::StoreLost {
            reason: reason.clone(),
        });
    }
    // 5. Deadlines.
    if let Some(op) = obs.earliest_op.as_ref().filter(|op| op.deadline <= now) {
        return broken(BreakCause::OpDeadline {
            op: op.op.clone(),
            after: op.timeout,
        });
    }
    // 6. Heartbeats: the longest-silent member past the timeout.
    let silent = obs
        .peers
        .iter()
        .map(|p| (now.saturating_duration_since(p.last_heard), p.rank))
        .max_by_key(|(silence, rank)| (*silence, std::cmp::Reverse(*rank)));
    if let Some((silence, rank)) = silent
        && silence >= cfg.heartbeat_timeout
    {
        return broken(BreakCause::HeartbeatTimeout {
            rank: Rank(rank),
            silent_for: silence,
        });
    }
    // 7. The store, unreachable past its grace.
    let store_down_for = now.saturating_duration_since(obs.store_last_ok);
    if let Some(err) = &obs.store_error
        && store_down_for >= cfg.store_grace
    {
        return broken(BreakCause::StoreLost {
            reason: format!("unreachable for {store_down_for:?}: {err}"),
        });
    }

    let mut next_check = now + cfg.heartbeat_interval;
    for p in &obs.peers {
        next_check = next_check.min(p.last_heard + cfg.heartbeat_timeout);
    }
    if let Some(op) = &obs.earliest_op {
        next_check = next_check.min(op.deadline);
    }
    if obs.store_error.is_some() {
        next_check = next_check.min(obs.store_last_ok + cfg.store_grace);
    }
    let next_check = next_check.max(now);

    let mut suspicions = Vec::new();
    if let Some((silence, rank)) = silent
        && silence * 2 >= cfg.heartbeat_timeout
    {
        suspicions.push(format!("rank {rank} silent past half the heartbeat timeout"));
    }
    if obs.store_error.is_some() {
        suspicions.push("the store is not answering".to_string());
    }
    let reason = if suspicions.is_empty() {
        format!("healthy: {} peers heard from recently", obs.peers.len())
    } else {
        format!("suspect: {}", suspicions.join("; "))
    };
    Decision {
        verdict: Verdict::Healthy,
        reason,
        next_check,
    }
}

/// Remembers the last reason so it is logged only when it changes.
#[derive(Debug, Default, Clone)]
pub struct ReasonLog {
    last: Option<String>,
}

impl ReasonLog {
    /// Records `reason`; true if it differs from the previous one.
    pub fn changed(&mut self, reason: &str) -> bool {
        if self.last.as_deref() == Some(reason) {
            false
        } else {
            self.last = Some(reason.to_string());
            true
        }
    }
}

/// The process monitor's decision: every watchdog (by name) whose last tick
/// is older than `stall_after`, with how long it has been stuck, longest
/// first.
pub fn stalled<N: Ord>(
    now: Instant,
    last_ticks: impl IntoIterator<Item = (N, Instant)>,
    stall_after: Duration,
) -> Vec<(N, Duration)> {
    let mut out: Vec<(N, Duration)> = last_ticks
        .into_iter()
        .map(|(name, tick)| (name, now.saturating_duration_since(tick)))
        .filter(|(_, stuck)| *stuck >= stall_after)
        .collect();
    out.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn healthy_obs(t0: Instant, ranks: &[u32]) -> Observations {
        Observations {
            peers: ranks
                .iter()
                .map(|&rank| PeerObservation {
                    rank,
                    last_heard: t0,
                    transport_error: None,
                    departed: false,
                })
                .collect(),
            earliest_op: None,
            device_op: None,
            closing: false,
            store_last_ok: t0,
            store_error: None,
            store_gone: None,
            reported_broken: None,
            device_error: None,
        }
    }

    #[test]
    fn a_quiet_healthy_world_is_healthy_and_checked_again_soon() {
        let cfg = WatchdogConfig::default();
        let t0 = Instant::now();
        let d = decide(t0 + ms(100), &healthy_obs(t0, &[1, 2]), &cfg);
        assert_eq!(d.verdict, Verdict::Healthy);
        assert_eq!(d.reason, "healthy: 2 peers heard from recently");
        assert_eq!(d.next_check, t0 + ms(300));
    }

    #[test]
    fn a_transport_error_breaks_at_once_naming_the_lowest_rank() {
        let cfg = WatchdogConfig::default();
        let t0 = Instant::now();
        let mut obs = healthy_obs(t0, &[1, 2, 3]);
        obs.peers[2].transport_error = Some("reset".into());
        obs.peers[1].transport_error = Some("eof".into());
        let d = decide(t0, &obs, &cfg);
        assert_eq!(
            d.verdict,
            Verdict::Broken(BreakCause::PeerLost {
                rank: Rank(2),
                reason: "eof".into()
            })
        );
        assert!(d.reason.starts_with("broken: rank 2 lost"), "{}", d.reason);
    }

    #[test]
    fn silence_becomes_suspicion_then_a_break_exactly_at_the_timeout() {
        let cfg = WatchdogConfig::default();
        let t0 = Instant::now();
        let mut obs = healthy_obs(t0, &[1, 2]);
        obs.peers[0].last_heard = t0 + ms(900);
        // 499 ms of silence: healthy; 500 ms: suspect; 999 ms: still not broken.
        assert_eq!(
            decide(t0 + ms(499), &obs, &cfg).reason,
            "healthy: 2 peers heard from recently"
        );
        let d = decide(t0 + ms(500), &obs, &cfg);
        assert_eq!(d.verdict, Verdict::Healthy);
        assert!(d.reason.contains("rank 2 silent"), "{}", d.reason);
        let d = decide(t0 + ms(999), &obs, &cfg);
        assert_eq!(d.verdict, Verdict::Healthy);
        assert_eq!(
            d.next_check,
            t0 + ms(1000),
            "wake exactly when the silence becomes a timeout"
        );
        let d = decide(t0 + ms(1000), &obs, &cfg);
        assert_eq!(
            d.verdict,
            Verdict::Broken(BreakCause::HeartbeatTimeout {
                rank: Rank(2),
                silent_for: ms(1000)
            })
        );
    }

    #[test]
    fn the_suspect_reason_is_stable_while_the_silence_grows() {
        let cfg = WatchdogConfig::default();
        let t0 = Instant::now();
        let obs = healthy_obs(t0, &[4]);
        let mut log = ReasonLog::default();
        assert!(log.changed(&decide(t0, &obs, &cfg).reason));
        assert!(!log.changed(&decide(t0 + ms(100), &obs, &cfg).reason));
        assert!(log.changed(&decide(t0 + ms(600), &obs, &cfg).reason));
        assert!(!log.changed(&decide(t0 + ms(700), &obs, &cfg).reason));
        assert!(!log.changed(&decide(t0 + ms(950), &obs, &cfg).reason));
        assert!(log.changed(&decide(t0 + ms(1000), &obs, &cfg).reason));
    }

    #[test]
    fn a_missed_deadline_breaks_the_world_and_sets_the_next_check() {
        let cfg = WatchdogConfig::default();
        let t0 = Instant::now();
        let mut obs = healthy_obs(t0, &[1]);
        obs.earliest_op = Some(PendingOp {
            op: "recv from rank 1".into(),
            deadline: t0 + ms(50),
            timeout: ms(50),
        });
        let d = decide(t0 + ms(10), &obs, &cfg);
        assert_eq!(d.verdict, Verdict::Healthy);
        assert_eq!(d.next_check, t0 + ms(50));
        let d = decide(t0 + ms(50), &obs, &cfg);
        assert_eq!(
            d.verdict,
            Verdict::Broken(BreakCause::OpDeadline {
                op: "recv from rank 1".into(),
                after: ms(50)
            })
        );
    }

    #[test]
    fn the_store_gets_a_grace_period() {
        let cfg = WatchdogConfig::default();
        let t0 = Instant::now();
        let mut obs = healthy_obs(t0, &[1]);
        // Peers keep talking; only the store is gone.
        obs.peers[0].last_heard = t0 + ms(1500);
        obs.store_error = Some("connection refused".into());
        let d = decide(t0 + ms(999), &obs, &cfg);
        assert_eq!(d.verdict, Verdict::Healthy);
        assert!(d.reason.contains("store"), "{}", d.reason);
        assert_eq!(d.next_check, t0 + ms(1000));
        match decide(t0 + ms(1000), &obs, &cfg).verdict {
            Verdict::Broken(BreakCause::StoreLost { reason }) => {
                assert!(reason.contains("connection refused"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
        // A store that answered again is fine whatever happened before.
        obs.store_error = None;
        assert_eq!(decide(t0 + ms(1400), &obs, &cfg).verdict, Verdict::Healthy);
    }

    #[test]
    fn a_closed_store_breaks_at_once() {
        let cfg = WatchdogConfig::default();
        let t0 = Instant::now();
        let mut obs = healthy_obs(t0, &[1]);
        obs.store_gone = Some("the world's store was closed".into());
        assert!(matches!(
            decide(t0, &obs, &cfg).verdict,
            Verdict::Broken(BreakCause::StoreLost { reason }) if reason.contains("closed")
        ));
    }

    #[test]
    fn a_device_error_breaks_at_once_and_ranks_after_peer_reports() {
        let cfg = WatchdogConfig::default();
        let t0 = Instant::now();
        let mut obs = healthy_obs(t0, &[1]);
        obs.device_error = Some("ncclRemoteError: a peer failed".into());
        let d = decide(t0, &obs, &cfg);
        assert!(d.reason.contains("device communicator failed"), "{}", d.reason);
        assert!(matches!(
            d.verdict,
            Verdict::Broken(BreakCause::Device { reason }) if reason.contains("ncclRemoteError")
        ));
        // A member's report is the better explanation of a remote error.
        obs.reported_broken = Some((1, "rank 2 lost".into()));
        assert!(matches!(
            decide(t0, &obs, &cfg).verdict,
            Verdict::Broken(BreakCause::ReportedByPeer { rank: Rank(1), .. })
        ));
    }

    #[test]
    fn stronger_evidence_wins() {
        let cfg = WatchdogConfig::default();
        let t0 = Instant::now();
        let mut obs = healthy_obs(t0, &[1, 2]);
        obs.store_error = Some("down".into());
        obs.reported_broken = Some((1, "rank 2 lost".into()));
        obs.peers[1].transport_error = Some("reset".into());
        let later = t0 + Duration::from_secs(10);
        assert!(matches!(
            decide(later, &obs, &cfg).verdict,
            Verdict::Broken(BreakCause::PeerLost { rank: Rank(2), .. })
        ));
        obs.peers[1].transport_error = None;
        assert!(matches!(
            decide(later, &obs, &cfg).verdict,
            Verdict::Broken(BreakCause::ReportedByPeer { rank: Rank(1), .. })
        ));
        obs.reported_broken = None;
        assert!(matches!(
            decide(later, &obs, &cfg).verdict,
            Verdict::Broken(BreakCause::HeartbeatTimeout { .. })
        ));
    }

    #[test]
    fn while_closing_orderly_departures_and_the_stores_end_weigh_nothing() {
        let cfg = WatchdogConfig::default();
        let t0 = Instant::now();
        let mut obs = healthy_obs(t0, &[1, 2]);
        obs.closing = true;
        obs.peers[0].departed = true;
        obs.peers[0].transport_error = Some("connection closed by peer".into());
        obs.store_error = Some("connection refused".into());
        obs.store_gone = Some("the world's store was closed".into());
        obs.reported_broken = Some((1, "rank 1 left".into()));
        // The departed member's silence does not count either.
        obs.peers[0].last_heard = t0 - ms(5000);
        let d = decide(t0 + ms(10) + cfg.store_grace, &obs, &cfg);
        assert!(
            matches!(
                d.verdict,
                Verdict::Broken(BreakCause::HeartbeatTimeout { rank: Rank(2), .. })
            ),
            "{d:?}"
        );
        // Rank 2 is still heard: healthy.
        obs.peers[1].last_heard = t0 + cfg.store_grace;
        let d = decide(t0 + ms(10) + cfg.store_grace, &obs, &cfg);
        assert_eq!(d.verdict, Verdict::Healthy, "{}", d.reason);
        // A member that did not depart and crashed still breaks the world.
        obs.peers[1].transport_error = Some("connection reset by peer".into());
        let d = decide(t0 + ms(10) + cfg.store_grace, &obs, &cfg);
        assert!(
            matches!(
                d.verdict,
                Verdict::Broken(BreakCause::PeerLost { rank: Rank(2), .. })
            ),
            "{d:?}"
        );
        // Not closing, the same departure is a lost peer.
        obs.peers[1].transport_error = None;
        obs.closing = false;
        let d = decide(t0 + ms(10) + cfg.store_grace, &obs, &cfg);
        assert!(
            matches!(
                d.verdict,
                Verdict::Broken(BreakCause::PeerLost { rank: Rank(1), .. })
            ),
            "{d:?}"
        );
    }

    #[test]
    fn the_earlier_of_the_host_and_device_deadlines_counts() {
        let cfg = WatchdogConfig::default();
        let t0 = Instant::now();
        let mut obs = healthy_obs(t0, &[1]);
        let op = |name: &str, at: u64| PendingOp {
            op: name.into(),
            deadline: t0 + ms(at),
            timeout: ms(at),
        };
        obs.earliest_op = Some(op("recv from rank 1", 80));
        obs.device_op = Some(op("all_reduce on the device", 30));
        let d = decide(t0 + ms(10), &obs, &cfg);
        assert_eq!(d.next_check, t0 + ms(30));
        let d = decide(t0 + ms(30), &obs, &cfg);
        assert_eq!(
            d.verdict,
            Verdict::Broken(BreakCause::OpDeadline {
                op: "all_reduce on the device".into(),
                after: ms(30)
            })
        );
        // Only a device op, or only a host op: that one.
        obs.earliest_op = None;
        assert!(matches!(
            decide(t0 + ms(30), &obs, &cfg).verdict,
            Verdict::Broken(_)
        ));
        obs.device_op = None;
        obs.earliest_op = Some(op("send to rank 1", 40));
        assert_eq!(decide(t0 + ms(30), &obs, &cfg).verdict, Verdict::Healthy);
        assert!(matches!(
            decide(t0 + ms(40), &obs, &cfg).verdict,
            Verdict::Broken(_)
        ));
    }

    #[test]
    fn a_world_of_one_has_nobody_to_hear_from() {
        let cfg = WatchdogConfig::default();
        let t0 = Instant::now();
        let d = decide(t0 + Duration::from_secs(60), &healthy_obs(t0, &[]), &cfg);
        assert_eq!(d.verdict, Verdict::Healthy);
    }

    #[test]
    fn config_validation() {
        assert_eq!(WatchdogConfig::default().validate(), Ok(()));
        let bad = WatchdogConfig {
            heartbeat_timeout: ms(500),
            ..WatchdogConfig::default()
        };
        assert!(bad.validate().unwrap_err().contains("3 heartbeat intervals"));
        let zero = WatchdogConfig {
            heartbeat_interval: Duration::ZERO,
            ..WatchdogConfig::default()
        };
        assert!(zero.validate().is_err());
    }

    #[test]
    fn the_monitor_reports_stuck_watchdogs_longest_first() {
        let t0 = Instant::now();
        let now = t0 + Duration::from_secs(10);
        let ticks = [
            ("a", now - ms(100)),
            ("b", now - Duration::from_secs(3)),
            ("c", now - Duration::from_secs(5)),
            ("d", now - Duration::from_secs(2)),
        ];
        let out = stalled(now, ticks, Duration::from_secs(2));
        assert_eq!(
            out,
            vec![
                ("c", Duration::from_secs(5)),
                ("b", Duration::from_secs(3)),
                ("d", Duration::from_secs(2)),
            ]
        );
        assert!(stalled(now, [("a", now)], Duration::from_secs(2)).is_empty());
    }
}
