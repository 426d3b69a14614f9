//! [`DeviceBuffer`]: device memory owned by one world — a device tensor:
//! dtype, shape (flat by default) and device — with deadline-bounded copies
//! to and from the host.
//!
//! Every access is ordered on the world's stream: NCCL operations, copies
//! and the final free are all enqueued there, so a buffer dropped while an
//! operation still reads it is freed only after that operation. A buffer can
//! only be used with the communicator that allocated it (checked).
//!
//! A buffer can also *borrow* device memory it does not own
//! ([`DeviceBuffer::borrowed`], e.g. a torch CUDA tensor's storage): it is
//! used exactly like an owned one but never freed; keeping the memory alive
//! and unused by other work until the operations on it complete is the
//! borrower's job.
//!
//! Host copies go through staging memory owned by the world (pinned, in
//! chunks; or, without pinned memory, a vector owned by the copy): the
//! caller's slice is only touched by plain `memcpy` while we hold it, so even
//! if the copy times out (and the staging memory is leaked on purpose) no DMA
//! can reach the caller's memory after we return. Host *tensors* in
//! page-locked memory ([`DeviceBuffer::pinned_host_tensor`]) are copied to
//! and from directly, one DMA copy each; one whose copy fails is leaked.

#![allow(unsafe_code)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::comm::NcclComm;
use crate::cuda::WorldDevice;
use crate::error::NcclError;
use crate::ffi::CuDevicePtr;
use crate::poll::poll_until;
use multiworld_types::{DType, Tensor};

/// Device memory of one world: `len` elements of `dtype` on that world's
/// device. Created by [`NcclComm::alloc`](crate::NcclComm::alloc) or
/// [`NcclComm::upload`](crate::NcclComm::upload); zero-initialised. Dropping
/// it frees the memory in stream order (never blocking). A buffer made by
/// [`DeviceBuffer::borrowed`] views memory owned by someone else and frees
/// nothing.
pub struct DeviceBuffer {
    dev: Arc<WorldDevice>,
    ptr: CuDevicePtr,
    /// Whether dropping the buffer frees `ptr` (false for borrowed memory).
    owned: bool,
    dtype: DType,
    len: usize,
    /// The tensor's shape: its product is always `len` (`[len]` by default).
    shape: Vec<usize>,
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("dtype", &self.dtype)
            .field("shape", &self.shape)
            .field("device", &self.dev.ordinal())
            .field("owned", &self.owned)
            .finish()
    }
}

impl DeviceBuffer {
    pub(crate) fn alloc(dev: &Arc<WorldDevice>, dtype: DType, len: usize) -> Result<DeviceBuffer, NcclError> {
        let bytes = len
            .checked_mul(dtype.size())
            .ok_or_else(|| NcclError::invalid(format!("{len} x {dtype} overflows usize")))?;
        let ptr = if bytes == 0 { 0 } else { dev.alloc(bytes)? };
        Ok(DeviceBuffer {
            dev: Arc::clone(dev),
            ptr,
            owned: true,
            dtype,
            len,
            shape: vec![len],
        })
    }

    /// A buffer of `comm`'s world over `len` elements of `dtype` at device
    /// address `ptr`, memory this crate does not own (for example a torch
    /// CUDA tensor's `data_ptr()`: torch allocates in the device's primary
    /// context, the context every world uses). It is used like any buffer of
    /// that world (operations, host copies) and **never freed**: dropping it
    /// leaves the memory alone. Refuses a null `ptr` for a non-empty buffer
    /// and a size that overflows.
    ///
    /// # Safety
    ///
    /// For as long as the buffer, or any operation or copy issued on it, is
    /// alive or in flight (an [`OpHandle`](crate::OpHandle) completes when the
    /// operation does), the caller guarantees that:
    /// - `ptr..ptr + len * dtype.size()` is device memory on `comm`'s device
    ///   ([`NcclComm::device`]), valid in that device's primary context;
    /// - the memory stays allocated (is not freed or reused by its owner);
    /// - no other work writes it (or, for buffers an operation writes, reads
    ///   it) concurrently: work on other streams must be finished before an
    ///   operation is issued (e.g. synchronise torch's stream first) and
    ///   must not start before that operation has completed.
    ///
    /// If the world is quarantined (its abort did not return), a kernel may
    /// still write the memory indefinitely: the owner must then never free
    /// it either.
    pub unsafe fn borrowed(
        comm: &NcclComm,
        ptr: u64,
        dtype: DType,
        len: usize,
    ) -> Result<DeviceBuffer, NcclError> {
        len.checked_mul(dtype.size())
            .ok_or_else(|| NcclError::invalid(format!("{len} x {dtype} overflows usize")))?;
        if ptr == 0 && len != 0 {
            return Err(NcclError::invalid(format!(
                "a borrowed buffer of {len} x {dtype} at a null device address"
            )));
        }
        Ok(DeviceBuffer {
            dev: Arc::clone(&comm.shared.dev),
            ptr,
            owned: false,
            dtype,
            len,
            shape: vec![len],
        })
    }

