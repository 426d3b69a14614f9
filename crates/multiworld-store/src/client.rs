//! The store client: [`StoreClient`] is one connection to a store server
//! (made with retry and backoff until a deadline), and [`WorldStore`] is one
//! world's store over it. Both are cheap to clone and safe to share.
//!
//! A client speaks the framed protocol by default, or gRPC
//! ([`ClientConfig::protocol`]); the server answers both on one port, with
//! the same operations, bounds and errors.
//!
//! Every call has a client-side deadline (the wait's own timeout plus a grace
//! for waiting calls, [`ClientConfig::op_timeout`] for the others), so a
//! frozen server never hangs a caller. When the call's future is dropped or
//! its deadline passes, the server is told (a `Cancel` frame, or the HTTP/2
//! stream is reset) and forgets the wait. When the server's process dies,
//! its connection closes and every in-flight call fails with `Unavailable`
//! at once.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use bytes::Bytes;
use multiworld_proto::store::v1 as pb;
use tonic::{
    Request, Response, Status,
    metadata::{Ascii, MetadataValue},
};

use multiworld_types::Secret;

use crate::{
    auth::{AUTH_METADATA, StoreProof, WORLD_METADATA, encode_world},
    conn::{Conn, ConnSettings},
    error::{Limit, StoreError},
    framed::{MAX_PROOF_LEN, Method},
    framed_conn::{FramedConn, HTTP2_ONLY},
    table::CasOutcome,
};

/// Which wire protocol a client speaks. A server answers both on one port
/// (it tells them apart by a connection's first byte), with the same
/// operations, bounds and errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum WireProtocol {
    /// The store's own framing: a 9-byte header and the request's protobuf
    /// message, no HTTP/2 (docs/protocol.md, "The framed store protocol").
    /// The default: a set+get costs about a quarter of gRPC's. A server of
    /// an earlier version, which answers only gRPC, is recognised when the
    /// client connects (it answers the framed preface in HTTP/2), and the
    /// client speaks gRPC to it.
    #[default]
    Framed,
    /// gRPC over HTTP/2 (the `multiworld.store.v1` service), for clients and
    /// tools that speak gRPC.
    Grpc,
}

/// How a client connects and how long it waits. `Default` gives the
/// documented defaults.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// How long [`StoreClient::connect`] keeps retrying (default 30 s).
    pub connect_timeout: Duration,
    /// First pause between connection attempts (default 10 ms); it doubles
    /// after each failure up to `backoff_max`.
    pub backoff_initial: Duration,
    /// Longest pause between connection attempts (default 500 ms).
    pub backoff_max: Duration,
    /// Client-side deadline of calls that do not wait for keys (default 30 s).
    pub op_timeout: Duration,
    /// Added to a waiting call's own timeout to form its client-side deadline
    /// (default 5 s).
    pub wait_grace: Duration,
    /// HTTP/2 keepalive ping interval (default 1 s): notices a host that is
    /// frozen or cut off rather than dead.
    pub keepalive_interval: Duration,
    /// How long a keepalive ping may go unanswered (default 3 s).
    pub keepalive_timeout: Duration,
    /// Largest reply decoded (default 64 MiB).
    pub max_message_bytes: usize,
    /// The wire protocol (default [`WireProtocol::Framed`]).
    pub protocol: WireProtocol,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            connect_timeout: Duration::from_secs(30),
            backoff_initial: Duration::from_millis(10),
            backoff_max: Duration::from_millis(500),
            op_timeout: Duration::from_secs(30),
            wait_grace: Duration::from_secs(5),
            keepalive_interval: Duration::from_secs(1),
            keepalive_timeout: Duration::from_secs(3),
            max_message_bytes: 64 << 20,
            protocol: WireProtocol::default(),
        }
    }
}

