//! One world's slice of the GPU: a reference on the device's primary
//! context, the world's own non-blocking CUDA stream, its own memory pool
//! (stream-ordered allocator), and completion events recorded on that
//! stream. Nothing here is shared between worlds, so a world whose kernels
//! hang cannot make another world's allocation, free or copy wait:
//! - the stream is `CU_STREAM_NON_BLOCKING`, so it never synchronises with
//!   the legacy default stream;
//! - memory comes from a per-world pool with `cuMemAllocFromPoolAsync` /
//!   `cuMemFreeAsync`, which are stream-ordered and never synchronise the
//!   device (plain `cuMemFree` may), and a per-world pool means the
//!   allocator can never make one world's stream wait on another's frees.
//!
//! Host copies stage through page-locked ("pinned") memory owned by the
//! world, in chunks of [`STAGING_BYTES`], so the DMA engine reads and writes
//! host memory directly and never waits on pageable memory; the staging
//! buffers are allocated on first use and reused.
//!
//! A quarantined world (abort did not return in time) is leaked on purpose:
//! its stream, pool, events and memory are never touched again.

#![allow(unsafe_code)]

use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::error::NcclError;
use crate::ffi::{self, CuDevice, CuDevicePtr, CuMemPoolProps, SendPtr};
use crate::poll::poll_until;
use crate::runtime::CudaDriver;
use multiworld_types::ExternalMemory;

/// Source of world-device ids, used to check that a buffer belongs to the
/// communicator it is passed to.
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// Size of one pinned staging buffer: host copies larger than this move in
/// chunks of this size.
pub(crate) const STAGING_BYTES: usize = 4 << 20;

/// One pinned host buffer of [`STAGING_BYTES`]. No `Drop`: losing one leaks
/// it, which is what a copy that timed out (DMA may still target it) must do.
struct Pinned(SendPtr);

/// A world's context reference, stream and memory pool.
pub(crate) struct WorldDevice {
    rt: CudaDriver,
    id: u64,
    ordinal: usize,
    device: CuDevice,
    ctx: SendPtr,
    stream: SendPtr,
    pool: SendPtr,
    /// Shared with the pinned host memory it makes, which must not be freed
    /// either once the world is quarantined.
    quarantined: Arc<AtomicBool>,
    /// Idle pinned staging buffers (one per concurrent copy, reused).
    staging: Mutex<Vec<Pinned>>,
    /// Set when pinned memory could not be had: copies stage through
    /// ordinary memory from then on.
    no_pinned: AtomicBool,
}

impl std::fmt::Debug for WorldDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorldDevice")
            .field("id", &self.id)
            .field("ordinal", &self.ordinal)
            .field("quarantined", &self.is_quarantined())
            .finish()
    }
}

