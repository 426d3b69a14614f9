//! GPU tensors in many worlds (feature `nccl`): a leader joins two NCCL
//! worlds, runs a device all-reduce in each, and exchanges a device tensor
//! with a worker process that shares its GPU, host-staged over a TCP world
//! (two processes on one GPU cannot form an NCCL world). With `--abort
//! gpu-a`, world gpu-a is aborted while gpu-b has an all-reduce in flight:
//! only gpu-a goes, gpu-b's result is still exact.
//!
//! `cargo run -p multiworld-examples --features nccl --bin gpu_worlds -- --abort gpu-a`
//!
//! Needs NCCL and a CUDA device (found like `NcclRuntime::load`: the
//! `NCCL_LIBRARY` variable, the loader path, a pip `nvidia-nccl` wheel);
//! without them it says why and exits with status 2.

use std::time::Duration;

use multiworld::nccl::{DeviceContext, NcclRuntime};
use multiworld::{Backend, Rank, Tag, WorldConfig, WorldEvent, WorldManager};
use multiworld::{DType, ReduceOp};
use multiworld_examples::{arg, spawn_self};

const T: Duration = Duration::from_secs(60);
/// Elements of the host-staged tensor (4 MiB of f32).
const STAGED: usize = 1 << 20;

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn device() -> usize {
    arg("--device").and_then(|d| d.parse().ok()).unwrap_or(0)
}

/// The worker: rank 1 of the TCP world "staged", on the leader's GPU.
async fn worker(rt: NcclRuntime, store: &str) -> anyhow::Result<()> {
    let ctx = DeviceContext::open(&rt, device())?;
    let manager = WorldManager::default();
    let w = manager.join(WorldConfig::new("staged", 1, 2, store)?).await?;
    let mut buf = ctx.alloc(DType::F32, STAGED)?;
    w.recv_device(Rank(0), Tag(0), &mut buf).await?;
    let doubled: Vec<f32> = f32s(&buf.to_host_vec(T)?).iter().map(|x| x * 2.0).collect();
    let answer = ctx.upload(DType::F32, &f32_bytes(&doubled), T)?;
    w.send_device(Rank(0), Tag(1), &answer).await?;
    w.finish(T).await?;
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let rt = match NcclRuntime::load() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("gpu_worlds: NCCL is not available here: {e}");
            std::process::exit(2);
        }
    };
    if let Some(store) = arg("--store") {
        return worker(rt, &store).await;
    }
    let manager = WorldManager::default();
    manager.use_nccl_runtime(rt.clone());
    let store = manager.serve_store("127.0.0.1:0").await?.to_string();
    let mut worlds = Vec::new();
    for name in ["gpu-a", "gpu-b"] {
        let mut c = WorldConfig::new(name, 0, 1, &store)?;
        c.backend = Backend::Nccl;
        c.local_rank = device() as u32;
        worlds.push(manager.join(c).await?);
    }
    println!(
        "leader: NCCL {} ({}); joined gpu-a and gpu-b",
        rt.version(),
        rt.nccl_library()
    );
    let x: Vec<f32> = (0..4096).map(|i| i as f32).collect();
    for w in &worlds {
        let nccl = w.nccl()?;
        let mut buf = nccl.upload(DType::F32, &f32_bytes(&x))?;
        nccl.all_reduce(&mut buf, ReduceOp::Sum)?.wait().await?;
        anyhow::ensure!(f32s(&nccl.download(&buf)?) == x, "{}: wrong all_reduce", w.name());
        println!("leader: {}: device all_reduce correct", w.name());
    }

    // A worker process on the same GPU: device tensors over TCP.
    let _worker = spawn_self(&["--store", &store, "--device", &device().to_string()])?;
    let staged = manager.join(WorldConfig::new("staged", 0, 2, &store)?).await?;
    let ctx = DeviceContext::open(&rt, device())?;
    let y: Vec<f32> = (0..STAGED).map(|i| (i % 1000) as f32 * 0.5).collect();
    let src = ctx.upload(DType::F32, &f32_bytes(&y), T)?;
    let mut back = ctx.alloc(DType::F32, STAGED)?;
    let started = std::time::Instant::now();
    staged.send_device(Rank(1), Tag(0), &src).await?;
    staged.recv_device(Rank(1), Tag(1), &mut back).await?;
    let doubled: Vec<f32> = y.iter().map(|v| v * 2.0).collect();
    anyhow::ensure!(f32s(&back.to_host_vec(T)?) == doubled, "staged: wrong answer");
    println!(
        "leader: staged: 4 MiB device tensor to the worker and its double back, host-staged over TCP, in {:?}",
        started.elapsed()
    );
    staged.finish(T).await?;

    if arg("--abort").as_deref() == Some("gpu-a") {
        let mut events = manager.events();
        let b = worlds[1].nccl()?;
        let mut buf = b.upload(DType::F32, &f32_bytes(&x))?;
        let running = b.all_reduce(&mut buf, ReduceOp::Max)?;
        worlds[0].abort();
        loop {
            match tokio::time::timeout(T, events.recv()).await?? {
                WorldEvent::Removed { world, .. } if world == "gpu-a" => break,
                WorldEvent::Quarantined { world, reason, .. } => {
                    println!("leader: {world} quarantined: {reason}")
                }
                _ => {}
            }
        }
        match worlds[0].nccl() {
            Err(e) => println!("leader: gpu-a aborted and removed: {e}"),
            Ok(_) => anyhow::bail!("gpu-a still usable after its abort"),
        }
        running.wait().await?;
        anyhow::ensure!(
            f32s(&b.download(&buf)?) == x,
            "gpu-b: wrong all_reduce after the abort"
        );
        println!("leader: gpu-b: its all_reduce completed correctly; only gpu-a is gone");
    }
    for w in &worlds {
        if w.nccl().is_ok() {
            manager.leave(w.name()).await?;
        }
    }
    manager.shutdown().await;
    println!("leader: done");
    Ok(())
}
