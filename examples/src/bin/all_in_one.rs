//! Every operation of one world in one run, each logged and checked:
//! broadcast (tensor and object), all_reduce, reduce, all_gather (list, into
//! one tensor, objects), gather (tensor and objects), scatter (tensor and
//! objects), reduce_scatter (list and tensor), all_to_all (list, and one
//! tensor with uneven splits), barrier, an async all_reduce handle,
//! point-to-point isend/irecv, a sub-group, and ending the world.
//!
//! `cargo run -p multiworld-examples --bin all_in_one -- --nproc 3`

use std::time::Duration;

use multiworld::{Rank, ReduceOp, Tag, Tensor, WorldManager};

fn t(v: Vec<f32>) -> anyhow::Result<Tensor> {
    let n = v.len();
    Ok(Tensor::from_vec(v, [n])?)
}

fn flat(ts: &[Tensor]) -> Vec<f32> {
    ts.iter()
        .flat_map(|x| x.as_slice::<f32>().unwrap_or(&[]).to_vec())
        .collect()
}

struct Log {
    rank: u32,
    wrong: usize,
}

impl Log {
    fn check<T: PartialEq + std::fmt::Debug>(&mut self, op: &str, got: T, want: T) {
        if got == want {
            println!("{op:<28} rank {}: {got:?}", self.rank);
        } else {
            println!("{op:<28} rank {}: {got:?} WRONG, expected {want:?}", self.rank);
            self.wrong += 1;
        }
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let config = multiworld_examples::spawn_or_join("all-in-one", multiworld_examples::nproc_arg(3)).await?;
    let (r, n) = (config.rank.0, config.size);
    anyhow::ensure!(n >= 2, "run with at least 2 ranks");
    let manager = WorldManager::default();
    let world = manager.join(config).await?;
    let g = world.collectives();
    let (rf, nf) = (r as f32, n as f32);
    let s = nf * (nf + 1.0) / 2.0; // 1 + 2 + ... + n
    let mut log = Log { rank: r, wrong: 0 };
    let vals = |x: &Tensor| x.as_slice::<f32>().map(<[f32]>::to_vec).unwrap_or_default();

    let mut x = t(if r == 0 { vec![1.0, 2.0, 3.0] } else { vec![0.0; 3] })?;
    g.broadcast(&mut x, Rank(0)).await?;
    log.check("broadcast", vals(&x), vec![1.0, 2.0, 3.0]);

    let cfg = (r == 0).then(|| ("learning-rate".to_string(), 3u32));
    let got = g.broadcast_object(cfg.as_ref(), Rank(0)).await?;
    log.check("broadcast_object", got, ("learning-rate".to_string(), 3));

    let mut x = t(vec![rf + 1.0])?;
    g.all_reduce(&mut x, ReduceOp::Sum).await?;
    log.check("all_reduce sum", vals(&x), vec![s]);

    for (op, want) in [
        (ReduceOp::Product, (1..=n).map(|v| v as f32).product()),
        (ReduceOp::Min, 1.0),
        (ReduceOp::Avg, s / nf),
    ] {
        let mut x = t(vec![rf + 1.0])?;
        g.all_reduce(&mut x, op).await?;
        log.check(&format!("all_reduce {op:?}"), vals(&x), vec![want]);
    }

    let mut x = t(vec![rf + 1.0])?;
    g.reduce(&mut x, Rank(0), ReduceOp::Sum).await?;
    log.check(
        "reduce sum (dst 0)",
        vals(&x),
        vec![if r == 0 { s } else { rf + 1.0 }],
    );

    let mut outs: Vec<Tensor> = (0..n).map(|_| t(vec![0.0])).collect::<Result<_, _>>()?;
    g.all_gather(&mut outs, &t(vec![rf])?).await?;
    log.check("all_gather", flat(&outs), (0..n).map(|v| v as f32).collect());

    let mut all = t(vec![0.0; n as usize])?;
    g.all_gather_into_tensor(&mut all, &t(vec![rf * 10.0])?).await?;
    log.check(
        "all_gather_into_tensor",
        vals(&all),
        (0..n).map(|v| v as f32 * 10.0).collect(),
    );

    let names = g.all_gather_object(&format!("rank-{r}")).await?;
    log.check(
        "all_gather_object",
        names,
        (0..n).map(|v| format!("rank-{v}")).collect(),
    );

    let mut outs: Vec<Tensor> = (0..n).map(|_| t(vec![0.0])).collect::<Result<_, _>>()?;
    g.gather(&t(vec![rf + 0.5])?, (r == 0).then_some(&mut outs[..]), Rank(0))
        .await?;
    if r == 0 {
        log.check(
            "gather (dst 0)",
            flat(&outs),
            (0..n).map(|v| v as f32 + 0.5).collect(),
        );
    }

    let got = g.gather_object(&(r * r), Rank(0)).await?;
    log.check(
        "gather_object (dst 0)",
        got,
        (r == 0).then(|| (0..n).map(|v| v * v).collect()),
    );

    let chunks: Vec<Tensor> = (0..n)
        .map(|j| t(vec![j as f32 * 100.0]))
        .collect::<Result<_, _>>()?;
    let mut x = t(vec![0.0])?;
    g.scatter(&mut x, (r == 0).then_some(&chunks[..]), Rank(0))
        .await?;
    log.check("scatter (src 0)", vals(&x), vec![rf * 100.0]);

    let jobs: Vec<String> = (0..n).map(|j| format!("job-{j}")).collect();
    let got = g.scatter_object((r == 0).then_some(&jobs[..]), Rank(0)).await?;
    log.check("scatter_object (src 0)", got, format!("job-{r}"));

    let inputs: Vec<Tensor> = (0..n)
        .map(|j| t(vec![(rf + 1.0) * (j as f32 + 1.0)]))
        .collect::<Result<_, _>>()?;
    let mut x = t(vec![0.0])?;
    g.reduce_scatter(&mut x, &inputs, ReduceOp::Sum).await?;
    log.check("reduce_scatter (list)", vals(&x), vec![s * (rf + 1.0)]);

    let input = t((0..2 * n).map(|i| (rf + 1.0) * (i as f32 + 1.0)).collect())?;
    let mut x = t(vec![0.0; 2])?;
    g.reduce_scatter_tensor(&mut x, &input, ReduceOp::Sum).await?;
    log.check(
        "reduce_scatter_tensor",
        vals(&x),
        vec![s * (2.0 * rf + 1.0), s * (2.0 * rf + 2.0)],
    );

    let inputs: Vec<Tensor> = (0..n)
        .map(|j| t(vec![10.0 * rf + j as f32]))
        .collect::<Result<_, _>>()?;
    let mut outs: Vec<Tensor> = (0..n).map(|_| t(vec![0.0])).collect::<Result<_, _>>()?;
    g.all_to_all(&mut outs, &inputs).await?;
    log.check(
        "all_to_all (list)",
        flat(&outs),
        (0..n).map(|j| 10.0 * j as f32 + rf).collect(),
    );

    // Uneven splits: rank r sends j + 1 copies of 100r + j to rank j.
    let in_splits: Vec<usize> = (1..=n as usize).collect();
    let out_splits: Vec<usize> = vec![r as usize + 1; n as usize];
    let input = t((0..n)
        .flat_map(|j| vec![100.0 * rf + j as f32; j as usize + 1])
        .collect())?;
    let mut output = t(vec![0.0; out_splits.iter().sum()])?;
    g.all_to_all_single(&mut output, &input, Some(&out_splits), Some(&in_splits))
        .await?;
    log.check(
        "all_to_all_single (uneven)",
        vals(&output),
        (0..n)
            .flat_map(|k| vec![100.0 * k as f32 + rf; r as usize + 1])
            .collect(),
    );

    g.barrier().await?;
    log.check("barrier", "passed", "passed");

    // An asynchronous collective: start it, do something else, then wait.
    let handle = g.all_reduce_handle(t(vec![1.0; 4])?, ReduceOp::Sum);
    println!(
        "async all_reduce started     rank {r}: completed yet? {}",
        handle.is_completed()
    );
    let x = handle.wait().await?;
    log.check("async all_reduce (handle)", vals(&x), vec![nf; 4]);

    // Point to point with handles: rank 0 and rank 1 swap a tensor.
    if r < 2 {
        let peer = Rank(1 - r);
        let send = world.isend(peer, Tag(7), t(vec![rf; 2])?);
        let recv = world.irecv(Some(peer), Tag(7), t(vec![0.0; 2])?);
        send.wait().await?;
        let got = recv.wait().await?;
        log.check(
            "isend/irecv",
            (got.src, vals(&got.tensor)),
            (peer, vec![peer.0 as f32; 2]),
        );
    }

    // A sub-group of ranks 0 and 1 (every rank takes part in creating it).
    let pair = g.new_group(&[Rank(0), Rank(1)]).await?;
    if pair.is_member() {
        let mut x = t(vec![if r == 1 { 7.0 } else { 0.0 }])?;
        pair.broadcast(&mut x, Rank(1)).await?;
        log.check("sub-group broadcast", vals(&x), vec![7.0]);
    }

    // Destroy: end the world together.
    world.finish(Duration::from_secs(30)).await?;
    log.check(
        "finish (world removed)",
        manager.world("all-in-one").is_none(),
        true,
    );
    anyhow::ensure!(log.wrong == 0, "{} wrong results", log.wrong);
    Ok(())
}
