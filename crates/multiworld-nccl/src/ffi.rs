//! The C ABI this crate speaks: the handful of NCCL and CUDA driver types,
//! struct layouts and function signatures we resolve with `dlsym` at run time,
//! and the tables of function pointers that hold them. Nothing here is linked
//! at build time, which is why the crate builds on machines with no CUDA.
//!
//! Every layout below is an assumption about a C header that the compiler
//! cannot check; each is marked `LAYOUT ASSUMPTION` with the header it
//! follows, and the sizes and offsets are asserted at compile time (64-bit
//! targets) and in unit tests.
//!
//! Sources followed:
//! - NCCL: `src/nccl.h.in` of NVIDIA/nccl (checked against the 2.14, 2.17,
//!   2.18 and 2.31 headers; the `ncclConfig_t` prefix we declare is the 2.18
//!   one, see [`NcclConfigRaw`]). The symbol list was checked with `nm -D`
//!   against the `nvidia-nccl-cu12` 2.32.3 wheel's `libnccl.so.2`.
//! - CUDA driver: `cuda.h` of CUDA 12.x. Where `cuda.h` maps a name to a
//!   versioned symbol (`#define cuMemFree cuMemFree_v2`), we resolve the
//!   versioned symbol, because the bare name is the old ABI kept for binaries
//!   built against CUDA 3.x.

#![allow(unsafe_code)]

use std::ffi::{c_char, c_int, c_uint, c_void};

use libloading::Library;

use crate::error::{LibraryKind, NcclError};

// ---------------------------------------------------------------------------
// NCCL types
// ---------------------------------------------------------------------------

/// `ncclResult_t` (a C enum, `int`-sized on every platform NCCL supports).
pub(crate) type NcclResultCode = c_int;
/// `ncclComm_t`: an opaque pointer owned by NCCL.
pub(crate) type RawComm = *mut c_void;

/// `ncclSuccess`.
pub(crate) const NCCL_SUCCESS: NcclResultCode = 0;
/// `ncclInvalidArgument`.
pub(crate) const NCCL_INVALID_ARGUMENT: NcclResultCode = 4;
/// `ncclInvalidUsage`.
pub(crate) const NCCL_INVALID_USAGE: NcclResultCode = 5;
/// `ncclInProgress`: returned by non-blocking communicators while work is
/// still being set up in the background.
pub(crate) const NCCL_IN_PROGRESS: NcclResultCode = 7;

/// `NCCL_UNIQUE_ID_BYTES`.
pub(crate) const NCCL_UNIQUE_ID_BYTES: usize = 128;

/// `ncclUniqueId`: `typedef struct { char internal[128]; } ncclUniqueId;`
///
/// LAYOUT ASSUMPTION (every NCCL 2.x header): 128 bytes, alignment 1, passed
/// **by value** to `ncclCommInitRankConfig`. Declared as `u8` rather than
/// `c_char` (whose signedness differs between x86_64 and aarch64): same size
/// and alignment, and the bytes are opaque to us.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct NcclUniqueIdRaw {
    pub(crate) internal: [u8; NCCL_UNIQUE_ID_BYTES],
}

/// `NCCL_CONFIG_UNDEF_INT` (`INT_MIN`).
pub(crate) const NCCL_CONFIG_UNDEF_INT: c_int = c_int::MIN;
/// `NCCL_API_MAGIC` / the `magic` of `NCCL_CONFIG_INITIALIZER`.
pub(crate) const NCCL_CONFIG_MAGIC: c_uint = 0xcafe_beef;
/// The `version` we put in the config: `NCCL_VERSION(2, 18, 0)`, the header
/// whose `ncclConfig_t` prefix [`NcclConfigRaw`] reproduces.
pub(crate) const NCCL_CONFIG_HEADER_VERSION: c_uint = 21_800;

