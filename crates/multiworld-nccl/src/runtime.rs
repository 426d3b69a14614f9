//! [`NcclRuntime`]: NCCL and the CUDA driver, found and loaded at run time
//! with `dlopen`; [`CudaDriver`]: the CUDA driver alone, which is all that
//! device memory and host copies ([`DeviceContext`](crate::DeviceContext))
//! need. Loading never panics: a missing library, a missing symbol or too
//! old a version is an [`NcclError`] that lists what was tried. Both are
//! cheap-to-clone `Arc` handles shared by every world; they hold only
//! function pointers and immutable facts, so sharing them couples no world
//! to another.
//!
//! The libraries are never unloaded: NCCL keeps background threads (proxy
//! threads, and the abort thread of a quarantined communicator) that may
//! outlive every handle, and unloading code under a running thread would
//! crash the process.

#![allow(unsafe_code)]

use std::ffi::c_int;
use std::sync::{Arc, OnceLock};

use libloading::Library;

use crate::error::{LibraryKind, NcclError};
use crate::ffi::{self, CuResult, CudaApi, NcclApi, NcclResultCode, NcclUniqueIdRaw, RawComm};
use crate::search::{Candidate, LibrarySearch};
use crate::unique_id::UniqueId;
use crate::version::NcclVersion;

/// NCCL and the CUDA driver, loaded. Clone freely (`Arc` inside); `Send +
/// Sync`.
#[derive(Clone)]
pub struct NcclRuntime {
    inner: Arc<RuntimeInner>,
}

struct RuntimeInner {
    nccl: NcclApi,
    version: NcclVersion,
    nccl_library: String,
    driver: CudaDriver,
}

impl std::fmt::Debug for NcclRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclRuntime")
            .field("version", &self.inner.version)
            .field("nccl_library", &self.inner.nccl_library)
            .field("cuda_library", &self.inner.driver.library())
            .finish()
    }
}

/// The CUDA driver alone, loaded: enough for device memory, streams and
/// host copies ([`DeviceContext`](crate::DeviceContext)); NCCL is not
/// needed. Clone freely (`Arc` inside); `Send + Sync`. An [`NcclRuntime`]
/// holds one ([`NcclRuntime::cuda_driver`]).
#[derive(Clone)]
pub struct CudaDriver {
    inner: Arc<DriverInner>,
}

struct DriverInner {
    cuda: CudaApi,
    library: String,
    /// `cuInit(0)`'s result, computed once (cuInit is idempotent but not
    /// free).
    cu_init: OnceLock<CuResult>,
}

impl std::fmt::Debug for CudaDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDriver")
            .field("library", &self.inner.library)
            .finish()
    }
}

impl AsRef<CudaDriver> for CudaDriver {
    fn as_ref(&self) -> &CudaDriver {
        self
    }
}

impl AsRef<CudaDriver> for NcclRuntime {
    fn as_ref(&self) -> &CudaDriver {
        self.cuda_driver()
    }
}

impl CudaDriver {
    /// Finds and loads the CUDA driver only (`CUDA_DRIVER_LIBRARY` first;
    /// see the `search` module docs); NCCL is neither needed nor looked
    /// for.
    pub fn load() -> Result<CudaDriver, NcclError> {
        CudaDriver::load_with(&LibrarySearch::from_env())
    }

    /// Loads the CUDA driver with an explicit search (its NCCL fields are
    /// not used).
    pub fn load_with(search: &LibrarySearch) -> Result<CudaDriver, NcclError> {
        let (lib, library) = open_first(LibraryKind::CudaDriver, &search.cuda_driver_candidates())?;
        let cuda = CudaApi::load(&lib, &library)?;
        // Never unloaded: see the module docs.
        std::mem::forget(lib);
        tracing::debug!(path = %library, "CUDA driver loaded");
        Ok(CudaDriver {
            inner: Arc::new(DriverInner {
                cuda,
                library,
                cu_init: OnceLock::new(),
            }),
        })
    }

