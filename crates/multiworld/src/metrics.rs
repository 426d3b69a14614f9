//! Metrics: what a process's worlds are doing, in Prometheus' text format,
//! built on `prometheus-client`, and the opt-in HTTP endpoint that serves
//! them (`ManagerConfig::metrics_addr`, `MULTIWORLD_METRICS_ADDR`).
//!
//! Two kinds of series:
//! - **Per world** (labels `world`, `generation`, `rank`, and `peer` or `op`
//!   where they apply), read from the live worlds at each scrape by
//!   [`WorldsCollector`]: state, bytes and messages sent and received per
//!   peer, seconds since each peer was last heard, operation latency
//!   histograms by kind. A removed world is no longer in the manager's
//!   registry, so its series disappear with it: cardinality follows the
//!   worlds that exist, however many come and go.
//! - **Per process**, registered once in [`Metrics`]: joins, breaks by
//!   cause, watchdog stalls, abort and teardown durations, store round trips,
//!   worlds by state.
//!
//! The catalogue, with every name and label, is in `docs/operations.md`.

use std::{
    net::SocketAddr,
    sync::{Arc, Mutex, PoisonError, Weak},
    time::{Duration, Instant},
};

use bytes::Bytes;
use http_body_util::Full;
use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric},
    metrics::{
        MetricType,
        counter::{ConstCounter, Counter},
        family::Family,
        gauge::ConstGauge,
        histogram::{Histogram, exponential_buckets},
    },
    registry::Registry as PromRegistry,
};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::{
    lifecycle::WorldState,
    world::{Registry, Slot, WorldShared},
};

/// Latency buckets: 10 µs to ~2.6 s, ×4 per bucket.
fn latency_buckets() -> impl Iterator<Item = f64> {
    exponential_buckets(1e-5, 4.0, 10)
}

fn latency_histogram() -> Histogram {
    Histogram::new(latency_buckets())
}

/// The label of a break's cause (`BreakCause::kind`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct CauseLabel {
    pub(crate) cause: &'static str,
}

/// The process-level metrics of one manager, and the registry that encodes
/// them together with its worlds' series.
pub(crate) struct Metrics {
    registry: PromRegistry,
    pub(crate) joins: Counter,
    pub(crate) breaks: Family<CauseLabel, Counter>,
    pub(crate) watchdog_stalls: Counter,
    pub(crate) abort_seconds: Histogram,
    pub(crate) teardown_seconds: Histogram,
    pub(crate) store_round_trip_seconds: Histogram,
    /// The process's last break, shown until the next one (one series).
    pub(crate) last_break: Arc<Mutex<Option<LastBreak>>>,
}

/// The last world of the process that broke.
#[derive(Debug, Clone)]
pub(crate) struct LastBreak {
    pub(crate) world: String,
    pub(crate) generation: u64,
    pub(crate) rank: u32,
    pub(crate) cause: &'static str,
    /// When, as Unix time in seconds.
    pub(crate) at_unix: f64,
}

#[derive(Debug)]
struct LastBreakCollector(Arc<Mutex<Option<LastBreak>>>);