/// `ncclConfig_t` as declared by the **NCCL 2.18** header: the fields
/// `size, magic, version, blocking, cgaClusterSize, minCTAs, maxCTAs,
/// netName, splitShare`, initialised as `NCCL_CONFIG_INITIALIZER` does
/// (`size = sizeof`, `magic = 0xcafebeef`, `version = NCCL_VERSION_CODE`,
/// every other field `NCCL_CONFIG_UNDEF_INT` / `NULL`).
///
/// LAYOUT ASSUMPTION: later headers only *append* fields (2.31 has 27 of
/// them). NCCL's `ncclCommInitRankConfig` reads `size` first, copies
/// `min(size, sizeof(its ncclConfig_t))` bytes over its own
/// `NCCL_CONFIG_INITIALIZER` copy and resets fields newer than `version`, so
/// a shorter, older prefix is the documented way to talk to any newer
/// library, and an older library (2.14–2.17) copies only the part it knows.
/// On x86_64/aarch64 Linux this is 48 bytes: offsets 0, 8, 12, 16, 20, 24,
/// 28, 32, 40, then 4 bytes of tail padding (declared, see `tail_padding`).
/// These offsets were checked by compiling against the `nccl.h` shipped in
/// the `nvidia-nccl-cu12` 2.32.3 wheel, whose `ncclConfig_t` (120 bytes)
/// starts with exactly this prefix.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct NcclConfigRaw {
    pub(crate) size: usize,
    pub(crate) magic: c_uint,
    pub(crate) version: c_uint,
    pub(crate) blocking: c_int,
    pub(crate) cga_cluster_size: c_int,
    pub(crate) min_ctas: c_int,
    pub(crate) max_ctas: c_int,
    pub(crate) net_name: *const c_char,
    pub(crate) split_share: c_int,
    /// The 4 bytes of tail padding the 2.18 header's `sizeof` includes. NCCL
    /// copies all `size` bytes, and 2.25+ reads them as `trafficClass`; it
    /// also resets that field because our `version` is older, but we make
    /// the bytes defined anyway: `NCCL_CONFIG_UNDEF_INT`, i.e. "default".
    pub(crate) tail_padding: c_int,
}

impl NcclConfigRaw {
    /// `NCCL_CONFIG_INITIALIZER` for the 2.18 layout.
    pub(crate) fn initializer() -> Self {
        NcclConfigRaw {
            size: std::mem::size_of::<NcclConfigRaw>(),
            magic: NCCL_CONFIG_MAGIC,
            version: NCCL_CONFIG_HEADER_VERSION,
            blocking: NCCL_CONFIG_UNDEF_INT,
            cga_cluster_size: NCCL_CONFIG_UNDEF_INT,
            min_ctas: NCCL_CONFIG_UNDEF_INT,
            max_ctas: NCCL_CONFIG_UNDEF_INT,
            net_name: std::ptr::null(),
            split_share: NCCL_CONFIG_UNDEF_INT,
            tail_padding: NCCL_CONFIG_UNDEF_INT,
        }
    }
}

#[cfg(target_pointer_width = "64")]
const _: () = {
    use std::mem::{offset_of, size_of};
    assert!(size_of::<NcclUniqueIdRaw>() == 128);
    assert!(size_of::<NcclConfigRaw>() == 48);
    assert!(offset_of!(NcclConfigRaw, magic) == 8);
    assert!(offset_of!(NcclConfigRaw, version) == 12);
    assert!(offset_of!(NcclConfigRaw, blocking) == 16);
    assert!(offset_of!(NcclConfigRaw, cga_cluster_size) == 20);
    assert!(offset_of!(NcclConfigRaw, min_ctas) == 24);
    assert!(offset_of!(NcclConfigRaw, max_ctas) == 28);
    assert!(offset_of!(NcclConfigRaw, net_name) == 32);
    assert!(offset_of!(NcclConfigRaw, split_share) == 40);
    assert!(offset_of!(NcclConfigRaw, tail_padding) == 44);
};

// ---------------------------------------------------------------------------
// CUDA driver types
// ---------------------------------------------------------------------------

/// `CUresult` (a C enum).
pub(crate) type CuResult = c_int;
/// `CUdevice` (`int`).
pub(crate) type CuDevice = c_int;
/// `CUcontext`.
pub(crate) type CuContext = *mut c_void;
/// `CUstream` (interchangeable with `cudaStream_t`, which NCCL takes).
pub(crate) type CuStream = *mut c_void;
/// `CUevent`.
pub(crate) type CuEvent = *mut c_void;
/// `CUmemoryPool`.
pub(crate) type CuMemPool = *mut c_void;
/// `CUdeviceptr` (`unsigned long long` since the `_v2` API).
pub(crate) type CuDevicePtr = u64;