/// How to open a world's store.
#[derive(Debug, Clone)]
pub struct OpenOptions {
    /// The world's secret, if it has one.
    pub secret: Option<Secret>,
    /// Ask the server to create the world if it is not open (only servers
    /// that allow remote creation do).
    pub create: bool,
    /// How long to keep asking while the world is not open yet, e.g. because
    /// its hosting rank has not got there (default 30 s).
    pub timeout: Duration,
}

impl Default for OpenOptions {
    fn default() -> Self {
        OpenOptions {
            secret: None,
            create: false,
            timeout: Duration::from_secs(30),
        }
    }
}

/// One connection to a store server.
#[derive(Clone)]
pub struct StoreClient {
    transport: Transport,
    addr: Arc<str>,
    config: Arc<ClientConfig>,
}

/// The connection, in the protocol the client speaks.
#[derive(Clone)]
enum Transport {
    Framed(FramedConn),
    Grpc { conn: Conn, origin: http::Uri },
}

/// What names a world's requests and proves its secret, in the forms both
/// protocols send.
struct WorldAuth {
    name: String,
    proof: Option<String>,
    world_meta: MetadataValue<Ascii>,
    auth_meta: Option<MetadataValue<Ascii>>,
}

impl WorldAuth {
    fn new(name: &str, secret: Option<&Secret>) -> Result<WorldAuth, StoreError> {
        let proof = secret.map(|s| s.proof(name));
        let auth_meta = match &proof {
            Some(p) => Some(
                MetadataValue::try_from(p.as_str())
                    .map_err(|e| StoreError::Protocol(format!("proof is not ASCII: {e}")))?,
            ),
            None => None,
        };
        if proof.as_ref().is_some_and(|p| p.len() > MAX_PROOF_LEN) || name.len() > usize::from(u16::MAX) {
            return Err(StoreError::InvalidArgument(format!(
                "world name of {} bytes, or its proof, too long to send",
                name.len()
            )));
        }
        Ok(WorldAuth {
            name: name.to_string(),
            proof,
            world_meta: world_metadata(name)?,
            auth_meta,
        })
    }
}

impl std::fmt::Debug for StoreClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreClient").field("addr", &self.addr).finish()
    }
}

impl StoreClient {
    /// Connects to the server at `addr` (`host:port`), retrying with
    /// exponential backoff until `config.connect_timeout`, and checks that a
    /// store answers there.
    pub async fn connect(addr: &str, config: ClientConfig) -> Result<StoreClient, StoreError> {
        let started = Instant::now();
        let deadline = started + config.connect_timeout;
        let origin = http::Uri::try_from(format!("http://{addr}"))
            .map_err(|e| StoreError::InvalidArgument(format!("bad store address '{addr}': {e}")))?;
        let settings = ConnSettings {
            keepalive_interval: config.keepalive_interval,
            keepalive_timeout: config.keepalive_timeout,
        };
        let shared_addr: Arc<str> = Arc::from(addr);
        let mut pause = config.backoff_initial;
        let mut attempts = 0u32;
        let mut config = config;
        loop {
            attempts += 1;
            let remaining = deadline.saturating_duration_since(Instant::now());
            let attempt = try_connect(
                &shared_addr,
                &settings,
                &config,
                remaining.min(Duration::from_secs(2)),
            );
            let last_error = match attempt.await {
                Ok(conn) => {
                    let transport = match conn {
                        Dialed::Framed(c) => Transport::Framed(c),
                        Dialed::Grpc(conn) => Transport::Grpc {
                            conn,
                            origin: origin.clone(),
                        },
                    };
                    let client = StoreClient {
                        transport,
                        addr: Arc::clone(&shared_addr),
                        config: Arc::new(config.clone()),
                    };
                    match client.ping().await {
                        Ok(_) => {
                            tracing::debug!(addr, attempts, protocol = ?config.protocol, "connected to store");
                            return Ok(client);
                        }
                        // A server of an earlier version, which speaks only
                        // gRPC: speak gRPC to it, at once.
                        Err(StoreError::Unavailable { reason, .. })
                            if config.protocol == WireProtocol::Framed && reason.contains(HTTP2_ONLY) =>
                        {
                            tracing::info!(
                                addr,
                                "the store answers only gRPC (an earlier version); speaking gRPC"
                            );
                            config.protocol = WireProtocol::Grpc;
                            continue;
                        }
                        Err(e) => e.to_string(),
                    }
                }
                Err(e) => e,
            };
            let now = Instant::now();
            if now >= deadline {
                return Err(StoreError::Unavailable {
                    addr: addr.to_string(),
                    reason: format!(
                        "no store answered after {attempts} attempts in {:?}: {last_error}",
                        now - started
                    ),
                });
            }
            tracing::trace!(addr, attempts, error = %last_error, "store not reachable yet");
            tokio::time::sleep(pause.min(deadline - now)).await;
            pause = (pause * 2).min(config.backoff_max);
        }
    }