    /// Where the CUDA driver was loaded from.
    pub fn library(&self) -> &str {
        &self.inner.library
    }

    /// The CUDA driver's version as `(major, minor)` (`cuDriverGetVersion`;
    /// works without a GPU).
    pub fn version(&self) -> Result<(u32, u32), NcclError> {
        let mut v: c_int = 0;
        // SAFETY: writes one int.
        let rc = unsafe { (self.inner.cuda.driver_get_version)(&mut v) };
        self.cuda_check("cuDriverGetVersion", rc)?;
        let v = u32::try_from(v).unwrap_or(0);
        Ok((v / 1000, (v % 1000) / 10))
    }

    /// Number of visible CUDA devices. `Ok(0)` when the driver reports no
    /// device; an error when the driver cannot initialise (e.g. a stub
    /// library, or a driver older than the kernel module).
    pub fn device_count(&self) -> Result<usize, NcclError> {
        let rc = self.cu_init();
        if rc == ffi::CUDA_ERROR_NO_DEVICE {
            return Ok(0);
        }
        self.cuda_check("cuInit", rc)?;
        let mut n: c_int = 0;
        // SAFETY: writes one int; cuInit succeeded.
        let rc = unsafe { (self.inner.cuda.device_get_count)(&mut n) };
        self.cuda_check("cuDeviceGetCount", rc)?;
        Ok(usize::try_from(n).unwrap_or(0))
    }

    pub(crate) fn cuda(&self) -> &CudaApi {
        &self.inner.cuda
    }

    fn cu_init(&self) -> CuResult {
        *self.inner.cu_init.get_or_init(|| {
            // SAFETY: cuInit(0) is thread-safe and idempotent.
            unsafe { (self.inner.cuda.init)(0) }
        })
    }

    /// Maps a `CUresult` to `Ok` or [`NcclError::Cuda`] with the driver's
    /// name and description of the code.
    pub(crate) fn cuda_check(&self, call: &'static str, rc: CuResult) -> Result<(), NcclError> {
        if rc == ffi::CUDA_SUCCESS {
            return Ok(());
        }
        Err(NcclError::Cuda {
            call,
            code: rc,
            message: self.cuda_message(rc),
        })
    }

    fn cuda_message(&self, rc: CuResult) -> String {
        let mut name = std::ptr::null();
        let mut text = std::ptr::null();
        // SAFETY: both calls write a pointer to a static string (or leave it
        // null for unknown codes); `c_string` copies it at once.
        let (name, text) = unsafe {
            let _ = (self.inner.cuda.get_error_name)(rc, &mut name);
            let _ = (self.inner.cuda.get_error_string)(rc, &mut text);
            (ffi::c_string(name), ffi::c_string(text))
        };
        match (name, text) {
            (Some(n), Some(t)) => format!("{n}: {t}"),
            (Some(n), None) => n,
            (None, Some(t)) => t,
            (None, None) => "unknown CUDA error".to_owned(),
        }
    }
}

/// Tries each candidate in order; returns the first that loads, or
/// `LibraryNotFound` with every candidate and why it failed.
fn open_first(kind: LibraryKind, candidates: &[Candidate]) -> Result<(Library, String), NcclError> {
    let mut tried = Vec::with_capacity(candidates.len());
    for c in candidates {
        let shown = c.name.display().to_string();
        if !c.is_bare_name() && !c.name.exists() {
            tried.push(format!("{shown} [{}]: no such file", c.origin));
            continue;
        }
        // SAFETY: loading runs the library's initialisers. The candidates are
        // the vendor libraries we look for (or the file the user named in
        // NCCL_LIBRARY); their initialisers only set up internal state.
        match unsafe { Library::new(&c.name) } {
            Ok(lib) => {
                tracing::debug!(library = %kind, path = %shown, origin = c.origin, "loaded");
                return Ok((lib, shown));
            }
            Err(e) => tried.push(format!("{shown} [{}]: {e}", c.origin)),
        }
    }
    Err(NcclError::LibraryNotFound { library: kind, tried })
}

