//! How the vocabulary's element types and reduction operations
//! ([`DType`], [`ReduceOp`] from `multiworld-types`, one set for every
//! backend) map onto NCCL's `ncclDataType_t` / `ncclRedOp_t`. Pure tables,
//! tested without a GPU.
//!
//! Two mappings exist because NCCL only knows ten numeric types:
//! - data movement (send/recv, broadcast, all_gather, all_to_all, gather,
//!   scatter) works for **every** dtype: types NCCL lacks (`i16`, `u16`,
//!   `bool`) travel as bytes ([`wire_type`]);
//! - reductions need a native type ([`nccl_reduction`]): `i16`/`u16` are
//!   unsupported, `bool` maps to `u8` with sum/max → max (logical or) and
//!   product/min → min (logical and), as PyTorch does; bitwise and/or/xor are
//!   unsupported on every numeric type (NCCL has no bitwise reductions).
//!
//! NCCL's FP8 types are listed in [`NcclDataType`] for completeness; no
//! [`DType`] maps to them until host tensors can hold FP8.

use multiworld_types::{DType, ReduceOp};

use crate::error::NcclError;
use crate::version::NcclVersion;

/// The NCCL type with the same representation as `dtype`, if NCCL has one
/// (`None` for `i16`, `u16` and `bool`).
pub fn nccl_native(dtype: DType) -> Option<NcclDataType> {
    Some(match dtype {
        DType::I8 => NcclDataType::Int8,
        DType::U8 => NcclDataType::Uint8,
        DType::I32 => NcclDataType::Int32,
        DType::U32 => NcclDataType::Uint32,
        DType::I64 => NcclDataType::Int64,
        DType::U64 => NcclDataType::Uint64,
        DType::F16 => NcclDataType::Float16,
        DType::F32 => NcclDataType::Float32,
        DType::F64 => NcclDataType::Float64,
        DType::BF16 => NcclDataType::Bfloat16,
        DType::I16 | DType::U16 | DType::Bool => return None,
    })
}

fn is_float(dtype: DType) -> bool {
    matches!(dtype, DType::F16 | DType::BF16 | DType::F32 | DType::F64)
}

/// `ncclDataType_t` (values from nccl.h; stable since 2.0, FP8 added later).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum NcclDataType {
    /// `ncclInt8` = 0.
    Int8,
    /// `ncclUint8` = 1.
    Uint8,
    /// `ncclInt32` = 2.
    Int32,
    /// `ncclUint32` = 3.
    Uint32,
    /// `ncclInt64` = 4.
    Int64,
    /// `ncclUint64` = 5.
    Uint64,
    /// `ncclFloat16` = 6.
    Float16,
    /// `ncclFloat32` = 7.
    Float32,
    /// `ncclFloat64` = 8.
    Float64,
    /// `ncclBfloat16` = 9.
    Bfloat16,
    /// `ncclFloat8e4m3` = 10.
    Float8e4m3,
    /// `ncclFloat8e5m2` = 11.
    Float8e5m2,
}

impl NcclDataType {
    /// The C enum value.
    pub fn code(self) -> i32 {
        match self {
            NcclDataType::Int8 => 0,
            NcclDataType::Uint8 => 1,
            NcclDataType::Int32 => 2,
            NcclDataType::Uint32 => 3,
            NcclDataType::Int64 => 4,
            NcclDataType::Uint64 => 5,
            NcclDataType::Float16 => 6,
            NcclDataType::Float32 => 7,
            NcclDataType::Float64 => 8,
            NcclDataType::Bfloat16 => 9,
            NcclDataType::Float8e4m3 => 10,
            NcclDataType::Float8e5m2 => 11,
        }
    }

    /// The first NCCL release that knows this type.
    pub fn since(self) -> NcclVersion {
        match self {
            NcclDataType::Bfloat16 => NcclVersion::AVG_AND_BF16,
            NcclDataType::Float8e4m3 | NcclDataType::Float8e5m2 => NcclVersion::FP8,
            _ => NcclVersion::new(2, 0, 0),
        }
    }
}

/// `ncclRedOp_t` for the built-in operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum NcclRedOp {
    /// `ncclSum` = 0.
    Sum,
    /// `ncclProd` = 1.
    Prod,
    /// `ncclMax` = 2.
    Max,
    /// `ncclMin` = 3.
    Min,
    /// `ncclAvg` = 4 (NCCL 2.10+).
    Avg,
}

