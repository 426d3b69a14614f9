//! [`OpHandle`]: the completion handle of one enqueued operation — a CUDA
//! event recorded on the world's stream right after it, and its deadline.
//! The watchdog asks `is_completed` (never blocks) and `is_overdue`; callers
//! `wait`, which polls the event and the communicator's asynchronous error
//! until the deadline.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::comm::{CommShared, CommState, lock};
use crate::cuda::Event;
use crate::error::NcclError;
use crate::poll::poll_until;

/// Completion handle of one enqueued operation: a CUDA event recorded on the
/// world's stream right after it, plus the operation's deadline. Querying it
/// never blocks; waiting polls.
pub struct OpHandle {
    shared: Arc<CommShared>,
    event: Event,
    op: &'static str,
    issued_at: Instant,
    deadline: Instant,
    budget: Duration,
}

impl fmt::Debug for OpHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OpHandle")
            .field("op", &self.op)
            .field("issued_at", &self.issued_at)
            .field("deadline", &self.deadline)
            .finish()
    }
}

impl OpHandle {
    pub(crate) fn new(
        shared: Arc<CommShared>,
        event: Event,
        op: &'static str,
        issued_at: Instant,
        budget: Duration,
    ) -> OpHandle {
        OpHandle {
            shared,
            event,
            op,
            issued_at,
            deadline: issued_at + budget,
            budget,
        }
    }

    /// The operation's name (`"all_reduce"`...).
    pub fn op(&self) -> &'static str {
        self.op
    }

    /// When it was issued.
    pub fn issued_at(&self) -> Instant {
        self.issued_at
    }

    /// Issue time + the communicator's `op_timeout`.
    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// True once `now` is past the deadline (a pure check; combine with
    /// [`is_completed`](Self::is_completed)).
    pub fn is_overdue(&self, now: Instant) -> bool {
        now >= self.deadline
    }

    /// Whether the operation has finished on the device (`cuEventQuery`;
    /// never blocks). An error if the communicator failed, was revoked,
    /// aborted or quarantined: the result cannot be trusted. A query that
    /// fails fails the communicator (world-fatal whatever its kind): the
    /// operation is enqueued, and its fate is unknown.
    pub fn is_completed(&self) -> Result<bool, NcclError> {
        match self.shared.state() {
            CommState::Live | CommState::Closing | CommState::Closed => {
                self.event.is_complete().map_err(|e| self.shared.fail_async(e))
            }
            CommState::Failed => Err(lock(&self.shared.failure).clone().unwrap_or(NcclError::Aborted {
                op: self.op,
                state: CommState::Failed,
            })),
            state => Err(NcclError::Aborted { op: self.op, state }),
        }
    }

    /// Waits (polling) until the operation completes, the communicator
    /// reports an error, or the operation's deadline.
    pub fn wait(&self) -> Result<(), NcclError> {
        self.wait_until(self.deadline, self.budget)
    }

    /// Like [`wait`](Self::wait) with an explicit timeout from now.
    pub fn wait_timeout(&self, timeout: Duration) -> Result<(), NcclError> {
        self.wait_until(Instant::now() + timeout, timeout)
    }

    fn wait_until(&self, deadline: Instant, budget: Duration) -> Result<(), NcclError> {
        poll_until(self.op, deadline, budget, || {
            if self.is_completed()? {
                return Ok(Some(()));
            }
            match self.shared.poll_error() {
                Some(e) => Err(e),
                None => Ok(None),
            }
        })
    }
}
