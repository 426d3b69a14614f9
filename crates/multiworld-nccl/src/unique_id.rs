//! [`UniqueId`]: the 128-byte `ncclUniqueId` that rank 0 creates and every
//! rank of the world passes to init. The world manager publishes it through
//! the world's store, so it converts to and from bytes with a length check.

use std::fmt;

use crate::error::NcclError;
use crate::ffi::{NCCL_UNIQUE_ID_BYTES, NcclUniqueIdRaw};

/// An NCCL unique id (`ncclUniqueId`, 128 opaque bytes). Create one with
/// [`NcclRuntime::unique_id`](crate::NcclRuntime::unique_id) on one rank and
/// hand it to every rank of the world.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct UniqueId([u8; UniqueId::LEN]);

impl UniqueId {
    /// Size in bytes (`NCCL_UNIQUE_ID_BYTES`).
    pub const LEN: usize = NCCL_UNIQUE_ID_BYTES;

    /// The raw bytes, for publishing in the store.
    pub fn to_bytes(&self) -> [u8; UniqueId::LEN] {
        self.0
    }

    /// The raw bytes, borrowed.
    pub fn as_bytes(&self) -> &[u8; UniqueId::LEN] {
        &self.0
    }

    /// Parses bytes read from the store: exactly [`UniqueId::LEN`] bytes.
    pub fn from_bytes(bytes: &[u8]) -> Result<UniqueId, NcclError> {
        let arr: [u8; UniqueId::LEN] = bytes.try_into().map_err(|_| {
            NcclError::invalid(format!(
                "an NCCL unique id is {} bytes, got {}",
                UniqueId::LEN,
                bytes.len()
            ))
        })?;
        Ok(UniqueId(arr))
    }

    pub(crate) fn from_raw(raw: NcclUniqueIdRaw) -> UniqueId {
        UniqueId(raw.internal)
    }

    pub(crate) fn to_raw(self) -> NcclUniqueIdRaw {
        NcclUniqueIdRaw { internal: self.0 }
    }

    /// A short fingerprint (FNV-1a, 64 bits) for logs: the id itself holds
    /// the root's socket address and should not be printed whole.
    pub fn fingerprint(&self) -> u64 {
        self.0.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
            (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
        })
    }
}

impl fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "UniqueId({:016x})", self.fingerprint())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> UniqueId {
        let mut b = [0u8; UniqueId::LEN];
        for (i, x) in b.iter_mut().enumerate() {
            *x = (i * 7 + 3) as u8;
        }
        UniqueId::from_bytes(&b).unwrap()
    }

    #[test]
    fn bytes_round_trip() {
        let id = sample();
        let bytes = id.to_bytes();
        assert_eq!(bytes.len(), 128);
        assert_eq!(UniqueId::from_bytes(&bytes).unwrap(), id);
        assert_eq!(id.as_bytes(), &bytes);
        assert_eq!(UniqueId::from_raw(id.to_raw()), id);
    }

    #[test]
    fn wrong_lengths_are_rejected() {
        for len in [0, 1, 127, 129, 256] {
            let e = UniqueId::from_bytes(&vec![0u8; len]).unwrap_err();
            assert!(matches!(e, NcclError::InvalidArgument { .. }));
            assert!(e.to_string().contains(&format!("got {len}")), "{e}");
        }
    }

    #[test]
    fn debug_shows_a_fingerprint_not_the_bytes() {
        let id = sample();
        let text = format!("{id:?}");
        assert!(text.starts_with("UniqueId("), "{text}");
        assert!(text.len() < 40, "{text}");
        let mut other = id.to_bytes();
        other[100] ^= 1;
        assert_ne!(
            UniqueId::from_bytes(&other).unwrap().fingerprint(),
            id.fingerprint()
        );
    }
}
