//! Multi-world send/recv: a leader receives from two workers, each in its own
//! world. With `--kill w1`, the first worker is killed part-way: world w1
//! breaks and only w1; the leader keeps receiving everything from w2.
//!
//! `cargo run -p multiworld-examples --bin multi_world -- --kill w1`

use std::{
    sync::{
        Arc,
        atomic::{AtomicU32, Ordering},
    },
    time::{Duration, Instant},
};

use multiworld::{DType, Rank, Tag, Tensor, WorldConfig, WorldError, WorldManager};
use multiworld_examples::{Process, arg, spawn_self};
use tokio::task::JoinHandle;

const MESSAGES: u32 = 50;

/// How long the leader waits for the workers' messages before it gives up
/// with an error instead of hanging (they take a fraction of a second).
const PATIENCE: Duration = Duration::from_secs(60);

/// A world's outcome at the leader: messages received, and whether the world
/// completed (rather than broke).
type Outcome = anyhow::Result<(u32, bool)>;

/// Waits for a receiving task until `deadline`.
async fn outcome(name: &str, task: JoinHandle<Outcome>, deadline: Instant) -> Outcome {
    match tokio::time::timeout_at(deadline.into(), task).await {
        Ok(joined) => joined?,
        Err(_) => {
            anyhow::bail!("{name} neither delivered its {MESSAGES} messages nor broke within {PATIENCE:?}")
        }
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    if let (Some(world), Some(store)) = (arg("--worker"), arg("--store")) {
        // A worker: send MESSAGES small tensors to the leader, a few ms apart.
        let manager = WorldManager::default();
        let w = manager.join(WorldConfig::new(&world, 1, 2, &store)?).await?;
        for i in 0..MESSAGES {
            w.send(Rank(0), Tag(0), &[i; 4][..]).await?;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        w.finish(Duration::from_secs(30)).await?;
        return Ok(());
    }
    let kill = arg("--kill");
    let manager = WorldManager::default();
    let store = manager.serve_store("127.0.0.1:0").await?.to_string();
    let mut workers: Vec<(String, Process)> = Vec::new();
    let mut worlds = Vec::new();
    for name in ["w1", "w2"] {
        workers.push((
            name.to_string(),
            spawn_self(&["--worker", name, "--store", &store])?,
        ));
        worlds.push(manager.join(WorldConfig::new(name, 0, 2, &store)?).await?);
    }
    println!("leader: joined w1 and w2");
    let progress: Vec<Arc<AtomicU32>> = (0..2).map(|_| Arc::new(AtomicU32::new(0))).collect();
    let receive = |w: multiworld::World, progress: Arc<AtomicU32>| async move {
        let mut buf = Tensor::zeros(DType::U32, [4])?;
        let mut got = 0u32;
        for i in 0..MESSAGES {
            match w.recv(Rank(1), Tag(0), &mut buf).await {
                Ok(()) => {
                    anyhow::ensure!(buf.as_slice::<u32>()? == [i; 4], "wrong data on {}", w.name());
                    got += 1;
                    progress.store(got, Ordering::Relaxed);
                }
                Err(e @ WorldError::Broken { .. }) => {
                    println!("leader: {} broke after {got} messages: {e}", w.name());
                    return Ok((got, false));
                }
                Err(e) => return Err(e.into()),
            }
        }
        w.finish(Duration::from_secs(30)).await?;
        Ok((got, true))
    };
    let deadline = Instant::now() + PATIENCE;
    let h1 = tokio::spawn(receive(worlds[0].clone(), Arc::clone(&progress[0])));
    let h2 = tokio::spawn(receive(worlds[1].clone(), Arc::clone(&progress[1])));
    if let Some(victim) = &kill {
        let i = workers
            .iter()
            .position(|(n, _)| n == victim)
            .ok_or_else(|| anyhow::anyhow!("no world {victim}"))?;
        // Kill it part-way: once the leader has received a few of its
        // messages. Its world may end first (its worker failed on its own):
        // then there is nothing to kill part-way, and no reason to wait.
        let task = if i == 0 { &h1 } else { &h2 };
        while progress[i].load(Ordering::Relaxed) < 5 {
            let got = progress[i].load(Ordering::Relaxed);
            anyhow::ensure!(
                !task.is_finished(),
                "{victim} ended after {got} messages, before its worker could be killed part-way"
            );
            anyhow::ensure!(
                Instant::now() < deadline,
                "{victim} delivered only {got} messages in {PATIENCE:?}; giving up before killing its worker"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let p = &mut workers[i].1;
        println!("leader: killing the worker of {victim}");
        p.kill()?;
    }
    let (r1, r2) = (
        outcome("w1", h1, deadline).await?,
        outcome("w2", h2, deadline).await?,
    );
    println!(
        "leader: w1 delivered {} messages, w2 delivered {} messages",
        r1.0, r2.0
    );
    if kill.is_some() {
        anyhow::ensure!(r2 == (MESSAGES, true), "w2 must be untouched by w1's failure");
        println!("leader: w1's failure did not touch w2");
    } else {
        anyhow::ensure!(
            r1 == (MESSAGES, true) && r2 == (MESSAGES, true),
            "both worlds complete"
        );
    }
    manager.shutdown().await;
    Ok(())
}
