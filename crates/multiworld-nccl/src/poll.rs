//! Deadline-bounded polling. Nothing in this crate waits *inside* CUDA or
//! NCCL: it asks a non-blocking question (`cuEventQuery`,
//! `ncclCommGetAsyncError`) and, if the answer is "not yet", backs off and
//! asks again until a deadline. This module is that loop, pure and tested
//! with closures.

use std::time::{Duration, Instant};

use crate::error::NcclError;

/// Spin-then-sleep backoff: a few `yield_now`s (an enqueue or a small
/// operation usually finishes within microseconds), then sleeps doubling from
/// 10 µs to 1 ms.
#[derive(Debug)]
pub(crate) struct Backoff {
    yields: u32,
    sleep: Duration,
}

impl Backoff {
    const YIELDS: u32 = 32;
    const FIRST_SLEEP: Duration = Duration::from_micros(10);
    const MAX_SLEEP: Duration = Duration::from_millis(1);

    pub(crate) fn new() -> Backoff {
        Backoff {
            yields: 0,
            sleep: Backoff::FIRST_SLEEP,
        }
    }

    /// Waits a little, never past `deadline`.
    pub(crate) fn snooze(&mut self, deadline: Instant) {
        if self.yields < Backoff::YIELDS {
            self.yields += 1;
            std::thread::yield_now();
            return;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        std::thread::sleep(self.sleep.min(left));
        self.sleep = (self.sleep * 2).min(Backoff::MAX_SLEEP);
    }
}

/// Calls `step` until it returns `Ok(Some(_))` or an error, or `deadline`
/// passes (then [`NcclError::Timeout`] for `op` with `budget` as the time
/// allowed). `step` runs at least once, even if the deadline has already
/// passed, so finished work is never reported as timed out.
pub(crate) fn poll_until<T>(
    op: &'static str,
    deadline: Instant,
    budget: Duration,
    mut step: impl FnMut() -> Result<Option<T>, NcclError>,
) -> Result<T, NcclError> {
    let mut backoff = Backoff::new();
    loop {
        if let Some(v) = step()? {
            return Ok(v);
        }
        if Instant::now() >= deadline {
            return Err(NcclError::Timeout { op, after: budget });
        }
        backoff.snooze(deadline);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn returns_as_soon_as_ready() {
        let mut n = 0;
        let v = poll_until(
            "t",
            Instant::now() + Duration::from_secs(5),
            Duration::from_secs(5),
            || {
                n += 1;
                Ok((n == 3).then_some(42))
            },
        )
        .unwrap();
        assert_eq!((v, n), (42, 3));
    }

    #[test]
    fn runs_once_even_after_the_deadline() {
        let past = Instant::now();
        std::thread::sleep(Duration::from_millis(1));
        assert_eq!(poll_until("t", past, Duration::ZERO, || Ok(Some(7))).unwrap(), 7);
    }

    #[test]
    fn times_out_with_the_op_and_budget() {
        let budget = Duration::from_millis(30);
        let start = Instant::now();
        let e = poll_until::<()>("all_reduce", start + budget, budget, || Ok(None)).unwrap_err();
        let waited = start.elapsed();
        assert!(matches!(e, NcclError::Timeout { op: "all_reduce", after } if after == budget));
        assert!(waited >= budget, "{waited:?}");
        assert!(waited < budget + Duration::from_millis(500), "{waited:?}");
    }

    #[test]
    fn errors_stop_the_loop() {
        let e = poll_until::<()>(
            "t",
            Instant::now() + Duration::from_secs(5),
            Duration::from_secs(5),
            || Err(NcclError::invalid("boom")),
        )
        .unwrap_err();
        assert!(matches!(e, NcclError::InvalidArgument { .. }));
    }
}
