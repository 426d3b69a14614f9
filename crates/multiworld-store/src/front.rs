//! The server's front: the accept loop, each connection's HTTP/2 driver and
//! deadlines, and the per-request gate that runs before the gRPC service.
//!
//! Everything a client can make the server hold is bounded here, before the
//! service sees the request:
//! - connections: at most `max_connections`; at the cap a new connection
//!   evicts one that never sent a request, else the one idle longest, or is
//!   closed at once if every connection has a request in flight;
//!   accept errors (fd exhaustion) back off instead of spinning;
//! - a connection's first request must arrive within
//!   `first_request_timeout`, and a connection with no request in flight is
//!   closed after `idle_timeout` (neither is reset by bytes or pings, so a
//!   slowloris or an idle attacker answering keepalives is closed too);
//! - each request is judged from its headers ([`gate::judge`]) before a byte
//!   of its body is read: a stranger's request is answered at once and its
//!   body discarded by HTTP/2 (small windows keep what it can push before
//!   that small); a pre-authentication request (`Open`, world-less `Ping`)
//!   gets a tiny body bound and a per-connection stream cap;
//! - an admitted request's body is read here under `request_body_timeout`,
//!   after reserving twice its declared size (the body and its decoded copy)
//!   from the process-wide budget `max_buffered_request_bytes`; the
//!   reservation travels in the request's extensions and is released when
//!   the handler takes the decoded message apart, so a long-poll wait holds
//!   no budget.

use std::{
    collections::HashMap,
    convert::Infallible,
    net::SocketAddr,
    pin::pin,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
    },
    time::Duration,
};

use bytes::{Bytes, BytesMut};
use http_body_util::{BodyExt, Full};
use hyper::{body::Incoming, server::conn::http2, service::service_fn};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::{
    net::{TcpListener, TcpStream},
    sync::Notify,
    time::Instant,
};
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use tonic::{Status, body::Body, codegen::Service, transport::server::TcpConnectInfo};

mod framed;

use crate::{
    auth::{AUTH_METADATA, WORLD_METADATA, decode_world},
    error::{Limit, StoreError},
    gate::{self, LogLimiter, Verdict, WorldState},
    limits::over,
    server::{ServerConfig, Shared},
};

/// The gRPC message prefix: a compression flag and a big-endian length.
const PREFIX: usize = 5;
/// Longest pause between failed accepts.
const MAX_ACCEPT_PAUSE: Duration = Duration::from_secs(1);
/// How long a connection told to go away (GOAWAY) may take to finish.
const CLOSE_GRACE: Duration = Duration::from_secs(1);

/// A reservation of request memory; dropping it returns the bytes.
#[derive(Debug)]
pub(crate) struct Reservation {
    budget: Arc<Budget>,
    bytes: usize,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.budget.used.fetch_sub(self.bytes, Ordering::AcqRel);
        self.budget.freed.notify_waiters();
    }
}

/// The process-wide budget for request bodies being received and decoded.
///
/// Deliberately not a FIFO semaphore: there a small request queues behind a
/// large one that cannot fit yet, so a client declaring large bodies would
/// starve everyone else. Here any request that fits now takes its bytes at
/// once; one that does not waits for bytes to be freed, up to
/// `request_memory_wait`.
#[derive(Debug)]
pub(crate) struct Budget {
    total: usize,
    used: AtomicUsize,
    freed: Notify,
}

impl Budget {
    pub(crate) fn new(total: usize) -> Budget {
        Budget {
            total,
            used: AtomicUsize::new(0),
            freed: Notify::new(),
        }
    }

    /// Bytes reserved right now.
    pub(crate) fn in_use(&self) -> usize {
        self.used.load(Ordering::Acquire)
    }

