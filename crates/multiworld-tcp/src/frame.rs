//! The data-frame codec, pure and I/O-free. After the handshake every byte on a
//! connection is a sequence of frames: a fixed [`HEADER_LEN`]-byte header, then
//! `len` payload bytes. [`decode`] validates magic, kind, flags, dtype and the
//! declared length against [`FrameLimits`] before the caller allocates or reads
//! anything; [`RxSequencer`] then checks the per-connection sequence number and the
//! world generation, so a desynchronised or foreign stream is caught at the next
//! header.
//!
//! Header layout (little-endian):
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 4 | magic `b"MWF1"` |
//! | 4 | 1 | kind (1 = data, 2 = bye, 3 = heartbeat) |
//! | 5 | 1 | dtype wire code (0 for control frames) |
//! | 6 | 2 | flags (reserved, must be 0) |
//! | 8 | 4 | tag |
//! | 12 | 4 | sequence number (per connection and direction, wrapping) |
//! | 16 | 8 | world generation |
//! | 24 | 8 | payload length in bytes |

use multiworld_types::DType;
use multiworld_types::{Generation, Tag};

/// Frame magic, the first four bytes of every header.
pub const FRAME_MAGIC: [u8; 4] = *b"MWF1";

/// Size of a frame header in bytes.
pub const HEADER_LEN: usize = 32;

const KIND_DATA: u8 = 1;
const KIND_BYE: u8 = 2;
const KIND_HEARTBEAT: u8 = 3;

/// Limits applied to every header read from the network.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameLimits {
    /// Largest payload a single message may declare, in bytes.
    pub max_message_bytes: u64,
}

impl Default for FrameLimits {
    /// 16 GiB: far above any realistic single message, far below "allocate
    /// whatever a corrupt header says".
    fn default() -> Self {
        FrameLimits {
            max_message_bytes: 16 << 30,
        }
    }
}

/// What a frame carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameKind {
    /// A tensor message of `len` bytes of `dtype` on `tag`.
    Data {
        /// Element type of the payload.
        dtype: DType,
        /// Message tag.
        tag: Tag,
        /// Payload length in bytes (a multiple of the dtype size).
        len: u64,
    },
    /// The sender is closing the connection in an orderly way; nothing follows.
    Bye,
    /// The sender is alive; sent every heartbeat interval when the
    /// connection's writer is free. It may echo the last heartbeat the sender
    /// received on the other direction, so that the peer can time a round
    /// trip (see [`Echo`]).
    Heartbeat {
        /// The echo, if the sender has received a heartbeat to echo.
        echo: Option<Echo>,
    },
}

/// The echo a heartbeat carries of the last heartbeat its sender received:
/// that heartbeat's sequence number and how long the sender held it before
/// this one went out. The peer that sent the echoed heartbeat times the
/// round trip as `now - sent - held`, whatever the two clocks say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Echo {
    /// Sequence number of the echoed heartbeat (on the other direction).
    pub seq: u32,
    /// Microseconds between receiving it and sending this one.
    pub held_us: u32,
}

/// Marks a heartbeat's length field as carrying an [`Echo`].
const ECHO_FLAG: u64 = 1 << 63;

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// What the frame carries.
    pub kind: FrameKind,
    /// Sequence number of this frame on its connection and direction.
    pub seq: u32,
    /// Generation of the world the connection belongs to.
    pub generation: Generation,
}

impl FrameHeader {
    /// Payload length that follows the header (for tests and the `wire` feature).
    #[cfg(any(test, feature = "wire"))]
    pub fn payload_len(&self) -> u64 {
        match self.kind {
            FrameKind::Data { len, .. } => len,
            FrameKind::Bye | FrameKind::Heartbeat { .. } => 0,
        }
    }

    /// Encodes the header.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&FRAME_MAGIC);
        let (kind, dtype, tag, len) = match self.kind {
            FrameKind::Data { dtype, tag, len } => (KIND_DATA, dtype.code(), tag.0, len),
            FrameKind::Bye => (KIND_BYE, 0, 0, 0),
            FrameKind::Heartbeat { echo: None } => (KIND_HEARTBEAT, 0, 0, 0),
            FrameKind::Heartbeat { echo: Some(e) } => {
                (KIND_HEARTBEAT, 0, e.seq, ECHO_FLAG | u64::from(e.held_us))
            }
        };
        b[4] = kind;
        b[5] = dtype;
        // b[6..8]: flags, zero.
        b[8..12].copy_from_slice(&tag.to_le_bytes());
        b[12..16].copy_from_slice(&self.seq.to_le_bytes());
        b[16..24].copy_from_slice(&self.generation.0.to_le_bytes());
        b[24..32].copy_from_slice(&len.to_le_bytes());
        b
    }
}

