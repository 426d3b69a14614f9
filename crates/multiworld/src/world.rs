//! One world this process is a member of: the [`World`] handle users call,
//! and the state behind it — its lifecycle, its communicator, its store, and
//! the two tasks that watch it:
//!
//! - the **watchdog** gathers observations (each peer's last sign of life and
//!   connection state from the communicator, the store's status), calls the
//!   pure [`decide`], logs the reason when it changes, and breaks the world
//!   when told to;
//! - the **store watcher** keeps one long-poll on the world's `broken` key,
//!   so a member that breaks the world tells every other member at once, and a
//!   dead or closed store is noticed as soon as its connection fails.
//!
//! Breaking a world aborts its communicator first (every pending operation
//! fails at once), takes its flight record (what it was doing: see
//! `recorder`), then announces the cause in the store, cancels the world's
//! tasks, closes the store if this process hosts it, and finally emits
//! `Removed`. Nothing here is shared with any other world.
//!
//! Every operation (point to point and collective) goes through one
//! [`OpGuard`]: it registers the deadline (with `op_timeout`), records the
//! operation in the flight recorder and its duration in the world's latency
//! histograms.

use std::{
    path::PathBuf,
    sync::{Arc, Mutex, MutexGuard, Weak},
    time::{Duration, Instant, SystemTime},
};

use dashmap::DashMap;
use multiworld_collectives::Group;
use multiworld_store::{StoreError, StoreServer, WorldStore};
use multiworld_tcp::{Communicator, Error as TcpError, Received};
use multiworld_types::{Generation, Rank, Tag, Tensor, TensorView, WorldName};
use tokio::sync::{broadcast, watch};
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use tracing::Instrument;

use crate::{
    config::WorldConfig,
    error::WorldError,
    events::WorldEvent,
    lifecycle::{BreakCause, Lifecycle, Transition, WorldState},
    metrics::{CauseLabel, Metrics, OpLatencies},
    recorder::{FlightRecord, FlightRecorder, OpStart, Outcome},
    watchdog::{Observations, PeerObservation, ReasonLog, Verdict, decide},
};

/// The tag of the tokens [`World::finish`] exchanges: one of the runtime's
/// own, outside both the users' tags and every collective's.
const FINISH_TAG: Tag = multiworld_types::runtime_tag(0);

/// Pause between a barrier's tries while its store is unreachable.
const BARRIER_RETRY: Duration = Duration::from_millis(50);

/// The store key through which a member announces that it broke the world.
/// Its value is `"<rank>\n<cause>"`.
pub(crate) const BROKEN_KEY: &str = "multiworld/broken";

/// How long a breaking member spends telling the others through the store.
const ANNOUNCE_TIMEOUT: Duration = Duration::from_millis(500);
/// Ended operations of a broken world's flight record shown in its log line.
const LOGGED_OPS: usize = 8;
/// How long teardown waits for the world's tasks before giving up on them
/// (they are cancelled; this only bounds a task that ignores cancellation).
const TEARDOWN_WAIT: Duration = Duration::from_secs(2);
/// Longest a teardown waits for its flight record to be written.
const FLIGHT_WRITE_WAIT: Duration = Duration::from_secs(2);

/// Where the manager keeps its members, by name.
pub(crate) type Registry = DashMap<WorldName, Slot>;

/// A name in the registry: being joined, or a member.
pub(crate) enum Slot {
    /// Reserved by a join in progress, with the rank and size it joins as
    /// (the generation is known only once the store is opened).
    Joining {
        rank: Rank,
        size: u32,
    },
    Member(Arc<WorldShared>),
}

/// What the store watcher has seen.
#[derive(Debug, Clone)]
struct StoreStatus {
    /// When the store was last known to work (set to the moment of the first
    /// failure while it fails).
    last_ok: Instant,
    error: Option<String>,
    gone: Option<String>,
    reported: Option<(u32, String)>,
}

/// The state of one member world.
pub(crate) struct WorldShared {
    pub(crate) name: WorldName,
    pub(crate) generation: Generation,
    pub(crate) rank: Rank,
    pub(crate) size: u32,
    pub(crate) config: WorldConfig,
    pub(crate) comm: Arc<Communicator>,
    /// The runtime the world joined in: its teardown is spawned there,
    /// whichever thread breaks or leaves the world (`World::abort` may be
    /// called from a thread of no runtime).
    runtime: tokio::runtime::Handle,
    /// The world group of the collectives: one per membership, because a
    /// group numbers its calls and every member must number them alike.
    collectives: Group,
    pub(crate) store: WorldStore,
    pub(crate) store_addr: String,
    /// The server hosting this world's store, when this process hosts it.
    host: Option<Arc<StoreServer>>,
    lifecycle: Mutex<Lifecycle>,
    /// The cause of the break, kept after removal so late callers still learn
    /// why (`None` if the world was left, not broken).
    cause: std::sync::OnceLock<BreakCause>,
    /// Cancels the world's tasks and its communicator (a child of the
    /// manager's root token).
    token: CancellationToken,
    /// Cancelled the moment the world breaks or is left, to interrupt waits
    /// that are not on the communicator (barriers in the store).
    ended: CancellationToken,
    /// Set by [`World::finish`]: every member is about to leave, so orderly
    /// departures (a goodbye, a "left" announcement, the store closing) are
    /// expected and no longer break the world. Crashes still do.
    closing: std::sync::atomic::AtomicBool,
    /// Operations in flight with a deadline, earliest first (only when
    /// `op_timeout` is set), and a poke for the watchdog when one is added.
    deadlines: Mutex<std::collections::BTreeMap<(Instant, u64), &'static str>>,
    next_op: std::sync::atomic::AtomicU64,
    deadline_added: tokio::sync::Notify,
    /// Barriers this member has entered.
    barriers: std::sync::atomic::AtomicU64,
    tasks: TaskTracker,
    events: broadcast::Sender<WorldEvent>,
    registry: Weak<Registry>,
    /// Microseconds after `epoch` of the watchdog's last tick.
    last_tick_us: std::sync::atomic::AtomicU64,
    epoch: Instant,
    removed: watch::Sender<bool>,
    /// What the world did lately (see `recorder`).
    recorder: FlightRecorder,
    /// Its operations' durations by kind.
    pub(crate) latencies: OpLatencies,
    /// The manager's process-level metrics.
    metrics: Arc<Metrics>,
    /// Where a broken world's flight record is written (one JSON file).
    flight_dir: Option<PathBuf>,
    /// The record taken at the break, for the teardown to write there.
    break_record: std::sync::OnceLock<Arc<FlightRecord>>,
    /// The span the world's tasks run in (fields world, generation, rank),
    /// so every line they log carries them (e.g. in JSON logs).
    span: tracing::Span,
    /// The world's NCCL communicator (NCCL worlds only), set once at join.
    #[cfg(feature = "nccl")]
    pub(crate) device: std::sync::OnceLock<Arc<crate::device::DeviceSide>>,
    /// Host memory kept for host-staged device transfers (any world).
    #[cfg(feature = "nccl")]
    pub(crate) host_staging: crate::device::HostStaging,
}

