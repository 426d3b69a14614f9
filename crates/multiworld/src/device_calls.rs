//! The agreement check of an NCCL world's collectives
//! ([`WorldConfig::check_device_calls`](crate::WorldConfig)). NCCL takes a
//! collective's arguments on trust: members that disagree on its dtype,
//! element count, root or reduce op make it hang or write wrong data. With
//! the check on, every member's description of its call is gathered over
//! the world's TCP mesh before the call reaches NCCL and compared here, so
//! that members that disagree all fail with the same `Mismatch` and nothing
//! is enqueued. A point-to-point message is described the same way: the
//! sender announces it over TCP, and the receiver compares it with its
//! receive. Pure: the encoding and the comparisons; `device` moves them.

use multiworld_types::{DType, Rank, ReduceOp};

/// Words of one member's description.
pub(crate) const WORDS: usize = 5;

/// Marks the first word ("MWDEV", then the call's kind): a gathered row
/// that does not start with it is not a description at all (a member was
/// in another collective of the mesh).
const MAGIC: u64 = 0x4d57_4445_5600_0000;
const KIND_MASK: u64 = 0xff;
const NONE: u64 = u64::MAX;

/// The calls the check knows, by code (the index): the collectives, and
/// the message of a point-to-point send.
const KINDS: [&str; 10] = [
    "barrier",
    "broadcast",
    "reduce",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "gather",
    "scatter",
    "send",
];

/// One member's device collective, as every member must call it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DeviceCall {
    /// The collective (one of [`KINDS`]).
    pub kind: &'static str,
    /// The element type, if the call moves data.
    pub dtype: Option<DType>,
    /// The element count every member gives (each member's own part).
    pub count: usize,
    /// The root, for rooted collectives.
    pub root: Option<Rank>,
    /// The reduce op, for reductions.
    pub op: Option<ReduceOp>,
}

impl DeviceCall {
    /// A point-to-point message of `count` elements of `dtype` (what the
    /// sender announces and the receiver expects).
    pub fn message(dtype: DType, count: usize) -> DeviceCall {
        DeviceCall {
            kind: "send",
            dtype: Some(dtype),
            count,
            root: None,
            op: None,
        }
    }

    /// This call as gathered: [`WORDS`] words.
    pub fn words(&self) -> [u64; WORDS] {
        let kind = KINDS
            .iter()
            .position(|k| *k == self.kind)
            .map_or(KIND_MASK, |i| i as u64);
        [
            MAGIC | kind,
            self.dtype.map_or(0, |d| u64::from(d.code())),
            self.count as u64,
            self.root.map_or(NONE, |r| u64::from(r.0)),
            self.op.map_or(0, |o| u64::from(o.code())),
        ]
    }
}

/// A gathered description, in words for an error message.
fn describe(w: &[u64]) -> String {
    let kind = (w[0] & !KIND_MASK == MAGIC)
        .then(|| KINDS.get((w[0] & KIND_MASK) as usize))
        .flatten();
    let Some(kind) = kind else {
        return "something other than a device collective (another collective of the world)".into();
    };
    let mut s = (*kind).to_string();
    if let Some(dtype) = u8::try_from(w[1]).ok().and_then(DType::from_code) {
        s.push_str(&format!(" of {} × {dtype}", w[2]));
    }
    if let Some(op) = u8::try_from(w[4]).ok().and_then(ReduceOp::from_code) {
        s.push_str(&format!(" ({op})"));
    }
    if w[3] != NONE {
        s.push_str(&format!(" with root {}", w[3]));
    }
    s
}

/// Compares every member's description (`all`: the gathered words, rank
/// order). `Err` names rank 0's call and the first rank whose call differs:
/// the same text on every member.
pub(crate) fn agree(all: &[u64]) -> Result<(), String> {
    let mut rows = all.chunks_exact(WORDS);
    let Some(first) = rows.next() else {
        return Ok(());
    };
    match rows.position(|r| r != first) {
        None => Ok(()),
        Some(i) => {
            let j = i + 1;
            let other = &all[j * WORDS..(j + 1) * WORDS];
            Err(format!(
                "members disagree on a device collective: rank 0 calls {}, rank {j} calls {}",
                describe(first),
                describe(other)
            ))
        }
    }
}

/// Compares the description `sent` that rank `from` announced for its
/// next device message with the receive `mine` of rank `me`. `Err` names
/// both.
pub(crate) fn matches_sent(sent: &[u64], mine: &DeviceCall, from: Rank, me: Rank) -> Result<(), String> {
    if sent == mine.words() {
        return Ok(());
    }
    let what = |w: &[u64]| match sent_message(w) {
        Some((dtype, count)) => format!("{count} × {dtype}"),
        None => describe(w),
    };
    Err(format!(
        "the device message disagrees with its receive: rank {from} sends {}, rank {me} receives {}",
        what(sent),
        what(&mine.words())
    ))
}

