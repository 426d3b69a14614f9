//! A world's GPU side (the `nccl` feature).
//!
//! - **NCCL worlds** (`Backend::Nccl`): the world keeps its TCP mesh as the
//!   control plane (heartbeats, host tensors, `finish`) and adds one
//!   non-blocking NCCL communicator on its own CUDA stream for device
//!   tensors. Rank 0 makes the NCCL unique id and publishes it in the
//!   world's store (or publishes why it could not, so nobody waits for an id
//!   that will never come); every rank then initialises its communicator
//!   within the join deadline. [`NcclWorld`] issues the device operations;
//!   each returns a [`DeviceOp`] that the world's watchdog also tracks: it
//!   polls the communicator's asynchronous error and every pending
//!   operation's completion event against its deadline, never blocking in
//!   CUDA or NCCL. A failure breaks only this world; its teardown aborts the
//!   communicator on a dedicated thread with a deadline, and a communicator
//!   whose abort does not return in time is quarantined (leaked on purpose)
//!   and reported with [`WorldEvent::Quarantined`](crate::WorldEvent).
//! - **Host-staged device tensors on any world**: [`World::send_device`] and
//!   [`World::recv_device`] move a [`DeviceBuffer`] over the world's TCP
//!   communicator, copied through pinned host memory, so processes that share
//!   one GPU (and so cannot form an NCCL world) can still exchange GPU
//!   tensors. The buffers come from a [`DeviceContext`](multiworld_nccl::DeviceContext)
//!   or an NCCL world.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use multiworld_nccl::{
    AbortOutcome, CommConfig, DeviceBuffer, NcclComm, NcclError, NcclRuntime, OpHandle, UniqueId,
};
use multiworld_store::{StoreError, WorldStore};
use multiworld_types::{DType, Rank, ReduceOp, Tag, Tensor, WorldName};

use crate::{
    config::WorldConfig,
    device_calls::{self, DeviceCall, WORDS},
    error::{JoinFailure, WorldError},
    lifecycle::BreakCause,
    recorder::OpStart,
    watchdog::PendingOp,
    world::{OpGuard, World, WorldShared},
};

/// The store key under which rank 0 publishes the NCCL unique id: one byte
/// [`ID_OK`], one byte saying whether rank 0 checks its device calls
/// (`WorldConfig::check_device_calls`, which every member must set alike),
/// and the 128-byte id; or [`ID_ERR`] followed by why rank 0 could not make
/// one.
pub(crate) const NCCL_ID_KEY: &str = "multiworld/nccl-id";
const ID_OK: u8 = 0;
const ID_ERR: u8 = 1;

/// The runtime's tag for the descriptions of device point-to-point
/// messages (`check_device_calls`).
const DEVICE_P2P_TAG: Tag = multiworld_types::runtime_tag(1);

/// How often a check waiting on an interruptible caller's thread asks
/// whether it was interrupted ([`interruptible`]).
const INTERRUPT_SLICE: Duration = Duration::from_millis(50);

thread_local! {
    /// This thread's interruption hook, while it runs [`interruptible`].
    static INTERRUPTED: std::cell::Cell<Option<fn() -> bool>> = const { std::cell::Cell::new(None) };
}