    fn try_take(&self, bytes: usize) -> bool {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(bytes).filter(|after| *after <= self.total)
            })
            .is_ok()
    }

    /// Reserves `bytes`, waiting at most `wait`; refuses at once what could
    /// never fit.
    async fn reserve(self: &Arc<Self>, bytes: usize, wait: Duration) -> Result<Reservation, StoreError> {
        let refused = || StoreError::LimitExceeded {
            limit: Limit::RequestMemory,
            max: self.total as u64,
            requested: bytes as u64,
        };
        if bytes > self.total {
            return Err(refused());
        }
        let deadline = Instant::now() + wait;
        loop {
            // Registered before the attempt, so a release in between wakes it.
            let mut freed = pin!(self.freed.notified());
            freed.as_mut().enable();
            if self.try_take(bytes) {
                return Ok(Reservation {
                    budget: Arc::clone(self),
                    bytes,
                });
            }
            if tokio::time::timeout_at(deadline, freed).await.is_err() {
                return Err(refused());
            }
        }
    }
}

/// One live connection, as the registry and its requests see it.
struct Conn {
    accepted: Instant,
    requests: AtomicU64,
    open: AtomicUsize,
    unauthenticated: AtomicUsize,
    idle_since: Mutex<Instant>,
    /// Woken when the last request in flight ends, or on eviction.
    changed: Notify,
    evicted: AtomicBool,
}

impl Conn {
    fn idle_since(&self) -> Instant {
        *self.idle_since.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// When the connection is next due a look.
    fn next_check(&self, config: &ServerConfig) -> Instant {
        if self.requests.load(Ordering::Acquire) == 0 {
            self.accepted + config.first_request_timeout
        } else if self.open.load(Ordering::Acquire) == 0 {
            self.idle_since() + config.idle_timeout
        } else {
            Instant::now() + config.idle_timeout
        }
    }

    /// Where the connection stands among those that may make room for a
    /// new one at the cap (lowest first), or `None` if it may not: first
    /// those that never sent a request (oldest first), then the idle ones
    /// (idle longest first), then those whose every request in flight is a
    /// pre-authentication one (a world-less `Ping`, an `Open` of a world the
    /// server cannot judge; oldest first). A connection with an admitted
    /// request in flight is never evicted. Without the third class, a
    /// stranger could hold every place by keeping a stalled world-less `Ping`
    /// on each connection, and every new client would be refused.
    fn eviction_order(&self) -> Option<(u8, Instant)> {
        let open = self.open.load(Ordering::Acquire);
        if open == 0 {
            return Some(if self.requests.load(Ordering::Acquire) == 0 {
                (0, self.accepted)
            } else {
                (1, self.idle_since())
            });
        }
        (open <= self.unauthenticated.load(Ordering::Acquire)).then_some((2, self.accepted))
    }

    /// Why the connection should go, if it should.
    fn expired(&self, now: Instant, config: &ServerConfig) -> Option<&'static str> {
        if self.requests.load(Ordering::Acquire) == 0 {
            (now >= self.accepted + config.first_request_timeout)
                .then_some("no request within first_request_timeout")
        } else if self.open.load(Ordering::Acquire) == 0 {
            (now >= self.idle_since() + config.idle_timeout).then_some("idle for idle_timeout")
        } else {
            None
        }
    }
}

/// A request in flight on a connection; dropping it marks the end.
struct InFlight(Arc<Conn>);

impl InFlight {
    fn begin(conn: &Arc<Conn>) -> InFlight {
        conn.requests.fetch_add(1, Ordering::AcqRel);
        conn.open.fetch_add(1, Ordering::AcqRel);
        InFlight(Arc::clone(conn))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if self.0.open.fetch_sub(1, Ordering::AcqRel) == 1 {
            *self.0.idle_since.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
            self.0.changed.notify_one();
        }
    }
}

/// Largest message of a request that names no world (a world-less `Ping`,
/// whose message is empty, or an unknown method, answered `unimplemented`):
/// read before any proof, so kept far below what members' requests need.
pub(crate) const WORLDLESS_MESSAGE_BYTES: usize = 64;

