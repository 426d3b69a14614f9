//! [`WorldError`]: the one error type of the facade. Its variants let a caller
//! tell "this world is dead" ([`WorldError::Broken`], with the cause the
//! watchdog recorded) from "this call was wrong" (`InvalidArgument`,
//! `Mismatch`) and from "this call ran out of time" (`Timeout`).

use std::time::Duration;

use multiworld_store::StoreError;
use multiworld_tcp::Error as TcpError;

use crate::{config::ConfigError, lifecycle::BreakCause};

/// Everything that can go wrong with a world.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum WorldError {
    /// The world is broken (or was removed): the operation did not run or was
    /// failed. `cause` is the first failure the watchdog saw, the same on every
    /// call.
    #[error("world '{world}' is broken: {cause}")]
    Broken {
        /// The world.
        world: String,
        /// Why it broke.
        cause: BreakCause,
    },
    /// The operation did not complete within its deadline (the world is not
    /// necessarily broken).
    #[error("world '{world}': {op} timed out after {after:?}")]
    Timeout {
        /// The world.
        world: String,
        /// The operation.
        op: String,
        /// Its deadline.
        after: Duration,
    },
    /// The call was wrong (bad rank, bad shape, ...).
    #[error("world '{world}': invalid argument: {detail}")]
    InvalidArgument {
        /// The world.
        world: String,
        /// What was wrong.
        detail: String,
    },
    /// Ranks disagreed on a message's size or type: nothing was received.
    #[error("world '{world}': {detail}")]
    Mismatch {
        /// The world.
        world: String,
        /// Which message and how it differed.
        detail: String,
    },
    /// A device call failed without breaking the world (out of device
    /// memory, an unsupported dtype or op, no GPU for a host-staged copy).
    #[error("world '{world}': device: {detail}")]
    Device {
        /// The world.
        world: String,
        /// What NCCL or CUDA said.
        detail: String,
    },
    /// This process is not a member of a world of that name.
    #[error("not a member of world '{world}'")]
    NotJoined {
        /// The world.
        world: String,
    },
    /// This process is already a member of a world of that name (leave it,
    /// or wait for its removal, to join a new generation).
    #[error("already a member of world '{world}' ({state})")]
    AlreadyJoined {
        /// The world.
        world: String,
        /// Its state.
        state: &'static str,
    },
    /// Joining failed.
    #[error("joining world '{world}' failed: {reason}")]
    JoinFailed {
        /// The world.
        world: String,
        /// Why.
        reason: String,
    },
    /// The configuration cannot be used.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The manager was shut down.
    #[error("the world manager is shut down")]
    ShutDown,
}

impl WorldError {
    /// True when the world is gone: retrying on it cannot succeed.
    pub fn is_world_broken(&self) -> bool {
        matches!(self, WorldError::Broken { .. })
    }

    /// Maps a communicator error of an operation that is not world-fatal.
    /// (World-fatal ones are turned into `Broken` by the world, which knows
    /// the recorded cause.)
    pub(crate) fn from_call(world: &str, err: TcpError) -> WorldError {
        let world = world.to_string();
        match err {
            TcpError::Timeout { op, after } => WorldError::Timeout {
                world,
                op: op.to_string(),
                after,
            },
            TcpError::Mismatch { .. } => WorldError::Mismatch {
                world,
                detail: err.to_string(),
            },
            TcpError::InvalidArgument(detail) => WorldError::InvalidArgument {
                world,
                detail: detail.to_string(),
            },
            other => WorldError::Broken {
                world,
                cause: BreakCause::PeerLost {
                    rank: other.rank().map_or(u32::MAX, |r| r.0),
                    reason: other.to_string(),
                },
            },
        }
    }

    pub(crate) fn join_failed(world: &str, reason: impl std::fmt::Display) -> WorldError {
        WorldError::JoinFailed {
            world: world.to_string(),
            reason: reason.to_string(),
        }
    }

    pub(crate) fn from_store(world: &str, err: StoreError) -> WorldError {
        WorldError::join_failed(world, format!("store: {err}"))
    }
}