/// Runs `f` on this thread with `interrupted` as its interruption hook: a
/// device call's check (`WorldConfig::check_device_calls`) that waits for
/// the other members asks it every 50 ms and, when it says so, stops
/// waiting and fails the call (`WorldError::Timeout`, op
/// `"device_check (interrupted)"`). For a caller whose user can interrupt
/// it (the Python package checks for Ctrl-C there). Nothing else of `f`
/// is interrupted.
pub fn interruptible<R>(interrupted: fn() -> bool, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<fn() -> bool>);
    impl Drop for Restore {
        fn drop(&mut self) {
            INTERRUPTED.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(INTERRUPTED.with(|c| c.replace(Some(interrupted))));
    f()
}

/// Which of a peer's two locks ([`DeviceSide`]'s `p2p`).
#[derive(Clone, Copy)]
enum Direction {
    Send,
    Recv,
}

/// The error of a check that cannot run.
fn check_unusable(w: &WorldShared, detail: &str) -> WorldError {
    WorldError::InvalidArgument {
        world: w.name.clone(),
        detail: format!("check_device_calls: {detail}"),
    }
}

/// The key a rank sets once it has read [`NCCL_ID_KEY`].
fn seen_key(rank: u32) -> String {
    format!("multiworld/nccl-id-seen/{rank}")
}

/// How long a rank 0 that could not make an id waits for the others to read
/// its reason before it gives up the world (and closes its store).
const SEEN_WAIT: Duration = Duration::from_secs(5);

/// The deadline of device operations and host copies when the world sets no
/// `op_timeout`: unlike the TCP side, a hung kernel is not caught by
/// heartbeats, so device operations always have one.
pub const DEFAULT_DEVICE_OP_TIMEOUT: Duration = Duration::from_secs(60);

/// How often the watchdog polls an NCCL world's communicator and pending
/// operations.
pub(crate) const DEVICE_POLL: Duration = Duration::from_millis(10);

/// Where the manager keeps its NCCL runtime: set by
/// `WorldManager::use_nccl_runtime`, or loaded on the first NCCL join.
pub(crate) type RuntimeSlot = Arc<Mutex<Option<NcclRuntime>>>;

/// The runtime in `slot`, loading (and keeping) one if none is there yet. A
/// failed load is not kept, so a later join reports it again.
pub(crate) fn runtime(slot: &RuntimeSlot) -> Result<NcclRuntime, NcclError> {
    let mut guard = slot.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(rt) = guard.as_ref() {
        return Ok(rt.clone());
    }
    let rt = NcclRuntime::load()?;
    *guard = Some(rt.clone());
    Ok(rt)
}

/// The NCCL side of one world.
pub(crate) struct DeviceSide {
    pub(crate) comm: NcclComm,
    /// Operations issued and not yet seen complete by the watchdog.
    pending: Mutex<Vec<Arc<OpHandle>>>,
    /// Per peer, held by a checked send (`check_device_calls`) from its
    /// enqueue to its announcement, and by a checked receive from reading
    /// the announcement to its enqueue: messages and their descriptions
    /// stay in one order however many threads send or receive. Two locks,
    /// so that a thread receiving from a peer never holds up another
    /// sending to it.
    p2p: Vec<(Mutex<()>, Mutex<()>)>,
}

impl DeviceSide {
    /// What the watchdog needs: the communicator's error (or a pending
    /// operation's), and the pending operation whose deadline comes first.
    /// Never blocks.
    pub(crate) fn observe(&self) -> (Option<String>, Option<PendingOp>) {
        if let Some(e) = self.comm.poll_error() {
            return (Some(e.to_string()), None);
        }
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        let mut error = None;
        pending.retain(|h| match h.is_completed() {
            Ok(done) => !done,
            Err(e) => {
                error.get_or_insert_with(|| format!("{}: {e}", h.op()));
                false
            }
        });
        let earliest = pending.iter().min_by_key(|h| h.deadline()).map(|h| PendingOp {
            op: format!("device {}", h.op()),
            deadline: h.deadline(),
            timeout: h.deadline().saturating_duration_since(h.issued_at()),
        });
        (error, earliest)
    }

    /// Aborts the communicator (bounded by its abort deadline); runs on a
    /// blocking thread.
    pub(crate) async fn abort(self: Arc<Self>) -> AbortOutcome {
        let me = Arc::clone(&self);
        let deadline = self.comm.config().abort_deadline;
        match tokio::task::spawn_blocking(move || me.comm.abort(deadline)).await {
            Ok(outcome) => outcome,
            // The blocking pool is gone (runtime shutting down): abort here;
            // it is still bounded by the deadline.
            Err(_) => self.comm.abort(deadline),
        }
    }
}

/// Sets up this rank's NCCL communicator for a world whose TCP mesh is up:
/// exchanges the unique id through the world's store and initialises the
/// communicator before `deadline`.
pub(crate) async fn join(
    slot: &RuntimeSlot,
    config: &WorldConfig,
    store: &WorldStore,
    deadline: Instant,
) -> Result<DeviceSide, JoinFailure> {
    let remaining = || deadline.saturating_duration_since(Instant::now());
    // Loading NCCL (a file search, `dlopen` of a library of hundreds of MiB
    // and its initialisers) and the first `ncclGetUniqueId` (NCCL's own
    // initialisation: a socket and a thread) take long: on a blocking
    // thread, so that no runtime thread, and no other world's heartbeats,
    // waits for them (nor for another join's load, behind the slot's lock).
    // Any failure to load (the blocking task's too) is rank 0's to publish
    // below, so that no other rank waits for an id that will never come.
    let rt: Result<NcclRuntime, String> = {
        let slot = Arc::clone(slot);
        tokio::task::spawn_blocking(move || runtime(&slot))
            .await
            .map_err(|e| format!("loading NCCL: {e}"))
            .and_then(|r| r.map_err(|e| e.to_string()))
    };
    let id = if config.rank == Rank(0) {
        let made = match &rt {
            Ok(rt) => {
                let rt = rt.clone();
                tokio::task::spawn_blocking(move || rt.unique_id())
                    .await
                    .map_err(|e| format!("making the NCCL id: {e}"))
                    .and_then(|r| r.map_err(|e| e.to_string()))
            }
            Err(e) => Err(e.clone()),
        };
        let value: Vec<u8> = match &made {
            Ok(id) => [ID_OK, u8::from(config.check_device_calls)]
                .into_iter()
                .chain(id.to_bytes())
                .collect(),
            Err(e) => std::iter::once(ID_ERR).chain(e.bytes()).collect(),
        };
        store
            .set(NCCL_ID_KEY, value)
            .await
            .map_err(|e| format!("publishing the NCCL id: {e}"))?;
        if made.is_err() {
            // Failing closes the world's store: first let every rank read why
            // (bounded), so none is left with "no store is open".
            let seen: Vec<String> = (1..config.size).map(seen_key).collect();
            let _ = store.wait(&seen, remaining().min(SEEN_WAIT)).await;
        }
        made?
    } else {
        let value = store.get(NCCL_ID_KEY, remaining()).await.map_err(|e| {
            let what = format!("waiting for rank 0's NCCL id: {e}");
            match e {
                // Rank 0 did not publish it in time (it has not joined yet,
                // or its NCCL is slow to load): the join's timeout.
                StoreError::Timeout { .. } => JoinFailure::deadline(what),
                _ => JoinFailure::Other(what),
            }
        })?;
        // Best effort: rank 0 waits for this only when it failed.
        let _ = store.set(seen_key(config.rank.0), Vec::new()).await;
        match value.split_first() {
            Some((&ID_OK, rest)) => {
                let Some((&checks, id)) = rest.split_first() else {
                    return Err(format!("malformed NCCL id in the store ({} bytes)", value.len()).into());
                };
                // Checked collectives wait for every member's description:
                // a member that goes straight to NCCL would never give it.
                if (checks != 0) != config.check_device_calls {
                    return Err(format!(
                        "members disagree on check_device_calls: rank 0 has it {}, rank {} {}",
                        if checks != 0 { "on" } else { "off" },
                        config.rank,
                        if config.check_device_calls { "on" } else { "off" },
                    )
                    .into());
                }
                UniqueId::from_bytes(id).map_err(|e| format!("rank 0's NCCL id: {e}"))?
            }
            Some((&ID_ERR, why)) => {
                return Err(format!("rank 0 could not set up NCCL: {}", String::from_utf8_lossy(why)).into());
            }
            _ => return Err(format!("malformed NCCL id in the store ({} bytes)", value.len()).into()),
        }
    };
    let rt = rt?;
    let comm_config = CommConfig::new(config.rank.index(), config.size as usize)
        .with_device(config.local_rank as usize)
        .with_init_timeout(remaining())
        .with_op_timeout(config.op_timeout.unwrap_or(DEFAULT_DEVICE_OP_TIMEOUT))
        .with_abort_deadline(config.nccl_abort_deadline);
    let comm = tokio::task::spawn_blocking(move || NcclComm::init(&rt, &comm_config, &id))
        .await
        .map_err(|e| format!("NCCL init did not finish: {e}"))?
        .map_err(|e| match e {
            // Not every rank's init came within what was left of the join.
            NcclError::Timeout { .. } => JoinFailure::deadline(format!("NCCL init: {e}")),
            _ => JoinFailure::Other(format!("NCCL init: {e}")),
        })?;
    Ok(DeviceSide {
        comm,
        pending: Mutex::new(Vec::new()),
        p2p: (0..config.size).map(|_| Default::default()).collect(),
    })
}

impl WorldShared {
    /// Turns an NCCL error of this world's communicator into the caller's
    /// error; a world-fatal one breaks the world.
    pub(crate) fn fail_device(self: &Arc<Self>, err: NcclError) -> WorldError {
        if err.is_world_fatal() {
            let cause = match &err {
                // An operation, its enqueue or a bounded copy that did not
                // finish within the device operation deadline: the cause the
                // watchdog gives an operation past its deadline, so the world
                // breaks alike whichever of the two sees it first.
                NcclError::Timeout { op, after } => BreakCause::OpDeadline {
                    op: (*op).to_owned(),
                    after: *after,
                },
                _ => BreakCause::Device {
                    reason: err.to_string(),
                },
            };
            self.break_with(cause);
            return self.unusable();
        }
        device_call_error(&self.name, err)
    }
}

/// An error of one device call that says nothing about the world's health
/// (bad argument, unsupported, out of memory, a host copy timing out).
fn device_call_error(world: &WorldName, err: NcclError) -> WorldError {
    match err {
        NcclError::Timeout { op, after } => WorldError::Timeout {
            world: world.clone(),
            op: op.to_string(),
            after,
        },
        NcclError::InvalidArgument { what } => WorldError::InvalidArgument {
            world: world.clone(),
            detail: what,
        },
        other => WorldError::Device {
            world: world.clone(),
            detail: other.to_string(),
        },
    }
}

/// The host tensors of one world's host-staged transfers
/// ([`World::send_device`], [`World::recv_device`]), kept from one call to
/// the next: a stream of transfers then reuses memory whose pages are
/// mapped already instead of faulting in a fresh buffer each call, which
/// cost more than the transfer itself (measured on an H100 VM: 64 MiB into
/// fresh pageable memory at 1.3 GB/s, a round trip of 64 MiB between two
/// processes 0.80 GB/s each way before). They are made in page-locked
/// memory where they can be, so the device copies them directly (the same
/// round trip: 1.57–1.91 GB/s through the world's 4 MiB pinned staging
/// buffer into kept pageable tensors, 2.76–3.06 GB/s into kept pinned ones).
/// Holds at most [`Self::KEEP`]
/// tensors and [`Self::KEEP_BYTES`] bytes, the ones given back last, and
/// hands out only one of the same dtype and length (the receive checks both
/// against the message). What it holds is freed when the world is torn
/// down ([`Self::close`]), not whenever its last handle goes; a larger
/// transfer is staged through memory of its own.
#[derive(Debug, Default)]
pub(crate) struct HostStaging(Mutex<Kept>);

/// The tensors a [`HostStaging`] holds, and whether its world has ended.
#[derive(Debug, Default)]
pub(crate) struct Kept {
    tensors: Vec<Tensor>,
    closed: bool,
}

impl HostStaging {
    /// A send and a receive in flight at once each use their own.
    const KEEP: usize = 2;
    /// What it may hold in all.
    const KEEP_BYTES: usize = 512 << 20;

    /// The largest tensor made in page-locked memory: such memory cannot be
    /// paged out, so a larger transfer stages through pageable memory.
    const PINNED_MAX: usize = 256 << 20;

    /// A kept tensor of `buf`'s dtype and length, or a new one (zeroed): in
    /// page-locked memory from `buf`'s device up to [`Self::PINNED_MAX`]
    /// bytes, so the device copies it directly, else (or when the driver
    /// has no pinned memory to give) in ordinary memory, which the copy
    /// stages through the world's pinned buffers.
    fn take(&self, world: &WorldName, buf: &DeviceBuffer) -> Result<Tensor, WorldError> {
        let (dtype, len) = (buf.dtype(), buf.len());
        if let Some(t) = self.kept(dtype, len) {
            return Ok(t);
        }
        if (1..=Self::PINNED_MAX).contains(&buf.byte_len()) {
            match buf.pinned_host_tensor() {
                Ok(t) => return Ok(t),
                Err(e) => tracing::debug!(world = %world, error = %e, "staging through pageable memory"),
            }
        }
        Tensor::zeros(dtype, [len]).map_err(|e| WorldError::InvalidArgument {
            world: world.clone(),
            detail: e.to_string(),
        })
    }

    /// A kept tensor of `dtype` and `len` elements, taken out.
    fn kept(&self, dtype: DType, len: usize) -> Option<Tensor> {
        let mut kept = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let i = kept
            .tensors
            .iter()
            .position(|t| t.dtype() == dtype && t.numel() == len)?;
        Some(kept.tensors.remove(i))
    }

    /// Keeps `t` for a later transfer (dropping the oldest beyond `KEEP`
    /// tensors or `KEEP_BYTES`; one larger than `KEEP_BYTES` is not kept).
    /// Only tensors whose transfer succeeded come back: one whose receive
    /// failed may hold anything, or nothing.
    fn give(&self, t: Tensor) {
        if t.nbytes() > Self::KEEP_BYTES {
            return;
        }
        let mut evicted = Vec::new();
        let mut kept = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if kept.closed {
            // The world has ended: a transfer that finished during its
            // teardown frees its tensor (after the lock).
            drop(kept);
            drop(t);
            return;
        }
        kept.tensors.push(t);
        while kept.tensors.len() > Self::KEEP
            || kept.tensors.iter().map(Tensor::nbytes).sum::<usize>() > Self::KEEP_BYTES
        {
            evicted.push(kept.tensors.remove(0));
        }
        // Freed after the lock (pinned memory goes back to the driver).
        drop(kept);
        drop(evicted);
    }

    /// Frees what it holds and keeps nothing from now on: called by the
    /// world's teardown, so a removed world's pinned memory goes back to
    /// the driver then, even while a task or a caller still holds a
    /// reference to the world.
    pub(crate) fn close(&self) {
        let mut kept = self.0.lock().unwrap_or_else(|e| e.into_inner());
        kept.closed = true;
        let freed = std::mem::take(&mut kept.tensors);
        drop(kept);
        // Pinned memory goes back to the driver, which can take a while for
        // hundreds of MiB: not on a runtime thread.
        blocking(move || drop(freed));
    }
}

/// Runs a device call that may block (a deadline-bounded host copy, or an
/// operation's enqueue, which waits for NCCL's `ncclInProgress` to clear for
/// up to the operation deadline) without stalling the other tasks of the
/// multi-threaded Tokio runtime it is called from: `block_in_place` hands
/// this worker's queue to another thread for the duration. The calls borrow
/// the caller's buffers, so `spawn_blocking` (which needs `'static` data)
/// cannot run them, and a caller that gave up waiting could free a buffer
/// that NCCL is about to use. `block_in_place` panics on a current-thread
/// runtime, so there (and outside any runtime) the call simply runs on the
/// calling thread: a current-thread runtime has no other thread to hand its
/// tasks to.
fn blocking<R>(f: impl FnOnce() -> R) -> R {
    match tokio::runtime::Handle::try_current() {
        Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(f)
        }
        _ => f(),
    }
}

