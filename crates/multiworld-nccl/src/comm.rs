//! [`NcclComm`]: one world's NCCL communicator — non-blocking, on the
//! world's own stream — and its lifecycle: init, asynchronous-error polling,
//! abort with a deadline, close, revoke and shrink. The operations live in
//! `ops.rs` and their completion handles in `handle.rs`.
//!
//! Concurrency and lock order (`issue` → `gate`):
//! - `issue` serialises *issuing* operations: a non-blocking communicator
//!   may return `ncclInProgress`, after which no other call may be made on it
//!   until `ncclCommGetAsyncError` stops saying so. It is held while an
//!   operation is enqueued (bounded by `op_timeout`), never while it runs.
//! - `gate` holds the raw communicator and is held only for the duration of
//!   individual NCCL calls, which never block on a non-blocking
//!   communicator. Abort *takes* the pointer out of the gate, so nothing can
//!   use a communicator after (or while) it is aborted.
//! - [`NcclComm::poll_error`] only `try_lock`s the gate: the watchdog never
//!   waits on anything.
//! - Abort runs `ncclCommAbort` on a dedicated thread and waits for it at
//!   most a deadline; past it the world is *quarantined*: the thread is left
//!   to finish (or hang) on its own, and the world's communicator, stream,
//!   memory and events are leaked, never touched again.

#![allow(unsafe_code)]

use std::ffi::c_int;
use std::fmt;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, TryLockError, mpsc};
use std::time::{Duration, Instant};

use crate::buffer::DeviceBuffer;
use crate::config::CommConfig;
use crate::cuda::WorldDevice;
use crate::error::NcclError;
use crate::ffi::{self, NcclResultCode, RawComm, SendPtr};
use crate::poll::{Backoff, poll_until};
use crate::runtime::NcclRuntime;
use crate::unique_id::UniqueId;
use crate::version::NcclVersion;
use multiworld_types::DType;

/// Lifecycle of a communicator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CommState {
    /// Usable.
    Live,
    /// An error was observed (asynchronous error, failed or timed-out
    /// operation); new operations are refused. The owner should abort.
    Failed,
    /// `ncclCommRevoke` was called: operations are refused; abort or close
    /// next.
    Revoked,
    /// An abort is running.
    Aborting,
    /// `ncclCommAbort` returned; resources are released.
    Aborted,
    /// `ncclCommAbort` did not return within its deadline; the communicator
    /// and the world's device resources are leaked and never touched again.
    Quarantined,
    /// A graceful close (finalize + destroy) is running.
    Closing,
    /// Finalized and destroyed.
    Closed,
}

impl CommState {
    const ALL: [CommState; 8] = [
        CommState::Live,
        CommState::Failed,
        CommState::Revoked,
        CommState::Aborting,
        CommState::Aborted,
        CommState::Quarantined,
        CommState::Closing,
        CommState::Closed,
    ];

    fn to_u8(self) -> u8 {
        match self {
            CommState::Live => 0,
            CommState::Failed => 1,
            CommState::Revoked => 2,
            CommState::Aborting => 3,
            CommState::Aborted => 4,
            CommState::Quarantined => 5,
            CommState::Closing => 6,
            CommState::Closed => 7,
        }
    }

    fn from_u8(v: u8) -> CommState {
        CommState::ALL
            .into_iter()
            .find(|s| s.to_u8() == v)
            .unwrap_or(CommState::Quarantined)
    }

    /// Lowercase name.
    pub fn name(self) -> &'static str {
        match self {
            CommState::Live => "live",
            CommState::Failed => "failed",
            CommState::Revoked => "revoked",
            CommState::Aborting => "aborting",
            CommState::Aborted => "aborted",
            CommState::Quarantined => "quarantined",
            CommState::Closing => "closing",
            CommState::Closed => "closed",
        }
    }
}

