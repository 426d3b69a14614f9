//! [`CommConfig`]: everything one communicator needs to join its world, with
//! defaults for all but the identity (world, generation, rank, size). The defaults
//! and how the timeouts relate are explained in `docs/protocol.md` (the TCP
//! transport) and `docs/failure-model.md` at the repository root.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use crate::error::{Error, Result};
use crate::frame::FrameLimits;
use multiworld_types::{Generation, Identity, Rank, Secret, WorldName};

/// Default of [`CommConfig::recv_spin`].
/// Zero: spinning burns CPU that other worlds in the process need (on a
/// 2-core machine, a spinning receive in one world slows every other world),
/// and the latency target is met without it. Opt in per world where one
/// latency-critical world matters more.
pub const DEFAULT_RECV_SPIN: Duration = Duration::ZERO;

/// Default of [`CommConfig::hello_timeout`]: long enough for any member (which
/// sends its Hello right after connecting) on links with round trips well under
/// a second, short enough that strangers holding silent connections free their
/// handshake slots quickly.
pub const DEFAULT_HELLO_TIMEOUT: Duration = Duration::from_secs(1);

/// Default of [`CommConfig::eager_limit`].
pub const DEFAULT_EAGER_LIMIT: usize = 16 << 10;

/// Configuration of one communicator (one world, one rank).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct CommConfig {
    /// World name.
    pub world: WorldName,
    /// World generation.
    pub generation: Generation,
    /// This process's rank.
    pub rank: Rank,
    /// Number of ranks.
    pub size: u32,
    /// Shared secret; `None` means the handshake proves nothing (identities are
    /// still checked).
    pub secret: Option<Secret>,
    /// Address to listen on. Default `127.0.0.1:0` (any free port).
    pub listen_addr: SocketAddr,
    /// Host to publish instead of the listener's IP (needed when listening on an
    /// unspecified address such as `0.0.0.0`).
    pub advertise_host: Option<IpAddr>,
    /// Deadline for the whole join: publishing, looking up peers, connecting and
    /// authenticating. Default 30 s.
    pub join_timeout: Duration,
    /// Deadline for one handshake: on the accepting side, for the whole inbound
    /// handshake (a stranger that sends half a handshake is dropped after this);
    /// on the connecting side, for one attempt (a join retries failed attempts
    /// until `join_timeout`). Default 5 s.
    pub handshake_timeout: Duration,
    /// Deadline, from accept, for an inbound connection's first message (the
    /// complete Hello). A member sends it in one write right after connecting, so
    /// only a silent or dribbling stranger ("slowloris") misses it; it then loses
    /// its handshake slot after this instead of after `handshake_timeout`. The
    /// effective deadline is the smaller of the two. Default 1 s (ample for any
    /// round-trip time under ~500 ms; raise it for slower links).
    pub hello_timeout: Duration,
    /// Default deadline of each blocking operation and handle wait (`None`: wait
    /// until the operation completes or the world fails). Default `None`.
    pub op_timeout: Option<Duration>,
    /// Limits on lengths read from the network.
    pub limits: FrameLimits,
    /// Largest message that is read off the socket even when no matching receive is
    /// posted yet (it is then buffered). Larger messages wait in the socket until a
    /// receive is posted, so they land directly in the caller's buffer (those
    /// above 16 KiB are read ahead only while the peer's early bytes stay
    /// within 1 MiB). Default 16 KiB. 256 KiB streams 64 KiB messages faster
    /// (see `docs/benchmarks.md`), but every receive of a read-ahead message
    /// completes without waiting: a consumer that computes for long per
    /// message then holds its runtime thread for up to 16 messages (receives
    /// yield every 16 in a row), where with 16 KiB a 64 KiB receive waits
    /// each time (the `m8d` isolation tests, debug builds: the other worlds'
    /// longest pause 16–185 ms against 14–48 ms); it is not the default.
    /// Above `unexpected_budget` it acts as `unexpected_budget`.
    pub eager_limit: usize,
    /// Per-peer cap on bytes held for messages that arrived before their receive.
    /// When it is reached the peer's socket is not read (TCP backpressure). Default 64 MiB.
    pub unexpected_budget: usize,
    /// SO_SNDBUF/SO_RCVBUF for data sockets; `None` keeps the kernel's autotuning.
    pub socket_buffer_size: Option<u32>,
    /// Most inbound (not yet authenticated) handshakes in progress at once. A
    /// newcomer is never refused for lack of a slot: when the slots are full, the
    /// oldest connection that has not yet sent a complete Hello (else the oldest
    /// of the busiest source address) is dropped to make room, so strangers who
    /// hold connections open cannot keep members out. Default 64.
    pub max_pending_handshakes: usize,
    /// Most of those handshakes from one source (an IPv4 address, or an IPv6
    /// /64 prefix); a newcomer from a source at its limit evicts that source's
    /// oldest handshake (never another source's). Must be at least 1. Default 16.
    pub max_pending_per_ip: usize,
    /// How often an idle connection carries a heartbeat frame, so the peer can
    /// tell a frozen or cut-off member from a quiet one
    /// ([`Communicator::liveness`](crate::Communicator::liveness)). `None`
    /// sends none. Default 200 ms.
    pub heartbeat_interval: Option<Duration>,
    /// How long a blocking receive polls (yielding to the runtime) before its
    /// task sleeps. Saves a thread wake-up per message when replies come fast, at
    /// the cost of up to this much CPU per receive. Default zero (off); 50 µs
    /// takes a 4-byte half round trip on the project's VM from ~46 µs to ~6 µs.
    pub recv_spin: Duration,
}

