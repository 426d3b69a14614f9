//! The one error type of the store crate, shared by the table, the server and
//! the client, and its mapping to and from gRPC statuses.
//!
//! The variants separate "this world's store is gone" (`Closed`,
//! `WorldNotFound`, `StaleGeneration`, `Unavailable`) from "this call was
//! wrong" (`InvalidArgument`, `LimitExceeded`, `Unauthenticated`) and from
//! "this call ran out of time" (`Timeout`), so a watchdog can tell them apart.
//! On the wire, each variant travels as a gRPC code plus a stable kind string
//! in the `mw-error` metadata entry (see docs/protocol.md).

use std::time::Duration;

use tonic::{Code, Status, metadata::MetadataValue};

/// The metadata entry that carries [`StoreError::kind`] in an error status.
pub const ERROR_KIND_METADATA: &str = "mw-error";
/// The metadata entry that carries a [`StoreError::StaleGeneration`]'s
/// current generation, when there is one.
pub const ERROR_GENERATION_METADATA: &str = "mw-generation";
/// The metadata entry that carries a [`StoreError::LimitExceeded`]'s
/// `limit max requested`, space separated.
pub const ERROR_LIMIT_METADATA: &str = "mw-limit";

/// Which bound a request went over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Limit {
    /// Bytes in one key.
    KeyLen,
    /// Bytes in one value.
    ValueLen,
    /// Keys in one world's store.
    Keys,
    /// Bytes of keys and values in one world's store.
    TotalBytes,
    /// Keys named in one request.
    KeysPerRequest,
    /// Pending waits of one client connection in one world.
    WaitersPerClient,
    /// Worlds open on one server.
    Worlds,
    /// Bytes in one world name.
    NameLen,
    /// Pending waits in one world, all clients together.
    WaitersPerWorld,
    /// Pending waits on one server, all worlds together.
    Waiters,
    /// Bytes of one (multi-)get reply, checked before it is built.
    ReplyBytes,
    /// Bytes of request bodies being received and decoded at once on one
    /// server (its memory budget for requests).
    RequestMemory,
    /// Concurrent requests on one connection that are not (yet) tied to an
    /// authenticated world (`Open`, world-less `Ping`).
    UnauthenticatedStreams,
    /// Waiting requests (get, wait, multi-get) in flight on one connection
    /// of the framed protocol, `ServerConfig::max_streams_per_connection`
    /// (HTTP/2 bounds its streams itself).
    ConnectionRequests,
    /// Bytes of one encoded request or reply (the gRPC layer's message
    /// bound: `ServerConfig::max_message_bytes` on the server,
    /// `ClientConfig::max_message_bytes` on the client), enforced before the
    /// message is decoded.
    MessageBytes,
}

impl Limit {
    const ALL: [Limit; 15] = [
        Limit::KeyLen,
        Limit::ValueLen,
        Limit::Keys,
        Limit::TotalBytes,
        Limit::KeysPerRequest,
        Limit::WaitersPerClient,
        Limit::Worlds,
        Limit::NameLen,
        Limit::MessageBytes,
        Limit::WaitersPerWorld,
        Limit::Waiters,
        Limit::ReplyBytes,
        Limit::RequestMemory,
        Limit::UnauthenticatedStreams,
        Limit::ConnectionRequests,
    ];

    /// The stable wire code of the limit.
    fn code(self) -> &'static str {
        match self {
            Limit::KeyLen => "key-len",
            Limit::ValueLen => "value-len",
            Limit::Keys => "keys",
            Limit::TotalBytes => "total-bytes",
            Limit::KeysPerRequest => "keys-per-request",
            Limit::WaitersPerClient => "waiters-per-client",
            Limit::Worlds => "worlds",
            Limit::NameLen => "name-len",
            Limit::MessageBytes => "message-bytes",
            Limit::WaitersPerWorld => "waiters-per-world",
            Limit::Waiters => "waiters",
            Limit::ReplyBytes => "reply-bytes",
            Limit::RequestMemory => "request-memory",
            Limit::UnauthenticatedStreams => "unauthenticated-streams",
            Limit::ConnectionRequests => "connection-requests",
        }
    }

    fn from_code(code: &str) -> Option<Limit> {
        Limit::ALL.into_iter().find(|l| l.code() == code)
    }

    /// True for a bound on what is in flight at once (waits, request
    /// memory, streams) or on what a world's store holds (keys, bytes,
    /// which go down as keys are deleted): the same request may pass
    /// later. The others (the sizes of one key, value, request, reply or
    /// name, and the worlds per server) refuse the same request every time.
    pub fn clears_by_itself(self) -> bool {
        matches!(
            self,
            Limit::Keys
                | Limit::TotalBytes
                | Limit::WaitersPerClient
                | Limit::WaitersPerWorld
                | Limit::Waiters
                | Limit::RequestMemory
                | Limit::UnauthenticatedStreams
                | Limit::ConnectionRequests
        )
    }

    /// A short name used in messages.
    pub fn as_str(self) -> &'static str {
        match self {
            Limit::KeyLen => "key length",
            Limit::ValueLen => "value length",
            Limit::Keys => "keys per world",
            Limit::TotalBytes => "bytes per world",
            Limit::KeysPerRequest => "keys per request",
            Limit::WaitersPerClient => "waiters per client",
            Limit::Worlds => "worlds per server",
            Limit::NameLen => "world name length",
            Limit::MessageBytes => "message size",
            Limit::WaitersPerWorld => "waiters per world",
            Limit::Waiters => "waiters per server",
            Limit::ReplyBytes => "reply size",
            Limit::RequestMemory => "request memory per server",
            Limit::UnauthenticatedStreams => "unauthenticated streams per connection",
            Limit::ConnectionRequests => "waiting requests per connection",
        }
    }
}

