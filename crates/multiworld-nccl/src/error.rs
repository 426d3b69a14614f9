//! The crate's one error type, [`NcclError`], and the questions the world
//! manager asks of it: is the world dead ([`NcclError::is_world_fatal`]), or
//! is NCCL/CUDA simply not usable on this machine
//! ([`NcclError::is_unavailable`]). Missing libraries, missing GPUs and old
//! versions are errors with the paths and versions involved, never panics.

use std::fmt;
use std::time::Duration;

use crate::comm::CommState;
use crate::version::NcclVersion;

/// Which shared library a loading error is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LibraryKind {
    /// NCCL (`libnccl.so.2`).
    Nccl,
    /// The CUDA driver (`libcuda.so.1`), installed with the GPU driver.
    CudaDriver,
}

impl fmt::Display for LibraryKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LibraryKind::Nccl => f.write_str("NCCL library (libnccl.so.2)"),
            LibraryKind::CudaDriver => f.write_str("CUDA driver library (libcuda.so.1)"),
        }
    }
}

/// Everything that can go wrong in this crate.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum NcclError {
    /// No candidate for the library could be loaded. `tried` lists every
    /// candidate in search order with the reason it was rejected.
    #[error(
        "{library} could not be loaded; tried, in order: [{}]. {}",
        tried.join("; "),
        library_hint(*library)
    )]
    LibraryNotFound {
        /// Which library.
        library: LibraryKind,
        /// `candidate: reason`, one entry per candidate, in search order.
        tried: Vec<String>,
    },
    /// The library loaded but lacks a required entry point.
    #[error("{library} at {path} has no symbol {symbol}; it is not a usable build")]
    SymbolMissing {
        /// Which library.
        library: LibraryKind,
        /// Where it was loaded from.
        path: String,
        /// The missing symbol.
        symbol: &'static str,
    },
    /// The NCCL found is older than something needs.
    #[error("NCCL {found} is too old: {what} needs NCCL {required} or newer")]
    VersionTooOld {
        /// The runtime version.
        found: NcclVersion,
        /// The minimum version.
        required: NcclVersion,
        /// What needs it.
        what: &'static str,
    },
    /// No GPU, or not the one asked for.
    #[error("no usable CUDA device: {reason}")]
    NoDevice {
        /// Why, with the device count where known.
        reason: String,
    },
    /// A CUDA driver call failed.
    #[error("CUDA call {call} failed with error {code} ({message})")]
    Cuda {
        /// The driver function.
        call: &'static str,
        /// The `CUresult`.
        code: i32,
        /// `cuGetErrorName: cuGetErrorString`.
        message: String,
    },
    /// An NCCL call failed, or the communicator reported an asynchronous
    /// error.
    #[error("NCCL call {call} failed with error {code} ({message})")]
    Nccl {
        /// The NCCL function (`ncclCommGetAsyncError` for asynchronous
        /// errors).
        call: &'static str,
        /// The `ncclResult_t`.
        code: i32,
        /// `ncclGetErrorString`, plus `ncclGetLastError` where available.
        message: String,
    },
    /// An operation did not finish by its deadline. The communicator is in an
    /// unknown state: treat the world as broken.
    #[error("{op} did not complete within {after:?}")]
    Timeout {
        /// The operation.
        op: &'static str,
        /// The time allowed.
        after: Duration,
    },
    /// The communicator has been aborted, quarantined, revoked or closed (or
    /// has failed), so `op` cannot run.
    #[error("cannot run {op}: the communicator is {state}")]
    Aborted {
        /// The operation refused.
        op: &'static str,
        /// The communicator's state.
        state: CommState,
    },
    /// The communicator failed on `cause`, an error a single call could
    /// otherwise have made (an `ncclInvalidUsage` that NCCL reports as the
    /// communicator's state, a CUDA out-of-memory after an operation was
    /// enqueued): world-fatal whatever `cause` is.
    #[error("the communicator failed: {cause}")]
    Failed {
        /// What failed it.
        cause: Box<NcclError>,
    },
    /// The request is valid but NCCL (or this version of it, or this device)
    /// cannot do it: e.g. a reduction on `i16`, bitwise reductions, `shrink`
    /// before NCCL 2.27.
    #[error("unsupported: {what}")]
    Unsupported {
        /// What and why.
        what: String,
    },
    /// The caller passed something wrong (rank out of range, buffer sizes
    /// that do not match, a buffer of another world...).
    #[error("invalid argument: {what}")]
    InvalidArgument {
        /// What and why.
        what: String,
    },
}

fn library_hint(kind: LibraryKind) -> &'static str {
    match kind {
        LibraryKind::Nccl => {
            "Install NCCL (e.g. `pip install nvidia-nccl-cu12`, which puts it in \
             <site-packages>/nvidia/nccl/lib) or set NCCL_LIBRARY to the full path of libnccl.so.2"
        }
        LibraryKind::CudaDriver => {
            "This machine has no NVIDIA driver (no GPU, or the driver libraries are not \
             mounted into the container)"
        }
    }
}

