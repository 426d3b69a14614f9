//! The store server: one port hosting the tables of many worlds.
//!
//! Each open world is a [`Slot`] (name, generation, optional secret and its
//! [`WorldTable`] behind a `std::sync::Mutex`). The mutex is never held across
//! an `.await`: every handler locks, runs one table operation, unlocks, and
//! only then delivers the completions it got back, so a slow or frozen client
//! can never hold a world's lock. Worlds share nothing but the map that finds
//! them, so closing one leaves the others untouched.
//!
//! A waiting request (get, wait, multi-get) registers a oneshot sender in the
//! table and awaits it next to its deadline. If the request goes away first
//! (client deadline, client disconnect, process killed), hyper drops the
//! handler future and [`PendingWait`]'s `Drop` removes the waiter, so a client
//! that disconnects releases everything it held.
//!
//! Connections, request bodies and their memory are bounded before a request
//! reaches this service, by [`front`](crate::front); what a request may make
//! the server hold afterwards (waiters, reply sizes) is bounded here and in
//! the table.

use std::{
    collections::hash_map::DefaultHasher,
    hash::{Hash, Hasher},
    net::SocketAddr,
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use bytes::Bytes;
use dashmap::{DashMap, mapref::entry::Entry};
use multiworld_proto::store::v1::{self as pb, store_server};
use tokio::{net::TcpListener, sync::oneshot, task::JoinHandle};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, metadata::MetadataMap};

use multiworld_types::Secret;

use crate::{
    auth::{AUTH_METADATA, StoreProof, WORLD_METADATA, decode_world},
    error::{Limit, StoreError},
    front::{self, Budget, Connections},
    gate::LogLimiter,
    limits::{Limits, over},
    table::{ClientId, Completion, TableStats, WaitPoll, WaitResult, WaiterId, WorldTable},
};

type Waker = oneshot::Sender<WaitResult>;
type Table = WorldTable<Waker>;

/// How a server behaves. `Default` gives the documented defaults.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Bounds of worlds created without their own (default: [`Limits::default`]).
    pub limits: Limits,
    /// Largest request the gRPC layer decodes (default: derived from `limits`).
    pub max_message_bytes: usize,
    /// Most worlds open at once (default 4,096).
    pub max_worlds: usize,
    /// Longest world name in bytes (default 256).
    pub max_name_len: usize,
    /// Whether clients may create worlds with `Open { create: true }`
    /// (default false: only the hosting process opens worlds). A standalone
    /// server turns this on.
    pub allow_remote_create: bool,
    /// The secret of worlds created remotely, which the creating request must
    /// prove (default none). It is also the server's own secret: a request
    /// naming a world that is not open is judged against it, so without a
    /// valid proof it gets the same `unauthenticated` answer as a request for
    /// an open world with a secret, and world names cannot be enumerated.
    pub remote_create_secret: Option<Secret>,
    /// HTTP/2 keepalive ping interval, which also notices dead clients and
    /// releases their waits (default 1 s).
    pub keepalive_interval: Duration,
    /// How long an unanswered keepalive ping may stay unanswered (default 5 s).
    pub keepalive_timeout: Duration,
    /// Most client connections open at once (default 1,024). At the cap, a
    /// new connection evicts one that never sent a request (oldest first),
    /// else the one idle longest (no request in flight); if every connection
    /// has a request in flight, the new one is closed at once.
    pub max_connections: usize,
    /// Most concurrent requests (HTTP/2 streams) on one connection (default
    /// `limits.max_waiters_per_client + 64` = 1,088).
    pub max_streams_per_connection: u32,
    /// Most concurrent requests on one connection that are not tied to an
    /// authenticated world: `Open` of a world the server cannot judge, a
    /// world-less `Ping` (default 16). More are refused with
    /// `LimitExceeded { UnauthenticatedStreams }`.
    pub max_unauthenticated_streams: usize,
    /// Largest message of an `Open`, a world-less `Ping` or an unknown
    /// method, all of which are read before any proof is checked (default
    /// 4 KiB).
    pub max_unauthenticated_body_bytes: usize,
    /// Bytes of request bodies received and decoded at once, all connections
    /// together (default 64 MiB). Each request reserves twice its declared
    /// message size (the body and its decoded copy) once its 5-byte gRPC
    /// prefix has arrived, before the rest is buffered; the reservation ends
    /// when the handler has the decoded request, so waits hold none.
    pub max_buffered_request_bytes: usize,
    /// How long a request may wait for its reservation before it is refused
    /// with `LimitExceeded { RequestMemory }` (RESOURCE_EXHAUSTED) (default
    /// 1 s).
    pub request_memory_wait: Duration,
    /// How long a request's body may take to arrive once its headers have
    /// (default 10 s); then it is refused with `timeout` and its memory
    /// released. This bounds incomplete requests only, never the time the
    /// server takes to answer, so long-poll waits are unaffected.
    pub request_body_timeout: Duration,
    /// How long a new connection has to deliver its first complete request
    /// header (HTTP/2 preface and all) before it is closed (default 5 s).
    pub first_request_timeout: Duration,
    /// How long a connection may have no request in flight before it is
    /// closed with GOAWAY (default 120 s). Bytes and pings do not count, so a
    /// slowloris or an idle peer answering keepalives is closed too.
    pub idle_timeout: Duration,
    /// HTTP/2 initial stream window (default 64 KiB): the most of one
    /// request body a client can push before the server reads it.
    pub initial_stream_window_bytes: u32,
    /// HTTP/2 initial connection window (default 256 KiB): the same for all
    /// streams of one connection together.
    pub initial_connection_window_bytes: u32,
    /// Largest request header block (default 16 KiB).
    pub max_header_list_bytes: u32,
    /// Most pending waits on the server, all worlds together (default
    /// 16,384); more are refused with `LimitExceeded { Waiters }`.
    pub max_waiters: usize,
    /// Whether binding raises the process's open-file soft limit to its hard
    /// limit, so the connection cap rather than the fd limit is what binds
    /// (default true; a failure is logged and ignored).
    pub raise_fd_limit: bool,
}

