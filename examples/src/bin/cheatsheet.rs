//! The collective cheatsheet: every collective of one world, with each rank
//! printing its tensor before and after, and checking the "after" exactly
//! (the program fails on any wrong value).
//!
//! `cargo run -p multiworld-examples --bin cheatsheet -- --nproc 4`, or
//! `m8d launch --nproc 4 -- target/debug/cheatsheet`.

use std::time::Duration;

use multiworld::{Rank, ReduceOp, Tensor, WorldManager};

fn t(v: Vec<f32>) -> anyhow::Result<Tensor> {
    let n = v.len();
    Ok(Tensor::from_vec(v, [n])?)
}

fn show(x: &Tensor) -> String {
    format!("{:?}", x.as_slice::<f32>().unwrap_or(&[]))
}

struct Sheet {
    rank: u32,
    failures: usize,
}

impl Sheet {
    fn line(&mut self, name: &str, before: &str, after: &Tensor, want: Option<Vec<f32>>) {
        let ok = want
            .as_deref()
            .is_none_or(|w| after.as_slice::<f32>().is_ok_and(|a| a == w));
        println!(
            "{name:<22} rank {}: before {before:<26} after {}{}",
            self.rank,
            show(after),
            if ok { "" } else { "   <-- WRONG" }
        );
        if !ok {
            self.failures += 1;
        }
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let config = multiworld_examples::spawn_or_join("cheatsheet", multiworld_examples::nproc_arg(4)).await?;
    let (r, n) = (config.rank.0, config.size);
    let manager = WorldManager::default();
    let world = manager.join(config).await?;
    let g = world.collectives();
    let rf = r as f32;
    let nf = n as f32;
    let sum_1_to_n = nf * (nf + 1.0) / 2.0;
    let mut sheet = Sheet { rank: r, failures: 0 };

    // BROADCAST: rank 0's [42, 43, 44] is copied to everyone.
    let mut x = t(if r == 0 {
        vec![42.0, 43.0, 44.0]
    } else {
        vec![0.0; 3]
    })?;
    let before = show(&x);
    g.broadcast(&mut x, Rank(0)).await?;
    sheet.line("BROADCAST (src=0)", &before, &x, Some(vec![42.0, 43.0, 44.0]));

    // SCATTER: rank 0 hands chunk [10r, 10r + 1] to rank r.
    let chunks: Vec<Tensor> = (0..n)
        .map(|j| t(vec![10.0 * j as f32, 10.0 * j as f32 + 1.0]))
        .collect::<Result<_, _>>()?;
    let mut x = t(vec![0.0; 2])?;
    let before = show(&x);
    g.scatter(&mut x, (r == 0).then_some(&chunks[..]), Rank(0))
        .await?;
    sheet.line(
        "SCATTER (src=0)",
        &before,
        &x,
        Some(vec![10.0 * rf, 10.0 * rf + 1.0]),
    );

    // GATHER: rank 0 collects everyone's [r + 1].
    let x = t(vec![rf + 1.0])?;
    let mut outs: Vec<Tensor> = (0..n).map(|_| t(vec![0.0])).collect::<Result<_, _>>()?;
    g.gather(&x, (r == 0).then_some(&mut outs[..]), Rank(0)).await?;
    let gathered = t(outs
        .iter()
        .flat_map(|o| o.as_slice::<f32>().unwrap_or(&[]).to_vec())
        .collect())?;
    let want = (r == 0).then(|| (1..=n).map(|v| v as f32).collect());
    sheet.line(
        "GATHER (dst=0)",
        &show(&x),
        &gathered,
        if r == 0 { want } else { Some(vec![0.0; n as usize]) },
    );

    // ALL_GATHER: everyone gets [1, 2, ..., n].
    let x = t(vec![rf + 1.0])?;
    let mut all = t(vec![0.0; n as usize])?;
    g.all_gather_into_tensor(&mut all, &x).await?;
    sheet.line(
        "ALL_GATHER",
        &show(&x),
        &all,
        Some((1..=n).map(|v| v as f32).collect()),
    );

    // REDUCE (sum): rank 0 gets 1 + 2 + ... + n; the others keep their input.
    let mut x = t(vec![rf + 1.0])?;
    let before = show(&x);
    g.reduce(&mut x, Rank(0), ReduceOp::Sum).await?;
    sheet.line(
        "REDUCE SUM (dst=0)",
        &before,
        &x,
        (r == 0).then(|| vec![sum_1_to_n]),
    );

    // ALL_REDUCE (sum): everyone gets [sum, 2 * sum].
    let mut x = t(vec![rf + 1.0, 2.0 * (rf + 1.0)])?;
    let before = show(&x);
    g.all_reduce(&mut x, ReduceOp::Sum).await?;
    sheet.line(
        "ALL_REDUCE SUM",
        &before,
        &x,
        Some(vec![sum_1_to_n, 2.0 * sum_1_to_n]),
    );

    // ALL_REDUCE (max): everyone gets n.
    let mut x = t(vec![rf + 1.0])?;
    let before = show(&x);
    g.all_reduce(&mut x, ReduceOp::Max).await?;
    sheet.line("ALL_REDUCE MAX", &before, &x, Some(vec![nf]));

    // REDUCE_SCATTER (sum): input j of rank r is (r + 1)(j + 1); rank r gets
    // the sum over ranks of their input r.
    let inputs: Vec<Tensor> = (0..n)
        .map(|j| t(vec![(rf + 1.0) * (j as f32 + 1.0)]))
        .collect::<Result<_, _>>()?;
    let mut x = t(vec![0.0])?;
    g.reduce_scatter(&mut x, &inputs, ReduceOp::Sum).await?;
    let before = format!(
        "{:?}",
        inputs
            .iter()
            .map(|i| i.as_slice::<f32>().map(|s| s[0]).unwrap_or(0.0))
            .collect::<Vec<_>>()
    );
    sheet.line(
        "REDUCE_SCATTER SUM",
        &before,
        &x,
        Some(vec![sum_1_to_n * (rf + 1.0)]),
    );

    // ALL_TO_ALL: rank r sends [10r + j] to rank j, so it receives [10j + r].
    let inputs: Vec<Tensor> = (0..n)
        .map(|j| t(vec![10.0 * rf + j as f32]))
        .collect::<Result<_, _>>()?;
    let mut outs: Vec<Tensor> = (0..n).map(|_| t(vec![0.0])).collect::<Result<_, _>>()?;
    g.all_to_all(&mut outs, &inputs).await?;
    let before = format!(
        "{:?}",
        inputs
            .iter()
            .map(|i| i.as_slice::<f32>().map(|s| s[0]).unwrap_or(0.0))
            .collect::<Vec<_>>()
    );
    let after = t(outs
        .iter()
        .flat_map(|o| o.as_slice::<f32>().unwrap_or(&[]).to_vec())
        .collect())?;
    sheet.line(
        "ALL_TO_ALL",
        &before,
        &after,
        Some((0..n).map(|j| 10.0 * j as f32 + rf).collect()),
    );

    // BARRIER: nobody passes until everyone arrived.
    g.barrier().await?;
    println!("{:<22} rank {r}: passed", "BARRIER");

    world.finish(Duration::from_secs(30)).await?;
    anyhow::ensure!(sheet.failures == 0, "{} wrong results", sheet.failures);
    Ok(())
}
