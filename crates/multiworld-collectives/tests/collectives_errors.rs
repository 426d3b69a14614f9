//! Collective error paths between in-process ranks: ranks that disagree on the
//! length, dtype, root, reduce op, operation, splits or settings all get a clear
//! error and nothing hangs (a timeout guard fails the test otherwise); the group
//! is usable again afterwards; invalid calls fail before any tensor data is sent
//! and tell the other members; a member that is lost in the middle of a call makes
//! every other member's call fail quickly (never a partial result reported as
//! success); deadlines apply.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use multiworld_collectives::{Algorithm, CollectiveConfig, Group};
use multiworld_tcp::{DType, Error, Rank, Tensor};
use multiworld_testkit::coll::*;
use multiworld_types::ReduceOp;

/// Every rank's call must fail; returns the errors.
async fn all_fail<F, Fut>(gs: &[Group], f: F) -> Vec<Error>
where
    F: Fn(usize, Group) -> Fut,
    Fut: std::future::Future<Output = multiworld_tcp::Result<()>> + Send + 'static,
{
    let t0 = Instant::now();
    let rs = on_all(gs, f).await;
    let errs: Vec<Error> = rs
        .into_iter()
        .enumerate()
        .map(|(r, x)| x.err().unwrap_or_else(|| panic!("rank {r} succeeded")))
        .collect();
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "errors took {:?}",
        t0.elapsed()
    );
    errs
}