impl Default for ServerConfig {
    fn default() -> Self {
        let limits = Limits::default();
        ServerConfig {
            max_message_bytes: limits.max_message_bytes(),
            limits: limits.clone(),
            max_worlds: 4096,
            max_name_len: 256,
            allow_remote_create: false,
            remote_create_secret: None,
            keepalive_interval: Duration::from_secs(1),
            keepalive_timeout: Duration::from_secs(5),
            max_connections: 1024,
            max_streams_per_connection: (limits.max_waiters_per_client as u32).saturating_add(64),
            max_unauthenticated_streams: 16,
            max_unauthenticated_body_bytes: 4096,
            max_buffered_request_bytes: 64 << 20,
            request_memory_wait: Duration::from_secs(1),
            request_body_timeout: Duration::from_secs(10),
            first_request_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(120),
            initial_stream_window_bytes: 64 << 10,
            initial_connection_window_bytes: 256 << 10,
            max_header_list_bytes: 16 << 10,
            max_waiters: 16_384,
            raise_fd_limit: true,
        }
    }
}

/// Options of one world's store.
#[derive(Debug, Clone, Default)]
pub struct WorldOptions {
    /// The world's shared secret; requests must prove it.
    pub secret: Option<Secret>,
    /// Bounds for this world (default: the server's).
    pub limits: Option<Limits>,
}

/// Counters of one open world's store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorldStats {
    /// The open generation.
    pub generation: u64,
    /// The table's counters.
    pub table: TableStats,
}

/// Counters of a whole server, for tests and monitoring.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ServerStats {
    /// Client connections open now.
    pub connections: usize,
    /// Connections closed at once because every place was busy.
    pub refused_connections: u64,
    /// Idle connections closed to make room for new ones.
    pub evicted_connections: u64,
    /// Requests answered with an error before they reached a world (refused
    /// from their headers, over a pre-authentication bound, out of request
    /// memory, body too slow).
    pub refused_requests: u64,
    /// Bytes of request memory reserved now (see
    /// [`ServerConfig::max_buffered_request_bytes`]).
    pub buffered_request_bytes: usize,
    /// Pending waits, all worlds together.
    pub waiters: usize,
}

/// One open generation of one world.
pub(crate) struct Slot {
    name: String,
    generation: u64,
    pub(crate) secret: Option<Secret>,
    table: Mutex<Table>,
}