impl NcclRedOp {
    /// The C enum value.
    pub fn code(self) -> i32 {
        match self {
            NcclRedOp::Sum => 0,
            NcclRedOp::Prod => 1,
            NcclRedOp::Max => 2,
            NcclRedOp::Min => 3,
            NcclRedOp::Avg => 4,
        }
    }
}

/// How `count` elements of `dtype` travel in a data-movement operation:
/// the native NCCL type when the runtime has it, otherwise bytes
/// (`ncclUint8`, `count * size`), which moves any type. Errors only if the
/// byte count overflows.
pub fn wire_type(
    dtype: DType,
    count: usize,
    version: NcclVersion,
) -> Result<(NcclDataType, usize), NcclError> {
    match nccl_native(dtype) {
        Some(t) if version >= t.since() => Ok((t, count)),
        _ => {
            let bytes = count
                .checked_mul(dtype.size())
                .ok_or_else(|| NcclError::invalid(format!("{count} x {dtype} overflows usize")))?;
            Ok((NcclDataType::Uint8, bytes))
        }
    }
}

/// The NCCL type and operation for reducing `dtype` with `op` on NCCL
/// `version`, or why not.
pub fn nccl_reduction(
    dtype: DType,
    op: ReduceOp,
    version: NcclVersion,
) -> Result<(NcclDataType, NcclRedOp), NcclError> {
    if dtype == DType::Bool {
        // Bytes that are 0 or 1: or = max, and = min.
        let red = match op {
            ReduceOp::Sum | ReduceOp::Max | ReduceOp::BOr => NcclRedOp::Max,
            ReduceOp::Product | ReduceOp::Min | ReduceOp::BAnd => NcclRedOp::Min,
            ReduceOp::Avg | ReduceOp::BXor => {
                return Err(NcclError::unsupported(format!(
                    "reduce op {op} on bool (NCCL has no such reduction)"
                )));
            }
        };
        return Ok((NcclDataType::Uint8, red));
    }
    let Some(t) = nccl_native(dtype) else {
        return Err(NcclError::unsupported(format!(
            "reductions on {dtype}: NCCL has no {dtype} type (data movement works)"
        )));
    };
    check_type_version(t, dtype, version)?;
    let red = match op {
        ReduceOp::Sum => NcclRedOp::Sum,
        ReduceOp::Product => NcclRedOp::Prod,
        ReduceOp::Min => NcclRedOp::Min,
        ReduceOp::Max => NcclRedOp::Max,
        ReduceOp::Avg => {
            if version < NcclVersion::AVG_AND_BF16 {
                return Err(NcclError::unsupported(format!(
                    "avg needs NCCL {} (runtime is {version})",
                    NcclVersion::AVG_AND_BF16
                )));
            }
            if !is_float(dtype) {
                return Err(NcclError::unsupported(format!(
                    "avg on integer type {dtype} (only floating-point types average)"
                )));
            }
            NcclRedOp::Avg
        }
        ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor => {
            return Err(NcclError::unsupported(format!(
                "bitwise reduction {op} on {dtype}: NCCL has no bitwise reductions"
            )));
        }
    };
    Ok((t, red))
}