impl fmt::Display for CommState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What [`NcclComm::abort`] achieved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AbortOutcome {
    /// `ncclCommAbort` returned after `elapsed`.
    Aborted {
        /// Time from the call to abort's return.
        elapsed: Duration,
    },
    /// `ncclCommAbort` did not return within the deadline: the communicator
    /// is quarantined (leaked, never touched again). Report the world.
    Quarantined {
        /// How long we waited.
        waited: Duration,
    },
    /// Nothing to do: the communicator was already in `state`.
    AlreadyClosed {
        /// The state found.
        state: CommState,
    },
}

impl AbortOutcome {
    /// True if the communicator had to be quarantined.
    pub fn is_quarantined(&self) -> bool {
        matches!(
            self,
            AbortOutcome::Quarantined { .. }
                | AbortOutcome::AlreadyClosed {
                    state: CommState::Quarantined
                }
        )
    }
}

/// What [`NcclComm::close`] achieved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CloseOutcome {
    /// Finalized (all issued work flushed) and destroyed.
    Destroyed {
        /// Time taken.
        elapsed: Duration,
    },
    /// Finalize failed or timed out (or the communicator had failed), so it
    /// was aborted instead.
    Aborted(AbortOutcome),
}

/// How [`NcclComm::shrink`] treats the parent communicator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ShrinkMode {
    /// `NCCL_SHRINK_DEFAULT`: the parent is healthy; shrinking is a
    /// collective of the remaining ranks.
    Default,
    /// `NCCL_SHRINK_ABORT`: first terminate the parent's pending operations
    /// (e.g. after a peer died), then shrink. The parent becomes `Failed`.
    Abort,
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

pub(crate) fn to_int(what: &str, v: usize) -> Result<c_int, NcclError> {
    c_int::try_from(v).map_err(|_| NcclError::invalid(format!("{what} {v} does not fit an int")))
}

/// State shared by a communicator, its operation handles and its abort
/// thread.
pub(crate) struct CommShared {
    pub(crate) rt: NcclRuntime,
    pub(crate) dev: Arc<WorldDevice>,
    pub(crate) config: CommConfig,
    state: AtomicU8,
    /// First world-fatal error seen, reported by `poll_error` afterwards.
    pub(crate) failure: Mutex<Option<NcclError>>,
    /// Serialises issuing operations. Lock order: `issue` before `gate`.
    pub(crate) issue: Mutex<()>,
    /// The raw communicator; `None` once abort or destroy has taken it.
    gate: Arc<Mutex<Option<SendPtr>>>,
    /// One `i32` for `barrier`.
    pub(crate) scratch: DeviceBuffer,
}

impl CommShared {
    pub(crate) fn state(&self) -> CommState {
        CommState::from_u8(self.state.load(Ordering::SeqCst))
    }

    fn set_state(&self, s: CommState) {
        self.state.store(s.to_u8(), Ordering::SeqCst);
    }

    /// Moves from one of `from` to `to`; returns the state found otherwise.
    fn transition(&self, from: &[CommState], to: CommState) -> Result<CommState, CommState> {
        let mut cur = self.state();
        loop {
            if !from.contains(&cur) {
                return Err(cur);
            }
            match self
                .state
                .compare_exchange(cur.to_u8(), to.to_u8(), Ordering::SeqCst, Ordering::SeqCst)
            {
                Ok(_) => return Ok(cur),
                Err(v) => cur = CommState::from_u8(v),
            }
        }
    }

    /// Records an error that fails the communicator whatever its kind: one
    /// the communicator reports as its state (`ncclCommGetAsyncError`: a
    /// communicator whose asynchronous error is set keeps it and fails every
    /// later call, so an `ncclInvalidUsage` there is no caller's mistake to
    /// retry), or one after an operation was enqueued (it runs on, and
    /// a retry would put the members' operations out of step).
    /// The error it returns (and keeps as the failure) is world-fatal: one
    /// that would not be on its own comes wrapped in [`NcclError::Failed`].
    pub(crate) fn fail_async(&self, e: NcclError) -> NcclError {
        let e = if e.is_world_fatal() {
            e
        } else {
            NcclError::Failed { cause: Box::new(e) }
        };
        self.record_failure(&e);
        e
    }