impl Slot {
    /// Locks the table. A poisoned lock (a panic while holding it, which the
    /// table's operations do not do) still yields the table.
    fn lock(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn close(&self) {
        let done = self.lock().close();
        deliver(done);
    }
}

fn deliver(done: Vec<Completion<Waker>>) {
    for c in done {
        // The receiver is gone if its request was dropped; nothing to do.
        let _ = c.token.send(c.result);
    }
}

pub(crate) struct Shared {
    pub(crate) config: ServerConfig,
    pub(crate) worlds: DashMap<String, Arc<Slot>>,
    next_generation: AtomicU64,
    pub(crate) connections: Connections,
    pub(crate) budget: Arc<Budget>,
    /// Pending waits, all worlds together.
    waiters: AtomicUsize,
    pub(crate) refused_requests: AtomicU64,
    /// Rate limit of the WARN lines for refused requests.
    pub(crate) auth_log: LogLimiter,
    /// Rate limit of the WARN lines for refused connections and accept errors.
    pub(crate) connection_log: LogLimiter,
}

/// How often a flood of refusals may log a line.
const LOG_INTERVAL: Duration = Duration::from_secs(5);

impl Shared {
    fn new(config: ServerConfig) -> Shared {
        // Generations are unique per server and, being seeded from the clock,
        // also across restarts of a server on the same port.
        let seed = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(1, |d| d.as_micros() as u64);
        Shared {
            budget: Arc::new(Budget::new(config.max_buffered_request_bytes)),
            config,
            worlds: DashMap::new(),
            next_generation: AtomicU64::new(seed.max(1)),
            connections: Connections::default(),
            waiters: AtomicUsize::new(0),
            refused_requests: AtomicU64::new(0),
            auth_log: LogLimiter::new(LOG_INTERVAL),
            connection_log: LogLimiter::new(LOG_INTERVAL),
        }
    }

    fn check_name(&self, name: &str) -> Result<(), StoreError> {
        if name.is_empty() {
            return Err(StoreError::InvalidArgument("empty world name".into()));
        }
        over(Limit::NameLen, self.config.max_name_len, name.len())
    }

    fn open(&self, name: &str, options: WorldOptions) -> Result<u64, StoreError> {
        self.check_name(name)?;
        let len = self.worlds.len();
        match self.worlds.entry(name.to_string()) {
            Entry::Occupied(e) => Err(StoreError::AlreadyOpen {
                world: name.to_string(),
                generation: e.get().generation,
            }),
            Entry::Vacant(e) => {
                over(Limit::Worlds, self.config.max_worlds, len + 1)?;
                let generation = self.next_generation.fetch_add(1, Ordering::Relaxed);
                let limits = options.limits.unwrap_or_else(|| self.config.limits.clone());
                e.insert(Arc::new(Slot {
                    name: name.to_string(),
                    generation,
                    secret: options.secret,
                    table: Mutex::new(WorldTable::new(name, limits)),
                }));
                tracing::debug!(world = name, generation, "world store opened");
                Ok(generation)
            }
        }
    }

    /// Closes `name` (only the given generation, if one is given).
    fn close(&self, name: &str, generation: Option<u64>) -> bool {
        let removed = self
            .worlds
            .remove_if(name, |_, slot| generation.is_none_or(|g| g == slot.generation));
        match removed {
            Some((_, slot)) => {
                slot.close();
                tracing::debug!(world = name, generation = slot.generation, "world store closed");
                true
            }
            None => false,
        }
    }

    fn close_all(&self) {
        let names: Vec<String> = self.worlds.iter().map(|e| e.key().clone()).collect();
        for name in names {
            self.close(&name, None);
        }
    }

    /// Finds the open slot a request names and checks its proof first (so a
    /// stranger learns nothing about generations), then its generation.
    fn resolve(&self, world: Option<pb::WorldRef>, meta: &MetadataMap) -> Result<Arc<Slot>, Status> {
        let world = world.ok_or_else(|| StoreError::InvalidArgument("no world given".into()))?;
        self.check_world_header(&world.name, meta)?;
        let slot = self
            .worlds
            .get(&world.name)
            .map(|e| Arc::clone(e.value()))
            .ok_or_else(|| StoreError::WorldNotFound {
                world: world.name.clone(),
            })?;
        self.authenticate(&slot.name, slot.secret.as_ref(), meta)?;
        if slot.generation != world.generation {
            return Err(StoreError::StaleGeneration {
                world: world.name,
                requested: world.generation,
                current: Some(slot.generation),
            }
            .into());
        }
        Ok(slot)
    }