/// The dtype and element count of an announced point-to-point message,
/// if `w` is one.
pub(crate) fn sent_message(w: &[u64]) -> Option<(DType, usize)> {
    let send = KINDS.iter().position(|k| *k == "send")? as u64;
    if w.len() != WORDS || w[0] != MAGIC | send {
        return None;
    }
    let dtype = u8::try_from(w[1]).ok().and_then(DType::from_code)?;
    Some((dtype, usize::try_from(w[2]).ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(kind: &'static str, count: usize) -> DeviceCall {
        DeviceCall {
            kind,
            dtype: Some(DType::F32),
            count,
            root: None,
            op: Some(ReduceOp::Sum),
        }
    }

    fn gathered(calls: &[DeviceCall]) -> Vec<u64> {
        calls.iter().flat_map(|c| c.words()).collect()
    }

    #[test]
    fn identical_calls_agree() {
        let c = call("all_reduce", 4);
        assert_eq!(agree(&gathered(&[c, c, c])), Ok(()));
        assert_eq!(agree(&[]), Ok(()));
        let b = DeviceCall {
            kind: "barrier",
            dtype: None,
            count: 0,
            root: None,
            op: None,
        };
        assert_eq!(agree(&gathered(&[b, b])), Ok(()));
    }

    /// Each field that differs is found, and named for both sides.
    #[test]
    fn a_difference_in_any_field_names_both_calls() {
        let base = DeviceCall {
            kind: "broadcast",
            dtype: Some(DType::F32),
            count: 4,
            root: Some(Rank(0)),
            op: None,
        };
        let cases = [
            (
                DeviceCall { count: 5, ..base },
                "broadcast of 5 × float32 with root 0",
            ),
            (
                DeviceCall {
                    dtype: Some(DType::I64),
                    ..base
                },
                "broadcast of 4 × int64 with root 0",
            ),
            (
                DeviceCall {
                    root: Some(Rank(1)),
                    ..base
                },
                "broadcast of 4 × float32 with root 1",
            ),
            (
                DeviceCall {
                    kind: "all_gather",
                    root: None,
                    ..base
                },
                "all_gather of 4 × float32",
            ),
        ];
        for (other, named) in cases {
            let err = agree(&gathered(&[base, base, other])).unwrap_err();
            assert_eq!(
                err,
                format!(
                    "members disagree on a device collective: rank 0 calls broadcast of 4 × float32 \
                     with root 0, rank 2 calls {named}"
                )
            );
        }
        let sum = call("all_reduce", 4);
        let max = DeviceCall {
            op: Some(ReduceOp::Max),
            ..sum
        };
        let err = agree(&gathered(&[sum, max])).unwrap_err();
        assert!(
            err.ends_with("rank 1 calls all_reduce of 4 × float32 (max)"),
            "{err}"
        );
    }

    /// A point-to-point message matches its receive only with the same
    /// dtype and count; a difference names both, and the sender's message
    /// is read back for draining.
    #[test]
    fn a_message_and_its_receive() {
        let sent = DeviceCall::message(DType::F32, 5).words();
        assert_eq!(
            matches_sent(&sent, &DeviceCall::message(DType::F32, 5), Rank(0), Rank(1)),
            Ok(())
        );
        let err = matches_sent(&sent, &DeviceCall::message(DType::F32, 4), Rank(0), Rank(1)).unwrap_err();
        assert_eq!(
            err,
            "the device message disagrees with its receive: rank 0 sends 5 × float32, rank 1 receives 4 × float32"
        );
        let err = matches_sent(&sent, &DeviceCall::message(DType::I64, 5), Rank(0), Rank(1)).unwrap_err();
        assert!(err.ends_with("rank 1 receives 5 × int64"), "{err}");
        assert_eq!(sent_message(&sent), Some((DType::F32, 5)));
        // Not a message's description: nothing to drain by.
        assert_eq!(sent_message(&call("all_reduce", 5).words()), None);
        assert_eq!(sent_message(&[1, 2, 3, 4, 5]), None);
        let err = matches_sent(
            &[1, 2, 3, 4, 5],
            &DeviceCall::message(DType::F32, 5),
            Rank(0),
            Rank(1),
        )
        .unwrap_err();
        assert!(err.contains("rank 0 sends something other than"), "{err}");
    }

    /// A row that is not a description (a member in another collective of
    /// the mesh) is told as such, never decoded as garbage.
    #[test]
    fn a_row_that_is_no_description_is_named_as_such() {
        let c = call("all_reduce", 4);
        let mut all = gathered(&[c, c]);
        all[WORDS..].copy_from_slice(&[7, 7, 7, 7, 7]);
        let err = agree(&all).unwrap_err();
        assert!(
            err.contains("rank 1 calls something other than a device collective"),
            "{err}"
        );
    }
}