impl CommConfig {
    /// A configuration with default settings for `rank` of a world of `size`.
    pub fn new(world: WorldName, generation: Generation, rank: Rank, size: u32) -> Self {
        CommConfig {
            world,
            generation,
            rank,
            size,
            secret: None,
            listen_addr: SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0),
            advertise_host: None,
            join_timeout: Duration::from_secs(30),
            handshake_timeout: Duration::from_secs(5),
            hello_timeout: DEFAULT_HELLO_TIMEOUT,
            op_timeout: None,
            limits: FrameLimits::default(),
            eager_limit: DEFAULT_EAGER_LIMIT,
            unexpected_budget: 64 << 20,
            socket_buffer_size: None,
            max_pending_handshakes: 64,
            max_pending_per_ip: 16,
            recv_spin: DEFAULT_RECV_SPIN,
            heartbeat_interval: Some(Duration::from_millis(200)),
        }
    }

    /// The largest message a connection's reader reads ahead of its
    /// receive: `eager_limit`, within `unexpected_budget`.
    pub fn read_ahead_limit(&self) -> usize {
        self.eager_limit.min(self.unexpected_budget)
    }

    /// Sets the shared secret.
    pub fn with_secret(mut self, secret: impl AsRef<[u8]>) -> Self {
        self.secret = Some(Secret::new(secret));
        self
    }

    /// Sets the default per-operation deadline.
    pub fn with_op_timeout(mut self, after: Option<Duration>) -> Self {
        self.op_timeout = after;
        self
    }

    /// This member's identity.
    pub fn identity(&self) -> Identity {
        Identity {
            world: self.world.clone(),
            generation: self.generation,
            rank: self.rank,
            size: self.size,
        }
    }

    pub(crate) fn secret_bytes(&self) -> &[u8] {
        self.secret.as_ref().map(Secret::expose).unwrap_or(&[])
    }

    pub(crate) fn validate(&self) -> Result<()> {
        if self.size == 0 {
            return Err(Error::invalid("world size must be at least 1"));
        }
        if self.rank.0 >= self.size {
            return Err(Error::invalid(format!(
                "rank {} is outside a world of {}",
                self.rank, self.size
            )));
        }
        if self.heartbeat_interval.is_some_and(|i| i.is_zero()) {
            return Err(Error::invalid("heartbeat_interval must be positive (or None)"));
        }
        if self.max_pending_handshakes == 0 {
            return Err(Error::invalid("max_pending_handshakes must be at least 1"));
        }
        if self.max_pending_per_ip == 0 {
            return Err(Error::invalid("max_pending_per_ip must be at least 1"));
        }
        if self.hello_timeout.is_zero() || self.handshake_timeout.is_zero() {
            return Err(Error::invalid(
                "hello_timeout and handshake_timeout must be positive",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn validation() {
        let w = WorldName::new("w").unwrap();
        CommConfig::new(w.clone(), Generation(0), Rank(1), 2)
            .validate()
            .unwrap();
        assert!(
            CommConfig::new(w.clone(), Generation(0), Rank(2), 2)
                .validate()
                .is_err()
        );
        assert!(
            CommConfig::new(w.clone(), Generation(0), Rank(0), 0)
                .validate()
                .is_err()
        );
        let mut c = CommConfig::new(w, Generation(0), Rank(0), 1).with_secret("s");
        assert_eq!(c.secret_bytes(), b"s");
        // An eager limit above the budget is the budget (a config that lowers
        // only the budget stays valid under any default eager limit).
        c.unexpected_budget = 64 << 10;
        assert!(c.validate().is_ok());
    }
}
