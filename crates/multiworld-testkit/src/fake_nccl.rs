//! The fake CUDA driver and NCCL (`fake/fake_cuda_nccl.c` of this crate) as
//! a test harness: compiles them with `cc` (or `$CC`) into `libcuda.so.1` and
//! `libnccl.so.2` once per test process (into a directory of the system's
//! temporary directory named after the user and the source, reused by later
//! processes), loads them, and calls their control functions. Used by
//! `multiworld-nccl`'s `tests/simulated.rs`, the facade's NCCL-world tests
//! and the examples' GPU test (feature `nccl`).
//!
//! The fakes keep global state, so a test holds the lock [`fake`] returns
//! for its whole run.

// The unsafe code resolves and calls the fake's control functions.
#![allow(unsafe_code)]

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, MutexGuard, OnceLock};

use multiworld_nccl::{LibrarySearch, NcclError, NcclRuntime};

/// The fakes' C source.
const SOURCE: &str = include_str!("../fake/fake_cuda_nccl.c");

static SERIAL: Mutex<()> = Mutex::new(());
static LIBS: OnceLock<(PathBuf, PathBuf)> = OnceLock::new();

/// Compiles the fakes once per process (unless an earlier process of this
/// user already compiled the same source with the same compiler); returns
/// (libnccl, libcuda) paths.
pub fn fake_libs() -> &'static (PathBuf, PathBuf) {
    LIBS.get_or_init(|| {
        let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
        let mut key = DefaultHasher::new();
        (SOURCE, &cc).hash(&mut key);
        let dir = std::env::temp_dir().join(format!(
            "multiworld-fake-nccl-{}-{:016x}",
            nix::unistd::getuid(),
            key.finish()
        ));
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
        let nccl = dir.join("libnccl.so.2");
        let cuda = dir.join("libcuda.so.1");
        for (define, out) in [("-DFAKE_NCCL", &nccl), ("-DFAKE_CUDA", &cuda)] {
            if !out.exists() {
                compile(&cc, define, &dir, out);
            }
        }
        (nccl, cuda)
    })
}

/// Compiles the fake selected by `define` into `out`, through a file of this
/// process renamed into place (so a concurrent test process never loads a
/// half-written library).
fn compile(cc: &str, define: &str, dir: &Path, out: &Path) {
    let pid = std::process::id();
    let src = dir.join(format!("fake_cuda_nccl-{pid}.c"));
    std::fs::write(&src, SOURCE).unwrap_or_else(|e| panic!("writing {}: {e}", src.display()));
    let tmp = dir.join(format!("{define}-{pid}.so.tmp"));
    let status = Command::new(cc)
        .args(["-shared", "-fPIC", "-O1", define, "-o"])
        .arg(&tmp)
        .arg(&src)
        .status()
        .expect("a C compiler (cc) is needed to build the fake CUDA/NCCL libraries");
    assert!(status.success(), "compiling the fake {define} failed");
    std::fs::rename(&tmp, out).unwrap_or_else(|e| panic!("renaming {} into place: {e}", tmp.display()));
    let _ = std::fs::remove_file(&src);
}

/// Resolves the control function `name` of `lib` (panics if it is missing).
///
/// # Safety
///
/// `T` must be the function's type as declared in fake_cuda_nccl.c.
unsafe fn control<'a, T>(lib: &'a libloading::Library, name: &str) -> libloading::Symbol<'a, T> {
    // SAFETY: the caller's promise.
    unsafe { lib.get::<T>(name.as_bytes()) }.unwrap_or_else(|e| panic!("the fake's {name}: {e}"))
}

/// Handles on the fake libraries' control functions.
pub struct Fake {
    nccl: libloading::Library,
    cuda: libloading::Library,
}

impl Fake {
    /// Calls the control function `name` of `lib`, which takes no argument.
    fn call0<R>(lib: &libloading::Library, name: &str) -> R {
        // SAFETY: every control function used through this helper takes no
        // argument and returns `R` as declared in fake_cuda_nccl.c.
        unsafe { control::<unsafe extern "C" fn() -> R>(lib, name)() }
    }

    /// Resets both fakes: NCCL reports `version` (e.g. 22_703 for 2.27.3),
    /// the driver `devices` devices; the hang, no-op and no-pinned switches
    /// off.
    pub fn reset(&self, version: i32, devices: i32) {
        // SAFETY: signatures as in fake_cuda_nccl.c.
        unsafe {
            control::<unsafe extern "C" fn(i32)>(&self.nccl, "fake_nccl_reset")(version);
            control::<unsafe extern "C" fn(i32)>(&self.cuda, "fake_cuda_reset")(devices);
        }
    }

    /// Makes NCCL's communicator init, its operations, or its abort hang
    /// (never complete) from now on.
    pub fn set(&self, init_hang: bool, ops_hang: bool, abort_hang: bool) {
        // SAFETY: signature as in fake_cuda_nccl.c.
        unsafe {
            control::<unsafe extern "C" fn(i32, i32, i32)>(&self.nccl, "fake_nccl_set")(
                init_hang as i32,
                ops_hang as i32,
                abort_hang as i32,
            );
        }
    }