/// Why a header was refused. Any of these closes the connection.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    /// The first four bytes are not [`FRAME_MAGIC`].
    #[error("bad frame magic {0:02x?}")]
    BadMagic([u8; 4]),
    /// Unknown frame kind.
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    /// Unknown dtype code in a data frame.
    #[error("unknown dtype code {0}")]
    UnknownDType(u8),
    /// Reserved flag bits were set.
    #[error("reserved flags set: {0:#06x}")]
    ReservedFlags(u16),
    /// The declared payload exceeds [`FrameLimits::max_message_bytes`].
    #[error("declared payload of {len} bytes exceeds the limit of {max} bytes")]
    TooLarge {
        /// Declared length.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// The payload length is not a whole number of elements.
    #[error("payload of {len} bytes is not a whole number of {dtype} elements")]
    Ragged {
        /// Declared length.
        len: u64,
        /// Declared dtype.
        dtype: DType,
    },
    /// A control frame had a dtype, tag or length.
    #[error("malformed control frame")]
    BadControl,
    /// The sequence number is not the next one expected.
    #[error("frame sequence {got}, expected {expected}")]
    Sequence {
        /// Expected sequence number.
        expected: u32,
        /// Received sequence number.
        got: u32,
    },
    /// The frame belongs to another generation of the world.
    #[error("frame of generation {got}, this connection is generation {expected}")]
    Generation {
        /// This connection's generation.
        expected: Generation,
        /// The frame's generation.
        got: Generation,
    },
}