    /// The front admitted the request for the world named in `mw-world`;
    /// the body must name the same one.
    fn check_world_header(&self, name: &str, meta: &MetadataMap) -> Result<(), StoreError> {
        let header = meta
            .get(WORLD_METADATA)
            .map(|v| decode_world(v.as_bytes(), self.config.max_name_len));
        match header {
            Some(Ok(h)) if h == name => Ok(()),
            _ => Err(StoreError::InvalidArgument(
                "the mw-world metadata entry does not name the request's world".into(),
            )),
        }
    }

    /// Checks a request's proof (again: the front checked it from the
    /// headers, but the world may have been replaced since). Refusals are
    /// logged at most once per interval.
    fn authenticate(
        &self,
        world: &str,
        secret: Option<&Secret>,
        meta: &MetadataMap,
    ) -> Result<(), StoreError> {
        let Some(secret) = secret else {
            return Ok(());
        };
        let proof = meta.get(AUTH_METADATA).and_then(|v| v.to_str().ok());
        secret.verify(world, proof).map_err(|reason| {
            if let Some(held_back) = self.auth_log.admit(Instant::now()) {
                tracing::warn!(
                    world,
                    reason,
                    held_back,
                    "refused an unauthenticated store request"
                );
            }
            StoreError::Unauthenticated {
                world: world.to_string(),
                reason: reason.to_string(),
            }
        })
    }

    /// Takes one of the server's waiter places, or refuses.
    fn take_waiter(&self) -> Result<WaiterPlace<'_>, StoreError> {
        let n = self.waiters.fetch_add(1, Ordering::AcqRel) + 1;
        let place = WaiterPlace(&self.waiters);
        over(Limit::Waiters, self.config.max_waiters, n)?;
        Ok(place)
    }
}

/// One of the server's waiter places; dropping it gives it back.
struct WaiterPlace<'a>(&'a AtomicUsize);

impl Drop for WaiterPlace<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

fn client_id<T>(request: &Request<T>) -> ClientId {
    let mut h = DefaultHasher::new();
    request.remote_addr().hash(&mut h);
    ClientId(h.finish())
}

/// A registered wait; dropping it before it completed removes the waiter.
struct PendingWait<'a> {
    slot: &'a Slot,
    id: WaiterId,
    done: bool,
}

impl Drop for PendingWait<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.slot.lock().cancel(self.id);
        }
    }
}

async fn wait_on(
    shared: &Shared,
    slot: &Slot,
    client: ClientId,
    keys: Vec<Bytes>,
    want_values: bool,
    timeout_ms: u64,
) -> WaitResult {
    let (tx, mut rx) = oneshot::channel();
    let now = Instant::now();
    let (id, _place, timeout) = {
        let mut table = slot.lock();
        let timeout = table.limits().timeout(timeout_ms);
        match table.wait(client, keys, want_values, now, timeout, tx)? {
            WaitPoll::Ready(values, _) => return Ok(values),
            // Only a wait that stays pending takes one of the server's places.
            WaitPoll::Pending(id) => match shared.take_waiter() {
                Ok(place) => (id, place, timeout),
                Err(e) => {
                    table.cancel(id);
                    return Err(e);
                }
            },
        }
    };
    let mut pending = PendingWait {
        slot,
        id,
        done: false,
    };
    let mut deadline = tokio::time::Instant::from_std(now) + timeout;
    loop {
        tokio::select! {
            result = &mut rx => {
                pending.done = true;
                // The sender is only dropped by delivering through it, so a
                // closed channel means the table went away with the world.
                return result.unwrap_or_else(|_| Err(StoreError::Closed { world: slot.name.clone() }));
            }
            _ = tokio::time::sleep_until(deadline) => {
                let done = slot.lock().expire(Instant::now());
                deliver(done);
                // Normally our own waiter was among them; if the clocks
                // disagreed by a hair, look again shortly.
                deadline = tokio::time::Instant::now() + Duration::from_millis(1);
            }
        }
    }
}

/// The gRPC service over the shared state.
struct Service {
    shared: Arc<Shared>,
}