    /// The driver refuses pinned host memory (to test the fallback without
    /// it).
    pub fn no_pinned(&self, on: bool) {
        // SAFETY: signature as in fake_cuda_nccl.c.
        unsafe { control::<unsafe extern "C" fn(i32)>(&self.cuda, "fake_cuda_no_pinned")(on as i32) }
    }

    /// While on, no context can be made current (`cuCtxSetCurrent` fails).
    pub fn no_set_current(&self, on: bool) {
        // SAFETY: signature as in fake_cuda_nccl.c.
        unsafe { control::<unsafe extern "C" fn(i32)>(&self.cuda, "fake_cuda_no_set_current")(on as i32) }
    }

    /// While `rc` is nonzero, `cuEventQuery` returns it (querying whether
    /// an operation has ended fails).
    pub fn event_query_fails(&self, rc: i32) {
        // SAFETY: signature as in fake_cuda_nccl.c.
        unsafe { control::<unsafe extern "C" fn(i32)>(&self.cuda, "fake_cuda_event_query_fails")(rc) }
    }

    /// While on, every host copy leaves its stream hung: the copy, and all
    /// later work on that stream, never completes.
    pub fn copies_hang(&self, on: bool) {
        // SAFETY: signature as in fake_cuda_nccl.c.
        unsafe { control::<unsafe extern "C" fn(i32)>(&self.cuda, "fake_cuda_copies_hang")(on as i32) }
    }

    /// Slows every later collective enqueued on the most recently created
    /// communicator: the NCCL call sleeps `sleep_ms`, then the communicator
    /// reports `ncclInProgress` for `polls` queries (`i32::MAX`: until the
    /// caller gives up). `(0, 0)` turns it off.
    pub fn stall_last(&self, polls: i32, sleep_ms: i32) {
        // SAFETY: signature as in fake_cuda_nccl.c.
        unsafe {
            control::<unsafe extern "C" fn(i32, i32)>(&self.nccl, "fake_nccl_stall_last")(polls, sleep_ms)
        }
    }

    /// Lets the operations left hanging on the most recently created
    /// communicator (by `set(_, true, _)`) complete now, moving no data.
    pub fn release_last(&self) {
        // SAFETY: signature as in fake_cuda_nccl.c.
        unsafe { control::<unsafe extern "C" fn()>(&self.nccl, "fake_nccl_release_last")() }
    }

    /// A broken NCCL: operations complete but move no data (to show that
    /// a check can fail).
    pub fn noop(&self, on: bool) {
        // SAFETY: signature as in fake_cuda_nccl.c.
        unsafe { control::<unsafe extern "C" fn(i32)>(&self.nccl, "fake_nccl_noop")(on as i32) }
    }

    /// Makes every later `ncclGetUniqueId` take `ms` milliseconds (NCCL's
    /// first call initialises it); 0 turns it off. `reset` turns it off too.
    pub fn slow_unique_id(&self, ms: i32) {
        // SAFETY: signature as in fake_cuda_nccl.c.
        unsafe { control::<unsafe extern "C" fn(i32)>(&self.nccl, "fake_nccl_slow_unique_id")(ms) }
    }

    /// Makes the most recently created communicator report the asynchronous
    /// NCCL error `code` (0: none).
    pub fn fail_last(&self, code: i32) {
        // SAFETY: signature as in fake_cuda_nccl.c.
        unsafe { control::<unsafe extern "C" fn(i32)>(&self.nccl, "fake_nccl_fail_last")(code) }
    }

    /// Live (comms, allocations, streams, events, context refs, pools, pinned
    /// host buffers).
    pub fn live(&self) -> [i64; 7] {
        let cuda = |what: i32| {
            // SAFETY: signature as in fake_cuda_nccl.c.
            unsafe { control::<unsafe extern "C" fn(i32) -> i64>(&self.cuda, "fake_cuda_live")(what) }
        };
        [
            Fake::call0::<i64>(&self.nccl, "fake_nccl_live"),
            cuda(0),
            cuda(1),
            cuda(2),
            cuda(3),
            cuda(4),
            cuda(5),
        ]
    }

    /// The NCCL runtime loaded from the fakes.
    pub fn runtime(&self) -> Result<NcclRuntime, NcclError> {
        let (nccl, cuda) = fake_libs();
        NcclRuntime::load_with(&LibrarySearch {
            nccl_library: Some(nccl.clone()),
            cuda_driver_library: Some(cuda.clone()),
            ..LibrarySearch::default()
        })
    }
}

/// Takes the serial lock and resets the fakes (NCCL 2.27.3, one device).
pub fn fake() -> (MutexGuard<'static, ()>, Fake) {
    fake_with(22_703, 1)
}

/// Takes the serial lock and resets the fakes to NCCL `version` with
/// `devices` devices.
pub fn fake_with(version: i32, devices: i32) -> (MutexGuard<'static, ()>, Fake) {
    let guard = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let (nccl, cuda) = fake_libs();
    // SAFETY: loading our own fake libraries, whose initialisers do nothing.
    let f = unsafe {
        Fake {
            nccl: libloading::Library::new(nccl).expect("loading the fake NCCL"),
            cuda: libloading::Library::new(cuda).expect("loading the fake CUDA driver"),
        }
    };
    f.reset(version, devices);
    (guard, f)
}
