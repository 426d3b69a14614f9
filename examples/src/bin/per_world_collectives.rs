//! Per-world collectives: a leader is rank 0 of two worlds, A and B, each with
//! two worker processes, and runs broadcast, reduce, all_reduce, all_gather,
//! gather and scatter in both worlds at the same time; every member checks
//! every result. With `--kill B2`, one worker of world B is killed before the
//! collectives: B's collectives fail on its survivors (never a partial
//! result), while A's all complete.
//!
//! `cargo run -p multiworld-examples --bin per_world_collectives -- --kill B2`

use std::time::Duration;

use multiworld::{CommError, Rank, ReduceOp, Tensor, World, WorldConfig, WorldManager};
use multiworld_examples::{arg, spawn_self};

fn t(v: Vec<f32>) -> anyhow::Result<Tensor> {
    let n = v.len();
    Ok(Tensor::from_vec(v, [n])?)
}

fn vals(x: &Tensor) -> Vec<f32> {
    x.as_slice::<f32>().map(<[f32]>::to_vec).unwrap_or_default()
}

/// What went wrong in a world's collectives.
#[derive(Debug)]
enum Failure {
    /// A collective failed (a member was lost, the world broke).
    Failed(CommError),
    /// A collective returned a wrong value (must never happen).
    Wrong(&'static str),
}

/// The same sequence of collectives on every member of one world; returns
/// how many completed with the right result.
async fn collectives(world: &World) -> Result<usize, Failure> {
    let g = world.collectives();
    let (r, n) = (world.rank().0, world.size());
    let (rf, nf) = (r as f32, n as f32);
    let sum = nf * (nf + 1.0) / 2.0;
    let tensor = |v: Vec<f32>| t(v).map_err(|_| Failure::Wrong("tensor"));
    let mut done = 0;

    let mut x = tensor(if r == 0 { vec![5.0, 6.0] } else { vec![0.0; 2] })?;
    g.broadcast(&mut x, Rank(0)).await.map_err(Failure::Failed)?;
    if vals(&x) != [5.0, 6.0] {
        return Err(Failure::Wrong("broadcast"));
    }
    done += 1;

    let mut x = tensor(vec![rf + 1.0])?;
    g.reduce(&mut x, Rank(0), ReduceOp::Sum)
        .await
        .map_err(Failure::Failed)?;
    if r == 0 && vals(&x) != [sum] {
        return Err(Failure::Wrong("reduce"));
    }
    done += 1;

    let mut x = tensor(vec![rf + 1.0])?;
    g.all_reduce(&mut x, ReduceOp::Sum)
        .await
        .map_err(Failure::Failed)?;
    if vals(&x) != [sum] {
        return Err(Failure::Wrong("all_reduce"));
    }
    done += 1;

    let mut all = tensor(vec![0.0; n as usize])?;
    g.all_gather_into_tensor(&mut all, &tensor(vec![rf])?)
        .await
        .map_err(Failure::Failed)?;
    if vals(&all) != (0..n).map(|v| v as f32).collect::<Vec<_>>() {
        return Err(Failure::Wrong("all_gather"));
    }
    done += 1;

    let mut outs: Vec<Tensor> = (0..n).map(|_| tensor(vec![0.0])).collect::<Result<_, _>>()?;
    g.gather(
        &tensor(vec![rf * 2.0])?,
        (r == 0).then_some(&mut outs[..]),
        Rank(0),
    )
    .await
    .map_err(Failure::Failed)?;
    let gathered: Vec<f32> = outs.iter().flat_map(vals).collect();
    if r == 0 && gathered != (0..n).map(|v| v as f32 * 2.0).collect::<Vec<_>>() {
        return Err(Failure::Wrong("gather"));
    }
    done += 1;

    let chunks: Vec<Tensor> = (0..n)
        .map(|j| tensor(vec![j as f32 + 0.5]))
        .collect::<Result<_, _>>()?;
    let mut x = tensor(vec![0.0])?;
    g.scatter(&mut x, (r == 0).then_some(&chunks[..]), Rank(0))
        .await
        .map_err(Failure::Failed)?;
    if vals(&x) != [rf + 0.5] {
        return Err(Failure::Wrong("scatter"));
    }
    done += 1;
    Ok(done)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    if let (Some(world), Some(rank), Some(store)) = (arg("--world"), arg("--rank"), arg("--store")) {
        let manager = WorldManager::default();
        let w = manager
            .join(WorldConfig::new(&world, rank.parse::<u32>()?, 3, &store)?)
            .await?;
        match collectives(&w).await {
            Ok(_) => w.finish(Duration::from_secs(30)).await?,
            // A lost member fails the collective: that is the expected end.
            Err(Failure::Failed(_)) => {}
            Err(Failure::Wrong(what)) => anyhow::bail!("{what}: a wrong result"),
        }
        return Ok(());
    }
    let kill = arg("--kill");
    let manager = WorldManager::default();
    let store = manager.serve_store("127.0.0.1:0").await?.to_string();
    let mut workers = Vec::new();
    for world in ["A", "B"] {
        for rank in ["1", "2"] {
            let name = format!("{world}{rank}");
            workers.push((
                name,
                spawn_self(&["--world", world, "--rank", rank, "--store", &store])?,
            ));
        }
    }
    let (a, b) = tokio::join!(
        manager.join(WorldConfig::new("A", 0, 3, &store)?),
        manager.join(WorldConfig::new("B", 0, 3, &store)?)
    );
    let (a, b) = (a?, b?);
    println!("leader: rank 0 of worlds A and B (three members each)");
    if let Some(victim) = &kill {
        let (_, p) = workers
            .iter_mut()
            .find(|(n, _)| n == victim)
            .ok_or_else(|| anyhow::anyhow!("no worker {victim}; use A1, A2, B1 or B2"))?;
        p.kill()?;
        println!("leader: killed worker {victim}");
    }
    let (ra, rb) = tokio::join!(collectives(&a), collectives(&b));
    for (name, r) in [("A", &ra), ("B", &rb)] {
        match r {
            Ok(n) => println!("leader: world {name}: all {n} collectives completed with the right results"),
            Err(Failure::Failed(e)) => println!("leader: world {name}: collectives failed: {e}"),
            Err(Failure::Wrong(what)) => anyhow::bail!("world {name}: {what} returned a wrong result"),
        }
    }
    match &kill {
        None => anyhow::ensure!(ra.is_ok() && rb.is_ok(), "both worlds must complete"),
        Some(v) => {
            let (hit, other) = if v.starts_with('A') {
                (&ra, &rb)
            } else {
                (&rb, &ra)
            };
            anyhow::ensure!(other.is_ok(), "the other world must be untouched");
            anyhow::ensure!(
                matches!(hit, Err(Failure::Failed(_))),
                "the killed worker's world must fail, not return results"
            );
            println!("leader: only the world that lost a member failed");
        }
    }
    // End the worlds whose collectives completed together with their workers.
    for (w, r) in [(&a, &ra), (&b, &rb)] {
        if r.is_ok() {
            w.finish(Duration::from_secs(30)).await?;
        }
    }
    manager.shutdown().await;
    Ok(())
}