    /// The server's address as given to `connect`.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// The wire protocol this client speaks.
    pub fn protocol(&self) -> WireProtocol {
        match self.transport {
            Transport::Framed(_) => WireProtocol::Framed,
            Transport::Grpc { .. } => WireProtocol::Grpc,
        }
    }

    /// Sends one request (naming `world`, with its proof, if given) and
    /// returns the reply's message, in the protocol the client speaks.
    async fn unary<Q, R>(&self, method: Method, world: Option<&WorldAuth>, message: Q) -> Result<R, Status>
    where
        Q: prost::Message + Send + Sync + 'static,
        R: prost::Message + Default + Send + 'static,
    {
        match &self.transport {
            Transport::Framed(conn) => {
                let (name, proof) = world.map_or(("", None), |w| (w.name.as_str(), w.proof.as_deref()));
                let reply = conn.call(method, name, proof, &message).await?;
                R::decode(reply).map_err(|e| Status::internal(format!("undecodable reply: {e}")))
            }
            Transport::Grpc { conn, origin } => {
                let mut req = Request::new(message);
                if let Some(w) = world {
                    req.metadata_mut().insert(WORLD_METADATA, w.world_meta.clone());
                    if let Some(a) = &w.auth_meta {
                        req.metadata_mut().insert(AUTH_METADATA, a.clone());
                    }
                }
                let mut grpc = tonic::client::Grpc::with_origin(conn.clone(), origin.clone())
                    .max_decoding_message_size(self.config.max_message_bytes)
                    .max_encoding_message_size(self.config.max_message_bytes);
                grpc.ready().await?;
                let path = http::uri::PathAndQuery::from_static(method.path());
                grpc.unary(req, path, tonic_prost::ProstCodec::default())
                    .await
                    .map(Response::into_inner)
            }
        }
    }

    /// Round trip to the server (not to any world).
    pub async fn ping(&self) -> Result<Duration, StoreError> {
        let started = Instant::now();
        let fut = self.unary::<_, pb::PingResponse>(Method::Ping, None, pb::PingRequest { world: None });
        match tokio::time::timeout(self.config.op_timeout, fut).await {
            Ok(Ok(_)) => Ok(started.elapsed()),
            Ok(Err(status)) => Err(StoreError::from_status(&status, "", &self.addr)),
            Err(_) => Err(self.deadline_passed(self.config.op_timeout)),
        }
    }