    /// Whether the buffer owns its memory (false for
    /// [`borrowed`](Self::borrowed) ones, which are never freed).
    pub fn is_owned(&self) -> bool {
        self.owned
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// The tensor's shape (`[len]` unless [`reshape`](Self::reshape)d).
    /// Operations and copies see the data flat, in row-major order.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Gives the buffer a new shape with the same number of elements.
    pub fn reshape(&mut self, shape: impl Into<Vec<usize>>) -> Result<(), NcclError> {
        let shape = shape.into();
        let numel = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
        if numel != Some(self.len) {
            return Err(NcclError::invalid(format!(
                "shape {shape:?} does not hold the buffer's {} elements",
                self.len
            )));
        }
        self.shape = shape;
        Ok(())
    }

    /// True if the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Size in bytes.
    pub fn byte_len(&self) -> usize {
        self.len * self.dtype.size()
    }

    /// CUDA device ordinal.
    pub fn device(&self) -> usize {
        self.dev.ordinal()
    }

    /// The raw device address (`CUdeviceptr`), for interop with other CUDA
    /// code. Using it is outside this crate's guarantees: such code must
    /// order its work after this world's stream.
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    pub(crate) fn world_id(&self) -> u64 {
        self.dev.id()
    }

    pub(crate) fn ptr(&self) -> CuDevicePtr {
        self.ptr
    }

    /// Copies `src` (exactly [`byte_len`](Self::byte_len) bytes, native
    /// endianness) into the buffer. Waits first for the world's earlier work
    /// on the buffer, then for the copy, all by polling, at most `timeout`.
    pub fn copy_from_host(&mut self, src: &[u8], timeout: Duration) -> Result<(), NcclError> {
        self.check_host_len(src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        let deadline = Instant::now() + timeout;
        // Earlier work first: the driver may synchronise a pageable copy with
        // the stream, and we never want to block inside CUDA.
        self.dev.wait_idle("copy_from_host", deadline, timeout)?;
        if self
            .dev
            .copy_htod_pinned("copy_from_host", self.ptr, src, deadline, timeout)?
        {
            return Ok(());
        }
        let staging: Vec<u8> = src.to_vec();
        self.dev.bind()?;
        let rt = self.dev.runtime();
        // SAFETY: `self.ptr` owns `byte_len` bytes; `staging` holds as many
        // and stays alive until the copy is known complete, or is leaked.
        let rc = unsafe {
            (rt.cuda().memcpy_htod_async)(
                self.ptr,
                staging.as_ptr().cast(),
                staging.len(),
                self.dev.stream(),
            )
        };
        rt.cuda_check("cuMemcpyHtoDAsync", rc)?;
        self.finish_copy("copy_from_host", staging, deadline, timeout)
    }

    /// Copies the buffer into `dst` (exactly [`byte_len`](Self::byte_len)
    /// bytes). Waits for the world's earlier work (e.g. the operation that
    /// produced the data), then for the copy, by polling, at most `timeout`.
    pub fn copy_to_host(&self, dst: &mut [u8], timeout: Duration) -> Result<(), NcclError> {
        self.check_host_len(dst.len())?;
        if dst.is_empty() {
            return Ok(());
        }
        let deadline = Instant::now() + timeout;
        self.dev.wait_idle("copy_to_host", deadline, timeout)?;
        if self
            .dev
            .copy_dtoh_pinned("copy_to_host", dst, self.ptr, deadline, timeout)?
        {
            return Ok(());
        }
        let mut staging = vec![0u8; dst.len()];
        self.dev.bind()?;
        let rt = self.dev.runtime();
        // SAFETY: as in `copy_from_host`, in the other direction.
        let rc = unsafe {
            (rt.cuda().memcpy_dtoh_async)(
                staging.as_mut_ptr().cast(),
                self.ptr,
                staging.len(),
                self.dev.stream(),
            )
        };
        rt.cuda_check("cuMemcpyDtoHAsync", rc)?;
        let staging = self.finish_copy_keep("copy_to_host", staging, deadline, timeout)?;
        dst.copy_from_slice(&staging);
        Ok(())
    }

    /// A host tensor of this buffer's dtype and length in page-locked
    /// ("pinned") memory from the CUDA driver, zeroed: what
    /// [`copy_to_host_tensor`](Self::copy_to_host_tensor) and
    /// [`copy_from_host_tensor`](Self::copy_from_host_tensor) copy to and
    /// from directly, with no staging copy. Its memory is freed when the
    /// tensor drops. Pinned memory is a scarce resource (it cannot be paged
    /// out): keep such tensors for reuse rather than making one per copy.
    /// Fails for an empty buffer, when the driver has no pinned memory to
    /// give, or in a quarantined world.
    pub fn pinned_host_tensor(&self) -> Result<Tensor, NcclError> {
        let mem = self.dev.alloc_pinned_host(self.byte_len())?;
        Tensor::from_external(self.dtype, [self.len], Box::new(mem))
            .map_err(|e| NcclError::invalid(e.to_string()))
    }

    /// Copies the buffer into `dst`, a host tensor of the same byte length
    /// (the dtype is not checked: bytes are copied as they are). A tensor
    /// in page-locked memory ([`Tensor::is_page_locked`], e.g. one from
    /// [`pinned_host_tensor`](Self::pinned_host_tensor)) is written by one
    /// DMA copy, ordered after the world's earlier work; any other goes
    /// through [`copy_to_host`](Self::copy_to_host)'s staging. Waits by
    /// polling, at most `timeout`.
    ///
    /// If a direct copy times out (or its wait fails) it may still be
    /// writing: `dst` is then left an empty tensor and its memory is leaked
    /// on purpose (with the context reference it holds), so nothing can
    /// free or reuse it under the copy.
    pub fn copy_to_host_tensor(&self, dst: &mut Tensor, timeout: Duration) -> Result<(), NcclError> {
        self.check_host_len(dst.nbytes())?;
        if !dst.is_page_locked() {
            return self.copy_to_host(dst.bytes_mut(), timeout);
        }
        self.copy_direct("copy_to_host_tensor", true, dst, timeout)
    }

    /// Copies `src`, a host tensor of the buffer's byte length, into the
    /// buffer: directly from page-locked memory, like
    /// [`copy_to_host_tensor`](Self::copy_to_host_tensor), or else through
    /// [`copy_from_host`](Self::copy_from_host)'s staging. A direct copy
    /// that times out may still be reading `src`, which is then left an
    /// empty tensor and its memory leaked (hence `&mut`).
    pub fn copy_from_host_tensor(&mut self, src: &mut Tensor, timeout: Duration) -> Result<(), NcclError> {
        self.check_host_len(src.nbytes())?;
        if !src.is_page_locked() {
            return self.copy_from_host(src.as_bytes(), timeout);
        }
        self.copy_direct("copy_from_host_tensor", false, src, timeout)
    }

    /// One direct copy between the buffer and `tensor` (page-locked, of the
    /// buffer's byte length), leaking the tensor's memory if it fails.
    fn copy_direct(
        &self,
        op: &'static str,
        to_host: bool,
        tensor: &mut Tensor,
        timeout: Duration,
    ) -> Result<(), NcclError> {
        if self.byte_len() == 0 {
            return Ok(());
        }
        let deadline = Instant::now() + timeout;
        // Earlier work first, as for the staged copies: should the memory
        // not be page-locked after all (a wrong `ExternalMemory::page_locked`),
        // the driver then waits inside the call only for the copy itself.
        self.dev.wait_idle(op, deadline, timeout)?;
        let host = tensor.bytes_mut().as_mut_ptr();
        // SAFETY: `self.ptr` holds `byte_len` device bytes of this world;
        // `host` is the memory of `tensor`, exactly as many bytes (checked
        // by the caller), which the caller's `&mut` keeps to us until we
        // return; if the copy is not known complete it is leaked below.
        unsafe {
            self.dev
                .enqueue_copy(op, to_host, self.ptr, host, self.byte_len())?
        };
        let r = self.dev.wait_idle(op, deadline, timeout);
        if r.is_err() {
            // The copy may still run: the memory must never be freed.
            std::mem::forget(std::mem::take(tensor));
        }
        r
    }

    /// The buffer's contents as a new vector of bytes.
    pub fn to_host_vec(&self, timeout: Duration) -> Result<Vec<u8>, NcclError> {
        let mut out = vec![0u8; self.byte_len()];
        self.copy_to_host(&mut out, timeout)?;
        Ok(out)
    }

    fn check_host_len(&self, got: usize) -> Result<(), NcclError> {
        if got != self.byte_len() {
            return Err(NcclError::invalid(format!(
                "host slice is {got} bytes but the buffer holds {} ({} x {})",
                self.byte_len(),
                self.len,
                self.dtype
            )));
        }
        Ok(())
    }

    fn finish_copy(
        &self,
        op: &'static str,
        staging: Vec<u8>,
        deadline: Instant,
        budget: Duration,
    ) -> Result<(), NcclError> {
        self.finish_copy_keep(op, staging, deadline, budget).map(drop)
    }

    /// Polls the copy to completion and hands the staging vector back; on
    /// error or timeout the vector is leaked, since DMA may still target it.
    fn finish_copy_keep(
        &self,
        op: &'static str,
        staging: Vec<u8>,
        deadline: Instant,
        budget: Duration,
    ) -> Result<Vec<u8>, NcclError> {
        let done = self
            .dev
            .record_event()
            .and_then(|ev| poll_until(op, deadline, budget, || Ok(ev.is_complete()?.then_some(()))));
        match done {
            Ok(()) => Ok(staging),
            Err(e) => {
                std::mem::forget(staging);
                Err(e)
            }
        }
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // Borrowed memory belongs to someone else: never freed here.
        if self.owned {
            self.dev.free(self.ptr);
        }
    }
}