/// What a completed join brings to a new [`WorldShared`].
pub(crate) struct Joined {
    pub(crate) config: WorldConfig,
    pub(crate) comm: Arc<Communicator>,
    pub(crate) store: WorldStore,
    pub(crate) store_addr: String,
    /// The server hosting the world's store, when this process hosts it.
    pub(crate) host: Option<Arc<StoreServer>>,
}

/// Where a world reports to: its cancellation (a child of the manager's
/// root token), the manager's event channel and registry.
pub(crate) struct Attachments {
    pub(crate) token: CancellationToken,
    pub(crate) events: broadcast::Sender<WorldEvent>,
    pub(crate) registry: Weak<Registry>,
    pub(crate) metrics: Arc<Metrics>,
    /// Operations the flight recorder keeps once ended.
    pub(crate) flight_capacity: usize,
    pub(crate) flight_dir: Option<PathBuf>,
}

impl WorldShared {
    pub(crate) fn new(joined: Joined, attach: Attachments) -> Arc<WorldShared> {
        let Joined {
            config,
            comm,
            store,
            store_addr,
            host,
        } = joined;
        let Attachments {
            token,
            events,
            registry,
            metrics,
            flight_capacity,
            flight_dir,
        } = attach;
        let epoch = Instant::now();
        let span = tracing::info_span!(
            "world",
            world = %config.name,
            generation = store.generation(),
            rank = config.rank.0
        );
        let mut lifecycle = Lifecycle::new();
        // A fresh lifecycle is Joining, so this cannot be refused.
        let _ = lifecycle.ready();
        Arc::new_cyclic(|me| WorldShared {
            name: config.name.clone(),
            generation: Generation(store.generation()),
            rank: config.rank,
            size: config.size,
            config,
            collectives: Group::world(&comm).with_observer(Arc::new(CollectiveCalls(me.clone()))),
            comm,
            // `new` runs in the join, inside a runtime.
            runtime: tokio::runtime::Handle::current(),
            store,
            store_addr,
            host,
            lifecycle: Mutex::new(lifecycle),
            cause: std::sync::OnceLock::new(),
            token,
            ended: CancellationToken::new(),
            closing: std::sync::atomic::AtomicBool::new(false),
            deadlines: Mutex::new(std::collections::BTreeMap::new()),
            next_op: std::sync::atomic::AtomicU64::new(0),
            deadline_added: tokio::sync::Notify::new(),
            barriers: std::sync::atomic::AtomicU64::new(0),
            tasks: TaskTracker::new(),
            events,
            registry,
            last_tick_us: std::sync::atomic::AtomicU64::new(0),
            epoch,
            removed: watch::Sender::new(false),
            recorder: FlightRecorder::new(flight_capacity, epoch, SystemTime::now()),
            latencies: OpLatencies::default(),
            metrics,
            flight_dir,
            break_record: std::sync::OnceLock::new(),
            span,
            #[cfg(feature = "nccl")]
            device: std::sync::OnceLock::new(),
            #[cfg(feature = "nccl")]
            host_staging: crate::device::HostStaging::default(),
        })
    }

    /// Starts the watchdog and the store watcher.
    pub(crate) fn start(self: &Arc<Self>) {
        if self.token.is_cancelled() {
            // Torn down before it started (a shutdown that came as its join
            // ended): no watchdog or store watcher for a removed world.
            self.tasks.close();
            return;
        }
        let (tx, rx) = watch::channel(StoreStatus {
            last_ok: Instant::now(),
            error: None,
            gone: None,
            reported: None,
        });
        self.tasks
            .spawn(store_watcher(Arc::clone(self), tx).instrument(self.span.clone()));
        self.tasks
            .spawn(watchdog(Arc::clone(self), rx).instrument(self.span.clone()));
        self.tasks.close();
    }

    /// The lifecycle, locked. Never held across an `.await`; a poisoned lock
    /// (a panic while holding it, which its short sections do not do) still
    /// yields the state.
    fn lifecycle(&self) -> MutexGuard<'_, Lifecycle> {
        self.lifecycle.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn state(&self) -> WorldState {
        self.lifecycle().state().clone()
    }

    fn tick(&self) {
        let us = self.epoch.elapsed().as_micros() as u64;
        self.last_tick_us.store(us, std::sync::atomic::Ordering::Relaxed);
    }

    pub(crate) fn last_tick(&self) -> Instant {
        self.epoch + Duration::from_micros(self.last_tick_us.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// The error every operation gets once the world is not ready.
    pub(crate) fn unusable(&self) -> WorldError {
        match self.cause.get() {
            Some(cause) => WorldError::Broken {
                world: self.name.clone(),
                cause: cause.clone(),
            },
            None => WorldError::NotJoined {
                world: self.name.to_string(),
            },
        }
    }

    /// Starts tracking an operation: its deadline (when the world has
    /// `op_timeout`), its flight record and its duration. The guard ends it.
    pub(crate) fn track(self: &Arc<Self>, start: OpStart) -> OpGuard {
        let now = Instant::now();
        let deadline = self.config.op_timeout.map(|after| {
            let key = (
                now + after,
                self.next_op.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            );
            self.deadlines
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(key, start.kind);
            self.deadline_added.notify_one();
            key
        });
        OpGuard {
            world: Arc::clone(self),
            seq: self.recorder.begin(start, now),
            kind: start.kind,
            started: now,
            deadline,
            outcome: None,
        }
    }

    /// Runs one request/response call to the world's store, timing it as a
    /// store round trip.
    /// Runs a request/response call to the world's store, timing it. A call
    /// cut off (its future dropped by a bound around it) is counted too, with
    /// the time it had taken: the slow calls are the ones to see.
    async fn store_call<T>(&self, call: impl std::future::Future<Output = T>) -> T {
        struct Timed<'a>(&'a Metrics, Instant);
        impl Drop for Timed<'_> {
            fn drop(&mut self) {
                self.0
                    .store_round_trip_seconds
                    .observe(self.1.elapsed().as_secs_f64());
            }
        }
        let _timed = Timed(&self.metrics, Instant::now());
        call.await
    }

    /// The flight record now (see `recorder`), with `reason` as its heading.
    pub(crate) fn flight_record(&self, reason: &str) -> FlightRecord {
        self.recorder.snapshot(
            self.name.as_str(),
            self.generation.0,
            self.rank.0,
            reason,
            Instant::now(),
        )
    }