    /// Records a world-fatal error and moves `Live` to `Failed`.
    pub(crate) fn fail(&self, e: NcclError) -> NcclError {
        if e.is_world_fatal() {
            self.record_failure(&e);
        }
        e
    }

    fn record_failure(&self, e: &NcclError) {
        let mut first = lock(&self.failure);
        if first.is_none() {
            *first = Some(e.clone());
        }
        drop(first);
        if self.transition(&[CommState::Live], CommState::Failed).is_ok() {
            tracing::warn!(error = %e, "NCCL communicator failed");
        }
    }

    pub(crate) fn ensure_live(&self, op: &'static str) -> Result<(), NcclError> {
        match self.state() {
            CommState::Live => Ok(()),
            state => Err(NcclError::Aborted { op, state }),
        }
    }

    /// Runs `f` on the raw communicator under the gate.
    pub(crate) fn with_comm<R>(
        &self,
        op: &'static str,
        f: impl FnOnce(RawComm) -> R,
    ) -> Result<R, NcclError> {
        let guard = lock(&self.gate);
        match *guard {
            Some(c) => Ok(f(c.0)),
            None => Err(NcclError::Aborted {
                op,
                state: self.state(),
            }),
        }
    }

    /// One `ncclCommGetAsyncError`: `Some(())` when the communicator is
    /// ready, `None` while `ncclInProgress`, an error (recorded) otherwise.
    fn ready_step(&self, call: &'static str) -> Result<Option<()>, NcclError> {
        let api = *self.rt.nccl();
        let (rc, st) = self.with_comm(call, |c| {
            let mut st: NcclResultCode = ffi::NCCL_SUCCESS;
            // SAFETY: `c` is live (we hold the gate); writes one int.
            let rc = unsafe { (api.comm_get_async_error)(c, &mut st) };
            (rc, st)
        })?;
        if rc != ffi::NCCL_SUCCESS {
            return Err(self.fail(self.rt.nccl_error("ncclCommGetAsyncError", rc, None)));
        }
        match st {
            ffi::NCCL_SUCCESS => Ok(Some(())),
            ffi::NCCL_IN_PROGRESS => Ok(None),
            e => Err(self.fail_async(self.rt.nccl_error(call, e, None))),
        }
    }

    /// Polls until the communicator leaves `ncclInProgress`, or `deadline`.
    pub(crate) fn wait_ready(
        &self,
        call: &'static str,
        deadline: Instant,
        budget: Duration,
    ) -> Result<(), NcclError> {
        poll_until(call, deadline, budget, || self.ready_step(call)).map_err(|e| self.fail(e))
    }

    /// Never blocks: `None` when healthy (or when another thread is inside an
    /// NCCL call on this communicator right now; ask again later).
    pub(crate) fn poll_error(&self) -> Option<NcclError> {
        let state = self.state();
        match state {
            CommState::Live | CommState::Revoked => {}
            CommState::Failed => {
                return Some(lock(&self.failure).clone().unwrap_or(NcclError::Aborted {
                    op: "poll_error",
                    state,
                }));
            }
            _ => {
                return Some(NcclError::Aborted {
                    op: "poll_error",
                    state,
                });
            }
        }
        let guard = match self.gate.try_lock() {
            Ok(g) => g,
            Err(TryLockError::WouldBlock) => return None,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
        };
        let comm = (*guard)?;
        let mut st: NcclResultCode = ffi::NCCL_SUCCESS;
        // SAFETY: `comm` is live while we hold the gate; writes one int.
        let rc = unsafe { (self.rt.nccl().comm_get_async_error)(comm.0, &mut st) };
        drop(guard);
        if rc != ffi::NCCL_SUCCESS {
            return Some(self.fail(self.rt.nccl_error("ncclCommGetAsyncError", rc, None)));
        }
        match st {
            ffi::NCCL_SUCCESS | ffi::NCCL_IN_PROGRESS => None,
            e => Some(self.fail_async(self.rt.nccl_error("ncclCommGetAsyncError", e, None))),
        }
    }

