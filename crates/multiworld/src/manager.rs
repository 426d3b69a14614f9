//! [`WorldManager`]: owns every world of the process. Joins worlds (many at
//! once, at any time), leaves them, finds them, lists them, and broadcasts
//! [`WorldEvent`]s. It hosts the stores of the worlds whose store this
//! process serves (one server per address, however many worlds use it), and
//! runs the process-level monitor that notices a stuck watchdog.
//!
//! The manager holds a root [`CancellationToken`]; each world gets a child
//! token, so tearing one world down cancels exactly its subtree, and dropping
//! the last manager handle cancels them all.

use std::{
    collections::HashSet,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    path::PathBuf,
    sync::{Arc, Weak},
    time::{Duration, Instant},
};

use dashmap::mapref::entry::Entry;
use multiworld_store::{ClientConfig, OpenOptions, ServerConfig, StoreClient, StoreServer, WorldOptions};
use multiworld_tcp::{CommConfig, Communicator};
use multiworld_types::{Generation, Rank, WorldName};
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

use crate::{
    config::{Backend, ConfigError, WorldConfig},
    error::{JoinFailure, WorldError},
    events::WorldEvent,
    lifecycle::WorldState,
    metrics::{Endpoint, Metrics},
    rendezvous::StoreRendezvous,
    watchdog::stalled,
    world::{Attachments, Joined, Registry, Slot, World, WorldShared},
};

/// Settings of a manager. `Default` gives the documented defaults, with
/// `metrics_addr` and `flight_recorder_dir` read from the environment
/// (`MULTIWORLD_METRICS_ADDR`, `MULTIWORLD_FLIGHT_RECORDER_DIR`).
#[derive(Debug, Clone)]
pub struct ManagerConfig {
    /// How often the process monitor looks at the watchdogs (default 500 ms).
    pub monitor_interval: Duration,
    /// A watchdog that has not run for this long is reported stuck
    /// (default 2 s).
    pub stall_after: Duration,
    /// Events buffered per subscriber before a slow one starts missing them
    /// (default 4,096).
    pub event_capacity: usize,
    /// Serve Prometheus metrics over HTTP at this address (`GET /metrics`;
    /// port 0 picks a free port, see [`WorldManager::metrics_addr`]). Default:
    /// `MULTIWORLD_METRICS_ADDR` when set (e.g. `0.0.0.0:9464`), else off.
    /// The metrics exist either way ([`WorldManager::metrics_text`]).
    pub metrics_addr: Option<SocketAddr>,
    /// Operations each world's flight recorder keeps once ended (default
    /// 256; the ones still running are always kept).
    pub flight_recorder_capacity: usize,
    /// Write a broken world's flight record to this directory, as
    /// `<world>-g<generation>-r<rank>.json` (`m8d flight FILE` prints it).
    /// Default: `MULTIWORLD_FLIGHT_RECORDER_DIR` when set, else off (the
    /// record is still logged and attached to [`WorldEvent::Broken`]).
    pub flight_recorder_dir: Option<PathBuf>,
}

/// The environment variable naming the metrics endpoint's address.
pub const METRICS_ADDR_ENV: &str = "MULTIWORLD_METRICS_ADDR";
/// The environment variable naming the flight records' directory.
pub const FLIGHT_RECORDER_DIR_ENV: &str = "MULTIWORLD_FLIGHT_RECORDER_DIR";

impl Default for ManagerConfig {
    fn default() -> Self {
        let metrics_addr = std::env::var(METRICS_ADDR_ENV)
            .ok()
            .map(|v| v.trim().to_string())
            .filter(|v| !v.is_empty())
            .and_then(|v| match v.parse() {
                Ok(a) => Some(a),
                Err(e) => {
                    tracing::error!(
                        "{METRICS_ADDR_ENV}={v:?} is not an ip:port address ({e}); metrics are not served"
                    );
                    None
                }
            });
        let flight_recorder_dir = std::env::var_os(FLIGHT_RECORDER_DIR_ENV)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from);
        ManagerConfig {
            monitor_interval: Duration::from_millis(500),
            stall_after: Duration::from_secs(2),
            event_capacity: 4096,
            metrics_addr,
            flight_recorder_capacity: crate::recorder::DEFAULT_CAPACITY,
            flight_recorder_dir,
        }
    }
}