impl Service {
    /// Runs one non-waiting table operation and delivers what it completed.
    fn with_table<T>(
        &self,
        world: Option<pb::WorldRef>,
        meta: &MetadataMap,
        op: impl FnOnce(&mut Table) -> Result<(T, Vec<Completion<Waker>>), StoreError>,
    ) -> Result<T, Status> {
        let slot = self.shared.resolve(world, meta)?;
        let (out, done) = op(&mut slot.lock())?;
        deliver(done);
        Ok(out)
    }

    async fn wait<T>(
        &self,
        request: Request<T>,
        world: impl FnOnce(&T) -> Option<pb::WorldRef>,
        keys: impl FnOnce(T) -> (Vec<Bytes>, u64),
        want_values: bool,
    ) -> Result<Vec<Bytes>, Status> {
        let client = client_id(&request);
        let slot = self
            .shared
            .resolve(world(request.get_ref()), request.metadata())?;
        let (keys, timeout_ms) = keys(request.into_inner());
        Ok(wait_on(&self.shared, &slot, client, keys, want_values, timeout_ms).await?)
    }
}

fn ok<T>(value: T) -> Result<Response<T>, Status> {
    Ok(Response::new(value))
}

#[tonic::async_trait]
impl store_server::Store for Service {
    async fn open(&self, request: Request<pb::OpenRequest>) -> Result<Response<pb::OpenResponse>, Status> {
        let shared = &self.shared;
        let req = request.get_ref();
        shared.check_name(&req.name)?;
        shared.check_world_header(&req.name, request.metadata())?;
        let existing = shared.worlds.get(&req.name).map(|e| Arc::clone(e.value()));
        let generation = match existing {
            Some(slot) => {
                shared.authenticate(&slot.name, slot.secret.as_ref(), request.metadata())?;
                slot.generation
            }
            None if req.create && shared.config.allow_remote_create => {
                let secret = shared.config.remote_create_secret.clone();
                shared.authenticate(&req.name, secret.as_ref(), request.metadata())?;
                match shared.open(&req.name, WorldOptions { secret, limits: None }) {
                    Ok(g) => g,
                    // Another client created it in between: attach to it.
                    Err(StoreError::AlreadyOpen { generation, .. }) => generation,
                    Err(e) => return Err(e.into()),
                }
            }
            None => {
                return Err(StoreError::WorldNotFound {
                    world: req.name.clone(),
                }
                .into());
            }
        };
        ok(pb::OpenResponse { generation })
    }

    async fn close(&self, request: Request<pb::CloseRequest>) -> Result<Response<pb::CloseResponse>, Status> {
        let world = request.get_ref().world.clone();
        let slot = self.shared.resolve(world, request.metadata())?;
        let closed = self.shared.close(&slot.name, Some(slot.generation));
        ok(pb::CloseResponse { closed })
    }

    async fn set(&self, request: Request<pb::SetRequest>) -> Result<Response<pb::SetResponse>, Status> {
        let (meta, _, req) = request.into_parts();
        self.with_table(req.world, &meta, |t| Ok(((), t.set(req.key, req.value)?)))?;
        ok(pb::SetResponse {})
    }

    async fn get(&self, request: Request<pb::GetRequest>) -> Result<Response<pb::GetResponse>, Status> {
        let values = self
            .wait(
                request,
                |r| r.world.clone(),
                |r| (vec![r.key], r.timeout_ms),
                true,
            )
            .await?;
        let value = values
            .into_iter()
            .next()
            .ok_or_else(|| Status::internal("a satisfied get returned no value"))?;
        ok(pb::GetResponse { value })
    }

    async fn try_get(
        &self,
        request: Request<pb::TryGetRequest>,
    ) -> Result<Response<pb::TryGetResponse>, Status> {
        let (meta, _, req) = request.into_parts();
        let value = self.with_table(req.world, &meta, |t| Ok((t.try_get(&req.key)?, Vec::new())))?;
        ok(pb::TryGetResponse { value })
    }

    async fn add(&self, request: Request<pb::AddRequest>) -> Result<Response<pb::AddResponse>, Status> {
        let (meta, _, req) = request.into_parts();
        let value = self.with_table(req.world, &meta, |t| t.add(req.key, req.delta))?;
        ok(pb::AddResponse { value })
    }