impl WorldDevice {
    /// Retains the primary context of device `ordinal` and creates the
    /// world's stream and memory pool.
    pub(crate) fn open(rt: &CudaDriver, ordinal: usize) -> Result<Arc<WorldDevice>, NcclError> {
        let count = rt.device_count()?;
        if count == 0 {
            return Err(NcclError::NoDevice {
                reason: "the CUDA driver reports no devices (check CUDA_VISIBLE_DEVICES and \
                         that the container was started with GPUs)"
                    .to_owned(),
            });
        }
        if ordinal >= count {
            return Err(NcclError::NoDevice {
                reason: format!("device {ordinal} requested but only {count} visible"),
            });
        }
        let cuda = rt.cuda();
        let Some(pools) = cuda.pools else {
            return Err(NcclError::unsupported(
                "this CUDA driver lacks the stream-ordered allocator (CUDA 11.2+ is required)",
            ));
        };
        let ord = c_int::try_from(ordinal)
            .map_err(|_| NcclError::invalid(format!("device {ordinal} does not fit an int")))?;
        let mut device: CuDevice = 0;
        // SAFETY: writes one CUdevice; cuInit succeeded in device_count.
        rt.cuda_check("cuDeviceGet", unsafe { (cuda.device_get)(&mut device, ord) })?;
        let mut ctx = std::ptr::null_mut();
        // SAFETY: writes one CUcontext, retained until our Drop releases it.
        rt.cuda_check("cuDevicePrimaryCtxRetain", unsafe {
            (cuda.primary_ctx_retain)(&mut ctx, device)
        })?;
        // From here on `wd`'s Drop releases whatever was created.
        let mut wd = WorldDevice {
            rt: rt.clone(),
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            ordinal,
            device,
            ctx: SendPtr(ctx),
            stream: SendPtr(std::ptr::null_mut()),
            pool: SendPtr(std::ptr::null_mut()),
            quarantined: Arc::new(AtomicBool::new(false)),
            staging: Mutex::new(Vec::new()),
            no_pinned: AtomicBool::new(false),
        };
        wd.bind()?;
        let mut stream = std::ptr::null_mut();
        // SAFETY: the context is current; writes one CUstream.
        rt.cuda_check("cuStreamCreate", unsafe {
            (cuda.stream_create)(&mut stream, ffi::CU_STREAM_NON_BLOCKING)
        })?;
        wd.stream = SendPtr(stream);
        let props = CuMemPoolProps::device(ord);
        let mut pool = std::ptr::null_mut();
        // SAFETY: `props` follows the CUmemPoolProps layout (see ffi.rs) and
        // outlives the call; writes one CUmemoryPool.
        let rc = unsafe { (pools.pool_create)(&mut pool, &props) };
        if rc == ffi::CUDA_ERROR_NOT_SUPPORTED {
            return Err(NcclError::unsupported(format!(
                "device {ordinal} does not support memory pools (cuMemPoolCreate)"
            )));
        }
        rt.cuda_check("cuMemPoolCreate", rc)?;
        wd.pool = SendPtr(pool);
        Ok(Arc::new(wd))
    }

    /// Unique id of this world device (buffer ownership checks).
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// CUDA device ordinal.
    pub(crate) fn ordinal(&self) -> usize {
        self.ordinal
    }

    pub(crate) fn runtime(&self) -> &CudaDriver {
        &self.rt
    }

    /// The world's stream, as NCCL's `cudaStream_t`.
    pub(crate) fn stream(&self) -> ffi::CuStream {
        self.stream.0
    }

    /// Makes the world's context current on the calling thread (driver calls
    /// act on the current context; threads start with none).
    pub(crate) fn bind(&self) -> Result<(), NcclError> {
        // SAFETY: `ctx` is a retained primary context, valid until Drop.
        let rc = unsafe { (self.rt.cuda().ctx_set_current)(self.ctx.0) };
        self.rt.cuda_check("cuCtxSetCurrent", rc)
    }

    /// Marks the world as quarantined: from now on nothing of it is freed or
    /// destroyed.
    pub(crate) fn quarantine(&self) {
        self.quarantined.store(true, Ordering::SeqCst);
    }

    pub(crate) fn is_quarantined(&self) -> bool {
        self.quarantined.load(Ordering::SeqCst)
    }

    fn refuse_if_quarantined(&self, what: &'static str) -> Result<(), NcclError> {
        if self.is_quarantined() {
            return Err(NcclError::Aborted {
                op: what,
                state: crate::comm::CommState::Quarantined,
            });
        }
        Ok(())
    }

    /// Records an event on the world's stream: it completes when all work
    /// enqueued so far has.
    pub(crate) fn record_event(self: &Arc<Self>) -> Result<Event, NcclError> {
        // SAFETY: the world's own stream is live while `self` is.
        unsafe { self.event_on(self.stream.0, "cuEventRecord") }
    }

    /// Makes this world's stream wait, on the device, for everything
    /// enqueued on `stream` so far (an event recorded there, waited for
    /// here): the host does not wait.
    ///
    /// # Safety
    /// `stream` is a live stream of this device's primary context, or null
    /// (the legacy default stream).
    pub(crate) unsafe fn wait_for_stream(
        self: &Arc<Self>,
        stream: *mut std::ffi::c_void,
    ) -> Result<(), NcclError> {
        // Destroyed when this returns: CUDA keeps an event recorded and
        // waited for until the work behind it is done.
        // SAFETY: the caller's promise, passed on.
        let event = unsafe { self.event_on(stream.cast(), "cuStreamWaitEvent") }?;
        // SAFETY: both handles are live and belong to this context.
        self.rt.cuda_check("cuStreamWaitEvent", unsafe {
            (self.rt.cuda().stream_wait_event)(self.stream.0, event.raw.0, 0)
        })
    }