    /// Opens a world's store on this server: waits (up to `options.timeout`)
    /// until the world is open there, or creates it if asked and allowed.
    pub async fn open(&self, name: &str, options: OpenOptions) -> Result<WorldStore, StoreError> {
        let auth = Arc::new(WorldAuth::new(name, options.secret.as_ref())?);
        let started = Instant::now();
        let mut pause = self.config.backoff_initial;
        loop {
            let req = pb::OpenRequest {
                name: name.to_string(),
                create: options.create,
            };
            let fut = self.unary::<_, pb::OpenResponse>(Method::Open, Some(&auth), req);
            let err = match tokio::time::timeout(self.config.op_timeout, fut).await {
                Ok(Ok(resp)) => {
                    return Ok(WorldStore {
                        client: self.clone(),
                        world: pb::WorldRef {
                            name: name.to_string(),
                            generation: resp.generation,
                        },
                        auth,
                    });
                }
                Ok(Err(status)) => StoreError::from_status(&status, name, &self.addr),
                Err(_) => return Err(self.deadline_passed(self.config.op_timeout)),
            };
            let elapsed = started.elapsed();
            if !matches!(err, StoreError::WorldNotFound { .. }) {
                return Err(err);
            }
            if elapsed >= options.timeout {
                return Err(StoreError::Timeout {
                    what: format!("world '{name}' to be opened on the store at {}", self.addr),
                    after: elapsed,
                });
            }
            tokio::time::sleep(pause.min(options.timeout - elapsed)).await;
            pause = (pause * 2).min(self.config.backoff_max);
        }
    }

    fn deadline_passed(&self, after: Duration) -> StoreError {
        StoreError::Timeout {
            what: format!("a reply from the store at {}", self.addr),
            after,
        }
    }
}

/// A new connection, in either protocol.
enum Dialed {
    Framed(FramedConn),
    Grpc(Conn),
}

async fn try_connect(
    addr: &Arc<str>,
    settings: &ConnSettings,
    config: &ClientConfig,
    limit: Duration,
) -> Result<Dialed, String> {
    let attempt = async {
        match config.protocol {
            WireProtocol::Framed => {
                FramedConn::connect(Arc::clone(addr), settings.clone(), config.max_message_bytes)
                    .await
                    .map(Dialed::Framed)
            }
            WireProtocol::Grpc => Conn::connect(Arc::clone(addr), settings.clone())
                .await
                .map(Dialed::Grpc),
        }
    };
    match tokio::time::timeout(limit.max(Duration::from_millis(1)), attempt).await {
        Ok(result) => result,
        Err(_) => Err(format!("connect attempt took longer than {limit:?}")),
    }
}

fn key(k: impl AsRef<[u8]>) -> Bytes {
    Bytes::copy_from_slice(k.as_ref())
}

fn keys<K: AsRef<[u8]>>(ks: &[K]) -> Vec<Bytes> {
    ks.iter().map(key).collect()
}

/// A wait's timeout on the wire: at least 1 ms, since 0 means "the server's
/// default".
fn wire_ms(timeout: Duration) -> u64 {
    (timeout.as_millis() as u64).max(1)
}

/// One world's store, reached through a [`StoreClient`].
#[derive(Clone)]
pub struct WorldStore {
    client: StoreClient,
    world: pb::WorldRef,
    auth: Arc<WorldAuth>,
}

/// The `mw-world` entry naming `name`, which lets the server check a
/// request's proof before reading its body.
fn world_metadata(name: &str) -> Result<MetadataValue<Ascii>, StoreError> {
    MetadataValue::try_from(encode_world(name))
        .map_err(|e| StoreError::Protocol(format!("world name does not fit in metadata: {e}")))
}

impl std::fmt::Debug for WorldStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorldStore")
            .field("addr", &self.client.addr)
            .field("world", &self.world.name)
            .field("generation", &self.world.generation)
            .finish()
    }
}

impl WorldStore {
    /// The world's name.
    pub fn name(&self) -> &str {
        &self.world.name
    }

    /// The generation this handle talks to.
    pub fn generation(&self) -> u64 {
        self.world.generation
    }

    /// The connection this handle uses.
    pub fn client(&self) -> &StoreClient {
        &self.client
    }

    fn world(&self) -> Option<pb::WorldRef> {
        Some(self.world.clone())
    }

    fn error(&self, status: &Status, waited: Option<Duration>) -> StoreError {
        match StoreError::from_status(status, &self.world.name, &self.client.addr) {
            StoreError::StaleGeneration { world, current, .. } => StoreError::StaleGeneration {
                world,
                requested: self.world.generation,
                current,
            },
            StoreError::Timeout { what, .. } => StoreError::Timeout {
                what,
                after: waited.unwrap_or_default(),
            },
            other => other,
        }
    }

