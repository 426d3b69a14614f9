//! Fuzzing of the transport's wire decoders (the frame header codec and the
//! handshake messages), on stable Rust with `proptest`: arbitrary bytes and
//! structure-aware mutations of valid encodings. Each property runs
//! `MULTIWORLD_FUZZ_CASES` cases (default: a few hundred to two thousand, for
//! CI); see docs/testing.md for the long run.
//!
//! Properties:
//! - no input panics; every input is accepted or refused with a typed error
//!   (`FrameError`, `Reject` with its `RejectCode`, the transport's `Error`);
//! - frame headers decode without allocating at all, and a decoded data
//!   frame never declares more than `FrameLimits::max_message_bytes`;
//! - what the handshake allocates is bounded by the protocol's own bounds
//!   (a world name of at most `MAX_WORLD_NAME_LEN`, a reject detail of at
//!   most 255 bytes), whatever length an input declares; measured with a
//!   counting global allocator that records, per thread, the number of
//!   allocations and the largest one while a probe is armed;
//! - valid encodings round-trip: `encode(decode(x)) == x`, and a decoded
//!   header or Hello re-encodes to the bytes it came from;
//! - the connecting side of the handshake (`client_handshake`), fed any
//!   reply from a fake accepting side, fails with a typed error unless the
//!   reply is the right challenge followed by Accept;
//! - a real listener, sent any bytes by a stranger, closes the connection
//!   and still lets the real member join.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]
// The counting allocator below is the one `unsafe` in this file: it only
// forwards to the system allocator.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use multiworld_tcp::frame::{self, FrameError, FrameHeader, FrameKind, FrameLimits, HEADER_LEN};
use multiworld_tcp::handshake::{
    self, CHALLENGE_BODY_LEN, Challenge, HELLO_FIXED_LEN, Hello, HelloPrefix, MAX_DETAIL_LEN, MSG_ACCEPT,
    MSG_CHALLENGE, MSG_REJECT, NONCE_LEN, Reject, RejectCode, Role,
};
use multiworld_tcp::mesh::{addr_key, client_handshake};
use multiworld_tcp::{
    Communicator, DType, Error, Generation, Identity, MemoryRendezvous, Rank, Rendezvous, Tag, WorldName,
};
use multiworld_testkit::*;
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::TestCaseError;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;

// ---------------------------------------------------------------------------
// Case counts.

