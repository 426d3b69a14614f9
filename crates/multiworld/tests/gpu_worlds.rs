//! NCCL worlds on a real GPU, driven by the world manager. Each test loads
//! the NCCL runtime and looks for a device first; where there is none it
//! prints `skipped: <reason>` and returns (set `MULTIWORLD_NCCL_REQUIRE_GPU=1`
//! to make that a failure). One GPU is enough: the NCCL worlds have one
//! member, and the host-staged test runs two processes on the same device.
//!
//! On a world of one every reduction's result is the input itself, so an
//! in-place "result == input" check passes even if nothing ran. Results are
//! therefore written out of place into buffers filled with [`POISON`] first
//! and compared byte for byte: an operation that writes nothing, the wrong
//! buffer or too little fails. Whether values from different ranks are
//! combined correctly needs 2+ GPUs and is not tested here.
//!
//! The same logic runs against the fake CUDA driver and NCCL of the test
//! kit (`crates/multiworld-testkit/fake`) when `NCCL_LIBRARY` and `CUDA_DRIVER_LIBRARY` point at
//! them (see `crates/multiworld-nccl/tests/fake/run-gpu-tests-on-fakes.sh`).
//!
//! `MULTIWORLD_NCCL_REQUIRE_GPU=1 cargo test -p multiworld --features nccl --test gpu_worlds -- --nocapture --test-threads=1`
#![cfg(feature = "nccl")]
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::time::{Duration, Instant};

use multiworld::nccl::{CudaDriver, DeviceBuffer, DeviceContext, NcclRuntime};
use multiworld::{
    Backend, BreakCause, DeviceOp, NcclWorld, Rank, Tag, WorldConfig, WorldError, WorldEvent, WorldManager,
    WorldState,
};
use multiworld::{DType, ReduceOp};
use multiworld_testkit::process::{Guard, self_test_command};

const T: Duration = Duration::from_secs(60);

