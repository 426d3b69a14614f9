//! A real rank process is SIGKILLed in the middle of a collective; every
//! surviving rank's call must fail (never return a partial result as success)
//! within a bound. World of 4: this test is rank 0 and re-executes its own binary
//! for ranks 1..=3 (see `collectives_kill_child`); they rendezvous through files in
//! a temporary directory, all run 16 MiB ring all-reduces back to back, and rank 2
//! is killed while rank 0's call is under way. Each survivor records when its call
//! failed; the test reports the delays from the kill.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::*;
use multiworld_tcp::collectives::{Group, ReduceOp};
use multiworld_tcp::{Communicator, DType, Error, Rank, Tensor};

const DIR_ENV: &str = "MW_COLL_KILL_DIR";
const RANK_ENV: &str = "MW_COLL_KILL_RANK";
const CHILD_TEST: &str = "collectives_kill_child";
const WORLD: u32 = 4;
const VICTIM: u32 = 2;
const LEN: usize = 4 << 20; // 16 MiB of f32: a ring all-reduce

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn now_nanos() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos()
}

/// Kills the children if the test fails before they end.
struct Children(Vec<(u32, Child)>);

impl Drop for Children {
    fn drop(&mut self) {
        for (_, c) in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A rank process: runs all-reduces until one fails, then writes
/// `<unix nanos of the failure> <completed calls> <error>` to `result-<rank>`.
/// Does nothing unless started by the test below.
#[test]
#[ignore = "helper process for a_rank_killed_mid_collective_fails_every_survivor"]
fn collectives_kill_child() {
    let (Ok(dir), Ok(rank)) = (std::env::var(DIR_ENV), std::env::var(RANK_ENV)) else {
        eprintln!("{CHILD_TEST}: not started by the parent test; nothing to do");
        return;
    };
    let rank: u32 = rank.parse().unwrap();
    runtime().block_on(async {
        let rdv = FileRendezvous {
            dir: dir.clone().into(),
        };
        let comm = Arc::new(
            Communicator::join(config("collkill", rank, WORLD), &rdv)
                .await
                .unwrap(),
        );
        let g = Group::world(&comm);
        let mut t = Tensor::zeros(DType::F32, [LEN]).unwrap();
        let mut done = 0u64;
        let err = loop {
            match g.all_reduce(&mut t, ReduceOp::Sum).await {
                Ok(()) => done += 1,
                Err(e) => break e,
            }
        };
        let line = format!("{} {done} {err}", now_nanos());
        let path = Path::new(&dir).join(format!("result-{rank}"));
        std::fs::write(path.with_extension("tmp"), line).unwrap();
        std::fs::rename(path.with_extension("tmp"), path).unwrap();
    });
}

#[test]
fn a_rank_killed_mid_collective_fails_every_survivor() {
    init_tracing();
    let dir = temp_dir("collkill");
    let exe = std::env::current_exe().unwrap();
    let mut children = Children(Vec::new());
    for r in 1..WORLD {
        let child = Command::new(&exe)
            .args([
                CHILD_TEST,
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(DIR_ENV, &dir)
            .env(RANK_ENV, r.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        children.0.push((r, child));
    }
    let (killed_at, parent_took, parent_err) = runtime().block_on(async {
        let rdv = FileRendezvous { dir: dir.clone() };
        let comm = Arc::new(
            Communicator::join(config("collkill", 0, WORLD), &rdv)
                .await
                .unwrap(),
        );
        let g = Group::world(&comm);
        let mut t = Tensor::zeros(DType::F32, [LEN]).unwrap();
        for _ in 0..3 {
            g.all_reduce(&mut t, ReduceOp::Sum).await.unwrap();
        }
        // Start a call and wait until data is flowing in it, then kill rank 2.
        let before = comm.peer_stats(Rank(WORLD - 1)).unwrap().bytes_received;
        let handle = g.all_reduce_handle(t, ReduceOp::Sum);
        let flowing = eventually(Duration::from_secs(30), || {
            comm.peer_stats(Rank(WORLD - 1)).unwrap().bytes_received >= before + (1 << 20)
        })
        .await;
        assert!(flowing, "the call never got under way");
        assert!(
            !handle.is_completed(),
            "the call must still be running when the rank is killed"
        );
        let victim = &mut children.0.iter_mut().find(|(r, _)| *r == VICTIM).unwrap().1;
        assert!(victim.try_wait().unwrap().is_none(), "victim still running");
        victim.kill().unwrap(); // SIGKILL on Unix
        let killed_at = now_nanos();
        let t0 = Instant::now();
        let r = tokio::time::timeout(Duration::from_secs(10), handle)
            .await
            .expect("rank 0's call must fail, not hang");
        let took = t0.elapsed();
        let e = r.expect_err("rank 0's call must not succeed with a partial result");
        (killed_at, took, e)
    });
    println!("rank 0: call failed {parent_took:?} after the SIGKILL: {parent_err}");
    assert!(parent_err.is_world_fatal(), "{parent_err}");
    assert!(
        matches!(&parent_err, Error::PeerLost { .. }),
        "expected PeerLost, got {parent_err}"
    );
    assert!(
        parent_took < Duration::from_secs(2),
        "rank 0 took {parent_took:?}"
    );
    // The surviving children report when their calls failed.
    let deadline = Instant::now() + Duration::from_secs(20);
    for (r, child) in children.0.iter_mut().filter(|(r, _)| *r != VICTIM) {
        loop {
            if child.try_wait().unwrap().is_some() {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "rank {r} did not finish: its call hung"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        let line = std::fs::read_to_string(dir.join(format!("result-{r}")))
            .unwrap_or_else(|e| panic!("rank {r} wrote no result ({e}); it crashed"));
        let mut parts = line.splitn(3, ' ');
        let at: u128 = parts.next().unwrap().parse().unwrap();
        let calls: u64 = parts.next().unwrap().parse().unwrap();
        let err = parts.next().unwrap_or_default();
        let took = Duration::from_nanos(at.saturating_sub(killed_at) as u64);
        println!("rank {r}: call failed {took:?} after the SIGKILL (after {calls} completed calls): {err}");
        assert!(
            err.contains("lost"),
            "rank {r}: expected a lost peer, got {err:?}"
        );
        assert!(took < Duration::from_secs(2), "rank {r} took {took:?}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
