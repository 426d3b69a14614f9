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
use tonic::{Request, Response, Status};

use multiworld_types::Secret;

use crate::{
    auth::{AUTH_METADATA, StoreProof, WORLD_METADATA, decode_world},
    error::{Limit, StoreError},
    framed::{self, Method},
    front::{self, Budget, Connections, Reservation},
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
    /// Largest request message decoded, gRPC or framed (default: derived
    /// from `limits`).
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
    /// Keepalive ping interval, HTTP/2 or framed, which also notices dead or
    /// frozen clients and releases their waits (default 1 s). A framed
    /// connection is pinged only when nothing arrived for this long.
    pub keepalive_interval: Duration,
    /// How long an unanswered keepalive ping may stay unanswered (default
    /// 5 s; on a framed connection, any byte arriving counts as an answer).
    pub keepalive_timeout: Duration,
    /// Most client connections open at once (default 1,024). At the cap, a
    /// new connection evicts one that never sent a request (oldest first),
    /// else the one idle longest (no request in flight), else the oldest
    /// whose every request in flight is a pre-authentication one (a
    /// world-less `Ping`, an `Open` the server cannot judge); if every
    /// connection has an admitted request in flight, the new one is closed
    /// at once.
    pub max_connections: usize,
    /// Most concurrent requests (HTTP/2 streams) on one connection; on a
    /// framed connection, most waiting requests (get, wait, multi-get) at
    /// once, more refused with `LimitExceeded { ConnectionRequests }`
    /// (default `limits.max_waiters_per_client + 64` = 1,088).
    pub max_streams_per_connection: u32,
    /// Most concurrent requests on one connection that are not tied to an
    /// authenticated world: `Open` of a world the server cannot judge, a
    /// world-less `Ping` (default 16). More are refused with
    /// `LimitExceeded { UnauthenticatedStreams }`. (A framed connection runs
    /// such requests one at a time.)
    pub max_unauthenticated_streams: usize,
    /// Largest message of an `Open`, which is read before any proof is
    /// checked (default 4 KiB). A request that names no world (a world-less
    /// `Ping`, an unknown method) is held to the smaller of this and 64
    /// bytes.
    pub max_unauthenticated_body_bytes: usize,
    /// Bytes of request bodies received and decoded at once, all connections
    /// together (default 64 MiB). Each request reserves twice its declared
    /// message size (the body and its decoded copy) once its 5-byte gRPC
    /// prefix (or its framed head) has arrived, before the rest is
    /// buffered; the reservation ends
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
    /// header (HTTP/2 preface and all; the framed preface and a request's
    /// frame header) before it is closed (default 5 s).
    pub first_request_timeout: Duration,
    /// How long a connection may have no request in flight before it is
    /// closed with GOAWAY (HTTP/2's, or the framed protocol's `GoAway`:
    /// clients send a request that raced the close again) (default 120 s).
    /// Bytes and pings do not count, so a slowloris or an idle peer
    /// answering keepalives is closed too.
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
    /// Held while a world is opened, so that concurrent opens of different
    /// names cannot together pass `max_worlds` (each counted the worlds
    /// before the others inserted theirs).
    opening: Mutex<()>,
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
            opening: Mutex::new(()),
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
        let _opening = self.opening.lock().unwrap_or_else(|e| e.into_inner());
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
    fn resolve(&self, world: Option<pb::WorldRef>, caller: &Caller) -> Result<Arc<Slot>, StoreError> {
        let world = world.ok_or_else(|| StoreError::InvalidArgument("no world given".into()))?;
        self.check_world_header(&world.name, caller)?;
        let slot = self
            .worlds
            .get(&world.name)
            .map(|e| Arc::clone(e.value()))
            .ok_or_else(|| StoreError::WorldNotFound {
                world: world.name.clone(),
            })?;
        self.authenticate(&slot.name, slot.secret.as_ref(), caller)?;
        if slot.generation != world.generation {
            return Err(StoreError::StaleGeneration {
                world: world.name,
                requested: world.generation,
                current: Some(slot.generation),
            });
        }
        Ok(slot)
    }

    /// The front admitted the request for the world its header names (the
    /// `mw-world` entry, or the framed request's head); the body must name
    /// the same one.
    fn check_world_header(&self, name: &str, caller: &Caller) -> Result<(), StoreError> {
        if caller.world.as_deref() == Some(name) {
            return Ok(());
        }
        Err(StoreError::InvalidArgument(
            "the request's header does not name the world of its body".into(),
        ))
    }

    /// Checks a request's proof (again: the front checked it from the
    /// headers, but the world may have been replaced since). Refusals are
    /// logged at most once per interval.
    fn authenticate(&self, world: &str, secret: Option<&Secret>, caller: &Caller) -> Result<(), StoreError> {
        let Some(secret) = secret else {
            return Ok(());
        };
        secret.verify(world, caller.proof.as_deref()).map_err(|reason| {
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

/// Refuses to open a world kept without a secret to a caller that holds one
/// (its request carries a proof): such a member expects a world that only
/// holders of its secret can read and write, and this one anyone can. It
/// happens on a server without a secret of its own that creates worlds for
/// its clients (`m8d store` without `--secret-file`), which cannot learn a
/// member's secret from its proof, and when a stranger created the name
/// first. Refused rather than opened silently, so the member fails its join
/// with the reason instead of using a public world.
fn refuse_unsecured(world: &str, unsecured: bool, caller: &Caller) -> Result<(), StoreError> {
    if unsecured && caller.proof.is_some() {
        return Err(StoreError::Unauthenticated {
            world: world.to_string(),
            reason: "the store keeps this world without a secret, so anyone can read and write it, \
                     but this member holds one: give the store a secret of its own \
                     (m8d store --secret-file FILE, or --secret-env with MULTIWORLD_SECRET set), \
                     or join without one"
                .to_string(),
        });
    }
    Ok(())
}

/// Who sent a request, as either front tells it: the world its header
/// names, its proof, and its connection.
#[derive(Debug, Clone)]
pub(crate) struct Caller {
    /// The world named outside the body (`mw-world`, or the framed head).
    pub(crate) world: Option<String>,
    /// The proof (`mw-auth`, or the framed head's).
    pub(crate) proof: Option<String>,
    /// The connection, for the table's per-client bounds.
    pub(crate) client: ClientId,
}

impl Caller {
    /// The caller of a gRPC request, from its metadata and connection.
    fn of<T>(request: &Request<T>, max_name_len: usize) -> Caller {
        let meta = request.metadata();
        Caller {
            world: meta
                .get(WORLD_METADATA)
                .and_then(|v| decode_world(v.as_bytes(), max_name_len).ok()),
            proof: meta
                .get(AUTH_METADATA)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string),
            client: client_id(request.remote_addr()),
        }
    }
}

/// The table's name for the client behind a connection.
pub(crate) fn client_id(remote: Option<SocketAddr>) -> ClientId {
    let mut h = DefaultHasher::new();
    remote.hash(&mut h);
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

/// The store's operations, once for both fronts: each takes the caller and
/// the decoded request and gives the response or a [`StoreError`]. The gRPC
/// service and the framed protocol's dispatch ([`Shared::dispatch`]) only
/// translate.
impl Shared {
    /// Runs one non-waiting table operation and delivers what it completed.
    fn with_table<T>(
        &self,
        world: Option<pb::WorldRef>,
        caller: &Caller,
        op: impl FnOnce(&mut Table) -> Result<(T, Vec<Completion<Waker>>), StoreError>,
    ) -> Result<T, StoreError> {
        let slot = self.resolve(world, caller)?;
        let (out, done) = op(&mut slot.lock())?;
        deliver(done);
        Ok(out)
    }

    async fn wait_keys(
        &self,
        world: Option<pb::WorldRef>,
        caller: &Caller,
        keys: Vec<Bytes>,
        timeout_ms: u64,
        want_values: bool,
    ) -> Result<Vec<Bytes>, StoreError> {
        let slot = self.resolve(world, caller)?;
        wait_on(self, &slot, caller.client, keys, want_values, timeout_ms).await
    }

    fn op_open(&self, caller: &Caller, req: pb::OpenRequest) -> Result<pb::OpenResponse, StoreError> {
        self.check_name(&req.name)?;
        self.check_world_header(&req.name, caller)?;
        let existing = self.worlds.get(&req.name).map(|e| Arc::clone(e.value()));
        let generation = match existing {
            Some(slot) => {
                self.authenticate(&slot.name, slot.secret.as_ref(), caller)?;
                refuse_unsecured(&req.name, slot.secret.is_none(), caller)?;
                slot.generation
            }
            None if req.create && self.config.allow_remote_create => {
                let secret = self.config.remote_create_secret.clone();
                self.authenticate(&req.name, secret.as_ref(), caller)?;
                refuse_unsecured(&req.name, secret.is_none(), caller)?;
                match self.open(&req.name, WorldOptions { secret, limits: None }) {
                    Ok(g) => g,
                    // Another client created it in between: attach to it.
                    Err(StoreError::AlreadyOpen { generation, .. }) => generation,
                    Err(e) => return Err(e),
                }
            }
            None => return Err(StoreError::WorldNotFound { world: req.name }),
        };
        Ok(pb::OpenResponse { generation })
    }

    fn op_close(&self, caller: &Caller, req: pb::CloseRequest) -> Result<pb::CloseResponse, StoreError> {
        let slot = self.resolve(req.world, caller)?;
        let closed = self.close(&slot.name, Some(slot.generation));
        Ok(pb::CloseResponse { closed })
    }

    fn op_set(&self, caller: &Caller, req: pb::SetRequest) -> Result<pb::SetResponse, StoreError> {
        self.with_table(req.world, caller, |t| Ok(((), t.set(req.key, req.value)?)))?;
        Ok(pb::SetResponse {})
    }

    async fn op_get(&self, caller: &Caller, req: pb::GetRequest) -> Result<pb::GetResponse, StoreError> {
        let values = self
            .wait_keys(req.world, caller, vec![req.key], req.timeout_ms, true)
            .await?;
        let value = values
            .into_iter()
            .next()
            .ok_or_else(|| StoreError::Protocol("a satisfied get returned no value".into()))?;
        Ok(pb::GetResponse { value })
    }

    fn op_try_get(&self, caller: &Caller, req: pb::TryGetRequest) -> Result<pb::TryGetResponse, StoreError> {
        let value = self.with_table(req.world, caller, |t| Ok((t.try_get(&req.key)?, Vec::new())))?;
        Ok(pb::TryGetResponse { value })
    }

    fn op_add(&self, caller: &Caller, req: pb::AddRequest) -> Result<pb::AddResponse, StoreError> {
        let value = self.with_table(req.world, caller, |t| t.add(req.key, req.delta))?;
        Ok(pb::AddResponse { value })
    }

    fn op_compare_and_set(
        &self,
        caller: &Caller,
        req: pb::CompareAndSetRequest,
    ) -> Result<pb::CompareAndSetResponse, StoreError> {
        let outcome = self.with_table(req.world, caller, |t| {
            t.compare_and_set(req.key, req.expected.as_deref(), req.desired)
        })?;
        Ok(pb::CompareAndSetResponse {
            swapped: outcome.swapped,
            current: outcome.current,
        })
    }

    async fn op_wait(&self, caller: &Caller, req: pb::WaitRequest) -> Result<pb::WaitResponse, StoreError> {
        self.wait_keys(req.world, caller, req.keys, req.timeout_ms, false)
            .await?;
        Ok(pb::WaitResponse {})
    }

    fn op_check(&self, caller: &Caller, req: pb::CheckRequest) -> Result<pb::CheckResponse, StoreError> {
        let all_present = self.with_table(req.world, caller, |t| Ok((t.check(&req.keys)?, Vec::new())))?;
        Ok(pb::CheckResponse { all_present })
    }

    fn op_delete(&self, caller: &Caller, req: pb::DeleteRequest) -> Result<pb::DeleteResponse, StoreError> {
        let existed = self.with_table(req.world, caller, |t| Ok((t.delete(&req.key)?, Vec::new())))?;
        Ok(pb::DeleteResponse { existed })
    }

    async fn op_multi_get(
        &self,
        caller: &Caller,
        req: pb::MultiGetRequest,
    ) -> Result<pb::MultiGetResponse, StoreError> {
        let values = self
            .wait_keys(req.world, caller, req.keys, req.timeout_ms, true)
            .await?;
        Ok(pb::MultiGetResponse { values })
    }

    fn op_multi_set(
        &self,
        caller: &Caller,
        req: pb::MultiSetRequest,
    ) -> Result<pb::MultiSetResponse, StoreError> {
        let entries = req.entries.into_iter().map(|kv| (kv.key, kv.value)).collect();
        self.with_table(req.world, caller, |t| Ok(((), t.multi_set(entries)?)))?;
        Ok(pb::MultiSetResponse {})
    }

    fn op_append(&self, caller: &Caller, req: pb::AppendRequest) -> Result<pb::AppendResponse, StoreError> {
        let length = self.with_table(req.world, caller, |t| t.append(req.key, &req.value))?;
        Ok(pb::AppendResponse {
            length: length as u64,
        })
    }

    fn op_num_keys(
        &self,
        caller: &Caller,
        req: pb::NumKeysRequest,
    ) -> Result<pb::NumKeysResponse, StoreError> {
        let count = self.with_table(req.world, caller, |t| Ok((t.num_keys()?, Vec::new())))?;
        Ok(pb::NumKeysResponse { count: count as u64 })
    }

    fn op_ping(&self, caller: &Caller, req: pb::PingRequest) -> Result<pb::PingResponse, StoreError> {
        if req.world.is_some() {
            self.resolve(req.world, caller)?;
        }
        let server_time_us = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64);
        Ok(pb::PingResponse { server_time_us })
    }

    /// Runs one request of the framed protocol: decodes `message` as the
    /// method's request (then gives back its memory reservation, as the
    /// gRPC path does once the handler has the decoded message), runs it,
    /// and encodes the reply frame for request `id`.
    pub(crate) async fn dispatch(
        &self,
        id: u32,
        method: Method,
        caller: &Caller,
        message: Bytes,
        reservation: Option<Reservation>,
    ) -> Bytes {
        fn decode<Q: prost::Message + Default>(
            message: Bytes,
            held: Option<Reservation>,
        ) -> Result<Q, StoreError> {
            let decoded = Q::decode(message)
                .map_err(|e| StoreError::InvalidArgument(format!("undecodable request: {e}")));
            drop(held);
            decoded
        }
        fn reply<R: prost::Message>(id: u32, result: Result<R, StoreError>) -> Bytes {
            match result {
                Ok(r) => framed::encode_reply(id, &r),
                Err(e) => framed::encode_error(id, e),
            }
        }
        let held = reservation;
        macro_rules! run {
            ($op:ident) => {
                match decode(message, held) {
                    Ok(req) => reply(id, self.$op(caller, req)),
                    Err(e) => framed::encode_error(id, e),
                }
            };
            (await $op:ident) => {
                match decode(message, held) {
                    Ok(req) => reply(id, self.$op(caller, req).await),
                    Err(e) => framed::encode_error(id, e),
                }
            };
        }
        match method {
            Method::Open => run!(op_open),
            Method::Close => run!(op_close),
            Method::Set => run!(op_set),
            Method::Get => run!(await op_get),
            Method::TryGet => run!(op_try_get),
            Method::Add => run!(op_add),
            Method::CompareAndSet => run!(op_compare_and_set),
            Method::Wait => run!(await op_wait),
            Method::Check => run!(op_check),
            Method::Delete => run!(op_delete),
            Method::MultiGet => run!(await op_multi_get),
            Method::MultiSet => run!(op_multi_set),
            Method::Append => run!(op_append),
            Method::NumKeys => run!(op_num_keys),
            Method::Ping => run!(op_ping),
        }
    }
}

/// The gRPC service over the shared state: each method takes its caller from
/// the request's metadata, gives back the request's memory reservation (it
/// travels in the extensions, dropped with them here) and runs the operation.
struct Service {
    shared: Arc<Shared>,
}

impl Service {
    fn take<T>(&self, request: Request<T>) -> (Caller, T) {
        let caller = Caller::of(&request, self.shared.config.max_name_len);
        (caller, request.into_inner())
    }
}

fn answer<T>(result: Result<T, StoreError>) -> Result<Response<T>, Status> {
    result.map(Response::new).map_err(Status::from)
}

#[tonic::async_trait]
impl store_server::Store for Service {
    async fn open(&self, request: Request<pb::OpenRequest>) -> Result<Response<pb::OpenResponse>, Status> {
        let (caller, req) = self.take(request);
        answer(self.shared.op_open(&caller, req))
    }

    async fn close(&self, request: Request<pb::CloseRequest>) -> Result<Response<pb::CloseResponse>, Status> {
        let (caller, req) = self.take(request);
        answer(self.shared.op_close(&caller, req))
    }

    async fn set(&self, request: Request<pb::SetRequest>) -> Result<Response<pb::SetResponse>, Status> {
        let (caller, req) = self.take(request);
        answer(self.shared.op_set(&caller, req))
    }

    async fn get(&self, request: Request<pb::GetRequest>) -> Result<Response<pb::GetResponse>, Status> {
        let (caller, req) = self.take(request);
        answer(self.shared.op_get(&caller, req).await)
    }

    async fn try_get(
        &self,
        request: Request<pb::TryGetRequest>,
    ) -> Result<Response<pb::TryGetResponse>, Status> {
        let (caller, req) = self.take(request);
        answer(self.shared.op_try_get(&caller, req))
    }

    async fn add(&self, request: Request<pb::AddRequest>) -> Result<Response<pb::AddResponse>, Status> {
        let (caller, req) = self.take(request);
        answer(self.shared.op_add(&caller, req))
    }

    async fn compare_and_set(
        &self,
        request: Request<pb::CompareAndSetRequest>,
    ) -> Result<Response<pb::CompareAndSetResponse>, Status> {
        let (caller, req) = self.take(request);
        answer(self.shared.op_compare_and_set(&caller, req))
    }

    async fn wait(&self, request: Request<pb::WaitRequest>) -> Result<Response<pb::WaitResponse>, Status> {
        let (caller, req) = self.take(request);
        answer(self.shared.op_wait(&caller, req).await)
    }

    async fn check(&self, request: Request<pb::CheckRequest>) -> Result<Response<pb::CheckResponse>, Status> {
        let (caller, req) = self.take(request);
        answer(self.shared.op_check(&caller, req))
    }

    async fn delete(
        &self,
        request: Request<pb::DeleteRequest>,
    ) -> Result<Response<pb::DeleteResponse>, Status> {
        let (caller, req) = self.take(request);
        answer(self.shared.op_delete(&caller, req))
    }

    async fn multi_get(
        &self,
        request: Request<pb::MultiGetRequest>,
    ) -> Result<Response<pb::MultiGetResponse>, Status> {
        let (caller, req) = self.take(request);
        answer(self.shared.op_multi_get(&caller, req).await)
    }

    async fn multi_set(
        &self,
        request: Request<pb::MultiSetRequest>,
    ) -> Result<Response<pb::MultiSetResponse>, Status> {
        let (caller, req) = self.take(request);
        answer(self.shared.op_multi_set(&caller, req))
    }

    async fn append(
        &self,
        request: Request<pb::AppendRequest>,
    ) -> Result<Response<pb::AppendResponse>, Status> {
        let (caller, req) = self.take(request);
        answer(self.shared.op_append(&caller, req))
    }

    async fn num_keys(
        &self,
        request: Request<pb::NumKeysRequest>,
    ) -> Result<Response<pb::NumKeysResponse>, Status> {
        let (caller, req) = self.take(request);
        answer(self.shared.op_num_keys(&caller, req))
    }

    async fn ping(&self, request: Request<pb::PingRequest>) -> Result<Response<pb::PingResponse>, Status> {
        let (caller, req) = self.take(request);
        answer(self.shared.op_ping(&caller, req))
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
