//! The flight recorder: each world keeps its last operations (point to point
//! and collectives) in a fixed-size ring, plus every operation still running,
//! so that when the world breaks it can tell what it was doing: which call was
//! pending, on which peer, since when.
//!
//! Pure: time comes in as an argument, nothing here does I/O. The world
//! records each operation's start and end ([`FlightRecorder::begin`] /
//! [`FlightRecorder::end`]); [`FlightRecorder::snapshot`] makes the
//! [`FlightRecord`] attached to [`WorldEvent::Broken`](crate::WorldEvent),
//! logged at the break, written to `MULTIWORLD_FLIGHT_RECORDER_DIR` and
//! printed by `m8d flight FILE` ([`FlightRecord::timeline`]).

use std::{
    collections::{BTreeMap, VecDeque},
    fmt::Write as _,
    sync::{Mutex, PoisonError},
    time::{Duration, Instant, SystemTime},
};

use serde::{Deserialize, Serialize};

/// Operations kept per world once they have ended (the default of
/// `ManagerConfig::flight_recorder_capacity`).
pub const DEFAULT_CAPACITY: usize = 256;

/// How an operation ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// Still running when the record was taken.
    Pending,
    /// Completed.
    Done,
    /// Failed with this error.
    Failed(String),
    /// Its caller stopped waiting (the future was dropped) before it ended.
    /// Not a send whose `isend` handle was dropped: that send goes on, and
    /// its record ends when the send does.
    Cancelled,
}

/// One operation of a world.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpRecord {
    /// Order of start within the world (0, 1, ...).
    pub seq: u64,
    /// What it was: `send`, `recv`, `irecv`, `all_reduce`, `barrier`, ...
    pub kind: String,
    /// The peer of a point-to-point operation (`None`: any peer, or a
    /// collective, which involves its whole group).
    pub peer: Option<u32>,
    /// The tag of a point-to-point operation.
    pub tag: Option<u32>,
    /// Payload bytes (0 when not known, e.g. a receive from any peer before
    /// it matched, or a collective).
    pub bytes: u64,
    /// Start, in microseconds since the world's record began (its join).
    pub start_us: u64,
    /// End, in microseconds since the record began (`None`: still running).
    pub end_us: Option<u64>,
    /// How it ended.
    pub outcome: Outcome,
}

/// What a world was doing: its last operations and those still running.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlightRecord {
    /// The world.
    pub world: String,
    /// Its generation.
    pub generation: u64,
    /// This process's rank.
    pub rank: u32,
    /// When the record began (the join), as Unix time in milliseconds.
    pub began_unix_ms: u64,
    /// When the snapshot was taken, in microseconds since the record began.
    pub taken_us: u64,
    /// Why the snapshot was taken (the break cause, when a world broke).
    pub reason: String,
    /// Operations started before these were dropped from the ring.
    pub dropped: u64,
    /// The operations kept, in order of start: the last ones that ended and
    /// every one still running.
    pub ops: Vec<OpRecord>,
}

impl FlightRecord {
    /// The record with only the last `n` ended operations (and every pending
    /// one): what the break's log line shows.
    pub fn tail(&self, n: usize) -> FlightRecord {
        let ended = self.ops.iter().filter(|o| o.outcome != Outcome::Pending).count();
        let skip = ended.saturating_sub(n);
        let mut seen = 0;
        let ops = self
            .ops
            .iter()
            .filter(|o| {
                if o.outcome == Outcome::Pending {
                    return true;
                }
                seen += 1;
                seen > skip
            })
            .cloned()
            .collect();
        FlightRecord {
            ops,
            dropped: self.dropped + skip as u64,
            ..self.clone()
        }
    }

    /// The operations still running when the record was taken.
    pub fn pending(&self) -> impl Iterator<Item = &OpRecord> {
        self.ops.iter().filter(|o| o.outcome == Outcome::Pending)
    }