/// Cases of a property: `MULTIWORLD_FUZZ_CASES` divided by `divisor` (the
/// loopback properties are about a hundred times slower per case than the
/// pure ones), or `default` when the variable is unset.
fn cases(default: u32, divisor: u32) -> u32 {
    std::env::var("MULTIWORLD_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse::<u32>().ok())
        .map_or(default, |n| (n / divisor).max(1))
}

fn fuzz_config(default: u32, divisor: u32) -> ProptestConfig {
    ProptestConfig {
        cases: cases(default, divisor),
        // Failures print the minimal input; nothing is written into the tree.
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

// ---------------------------------------------------------------------------
// The counting allocator.

struct Probe;

thread_local! {
    static ARMED: Cell<bool> = const { Cell::new(false) };
    static COUNT: Cell<u64> = const { Cell::new(0) };
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

fn note(size: usize) {
    // `try_with`: never panics, even while a thread is being torn down.
    let _ = ARMED.try_with(|armed| {
        if armed.get() {
            let _ = COUNT.try_with(|c| c.set(c.get() + 1));
            let _ = LARGEST.try_with(|l| l.set(l.get().max(size)));
        }
    });
}

// SAFETY: every call is forwarded unchanged to the system allocator; the
// bookkeeping touches only const-initialised thread-locals without
// destructors, which never allocate.
unsafe impl GlobalAlloc for Probe {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static PROBE: Probe = Probe;

/// What this thread allocated while `f` ran.
#[derive(Debug, Clone, Copy)]
struct Allocs {
    count: u64,
    largest: usize,
}

fn measure<T>(f: impl FnOnce() -> T) -> (T, Allocs) {
    COUNT.with(|c| c.set(0));
    LARGEST.with(|l| l.set(0));
    ARMED.with(|a| a.set(true));
    let out = f();
    ARMED.with(|a| a.set(false));
    let allocs = Allocs {
        count: COUNT.with(Cell::get),
        largest: LARGEST.with(Cell::get),
    };
    (out, allocs)
}

/// The largest single allocation the handshake may make whatever it is sent:
/// a world name is at most 255 bytes, a reject detail at most 255, and the
/// refusal messages formatted around them a few hundred more.
const HANDSHAKE_ALLOC_BOUND: usize = 4096;

// ---------------------------------------------------------------------------
// Structure-aware mutations.

/// One edit of a valid encoding; positions are taken modulo the length.
#[derive(Debug, Clone)]
enum Mutation {
    FlipBit(usize, u8),
    SetByte(usize, u8),
    /// Overwrites 8 bytes with an interesting little-endian integer (a
    /// length or count field lands on one of these sooner or later).
    SetWord(usize, u64),
    Truncate(usize),
    Insert(usize, Vec<u8>),
    Remove(usize, usize),
}

fn interesting_u64() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0u64),
        Just(1),
        Just(u64::from(u16::MAX)),
        Just(u64::from(u32::MAX)),
        Just(u64::MAX),
        Just(u64::MAX / 2 + 1),
        Just(16u64 << 30),
        Just((16u64 << 30) + 1),
        any::<u64>(),
    ]
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), 0u8..8).prop_map(|(p, b)| Mutation::FlipBit(p, b)),
        (any::<usize>(), any::<u8>()).prop_map(|(p, v)| Mutation::SetByte(p, v)),
        (any::<usize>(), interesting_u64()).prop_map(|(p, v)| Mutation::SetWord(p, v)),
        any::<usize>().prop_map(Mutation::Truncate),
        (any::<usize>(), proptest::collection::vec(any::<u8>(), 1..16))
            .prop_map(|(p, v)| Mutation::Insert(p, v)),
        (any::<usize>(), 1usize..16).prop_map(|(p, n)| Mutation::Remove(p, n)),
    ]
}

fn mutations() -> impl Strategy<Value = Vec<Mutation>> {
    proptest::collection::vec(mutation(), 1..4)
}

fn apply(bytes: &mut Vec<u8>, edits: &[Mutation]) {
    for m in edits {
        let len = bytes.len();
        match m {
            Mutation::FlipBit(p, b) if len > 0 => bytes[p % len] ^= 1 << b,
            Mutation::SetByte(p, v) if len > 0 => bytes[p % len] = *v,
            Mutation::SetWord(p, v) if len > 0 => {
                let at = p % len;
                for (i, b) in v.to_le_bytes().into_iter().enumerate() {
                    if let Some(x) = bytes.get_mut(at + i) {
                        *x = b;
                    }
                }
            }
            Mutation::Truncate(n) => bytes.truncate(n % (len + 1)),
            Mutation::Insert(p, v) => {
                let at = p % (len + 1);
                bytes.splice(at..at, v.iter().copied());
            }
            Mutation::Remove(p, n) if len > 0 => {
                let at = p % len;
                let end = (at + n).min(len);
                bytes.drain(at..end);
            }
            _ => {}
        }
    }
}

// ---------------------------------------------------------------------------
// Frame headers.

fn dtype() -> impl Strategy<Value = DType> {
    proptest::sample::select(DType::ALL.to_vec())
}

