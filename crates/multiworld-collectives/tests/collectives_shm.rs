//! The same-host shared-memory all-reduce (`Algorithm::SharedMemory`, and
//! `Algorithm::Auto` above `shm_min_bytes`) between in-process ranks: every
//! dtype × reduce op on 2, 3 and 5 ranks, bit for bit equal to the sequential
//! rank-order reference even with general (non-integer) floats; tensors that go
//! through the segment in many pieces, back to back and interleaved with other
//! operations and handle forms; gather, scatter and the all-to-alls with
//! uneven sizes, forced and under Auto (and its eager exception); the Auto
//! threshold on 1 to 8 ranks; one 16 MiB
//! case; a member that declines (the group falls back to the ring for good);
//! sub-groups with their own segments, set up and used concurrently with the
//! world's; settings that disagree; a member lost in the middle of a call; a
//! member that never calls; no file descriptor or mapping left behind.
//!
//! The tests run one at a time (see [`run`]): they measure time, count file
//! descriptors and mappings of this process, and share two cores.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use multiworld_collectives::{Algorithm, CollectiveConfig, Group, SharedMemory};
use multiworld_tcp::{DType, Error, Rank, Tensor, bf16, f16};
use multiworld_testkit::coll::*;
use multiworld_testkit::eventually;
use multiworld_types::ReduceOp;

/// Size of a group of `n`'s segment with the default pieces of 1 MiB: a 4 KiB
/// header, the descriptor slots (two per member, whole pages) and three
/// buffers of one piece per member (see `CollectiveConfig::shm_piece_bytes`).
fn default_segment(n: usize) -> usize {
    segment(n, 1 << 20)
}

/// Size of a group of `n`'s segment with pieces of `piece` bytes.
fn segment(n: usize, piece: usize) -> usize {
    let descriptor_words = 8 + 2 * n;
    4096 + (2 * n * descriptor_words * 8).next_multiple_of(4096) + 3 * n * piece
}

/// Runs one test on its own runtime (multi-thread, 2 workers), one test of this
/// file at a time, so that timings, descriptor counts and mappings are this
/// test's own; the runtime is shut down before the next test starts.
fn run<F: Future>(f: F) -> F::Output {
    static SERIAL: Mutex<()> = Mutex::new(());
    let _one_at_a_time = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let out = rt.block_on(f);
    drop(rt);
    out
}

fn shm_cfg() -> CollectiveConfig {
    CollectiveConfig::default().with_algorithm(Algorithm::SharedMemory)
}

/// A config with pieces of `piece` bytes.
fn small_pieces(piece: usize) -> CollectiveConfig {
    let mut c = shm_cfg();
    c.shm_piece_bytes = piece;
    c
}

async fn statuses(gs: &[Group]) -> Vec<SharedMemory> {
    let mut out = Vec::new();
    for g in gs {
        out.push(g.shared_memory().await);
    }
    out
}

#[track_caller]
fn assert_all(got: &[SharedMemory], want: &SharedMemory, what: &str) {
    for (r, s) in got.iter().enumerate() {
        assert_eq!(s, want, "{what}: member {r}");
    }
}

/// Rank `rank`'s input: for floats, general values `±(1 + m) × 2^e` (random
/// mantissa bits, exponents spread over a range; never zero, infinite or NaN),
/// so that sums and products round and only the rank-order reduction gives the
/// reference's bits; other dtypes as [`input`].
fn general_input(dtype: DType, numel: usize, rank: usize, seed: u64) -> Tensor {
    let mut r = Rng::new(seed ^ ((rank as u64 + 1) * 0x9e37_79b9) ^ (numel as u64).rotate_left(17));
    let mut val = |bits: u32, e_max: u64| -> f64 {
        let m = (r.next_u64() >> 11) & ((1u64 << bits) - 1);
        let e = (r.next_u64() % (2 * e_max + 1)) as i32 - e_max as i32;
        let s = if r.next_u64() & 1 == 1 { -1.0 } else { 1.0 };
        s * (1.0 + m as f64 / (1u64 << bits) as f64) * 2f64.powi(e)
    };
    match dtype {
        DType::F16 => Tensor::from((0..numel).map(|_| f16::from_f64(val(10, 3))).collect::<Vec<_>>()),
        DType::BF16 => Tensor::from((0..numel).map(|_| bf16::from_f64(val(7, 12))).collect::<Vec<_>>()),
        DType::F32 => Tensor::from((0..numel).map(|_| val(23, 20) as f32).collect::<Vec<_>>()),
        DType::F64 => Tensor::from((0..numel).map(|_| val(52, 40)).collect::<Vec<_>>()),
        d => input(d, numel, rank, seed),
    }
}

/// Payload bytes this member has sent to the other members so far.
fn bytes_sent(g: &Group) -> u64 {
    g.ranks()
        .iter()
        .filter_map(|&r| g.comm().peer_stats(r))
        .map(|s| s.bytes_sent)
        .sum()
}

/// A sum all-reduce of `ins[rank]` on every member, checked bit for bit against
/// the rank-order reference; returns the payload bytes each member sent over
/// TCP meanwhile.
async fn sum_checked(gs: &[Group], ins: Vec<Tensor>, what: &str) -> Vec<u64> {
    let want = Arc::new(reference(&ins, ReduceOp::Sum));
    let ins = Arc::new(ins);
    let what: Arc<str> = what.into();
    on_all(gs, move |me, g| {
        let (ins, want, what) = (Arc::clone(&ins), Arc::clone(&want), Arc::clone(&what));
        async move {
            let before = bytes_sent(&g);
            let mut t = ins[me].clone();
            g.all_reduce(&mut t, ReduceOp::Sum).await.unwrap();
            assert_same(&t, &want, &what);
            bytes_sent(&g) - before
        }
    })
    .await
}

/// The state of a group whose segment is set up.
fn active(segment_bytes: usize) -> SharedMemory {
    SharedMemory::Active { segment_bytes }
}

// ------------------------------------------------------------------- 1. matrix

const MATRIX_LENGTHS: [usize; 5] = [0, 1, 4, 1009, 3031];

/// Every (dtype, reduce op) pair through the shared-memory all-reduce on `n`
/// ranks; undefined pairs fail with InvalidArgument as with the other algorithms.
async fn shm_matrix(n: u32) {
    let gs = with_cfg(&groups(&format!("shm-matrix-{n}"), n).await, &shm_cfg());
    assert_all(&statuses(&gs).await, &SharedMemory::Untried, "before any call");
    let t0 = Instant::now();
    let counts = on_all(&gs, |me, g| async move {
        let n = g.size();
        let mut checked = 0usize;
        for dtype in DType::ALL {
            for op in ReduceOp::ALL {
                for len in MATRIX_LENGTHS {
                    let seed = seed_of(&[dtype.code().into(), op as u64, len as u64, n as u64]);
                    let what = format!("n={n} shm {dtype} {op} len={len}");
                    let ins: Vec<Tensor> = (0..n).map(|r| general_input(dtype, len, r, seed)).collect();
                    if !op.supports(dtype) {
                        assert_undefined_op_refused(&g, &ins[me], op, &what).await;
                        continue;
                    }
                    let mut t = ins[me].clone();
                    let want = reference(&ins, op);
                    g.all_reduce(&mut t, op).await.unwrap();
                    assert_same(&t, &want, &format!("all_reduce {what}"));
                    // Reduce to a root that moves with the length: only the
                    // root's tensor changes.
                    let root = len % n;
                    let mut t = ins[me].clone();
                    g.reduce(&mut t, Rank(root as u32), op).await.unwrap();
                    let want = if me == root {
                        reference(&ins, op)
                    } else {
                        ins[me].clone()
                    };
                    assert_same(&t, &want, &format!("reduce to {root} {what}"));
                    // Reduce-scatter: of one tensor (segments of `len`), and
                    // of lists whose segments differ in length (`len + q`).
                    let big: Vec<Tensor> = (0..n)
                        .map(|r| general_input(dtype, n * len, r, seed ^ 1))
                        .collect();
                    let mut out = Tensor::zeros(dtype, [len]).unwrap();
                    g.reduce_scatter_tensor(&mut out, &big[me], op).await.unwrap();
                    let want = slice(&reference(&big, op), me * len..(me + 1) * len);
                    assert_same(&out, &want, &format!("reduce_scatter_tensor {what}"));
                    let lists: Vec<Vec<Tensor>> = (0..n)
                        .map(|r| {
                            (0..n)
                                .map(|q| general_input(dtype, len + q, r, seed ^ (2 + q as u64)))
                                .collect()
                        })
                        .collect();
                    let mut out = Tensor::zeros(dtype, [len + me]).unwrap();
                    g.reduce_scatter(&mut out, &lists[me], op).await.unwrap();
                    let mine: Vec<Tensor> = lists.iter().map(|l| l[me].clone()).collect();
                    assert_same(&out, &reference(&mine, op), &format!("reduce_scatter {what}"));
                    checked += 1;
                }
            }
        }
        checked
    })
    .await;
    println!(
        "n={n}: {} checked shm all-reduces per rank in {:?}",
        counts[0],
        t0.elapsed()
    );
    assert!(counts.iter().all(|&c| c == counts[0] && c > 0));
    assert_all(
        &statuses(&gs).await,
        &active(default_segment(n as usize)),
        &format!("n={n} after the matrix"),
    );
}

#[test]
fn every_dtype_and_reduce_op_bit_exact_in_rank_order() {
    // The inputs have the power to tell the orders apart: with 3 or more ranks,
    // summing general floats in another order changes some bits.
    let ins: Vec<Tensor> = (0..3).map(|r| general_input(DType::F32, 1009, r, 1)).collect();
    let reversed: Vec<Tensor> = ins.iter().rev().cloned().collect();
    assert_ne!(
        reference(&ins, ReduceOp::Sum).as_bytes(),
        reference(&reversed, ReduceOp::Sum).as_bytes(),
        "general float inputs must depend on the order of the ranks"
    );
    run(async {
        for n in [2, 3, 5] {
            shm_matrix(n).await;
        }
    });
}

