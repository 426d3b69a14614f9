//! Helpers for the collective tests: in-process worlds of `Group`s, running one
//! closure per rank with a hang guard, deterministic per-rank inputs that make
//! every reduction exact (so results can be compared bit for bit with a
//! sequential reference in rank order), and that reference.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use multiworld_collectives::{Algorithm, CollectiveConfig, Group};
use multiworld_tcp::Error;
use multiworld_types::{DType, ReduceOp, Tensor, bf16, f16};

use crate::mesh;

/// Every call of a test must finish within this, or the test fails (a hang).
pub const HANG: Duration = Duration::from_secs(60);

/// World groups of `n` in-process ranks.
pub async fn groups(name: &str, n: u32) -> Vec<Group> {
    mesh(name, n)
        .await
        .into_iter()
        .map(|c| Group::world(&Arc::new(c)))
        .collect()
}

/// The same groups with other settings.
pub fn with_cfg(gs: &[Group], cfg: &CollectiveConfig) -> Vec<Group> {
    gs.iter().map(|g| g.with_config(cfg.clone())).collect()
}

/// The same groups with an algorithm forced.
pub fn with_algo(gs: &[Group], a: Algorithm) -> Vec<Group> {
    with_cfg(gs, &CollectiveConfig::default().with_algorithm(a))
}

/// A seed from the parts that name a test case (FNV-1a over the words).
pub fn seed_of(parts: &[u64]) -> u64 {
    parts.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &p| {
        (h ^ p).wrapping_mul(0x100_0000_01b3)
    })
}

/// An all-reduce with `op`, which is not defined for `input`'s dtype, fails
/// with InvalidArgument before touching the tensor.
pub async fn assert_undefined_op_refused(g: &Group, input: &Tensor, op: ReduceOp, what: &str) {
    let mut t = input.clone();
    let e = g.all_reduce(&mut t, op).await.unwrap_err();
    assert!(
        matches!(&e, Error::InvalidArgument(m) if m.contains("not defined")),
        "{what}: {e}"
    );
    assert_same(&t, input, "input untouched");
}

/// Runs `f(rank_index, group)` for every rank concurrently (one task each) and
/// returns the outputs in rank order; fails the test if they do not all finish
/// within [`HANG`].
pub async fn on_all<T, F, Fut>(gs: &[Group], f: F) -> Vec<T>
where
    T: Send + 'static,
    F: Fn(usize, Group) -> Fut,
    Fut: Future<Output = T> + Send + 'static,
{
    let tasks: Vec<_> = gs
        .iter()
        .enumerate()
        .map(|(i, g)| tokio::spawn(f(i, g.clone())))
        .collect();
    let mut out = Vec::new();
    for (i, t) in tasks.into_iter().enumerate() {
        let r = tokio::time::timeout(HANG, t)
            .await
            .unwrap_or_else(|_| panic!("rank {i} hung (> {HANG:?})"));
        out.push(r.unwrap());
    }
    out
}

/// A small deterministic generator (xorshift).
pub struct Rng(u64);

impl Rng {
    /// A generator started from `seed`.
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    /// The next number (xorshift).
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
}

/// Rank `rank`'s input of `numel` elements of `dtype` for test `seed`. Floats are
/// small integers in -2..=2 (so sums and products of up to 8 ranks are exact in
/// every float type, whatever the order); integers are arbitrary (wrapping
/// arithmetic is exact in any order); bools random.
pub fn input(dtype: DType, numel: usize, rank: usize, seed: u64) -> Tensor {
    let mut r = Rng::new(seed ^ ((rank as u64 + 1) * 0x1234_5678) ^ numel as u64);
    let small = |r: &mut Rng| (r.next_u64() % 5) as i64 - 2;
    match dtype {
        DType::F16 => Tensor::from(
            (0..numel)
                .map(|_| f16::from_f32(small(&mut r) as f32))
                .collect::<Vec<_>>(),
        ),
        DType::BF16 => Tensor::from(
            (0..numel)
                .map(|_| bf16::from_f32(small(&mut r) as f32))
                .collect::<Vec<_>>(),
        ),
        DType::F32 => Tensor::from((0..numel).map(|_| small(&mut r) as f32).collect::<Vec<_>>()),
        DType::F64 => Tensor::from((0..numel).map(|_| small(&mut r) as f64).collect::<Vec<_>>()),
        DType::Bool => Tensor::from((0..numel).map(|_| r.next_u64() & 1 == 1).collect::<Vec<_>>()),
        d => {
            let bytes: Vec<u8> = (0..numel * d.size()).map(|_| r.next_u64() as u8).collect();
            Tensor::from_bytes(d, [numel], &bytes).unwrap()
        }
    }
}