    /// A new event recorded on `stream` (`op` names the call a quarantined
    /// world refuses).
    ///
    /// # Safety
    /// `stream` is a live stream of this device's primary context, or null.
    unsafe fn event_on(
        self: &Arc<Self>,
        stream: ffi::CuStream,
        op: &'static str,
    ) -> Result<Event, NcclError> {
        self.refuse_if_quarantined(op)?;
        self.bind()?;
        let cuda = self.rt.cuda();
        let mut ev = std::ptr::null_mut();
        // SAFETY: context current; writes one CUevent.
        self.rt.cuda_check("cuEventCreate", unsafe {
            (cuda.event_create)(&mut ev, ffi::CU_EVENT_DISABLE_TIMING)
        })?;
        let event = Event {
            dev: Arc::clone(self),
            raw: SendPtr(ev),
        };
        // SAFETY: `ev` is live; `stream` is live or null (the caller's
        // promise).
        self.rt
            .cuda_check("cuEventRecord", unsafe { (cuda.event_record)(ev, stream) })?;
        Ok(event)
    }

    /// Waits, by polling, until everything enqueued on the stream so far has
    /// finished, or `deadline`.
    pub(crate) fn wait_idle(
        self: &Arc<Self>,
        op: &'static str,
        deadline: Instant,
        budget: Duration,
    ) -> Result<(), NcclError> {
        let ev = self.record_event()?;
        poll_until(op, deadline, budget, || Ok(ev.is_complete()?.then_some(())))
    }

    /// Allocates `bytes` (> 0) from the world's pool, stream-ordered, and
    /// zeroes them.
    pub(crate) fn alloc(&self, bytes: usize) -> Result<CuDevicePtr, NcclError> {
        self.refuse_if_quarantined("alloc")?;
        let Some(pools) = self.rt.cuda().pools else {
            return Err(NcclError::unsupported("stream-ordered allocator missing"));
        };
        self.bind()?;
        let mut ptr: CuDevicePtr = 0;
        // SAFETY: pool and stream are live; writes one CUdeviceptr.
        self.rt.cuda_check("cuMemAllocFromPoolAsync", unsafe {
            (pools.alloc_from_pool_async)(&mut ptr, bytes, self.pool.0, self.stream.0)
        })?;
        // SAFETY: `ptr` owns `bytes` bytes, ordered after the allocation on
        // the same stream.
        let rc = unsafe { (self.rt.cuda().memset_d8_async)(ptr, 0, bytes, self.stream.0) };
        if let Err(e) = self.rt.cuda_check("cuMemsetD8Async", rc) {
            self.free(ptr);
            return Err(e);
        }
        Ok(ptr)
    }

    /// Frees `ptr` in stream order (after every operation already enqueued
    /// that uses it). Leaks it if the world is quarantined: a hung kernel may
    /// still be writing there.
    pub(crate) fn free(&self, ptr: CuDevicePtr) {
        if ptr == 0 || self.is_quarantined() {
            return;
        }
        let Some(pools) = self.rt.cuda().pools else {
            return;
        };
        if self.bind().is_err() {
            return;
        }
        // SAFETY: `ptr` came from this pool and is freed once (DeviceBuffer
        // owns it uniquely).
        let rc = unsafe { (pools.free_async)(ptr, self.stream.0) };
        if let Err(e) = self.rt.cuda_check("cuMemFreeAsync", rc) {
            tracing::warn!(error = %e, "leaking device memory that could not be freed");
        }
    }