fn frame_header(max: u64) -> impl Strategy<Value = FrameHeader> {
    let data = (dtype(), any::<u32>(), 0..=max).prop_map(|(dtype, tag, len)| FrameKind::Data {
        dtype,
        tag: Tag(tag),
        // Whole elements only.
        len: len - len % dtype.size() as u64,
    });
    let kind = prop_oneof![
        4 => data,
        1 => Just(FrameKind::Bye),
        1 => Just(FrameKind::Heartbeat { echo: None }),
        1 => (any::<u32>(), any::<u32>()).prop_map(|(seq, held_us)| FrameKind::Heartbeat {
            echo: Some(frame::Echo { seq, held_us }),
        }),
    ];
    (kind, any::<u32>(), any::<u64>()).prop_map(|(kind, seq, g)| FrameHeader {
        kind,
        seq,
        generation: Generation(g),
    })
}

fn limits() -> impl Strategy<Value = FrameLimits> {
    prop_oneof![
        Just(FrameLimits::default()),
        Just(FrameLimits { max_message_bytes: 0 }),
        (0u64..1 << 20).prop_map(|m| FrameLimits { max_message_bytes: m }),
        any::<u64>().prop_map(|m| FrameLimits { max_message_bytes: m }),
    ]
}

/// Decodes one header under the probe and checks everything that must hold
/// of any outcome.
fn check_frame(
    b: &[u8; HEADER_LEN],
    lim: &FrameLimits,
) -> Result<Result<FrameHeader, FrameError>, TestCaseError> {
    let (out, allocs) = measure(|| frame::decode(b, lim));
    prop_assert_eq!(allocs.count, 0, "decoding a header allocated: {:?}", allocs);
    match &out {
        Ok(h) => {
            prop_assert!(h.payload_len() <= lim.max_message_bytes);
            if let FrameKind::Data { dtype, len, .. } = h.kind {
                prop_assert_eq!(len % dtype.size() as u64, 0);
            }
            // Accepted headers are canonical: they re-encode to the same bytes.
            prop_assert_eq!(&h.encode(), b);
        }
        Err(e) => {
            // Typed and printable.
            prop_assert!(!e.to_string().is_empty());
            if let FrameError::TooLarge { len, max } = e {
                prop_assert!(len > max);
            }
        }
    }
    Ok(out)
}

proptest! {
    #![proptest_config(fuzz_config(1000, 1))]

    #[test]
    fn frame_arbitrary_bytes(b in any::<[u8; HEADER_LEN]>(), lim in limits()) {
        let _ = check_frame(&b, &lim)?;
    }

    /// Arbitrary bytes behind a valid magic, so the later checks are reached.
    #[test]
    fn frame_arbitrary_bytes_behind_the_magic(
        mut b in any::<[u8; HEADER_LEN]>(),
        kind in 0u8..5,
        lim in limits(),
    ) {
        b[..4].copy_from_slice(&frame::FRAME_MAGIC);
        b[4] = kind;
        let _ = check_frame(&b, &lim)?;
    }

    #[test]
    fn frame_round_trip(h in frame_header(1 << 40)) {
        let lim = FrameLimits { max_message_bytes: 1 << 40 };
        let b = h.encode();
        prop_assert_eq!(check_frame(&b, &lim)?, Ok(h));
    }

    #[test]
    fn frame_mutated(h in frame_header(1 << 20), edits in mutations(), lim in limits()) {
        let mut b = h.encode().to_vec();
        apply(&mut b, &edits);
        // The reader always reads exactly HEADER_LEN bytes: pad or cut.
        b.resize(HEADER_LEN, 0);
        let b: [u8; HEADER_LEN] = b.try_into().unwrap();
        let _ = check_frame(&b, &lim)?;
    }
}

// ---------------------------------------------------------------------------
// Handshake messages, pure.

fn world_name() -> impl Strategy<Value = WorldName> {
    prop_oneof![
        "[a-z0-9/_.-]{1,40}",
        // Multi-byte UTF-8, up to the byte limit.
        "[a-zé€𝄞]{1,60}",
        Just("x".repeat(multiworld_types::MAX_WORLD_NAME_LEN)),
    ]
    .prop_filter_map("valid world name", |s| WorldName::new(s).ok())
}