fn u32_at(b: &[u8; HEADER_LEN], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

fn u64_at(b: &[u8; HEADER_LEN], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

/// Decodes and validates a header. Nothing is allocated; the declared length is
/// checked against `limits` here and against the posted receive by the caller.
pub fn decode(b: &[u8; HEADER_LEN], limits: &FrameLimits) -> Result<FrameHeader, FrameError> {
    let magic = [b[0], b[1], b[2], b[3]];
    if magic != FRAME_MAGIC {
        return Err(FrameError::BadMagic(magic));
    }
    let flags = u16::from_le_bytes([b[6], b[7]]);
    if flags != 0 {
        return Err(FrameError::ReservedFlags(flags));
    }
    let tag = u32_at(b, 8);
    let seq = u32_at(b, 12);
    let generation = Generation(u64_at(b, 16));
    let len = u64_at(b, 24);
    let kind = match b[4] {
        KIND_DATA => {
            let dtype = DType::from_code(b[5]).ok_or(FrameError::UnknownDType(b[5]))?;
            if len > limits.max_message_bytes {
                return Err(FrameError::TooLarge {
                    len,
                    max: limits.max_message_bytes,
                });
            }
            if len % dtype.size() as u64 != 0 {
                return Err(FrameError::Ragged { len, dtype });
            }
            FrameKind::Data {
                dtype,
                tag: Tag(tag),
                len,
            }
        }
        KIND_BYE => {
            if b[5] != 0 || tag != 0 || len != 0 {
                return Err(FrameError::BadControl);
            }
            FrameKind::Bye
        }
        KIND_HEARTBEAT => {
            if b[5] != 0 {
                return Err(FrameError::BadControl);
            }
            let echo = match (tag, len) {
                (0, 0) => None,
                (seq, len) if len & ECHO_FLAG != 0 => match u32::try_from(len & !ECHO_FLAG) {
                    Ok(held_us) => Some(Echo { seq, held_us }),
                    Err(_) => return Err(FrameError::BadControl),
                },
                _ => return Err(FrameError::BadControl),
            };
            FrameKind::Heartbeat { echo }
        }
        other => return Err(FrameError::UnknownKind(other)),
    };
    Ok(FrameHeader {
        kind,
        seq,
        generation,
    })
}

/// Checks that frames on one connection come in sequence and from the right
/// generation.
#[derive(Debug, Clone)]
pub struct RxSequencer {
    generation: Generation,
    next: u32,
}

impl RxSequencer {
    /// A sequencer for a fresh connection of `generation` (first frame is 0).
    pub fn new(generation: Generation) -> Self {
        RxSequencer { generation, next: 0 }
    }

    /// Accepts the next header or says why not.
    pub fn check(&mut self, h: &FrameHeader) -> Result<(), FrameError> {
        if h.generation != self.generation {
            return Err(FrameError::Generation {
                expected: self.generation,
                got: h.generation,
            });
        }
        if h.seq != self.next {
            return Err(FrameError::Sequence {
                expected: self.next,
                got: h.seq,
            });
        }
        self.next = self.next.wrapping_add(1);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn data(len: u64) -> FrameHeader {
        FrameHeader {
            kind: FrameKind::Data {
                dtype: DType::F32,
                tag: Tag(7),
                len,
            },
            seq: 3,
            generation: Generation(9),
        }
    }

    #[test]
    fn heartbeat_round_trips_and_rejects_payload() {
        let h = FrameHeader {
            kind: FrameKind::Heartbeat { echo: None },
            seq: 9,
            generation: Generation(4),
        };
        let b = h.encode();
        assert_eq!(decode(&b, &FrameLimits::default()), Ok(h));
        assert_eq!(h.payload_len(), 0);
        let mut bad = b;
        bad[24] = 1;
        assert_eq!(decode(&bad, &FrameLimits::default()), Err(FrameError::BadControl));
        // An echo round-trips; a length that is neither 0 nor flag + 32 bits
        // of held time, or a tag without the flag, is refused.
        for echo in [
            Echo { seq: 0, held_us: 0 },
            Echo {
                seq: u32::MAX,
                held_us: u32::MAX,
            },
        ] {
            let h = FrameHeader {
                kind: FrameKind::Heartbeat { echo: Some(echo) },
                ..h
            };
            assert_eq!(decode(&h.encode(), &FrameLimits::default()), Ok(h));
            assert_eq!(h.payload_len(), 0);
        }
        let mut bad = h.encode();
        bad[8] = 5; // a tag without the flag
        assert_eq!(decode(&bad, &FrameLimits::default()), Err(FrameError::BadControl));
        let mut bad = FrameHeader {
            kind: FrameKind::Heartbeat {
                echo: Some(Echo { seq: 1, held_us: 2 }),
            },
            ..h
        }
        .encode();
        bad[28] = 1; // held time over 32 bits
        assert_eq!(decode(&bad, &FrameLimits::default()), Err(FrameError::BadControl));
    }

    #[test]
    fn roundtrip() {
        let lim = FrameLimits::default();
        for h in [
            data(0),
            data(4096),
            FrameHeader {
                kind: FrameKind::Bye,
                seq: u32::MAX,
                generation: Generation(u64::MAX),
            },
        ] {
            assert_eq!(decode(&h.encode(), &lim).unwrap(), h);
        }
        for d in DType::ALL {
            let h = FrameHeader {
                kind: FrameKind::Data {
                    dtype: d,
                    tag: Tag(u32::MAX),
                    len: d.size() as u64 * 3,
                },
                seq: 0,
                generation: Generation(1),
            };
            assert_eq!(decode(&h.encode(), &lim).unwrap(), h);
        }
    }

    #[test]
    fn refuses_bad_headers() {
        let lim = FrameLimits {
            max_message_bytes: 1024,
        };
        let mut b = data(8).encode();
        b[0] = b'X';
        assert!(matches!(decode(&b, &lim), Err(FrameError::BadMagic(_))));

        let mut b = data(8).encode();
        b[4] = 99;
        assert_eq!(decode(&b, &lim), Err(FrameError::UnknownKind(99)));

        let mut b = data(8).encode();
        b[5] = 0;
        assert_eq!(decode(&b, &lim), Err(FrameError::UnknownDType(0)));

        let mut b = data(8).encode();
        b[6] = 1;
        assert_eq!(decode(&b, &lim), Err(FrameError::ReservedFlags(1)));

        assert_eq!(
            decode(&data(2048).encode(), &lim),
            Err(FrameError::TooLarge { len: 2048, max: 1024 })
        );
        assert!(matches!(
            decode(&data(u64::MAX).encode(), &FrameLimits::default()),
            Err(FrameError::TooLarge { .. })
        ));
        assert!(matches!(
            decode(&data(6).encode(), &lim),
            Err(FrameError::Ragged { len: 6, .. })
        ));

        let mut b = FrameHeader {
            kind: FrameKind::Bye,
            seq: 0,
            generation: Generation(0),
        }
        .encode();
        b[24] = 1;
        assert_eq!(decode(&b, &lim), Err(FrameError::BadControl));

        // Random bytes never decode into a data frame with an unbounded length.
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        for _ in 0..2000 {
            let mut b = [0u8; HEADER_LEN];
            for byte in b.iter_mut() {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                *byte = x as u8;
            }
            if let Ok(h) = decode(&b, &lim) {
                assert!(h.payload_len() <= 1024);
            }
        }
    }

    #[test]
    fn sequencer() {
        let mut s = RxSequencer::new(Generation(9));
        let mut h = data(0);
        h.seq = 0;
        s.check(&h).unwrap();
        assert_eq!(s.check(&h), Err(FrameError::Sequence { expected: 1, got: 0 }));
        h.seq = 1;
        h.generation = Generation(8);
        assert!(matches!(s.check(&h), Err(FrameError::Generation { .. })));
        h.generation = Generation(9);
        s.check(&h).unwrap();
    }
}