    /// Takes the raw communicator out of the gate on a dedicated thread and
    /// runs `call` on it; waits at most `deadline`. `None` if the thread did
    /// not report in time (or could not be started).
    fn run_detached(
        &self,
        name: &'static str,
        deadline: Duration,
        call: unsafe extern "C" fn(RawComm) -> NcclResultCode,
    ) -> Option<NcclResultCode> {
        let gate = Arc::clone(&self.gate);
        let dev = Arc::clone(&self.dev);
        let (tx, rx) = mpsc::sync_channel(1);
        let spawned = std::thread::Builder::new()
            .name(format!("{name}-dev{}", self.dev.ordinal()))
            .spawn(move || {
                // May block if an NCCL call hangs while holding the gate; then
                // the caller's deadline passes and the world is quarantined.
                let taken = lock(&gate).take();
                let rc = match taken {
                    Some(c) => {
                        let _ = dev.bind();
                        // SAFETY: we own the only copy of the pointer now (it
                        // left the gate), so this is its last use.
                        unsafe { call(c.0) }
                    }
                    None => ffi::NCCL_SUCCESS,
                };
                // Release our references before reporting, so that when the
                // caller hears back the world's device resources can already
                // be gone (the last reference may be this one).
                drop(dev);
                drop(gate);
                let _ = tx.send(rc);
            });
        if let Err(e) = spawned {
            tracing::error!(error = %e, "could not start the {name} thread");
            return None;
        }
        rx.recv_timeout(deadline).ok()
    }

    fn abort(&self, deadline: Duration) -> AbortOutcome {
        let start = Instant::now();
        match self.transition(
            &[
                CommState::Live,
                CommState::Failed,
                CommState::Revoked,
                CommState::Closing,
            ],
            CommState::Aborting,
        ) {
            Ok(_) => {}
            Err(CommState::Aborting) => {
                // Another thread is aborting: wait for its outcome.
                let until = start + deadline;
                let mut backoff = Backoff::new();
                while self.state() == CommState::Aborting && Instant::now() < until {
                    backoff.snooze(until);
                }
                return AbortOutcome::AlreadyClosed { state: self.state() };
            }
            Err(state) => return AbortOutcome::AlreadyClosed { state },
        }
        let api = *self.rt.nccl();
        match self.run_detached("nccl-abort", deadline, api.comm_abort) {
            Some(rc) => {
                if rc != ffi::NCCL_SUCCESS {
                    tracing::warn!(
                        code = rc,
                        "ncclCommAbort returned an error; resources released anyway"
                    );
                }
                self.set_state(CommState::Aborted);
                let elapsed = start.elapsed();
                tracing::info!(?elapsed, device = self.dev.ordinal(), "NCCL communicator aborted");
                AbortOutcome::Aborted { elapsed }
            }
            None => {
                self.set_state(CommState::Quarantined);
                self.dev.quarantine();
                let waited = start.elapsed();
                tracing::error!(
                    ?waited,
                    device = self.dev.ordinal(),
                    "ncclCommAbort did not return in time; communicator quarantined"
                );
                AbortOutcome::Quarantined { waited }
            }
        }
    }
}

/// One world's NCCL communicator. `Send + Sync`: every method takes `&self`
/// and the communicator serialises what NCCL requires (see the module docs).
/// Dropping it aborts it (bounded by `abort_deadline`) unless it was closed
/// or aborted already; drop never panics and never blocks longer than that.
pub struct NcclComm {
    pub(crate) shared: Arc<CommShared>,
}

