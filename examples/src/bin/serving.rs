//! A serving pipeline: a leader dispatches inference requests to worker
//! processes, each in its own world; each worker runs a small MLP (64 → 32
//! ReLU → 16) and sends the answer back; the leader checks every answer
//! against its own computation. With `--kill-after N`, the leader kills one
//! worker after N answers: that world breaks, its in-flight request fails
//! over to the other workers, and a replacement worker joins a new
//! generation of the same world. Nothing else is disturbed.
//!
//! `cargo run -p multiworld-examples --bin serving -- --requests 300 --kill-after 100`

use std::{
    collections::VecDeque,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use multiworld::{DType, Rank, Tag, Tensor, WorldConfig, WorldError, WorldManager};
use multiworld_examples::{Process, arg, mlp::Mlp, spawn_self};
use tokio::sync::Notify;

const REQUEST: Tag = Tag(1);
const ANSWER: Tag = Tag(2);

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match (arg("--worker"), arg("--store")) {
        (Some(world), Some(store)) => worker(&world, &store).await,
        _ => leader().await,
    }
}

/// Serves requests until the world ends.
async fn worker(world: &str, store: &str) -> anyhow::Result<()> {
    let manager = WorldManager::default();
    let w = manager.join(WorldConfig::new(world, 1, 2, store)?).await?;
    let mlp = Mlp::new(7);
    let mut input = Tensor::zeros(DType::F32, [Mlp::INPUTS])?;
    loop {
        match w.recv(Rank(0), REQUEST, &mut input).await {
            Ok(()) => {}
            // The leader left or the world broke: the service is over.
            Err(WorldError::Broken { .. }) => return Ok(()),
            Err(e) => return Err(e.into()),
        }
        let answer = mlp.forward(input.as_slice::<f32>()?);
        match w.send(Rank(0), ANSWER, &answer[..]).await {
            Ok(()) => {}
            Err(WorldError::Broken { .. }) => return Ok(()),
            Err(e) => return Err(e.into()),
        }
    }
}

fn spawn_worker(world: &str, store: &str) -> anyhow::Result<Process> {
    spawn_self(&["--worker", world, "--store", store])
}

/// The leader's shared state: the request queue and the tally.
struct Service {
    queue: Mutex<VecDeque<u64>>,
    more: Notify,
    answered: Mutex<Vec<(u64, String)>>,
    total: u64,
    mlp: Mlp,
}

impl Service {
    fn next(&self) -> Option<u64> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner()).pop_front()
    }

    fn give_back(&self, id: u64) {
        self.queue
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_front(id);
        self.more.notify_waiters();
    }

    fn done(&self) -> bool {
        self.answered.lock().unwrap_or_else(|e| e.into_inner()).len() as u64 >= self.total
    }
}

/// Sends requests to one world's worker until the queue is empty or the
/// world breaks. Returns whether the world broke.
async fn serve(world: multiworld::World, svc: Arc<Service>) -> anyhow::Result<bool> {
    let mut answer = Tensor::zeros(DType::F32, [Mlp::OUTPUTS])?;
    loop {
        let Some(id) = svc.next() else {
            if svc.done() {
                return Ok(false);
            }
            // Another world may fail and give a request back.
            tokio::select! {
                _ = svc.more.notified() => {}
                _ = tokio::time::sleep(Duration::from_millis(20)) => {}
            }
            continue;
        };
        let input = Mlp::input(id);
        let result = async {
            world.send(Rank(1), REQUEST, &input[..]).await?;
            world.recv(Rank(1), ANSWER, &mut answer).await
        }
        .await;
        match result {
            Ok(()) => {
                anyhow::ensure!(
                    answer.as_slice::<f32>()? == svc.mlp.forward(&input).as_slice(),
                    "request {id}: wrong answer from {}",
                    world.name()
                );
                svc.answered
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push((id, world.name().to_string()));
            }
            Err(WorldError::Broken { cause, .. }) => {
                println!(
                    "leader: {} broke ({cause}); request {id} fails over",
                    world.name()
                );
                svc.give_back(id);
                return Ok(true);
            }
            Err(e) => return Err(e.into()),
        }
    }
}

async fn leader() -> anyhow::Result<()> {
    let requests: u64 = arg("--requests").and_then(|v| v.parse().ok()).unwrap_or(300);
    let kill_after: Option<u64> = arg("--kill-after").and_then(|v| v.parse().ok());
    let workers = 3;
    let started = Instant::now();
    let manager = WorldManager::default();
    let store = manager.serve_store("127.0.0.1:0").await?.to_string();
    let svc = Arc::new(Service {
        queue: Mutex::new((0..requests).collect()),
        more: Notify::new(),
        answered: Mutex::new(Vec::new()),
        total: requests,
        mlp: Mlp::new(7),
    });
    let mut procs = Vec::new();
    let mut servers = Vec::new();
    for i in 1..=workers {
        let name = format!("worker-{i}");
        procs.push(spawn_worker(&name, &store)?);
        let world = manager.join(WorldConfig::new(&name, 0, 2, &store)?).await?;
        println!("leader: joined {name} (generation {})", world.generation());
        servers.push(tokio::spawn(serve(world, Arc::clone(&svc))));
    }

    // Kill worker 2 after `kill_after` answers, then bring in a replacement.
    let mut replaced = None;
    if let Some(n) = kill_after {
        while (svc.answered.lock().unwrap_or_else(|e| e.into_inner()).len() as u64) < n {
            anyhow::ensure!(started.elapsed() < Duration::from_secs(60), "no progress");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        println!("leader: killing the process of worker-2 after {n} answers");
        procs[1].0.kill()?;
        procs[1].0.wait()?;
        let broke = servers.remove(1).await??;
        anyhow::ensure!(broke, "worker-2's world did not break");
        let old = manager.world("worker-2").map_or(0, |w| w.generation().0);
        if let Some(w) = manager.world("worker-2") {
            w.removed().await;
        }
        procs[1] = spawn_worker("worker-2", &store)?;
        let world = manager.join(WorldConfig::new("worker-2", 0, 2, &store)?).await?;
        println!(
            "leader: a replacement joined worker-2 as generation {} (was {old})",
            world.generation()
        );
        replaced = Some(world.generation());
        servers.push(tokio::spawn(serve(world, Arc::clone(&svc))));
    }
    for s in servers {
        let broke = s.await??;
        anyhow::ensure!(!broke, "a world broke without a fault being injected");
    }
    let answered = svc.answered.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let mut ids: Vec<u64> = answered.iter().map(|(id, _)| *id).collect();
    ids.sort_unstable();
    ids.dedup();
    anyhow::ensure!(
        ids.len() as u64 == requests,
        "{} of {requests} requests answered",
        ids.len()
    );
    for i in 1..=workers {
        let name = format!("worker-{i}");
        let n = answered.iter().filter(|(_, w)| *w == name).count();
        println!("leader: {name} answered {n} requests");
    }
    println!(
        "leader: all {requests} requests answered correctly in {:?}{}",
        started.elapsed(),
        if replaced.is_some() {
            ", one worker replaced"
        } else {
            ""
        }
    );
    manager.shutdown().await;
    // Workers see the leader leave and exit by themselves.
    for mut p in procs {
        let deadline = Instant::now() + Duration::from_secs(10);
        while p.0.try_wait()?.is_none() {
            anyhow::ensure!(Instant::now() < deadline, "a worker did not exit");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    Ok(())
}