/// A pre-authentication request in flight; dropping it frees its place.
struct Unauthenticated(Arc<Conn>);

impl Unauthenticated {
    /// Counts a request on `conn` as a stranger's until this is dropped.
    fn begin(conn: &Arc<Conn>) -> Unauthenticated {
        conn.unauthenticated.fetch_add(1, Ordering::AcqRel);
        Unauthenticated(Arc::clone(conn))
    }
}

impl Drop for Unauthenticated {
    fn drop(&mut self) {
        self.0.unauthenticated.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The live connections, for the cap and eviction.
#[derive(Default)]
pub(crate) struct Connections {
    live: Mutex<HashMap<u64, Arc<Conn>>>,
    next_id: AtomicU64,
    /// Connections closed at once because every place was busy.
    pub(crate) refused: AtomicU64,
    /// Connections evicted to make room.
    pub(crate) evicted: AtomicU64,
}

impl Connections {
    pub(crate) fn count(&self) -> usize {
        self.live.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Registers a new connection, evicting the longest-idle one at the cap;
    /// `None` when every connection is busy.
    fn admit(&self, max: usize) -> Option<(u64, Arc<Conn>)> {
        let mut live = self.live.lock().unwrap_or_else(|e| e.into_inner());
        if live.len() >= max {
            let victim = live
                .iter()
                .filter_map(|(id, c)| c.eviction_order().map(|k| (k, *id)))
                .min()
                .map(|(_, id)| id);
            let victim = victim.and_then(|id| live.remove(&id));
            match victim {
                Some(c) => {
                    c.evicted.store(true, Ordering::Release);
                    c.changed.notify_one();
                    self.evicted.fetch_add(1, Ordering::Relaxed);
                }
                None => {
                    self.refused.fetch_add(1, Ordering::Relaxed);
                    return None;
                }
            }
        }
        let now = Instant::now();
        let conn = Arc::new(Conn {
            accepted: now,
            requests: AtomicU64::new(0),
            open: AtomicUsize::new(0),
            unauthenticated: AtomicUsize::new(0),
            idle_since: Mutex::new(now),
            changed: Notify::new(),
            evicted: AtomicBool::new(false),
        });
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        live.insert(id, Arc::clone(&conn));
        Some((id, conn))
    }

    fn remove(&self, id: u64) {
        self.live.lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
    }
}

/// Removes a connection from the registry when its task ends.
struct Registered<'a>(&'a Connections, u64);

impl Drop for Registered<'_> {
    fn drop(&mut self) {
        self.0.remove(self.1);
    }
}

/// Logs through a limiter: one line per interval, with the count held back.
fn log_limited(limiter: &LogLimiter, what: &str, detail: &dyn std::fmt::Display) {
    if let Some(held) = limiter.admit(std::time::Instant::now()) {
        tracing::warn!(held_back = held, "{what}: {detail}");
    }
}

/// The gRPC service the front hands admitted requests to.
pub(crate) trait Grpc:
    Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible, Future: Send>
    + Clone
    + Send
    + 'static
{
}

impl<S> Grpc for S where
    S: Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible, Future: Send>
        + Clone
        + Send
        + 'static
{
}

/// Accepts connections until `stop`, then waits for them to finish;
/// `kill` closes them at once.
pub(crate) async fn accept_loop<S: Grpc>(
    listener: TcpListener,
    shared: Arc<Shared>,
    grpc: S,
    stop: CancellationToken,
    kill: CancellationToken,
) {
    let tracker = TaskTracker::new();
    let mut pause = Duration::from_millis(1);
    loop {
        let accepted = tokio::select! {
            _ = stop.cancelled() => break,
            r = listener.accept() => r,
        };
        match accepted {
            Ok((stream, remote)) => {
                pause = Duration::from_millis(1);
                let Some((id, conn)) = shared.connections.admit(shared.config.max_connections) else {
                    log_limited(
                        &shared.connection_log,
                        "closed a new store connection: every place is busy",
                        &remote,
                    );
                    drop(stream);
                    continue;
                };
                let _ = stream.set_nodelay(true);
                let (shared, grpc, stop, kill) =
                    (Arc::clone(&shared), grpc.clone(), stop.clone(), kill.clone());
                tracker.spawn(async move {
                    let _registered = Registered(&shared.connections, id);
                    let accepted = Accepted {
                        stream,
                        remote,
                        conn,
                        stop,
                        kill,
                    };
                    serve_connection(accepted, &shared, grpc).await;
                });
            }
            Err(e) => {
                // EMFILE/ENFILE and friends: the pending connection stays in
                // the backlog, so retrying at once would spin. Back off.
                log_limited(&shared.connection_log, "store accept failed; backing off", &e);
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tokio::time::sleep(pause) => {}
                }
                pause = (pause * 2).min(MAX_ACCEPT_PAUSE);
            }
        }
    }
    drop(listener);
    tracker.close();
    tracker.wait().await;
}