/// A world's name, generation and state, as listed by [`WorldManager::worlds`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorldInfo {
    /// The world.
    pub name: WorldName,
    /// Its generation (0 while joining).
    pub generation: Generation,
    /// This process's rank.
    pub rank: Rank,
    /// Number of members.
    pub size: u32,
    /// Its state.
    pub state: WorldState,
}

struct HostedStore {
    requested: String,
    server: Arc<StoreServer>,
}

struct Inner {
    config: ManagerConfig,
    registry: Arc<Registry>,
    metrics: Arc<Metrics>,
    /// The metrics endpoint, when one is served.
    endpoint: Option<Endpoint>,
    events: broadcast::Sender<WorldEvent>,
    root: CancellationToken,
    /// Cancelled when [`WorldManager::shutdown`] begins: joins in progress
    /// end with [`WorldError::ShutDown`] and new ones are refused, while the
    /// worlds are still being left (before `root`, which ends them all).
    closing: CancellationToken,
    hosts: tokio::sync::Mutex<Vec<HostedStore>>,
    /// The NCCL runtime of this process's NCCL worlds.
    #[cfg(feature = "nccl")]
    nccl: crate::device::RuntimeSlot,
}

/// How long after its deadline a join is cut off if a step inside it has not
/// ended by its own bound.
const JOIN_BACKSTOP: Duration = Duration::from_millis(500);

/// How close to its deadline a join that fails with an error it retries
/// counts as timed out: the steps inside give up at the deadline by their
/// own timers, which may fire a little early.
const AT_DEADLINE: Duration = Duration::from_millis(50);

/// How long [`stale_generation`] waits, in all, for a published member to take a
/// connection: longer than a first SYN's retransmission (1 s), so that one
/// lost packet does not make a live member look gone.
const STALE_PROBE: Duration = Duration::from_millis(1200);

/// Longest a member waits for the store to take its [`FORMED_KEY`].
const FORMED_WRITE: Duration = Duration::from_millis(500);

/// How many members [`stale_generation`] probes (the lowest ranks, all at
/// once): while a world waits in its generation, its members are there.
const STALE_PROBES: usize = 64;

/// Shortest probe [`stale_generation`] trusts: with less of the join left, a
/// live member could look gone, so the generation is taken as it is.
const STALE_PROBE_MIN: Duration = Duration::from_millis(100);

/// Written in a standalone store's generation by each member once the
/// world has formed (every member connected): [`stale_generation`] tells a
/// world that lost a member from a join still under way by it.
const FORMED_KEY: &str = "multiworld/formed";

/// Whether the generation `store` opened is left over, so that this member
/// must not join it: an address is already published for `rank` (a member
/// of this rank joined it before; a fresh generation has no keys, and one
/// torn down in order is closed and never opened again), and either the
/// world formed in it (its members are gone, or they lost that member and
/// the world is over) or no other member's published address takes a
/// connection (every member of a join that never completed is gone). When
/// the world never formed and another member still answers, the earlier
/// address of this rank is a failed attempt's (this process's, or one
/// restarted after a crash) while that member waits in the generation: the
/// join goes on in it and publishes again. A store that cannot tell counts
/// as fresh: the join then goes on and fails on its own if it must.
async fn stale_generation(
    store: &multiworld_store::WorldStore,
    world: &WorldName,
    rank: Rank,
    size: u32,
    left: Duration,
) -> bool {
    let generation = multiworld_tcp::Generation(store.generation());
    let own = multiworld_tcp::addr_key(world, generation, rank);
    if !matches!(store.try_get(own).await, Ok(Some(_))) {
        return false;
    }
    if matches!(store.try_get(FORMED_KEY.to_owned()).await, Ok(Some(_))) {
        return true;
    }
    if left < STALE_PROBE_MIN {
        return false;
    }
    // One bound for both steps below, within what is left of the join.
    let until = tokio::time::Instant::now() + STALE_PROBE.min(left);
    // The addresses first: a store too slow to give them within the bound
    // cannot tell, and the generation counts as fresh.
    let lookups = (0..size)
        .filter(|&r| r != rank.0)
        .take(STALE_PROBES)
        .map(|r| async move {
            let key = multiworld_tcp::addr_key(world, generation, Rank(r));
            match store.try_get(key).await {
                Ok(Some(raw)) => Some(multiworld_tcp::published_addr(&raw)),
                // Not published (that member never came), or unreadable.
                Ok(None) => Some(None),
                Err(_) => None,
            }
        });
    let Ok(looked_up) = tokio::time::timeout_at(until, futures::future::join_all(lookups)).await else {
        return false;
    };
    let Some(addrs) = looked_up.into_iter().collect::<Option<Vec<Option<SocketAddr>>>>() else {
        return false;
    };
    // Then the connections, all at once within what is left of the bound;
    // the first member that answers settles it. Closed without a byte: the listener takes
    // that for a probe, not a refused member.
    use futures::StreamExt as _;
    let mut probes: futures::stream::FuturesUnordered<_> = addrs
        .into_iter()
        .flatten()
        .map(|addr| async move { tokio::net::TcpStream::connect(addr).await.is_ok() })
        .collect();
    let answered = tokio::time::timeout_at(until, async {
        while let Some(live) = probes.next().await {
            if live {
                return true;
            }
        }
        false
    })
    .await;
    !matches!(answered, Ok(true))
}

