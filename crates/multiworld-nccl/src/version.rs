//! NCCL versions: decoding the integer `ncclGetVersion` returns, and the
//! versions at which the features this crate uses appeared. Optional calls
//! (shrink, revoke) are gated on the *runtime* version, never on what we were
//! built against (we are built against nothing).

use std::fmt;

/// An NCCL release, e.g. 2.21.5.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NcclVersion {
    /// Major version.
    pub major: u32,
    /// Minor version.
    pub minor: u32,
    /// Patch level.
    pub patch: u32,
}

impl NcclVersion {
    /// Oldest NCCL this crate accepts: `ncclCommInitRankConfig` with a
    /// `blocking = 0` config (non-blocking communicators) and
    /// `ncclCommFinalize` appeared in 2.14.
    pub const MINIMUM: NcclVersion = NcclVersion::new(2, 14, 0);
    /// `ncclAvg` and `ncclBfloat16` appeared in 2.10.
    pub const AVG_AND_BF16: NcclVersion = NcclVersion::new(2, 10, 0);
    /// FP8 (`ncclFloat8e4m3`, `ncclFloat8e5m2`). Conservative: we gate at
    /// 2.24; older releases may accept them on some builds.
    pub const FP8: NcclVersion = NcclVersion::new(2, 24, 0);
    /// `ncclCommShrink` appeared in 2.27.
    pub const SHRINK: NcclVersion = NcclVersion::new(2, 27, 0);
    /// `ncclCommRevoke` appeared in 2.29.
    pub const REVOKE: NcclVersion = NcclVersion::new(2, 29, 0);

    /// A version from its parts.
    pub const fn new(major: u32, minor: u32, patch: u32) -> NcclVersion {
        NcclVersion { major, minor, patch }
    }

    /// Decodes `NCCL_VERSION_CODE` as returned by `ncclGetVersion`. NCCL
    /// changed the encoding at 2.9: before, `major*1000 + minor*100 + patch`
    /// (2.8.4 = 2804); from 2.9 on, `major*10000 + minor*100 + patch`
    /// (2.21.5 = 22105). Returns `None` for a negative code.
    pub fn from_code(code: i32) -> Option<NcclVersion> {
        let code = u32::try_from(code).ok()?;
        Some(if code >= 10_000 {
            NcclVersion::new(code / 10_000, (code % 10_000) / 100, code % 100)
        } else {
            NcclVersion::new(code / 1_000, (code % 1_000) / 100, code % 100)
        })
    }

    /// The `NCCL_VERSION(major, minor, patch)` macro: the inverse of
    /// [`NcclVersion::from_code`].
    pub fn code(self) -> u32 {
        if self.major <= 2 && self.minor <= 8 {
            self.major * 1_000 + self.minor * 100 + self.patch
        } else {
            self.major * 10_000 + self.minor * 100 + self.patch
        }
    }

    /// Whether `ncclCommShrink` exists in this release.
    pub fn has_shrink(self) -> bool {
        self >= NcclVersion::SHRINK
    }

    /// Whether `ncclCommRevoke` exists in this release.
    pub fn has_revoke(self) -> bool {
        self >= NcclVersion::REVOKE
    }
}

impl fmt::Display for NcclVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_both_encodings() {
        assert_eq!(NcclVersion::from_code(2804), Some(NcclVersion::new(2, 8, 4)));
        assert_eq!(NcclVersion::from_code(20_903), Some(NcclVersion::new(2, 9, 3)));
        assert_eq!(NcclVersion::from_code(22_105), Some(NcclVersion::new(2, 21, 5)));
        assert_eq!(NcclVersion::from_code(23_203), Some(NcclVersion::new(2, 32, 3)));
        assert_eq!(NcclVersion::from_code(-1), None);
    }

    #[test]
    fn code_round_trips() {
        for v in [
            NcclVersion::new(2, 8, 4),
            NcclVersion::new(2, 14, 3),
            NcclVersion::new(2, 27, 7),
            NcclVersion::new(3, 0, 1),
        ] {
            assert_eq!(NcclVersion::from_code(v.code() as i32), Some(v));
        }
        assert_eq!(NcclVersion::new(2, 18, 0).code(), 21_800);
    }

    #[test]
    fn gates_follow_the_release_that_added_each_call() {
        assert!(!NcclVersion::new(2, 26, 5).has_shrink());
        assert!(NcclVersion::new(2, 27, 0).has_shrink());
        assert!(!NcclVersion::new(2, 28, 9).has_revoke());
        assert!(NcclVersion::new(2, 29, 1).has_revoke());
        assert!(NcclVersion::new(2, 9, 9) < NcclVersion::new(2, 10, 0));
        assert_eq!(NcclVersion::new(2, 21, 5).to_string(), "2.21.5");
    }
}