impl Collector for LastBreakCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let last = self.0.lock().unwrap_or_else(PoisonError::into_inner).clone();
        let Some(b) = last else {
            return Ok(());
        };
        let mut fam = encoder.encode_descriptor(
            "multiworld_last_break_timestamp_seconds",
            "When the process's last world break happened (Unix time), with its world and cause",
            None,
            MetricType::Gauge,
        )?;
        let labels = [
            ("world", label_value(&b.world)),
            ("generation", b.generation.to_string()),
            ("rank", b.rank.to_string()),
            ("cause", b.cause.to_string()),
        ];
        ConstGauge::new(b.at_unix).encode(fam.encode_family(&labels)?)
    }
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Metrics {
    /// The metrics of a manager whose worlds are in `worlds`.
    pub(crate) fn new(worlds: Weak<Registry>) -> Metrics {
        let mut registry = PromRegistry::default();
        let joins = Counter::default();
        let breaks = Family::<CauseLabel, Counter>::default();
        let watchdog_stalls = Counter::default();
        let abort_seconds = latency_histogram();
        let teardown_seconds = latency_histogram();
        let store_round_trip_seconds = latency_histogram();
        registry.register("multiworld_joins", "Worlds joined by this process", joins.clone());
        registry.register(
            "multiworld_breaks",
            "Worlds of this process that broke, by cause",
            breaks.clone(),
        );
        registry.register(
            "multiworld_watchdog_stalls",
            "Times a world's watchdog was found not running (runtime blocked or starved)",
            watchdog_stalls.clone(),
        );
        registry.register(
            "multiworld_abort_duration_seconds",
            "From a world's break to every pending operation of it failed",
            abort_seconds.clone(),
        );
        registry.register(
            "multiworld_teardown_duration_seconds",
            "From the start of a world's teardown (at a break, or after a leave's goodbyes) to its removal",
            teardown_seconds.clone(),
        );
        registry.register(
            "multiworld_store_round_trip_seconds",
            "Request/response calls to the worlds' stores (barrier keys, break announcements, closes)",
            store_round_trip_seconds.clone(),
        );
        registry.register_collector(Box::new(WorldsCollector { worlds }));
        let last_break = Arc::new(Mutex::new(None));
        registry.register_collector(Box::new(LastBreakCollector(Arc::clone(&last_break))));
        Metrics {
            registry,
            joins,
            breaks,
            watchdog_stalls,
            abort_seconds,
            teardown_seconds,
            store_round_trip_seconds,
            last_break,
        }
    }

    /// Every series now, in Prometheus' text format.
    pub(crate) fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// Operation latencies of one world, by kind (a handful of kinds per world:
/// a short list under a lock held for one observation).
#[derive(Default)]
pub(crate) struct OpLatencies(Mutex<Vec<(&'static str, Histogram)>>);

impl OpLatencies {
    /// Records one operation of `kind` that took `took`.
    pub(crate) fn observe(&self, kind: &'static str, took: Duration) {
        let mut v = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let secs = took.as_secs_f64();
        if let Some((_, h)) = v.iter().find(|(k, _)| *k == kind) {
            h.observe(secs);
            return;
        }
        let h = latency_histogram();
        h.observe(secs);
        v.push((kind, h));
    }

    fn each(
        &self,
        mut f: impl FnMut(&'static str, &Histogram) -> Result<(), std::fmt::Error>,
    ) -> Result<(), std::fmt::Error> {
        let v = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        for (k, h) in v.iter() {
            f(k, h)?;
        }
        Ok(())
    }
}

/// Reads the per-world series from the live worlds at each scrape.
#[derive(Debug)]
struct WorldsCollector {
    worlds: Weak<Registry>,
}

/// What one scrape reads of one world, once: its state, labels, and each
/// peer's traffic counters and liveness.
struct Seen {
    w: Arc<WorldShared>,
    state: WorldState,
    labels: [(&'static str, String); 3],
    traffic: Vec<multiworld_tcp::PeerStats>,
    liveness: Vec<multiworld_tcp::PeerLiveness>,
}

impl Seen {
    fn of(w: Arc<WorldShared>) -> Seen {
        let traffic = (0..w.size)
            .map(multiworld_types::Rank)
            .filter(|&r| r != w.rank)
            .filter_map(|r| w.comm.peer_stats(r))
            .collect();
        Seen {
            state: w.state(),
            labels: [
                ("world", label_value(w.name.as_str())),
                ("generation", w.generation.0.to_string()),
                ("rank", w.rank.0.to_string()),
            ],
            traffic,
            liveness: w.comm.liveness(),
            w,
        }
    }

    /// The world's labels and one more.
    fn with(&self, key: &'static str, value: String) -> [(&'static str, String); 4] {
        let [a, b, c] = self.labels.clone();
        [a, b, c, (key, value)]
    }
}

impl Collector for WorldsCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let Some(registry) = self.worlds.upgrade() else {
            return Ok(());
        };
        let mut joining = 0i64;
        let mut members: Vec<Arc<WorldShared>> = Vec::new();
        for e in registry.iter() {
            match e.value() {
                Slot::Joining { .. } => joining += 1,
                Slot::Member(w) => members.push(Arc::clone(w)),
            }
        }
        members.sort_by(|a, b| a.name.as_str().cmp(b.name.as_str()));
        let seen: Vec<Seen> = members.into_iter().map(Seen::of).collect();

        {
            let mut by_state = encoder.encode_descriptor(
                "multiworld_worlds",
                "Worlds of this process by state",
                None,
                MetricType::Gauge,
            )?;
            for label in ["joining", "ready", "broken", "removed"] {
                let n = if label == "joining" {
                    joining
                } else {
                    seen.iter().filter(|s| s.state.label() == label).count() as i64
                };
                ConstGauge::new(n).encode(by_state.encode_family(&[("state", label)])?)?;
            }
        }
        {
            let mut state = encoder.encode_descriptor(
                "multiworld_world_state",
                "1 for the state each world is in (label state), with its break cause",
                None,
                MetricType::Gauge,
            )?;
            for s in &seen {
                let cause = match &s.state {
                    WorldState::Broken(c) => c.kind().to_string(),
                    _ => String::new(),
                };
                let [a, b, c] = s.labels.clone();
                let labels = [a, b, c, ("state", s.state.label().to_string()), ("cause", cause)];
                ConstGauge::new(1i64).encode(state.encode_family(&labels)?)?;
            }
        }
        type Pick = fn(&multiworld_tcp::PeerStats) -> u64;
        let traffic: [(&'static str, &'static str, Pick); 5] = [
            ("multiworld_sent_bytes", "Payload bytes sent to each peer", |p| {
                p.bytes_sent
            }),
            (
                "multiworld_received_bytes",
                "Payload bytes received from each peer",
                |p| p.bytes_received,
            ),
            ("multiworld_sent_messages", "Messages sent to each peer", |p| {
                p.messages_sent
            }),
            (
                "multiworld_received_messages",
                "Messages received from each peer",
                |p| p.messages_received,
            ),
            (
                "multiworld_received_in_call_messages",
                "Messages from each peer whose payload the receiving call read from the socket itself",
                |p| p.messages_read_in_call,
            ),
        ];
        for (name, help, pick) in traffic {
            let mut fam = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for s in &seen {
                for p in &s.traffic {
                    let labels = s.with("peer", p.rank.0.to_string());
                    ConstCounter::new(pick(p)).encode(fam.encode_family(&labels)?)?;
                }
            }
        }
        {
            let now = Instant::now();
            let mut heard = encoder.encode_descriptor(
                "multiworld_peer_last_heard_seconds",
                "Seconds since anything (data or a heartbeat) last arrived from each peer",
                None,
                MetricType::Gauge,
            )?;
            for s in &seen {
                for p in &s.liveness {
                    let labels = s.with("peer", p.rank.0.to_string());
                    let ago = now.saturating_duration_since(p.last_heard).as_secs_f64();
                    ConstGauge::new(ago).encode(heard.encode_family(&labels)?)?;
                }
            }
        }
        {
            let mut rtt = encoder.encode_descriptor(
                "multiworld_heartbeat_rtt_seconds",
                "The last heartbeat round trip to each peer (heartbeats echo each other)",
                None,
                MetricType::Gauge,
            )?;
            for s in &seen {
                for p in &s.liveness {
                    if let Some(d) = p.heartbeat_rtt {
                        let labels = s.with("peer", p.rank.0.to_string());
                        ConstGauge::new(d.as_secs_f64()).encode(rtt.encode_family(&labels)?)?;
                    }
                }
            }
        }
        {
            let mut ops = encoder.encode_descriptor(
                "multiworld_op_duration_seconds",
                "Duration of each world's operations by kind (label op), failed ones included",
                None,
                MetricType::Histogram,
            )?;
            for s in &seen {
                s.w.latencies.each(|kind, h| {
                    let labels = s.with("op", kind.to_string());
                    h.encode(ops.encode_family(&labels)?)
                })?;
            }
        }
        Ok(())
    }
}

/// A running metrics endpoint; dropping it stops it.
#[derive(Debug)]
pub(crate) struct Endpoint {
    pub(crate) addr: SocketAddr,
    stop: CancellationToken,
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// `s` as a label value of the text format: the encoder writes values as
/// they are, so a backslash or a double quote in a world's name must be
/// escaped here, or the whole page would not parse. (A world's name holds
/// no control character; a line break is escaped all the same.)
fn label_value(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

/// Most connections the endpoint serves at once; more are closed at once.
const MAX_CONNECTIONS: usize = 64;

/// How long a client may take to send a request's head.
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

/// Longest one connection is kept (a scraper that keeps its connection
/// alive opens another).
const CONNECTION_LIFETIME: Duration = Duration::from_secs(60);

/// Serves `GET /metrics` (and `/`) with `metrics` on `bind` over HTTP/1.1,
/// until `stop` is cancelled or the endpoint dropped. Binds at once (so a
/// taken port is an error here); needs a Tokio runtime (an error without
/// one). At most [`MAX_CONNECTIONS`] at once, each given [`HEADER_TIMEOUT`]
/// for a request's head and closed after [`CONNECTION_LIFETIME`]: a client
/// that connects and stalls holds nothing for long.
pub(crate) fn serve(
    bind: SocketAddr,
    metrics: Weak<Metrics>,
    stop: &CancellationToken,
) -> std::io::Result<Endpoint> {
    let runtime = tokio::runtime::Handle::try_current().map_err(|_| {
        std::io::Error::other("the metrics endpoint needs a Tokio runtime, and none is running here")
    })?;
    let _in_runtime = runtime.enter();
    let std_listener = std::net::TcpListener::bind(bind)?;
    std_listener.set_nonblocking(true)?;
    let listener = TcpListener::from_std(std_listener)?;
    let addr = listener.local_addr()?;
    let token = stop.child_token();
    let run = token.clone();
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    tokio::spawn(async move {
        loop {
            let (stream, _) = tokio::select! {
                _ = run.cancelled() => return,
                accepted = listener.accept() => match accepted {
                    Ok(s) => s,
                    Err(e) => {
                        tracing::debug!(error = %e, "metrics endpoint: accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
                tracing::debug!("metrics endpoint: {MAX_CONNECTIONS} connections open; closing a new one");
                continue;
            };
            let metrics = metrics.clone();
            let conn_stop = run.clone();
            tokio::spawn(async move {
                let _slot = slot;
                let service =
                    hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                        let metrics = metrics.clone();
                        async move { Ok::<_, std::convert::Infallible>(respond(req.uri().path(), &metrics)) }
                    });
                let conn = hyper::server::conn::http1::Builder::new()
                    .timer(hyper_util::rt::TokioTimer::new())
                    .header_read_timeout(HEADER_TIMEOUT)
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
                tokio::select! {
                    _ = conn_stop.cancelled() => {}
                    // A scraper that goes away mid-request is not our problem.
                    _ = conn => {}
                    _ = tokio::time::sleep(CONNECTION_LIFETIME) => {}
                }
            });
        }
    });
    Ok(Endpoint { addr, stop: token })
}

fn respond(path: &str, metrics: &Weak<Metrics>) -> hyper::Response<Full<Bytes>> {
    let reply = |status: http::StatusCode, content_type: &'static str, body: String| {
        let mut r = hyper::Response::new(Full::new(Bytes::from(body)));
        *r.status_mut() = status;
        r.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static(content_type),
        );
        r
    };
    match (path, metrics.upgrade()) {
        ("/metrics" | "/", Some(m)) => reply(
            http::StatusCode::OK,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            m.encode(),
        ),
        ("/metrics" | "/", None) => reply(
            http::StatusCode::SERVICE_UNAVAILABLE,
            "text/plain; charset=utf-8",
            "the manager is gone\n".into(),
        ),
        _ => reply(
            http::StatusCode::NOT_FOUND,
            "text/plain; charset=utf-8",
            "not found: the metrics are at /metrics\n".into(),
        ),
    }
}