    /// An idle pinned staging buffer, allocating one if none is idle;
    /// `None` when pinned memory is unavailable (or the world quarantined).
    fn take_staging(&self) -> Option<Pinned> {
        if self.is_quarantined() {
            return None;
        }
        if let Some(p) = self.staging.lock().unwrap_or_else(|e| e.into_inner()).pop() {
            return Some(p);
        }
        if self.no_pinned.load(Ordering::Relaxed) {
            return None;
        }
        let api = self.rt.cuda().pinned?;
        self.bind().ok()?;
        let mut p = std::ptr::null_mut();
        // SAFETY: writes one host pointer to STAGING_BYTES of pinned memory.
        let rc = unsafe { (api.host_alloc)(&mut p, STAGING_BYTES, 0) };
        if rc != ffi::CUDA_SUCCESS || p.is_null() {
            self.no_pinned.store(true, Ordering::Relaxed);
            tracing::debug!(
                code = rc,
                "no pinned host memory; host copies stage through pageable memory"
            );
            return None;
        }
        Some(Pinned(SendPtr(p)))
    }

    /// `len` (> 0) zeroed bytes of page-locked host memory, portable to
    /// every context, freed when the returned value drops (see
    /// [`PinnedHost`]).
    pub(crate) fn alloc_pinned_host(self: &Arc<Self>, len: usize) -> Result<PinnedHost, NcclError> {
        self.refuse_if_quarantined("alloc_pinned_host")?;
        if len == 0 {
            return Err(NcclError::invalid("page-locked host memory of 0 bytes"));
        }
        let Some(api) = self.rt.cuda().pinned else {
            return Err(NcclError::unsupported("this CUDA driver lacks cuMemHostAlloc"));
        };
        self.bind()?;
        let mut p = std::ptr::null_mut();
        // SAFETY: writes one host pointer to `len` bytes of pinned memory.
        self.rt.cuda_check("cuMemHostAlloc", unsafe {
            (api.host_alloc)(&mut p, len, ffi::CU_MEMHOSTALLOC_PORTABLE)
        })?;
        if p.is_null() {
            return Err(NcclError::unsupported("cuMemHostAlloc returned no memory"));
        }
        // SAFETY: `p` holds `len` writable bytes that nothing else uses yet.
        unsafe { std::ptr::write_bytes(p.cast::<u8>(), 0, len) };
        let mut ctx = std::ptr::null_mut();
        // SAFETY: writes one CUcontext (the one `self.ctx` is), retained
        // until the PinnedHost's Drop releases it.
        let rc = unsafe { (self.rt.cuda().primary_ctx_retain)(&mut ctx, self.device) };
        if let Err(e) = self.rt.cuda_check("cuDevicePrimaryCtxRetain", rc) {
            // SAFETY: `p` came from cuMemHostAlloc just above; nothing uses it.
            let _ = unsafe { (api.free_host)(p) };
            return Err(e);
        }
        Ok(PinnedHost {
            rt: self.rt.clone(),
            quarantined: Arc::clone(&self.quarantined),
            device: self.device,
            ctx: SendPtr(ctx),
            ptr: SendPtr(p),
            len,
        })
    }

    /// Enqueues one copy on the world's stream between device address
    /// `dev_ptr` and the host memory at `host` (`len` bytes; `to_host` picks
    /// the direction): a chunk of the pinned staging, or a whole pinned host
    /// tensor. `host` should be page-locked, or the driver may wait inside
    /// the call. The caller then waits for it ([`Self::wait_idle`]).
    ///
    /// # Safety
    /// `dev_ptr..+len` is device memory of this world's context and
    /// `host..+len` host memory that stays allocated (and, for a copy to the
    /// host, unread and unwritten by anyone else) until the copy is known
    /// complete; if that is never known (a timeout) the caller must never
    /// free or reuse the host memory (leak it). Nothing was enqueued if this
    /// returns an error.
    pub(crate) unsafe fn enqueue_copy(
        &self,
        op: &'static str,
        to_host: bool,
        dev_ptr: CuDevicePtr,
        host: *mut u8,
        len: usize,
    ) -> Result<(), NcclError> {
        self.refuse_if_quarantined(op)?;
        self.bind()?;
        let cuda = self.rt.cuda();
        // SAFETY: the caller's promises, passed on; stream order puts the
        // copy after the world's earlier work on the memory.
        let (call, rc) = unsafe {
            if to_host {
                (
                    "cuMemcpyDtoHAsync",
                    (cuda.memcpy_dtoh_async)(host.cast(), dev_ptr, len, self.stream.0),
                )
            } else {
                (
                    "cuMemcpyHtoDAsync",
                    (cuda.memcpy_htod_async)(dev_ptr, host.cast(), len, self.stream.0),
                )
            }
        };
        self.rt.cuda_check(call, rc)
    }

