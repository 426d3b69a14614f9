//! [`CommConfig`]: what one world's communicator needs to know (rank, size,
//! device, deadlines), its defaults and validation, and the raw
//! `ncclConfig_t` built from it. Pure, unit-tested without a GPU.

use std::time::Duration;

use crate::error::NcclError;
use crate::ffi::NcclConfigRaw;

/// Configuration of one world's NCCL communicator.
///
/// Timeouts relate as follows: `init_timeout` bounds communicator creation
/// (all ranks must call init within it); `op_timeout` is the deadline each
/// [`OpHandle`](crate::OpHandle) carries and the bound on enqueueing an
/// operation; `abort_deadline` bounds how long [`abort`](crate::NcclComm::abort)
/// (and `Drop`) wait for `ncclCommAbort` before quarantining the communicator.
/// `abort_deadline` should be well under the world manager's own teardown
/// budget.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommConfig {
    /// This process's rank in the world, `0..size`.
    pub rank: usize,
    /// Number of ranks in the world (≥ 1).
    pub size: usize,
    /// CUDA device ordinal this rank uses.
    pub device: usize,
    /// Deadline for `ncclCommInitRankConfig` to finish (default 60 s).
    pub init_timeout: Duration,
    /// Deadline of each operation (default 60 s).
    pub op_timeout: Duration,
    /// How long to wait for `ncclCommAbort` before quarantining (default 5 s).
    pub abort_deadline: Duration,
}

impl Default for CommConfig {
    /// A world of one: rank 0 of 1 on device 0.
    fn default() -> Self {
        CommConfig {
            rank: 0,
            size: 1,
            device: 0,
            init_timeout: Duration::from_secs(60),
            op_timeout: Duration::from_secs(60),
            abort_deadline: Duration::from_secs(5),
        }
    }
}

impl CommConfig {
    /// Rank `rank` of `size` on device 0, default deadlines.
    pub fn new(rank: usize, size: usize) -> CommConfig {
        CommConfig {
            rank,
            size,
            ..CommConfig::default()
        }
    }

    /// Sets the CUDA device ordinal.
    pub fn with_device(mut self, device: usize) -> CommConfig {
        self.device = device;
        self
    }

    /// Sets the init deadline.
    pub fn with_init_timeout(mut self, timeout: Duration) -> CommConfig {
        self.init_timeout = timeout;
        self
    }

    /// Sets the per-operation deadline.
    pub fn with_op_timeout(mut self, timeout: Duration) -> CommConfig {
        self.op_timeout = timeout;
        self
    }

    /// Sets the abort deadline.
    pub fn with_abort_deadline(mut self, deadline: Duration) -> CommConfig {
        self.abort_deadline = deadline;
        self
    }

    /// Checks the configuration: `size ≥ 1`, `rank < size`, rank, size and
    /// device fit NCCL's `int`, every duration non-zero.
    pub fn validate(&self) -> Result<(), NcclError> {
        if self.size == 0 {
            return Err(NcclError::invalid("size must be at least 1"));
        }
        if self.rank >= self.size {
            return Err(NcclError::invalid(format!(
                "rank {} is out of range for size {}",
                self.rank, self.size
            )));
        }
        if i32::try_from(self.size).is_err() {
            return Err(NcclError::invalid(format!(
                "size {} does not fit NCCL's int",
                self.size
            )));
        }
        if i32::try_from(self.device).is_err() {
            return Err(NcclError::invalid(format!(
                "device {} does not fit CUDA's int",
                self.device
            )));
        }
        for (name, d) in [
            ("init_timeout", self.init_timeout),
            ("op_timeout", self.op_timeout),
            ("abort_deadline", self.abort_deadline),
        ] {
            if d.is_zero() {
                return Err(NcclError::invalid(format!("{name} must be non-zero")));
            }
        }
        Ok(())
    }

    /// The `ncclConfig_t` passed to `ncclCommInitRankConfig`:
    /// `NCCL_CONFIG_INITIALIZER` with `blocking = 0`, so init and every
    /// later call return `ncclInProgress` instead of blocking.
    pub(crate) fn raw_nccl_config(&self) -> NcclConfigRaw {
        let mut raw = NcclConfigRaw::initializer();
        raw.blocking = 0;
        raw
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_a_valid_world_of_one() {
        let c = CommConfig::default();
        assert_eq!((c.rank, c.size, c.device), (0, 1, 0));
        assert!(c.validate().is_ok());
        assert!(c.abort_deadline < c.op_timeout);
    }

    #[test]
    fn builders_set_fields() {
        let c = CommConfig::new(2, 4)
            .with_device(1)
            .with_init_timeout(Duration::from_secs(3))
            .with_op_timeout(Duration::from_millis(500))
            .with_abort_deadline(Duration::from_millis(200));
        assert_eq!((c.rank, c.size, c.device), (2, 4, 1));
        assert_eq!(c.init_timeout, Duration::from_secs(3));
        assert_eq!(c.op_timeout, Duration::from_millis(500));
        assert_eq!(c.abort_deadline, Duration::from_millis(200));
        assert!(c.validate().is_ok());
    }

    #[test]
    fn validation_rejects_bad_values() {
        let bad = [
            CommConfig::new(0, 0),
            CommConfig::new(4, 4),
            CommConfig::new(0, usize::MAX),
            CommConfig::new(0, 1).with_device(usize::MAX),
            CommConfig::new(0, 1).with_init_timeout(Duration::ZERO),
            CommConfig::new(0, 1).with_op_timeout(Duration::ZERO),
            CommConfig::new(0, 1).with_abort_deadline(Duration::ZERO),
        ];
        for c in bad {
            let e = c.validate().unwrap_err();
            assert!(matches!(e, NcclError::InvalidArgument { .. }), "{c:?}: {e}");
        }
        let e = CommConfig::new(4, 4).validate().unwrap_err().to_string();
        assert!(e.contains("rank 4") && e.contains("size 4"), "{e}");
    }

    #[test]
    fn raw_config_is_non_blocking_initializer() {
        let raw = CommConfig::new(1, 2).raw_nccl_config();
        assert_eq!(raw.blocking, 0);
        assert_eq!(raw.magic, 0xcafe_beef);
        assert_eq!(raw.size, std::mem::size_of::<NcclConfigRaw>());
        assert_eq!(raw.version, 21_800);
        assert_eq!(raw.cga_cluster_size, i32::MIN);
        assert_eq!(raw.split_share, i32::MIN);
        assert!(raw.net_name.is_null());
    }
}