/// One accepted connection, handed to the driver of its protocol.
struct Accepted {
    stream: TcpStream,
    remote: SocketAddr,
    /// Its place among the server's connections (deadlines, eviction).
    conn: Arc<Conn>,
    /// The server's graceful stop: requests in flight finish.
    stop: CancellationToken,
    /// The server's kill: the connection closes at once.
    kill: CancellationToken,
}

impl Accepted {
    /// The connection, its address, its place, the server's stop and kill.
    fn into_parts(
        self,
    ) -> (
        TcpStream,
        SocketAddr,
        Arc<Conn>,
        CancellationToken,
        CancellationToken,
    ) {
        (self.stream, self.remote, self.conn, self.stop, self.kill)
    }
}

/// Serves one connection in the protocol its first byte names: `M` (the
/// framed protocol's preface) or anything else (HTTP/2's starts with `P`).
async fn serve_connection<S: Grpc>(accepted: Accepted, shared: &Arc<Shared>, grpc: S) {
    let (conn, remote) = (&accepted.conn, accepted.remote);
    let (stop, kill) = (&accepted.stop, &accepted.kill);
    let mut first = [0u8; 1];
    let peeked = tokio::select! {
        r = accepted.stream.peek(&mut first) => r,
        _ = kill.cancelled() => return,
        _ = stop.cancelled() => return,
        _ = tokio::time::sleep_until(conn.accepted + shared.config.first_request_timeout) => {
            tracing::debug!(%remote, "closing store connection: nothing sent within first_request_timeout");
            return;
        }
        // An eviction while nothing was sent yet.
        _ = conn.changed.notified() => return,
    };
    match peeked {
        Ok(0) | Err(_) => {}
        Ok(_) if first[0] == crate::framed::PREFACE[0] => framed::serve(accepted, shared).await,
        Ok(_) => serve_http2(accepted, shared, grpc).await,
    }
}