impl World {
    /// This world's NCCL communicator, for device operations. Fails with
    /// `InvalidArgument` if the world was not joined with `Backend::Nccl`.
    pub fn nccl(&self) -> Result<NcclWorld, WorldError> {
        self.shared.check()?;
        match self.shared.device.get() {
            Some(dev) => Ok(NcclWorld {
                world: self.clone(),
                dev: Arc::clone(dev),
            }),
            None => Err(WorldError::InvalidArgument {
                world: self.shared.name.clone(),
                detail: "not an NCCL world (joined with the TCP backend); use send_device/recv_device \
                         for host-staged device tensors"
                    .into(),
            }),
        }
    }

    /// Sends a device buffer to `dst` over this world's TCP communicator,
    /// copied to the host through pinned memory first (host-staged: works
    /// on any world, e.g. between processes that share one GPU). The
    /// receiver must post [`recv_device`](World::recv_device) (or a host
    /// receive) of the same dtype and length.
    pub async fn send_device(&self, dst: Rank, tag: Tag, buf: &DeviceBuffer) -> Result<(), WorldError> {
        let w = &self.shared;
        w.check()?;
        w.check_tag(tag)?;
        let timeout = w.config.op_timeout.unwrap_or(DEFAULT_DEVICE_OP_TIMEOUT);
        // Off the runtime's threads: a new pinned tensor is allocated and
        // zeroed in the driver (up to 256 MiB).
        let mut host = blocking(|| w.host_staging.take(&w.name, buf))?;
        blocking(|| buf.copy_to_host_tensor(&mut host, timeout))
            .map_err(|e| device_call_error(&w.name, e))?;
        if !host.validate_after_write() {
            // Refused here: the receiver's reader would take such a payload
            // for a protocol violation and break the world.
            return Err(WorldError::InvalidArgument {
                world: w.name.clone(),
                detail: "a bool device buffer holds bytes other than 0 and 1".into(),
            });
        }
        let r = self.send(dst, tag, host.view()).await;
        blocking(|| w.host_staging.give(host));
        r
    }