    async fn compare_and_set(
        &self,
        request: Request<pb::CompareAndSetRequest>,
    ) -> Result<Response<pb::CompareAndSetResponse>, Status> {
        let (meta, _, req) = request.into_parts();
        let outcome = self.with_table(req.world, &meta, |t| {
            t.compare_and_set(req.key, req.expected.as_deref(), req.desired)
        })?;
        ok(pb::CompareAndSetResponse {
            swapped: outcome.swapped,
            current: outcome.current,
        })
    }

    async fn wait(&self, request: Request<pb::WaitRequest>) -> Result<Response<pb::WaitResponse>, Status> {
        Service::wait(
            self,
            request,
            |r| r.world.clone(),
            |r| (r.keys, r.timeout_ms),
            false,
        )
        .await?;
        ok(pb::WaitResponse {})
    }

    async fn check(&self, request: Request<pb::CheckRequest>) -> Result<Response<pb::CheckResponse>, Status> {
        let (meta, _, req) = request.into_parts();
        let all_present = self.with_table(req.world, &meta, |t| Ok((t.check(&req.keys)?, Vec::new())))?;
        ok(pb::CheckResponse { all_present })
    }

    async fn delete(
        &self,
        request: Request<pb::DeleteRequest>,
    ) -> Result<Response<pb::DeleteResponse>, Status> {
        let (meta, _, req) = request.into_parts();
        let existed = self.with_table(req.world, &meta, |t| Ok((t.delete(&req.key)?, Vec::new())))?;
        ok(pb::DeleteResponse { existed })
    }

    async fn multi_get(
        &self,
        request: Request<pb::MultiGetRequest>,
    ) -> Result<Response<pb::MultiGetResponse>, Status> {
        let values = self
            .wait(request, |r| r.world.clone(), |r| (r.keys, r.timeout_ms), true)
            .await?;
        ok(pb::MultiGetResponse { values })
    }

    async fn multi_set(
        &self,
        request: Request<pb::MultiSetRequest>,
    ) -> Result<Response<pb::MultiSetResponse>, Status> {
        let (meta, _, req) = request.into_parts();
        let entries = req.entries.into_iter().map(|kv| (kv.key, kv.value)).collect();
        self.with_table(req.world, &meta, |t| Ok(((), t.multi_set(entries)?)))?;
        ok(pb::MultiSetResponse {})
    }

    async fn append(
        &self,
        request: Request<pb::AppendRequest>,
    ) -> Result<Response<pb::AppendResponse>, Status> {
        let (meta, _, req) = request.into_parts();
        let length = self.with_table(req.world, &meta, |t| t.append(req.key, &req.value))?;
        ok(pb::AppendResponse {
            length: length as u64,
        })
    }

    async fn num_keys(
        &self,
        request: Request<pb::NumKeysRequest>,
    ) -> Result<Response<pb::NumKeysResponse>, Status> {
        let (meta, _, req) = request.into_parts();
        let count = self.with_table(req.world, &meta, |t| Ok((t.num_keys()?, Vec::new())))?;
        ok(pb::NumKeysResponse { count: count as u64 })
    }

    async fn ping(&self, request: Request<pb::PingRequest>) -> Result<Response<pb::PingResponse>, Status> {
        let (meta, _, req) = request.into_parts();
        if req.world.is_some() {
            self.shared.resolve(req.world, &meta)?;
        }
        let server_time_us = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64);
        ok(pb::PingResponse { server_time_us })
    }
}

/// A running store server. Dropping it closes every world it hosts (waking
/// their waiters with `Closed`) and stops accepting; [`shutdown`] does the
/// same and waits for the connections to drain.
///
/// [`shutdown`]: StoreServer::shutdown
pub struct StoreServer {
    shared: Arc<Shared>,
    local_addr: SocketAddr,
    stop: CancellationToken,
    kill: CancellationToken,
    /// The accept loop; taken by the first `stop`.
    task: std::sync::Mutex<Option<JoinHandle<()>>>,
}