/// `CUDA_SUCCESS`.
pub(crate) const CUDA_SUCCESS: CuResult = 0;
/// `CUDA_ERROR_OUT_OF_MEMORY`.
pub(crate) const CUDA_ERROR_OUT_OF_MEMORY: CuResult = 2;
/// `CUDA_ERROR_NO_DEVICE`.
pub(crate) const CUDA_ERROR_NO_DEVICE: CuResult = 100;
/// `CUDA_ERROR_NOT_READY`: what `cuEventQuery` returns for pending work.
pub(crate) const CUDA_ERROR_NOT_READY: CuResult = 600;
/// `CUDA_ERROR_NOT_SUPPORTED`.
pub(crate) const CUDA_ERROR_NOT_SUPPORTED: CuResult = 801;

/// `CU_STREAM_NON_BLOCKING`: the stream does not synchronise with the legacy
/// default stream, so work other code puts there cannot stall a world.
pub(crate) const CU_STREAM_NON_BLOCKING: c_uint = 0x1;

/// `CU_MEMHOSTALLOC_PORTABLE`: page-locked memory that every context treats
/// as pinned, not only the one that allocated it.
pub(crate) const CU_MEMHOSTALLOC_PORTABLE: c_uint = 0x1;
/// `CU_EVENT_DISABLE_TIMING`: cheapest event kind, we only query completion.
pub(crate) const CU_EVENT_DISABLE_TIMING: c_uint = 0x2;
/// `CU_MEM_ALLOCATION_TYPE_PINNED`.
pub(crate) const CU_MEM_ALLOCATION_TYPE_PINNED: c_int = 1;
/// `CU_MEM_LOCATION_TYPE_DEVICE`.
pub(crate) const CU_MEM_LOCATION_TYPE_DEVICE: c_int = 1;

/// `CUmemLocation`: `{ CUmemLocationType type; int id; }`.
///
/// LAYOUT ASSUMPTION (cuda.h 11.2 through 12.x): 8 bytes, `type` first.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct CuMemLocation {
    pub(crate) kind: c_int,
    pub(crate) id: c_int,
}

/// `CUmemPoolProps` (`CUmemPoolProps_v1`).
///
/// LAYOUT ASSUMPTION: cuda.h 11.2–12.1 declares `allocType, handleTypes,
/// location, win32SecurityAttributes, reserved[64]`; 12.2+ splits the
/// reserved tail into `size_t maxSize; unsigned short usage; unsigned char
/// reserved[54]`. Both are 88 bytes on 64-bit targets and we zero the whole
/// tail, which both versions read as "defaults" (`maxSize = 0` means the
/// device's limit).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct CuMemPoolProps {
    pub(crate) alloc_type: c_int,
    pub(crate) handle_types: c_int,
    pub(crate) location: CuMemLocation,
    pub(crate) win32_security_attributes: *mut c_void,
    pub(crate) max_size: usize,
    pub(crate) usage: u16,
    pub(crate) reserved: [u8; 54],
}

impl CuMemPoolProps {
    /// Properties of a pool of ordinary device memory on `ordinal`.
    pub(crate) fn device(ordinal: c_int) -> Self {
        CuMemPoolProps {
            alloc_type: CU_MEM_ALLOCATION_TYPE_PINNED,
            handle_types: 0,
            location: CuMemLocation {
                kind: CU_MEM_LOCATION_TYPE_DEVICE,
                id: ordinal,
            },
            win32_security_attributes: std::ptr::null_mut(),
            max_size: 0,
            usage: 0,
            reserved: [0; 54],
        }
    }
}

#[cfg(target_pointer_width = "64")]
const _: () = {
    use std::mem::{offset_of, size_of};
    assert!(size_of::<CuMemPoolProps>() == 88);
    assert!(offset_of!(CuMemPoolProps, location) == 8);
    assert!(offset_of!(CuMemPoolProps, win32_security_attributes) == 16);
    assert!(offset_of!(CuMemPoolProps, max_size) == 24);
    assert!(offset_of!(CuMemPoolProps, usage) == 32);
};