impl fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NcclComm")
            .field("rank", &self.shared.config.rank)
            .field("size", &self.shared.config.size)
            .field("device", &self.shared.config.device)
            .field("state", &self.shared.state())
            .finish()
    }
}

impl NcclComm {
    /// Creates this rank's communicator for a world: a non-blocking
    /// `ncclCommInitRankConfig` (`blocking = 0`) on the configured device,
    /// polled with `ncclCommGetAsyncError` until ready or `init_timeout`
    /// (then aborted and [`NcclError::Timeout`]). Every rank of the world
    /// must call it with the same `id` and size. The world gets its own CUDA
    /// stream and memory pool.
    pub fn init(rt: &NcclRuntime, config: &CommConfig, id: &UniqueId) -> Result<NcclComm, NcclError> {
        config.validate()?;
        let size = to_int("size", config.size)?;
        let rank = to_int("rank", config.rank)?;
        let dev = WorldDevice::open(rt.cuda_driver(), config.device)?;
        let scratch = DeviceBuffer::alloc(&dev, DType::I32, 1)?;
        dev.bind()?;
        let start = Instant::now();
        let deadline = start + config.init_timeout;
        let mut raw_config = config.raw_nccl_config();
        let mut comm: RawComm = std::ptr::null_mut();
        // SAFETY: `comm` receives the new communicator; the id is passed by
        // value as the C API declares; `raw_config` follows the ncclConfig_t
        // layout (ffi.rs) and outlives the call (NCCL copies it).
        let rc =
            unsafe { (rt.nccl().comm_init_rank_config)(&mut comm, size, id.to_raw(), rank, &mut raw_config) };
        if comm.is_null() {
            rt.nccl_check("ncclCommInitRankConfig", rc, None)?;
            return Err(NcclError::Nccl {
                call: "ncclCommInitRankConfig",
                code: rc,
                message: "returned no communicator".to_owned(),
            });
        }
        let nccl = NcclComm::from_parts(rt, dev, config.clone(), comm, scratch);
        // On any error below, dropping `nccl` aborts the half-made communicator.
        rt.nccl_check("ncclCommInitRankConfig", rc, None)?;
        nccl.shared
            .wait_ready("ncclCommInitRankConfig", deadline, config.init_timeout)?;
        tracing::debug!(
            rank = config.rank,
            size = config.size,
            device = config.device,
            id = ?id,
            elapsed = ?start.elapsed(),
            "NCCL communicator ready"
        );
        Ok(nccl)
    }

    fn from_parts(
        rt: &NcclRuntime,
        dev: Arc<WorldDevice>,
        config: CommConfig,
        comm: RawComm,
        scratch: DeviceBuffer,
    ) -> NcclComm {
        NcclComm {
            shared: Arc::new(CommShared {
                rt: rt.clone(),
                dev,
                config,
                state: AtomicU8::new(CommState::Live.to_u8()),
                failure: Mutex::new(None),
                issue: Mutex::new(()),
                gate: Arc::new(Mutex::new(Some(SendPtr(comm)))),
                scratch,
            }),
        }
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.shared.config.rank
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.shared.config.size
    }

    /// CUDA device ordinal.
    pub fn device(&self) -> usize {
        self.shared.config.device
    }

    /// The configuration it was created with.
    pub fn config(&self) -> &CommConfig {
        &self.shared.config
    }

