//! [`WorldEvent`]: what the manager tells subscribers about its worlds.

use multiworld_types::{Generation, Rank, WorldName};

use std::sync::Arc;

use crate::{lifecycle::BreakCause, recorder::FlightRecord};

/// Something that happened to one of the process's worlds.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum WorldEvent {
    /// The world was joined and is ready.
    Joined {
        /// The world.
        world: WorldName,
        /// Its generation.
        generation: Generation,
        /// This process's rank.
        rank: Rank,
        /// Number of members.
        size: u32,
    },
    /// The world broke; its teardown has started.
    Broken {
        /// The world.
        world: WorldName,
        /// Its generation.
        generation: Generation,
        /// Why.
        cause: BreakCause,
        /// What the world was doing when it broke: its last operations and
        /// those still pending (see [`FlightRecord::timeline`]).
        record: Arc<FlightRecord>,
    },
    /// The world's device communicator did not finish aborting within its
    /// deadline (a hung kernel or NCCL call): its communicator, stream and
    /// device memory are leaked on purpose and never touched again. The
    /// world is still torn down and `Removed` follows; other worlds are not
    /// affected, but the leaked resources stay until the process exits.
    Quarantined {
        /// The world.
        world: WorldName,
        /// Its generation.
        generation: Generation,
        /// What the abort reported.
        reason: String,
    },
    /// The process monitor found the world's watchdog not running for
    /// `stuck_for` (at least `ManagerConfig::stall_after`): the Tokio
    /// runtime the watchdogs run on is blocked or starved, so failures of
    /// this world are not being detected. Reported once per episode; the
    /// world itself is not changed.
    WatchdogStalled {
        /// The world.
        world: WorldName,
        /// How long its watchdog had not run when this was reported.
        stuck_for: std::time::Duration,
    },
    /// The world was torn down (after a break or a leave); its name can be
    /// joined again.
    Removed {
        /// The world.
        world: WorldName,
        /// Its generation.
        generation: Generation,
    },
}

impl WorldEvent {
    /// The world the event is about.
    pub fn world(&self) -> &WorldName {
        match self {
            WorldEvent::Joined { world, .. }
            | WorldEvent::Broken { world, .. }
            | WorldEvent::Quarantined { world, .. }
            | WorldEvent::WatchdogStalled { world, .. }
            | WorldEvent::Removed { world, .. } => world,
        }
    }
}