/// `ncclResult_t` codes that mean "this call was wrong", not "the world is
/// broken": `ncclInvalidArgument` (4) and `ncclInvalidUsage` (5).
fn nccl_code_is_caller_error(code: i32) -> bool {
    code == crate::ffi::NCCL_INVALID_ARGUMENT || code == crate::ffi::NCCL_INVALID_USAGE
}

impl NcclError {
    /// True when the world that produced this error must be torn down: its
    /// communicator failed, timed out, or is already aborted. False for
    /// errors of a single call (invalid arguments, unsupported requests, a
    /// device allocation that ran out of memory) and for errors that happen
    /// before a communicator exists (missing libraries, no GPU), which fail
    /// the join instead.
    pub fn is_world_fatal(&self) -> bool {
        match self {
            NcclError::Nccl { code, .. } => !nccl_code_is_caller_error(*code),
            NcclError::Cuda { code, .. } => {
                *code != crate::ffi::CUDA_ERROR_OUT_OF_MEMORY && *code != crate::ffi::CUDA_ERROR_NOT_SUPPORTED
            }
            NcclError::Timeout { .. } | NcclError::Aborted { .. } | NcclError::Failed { .. } => true,
            NcclError::LibraryNotFound { .. }
            | NcclError::SymbolMissing { .. }
            | NcclError::VersionTooOld { .. }
            | NcclError::NoDevice { .. }
            | NcclError::Unsupported { .. }
            | NcclError::InvalidArgument { .. } => false,
        }
    }

    /// True when NCCL or CUDA cannot be used on this machine at all (missing
    /// or broken libraries, too old a version, no GPU). GPU tests use it to
    /// decide to skip.
    pub fn is_unavailable(&self) -> bool {
        matches!(
            self,
            NcclError::LibraryNotFound { .. }
                | NcclError::SymbolMissing { .. }
                | NcclError::VersionTooOld { .. }
                | NcclError::NoDevice { .. }
        )
    }

    pub(crate) fn invalid(what: impl Into<String>) -> NcclError {
        NcclError::InvalidArgument { what: what.into() }
    }

    pub(crate) fn unsupported(what: impl Into<String>) -> NcclError {
        NcclError::Unsupported { what: what.into() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fatality_separates_world_failures_from_bad_calls() {
        let nccl = |code| NcclError::Nccl {
            call: "ncclAllReduce",
            code,
            message: String::new(),
        };
        assert!(nccl(1).is_world_fatal(), "unhandled CUDA error");
        assert!(nccl(2).is_world_fatal(), "system error");
        assert!(nccl(3).is_world_fatal(), "internal error");
        assert!(nccl(6).is_world_fatal(), "remote error");
        assert!(!nccl(4).is_world_fatal(), "invalid argument");
        assert!(!nccl(5).is_world_fatal(), "invalid usage");
        let cuda = |code| NcclError::Cuda {
            call: "cuMemAllocFromPoolAsync",
            code,
            message: String::new(),
        };
        assert!(!cuda(2).is_world_fatal(), "out of memory");
        assert!(cuda(700).is_world_fatal(), "illegal address");
        assert!(
            NcclError::Timeout {
                op: "all_reduce",
                after: Duration::from_secs(1)
            }
            .is_world_fatal()
        );
        assert!(
            NcclError::Aborted {
                op: "send",
                state: CommState::Quarantined
            }
            .is_world_fatal()
        );
        assert!(!NcclError::invalid("x").is_world_fatal());
        assert!(!NcclError::unsupported("x").is_world_fatal());
    }

    #[test]
    fn unavailability_is_only_about_the_environment() {
        let missing = NcclError::LibraryNotFound {
            library: LibraryKind::Nccl,
            tried: vec!["libnccl.so.2: not found".into()],
        };
        assert!(missing.is_unavailable());
        assert!(!missing.is_world_fatal());
        assert!(
            NcclError::NoDevice {
                reason: "0 devices".into()
            }
            .is_unavailable()
        );
        assert!(!NcclError::invalid("x").is_unavailable());
    }

    #[test]
    fn library_not_found_message_lists_every_path_and_a_hint() {
        let e = NcclError::LibraryNotFound {
            library: LibraryKind::Nccl,
            tried: vec!["/a/libnccl.so.2: missing".into(), "libnccl.so: missing".into()],
        };
        let text = e.to_string();
        assert!(
            text.contains("/a/libnccl.so.2: missing; libnccl.so: missing"),
            "{text}"
        );
        assert!(text.contains("NCCL_LIBRARY"), "{text}");
    }
}