async fn serve_http2<S: Grpc>(accepted: Accepted, shared: &Arc<Shared>, grpc: S) {
    let (stream, remote, conn, stop, kill) = accepted.into_parts();
    let config = &shared.config;
    let info = TcpConnectInfo {
        local_addr: stream.local_addr().ok(),
        remote_addr: Some(remote),
    };
    let service = {
        let (shared, conn) = (Arc::clone(shared), Arc::clone(&conn));
        service_fn(move |req: http::Request<Incoming>| {
            let (shared, conn, grpc, info) =
                (Arc::clone(&shared), Arc::clone(&conn), grpc.clone(), info.clone());
            async move { Ok::<_, Infallible>(handle(req, &shared, &conn, grpc, info).await) }
        })
    };
    let mut builder = http2::Builder::new(TokioExecutor::new());
    builder
        .timer(TokioTimer::new())
        .adaptive_window(false)
        .initial_stream_window_size(config.initial_stream_window_bytes)
        .initial_connection_window_size(config.initial_connection_window_bytes)
        .max_concurrent_streams(config.max_streams_per_connection)
        .max_header_list_size(config.max_header_list_bytes)
        .keep_alive_interval(config.keepalive_interval)
        .keep_alive_timeout(config.keepalive_timeout);
    let mut http = pin!(builder.serve_connection(TokioIo::new(stream), service));
    // Set once the connection was told to go: the time it must be gone by.
    let mut closing: Option<Instant> = None;
    loop {
        let check = closing.unwrap_or_else(|| conn.next_check(config));
        tokio::select! {
            result = http.as_mut() => {
                if let Err(e) = result {
                    tracing::debug!(%remote, error = %e, "store connection ended with an error");
                }
                return;
            }
            _ = kill.cancelled() => return,
            _ = stop.cancelled(), if closing.is_none() => {
                // Graceful: in-flight requests finish (the worlds were closed,
                // so waits end at once); the server's shutdown bounds the rest.
                http.as_mut().graceful_shutdown();
                closing = Some(Instant::now() + Duration::from_secs(86_400));
            }
            _ = conn.changed.notified() => {
                if conn.evicted.load(Ordering::Acquire) {
                    tracing::debug!(%remote, "store connection evicted to make room");
                    return;
                }
            }
            _ = tokio::time::sleep_until(check) => {
                if closing.is_some() {
                    return;
                }
                if let Some(why) = conn.expired(Instant::now(), config) {
                    tracing::debug!(%remote, why, "closing store connection");
                    http.as_mut().graceful_shutdown();
                    closing = Some(Instant::now() + CLOSE_GRACE);
                }
            }
        }
    }
}

fn refusal(err: StoreError) -> http::Response<Body> {
    Status::from(err).into_http()
}

/// What the gate lets a request do: the bound of its message, and (a
/// pre-authentication request) its place among the connection's, held
/// until the request ends.
pub(crate) struct Admitted {
    bound: usize,
    _unauthenticated: Option<Unauthenticated>,
}

/// Judges a request from its method, the world its header names and its
/// proof, before any of its message is read (both protocols).
fn admit(
    shared: &Shared,
    conn: &Arc<Conn>,
    method: &str,
    world: Option<&str>,
    proof: Option<&str>,
) -> Result<Admitted, StoreError> {
    let config = &shared.config;
    let slot = world.and_then(|w| shared.worlds.get(w).map(|e| Arc::clone(e.value())));
    let state = match &slot {
        Some(slot) => WorldState::Open(slot.secret.as_ref()),
        None => WorldState::Missing,
    };
    let verdict = gate::judge(method, world, proof, state, config.remote_create_secret.as_ref());
    drop(slot);
    let mut unauthenticated = None;
    match verdict {
        Verdict::Refuse(err) => return Err(err),
        Verdict::PreAuth => {
            let n = conn.unauthenticated.fetch_add(1, Ordering::AcqRel) + 1;
            unauthenticated = Some(Unauthenticated(Arc::clone(conn)));
            over(
                Limit::UnauthenticatedStreams,
                config.max_unauthenticated_streams,
                n,
            )?;
        }
        Verdict::Admit => {}
    }
    Ok(Admitted {
        bound: if world.is_none() {
            // A world-less Ping carries next to nothing: a stranger's must
            // not be able to reserve request memory that members need.
            config.max_unauthenticated_body_bytes.min(WORLDLESS_MESSAGE_BYTES)
        } else if method == "Open" {
            config.max_unauthenticated_body_bytes
        } else {
            config.max_message_bytes
        },
        _unauthenticated: unauthenticated,
    })
}

/// Counts a refused request, and logs a stranger's (rate limited).
fn count_refusal(shared: &Shared, err: &StoreError) {
    shared.refused_requests.fetch_add(1, Ordering::Relaxed);
    if matches!(err, StoreError::Unauthenticated { .. }) {
        log_limited(&shared.auth_log, "refused unauthenticated store requests", err);
    }
}