impl std::fmt::Display for Limit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Everything that can go wrong with a store operation.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The keys did not all appear before the timeout.
    #[error("timed out after {after:?} waiting for {what}")]
    Timeout {
        /// What was awaited (keys, connection, ...).
        what: String,
        /// How long the call waited.
        after: Duration,
    },
    /// The world's store was closed (before or during the call).
    #[error("the store of world '{world}' is closed")]
    Closed {
        /// The world.
        world: String,
    },
    /// No store is open for that world name on the server.
    #[error("no store is open for world '{world}'")]
    WorldNotFound {
        /// The world.
        world: String,
    },
    /// The request named a generation that is not the one currently open.
    #[error("world '{world}' generation {requested} is not open (current: {current:?})")]
    StaleGeneration {
        /// The world.
        world: String,
        /// The generation the request named.
        requested: u64,
        /// The generation that is open now, if any.
        current: Option<u64>,
    },
    /// A world of that name is already open (close it to start a new
    /// generation).
    #[error("world '{world}' is already open at generation {generation}")]
    AlreadyOpen {
        /// The world.
        world: String,
        /// The generation that is open.
        generation: u64,
    },
    /// The request did not prove knowledge of the world's secret.
    #[error("unauthenticated for world '{world}': {reason}")]
    Unauthenticated {
        /// The world.
        world: String,
        /// Why: no proof, malformed proof, wrong secret.
        reason: String,
    },
    /// A request went over a configured bound and was refused before anything
    /// was allocated for it.
    #[error("{limit} limit exceeded: {requested} > {max}")]
    LimitExceeded {
        /// Which bound.
        limit: Limit,
        /// The configured maximum.
        max: u64,
        /// What the request asked for.
        requested: u64,
    },
    /// The call's arguments were wrong (empty key, non-integer counter, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The store host could not be reached, or the connection to it broke.
    #[error("store at {addr} unavailable: {reason}")]
    Unavailable {
        /// The server's address.
        addr: String,
        /// The transport's explanation.
        reason: String,
    },
    /// The server answered something this client does not understand.
    #[error("protocol error: {0}")]
    Protocol(String),
}

impl StoreError {
    /// A stable, machine-readable name of the variant (sent as `mw-error`).
    pub fn kind(&self) -> &'static str {
        match self {
            StoreError::Timeout { .. } => "timeout",
            StoreError::Closed { .. } => "closed",
            StoreError::WorldNotFound { .. } => "world-not-found",
            StoreError::StaleGeneration { .. } => "stale-generation",
            StoreError::AlreadyOpen { .. } => "already-open",
            StoreError::Unauthenticated { .. } => "unauthenticated",
            StoreError::LimitExceeded { .. } => "limit-exceeded",
            StoreError::InvalidArgument(_) => "invalid-argument",
            StoreError::Unavailable { .. } => "unavailable",
            StoreError::Protocol(_) => "protocol",
        }
    }

    /// True when the error means the world's store is gone for good (closed,
    /// replaced by a newer generation, or its host unreachable): retrying the
    /// same call on the same world cannot succeed.
    pub fn is_world_gone(&self) -> bool {
        matches!(
            self,
            StoreError::Closed { .. } | StoreError::StaleGeneration { .. } | StoreError::Unavailable { .. }
        )
    }

    fn code(&self) -> Code {
        match self {
            StoreError::Timeout { .. } => Code::DeadlineExceeded,
            StoreError::Closed { .. } | StoreError::StaleGeneration { .. } => Code::FailedPrecondition,
            StoreError::WorldNotFound { .. } => Code::NotFound,
            StoreError::AlreadyOpen { .. } => Code::AlreadyExists,
            StoreError::Unauthenticated { .. } => Code::Unauthenticated,
            StoreError::LimitExceeded { .. } => Code::ResourceExhausted,
            StoreError::InvalidArgument(_) => Code::InvalidArgument,
            StoreError::Unavailable { .. } => Code::Unavailable,
            StoreError::Protocol(_) => Code::Internal,
        }
    }

    /// Converts a status received from a server back into an error. `world`
    /// and `addr` fill in context the status does not carry.
    pub fn from_status(status: &Status, world: &str, addr: &str) -> StoreError {
        let kind = status
            .metadata()
            .get(ERROR_KIND_METADATA)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        let msg = status.message().to_string();
        let world = world.to_string();
        match (status.code(), kind) {
            (_, "timeout") | (Code::DeadlineExceeded, _) => StoreError::Timeout {
                what: msg,
                after: Duration::ZERO,
            },
            (_, "closed") => StoreError::Closed { world },
            (_, "world-not-found") | (Code::NotFound, _) => StoreError::WorldNotFound { world },
            (_, "already-open") | (Code::AlreadyExists, _) => {
                StoreError::AlreadyOpen { world, generation: 0 }
            }
            (_, "stale-generation") => StoreError::StaleGeneration {
                world,
                requested: 0,
                current: status
                    .metadata()
                    .get(ERROR_GENERATION_METADATA)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.parse().ok()),
            },
            (_, "unauthenticated") | (Code::Unauthenticated, _) => {
                StoreError::Unauthenticated { world, reason: msg }
            }
            (_, "limit-exceeded") | (Code::ResourceExhausted, _) => status
                .metadata()
                .get(ERROR_LIMIT_METADATA)
                .and_then(|v| v.to_str().ok())
                .and_then(parse_limit)
                .unwrap_or_else(|| StoreError::Protocol(format!("limit exceeded: {msg}"))),
            (_, "invalid-argument") | (Code::InvalidArgument, _) => StoreError::InvalidArgument(msg),
            // The gRPC codec's own bound (either side's), checked before a
            // message is decoded: it says so only in its text.
            (Code::OutOfRange, _) if msg.contains("message length too large") => {
                let (requested, max) = message_bounds(&msg);
                StoreError::LimitExceeded {
                    limit: Limit::MessageBytes,
                    max,
                    requested,
                }
            }
            (Code::Unavailable, _) | (Code::Cancelled, _) | (Code::Unknown, _) => StoreError::Unavailable {
                addr: addr.to_string(),
                reason: msg,
            },
            _ => StoreError::Protocol(format!("{:?}: {msg}", status.code())),
        }
    }
}