fn hello() -> impl Strategy<Value = Hello> {
    (
        world_name(),
        any::<u64>(),
        any::<u32>(),
        any::<u32>(),
        any::<u32>(),
        any::<[u8; NONCE_LEN]>(),
    )
        .prop_map(|(world, g, from, to, size, nonce)| Hello {
            version: handshake::PROTOCOL_VERSION,
            world,
            generation: Generation(g),
            from: Rank(from),
            to: Rank(to),
            size,
            nonce,
        })
}

/// Parses a Hello the way the accepting side reads it from a stream: the
/// fixed part, then exactly the declared name length (short input is an
/// EOF there, `None` here). Checks the allocation bound on the way.
fn parse_hello(bytes: &[u8]) -> Result<Option<Result<Hello, Reject>>, TestCaseError> {
    let (out, allocs) = measure(|| {
        let fixed: [u8; HELLO_FIXED_LEN] = bytes.get(..HELLO_FIXED_LEN)?.try_into().ok()?;
        let prefix = match HelloPrefix::decode(&fixed) {
            Ok(p) => p,
            Err(r) => return Some(Err(r)),
        };
        let n = prefix.name_len();
        // What the reader allocates for the name: bounded by the prefix.
        let mut name = vec![0u8; n];
        name.copy_from_slice(bytes.get(HELLO_FIXED_LEN..HELLO_FIXED_LEN + n)?);
        Some(prefix.finish(&name))
    });
    prop_assert!(
        allocs.largest <= HANDSHAKE_ALLOC_BOUND,
        "parsing a hello allocated {} bytes at once",
        allocs.largest
    );
    if let Some(Err(r)) = &out {
        prop_assert!(
            matches!(
                r.code,
                RejectCode::Malformed | RejectCode::BadMagic | RejectCode::Version
            ),
            "a hello refused before the identity check with {:?}",
            r.code
        );
    }
    if let Some(Ok(h)) = &out {
        // Accepted hellos are canonical.
        let n = h.world.as_str().len();
        prop_assert_eq!(&h.encode()[..], &bytes[..HELLO_FIXED_LEN + n]);
    }
    Ok(out)
}

fn identity() -> impl Strategy<Value = Identity> {
    (world_name(), 0u64..4, 0u32..6, 1u32..6).prop_map(|(world, g, rank, size)| Identity {
        world,
        generation: Generation(g),
        rank: Rank(rank),
        size,
    })
}

