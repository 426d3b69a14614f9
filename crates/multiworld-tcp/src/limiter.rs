//! A rate limiter for log lines about events a stranger can cause at will
//! (refused connections, failed accepts): a flood of them must not become a
//! flood of WARN lines. Pure (the time is an argument), so it is unit-tested
//! with a fake clock.

use std::time::Duration;

use tokio::time::Instant;

/// How often a listener may write a WARN line about refused connections (and,
/// separately, about failed accepts).
pub(crate) const LOG_INTERVAL: Duration = Duration::from_secs(1);

/// Lets at most one log line through per `interval` and counts the events held
/// back in between, so the next line can say how many there were.
#[derive(Debug)]
pub(crate) struct LogLimiter {
    interval: Duration,
    /// When a line was last let through.
    last: Option<Instant>,
    /// Events held back since then.
    held: u64,
}

impl LogLimiter {
    /// A limiter letting one line through per `interval`.
    pub(crate) const fn new(interval: Duration) -> LogLimiter {
        LogLimiter {
            interval,
            last: None,
            held: 0,
        }
    }

    fn line_allowed(&self, now: Instant) -> bool {
        match self.last {
            Some(t) => now.saturating_duration_since(t) >= self.interval,
            None => true,
        }
    }

    /// An event at `now`: `Some(n)` to log it (a line at the usual level),
    /// with `n` the number of events held back since the last line; `None`
    /// to hold it back (log it at a lower level, if at all).
    pub(crate) fn admit(&mut self, now: Instant) -> Option<u64> {
        if self.line_allowed(now) {
            self.last = Some(now);
            Some(std::mem::take(&mut self.held))
        } else {
            self.held += 1;
            None
        }
    }

    /// Events held back since the last line.
    pub(crate) fn held(&self) -> u64 {
        self.held
    }

    /// When the next line may be written (`None`: now).
    pub(crate) fn next_line_at(&self) -> Option<Instant> {
        self.last.map(|t| t + self.interval)
    }

    /// A summary line at `now` for the events held back, without a new event:
    /// `Some(n)` (n > 0) when there are some and a line is allowed (which
    /// counts as this interval's line), else `None`.
    pub(crate) fn flush(&mut self, now: Instant) -> Option<u64> {
        if self.held == 0 || !self.line_allowed(now) {
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.held))
    }

    /// Takes the count of events held back, whatever the time (for a last
    /// summary when the listener closes).
    pub(crate) fn take_held(&mut self) -> u64 {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn the_first_event_is_logged_then_one_line_per_interval_with_the_count() {
        let mut l = LogLimiter::new(S);
        let t0 = Instant::now();
        assert_eq!(l.admit(t0), Some(0), "the first event is logged");
        for i in 1..1000u64 {
            assert_eq!(l.admit(t0 + Duration::from_micros(i)), None, "event {i}");
        }
        assert_eq!(l.held(), 999);
        assert_eq!(l.next_line_at(), Some(t0 + S));
        // Just before the interval: still held back.
        assert_eq!(l.admit(t0 + S - Duration::from_nanos(1)), None);
        // The next line after the interval reports every event held back.
        assert_eq!(l.admit(t0 + S), Some(1000));
        assert_eq!(l.held(), 0);
        // The interval restarts at that line, not at the previous one.
        assert_eq!(l.admit(t0 + S.mul_f64(1.5)), None);
        assert_eq!(l.admit(t0 + S.mul_f64(1.99)), None);
        assert_eq!(l.admit(t0 + S * 2), Some(2));
        // A quiet spell: the next event is logged at once, with nothing held.
        assert_eq!(l.admit(t0 + S * 60), Some(0));
    }

    #[test]
    fn a_flush_reports_the_held_events_once_the_interval_is_over() {
        let mut l = LogLimiter::new(S);
        let t0 = Instant::now();
        assert_eq!(l.flush(t0), None, "nothing to report");
        assert_eq!(l.admit(t0), Some(0));
        assert_eq!(l.flush(t0 + S), None, "nothing held");
        assert_eq!(l.admit(t0 + S / 10), None);
        assert_eq!(l.admit(t0 + S / 5), None);
        assert_eq!(l.flush(t0 + S / 2), None, "too early");
        assert_eq!(l.flush(t0 + S), Some(2));
        // The flush was this interval's line.
        assert_eq!(l.admit(t0 + S.mul_f64(1.5)), None);
        assert_eq!(l.admit(t0 + S * 2), Some(1));
        assert_eq!(l.admit(t0 + S * 2), None);
        assert_eq!(l.take_held(), 1);
        assert_eq!(l.take_held(), 0);
        assert_eq!(l.flush(t0 + S * 10), None);
    }

    #[test]
    fn a_clock_that_goes_back_does_not_open_the_gate() {
        let mut l = LogLimiter::new(S);
        let t0 = Instant::now() + S * 10;
        assert_eq!(l.admit(t0), Some(0));
        assert_eq!(l.admit(t0 - S * 5), None);
        assert_eq!(l.admit(t0 + S), Some(1));
    }
}