    /// Writes the record taken at the break to `flight_dir` as
    /// `<world>-g<generation>-r<rank>.json` ([`flight_file_name`]; best
    /// effort: a write that fails
    /// is logged, never fatal). Called by the teardown, so the file is there
    /// before the world is reported removed. The file system is used on a
    /// blocking-pool thread, never on a runtime thread (a hung mount would
    /// stall every world's heartbeats), and waited for at most
    /// [`FLIGHT_WRITE_WAIT`].
    async fn write_flight_record(&self) {
        let (Some(dir), Some(record)) = (&self.flight_dir, self.break_record.get()) else {
            return;
        };
        let name = flight_file_name(self.name.as_str(), self.generation.0, self.rank.0);
        let file = dir.join(&name);
        // Written whole under a hidden name, then renamed: a reader never
        // sees a partial record under the final name.
        let partial = dir.join(format!(".{name}.partial"));
        let bytes = match serde_json::to_vec_pretty(&**record) {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(world = %self.name, error = %e, "could not encode the flight record");
                return;
            }
        };
        let (dir, path) = (dir.clone(), file.clone());
        let write = tokio::task::spawn_blocking(move || {
            std::fs::create_dir_all(&dir)
                .and_then(|()| std::fs::write(&partial, bytes))
                .and_then(|()| std::fs::rename(&partial, &path))
        });
        match tokio::time::timeout(FLIGHT_WRITE_WAIT, write).await {
            Ok(written) => match written.map_err(std::io::Error::other).and_then(|r| r) {
                Ok(()) => tracing::info!(world = %self.name, file = %file.display(), "flight record written"),
                Err(e) => {
                    tracing::warn!(world = %self.name, file = %file.display(), error = %e, "could not write the flight record")
                }
            },
            Err(_) => tracing::warn!(
                world = %self.name,
                file = %file.display(),
                "the flight record was not written within {FLIGHT_WRITE_WAIT:?}; going on without it"
            ),
        }
    }

    fn earliest_deadline(&self) -> Option<crate::watchdog::PendingOp> {
        let after = self.config.op_timeout?;
        let deadlines = self.deadlines.lock().unwrap_or_else(|e| e.into_inner());
        deadlines
            .first_key_value()
            .map(|(&(deadline, _), &op)| crate::watchdog::PendingOp {
                op: op.to_string(),
                deadline,
                timeout: after,
            })
    }

    /// Refuses the tags reserved for the runtime and the collectives.
    pub(crate) fn check_tag(&self, tag: Tag) -> Result<(), WorldError> {
        if multiworld_types::is_internal_tag(tag) {
            return Err(WorldError::InvalidArgument {
                world: self.name.clone(),
                detail: format!("tag {:#x} is reserved: user tags must be below 2^31", tag.0),
            });
        }
        Ok(())
    }

    pub(crate) fn check(&self) -> Result<(), WorldError> {
        if self.lifecycle().is_usable() {
            Ok(())
        } else {
            Err(self.unusable())
        }
    }

    /// Turns a communicator error into the caller's error; a world-fatal one
    /// breaks the world (if nothing broke it yet) and reports the recorded
    /// cause.
    fn fail(self: &Arc<Self>, err: TcpError) -> WorldError {
        if !err.is_world_fatal() {
            return WorldError::from_call(&self.name, err);
        }
        if let TcpError::PeerLost { rank, .. } = &err
            && self.closing.load(std::sync::atomic::Ordering::Relaxed)
            && self.comm.liveness().iter().any(|p| p.rank == *rank && p.departed)
        {
            // A member leaving in an orderly way while this one finishes is
            // expected (as the watchdog judges it): the operation fails, the
            // world does not break.
            return WorldError::from_call(&self.name, err);
        }
        let cause = match &err {
            TcpError::PeerLost { rank, cause } => BreakCause::PeerLost {
                rank: *rank,
                reason: cause.to_string(),
            },
            _ => BreakCause::Aborted,
        };
        self.break_with(cause);
        self.unusable()
    }

    /// Breaks the world for `cause` (the first cause wins) and starts its
    /// teardown. Synchronous: when it returns, every pending operation of the
    /// world has failed.
    pub(crate) fn break_with(self: &Arc<Self>, cause: BreakCause) {
        {
            let mut lifecycle = self.lifecycle();
            if lifecycle.break_with(cause.clone()) != Ok(Transition::Changed) {
                return;
            }
            // Set under the lifecycle lock, before anyone can see the world
            // broken, so `unusable` always finds it.
            let _ = self.cause.set(cause.clone());
        }
        let broke_at = Instant::now();
        // Taken before the abort, so operations pending at the break show as
        // pending (the abort ends them as failed).
        let record = self.flight_record(&format!("broken: {cause}"));
        tracing::warn!(world = %self.name, generation = self.generation.0, %cause, "world broken");
        self.comm
            .abort_with_reason(&format!("world '{}' broken: {cause}", self.name));
        self.ended.cancel();
        self.metrics
            .abort_seconds
            .observe(broke_at.elapsed().as_secs_f64());
        self.metrics
            .breaks
            .get_or_create(&CauseLabel { cause: cause.kind() })
            .inc();
        *self
            .metrics
            .last_break
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(crate::metrics::LastBreak {
            world: self.name.to_string(),
            generation: self.generation.0,
            rank: self.rank.0,
            cause: cause.kind(),
            at_unix: SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64()),
        });
        let pending: Vec<String> = record
            .pending()
            .map(|o| match o.peer {
                Some(p) => format!("{} (peer {p})", o.kind),
                None => o.kind.clone(),
            })
            .collect();
        tracing::warn!(
            world = %self.name,
            generation = self.generation.0,
            pending = ?pending,
            "flight record at the break (last operations; the whole record is on the Broken event{}):\n{}",
            if self.flight_dir.is_some() { " and in the flight recorder directory" } else { "" },
            record.tail(LOGGED_OPS).timeline()
        );
        let record = Arc::new(record);
        let _ = self.break_record.set(Arc::clone(&record));
        let _ = self.events.send(WorldEvent::Broken {
            world: self.name.clone(),
            generation: self.generation,
            cause: cause.clone(),
            record,
        });
        let announce = match &cause {
            // Told by the store: everybody already knows.
            BreakCause::ReportedByPeer { .. } | BreakCause::StoreLost { .. } => None,
            other => Some(format!("{}\n{other}", self.rank)),
        };
        let me = Arc::clone(self);
        let span = self.span.clone();
        self.runtime
            .spawn(async move { me.teardown(announce, false).await }.instrument(span));
    }

    /// Leaves the world on purpose: an orderly goodbye to the peers (who see
    /// this member leave and break their side), then the same teardown.
    pub(crate) async fn leave(self: &Arc<Self>) {
        let leaving = {
            let mut lifecycle = self.lifecycle();
            match lifecycle.state() {
                WorldState::Joining | WorldState::Ready => lifecycle.removed().is_ok(),
                WorldState::Broken(_) | WorldState::Removed => false,
            }
        };
        if leaving {
            tracing::info!(world = %self.name, generation = self.generation.0, "leaving world");
            self.ended.cancel();
            // A task of its own: a caller that stops waiting (a timeout, a
            // `select!`, Ctrl-C in Python) must not leave the world half
            // torn down, its name stuck and its `Removed` never sent.
            let me = Arc::clone(self);
            let span = self.span.clone();
            self.runtime.spawn(
                async move {
                    me.comm.close().await;
                    let announce = Some(format!("{}\nrank {} left the world", me.rank, me.rank));
                    me.teardown(announce, true).await;
                }
                .instrument(span),
            );
        }
        // Broken or left: its teardown is running (or done).
        self.wait_removed().await;
    }

    async fn teardown(self: Arc<Self>, announce: Option<String>, left: bool) {
        let started = Instant::now();
        if let Some(text) = announce {
            // Best effort: a dead store cannot be told anything.
            let _ = tokio::time::timeout(
                ANNOUNCE_TIMEOUT,
                self.store_call(self.store.set(BROKEN_KEY, text)),
            )
            .await;
        }
        self.token.cancel();
        // A world torn down before it started (a shutdown that came as its
        // join ended) has no tasks and a tracker nobody closed: close it, or
        // the wait below would last its whole bound.
        self.tasks.close();
        if tokio::time::timeout(TEARDOWN_WAIT, self.tasks.wait())
            .await
            .is_err()
        {
            tracing::error!(world = %self.name, "world tasks did not stop within {TEARDOWN_WAIT:?}");
        }
        if tokio::time::timeout(TEARDOWN_WAIT, self.comm.wait_closed())
            .await
            .is_err()
        {
            tracing::error!(world = %self.name, "communicator tasks did not stop within {TEARDOWN_WAIT:?}");
        }
        #[cfg(feature = "nccl")]
        if let Some(device) = self.device.get() {
            let outcome = Arc::clone(device).abort().await;
            if outcome.is_quarantined() {
                tracing::error!(
                    world = %self.name,
                    generation = self.generation.0,
                    ?outcome,
                    "the NCCL communicator did not abort in time: quarantined (leaked)"
                );
                let _ = self.events.send(WorldEvent::Quarantined {
                    world: self.name.clone(),
                    generation: self.generation,
                    reason: format!("{outcome:?}"),
                });
            } else {
                tracing::debug!(world = %self.name, ?outcome, "NCCL communicator aborted");
            }
        }
        // The kept (pinned) memory of host-staged device transfers goes back
        // now, not with the world's last reference (a transfer still
        // running fails with the communicator and frees its own).
        #[cfg(feature = "nccl")]
        self.host_staging.close();
        // Close exactly this generation of the world's store, so its waiters
        // wake and a re-join gets a fresh generation, even on a standalone
        // store that no member hosts.
        match &self.host {
            Some(host) => {
                host.close_world_generation(self.name.as_str(), self.generation.0);
            }
            None => {
                let _ = tokio::time::timeout(ANNOUNCE_TIMEOUT, self.store_call(self.store.close())).await;
            }
        }
        // After the peers were told and everything was let go: a slow disk
        // delays only this world's removal.
        self.write_flight_record().await;
        if !left {
            let _ = self.lifecycle().removed();
        }
        if let Some(registry) = self.registry.upgrade() {
            registry.remove_if(
                &self.name,
                |_, slot| matches!(slot, Slot::Member(w) if w.generation == self.generation),
            );
        }
        self.metrics
            .teardown_seconds
            .observe(started.elapsed().as_secs_f64());
        tracing::info!(world = %self.name, generation = self.generation.0, "world removed");
        let _ = self.events.send(WorldEvent::Removed {
            world: self.name.clone(),
            generation: self.generation,
        });
        self.removed.send_replace(true);
    }

    pub(crate) async fn wait_removed(&self) {
        let mut rx = self.removed.subscribe();
        // The sender lives as long as `self`, so this only ends when removed.
        let _ = rx.wait_for(|removed| *removed).await;
    }
}