// --------------------------------------------------------------- 2. many pieces

#[test]
fn tensors_larger_than_a_piece_go_through_in_pieces() {
    run(async {
        const N: usize = 3;
        const PIECE: usize = 4096;
        let cfg = small_pieces(PIECE);
        let seg = segment(N, PIECE);
        let gs = with_cfg(&groups("shm-pieces", N as u32).await, &cfg);
        // Bool tensors never go through the segment (every operation of
        // them runs as with `Algorithm::Ring`), so it is not set up.
        on_all(&gs, |me, g| async move {
            let ins: Vec<Tensor> = (0..N).map(|r| input(DType::Bool, 5_000, r, 21)).collect();
            let mut out = Tensor::zeros(DType::Bool, [N * 5_000]).unwrap();
            g.all_gather_into_tensor(&mut out, &ins[me]).await.unwrap();
            assert_same(&out, &concat(&ins), "all_gather (bool)");
        })
        .await;
        assert_all(
            &statuses(&gs).await,
            &SharedMemory::Untried,
            "after other operations",
        );
        // Reduce-scatter in many parts (1344 bytes per pair and step), of one
        // tensor and of lists with segments of different lengths, general
        // floats in rank order.
        on_all(&gs, |me, g| async move {
            let big: Vec<Tensor> = (0..N)
                .map(|r| general_input(DType::BF16, N * 10_007, r, 21))
                .collect();
            let want_big = reference(&big, ReduceOp::Avg);
            let mut out = Tensor::zeros(DType::BF16, [10_007]).unwrap();
            g.reduce_scatter_tensor(&mut out, &big[me], ReduceOp::Avg)
                .await
                .unwrap();
            assert_same(
                &out,
                &slice(&want_big, me * 10_007..(me + 1) * 10_007),
                "reduce_scatter_tensor",
            );
            let len = |q: usize| [3 * PIECE, 1, 0][q] + 7 * q;
            let lists: Vec<Vec<Tensor>> = (0..N)
                .map(|r| {
                    (0..N)
                        .map(|q| general_input(DType::F64, len(q), r, 30 + q as u64))
                        .collect()
                })
                .collect();
            let mut out = Tensor::zeros(DType::F64, [len(me)]).unwrap();
            g.reduce_scatter(&mut out, &lists[me], ReduceOp::Sum)
                .await
                .unwrap();
            let mine: Vec<Tensor> = lists.iter().map(|l| l[me].clone()).collect();
            assert_same(&out, &reference(&mine, ReduceOp::Sum), "reduce_scatter (list)");
        })
        .await;
        assert_all(&statuses(&gs).await, &active(seg), "after reduce-scatters");
        // All-gather into a list whose tensors differ in length (many pieces,
        // none, less than one), from the segment as well.
        on_all(&gs, |me, g| async move {
            let len = |r: usize| [3 * PIECE + 5, 0, 17][r];
            let ins: Vec<Tensor> = (0..N).map(|r| input(DType::U8, len(r), r, 23)).collect();
            let mut outs: Vec<Tensor> = (0..N)
                .map(|r| Tensor::zeros(DType::U8, [len(r)]).unwrap())
                .collect();
            let before = bytes_sent(&g);
            g.all_gather(&mut outs, &ins[me]).await.unwrap();
            for (p, o) in outs.iter().enumerate() {
                assert_same(o, &ins[p], "all_gather (list)");
            }
            let sent = bytes_sent(&g) - before;
            assert!(
                sent <= TCP_ONLY_ORDERS,
                "all_gather (list): {sent} bytes over TCP"
            );
        })
        .await;
        // Reduce goes through the segment too (in pieces, to a root that is
        // not member 0; the others' tensors stay as they were).
        on_all(&gs, |me, g| async move {
            let ins: Vec<Tensor> = (0..N).map(|r| input(DType::F32, 30_001, r, 20)).collect();
            let want = reference(&ins, ReduceOp::Sum);
            let mut t = ins[me].clone();
            g.reduce(&mut t, Rank(2), ReduceOp::Sum).await.unwrap();
            assert_same(&t, if me == 2 { &want } else { &ins[me] }, "reduce");
        })
        .await;
        assert_all(&statuses(&gs).await, &active(seg), "after a reduce");
        // Broadcast goes through the segment too, piece by piece, from any
        // root: many pieces, exactly one, one and a byte, under one, none.
        let edges = [
            (DType::I16, 40_000),
            (DType::U8, PIECE),
            (DType::U8, PIECE + 1),
            (DType::F64, 100),
            (DType::F32, 0),
            (DType::I64, 3 * PIECE / 8 + 7),
        ];
        on_all(&gs, move |me, g| async move {
            for (k, (dtype, numel)) in edges.into_iter().enumerate() {
                let root = k % N;
                let src = input(dtype, numel, root, 22 + k as u64);
                let mut t = if me == root {
                    src.clone()
                } else {
                    Tensor::zeros(dtype, [numel]).unwrap()
                };
                g.broadcast(&mut t, Rank(root as u32)).await.unwrap();
                assert_same(&t, &src, &format!("broadcast {dtype} x {numel} from {root}"));
            }
        })
        .await;
        assert_all(&statuses(&gs).await, &active(seg), "after broadcasts");
        // All-gather into one tensor, the same edges: every member's bytes
        // in member order.
        on_all(&gs, move |me, g| async move {
            for (k, (dtype, numel)) in edges.into_iter().enumerate() {
                let ins: Vec<Tensor> = (0..N).map(|r| input(dtype, numel, r, 40 + k as u64)).collect();
                let mut out = Tensor::zeros(dtype, [N * numel]).unwrap();
                g.all_gather_into_tensor(&mut out, &ins[me]).await.unwrap();
                let want: Vec<u8> = ins.iter().flat_map(|t| t.as_bytes().to_vec()).collect();
                assert_eq!(out.as_bytes(), &want[..], "all_gather {dtype} x {numel}");
            }
        })
        .await;
        let t0 = Instant::now();
        // Back to back: many pieces, exactly one piece, one piece and one
        // element, whole pieces, and dtypes of every width in successive calls.
        let calls: Vec<(DType, ReduceOp, usize)> = vec![
            (DType::F32, ReduceOp::Sum, 300_007),
            (DType::F64, ReduceOp::Avg, PIECE / 8),
            (DType::F64, ReduceOp::Product, PIECE / 8 + 1),
            (DType::I8, ReduceOp::Sum, PIECE * 7 + 5),
            (DType::BF16, ReduceOp::Max, PIECE / 2 * 3),
            (DType::U64, ReduceOp::BXor, 20_001),
            (DType::F16, ReduceOp::Sum, 50_001),
            (DType::Bool, ReduceOp::Min, 9_999),
            (DType::F32, ReduceOp::Avg, 2 * PIECE / 4 - 1),
        ];
        let calls = Arc::new(calls);
        on_all(&gs, move |me, g| {
            let calls = Arc::clone(&calls);
            async move {
                for (i, &(dtype, op, len)) in calls.iter().enumerate() {
                    let ins: Vec<Tensor> = (0..N).map(|r| general_input(dtype, len, r, i as u64)).collect();
                    let mut t = ins[me].clone();
                    g.all_reduce(&mut t, op).await.unwrap();
                    assert_same(
                        &t,
                        &reference(&ins, op),
                        &format!("call {i}: {dtype} {op} len={len}"),
                    );
                }
            }
        })
        .await;
        println!("back-to-back calls in {:?}", t0.elapsed());
        // Handle forms, started back to back and interleaved with other
        // operations, then awaited.
        let t0 = Instant::now();
        on_all(&gs, |me, g| async move {
            let ar = |dtype: DType, len: usize, seed: u64| -> Vec<Tensor> {
                (0..N).map(|r| general_input(dtype, len, r, seed)).collect()
            };
            let a = ar(DType::F32, 100_003, 10);
            let b = ar(DType::F64, 7_777, 11);
            let c = ar(DType::I32, 4_099, 12);
            let bc = general_input(DType::U8, 50_000, 1, 13);
            let gin: Vec<Tensor> = (0..N)
                .map(|r| general_input(DType::BF16, 1_000 + r, r, 14))
                .collect();

            let h1 = g.all_reduce_handle(a[me].clone(), ReduceOp::Sum);
            let bt = if me == 1 {
                bc.clone()
            } else {
                Tensor::zeros(DType::U8, [50_000]).unwrap()
            };
            let h2 = g.broadcast_handle(bt, Rank(1));
            let h3 = g.all_reduce_handle(b[me].clone(), ReduceOp::Avg);
            let outs: Vec<Tensor> = (0..N)
                .map(|r| Tensor::zeros(DType::BF16, [1_000 + r]).unwrap())
                .collect();
            let h4 = g.all_gather_handle(outs, gin[me].clone());
            let h5 = g.all_reduce_handle(c[me].clone(), ReduceOp::Max);
            let h6 = g.all_reduce_handle(Tensor::zeros(DType::F32, [0]).unwrap(), ReduceOp::Sum);
            // A blocking-style call queued behind them.
            let mut d = a[me].clone();
            g.all_reduce(&mut d, ReduceOp::Product).await.unwrap();

            assert_same(&h1.await.unwrap(), &reference(&a, ReduceOp::Sum), "handle 1");
            assert_same(&h2.await.unwrap(), &bc, "broadcast between");
            assert_same(&h3.await.unwrap(), &reference(&b, ReduceOp::Avg), "handle 3");
            for (r, o) in h4.await.unwrap().iter().enumerate() {
                assert_same(o, &gin[r], &format!("all_gather output {r}"));
            }
            assert_same(&h5.await.unwrap(), &reference(&c, ReduceOp::Max), "handle 5");
            assert_eq!(h6.await.unwrap().numel(), 0);
            assert_same(
                &d,
                &reference(&a, ReduceOp::Product),
                "blocking call after handles",
            );
        })
        .await;
        println!("handles in {:?}", t0.elapsed());
        assert_all(&statuses(&gs).await, &active(seg), "small segment");
    });
}