/// Longest [`WorldManager::shutdown`] waits for joins in progress to end.
const SHUTDOWN_JOIN_WAIT: Duration = Duration::from_secs(5);

impl Drop for Inner {
    fn drop(&mut self) {
        self.root.cancel();
    }
}

/// Owns every world of this process. Cheap to clone; dropping the last clone
/// aborts every world (prefer [`WorldManager::shutdown`] for an orderly end).
/// Must be created inside a Tokio runtime.
#[derive(Clone)]
pub struct WorldManager {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for WorldManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorldManager")
            .field("worlds", &self.inner.registry.len())
            .finish()
    }
}

impl Default for WorldManager {
    fn default() -> Self {
        WorldManager::new(ManagerConfig::default())
    }
}

/// Removes a `Joining` reservation unless the join completed.
struct Reservation<'a> {
    registry: &'a Registry,
    name: &'a WorldName,
    armed: bool,
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.registry
                .remove_if(self.name, |_, slot| matches!(slot, Slot::Joining { .. }));
        }
    }
}

/// Closes a world's store on its host unless the join completed.
struct OpenedStore<'a> {
    server: Option<&'a StoreServer>,
    name: &'a str,
    armed: bool,
}

impl Drop for OpenedStore<'_> {
    fn drop(&mut self) {
        if let (true, Some(server)) = (self.armed, self.server) {
            server.close_world(self.name);
        }
    }
}

impl WorldManager {
    /// A manager with no worlds. Starts the process monitor on a thread of
    /// its own (see [`WorldEvent::WatchdogStalled`]).
    pub fn new(config: ManagerConfig) -> WorldManager {
        let (events, _) = broadcast::channel(config.event_capacity.max(16));
        let registry = Arc::new(Registry::new());
        let metrics = Arc::new(Metrics::new(Arc::downgrade(&registry)));
        let root = CancellationToken::new();
        let endpoint = config.metrics_addr.and_then(|addr| {
            match crate::metrics::serve(addr, Arc::downgrade(&metrics), &root) {
                Ok(e) => {
                    tracing::info!(addr = %e.addr, "serving metrics at http://{}/metrics", e.addr);
                    Some(e)
                }
                Err(e) => {
                    tracing::error!(%addr, error = %e, "cannot serve metrics");
                    None
                }
            }
        });
        let inner = Arc::new(Inner {
            config,
            registry,
            metrics,
            endpoint,
            events,
            root,
            closing: CancellationToken::new(),
            hosts: tokio::sync::Mutex::new(Vec::new()),
            #[cfg(feature = "nccl")]
            nccl: std::sync::Arc::new(std::sync::Mutex::new(None)),
        });
        let (weak, stop) = (Arc::downgrade(&inner), inner.root.clone());
        if let Err(e) = std::thread::Builder::new()
            .name("multiworld-monitor".into())
            .spawn(move || monitor(weak, stop))
        {
            // Worlds still work without it; only stuck watchdogs go unreported.
            tracing::error!(error = %e, "could not start the process monitor thread");
        }
        WorldManager { inner }
    }

    /// Sets the NCCL runtime (the loaded NCCL and CUDA driver libraries) that
    /// NCCL worlds joined from now on use. Without it, the first NCCL join
    /// loads one with [`NcclRuntime::load`](multiworld_nccl::NcclRuntime::load)
    /// (`NCCL_LIBRARY`, the loader path, pip-wheel locations).
    #[cfg(feature = "nccl")]
    pub fn use_nccl_runtime(&self, runtime: multiworld_nccl::NcclRuntime) {
        *self.inner.nccl.lock().unwrap_or_else(|e| e.into_inner()) = Some(runtime);
    }