// ---------------------------------------------------------------------------
// Function tables
// ---------------------------------------------------------------------------

/// Resolves `name` in `lib` and copies the function pointer out.
///
/// # Safety
/// `T` must be the exact `unsafe extern "C" fn` type of the symbol.
unsafe fn symbol<T: Copy>(
    lib: &Library,
    kind: LibraryKind,
    path: &str,
    name: &'static str,
) -> Result<T, NcclError> {
    let mut bytes = Vec::with_capacity(name.len() + 1);
    bytes.extend_from_slice(name.as_bytes());
    bytes.push(0);
    // SAFETY: the caller guarantees `T` matches the C declaration of `name`;
    // the pointer stays valid because the library is never unloaded (see
    // `runtime.rs`).
    match unsafe { lib.get::<T>(&bytes) } {
        Ok(sym) => Ok(*sym),
        Err(_) => Err(NcclError::SymbolMissing {
            library: kind,
            path: path.to_owned(),
            symbol: name,
        }),
    }
}

/// Like [`symbol`], but a missing symbol is `None` (optional, newer calls).
///
/// # Safety
/// As for [`symbol`].
unsafe fn optional_symbol<T: Copy>(lib: &Library, name: &'static str) -> Option<T> {
    let mut bytes = Vec::with_capacity(name.len() + 1);
    bytes.extend_from_slice(name.as_bytes());
    bytes.push(0);
    // SAFETY: as in `symbol`.
    unsafe { lib.get::<T>(&bytes) }.ok().map(|s| *s)
}

/// `ncclResult_t ncclGetVersion(int *version)`.
pub(crate) type NcclGetVersionFn = unsafe extern "C" fn(*mut c_int) -> NcclResultCode;

/// The NCCL entry points this crate uses. Plain function pointers: `Copy`,
/// `Send` and `Sync`.
#[derive(Clone, Copy)]
pub(crate) struct NcclApi {
    pub(crate) get_unique_id: unsafe extern "C" fn(*mut NcclUniqueIdRaw) -> NcclResultCode,
    pub(crate) comm_init_rank_config: unsafe extern "C" fn(
        *mut RawComm,
        c_int,
        NcclUniqueIdRaw,
        c_int,
        *mut NcclConfigRaw,
    ) -> NcclResultCode,
    pub(crate) comm_get_async_error: unsafe extern "C" fn(RawComm, *mut NcclResultCode) -> NcclResultCode,
    pub(crate) comm_abort: unsafe extern "C" fn(RawComm) -> NcclResultCode,
    pub(crate) comm_finalize: unsafe extern "C" fn(RawComm) -> NcclResultCode,
    pub(crate) comm_destroy: unsafe extern "C" fn(RawComm) -> NcclResultCode,
    pub(crate) get_error_string: unsafe extern "C" fn(NcclResultCode) -> *const c_char,
    pub(crate) all_reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        RawComm,
        CuStream,
    ) -> NcclResultCode,
    pub(crate) broadcast: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        RawComm,
        CuStream,
    ) -> NcclResultCode,
    pub(crate) reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        c_int,
        RawComm,
        CuStream,
    ) -> NcclResultCode,
    pub(crate) all_gather:
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, RawComm, CuStream) -> NcclResultCode,
    pub(crate) reduce_scatter: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        RawComm,
        CuStream,
    ) -> NcclResultCode,
    pub(crate) send:
        unsafe extern "C" fn(*const c_void, usize, c_int, c_int, RawComm, CuStream) -> NcclResultCode,
    pub(crate) recv:
        unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, RawComm, CuStream) -> NcclResultCode,
    pub(crate) group_start: unsafe extern "C" fn() -> NcclResultCode,
    pub(crate) group_end: unsafe extern "C" fn() -> NcclResultCode,
    /// `ncclGetLastError` (2.13+).
    pub(crate) get_last_error: Option<unsafe extern "C" fn(RawComm) -> *const c_char>,
    /// `ncclCommShrink(comm, excludeRanks, count, newcomm, config, flags)`
    /// (2.27+).
    pub(crate) comm_shrink: Option<
        unsafe extern "C" fn(
            RawComm,
            *mut c_int,
            c_int,
            *mut RawComm,
            *mut NcclConfigRaw,
            c_int,
        ) -> NcclResultCode,
    >,
    /// `ncclCommRevoke(comm, revokeFlags)` (2.29+).
    pub(crate) comm_revoke: Option<unsafe extern "C" fn(RawComm, c_int) -> NcclResultCode>,
}