impl NcclRuntime {
    /// Finds and loads NCCL and the CUDA driver using the search order of
    /// [`LibrarySearch::from_env`] (`NCCL_LIBRARY` first; see the `search`
    /// module docs for the full list).
    pub fn load() -> Result<NcclRuntime, NcclError> {
        NcclRuntime::load_with(&LibrarySearch::from_env())
    }

    /// Loads with an explicit search (tests, or a caller with its own idea of
    /// where NCCL is). NCCL is loaded and version-checked first, then the
    /// CUDA driver.
    pub fn load_with(search: &LibrarySearch) -> Result<NcclRuntime, NcclError> {
        let (nccl_lib, nccl_library) = open_first(LibraryKind::Nccl, &search.nccl_candidates())?;
        let get_version = NcclApi::load_get_version(&nccl_lib, &nccl_library)?;
        let mut code: c_int = 0;
        // SAFETY: `ncclGetVersion(int*)` writes one int; it needs no GPU.
        let rc = unsafe { get_version(&mut code) };
        if rc != ffi::NCCL_SUCCESS {
            return Err(NcclError::Nccl {
                call: "ncclGetVersion",
                code: rc,
                message: format!("library at {nccl_library}"),
            });
        }
        let version = NcclVersion::from_code(code).ok_or_else(|| NcclError::Nccl {
            call: "ncclGetVersion",
            code: ffi::NCCL_SUCCESS,
            message: format!("nonsensical version code {code} from {nccl_library}"),
        })?;
        if version < NcclVersion::MINIMUM {
            return Err(NcclError::VersionTooOld {
                found: version,
                required: NcclVersion::MINIMUM,
                what: "non-blocking communicators (ncclCommInitRankConfig with blocking = 0)",
            });
        }
        let nccl = NcclApi::load(&nccl_lib, &nccl_library)?;
        tracing::debug!(%version, path = %nccl_library, "NCCL found; loading the CUDA driver");

        let driver = CudaDriver::load_with(search)?;

        // Never unloaded: see the module docs.
        std::mem::forget(nccl_lib);
        tracing::info!(%version, nccl = %nccl_library, cuda = %driver.library(), "NCCL runtime loaded");
        Ok(NcclRuntime {
            inner: Arc::new(RuntimeInner {
                nccl,
                version,
                nccl_library,
                driver,
            }),
        })
    }

    /// The CUDA driver this runtime uses.
    pub fn cuda_driver(&self) -> &CudaDriver {
        &self.inner.driver
    }

    /// The NCCL version of the loaded library (`ncclGetVersion`).
    pub fn version(&self) -> NcclVersion {
        self.inner.version
    }

    /// Where NCCL was loaded from (a path, or the bare name the dynamic
    /// loader resolved).
    pub fn nccl_library(&self) -> &str {
        &self.inner.nccl_library
    }

    /// Where the CUDA driver was loaded from.
    pub fn cuda_driver_library(&self) -> &str {
        self.inner.driver.library()
    }

    /// Whether `ncclCommShrink` may be used: runtime NCCL ≥ 2.27 and the
    /// symbol is present.
    pub fn supports_shrink(&self) -> bool {
        self.inner.version.has_shrink() && self.inner.nccl.comm_shrink.is_some()
    }

    /// Whether `ncclCommRevoke` may be used: runtime NCCL ≥ 2.29 and the
    /// symbol is present.
    pub fn supports_revoke(&self) -> bool {
        self.inner.version.has_revoke() && self.inner.nccl.comm_revoke.is_some()
    }

    /// The CUDA driver's version as `(major, minor)` (`cuDriverGetVersion`;
    /// works without a GPU).
    pub fn cuda_driver_version(&self) -> Result<(u32, u32), NcclError> {
        self.inner.driver.version()
    }

    /// Number of visible CUDA devices (see [`CudaDriver::device_count`]).
    pub fn device_count(&self) -> Result<usize, NcclError> {
        self.inner.driver.device_count()
    }