fn check_type_version(t: NcclDataType, dtype: DType, version: NcclVersion) -> Result<(), NcclError> {
    if version < t.since() {
        return Err(NcclError::unsupported(format!(
            "{dtype} needs NCCL {} (runtime is {version})",
            t.since()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const NEW: NcclVersion = NcclVersion::new(2, 27, 3);

    #[test]
    fn native_type_codes_match_nccl_h() {
        let table = [
            (DType::I8, 0),
            (DType::U8, 1),
            (DType::I32, 2),
            (DType::U32, 3),
            (DType::I64, 4),
            (DType::U64, 5),
            (DType::F16, 6),
            (DType::F32, 7),
            (DType::F64, 8),
            (DType::BF16, 9),
        ];
        for (dtype, code) in table {
            assert_eq!(nccl_native(dtype).map(NcclDataType::code), Some(code), "{dtype}");
        }
        for dtype in [DType::I16, DType::U16, DType::Bool] {
            assert_eq!(nccl_native(dtype), None, "{dtype}");
        }
        assert_eq!(NcclDataType::Float8e4m3.code(), 10);
        assert_eq!(NcclDataType::Float8e5m2.code(), 11);
        assert_eq!(NcclDataType::Float8e4m3.since(), NcclVersion::FP8);
    }

    #[test]
    fn red_op_codes_match_nccl_h() {
        assert_eq!(NcclRedOp::Sum.code(), 0);
        assert_eq!(NcclRedOp::Prod.code(), 1);
        assert_eq!(NcclRedOp::Max.code(), 2);
        assert_eq!(NcclRedOp::Min.code(), 3);
        assert_eq!(NcclRedOp::Avg.code(), 4);
    }

    #[test]
    fn every_dtype_can_move_and_sizes_are_right() {
        for dtype in DType::ALL {
            let (t, count) = wire_type(dtype, 10, NEW).unwrap();
            if nccl_native(dtype).is_some() {
                assert_eq!(count, 10);
                assert_eq!(Some(t), nccl_native(dtype));
            } else {
                assert_eq!(t, NcclDataType::Uint8);
                assert_eq!(count, 10 * dtype.size());
            }
        }
        assert_eq!(wire_type(DType::I16, 3, NEW).unwrap(), (NcclDataType::Uint8, 6));
        assert!(
            wire_type(DType::U64, usize::MAX, NEW).is_ok(),
            "native: count unchanged"
        );
        assert!(matches!(
            wire_type(DType::I16, usize::MAX, NEW),
            Err(NcclError::InvalidArgument { .. })
        ));
    }

    #[test]
    fn reductions_on_numeric_types_map_directly() {
        for dtype in [DType::F32, DType::I64, DType::BF16, DType::U8] {
            assert_eq!(
                nccl_reduction(dtype, ReduceOp::Sum, NEW).unwrap().1,
                NcclRedOp::Sum
            );
            assert_eq!(
                nccl_reduction(dtype, ReduceOp::Product, NEW).unwrap().1,
                NcclRedOp::Prod
            );
            assert_eq!(
                nccl_reduction(dtype, ReduceOp::Min, NEW).unwrap().1,
                NcclRedOp::Min
            );
            assert_eq!(
                nccl_reduction(dtype, ReduceOp::Max, NEW).unwrap().1,
                NcclRedOp::Max
            );
        }
        assert_eq!(
            nccl_reduction(DType::F16, ReduceOp::Avg, NEW).unwrap(),
            (NcclDataType::Float16, NcclRedOp::Avg)
        );
    }

    #[test]
    fn unsupported_reductions_are_clear_errors() {
        for dtype in [DType::I16, DType::U16] {
            let e = nccl_reduction(dtype, ReduceOp::Sum, NEW).unwrap_err();
            assert!(matches!(e, NcclError::Unsupported { .. }), "{e}");
            assert!(e.to_string().contains(dtype.name()), "{e}");
        }
        for op in [ReduceOp::BAnd, ReduceOp::BOr, ReduceOp::BXor] {
            let e = nccl_reduction(DType::I32, op, NEW).unwrap_err();
            assert!(matches!(e, NcclError::Unsupported { .. }), "{e}");
        }
        assert!(nccl_reduction(DType::I32, ReduceOp::Avg, NEW).is_err());
        assert!(nccl_reduction(DType::Bool, ReduceOp::Avg, NEW).is_err());
        assert!(nccl_reduction(DType::Bool, ReduceOp::BXor, NEW).is_err());
    }

    #[test]
    fn bool_reduces_as_logical_or_and_and() {
        for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::BOr] {
            assert_eq!(
                nccl_reduction(DType::Bool, op, NEW).unwrap(),
                (NcclDataType::Uint8, NcclRedOp::Max)
            );
        }
        for op in [ReduceOp::Product, ReduceOp::Min, ReduceOp::BAnd] {
            assert_eq!(
                nccl_reduction(DType::Bool, op, NEW).unwrap(),
                (NcclDataType::Uint8, NcclRedOp::Min)
            );
        }
    }

    #[test]
    fn newer_types_are_gated_on_the_runtime_version() {
        let old = NcclVersion::new(2, 9, 9);
        assert!(nccl_reduction(DType::BF16, ReduceOp::Sum, old).is_err());
        assert!(nccl_reduction(DType::F32, ReduceOp::Avg, old).is_err());
        // Data movement falls back to bytes where the runtime lacks the type.
        assert_eq!(wire_type(DType::BF16, 4, old).unwrap(), (NcclDataType::Uint8, 8));
        assert_eq!(
            wire_type(DType::BF16, 4, NEW).unwrap(),
            (NcclDataType::Bfloat16, 4)
        );
    }
}
