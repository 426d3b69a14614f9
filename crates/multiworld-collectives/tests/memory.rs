//! The collectives over worlds built in memory (the transport's `memory`
//! feature: every member in this process, connected by pipes, no sockets),
//! checked against the test kit's sequential reference: all_reduce, broadcast,
//! all_gather (uneven), all_gather_into_tensor, reduce_scatter_tensor and
//! reduce_scatter (uneven) for 2, 3 and 4 members, several dtypes and both
//! algorithm families, the data over the pipes (shared memory off) and with
//! the default settings; and a member dropped in the middle of a call, which
//! must fail every other member with an error within a bound, never hang.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use multiworld_collectives::{Algorithm, CollectiveConfig, Group};
use multiworld_tcp::{DType, Error, Rank, Tensor};
use multiworld_testkit::coll::*;
use multiworld_testkit::eventually;
use multiworld_testkit::memory::{memory_mesh, memory_mesh_with};
use multiworld_types::ReduceOp;

const DTYPES: [DType; 7] = [
    DType::F32,
    DType::F64,
    DType::BF16,
    DType::F16,
    DType::I32,
    DType::U8,
    DType::Bool,
];

/// Lengths checked for every dtype: empty, tiny, odd, and above the
/// transport's eager limit in these worlds (5000 × 8 bytes is 40 KB; see
/// [`groups_holding_back`]).
const LENS: [usize; 4] = [0, 1, 13, 5000];
/// A length above the collectives' direct and chunk sizes and the pipes'
/// capacity (70 000 f32 is 280 KB), checked for one dtype per algorithm (the
/// reference is slow in debug builds).
const LONG: usize = 70_000;

fn algo_code(a: Algorithm) -> u64 {
    match a {
        Algorithm::Direct => 1,
        Algorithm::Ring => 2,
        _ => 3,
    }
}

/// Every checked operation for one (algorithm, dtype, length) on member `me`;
/// returns how many calls it checked.
async fn check_ops(g: &Group, me: usize, dtype: DType, len: usize, salt: u64) -> usize {
    let n = g.size();
    let what = format!("n={n} {dtype} len={len} salt={salt}");
    let seed = seed_of(&[dtype.code().into(), len as u64, salt]);
    let mut checked = 0;

    for op in [ReduceOp::Sum, ReduceOp::Max] {
        if !op.supports(dtype) {
            continue;
        }
        let ins: Vec<Tensor> = (0..n).map(|r| input(dtype, len, r, seed ^ op as u64)).collect();
        let mut t = ins[me].clone();
        g.all_reduce(&mut t, op).await.unwrap();
        assert_same(&t, &reference(&ins, op), &format!("all_reduce {op} {what}"));
        checked += 1;
    }

    let root = (seed % n as u64) as usize;
    let ins: Vec<Tensor> = (0..n).map(|r| input(dtype, len, r, seed ^ 3)).collect();
    let mut t = if me == root {
        ins[me].clone()
    } else {
        Tensor::zeros(dtype, [len]).unwrap()
    };
    g.broadcast(&mut t, Rank(root as u32)).await.unwrap();
    assert_same(&t, &ins[root], &format!("broadcast {what} root {root}"));
    checked += 1;

    // all_gather, uneven: member p contributes len + p elements.
    let own = |p: usize| input(dtype, len + p, p, seed ^ 4);
    let mut outs: Vec<Tensor> = (0..n).map(|p| Tensor::zeros(dtype, [len + p]).unwrap()).collect();
    g.all_gather(&mut outs, &own(me)).await.unwrap();
    for (p, o) in outs.iter().enumerate() {
        assert_same(o, &own(p), &format!("all_gather {what} from {p}"));
    }
    let mut out = Tensor::zeros(dtype, [n * len]).unwrap();
    g.all_gather_into_tensor(&mut out, &ins[me]).await.unwrap();
    assert_same(&out, &concat(&ins), &format!("all_gather_into_tensor {what}"));
    checked += 2;

    let op = ReduceOp::Sum;
    if op.supports(dtype) {
        let big: Vec<Tensor> = (0..n).map(|r| input(dtype, n * len, r, seed ^ 7)).collect();
        let want = reference(&big, op);
        let mut out = Tensor::zeros(dtype, [len]).unwrap();
        g.reduce_scatter_tensor(&mut out, &big[me], op).await.unwrap();
        assert_same(
            &out,
            &slice(&want, me * len..(me + 1) * len),
            &format!("reduce_scatter_tensor {what}"),
        );

        // reduce_scatter from a list with uneven segments.
        let sizes: Vec<usize> = (0..n).map(|q| len / 2 + q * 3).collect();
        let total: usize = sizes.iter().sum();
        let full: Vec<Tensor> = (0..n).map(|r| input(dtype, total, r, seed ^ 9)).collect();
        let want = reference(&full, op);
        let mut segs = Vec::new();
        let mut at = 0;
        for &s in &sizes {
            segs.push(at..at + s);
            at += s;
        }
        let list: Vec<Tensor> = segs.iter().map(|s| slice(&full[me], s.clone())).collect();
        let mut out = Tensor::zeros(dtype, [sizes[me]]).unwrap();
        g.reduce_scatter(&mut out, &list, op).await.unwrap();
        assert_same(
            &out,
            &slice(&want, segs[me].clone()),
            &format!("reduce_scatter {what}"),
        );
        checked += 2;
    }
    checked
}