    /// Subscribes to world events from now on.
    pub fn events(&self) -> broadcast::Receiver<WorldEvent> {
        self.inner.events.subscribe()
    }

    /// Where the metrics endpoint listens (`None`: not served, see
    /// [`ManagerConfig::metrics_addr`]).
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.inner.endpoint.as_ref().map(|e| e.addr)
    }

    /// Every metric of this process and its worlds now, in Prometheus' text
    /// format (what the endpoint serves).
    pub fn metrics_text(&self) -> String {
        self.inner.metrics.encode()
    }

    /// The flight record of the world `name` now (its last operations and
    /// those running), if this process is a member.
    pub fn flight_record(&self, name: impl AsRef<str>) -> Option<crate::recorder::FlightRecord> {
        match self.inner.registry.get(name.as_ref()).as_deref() {
            Some(Slot::Member(w)) => Some(w.flight_record("on request")),
            _ => None,
        }
    }

    /// Starts (or finds) a store server of this process at `bind` and returns
    /// the address it listens on. Worlds whose config names `bind` or that
    /// address, with `host_store`, are hosted there: one port for any number
    /// of worlds.
    pub async fn serve_store(&self, bind: &str) -> Result<std::net::SocketAddr, WorldError> {
        Ok(self.host(bind).await?.local_addr())
    }

    async fn host(&self, addr: &str) -> Result<Arc<StoreServer>, WorldError> {
        let mut hosts = self.inner.hosts.lock().await;
        // Checked under the lock `shutdown` empties the list with: a server
        // started after that would never be stopped.
        if self.inner.closing.is_cancelled() {
            return Err(WorldError::ShutDown);
        }
        if let Some(h) = hosts
            .iter()
            .find(|h| h.requested == addr || h.server.local_addr().to_string() == addr)
        {
            return Ok(Arc::clone(&h.server));
        }
        let bind = addr
            .parse()
            .map_err(|e: std::net::AddrParseError| WorldError::HostStore {
                addr: addr.to_string(),
                reason: JoinFailure::Other(format!("not an ip:port address: {e}")),
            })?;
        let server = StoreServer::bind(bind, ServerConfig::default())
            .await
            .map_err(|e| WorldError::HostStore {
                addr: addr.to_string(),
                reason: e.into(),
            })?;
        let server = Arc::new(server);
        hosts.push(HostedStore {
            requested: addr.to_string(),
            server: Arc::clone(&server),
        });
        Ok(server)
    }

    /// Joins a world: hosts or reaches its store, rendezvouses with the other
    /// members, connects to every one of them, and starts its watchdog. Fails
    /// after `config.join_timeout`. Joining a name whose previous generation
    /// is still being torn down (broken, or being left) waits for that
    /// teardown first.
    pub async fn join(&self, config: WorldConfig) -> Result<World, WorldError> {
        config.validate()?;
        check_stall_after(&config, self.inner.config.stall_after)?;
        if self.inner.root.is_cancelled() || self.inner.closing.is_cancelled() {
            return Err(WorldError::ShutDown);
        }
        #[cfg(not(feature = "nccl"))]
        if config.backend == Backend::Nccl {
            return Err(WorldError::join_failed(
                &config.name,
                "this build has no NCCL support: enable the `nccl` feature of multiworld",
            ));
        }
        let started = Instant::now();
        let deadline = started + config.join_timeout;
        let name = config.name.clone();
        // Reserve the name (waiting out the teardown of a broken or left
        // predecessor).
        loop {
            let previous = match self.inner.registry.entry(name.clone()) {
                Entry::Vacant(v) => {
                    v.insert(Slot::Joining {
                        rank: config.rank,
                        size: config.size,
                    });
                    break;
                }
                Entry::Occupied(o) => match o.get() {
                    Slot::Joining { .. } => {
                        return Err(WorldError::AlreadyJoined {
                            world: name,
                            state: "joining",
                        });
                    }
                    Slot::Member(w) => match w.state() {
                        // Being torn down (broken, or left): wait for it.
                        WorldState::Broken(_) | WorldState::Removed => Arc::clone(w),
                        other => {
                            return Err(WorldError::AlreadyJoined {
                                world: name,
                                state: other.label(),
                            });
                        }
                    },
                },
            };
            let remaining = deadline.saturating_duration_since(Instant::now());
            if tokio::time::timeout(remaining, previous.wait_removed())
                .await
                .is_err()
            {
                return Err(WorldError::join_failed(
                    &name,
                    JoinFailure::deadline(
                        "the previous generation was still being torn down at the join timeout",
                    ),
                ));
            }
        }
        let mut reservation = Reservation {
            registry: &self.inner.registry,
            name: &name,
            armed: true,
        };
        // The steps inside honour `deadline` themselves and fail with their
        // own typed errors; this bound is a backstop, a little later, so
        // that it does not race them and replace their error with its own.
        let remaining = deadline.saturating_duration_since(Instant::now()) + JOIN_BACKSTOP;
        let joined = tokio::select! {
            r = tokio::time::timeout(remaining, self.join_inner(&config, deadline)) => r,
            _ = self.inner.closing.cancelled() => return Err(WorldError::ShutDown),
        };
        let shared = match joined {
            Ok(Ok(shared)) => shared,
            // An error the join retries until its deadline, reported at the
            // deadline, is the join's timeout (a store that never answered,
            // an address that kept refusing, a refused stranger).
            Ok(Err(WorldError::JoinFailed { world, reason }))
                if reason.is_retried() && Instant::now() + AT_DEADLINE >= deadline =>
            {
                return Err(WorldError::JoinFailed {
                    world,
                    reason: reason.at_deadline(),
                });
            }
            Ok(Err(e)) => return Err(e),
            Err(_) => {
                return Err(WorldError::join_failed(
                    &name,
                    JoinFailure::deadline(format!(
                        "not every member arrived within {:?}",
                        config.join_timeout
                    )),
                ));
            }
        };
        // `Joined` is sent while the new entry's lock is held: a shutdown
        // (or a leave) can find the world only after it, and it comes
        // before the watchdog starts, so whatever ends the world (a break
        // found at once, a leave) is reported after it.
        let entry = self
            .inner
            .registry
            .entry(name.clone())
            .insert(Slot::Member(Arc::clone(&shared)));
        let _ = self.inner.events.send(WorldEvent::Joined {
            world: name.clone(),
            generation: shared.generation,
            rank: shared.rank,
            size: shared.size,
        });
        drop(entry);
        reservation.armed = false;
        drop(reservation);
        self.inner.metrics.joins.inc();
        tracing::info!(
            world = %name,
            generation = shared.generation.0,
            rank = shared.rank.0,
            size = shared.size,
            took = ?started.elapsed(),
            "joined world"
        );
        if self.inner.closing.is_cancelled() {
            // A shutdown began while this join ended, and may have looked
            // at the registry before the world was in it: leave it here
            // (a leave from both sides is harmless).
            shared.leave().await;
            return Err(WorldError::ShutDown);
        }
        shared.start();
        Ok(World { shared })
    }

    async fn join_inner(
        &self,
        config: &WorldConfig,
        deadline: Instant,
    ) -> Result<Arc<WorldShared>, WorldError> {
        let name = &config.name;
        let world_name = name.clone();
        let secret = config.secret.clone();
        let host = if config.host_store {
            Some(self.host(&config.store_addr).await.map_err(|e| match e {
                WorldError::HostStore { reason, .. } => WorldError::join_failed(name, reason),
                other => other,
            })?)
        } else {
            None
        };
        let mut opened = OpenedStore {
            server: host.as_deref(),
            name: name.as_str(),
            armed: false,
        };
        if let Some(server) = &host {
            let options = WorldOptions {
                secret: secret.clone(),
                limits: None,
            };
            server
                .open_world(name.as_str(), options)
                .map_err(|e| WorldError::from_store(name, e))?;
            opened.armed = true;
        }
        let store_addr = host
            .as_ref()
            .map_or_else(|| config.store_addr.clone(), |h| h.local_addr().to_string());
        let remaining = || deadline.saturating_duration_since(Instant::now());
        let client_config = ClientConfig {
            connect_timeout: remaining(),
            ..ClientConfig::default()
        };
        let client = StoreClient::connect(&store_addr, client_config)
            .await
            .map_err(|e| WorldError::from_store(name, e))?;
        loop {
            // A standalone store (`m8d store`) lets the first member create
            // the world; a store embedded in a member ignores `create` and
            // waits for its host to open it.
            let options = OpenOptions {
                secret: secret.clone(),
                create: host.is_none(),
                timeout: remaining(),
            };
            let store = client
                .open(name.as_str(), options)
                .await
                .map_err(|e| WorldError::from_store(name, e))?;
            if host.is_none()
                && stale_generation(&store, &world_name, config.rank, config.size, remaining()).await
            {
                // A member of this rank joined this generation before, and
                // the world formed in it or no other member answers: it is
                // what is left of a world whose members died without
                // closing it, or that lost this rank (a standalone store
                // keeps it, with their addresses). Close it and open a fresh
                // one; a member of the new job that opened it too finds it
                // gone and opens again.
                tracing::info!(
                    world = %name,
                    generation = store.generation(),
                    "the store kept a generation whose members are gone; opening a fresh one"
                );
                let _ = store.close().await;
                if remaining().is_zero() {
                    return Err(WorldError::join_failed(
                        name,
                        JoinFailure::deadline(
                            "the store kept a stale generation of this world until the join timeout",
                        ),
                    ));
                }
                continue;
            }
            let rendezvous = StoreRendezvous::new(store.clone());
            let mut comm_config = CommConfig::new(
                world_name.clone(),
                Generation(store.generation()),
                config.rank,
                config.size,
            );
            comm_config.secret = secret.clone();
            comm_config.listen_addr = SocketAddr::new(mesh_host(config).await, 0);
            comm_config.join_timeout = remaining();
            // Deadlines are the watchdog's (see `WorldConfig::op_timeout`),
            // so the communicator itself never times an operation out.
            comm_config.op_timeout = None;
            comm_config.heartbeat_interval = Some(config.watchdog.heartbeat_interval);
            comm_config.eager_limit = config.read_ahead;
            let token = self.inner.root.child_token();
            match Communicator::join_with_token(comm_config, &rendezvous, token.child_token()).await {
                Ok(comm) => {
                    if host.is_none() {
                        // Best effort, bounded: see `stale_generation`. A
                        // slow store does not hold a join whose mesh is up.
                        let _ = tokio::time::timeout(
                            remaining().clamp(STALE_PROBE_MIN, FORMED_WRITE),
                            store.set(FORMED_KEY, Vec::new()),
                        )
                        .await;
                    }
                    #[cfg(feature = "nccl")]
                    let device = if config.backend == Backend::Nccl {
                        match crate::device::join(&self.inner.nccl, config, &store, deadline).await {
                            Ok(device) => Some(Arc::new(device)),
                            Err(reason) => {
                                comm.abort_with_reason("the world's NCCL communicator could not be set up");
                                return Err(WorldError::join_failed(name, reason));
                            }
                        }
                    } else {
                        None
                    };
                    opened.armed = false;
                    let shared = WorldShared::new(
                        Joined {
                            config: config.clone(),
                            comm: Arc::new(comm),
                            store,
                            store_addr,
                            host: host.clone(),
                        },
                        Attachments {
                            token,
                            events: self.inner.events.clone(),
                            registry: Arc::downgrade(&self.inner.registry),
                            metrics: Arc::clone(&self.inner.metrics),
                            flight_capacity: self.inner.config.flight_recorder_capacity,
                            flight_dir: self.inner.config.flight_recorder_dir.clone(),
                        },
                    );
                    #[cfg(feature = "nccl")]
                    if let Some(device) = device {
                        // A fresh world's slot is empty, so this cannot be refused.
                        let _ = shared.device.set(device);
                    }
                    return Ok(shared);
                }
                // We found the store of a generation that was being torn down
                // (a replacement member racing the teardown): look again.
                Err(_) if rendezvous.world_gone() && host.is_none() && !remaining().is_zero() => {
                    tracing::debug!(
                        world = %name,
                        "joined a generation that is gone; opening the store again"
                    );
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(e) => return Err(WorldError::join_failed(name, e)),
            }
        }
    }

    /// The world of that name, if this process is a member.
    pub fn world(&self, name: impl AsRef<str>) -> Option<World> {
        match self.inner.registry.get(name.as_ref()).as_deref() {
            Some(Slot::Member(shared)) => Some(World {
                shared: Arc::clone(shared),
            }),
            _ => None,
        }
    }

    /// Every world this process is in (or joining), sorted by name.
    pub fn worlds(&self) -> Vec<WorldInfo> {
        let mut out: Vec<WorldInfo> = self
            .inner
            .registry
            .iter()
            .map(|e| match e.value() {
                Slot::Joining { rank, size } => WorldInfo {
                    name: e.key().clone(),
                    generation: Generation(0),
                    rank: *rank,
                    size: *size,
                    state: WorldState::Joining,
                },
                Slot::Member(w) => WorldInfo {
                    name: w.name.clone(),
                    generation: w.generation,
                    rank: w.rank,
                    size: w.size,
                    state: w.state(),
                },
            })
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        out
    }

    /// Leaves a world: says goodbye to its members (whose side of the world
    /// then breaks), releases everything, and returns once it is removed.
    pub async fn leave(&self, name: impl AsRef<str>) -> Result<(), WorldError> {
        let name = name.as_ref();
        let world = self.world(name).ok_or_else(|| WorldError::NotJoined {
            world: name.to_string(),
        })?;
        world.shared.leave().await;
        Ok(())
    }

    /// Watchdogs that have not run for longer than `stall_after`, with how
    /// long (what the process monitor reports).
    pub fn stalled_watchdogs(&self) -> Vec<(WorldName, Duration)> {
        stalled_now(&self.inner)
    }

    /// Leaves every world, stops the stores this process hosts (their ports
    /// are free when it returns, even while world handles are still held),
    /// and stops the monitor. Joins in progress end with
    /// [`WorldError::ShutDown`], and joins fail afterwards.
    pub async fn shutdown(&self) {
        self.inner.closing.cancel();
        // Joins in progress see `closing` and end (at once, or by leaving the
        // world they just joined); a join whose future nobody polls keeps
        // its name reserved, so the wait for them is bounded.
        let give_up = Instant::now() + SHUTDOWN_JOIN_WAIT;
        loop {
            let names: Vec<WorldName> = self.inner.registry.iter().map(|e| e.key().clone()).collect();
            if names.is_empty() || Instant::now() >= give_up {
                break;
            }
            let mut joining = false;
            for name in names {
                if let Err(WorldError::NotJoined { .. }) = self.leave(&name).await {
                    joining = true;
                }
            }
            if joining {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        self.inner.root.cancel();
        let hosts = std::mem::take(&mut *self.inner.hosts.lock().await);
        for h in hosts {
            // Stopped even while world handles the application still holds
            // share it: every world of this manager has been left, and the
            // port must be free when shutdown returns.
            h.server.stop(Duration::from_secs(1)).await;
        }
    }
}

/// A watchdog runs at least once per heartbeat interval, so the process
/// monitor, which reports one that has not run for the manager's
/// `stall_after`, needs that to be at least two intervals: refuses a world
/// whose heartbeats are slower than that (it would be reported stuck while
/// healthy).
fn check_stall_after(config: &WorldConfig, stall_after: Duration) -> Result<(), ConfigError> {
    let interval = config.watchdog.heartbeat_interval;
    if stall_after < interval * 2 {
        return Err(ConfigError::Invalid {
            what: "heartbeat interval",
            value: format!("{interval:?}"),
            why: format!("must be at most half the manager's stall_after ({stall_after:?})"),
        });
    }
    Ok(())
}

/// The address this member's mesh listens on and publishes: the configured
/// one, else the address of this host's interface that reaches the store, so
/// members on other hosts can connect back (loopback when the store is on
/// loopback or cannot be resolved).
async fn mesh_host(config: &WorldConfig) -> IpAddr {
    if let Some(ip) = config.listen_host {
        return ip;
    }
    let store = tokio::net::lookup_host(config.store_addr.as_str())
        .await
        .ok()
        .and_then(|mut addrs| addrs.next());
    store
        .and_then(local_ip_towards)
        .unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST))
}

