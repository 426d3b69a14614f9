//! A ring: every rank sends a tensor holding its rank to the next rank and
//! receives from the previous one, then prints what it got.
//!
//! `cargo run -p multiworld-examples --bin ring -- --nproc 3` (spawns its own
//! ranks), or under the launcher:
//! `m8d launch --nproc 3 -- target/debug/ring`.

use multiworld::{DType, Rank, Tag, Tensor, WorldManager};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let config = multiworld_examples::spawn_or_join("ring", multiworld_examples::nproc_arg(2)).await?;
    let (rank, size) = (config.rank.0, config.size);
    let manager = WorldManager::default();
    let world = manager.join(config).await?;
    let next = Rank((rank + 1) % size);
    let prev = Rank((rank + size - 1) % size);
    let mine = vec![rank as f32; 4];
    let mut got = Tensor::zeros(DType::F32, [4])?;
    if size > 1 {
        let (sent, received) = tokio::join!(
            world.send(next, Tag(0), &mine[..]),
            world.recv(prev, Tag(0), &mut got)
        );
        sent?;
        received?;
    } else {
        got = Tensor::from_vec(mine, [4])?;
    }
    println!(
        "rank {rank} of {size}: received {:?} from rank {}",
        got.as_slice::<f32>()?,
        prev.0
    );
    anyhow::ensure!(
        got.as_slice::<f32>()?.iter().all(|&v| v == prev.0 as f32),
        "wrong data"
    );
    // End the world together: a plain leave would break it for ranks still
    // reading their message.
    world.finish(std::time::Duration::from_secs(30)).await?;
    Ok(())
}