/// The sizes in the gRPC codec's "message length too large: found N bytes,
/// the limit is: M bytes" (0 where the text says otherwise).
fn message_bounds(msg: &str) -> (u64, u64) {
    let number_after = |marker: &str| -> u64 {
        msg.split_once(marker)
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    (number_after("found "), number_after("limit is: "))
}

fn parse_limit(text: &str) -> Option<StoreError> {
    let mut parts = text.split(' ');
    let limit = Limit::from_code(parts.next()?)?;
    let max = parts.next()?.parse().ok()?;
    let requested = parts.next()?.parse().ok()?;
    Some(StoreError::LimitExceeded {
        limit,
        max,
        requested,
    })
}

impl From<StoreError> for Status {
    fn from(err: StoreError) -> Status {
        let mut status = Status::new(err.code(), err.to_string());
        let meta = status.metadata_mut();
        meta.insert(ERROR_KIND_METADATA, MetadataValue::from_static(err.kind()));
        match err {
            StoreError::LimitExceeded {
                limit,
                max,
                requested,
            } => {
                let text = format!("{} {max} {requested}", limit.code());
                if let Ok(value) = MetadataValue::try_from(text) {
                    meta.insert(ERROR_LIMIT_METADATA, value);
                }
            }
            StoreError::StaleGeneration {
                current: Some(current),
                ..
            } => {
                meta.insert(ERROR_GENERATION_METADATA, MetadataValue::from(current));
            }
            _ => {}
        }
        status
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_survives_the_wire() {
        let cases = [
            StoreError::Timeout {
                what: "key 'a'".into(),
                after: Duration::from_millis(5),
            },
            StoreError::Closed { world: "w".into() },
            StoreError::WorldNotFound { world: "w".into() },
            StoreError::StaleGeneration {
                world: "w".into(),
                requested: 1,
                current: Some(2),
            },
            StoreError::Unauthenticated {
                world: "w".into(),
                reason: "no proof".into(),
            },
            StoreError::InvalidArgument("empty key".into()),
            StoreError::AlreadyOpen {
                world: "w".into(),
                generation: 3,
            },
            StoreError::Unavailable {
                addr: "x".into(),
                reason: "y".into(),
            },
        ];
        for err in cases {
            let status = Status::from(err.clone());
            let back = StoreError::from_status(&status, "w", "x");
            assert_eq!(back.kind(), err.kind(), "{err} came back as {back}");
        }
    }

    #[test]
    fn limit_errors_keep_their_message() {
        let err = StoreError::LimitExceeded {
            limit: Limit::ValueLen,
            max: 10,
            requested: 11,
        };
        let status = Status::from(err);
        assert_eq!(status.code(), Code::ResourceExhausted);
        let back = StoreError::from_status(&status, "w", "x");
        assert!(
            matches!(
                back,
                StoreError::LimitExceeded {
                    limit: Limit::ValueLen,
                    max: 10,
                    requested: 11
                }
            ),
            "{back}"
        );
    }
}