/// The reference reduction of `inputs` (rank order, sequentially).
pub fn reference(inputs: &[Tensor], op: ReduceOp) -> Tensor {
    let d = inputs[0].dtype();
    let n = inputs.len();
    macro_rules! fold {
        ($t:ty, $f:expr, $avg:expr) => {{
            let vs: Vec<&[$t]> = inputs.iter().map(|t| t.as_slice::<$t>().unwrap()).collect();
            let out: Vec<$t> = (0..vs[0].len())
                .map(|i| {
                    let mut acc = vs[0][i];
                    for v in &vs[1..] {
                        acc = $f(acc, v[i]);
                    }
                    if op == ReduceOp::Avg { $avg(acc, n) } else { acc }
                })
                .collect();
            Tensor::from(out)
        }};
    }
    macro_rules! int {
        ($t:ty) => {
            fold!(
                $t,
                |a: $t, b: $t| match op {
                    ReduceOp::Sum => a.wrapping_add(b),
                    ReduceOp::Product => a.wrapping_mul(b),
                    ReduceOp::Min => a.min(b),
                    ReduceOp::Max => a.max(b),
                    ReduceOp::BAnd => a & b,
                    ReduceOp::BOr => a | b,
                    ReduceOp::BXor => a ^ b,
                    other => panic!("{other} on an integer"),
                },
                |a: $t, _n| a
            )
        };
    }
    macro_rules! float {
        ($t:ty, $to:expr, $from:expr) => {
            fold!(
                $t,
                |a: $t, b: $t| {
                    let (x, y) = ($to(a), $to(b));
                    $from(match op {
                        ReduceOp::Sum | ReduceOp::Avg => x + y,
                        ReduceOp::Product => x * y,
                        ReduceOp::Min => {
                            if x.is_nan() || y.is_nan() {
                                f64::NAN
                            } else {
                                x.min(y)
                            }
                        }
                        ReduceOp::Max => {
                            if x.is_nan() || y.is_nan() {
                                f64::NAN
                            } else {
                                x.max(y)
                            }
                        }
                        other => panic!("{other} on a float"),
                    })
                },
                |a: $t, n: usize| $from($to(a) / n as f64)
            )
        };
    }
    match d {
        DType::I8 => int!(i8),
        DType::I16 => int!(i16),
        DType::I32 => int!(i32),
        DType::I64 => int!(i64),
        DType::U8 => int!(u8),
        DType::U16 => int!(u16),
        DType::U32 => int!(u32),
        DType::U64 => int!(u64),
        // Inputs are small integers, so every intermediate is exact in f64 and in
        // the tensor's own type; the one rounding is the average's division, done
        // in f32 for halves (as the kernel does) and in the type itself otherwise.
        DType::F16 => {
            let avg = |s: f16, n: usize| f16::from_f32(s.to_f32() / n as f32);
            let t = float!(f16, |v: f16| v.to_f64(), |x: f64| f16::from_f64(x));
            if op == ReduceOp::Avg {
                map_avg(reference(inputs, ReduceOp::Sum), n, avg)
            } else {
                t
            }
        }
        DType::BF16 => {
            let avg = |s: bf16, n: usize| bf16::from_f32(s.to_f32() / n as f32);
            let t = float!(bf16, |v: bf16| v.to_f64(), |x: f64| bf16::from_f64(x));
            if op == ReduceOp::Avg {
                map_avg(reference(inputs, ReduceOp::Sum), n, avg)
            } else {
                t
            }
        }
        DType::F32 => {
            let t = float!(f32, |v: f32| v as f64, |x: f64| x as f32);
            if op == ReduceOp::Avg {
                map_avg(reference(inputs, ReduceOp::Sum), n, |s: f32, n| s / n as f32)
            } else {
                t
            }
        }
        DType::F64 => float!(f64, |v: f64| v, |x: f64| x),
        DType::Bool => fold!(
            bool,
            |a: bool, b: bool| match op {
                ReduceOp::Sum | ReduceOp::Max | ReduceOp::BOr => a | b,
                ReduceOp::Product | ReduceOp::Min | ReduceOp::BAnd => a & b,
                ReduceOp::BXor => a ^ b,
                other => panic!("{other} on bool"),
            },
            |a: bool, _n| a
        ),
    }
}

fn map_avg<T: multiworld_types::Element>(sum: Tensor, n: usize, f: impl Fn(T, usize) -> T) -> Tensor {
    Tensor::from(
        sum.as_slice::<T>()
            .unwrap()
            .iter()
            .map(|&s| f(s, n))
            .collect::<Vec<_>>(),
    )
}

/// Elements `range` of `t` as a new tensor.
pub fn slice(t: &Tensor, range: std::ops::Range<usize>) -> Tensor {
    let es = t.dtype().size();
    Tensor::from_bytes(
        t.dtype(),
        [range.len()],
        &t.as_bytes()[range.start * es..range.end * es],
    )
    .unwrap()
}

/// Concatenation of tensors of one dtype.
pub fn concat(ts: &[Tensor]) -> Tensor {
    let d = ts[0].dtype();
    let bytes: Vec<u8> = ts.iter().flat_map(|t| t.as_bytes().to_vec()).collect();
    Tensor::from_bytes(d, [bytes.len() / d.size()], &bytes).unwrap()
}

/// Asserts two tensors have the same dtype and the same bytes.
#[track_caller]
pub fn assert_same(got: &Tensor, want: &Tensor, what: &str) {
    assert_eq!(got.dtype(), want.dtype(), "{what}: dtype");
    assert_eq!(got.numel(), want.numel(), "{what}: numel");
    if got.as_bytes() != want.as_bytes() {
        let es = got.dtype().size();
        let i = (0..got.numel())
            .find(|&i| got.as_bytes()[i * es..(i + 1) * es] != want.as_bytes()[i * es..(i + 1) * es])
            .unwrap();
        panic!(
            "{what}: differs first at element {i}: got {:?}, want {:?}",
            &got.as_bytes()[i * es..(i + 1) * es],
            &want.as_bytes()[i * es..(i + 1) * es]
        );
    }
}