/// One operation in flight (see [`WorldShared::track`]): when it ends it
/// leaves the deadlines, is recorded with its outcome, and its duration goes
/// to the latency histogram of its kind. Dropped without an outcome (its
/// caller stopped waiting), it is recorded as cancelled, or as failed when
/// the world broke meanwhile.
pub(crate) struct OpGuard {
    world: Arc<WorldShared>,
    seq: u64,
    kind: &'static str,
    started: Instant,
    deadline: Option<(Instant, u64)>,
    outcome: Option<Outcome>,
}

impl OpGuard {
    /// Notes how the operation ended.
    pub(crate) fn finish<T, E: std::fmt::Display>(&mut self, r: &Result<T, E>) {
        self.outcome = Some(match r {
            Ok(_) => Outcome::Done,
            Err(e) => Outcome::Failed(e.to_string()),
        });
    }
}

impl Drop for OpGuard {
    fn drop(&mut self) {
        let now = Instant::now();
        if let Some(key) = self.deadline {
            self.world
                .deadlines
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&key);
        }
        let outcome = self
            .outcome
            .take()
            .unwrap_or_else(|| match self.world.cause.get() {
                Some(cause) => Outcome::Failed(format!("world broken: {cause}")),
                None => Outcome::Cancelled,
            });
        self.world.recorder.end(self.seq, now, outcome);
        self.world
            .latencies
            .observe(self.kind, now.saturating_duration_since(self.started));
    }
}

impl multiworld_collectives::CallEnd for OpGuard {
    fn ended(mut self: Box<Self>, error: Option<&TcpError>) {
        self.outcome = Some(match error {
            None => Outcome::Done,
            Some(e) => Outcome::Failed(e.to_string()),
        });
    }
}

/// Tracks every collective call of a world (and of its sub-groups) like its
/// point-to-point operations: deadline (a call still running at `op_timeout`
/// breaks the world with `BreakCause::OpDeadline`), flight record, duration.
struct CollectiveCalls(Weak<WorldShared>);

impl multiworld_collectives::CallObserver for CollectiveCalls {
    fn call_started(&self, op: &'static str) -> Box<dyn multiworld_collectives::CallEnd> {
        match self.0.upgrade() {
            Some(w) => Box::new(w.track(OpStart {
                kind: op,
                peer: None,
                tag: None,
                bytes: 0,
            })),
            None => Box::new(Untracked),
        }
    }
}

/// A call of a world that is gone: nothing to record.
struct Untracked;

impl multiworld_collectives::CallEnd for Untracked {
    fn ended(self: Box<Self>, _: Option<&TcpError>) {}
}

/// Watches one world until it breaks or is torn down.
async fn watchdog(w: Arc<WorldShared>, mut store: watch::Receiver<StoreStatus>) {
    let mut store_open = true;
    let mut health = Some(w.comm.health_events());
    let mut log = ReasonLog::default();
    let cfg = w.config.watchdog.clone();
    loop {
        w.tick();
        if !w.lifecycle().is_usable() {
            return;
        }
        let now = Instant::now();
        let status = store.borrow_and_update().clone();
        #[cfg(feature = "nccl")]
        let (device_error, device_op) = w.device.get().map(|d| d.observe()).unwrap_or((None, None));
        #[cfg(not(feature = "nccl"))]
        let (device_error, device_op): (Option<String>, Option<crate::watchdog::PendingOp>) = (None, None);
        // Only gathered here; every judgement (closing, departures, which
        // deadline counts) is `decide`'s.
        let obs = Observations {
            peers: w
                .comm
                .liveness()
                .into_iter()
                .map(|p| PeerObservation {
                    rank: p.rank.0,
                    last_heard: p.last_heard,
                    transport_error: p.lost.map(|c| c.to_string()),
                    departed: p.departed,
                })
                .collect(),
            earliest_op: w.earliest_deadline(),
            device_op,
            closing: w.closing.load(std::sync::atomic::Ordering::Relaxed),
            store_last_ok: status.last_ok,
            store_error: status.error,
            store_gone: status.gone,
            reported_broken: status.reported,
            device_error,
        };
        let decision = decide(now, &obs, &cfg);
        if log.changed(&decision.reason) {
            tracing::debug!(world = %w.name, reason = %decision.reason, "watchdog");
        }
        if let Verdict::Broken(cause) = decision.verdict {
            w.break_with(cause);
            return;
        }
        #[allow(unused_mut)]
        let mut next_check = decision.next_check;
        // A device communicator is polled: NCCL cannot wake us.
        #[cfg(feature = "nccl")]
        if w.device.get().is_some() {
            next_check = next_check.min(now + crate::device::DEVICE_POLL);
        }
        let wake = tokio::time::Instant::from_std(next_check.max(now + Duration::from_millis(1)));
        tokio::select! {
            biased;
            _ = w.token.cancelled() => return,
            event = async {
                match health.as_mut() {
                    Some(h) => h.recv().await,
                    None => std::future::pending().await,
                }
            } => {
                // The channel closes only with the communicator, which this
                // task keeps alive; if it ever did, stop listening to it
                // rather than spin on it.
                if let Err(tokio::sync::broadcast::error::RecvError::Closed) = event {
                    health = None;
                }
            }
            changed = async {
                if store_open {
                    store.changed().await
                } else {
                    std::future::pending().await
                }
            } => {
                // The store watcher has ended (it saw the world's end
                // announced): its last status stays as it is; waiting on a
                // closed channel again would return at once, for ever.
                if changed.is_err() {
                    store_open = false;
                }
            }
            _ = w.deadline_added.notified() => {}
            _ = tokio::time::sleep_until(wake) => {}
        }
    }
}