/// The group still works: a correct all-reduce on every rank.
async fn still_works(gs: &[Group]) {
    let n = gs.len() as u64;
    let out = on_all(gs, |_, g| async move {
        let mut t = Tensor::from(vec![1u64; 1000]);
        g.all_reduce(&mut t, ReduceOp::Sum).await.map(|()| t)
    })
    .await;
    for t in out {
        assert!(t.unwrap().as_slice::<u64>().unwrap().iter().all(|&x| x == n));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disagreements_fail_on_every_rank_and_the_group_recovers() {
    let base = groups("disagree", 3).await;
    for algo in [Algorithm::Auto, Algorithm::Direct, Algorithm::Ring] {
        let gs = with_algo(&base, algo);
        // Length: small (direct payloads sent eagerly) and large (ring).
        for len in [4usize, 300_000] {
            let errs = all_fail(&gs, move |r, g| async move {
                let mut t = Tensor::zeros(DType::F32, [len + usize::from(r == 2)]).unwrap();
                g.all_reduce(&mut t, ReduceOp::Sum).await
            })
            .await;
            for (r, e) in errs.iter().enumerate() {
                match e {
                    Error::Mismatch {
                        peer, expected, got, ..
                    } => {
                        assert_eq!(*peer, if r == 2 { Rank(0) } else { Rank(2) }, "{e}");
                        assert_ne!(expected.bytes, got.bytes);
                    }
                    other => panic!("{algo:?} rank {r}: expected Mismatch, got {other}"),
                }
            }
            still_works(&gs).await;
        }
        // Dtype.
        let errs = all_fail(&gs, |r, g| async move {
            let d = if r == 1 { DType::F64 } else { DType::F32 };
            let mut t = Tensor::zeros(d, [10]).unwrap();
            g.all_reduce(&mut t, ReduceOp::Sum).await
        })
        .await;
        assert!(
            errs.iter().all(|e| matches!(e, Error::Mismatch { .. })),
            "{errs:?}"
        );
        still_works(&gs).await;
        // Root.
        let errs = all_fail(&gs, |r, g| async move {
            let mut t = Tensor::zeros(DType::U8, [100]).unwrap();
            g.broadcast(&mut t, Rank(if r == 0 { 0 } else { 1 })).await
        })
        .await;
        for e in &errs {
            let m = e.to_string();
            assert!(
                m.contains("disagree on the root") && m.contains("rank 0: 0") && m.contains("rank 1: 1"),
                "{m}"
            );
        }
        assert!(
            errs.iter().all(|e| e.to_string() == errs[0].to_string()),
            "same text on every rank"
        );
        still_works(&gs).await;
        // Reduce op.
        let errs = all_fail(&gs, |r, g| async move {
            let mut t = Tensor::zeros(DType::I32, [10]).unwrap();
            let op = if r == 2 { ReduceOp::Max } else { ReduceOp::Sum };
            g.reduce(&mut t, Rank(0), op).await
        })
        .await;
        assert!(
            errs.iter().all(|e| e.to_string().contains("reduce op")),
            "{errs:?}"
        );
        still_works(&gs).await;
        // Operation.
        let errs = all_fail(&gs, |r, g| async move {
            let mut t = Tensor::zeros(DType::I32, [10]).unwrap();
            if r == 0 {
                g.all_reduce(&mut t, ReduceOp::Sum).await
            } else {
                g.broadcast(&mut t, Rank(1)).await
            }
        })
        .await;
        assert!(
            errs.iter().all(|e| e.to_string().contains("operation")),
            "{errs:?}"
        );
        still_works(&gs).await;
        // all_to_all_single splits that do not match.
        let errs = all_fail(&gs, |r, g| async move {
            let input = Tensor::zeros(DType::I16, [6]).unwrap();
            // Rank 1 expects 3 elements from rank 0, which sends 2 (its own split agrees).
            let out_splits = if r == 1 { [3usize, 2, 1] } else { [2, 2, 2] };
            let mut out = Tensor::zeros(DType::I16, [6]).unwrap();
            g.all_to_all_single(&mut out, &input, Some(&out_splits), None)
                .await
        })
        .await;
        assert!(
            errs.iter().all(|e| e.to_string().contains("split sizes")),
            "{errs:?}"
        );
        still_works(&gs).await;
        // gather with a wrong size at the root.
        let errs = all_fail(&gs, |r, g| async move {
            let input = Tensor::zeros(DType::F32, [5]).unwrap();
            let mut outs: Vec<Tensor> = (0..3)
                .map(|p| Tensor::zeros(DType::F32, [if p == 2 { 4 } else { 5 }]).unwrap())
                .collect();
            g.gather(&input, (r == 0).then_some(&mut outs[..]), Rank(0)).await
        })
        .await;
        assert!(
            errs.iter()
                .all(|e| e.to_string().contains("expects 4 from rank 2")),
            "{errs:?}"
        );
        still_works(&gs).await;
    }
    // Settings that choose different algorithms.
    let errs = all_fail(&base, |r, g| async move {
        let a = if r == 0 {
            Algorithm::Ring
        } else {
            Algorithm::Direct
        };
        let g = g.with_config(CollectiveConfig::default().with_algorithm(a));
        let mut t = Tensor::zeros(DType::F32, [1000]).unwrap();
        g.all_reduce(&mut t, ReduceOp::Sum).await
    })
    .await;
    assert!(
        errs.iter().all(|e| e.to_string().contains("CollectiveConfig")),
        "{errs:?}"
    );
    still_works(&base).await;
    // Object size limits that differ: an object one member would refuse and
    // the others take fails the call on every member, before any of it is
    // sent (no member waits for an object that never comes).
    let errs = all_fail(&base, |r, g| async move {
        let mut cfg = CollectiveConfig::default();
        if r == 2 {
            cfg.max_object_bytes = 1 << 20;
        }
        let g = g.with_config(cfg);
        // Rank 0's object is within its own limit and above rank 2's; rank
        // 2's own object is small, so rank 2 has nothing to refuse locally.
        let value = vec![r as u8; if r == 0 { 2 << 20 } else { 16 }];
        g.all_gather_object(&value).await.map(drop)
    })
    .await;
    // Each member names the difference it sees first: the settings, or (on
    // rank 2) the object above its limit.
    assert!(
        errs.iter()
            .all(|e| e.to_string().contains("CollectiveConfig") || e.to_string().contains("max_object_bytes")),
        "{errs:?}"
    );
    still_works(&base).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_calls_fail_before_any_data_and_tell_the_others() {
    let gs = groups("invalid", 3).await;
    // The same undefined (op, dtype) pair on every rank: an immediate error
    // everywhere, and no tensor data on the wire (only the small descriptors).
    let len = 100_000usize;
    let before: Vec<u64> = gs
        .iter()
        .map(|g| {
            g.ranks()
                .iter()
                .filter_map(|&r| g.comm().peer_stats(r))
                .map(|s| s.bytes_sent)
                .sum()
        })
        .collect();
    for (op, dtype) in [
        (ReduceOp::BAnd, DType::F32),
        (ReduceOp::Avg, DType::I32),
        (ReduceOp::Avg, DType::Bool),
        (ReduceOp::BXor, DType::BF16),
    ] {
        let errs = all_fail(&gs, move |_, g| async move {
            let mut t = Tensor::zeros(dtype, [len]).unwrap();
            g.all_reduce(&mut t, op).await
        })
        .await;
        for e in errs {
            let m = e.to_string();
            assert!(
                matches!(e, Error::InvalidArgument(_)) && m.contains("not defined for"),
                "{m}"
            );
        }
    }
    still_works(&gs).await;
    for (g, b) in gs.iter().zip(before) {
        let after: u64 = g
            .ranks()
            .iter()
            .filter_map(|&r| g.comm().peer_stats(r))
            .map(|s| s.bytes_sent)
            .sum();
        // 4 invalid calls + 1 all-reduce of 8000 bytes to 2 peers, plus descriptors.
        let sent = after - b;
        println!("rank {:?} sent {sent} bytes", g.group_rank());
        assert!(
            sent < 2 * 8000 + 10 * 1000,
            "sent {sent} bytes: tensor data went out"
        );
    }
    // One rank's call is invalid, the others' is fine: that rank fails with the
    // reason, the others learn that it rejected its call.
    let errs = all_fail(&gs, |r, g| async move {
        let mut t = Tensor::zeros(DType::I32, [10]).unwrap();
        let op = if r == 0 { ReduceOp::Avg } else { ReduceOp::Sum };
        g.all_reduce(&mut t, op).await
    })
    .await;
    assert!(errs[0].to_string().contains("not defined"), "{}", errs[0]);
    for e in &errs[1..] {
        assert!(e.to_string().contains("rank(s) 0 rejected"), "{e}");
    }
    still_works(&gs).await;
    // Other invalid calls: a root outside the group, a wrong list length, a root
    // without its list, an output of the wrong size.
    let errs = all_fail(&gs, |_, g| async move {
        let mut t = Tensor::zeros(DType::U8, [3]).unwrap();
        g.broadcast(&mut t, Rank(7)).await
    })
    .await;
    assert!(
        errs.iter().all(|e| e.to_string().contains("not a member")),
        "{errs:?}"
    );
    let errs = all_fail(&gs, |r, g| async move {
        let input = Tensor::zeros(DType::U8, [3]).unwrap();
        let mut outs: Vec<Tensor> = (0..if r == 1 { 2 } else { 3 })
            .map(|_| Tensor::zeros(DType::U8, [3]).unwrap())
            .collect();
        g.all_gather(&mut outs, &input).await
    })
    .await;
    assert!(
        errs[1].to_string().contains("output list has 2 elements"),
        "{}",
        errs[1]
    );
    let errs = all_fail(&gs, |r, g| async move {
        let mut out = Tensor::zeros(DType::U8, [3]).unwrap();
        let _ = r;
        g.scatter(&mut out, None, Rank(0)).await
    })
    .await;
    assert!(
        errs[0].to_string().contains("must pass an input list"),
        "{}",
        errs[0]
    );
    let errs = all_fail(&gs, |_, g| async move {
        let mut out = Tensor::zeros(DType::F32, [4]).unwrap();
        g.all_gather_into_tensor(&mut out, &Tensor::zeros(DType::F32, [2]).unwrap())
            .await
    })
    .await;
    assert!(
        errs.iter()
            .all(|e| e.to_string().contains("all_gather_into_tensor")),
        "{errs:?}"
    );
    still_works(&gs).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_lost_mid_call_fails_every_other_member() {
    // Ranks 0..=2 run a large ring all-reduce; rank 3 aborts its communicator
    // part-way. Every survivor must fail quickly with an error, never return.
    const LEN: usize = 8 << 20; // 32 MiB of f32
    let gs = groups("lost", 4).await;
    let outs = on_all(&gs, |r, g| async move {
        let mut t = Tensor::zeros(DType::F32, [LEN]).unwrap();
        // A first call completes normally.
        g.all_reduce(&mut t, ReduceOp::Sum).await.unwrap();
        if r == 3 {
            let comm = g.comm().clone();
            let call = tokio::spawn({
                let g = g.clone();
                async move { g.all_reduce(&mut t, ReduceOp::Sum).await }
            });
            // Let the call get under way, then pull the plug.
            tokio::time::sleep(Duration::from_millis(20)).await;
            comm.abort();
            let e = call.await.unwrap().unwrap_err();
            return (e, Duration::ZERO);
        }
        let started = Instant::now();
        let e = g.all_reduce(&mut t, ReduceOp::Sum).await.unwrap_err();
        (e, started.elapsed())
    })
    .await;
    let (e3, _) = &outs[3];
    assert!(matches!(e3, Error::Aborted { .. }), "the aborting rank: {e3}");
    for (r, (e, took)) in outs[..3].iter().enumerate() {
        println!("rank {r}: failed after {took:?} (call start to error; the abort is ~20 ms in): {e}");
        assert!(e.is_world_fatal(), "rank {r}: {e}");
        assert!(*took < Duration::from_secs(2), "rank {r} took {took:?}");
    }
    // Later calls fail at once, without waiting for anything.
    let later = on_all(&gs[..3], |_, g| async move {
        let t0 = Instant::now();
        let e = g.barrier().await.unwrap_err();
        (e, t0.elapsed())
    })
    .await;
    for (e, took) in later {
        // Rank 3, or a survivor whose connection broke when the failed call was
        // abandoned part-way through a send: the world is broken either way.
        assert!(matches!(e, Error::PeerLost { .. }), "{e}");
        assert!(took < Duration::from_millis(100), "{took:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_that_never_calls_hits_the_deadline() {
    let gs = groups("deadline", 3).await;
    let cfg = CollectiveConfig::default().with_timeout(Some(Duration::from_millis(200)));
    let out = on_all(&gs[..2], move |_, g| {
        let g = g.with_config(cfg.clone());
        async move {
            let t0 = Instant::now();
            let e = g.barrier().await.unwrap_err();
            (e, t0.elapsed())
        }
    })
    .await;
    for (e, took) in out {
        assert!(matches!(e, Error::Timeout { op: "barrier", .. }), "{e}");
        assert!(
            took >= Duration::from_millis(190) && took < Duration::from_secs(2),
            "{took:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handle_forms_report_errors_too() {
    let gs = groups("handle-errors", 2).await;
    let out = on_all(&gs, |r, g| async move {
        let t = Tensor::zeros(DType::F32, [3 + r]).unwrap();
        let h = g.all_reduce_handle(t, ReduceOp::Sum);
        let e = h.wait().await.unwrap_err();
        let h = g.reduce_scatter_tensor_handle(
            Tensor::zeros(DType::I8, [1]).unwrap(),
            Tensor::zeros(DType::I8, [2]).unwrap(),
            ReduceOp::Avg,
        );
        let e2 = h.await.unwrap_err();
        (e, e2)
    })
    .await;
    for (e, e2) in out {
        assert!(matches!(e, Error::Mismatch { .. }), "{e}");
        assert!(e2.to_string().contains("not defined"), "{e2}");
    }
    // Outside a runtime, a handle is an error, not a panic.
    let g = gs[0].clone();
    let h = std::thread::spawn(move || g.barrier_handle()).join().unwrap();
    assert!(h.is_completed());
    assert!(h.await.unwrap_err().to_string().contains("Tokio runtime"));
}