    /// A readable timeline: a header, then one line per operation with its
    /// start relative to the snapshot, its duration or how long it had been
    /// pending, peer, tag, size and outcome.
    pub fn timeline(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "world {} generation {} rank {}: {} (record of {} operations{})",
            self.world,
            self.generation,
            self.rank,
            self.reason,
            self.ops.len(),
            if self.dropped > 0 {
                format!(", {} older ones dropped", self.dropped)
            } else {
                String::new()
            }
        );
        for op in &self.ops {
            let ago = Duration::from_micros(self.taken_us.saturating_sub(op.start_us));
            let mut line = format!("  #{:<6} -{:>10.3} ms  {:<24}", op.seq, ms(ago), op.kind);
            match op.peer {
                Some(p) => {
                    let _ = write!(line, " peer {p:<4}");
                }
                None => line.push_str(" peer -   "),
            }
            match op.tag {
                Some(t) => {
                    let _ = write!(line, " tag {t:<10}");
                }
                None => line.push_str(" tag -         "),
            }
            let _ = write!(line, " {:>12} B  ", op.bytes);
            match (&op.outcome, op.end_us) {
                (Outcome::Pending, _) => {
                    let _ = write!(line, "PENDING for {:.3} ms", ms(ago));
                }
                (outcome, Some(end)) => {
                    let took = Duration::from_micros(end.saturating_sub(op.start_us));
                    let what = match outcome {
                        Outcome::Done => "done".to_string(),
                        Outcome::Failed(e) => format!("failed: {e}"),
                        Outcome::Cancelled => "cancelled".to_string(),
                        Outcome::Pending => String::new(),
                    };
                    let _ = write!(line, "{what} in {:.3} ms", ms(took));
                }
                (outcome, None) => {
                    let _ = write!(line, "{outcome:?}");
                }
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// What a starting operation is.
#[derive(Debug, Clone, Copy)]
pub struct OpStart {
    /// Its kind (`send`, `all_reduce`, ...).
    pub kind: &'static str,
    /// Its peer, for point to point.
    pub peer: Option<u32>,
    /// Its tag, for point to point.
    pub tag: Option<u32>,
    /// Its payload bytes, when known.
    pub bytes: u64,
}

struct Running {
    start: OpStart,
    start_us: u64,
}

struct Ring {
    next_seq: u64,
    running: BTreeMap<u64, Running>,
    ended: VecDeque<OpRecord>,
    dropped: u64,
}

/// One world's recorder (see the module docs). Thread-safe; each call holds a
/// short lock and allocates only the ended operation's record (its kind's
/// name, and a failed operation's message).
pub struct FlightRecorder {
    capacity: usize,
    epoch: Instant,
    began: SystemTime,
    ring: Mutex<Ring>,
}

impl std::fmt::Debug for FlightRecorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FlightRecorder")
            .field("capacity", &self.capacity)
            .finish()
    }
}

impl FlightRecorder {
    /// A recorder keeping the last `capacity` ended operations (at least 1),
    /// whose times count from `epoch` (wall-clock `began`).
    pub fn new(capacity: usize, epoch: Instant, began: SystemTime) -> FlightRecorder {
        let capacity = capacity.max(1);
        FlightRecorder {
            capacity,
            epoch,
            began,
            ring: Mutex::new(Ring {
                next_seq: 0,
                running: BTreeMap::new(),
                ended: VecDeque::with_capacity(capacity),
                dropped: 0,
            }),
        }
    }

