//! Reduce operations ([`ReduceOp`]), which dtype each is defined for, and the
//! element-wise kernels that apply them. Kernels are plain loops over equal-length
//! slices (so the compiler vectorises them); `f16`/`bf16` are widened to `f32` in
//! small blocks, combined, and rounded back, which gives the correctly rounded
//! half-precision result of each binary operation (`f32` has more than twice the
//! significand bits of either half type, so the double rounding is innocuous).
//!
//! Definitions (chosen to match torch where torch defines them):
//! * integers: `sum`/`product` wrap on overflow (two's complement, like torch);
//!   `min`/`max` are exact; `band`/`bor`/`bxor` are bitwise; `avg` is **not
//!   defined** (the wrapped sum would make it meaningless) and is refused.
//! * floats: IEEE `+` and `*`; `min`/`max` propagate NaN and order `-0 < +0`, so
//!   they do not depend on the order of the ranks; `avg` is the sum divided by the
//!   number of ranks once at the end (for halves: the half-precision sum, divided in
//!   `f32`, rounded once); `band`/`bor`/`bxor` are refused.
//! * bool: `sum` and `max` are logical or, `product` and `min` logical and,
//!   `band`/`bor`/`bxor` are and/or/xor; `avg` is refused.

use std::fmt;

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use crate::tensor::{DType, Element};

/// A reduction, as in `torch.distributed.ReduceOp`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
// Exhaustive on purpose: every backend's tables (wire codes, NCCL types,
// kernels) match on it, so adding a variant is a compile error wherever one
// must be taught about it.
pub enum ReduceOp {
    /// Element-wise sum (integers wrap; bool: logical or).
    Sum,
    /// Element-wise product (integers wrap; bool: logical and).
    Product,
    /// Element-wise minimum (floats: NaN wins, `-0 < +0`; bool: and).
    Min,
    /// Element-wise maximum (floats: NaN wins, `-0 < +0`; bool: or).
    Max,
    /// Sum divided by the number of ranks; floating-point dtypes only.
    Avg,
    /// Bitwise and; integer and bool dtypes only.
    BAnd,
    /// Bitwise or; integer and bool dtypes only.
    BOr,
    /// Bitwise xor; integer and bool dtypes only.
    BXor,
}

impl ReduceOp {
    /// Every reduce op.
    pub const ALL: [ReduceOp; 8] = [
        ReduceOp::Sum,
        ReduceOp::Product,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Avg,
        ReduceOp::BAnd,
        ReduceOp::BOr,
        ReduceOp::BXor,
    ];