    /// Receives into a device buffer from `src` over this world's TCP
    /// communicator (see [`send_device`](World::send_device)); the message
    /// must match the buffer's dtype and length, or this fails with
    /// `Mismatch` and the buffer is untouched.
    pub async fn recv_device(&self, src: Rank, tag: Tag, buf: &mut DeviceBuffer) -> Result<(), WorldError> {
        let w = &self.shared;
        let mut host = blocking(|| w.host_staging.take(&w.name, buf))?;
        self.recv(src, tag, &mut host).await?;
        let timeout = w.config.op_timeout.unwrap_or(DEFAULT_DEVICE_OP_TIMEOUT);
        blocking(|| buf.copy_from_host_tensor(&mut host, timeout))
            .map_err(|e| device_call_error(&w.name, e))?;
        blocking(|| w.host_staging.give(host));
        Ok(())
    }
}

/// The device operations of an NCCL world. Cheap to clone. Every operation
/// is enqueued on the world's own stream and returns with a [`DeviceOp`] once
/// NCCL has accepted it; buffers must come from this world
/// ([`NcclWorld::alloc`], [`NcclWorld::upload`]). Once the world is broken
/// every call fails with `WorldError::Broken`.
///
/// The enqueue itself can take a while (NCCL may answer `ncclInProgress`,
/// and the world then polls until it clears, at most the device operation
/// deadline, after which the world breaks). On a multi-threaded Tokio
/// runtime it runs under `block_in_place`, as do uploads and downloads, so
/// other tasks — and other worlds — keep running; on a current-thread
/// runtime it blocks that runtime for as long as it takes.
#[derive(Clone)]
pub struct NcclWorld {
    world: World,
    dev: Arc<DeviceSide>,
}

impl std::fmt::Debug for NcclWorld {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclWorld")
            .field("world", &self.world.name())
            .field("comm", &self.dev.comm)
            .finish()
    }
}

impl NcclWorld {
    /// The raw communicator (state, configuration, runtime). Operations
    /// issued on it directly are not tracked by the world's watchdog.
    pub fn comm(&self) -> &NcclComm {
        &self.dev.comm
    }

    /// A zeroed device buffer of `len` elements owned by this world.
    pub fn alloc(&self, dtype: DType, len: usize) -> Result<DeviceBuffer, WorldError> {
        self.world.shared.check()?;
        self.dev
            .comm
            .alloc(dtype, len)
            .map_err(|e| self.world.shared.fail_device(e))
    }

    /// A device buffer holding `bytes` (native-endian elements of `dtype`).
    pub fn upload(&self, dtype: DType, bytes: &[u8]) -> Result<DeviceBuffer, WorldError> {
        self.world.shared.check()?;
        blocking(|| self.dev.comm.upload(dtype, bytes)).map_err(|e| self.world.shared.fail_device(e))
    }

    /// Copies a device buffer of this world to the host, after the world's
    /// earlier operations (bounded by the device operation deadline).
    pub fn download(&self, buf: &DeviceBuffer) -> Result<Vec<u8>, WorldError> {
        self.world.shared.check()?;
        let timeout = self.dev.comm.config().op_timeout;
        blocking(|| buf.to_host_vec(timeout)).map_err(|e| self.world.shared.fail_device(e))
    }

    /// A device tensor holding a host tensor's data, with its dtype and
    /// shape.
    pub fn upload_tensor(&self, tensor: &Tensor) -> Result<DeviceBuffer, WorldError> {
        let mut buf = self.upload(tensor.dtype(), tensor.as_bytes())?;
        buf.reshape(tensor.shape())
            .map_err(|e| device_call_error(&self.world.shared.name, e))?;
        Ok(buf)
    }

    /// A host tensor with a device tensor's data, dtype and shape.
    pub fn download_tensor(&self, buf: &DeviceBuffer) -> Result<Tensor, WorldError> {
        let bytes = self.download(buf)?;
        Tensor::from_bytes(buf.dtype(), buf.shape(), &bytes).map_err(|e| WorldError::InvalidArgument {
            world: self.world.shared.name.clone(),
            detail: e.to_string(),
        })
    }

    /// With [`WorldConfig::check_device_calls`](crate::WorldConfig): gathers
    /// every member's description of this collective over the world's TCP
    /// mesh (a small all-gather, waited for on this thread, for at most the
    /// device operations' deadline, past which the world breaks with
    /// `OpDeadline`) and fails with `Mismatch` on every member if they
    /// differ, before anything reaches NCCL. Without it: nothing.
    fn agreed(&self, call: DeviceCall) -> Result<(), WorldError> {
        if !self.world.shared.config.check_device_calls {
            return Ok(());
        }
        let w = &self.world.shared;
        let mine = self.words_tensor(call.words().to_vec())?;
        let n = w.size as usize;
        let mut all = self.words_tensor(vec![0; n * WORDS])?;
        let group = self.world.collectives();
        self.wait_for_check(group.all_gather_into_tensor(&mut all, &mine))?;
        let gathered = all
            .as_slice::<u64>()
            .map_err(|e| check_unusable(w, &e.to_string()))?;
        device_calls::agree(gathered).map_err(|detail| WorldError::Mismatch {
            world: w.name.clone(),
            detail,
        })
    }