    fn us(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.epoch).as_micros()).unwrap_or(u64::MAX)
    }

    fn ring(&self) -> std::sync::MutexGuard<'_, Ring> {
        self.ring.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Notes that an operation started at `now`; returns its sequence number
    /// for [`end`](Self::end).
    pub fn begin(&self, start: OpStart, now: Instant) -> u64 {
        let start_us = self.us(now);
        let mut ring = self.ring();
        let seq = ring.next_seq;
        ring.next_seq += 1;
        ring.running.insert(seq, Running { start, start_us });
        seq
    }

    /// Notes that operation `seq` ended at `now` with `outcome` (a second end
    /// of the same operation is ignored).
    pub fn end(&self, seq: u64, now: Instant, outcome: Outcome) {
        let end_us = self.us(now);
        let mut ring = self.ring();
        let Some(run) = ring.running.remove(&seq) else {
            return;
        };
        if ring.ended.len() == self.capacity {
            ring.ended.pop_front();
            ring.dropped += 1;
        }
        ring.ended.push_back(OpRecord {
            seq,
            kind: run.start.kind.to_string(),
            peer: run.start.peer,
            tag: run.start.tag,
            bytes: run.start.bytes,
            start_us: run.start_us,
            end_us: Some(end_us),
            outcome,
        });
    }

    /// The record now: the kept ended operations and every running one,
    /// ordered by start.
    pub fn snapshot(
        &self,
        world: &str,
        generation: u64,
        rank: u32,
        reason: &str,
        now: Instant,
    ) -> FlightRecord {
        let taken_us = self.us(now);
        let ring = self.ring();
        let mut ops: Vec<OpRecord> = ring.ended.iter().cloned().collect();
        ops.extend(ring.running.iter().map(|(&seq, r)| OpRecord {
            seq,
            kind: r.start.kind.to_string(),
            peer: r.start.peer,
            tag: r.start.tag,
            bytes: r.start.bytes,
            start_us: r.start_us,
            end_us: None,
            outcome: Outcome::Pending,
        }));
        ops.sort_by_key(|o| o.seq);
        let began_unix_ms = self
            .began
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        FlightRecord {
            world: world.to_string(),
            generation,
            rank,
            began_unix_ms,
            taken_us,
            reason: reason.to_string(),
            dropped: ring.dropped,
            ops,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn op(kind: &'static str, peer: Option<u32>) -> OpStart {
        OpStart {
            kind,
            peer,
            tag: peer.map(|_| 7),
            bytes: 64,
        }
    }

    #[test]
    fn keeps_the_last_ended_and_every_running_operation_in_order() {
        let t0 = Instant::now();
        let r = FlightRecorder::new(3, t0, SystemTime::now());
        let stuck = r.begin(op("all_reduce", None), t0);
        for i in 0..5u64 {
            let s = r.begin(op("send", Some(1)), t0 + Duration::from_millis(i));
            r.end(s, t0 + Duration::from_millis(i + 1), Outcome::Done);
        }
        let failed = r.begin(op("recv", Some(2)), t0 + Duration::from_millis(10));
        r.end(
            failed,
            t0 + Duration::from_millis(12),
            Outcome::Failed("peer 2 lost".into()),
        );
        r.end(failed, t0 + Duration::from_millis(13), Outcome::Done); // ignored
        let rec = r.snapshot("w", 3, 0, "peer 2 lost", t0 + Duration::from_millis(20));
        let seqs: Vec<u64> = rec.ops.iter().map(|o| o.seq).collect();
        // The running all_reduce (seq 0) stays although 6 newer ops ended.
        assert_eq!(seqs, vec![0, 4, 5, 6]);
        assert_eq!(rec.dropped, 3);
        assert_eq!(
            rec.pending().map(|o| o.kind.as_str()).collect::<Vec<_>>(),
            ["all_reduce"]
        );
        assert_eq!(rec.ops[3].outcome, Outcome::Failed("peer 2 lost".into()));
        assert_eq!(rec.ops[3].end_us, Some(12_000));
        assert_eq!(rec.taken_us, 20_000);
        let tail = rec.tail(1);
        assert_eq!(tail.ops.iter().map(|o| o.seq).collect::<Vec<_>>(), vec![0, 6]);
        assert_eq!(tail.dropped, 5);
        r.end(stuck, t0 + Duration::from_millis(30), Outcome::Cancelled);
        assert_eq!(r.snapshot("w", 3, 0, "", t0).pending().count(), 0);
    }

    #[test]
    fn the_timeline_names_the_pending_operation_and_its_peer() {
        let t0 = Instant::now();
        let r = FlightRecorder::new(8, t0, SystemTime::now());
        let s = r.begin(op("send", Some(1)), t0);
        r.end(s, t0 + Duration::from_micros(250), Outcome::Done);
        r.begin(op("recv", Some(2)), t0 + Duration::from_millis(1));
        let rec = r.snapshot(
            "serve",
            2,
            0,
            "peer 2 lost: connection reset",
            t0 + Duration::from_millis(501),
        );
        let text = rec.timeline();
        assert!(
            text.starts_with("world serve generation 2 rank 0: peer 2 lost"),
            "{text}"
        );
        assert!(text.contains("done in 0.250 ms"), "{text}");
        let pending = text.lines().find(|l| l.contains("PENDING")).unwrap();
        assert!(
            pending.contains("recv") && pending.contains("peer 2") && pending.contains("500.000 ms"),
            "{pending}"
        );
        // A record survives a round trip through JSON (the file format).
        let back: FlightRecord = serde_json::from_str(&serde_json::to_string(&rec).unwrap()).unwrap();
        assert_eq!(back, rec);
    }
}