fn parse_announcement(value: &[u8]) -> (u32, String) {
    let text = String::from_utf8_lossy(value);
    match text.split_once('\n') {
        Some((rank, cause)) => (rank.trim().parse().unwrap_or(u32::MAX), cause.to_string()),
        None => (u32::MAX, text.into_owned()),
    }
}

/// How long the store watcher's next wait on the world's `broken` key
/// lasts: a long poll while the store works, and a short probe while it
/// fails. The probe's timeout (the store answered, and nobody announced a
/// break) is what tells the watcher that the store is back: a long poll
/// would only end with an announcement, an error or the hour, and the
/// failure it replaced would stand until the watchdog broke the world with
/// `StoreLost` after `store_grace`, however short the outage.
fn store_wait(failing: bool) -> Duration {
    const POLL: Duration = Duration::from_secs(3600);
    const PROBE: Duration = Duration::from_millis(50);
    if failing { PROBE } else { POLL }
}

/// Whether a wait of `asked` on the store that ended with a timeout after
/// `took` was the store's answer ("nothing was set": it comes once `asked`
/// has passed) rather than the client giving up on a store that did not
/// answer at all (its deadline is `asked` plus a grace of seconds: a store
/// behind a dead link, whose connection attempts hang). Both are
/// `StoreError::Timeout`; only the first says the store is there.
fn store_answered(asked: Duration, took: Duration) -> bool {
    const SLACK: Duration = Duration::from_secs(1);
    took < asked.saturating_add(SLACK)
}

/// Keeps a long-poll on the world's `broken` key: returns when a member
/// announces a break; reports a failure at once when the store's connection
/// breaks, and its end once the store answers again (see [`store_wait`]).
async fn store_watcher(w: Arc<WorldShared>, tx: watch::Sender<StoreStatus>) {
    const RETRY: Duration = Duration::from_millis(100);
    loop {
        let wait = store_wait(tx.borrow().error.is_some());
        let asked = Instant::now();
        let result = tokio::select! {
            biased;
            _ = w.token.cancelled() => return,
            r = w.store.get(BROKEN_KEY, wait) => r,
        };
        let result = match result {
            Err(StoreError::Timeout { after, .. }) if !store_answered(wait, asked.elapsed()) => {
                Err(StoreError::Unavailable {
                    addr: w.store_addr.clone(),
                    reason: format!("no answer to a {wait:?} wait within {after:?}"),
                })
            }
            other => other,
        };
        match result {
            Ok(value) => {
                let (rank, cause) = parse_announcement(&value);
                if rank != w.rank.0 {
                    tx.send_modify(|s| s.reported = Some((rank, cause)));
                }
                return;
            }
            Err(StoreError::Timeout { .. }) => {
                tx.send_modify(|s| {
                    s.error = None;
                    s.last_ok = Instant::now();
                });
            }
            Err(
                e @ (StoreError::Closed { .. }
                | StoreError::StaleGeneration { .. }
                | StoreError::WorldNotFound { .. }),
            ) => {
                tx.send_modify(|s| s.gone = Some(format!("the world's store is gone: {e}")));
                return;
            }
            Err(e) => {
                tx.send_modify(|s| {
                    if s.error.is_none() {
                        s.last_ok = Instant::now();
                    }
                    s.error = Some(e.to_string());
                });
                tokio::select! {
                    biased;
                    _ = w.token.cancelled() => return,
                    _ = tokio::time::sleep(RETRY) => {}
                }
            }
        }
    }
}

/// A world this process is a member of. Cheap to clone; every clone is the
/// same membership. Operations fail with [`WorldError::Broken`] once the world
/// is broken, and with [`WorldError::NotJoined`] after it was left.
#[derive(Clone)]
pub struct World {
    pub(crate) shared: Arc<WorldShared>,
}

impl std::fmt::Debug for World {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("World")
            .field("name", &self.shared.name)
            .field("generation", &self.shared.generation)
            .field("rank", &self.shared.rank)
            .field("size", &self.shared.size)
            .field("state", &self.shared.state().label())
            .finish()
    }
}

impl World {
    /// The world's name.
    pub fn name(&self) -> &WorldName {
        &self.shared.name
    }

    /// This membership's generation (assigned by the world's store).
    pub fn generation(&self) -> Generation {
        self.shared.generation
    }

    /// This process's rank.
    pub fn rank(&self) -> Rank {
        self.shared.rank
    }

    /// Number of members.
    pub fn size(&self) -> u32 {
        self.shared.size
    }

    /// Where the world's store is (the address other members connect to).
    pub fn store_addr(&self) -> &str {
        &self.shared.store_addr
    }

    /// The world's state now.
    pub fn state(&self) -> WorldState {
        self.shared.state()
    }

    /// How long an operation may run before it breaks the world
    /// (`WorldConfig::op_timeout`; `None`: no deadline). An operation ends,
    /// for its deadline, when its future (or handle's `wait`) completes.
    pub fn op_timeout(&self) -> Option<std::time::Duration> {
        self.shared.config.op_timeout
    }

    /// Whether this world checks its device calls against the other
    /// members before they reach NCCL (`WorldConfig::check_device_calls`
    /// on an NCCL world): a collective waits for every member's description
    /// of it, a receive for its sender's description of the message.
    pub fn checks_device_calls(&self) -> bool {
        self.shared.config.check_device_calls && self.shared.config.backend == crate::Backend::Nccl
    }

    /// The world's communicator, for operations this handle does not wrap.
    /// Its errors are the backend's own; a world-fatal one also breaks the
    /// world through the watchdog.
    pub fn communicator(&self) -> &Communicator {
        &self.shared.comm
    }

