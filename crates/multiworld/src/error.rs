//! [`WorldError`]: the one error type of the facade. Its variants let a caller
//! tell "this world is dead" ([`WorldError::Broken`], with the cause the
//! watchdog recorded) from "this call was wrong" (`InvalidArgument`,
//! `Mismatch`), from "this call ran out of time" (`Timeout`) and from "this
//! call failed but the world is fine" (`Transport`). Where a lower layer's
//! error is the cause it is kept, typed, as the error's `source()`
//! ([`JoinFailure`] for a failed join), never flattened into a string.

use std::time::Duration;

use multiworld_store::StoreError;
use multiworld_tcp::Error as TcpError;
use multiworld_tcp::RendezvousError;
use multiworld_types::WorldName;

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
        world: WorldName,
        /// Why it broke.
        cause: BreakCause,
    },
    /// The operation did not complete within its deadline (the world is not
    /// necessarily broken).
    #[error("world '{world}': {op} timed out after {after:?}")]
    Timeout {
        /// The world.
        world: WorldName,
        /// The operation.
        op: String,
        /// Its deadline.
        after: Duration,
    },
    /// The call was wrong (bad rank, bad shape, ...).
    #[error("world '{world}': invalid argument: {detail}")]
    InvalidArgument {
        /// The world.
        world: WorldName,
        /// What was wrong.
        detail: String,
    },
    /// Ranks disagreed on a message's size or type: nothing was received.
    #[error("world '{world}': {detail}")]
    Mismatch {
        /// The world.
        world: WorldName,
        /// Which message and how it differed.
        detail: String,
    },
    /// A device call failed without breaking the world (out of device
    /// memory, an unsupported dtype or op, no GPU for a host-staged copy).
    #[error("world '{world}': device: {detail}")]
    Device {
        /// The world.
        world: WorldName,
        /// What NCCL or CUDA said.
        detail: String,
    },
    /// This process is not a member of a world of that name.
    #[error("not a member of world '{world}'")]
    NotJoined {
        /// The name asked for, as given (it may not even be a valid name).
        world: String,
    },
    /// This process is already a member of a world of that name (leave it,
    /// or wait for its removal, to join a new generation).
    #[error("already a member of world '{world}' ({state})")]
    AlreadyJoined {
        /// The world.
        world: WorldName,
        /// Its state.
        state: &'static str,
    },
    /// A call failed in the transport without breaking the world: a local
    /// I/O error, a connection refused during a handshake, a rendezvous
    /// lookup that failed. The world stays usable (`is_world_broken()` is
    /// false); the communicator's error is the `source()`.
    #[error("world '{world}': {source}")]
    Transport {
        /// The world.
        world: WorldName,
        /// What the communicator reported.
        #[source]
        source: TcpError,
    },
    /// Joining failed; `reason` (also the `source()`) says where.
    #[error("joining world '{world}' failed: {reason}")]
    JoinFailed {
        /// The world.
        world: WorldName,
        /// Why, typed.
        #[source]
        reason: JoinFailure,
    },
    /// This process could not host a store at `addr` (a bad address, or the
    /// port is taken).
    #[error("cannot host a store at '{addr}': {reason}")]
    HostStore {
        /// The address asked for.
        addr: String,
        /// Why, typed.
        #[source]
        reason: JoinFailure,
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

    /// True when a join failed because it ran out of time (see
    /// [`JoinFailure::is_timeout`]).
    pub fn is_join_timeout(&self) -> bool {
        matches!(self, WorldError::JoinFailed { reason, .. } if reason.is_timeout())
    }

    /// Maps a communicator error of an operation that is not world-fatal.
    /// (World-fatal ones are turned into `Broken` by the world, which knows
    /// the recorded cause.)
    pub(crate) fn from_call(world: &WorldName, err: TcpError) -> WorldError {
        let world = world.clone();
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
            // Not world-fatal (the world turns those into `Broken` itself):
            // I/O, a refused handshake, a rendezvous lookup.
            source => WorldError::Transport { world, source },
        }
    }

    /// A failed join for `reason` (a store or transport error, or a message).
    pub(crate) fn join_failed(world: &WorldName, reason: impl Into<JoinFailure>) -> WorldError {
        WorldError::JoinFailed {
            world: world.clone(),
            reason: reason.into(),
        }
    }

    pub(crate) fn from_store(world: &WorldName, err: StoreError) -> WorldError {
        WorldError::join_failed(world, err)
    }
}