/// The runtime, or `None` after printing why the test is skipped.
fn gpu(test: &str) -> Option<NcclRuntime> {
    let require = std::env::var_os("MULTIWORLD_NCCL_REQUIRE_GPU").is_some_and(|v| v == "1");
    let reason = match NcclRuntime::load() {
        Err(e) => e.to_string(),
        Ok(rt) => match rt.device_count() {
            Ok(0) => "the CUDA driver reports no device".to_owned(),
            Err(e) => e.to_string(),
            Ok(n) => {
                println!(
                    "{test}: NCCL {} ({}), {n} device(s)",
                    rt.version(),
                    rt.nccl_library()
                );
                return Some(rt);
            }
        },
    };
    assert!(!require, "{test}: MULTIWORLD_NCCL_REQUIRE_GPU=1 but: {reason}");
    println!("skipped: {test}: {reason}");
    None
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

/// The byte result buffers hold before an operation writes them; no input
/// here contains it.
const POISON: u8 = 0xA5;

/// Distinct, fractional f32 values of both signs (exact in f32).
fn ramp(n: usize, k: f32) -> Vec<f32> {
    (0..n).map(|i| (i % 4093) as f32 * k - 517.25).collect()
}

/// A `len`-element f32 buffer of `nccl`'s world full of [`POISON`] (checked).
fn poisoned(nccl: &NcclWorld, len: usize) -> DeviceBuffer {
    let b = nccl.upload(DType::F32, &vec![POISON; len * 4]).unwrap();
    assert!(nccl.download(&b).unwrap().iter().all(|x| *x == POISON));
    b
}

/// Runs `op` into a fresh poisoned buffer, waits, and returns its bytes.
async fn into_poisoned(
    nccl: &NcclWorld,
    len: usize,
    op: impl FnOnce(&mut DeviceBuffer) -> Result<DeviceOp, WorldError>,
) -> Vec<u8> {
    let mut out = poisoned(nccl, len);
    op(&mut out).unwrap().wait().await.unwrap();
    nccl.download(&out).unwrap()
}

fn nccl_cfg(name: &str, store: &str) -> WorldConfig {
    let mut c = WorldConfig::new(name, 0, 1, store).unwrap();
    c.backend = Backend::Nccl;
    c.join_timeout = T;
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nccl_worlds_in_one_process_and_aborting_one_leaves_the_other_running() {
    let Some(rt) = gpu("two_nccl_worlds_in_one_process") else {
        return;
    };
    let m = WorldManager::default();
    m.use_nccl_runtime(rt);
    let store = m.serve_store("127.0.0.1:0").await.unwrap().to_string();
    let started = Instant::now();
    let (a, b) = tokio::join!(
        m.join(nccl_cfg("gpu-a", &store)),
        m.join(nccl_cfg("gpu-b", &store))
    );
    let (a, b) = (a.unwrap(), b.unwrap());
    println!("two NCCL worlds joined in {:?}", started.elapsed());
    let mut events = m.events();

    let n = 16 << 20; // 64 MiB of f32
    let x = f32_bytes(&ramp(n, 0.5));
    for w in [&a, &b] {
        let nccl = w.nccl().unwrap();
        let send = nccl.upload(DType::F32, &x).unwrap();
        let mut out = poisoned(&nccl, n);
        let t = Instant::now();
        nccl.all_reduce_into(&send, &mut out, ReduceOp::Sum)
            .unwrap()
            .wait()
            .await
            .unwrap();
        println!("{}: 64 MiB all_reduce in {:?}", w.name(), t.elapsed());
        assert!(nccl.download(&out).unwrap() == x, "{}: wrong result", w.name());
    }

    // b keeps working on the device while a is aborted.
    let nb = b.nccl().unwrap();
    let sb = nb.upload(DType::F32, &x).unwrap();
    let mut bb = poisoned(&nb, n);
    let running = nb.all_reduce_into(&sb, &mut bb, ReduceOp::Max).unwrap();
    let t = Instant::now();
    a.abort();
    loop {
        match tokio::time::timeout(T, events.recv()).await.unwrap().unwrap() {
            WorldEvent::Removed { world, .. } if world == "gpu-a" => break,
            WorldEvent::Broken { world, cause, .. } if world == "gpu-a" => {
                assert_eq!(cause, BreakCause::Aborted)
            }
            WorldEvent::Quarantined { world, .. } => panic!("{world} quarantined"),
            _ => {}
        }
    }
    println!("gpu-a aborted and removed in {:?}", t.elapsed());
    running.wait().await.unwrap();
    assert!(nb.download(&bb).unwrap() == x, "gpu-b: wrong result");
    assert_eq!(b.state(), WorldState::Ready);
    nb.barrier().unwrap().wait().await.unwrap();
    m.leave("gpu-b").await.unwrap();
    m.shutdown().await;
}

/// Every device operation of an NCCL world writes its result: out of place
/// into poisoned buffers, for every reduce op (world of one: each result is
/// the input; cross-rank results need 2+ GPUs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_device_operation_writes_its_result() {
    let Some(rt) = gpu("every_device_operation_writes_its_result") else {
        return;
    };
    let m = WorldManager::default();
    m.use_nccl_runtime(rt);
    let store = m.serve_store("127.0.0.1:0").await.unwrap().to_string();
    let w = m.join(nccl_cfg("gpu-ops", &store)).await.unwrap();
    let nccl = w.nccl().unwrap();
    let n = 4099; // odd and over 4096: a wrong count leaves a poisoned tail
    let want = f32_bytes(&ramp(n, 0.75));
    let send = nccl.upload(DType::F32, &want).unwrap();
    for op in [
        ReduceOp::Sum,
        ReduceOp::Product,
        ReduceOp::Max,
        ReduceOp::Min,
        ReduceOp::Avg,
    ] {
        let got = into_poisoned(&nccl, n, |o| nccl.all_reduce_into(&send, o, op)).await;
        assert!(got == want, "all_reduce_into {op}: wrong result");
        let got = into_poisoned(&nccl, n, |o| nccl.reduce_into(&send, o, op, Rank(0))).await;
        assert!(got == want, "reduce_into {op}: wrong result");
    }
    let got = into_poisoned(&nccl, n, |o| nccl.broadcast_into(Some(&send), o, Rank(0))).await;
    assert!(got == want, "broadcast_into: wrong result");
    let got = into_poisoned(&nccl, n, |o| nccl.all_gather(&send, o)).await;
    assert!(got == want, "all_gather: wrong result");
    let got = into_poisoned(&nccl, n, |o| nccl.reduce_scatter(&send, o, ReduceOp::Sum)).await;
    assert!(got == want, "reduce_scatter: wrong result");
    let got = into_poisoned(&nccl, n, |o| nccl.all_to_all(&send, o)).await;
    assert!(got == want, "all_to_all: wrong result");
    let got = into_poisoned(&nccl, n, |o| nccl.gather(&send, Some(o), Rank(0))).await;
    assert!(got == want, "gather: wrong result");
    let got = into_poisoned(&nccl, n, |o| nccl.scatter(Some(&send), o, Rank(0))).await;
    assert!(got == want, "scatter: wrong result");
    assert!(nccl.download(&send).unwrap() == want, "the input changed");
    // Host tensors keep dtype, shape and values through the device.
    let t = multiworld::Tensor::from_vec((0..12i64).map(|i| i * 1001 - 5000).collect::<Vec<_>>(), [3, 4])
        .unwrap();
    let d = nccl.upload_tensor(&t).unwrap();
    let mut out = nccl
        .upload_tensor(&multiworld::Tensor::from_vec(vec![-1i64; 12], [3, 4]).unwrap())
        .unwrap();
    nccl.all_reduce_into(&d, &mut out, ReduceOp::Sum)
        .unwrap()
        .wait()
        .await
        .unwrap();
    let back = nccl.download_tensor(&out).unwrap();
    assert_eq!(back.shape(), &[3, 4]);
    assert_eq!(back.as_slice::<i64>().unwrap(), t.as_slice::<i64>().unwrap());
    nccl.barrier().unwrap().wait().await.unwrap();
    assert_eq!(w.state(), WorldState::Ready);
    m.leave("gpu-ops").await.unwrap();
    m.shutdown().await;
}

/// Round trips of the host-staged test (the first pays for the host
/// memory the later ones reuse).
const STAGED_ROUNDS: usize = 4;

/// What the child answers in round `r` of the host-staged test.
fn answer(n: usize, r: usize) -> Vec<f32> {
    ramp(n, -1.0 - r as f32)
}

/// The child's half of the host-staged test: rank 1 of a TCP world whose
/// store address is in `MW_GPU_STORE`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run by host_staged_transfer_between_two_processes_on_one_gpu"]
async fn child_host_staged_rank_1() {
    let store = std::env::var("MW_GPU_STORE").unwrap();
    let n: usize = std::env::var("MW_GPU_N").unwrap().parse().unwrap();
    // Host-staged transfers need only the CUDA driver, not NCCL.
    let driver = CudaDriver::load().unwrap();
    let ctx = DeviceContext::open(&driver, 0).unwrap();
    let poison = vec![POISON; n * 4];
    let mut buf = ctx.upload(DType::F32, &poison, T).unwrap();
    // The answers, uploaded before joining: the leader's clock starts after
    // the join.
    let answers: Vec<_> = (0..STAGED_ROUNDS)
        .map(|r| ctx.upload(DType::F32, &f32_bytes(&answer(n, r)), T).unwrap())
        .collect();
    let m = WorldManager::default();
    let w = m
        .join(WorldConfig::new("staged", 1, 2, &store).unwrap())
        .await
        .unwrap();
    for (r, reply) in answers.iter().enumerate() {
        // Poisoned, so the check holds only if the receive wrote every byte.
        buf.copy_from_host(&poison, T).unwrap();
        w.recv_device(Rank(0), Tag(1), &mut buf).await.unwrap();
        // Answers with other data: the leader's receive reuses host memory
        // that held what it sent, so an echo of the same bytes would pass
        // even if that receive wrote nothing.
        w.send_device(Rank(0), Tag(2), reply).await.unwrap();
        // Checked once the answer is out, off the leader's clock.
        assert!(
            buf.to_host_vec(T).unwrap() == f32_bytes(&ramp(n, 0.5 + r as f32)),
            "round {r}: received data differs"
        );
    }
    w.finish(T).await.unwrap();
    m.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_staged_transfer_between_two_processes_on_one_gpu() {
    let Some(rt) = gpu("host_staged_transfer_between_two_processes_on_one_gpu") else {
        return;
    };
    let n = 16 << 20; // 64 MiB of f32
    let m = WorldManager::default();
    let store = m.serve_store("127.0.0.1:0").await.unwrap().to_string();
    // Killed with its process group if the test fails before it exits.
    let mut child = Guard::spawn(
        self_test_command("child_host_staged_rank_1")
            .env("MW_GPU_STORE", &store)
            .env("MW_GPU_N", n.to_string()),
    );
    let ctx = DeviceContext::open(&rt, 0).unwrap();
    let w = m
        .join(WorldConfig::new("staged", 0, 2, &store).unwrap())
        .await
        .unwrap();
    let poison = vec![POISON; n * 4];
    let mut back = ctx.upload(DType::F32, &poison, T).unwrap();
    let mut took = Vec::new();
    for round in 0..STAGED_ROUNDS {
        let src = ctx
            .upload(DType::F32, &f32_bytes(&ramp(n, 0.5 + round as f32)), T)
            .unwrap();
        back.copy_from_host(&poison, T).unwrap();
        let t = Instant::now();
        w.send_device(Rank(1), Tag(1), &src).await.unwrap();
        w.recv_device(Rank(1), Tag(2), &mut back).await.unwrap();
        took.push(t.elapsed());
        assert!(
            back.to_host_vec(T).unwrap() == f32_bytes(&answer(n, round)),
            "the answer differs in round {round}"
        );
    }
    let gbs = |d: &Duration| 2.0 * (n * 4) as f64 / d.as_secs_f64() / 1e9;
    let best = took.iter().min().unwrap();
    println!(
        "64 MiB device -> TCP -> device and an answer back between two processes, {STAGED_ROUNDS} rounds: first {:?} \
         ({:.2} GB/s counting both ways), best {best:?} ({:.2} GB/s)",
        took[0],
        gbs(&took[0]),
        gbs(best)
    );
    w.finish(T).await.unwrap();
    let deadline = Instant::now() + T;
    let status = loop {
        if let Some(status) = child.try_wait() {
            break status;
        }
        assert!(Instant::now() < deadline, "the child did not exit");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(status.success(), "child failed: {status}");
    m.shutdown().await;
}
