//! Checksummed tensor streams between a leader and its workers: what the
//! demo, the failover benchmark and the fault-injection tests send.
//!
//! A message is a `u64` tensor `[seq, checksum, fill...]` where `fill[i]` is a
//! function of `seq` and `i` and `checksum` is the XOR of the fill, so the
//! receiver detects a corrupted message (wrong checksum) and a lost or
//! reordered one (a gap in `seq`) on its own.
//!
//! A stream that ends cleanly ends with an end-of-stream message: the same
//! shape, its `seq` the number of messages sent with [`END_BIT`] set (see
//! [`send_end`]). The receiver then knows how many were sent, so a lost tail
//! is counted too, not only gaps; [`StreamStats::sent`] reports the count.
//! The leader asks a worker to end its stream with [`request_end`] on
//! [`CONTROL_TAG`].

use std::{
    sync::{
        Arc, Mutex, OnceLock,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use multiworld::{DType, Rank, Tag, Tensor, World, WorldError};

/// What rank `rank` contributes to all-reduce round `round` (small integers,
/// exact in f32).
pub fn all_reduce_value(rank: u32, round: u64) -> f32 {
    ((round % 1000) + u64::from(rank) + 1) as f32
}

/// The exact sum of [`all_reduce_value`] over `size` ranks.
pub fn all_reduce_sum(size: u32, round: u64) -> f32 {
    (0..size).map(|r| all_reduce_value(r, round)).sum()
}

/// The tag stream messages travel on.
pub const STREAM_TAG: Tag = Tag(0);

/// The tag on which the receiving side asks the sender to end its stream
/// (one `u8`, see [`request_end`]).
pub const CONTROL_TAG: Tag = Tag(1);

/// Set in the `seq` of an end-of-stream message, whose other bits are the
/// number of messages sent before it (a real `seq` never gets this large).
pub const END_BIT: u64 = 1 << 63;

fn fill(seq: u64, i: usize) -> u64 {
    seq.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (i as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9)
}

/// Elements of a message of about `bytes` bytes (at least 3).
pub fn elements(bytes: usize) -> usize {
    (bytes / 8).max(3)
}

/// Writes message `seq` into `buf` (a `u64` tensor of at least 3 elements).
pub fn encode(seq: u64, buf: &mut [u64]) {
    let mut sum = 0u64;
    for (i, v) in buf.iter_mut().enumerate().skip(2) {
        *v = fill(seq, i);
        sum ^= *v;
    }
    buf[0] = seq;
    buf[1] = sum;
}

/// What a received message turned out to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Check {
    /// Intact, and the sequence number expected.
    Ok,
    /// Intact, but `missing` messages before it never arrived.
    Gap {
        /// How many were skipped.
        missing: u64,
    },
    /// The content does not match its checksum or its sequence number.
    Corrupt,
    /// An intact end-of-stream message: the sender sent `sent` messages
    /// before it.
    End {
        /// Messages sent before the end.
        sent: u64,
    },
}

/// Checks message `buf` against the expected sequence number.
pub fn verify(expected_seq: u64, buf: &[u64]) -> Check {
    if buf.len() < 3 {
        return Check::Corrupt;
    }
    let seq = buf[0];
    let mut sum = 0u64;
    for (i, v) in buf.iter().enumerate().skip(2) {
        if *v != fill(seq, i) {
            return Check::Corrupt;
        }
        sum ^= *v;
    }
    if sum != buf[1] {
        Check::Corrupt
    } else if seq & END_BIT != 0 {
        Check::End { sent: seq & !END_BIT }
    } else if seq < expected_seq {
        Check::Corrupt
    } else if seq > expected_seq {
        Check::Gap {
            missing: seq - expected_seq,
        }
    } else {
        Check::Ok
    }
}

/// Sends checksummed messages to `dst` until the world breaks or `stop`
/// returns true. Returns how many were sent and the error that ended it.
/// Follow a stop with [`send_end`] so the receiver can count what it got.
pub async fn send_stream(
    world: &World,
    dst: Rank,
    bytes: usize,
    stop: impl Fn() -> bool,
) -> (u64, Option<WorldError>) {
    let mut buf = vec![0u64; elements(bytes)];
    let mut seq = 0u64;
    while !stop() {
        encode(seq, &mut buf);
        if let Err(e) = world.send(dst, STREAM_TAG, &buf[..]).await {
            return (seq, Some(e));
        }
        seq += 1;
    }
    (seq, None)
}

/// Ends a stream of `sent` messages of about `bytes` bytes to `dst` with its
/// end-of-stream message.
pub async fn send_end(world: &World, dst: Rank, bytes: usize, sent: u64) -> Result<(), WorldError> {
    let mut buf = vec![0u64; elements(bytes)];
    encode(sent | END_BIT, &mut buf);
    world.send(dst, STREAM_TAG, &buf[..]).await
}

/// Asks `sender` to stop streaming and send its end-of-stream message.
pub async fn request_end(world: &World, sender: Rank) -> Result<(), WorldError> {
    world.send(sender, CONTROL_TAG, &[1u8][..]).await
}

/// Waits until `leader` asks this member to end its stream ([`request_end`]);
/// `Err` if the world ends first.
pub async fn end_requested(world: &World, leader: Rank) -> Result<(), WorldError> {
    let mut buf = Tensor::zeros(DType::U8, [1]).map_err(|e| WorldError::InvalidArgument {
        world: world.name().clone(),
        detail: e.to_string(),
    })?;
    world.recv(leader, CONTROL_TAG, &mut buf).await
}

/// Live counters of one received stream, shared with whoever watches it.
#[derive(Debug, Default)]
pub struct StreamStats {
    /// Messages received intact.
    pub messages: AtomicU64,
    /// Payload bytes received intact.
    pub bytes: AtomicU64,
    /// Messages whose content was wrong.
    pub corrupted: AtomicU64,
    /// Messages that never arrived: gaps in the sequence, and after a clean
    /// end the ones sent but never received.
    pub lost: AtomicU64,
    /// Set by the end-of-stream message: how many the sender sent.
    sent: OnceLock<u64>,
    gaps: Mutex<GapTracker>,
}

#[derive(Debug, Default)]
struct GapTracker {
    last: Option<Instant>,
    /// The longest pause between two receptions within the current window.
    max_gap: Duration,
}

impl StreamStats {
    fn record(&self, now: Instant, bytes: usize) {
        self.messages.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(bytes as u64, Ordering::Relaxed);
        let mut g = self.gaps.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(last) = g.last {
            g.max_gap = g.max_gap.max(now.saturating_duration_since(last));
        }
        g.last = Some(now);
    }

    /// The longest pause between two receptions since the last call, and
    /// starts a new window.
    pub fn take_max_gap(&self) -> Duration {
        let mut g = self.gaps.lock().unwrap_or_else(|e| e.into_inner());
        std::mem::take(&mut g.max_gap)
    }

    /// Messages received so far.
    pub fn count(&self) -> u64 {
        self.messages.load(Ordering::Relaxed)
    }

    /// How many messages the sender sent, known once the stream ended
    /// cleanly with its end-of-stream message; `None` before that, and for
    /// a stream that ended with its world (a killed or frozen sender).
    pub fn sent(&self) -> Option<u64> {
        self.sent.get().copied()
    }
}

/// Receives checksummed messages from `src` until the world breaks, the
/// stream's end-of-stream message arrives, or `stop` returns true after a
/// message, counting into `stats`. Returns the error that ended it and when
/// it came, or `None` after a clean end or a stop.
pub async fn receive_stream(
    world: &World,
    src: Rank,
    bytes: usize,
    stats: Arc<StreamStats>,
    stop: impl Fn() -> bool,
) -> Option<(WorldError, Instant)> {
    let n = elements(bytes);
    let mut buf = match Tensor::zeros(DType::U64, [n]) {
        Ok(t) => t,
        Err(e) => {
            let err = WorldError::InvalidArgument {
                world: world.name().clone(),
                detail: e.to_string(),
            };
            return Some((err, Instant::now()));
        }
    };
    let mut expected = 0u64;
    while !stop() {
        if let Err(e) = world.recv(src, STREAM_TAG, &mut buf).await {
            return Some((e, Instant::now()));
        }
        let now = Instant::now();
        let data = buf.as_slice::<u64>().unwrap_or(&[]);
        match verify(expected, data) {
            Check::End { sent } => {
                // Everything sent before the end arrived before it (one
                // tag, in order): what did not is lost; more than was sent
                // cannot be.
                if sent > expected {
                    stats.lost.fetch_add(sent - expected, Ordering::Relaxed);
                } else if sent < expected {
                    stats.corrupted.fetch_add(1, Ordering::Relaxed);
                }
                let _ = stats.sent.set(sent);
                return None;
            }
            Check::Ok => {}
            Check::Gap { missing } => {
                stats.lost.fetch_add(missing, Ordering::Relaxed);
            }
            Check::Corrupt => {
                stats.corrupted.fetch_add(1, Ordering::Relaxed);
            }
        }
        expected = data.first().copied().unwrap_or(expected).wrapping_add(1);
        stats.record(now, n * 8);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn intact_gapped_and_corrupt_messages_are_told_apart() {
        let mut buf = vec![0u64; elements(4096)];
        encode(5, &mut buf);
        assert_eq!(verify(5, &buf), Check::Ok);
        assert_eq!(verify(3, &buf), Check::Gap { missing: 2 });
        assert_eq!(verify(6, &buf), Check::Corrupt, "a repeated message");
        let mut bad = buf.clone();
        bad[100] ^= 1;
        assert_eq!(verify(5, &bad), Check::Corrupt);
        let mut bad = buf.clone();
        bad[1] ^= 1;
        assert_eq!(verify(5, &bad), Check::Corrupt);
        assert_eq!(verify(0, &buf[..2]), Check::Corrupt);
    }

    #[test]
    fn an_end_of_stream_message_carries_the_count_and_is_checked_too() {
        let mut buf = vec![0u64; elements(4096)];
        encode(1234 | END_BIT, &mut buf);
        for expected in [0, 1234, 5000] {
            assert_eq!(verify(expected, &buf), Check::End { sent: 1234 });
        }
        let mut bad = buf.clone();
        bad[7] ^= 1;
        assert_eq!(verify(1234, &bad), Check::Corrupt);
    }
}