// ------------------------------- 2b. gather, scatter and the all-to-alls

/// The most a member of 3 sends over TCP in a call whose data go through
/// shared memory: its descriptor (14 words) to each other member, and in
/// the call that sets the segment up, an offer (6 words) and a verdict (2)
/// to each (member 0) or an answer (1 word, the others).
const TCP_ONLY_ORDERS: u64 = 2 * (14 + 6 + 2) * 8;

/// A call sized after the agreement, as the tests below run it.
#[derive(Clone, Copy, Debug)]
enum Moving {
    Gather(usize),
    Scatter(usize),
    AllToAll,
    AllToAllSingle,
}

/// Elements member `p` sends member `q`.
type Sizes = Arc<dyn Fn(usize, usize) -> usize + Send + Sync>;

/// What member `p` sends member `q` (deterministic, so every member knows
/// every other member's data).
fn piece_of(dtype: DType, sizes: &Sizes, p: usize, q: usize, n: usize, seed: u64) -> Tensor {
    input(dtype, sizes(p, q), p * n + q, seed)
}

/// One `call` on every member of `gs`, member `p` sending `sizes(p, q)`
/// elements of `dtype` to member `q` (as the call allows: a gather's members
/// to the root, a scatter's root to each), checked byte for byte; returns the
/// payload bytes each member sent over TCP meanwhile.
async fn moved_checked(
    gs: &[Group],
    call: Moving,
    dtype: DType,
    sizes: Sizes,
    seed: u64,
    what: &str,
) -> Vec<u64> {
    let what: Arc<str> = format!("{what}: {call:?} of {dtype}").into();
    on_all(gs, move |me, g| {
        let (sizes, what) = (Arc::clone(&sizes), Arc::clone(&what));
        async move {
            let n = g.size();
            let mine = |q: usize| piece_of(dtype, &sizes, me, q, n, seed);
            let theirs = |p: usize| piece_of(dtype, &sizes, p, me, n, seed);
            let zeros = |len: usize| Tensor::zeros(dtype, [len]).unwrap();
            let before = bytes_sent(&g);
            match call {
                Moving::Gather(root) => {
                    let input = mine(root);
                    let mut outs =
                        (me == root).then(|| (0..n).map(|p| zeros(sizes(p, root))).collect::<Vec<_>>());
                    g.gather(&input, outs.as_deref_mut(), Rank(root as u32))
                        .await
                        .unwrap();
                    for (p, o) in outs.iter().flatten().enumerate() {
                        assert_same(
                            o,
                            &piece_of(dtype, &sizes, p, root, n, seed),
                            &format!("{what}: from {p}"),
                        );
                    }
                }
                Moving::Scatter(root) => {
                    let ins = (me == root).then(|| (0..n).map(mine).collect::<Vec<_>>());
                    let mut out = zeros(sizes(root, me));
                    g.scatter(&mut out, ins.as_deref(), Rank(root as u32))
                        .await
                        .unwrap();
                    assert_same(&out, &theirs(root), &what);
                }
                Moving::AllToAll => {
                    let ins: Vec<Tensor> = (0..n).map(mine).collect();
                    let mut outs: Vec<Tensor> = (0..n).map(|p| zeros(sizes(p, me))).collect();
                    g.all_to_all(&mut outs, &ins).await.unwrap();
                    for (p, o) in outs.iter().enumerate() {
                        assert_same(o, &theirs(p), &format!("{what}: from {p}"));
                    }
                }
                Moving::AllToAllSingle => {
                    let ins: Vec<Tensor> = (0..n).map(mine).collect();
                    let (in_splits, out_splits): (Vec<usize>, Vec<usize>) =
                        (0..n).map(|q| (sizes(me, q), sizes(q, me))).unzip();
                    let mut out = zeros(out_splits.iter().sum());
                    g.all_to_all_single(&mut out, &concat(&ins), Some(&out_splits), Some(&in_splits))
                        .await
                        .unwrap();
                    assert_same(&out, &concat(&(0..n).map(theirs).collect::<Vec<_>>()), &what);
                }
            }
            bytes_sent(&g) - before
        }
    })
    .await
}

/// A member's own part of 8 MiB and more (copied into its output with
/// non-temporal stores, `shm::copy_large`), a few bytes past a 16-byte lane,
/// arrives exact in a gather's and a scatter's root and in an all-to-all,
/// through the segment and over TCP.
#[test]
fn own_parts_of_8_mib_and_more_are_copied_exactly() {
    run(async {
        const N: usize = 2;
        // f32: 8 MiB + 12 bytes (+ 4 per rank) to itself, 4 KiB and a bit to the other.
        let sizes: Sizes = Arc::new(|p, q| {
            if p == q {
                (2 << 20) + 3 + p
            } else {
                1000 + 7 * p + q
            }
        });
        let base = groups("shm-own-8mib", N as u32).await;
        for (how, gs) in [("forced", with_cfg(&base, &shm_cfg())), ("auto", base.clone())] {
            for call in [
                Moving::Gather(1),
                Moving::Scatter(0),
                Moving::AllToAll,
                Moving::AllToAllSingle,
            ] {
                moved_checked(&gs, call, DType::F32, Arc::clone(&sizes), 40, how).await;
            }
        }
    });
}