impl NcclApi {
    /// Resolves `ncclGetVersion` alone, so an old library is reported as "too
    /// old" rather than as missing some newer symbol.
    pub(crate) fn load_get_version(lib: &Library, path: &str) -> Result<NcclGetVersionFn, NcclError> {
        // SAFETY: signature copied from nccl.h.
        unsafe { symbol(lib, LibraryKind::Nccl, path, "ncclGetVersion") }
    }

    /// Resolves every entry point.
    pub(crate) fn load(lib: &Library, path: &str) -> Result<NcclApi, NcclError> {
        let k = LibraryKind::Nccl;
        // SAFETY: each function pointer type below is transcribed from the
        // NCCL header cited in the module docs; `ncclDataType_t`,
        // `ncclRedOp_t` and `ncclResult_t` are C enums passed as `int`.
        unsafe {
            Ok(NcclApi {
                get_unique_id: symbol(lib, k, path, "ncclGetUniqueId")?,
                comm_init_rank_config: symbol(lib, k, path, "ncclCommInitRankConfig")?,
                comm_get_async_error: symbol(lib, k, path, "ncclCommGetAsyncError")?,
                comm_abort: symbol(lib, k, path, "ncclCommAbort")?,
                comm_finalize: symbol(lib, k, path, "ncclCommFinalize")?,
                comm_destroy: symbol(lib, k, path, "ncclCommDestroy")?,
                get_error_string: symbol(lib, k, path, "ncclGetErrorString")?,
                all_reduce: symbol(lib, k, path, "ncclAllReduce")?,
                broadcast: symbol(lib, k, path, "ncclBroadcast")?,
                reduce: symbol(lib, k, path, "ncclReduce")?,
                all_gather: symbol(lib, k, path, "ncclAllGather")?,
                reduce_scatter: symbol(lib, k, path, "ncclReduceScatter")?,
                send: symbol(lib, k, path, "ncclSend")?,
                recv: symbol(lib, k, path, "ncclRecv")?,
                group_start: symbol(lib, k, path, "ncclGroupStart")?,
                group_end: symbol(lib, k, path, "ncclGroupEnd")?,
                get_last_error: optional_symbol(lib, "ncclGetLastError"),
                comm_shrink: optional_symbol(lib, "ncclCommShrink"),
                comm_revoke: optional_symbol(lib, "ncclCommRevoke"),
            })
        }
    }
}