    /// Sends one request with this world's proof and a client-side deadline.
    async fn call<Q, R>(&self, method: Method, message: Q, waited: Option<Duration>) -> Result<R, StoreError>
    where
        Q: prost::Message + Send + Sync + 'static,
        R: prost::Message + Default + Send + 'static,
    {
        // Over this client's own bound the gRPC encoder would fail halfway
        // through the request body, which reaches us as an opaque HTTP/2
        // error: refuse it here, typed, before anything is sent.
        let len = message.encoded_len();
        if len > self.client.config.max_message_bytes {
            return Err(StoreError::LimitExceeded {
                limit: Limit::MessageBytes,
                max: self.client.config.max_message_bytes as u64,
                requested: len as u64,
            });
        }
        let config = &self.client.config;
        let deadline = match waited {
            Some(w) => w.saturating_add(config.wait_grace),
            None => config.op_timeout,
        };
        let fut = self.client.unary(method, Some(&self.auth), message);
        match tokio::time::timeout(deadline, fut).await {
            Ok(Ok(reply)) => Ok(reply),
            Ok(Err(status)) => Err(self.error(&status, waited)),
            Err(_) => Err(self.client.deadline_passed(deadline)),
        }
    }

    /// Sets `key` to `value`.
    pub async fn set(&self, k: impl AsRef<[u8]>, value: impl Into<Bytes>) -> Result<(), StoreError> {
        let m = pb::SetRequest {
            world: self.world(),
            key: key(k),
            value: value.into(),
        };
        self.call::<_, pb::SetResponse>(Method::Set, m, None).await?;
        Ok(())
    }

    /// Waits up to `timeout` for `key` to exist and returns its value.
    pub async fn get(&self, k: impl AsRef<[u8]>, timeout: Duration) -> Result<Bytes, StoreError> {
        let m = pb::GetRequest {
            world: self.world(),
            key: key(k),
            timeout_ms: wire_ms(timeout),
        };
        let r = self
            .call::<_, pb::GetResponse>(Method::Get, m, Some(timeout))
            .await?;
        Ok(r.value)
    }

    /// The value of `key` if it exists, without waiting.
    pub async fn try_get(&self, k: impl AsRef<[u8]>) -> Result<Option<Bytes>, StoreError> {
        let m = pb::TryGetRequest {
            world: self.world(),
            key: key(k),
        };
        let r = self
            .call::<_, pb::TryGetResponse>(Method::TryGet, m, None)
            .await?;
        Ok(r.value)
    }

    /// Atomically adds `delta` to the counter at `key` (absent = 0) and
    /// returns the new value.
    pub async fn add(&self, k: impl AsRef<[u8]>, delta: i64) -> Result<i64, StoreError> {
        let m = pb::AddRequest {
            world: self.world(),
            key: key(k),
            delta,
        };
        let r = self.call::<_, pb::AddResponse>(Method::Add, m, None).await?;
        Ok(r.value)
    }

    /// Sets `key` to `desired` if its value is `expected` (`None`: if the key
    /// does not exist).
    pub async fn compare_and_set(
        &self,
        k: impl AsRef<[u8]>,
        expected: Option<&[u8]>,
        desired: impl Into<Bytes>,
    ) -> Result<CasOutcome, StoreError> {
        let m = pb::CompareAndSetRequest {
            world: self.world(),
            key: key(k),
            expected: expected.map(Bytes::copy_from_slice),
            desired: desired.into(),
        };
        let r = self
            .call::<_, pb::CompareAndSetResponse>(Method::CompareAndSet, m, None)
            .await?;
        Ok(CasOutcome {
            swapped: r.swapped,
            current: r.current,
        })
    }