    /// Sends `buf` to `peer`. With `check_device_calls`, its arguments are
    /// checked, then
    /// announced to `peer` over TCP (without waiting), then enqueued, all
    /// under the peer's send lock, so that descriptions go in the order of
    /// the messages. Announced before the enqueue: NCCL may not finish
    /// enqueueing a pair's first send until the receiver has posted its
    /// receive (the pair connects then), and the receiver posts it once it
    /// has read the announcement. A send refused for its arguments is
    /// refused before its announcement; one whose enqueue fails after it
    /// would leave a description without its message, so the world breaks.
    pub fn send(&self, buf: &DeviceBuffer, peer: Rank) -> Result<DeviceOp, WorldError> {
        let w = &self.world.shared;
        if !w.config.check_device_calls {
            return self.issue("device_send", |c| c.send(buf, peer.0 as usize));
        }
        let _order = self.lock_peer(peer, Direction::Send)?;
        self.dev
            .comm
            .check_p2p(buf, peer.index())
            .map_err(|e| w.fail_device(e))?;
        self.announce(DeviceCall::message(buf.dtype(), buf.len()), peer)?;
        match self.issue("device_send", |c| c.send(buf, peer.0 as usize)) {
            Err(e) if !e.is_world_broken() => {
                w.break_with(BreakCause::Device {
                    reason: format!("a device send to rank {peer} failed after its announcement: {e}"),
                });
                Err(w.unusable())
            }
            r => r,
        }
    }

    /// Sends the description `call` to `peer` (written in the background:
    /// a failure to write it is the connection's, which breaks the world on
    /// both sides).
    fn announce(&self, call: DeviceCall, peer: Rank) -> Result<(), WorldError> {
        let words = self.words_tensor(call.words().to_vec())?;
        drop(self.world.communicator().isend(peer, DEVICE_P2P_TAG, words));
        Ok(())
    }

    /// Receives into `buf` from `peer`. With `check_device_calls`, under the
    /// peer's receive lock,
    /// it waits (on this thread, at most the device deadline) for the
    /// description of the message `peer` sent next and compares it with
    /// this receive. On a difference, or if this receive then fails to
    /// enqueue, the sender's message is already on its way through NCCL:
    /// it is received into scratch device memory of its own size in this
    /// receive's place (freed once it has arrived), so that the world goes
    /// on, and this receive fails (`Mismatch` naming both, its buffer
    /// untouched; or the enqueue's own error). If even that cannot be done,
    /// messages and descriptions would be apart for good: the world breaks.
    pub fn recv(&self, buf: &mut DeviceBuffer, peer: Rank) -> Result<DeviceOp, WorldError> {
        let w = &self.world.shared;
        if !w.config.check_device_calls {
            return self.issue("device_recv", |c| c.recv(buf, peer.0 as usize));
        }
        let _order = self.lock_peer(peer, Direction::Recv)?;
        let mut got = self.words_tensor(vec![0; WORDS])?;
        let comm = self.world.communicator();
        self.wait_for_check(comm.recv(peer, DEVICE_P2P_TAG, &mut got))?;
        let sent = got
            .as_slice::<u64>()
            .map_err(|e| check_unusable(w, &e.to_string()))?;
        let mine = DeviceCall::message(buf.dtype(), buf.len());
        let failure = match device_calls::matches_sent(sent, &mine, peer, w.rank) {
            Ok(()) => match self.issue("device_recv", |c| c.recv(buf, peer.0 as usize)) {
                Ok(op) => return Ok(op),
                Err(e) if e.is_world_broken() => return Err(e),
                Err(e) => e,
            },
            Err(detail) => WorldError::Mismatch {
                world: w.name.clone(),
                detail,
            },
        };
        if let Err(why) = self.drain(sent, peer) {
            w.break_with(BreakCause::Device {
                reason: format!(
                    "a device message from rank {peer} could not be received after its receive failed ({failure}): {why}"
                ),
            });
            return Err(w.unusable());
        }
        Err(failure)
    }

    /// Receives the message `peer` announced with `sent` into scratch
    /// device memory of its size, freed once it has arrived (and kept
    /// forever if that fails: a kernel may write it until the abort).
    fn drain(&self, sent: &[u64], peer: Rank) -> Result<(), String> {
        let (dtype, len) = device_calls::sent_message(sent)
            .ok_or_else(|| "its description is not one of a message".to_string())?;
        let mut scratch = self.alloc(dtype, len).map_err(|e| e.to_string())?;
        let mut op = self
            .issue("device_recv_drain", |c| c.recv(&mut scratch, peer.0 as usize))
            .map_err(|e| e.to_string())?;
        let handle = tokio::runtime::Handle::try_current().map_err(|e| e.to_string())?;
        drop(handle.spawn(async move {
            match op.completed().await {
                Ok(()) => drop(scratch),
                Err(_) => std::mem::forget(scratch),
            }
        }));
        Ok(())
    }