    /// A fresh NCCL unique id (`ncclGetUniqueId`), to be created on one rank
    /// and published to the others through the world's store.
    pub fn unique_id(&self) -> Result<UniqueId, NcclError> {
        let mut raw = NcclUniqueIdRaw {
            internal: [0; ffi::NCCL_UNIQUE_ID_BYTES],
        };
        // SAFETY: writes a 128-byte ncclUniqueId into `raw`.
        let rc = unsafe { (self.inner.nccl.get_unique_id)(&mut raw) };
        self.nccl_check("ncclGetUniqueId", rc, None)?;
        Ok(UniqueId::from_raw(raw))
    }

    pub(crate) fn nccl(&self) -> &NcclApi {
        &self.inner.nccl
    }

    /// Maps an `ncclResult_t` to `Ok` (success *or* `ncclInProgress`, which a
    /// non-blocking communicator returns for work that continues in the
    /// background) or [`NcclError::Nccl`].
    pub(crate) fn nccl_check(
        &self,
        call: &'static str,
        rc: NcclResultCode,
        comm: Option<RawComm>,
    ) -> Result<(), NcclError> {
        if rc == ffi::NCCL_SUCCESS || rc == ffi::NCCL_IN_PROGRESS {
            return Ok(());
        }
        Err(self.nccl_error(call, rc, comm))
    }

    /// [`NcclError::Nccl`] for `rc`, with `ncclGetErrorString` and, where the
    /// library has it, `ncclGetLastError`.
    pub(crate) fn nccl_error(
        &self,
        call: &'static str,
        rc: NcclResultCode,
        comm: Option<RawComm>,
    ) -> NcclError {
        // SAFETY: returns a pointer to a static string; copied at once.
        let mut message = unsafe { ffi::c_string((self.inner.nccl.get_error_string)(rc)) }
            .unwrap_or_else(|| "unknown NCCL error".to_owned());
        if let Some(last) = self.inner.nccl.get_last_error {
            // SAFETY: ncclGetLastError ignores its argument in every release
            // so far (documented "currently unused, can be NULL"); the string
            // is copied at once.
            let detail = unsafe { ffi::c_string(last(comm.unwrap_or(std::ptr::null_mut()))) };
            if let Some(d) = detail.filter(|d| !d.trim().is_empty()) {
                message.push_str(": ");
                message.push_str(d.trim());
            }
        }
        NcclError::Nccl {
            call,
            code: rc,
            message,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    #[test]
    fn explicit_missing_path_reports_library_not_found() {
        let search = LibrarySearch {
            nccl_library: Some(PathBuf::from("/nonexistent/libnccl.so.2")),
            ..LibrarySearch::default()
        };
        match NcclRuntime::load_with(&search) {
            Err(NcclError::LibraryNotFound { library, tried }) => {
                assert_eq!(library, LibraryKind::Nccl);
                assert_eq!(tried.len(), 1);
                assert!(
                    tried[0].starts_with("/nonexistent/libnccl.so.2 [NCCL_LIBRARY]"),
                    "{tried:?}"
                );
            }
            other => panic!("expected LibraryNotFound, got {other:?}"),
        }
    }

    #[test]
    fn a_file_that_is_not_a_library_is_reported_with_the_loader_error() {
        let path = std::env::temp_dir().join(format!("mw-nccl-not-a-lib-{}.so", std::process::id()));
        std::fs::write(&path, b"definitely not ELF").unwrap();
        let search = LibrarySearch {
            nccl_library: Some(path.clone()),
            ..LibrarySearch::default()
        };
        let result = NcclRuntime::load_with(&search);
        let _ = std::fs::remove_file(&path);
        match result {
            Err(NcclError::LibraryNotFound { tried, .. }) => {
                assert_eq!(tried.len(), 1);
                assert!(!tried[0].contains("no such file"), "{tried:?}");
            }
            other => panic!("expected LibraryNotFound, got {other:?}"),
        }
    }
}