    /// The world's collectives (broadcast, all_reduce, all_gather, ...,
    /// barrier, sub-groups), as one group over every member. Every member
    /// must call the same collectives in the same order. If a member is lost
    /// during a collective, every surviving member's call fails; the world
    /// then breaks as for any lost member. Each call (also on sub-groups made
    /// from this group) is bound by the world's `op_timeout` like a send or a
    /// receive: one still running at its deadline breaks the world, and the
    /// call fails with [`CommError::Aborted`](crate::CommError) naming the
    /// world and the cause. Errors are the backend's:
    /// `is_world_fatal()` tells a broken world from a wrong call, and
    /// [`World::collective_error`] turns one into this world's error.
    pub fn collectives(&self) -> &Group {
        &self.shared.collectives
    }

    /// This world's error for an error of one of its collectives (from
    /// [`World::collectives`], or a sub-group made from it), as a send or a
    /// receive would report it: a world-fatal one (a member lost, the
    /// communicator aborted) breaks the world if nothing broke it yet and is
    /// [`WorldError::Broken`] with the world's name and its recorded cause
    /// (the first one wins: a collective cut off by the watchdog's break
    /// reports the watchdog's cause); the others are `Timeout`, `Mismatch`,
    /// `InvalidArgument` or `Transport`, naming the world, which stays
    /// usable.
    pub fn collective_error(&self, err: TcpError) -> WorldError {
        self.shared.fail(err)
    }

