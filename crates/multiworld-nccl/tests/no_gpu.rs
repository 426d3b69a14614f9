//! Tests that run everywhere, GPU or not: the real `NcclRuntime::load()`
//! entry point (reading the process environment) reports a missing library
//! as `LibraryNotFound` with every path it tried, and never panics.
//!
//! `NCCL_LIBRARY` must be set for the *whole* process to test `load()` as
//! users call it, and changing the environment of a multi-threaded test
//! process is unsound, so the parent test re-runs this binary with the
//! variable set and runs one `#[ignore]`d child test in it.

use multiworld_nccl::{LibraryKind, NcclError, NcclRuntime};
use multiworld_testkit::process;

const MISSING: &str = "/nonexistent/libnccl.so.2";
const CHILD_OK: &str = "CHILD-CHECKS-PASSED";

/// Runs in the child process (see `nccl_library_pointing_nowhere_is_library_not_found`).
#[test]
#[ignore = "run by nccl_library_pointing_nowhere_is_library_not_found in a child process"]
fn child_load_with_missing_nccl_library() {
    assert_eq!(std::env::var("NCCL_LIBRARY").as_deref(), Ok(MISSING));
    match NcclRuntime::load() {
        Err(NcclError::LibraryNotFound { library, tried }) => {
            assert_eq!(library, LibraryKind::Nccl);
            assert_eq!(tried.len(), 1, "NCCL_LIBRARY is the only candidate: {tried:?}");
            assert!(tried[0].contains(MISSING), "{tried:?}");
            let e = NcclError::LibraryNotFound {
                library,
                tried: tried.clone(),
            };
            assert!(e.is_unavailable());
            assert!(!e.is_world_fatal());
            assert!(e.to_string().contains(MISSING), "{e}");
            println!("{CHILD_OK}: {e}");
        }
        other => panic!("expected LibraryNotFound for NCCL, got {other:?}"),
    }
}

#[test]
fn nccl_library_pointing_nowhere_is_library_not_found() {
    let out = process::run(
        process::self_test_command("child_load_with_missing_nccl_library").env("NCCL_LIBRARY", MISSING),
    );
    let (stdout, stderr) = (&out.stdout, &out.stderr);
    assert!(out.success(), "child failed:\n{stdout}\n{stderr}");
    assert!(
        stdout.contains(CHILD_OK),
        "child did not run its checks:\n{stdout}\n{stderr}"
    );
}

#[test]
fn load_from_the_environment_never_panics_and_explains_itself() {
    match NcclRuntime::load() {
        Ok(rt) => {
            // A machine with NCCL and a driver: the facts must be sane.
            assert!(rt.version() >= multiworld_nccl::NcclVersion::MINIMUM);
            assert!(!rt.nccl_library().is_empty());
            println!("NCCL {} from {}", rt.version(), rt.nccl_library());
            match rt.device_count() {
                Ok(n) => println!("{n} CUDA device(s)"),
                Err(e) => println!("device_count: {e}"),
            }
        }
        Err(e) => {
            assert!(e.is_unavailable(), "unexpected kind of error: {e:?}");
            if let NcclError::LibraryNotFound { library, tried } = &e {
                assert!(!tried.is_empty());
                let first = match library {
                    LibraryKind::Nccl if std::env::var_os("NCCL_LIBRARY").is_none() => "libnccl.so.2 ",
                    LibraryKind::Nccl => "",
                    LibraryKind::CudaDriver => "libcuda.so.1 ",
                };
                assert!(tried[0].starts_with(first), "{tried:?}");
            }
            println!("NCCL unavailable here, as expected without a GPU: {e}");
        }
    }
}