proptest! {
    #![proptest_config(fuzz_config(512, 1))]

    #[test]
    fn hello_arbitrary_bytes(b in proptest::collection::vec(any::<u8>(), 0..400)) {
        parse_hello(&b)?;
    }

    /// Arbitrary bytes behind a valid type byte, magic and version.
    #[test]
    fn hello_arbitrary_bytes_behind_the_magic(tail in proptest::collection::vec(any::<u8>(), 0..400)) {
        let mut b = vec![handshake::MSG_HELLO];
        b.extend_from_slice(&handshake::HANDSHAKE_MAGIC);
        b.extend_from_slice(&handshake::PROTOCOL_VERSION.to_le_bytes());
        b.extend_from_slice(&tail);
        parse_hello(&b)?;
    }

    #[test]
    fn hello_round_trip(h in hello()) {
        prop_assert_eq!(parse_hello(&h.encode())?, Some(Ok(h)));
    }

    #[test]
    fn hello_mutated_then_checked(h in hello(), edits in mutations(), local in identity()) {
        let mut b = h.encode();
        apply(&mut b, &edits);
        if let Some(Ok(h)) = parse_hello(&b)? {
            // The identity check is total too, and its refusals are typed.
            if let Err(r) = handshake::check_hello(&h, &local) {
                prop_assert!(matches!(
                    r.code,
                    RejectCode::World | RejectCode::Generation | RejectCode::Size | RejectCode::Rank
                ));
            } else {
                prop_assert!(h.from.0 < local.size && h.from > local.rank && h.to == local.rank);
            }
        }
    }

    #[test]
    fn reject_round_trip_and_arbitrary_bodies(
        code in any::<u8>(),
        detail in proptest::collection::vec(any::<u8>(), 0..=255),
        text in ".{0,300}",
    ) {
        // Any body the reader can be sent (code byte, length byte, that many
        // bytes) decodes to a typed code and a bounded detail.
        let (r, allocs) = measure(|| Reject::decode(code, &detail));
        prop_assert!(allocs.largest <= HANDSHAKE_ALLOC_BOUND);
        prop_assert_eq!(r.code, RejectCode::from_code(code));
        prop_assert!(r.detail.len() <= 3 * detail.len());
        // What this side sends: at most MAX_DETAIL_LEN bytes of detail, cut at
        // a character boundary, and it decodes back to a prefix of the text.
        let sent = Reject::new(RejectCode::from_code(code), text.clone());
        let b = sent.encode();
        prop_assert_eq!(b[0], MSG_REJECT);
        prop_assert!(usize::from(b[2]) <= MAX_DETAIL_LEN);
        prop_assert_eq!(b.len(), 3 + usize::from(b[2]));
        let back = Reject::decode(b[1], &b[3..]);
        prop_assert_eq!(back.code, sent.code);
        prop_assert!(text.starts_with(&back.detail));
        prop_assert_eq!(back.encode(), b);
    }

    #[test]
    fn challenge_round_trip(body in any::<[u8; CHALLENGE_BODY_LEN]>()) {
        let ch = Challenge::decode(&body);
        let b = ch.encode();
        prop_assert_eq!(b[0], MSG_CHALLENGE);
        prop_assert_eq!(&b[1..], &body[..]);
        let proof = handshake::encode_proof(&ch.mac);
        prop_assert_eq!(&proof[1..], &ch.mac[..]);
    }
}

// ---------------------------------------------------------------------------
// The connecting side of the handshake against a fake accepting side.

/// A byte stream whose read side is a script and whose write side is
/// recorded. With `answer_hello`, the first bytes read are a Challenge for
/// the Hello written so far (its proof computed with that secret, then
/// mutated by `challenge_edits`), then the script, so a fuzzed reply can get
/// past the proof check. `right` keeps the unmutated challenge under the
/// real secret, to tell what the outcome must be.
struct Scripted {
    script: Vec<u8>,
    at: usize,
    written: Vec<u8>,
    answer_hello: Option<Vec<u8>>,
    challenge_edits: Vec<Mutation>,
    right: Option<Vec<u8>>,
}

impl Scripted {
    fn new(script: Vec<u8>, answer_hello: Option<Vec<u8>>, challenge_edits: Vec<Mutation>) -> Scripted {
        Scripted {
            script,
            at: 0,
            written: Vec::new(),
            answer_hello,
            challenge_edits,
            right: None,
        }
    }

    /// Whether the bytes read were the right challenge followed by Accept.
    fn deserves_success(&self) -> bool {
        self.right.as_ref().is_some_and(|right| {
            self.script.starts_with(right) && self.script.get(right.len()) == Some(&MSG_ACCEPT)
        })
    }
}

fn challenge_for(written: &[u8], secret: &[u8]) -> Vec<u8> {
    let fixed: [u8; HELLO_FIXED_LEN] = written[..HELLO_FIXED_LEN].try_into().unwrap();
    let prefix = HelloPrefix::decode(&fixed).unwrap();
    let n = prefix.name_len();
    let hello = prefix
        .finish(&written[HELLO_FIXED_LEN..HELLO_FIXED_LEN + n])
        .unwrap();
    let nonce = [0x5a; NONCE_LEN];
    let t = handshake::transcript(&hello, &nonce);
    Challenge {
        nonce,
        mac: handshake::mac(secret, Role::Server, &t),
    }
    .encode()
    .to_vec()
}