    /// Takes `peer`'s send or receive lock (off the async worker: a
    /// receive holds it across its wait for the announcement), then checks
    /// that the world is usable.
    fn lock_peer(&self, peer: Rank, direction: Direction) -> Result<MutexGuard<'_, ()>, WorldError> {
        let w = &self.world.shared;
        let locks = self
            .dev
            .p2p
            .get(peer.index())
            .ok_or_else(|| WorldError::InvalidArgument {
                world: w.name.clone(),
                detail: format!("no rank {peer} in a world of {}", w.size),
            })?;
        let lock = match direction {
            Direction::Send => &locks.0,
            Direction::Recv => &locks.1,
        };
        let guard = blocking(|| lock.lock().unwrap_or_else(PoisonError::into_inner));
        w.check()?;
        Ok(guard)
    }

    /// A tensor of description words.
    fn words_tensor(&self, words: Vec<u64>) -> Result<Tensor, WorldError> {
        let len = words.len();
        Tensor::from_vec(words, [len]).map_err(|e| check_unusable(&self.world.shared, &e.to_string()))
    }

    /// Waits on this thread for one step of the check over TCP: at most the
    /// device operations' deadline (the check is bounded like the device
    /// call it guards), past which the world breaks with `OpDeadline` (a
    /// TCP call cut off part-way leaves the members' streams apart).
    fn wait_for_check<T>(
        &self,
        step: impl std::future::Future<Output = Result<T, multiworld_tcp::Error>>,
    ) -> Result<T, WorldError> {
        let w = &self.world.shared;
        let handle = tokio::runtime::Handle::try_current()
            .map_err(|_| check_unusable(w, "a device call must be made from within the runtime"))?;
        if handle.runtime_flavor() != tokio::runtime::RuntimeFlavor::MultiThread {
            return Err(check_unusable(
                w,
                "a device call must be made on a multi-threaded runtime",
            ));
        }
        let limit = w.config.op_timeout.unwrap_or(DEFAULT_DEVICE_OP_TIMEOUT);
        let deadline = Instant::now() + limit;
        let interrupted = INTERRUPTED.with(std::cell::Cell::get);
        let mut step = std::pin::pin!(step);
        loop {
            // In slices when the caller can be interrupted ([`interruptible`]).
            let left = deadline.saturating_duration_since(Instant::now());
            let slice = if interrupted.is_some() {
                left.min(INTERRUPT_SLICE)
            } else {
                left
            };
            // Off the async worker, as the enqueue itself is (see
            // `blocking`): the TCP I/O runs on the runtime's other threads
            // meanwhile.
            let r =
                tokio::task::block_in_place(|| handle.block_on(tokio::time::timeout(slice, step.as_mut())));
            if let Ok(r) = r {
                return r.map_err(|e| self.world.collective_error(e));
            }
            if Instant::now() >= deadline {
                w.break_with(BreakCause::OpDeadline {
                    op: "device_check".into(),
                    after: limit,
                });
                return Err(w.unusable());
            }
            if interrupted.is_some_and(|hook| hook()) {
                // The step is dropped: a receive of a description is
                // withdrawn (the description waits for the next), a
                // gather ends as any collective dropped part-way does.
                return Err(WorldError::Timeout {
                    world: w.name.clone(),
                    op: "device_check (interrupted)".into(),
                    after: limit.saturating_sub(deadline.saturating_duration_since(Instant::now())),
                });
            }
        }
    }

    fn issue(
        &self,
        kind: &'static str,
        f: impl FnOnce(&NcclComm) -> Result<OpHandle, NcclError>,
    ) -> Result<DeviceOp, WorldError> {
        let w = &self.world.shared;
        w.check()?;
        // Recorded and timed from the enqueue to the completion `wait` sees.
        let mut op = w.track(OpStart {
            kind,
            peer: None,
            tag: None,
            bytes: 0,
        });
        // May wait in `NcclComm::issue` (its lock, and polling NCCL until the
        // enqueue completes): off the async worker (see `blocking`).
        let comm = &self.dev.comm;
        let handle = match blocking(|| f(comm)).map_err(|e| w.fail_device(e)) {
            Ok(h) => Arc::new(h),
            Err(e) => {
                op.finish::<(), _>(&Err(&e));
                return Err(e);
            }
        };
        self.dev
            .pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Arc::clone(&handle));
        Ok(DeviceOp {
            probe: DeviceProbe {
                handle,
                world: Arc::clone(w),
            },
            op,
        })
    }

    /// All-reduce in place.
    pub fn all_reduce(&self, buf: &mut DeviceBuffer, op: ReduceOp) -> Result<DeviceOp, WorldError> {
        self.agreed(DeviceCall {
            kind: "all_reduce",
            dtype: Some(buf.dtype()),
            count: buf.len(),
            root: None,
            op: Some(op),
        })?;
        self.issue("device_all_reduce", |c| c.all_reduce_in_place(buf, op))
    }

    /// All-reduce out of place: `recv` gets the reduction of every rank's
    /// `send` (same dtype and length); `send` is left as it was.
    pub fn all_reduce_into(
        &self,
        send: &DeviceBuffer,
        recv: &mut DeviceBuffer,
        op: ReduceOp,
    ) -> Result<DeviceOp, WorldError> {
        self.agreed(DeviceCall {
            kind: "all_reduce",
            dtype: Some(send.dtype()),
            count: send.len(),
            root: None,
            op: Some(op),
        })?;
        self.issue("device_all_reduce", |c| c.all_reduce(send, recv, op))
    }

    /// Broadcast from `root`, in place.
    pub fn broadcast(&self, buf: &mut DeviceBuffer, root: Rank) -> Result<DeviceOp, WorldError> {
        self.agreed(DeviceCall {
            kind: "broadcast",
            dtype: Some(buf.dtype()),
            count: buf.len(),
            root: Some(root),
            op: None,
        })?;
        self.issue("device_broadcast", |c| c.broadcast(buf, root.0 as usize))
    }

    /// Broadcast from `root` out of place: every rank's `recv` (the root's
    /// included) gets the root's `send`. `send` is required on the root
    /// (same dtype and length as `recv`) and ignored elsewhere.
    pub fn broadcast_into(
        &self,
        send: Option<&DeviceBuffer>,
        recv: &mut DeviceBuffer,
        root: Rank,
    ) -> Result<DeviceOp, WorldError> {
        self.agreed(DeviceCall {
            kind: "broadcast",
            dtype: Some(recv.dtype()),
            count: recv.len(),
            root: Some(root),
            op: None,
        })?;
        self.issue("device_broadcast", |c| {
            c.broadcast_into(send, recv, root.0 as usize)
        })
    }

    /// Reduce to `root`, in place (only the root's buffer holds the result).
    pub fn reduce(&self, buf: &mut DeviceBuffer, op: ReduceOp, root: Rank) -> Result<DeviceOp, WorldError> {
        self.agreed(DeviceCall {
            kind: "reduce",
            dtype: Some(buf.dtype()),
            count: buf.len(),
            root: Some(root),
            op: Some(op),
        })?;
        self.issue("device_reduce", |c| c.reduce_in_place(buf, op, root.0 as usize))
    }

    /// Reduce to `root` out of place: the root's `recv` gets the reduction
    /// of every rank's `send` (same dtype and length); `recv` is left
    /// untouched on the other ranks.
    pub fn reduce_into(
        &self,
        send: &DeviceBuffer,
        recv: &mut DeviceBuffer,
        op: ReduceOp,
        root: Rank,
    ) -> Result<DeviceOp, WorldError> {
        self.agreed(DeviceCall {
            kind: "reduce",
            dtype: Some(send.dtype()),
            count: send.len(),
            root: Some(root),
            op: Some(op),
        })?;
        self.issue("device_reduce", |c| c.reduce(send, recv, op, root.0 as usize))
    }

    /// All-gather: `recv` holds every rank's `send`, in rank order.
    pub fn all_gather(&self, send: &DeviceBuffer, recv: &mut DeviceBuffer) -> Result<DeviceOp, WorldError> {
        self.agreed(DeviceCall {
            kind: "all_gather",
            dtype: Some(send.dtype()),
            count: send.len(),
            root: None,
            op: None,
        })?;
        self.issue("device_all_gather", |c| c.all_gather(send, recv))
    }

    /// Reduce-scatter: `recv` gets this rank's slice of the reduction of
    /// every rank's `send`.
    pub fn reduce_scatter(
        &self,
        send: &DeviceBuffer,
        recv: &mut DeviceBuffer,
        op: ReduceOp,
    ) -> Result<DeviceOp, WorldError> {
        self.agreed(DeviceCall {
            kind: "reduce_scatter",
            dtype: Some(recv.dtype()),
            count: recv.len(),
            root: None,
            op: Some(op),
        })?;
        self.issue("device_reduce_scatter", |c| c.reduce_scatter(send, recv, op))
    }

    /// All-to-all with equal slices.
    pub fn all_to_all(&self, send: &DeviceBuffer, recv: &mut DeviceBuffer) -> Result<DeviceOp, WorldError> {
        self.agreed(DeviceCall {
            kind: "all_to_all",
            dtype: Some(send.dtype()),
            count: send.len(),
            root: None,
            op: None,
        })?;
        self.issue("device_all_to_all", |c| c.all_to_all(send, recv))
    }

    /// Gather to `root` (`recv` only on the root).
    pub fn gather(
        &self,
        send: &DeviceBuffer,
        recv: Option<&mut DeviceBuffer>,
        root: Rank,
    ) -> Result<DeviceOp, WorldError> {
        self.agreed(DeviceCall {
            kind: "gather",
            dtype: Some(send.dtype()),
            count: send.len(),
            root: Some(root),
            op: None,
        })?;
        self.issue("device_gather", |c| c.gather(send, recv, root.0 as usize))
    }

    /// Scatter from `root` (`send` only on the root).
    pub fn scatter(
        &self,
        send: Option<&DeviceBuffer>,
        recv: &mut DeviceBuffer,
        root: Rank,
    ) -> Result<DeviceOp, WorldError> {
        self.agreed(DeviceCall {
            kind: "scatter",
            dtype: Some(recv.dtype()),
            count: recv.len(),
            root: Some(root),
            op: None,
        })?;
        self.issue("device_scatter", |c| c.scatter(send, recv, root.0 as usize))
    }

    /// A barrier on the device (an all-reduce of one element).
    pub fn barrier(&self) -> Result<DeviceOp, WorldError> {
        self.agreed(DeviceCall {
            kind: "barrier",
            dtype: None,
            count: 0,
            root: None,
            op: None,
        })?;
        self.issue("device_barrier", |c| c.barrier())
    }
}

