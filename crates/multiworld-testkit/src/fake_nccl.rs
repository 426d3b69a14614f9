//! The fake CUDA driver and NCCL (`fake_cuda_nccl.c`) as a test harness:
//! compiles them with `cc` into `libcuda.so.1` and `libnccl.so.2` once per
//! test process, loads them, and calls their control functions. Shared by
//! this crate's `tests/simulated.rs` and the facade's NCCL-world tests.
//!
//! The fakes keep global state, so a test holds the lock [`fake`] returns
//! for its whole run.

// Test code: a failed unwrap is a failed test. The unsafe code resolves and
// calls the fake's control functions.
#![allow(clippy::unwrap_used, clippy::expect_used, unsafe_code, dead_code)]

use std::path::PathBuf;
use std::process::Command;
use std::sync::{Mutex, MutexGuard, OnceLock};

use multiworld_nccl::{LibrarySearch, NcclError, NcclRuntime};

static SERIAL: Mutex<()> = Mutex::new(());
static LIBS: OnceLock<(PathBuf, PathBuf)> = OnceLock::new();

/// Compiles the fakes once per process; returns (libnccl, libcuda) paths.
pub fn fake_libs() -> &'static (PathBuf, PathBuf) {
    LIBS.get_or_init(|| {
        let dir =
            PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("fake-nccl-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let src = dir.join("fake_cuda_nccl.c");
        std::fs::write(&src, include_str!("fake_cuda_nccl.c")).unwrap();
        let nccl = dir.join("libnccl.so.2");
        let cuda = dir.join("libcuda.so.1");
        for (define, out) in [("-DFAKE_NCCL", &nccl), ("-DFAKE_CUDA", &cuda)] {
            let status = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()))
                .args(["-shared", "-fPIC", "-O1", define, "-o"])
                .arg(out)
                .arg(&src)
                .status()
                .expect("a C compiler (cc) is needed to build the fake CUDA/NCCL libraries");
            assert!(status.success(), "compiling the fake {define} failed");
        }
        (nccl, cuda)
    })
}

/// Handles on the fake libraries' control functions.
pub struct Fake {
    nccl: libloading::Library,
    cuda: libloading::Library,
}

impl Fake {
    fn call0<R>(lib: &libloading::Library, name: &str) -> R {
        // SAFETY: every control function used through this helper takes no
        // argument and returns `R` as declared in fake_cuda_nccl.c.
        unsafe { lib.get::<unsafe extern "C" fn() -> R>(name.as_bytes()).unwrap()() }
    }

    pub fn reset(&self, version: i32, devices: i32) {
        // SAFETY: signatures as in fake_cuda_nccl.c.
        unsafe {
            self.nccl
                .get::<unsafe extern "C" fn(i32)>(b"fake_nccl_reset")
                .unwrap()(version);
            self.cuda
                .get::<unsafe extern "C" fn(i32)>(b"fake_cuda_reset")
                .unwrap()(devices);
        }
    }

    pub fn set(&self, init_hang: bool, ops_hang: bool, abort_hang: bool) {
        // SAFETY: signature as in fake_cuda_nccl.c.
        unsafe {
            self.nccl
                .get::<unsafe extern "C" fn(i32, i32, i32)>(b"fake_nccl_set")
                .unwrap()(init_hang as i32, ops_hang as i32, abort_hang as i32);
        }
    }

    pub fn no_pinned(&self, on: bool) {
        // SAFETY: signature as in fake_cuda_nccl.c.
        unsafe {
            self.cuda
                .get::<unsafe extern "C" fn(i32)>(b"fake_cuda_no_pinned")
                .unwrap()(on as i32)
        }
    }

    /// Slows every later collective enqueued on the most recently created
    /// communicator: the NCCL call sleeps `sleep_ms`, then the communicator
    /// reports `ncclInProgress` for `polls` queries (`i32::MAX`: until the
    /// caller gives up). `(0, 0)` turns it off.
    pub fn stall_last(&self, polls: i32, sleep_ms: i32) {
        // SAFETY: signature as in fake_cuda_nccl.c.
        unsafe {
            self.nccl
                .get::<unsafe extern "C" fn(i32, i32)>(b"fake_nccl_stall_last")
                .unwrap()(polls, sleep_ms)
        }
    }

    /// A broken NCCL: operations complete but move no data (to show that
    /// a check can fail).
    pub fn noop(&self, on: bool) {
        // SAFETY: signature as in fake_cuda_nccl.c.
        unsafe {
            self.nccl
                .get::<unsafe extern "C" fn(i32)>(b"fake_nccl_noop")
                .unwrap()(on as i32)
        }
    }

    pub fn fail_last(&self, code: i32) {
        // SAFETY: signature as in fake_cuda_nccl.c.
        unsafe {
            self.nccl
                .get::<unsafe extern "C" fn(i32)>(b"fake_nccl_fail_last")
                .unwrap()(code)
        }
    }

    /// Live (comms, allocations, streams, events, context refs, pools, pinned
    /// host buffers).
    pub fn live(&self) -> [i64; 7] {
        let cuda = |what: i32| {
            // SAFETY: signature as in fake_cuda_nccl.c.
            unsafe {
                self.cuda
                    .get::<unsafe extern "C" fn(i32) -> i64>(b"fake_cuda_live")
                    .unwrap()(what)
            }
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

pub fn fake_with(version: i32, devices: i32) -> (MutexGuard<'static, ()>, Fake) {
    let guard = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let (nccl, cuda) = fake_libs();
    // SAFETY: loading our own fake libraries, whose initialisers do nothing.
    let f = unsafe {
        Fake {
            nccl: libloading::Library::new(nccl).unwrap(),
            cuda: libloading::Library::new(cuda).unwrap(),
        }
    };
    f.reset(version, devices);
    (guard, f)
}
