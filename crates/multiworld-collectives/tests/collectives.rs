//! Collectives between in-process ranks over loopback, checked against a
//! sequential reference: every operation × every dtype × every reduce op where
//! defined, world sizes 1 to 8, lengths 0, 1, primes, sizes not divisible by the
//! world size, uneven splits, a 16 MiB case, both algorithm families, sub-groups,
//! handle forms and object variants. Inputs make every reduction exact (see
//! `common/coll.rs`), so float results are compared bit for bit too; the ring's
//! rounding with general floats is checked against the documented bound.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Instant;

use multiworld_collectives::{Algorithm, CollectiveConfig, Group};
use multiworld_tcp::{DType, Error, Rank, Tag, Tensor, bf16, f16};
use multiworld_testkit::coll::*;
use multiworld_types::ReduceOp;
use serde::{Deserialize, Serialize};

const ALGOS: [Algorithm; 2] = [Algorithm::Direct, Algorithm::Ring];

fn algo_code(a: Algorithm) -> u64 {
    match a {
        Algorithm::Direct => 1,
        Algorithm::Ring => 2,
        _ => 3,
    }
}

/// Every (dtype, reduce op) pair through all_reduce, reduce, reduce_scatter and
/// reduce_scatter_tensor, with both algorithms and lengths 0, 1 and 13; undefined
/// pairs must fail with InvalidArgument on every rank.
async fn reduction_matrix(n: u32) {
    let gs = groups(&format!("matrix-{n}"), n).await;
    let t0 = Instant::now();
    let counts = on_all(&gs, |me, g| async move {
        let n = g.size();
        let mut checked = 0usize;
        for algo in ALGOS {
            let g = g.with_config(CollectiveConfig::default().with_algorithm(algo));
            for dtype in DType::ALL {
                for op in ReduceOp::ALL {
                    for len in [0usize, 1, 13] {
                        let seed = seed_of(&[dtype.code().into(), op as u64, len as u64, algo_code(algo)]);
                        let what = format!("n={n} {algo:?} {dtype} {op} len={len}");
                        let ins: Vec<Tensor> = (0..n).map(|r| input(dtype, len, r, seed)).collect();
                        if !op.supports(dtype) {
                            assert_undefined_op_refused(&g, &ins[me], op, &what).await;
                            continue;
                        }
                        let want = reference(&ins, op);

                        let mut t = ins[me].clone();
                        g.all_reduce(&mut t, op).await.unwrap();
                        assert_same(&t, &want, &format!("all_reduce {what}"));

                        let root = (seed % n as u64) as usize;
                        let mut t = ins[me].clone();
                        g.reduce(&mut t, Rank(root as u32), op).await.unwrap();
                        let expect = if me == root { &want } else { &ins[me] };
                        assert_same(&t, expect, &format!("reduce {what} root {root}"));

                        // reduce_scatter_tensor: n segments of `len` each.
                        let big: Vec<Tensor> = (0..n).map(|r| input(dtype, n * len, r, seed ^ 7)).collect();
                        let want_big = reference(&big, op);
                        let mut out = Tensor::zeros(dtype, [len]).unwrap();
                        g.reduce_scatter_tensor(&mut out, &big[me], op).await.unwrap();
                        assert_same(
                            &out,
                            &slice(&want_big, me * len..(me + 1) * len),
                            &format!("rs_tensor {what}"),
                        );

                        // reduce_scatter from a list with uneven segment sizes.
                        let sizes: Vec<usize> = (0..n).map(|q| (len + q) % 4).collect();
                        let total: usize = sizes.iter().sum();
                        let full: Vec<Tensor> = (0..n).map(|r| input(dtype, total, r, seed ^ 9)).collect();
                        let want_full = reference(&full, op);
                        let mut at = 0;
                        let mut segs = Vec::new();
                        for &s in &sizes {
                            segs.push(at..at + s);
                            at += s;
                        }
                        let list: Vec<Tensor> = segs.iter().map(|s| slice(&full[me], s.clone())).collect();
                        let mut out = Tensor::zeros(dtype, [sizes[me]]).unwrap();
                        g.reduce_scatter(&mut out, &list, op).await.unwrap();
                        assert_same(
                            &out,
                            &slice(&want_full, segs[me].clone()),
                            &format!("rs_list {what}"),
                        );
                        checked += 4;
                    }
                }
            }
        }
        checked
    })
    .await;
    println!(
        "n={n}: {} checked calls per rank in {:?}",
        counts[0],
        t0.elapsed()
    );
    assert!(counts.iter().all(|&c| c == counts[0] && c > 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dtype_and_reduce_op_with_3_ranks() {
    reduction_matrix(3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dtype_and_reduce_op_with_4_ranks() {
    reduction_matrix(4).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dtype_and_reduce_op_with_1_and_2_ranks() {
    reduction_matrix(1).await;
    reduction_matrix(2).await;
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Obj {
    rank: u32,
    name: String,
    data: Vec<u64>,
}

fn obj(rank: usize, len: usize) -> Obj {
    Obj {
        rank: rank as u32,
        name: format!("rank-{rank}-{}", "x".repeat(len % 50)),
        data: (0..(len + rank) as u64).collect(),
    }
}

/// Elements rank `p` sends rank `q` in the all-to-all tests (uneven, some zero).
fn a2a_count(len: usize, p: usize, q: usize) -> usize {
    if len == 0 {
        0
    } else {
        (len + p + 2 * q) % 7 + len / 2
    }
}

const SOME_DTYPES: [DType; 4] = [DType::F32, DType::I64, DType::BF16, DType::Bool];
const LENGTHS: [usize; 5] = [0, 1, 7, 13, 1031];

/// Every operation on one world size, with the given dtypes and lengths and both
/// algorithms.
async fn every_op(n: u32, dtypes: &'static [DType], lengths: &'static [usize]) {
    let gs = groups(&format!("ops-{n}-{}", dtypes.len()), n).await;
    let t0 = Instant::now();
    on_all(&gs, move |me, g| async move {
        let n = g.size();
        for algo in ALGOS {
            let g = g.with_config(CollectiveConfig::default().with_algorithm(algo));
            for &dtype in dtypes {
                for &len in lengths {
                    let seed = seed_of(&[u64::from(dtype.code()), len as u64, algo_code(algo), 99]);
                    let what = format!("n={n} {algo:?} {dtype} len={len}");
                    let root = (seed % n as u64) as usize;
                    let root_rank = Rank(root as u32);
                    let inp = |r: usize, c: usize, s: u64| input(dtype, c, r, seed ^ s);

                    // broadcast
                    let mut t = if me == root {
                        inp(root, len, 1)
                    } else {
                        Tensor::zeros(dtype, [len]).unwrap()
                    };
                    g.broadcast(&mut t, root_rank).await.unwrap();
                    assert_same(&t, &inp(root, len, 1), &format!("broadcast {what}"));

                    // reductions with a common op per dtype
                    let op = if dtype == DType::F32 {
                        ReduceOp::Sum
                    } else {
                        ReduceOp::Max
                    };
                    let ins: Vec<Tensor> = (0..n).map(|r| inp(r, len, 2)).collect();
                    let want = reference(&ins, op);
                    let mut t = ins[me].clone();
                    g.all_reduce(&mut t, op).await.unwrap();
                    assert_same(&t, &want, &format!("all_reduce {what}"));
                    let mut t = ins[me].clone();
                    g.reduce(&mut t, root_rank, op).await.unwrap();
                    assert_same(
                        &t,
                        if me == root { &want } else { &ins[me] },
                        &format!("reduce {what}"),
                    );
                    let big: Vec<Tensor> = (0..n).map(|r| inp(r, n * len, 3)).collect();
                    let want_big = reference(&big, op);
                    let mut out = Tensor::zeros(dtype, [len]).unwrap();
                    g.reduce_scatter_tensor(&mut out, &big[me], op).await.unwrap();
                    assert_same(
                        &out,
                        &slice(&want_big, me * len..(me + 1) * len),
                        &format!("rs {what}"),
                    );
                    let list: Vec<Tensor> = (0..n).map(|q| slice(&big[me], q * len..(q + 1) * len)).collect();
                    let mut out = Tensor::zeros(dtype, [len]).unwrap();
                    g.reduce_scatter(&mut out, &list, op).await.unwrap();
                    assert_same(
                        &out,
                        &slice(&want_big, me * len..(me + 1) * len),
                        &format!("rs list {what}"),
                    );

                    // all_gather (uneven: rank p contributes len + p elements)
                    let own = inp(me, len + me, 4);
                    let mut outs: Vec<Tensor> =
                        (0..n).map(|p| Tensor::zeros(dtype, [len + p]).unwrap()).collect();
                    g.all_gather(&mut outs, &own).await.unwrap();
                    for (p, o) in outs.iter().enumerate() {
                        assert_same(o, &inp(p, len + p, 4), &format!("all_gather {what} from {p}"));
                    }
                    let mut out = Tensor::zeros(dtype, [n * len]).unwrap();
                    g.all_gather_into_tensor(&mut out, &inp(me, len, 5))
                        .await
                        .unwrap();
                    let want_cat = concat(&(0..n).map(|p| inp(p, len, 5)).collect::<Vec<_>>());
                    assert_same(&out, &want_cat, &format!("all_gather_into {what}"));

                    // gather (uneven) and scatter (uneven)
                    let mut outs: Vec<Tensor> =
                        (0..n).map(|p| Tensor::zeros(dtype, [len + p]).unwrap()).collect();
                    let own = inp(me, len + me, 6);
                    g.gather(&own, (me == root).then_some(&mut outs[..]), root_rank)
                        .await
                        .unwrap();
                    if me == root {
                        for (p, o) in outs.iter().enumerate() {
                            assert_same(o, &inp(p, len + p, 6), &format!("gather {what} from {p}"));
                        }
                    }
                    let pieces: Vec<Tensor> = (0..n).map(|q| inp(100 + q, len + q, 7)).collect();
                    let mut out = Tensor::zeros(dtype, [len + me]).unwrap();
                    g.scatter(&mut out, (me == root).then_some(&pieces[..]), root_rank)
                        .await
                        .unwrap();
                    assert_same(&out, &inp(100 + me, len + me, 7), &format!("scatter {what}"));

                    // all_to_all (lists, uneven) and all_to_all_single (uneven splits)
                    let piece = |p: usize, q: usize| inp(p * 16 + q, a2a_count(len, p, q), 8);
                    let inputs: Vec<Tensor> = (0..n).map(|q| piece(me, q)).collect();
                    let mut outs: Vec<Tensor> = (0..n)
                        .map(|p| Tensor::zeros(dtype, [a2a_count(len, p, me)]).unwrap())
                        .collect();
                    g.all_to_all(&mut outs, &inputs).await.unwrap();
                    for (p, o) in outs.iter().enumerate() {
                        assert_same(o, &piece(p, me), &format!("all_to_all {what} from {p}"));
                    }
                    let in_splits: Vec<usize> = (0..n).map(|q| a2a_count(len, me, q)).collect();
                    let out_splits: Vec<usize> = (0..n).map(|p| a2a_count(len, p, me)).collect();
                    let input_t = concat(&inputs);
                    let mut out = Tensor::zeros(dtype, [out_splits.iter().sum::<usize>()]).unwrap();
                    g.all_to_all_single(&mut out, &input_t, Some(&out_splits), Some(&in_splits))
                        .await
                        .unwrap();
                    assert_same(
                        &out,
                        &concat(&(0..n).map(|p| piece(p, me)).collect::<Vec<_>>()),
                        &format!("a2a single {what}"),
                    );
                    // even splits (None)
                    let input_t = inp(me, n * len, 9);
                    let mut out = Tensor::zeros(dtype, [n * len]).unwrap();
                    g.all_to_all_single(&mut out, &input_t, None, None).await.unwrap();
                    let want = concat(
                        &(0..n)
                            .map(|p| slice(&inp(p, n * len, 9), me * len..(me + 1) * len))
                            .collect::<Vec<_>>(),
                    );
                    assert_same(&out, &want, &format!("a2a even {what}"));

                    g.barrier().await.unwrap();
                }
            }
            // Objects.
            for len in [0usize, 3, 300] {
                let got: Obj = g
                    .broadcast_object((me == 0).then(|| obj(0, len)).as_ref(), Rank(0))
                    .await
                    .unwrap();
                assert_eq!(got, obj(0, len));
                let all: Vec<Obj> = g.all_gather_object(&obj(me, len)).await.unwrap();
                assert_eq!(all, (0..n).map(|p| obj(p, len)).collect::<Vec<_>>());
                let root = n - 1;
                let gathered = g.gather_object(&obj(me, len), Rank(root as u32)).await.unwrap();
                if me == root {
                    assert_eq!(gathered.unwrap(), (0..n).map(|p| obj(p, len)).collect::<Vec<_>>());
                } else {
                    assert!(gathered.is_none());
                }
                let values: Vec<Obj> = (0..n).map(|q| obj(q + 10, len + q)).collect();
                let mine: Obj = g
                    .scatter_object((me == root).then_some(&values[..]), Rank(root as u32))
                    .await
                    .unwrap();
                assert_eq!(mine, obj(me + 10, len + me));
            }
        }
    })
    .await;
    println!("every op with {n} ranks: {:?}", t0.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_op_world_sizes_1_to_4() {
    for n in 1..=4 {
        every_op(n, &SOME_DTYPES, &LENGTHS).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_op_world_sizes_5_to_8() {
    for n in 5..=8 {
        every_op(n, &SOME_DTYPES, &LENGTHS).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_op_every_dtype_with_3_ranks() {
    every_op(3, &DType::ALL, &[0, 1, 13]).await;
}

/// The ring all-reduce with tiny chunks, so that every segment is many chunks
/// (and segments of different sizes have different chunk counts): the pipelined
/// stream must match every message with the right receive and fold every chunk
/// in the right place, for 2 to 5 ranks, pipeline depths 1 and 3, lengths 0, 1,
/// primes and sizes not divisible by the world size, several dtypes and ops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ring_all_reduce_with_many_small_chunks() {
    for n in 2..=5u32 {
        let gs = groups(&format!("small-chunks-{n}"), n).await;
        on_all(&gs, |me, g| async move {
            let n = g.size();
            for depth in [1usize, 3] {
                let mut cfg = CollectiveConfig::default().with_algorithm(Algorithm::Ring);
                cfg.chunk_bytes = 16;
                cfg.pipeline_depth = depth;
                let g = g.with_config(cfg);
                for dtype in [DType::F32, DType::I64, DType::BF16, DType::Bool] {
                    for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::BXor] {
                        if !op.supports(dtype) {
                            continue;
                        }
                        for len in [0usize, 1, 7, 13, 61, 1031] {
                            let seed = seed_of(&[dtype.code().into(), op as u64, len as u64, depth as u64]);
                            let what = format!("n={n} depth={depth} {dtype} {op} len={len}");
                            let ins: Vec<Tensor> = (0..n).map(|r| input(dtype, len, r, seed)).collect();
                            let want = reference(&ins, op);
                            let mut t = ins[me].clone();
                            g.all_reduce(&mut t, op).await.unwrap();
                            assert_same(&t, &want, &format!("all_reduce {what}"));
                        }
                    }
                }
                // The all-gather runs through the same chunking.
                for len in [0usize, 1, 13, 61] {
                    let ins: Vec<Tensor> = (0..n).map(|r| input(DType::F32, len, r, 5)).collect();
                    let mut out = Tensor::zeros(DType::F32, [n * len]).unwrap();
                    g.all_gather_into_tensor(&mut out, &ins[me]).await.unwrap();
                    assert_same(
                        &out,
                        &concat(&ins),
                        &format!("all_gather n={n} depth={depth} len={len}"),
                    );
                }
            }
        })
        .await;
    }
}

/// 16 MiB buffers through the bandwidth algorithms (default, automatic choice).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_mib() {
    const N: usize = 4 << 20; // 4 Mi f32 = 16 MiB
    let gs = groups("sixteen", 3).await;
    let ins: Arc<Vec<Tensor>> = Arc::new((0..3).map(|r| input(DType::F32, N, r, 16)).collect());
    let want = Arc::new(reference(&ins, ReduceOp::Sum));
    let t0 = Instant::now();
    let ins2 = Arc::clone(&ins);
    let want2 = Arc::clone(&want);
    on_all(&gs, move |me, g| {
        let (ins, want) = (Arc::clone(&ins2), Arc::clone(&want2));
        async move {
            let mut t = ins[me].clone();
            g.all_reduce(&mut t, ReduceOp::Sum).await.unwrap();
            assert_same(&t, &want, "16 MiB all_reduce");
            let mut t = if me == 1 {
                ins[1].clone()
            } else {
                Tensor::zeros(DType::F32, [N]).unwrap()
            };
            g.broadcast(&mut t, Rank(1)).await.unwrap();
            assert_same(&t, &ins[1], "16 MiB broadcast");
            // 16 MiB input, a third each out (4 Mi is not divisible by 3: use 3 × (N/3)).
            let m = N / 3;
            let input = slice(&ins[me], 0..3 * m);
            let mut out = Tensor::zeros(DType::F32, [m]).unwrap();
            g.reduce_scatter_tensor(&mut out, &input, ReduceOp::Sum)
                .await
                .unwrap();
            assert_same(&out, &slice(&want, me * m..(me + 1) * m), "reduce_scatter_tensor");
        }
    })
    .await;
    println!(
        "16 MiB all_reduce + broadcast + reduce_scatter over 3 ranks (debug): {:?}",
        t0.elapsed()
    );
}

/// Ring reductions of general floats stay within the documented bound of the
/// rank-order reference; direct ones equal it exactly; every rank gets the same
/// bits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn float_rounding_within_documented_bound() {
    let n = 5usize;
    let gs = groups("floats", n as u32).await;
    const LEN: usize = 10_007;
    let len = LEN;
    let values = |r: usize| -> Vec<f64> {
        let mut rng = Rng::new(r as u64 + 77);
        (0..LEN)
            .map(|_| {
                let x = (rng.next_u64() % 2_000_001) as f64 / 1000.0 - 1000.0;
                x * 1.000_000_1f64.powi((rng.next_u64() % 50) as i32)
            })
            .collect()
    };
    let outs = on_all(&gs, move |me, g| async move {
        let mut res = Vec::new();
        for algo in ALGOS {
            let g = g.with_config(CollectiveConfig::default().with_algorithm(algo));
            let mut a = Tensor::from(values(me).iter().map(|&x| x as f32).collect::<Vec<_>>());
            g.all_reduce(&mut a, ReduceOp::Sum).await.unwrap();
            let mut b = Tensor::from(values(me));
            g.all_reduce(&mut b, ReduceOp::Avg).await.unwrap();
            let mut h = Tensor::from(
                values(me)
                    .iter()
                    .map(|&x| f16::from_f64(x / 100.0))
                    .collect::<Vec<_>>(),
            );
            g.all_reduce(&mut h, ReduceOp::Sum).await.unwrap();
            let mut bf = Tensor::from(values(me).iter().map(|&x| bf16::from_f64(x)).collect::<Vec<_>>());
            g.all_reduce(&mut bf, ReduceOp::Sum).await.unwrap();
            res.push((a, b, h, bf));
        }
        res
    })
    .await;
    let inputs: Vec<Vec<f64>> = (0..n).map(values).collect();
    // |ring - exact| and |reference - exact| are each at most (n-1)·u·Σ|x|.
    let check = |got: &[f64], xs: &dyn Fn(usize, usize) -> f64, u: f64, what: &str| {
        assert_eq!(got.len(), len, "{what}");
        for (i, &g) in got.iter().enumerate() {
            let mut seq = xs(0, i);
            let mut abs = xs(0, i).abs();
            for r in 1..n {
                seq += xs(r, i);
                abs += xs(r, i).abs();
            }
            let bound = 2.0 * (n as f64 - 1.0) * u * abs + 1e-300;
            let err = (g - seq).abs();
            assert!(
                err <= bound,
                "{what} element {i}: got {g}, reference {seq}, error {err} > {bound}"
            );
        }
    };
    for (ai, algo) in ALGOS.iter().enumerate() {
        // Same bits on every rank.
        for r in 1..n {
            assert_same(&outs[r][ai].0, &outs[0][ai].0, "f32 sum agrees across ranks");
            assert_same(&outs[r][ai].1, &outs[0][ai].1, "f64 avg agrees across ranks");
            assert_same(&outs[r][ai].2, &outs[0][ai].2, "f16 sum agrees across ranks");
            assert_same(&outs[r][ai].3, &outs[0][ai].3, "bf16 sum agrees across ranks");
        }
        let (a, b, h, bf) = &outs[0][ai];
        let f32s: Vec<Vec<f32>> = inputs
            .iter()
            .map(|v| v.iter().map(|&x| x as f32).collect())
            .collect();
        let got: Vec<f64> = a.as_slice::<f32>().unwrap().iter().map(|&x| x as f64).collect();
        check(
            &got,
            &|r, i| f32s[r][i] as f64,
            f32::EPSILON as f64 / 2.0,
            &format!("{algo:?} f32 sum"),
        );
        let got: Vec<f64> = b
            .as_slice::<f64>()
            .unwrap()
            .iter()
            .map(|&x| x * n as f64)
            .collect();
        check(
            &got,
            &|r, i| inputs[r][i],
            f64::EPSILON,
            &format!("{algo:?} f64 avg"),
        );
        let hs: Vec<Vec<f16>> = inputs
            .iter()
            .map(|v| v.iter().map(|&x| f16::from_f64(x / 100.0)).collect())
            .collect();
        let got: Vec<f64> = h.as_slice::<f16>().unwrap().iter().map(|x| x.to_f64()).collect();
        check(
            &got,
            &|r, i| hs[r][i].to_f64(),
            2f64.powi(-11),
            &format!("{algo:?} f16 sum"),
        );
        let bs: Vec<Vec<bf16>> = inputs
            .iter()
            .map(|v| v.iter().map(|&x| bf16::from_f64(x)).collect())
            .collect();
        let got: Vec<f64> = bf
            .as_slice::<bf16>()
            .unwrap()
            .iter()
            .map(|x| x.to_f64())
            .collect();
        check(
            &got,
            &|r, i| bs[r][i].to_f64(),
            2f64.powi(-8),
            &format!("{algo:?} bf16 sum"),
        );
        if *algo == Algorithm::Direct {
            // Direct reductions are exactly the rank-order reference.
            let seq: Vec<f32> = (0..len)
                .map(|i| (1..n).fold(f32s[0][i], |acc, r| acc + f32s[r][i]))
                .collect();
            assert_same(a, &Tensor::from(seq), "direct f32 sum is the rank-order sum");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sub_groups() {
    let gs = groups("subgroups", 5).await;
    on_all(&gs, |me, world| async move {
        // Every rank calls new_group, in the same order; ranks in any order.
        let g = world.new_group(&[Rank(4), Rank(1), Rank(3)]).await.unwrap();
        assert_eq!(g.ranks(), &[Rank(1), Rank(3), Rank(4)]);
        assert_ne!(g.id(), 0);
        let member = [1, 3, 4].contains(&me);
        assert_eq!(g.is_member(), member);
        let pair = world.new_group(&[Rank(0), Rank(2)]).await.unwrap();
        assert_ne!(pair.id(), g.id());
        if member {
            // A collective on the sub-group, while the world group is used too.
            let gi = g.group_rank().unwrap();
            let mut t = Tensor::from(vec![me as i32; 3]);
            let h = g.all_reduce_handle(t.clone(), ReduceOp::Sum);
            t = h.wait().await.unwrap();
            assert_eq!(t.as_slice::<i32>().unwrap(), &[8, 8, 8]);
            let mut b = Tensor::from(vec![gi as u8; 4]);
            g.broadcast(&mut b, Rank(3)).await.unwrap();
            assert_eq!(b.as_slice::<u8>().unwrap(), &[1; 4], "root 3 is member index 1");
            // A sub-group of the sub-group: only its members call.
            let inner = g.new_group(&[Rank(3), Rank(4)]).await.unwrap();
            assert!(inner.id() != g.id() && inner.id() != pair.id());
            if inner.is_member() {
                let all: Vec<usize> = inner.all_gather_object(&me).await.unwrap();
                assert_eq!(all, vec![3, 4]);
            } else {
                let e = inner.barrier().await.unwrap_err();
                assert!(e.to_string().contains("not a member"), "{e}");
            }
            // Point-to-point inside the group refuses reserved tags.
            let e = g.send(Rank(1), Tag(1 << 31), &[1u8]).await.unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
        } else {
            let mut t = Tensor::from(vec![1.0f32]);
            let e = g.all_reduce(&mut t, ReduceOp::Sum).await.unwrap_err();
            assert!(
                matches!(&e, Error::InvalidArgument(m) if m.contains("not a member")),
                "{e}"
            );
            let all: Vec<usize> = pair.all_gather_object(&me).await.unwrap();
            assert_eq!(all, vec![0, 2]);
        }
        // Calls on the world and on the sub-group at the same time, from separate
        // tasks, sharing the same connections (ring-sized buffers).
        let w = world.all_reduce_handle(Tensor::from(vec![1.0f32; 300_000]), ReduceOp::Sum);
        let s = member.then(|| g.all_reduce_handle(Tensor::from(vec![2.0f32; 300_000]), ReduceOp::Sum));
        let w = w.await.unwrap();
        assert!(w.as_slice::<f32>().unwrap().iter().all(|&x| x == 5.0));
        if let Some(s) = s {
            assert!(
                s.await
                    .unwrap()
                    .as_slice::<f32>()
                    .unwrap()
                    .iter()
                    .all(|&x| x == 6.0)
            );
        }
        // The world group still works, and agrees across members and non-members.
        let mut t = Tensor::from(vec![1u64]);
        world.all_reduce(&mut t, ReduceOp::Sum).await.unwrap();
        assert_eq!(t.as_slice::<u64>().unwrap(), &[5]);
        // A member list that is not a subset, or differs between ranks, fails on
        // every rank.
        let e = world.new_group(&[Rank(0), Rank(9)]).await.unwrap_err();
        assert!(e.to_string().contains("rank 9"), "{e}");
        let list = if me == 0 {
            vec![Rank(0), Rank(1)]
        } else {
            vec![Rank(0), Rank(2)]
        };
        let e = world.new_group(&list).await.unwrap_err();
        assert!(
            e.to_string().contains("member list") || e.to_string().contains("rejected"),
            "{e}"
        );
        world.barrier().await.unwrap();
    })
    .await;
}

/// Two sub-groups of the same ranks, created at the same time from two
/// different parent groups, get distinct ids at the members they share — even
/// when the members' id counters have drifted apart — so their calls never
/// take each other's messages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sub_groups_created_at_once_from_different_parents_get_distinct_ids() {
    let gs = groups("concurrent-subgroups", 4).await;
    on_all(&gs, |me, world| async move {
        let a = world.new_group(&[Rank(0), Rank(1), Rank(2)]).await.unwrap();
        let b = world.new_group(&[Rank(1), Rank(2), Rank(3)]).await.unwrap();
        let c = world.new_group(&[Rank(0), Rank(3)]).await.unwrap();
        // Ranks 0 and 3 create one group more than ranks 1 and 2: their
        // id counters run one ahead.
        if c.is_member() {
            c.new_group(&[Rank(0), Rank(3)]).await.unwrap();
        }
        // Ranks 1 and 2 create a sub-group {1, 2} of `a` and one of `b` at
        // the same time.
        let pair = [Rank(1), Rank(2)];
        let (p, q) = match me {
            0 => (Some(a.new_group(&pair).await.unwrap()), None),
            3 => (None, Some(b.new_group(&pair).await.unwrap())),
            _ => {
                let (p, q) = tokio::join!(a.new_group(&pair), b.new_group(&pair));
                (Some(p.unwrap()), Some(q.unwrap()))
            }
        };
        if let (Some(p), Some(q)) = (&p, &q) {
            assert_ne!(p.id(), q.id(), "rank {me}: both sub-groups got id {}", p.id());
            // The same call on both at once: each sums only its own inputs.
            let hp = p.all_reduce_handle(Tensor::from(vec![1.0f32; 1000]), ReduceOp::Sum);
            let hq = q.all_reduce_handle(Tensor::from(vec![10.0f32; 1000]), ReduceOp::Sum);
            let (tp, tq) = (hp.await.unwrap(), hq.await.unwrap());
            assert!(
                tp.as_slice::<f32>().unwrap().iter().all(|&x| x == 2.0),
                "rank {me}: p"
            );
            assert!(
                tq.as_slice::<f32>().unwrap().iter().all(|&x| x == 20.0),
                "rank {me}: q"
            );
        }
        // Every member agrees on each group's id.
        for g in [&p, &q].into_iter().flatten().filter(|g| g.is_member()) {
            let ids: Vec<u16> = g
                .all_gather_object(&g.id())
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            assert!(ids.iter().all(|&i| i == g.id()), "rank {me}: ids {ids:?}");
        }
        world.barrier().await.unwrap();
    })
    .await;
}

/// Two members creating sub-groups of two shared parents at the same time,
/// in opposite orders, so that each claims the first agreed id for a
/// different group: they agree again until both groups have an id, and the
/// ids differ.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sub_groups_created_at_once_in_opposite_orders_all_get_ids() {
    let gs = groups("crossed-subgroups", 2).await;
    on_all(&gs, |me, world| async move {
        let a = world.new_group(&[Rank(0), Rank(1)]).await.unwrap();
        let b = world.new_group(&[Rank(0), Rank(1)]).await.unwrap();
        let pair = [Rank(0), Rank(1)];
        for round in 0..20 {
            let (p, q) = if me == 0 {
                tokio::join!(a.new_group(&pair), b.new_group(&pair))
            } else {
                let (q, p) = tokio::join!(b.new_group(&pair), a.new_group(&pair));
                (p, q)
            };
            let (p, q) = (
                p.unwrap_or_else(|e| panic!("rank {me} round {round}: {e}")),
                q.unwrap_or_else(|e| panic!("rank {me} round {round}: {e}")),
            );
            assert_ne!(p.id(), q.id(), "rank {me} round {round}");
            let ids: Vec<u16> = p.all_gather_object(&p.id()).await.unwrap();
            assert!(ids.iter().all(|&i| i == p.id()), "round {round}: {ids:?}");
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handles_keep_call_order_and_report_completion() {
    let gs = groups("handles", 3).await;
    on_all(&gs, |me, g| async move {
        let a = g.all_reduce_handle(Tensor::from(vec![me as f64; 5]), ReduceOp::Sum);
        let b = g.broadcast_handle(Tensor::from(vec![me as u16; 70_000]), Rank(2));
        let c = g.barrier_handle();
        let d = g.all_gather_into_tensor_handle(
            Tensor::zeros(DType::I8, [3]).unwrap(),
            Tensor::from(vec![me as i8]),
        );
        let e = g.reduce_scatter_tensor_handle(
            Tensor::zeros(DType::U32, [2]).unwrap(),
            Tensor::from(vec![1u32, 2, 3, 4, 5, 6]),
            ReduceOp::Product,
        );
        let f = g.all_gather_object_handle(format!("r{me}"));
        // Wait in reverse order: each call still ran in issue order.
        assert_eq!(f.wait().await.unwrap(), vec!["r0", "r1", "r2"]);
        let e = e.await.unwrap();
        assert_eq!(e.as_slice::<u32>().unwrap(), &[[1, 8], [27, 64], [125, 216]][me]);
        let d = d.wait().await.unwrap();
        assert_eq!(d.as_slice::<i8>().unwrap(), &[0, 1, 2]);
        assert!(c.is_completed());
        c.await.unwrap();
        let b = b.wait().await.unwrap();
        assert!(b.as_slice::<u16>().unwrap().iter().all(|&x| x == 2));
        let a = a.wait().await.unwrap();
        assert_eq!(a.as_slice::<f64>().unwrap(), &[3.0; 5]);
        // A handle that is never awaited still completes (dropping does not cancel).
        drop(g.all_reduce_handle(Tensor::from(vec![1i16]), ReduceOp::Sum));
        let mut t = Tensor::from(vec![2i16]);
        g.all_reduce(&mut t, ReduceOp::Sum).await.unwrap();
        assert_eq!(t.as_slice::<i16>().unwrap(), &[6]);
    })
    .await;
}

/// `Group::world` called twice for one communicator shares the call sequence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn world_group_state_is_per_communicator() {
    let gs = groups("twice", 2).await;
    on_all(&gs, |me, g| async move {
        let g2 = Group::world(g.comm());
        let mut t = Tensor::from(vec![1u8]);
        g.all_reduce(&mut t, ReduceOp::Sum).await.unwrap();
        // Rank 0 uses the first handle again, rank 1 the second: same sequence.
        let second = if me == 0 { &g } else { &g2 };
        second.all_reduce(&mut t, ReduceOp::Sum).await.unwrap();
        assert_eq!(t.as_slice::<u8>().unwrap(), &[4]);
        assert!(g.scratch_bytes().await < 1 << 20);
        g.release_scratch().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn object_size_limit_is_enforced_on_every_rank() {
    let gs = groups("objlimit", 3).await;
    on_all(&gs, |me, g| async move {
        let mut cfg = CollectiveConfig::default();
        cfg.max_object_bytes = 64;
        let g = g.with_config(cfg);
        // Rank 1's object is too large: it fails locally, the others hear of it.
        let v = if me == 1 { "y".repeat(500) } else { "x".to_owned() };
        let e = g.all_gather_object(&v).await.unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
        let v: String = g
            .broadcast_object(Some(&"small".to_owned()), Rank(0))
            .await
            .unwrap();
        assert_eq!(v, "small");
    })
    .await;
}