/// Names of this process's threads.
fn thread_names() -> Vec<String> {
    std::fs::read_dir("/proc/self/task")
        .map(|d| {
            d.flatten()
                .filter_map(|t| std::fs::read_to_string(t.path().join("comm")).ok())
                .map(|c| c.trim().to_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// Run by [`copies_split_between_threads_are_exact`] in a child process
/// whose environment asks for 3 copy threads: every kind of copy through the
/// segment, in ranges large enough to be split between this thread and the
/// copy pool's (256 KiB and more, ends off the cache lines), arrives exact,
/// and the pool's threads exist.
#[test]
#[ignore = "run in a child process by copies_split_between_threads_are_exact"]
fn copies_split_between_threads_child() {
    assert_eq!(std::env::var("MULTIWORLD_SHM_COPY_THREADS").as_deref(), Ok("3"));
    run(async {
        const N: usize = 3;
        let gs = with_cfg(&groups("shm-split-copies", N as u32).await, &shm_cfg());
        // All-reduce (publish, the reduction, take), 1 MiB and 28 bytes.
        let ins = (0..N)
            .map(|r| general_input(DType::F32, (1 << 18) + 7, r, 50))
            .collect();
        sum_checked(&gs, ins, "split copies").await;
        on_all(&gs, |me, g| async move {
            // Reduce to 2 and reduce-scatter, general floats in rank order.
            let ins: Vec<Tensor> = (0..N)
                .map(|r| general_input(DType::F32, (1 << 18) + 9, r, 54))
                .collect();
            let mut t = ins[me].clone();
            g.reduce(&mut t, Rank(2), ReduceOp::Sum).await.unwrap();
            let want = if me == 2 {
                reference(&ins, ReduceOp::Sum)
            } else {
                ins[me].clone()
            };
            assert_same(&t, &want, "reduce");
            let seg = (1 << 17) + 5;
            let big: Vec<Tensor> = (0..N)
                .map(|r| general_input(DType::F64, N * seg, r, 55))
                .collect();
            let mut out = Tensor::zeros(DType::F64, [seg]).unwrap();
            g.reduce_scatter_tensor(&mut out, &big[me], ReduceOp::Avg)
                .await
                .unwrap();
            let want = slice(&reference(&big, ReduceOp::Avg), me * seg..(me + 1) * seg);
            assert_same(&out, &want, "reduce_scatter_tensor");
        })
        .await;
        on_all(&gs, |me, g| async move {
            // Broadcast from 1 (3 pieces and 5 bytes) and all-gather.
            let from_1 = input(DType::U8, (3 << 20) + 5, 1, 51);
            let mut t = if me == 1 {
                from_1.clone()
            } else {
                Tensor::zeros(DType::U8, [(3 << 20) + 5]).unwrap()
            };
            g.broadcast(&mut t, Rank(1)).await.unwrap();
            assert_same(&t, &from_1, "broadcast");
            let ins: Vec<Tensor> = (0..N).map(|r| input(DType::F64, (1 << 17) + 3, r, 52)).collect();
            let mut out = Tensor::zeros(DType::F64, [N * ((1 << 17) + 3)]).unwrap();
            g.all_gather_into_tensor(&mut out, &ins[me]).await.unwrap();
            assert_same(&out, &concat(&ins), "all_gather_into_tensor");
        })
        .await;
        // Pairs of a third of a piece and more; own parts of 8 MiB and more.
        let sizes: Sizes = Arc::new(|p, q| {
            if p == q {
                (2 << 20) + 3
            } else {
                (1 << 17) + 31 * p + q
            }
        });
        for call in [
            Moving::Scatter(2),
            Moving::Gather(0),
            Moving::AllToAll,
            Moving::AllToAllSingle,
        ] {
            moved_checked(&gs, call, DType::F32, Arc::clone(&sizes), 53, "split copies").await;
        }
    });
    let names = thread_names();
    for want in ["mw-copy-0", "mw-copy-1"] {
        assert!(names.iter().any(|n| n == want), "no thread {want}: {names:?}");
    }
}

/// Copies split between threads (`MULTIWORLD_SHM_COPY_THREADS`, more than
/// one by default on 8 CPUs or more) are exact: runs
/// [`copies_split_between_threads_child`] in a child process with 3.
#[test]
fn copies_split_between_threads_are_exact() {
    let out = multiworld_testkit::process::self_test_command("copies_split_between_threads_child")
        .env("MULTIWORLD_SHM_COPY_THREADS", "3")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "child failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Gather, scatter and the all-to-alls through the segment (forced), on 3
/// members with small pieces (4 KiB: 1344 bytes per pair in an all-to-all):
/// the first such call sets the segment up; sizes that differ per pair,
/// zeros, exactly one part, one part and a byte, many parts; every root;
/// their data never go over TCP. Bool tensors (never through shared memory)
/// go over TCP.
#[test]
fn gather_scatter_and_all_to_all_move_uneven_sizes_through_shared_memory() {
    run(async {
        const N: usize = 3;
        const PIECE: usize = 4096;
        let gs = with_cfg(&groups("shm-moves", N as u32).await, &small_pieces(PIECE));
        let pair = (PIECE / N) & !63;
        let sizes: Vec<(&str, DType, Sizes)> = vec![
            ("many parts", DType::F32, Arc::new(|p, q| 10_007 + 13 * p + q)),
            (
                "uneven with zeros",
                DType::I16,
                Arc::new(|p, q| (p * 7 + q * 3) % 5 * 1_111),
            ),
            ("one pair's part", DType::U8, Arc::new(move |_, _| pair)),
            ("a part and a byte", DType::U8, Arc::new(move |_, _| pair + 1)),
            ("one slot", DType::U8, Arc::new(|_, _| PIECE)),
            ("a slot and a byte", DType::U8, Arc::new(|_, _| PIECE + 1)),
            (
                "only some pairs",
                DType::F64,
                Arc::new(|p, q| if (p + q) % 2 == 0 { 3_001 } else { 0 }),
            ),
            ("nothing", DType::BF16, Arc::new(|_, _| 0)),
        ];
        assert_all(&statuses(&gs).await, &SharedMemory::Untried, "a new group");
        let t0 = Instant::now();
        for (k, (what, dtype, size)) in sizes.into_iter().enumerate() {
            let calls = [
                Moving::Gather(k % N),
                Moving::Scatter((k + 1) % N),
                Moving::AllToAll,
                Moving::AllToAllSingle,
            ];
            for call in calls {
                let sent = moved_checked(&gs, call, dtype, Arc::clone(&size), k as u64, what).await;
                assert_all(&statuses(&gs).await, &active(segment(N, PIECE)), what);
                for (r, s) in sent.iter().enumerate() {
                    assert!(
                        *s <= TCP_ONLY_ORDERS,
                        "{what}: {call:?}: rank {r} sent {s} bytes over TCP"
                    );
                }
            }
        }
        println!(
            "gather, scatter and all-to-alls through shared memory in {:?}",
            t0.elapsed()
        );
        let all: Sizes = Arc::new(|_, _| 5_000);
        for call in [
            Moving::Gather(1),
            Moving::Scatter(2),
            Moving::AllToAll,
            Moving::AllToAllSingle,
        ] {
            let sent = moved_checked(&gs, call, DType::Bool, Arc::clone(&all), 9, "bool").await;
            assert!(sent.iter().any(|&s| s >= 5_000), "bool: {call:?}: {sent:?}");
        }
    });
}

/// A group's segment keeps the piece size it was set up with: calls made
/// later through a config that asks for another `shm_piece_bytes` (every
/// member the same, so the settings agree) plan their moves with the
/// segment's slots and go through it, instead of failing on every member.
#[test]
fn a_later_config_with_other_pieces_uses_the_segments_own() {
    run(async {
        const N: usize = 3;
        const PIECE: usize = 4096;
        let base = groups("shm-repiece", N as u32).await;
        let small = with_cfg(&base, &small_pieces(PIECE));
        let each: Sizes = Arc::new(|_, _| 20_000);
        moved_checked(
            &small,
            Moving::AllToAllSingle,
            DType::U8,
            Arc::clone(&each),
            1,
            "set up",
        )
        .await;
        assert_all(&statuses(&small).await, &active(segment(N, PIECE)), "set up");
        let large = with_cfg(&base, &small_pieces(1 << 20));
        for (k, call) in [
            Moving::AllToAllSingle,
            Moving::AllToAll,
            Moving::Gather(1),
            Moving::Scatter(2),
        ]
        .into_iter()
        .enumerate()
        {
            let sent = moved_checked(
                &large,
                call,
                DType::F32,
                Arc::clone(&each),
                2 + k as u64,
                "1 MiB pieces asked",
            )
            .await;
            assert!(
                sent.iter().all(|&s| s <= TCP_ONLY_ORDERS),
                "{call:?} went over TCP: {sent:?}"
            );
        }
        assert_all(
            &statuses(&large).await,
            &active(segment(N, PIECE)),
            "still the first segment",
        );
    });
}

/// With `Algorithm::Auto` (the default): a gather, scatter or all-to-all goes
/// through shared memory once its members move `shm_min_bytes` between them,
/// unless one of them sends little enough to send it eagerly; the
/// reported algorithm follows.
#[test]
fn auto_moves_large_gathers_scatters_and_all_to_alls_through_shared_memory() {
    run(async {
        use multiworld_collectives::CollectiveKind as K;
        const N: usize = 3;
        let gs = groups("shm-moves-auto", N as u32).await;
        let cfg = CollectiveConfig::default();
        let (eager, min) = (cfg.eager_max_bytes, cfg.shm_min_bytes);
        assert_eq!(gs[0].algorithm_name(K::AllToAll, 1024).await, "direct");
        assert_eq!(gs[0].algorithm_name(K::Gather, 1 << 20).await, "shm");
        // A scatter's root sends `(N - 1) × size`: through the segment once
        // that is more than it sends eagerly and at least the threshold.
        let shm_at = (eager / (N - 1) + 64).max(min.div_ceil(N - 1));
        assert_eq!(gs[0].algorithm_name(K::Scatter, shm_at as u64).await, "shm");
        assert_eq!(
            gs[0].algorithm_name(K::Scatter, (eager / (N - 1)) as u64).await,
            "direct"
        );
        // Small: direct, shared memory not tried.
        for call in [
            Moving::Gather(0),
            Moving::Scatter(1),
            Moving::AllToAll,
            Moving::AllToAllSingle,
        ] {
            moved_checked(&gs, call, DType::F32, Arc::new(|_, _| 256), 1, "small").await;
        }
        assert_all(&statuses(&gs).await, &SharedMemory::Untried, "after small calls");
        // Large in all, but member 0 sends a few bytes (eagerly, so over TCP):
        // the whole call goes over TCP.
        let one_small: Sizes = Arc::new(move |p, _| if p == 0 { 16 } else { eager / 4 + 1 });
        for call in [Moving::AllToAll, Moving::AllToAllSingle] {
            let sent = moved_checked(
                &gs,
                call,
                DType::F32,
                Arc::clone(&one_small),
                2,
                "one member eager",
            )
            .await;
            assert!(sent[1] > eager as u64, "{call:?}: {sent:?}");
        }
        assert_all(
            &statuses(&gs).await,
            &SharedMemory::Untried,
            "after a call with an eager member",
        );
        // Member 2 sends nothing (as an expert that got no tokens): it has
        // nothing to send eagerly, so the call goes through the segment (set
        // up in this call), and no empty message is left unread.
        // (f32: more than the threshold, and than what is sent eagerly.)
        let two_idle: Sizes = Arc::new(move |p, _| if p == 2 { 0 } else { min.max(eager) / 4 + 16 });
        for call in [Moving::AllToAll, Moving::AllToAllSingle, Moving::Gather(0)] {
            let sent = moved_checked(&gs, call, DType::F32, Arc::clone(&two_idle), 4, "member 2 idle").await;
            assert_all(&statuses(&gs).await, &active(default_segment(N)), "member 2 idle");
            for (r, s) in sent.iter().enumerate() {
                assert!(
                    *s <= TCP_ONLY_ORDERS,
                    "{call:?}: rank {r} sent {s} bytes over TCP"
                );
            }
        }
        // Large: through the segment.
        // f32: more than the threshold and than what is sent eagerly, to
        // each, from each (a gather's member sends to one).
        let large: Sizes = Arc::new(move |p, q| min.max(eager) / 4 + 16 + 31 * p + q);
        for call in [
            Moving::Scatter(2),
            Moving::Gather(1),
            Moving::AllToAll,
            Moving::AllToAllSingle,
        ] {
            let sent = moved_checked(&gs, call, DType::F32, Arc::clone(&large), 3, "large").await;
            assert_all(
                &statuses(&gs).await,
                &active(default_segment(N)),
                "after a large call",
            );
            for (r, s) in sent.iter().enumerate() {
                assert!(
                    *s <= TCP_ONLY_ORDERS,
                    "{call:?}: rank {r} sent {s} bytes over TCP"
                );
            }
        }
    });
}

/// A small gather under Auto is lent the group's shared-memory state (it may
/// use the segment, until the sizes say otherwise); dropped on one member
/// before its data moved, it leaves that member's state as it was, so later
/// calls still agree and still use the segment.
#[test]
fn a_small_call_dropped_before_it_used_the_segment_changes_nothing() {
    run(async {
        const N: usize = 3;
        let gs = groups("shm-dropped-small", N as u32).await;
        let input = |r: usize| input(DType::F32, 256, r, 5);
        // Member 1 sends its 1 KiB eagerly behind its descriptor, then waits
        // for the others' descriptors: dropped there.
        let dropped =
            tokio::time::timeout(Duration::from_millis(100), gs[1].gather(&input(1), None, Rank(0))).await;
        assert!(
            dropped.is_err(),
            "the gather cannot end before the others call it"
        );
        // The others complete that call with member 1's eager payload.
        on_all(&[gs[0].clone(), gs[2].clone()], move |i, g| async move {
            let me = [0, 2][i];
            let mut outs = (me == 0).then(|| {
                (0..N)
                    .map(|_| Tensor::zeros(DType::F32, [256]).unwrap())
                    .collect::<Vec<_>>()
            });
            g.gather(&input(me), outs.as_deref_mut(), Rank(0)).await.unwrap();
            for (p, o) in outs.iter().flatten().enumerate() {
                assert_same(o, &input(p), "the gather member 1 dropped");
            }
        })
        .await;
        assert_all(
            &statuses(&gs).await,
            &SharedMemory::Untried,
            "after the dropped call",
        );
        // A large all-reduce and a large all-to-all: the segment, everywhere.
        let at = CollectiveConfig::default().shm_min_bytes / 4;
        let ins = (0..N).map(|r| general_input(DType::F32, at, r, 6)).collect();
        sum_checked(&gs, ins, "after a dropped small call").await;
        assert_all(
            &statuses(&gs).await,
            &active(default_segment(N)),
            "after a dropped small call",
        );
        moved_checked(
            &gs,
            Moving::AllToAll,
            DType::F32,
            Arc::new(move |_, _| at / 2),
            7,
            "then",
        )
        .await;
    });
}

// ------------------------------------------------------ 3. Auto, sizes 1 to 8

#[test]
fn auto_uses_shared_memory_from_the_threshold_on_every_world_size() {
    run(async {
        let min = CollectiveConfig::default().shm_min_bytes;
        let t0 = Instant::now();
        for n in 1..=8u32 {
            let gs = groups(&format!("shm-auto-{n}"), n).await;
            let nu = n as usize;
            // The smallest f32 length with `bytes × (n − 1) >= shm_min_bytes`.
            let at = if nu == 1 {
                1 << 18
            } else {
                min.div_ceil(4 * (nu - 1))
            };
            // Just below: the TCP algorithms, shared memory not tried.
            if nu > 1 {
                let ins = (0..nu).map(|r| input(DType::F32, at - 1, r, 1)).collect();
                sum_checked(&gs, ins, &format!("n={n} below the threshold")).await;
                assert_all(
                    &statuses(&gs).await,
                    &SharedMemory::Untried,
                    &format!("n={n} below the threshold"),
                );
            }
            // At the threshold: shared memory, and the data do not go over TCP.
            let ins = (0..nu).map(|r| input(DType::F32, at, r, 2)).collect();
            let sent = sum_checked(&gs, ins, &format!("n={n} at the threshold")).await;
            let st = statuses(&gs).await;
            if nu == 1 {
                assert_all(&st, &SharedMemory::Untried, "a group of one");
            } else {
                assert_all(
                    &st,
                    &active(default_segment(nu)),
                    &format!("n={n} at the threshold"),
                );
                for (r, s) in sent.iter().enumerate() {
                    // Less than a quarter of the tensor's bytes.
                    assert!(
                        *s < at as u64,
                        "n={n} rank {r} sent {s} bytes over TCP for a {} byte shm all-reduce",
                        at * 4
                    );
                }
            }
        }
        println!("world sizes 1..=8 in {:?}", t0.elapsed());
    });
}

/// The one large case: 16 MiB per rank on 4 ranks with the default settings
/// (Auto picks shared memory; pieces of 1 MiB, so sixteen of them, written
/// back with non-temporal stores), general floats,
/// bit for bit; the data do not go over TCP.
#[test]
fn a_16_mib_all_reduce_with_the_default_settings() {
    run(async {
        const LEN: usize = 4 << 20;
        let gs = groups("shm-16mib", 4).await;
        let ins = (0..4).map(|r| general_input(DType::F32, LEN, r, 16)).collect();
        let t0 = Instant::now();
        let sent = sum_checked(&gs, ins, "16 MiB").await;
        println!(
            "16 MiB on 4 ranks in {:?}; TCP bytes sent per rank: {sent:?}",
            t0.elapsed()
        );
        assert!(sent.iter().all(|&s| s < 1 << 20), "{sent:?}");
        assert_all(&statuses(&gs).await, &active(default_segment(4)), "16 MiB");
    });
}

// ------------------------------------------------------- 4. a member declines

#[test]
fn a_member_that_declines_makes_the_group_use_the_ring_for_good() {
    run(async {
        const LEN: usize = 1 << 18; // 1 MiB of f32: Auto picks shared memory with 3 ranks
        for decliner in [1usize, 0] {
            let base = groups(&format!("shm-decline-{decliner}"), 3).await;
            let gs: Vec<Group> = base
                .iter()
                .enumerate()
                .map(|(r, g)| g.with_config(CollectiveConfig::default().with_shared_memory(r != decliner)))
                .collect();
            let ins: Arc<Vec<Tensor>> = Arc::new((0..3).map(|r| input(DType::F32, LEN, r, 5)).collect());
            let want = Arc::new(reference(&ins, ReduceOp::Sum));
            let mut first: Option<Vec<SharedMemory>> = None;
            for (call, algo) in [
                (0, Algorithm::Auto),
                (1, Algorithm::Auto),
                (2, Algorithm::SharedMemory),
            ] {
                let (ins, want) = (Arc::clone(&ins), Arc::clone(&want));
                let sent = on_all(&gs, move |me, g| {
                    let (ins, want) = (Arc::clone(&ins), Arc::clone(&want));
                    async move {
                        let mut cfg = g.config().clone();
                        cfg.algorithm = algo;
                        let g = g.with_config(cfg);
                        let before = bytes_sent(&g);
                        let mut t = ins[me].clone();
                        tokio::time::timeout(Duration::from_secs(30), g.all_reduce(&mut t, ReduceOp::Sum))
                            .await
                            .expect("no hang")
                            .unwrap();
                        assert_same(&t, &want, &format!("call {call} ({algo:?}) on rank {me}"));
                        bytes_sent(&g) - before
                    }
                })
                .await;
                // The ring moved the data over TCP.
                for (r, s) in sent.iter().enumerate() {
                    assert!(
                        *s >= (LEN * 4 / 2) as u64,
                        "call {call}: rank {r} sent only {s} bytes: not the ring"
                    );
                }
                let st = statuses(&gs).await;
                for (r, s) in st.iter().enumerate() {
                    let SharedMemory::Unavailable { reason } = s else {
                        panic!("decliner {decliner}, call {call}: rank {r} reports {s}");
                    };
                    if r == decliner {
                        assert!(reason.contains("turned off"), "rank {r}: {reason}");
                    } else {
                        assert!(
                            reason.contains(&format!("rank {decliner}")),
                            "rank {r} must name rank {decliner}: {reason}"
                        );
                    }
                }
                match &first {
                    None => first = Some(st),
                    Some(f) => assert_eq!(f, &st, "the state does not change after the first call"),
                }
            }
            println!("decliner {decliner}: {:?}", first.unwrap());
        }
    });
}

// ------------------------------------------------------------- 5. sub-groups

#[test]
fn sub_groups_have_their_own_segments() {
    run(async {
        const PIECE_A: usize = 256 << 10;
        const PIECE_B: usize = 64 << 10;
        let world = with_cfg(&groups("shm-sub", 4).await, &shm_cfg());
        // A = world ranks 1, 2, 3 (its member 0, which creates its segment, is
        // world rank 1); B = world ranks 0 and 3. Every world member makes both.
        let made = on_all(&world, |_, g| async move {
            let a = g.new_group(&[Rank(1), Rank(2), Rank(3)]).await.unwrap();
            let b = g.new_group(&[Rank(3), Rank(0)]).await.unwrap();
            (a, b)
        })
        .await;
        let a: Vec<Group> = made
            .iter()
            .map(|(a, _)| a.with_config(small_pieces(PIECE_A)))
            .collect();
        let b: Vec<Group> = made
            .iter()
            .map(|(_, b)| b.with_config(small_pieces(PIECE_B)))
            .collect();
        let (a, b) = (Arc::new(a), Arc::new(b));
        // (inputs, expected result) of A (sum), B (product) and the world (avg).
        let case = |n: usize, dtype: DType, len: usize, seed: u64, op: ReduceOp| {
            let ins: Vec<Tensor> = (0..n).map(|r| general_input(dtype, len, r, seed)).collect();
            let want = reference(&ins, op);
            (ins, want)
        };
        let cases = Arc::new([
            case(3, DType::F32, 300_001, 3, ReduceOp::Sum),
            case(2, DType::F16, 100_003, 4, ReduceOp::Product),
            case(4, DType::F64, 200_003, 5, ReduceOp::Avg),
        ]);
        // A sets up its segment alone; the world group and B are not involved.
        {
            let cases = Arc::clone(&cases);
            on_all(&a[1..], move |i, g| {
                let cases = Arc::clone(&cases);
                async move {
                    let (ins, want) = &cases[0];
                    assert_eq!(g.group_rank(), Some(i));
                    let mut t = ins[i].clone();
                    g.all_reduce(&mut t, ReduceOp::Sum).await.unwrap();
                    assert_same(&t, want, "sub-group A alone");
                }
            })
            .await;
        }
        assert_all(
            &statuses(&a[1..]).await,
            &active(segment(3, PIECE_A)),
            "sub-group A",
        );
        assert_eq!(
            a[0].shared_memory().await,
            SharedMemory::Untried,
            "A's non-member"
        );
        assert_all(
            &statuses(&world).await,
            &SharedMemory::Untried,
            "world after A's call",
        );
        assert_all(&statuses(&b).await, &SharedMemory::Untried, "B after A's call");
        // Then all three groups at once on every rank that is a member: the
        // world and B set up their segments concurrently in round 0.
        for round in 0..3 {
            let (a, b, cases) = (Arc::clone(&a), Arc::clone(&b), Arc::clone(&cases));
            on_all(&world, move |me, g| {
                let (a, b, cases) = (Arc::clone(&a), Arc::clone(&b), Arc::clone(&cases));
                async move {
                    let [(ins_a, want_a), (ins_b, want_b), (ins_w, want_w)] = &*cases;
                    let hw = g.all_reduce_handle(ins_w[me].clone(), ReduceOp::Avg);
                    let ha = a[me]
                        .group_rank()
                        .map(|i| a[me].all_reduce_handle(ins_a[i].clone(), ReduceOp::Sum));
                    let hb = b[me]
                        .group_rank()
                        .map(|i| b[me].all_reduce_handle(ins_b[i].clone(), ReduceOp::Product));
                    assert_same(&hw.await.unwrap(), want_w, &format!("world, round {round}"));
                    if let Some(h) = ha {
                        assert_same(&h.await.unwrap(), want_a, &format!("A, round {round}"));
                    }
                    if let Some(h) = hb {
                        assert_same(&h.await.unwrap(), want_b, &format!("B, round {round}"));
                    }
                }
            })
            .await;
        }
        assert_all(&statuses(&world).await, &active(default_segment(4)), "world");
        assert_all(
            &statuses(&a[1..]).await,
            &active(segment(3, PIECE_A)),
            "A at the end",
        );
        assert_all(
            &[b[0].shared_memory().await, b[3].shared_memory().await],
            &active(segment(2, PIECE_B)),
            "B",
        );
        assert_eq!(
            b[1].shared_memory().await,
            SharedMemory::Untried,
            "B's non-member"
        );
    });
}

// ---------------------------------------------------- 6. settings that differ

#[test]
fn shared_memory_settings_that_differ_fail_on_every_member() {
    run(async {
        let base = groups("shm-mismatch", 3).await;
        let odd_piece = |c: CollectiveConfig| {
            let mut c = c.with_algorithm(Algorithm::SharedMemory);
            c.shm_piece_bytes = 512 << 10;
            c
        };
        let odd_min = |c: CollectiveConfig| {
            let mut c = c;
            c.shm_min_bytes = 64 << 10;
            c
        };
        // (setting, the member that differs, how it differs, everyone's algorithm)
        type Tweak = fn(CollectiveConfig) -> CollectiveConfig;
        let variants: [(&str, usize, Tweak, Algorithm); 3] = [
            ("shm_piece_bytes", 2, odd_piece, Algorithm::SharedMemory),
            ("shm_min_bytes", 0, odd_min, Algorithm::Auto),
            (
                "algorithm",
                1,
                |c| c.with_algorithm(Algorithm::SharedMemory),
                Algorithm::Auto,
            ),
        ];
        for (what, odd, tweak, algo) in variants {
            let gs: Vec<Group> = base
                .iter()
                .enumerate()
                .map(|(r, g)| {
                    let c = CollectiveConfig::default().with_algorithm(algo);
                    g.with_config(if r == odd { tweak(c) } else { c })
                })
                .collect();
            let t0 = Instant::now();
            let errs = on_all(&gs, |_, g| async move {
                let mut t = Tensor::zeros(DType::F32, [1 << 18]).unwrap();
                tokio::time::timeout(Duration::from_secs(10), g.all_reduce(&mut t, ReduceOp::Sum))
                    .await
                    .expect("a disagreement must not hang")
                    .unwrap_err()
            })
            .await;
            assert!(t0.elapsed() < Duration::from_secs(10));
            for (r, e) in errs.iter().enumerate() {
                assert!(
                    matches!(e, Error::InvalidArgument(m) if m.contains("CollectiveConfig")),
                    "{what}: rank {r}: {e}"
                );
            }
            assert_all(&statuses(&gs).await, &SharedMemory::Untried, what);
        }
        // Agreeing members go on: the group is usable and sets up its segment.
        let gs = with_cfg(&base, &shm_cfg());
        let ins = (0..3).map(|r| input(DType::I64, 10_000, r, 6)).collect();
        sum_checked(&gs, ins, "after the disagreements").await;
        assert_all(
            &statuses(&gs).await,
            &active(default_segment(3)),
            "after the disagreements",
        );
    });
}

// ------------------------------------------------------ 7. a member is lost

#[test]
fn a_member_lost_during_a_shared_memory_all_reduce_fails_the_others() {
    run(lost_member_rounds(Op::AllReduce));
}

#[test]
fn a_member_lost_during_a_shared_memory_broadcast_fails_the_others() {
    run(lost_member_rounds(Op::Broadcast));
}

#[test]
fn a_member_lost_during_a_shared_memory_reduce_fails_the_others() {
    run(lost_member_rounds(Op::Reduce));
}

#[test]
fn a_member_lost_during_a_shared_memory_all_gather_fails_the_others() {
    run(lost_member_rounds(Op::AllGather));
}

#[test]
fn a_member_lost_during_a_shared_memory_gather_fails_the_others() {
    run(lost_member_rounds(Op::Gather));
}

#[test]
fn a_member_lost_during_a_shared_memory_scatter_fails_the_others() {
    run(lost_member_rounds(Op::Scatter));
}

#[test]
fn a_member_lost_during_a_shared_memory_all_to_all_fails_the_others() {
    run(lost_member_rounds(Op::AllToAll));
}

#[test]
fn a_member_lost_during_a_shared_memory_reduce_scatter_fails_the_others() {
    run(lost_member_rounds(Op::ReduceScatter));
}

/// The collective the loss rounds run.
#[derive(Clone, Copy, Debug)]
enum Op {
    AllReduce,
    Broadcast,
    Reduce,
    AllGather,
    /// To member 0, which ends with every member's tensor in member order.
    Gather,
    /// From member 0's tensor, cut into `n` parts: member `q` ends with part `q`.
    Scatter,
    /// `all_to_all_single`: part `q` of each member's tensor to member `q`.
    AllToAll,
    /// `reduce_scatter` (sum) of each member's tensor cut into `n` parts.
    ReduceScatter,
}

/// Part `q` of `len` elements cut into `n` parts.
fn part(len: usize, n: usize, q: usize) -> std::ops::Range<usize> {
    q * len / n..(q + 1) * len / n
}

impl Op {
    async fn call(self, g: &Group, t: &mut Tensor) -> multiworld_tcp::Result<()> {
        match self {
            Op::AllReduce => g.all_reduce(t, ReduceOp::Sum).await,
            Op::Broadcast => g.broadcast(t, Rank(0)).await,
            Op::Reduce => g.reduce(t, Rank(0), ReduceOp::Sum).await,
            Op::AllGather => {
                let n = g.size();
                let mut out = Tensor::zeros(t.dtype(), [n * t.numel()]).unwrap();
                g.all_gather_into_tensor(&mut out, t).await?;
                *t = out;
                Ok(())
            }
            Op::Gather => {
                let n = g.size();
                let zeros = || Tensor::zeros(t.dtype(), [t.numel()]).unwrap();
                let mut outs =
                    (g.group_rank() == Some(0)).then(|| (0..n).map(|_| zeros()).collect::<Vec<_>>());
                g.gather(t, outs.as_deref_mut(), Rank(0)).await?;
                if let Some(outs) = outs {
                    *t = concat(&outs);
                }
                Ok(())
            }
            Op::Scatter => {
                let (n, me, len) = (g.size(), g.group_rank().unwrap(), t.numel());
                let ins = (me == 0).then(|| (0..n).map(|q| slice(t, part(len, n, q))).collect::<Vec<_>>());
                let mut out = Tensor::zeros(t.dtype(), [part(len, n, me).len()]).unwrap();
                g.scatter(&mut out, ins.as_deref(), Rank(0)).await?;
                *t = out;
                Ok(())
            }
            Op::AllToAll => {
                let (n, me, len) = (g.size(), g.group_rank().unwrap(), t.numel());
                let ins: Vec<usize> = (0..n).map(|q| part(len, n, q).len()).collect();
                let outs = vec![part(len, n, me).len(); n];
                let mut out = Tensor::zeros(t.dtype(), [outs.iter().sum::<usize>()]).unwrap();
                g.all_to_all_single(&mut out, t, Some(&outs), Some(&ins)).await?;
                *t = out;
                Ok(())
            }
            Op::ReduceScatter => {
                let (n, me, len) = (g.size(), g.group_rank().unwrap(), t.numel());
                let ins: Vec<Tensor> = (0..n).map(|q| slice(t, part(len, n, q))).collect();
                let mut out = Tensor::zeros(t.dtype(), [part(len, n, me).len()]).unwrap();
                g.reduce_scatter(&mut out, &ins, ReduceOp::Sum).await?;
                *t = out;
                Ok(())
            }
        }
    }

    /// What member `me` holds after a call on `ins`.
    fn want(self, ins: &[Tensor], me: usize) -> Tensor {
        match self {
            Op::AllReduce => reference(ins, ReduceOp::Sum),
            Op::Broadcast => ins[0].clone(),
            Op::Reduce if me == 0 => reference(ins, ReduceOp::Sum),
            Op::Reduce => ins[me].clone(),
            Op::AllGather => concat(ins),
            Op::Gather if me == 0 => concat(ins),
            Op::Gather => ins[me].clone(),
            Op::Scatter => slice(&ins[0], part(ins[0].numel(), ins.len(), me)),
            Op::AllToAll => {
                let n = ins.len();
                concat(
                    &ins.iter()
                        .map(|t| slice(t, part(t.numel(), n, me)))
                        .collect::<Vec<_>>(),
                )
            }
            Op::ReduceScatter => {
                let n = ins.len();
                let parts: Vec<Tensor> = ins.iter().map(|t| slice(t, part(t.numel(), n, me))).collect();
                reference(&parts, ReduceOp::Sum)
            }
        }
    }
}

/// Members calling `op` back to back through the segment; one is aborted or
/// closed mid-way: every call that succeeded was exact, every survivor fails
/// within a bound, later calls fail at once.
async fn lost_member_rounds(op: Op) {
    {
        const N: usize = 3;
        const LEN: usize = 1 << 20; // 4 MiB of f32 in 64 KiB pieces
        // The loss lands wherever the calls happen to be; several rounds try
        // several places, and lose the member that created the segment too.
        let rounds = [("abort", 2, 1), ("abort", 0, 3), ("abort", 1, 6), ("close", 0, 2)];
        for (round, (how, victim, calls)) in rounds.into_iter().enumerate() {
            let gs = with_cfg(
                &groups(&format!("shm-lost-{op:?}-{round}"), N as u32).await,
                &small_pieces(64 << 10),
            );
            let ins: Arc<Vec<Tensor>> = Arc::new((0..N).map(|r| input(DType::F32, LEN, r, 8)).collect());
            let want: Arc<Vec<Tensor>> = Arc::new((0..N).map(|me| op.want(&ins, me)).collect());
            let done: Arc<[AtomicUsize; N]> = Arc::new(Default::default());
            // Every rank runs all-reduces back to back until one fails; every
            // call that succeeds must be exact.
            let tasks: Vec<_> = gs
                .iter()
                .enumerate()
                .map(|(me, g)| {
                    let (g, ins, want, done) =
                        (g.clone(), Arc::clone(&ins), Arc::clone(&want), Arc::clone(&done));
                    tokio::spawn(async move {
                        loop {
                            let mut t = ins[me].clone();
                            match op.call(&g, &mut t).await {
                                Ok(()) => {
                                    assert_same(&t, &want[me], &format!("rank {me}: a call that succeeded"));
                                    let k = done[me].fetch_add(1, Ordering::SeqCst) + 1;
                                    assert!(k < 10_000, "rank {me}: the calls never fail");
                                }
                                Err(e) => return (e, Instant::now()),
                            }
                        }
                    })
                })
                .collect();
            let under_way = eventually(Duration::from_secs(30), || {
                done.iter().all(|d| d.load(Ordering::SeqCst) >= calls)
            })
            .await;
            assert!(under_way, "the calls never got going");
            assert_all(
                &statuses(&gs[..1]).await,
                &SharedMemory::Active {
                    segment_bytes: segment(N, 64 << 10),
                },
                "before the loss",
            );
            let comm = gs[victim].comm().clone();
            let at = Instant::now();
            match how {
                "abort" => comm.abort(),
                _ => comm.close().await,
            }
            let mut outs = Vec::new();
            for (r, t) in tasks.into_iter().enumerate() {
                let (e, when) = tokio::time::timeout(Duration::from_secs(20), t)
                    .await
                    .unwrap_or_else(|_| panic!("{how} of rank {victim}: rank {r} hung"))
                    .unwrap();
                let took = when.saturating_duration_since(at);
                println!(
                    "{how} of rank {victim}: rank {r} failed {took:?} after the loss (after {} calls): {e}",
                    done[r].load(Ordering::SeqCst)
                );
                outs.push((e, took));
            }
            assert!(
                matches!(outs[victim].0, Error::Aborted { .. }),
                "{how} of rank {victim}: the victim: {}",
                outs[victim].0
            );
            for (r, (e, took)) in outs.iter().enumerate().filter(|&(r, _)| r != victim) {
                assert!(e.is_world_fatal(), "{how} of rank {victim}: rank {r}: {e}");
                assert!(
                    *took < Duration::from_secs(5),
                    "{how} of rank {victim}: rank {r} took {took:?}"
                );
            }
            // Later calls fail at once.
            for g in gs.iter().filter(|g| g.group_rank() != Some(victim)) {
                let t0 = Instant::now();
                let mut t = ins[0].clone();
                let e = op.call(g, &mut t).await.unwrap_err();
                assert!(e.is_world_fatal(), "{how} of rank {victim}: a later call: {e}");
                assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
            }
        }
    }
}

// -------------------------------------------------- 8. a member never arrives

#[test]
fn a_member_that_never_calls_hits_the_deadline_after_setup() {
    run(async {
        const DEADLINE: Duration = Duration::from_millis(300);
        let gs = with_cfg(
            &groups("shm-deadline", 2).await,
            &shm_cfg().with_timeout(Some(DEADLINE)),
        );
        let ins: Vec<Tensor> = (0..2).map(|r| input(DType::F32, 100_000, r, 9)).collect();
        sum_checked(&gs, ins.clone(), "first call").await;
        assert_all(
            &statuses(&gs).await,
            &active(default_segment(2)),
            "after the first call",
        );
        // Rank 1 does not call.
        let t0 = Instant::now();
        let mut t = ins[0].clone();
        let e = tokio::time::timeout(Duration::from_secs(10), gs[0].all_reduce(&mut t, ReduceOp::Sum))
            .await
            .expect("the deadline must end the call")
            .unwrap_err();
        let took = t0.elapsed();
        println!("rank 0 failed after {took:?}: {e}");
        assert!(matches!(e, Error::Timeout { op: "all_reduce", .. }), "{e}");
        assert!(
            took >= DEADLINE - Duration::from_millis(10) && took < Duration::from_secs(5),
            "{took:?}"
        );
    });
}

// ------------------------------------------- 9. nothing left behind (Linux)

/// Open file descriptors of this process.
#[cfg(target_os = "linux")]
fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// Open file descriptors of this process that are a shared-memory segment.
#[cfg(target_os = "linux")]
fn segment_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|p| p.to_string_lossy().contains("multiworld-collectives"))
        .count()
}

/// Mappings of a shared-memory segment in this process.
#[cfg(target_os = "linux")]
fn segment_maps() -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter(|l| l.contains("multiworld-collectives"))
        .count()
}

/// A world of 3 that sets up its segment and runs an all-reduce through it;
/// everything is dropped at the end.
#[cfg(target_os = "linux")]
async fn one_shm_world(name: &str) {
    let gs = with_cfg(&groups(name, 3).await, &shm_cfg());
    let ins = (0..3).map(|r| input(DType::F32, 10_000, r, 10)).collect();
    sum_checked(&gs, ins, "fd test").await;
    assert_all(&statuses(&gs).await, &active(default_segment(3)), name);
    // Every member maps the segment; nobody keeps a descriptor of it.
    assert_eq!(segment_maps(), 3, "one mapping per member");
    assert_eq!(segment_fds(), 0, "the creator's memfd is closed after setup");
    drop(gs);
}

#[cfg(target_os = "linux")]
#[test]
fn no_descriptor_or_mapping_is_left_behind() {
    run(async {
        let quiet = || segment_maps() == 0 && segment_fds() == 0;
        let start = open_fds();
        for i in 0..3 {
            one_shm_world(&format!("shm-fd-{i}")).await;
            assert!(
                eventually(Duration::from_secs(10), quiet).await,
                "world {i}: {} mappings and {} descriptors of a segment left after the groups were dropped",
                segment_maps(),
                segment_fds()
            );
        }
        let ok = eventually(Duration::from_secs(10), || open_fds() <= start).await;
        println!("descriptors: {start} before, {} after", open_fds());
        assert!(ok, "{} descriptors open, {start} before the worlds", open_fds());
    });
}

// ------------------------------- 10. the agreement round through the segment

/// Messages this member has sent to the other members so far.
fn messages_sent(g: &Group) -> u64 {
    g.ranks()
        .iter()
        .filter_map(|&r| g.comm().peer_stats(r))
        .map(|s| s.messages_sent)
        .sum()
}

/// Runs `call` on every member and returns, per member, its result and the
/// messages it sent meanwhile.
async fn counted<T, F, Fut>(gs: &[Group], call: F) -> Vec<(T, u64)>
where
    T: Send + 'static,
    F: Fn(usize, Group) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = T> + Send + 'static,
{
    let call = Arc::new(call);
    on_all(gs, move |me, g| {
        let call = Arc::clone(&call);
        async move {
            let before = messages_sent(&g);
            let out = tokio::time::timeout(Duration::from_secs(20), call(me, g.clone()))
                .await
                .expect("a call must not hang");
            (out, messages_sent(&g) - before)
        }
    })
    .await
}

/// Once a group's segment is set up, its calls agree through it, and under
/// `Auto` the small all-reduces, broadcasts, reduces, all-gathers and
/// reduce-scatters move their data through it too: a barrier, a large and
/// a small all-reduce send no message at all (a small one sent a
/// descriptor and its payload to each member before), and the algorithm
/// reported follows; a small `bool`
/// all-reduce, which never goes through the segment, still gives exact
/// results. Disagreements and invalid calls still fail on every member
/// with the errors they get over TCP, and the group goes on.
#[test]
fn calls_agree_through_the_segment_once_it_is_set_up() {
    run(async {
        use multiworld_collectives::CollectiveKind as K;
        const N: usize = 3;
        let gs = groups("shm-agree", N as u32).await;
        let large = CollectiveConfig::default().shm_min_bytes / 4;
        let barrier = |_: usize, g: Group| async move { g.barrier().await.unwrap() };
        let small_kinds = [
            K::AllReduce,
            K::Broadcast,
            K::Reduce,
            K::AllGatherInto,
            K::ReduceScatterTensor,
        ];
        for kind in small_kinds {
            assert_eq!(
                gs[0].algorithm_name(kind, 1024).await,
                "direct",
                "{kind:?} before the segment"
            );
        }
        let small: Vec<Tensor> = (0..N).map(|r| input(DType::I32, 256, r, 22)).collect();
        let want = Arc::new(reference(&small, ReduceOp::Sum));
        let small = Arc::new(small);
        let small_all_reduce = {
            let (small, want) = (Arc::clone(&small), Arc::clone(&want));
            move |me: usize, g: Group| {
                let (small, want) = (Arc::clone(&small), Arc::clone(&want));
                async move {
                    let mut t = small[me].clone();
                    g.all_reduce(&mut t, ReduceOp::Sum).await.unwrap();
                    assert_same(&t, &want, "a small all-reduce");
                }
            }
        };
        for (_, sent) in counted(&gs, small_all_reduce.clone()).await {
            assert_eq!(
                sent,
                2 * (N as u64 - 1),
                "a small direct all-reduce before the segment: a descriptor and a payload to each"
            );
        }
        // Before the segment: one descriptor to each other member.
        for (_, sent) in counted(&gs, barrier).await {
            assert_eq!(sent, N as u64 - 1, "a barrier over TCP");
        }
        let ins: Vec<Tensor> = (0..N).map(|r| general_input(DType::F32, large, r, 21)).collect();
        sum_checked(&gs, ins.clone(), "setting up").await;
        assert_all(
            &statuses(&gs).await,
            &active(default_segment(N)),
            "after setting up",
        );

        // Through the segment: no message for a barrier or a large all-reduce.
        for (_, sent) in counted(&gs, barrier).await {
            assert_eq!(sent, 0, "a barrier through the segment");
        }
        for round in 0..3 {
            let sent = sum_checked(&gs, ins.clone(), &format!("large, round {round}")).await;
            assert_eq!(
                sent,
                vec![0; N],
                "payload bytes of a large all-reduce, round {round}"
            );
        }
        for kind in small_kinds {
            assert_eq!(
                gs[0].algorithm_name(kind, 1024).await,
                "shm",
                "{kind:?} with the segment"
            );
        }
        for (_, sent) in counted(&gs, small_all_reduce).await {
            assert_eq!(sent, 0, "a small all-reduce through the segment");
        }
        let bools: Vec<Tensor> = (0..N).map(|r| input(DType::Bool, 100, r, 23)).collect();
        let want_or = Arc::new(reference(&bools, ReduceOp::Max));
        let bools = Arc::new(bools);
        counted(&gs, move |me, g| {
            let (bools, want_or) = (Arc::clone(&bools), Arc::clone(&want_or));
            async move {
                let mut t = bools[me].clone();
                g.all_reduce(&mut t, ReduceOp::Max).await.unwrap();
                assert_same(&t, &want_or, "a small bool all-reduce");
            }
        })
        .await;

        // Member 2 reduces with another op: every member fails alike.
        let errs = counted(&gs, move |me, g| async move {
            let mut t = Tensor::zeros(DType::F32, [large]).unwrap();
            let op = if me == 2 { ReduceOp::Max } else { ReduceOp::Sum };
            g.all_reduce(&mut t, op).await.unwrap_err().to_string()
        })
        .await;
        for (r, (e, sent)) in errs.iter().enumerate() {
            assert!(e.contains("reduce op") && e.contains("max"), "rank {r}: {e}");
            assert_eq!(e, &errs[0].0, "the same error everywhere");
            assert_eq!(*sent, 0, "rank {r}");
        }
        // Member 1 makes an invalid call (a root outside the group) while the
        // others plan a small broadcast through the segment.
        let errs = counted(&gs, move |me, g| async move {
            let mut t = Tensor::zeros(DType::F32, [64]).unwrap();
            let root = if me == 1 { Rank(99) } else { Rank(0) };
            g.broadcast(&mut t, root).await.unwrap_err().to_string()
        })
        .await;
        for (r, (e, _)) in errs.iter().enumerate() {
            let want = if r == 1 { "root" } else { "rejected their own call" };
            assert!(e.contains(want), "rank {r}: {e}");
        }
        // The group goes on, through the segment.
        sum_checked(&gs, ins.clone(), "after the failed calls").await;
        for (_, sent) in counted(&gs, barrier).await {
            assert_eq!(sent, 0, "a barrier after the failed calls");
        }
        assert_all(&statuses(&gs).await, &active(default_segment(N)), "at the end");
    });
}

/// A member whose call is dropped while it uses the segment (here: after
/// arriving at the agreement, before the others came) abandons the segment
/// with its next call: the others, waiting for it at a barrier of the
/// dropped call, fail at once instead of hanging; from that next call on
/// every member agrees over TCP, and the calls give exact results.
#[test]
fn a_call_dropped_while_it_used_the_segment_fails_the_others_then_the_group_uses_tcp() {
    run(dropped_while_using_the_segment(Dropped::AllReduce));
}

/// As above, the dropped call a broadcast from the dropped member: the
/// others wait in the broadcast's steps for pieces it never writes.
#[test]
fn a_broadcast_dropped_on_its_root_fails_the_others_then_the_group_uses_tcp() {
    run(dropped_while_using_the_segment(Dropped::BroadcastFromIt));
}

/// The call that member 1 drops while it uses the segment.
#[derive(Clone, Copy, Debug)]
enum Dropped {
    AllReduce,
    /// A broadcast from member 1.
    BroadcastFromIt,
}

impl Dropped {
    async fn call(self, g: &Group, t: &mut Tensor) -> multiworld_tcp::Result<()> {
        match self {
            Dropped::AllReduce => g.all_reduce(t, ReduceOp::Sum).await,
            Dropped::BroadcastFromIt => g.broadcast(t, Rank(1)).await,
        }
    }
}

/// Member 1 drops a `dropped` call while it waits for the others: they fail
/// once its next call abandons the segment, and from then on every call of
/// the group goes over TCP.
async fn dropped_while_using_the_segment(dropped: Dropped) {
    {
        const N: usize = 3;
        let gs = groups(&format!("shm-abandoned-{dropped:?}"), N as u32).await;
        let large = CollectiveConfig::default().shm_min_bytes / 4;
        let ins: Vec<Tensor> = (0..N).map(|r| general_input(DType::F32, large, r, 31)).collect();
        sum_checked(&gs, ins.clone(), "setting up").await;
        assert_all(
            &statuses(&gs).await,
            &active(default_segment(N)),
            "after setting up",
        );

        // Member 1 calls alone and is dropped while it waits for the others.
        let mut t = ins[1].clone();
        let ended = tokio::time::timeout(Duration::from_millis(100), dropped.call(&gs[1], &mut t)).await;
        assert!(ended.is_err(), "the call cannot end before the others make it");
        // The others make that call: member 1's arrival lets them through the
        // agreement, then they wait for it in the algorithm.
        let others: Vec<_> = [0, 2]
            .into_iter()
            .map(|me| {
                let (g, mut t) = (gs[me].clone(), ins[me].clone());
                tokio::spawn(async move {
                    let r = tokio::time::timeout(Duration::from_secs(20), dropped.call(&g, &mut t)).await;
                    (r.expect("the others must not hang"), Instant::now())
                })
            })
            .collect();
        // Member 1's next call abandons the segment (and agrees over TCP).
        let abandoned_at = Instant::now();
        let ins2: Vec<Tensor> = (0..N).map(|r| input(DType::I64, 5_000, r, 32)).collect();
        let want = reference(&ins2, ReduceOp::Sum);
        let next1 = {
            let (g, mut t, want) = (gs[1].clone(), ins2[1].clone(), want.clone());
            tokio::spawn(async move {
                g.all_reduce(&mut t, ReduceOp::Sum).await.unwrap();
                assert_same(&t, &want, "member 1's next call");
            })
        };
        for (i, h) in others.into_iter().enumerate() {
            let (r, ended) = h.await.unwrap();
            let e = r.unwrap_err();
            assert!(
                matches!(&e, Error::InvalidArgument(m) if m.contains("rank 1 abandoned")),
                "member {}: {e}",
                [0, 2][i]
            );
            let waited = ended.saturating_duration_since(abandoned_at);
            assert!(
                waited < Duration::from_secs(5),
                "failed {waited:?} after the abandoning"
            );
        }
        // The others' next call meets member 1's over TCP.
        on_all(&[gs[0].clone(), gs[2].clone()], {
            let (ins2, want) = (ins2.clone(), want.clone());
            move |i, g| {
                let (mut t, want) = (ins2[[0, 2][i]].clone(), want.clone());
                async move {
                    g.all_reduce(&mut t, ReduceOp::Sum).await.unwrap();
                    assert_same(&t, &want, "the others' next call");
                }
            }
        })
        .await;
        next1.await.unwrap();
        for (r, s) in statuses(&gs).await.iter().enumerate() {
            assert!(
                matches!(s, SharedMemory::Unavailable { reason } if reason.contains("cancelled")),
                "member {r}: {s}"
            );
        }
        // Later calls: the ring over TCP (integers: the ring does not reduce
        // in rank order).
        let ins3 = (0..N).map(|r| input(DType::I64, large, r, 33)).collect();
        let sent = sum_checked(&gs, ins3, "after the abandoning").await;
        assert!(
            sent.iter().all(|&b| b > 0),
            "the ring's payloads go over TCP: {sent:?}"
        );
        for g in &gs {
            assert_eq!(
                g.algorithm_name(multiworld_collectives::CollectiveKind::AllReduce, 1 << 24)
                    .await,
                "ring"
            );
        }
    }
}

/// A call dropped after its member arrived at the agreement barrier: the
/// others still complete that call, however slow one of them is, and
/// although the dropped member abandons the segment meanwhile (it had
/// arrived; only the barriers it never reaches may fail). Then every member
/// agrees over TCP.
#[test]
fn a_call_dropped_after_it_arrived_still_completes_on_the_others() {
    run(async {
        const N: usize = 3;
        let gs = groups("shm-abandoned-late", N as u32).await;
        let large = CollectiveConfig::default().shm_min_bytes / 4;
        let ins: Vec<Tensor> = (0..N).map(|r| input(DType::I64, large, r, 41)).collect();
        sum_checked(&gs, ins.clone(), "setting up").await;
        // Member 2 arrives at the barrier's agreement and is dropped there.
        let dropped = tokio::time::timeout(Duration::from_millis(100), gs[2].barrier()).await;
        assert!(dropped.is_err(), "the barrier cannot end before the others come");
        // Member 0 comes and waits for member 1.
        let zero = {
            let g = gs[0].clone();
            tokio::spawn(async move { tokio::time::timeout(Duration::from_secs(20), g.barrier()).await })
        };
        // Member 2's next call abandons the segment and agrees over TCP: its
        // descriptors go out.
        let sent_before = messages_sent(&gs[2]);
        let next2 = {
            let g = gs[2].clone();
            tokio::spawn(async move { g.barrier().await })
        };
        let out = eventually(Duration::from_secs(10), || {
            messages_sent(&gs[2]) >= sent_before + 2
        })
        .await;
        assert!(out, "member 2's next call sent no descriptor");
        // Member 1 comes late to the dropped call: it and member 0 pass it.
        let one = tokio::time::timeout(Duration::from_secs(20), gs[1].barrier()).await;
        assert!(matches!(one, Ok(Ok(()))), "member 1: {one:?}");
        let zero = zero.await.unwrap();
        assert!(matches!(zero, Ok(Ok(()))), "member 0: {zero:?}");
        // The next call, over TCP everywhere.
        on_all(&[gs[0].clone(), gs[1].clone()], |_, g| async move {
            g.barrier().await.unwrap()
        })
        .await;
        next2.await.unwrap().unwrap();
        for (r, s) in statuses(&gs).await.iter().enumerate() {
            assert!(matches!(s, SharedMemory::Unavailable { .. }), "member {r}: {s}");
        }
        sum_checked(&gs, ins, "after").await;
    });
}