/// The CUDA driver entry points this crate uses.
#[derive(Clone, Copy)]
pub(crate) struct CudaApi {
    pub(crate) init: unsafe extern "C" fn(c_uint) -> CuResult,
    pub(crate) driver_get_version: unsafe extern "C" fn(*mut c_int) -> CuResult,
    pub(crate) device_get_count: unsafe extern "C" fn(*mut c_int) -> CuResult,
    pub(crate) device_get: unsafe extern "C" fn(*mut CuDevice, c_int) -> CuResult,
    pub(crate) primary_ctx_retain: unsafe extern "C" fn(*mut CuContext, CuDevice) -> CuResult,
    /// `cuDevicePrimaryCtxRelease_v2`.
    pub(crate) primary_ctx_release: unsafe extern "C" fn(CuDevice) -> CuResult,
    pub(crate) ctx_set_current: unsafe extern "C" fn(CuContext) -> CuResult,
    pub(crate) stream_create: unsafe extern "C" fn(*mut CuStream, c_uint) -> CuResult,
    /// `cuStreamDestroy_v2`.
    pub(crate) stream_destroy: unsafe extern "C" fn(CuStream) -> CuResult,
    pub(crate) event_create: unsafe extern "C" fn(*mut CuEvent, c_uint) -> CuResult,
    pub(crate) event_record: unsafe extern "C" fn(CuEvent, CuStream) -> CuResult,
    pub(crate) event_query: unsafe extern "C" fn(CuEvent) -> CuResult,
    pub(crate) stream_wait_event: unsafe extern "C" fn(CuStream, CuEvent, c_uint) -> CuResult,
    /// `cuEventDestroy_v2`.
    pub(crate) event_destroy: unsafe extern "C" fn(CuEvent) -> CuResult,
    /// `cuMemcpyHtoDAsync_v2`.
    pub(crate) memcpy_htod_async:
        unsafe extern "C" fn(CuDevicePtr, *const c_void, usize, CuStream) -> CuResult,
    /// `cuMemcpyDtoHAsync_v2`.
    pub(crate) memcpy_dtoh_async: unsafe extern "C" fn(*mut c_void, CuDevicePtr, usize, CuStream) -> CuResult,
    pub(crate) memset_d8_async: unsafe extern "C" fn(CuDevicePtr, u8, usize, CuStream) -> CuResult,
    pub(crate) get_error_string: unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult,
    pub(crate) get_error_name: unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult,
    /// Stream-ordered allocator (CUDA 11.2+); `None` on older drivers.
    pub(crate) pools: Option<PoolApi>,
    /// Page-locked host memory, for staging copies; `None` if the driver
    /// lacks it (copies then stage through ordinary memory).
    pub(crate) pinned: Option<PinnedApi>,
}

/// Page-locked ("pinned") host memory entry points.
#[derive(Clone, Copy)]
pub(crate) struct PinnedApi {
    /// `cuMemHostAlloc(void **pp, size_t bytes, unsigned flags)`.
    pub(crate) host_alloc: unsafe extern "C" fn(*mut *mut c_void, usize, c_uint) -> CuResult,
    /// `cuMemFreeHost(void *p)`.
    pub(crate) free_host: unsafe extern "C" fn(*mut c_void) -> CuResult,
}

/// The stream-ordered allocator entry points (CUDA 11.2+).
#[derive(Clone, Copy)]
pub(crate) struct PoolApi {
    pub(crate) pool_create: unsafe extern "C" fn(*mut CuMemPool, *const CuMemPoolProps) -> CuResult,
    pub(crate) pool_destroy: unsafe extern "C" fn(CuMemPool) -> CuResult,
    pub(crate) alloc_from_pool_async:
        unsafe extern "C" fn(*mut CuDevicePtr, usize, CuMemPool, CuStream) -> CuResult,
    pub(crate) free_async: unsafe extern "C" fn(CuDevicePtr, CuStream) -> CuResult,
}