/// Judges one request from its headers, reads its body within its bounds,
/// and hands it to the gRPC service.
async fn handle<S: Grpc>(
    req: http::Request<Incoming>,
    shared: &Shared,
    conn: &Arc<Conn>,
    mut grpc: S,
    info: TcpConnectInfo,
) -> http::Response<Body> {
    let _in_flight = InFlight::begin(conn);
    let config = &shared.config;
    let method = req.uri().path().rsplit('/').next().unwrap_or("");
    let world = match req.headers().get(WORLD_METADATA) {
        None => None,
        Some(v) => match decode_world(v.as_bytes(), config.max_name_len) {
            Ok(name) => Some(name),
            Err(why) => {
                let err = StoreError::InvalidArgument(why.into());
                count_refusal(shared, &err);
                return refusal(err);
            }
        },
    };
    let proof = req.headers().get(AUTH_METADATA).and_then(|v| v.to_str().ok());
    let admitted = match admit(shared, conn, method, world.as_deref(), proof) {
        Ok(admitted) => admitted,
        Err(err) => {
            count_refusal(shared, &err);
            return refusal(err);
        }
    };
    let (parts, body) = req.into_parts();
    let (bytes, reservation) = match read_body(body, admitted.bound, shared).await {
        Ok(read) => read,
        Err(err) => {
            count_refusal(shared, &err);
            return refusal(err);
        }
    };
    let mut req = http::Request::from_parts(parts, Body::new(Full::new(bytes)));
    req.extensions_mut().insert(info);
    if let Some(r) = reservation {
        req.extensions_mut().insert(Arc::new(r));
    }
    match grpc.call(req).await {
        Ok(response) => response,
        Err(never) => match never {},
    }
}

/// Reads a unary request's body: its 5-byte prefix, then (after reserving
/// twice the declared length from the budget) the message, all within
/// `request_body_timeout`.
async fn read_body(
    mut body: Incoming,
    bound: usize,
    shared: &Shared,
) -> Result<(Bytes, Option<Reservation>), StoreError> {
    let config = &shared.config;
    let deadline = Instant::now() + config.request_body_timeout;
    let mut buf = BytesMut::new();
    let mut permit = None;
    let mut expected: Option<usize> = None;
    loop {
        let frame = match tokio::time::timeout_at(deadline, body.frame()).await {
            Err(_) => {
                return Err(StoreError::Timeout {
                    what: "the rest of the request body".into(),
                    after: config.request_body_timeout,
                });
            }
            Ok(None) => break,
            Ok(Some(Err(e))) => return Err(StoreError::InvalidArgument(format!("request body: {e}"))),
            Ok(Some(Ok(frame))) => frame,
        };
        let Ok(data) = frame.into_data() else {
            continue;
        };
        // Before the prefix is known at most one HTTP/2 frame is held.
        let limit = expected.unwrap_or(PREFIX + bound.max(PREFIX));
        if buf.len() + data.len() > limit {
            return Err(match expected {
                Some(_) => StoreError::InvalidArgument("more than one message in a unary request".into()),
                None => StoreError::LimitExceeded {
                    limit: Limit::MessageBytes,
                    max: bound as u64,
                    requested: (buf.len() + data.len()) as u64,
                },
            });
        }
        buf.extend_from_slice(&data);
        if expected.is_none() && buf.len() >= PREFIX {
            if buf[0] != 0 {
                return Err(StoreError::InvalidArgument(
                    "compressed requests are not accepted".into(),
                ));
            }
            let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
            over(Limit::MessageBytes, bound, len)?;
            let reserve = len.saturating_mul(2).saturating_add(PREFIX);
            permit = Some(shared.budget.reserve(reserve, config.request_memory_wait).await?);
            buf.reserve(PREFIX + len - buf.len().min(PREFIX + len));
            expected = Some(PREFIX + len);
        }
    }
    Ok((buf.freeze(), permit))
}