/// A device operation in flight: completes when its completion event does.
/// Dropping it does not cancel the operation (the device runs it anyway);
/// the watchdog keeps watching its deadline either way.
pub struct DeviceOp {
    probe: DeviceProbe,
    /// The operation's flight record and timing; dropped un-waited, it is
    /// recorded as cancelled (the device runs it anyway).
    op: OpGuard,
}

impl std::fmt::Debug for DeviceOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceOp")
            .field("world", &self.probe.world.name)
            .field("op", &self.probe.handle.op())
            .field("deadline", &self.probe.handle.deadline())
            .finish()
    }
}

/// A view of a [`DeviceOp`]'s completion that does not own the operation
/// ([`DeviceOp::probe`]): its holder can see or wait for the end (e.g. a
/// thread that waits on a handle while a task owns the operation and the
/// memory it uses). It records nothing; the operation's owner does.
#[derive(Clone)]
pub struct DeviceProbe {
    handle: Arc<OpHandle>,
    world: Arc<WorldShared>,
}

impl std::fmt::Debug for DeviceProbe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceProbe")
            .field("world", &self.world.name)
            .field("op", &self.handle.op())
            .finish()
    }
}

impl DeviceOp {
    /// Whether the operation has completed (never blocks).
    pub fn is_completed(&self) -> Result<bool, WorldError> {
        self.probe.is_completed()
    }

    /// A view of this operation's completion for another waiter (see
    /// [`DeviceProbe`]).
    pub fn probe(&self) -> DeviceProbe {
        self.probe.clone()
    }

    /// Waits for completion without blocking the runtime. Fails with
    /// `WorldError::Broken` as soon as the world breaks (the watchdog breaks
    /// it when the operation passes its deadline).
    pub async fn wait(mut self) -> Result<(), WorldError> {
        self.completed().await
    }

    /// [`wait`](Self::wait) that leaves the operation with its owner: a
    /// wait dropped before the end (its caller interrupted) leaves the
    /// operation as it was, to be waited for again or handed on, e.g. to a
    /// task that keeps its memory alive until it completes. Once this has
    /// returned, dropping the operation records it as ended.
    pub async fn completed(&mut self) -> Result<(), WorldError> {
        let r = self.probe.completed().await;
        self.op.finish(&r);
        r
    }
}

impl DeviceProbe {
    /// Whether the operation has completed (never blocks).
    pub fn is_completed(&self) -> Result<bool, WorldError> {
        self.world.check()?;
        self.handle.is_completed().map_err(|e| self.world.fail_device(e))
    }

    /// Waits for the operation's completion as [`DeviceOp::wait`] does
    /// (on the caller's own thread under `as_blocking_caller`), recording
    /// nothing. Can be dropped and called again.
    pub async fn completed(&self) -> Result<(), WorldError> {
        // Short operations: polled eagerly on the runtime.
        for _ in 0..EAGER_POLLS {
            if self.is_completed()? {
                return Ok(());
            }
            tokio::task::yield_now().await;
        }
        if multiworld_tcp::on_blocking_caller() {
            return self.completion_here().await;
        }
        // Longer ones: polled on a blocking thread with a fine backoff.
        // Tokio's timer ticks in milliseconds, which rounded every
        // operation past the eager polls up to 1 ms or more (a 300 µs
        // collective took over 1 ms). The thread stops when the operation
        // completes, the world breaks (the watchdog breaks it at the
        // deadline), or this wait is dropped.
        let (handle, world) = (Arc::clone(&self.handle), Arc::clone(&self.world));
        let dropped = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let _stop = StopOnDrop(Arc::clone(&dropped));
        let poll = tokio::task::spawn_blocking(move || {
            let completed = || {
                world.check()?;
                handle.is_completed().map_err(|e| world.fail_device(e))
            };
            let stop = || dropped.load(std::sync::atomic::Ordering::Relaxed);
            poll_with_backoff(&mut Backoff::default(), completed, stop)
        });
        match poll.await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(e),
            // The blocking pool is shutting down (the runtime is going away):
            // fall back to the millisecond timer.
            Err(_) => loop {
                if self.is_completed()? {
                    return Ok(());
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            },
        }
    }
}

impl DeviceProbe {
    /// The longer operations' waiting on a blocking caller's own thread
    /// (`multiworld_tcp::as_blocking_caller`: a Python thread in a blocking
    /// call): polled there with the blocking poller's backoff, which saves
    /// handing the wait to a pool thread and being woken by it; between
    /// slices of [`HERE_SLICE`] the wait yields, so the rest of the caller's
    /// future (its deadline, Ctrl-C checks) keeps its turn.
    async fn completion_here(&self) -> Result<(), WorldError> {
        let mut backoff = Backoff::default();
        loop {
            let until = Instant::now() + HERE_SLICE;
            if poll_with_backoff(&mut backoff, || self.is_completed(), || Instant::now() >= until)? {
                return Ok(());
            }
            tokio::task::yield_now().await;
        }
    }
}

/// Polls `completed` until it is true (`Ok(true)`) or `stop` is (`Ok(false)`),
/// pausing between polls as `backoff` says (it keeps its state, for a
/// caller that goes on).
fn poll_with_backoff(
    backoff: &mut Backoff,
    mut completed: impl FnMut() -> Result<bool, WorldError>,
    mut stop: impl FnMut() -> bool,
) -> Result<bool, WorldError> {
    loop {
        if completed()? {
            return Ok(true);
        }
        if stop() {
            return Ok(false);
        }
        backoff.pause();
    }
}