/// Why a join failed, with the lower layer's error kept as it was.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum JoinFailure {
    /// The world's store could not be hosted, reached or opened.
    #[error("store: {0}")]
    Store(#[from] StoreError),
    /// The transport could not rendezvous, connect or authenticate.
    #[error(transparent)]
    Transport(#[from] TcpError),
    /// The join's deadline passed. Inside: what it was waiting for (the
    /// previous generation still being torn down, not every member arriving,
    /// a stale generation kept by the store), or the last error it met
    /// while it retried (a store that never answered, a member's address
    /// that refused connections, a refused stranger), kept as it was.
    #[error("{0}")]
    TimedOut(Box<JoinFailure>),
    /// Anything else (a name the transport refuses, no NCCL in this build,
    /// the NCCL communicator could not be set up), as text.
    #[error("{0}")]
    Other(String),
}

impl JoinFailure {
    /// The join's deadline passed while it waited for `what`.
    pub(crate) fn deadline(what: impl Into<String>) -> JoinFailure {
        JoinFailure::TimedOut(Box::new(JoinFailure::Other(what.into())))
    }

    /// This failure, met when the join's deadline had passed: a timeout
    /// (as it is if it already is one).
    pub(crate) fn at_deadline(self) -> JoinFailure {
        if self.is_timeout() {
            self
        } else {
            JoinFailure::TimedOut(Box::new(self))
        }
    }

    /// True for the errors a join retries until its deadline and then
    /// reports as the last one met: a store that does not answer, a
    /// member's address that refuses connections or is refused, a store
    /// that cannot be reached for a lookup. At the deadline they mean the
    /// join ran out of time ([`JoinFailure::at_deadline`]).
    pub(crate) fn is_retried(&self) -> bool {
        matches!(
            self,
            JoinFailure::Store(StoreError::Unavailable { .. })
                | JoinFailure::Transport(
                    TcpError::Io { .. }
                        | TcpError::Refused { .. }
                        | TcpError::Rendezvous(RendezvousError::Unavailable(_))
                )
        )
    }

    /// True when the join ran out of time: its own deadline, or a store or
    /// rendezvous wait bounded by it. Joining again (with a longer timeout,
    /// or once the missing members are up) may succeed.
    pub fn is_timeout(&self) -> bool {
        matches!(
            self,
            JoinFailure::TimedOut(_)
                | JoinFailure::Store(StoreError::Timeout { .. })
                | JoinFailure::Transport(
                    TcpError::Timeout { .. } | TcpError::Rendezvous(RendezvousError::Timeout { .. })
                )
        )
    }
}

impl From<String> for JoinFailure {
    fn from(reason: String) -> Self {
        JoinFailure::Other(reason)
    }
}

impl From<&str> for JoinFailure {
    fn from(reason: &str) -> Self {
        JoinFailure::Other(reason.to_string())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use std::error::Error as _;
    use std::sync::Arc;

    use multiworld_tcp::{RendezvousError, Side};

    use super::*;

    fn name(s: &str) -> WorldName {
        WorldName::new(s).unwrap()
    }

    /// Errors of a call that leave the world usable are never reported as
    /// broken, and keep the communicator's error as their source.
    #[test]
    fn non_fatal_call_errors_are_not_broken() {
        let io = TcpError::Io {
            context: "connect",
            source: Arc::new(std::io::Error::from(std::io::ErrorKind::ConnectionRefused)),
        };
        let refused = TcpError::Refused {
            addr: "127.0.0.1:1".parse().unwrap(),
            side: Side::Remote,
            code: multiworld_tcp::RejectCode::Generation,
            detail: Arc::from("refused"),
        };
        let rendezvous = TcpError::Rendezvous(RendezvousError::Unavailable(Arc::from("store gone")));
        let invalid = TcpError::InvalidArgument(Arc::from("bad rank"));
        let timeout = TcpError::Timeout {
            op: "recv",
            after: Duration::from_millis(5),
        };
        for err in [io, refused, rendezvous, invalid, timeout] {
            let text = err.to_string();
            let mapped = WorldError::from_call(&name("w"), err);
            assert!(!mapped.is_world_broken(), "{mapped}");
            assert!(
                mapped.to_string().contains(&text) || matches!(mapped, WorldError::Timeout { .. }),
                "{mapped}"
            );
        }
        let io = TcpError::Io {
            context: "bind",
            source: Arc::new(std::io::Error::from(std::io::ErrorKind::AddrInUse)),
        };
        let mapped = WorldError::from_call(&name("w"), io);
        let source = mapped.source().expect("the transport error is the source");
        assert!(source.downcast_ref::<TcpError>().is_some(), "{source}");
    }

    /// A failed rendezvous or store keeps its typed error as the source.
    #[test]
    fn join_failures_keep_their_cause() {
        let err = WorldError::join_failed(
            &name("w"),
            TcpError::Rendezvous(RendezvousError::Unavailable(Arc::from("x"))),
        );
        assert!(!err.is_world_broken());
        let source = err.source().expect("a source");
        assert!(
            matches!(
                source.downcast_ref::<JoinFailure>(),
                Some(JoinFailure::Transport(TcpError::Rendezvous(_)))
            ),
            "{source:?}"
        );
        assert!(!err.is_join_timeout(), "{err}");
        let err = WorldError::from_store(&name("w"), StoreError::InvalidArgument("no".into()));
        assert!(matches!(
            err,
            WorldError::JoinFailed {
                reason: JoinFailure::Store(StoreError::InvalidArgument(_)),
                ..
            }
        ));
        assert!(!err.is_join_timeout());
    }

    /// Every way a join runs out of time is told apart from its other
    /// failures, whichever layer's deadline passed.
    #[test]
    fn join_timeouts_are_told_apart() {
        let after = Duration::from_secs(2);
        let timeouts: [JoinFailure; 5] = [
            JoinFailure::deadline("not every member arrived"),
            JoinFailure::Other("a store that never answered".into()).at_deadline(),
            StoreError::Timeout {
                what: "world w".into(),
                after,
            }
            .into(),
            TcpError::Timeout { op: "join", after }.into(),
            TcpError::Rendezvous(RendezvousError::Timeout {
                key: "addr/0".into(),
                after,
            })
            .into(),
        ];
        for reason in timeouts {
            let err = WorldError::join_failed(&name("w"), reason);
            assert!(err.is_join_timeout(), "{err}");
        }
        let others: [JoinFailure; 4] = [
            JoinFailure::Other("no NCCL".into()),
            StoreError::InvalidArgument("no".into()).into(),
            TcpError::Rendezvous(RendezvousError::Unavailable(Arc::from("gone"))).into(),
            TcpError::InvalidArgument(Arc::from("bad name")).into(),
        ];
        for reason in others {
            let err = WorldError::join_failed(&name("w"), reason);
            assert!(!err.is_join_timeout(), "{err}");
        }
        let call = WorldError::Timeout {
            world: name("w"),
            op: "recv".into(),
            after,
        };
        assert!(!call.is_join_timeout(), "a call's timeout is not a join's");
        // What a join retries until its deadline, and what it does not.
        let unanswered = JoinFailure::Store(StoreError::Unavailable {
            addr: "127.0.0.1:1".into(),
            reason: "no store answered".into(),
        });
        assert!(unanswered.is_retried() && !unanswered.is_timeout());
        assert!(unanswered.at_deadline().is_timeout());
        assert!(!JoinFailure::Other("no NCCL".into()).is_retried());
        assert!(!JoinFailure::Store(StoreError::InvalidArgument("no".into())).is_retried());
    }
}
