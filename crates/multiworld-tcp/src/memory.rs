//! Worlds whose members all live in this process and talk over in-memory
//! pipes instead of sockets (feature `memory`): [`MemoryWorld`] and
//! [`Communicator::memory_world`]. For tests of the communicator and of what
//! is built on it (the collectives) without ports, handshakes or kernel
//! buffers.
//!
//! Such a communicator is the same [`Communicator`]: the same framing,
//! matching, budgets, heartbeats, liveness, health events and abort; only the
//! byte streams under it differ (see the `link` module). What a pipe lacks:
//! there is no listener (`local_addr` is `0.0.0.0:0`), no handshake (the
//! members are connected and authenticated by construction: there is no
//! stranger in a pipe), so `rejected_connections` stays 0 and the secret and
//! the listening and handshake settings are unused.
//!
//! A member fails the way a TCP member does: dropping or aborting its
//! communicator drops its pipe ends, so every other member's reader sees the
//! stream end ("connection closed by peer") and its writes to it fail, and
//! both report [`Error::PeerLost`](crate::Error::PeerLost) for its rank.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::info;

use crate::comm::{Communicator, Started};
use crate::config::CommConfig;
use crate::error::{Error, Result};
use crate::link::memory::{PipeReader, PipeWriter, pipe};
use crate::link::{ReadLink, WriteLink};
use multiworld_types::{Generation, Rank, WorldName};

/// Default of [`MemoryWorld::pipe_capacity`].
pub const DEFAULT_PIPE_CAPACITY: usize = 256 << 10;

/// The recipe of a world built in memory by [`Communicator::memory_world`]:
/// its members' settings and the size of its pipes.
///
/// ```
/// # use multiworld_tcp::{Communicator, MemoryWorld, Rank, Tag, Tensor, WorldName};
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> multiworld_tcp::Result<()> {
/// let comms = Communicator::memory_world(&MemoryWorld::new(WorldName::new("w").unwrap(), 2))?;
/// comms[0].send(Rank(1), Tag(0), &Tensor::from(vec![1.0f32, 2.0])).await?;
/// let mut buf = Tensor::zeros(multiworld_tcp::DType::F32, [2]).unwrap();
/// comms[1].recv(Rank(0), Tag(0), &mut buf).await?;
/// assert_eq!(buf.as_slice::<f32>().unwrap(), &[1.0, 2.0]);
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct MemoryWorld {
    /// What every member is configured with: the world, generation and size
    /// are the world's; the rank is replaced by each member's own. Operation
    /// timeouts, limits, eager limit, budget, heartbeats and receive spin
    /// apply as over TCP; the secret, listening and handshake settings are
    /// unused.
    pub config: CommConfig,
    /// Most unread bytes each one-way pipe (one per ordered pair of members)
    /// holds before a write waits: what the socket buffers are to TCP, so
    /// also the point where a reader that holds back stops its sender.
    /// Default [`DEFAULT_PIPE_CAPACITY`] (256 KiB); at least 1.
    pub pipe_capacity: usize,
}

impl MemoryWorld {
    /// A world of `size` members named `world`, generation 0, default settings.
    pub fn new(world: WorldName, size: u32) -> Self {
        MemoryWorld {
            config: CommConfig::new(world, Generation(0), Rank(0), size),
            pipe_capacity: DEFAULT_PIPE_CAPACITY,
        }
    }

    /// The same world with every member configured by `config` (its rank is
    /// ignored; its world, generation and size become the world's).
    pub fn with_config(mut self, config: CommConfig) -> Self {
        self.config = config;
        self
    }

    /// The same world with pipes of `bytes` (at least 1).
    pub fn with_pipe_capacity(mut self, bytes: usize) -> Self {
        self.pipe_capacity = bytes;
        self
    }
}

impl Communicator {
    /// Builds every member of the world `spec` describes in this process,
    /// fully connected by in-memory pipes and ready at once (no rendezvous,
    /// no handshake), and returns them in rank order. Each has its own
    /// cancellation token and tasks, as if it had joined alone; dropping or
    /// aborting one makes the others lose it as they would a TCP peer.
    ///
    /// Must be called from within a Tokio runtime (its tasks are spawned
    /// there). Fails with [`Error::InvalidArgument`] outside one, for a zero
    /// pipe capacity, or for settings [`Communicator::join`] would refuse.
    /// Builds `size × (size − 1)` pipes.
    ///
    /// Only with the `memory` feature: a test transport, not a deployment
    /// one.
    pub fn memory_world(spec: &MemoryWorld) -> Result<Vec<Communicator>> {
        let runtime = tokio::runtime::Handle::try_current()
            .map_err(|_| Error::invalid("a memory world must be built within a Tokio runtime"))?;
        if spec.pipe_capacity == 0 {
            return Err(Error::invalid("pipe_capacity must be at least 1"));
        }
        let size = spec.config.size;
        let configs: Vec<CommConfig> = (0..size)
            .map(|r| {
                let mut cfg = spec.config.clone();
                cfg.rank = Rank(r);
                cfg.validate().map(|()| cfg)
            })
            .collect::<Result<_>>()?;
        // `spec.config.validate()` refuses size 0 only through the rank check,
        // which no member ran when there are none.
        if configs.is_empty() {
            return Err(Error::invalid("world size must be at least 1"));
        }

        // writers[i][j]: the pipe from member i to member j; readers[j][i]
        // its other end (none on the diagonal).
        let n = size as usize;
        let mut readers: Vec<Vec<Option<PipeReader>>> =
            (0..n).map(|_| (0..n).map(|_| None).collect()).collect();
        let writers: Vec<Vec<Option<PipeWriter>>> = (0..n)
            .map(|i| {
                (0..n)
                    .map(|j| {
                        (i != j).then(|| {
                            let (w, r) = pipe(spec.pipe_capacity);
                            readers[j][i] = Some(r);
                            w
                        })
                    })
                    .collect()
            })
            .collect();
        let links = writers.into_iter().zip(readers).map(|(ws, rs)| {
            ws.into_iter()
                .zip(rs)
                .map(|(w, r)| Some((ReadLink::Memory(r?), WriteLink::Memory(w?))))
                .collect::<Vec<_>>()
        });

        let no_listener = SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0);
        let comms: Vec<Communicator> = configs
            .into_iter()
            .zip(links)
            .map(|(cfg, links)| {
                let tracker = TaskTracker::new();
                tracker.close();
                Communicator::start(Started {
                    cfg,
                    token: CancellationToken::new(),
                    tracker,
                    rejected: Arc::new(AtomicU64::new(0)),
                    local_addr: no_listener,
                    runtime: runtime.clone(),
                    links,
                })
            })
            .collect();
        info!(world = %spec.config.world, size, "built world in memory");
        Ok(comms)
    }
}