/// How a blocking poller waits between polls of a device operation: for
/// the first [`SPIN`] it only yields its thread, so an operation that ends
/// within it is seen at once (CUDA's own synchronisation spins first too);
/// then it sleeps from [`FIRST_SLEEP`], doubled each time up to
/// [`MAX_SLEEP`]. Why: on an H100, before the yielding phase, a 75 µs
/// device copy (`all_gather_into_tensor` of 64 MiB in a world of one) took
/// 155–161 µs per blocking call from Python against torch.distributed's
/// 73 µs, since a sleep of 10 µs lasts about 60 (the kernel's timer slack).
/// The same loop with a deadline in place of the device's event, on the
/// project machine: an end 75, 250 and 1000 µs out was seen 4–15, 52–95 and
/// 108–268 µs late (median–p90) with the sleeps alone, under 1 µs late
/// while yielding. Past [`SPIN`], a wait ends at most about `MAX_SLEEP`
/// plus the timer slack late.
#[derive(Debug, Default)]
struct Backoff {
    /// When the yielding phase ends (set by the first pause).
    spin_until: Option<Instant>,
    /// The next sleep (zero: `FIRST_SLEEP`).
    sleep: Duration,
}

impl Backoff {
    fn pause(&mut self) {
        let now = Instant::now();
        if now < *self.spin_until.get_or_insert(now + SPIN) {
            std::thread::yield_now();
            return;
        }
        let sleep = self.sleep.max(FIRST_SLEEP);
        std::thread::sleep(sleep);
        self.sleep = (sleep * 2).min(MAX_SLEEP);
    }
}

/// Longest a blocking caller's thread polls a device operation before its
/// wait yields once (see `DeviceProbe::completion_here`).
const HERE_SLICE: Duration = Duration::from_millis(10);

/// Polls of a device operation on the runtime before a blocking thread
/// takes over (see `DeviceProbe::completed`).
const EAGER_POLLS: u32 = 64;
/// How long the blocking poller only yields between polls (see
/// [`Backoff`]): the poller's thread stays busy that long, as a thread in
/// CUDA's default synchronisation does for the whole wait.
const SPIN: Duration = Duration::from_millis(1);
/// The blocking poller's first and longest sleep between polls: a wait
/// ends at most this long after the operation (and one `cuEventQuery`
/// every 200 µs is nothing next to an operation that long).
const FIRST_SLEEP: Duration = Duration::from_micros(10);
const MAX_SLEEP: Duration = Duration::from_micros(200);

/// Sets its flag when dropped (a wait that was dropped stops its poller).
struct StopOnDrop(Arc<std::sync::atomic::AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `HostStaging::take` hands out without a device: a kept tensor
    /// or a new zeroed one.
    fn take(s: &HostStaging, dtype: DType, len: usize) -> Tensor {
        s.kept(dtype, len)
            .unwrap_or_else(|| Tensor::zeros(dtype, [len]).unwrap())
    }

    #[test]
    fn host_staging_reuses_a_tensor_of_the_same_dtype_and_length() {
        let s = HostStaging::default();
        let mut t = take(&s, DType::F32, 4);
        t.bytes_mut()[0] = 7; // marks this allocation
        let at = t.as_bytes().as_ptr();
        s.give(t);
        // Another dtype or length gets a new, zeroed tensor.
        let other = take(&s, DType::I32, 4);
        assert_eq!(other.as_bytes(), &[0u8; 16]);
        let longer = take(&s, DType::F32, 5);
        assert_eq!(longer.numel(), 5);
        // The same dtype and length gets the kept one back, as it was.
        let again = take(&s, DType::F32, 4);
        assert_eq!(again.as_bytes().as_ptr(), at);
        assert_eq!(again.as_bytes()[0], 7);
        // Taken: the next one is new.
        let fresh = take(&s, DType::F32, 4);
        assert_ne!(fresh.as_bytes().as_ptr(), at);
        assert_eq!(fresh.as_bytes()[0], 0);
    }

    #[test]
    fn the_backoff_yields_first_then_sleeps_longer_up_to_its_cap() {
        let mut b = Backoff::default();
        let start = Instant::now();
        let mut pauses = 0;
        while start.elapsed() < SPIN {
            b.pause();
            pauses += 1;
        }
        assert_eq!(
            b.sleep,
            Duration::ZERO,
            "no sleep within the yielding phase ({pauses} pauses)"
        );
        let mut sleeps = Vec::new();
        while sleeps.len() < 8 {
            b.pause();
            if b.sleep != Duration::ZERO && sleeps.last() != Some(&b.sleep) {
                sleeps.push(b.sleep);
            }
            if b.sleep == MAX_SLEEP {
                break;
            }
        }
        assert_eq!(
            sleeps.first(),
            Some(&(FIRST_SLEEP * 2)),
            "the first sleep was FIRST_SLEEP"
        );
        assert!(sleeps.windows(2).all(|w| w[1] > w[0]), "{sleeps:?}");
        assert_eq!(sleeps.last(), Some(&MAX_SLEEP));
    }

    #[test]
    fn host_staging_keeps_only_the_last_given_back() {
        let s = HostStaging::default();
        for len in 1..=3 {
            s.give(take(&s, DType::U8, len));
        }
        let kept = s.0.lock().unwrap();
        assert_eq!(kept.tensors.len(), HostStaging::KEEP);
        assert_eq!(kept.tensors.iter().map(|t| t.numel()).collect::<Vec<_>>(), [2, 3]);
    }

    #[test]
    fn host_staging_keeps_at_most_its_byte_budget() {
        let s = HostStaging::default();
        let half = HostStaging::KEEP_BYTES / 2;
        s.give(take(&s, DType::U8, 16));
        s.give(take(&s, DType::U8, half + 1));
        // Both together are within budget.
        assert_eq!(s.0.lock().unwrap().tensors.len(), 2);
        // Another large one pushes the older ones out, the small one first.
        s.give(take(&s, DType::U8, half));
        let sizes: Vec<usize> = s.0.lock().unwrap().tensors.iter().map(Tensor::nbytes).collect();
        assert_eq!(sizes, [half]);
        // One over the whole budget is never kept.
        s.give(take(&s, DType::U8, HostStaging::KEEP_BYTES + 1));
        let sizes: Vec<usize> = s.0.lock().unwrap().tensors.iter().map(Tensor::nbytes).collect();
        assert_eq!(sizes, [half]);
    }

    #[test]
    fn closed_host_staging_frees_what_it_held_and_keeps_nothing_more() {
        let s = HostStaging::default();
        s.give(take(&s, DType::U8, 16));
        s.close();
        assert!(s.0.lock().unwrap().tensors.is_empty());
        // A transfer that ends after the teardown gives its tensor back in
        // vain, and the next take makes a new one.
        s.give(take(&s, DType::U8, 16));
        assert!(s.0.lock().unwrap().tensors.is_empty());
        assert!(s.kept(DType::U8, 16).is_none());
    }
}