/// The local address the operating system would use to reach `peer` (a UDP
/// socket's `connect` picks the route and sends nothing); `None` when there
/// is no route. A loopback peer is reached over loopback; an unspecified one
/// (a store bound to every interface) tells nothing, so `None`.
pub(crate) fn local_ip_towards(peer: SocketAddr) -> Option<IpAddr> {
    let ip = peer.ip();
    if ip.is_loopback() {
        return Some(ip);
    }
    if ip.is_unspecified() {
        return None;
    }
    let bind: SocketAddr = if ip.is_ipv4() {
        (Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let socket = std::net::UdpSocket::bind(bind).ok()?;
    socket.connect(peer).ok()?;
    let local = socket.local_addr().ok()?.ip();
    (!local.is_unspecified()).then_some(local)
}

fn stalled_now(inner: &Inner) -> Vec<(WorldName, Duration)> {
    let worlds = inner
        .registry
        .iter()
        .filter_map(|e| match e.value() {
            Slot::Member(w) if w.state() == WorldState::Ready => Some((w.name.clone(), w.last_tick())),
            _ => None,
        })
        .collect::<Vec<_>>();
    stalled(Instant::now(), worlds, inner.config.stall_after)
}

/// The process monitor, on its own OS thread so that it keeps running when
/// the Tokio runtime the watchdogs live on is blocked (the very failure it
/// is there to notice): reports (once per episode) every watchdog that has
/// stopped ticking, as an error log line and a
/// [`WorldEvent::WatchdogStalled`], and logs when it recovers. Stops when the
/// manager is shut down or dropped.
fn monitor(inner: Weak<Inner>, stop: CancellationToken) {
    let mut reported: HashSet<WorldName> = HashSet::new();
    loop {
        let every = match inner.upgrade() {
            Some(i) => i.config.monitor_interval,
            None => return,
        };
        // Sleep in short steps so a dropped or shut down manager's thread
        // ends promptly.
        let wake = Instant::now() + every;
        loop {
            if stop.is_cancelled() || inner.strong_count() == 0 {
                return;
            }
            let left = wake.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            std::thread::sleep(left.min(MONITOR_POLL));
        }
        let Some(inner) = inner.upgrade() else {
            return;
        };
        let now_stalled = stalled_now(&inner);
        for (name, stuck) in &now_stalled {
            if reported.insert(name.clone()) {
                tracing::error!(world = %name, stuck_for = ?stuck, "the world's watchdog is not running");
                inner.metrics.watchdog_stalls.inc();
                let _ = inner.events.send(WorldEvent::WatchdogStalled {
                    world: name.clone(),
                    stuck_for: *stuck,
                });
            }
        }
        reported.retain(|name| {
            let still = now_stalled.iter().any(|(n, _)| n == name);
            if !still {
                tracing::info!(world = %name, "the world's watchdog is running again");
            }
            still
        });
    }
}

/// How often the monitor thread checks, while it waits, whether its manager
/// is gone.
const MONITOR_POLL: Duration = Duration::from_millis(50);

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn the_mesh_listens_where_the_store_is_reached_from() {
        let lo4: SocketAddr = "127.0.0.1:29500".parse().unwrap();
        assert_eq!(local_ip_towards(lo4), Some(lo4.ip()));
        let lo6: SocketAddr = "[::1]:29500".parse().unwrap();
        assert_eq!(local_ip_towards(lo6), Some(lo6.ip()));
        assert_eq!(local_ip_towards("0.0.0.0:29500".parse().unwrap()), None);
        // A routed address is reached from a real interface, never from an
        // unspecified one (where the machine has a route at all).
        if let Some(ip) = local_ip_towards("10.255.255.254:9".parse().unwrap()) {
            assert!(!ip.is_unspecified(), "{ip}");
        }
    }

    #[tokio::test]
    async fn a_world_whose_heartbeats_are_slower_than_half_the_stall_threshold_is_refused() {
        let mut c = WorldConfig::new("slow", 0, 1, "127.0.0.1:1").unwrap();
        let stall = ManagerConfig::default().stall_after;
        assert!(check_stall_after(&c, stall).is_ok(), "the defaults fit");
        c.watchdog.heartbeat_interval = stall / 2;
        c.watchdog.heartbeat_timeout = stall * 2;
        assert!(check_stall_after(&c, stall).is_ok(), "exactly half fits");
        c.watchdog.heartbeat_interval = stall;
        c.watchdog.heartbeat_timeout = stall * 3;
        assert!(c.validate().is_ok(), "valid for the world alone");
        let e = check_stall_after(&c, stall).unwrap_err().to_string();
        assert!(
            e.contains("stall_after") && e.contains("heartbeat interval"),
            "{e}"
        );
        // The manager refuses it before reaching for any store.
        let m = WorldManager::default();
        let e = m.join(c).await.unwrap_err();
        assert!(matches!(e, WorldError::Config(_)), "{e}");
        m.shutdown().await;
    }
}
