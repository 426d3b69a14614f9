//! The single-world baseline: the same leader and two workers, but all three
//! in ONE world. Killing one worker breaks the whole group: the leader stops
//! receiving from the healthy worker too. Compare with `multi_world`.
//!
//! `cargo run -p multiworld-examples --bin single_world`

use std::{
    sync::{
        Arc,
        atomic::{AtomicU32, Ordering},
    },
    time::{Duration, Instant},
};

use multiworld::{DType, Rank, Tag, Tensor, WorldConfig, WorldError, WorldManager};
use multiworld_examples::{arg, spawn_self};

const MESSAGES: u32 = 50;

/// How long the leader waits for the workers' messages before it gives up
/// with an error instead of hanging (they take a fraction of a second).
const PATIENCE: Duration = Duration::from_secs(60);

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    if let (Some(rank), Some(store)) = (arg("--rank"), arg("--store")) {
        let rank: u32 = rank.parse()?;
        let manager = WorldManager::default();
        let w = manager.join(WorldConfig::new("all", rank, 3, &store)?).await?;
        for i in 0..MESSAGES {
            if let Err(WorldError::Broken { .. }) = w.send(Rank(0), Tag(0), &[i; 4][..]).await {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let _ = w.finish(Duration::from_secs(30)).await;
        return Ok(());
    }
    let manager = WorldManager::default();
    let store = manager.serve_store("127.0.0.1:0").await?.to_string();
    let mut one = spawn_self(&["--rank", "1", "--store", &store])?;
    let _two = spawn_self(&["--rank", "2", "--store", &store])?;
    let world = manager.join(WorldConfig::new("all", 0, 3, &store)?).await?;
    println!("leader: joined world 'all' with two workers (ranks 1 and 2)");
    let from_one = Arc::new(AtomicU32::new(0));
    let receive = |src: u32| {
        let (w, from_one) = (world.clone(), Arc::clone(&from_one));
        async move {
            let mut buf = Tensor::zeros(DType::U32, [4])?;
            let mut got = 0u32;
            while got < MESSAGES {
                match w.recv(Rank(src), Tag(0), &mut buf).await {
                    Ok(()) => {
                        got += 1;
                        if src == 1 {
                            from_one.store(got, Ordering::Relaxed);
                        }
                    }
                    Err(WorldError::Broken { .. }) => break,
                    Err(e) => return Err(e.into()),
                }
            }
            anyhow::Ok(got)
        }
    };
    let deadline = Instant::now() + PATIENCE;
    let (h1, h2) = (tokio::spawn(receive(1)), tokio::spawn(receive(2)));
    // Kill rank 1 part-way: once the leader has received a few of its
    // messages. The world may break first (a worker failed on its own): then
    // there is nothing to kill part-way, and no reason to wait.
    while from_one.load(Ordering::Relaxed) < 5 {
        let got = from_one.load(Ordering::Relaxed);
        anyhow::ensure!(
            !h1.is_finished(),
            "rank 1's stream ended after {got} messages, before its worker could be killed part-way"
        );
        anyhow::ensure!(
            Instant::now() < deadline,
            "rank 1 delivered only {got} messages in {PATIENCE:?}; giving up before killing it"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    println!("leader: killing the worker with rank 1");
    one.kill()?;
    let both = async { anyhow::Ok((h1.await??, h2.await??)) };
    let (g1, g2) = tokio::time::timeout_at(deadline.into(), both)
        .await
        .map_err(|_| {
            anyhow::anyhow!("the world neither broke nor delivered every message within {PATIENCE:?}")
        })??;
    println!("leader: rank 1 delivered {g1} messages, rank 2 (healthy) delivered {g2} of {MESSAGES}");
    anyhow::ensure!(
        g2 < MESSAGES,
        "in one world, one failure stops the healthy worker's stream too"
    );
    println!("leader: one failure broke the whole group; put each worker in its own world (see multi_world)");
    manager.shutdown().await;
    Ok(())
}
