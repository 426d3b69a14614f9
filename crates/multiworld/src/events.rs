//! [`WorldEvent`]: what the manager tells subscribers about its worlds.

use crate::lifecycle::BreakCause;

/// Something that happened to one of the process's worlds.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum WorldEvent {
    /// The world was joined and is ready.
    Joined {
        /// The world.
        world: String,
        /// Its generation.
        generation: u64,
        /// This process's rank.
        rank: u32,
        /// Number of members.
        size: u32,
    },
    /// The world broke; its teardown has started.
    Broken {
        /// The world.
        world: String,
        /// Its generation.
        generation: u64,
        /// Why.
        cause: BreakCause,
    },
    /// The world was torn down (after a break or a leave); its name can be
    /// joined again.
    Removed {
        /// The world.
        world: String,
        /// Its generation.
        generation: u64,
    },
}

impl WorldEvent {
    /// The world the event is about.
    pub fn world(&self) -> &str {
        match self {
            WorldEvent::Joined { world, .. }
            | WorldEvent::Broken { world, .. }
            | WorldEvent::Removed { world, .. } => world,
        }
    }
}