    /// The name torch uses (`"sum"`, `"band"`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Product => "product",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Avg => "avg",
            ReduceOp::BAnd => "band",
            ReduceOp::BOr => "bor",
            ReduceOp::BXor => "bxor",
        }
    }

    /// Whether this op is defined for `dtype` (see the module docs). Calls with an
    /// undefined pair fail with an invalid-argument error before any tensor
    /// data is sent.
    pub const fn supports(self, dtype: DType) -> bool {
        let float = matches!(dtype, DType::F16 | DType::BF16 | DType::F32 | DType::F64);
        match self {
            ReduceOp::Sum | ReduceOp::Product | ReduceOp::Min | ReduceOp::Max => true,
            ReduceOp::Avg => float,
            ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor => !float,
        }
    }

    /// Stable code used in collective descriptors (never 0).
    pub const fn code(self) -> u8 {
        match self {
            ReduceOp::Sum => 1,
            ReduceOp::Product => 2,
            ReduceOp::Min => 3,
            ReduceOp::Max => 4,
            ReduceOp::Avg => 5,
            ReduceOp::BAnd => 6,
            ReduceOp::BOr => 7,
            ReduceOp::BXor => 8,
        }
    }

    /// The op with this descriptor code, if any.
    pub const fn from_code(code: u8) -> Option<ReduceOp> {
        Some(match code {
            1 => ReduceOp::Sum,
            2 => ReduceOp::Product,
            3 => ReduceOp::Min,
            4 => ReduceOp::Max,
            5 => ReduceOp::Avg,
            6 => ReduceOp::BAnd,
            7 => ReduceOp::BOr,
            8 => ReduceOp::BXor,
            _ => return None,
        })
    }

    /// The binary element operation (avg reduces with `+` and divides at the end).
    pub const fn elem(self) -> ElemOp {
        match self {
            ReduceOp::Sum | ReduceOp::Avg => ElemOp::Add,
            ReduceOp::Product => ElemOp::Mul,
            ReduceOp::Min => ElemOp::Min,
            ReduceOp::Max => ElemOp::Max,
            ReduceOp::BAnd => ElemOp::And,
            ReduceOp::BOr => ElemOp::Or,
            ReduceOp::BXor => ElemOp::Xor,
        }
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A binary element operation, what the kernels implement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ElemOp {
    /// `a + b` (bool: or).
    Add,
    /// `a * b` (bool: and).
    Mul,
    /// The smaller (floats: NaN wins, `-0 < +0`; bool: and).
    Min,
    /// The larger (floats: NaN wins, `-0 < +0`; bool: or).
    Max,
    /// Bitwise and.
    And,
    /// Bitwise or.
    Or,
    /// Bitwise xor.
    Xor,
}

/// Element types the kernels work on: every [`Element`].
pub trait Kernel: Element {
    /// `out[i] = a[i] op b[i]` (all three slices have the same length).
    fn combine(op: ElemOp, out: &mut [Self], a: &[Self], b: &[Self]);
    /// `acc[i] = acc[i] op b[i]`.
    fn combine_assign(op: ElemOp, acc: &mut [Self], b: &[Self]);
    /// `x[i] = x[i] / n`, the end of an average. Only called for floating-point
    /// dtypes ([`ReduceOp::Avg`] is refused for the others before any work).
    fn divide(x: &mut [Self], n: usize);
}

#[inline(always)]
fn map3<T: Copy>(out: &mut [T], a: &[T], b: &[T], f: impl Fn(T, T) -> T) {
    debug_assert!(out.len() == a.len() && a.len() == b.len());
    // Re-slicing to one length lets the compiler drop bounds checks and vectorise.
    let n = out.len().min(a.len()).min(b.len());
    let (out, a, b) = (&mut out[..n], &a[..n], &b[..n]);
    for i in 0..n {
        out[i] = f(a[i], b[i]);
    }
}

#[inline(always)]
fn map2<T: Copy>(acc: &mut [T], b: &[T], f: impl Fn(T, T) -> T) {
    debug_assert_eq!(acc.len(), b.len());
    let n = acc.len().min(b.len());
    let (acc, b) = (&mut acc[..n], &b[..n]);
    for i in 0..n {
        acc[i] = f(acc[i], b[i]);
    }
}

macro_rules! int_kernel {
    ($($t:ty),*) => {$(
        impl Kernel for $t {
            fn combine(op: ElemOp, out: &mut [Self], a: &[Self], b: &[Self]) {
                match op {
                    ElemOp::Add => map3(out, a, b, <$t>::wrapping_add),
                    ElemOp::Mul => map3(out, a, b, <$t>::wrapping_mul),
                    ElemOp::Min => map3(out, a, b, Ord::min),
                    ElemOp::Max => map3(out, a, b, Ord::max),
                    ElemOp::And => map3(out, a, b, |x, y| x & y),
                    ElemOp::Or => map3(out, a, b, |x, y| x | y),
                    ElemOp::Xor => map3(out, a, b, |x, y| x ^ y),
                }
            }
            fn combine_assign(op: ElemOp, acc: &mut [Self], b: &[Self]) {
                match op {
                    ElemOp::Add => map2(acc, b, <$t>::wrapping_add),
                    ElemOp::Mul => map2(acc, b, <$t>::wrapping_mul),
                    ElemOp::Min => map2(acc, b, Ord::min),
                    ElemOp::Max => map2(acc, b, Ord::max),
                    ElemOp::And => map2(acc, b, |x, y| x & y),
                    ElemOp::Or => map2(acc, b, |x, y| x | y),
                    ElemOp::Xor => map2(acc, b, |x, y| x ^ y),
                }
            }
            fn divide(_x: &mut [Self], _n: usize) {
                // Avg is refused for integers before any byte is sent; nothing to do.
            }
        }
    )*};
}

int_kernel!(i8, i16, i32, i64, u8, u16, u32, u64);

macro_rules! float_kernel {
    ($($t:ty),*) => {$(
        impl Kernel for $t {
            fn combine(op: ElemOp, out: &mut [Self], a: &[Self], b: &[Self]) {
                match op {
                    ElemOp::Add => map3(out, a, b, |x, y| x + y),
                    ElemOp::Mul => map3(out, a, b, |x, y| x * y),
                    ElemOp::Min => map3(out, a, b, fmin),
                    ElemOp::Max => map3(out, a, b, fmax),
                    // Refused for floats before any work; defined on the bits so the
                    // kernel is total.
                    ElemOp::And => map3(out, a, b, |x, y| <$t>::from_bits(x.to_bits() & y.to_bits())),
                    ElemOp::Or => map3(out, a, b, |x, y| <$t>::from_bits(x.to_bits() | y.to_bits())),
                    ElemOp::Xor => map3(out, a, b, |x, y| <$t>::from_bits(x.to_bits() ^ y.to_bits())),
                }
            }
            fn combine_assign(op: ElemOp, acc: &mut [Self], b: &[Self]) {
                match op {
                    ElemOp::Add => map2(acc, b, |x, y| x + y),
                    ElemOp::Mul => map2(acc, b, |x, y| x * y),
                    ElemOp::Min => map2(acc, b, fmin),
                    ElemOp::Max => map2(acc, b, fmax),
                    ElemOp::And => map2(acc, b, |x, y| <$t>::from_bits(x.to_bits() & y.to_bits())),
                    ElemOp::Or => map2(acc, b, |x, y| <$t>::from_bits(x.to_bits() | y.to_bits())),
                    ElemOp::Xor => map2(acc, b, |x, y| <$t>::from_bits(x.to_bits() ^ y.to_bits())),
                }
            }
            fn divide(x: &mut [Self], n: usize) {
                let d = n as $t;
                for v in x {
                    *v /= d;
                }
            }
        }
    )*};
}

/// Float operations shared by `f32` and `f64` min/max.
trait FloatLike: Copy + PartialOrd {
    fn nan(self) -> bool;
    fn neg(self) -> bool;
}

impl FloatLike for f32 {
    fn nan(self) -> bool {
        self.is_nan()
    }
    fn neg(self) -> bool {
        self.is_sign_negative()
    }
}

impl FloatLike for f64 {
    fn nan(self) -> bool {
        self.is_nan()
    }
    fn neg(self) -> bool {
        self.is_sign_negative()
    }
}

/// Maximum that propagates NaN and treats `+0` as greater than `-0`, so that it is
/// commutative and associative (the result does not depend on the ranks' order).
#[inline(always)]
fn fmax<T: FloatLike>(a: T, b: T) -> T {
    if a.nan() {
        a
    } else if b.nan() || b > a || (b == a && a.neg()) {
        b
    } else {
        a
    }
}

/// Minimum counterpart of [`fmax`].
#[inline(always)]
fn fmin<T: FloatLike>(a: T, b: T) -> T {
    if a.nan() {
        a
    } else if b.nan() || b < a || (b == a && b.neg()) {
        b
    } else {
        a
    }
}

float_kernel!(f32, f64);

/// Block size for widening halves to `f32` (two stack blocks of 1 KiB each).
const HALF_BLOCK: usize = 256;

macro_rules! half_kernel {
    ($($t:ty),*) => {$(
        impl Kernel for $t {
            fn combine(op: ElemOp, out: &mut [Self], a: &[Self], b: &[Self]) {
                if let Some(f) = bit_op(op) {
                    map3(out, a, b, |x, y| <$t>::from_bits(f(x.to_bits(), y.to_bits())));
                    return;
                }
                let mut fa = [0f32; HALF_BLOCK];
                let mut fb = [0f32; HALF_BLOCK];
                for ((o, a), b) in out.chunks_mut(HALF_BLOCK).zip(a.chunks(HALF_BLOCK)).zip(b.chunks(HALF_BLOCK)) {
                    let k = o.len().min(a.len()).min(b.len());
                    a[..k].convert_to_f32_slice(&mut fa[..k]);
                    b[..k].convert_to_f32_slice(&mut fb[..k]);
                    f32::combine_assign(op, &mut fa[..k], &fb[..k]);
                    o[..k].convert_from_f32_slice(&fa[..k]);
                }
            }
            fn combine_assign(op: ElemOp, acc: &mut [Self], b: &[Self]) {
                if let Some(f) = bit_op(op) {
                    map2(acc, b, |x, y| <$t>::from_bits(f(x.to_bits(), y.to_bits())));
                    return;
                }
                let mut fa = [0f32; HALF_BLOCK];
                let mut fb = [0f32; HALF_BLOCK];
                for (a, b) in acc.chunks_mut(HALF_BLOCK).zip(b.chunks(HALF_BLOCK)) {
                    let k = a.len().min(b.len());
                    a[..k].convert_to_f32_slice(&mut fa[..k]);
                    b[..k].convert_to_f32_slice(&mut fb[..k]);
                    f32::combine_assign(op, &mut fa[..k], &fb[..k]);
                    a[..k].convert_from_f32_slice(&fa[..k]);
                }
            }
            fn divide(x: &mut [Self], n: usize) {
                let d = n as f32;
                for v in x {
                    *v = <$t>::from_f32(v.to_f32() / d);
                }
            }
        }
    )*};
}

/// The bitwise ops on half bit patterns (refused for floats before any work; kept
/// so the kernel is total).
fn bit_op(op: ElemOp) -> Option<fn(u16, u16) -> u16> {
    match op {
        ElemOp::And => Some(|x, y| x & y),
        ElemOp::Or => Some(|x, y| x | y),
        ElemOp::Xor => Some(|x, y| x ^ y),
        _ => None,
    }
}

half_kernel!(f16, bf16);

impl Kernel for bool {
    fn combine(op: ElemOp, out: &mut [Self], a: &[Self], b: &[Self]) {
        match op {
            ElemOp::Add | ElemOp::Max | ElemOp::Or => map3(out, a, b, |x, y| x | y),
            ElemOp::Mul | ElemOp::Min | ElemOp::And => map3(out, a, b, |x, y| x & y),
            ElemOp::Xor => map3(out, a, b, |x, y| x ^ y),
        }
    }
    fn combine_assign(op: ElemOp, acc: &mut [Self], b: &[Self]) {
        match op {
            ElemOp::Add | ElemOp::Max | ElemOp::Or => map2(acc, b, |x, y| x | y),
            ElemOp::Mul | ElemOp::Min | ElemOp::And => map2(acc, b, |x, y| x & y),
            ElemOp::Xor => map2(acc, b, |x, y| x ^ y),
        }
    }
    fn divide(_x: &mut [Self], _n: usize) {
        // Avg is refused for bool before any byte is sent; nothing to do.
    }
}

/// Runs `$body` with `$T` bound to the Rust element type of `$dtype` (a
/// [`DType`](crate::DType)), so one generic kernel call serves every dtype.
#[macro_export]
macro_rules! with_type {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            $crate::DType::F16 => {
                type $T = $crate::f16;
                $body
            }
            $crate::DType::BF16 => {
                type $T = $crate::bf16;
                $body
            }
            $crate::DType::F32 => {
                type $T = f32;
                $body
            }
            $crate::DType::F64 => {
                type $T = f64;
                $body
            }
            $crate::DType::I8 => {
                type $T = i8;
                $body
            }
            $crate::DType::I16 => {
                type $T = i16;
                $body
            }
            $crate::DType::I32 => {
                type $T = i32;
                $body
            }
            $crate::DType::I64 => {
                type $T = i64;
                $body
            }
            $crate::DType::U8 => {
                type $T = u8;
                $body
            }
            $crate::DType::U16 => {
                type $T = u16;
                $body
            }
            $crate::DType::U32 => {
                type $T = u32;
                $body
            }
            $crate::DType::U64 => {
                type $T = u64;
                $body
            }
            $crate::DType::Bool => {
                type $T = bool;
                $body
            }
        }
    };
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn support_table() {
        for d in DType::ALL {
            let float = matches!(d, DType::F16 | DType::BF16 | DType::F32 | DType::F64);
            assert!(ReduceOp::Sum.supports(d));
            assert!(ReduceOp::Max.supports(d));
            assert_eq!(ReduceOp::Avg.supports(d), float, "{d}");
            assert_eq!(ReduceOp::BXor.supports(d), !float, "{d}");
        }
        for op in ReduceOp::ALL {
            assert_eq!(ReduceOp::from_code(op.code()), Some(op));
            assert!(!op.name().is_empty());
        }
        assert_eq!(ReduceOp::from_code(0), None);
    }

    #[test]
    fn integer_ops_wrap_and_are_exact() {
        let mut out = [0i8; 3];
        i8::combine(ElemOp::Add, &mut out, &[127, -128, 5], &[1, -1, -7]);
        assert_eq!(out, [-128, 127, -2]);
        i8::combine(ElemOp::Mul, &mut out, &[64, 3, -1], &[2, 5, -128]);
        assert_eq!(out, [-128, 15, -128]);
        let mut acc = [0b1100u8, 7, 200];
        u8::combine_assign(ElemOp::Xor, &mut acc, &[0b1010, 7, 1]);
        assert_eq!(acc, [0b0110, 0, 201]);
        let mut acc = [3u64, u64::MAX];
        u64::combine_assign(ElemOp::Min, &mut acc, &[4, 1]);
        assert_eq!(acc, [3, 1]);
    }

    #[test]
    fn float_min_max_are_order_independent() {
        let vals = [0.0f32, -0.0, 1.0, f32::NAN, -2.5, f32::INFINITY];
        for &a in &vals {
            for &b in &vals {
                let (x, y) = (fmax(a, b), fmax(b, a));
                assert_eq!(x.is_nan(), y.is_nan());
                if !x.is_nan() {
                    assert_eq!(x.to_bits(), y.to_bits(), "max({a}, {b})");
                }
                let (x, y) = (fmin(a, b), fmin(b, a));
                if !x.is_nan() {
                    assert_eq!(x.to_bits(), y.to_bits(), "min({a}, {b})");
                }
            }
        }
        assert_eq!(fmax(-0.0f64, 0.0).to_bits(), 0.0f64.to_bits());
        assert_eq!(fmin(0.0f64, -0.0).to_bits(), (-0.0f64).to_bits());
        assert!(fmax(1.0f32, f32::NAN).is_nan());
        assert!(fmin(f32::NAN, 1.0).is_nan());
    }

    #[test]
    fn halves_round_like_half_arithmetic() {
        // 2048 + 1 is not representable in f16 (spacing 2 there): ties to even.
        let a = [f16::from_f32(2048.0), f16::from_f32(0.1), f16::from_f32(-3.0)];
        let b = [f16::from_f32(1.0), f16::from_f32(0.2), f16::from_f32(0.5)];
        let mut out = [f16::ZERO; 3];
        f16::combine(ElemOp::Add, &mut out, &a, &b);
        for i in 0..3 {
            let want = f16::from_f32(a[i].to_f32() + b[i].to_f32());
            assert_eq!(out[i].to_bits(), want.to_bits());
        }
        let mut acc = vec![bf16::from_f32(1.5); 1000];
        let b = vec![bf16::from_f32(2.0); 1000];
        bf16::combine_assign(ElemOp::Mul, &mut acc, &b);
        assert!(acc.iter().all(|v| v.to_f32() == 3.0));
        bf16::divide(&mut acc, 3);
        assert!(acc.iter().all(|v| v.to_f32() == 1.0));
    }

    #[test]
    fn bool_ops() {
        let a = [true, true, false, false];
        let b = [true, false, true, false];
        let mut out = [false; 4];
        bool::combine(ElemOp::Add, &mut out, &a, &b);
        assert_eq!(out, [true, true, true, false]);
        bool::combine(ElemOp::Min, &mut out, &a, &b);
        assert_eq!(out, [true, false, false, false]);
        bool::combine(ElemOp::Xor, &mut out, &a, &b);
        assert_eq!(out, [false, true, true, false]);
    }

    #[test]
    fn dispatch_covers_every_dtype() {
        for d in DType::ALL {
            let size = with_type!(d, T => std::mem::size_of::<T>());
            assert_eq!(size, d.size());
            let dt = with_type!(d, T => <T as Element>::DTYPE);
            assert_eq!(dt, d);
        }
    }
}