    /// Sends `data` to `dst` on `tag` (no copy of the caller's data).
    pub async fn send<'a>(
        &self,
        dst: Rank,
        tag: Tag,
        data: impl Into<TensorView<'a>>,
    ) -> Result<(), WorldError> {
        self.shared.check()?;
        self.shared.check_tag(tag)?;
        let data: TensorView<'a> = data.into();
        let mut op = self.shared.track(OpStart {
            kind: "send",
            peer: Some(dst.0),
            tag: Some(tag.0),
            bytes: data.as_bytes().len() as u64,
        });
        let r = self
            .shared
            .comm
            .send(dst, tag, data)
            .await
            .map_err(|e| self.shared.fail(e));
        op.finish(&r);
        r
    }

    /// Receives from `src` on `tag` into `buf`, whose dtype and size must
    /// match the message.
    pub async fn recv(&self, src: Rank, tag: Tag, buf: &mut Tensor) -> Result<(), WorldError> {
        self.shared.check()?;
        self.shared.check_tag(tag)?;
        let mut op = self.shared.track(OpStart {
            kind: "recv",
            peer: Some(src.0),
            tag: Some(tag.0),
            bytes: buf.nbytes() as u64,
        });
        let r = self
            .shared
            .comm
            .recv(src, tag, buf)
            .await
            .map_err(|e| self.shared.fail(e));
        op.finish(&r);
        r
    }

    /// Receives from any member on `tag`; returns who sent it.
    pub async fn recv_any(&self, tag: Tag, buf: &mut Tensor) -> Result<Rank, WorldError> {
        self.shared.check()?;
        self.shared.check_tag(tag)?;
        let mut op = self.shared.track(OpStart {
            kind: "recv_any",
            peer: None,
            tag: Some(tag.0),
            bytes: buf.nbytes() as u64,
        });
        let r = self
            .shared
            .comm
            .recv_any(tag, buf)
            .await
            .map_err(|e| self.shared.fail(e));
        op.finish(&r);
        r
    }

    /// Takes a message from `src` (`None`: any member) on `tag` into `buf`
    /// only if it has already arrived: `None` (nothing recorded, nothing
    /// posted) when none is here; otherwise the receive's outcome, recorded
    /// like any receive. For callers that must not wait (an event loop).
    pub fn try_recv(
        &self,
        src: Option<Rank>,
        tag: Tag,
        buf: &mut Tensor,
    ) -> Option<Result<Rank, WorldError>> {
        if let Err(e) = self.shared.check().and_then(|()| self.shared.check_tag(tag)) {
            return Some(Err(e));
        }
        let bytes = buf.nbytes() as u64;
        let r = match src {
            Some(r) => self.shared.comm.try_recv(r, tag, buf),
            None => self.shared.comm.try_recv(multiworld_tcp::Source::Any, tag, buf),
        }?
        .map_err(|e| self.shared.fail(e));
        let mut op = self.shared.track(OpStart {
            kind: if src.is_some() { "recv" } else { "recv_any" },
            peer: src.map(|r| r.0),
            tag: Some(tag.0),
            bytes,
        });
        op.finish(&r);
        Some(r)
    }

    /// [`recv`](Self::recv) (or, with `src` `None`, [`recv_any`](Self::recv_any))
    /// with a deadline of its own: when no message has arrived after `after`,
    /// the receive is withdrawn and fails with `WorldError::Timeout`, the
    /// world stays usable, and `buf` keeps its dtype and shape (a message
    /// sent later goes to a later receive). Returns the sender.
    pub async fn recv_timeout(
        &self,
        src: Option<Rank>,
        tag: Tag,
        buf: &mut Tensor,
        after: Duration,
    ) -> Result<Rank, WorldError> {
        let pending = self.irecv(src, tag, std::mem::take(buf));
        match pending.wait_timeout(after).await {
            Ok(r) => {
                *buf = r.tensor;
                Ok(r.src)
            }
            Err(f) => {
                *buf = f.buffer;
                Err(f.error)
            }
        }
    }

    /// Starts a send of an owned tensor; the handle gives the tensor back.
    /// Dropping the handle does not cancel the send.
    pub fn isend(&self, dst: Rank, tag: Tag, data: Tensor) -> PendingSend {
        let bytes = data.nbytes() as u64;
        let inner = self
            .shared
            .check()
            .and_then(|()| self.shared.check_tag(tag))
            .map(|()| self.shared.comm.isend(dst, tag, data));
        PendingSend {
            world: Arc::clone(&self.shared),
            op: inner.as_ref().ok().map(|_| {
                self.shared.track(OpStart {
                    kind: "isend",
                    peer: Some(dst.0),
                    tag: Some(tag.0),
                    bytes,
                })
            }),
            inner: Some(inner),
        }
    }

    /// Starts a receive into an owned tensor from `src` (`None`: any member);
    /// the handle gives back the sender and the filled tensor. Dropping the
    /// handle cancels the receive.
    pub fn irecv(&self, src: Option<Rank>, tag: Tag, buf: Tensor) -> PendingRecv {
        self.post_recv(src, tag, buf, false)
    }

    /// [`World::irecv`] for a thread whose time is worth more than the
    /// runtime's (an event loop's, serving many worlds alone): a message
    /// small enough to be read ahead ([`WorldConfig::read_ahead`]) that its
    /// connection's reader has held back for the moment is left to the
    /// reader, which is woken, instead of being read from the socket in
    /// this call (`Communicator::irecv_leaving`); larger ones are read in
    /// the call as by [`World::irecv`], and one already read ahead is
    /// copied in the call. A receive from any member (`src` `None`) reads
    /// in the call as [`World::irecv`] does, so that it still takes the
    /// earliest held-back message.
    pub fn irecv_leaving_small(&self, src: Option<Rank>, tag: Tag, buf: Tensor) -> PendingRecv {
        self.post_recv(src, tag, buf, true)
    }

    /// [`World::irecv`] (`leave_small`: [`World::irecv_leaving_small`]).
    fn post_recv(&self, src: Option<Rank>, tag: Tag, buf: Tensor, leave_small: bool) -> PendingRecv {
        let source = src.map_or(multiworld_tcp::Source::Any, multiworld_tcp::Source::Rank);
        let bytes = buf.nbytes() as u64;
        let comm = &self.shared.comm;
        let inner = match self.shared.check().and_then(|()| self.shared.check_tag(tag)) {
            Ok(()) if leave_small => {
                Ok(comm.irecv_leaving(source, tag, buf, comm.config().read_ahead_limit()))
            }
            Ok(()) => Ok(comm.irecv(source, tag, buf)),
            Err(error) => Err(ReceiveFailed { error, buffer: buf }),
        };
        PendingRecv {
            world: Arc::clone(&self.shared),
            op: inner.as_ref().ok().map(|_| {
                self.shared.track(OpStart {
                    kind: "irecv",
                    peer: src.map(|r| r.0),
                    tag: Some(tag.0),
                    bytes,
                })
            }),
            inner,
        }
    }

    /// Waits until every member has entered this barrier (the n-th call on
    /// each member meets the n-th call on the others), at most `timeout`.
    /// Runs through the world's store: a store unreachable for a moment (or
    /// with its request budget full) is tried again until `timeout`, and
    /// only a store whose world is gone (closed, replaced) breaks the world
    /// here; a longer outage is the watchdog's (`store_grace`). A store
    /// bound the barrier goes over every time (more members than one
    /// request may name keys) fails it at once as
    /// [`WorldError::InvalidArgument`], naming the bound; the world goes on.
    /// A `timeout` past the clock's range waits without a deadline. To end a world, use
    /// [`finish`](Self::finish) instead: a member leaving right after a store
    /// barrier can close the store under a member whose wait is still on its
    /// way.
    pub async fn barrier(&self, timeout: std::time::Duration) -> Result<(), WorldError> {
        let w = &self.shared;
        w.check()?;
        let n = w.barriers.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let key = |n: u64, rank: u32| format!("multiworld/barrier/{n}/{rank}");
        let keys: Vec<String> = (0..w.size).map(|r| key(n, r)).collect();
        // No deadline for a timeout past the clock's range ("wait forever").
        let deadline = Instant::now().checked_add(timeout);
        let wait = async {
            let mut warned = false;
            loop {
                let left = deadline.map_or(timeout, |d| d.saturating_duration_since(Instant::now()));
                let tried = async {
                    w.store_call(w.store.set(key(n, w.rank.0), Vec::new())).await?;
                    w.store.wait(&keys, left).await
                }
                .await;
                match tried {
                    // The store unreachable for a moment, or its budget for
                    // requests in flight full: tried again until the
                    // barrier's own timeout. Whether the store is lost is
                    // the watchdog's to say (`store_grace`), which ends this
                    // wait if so.
                    Err(StoreError::Unavailable { .. }) => {}
                    Err(e @ StoreError::LimitExceeded { limit, .. }) if limit.clears_by_itself() => {
                        // Said once per barrier: a store that stays full
                        // (keys nobody deletes) would keep it waiting.
                        if !warned {
                            warned = true;
                            tracing::warn!(world = %w.name, barrier = n, error = %e, "barrier waits for the store to take its key; trying again until its timeout");
                        }
                    }
                    // The store's own bound on one wait (`max_timeout`) came
                    // before the barrier's: wait again.
                    Err(StoreError::Timeout { .. }) if deadline.is_none_or(|d| Instant::now() < d) => {}
                    r => return r,
                }
                if left.is_zero() {
                    return Err(StoreError::Timeout {
                        what: format!("barrier {n}"),
                        after: timeout,
                    });
                }
                tokio::time::sleep(BARRIER_RETRY.min(left)).await;
            }
        };
        let result = tokio::select! {
            biased;
            _ = w.ended.cancelled() => return Err(w.unusable()),
            r = wait => r,
        };
        match result {
            Ok(()) => {
                // Everyone entered barrier n, so everyone left barrier n - 1:
                // its key is no longer needed.
                if n > 0 {
                    let _ = w.store_call(w.store.delete(key(n - 1, w.rank.0))).await;
                }
                Ok(())
            }
            // The barrier's own timeout (the last wait's slice would name
            // only the rest of it).
            Err(StoreError::Timeout { .. }) => Err(WorldError::Timeout {
                world: w.name.clone(),
                op: format!("barrier {n}"),
                after: timeout,
            }),
            // A bound this barrier's requests go over every time (a world
            // with more members than one request may name keys): the call
            // cannot work through this store, but the world is fine.
            Err(e @ StoreError::LimitExceeded { .. }) => Err(WorldError::InvalidArgument {
                world: w.name.clone(),
                detail: format!("barrier {n} cannot run through the world's store: {e}"),
            }),
            Err(e) => {
                // The world's store generation is gone (closed, replaced),
                // or the call cannot work at all.
                w.break_with(BreakCause::StoreLost {
                    reason: e.to_string(),
                });
                Err(w.unusable())
            }
        }
    }

    /// Ends the world for everyone, in order: marks it closing (from now on
    /// members leaving in an orderly way are expected, not failures), sends
    /// a token to every other member over the world's own connections and
    /// waits for one from each, then leaves. Every member must call it. A
    /// member's goodbye travels behind its token on the same connection, so
    /// everyone has every token before anyone's departure can be seen, and
    /// nobody's leave cuts off a member that is still finishing. A member
    /// that crashes meanwhile still breaks the world. Once started it runs
    /// to its end (or `timeout`) and leaves, even if the caller stops
    /// waiting for it.
    pub async fn finish(&self, timeout: std::time::Duration) -> Result<(), WorldError> {
        self.shared.check()?;
        self.shared
            .closing
            .store(true, std::sync::atomic::Ordering::Relaxed);
        // A task of its own: a caller that stops waiting (a timeout of its
        // own, a `select!`, Ctrl-C in Python) must not leave the world
        // closing for ever (it then ignores departures and the store's
        // end): the exchange runs to its end or to `timeout`, and the world
        // is left either way.
        let shared = Arc::clone(&self.shared);
        let span = shared.span.clone();
        match tokio::spawn(Self::finishing(shared, timeout).instrument(span)).await {
            Ok(r) => r,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(_) => Err(self.shared.unusable()),
        }
    }

    /// The body of [`World::finish`], in its task.
    async fn finishing(w: Arc<WorldShared>, timeout: std::time::Duration) -> Result<(), WorldError> {
        let w = &w;
        let me = w.rank;
        let token = [1u8];
        let exchange = (0..w.size).filter(|&r| r != me.0).map(|r| async move {
            let mut got = Tensor::zeros(multiworld_types::DType::U8, [1]).map_err(|e| w.fail(e.into()))?;
            let (sent, received) = tokio::join!(
                w.comm.send(Rank(r), FINISH_TAG, &token[..]),
                w.comm.recv(Rank(r), FINISH_TAG, &mut got)
            );
            sent.and(received).map_err(|e| w.fail(e))
        });
        let all = async {
            for r in futures::future::join_all(exchange).await {
                r?;
            }
            Ok(())
        };
        let passed = match tokio::time::timeout(timeout, all).await {
            Ok(r) => r,
            Err(_) => Err(WorldError::Timeout {
                world: w.name.clone(),
                op: "finish".into(),
                after: timeout,
            }),
        };
        w.leave().await;
        passed
    }

    /// Breaks the world now with [`BreakCause::Aborted`]: every pending and
    /// future operation fails, the peers are told, and the world is torn down.
    pub fn abort(&self) {
        self.shared.break_with(BreakCause::Aborted);
    }

    /// Waits until the world has been torn down and removed (after a break or
    /// a leave).
    pub async fn removed(&self) {
        self.shared.wait_removed().await;
    }
}

