//! The tag scheme that keeps collective traffic apart from user point-to-point
//! traffic and from other collectives. Tags with the top bit set are internal:
//!
//! ```text
//!  bit 31     30 ........ 21   20 ............... 1   0
//!  [  1  ][ group id (10) ][ call sequence (20) ][ phase ]
//! ```
//!
//! * **group id**: 0 is the world group; sub-groups get 1..=1022, agreed by their
//!   members when the group is created; 1023 is the runtime's own (see
//!   [`runtime_tag`]), never a group's.
//! * **call sequence**: per group, incremented by every collective call on every
//!   member in the same order (calls on one group are serialised), taken modulo 2^20.
//!   Two consecutive calls therefore never share a tag; a tag comes back only after
//!   2^20 further calls on the same group, by which time every message of the old
//!   call has long been consumed (every successful or mismatched call consumes all
//!   messages sent to it).
//! * **phase**: 0 for the call descriptor, 1 for data.
//!
//! Within one call, messages between a pair of ranks on one tag are matched in the
//! order they were sent, which the algorithms rely on.

use crate::error::{InvalidArgument as Error, Result};
use crate::id::Tag;

/// The bit that marks a tag as internal (reserved for collectives).
pub const INTERNAL_TAG_BIT: u32 = 1 << 31;
/// Bits of the group id.
pub const GROUP_ID_BITS: u32 = 10;
/// The group id reserved for the runtime's own messages ([`runtime_tag`]).
pub const RUNTIME_GROUP_ID: u16 = (1 << GROUP_ID_BITS) - 1;
/// Largest sub-group id; a communicator can create at most this many sub-groups.
pub const MAX_GROUP_ID: u16 = RUNTIME_GROUP_ID - 1;
/// Bits of the per-group call sequence number.
pub const SEQ_BITS: u32 = 20;

/// Whether `tag` is reserved for internal use (collectives). User point-to-point
/// tags must have the top bit clear; the collectives' point-to-point methods
/// refuse internal tags.
pub const fn is_internal_tag(tag: Tag) -> bool {
    tag.0 & INTERNAL_TAG_BIT != 0
}

/// Internal tag number `n` of the runtime itself (outside every group's
/// range, so it never meets a collective's message): e.g. the tokens a world
/// exchanges when it finishes.
pub const fn runtime_tag(n: u32) -> Tag {
    Tag(INTERNAL_TAG_BIT | ((RUNTIME_GROUP_ID as u32) << (SEQ_BITS + 1)) | (n & ((1 << (SEQ_BITS + 1)) - 1)))
}

/// Refuses internal tags for user point-to-point traffic.
pub fn check_user_tag(tag: Tag) -> Result<()> {
    if is_internal_tag(tag) {
        return Err(Error::new(format!(
            "tag {:#x} has the top bit set; tags >= 2^31 are reserved for collectives",
            tag.0
        )));
    }
    Ok(())
}

/// Which message stream of a collective call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// The call descriptor, exchanged before any data (the agreement round).
    Descriptor = 0,
    /// The call's data.
    Data = 1,
}

/// The tag of `phase` of call `seq` on group `group`.
pub fn collective_tag(group: u16, seq: u64, phase: Phase) -> Tag {
    let seq = (seq & ((1 << SEQ_BITS) - 1)) as u32;
    let group = u32::from(group.min(MAX_GROUP_ID));
    Tag(INTERNAL_TAG_BIT | (group << (SEQ_BITS + 1)) | (seq << 1) | phase as u32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn tags_are_internal_and_distinct() {
        let mut seen = HashSet::new();
        for g in [0u16, 1, 2, MAX_GROUP_ID] {
            for s in [0u64, 1, 2, (1 << SEQ_BITS) - 1] {
                for p in [Phase::Descriptor, Phase::Data] {
                    let t = collective_tag(g, s, p);
                    assert!(is_internal_tag(t));
                    assert!(seen.insert(t), "{g} {s} {p:?}");
                }
            }
        }
        // The sequence wraps after 2^20 calls.
        assert_eq!(
            collective_tag(3, 5, Phase::Data),
            collective_tag(3, 5 + (1 << SEQ_BITS), Phase::Data)
        );
        assert!(!is_internal_tag(Tag(0x7fff_ffff)));
        assert!(check_user_tag(Tag(7)).is_ok());
        assert!(check_user_tag(Tag(u32::MAX)).is_err());
        // The runtime's tags are internal and never a group's.
        for n in [0, 1, 7] {
            assert!(is_internal_tag(runtime_tag(n)));
            assert!(!seen.contains(&runtime_tag(n)));
        }
    }
}