/// Groups whose transport reads ahead only messages of up to 4 KiB (the
/// default is 256 KiB), so that most messages here wait in the pipe for
/// their receive, as large ones do by default.
fn groups_holding_back(name: &str, n: u32) -> Vec<Group> {
    memory_mesh_with(name, n, |mut c| {
        c.eager_limit = 4 << 10;
        c
    })
    .into_iter()
    .map(|c| Group::world(&Arc::new(c)))
    .collect()
}

async fn matrix(n: u32) {
    let gs = groups_holding_back(&format!("mem-coll-{n}"), n);
    let t0 = Instant::now();
    let counts = on_all(&gs, |me, g| async move {
        let mut checked = 0;
        // The data over the pipes, each algorithm forced.
        for algo in [Algorithm::Direct, Algorithm::Ring] {
            let g = g.with_config(
                CollectiveConfig::default()
                    .with_algorithm(algo)
                    .with_shared_memory(false),
            );
            for dtype in DTYPES {
                for len in LENS {
                    checked += check_ops(&g, me, dtype, len, algo_code(algo)).await;
                }
            }
            checked += check_ops(&g, me, DType::F32, LONG, algo_code(algo)).await;
        }
        // Default settings: the members share a host (a process), so large
        // calls may take shared memory, with the pipes ordering the phases.
        checked += check_ops(&g, me, DType::F32, 300_000, 99).await;
        checked
    })
    .await;
    println!(
        "n={n}: {} checked calls per member in {:?}",
        counts[0],
        t0.elapsed()
    );
    assert!(counts.iter().all(|&c| c == counts[0] && c > 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn collectives_over_memory_with_2_members() {
    matrix(2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn collectives_over_memory_with_3_members() {
    matrix(3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn collectives_over_memory_with_4_members() {
    matrix(4).await;
}

/// Members 0..=2 run a large ring all-reduce over the pipes; member 3 starts
/// the same call and is then dropped (its call future and its communicator,
/// the last reference), as a process that dies. Every survivor must fail
/// with a world-fatal error within a bound, and later calls fail at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_dropped_mid_call_fails_the_others_within_a_bound() {
    const LEN: usize = 8 << 20; // 32 MiB of f32
    let cfg = CollectiveConfig::default()
        .with_algorithm(Algorithm::Ring)
        .with_shared_memory(false);
    let mut gs: Vec<Group> = memory_mesh("mem-coll-lost", 4)
        .into_iter()
        .map(|c| Group::world(&Arc::new(c)).with_config(cfg.clone()))
        .collect();
    let victim = gs.pop().unwrap();
    let gone = Arc::downgrade(victim.comm());
    let victim = tokio::spawn(async move {
        let mut t = Tensor::zeros(DType::F32, [LEN]).unwrap();
        // A first call completes normally.
        victim.all_reduce(&mut t, ReduceOp::Sum).await.unwrap();
        // Let the second get under way, then drop it and the member.
        let call = tokio::time::timeout(
            Duration::from_millis(20),
            victim.all_reduce(&mut t, ReduceOp::Sum),
        )
        .await;
        assert!(call.is_err(), "the call finished before the member was dropped");
        drop(victim);
    });
    let outs = on_all(&gs, |_, g| async move {
        let mut t = Tensor::zeros(DType::F32, [LEN]).unwrap();
        g.all_reduce(&mut t, ReduceOp::Sum).await.unwrap();
        let started = Instant::now();
        let e = g.all_reduce(&mut t, ReduceOp::Sum).await.unwrap_err();
        (e, started.elapsed())
    })
    .await;
    victim.await.unwrap();
    assert!(
        eventually(Duration::from_secs(5), || gone.upgrade().is_none()).await,
        "the dropped member's communicator is still alive"
    );
    for (r, (e, took)) in outs.iter().enumerate() {
        println!("member {r}: failed after {took:?} (the drop is ~20 ms in): {e}");
        assert!(e.is_world_fatal(), "member {r}: {e}");
        assert!(*took < Duration::from_secs(5), "member {r} took {took:?}");
    }
    let later = on_all(&gs, |_, g| async move {
        let t0 = Instant::now();
        let e = g.barrier().await.unwrap_err();
        (e, t0.elapsed())
    })
    .await;
    for (e, took) in later {
        assert!(matches!(e, Error::PeerLost { .. }), "{e}");
        assert!(took < Duration::from_millis(500), "{took:?}");
    }
}
