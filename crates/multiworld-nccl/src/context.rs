//! [`DeviceContext`]: a world's slice of a GPU without an NCCL communicator
//! — its own stream, memory pool and pinned staging — for worlds whose
//! device tensors travel over another transport (the TCP backend, staged
//! through pinned host memory), for example two processes that share one GPU
//! and so cannot form an NCCL world. It needs only the CUDA driver
//! ([`CudaDriver`]); NCCL need not be installed.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::buffer::DeviceBuffer;
use crate::cuda::WorldDevice;
use crate::error::NcclError;
use crate::runtime::CudaDriver;
use multiworld_types::DType;

/// Device memory and copies for one world on one GPU, with no NCCL
/// communicator. `Send + Sync`; buffers it allocates keep it alive.
#[derive(Debug, Clone)]
pub struct DeviceContext {
    dev: Arc<WorldDevice>,
}

impl DeviceContext {
    /// Retains device `device`'s primary context and creates the world's own
    /// stream and memory pool. Takes a [`CudaDriver`] (no NCCL needed:
    /// [`CudaDriver::load`]) or an [`NcclRuntime`](crate::NcclRuntime)
    /// (its driver). Fails with [`NcclError::NoDevice`] when the device does
    /// not exist.
    pub fn open(driver: &impl AsRef<CudaDriver>, device: usize) -> Result<DeviceContext, NcclError> {
        Ok(DeviceContext {
            dev: WorldDevice::open(driver.as_ref(), device)?,
        })
    }

    /// CUDA device ordinal.
    pub fn device(&self) -> usize {
        self.dev.ordinal()
    }

    /// A zeroed device buffer of `len` elements.
    pub fn alloc(&self, dtype: DType, len: usize) -> Result<DeviceBuffer, NcclError> {
        DeviceBuffer::alloc(&self.dev, dtype, len)
    }

    /// A device buffer holding `bytes` (native-endian elements of `dtype`),
    /// copied within `timeout`.
    pub fn upload(&self, dtype: DType, bytes: &[u8], timeout: Duration) -> Result<DeviceBuffer, NcclError> {
        upload(&self.dev, dtype, bytes, timeout)
    }

    /// Waits, by polling and at most `timeout`, until every copy and free
    /// enqueued on this context's stream so far has finished.
    pub fn synchronize(&self, timeout: Duration) -> Result<(), NcclError> {
        self.dev
            .wait_idle("synchronize", Instant::now() + timeout, timeout)
    }
}

/// Allocates a buffer on `dev` and copies `bytes` into it.
pub(crate) fn upload(
    dev: &Arc<WorldDevice>,
    dtype: DType,
    bytes: &[u8],
    timeout: Duration,
) -> Result<DeviceBuffer, NcclError> {
    if bytes.len() % dtype.size() != 0 {
        return Err(NcclError::invalid(format!(
            "{} bytes is not a whole number of {dtype} elements",
            bytes.len()
        )));
    }
    let mut buf = DeviceBuffer::alloc(dev, dtype, bytes.len() / dtype.size())?;
    buf.copy_from_host(bytes, timeout)?;
    Ok(buf)
}
