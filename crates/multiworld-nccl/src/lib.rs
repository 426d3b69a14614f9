//! multiworld's NCCL backend: one non-blocking NCCL communicator per world,
//! with NCCL and the CUDA driver loaded at run time, so the crate builds and
//! its tests run on machines with no GPU, no CUDA and no NCCL.
//!
//! Module map:
//! - `runtime` — [`NcclRuntime`]: finds and `dlopen`s `libnccl.so.2` and
//!   `libcuda.so.1`, reads the NCCL version, gates optional calls, counts
//!   devices, makes [`UniqueId`]s; [`CudaDriver`]: the CUDA driver alone,
//!   for device memory and host copies without NCCL.
//! - `search` — [`LibrarySearch`]: the ordered list of places to look (the
//!   `NCCL_LIBRARY` variable, the loader path, pip-wheel and conda
//!   locations), computed without running Python.
//! - `comm` — [`NcclComm`]: a world's communicator and its lifecycle
//!   (non-blocking init, `poll_error`, `abort` on a dedicated thread with a
//!   deadline → [`AbortOutcome`], `close`, the version-gated
//!   `revoke`/`shrink`), its locks and states ([`CommState`]).
//! - `ops` — the operations (send/recv, broadcast, reduce, all_reduce,
//!   all_gather, reduce_scatter, all_to_all, gather, scatter, barrier).
//! - `handle` — [`OpHandle`]: per-operation completion event and deadline.
//! - `buffer` — [`DeviceBuffer`]: device memory owned by one world, with
//!   deadline-bounded host copies (staged through pinned memory), or
//!   borrowed from its owner (`DeviceBuffer::borrowed`, e.g. a torch CUDA
//!   tensor's memory; never freed).
//! - `context` — [`DeviceContext`]: a world's stream, memory pool and pinned
//!   staging without an NCCL communicator (device tensors over TCP); needs
//!   only a [`CudaDriver`].
//! - `cuda` — a world's context reference, own stream, memory pool, pinned
//!   staging buffers and events (crate-private).
//! - `config` — [`CommConfig`]: rank, size, device and deadlines, validated.
//! - `unique_id` — [`UniqueId`]: the 128-byte id, to and from bytes.
//! - `dtype` — how the vocabulary's `DType` and `ReduceOp` (crate
//!   `multiworld-types`) map onto NCCL's types and operations.
//! - `version` — [`NcclVersion`] and the release each feature needs.
//! - `error` — [`NcclError`] and its `is_world_fatal` / `is_unavailable`.
//! - `poll` — the deadline-bounded polling loop everything waits with.
//! - `ffi` — the C types, layouts (each assumption marked) and function
//!   tables; the only place that describes the C ABI.
//!
//! Typical use, on every rank of a world (rank 0 publishes the id through the
//! world's store, the others read it):
//!
//! ```no_run
//! use std::time::Duration;
//! use multiworld_nccl::{CommConfig, NcclComm, NcclRuntime};
//! use multiworld_types::{DType, ReduceOp};
//!
//! # fn main() -> Result<(), multiworld_nccl::NcclError> {
//! let rt = NcclRuntime::load()?;
//! let id = rt.unique_id()?; // rank 0; others: UniqueId::from_bytes(&bytes)?
//! let comm = NcclComm::init(&rt, &CommConfig::new(0, 1), &id)?;
//! let bytes: Vec<u8> = [1.0f32, 2.0].iter().flat_map(|x| x.to_ne_bytes()).collect();
//! let mut buf = comm.upload(DType::F32, &bytes)?;
//! comm.all_reduce_in_place(&mut buf, ReduceOp::Sum)?.wait()?;
//! let out = buf.to_host_vec(Duration::from_secs(5))?;
//! # let _ = out;
//! # Ok(())
//! # }
//! ```

mod buffer;
mod comm;
mod config;
mod context;
mod cuda;
mod dtype;
mod error;
mod ffi;
mod handle;
mod ops;
mod poll;
mod runtime;
mod search;
mod unique_id;
mod version;

pub use buffer::DeviceBuffer;
pub use comm::{AbortOutcome, CloseOutcome, CommState, NcclComm, ShrinkMode};
pub use config::CommConfig;
pub use context::DeviceContext;
pub use dtype::{NcclDataType, NcclRedOp, nccl_native, nccl_reduction, wire_type};
pub use error::{LibraryKind, NcclError};
pub use handle::OpHandle;
pub use runtime::{CudaDriver, NcclRuntime};
pub use search::{Candidate, LibrarySearch};
pub use unique_id::UniqueId;
pub use version::NcclVersion;
