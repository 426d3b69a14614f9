//! Fuzzing of the agreement descriptors peers send each other, on stable
//! Rust with `proptest` (`MULTIWORLD_FUZZ_CASES` sets the case count; see
//! docs/testing.md): arbitrary words and mutated valid encodings decoded as
//! a peer's descriptor, then run through the agreement check and the eager
//! payload rule next to honest descriptors.
//!
//! Properties: no input panics; a descriptor is accepted or refused with a
//! reason; valid descriptors round-trip (`decode(encode(d)) == d`), and an
//! accepted descriptor re-encodes to its input except for the bits the
//! format reserves (flag bits 2–7 of word 1 and its bits 40–63, which the
//! decoder ignores); `agree` returns a typed error or `Ok` on every member,
//! on every member alike (all go on, or all fail for the same reason; the
//! error's prefix names each caller's own operation and call number); what a member would
//! receive and drop on disagreement (`eager_payload`) is never more than the
//! transport's message bound allows it to allocate.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use multiworld_tcp::{DType, Error, Rank, Tag};
use multiworld_types::ReduceOp;
use proptest::prelude::*;

use crate::desc::{AgreeCtx, Algo, Desc, Kind, agree, eager_payload, words};

fn fuzz_config(default: u32) -> ProptestConfig {
    let cases = std::env::var("MULTIWORLD_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse::<u32>().ok())
        .unwrap_or(default);
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

fn small() -> impl Strategy<Value = u64> {
    prop_oneof![0u64..8, Just(u64::MAX), Just(1 << 40), any::<u64>()]
}

/// A valid descriptor of a group of `n`.
fn desc(n: usize) -> impl Strategy<Value = Desc> {
    (
        proptest::sample::select(Kind::ALL.to_vec()),
        any::<bool>(),
        any::<bool>(),
        proptest::sample::select(vec![Algo::Direct, Algo::Ring, Algo::Shm]),
        proptest::option::of(proptest::sample::select(DType::ALL.to_vec())),
        proptest::option::of(proptest::sample::select(ReduceOp::ALL.to_vec())),
        proptest::option::of(prop_oneof![0u32..8, Just(u32::MAX)].prop_map(Rank)),
        (0u64..3, 0u64..3, 0u64..3),
        (small(), small()),
        proptest::collection::vec(small(), n),
        proptest::collection::vec(small(), n),
    )
        .prop_map(
            move |(kind, abstain, eager, algo, dtype, op, root, (seq, group, config), (count, aux), a, b)| {
                Desc {
                    kind,
                    abstain,
                    eager,
                    algo,
                    dtype,
                    op,
                    root,
                    seq,
                    group,
                    config,
                    count,
                    aux,
                    a,
                    b,
                }
            },
        )
}

/// The bits of word 1 the format reserves (ignored by the decoder).
const RESERVED_1: u64 = (0xfc << 8) | (0xff_ffff << 40);

#[derive(Debug, Clone)]
enum Mutation {
    FlipBit(usize, u8),
    SetWord(usize, u64),
    /// Replaces one byte-wide field of word 1 (kind, flags, dtype, op, algo).
    SetField(u8, u8),
    Truncate(usize),
    Push(u64),
}

fn mutations() -> impl Strategy<Value = Vec<Mutation>> {
    let one = prop_oneof![
        (any::<usize>(), 0u8..64).prop_map(|(p, b)| Mutation::FlipBit(p, b)),
        (any::<usize>(), small()).prop_map(|(p, v)| Mutation::SetWord(p, v)),
        (0u8..5, any::<u8>()).prop_map(|(f, v)| Mutation::SetField(f, v)),
        any::<usize>().prop_map(Mutation::Truncate),
        small().prop_map(Mutation::Push),
    ];
    proptest::collection::vec(one, 1..4)
}

fn apply(w: &mut Vec<u64>, edits: &[Mutation]) {
    for m in edits {
        let len = w.len();
        match m {
            Mutation::FlipBit(p, b) if len > 0 => w[p % len] ^= 1 << b,
            Mutation::SetWord(p, v) if len > 0 => w[p % len] = *v,
            Mutation::SetField(f, v) if len > 1 => {
                let shift = [0u32, 8, 16, 24, 32][usize::from(*f)];
                w[1] = (w[1] & !(0xff << shift)) | (u64::from(*v) << shift);
            }
            Mutation::Truncate(n) => w.truncate(n % (len + 1)),
            Mutation::Push(v) => w.push(*v),
            _ => {}
        }
    }
}

/// Decodes words as a peer's descriptor and checks what must hold of any
/// outcome.
fn decode_checked(w: &[u64], n: usize) -> Result<Option<Desc>, TestCaseError> {
    match Desc::decode(w, n) {
        Ok(d) => {
            prop_assert_eq!(w.len(), words(n));
            prop_assert_eq!(d.a.len(), n);
            prop_assert_eq!(d.b.len(), n);
            let mut canonical = w.to_vec();
            canonical[1] &= !RESERVED_1;
            prop_assert_eq!(d.encode(), canonical);
            Ok(Some(d))
        }
        Err(why) => {
            prop_assert!(!why.is_empty());
            Ok(None)
        }
    }
}

/// Runs the agreement check on every member with these descriptors and
/// checks that the members reach the same verdict.
fn agree_everywhere(descs: &[Desc], members: &[Rank]) -> Result<(), TestCaseError> {
    let mut texts = Vec::new();
    for me in 0..descs.len() {
        let cx = AgreeCtx {
            members,
            me,
            group_id: 3,
            data_tag: Tag(0x8000_0001),
            max_object_bytes: 4096,
        };
        let verdict = agree(descs, &cx);
        match &verdict {
            Ok(()) => texts.push("ok".to_owned()),
            Err(Error::Mismatch { .. }) => texts.push("mismatch".to_owned()),
            Err(Error::InvalidArgument(why)) => texts.push(why.to_string()),
            Err(e) => return Err(TestCaseError::fail(format!("untyped disagreement {e:?}"))),
        }
        // What this member would receive and drop on disagreement comes
        // only from an eager, non-abstaining peer that runs a direct
        // algorithm (or may use shared memory, for kinds sized after the
        // agreement), with that peer's dtype (group.rs bounds the count by the
        // transport's message limit before allocating).
        for (p, d) in descs.iter().enumerate() {
            if let Some((dtype, count)) = eager_payload(d, p, me, members) {
                let direct =
                    d.algo == Algo::Direct || (d.algo == Algo::Shm && d.kind.sized_after_agreement());
                prop_assert!(p != me && d.eager && !d.abstain && direct);
                // An object's bytes, or the descriptor's own dtype.
                prop_assert!(d.dtype == Some(dtype) || dtype == DType::U8);
                let _ = count;
            }
        }
    }
    // Every member goes on, or every member fails, for the same reason: the
    // text after the prefix (which names the caller's own operation and call
    // number, so it differs where those are what the members disagree on).
    let body = |t: &String| t.split_once(": ").map_or(t.clone(), |(_, rest)| rest.to_owned());
    prop_assert!(
        texts.windows(2).all(|t| body(&t[0]) == body(&t[1])),
        "members disagree about the verdict: {:?}",
        texts
    );
    Ok(())
}

proptest! {
    #![proptest_config(fuzz_config(1000))]

    #[test]
    fn descriptors_from_arbitrary_words(n in 1usize..6, w in proptest::collection::vec(any::<u64>(), 0..24)) {
        decode_checked(&w, n)?;
    }

    /// Arbitrary words behind the right magic and length, so the field
    /// checks are reached.
    #[test]
    fn descriptors_from_arbitrary_words_behind_the_magic(n in 1usize..6, seed in proptest::collection::vec(any::<u64>(), 20)) {
        let mut w = seed[..words(n)].to_vec();
        w[0] = Desc::new(Kind::Barrier, n, 0, 0, 0).encode()[0];
        // Small field codes, so valid ones come up often.
        w[1] &= 0x1f_031f_1f1f;
        decode_checked(&w, n)?;
    }

    #[test]
    fn descriptors_from_arbitrary_bytes(n in 1usize..6, b in proptest::collection::vec(any::<u8>(), 0..200)) {
        // How the transport hands a received message over: bytes read as
        // little-endian u64 words (a ragged length never reaches the decoder:
        // the receive buffer is exactly words(n) u64s).
        let w: Vec<u64> = b.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().unwrap())).collect();
        decode_checked(&w, n)?;
    }

    #[test]
    fn descriptors_round_trip(d in (1usize..6).prop_flat_map(desc)) {
        let n = d.a.len();
        let w = d.encode();
        prop_assert_eq!(w.len(), words(n));
        prop_assert_eq!(decode_checked(&w, n)?, Some(d));
    }

    #[test]
    fn mutated_descriptors_against_the_agreement(
        (honest, edits, liar) in (1usize..5).prop_flat_map(|n| (
            proptest::collection::vec(desc(n), n),
            mutations(),
            0..n,
        )),
        agreeing in any::<bool>(),
    ) {
        let n = honest.len();
        let members: Vec<Rank> = (0..n as u32).map(|r| Rank(r * 2 + 1)).collect();
        // Either everybody made the same call, or anything goes.
        let mut descs = if agreeing { vec![honest[0].clone(); n] } else { honest };
        let mut w = descs[liar].encode();
        apply(&mut w, &edits);
        if let Some(d) = decode_checked(&w, n)? {
            descs[liar] = d;
            agree_everywhere(&descs, &members)?;
        }
    }
}