    fn put_staging(&self, p: Pinned) {
        self.staging.lock().unwrap_or_else(|e| e.into_inner()).push(p);
    }

    /// Copies `src` to device address `dst` through pinned staging, chunk by
    /// chunk, each chunk polled to completion by `deadline`. `Ok(false)`:
    /// no pinned memory, nothing was done. On error a staging buffer that
    /// may still be read by DMA is leaked.
    pub(crate) fn copy_htod_pinned(
        self: &Arc<Self>,
        op: &'static str,
        dst: CuDevicePtr,
        src: &[u8],
        deadline: Instant,
        budget: Duration,
    ) -> Result<bool, NcclError> {
        let Some(pin) = self.take_staging() else {
            return Ok(false);
        };
        let stage = pin.0.0.cast::<u8>();
        let mut offset = 0u64;
        for chunk in src.chunks(STAGING_BYTES) {
            // SAFETY: `stage` holds STAGING_BYTES ≥ chunk.len() bytes that only
            // this copy uses, and no DMA is pending on it (the previous chunk
            // completed).
            unsafe { std::ptr::copy_nonoverlapping(chunk.as_ptr(), stage, chunk.len()) };
            // SAFETY: `dst + offset` has chunk.len() device bytes (the caller
            // owns dst..dst+src.len()); the stage stays alive until the
            // event below completes, or is leaked.
            if let Err(e) = unsafe { self.enqueue_copy(op, false, dst + offset, stage, chunk.len()) } {
                // Not enqueued: nothing reads the stage.
                self.put_staging(pin);
                return Err(e);
            }
            self.wait_idle(op, deadline, budget)?;
            offset += chunk.len() as u64;
        }
        self.put_staging(pin);
        Ok(true)
    }

    /// Copies device address `src` into `dst` through pinned staging, chunk
    /// by chunk (see [`copy_htod_pinned`](Self::copy_htod_pinned)).
    pub(crate) fn copy_dtoh_pinned(
        self: &Arc<Self>,
        op: &'static str,
        dst: &mut [u8],
        src: CuDevicePtr,
        deadline: Instant,
        budget: Duration,
    ) -> Result<bool, NcclError> {
        let Some(pin) = self.take_staging() else {
            return Ok(false);
        };
        let stage = pin.0.0.cast::<u8>();
        let mut offset = 0u64;
        for chunk in dst.chunks_mut(STAGING_BYTES) {
            // SAFETY: `src + offset` has chunk.len() device bytes; the stage
            // has room and stays alive until the copy completes, or is leaked.
            if let Err(e) = unsafe { self.enqueue_copy(op, true, src + offset, stage, chunk.len()) } {
                self.put_staging(pin);
                return Err(e);
            }
            self.wait_idle(op, deadline, budget)?;
            // SAFETY: the copy into the stage completed; chunk.len() bytes.
            unsafe { std::ptr::copy_nonoverlapping(stage, chunk.as_mut_ptr(), chunk.len()) };
            offset += chunk.len() as u64;
        }
        self.put_staging(pin);
        Ok(true)
    }
}