impl StoreServer {
    /// Binds `addr` (port 0 picks a free port) and starts serving.
    pub async fn bind(addr: SocketAddr, config: ServerConfig) -> Result<StoreServer, StoreError> {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|e| StoreError::Unavailable {
                addr: addr.to_string(),
                reason: format!("cannot bind: {e}"),
            })?;
        StoreServer::serve(listener, config)
    }

    /// Serves on an already bound listener.
    pub fn serve(listener: TcpListener, config: ServerConfig) -> Result<StoreServer, StoreError> {
        let local_addr = listener.local_addr().map_err(|e| StoreError::Unavailable {
            addr: "listener".into(),
            reason: e.to_string(),
        })?;
        if config.raise_fd_limit {
            raise_fd_limit();
        }
        let shared = Arc::new(Shared::new(config));
        let service = store_server::StoreServer::new(Service {
            shared: Arc::clone(&shared),
        })
        .max_decoding_message_size(shared.config.max_message_bytes)
        .max_encoding_message_size(shared.config.max_message_bytes.saturating_mul(2));
        let stop = CancellationToken::new();
        let kill = CancellationToken::new();
        let task = tokio::spawn(front::accept_loop(
            listener,
            Arc::clone(&shared),
            service,
            stop.clone(),
            kill.clone(),
        ));
        tracing::info!(%local_addr, "store server listening");
        Ok(StoreServer {
            shared,
            local_addr,
            stop,
            kill,
            task: std::sync::Mutex::new(Some(task)),
        })
    }

    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Opens a world's store here and returns its generation. Fails with
    /// `AlreadyOpen` if the name is open: close it first to start a new
    /// generation.
    pub fn open_world(&self, name: &str, options: WorldOptions) -> Result<u64, StoreError> {
        self.shared.open(name, options)
    }

    /// Closes a world's store: its waiters fail with `Closed` at once, its
    /// memory is released, and the name can be opened again as a new
    /// generation. Returns whether it was open.
    pub fn close_world(&self, name: &str) -> bool {
        self.shared.close(name, None)
    }

    /// Closes one generation of a world's store (see [`close_world`]); does
    /// nothing if another generation is open under that name.
    ///
    /// [`close_world`]: StoreServer::close_world
    pub fn close_world_generation(&self, name: &str, generation: u64) -> bool {
        self.shared.close(name, Some(generation))
    }

    /// Counters of an open world's store.
    pub fn world_stats(&self, name: &str) -> Option<WorldStats> {
        let slot = self.shared.worlds.get(name).map(|e| Arc::clone(e.value()))?;
        let table = slot.lock().stats();
        Some(WorldStats {
            generation: slot.generation,
            table,
        })
    }

    /// Counters of the whole server.
    pub fn stats(&self) -> ServerStats {
        let s = &self.shared;
        ServerStats {
            connections: s.connections.count(),
            refused_connections: s.connections.refused.load(Ordering::Relaxed),
            evicted_connections: s.connections.evicted.load(Ordering::Relaxed),
            refused_requests: s.refused_requests.load(Ordering::Relaxed),
            buffered_request_bytes: s.budget.in_use(),
            waiters: s.waiters.load(Ordering::Acquire),
        }
    }

    /// Names of the open worlds.
    pub fn worlds(&self) -> Vec<String> {
        self.shared.worlds.iter().map(|e| e.key().clone()).collect()
    }

    /// Closes every world, stops accepting, and waits (at most `grace`) for
    /// open connections to finish.
    pub async fn shutdown(self, grace: Duration) {
        self.stop(grace).await;
    }

    /// [`StoreServer::shutdown`] through a shared reference (for a server
    /// that others still hold): when it returns, the listening port is free
    /// and every connection is closed. Later calls return at once.
    pub async fn stop(&self, grace: Duration) {
        self.shared.close_all();
        self.stop.cancel();
        let task = self
            .task
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        if let Some(mut task) = task {
            if tokio::time::timeout(grace, &mut task).await.is_err() {
                tracing::warn!(addr = %self.local_addr, "store connections did not drain in time; aborting");
                self.kill.cancel();
                task.abort();
            }
        }
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.shared.close_all();
        self.stop.cancel();
    }
}

/// Raises the open-file soft limit to the hard limit, so that the connection
/// cap, not the fd limit, is what bounds connections (at the fd limit every
/// new client would fail, the store's own files included). Where the hard
/// limit cannot be read or set, nothing changes and the reason is logged.
fn raise_fd_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => tracing::debug!(from = soft, to = hard, "raised the open-file limit"),
            Err(e) => tracing::info!(soft, hard, error = %e, "could not raise the open-file limit"),
        },
        Ok(_) => {}
        Err(e) => tracing::info!(error = %e, "could not read the open-file limit"),
    }
}