/// A send started by [`World::isend`].
pub struct PendingSend {
    world: Arc<WorldShared>,
    op: Option<OpGuard>,
    /// Taken by [`PendingSend::wait`] (`None` after).
    inner: Option<Result<multiworld_tcp::SendHandle, WorldError>>,
}

impl Drop for PendingSend {
    /// Dropping the handle does not cancel the send: it goes on in the
    /// background, and so does its record (and its deadline, if the world
    /// has one), which end when the send does. Outside a Tokio runtime the
    /// record ends now, as cancelled.
    fn drop(&mut self) {
        let (Some(Ok(handle)), Some(mut op)) = (self.inner.take(), self.op.take()) else {
            return;
        };
        let mut sent = Box::pin(handle.wait());
        if let Some(r) = futures::FutureExt::now_or_never(&mut sent) {
            op.finish(&r);
        } else if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                let r = sent.await;
                op.finish(&r);
            });
        }
    }
}

impl PendingSend {
    /// Whether the send has finished (successfully or not).
    pub fn is_completed(&self) -> bool {
        match &self.inner {
            Some(Ok(h)) => h.is_completed(),
            _ => true,
        }
    }

    /// Waits for the send; returns the tensor.
    pub async fn wait(mut self) -> Result<Tensor, WorldError> {
        let mut op = self.op.take();
        let r = match self.inner.take() {
            Some(Ok(h)) => h.wait().await.map_err(|e| self.world.fail(e)),
            Some(Err(e)) => Err(e),
            None => Err(WorldError::InvalidArgument {
                world: self.world.name.clone(),
                detail: "internal: the send was already waited for".into(),
            }),
        };
        if let Some(op) = &mut op {
            op.finish(&r);
        }
        r
    }
}

/// A receive started by [`World::irecv`].
pub struct PendingRecv {
    world: Arc<WorldShared>,
    op: Option<OpGuard>,
    inner: Result<multiworld_tcp::RecvHandle, ReceiveFailed>,
}

/// A receive that failed, with the buffer it was posted with (its dtype and
/// shape as given; its contents unspecified).
#[derive(Debug)]
pub struct ReceiveFailed {
    /// Why: `WorldError::Timeout` when the call's own deadline passed first
    /// (the world stays usable), or what a failed receive reports.
    pub error: WorldError,
    /// The caller's buffer, given back.
    pub buffer: Tensor,
}

impl std::fmt::Display for ReceiveFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.error.fmt(f)
    }
}

impl std::error::Error for ReceiveFailed {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

impl PendingRecv {
    /// Whether the receive has finished (successfully or not).
    pub fn is_completed(&self) -> bool {
        self.inner.as_ref().map_or(true, |h| h.is_completed())
    }

    /// Waits for the receive; returns the sender and the filled tensor.
    pub async fn wait(self) -> Result<Received, WorldError> {
        let PendingRecv { world, mut op, inner } = self;
        let handle = inner.map_err(|f| f.error)?;
        let r = handle.wait().await.map_err(|e| world.fail(e));
        if let Some(op) = &mut op {
            op.finish(&r);
        }
        r
    }

    /// Waits at most `after`, a deadline of this call alone: when no message
    /// has arrived by then, the receive is withdrawn (a message sent later
    /// goes to a later receive, nothing is lost) and it fails with
    /// `WorldError::Timeout`; the world stays usable. Unlike
    /// `WorldConfig::op_timeout`, which breaks the world, this is the
    /// caller's own patience. Every failure gives the caller's buffer back.
    pub async fn wait_timeout(self, after: Duration) -> Result<Received, ReceiveFailed> {
        let PendingRecv { world, mut op, inner } = self;
        let handle = inner?;
        let r = handle.wait_timeout(after).await.map_err(|f| ReceiveFailed {
            error: match f.error {
                multiworld_tcp::Error::Timeout { after, .. } => WorldError::Timeout {
                    world: world.name.clone(),
                    op: "recv".to_string(),
                    after,
                },
                other => world.fail(other),
            },
            buffer: f.buffer,
        });
        if let Some(op) = &mut op {
            op.finish(&r);
        }
        r
    }
}

/// The file name of a flight record: `<world>-g<generation>-r<rank>.json`,
/// with `/` and `\` in the world's name made `_`. A name too long for a
/// file name (most file systems allow 255 bytes, and the record is first
/// written under a name 9 bytes longer) keeps its first bytes and gets a
/// hash of the whole name, so records of different worlds stay apart.
pub(crate) fn flight_file_name(world: &str, generation: u64, rank: u32) -> String {
    const MAX: usize = 240;
    let safe = world.replace(['/', '\\'], "_");
    let tail = format!("-g{generation}-r{rank}.json");
    if safe.len() + tail.len() <= MAX {
        return format!("{safe}{tail}");
    }
    let hash = {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        world.hash(&mut h);
        h.finish()
    };
    let mark = format!("~{hash:016x}");
    let mut keep = MAX - tail.len() - mark.len();
    while !safe.is_char_boundary(keep) {
        keep -= 1;
    }
    format!("{}{mark}{tail}", &safe[..keep])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A flight record's file name fits any file system, the partial one's
    /// too, and names that share their first 240 bytes stay apart.
    #[test]
    fn flight_file_names_fit_and_stay_apart() {
        assert_eq!(flight_file_name("a/b\\c", 7, 1), "a_b_c-g7-r1.json");
        let long_a = format!("{}a", "é".repeat(127));
        let long_b = format!("{}b", "é".repeat(127));
        let (a, b) = (
            flight_file_name(&long_a, 1795470672325382, 3),
            flight_file_name(&long_b, 1795470672325382, 3),
        );
        assert!(a.len() <= 240 && format!(".{a}.partial").len() <= 255, "{a}");
        assert_ne!(a, b);
        assert!(a.ends_with("-g1795470672325382-r3.json"), "{a}");
    }

    /// A wait's timeout counts as the store's answer only when it came about
    /// when asked; one that came with the client's own deadline (seconds
    /// later) means the store never answered, so the store stays failing and
    /// `store_grace` is measured from the first failure.
    #[test]
    fn only_a_timely_timeout_is_the_stores_answer() {
        let probe = store_wait(true);
        assert_eq!(probe, Duration::from_millis(50));
        assert!(store_answered(probe, Duration::from_millis(52)));
        assert!(store_answered(probe, Duration::from_millis(600)), "a slow answer");
        // The client's deadline: the wait plus its 5 s grace.
        assert!(!store_answered(probe, Duration::from_millis(5050)));
        let poll = store_wait(false);
        assert!(store_answered(poll, poll + Duration::from_millis(3)));
        assert!(!store_answered(poll, poll + Duration::from_secs(5)));
    }
}