impl Drop for WorldDevice {
    fn drop(&mut self) {
        if self.is_quarantined() {
            tracing::warn!(
                device = self.ordinal,
                "leaking the stream, memory pool and context reference of a quarantined world"
            );
            return;
        }
        let cuda = *self.rt.cuda();
        if self.bind().is_err() {
            // The handles need the context current and are left to it; the
            // context reference does not, and is given back.
            // SAFETY: this value retained the device's primary context once.
            unsafe {
                let _ = (cuda.primary_ctx_release)(self.device);
            }
            return;
        }
        // SAFETY: each handle is ours, live and destroyed once. None of these
        // calls blocks: a pool with outstanding frees and a stream with
        // pending work are released by the driver once that work completes.
        unsafe {
            if let Some(pinned) = cuda.pinned {
                for p in self
                    .staging
                    .get_mut()
                    .unwrap_or_else(|e| e.into_inner())
                    .drain(..)
                {
                    let _ = (pinned.free_host)(p.0.0);
                }
            }
            if !self.pool.0.is_null() {
                if let Some(pools) = cuda.pools {
                    let _ = (pools.pool_destroy)(self.pool.0);
                }
            }
            if !self.stream.0.is_null() {
                let _ = (cuda.stream_destroy)(self.stream.0);
            }
            let _ = (cuda.primary_ctx_release)(self.device);
        }
    }
}

/// Page-locked host memory made by [`WorldDevice::alloc_pinned_host`]: the
/// memory of a host tensor ([`ExternalMemory`]) that device copies read and
/// write directly. Holds its own reference on the device's primary context
/// (the memory lives in it), not the world's stream or pool, so it may
/// outlive the world device that made it; dropping it frees the memory and
/// that reference, unless that world was quarantined (nothing of it is freed
/// then: a hung kernel may keep the driver busy). Memory a copy may still
/// use is never dropped: the copy's caller leaks it.
pub(crate) struct PinnedHost {
    rt: CudaDriver,
    quarantined: Arc<AtomicBool>,
    device: CuDevice,
    ctx: SendPtr,
    ptr: SendPtr,
    len: usize,
}

impl ExternalMemory for PinnedHost {
    fn bytes(&self) -> &[u8] {
        // SAFETY: `ptr` holds `len` initialised bytes (zeroed at allocation)
        // owned by this value until it drops.
        unsafe { std::slice::from_raw_parts(self.ptr.0.cast::<u8>(), self.len) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`; `&mut self` makes the access unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.0.cast::<u8>(), self.len) }
    }

    fn page_locked(&self) -> bool {
        true
    }
}

impl Drop for PinnedHost {
    fn drop(&mut self) {
        if self.quarantined.load(Ordering::SeqCst) {
            return;
        }
        let cuda = *self.rt.cuda();
        // SAFETY: `ctx` is the primary context this value retained; `ptr`
        // came from cuMemHostAlloc in it and is freed once, while no copy
        // uses it (one that timed out leaked its owner instead).
        unsafe {
            if (cuda.ctx_set_current)(self.ctx.0) == ffi::CUDA_SUCCESS {
                if let Some(api) = cuda.pinned {
                    let _ = (api.free_host)(self.ptr.0);
                }
            }
            let _ = (cuda.primary_ctx_release)(self.device);
        }
    }
}

/// A CUDA event recorded on a world's stream.
pub(crate) struct Event {
    dev: Arc<WorldDevice>,
    raw: SendPtr,
}

impl Event {
    /// `cuEventQuery`: `Ok(true)` once the work before the event has
    /// finished, `Ok(false)` while pending. Never blocks.
    pub(crate) fn is_complete(&self) -> Result<bool, NcclError> {
        self.dev.bind()?;
        // SAFETY: the event is live (destroyed only in Drop).
        let rc = unsafe { (self.dev.rt.cuda().event_query)(self.raw.0) };
        if rc == ffi::CUDA_ERROR_NOT_READY {
            return Ok(false);
        }
        self.dev.rt.cuda_check("cuEventQuery", rc)?;
        Ok(true)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if self.dev.is_quarantined() || self.dev.bind().is_err() {
            return;
        }
        // SAFETY: destroyed once; cuEventDestroy does not block on pending
        // work (the driver releases the event when it completes).
        let _ = unsafe { (self.dev.rt.cuda().event_destroy)(self.raw.0) };
    }
}