impl CudaApi {
    /// Resolves every entry point.
    pub(crate) fn load(lib: &Library, path: &str) -> Result<CudaApi, NcclError> {
        let k = LibraryKind::CudaDriver;
        // SAFETY: each function pointer type below is transcribed from cuda.h
        // (CUDA 12.x) for the (versioned) symbol named.
        unsafe {
            let pools = match (
                optional_symbol(lib, "cuMemPoolCreate"),
                optional_symbol(lib, "cuMemPoolDestroy"),
                optional_symbol(lib, "cuMemAllocFromPoolAsync"),
                optional_symbol(lib, "cuMemFreeAsync"),
            ) {
                (Some(pool_create), Some(pool_destroy), Some(alloc_from_pool_async), Some(free_async)) => {
                    Some(PoolApi {
                        pool_create,
                        pool_destroy,
                        alloc_from_pool_async,
                        free_async,
                    })
                }
                _ => None,
            };
            let pinned = match (
                optional_symbol(lib, "cuMemHostAlloc"),
                optional_symbol(lib, "cuMemFreeHost"),
            ) {
                (Some(host_alloc), Some(free_host)) => Some(PinnedApi {
                    host_alloc,
                    free_host,
                }),
                _ => None,
            };
            Ok(CudaApi {
                init: symbol(lib, k, path, "cuInit")?,
                driver_get_version: symbol(lib, k, path, "cuDriverGetVersion")?,
                device_get_count: symbol(lib, k, path, "cuDeviceGetCount")?,
                device_get: symbol(lib, k, path, "cuDeviceGet")?,
                primary_ctx_retain: symbol(lib, k, path, "cuDevicePrimaryCtxRetain")?,
                primary_ctx_release: symbol(lib, k, path, "cuDevicePrimaryCtxRelease_v2")?,
                ctx_set_current: symbol(lib, k, path, "cuCtxSetCurrent")?,
                stream_create: symbol(lib, k, path, "cuStreamCreate")?,
                stream_destroy: symbol(lib, k, path, "cuStreamDestroy_v2")?,
                event_create: symbol(lib, k, path, "cuEventCreate")?,
                event_record: symbol(lib, k, path, "cuEventRecord")?,
                event_query: symbol(lib, k, path, "cuEventQuery")?,
                stream_wait_event: symbol(lib, k, path, "cuStreamWaitEvent")?,
                event_destroy: symbol(lib, k, path, "cuEventDestroy_v2")?,
                memcpy_htod_async: symbol(lib, k, path, "cuMemcpyHtoDAsync_v2")?,
                memcpy_dtoh_async: symbol(lib, k, path, "cuMemcpyDtoHAsync_v2")?,
                memset_d8_async: symbol(lib, k, path, "cuMemsetD8Async")?,
                get_error_string: symbol(lib, k, path, "cuGetErrorString")?,
                get_error_name: symbol(lib, k, path, "cuGetErrorName")?,
                pools,
                pinned,
            })
        }
    }
}

/// Copies a C string owned by the library (static error strings) into an
/// owned `String`; `None` for a null pointer.
///
/// # Safety
/// `ptr` must be null or point to a NUL-terminated string that stays valid
/// for the duration of the call.
pub(crate) unsafe fn c_string(ptr: *const c_char) -> Option<String> {
    if ptr.is_null() {
        return None;
    }
    // SAFETY: non-null and NUL-terminated per the caller's contract.
    let s = unsafe { std::ffi::CStr::from_ptr(ptr) };
    Some(s.to_string_lossy().into_owned())
}

/// A raw pointer that we promise to use only under the rules of the library
/// that made it (CUDA and NCCL handles are process-wide, not thread-bound).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SendPtr(pub(crate) *mut c_void);

// SAFETY: CUDA driver handles (contexts, streams, events, pools) and NCCL
// communicators are process-global objects usable from any thread; the
// crate serialises the calls whose documentation requires it (see comm.rs).
unsafe impl Send for SendPtr {}
// SAFETY: as above; `SendPtr` is only copied, never dereferenced by Rust.
unsafe impl Sync for SendPtr {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_initializer_matches_nccl_2_18_header() {
        let c = NcclConfigRaw::initializer();
        assert_eq!(c.size, std::mem::size_of::<NcclConfigRaw>());
        assert_eq!(c.magic, 0xcafe_beef);
        assert_eq!(c.version, 21_800);
        assert_eq!(c.blocking, i32::MIN);
        assert_eq!(c.cga_cluster_size, i32::MIN);
        assert_eq!(c.min_ctas, i32::MIN);
        assert_eq!(c.max_ctas, i32::MIN);
        assert!(c.net_name.is_null());
        assert_eq!(c.split_share, i32::MIN);
        assert_eq!(c.tail_padding, i32::MIN);
    }

    #[cfg(target_pointer_width = "64")]
    #[test]
    fn raw_layouts_have_the_header_sizes() {
        assert_eq!(std::mem::size_of::<NcclUniqueIdRaw>(), 128);
        assert_eq!(std::mem::align_of::<NcclUniqueIdRaw>(), 1);
        assert_eq!(std::mem::size_of::<NcclConfigRaw>(), 48);
        assert_eq!(std::mem::size_of::<CuMemPoolProps>(), 88);
        let p = CuMemPoolProps::device(3);
        assert_eq!(p.alloc_type, 1);
        assert_eq!(p.location.kind, 1);
        assert_eq!(p.location.id, 3);
        assert!(p.reserved.iter().all(|b| *b == 0));
    }
}