    /// Waits up to `timeout` until every key exists.
    pub async fn wait<K: AsRef<[u8]>>(&self, ks: &[K], timeout: Duration) -> Result<(), StoreError> {
        let m = pb::WaitRequest {
            world: self.world(),
            keys: keys(ks),
            timeout_ms: wire_ms(timeout),
        };
        self.call::<_, pb::WaitResponse>(Method::Wait, m, Some(timeout))
            .await?;
        Ok(())
    }

    /// Whether every key exists, without waiting.
    pub async fn check<K: AsRef<[u8]>>(&self, ks: &[K]) -> Result<bool, StoreError> {
        let m = pb::CheckRequest {
            world: self.world(),
            keys: keys(ks),
        };
        let r = self.call::<_, pb::CheckResponse>(Method::Check, m, None).await?;
        Ok(r.all_present)
    }

    /// Deletes `key`; returns whether it existed.
    pub async fn delete(&self, k: impl AsRef<[u8]>) -> Result<bool, StoreError> {
        let m = pb::DeleteRequest {
            world: self.world(),
            key: key(k),
        };
        let r = self
            .call::<_, pb::DeleteResponse>(Method::Delete, m, None)
            .await?;
        Ok(r.existed)
    }

    /// Waits up to `timeout` until every key exists and returns their values
    /// in the order asked.
    pub async fn multi_get<K: AsRef<[u8]>>(
        &self,
        ks: &[K],
        timeout: Duration,
    ) -> Result<Vec<Bytes>, StoreError> {
        let m = pb::MultiGetRequest {
            world: self.world(),
            keys: keys(ks),
            timeout_ms: wire_ms(timeout),
        };
        let r = self
            .call::<_, pb::MultiGetResponse>(Method::MultiGet, m, Some(timeout))
            .await?;
        if r.values.len() != ks.len() {
            return Err(StoreError::Protocol(format!(
                "asked for {} keys, got {} values",
                ks.len(),
                r.values.len()
            )));
        }
        Ok(r.values)
    }

    /// Sets every entry at once (all or none).
    pub async fn multi_set<K, V>(&self, entries: impl IntoIterator<Item = (K, V)>) -> Result<(), StoreError>
    where
        K: AsRef<[u8]>,
        V: Into<Bytes>,
    {
        let m = pb::MultiSetRequest {
            world: self.world(),
            entries: entries
                .into_iter()
                .map(|(k, v)| pb::KeyValue {
                    key: key(k),
                    value: v.into(),
                })
                .collect(),
        };
        self.call::<_, pb::MultiSetResponse>(Method::MultiSet, m, None)
            .await?;
        Ok(())
    }

    /// Appends `value` to `key`'s value (creating it); returns the new length.
    pub async fn append(&self, k: impl AsRef<[u8]>, value: impl Into<Bytes>) -> Result<u64, StoreError> {
        let m = pb::AppendRequest {
            world: self.world(),
            key: key(k),
            value: value.into(),
        };
        let r = self
            .call::<_, pb::AppendResponse>(Method::Append, m, None)
            .await?;
        Ok(r.length)
    }

    /// Number of keys in the world's store.
    pub async fn num_keys(&self) -> Result<u64, StoreError> {
        let m = pb::NumKeysRequest { world: self.world() };
        let r = self
            .call::<_, pb::NumKeysResponse>(Method::NumKeys, m, None)
            .await?;
        Ok(r.count)
    }

    /// Round trip to this world's store (fails if it is closed or replaced).
    pub async fn ping(&self) -> Result<Duration, StoreError> {
        let started = Instant::now();
        let m = pb::PingRequest { world: self.world() };
        self.call::<_, pb::PingResponse>(Method::Ping, m, None).await?;
        Ok(started.elapsed())
    }

    /// Closes this generation of the world's store on the server (waking its
    /// waiters with `Closed`). Returns whether this call closed it.
    pub async fn close(&self) -> Result<bool, StoreError> {
        let m = pb::CloseRequest { world: self.world() };
        let r = self.call::<_, pb::CloseResponse>(Method::Close, m, None).await?;
        Ok(r.closed)
    }
}
