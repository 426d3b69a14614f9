//! The life of one world as a pure state machine:
//! `Joining → Ready → Broken → Removed`, with `Joining → Broken` (the join
//! failed), `Ready → Removed` and `Joining → Removed` (left on purpose).
//!
//! Every transition is checked, so the manager can never, say, revive a
//! broken world or report it removed twice; the first cause of a break is
//! kept even if more failures follow (they are usually consequences of it).

use std::{fmt, time::Duration};

use multiworld_types::Rank;

/// Why a world broke. The first cause is the one kept and reported.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum BreakCause {
    /// A member's connection closed or reset (it died or was killed).
    PeerLost {
        /// The member.
        rank: Rank,
        /// What the transport saw.
        reason: String,
    },
    /// A member sent nothing, not even a heartbeat, for too long (frozen or
    /// cut off).
    HeartbeatTimeout {
        /// The member.
        rank: Rank,
        /// How long it was silent.
        silent_for: Duration,
    },
    /// An operation did not complete before its deadline.
    OpDeadline {
        /// The operation.
        op: String,
        /// Its deadline.
        after: Duration,
    },
    /// The world's store (its rendezvous) became unreachable or was closed.
    StoreLost {
        /// What the store client saw.
        reason: String,
    },
    /// Another member declared the world broken (through the store).
    ReportedByPeer {
        /// Who reported it.
        rank: Rank,
        /// Its cause, as text.
        reason: String,
    },
    /// The world's device communicator (NCCL) reported an error: its
    /// asynchronous error, or an operation that failed on the device.
    Device {
        /// What NCCL or CUDA said.
        reason: String,
    },
    /// This process aborted the world.
    Aborted,
}

impl BreakCause {
    /// The cause's kind as a short name: `peer_lost`, `heartbeat_timeout`,
    /// `op_deadline`, `store_lost`, `reported_by_peer`, `device` or
    /// `aborted` (the metrics' `cause` label and the Python `.cause`).
    pub fn kind(&self) -> &'static str {
        match self {
            BreakCause::PeerLost { .. } => "peer_lost",
            BreakCause::HeartbeatTimeout { .. } => "heartbeat_timeout",
            BreakCause::OpDeadline { .. } => "op_deadline",
            BreakCause::StoreLost { .. } => "store_lost",
            BreakCause::ReportedByPeer { .. } => "reported_by_peer",
            BreakCause::Device { .. } => "device",
            BreakCause::Aborted => "aborted",
        }
    }

    /// The member the cause is about, if any.
    pub fn rank(&self) -> Option<Rank> {
        match self {
            BreakCause::PeerLost { rank, .. }
            | BreakCause::HeartbeatTimeout { rank, .. }
            | BreakCause::ReportedByPeer { rank, .. } => Some(*rank),
            _ => None,
        }
    }
}

impl fmt::Display for BreakCause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BreakCause::PeerLost { rank, reason } => write!(f, "rank {rank} lost: {reason}"),
            BreakCause::HeartbeatTimeout { rank, silent_for } => {
                write!(f, "rank {rank} silent for {silent_for:?} (frozen or cut off)")
            }
            BreakCause::OpDeadline { op, after } => write!(f, "{op} did not complete within {after:?}"),
            BreakCause::StoreLost { reason } => write!(f, "the world's store was lost: {reason}"),
            BreakCause::ReportedByPeer { rank, reason } => {
                write!(f, "rank {rank} reported the world broken: {reason}")
            }
            BreakCause::Device { reason } => write!(f, "the device communicator failed: {reason}"),
            BreakCause::Aborted => f.write_str("aborted by this process"),
        }
    }
}

/// Where a world is in its life.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WorldState {
    /// Rendezvous and connections are being made.
    Joining,
    /// Every member is connected; operations run.
    Ready,
    /// A failure was detected; operations fail; teardown is under way.
    Broken(BreakCause),
    /// Everything is released; the name may be joined again.
    Removed,
}

impl WorldState {
    /// A short name for tables and logs.
    pub fn label(&self) -> &'static str {
        match self {
            WorldState::Joining => "joining",
            WorldState::Ready => "ready",
            WorldState::Broken(_) => "broken",
            WorldState::Removed => "removed",
        }
    }
}

/// A transition that the state machine refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a world cannot go from {from} to {to}")]
pub struct BadTransition {
    /// The state it was in.
    pub from: &'static str,
    /// The state asked for.
    pub to: &'static str,
}

