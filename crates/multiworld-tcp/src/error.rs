//! The crate's one error type. Variants are split so a watchdog can tell "this world
//! is dead" ([`Error::PeerLost`], [`Error::Aborted`]; see [`Error::is_world_fatal`])
//! from "this call was wrong" ([`Error::InvalidArgument`], [`Error::Mismatch`]) and
//! from "this call took too long" ([`Error::Timeout`], which a watchdog weighs against
//! its own heartbeats). Errors are `Clone` because one failure is delivered to every
//! pending operation it affects.

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::handshake::RejectCode;
use crate::rendezvous::RendezvousError;
use multiworld_types::DType;
use multiworld_types::{Rank, Tag};

/// Shorthand for results of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in the TCP communicator.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The connection to `rank` is gone (EOF, reset, protocol violation, write
    /// failure, or the peer left). Every operation involving that rank fails with
    /// this; the world should be considered broken.
    #[error("peer rank {rank} lost: {cause}")]
    PeerLost {
        /// The rank whose connection failed.
        rank: Rank,
        /// Human-readable reason, e.g. "connection reset by peer".
        cause: Arc<str>,
    },
    /// The communicator was aborted (explicitly, or because it was dropped or
    /// closed); every pending and future operation fails with this.
    #[error("communicator aborted: {reason}")]
    Aborted {
        /// Why it was aborted.
        reason: Arc<str>,
    },
    /// An operation did not complete within its deadline.
    #[error("{op} timed out after {after:?}")]
    Timeout {
        /// The operation, e.g. `"recv"`.
        op: &'static str,
        /// The deadline that passed.
        after: Duration,
    },
    /// The call itself was wrong (bad rank, bad shape, wrong dtype, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(Arc<str>),
    /// A message arrived whose dtype or byte size does not match the posted
    /// receive. The message is consumed and discarded; nothing was written into the
    /// receive buffer beyond what it already held.
    #[error(
        "message from rank {peer} on tag {tag} does not match the receive: expected {expected}, got {got}"
    )]
    Mismatch {
        /// Sender of the message.
        peer: Rank,
        /// Tag of the message.
        tag: Tag,
        /// What the receive buffer can hold.
        expected: MessageDesc,
        /// What was sent.
        got: MessageDesc,
    },
    /// A connection to or from a world member was refused during the handshake.
    #[error("connection with {addr} refused by the {side} side: {code}: {detail}")]
    Refused {
        /// The other end of the connection.
        addr: SocketAddr,
        /// Which side refused.
        side: Side,
        /// Machine-readable reason.
        code: RejectCode,
        /// Human-readable detail.
        detail: Arc<str>,
    },
    /// Publishing or looking up an address in the rendezvous failed.
    #[error("rendezvous failed: {0}")]
    Rendezvous(#[from] RendezvousError),
    /// A local I/O operation (bind, connect, ...) failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: &'static str,
        /// The underlying error.
        #[source]
        source: Arc<io::Error>,
    },
}

impl From<multiworld_types::InvalidArgument> for Error {
    fn from(e: multiworld_types::InvalidArgument) -> Self {
        Error::InvalidArgument(e.message().clone())
    }
}

impl Error {
    /// True when the error means the world (or the connection to one of its members)
    /// is dead, as opposed to a wrong call or a deadline. A watchdog tears the world
    /// down on these.
    pub fn is_world_fatal(&self) -> bool {
        matches!(self, Error::PeerLost { .. } | Error::Aborted { .. })
    }

    /// The rank this error is about, when there is one.
    pub fn rank(&self) -> Option<Rank> {
        match self {
            Error::PeerLost { rank, .. } => Some(*rank),
            Error::Mismatch { peer, .. } => Some(*peer),
            _ => None,
        }
    }

    /// An [`Error::InvalidArgument`] with this message.
    pub fn invalid(msg: impl Into<String>) -> Self {
        Error::InvalidArgument(Arc::from(msg.into()))
    }

    /// An [`Error::Io`] while doing `context`.
    pub fn io(context: &'static str, source: io::Error) -> Self {
        Error::Io {
            context,
            source: Arc::new(source),
        }
    }

    pub(crate) fn peer_lost(rank: Rank, cause: &Arc<str>) -> Self {
        Error::PeerLost {
            rank,
            cause: Arc::clone(cause),
        }
    }
}

/// The type and size of a message, as used in [`Error::Mismatch`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MessageDesc {
    /// Element type.
    pub dtype: DType,
    /// Payload size in bytes.
    pub bytes: u64,
}

impl fmt::Display for MessageDesc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} bytes of {}", self.bytes, self.dtype)
    }
}

/// Which end of a connection refused it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// This process refused the other end.
    Local,
    /// The other end refused this process.
    Remote,
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Side::Local => "local",
            Side::Remote => "remote",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fatal_classification() {
        let lost = Error::PeerLost {
            rank: Rank(1),
            cause: Arc::from("reset"),
        };
        assert!(lost.is_world_fatal());
        assert_eq!(lost.rank(), Some(Rank(1)));
        assert!(
            Error::Aborted {
                reason: Arc::from("x")
            }
            .is_world_fatal()
        );
        assert!(!Error::invalid("x").is_world_fatal());
        assert!(
            !Error::Timeout {
                op: "recv",
                after: Duration::from_millis(1)
            }
            .is_world_fatal()
        );
        let text = lost.to_string();
        assert!(text.contains("rank 1") && text.contains("reset"), "{text}");
    }
}