    /// Orders the operations issued after this call behind everything
    /// enqueued so far on `stream` (a raw `CUstream`, e.g. torch's
    /// `torch.cuda.current_stream().cuda_stream`), on the device: an event
    /// recorded on `stream` that the world's stream waits for. The host does
    /// not wait, unlike synchronising `stream` first.
    ///
    /// # Safety
    /// `stream` is a live stream of this communicator's device in its
    /// primary context (where torch's streams live), or 0 for the legacy
    /// default stream.
    pub unsafe fn order_after_stream(&self, stream: usize) -> Result<(), NcclError> {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.shared.dev.wait_for_stream(stream as *mut std::ffi::c_void) }
    }

    /// Current lifecycle state.
    pub fn state(&self) -> CommState {
        self.shared.state()
    }

    /// The runtime it uses.
    pub fn runtime(&self) -> &NcclRuntime {
        &self.shared.rt
    }

    pub(crate) fn version(&self) -> NcclVersion {
        self.shared.rt.version()
    }

    /// A zeroed device buffer of `len` elements owned by this world.
    pub fn alloc(&self, dtype: DType, len: usize) -> Result<DeviceBuffer, NcclError> {
        DeviceBuffer::alloc(&self.shared.dev, dtype, len)
    }

    /// A device buffer holding `bytes` (native-endian elements of `dtype`;
    /// the length must be a multiple of the element size). The copy is
    /// bounded by `op_timeout`.
    pub fn upload(&self, dtype: DType, bytes: &[u8]) -> Result<DeviceBuffer, NcclError> {
        crate::context::upload(&self.shared.dev, dtype, bytes, self.shared.config.op_timeout)
    }

    /// The communicator's asynchronous error, if any (`ncclCommGetAsyncError`;
    /// a remote peer's failure shows up here). Never blocks: returns `None`
    /// while another thread is inside an NCCL call on this communicator.
    /// After a failure it keeps returning the first error; once aborted or
    /// closed it returns [`NcclError::Aborted`].
    pub fn poll_error(&self) -> Option<NcclError> {
        self.shared.poll_error()
    }

    /// Aborts the communicator: `ncclCommAbort` on a dedicated thread, waited
    /// for at most `deadline`. Pending and future operations fail with
    /// [`NcclError::Aborted`]. If the deadline passes the communicator is
    /// quarantined (see [`AbortOutcome::Quarantined`]). Other worlds are not
    /// affected either way. Idempotent.
    pub fn abort(&self, deadline: Duration) -> AbortOutcome {
        self.shared.abort(deadline)
    }

    /// Graceful teardown: `ncclCommFinalize` (flushes issued work; all ranks
    /// must close), polled until done or `timeout`, then `ncclCommDestroy`.
    /// Falls back to [`abort`](Self::abort) on error or timeout. After
    /// [`revoke`](Self::revoke) it destroys directly, as NCCL requires.
    pub fn close(self, timeout: Duration) -> CloseOutcome {
        let sh = Arc::clone(&self.shared);
        let start = Instant::now();
        let deadline = start + timeout;
        let abort_deadline = sh.config.abort_deadline;
        let previous = match sh.transition(&[CommState::Live, CommState::Revoked], CommState::Closing) {
            Ok(prev) => prev,
            Err(CommState::Failed) => return CloseOutcome::Aborted(sh.abort(abort_deadline)),
            Err(state) => return CloseOutcome::Aborted(AbortOutcome::AlreadyClosed { state }),
        };
        // Let an operation being enqueued finish (bounded by our deadline).
        let mut backoff = Backoff::new();
        let issue_guard = loop {
            match sh.issue.try_lock() {
                Ok(g) => break Some(g),
                Err(TryLockError::Poisoned(p)) => break Some(p.into_inner()),
                Err(TryLockError::WouldBlock) if Instant::now() >= deadline => break None,
                Err(TryLockError::WouldBlock) => backoff.snooze(deadline),
            }
        };
        let Some(_issue_guard) = issue_guard else {
            tracing::warn!("close: an operation is still being enqueued; aborting instead");
            return CloseOutcome::Aborted(sh.abort(abort_deadline));
        };
        if previous == CommState::Live {
            let api = *sh.rt.nccl();
            let finalized = sh
                .with_comm("close", |c| {
                    // SAFETY: `c` is live under the gate.
                    unsafe { (api.comm_finalize)(c) }
                })
                .and_then(|rc| sh.rt.nccl_check("ncclCommFinalize", rc, None))
                .and_then(|()| sh.wait_ready("ncclCommFinalize", deadline, timeout));
            if let Err(e) = finalized {
                tracing::warn!(error = %e, "ncclCommFinalize failed; aborting instead");
                return CloseOutcome::Aborted(sh.abort(abort_deadline));
            }
        }
        let api = *sh.rt.nccl();
        match sh.run_detached("nccl-destroy", abort_deadline, api.comm_destroy) {
            Some(rc) => {
                if rc != ffi::NCCL_SUCCESS {
                    tracing::warn!(code = rc, "ncclCommDestroy returned an error");
                }
                sh.set_state(CommState::Closed);
                CloseOutcome::Destroyed {
                    elapsed: start.elapsed(),
                }
            }
            None => {
                sh.set_state(CommState::Quarantined);
                sh.dev.quarantine();
                tracing::error!("ncclCommDestroy did not return in time; communicator quarantined");
                CloseOutcome::Aborted(AbortOutcome::Quarantined {
                    waited: start.elapsed(),
                })
            }
        }
    }

    /// `ncclCommRevoke` (NCCL ≥ 2.29 only, else [`NcclError::Unsupported`]):
    /// stops in-flight operations without destroying the communicator, polled
    /// until quiescent or `timeout`. Afterwards operations are refused; use
    /// [`shrink`](Self::shrink), [`abort`](Self::abort) or
    /// [`close`](Self::close).
    pub fn revoke(&self, timeout: Duration) -> Result<(), NcclError> {
        let sh = &self.shared;
        let Some(revoke) = sh.rt.nccl().comm_revoke.filter(|_| sh.rt.supports_revoke()) else {
            return Err(NcclError::unsupported(format!(
                "ncclCommRevoke needs NCCL {} (runtime is {})",
                NcclVersion::REVOKE,
                sh.rt.version()
            )));
        };
        sh.transition(&[CommState::Live, CommState::Failed], CommState::Revoked)
            .map_err(|state| NcclError::Aborted { op: "revoke", state })?;
        let deadline = Instant::now() + timeout;
        let rc = sh.with_comm("revoke", |c| {
            // SAFETY: `c` is live under the gate; flags must be 0
            // (NCCL_REVOKE_DEFAULT).
            unsafe { revoke(c, 0) }
        })?;
        sh.rt.nccl_check("ncclCommRevoke", rc, None)?;
        sh.wait_ready("ncclCommRevoke", deadline, timeout)
    }

    /// `ncclCommShrink` (NCCL ≥ 2.27 only, else [`NcclError::Unsupported`]):
    /// a new communicator without the ranks in `exclude`, on a new stream and
    /// memory pool (a new world). Ranks are renumbered densely; every
    /// remaining rank must call it with the same list. Polled until ready or
    /// `timeout`.
    pub fn shrink(
        &self,
        exclude: &[usize],
        mode: ShrinkMode,
        timeout: Duration,
    ) -> Result<NcclComm, NcclError> {
        let sh = &self.shared;
        let Some(shrink) = sh.rt.nccl().comm_shrink.filter(|_| sh.rt.supports_shrink()) else {
            return Err(NcclError::unsupported(format!(
                "ncclCommShrink needs NCCL {} (runtime is {})",
                NcclVersion::SHRINK,
                sh.rt.version()
            )));
        };
        let (rank, size) = (self.rank(), self.size());
        let mut sorted = exclude.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        if sorted.len() != exclude.len() {
            return Err(NcclError::invalid("shrink: duplicate ranks in the exclude list"));
        }
        if let Some(bad) = sorted.iter().find(|r| **r >= size) {
            return Err(NcclError::invalid(format!(
                "shrink: rank {bad} is out of range for size {size}"
            )));
        }
        if sorted.contains(&rank) {
            return Err(NcclError::invalid(format!(
                "shrink: this rank ({rank}) is in the exclude list"
            )));
        }
        let allowed: &[CommState] = match mode {
            ShrinkMode::Default => &[CommState::Live],
            ShrinkMode::Abort => &[CommState::Live, CommState::Failed, CommState::Revoked],
        };
        let state = sh.state();
        if !allowed.contains(&state) {
            return Err(NcclError::Aborted { op: "shrink", state });
        }
        let new_config = CommConfig {
            rank: rank - sorted.iter().filter(|r| **r < rank).count(),
            size: size - sorted.len(),
            ..sh.config.clone()
        };
        let dev = WorldDevice::open(sh.rt.cuda_driver(), sh.config.device)?;
        let scratch = DeviceBuffer::alloc(&dev, DType::I32, 1)?;
        let mut list: Vec<c_int> = sorted
            .iter()
            .map(|r| to_int("rank", *r))
            .collect::<Result<_, _>>()?;
        let count = to_int("exclude count", list.len())?;
        let flags: c_int = match mode {
            ShrinkMode::Default => 0,
            ShrinkMode::Abort => 1,
        };
        let deadline = Instant::now() + timeout;
        // In default mode the parent must not be mid-enqueue; in abort mode we
        // deliberately do not wait for it.
        let _issue = match mode {
            ShrinkMode::Default => Some(lock(&sh.issue)),
            ShrinkMode::Abort => None,
        };
        dev.bind()?;
        let mut newcomm: RawComm = std::ptr::null_mut();
        let rc = sh.with_comm("shrink", |c| {
            // SAFETY: `c` is live under the gate; `list` holds `count` ints
            // and outlives the call; a NULL config inherits the parent's
            // (non-blocking) configuration.
            unsafe {
                shrink(
                    c,
                    list.as_mut_ptr(),
                    count,
                    &mut newcomm,
                    std::ptr::null_mut(),
                    flags,
                )
            }
        })?;
        if mode == ShrinkMode::Abort {
            let _ = sh.fail(NcclError::Aborted {
                op: "shrink(abort)",
                state: CommState::Failed,
            });
        }
        if newcomm.is_null() {
            sh.rt.nccl_check("ncclCommShrink", rc, None)?;
            return Err(NcclError::Nccl {
                call: "ncclCommShrink",
                code: rc,
                message: "returned no communicator".to_owned(),
            });
        }
        let child = NcclComm::from_parts(&sh.rt, dev, new_config, newcomm, scratch);
        sh.rt.nccl_check("ncclCommShrink", rc, None)?;
        child.shared.wait_ready("ncclCommShrink", deadline, timeout)?;
        Ok(child)
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        let sh = &self.shared;
        if matches!(
            sh.state(),
            CommState::Live | CommState::Failed | CommState::Revoked
        ) {
            let outcome = sh.abort(sh.config.abort_deadline);
            tracing::debug!(?outcome, "NCCL communicator dropped");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_codes_round_trip() {
        for s in CommState::ALL {
            assert_eq!(CommState::from_u8(s.to_u8()), s);
        }
        assert_eq!(CommState::from_u8(200), CommState::Quarantined);
        assert_eq!(CommState::Quarantined.to_string(), "quarantined");
    }

    #[test]
    fn quarantine_is_visible_in_outcomes() {
        assert!(
            AbortOutcome::Quarantined {
                waited: Duration::ZERO
            }
            .is_quarantined()
        );
        assert!(
            AbortOutcome::AlreadyClosed {
                state: CommState::Quarantined
            }
            .is_quarantined()
        );
        assert!(
            !AbortOutcome::Aborted {
                elapsed: Duration::ZERO
            }
            .is_quarantined()
        );
    }

    #[test]
    fn handles_are_send_and_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<NcclComm>();
        assert_send_sync::<crate::OpHandle>();
        assert_send_sync::<DeviceBuffer>();
        assert_send_sync::<NcclRuntime>();
    }
}