impl AsyncRead for Scripted {
    fn poll_read(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let me = &mut *self;
        if let Some(secret) = me.answer_hello.take() {
            me.right = Some(challenge_for(&me.written, SECRET));
            let mut reply = challenge_for(&me.written, &secret);
            apply(&mut reply, &me.challenge_edits);
            reply.extend_from_slice(&me.script);
            me.script = reply;
        }
        let rest = &me.script[me.at..];
        let n = rest.len().min(buf.remaining());
        buf.put_slice(&rest[..n]);
        me.at += n;
        // At the end of the script: EOF.
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for Scripted {
    fn poll_write(mut self: Pin<&mut Self>, _: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        self.written.extend_from_slice(buf);
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

const SECRET: &[u8] = b"fuzz secret";

fn reply_tail() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..300),
        Just(vec![MSG_ACCEPT]),
        (any::<u8>(), proptest::collection::vec(any::<u8>(), 0..=255)).prop_map(|(code, d)| {
            let mut b = vec![MSG_REJECT, code, d.len() as u8];
            b.extend_from_slice(&d);
            b
        }),
        // A reject that declares more detail than it sends.
        (
            any::<u8>(),
            any::<u8>(),
            proptest::collection::vec(any::<u8>(), 0..8)
        )
            .prop_map(|(code, len, d)| [vec![MSG_REJECT, code, len], d].concat()),
    ]
}

/// Runs the connecting side against `stream`; checks the allocation bound,
/// that a failure is typed, and that it succeeds exactly when it should.
fn client_outcome(rt: &tokio::runtime::Runtime, stream: &mut Scripted) -> Result<(), TestCaseError> {
    let local = Identity {
        world: world("fuzz"),
        generation: Generation(3),
        rank: Rank(1),
        size: 2,
    };
    let peer: SocketAddr = "127.0.0.1:1".parse().unwrap();
    let (out, allocs) = measure(|| rt.block_on(client_handshake(stream, &local, Rank(0), SECRET, peer)));
    prop_assert!(
        allocs.largest <= HANDSHAKE_ALLOC_BOUND,
        "the connecting side allocated {} bytes at once",
        allocs.largest
    );
    match &out {
        Ok(()) => prop_assert!(stream.deserves_success(), "accepted {:02x?}", stream.script),
        Err(e) => {
            prop_assert!(!stream.deserves_success(), "refused the right reply: {e}");
            prop_assert!(
                matches!(e, Error::Refused { .. } | Error::Io { .. }),
                "untyped failure: {e:?}"
            );
            if let Error::Refused { code, detail, .. } = e {
                // The connecting side refuses with Auth or Malformed; a code
                // it was sent is decoded into the typed set.
                prop_assert!(RejectCode::from_code(code.code()) == *code);
                prop_assert!(detail.len() <= 3 * 255 + 200);
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(fuzz_config(512, 1))]

    #[test]
    fn client_handshake_any_reply(script in proptest::collection::vec(any::<u8>(), 0..400)) {
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        client_outcome(&rt, &mut Scripted::new(script, None, Vec::new()))?;
    }

    #[test]
    fn client_handshake_after_a_right_or_mutated_challenge(
        tail in reply_tail(),
        edits in proptest::option::of(mutations()),
        wrong_secret in any::<bool>(),
    ) {
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let secret = if wrong_secret { b"other".to_vec() } else { SECRET.to_vec() };
        let mut s = Scripted::new(tail, Some(secret), edits.unwrap_or_default());
        client_outcome(&rt, &mut s)?;
    }
}

// ---------------------------------------------------------------------------
// The accepting side: a real listener sent anything by a stranger.

/// A stranger's bytes: garbage, or a Hello of this world (or another), mutated,
/// followed by anything.
fn stranger_bytes(name: &'static str) -> impl Strategy<Value = Vec<u8>> {
    let own = (
        0u32..4,
        0u32..3,
        0u64..3,
        any::<[u8; NONCE_LEN]>(),
        mutations(),
        proptest::collection::vec(any::<u8>(), 0..80),
    )
        .prop_map(move |(from, to, g, nonce, edits, tail)| {
            let mut b = Hello {
                version: handshake::PROTOCOL_VERSION,
                world: world(name),
                generation: Generation(g),
                from: Rank(from),
                to: Rank(to),
                size: 2,
                nonce,
            }
            .encode();
            apply(&mut b, &edits);
            b.extend_from_slice(&tail);
            b
        });
    prop_oneof![
        1 => proptest::collection::vec(any::<u8>(), 0..300),
        3 => own,
    ]
}

#[test]
fn listener_refuses_any_stranger_and_the_member_still_joins() {
    let n = cases(128, 100);
    let rt = runtime();
    rt.block_on(async {
        init_tracing();
        let rdv = MemoryRendezvous::new();
        let name = "fuzz-listener";
        let cfg = config(name, 0, 2).with_secret(std::str::from_utf8(SECRET).unwrap());
        let rdv2 = rdv.clone();
        let join = tokio::spawn(async move { Communicator::join(cfg, &rdv2).await });
        let raw = rdv
            .get(
                &addr_key(&world(name), Generation(1), Rank(0)),
                Duration::from_secs(10),
            )
            .await
            .unwrap();
        let addr: SocketAddr = std::str::from_utf8(&raw).unwrap().parse().unwrap();

        let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
            cases: n,
            failure_persistence: None,
            ..ProptestConfig::default()
        });
        let strategy = stranger_bytes(name);
        for _ in 0..n {
            let bytes = strategy.new_tree(&mut runner).unwrap().current();
            let mut s = TcpStream::connect(addr).await.unwrap();
            // Everything, then EOF: the listener must answer (or not) and close.
            let _ = s.write_all(&bytes).await;
            let _ = s.shutdown().await;
            let closed = tokio::time::timeout(Duration::from_secs(10), async {
                let mut buf = [0u8; 512];
                let mut got = Vec::new();
                loop {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => break got,
                        Ok(k) => got.extend_from_slice(&buf[..k]),
                    }
                }
            })
            .await;
            let got = closed.unwrap_or_else(|_| panic!("the listener kept a stranger open: {bytes:02x?}"));
            // Whatever it answered is a Challenge (a well-formed Hello whose
            // sender then vanished) or a Reject carrying only its code.
            if let Some(&ty) = got.first() {
                assert!(
                    ty == MSG_CHALLENGE || ty == MSG_REJECT,
                    "answer {got:02x?} to {bytes:02x?}"
                );
                if ty == MSG_REJECT {
                    assert!(
                        got.len() >= 3 && got.len() == 3 + usize::from(got[2]),
                        "{got:02x?}"
                    );
                }
            }
        }

        // The real member joins through the same listener afterwards.
        let cfg1 = config(name, 1, 2).with_secret(std::str::from_utf8(SECRET).unwrap());
        let c1 = Communicator::join(cfg1, &rdv).await.unwrap();
        let c0 = join.await.unwrap().unwrap();
        let (s, r) = tokio::join!(c1.send(Rank(0), Tag(1), &[1u32, 2, 3]), async {
            let mut t = multiworld_tcp::Tensor::zeros(DType::U32, [3]).unwrap();
            c0.recv(Rank(1), Tag(1), &mut t).await.map(|()| t)
        });
        s.unwrap();
        assert_eq!(r.unwrap().as_slice::<u32>().unwrap(), &[1, 2, 3]);
        println!("listener: {n} strangers refused, then the member joined");
    });
}

#[test]
fn the_probe_sees_allocations() {
    let (v, a) = measure(|| vec![0u8; 10_000]);
    assert_eq!(v.len(), 10_000);
    assert!(a.count >= 1 && a.largest >= 10_000, "{a:?}");
    let (_, none) = measure(|| 1 + 1);
    assert_eq!(none.count, 0);
}