/// What a transition changed, for the manager to act on (emit events, start
/// teardown).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transition {
    /// The state changed.
    Changed,
    /// The world was already broken: the cause was not replaced.
    AlreadyBroken,
}

/// The state machine of one world.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lifecycle {
    state: WorldState,
}

impl Default for Lifecycle {
    fn default() -> Self {
        Lifecycle {
            state: WorldState::Joining,
        }
    }
}

impl Lifecycle {
    /// A world that starts joining.
    pub fn new() -> Lifecycle {
        Lifecycle::default()
    }

    /// The current state.
    pub fn state(&self) -> &WorldState {
        &self.state
    }

    /// Whether operations may run (the world is ready).
    pub fn is_usable(&self) -> bool {
        self.state == WorldState::Ready
    }

    fn refuse(&self, to: &'static str) -> BadTransition {
        BadTransition {
            from: self.state.label(),
            to,
        }
    }

    /// Joining → Ready.
    pub fn ready(&mut self) -> Result<Transition, BadTransition> {
        match self.state {
            WorldState::Joining => {
                self.state = WorldState::Ready;
                Ok(Transition::Changed)
            }
            _ => Err(self.refuse("ready")),
        }
    }

    /// Joining or Ready → Broken. Breaking a broken world keeps the first
    /// cause; breaking a removed world is refused.
    pub fn break_with(&mut self, cause: BreakCause) -> Result<Transition, BadTransition> {
        match self.state {
            WorldState::Joining | WorldState::Ready => {
                self.state = WorldState::Broken(cause);
                Ok(Transition::Changed)
            }
            WorldState::Broken(_) => Ok(Transition::AlreadyBroken),
            WorldState::Removed => Err(self.refuse("broken")),
        }
    }

    /// Any state but Removed → Removed (teardown finished, or the world was
    /// left on purpose).
    pub fn removed(&mut self) -> Result<Transition, BadTransition> {
        match self.state {
            WorldState::Removed => Err(self.refuse("removed")),
            _ => {
                self.state = WorldState::Removed;
                Ok(Transition::Changed)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lost() -> BreakCause {
        BreakCause::PeerLost {
            rank: Rank(2),
            reason: "connection reset".into(),
        }
    }

    #[test]
    fn the_normal_life() {
        let mut l = Lifecycle::new();
        assert_eq!(l.state(), &WorldState::Joining);
        assert!(!l.is_usable());
        assert_eq!(l.ready(), Ok(Transition::Changed));
        assert!(l.is_usable());
        assert_eq!(l.break_with(lost()), Ok(Transition::Changed));
        assert!(!l.is_usable());
        assert_eq!(l.removed(), Ok(Transition::Changed));
        assert_eq!(l.state(), &WorldState::Removed);
    }

    #[test]
    fn the_first_cause_is_kept() {
        let mut l = Lifecycle::new();
        l.ready().unwrap();
        l.break_with(lost()).unwrap();
        assert_eq!(l.break_with(BreakCause::Aborted), Ok(Transition::AlreadyBroken));
        assert_eq!(l.state(), &WorldState::Broken(lost()));
    }

    #[test]
    fn refused_transitions() {
        let mut l = Lifecycle::new();
        l.ready().unwrap();
        assert_eq!(
            l.ready(),
            Err(BadTransition {
                from: "ready",
                to: "ready"
            })
        );
        l.break_with(BreakCause::Aborted).unwrap();
        assert!(l.ready().is_err(), "a broken world never becomes ready again");
        l.removed().unwrap();
        assert!(l.removed().is_err());
        assert!(l.break_with(BreakCause::Aborted).is_err());
        assert!(l.ready().is_err());
    }

    #[test]
    fn a_join_can_fail_or_be_abandoned() {
        let mut l = Lifecycle::new();
        let cause = BreakCause::Aborted;
        assert_eq!(l.break_with(cause.clone()), Ok(Transition::Changed));
        assert_eq!(l.state(), &WorldState::Broken(cause));
        let mut l = Lifecycle::new();
        assert_eq!(l.removed(), Ok(Transition::Changed));
    }

    #[test]
    fn causes_read_well() {
        let text = BreakCause::HeartbeatTimeout {
            rank: Rank(3),
            silent_for: Duration::from_millis(1200),
        }
        .to_string();
        assert!(text.contains("rank 3") && text.contains("frozen"), "{text}");
        assert!(lost().to_string().contains("connection reset"));
    }
}
