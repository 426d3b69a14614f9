//! The bounds every world's store enforces, with their documented defaults.
//!
//! Each bound is checked before anything is allocated for the request that
//! would exceed it (the gRPC layer additionally refuses messages larger than
//! [`Limits::max_message_bytes`] before decoding them).

use std::time::Duration;

use crate::error::{Limit, StoreError};

/// Bounds of one world's store. `Default` gives the documented defaults.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Longest key in bytes (default 1 KiB).
    pub max_key_len: usize,
    /// Longest value in bytes (default 4 MiB).
    pub max_value_len: usize,
    /// Most keys in one world's store (default 65,536).
    pub max_keys: usize,
    /// Most bytes of keys plus values in one world's store (default 256 MiB).
    pub max_total_bytes: usize,
    /// Most keys named in one request (default 4,096).
    pub max_keys_per_request: usize,
    /// Most pending waits per client connection per world (default 1,024).
    pub max_waiters_per_client: usize,
    /// Most pending waits in one world, all clients together (default
    /// 4,096), so many connections cannot park unbounded waiters.
    pub max_waiters_per_world: usize,
    /// Largest reply a (multi-)get may produce: the values' bytes plus their
    /// framing (default 8 MiB, under the server's encoding bound of twice
    /// `max_message_bytes`). Checked in the table before the reply is built.
    pub max_reply_bytes: usize,
    /// Wait used when a request gives none (default 300 s, as torch's store).
    pub default_timeout: Duration,
    /// Longest wait a request may ask for (default 1 h).
    pub max_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_key_len: 1024,
            max_value_len: 4 << 20,
            max_keys: 65_536,
            max_total_bytes: 256 << 20,
            max_keys_per_request: 4096,
            max_waiters_per_client: 1024,
            max_waiters_per_world: 4096,
            max_reply_bytes: 8 << 20,
            default_timeout: Duration::from_secs(300),
            max_timeout: Duration::from_secs(3600),
        }
    }
}

impl Limits {
    /// The largest encoded request these limits can produce (a multi-set at
    /// every bound would be larger, but the total-bytes bound refuses it
    /// anyway); the gRPC layer refuses bigger messages before decoding.
    pub fn max_message_bytes(&self) -> usize {
        self.max_value_len
            .saturating_add(self.max_key_len)
            .saturating_add(64 * 1024)
            .max(self.max_keys_per_request.saturating_mul(self.max_key_len + 8))
    }

    /// Refuses a key that is empty or over the bound.
    pub fn check_key(&self, key: &[u8]) -> Result<(), StoreError> {
        if key.is_empty() {
            return Err(StoreError::InvalidArgument("empty key".into()));
        }
        over(Limit::KeyLen, self.max_key_len, key.len())
    }

    /// Refuses a value over the bound.
    pub fn check_value(&self, value: &[u8]) -> Result<(), StoreError> {
        over(Limit::ValueLen, self.max_value_len, value.len())
    }

    /// Refuses a request naming no keys or too many, or any bad key.
    pub fn check_keys<K: AsRef<[u8]>>(&self, keys: &[K]) -> Result<(), StoreError> {
        if keys.is_empty() {
            return Err(StoreError::InvalidArgument("no keys given".into()));
        }
        over(Limit::KeysPerRequest, self.max_keys_per_request, keys.len())?;
        keys.iter().try_for_each(|k| self.check_key(k.as_ref()))
    }

    /// The wait a request gets: its own (0 = default), capped at the maximum.
    pub fn timeout(&self, requested_ms: u64) -> Duration {
        if requested_ms == 0 {
            self.default_timeout
        } else {
            Duration::from_millis(requested_ms).min(self.max_timeout)
        }
    }
}

/// `Err(LimitExceeded)` when `requested > max`.
pub(crate) fn over(limit: Limit, max: usize, requested: usize) -> Result<(), StoreError> {
    if requested > max {
        Err(StoreError::LimitExceeded {
            limit,
            max: max as u64,
            requested: requested as u64,
        })
    } else {
        Ok(())
    }
}
