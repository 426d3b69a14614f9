//! Fuzzing of what the store decodes from the network, on stable Rust with
//! `proptest` (`MULTIWORLD_FUZZ_CASES` sets the case count; docs/testing.md):
//!
//! - every request message decoded from arbitrary bytes and from mutated
//!   valid encodings: no panic, a typed `DecodeError` or a message no larger
//!   than its input, and valid messages round-trip;
//! - sequences of decoded requests applied to a [`WorldTable`] with small
//!   bounds and a fake clock, the way the service applies them, against a
//!   model of the table: every refusal is a typed [`StoreError`] and leaves
//!   the table as it was, every success does what the model says, and the
//!   bounds (keys, bytes, waiters, reply size) hold after every step;
//! - arbitrary header sets (method, `mw-world`, `mw-auth`) judged by the
//!   gate: no panic, and a request without a valid proof gets the same answer
//!   for a secret world as for a missing one.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::time::{Duration, Instant};

use bytes::Bytes;
use multiworld_proto::store::v1 as pb;
use multiworld_types::Secret;
use proptest::prelude::*;
use prost::Message;

use crate::auth::{StoreProof, decode_world, encode_world};
use crate::error::StoreError;
use crate::gate::{Verdict, WorldState, judge};
use crate::limits::Limits;
use crate::table::{ClientId, Completion, WaitPoll, WaiterId, WorldTable};

/// Cases of a property: `MULTIWORLD_FUZZ_CASES`, or `default`.
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

// ---------------------------------------------------------------------------
// Requests.

/// Keys from a small alphabet, so requests collide; sometimes empty or over
/// the bound.
fn key() -> impl Strategy<Value = Bytes> {
    prop_oneof![
        8 => "[abc]{1,3}".prop_map(Bytes::from),
        1 => Just(Bytes::new()),
        1 => Just(Bytes::from(vec![b'k'; 65])),
    ]
}

fn value() -> impl Strategy<Value = Bytes> {
    prop_oneof![
        6 => proptest::collection::vec(any::<u8>(), 0..24).prop_map(Bytes::from),
        2 => (-3i64..1000).prop_map(|n| Bytes::from(n.to_string())),
        1 => Just(Bytes::from(i64::MAX.to_string())),
        1 => Just(Bytes::from(vec![b'v'; 300])),
    ]
}

fn world_ref() -> impl Strategy<Value = Option<pb::WorldRef>> {
    proptest::option::of(
        ("[wx]{1,2}", 0u64..3).prop_map(|(name, generation)| pb::WorldRef { name, generation }),
    )
}

fn keys() -> impl Strategy<Value = Vec<Bytes>> {
    proptest::collection::vec(key(), 0..7)
}

fn timeout_ms() -> impl Strategy<Value = u64> {
    prop_oneof![Just(0u64), 1u64..5000, Just(u64::MAX)]
}

/// One request, as the service receives it.
#[derive(Debug, Clone)]
enum Req {
    Open(pb::OpenRequest),
    Close(pb::CloseRequest),
    Set(pb::SetRequest),
    Get(pb::GetRequest),
    TryGet(pb::TryGetRequest),
    Add(pb::AddRequest),
    Cas(pb::CompareAndSetRequest),
    Wait(pb::WaitRequest),
    Check(pb::CheckRequest),
    Delete(pb::DeleteRequest),
    MultiGet(pb::MultiGetRequest),
    MultiSet(pb::MultiSetRequest),
    Append(pb::AppendRequest),
    NumKeys(pb::NumKeysRequest),
    Ping(pb::PingRequest),
}

fn request() -> impl Strategy<Value = Req> {
    let w = world_ref;
    prop_oneof![
        ("[wx]{0,3}", any::<bool>()).prop_map(|(name, create)| Req::Open(pb::OpenRequest { name, create })),
        w().prop_map(|world| Req::Close(pb::CloseRequest { world })),
        (w(), key(), value()).prop_map(|(world, key, value)| Req::Set(pb::SetRequest { world, key, value })),
        (w(), key(), timeout_ms()).prop_map(|(world, key, timeout_ms)| Req::Get(pb::GetRequest {
            world,
            key,
            timeout_ms
        })),
        (w(), key()).prop_map(|(world, key)| Req::TryGet(pb::TryGetRequest { world, key })),
        (w(), key(), prop_oneof![-5i64..5, Just(i64::MAX), Just(i64::MIN)])
            .prop_map(|(world, key, delta)| Req::Add(pb::AddRequest { world, key, delta })),
        (w(), key(), proptest::option::of(value()), value()).prop_map(|(world, key, expected, desired)| {
            Req::Cas(pb::CompareAndSetRequest {
                world,
                key,
                expected,
                desired,
            })
        }),
        (w(), keys(), timeout_ms()).prop_map(|(world, keys, timeout_ms)| Req::Wait(pb::WaitRequest {
            world,
            keys,
            timeout_ms
        })),
        (w(), keys()).prop_map(|(world, keys)| Req::Check(pb::CheckRequest { world, keys })),
        (w(), key()).prop_map(|(world, key)| Req::Delete(pb::DeleteRequest { world, key })),
        (w(), keys(), timeout_ms()).prop_map(|(world, keys, timeout_ms)| Req::MultiGet(
            pb::MultiGetRequest {
                world,
                keys,
                timeout_ms
            }
        )),
        (w(), proptest::collection::vec((key(), value()), 0..6)).prop_map(|(world, kvs)| {
            Req::MultiSet(pb::MultiSetRequest {
                world,
                entries: kvs
                    .into_iter()
                    .map(|(key, value)| pb::KeyValue { key, value })
                    .collect(),
            })
        }),
        (w(), key(), value()).prop_map(|(world, key, value)| Req::Append(pb::AppendRequest {
            world,
            key,
            value
        })),
        w().prop_map(|world| Req::NumKeys(pb::NumKeysRequest { world })),
        w().prop_map(|world| Req::Ping(pb::PingRequest { world })),
    ]
}

impl Req {
    fn index(&self) -> u8 {
        match self {
            Req::Open(_) => 0,
            Req::Close(_) => 1,
            Req::Set(_) => 2,
            Req::Get(_) => 3,
            Req::TryGet(_) => 4,
            Req::Add(_) => 5,
            Req::Cas(_) => 6,
            Req::Wait(_) => 7,
            Req::Check(_) => 8,
            Req::Delete(_) => 9,
            Req::MultiGet(_) => 10,
            Req::MultiSet(_) => 11,
            Req::Append(_) => 12,
            Req::NumKeys(_) => 13,
            Req::Ping(_) => 14,
        }
    }

    fn encode(&self) -> Vec<u8> {
        match self {
            Req::Open(m) => m.encode_to_vec(),
            Req::Close(m) => m.encode_to_vec(),
            Req::Set(m) => m.encode_to_vec(),
            Req::Get(m) => m.encode_to_vec(),
            Req::TryGet(m) => m.encode_to_vec(),
            Req::Add(m) => m.encode_to_vec(),
            Req::Cas(m) => m.encode_to_vec(),
            Req::Wait(m) => m.encode_to_vec(),
            Req::Check(m) => m.encode_to_vec(),
            Req::Delete(m) => m.encode_to_vec(),
            Req::MultiGet(m) => m.encode_to_vec(),
            Req::MultiSet(m) => m.encode_to_vec(),
            Req::Append(m) => m.encode_to_vec(),
            Req::NumKeys(m) => m.encode_to_vec(),
            Req::Ping(m) => m.encode_to_vec(),
        }
    }

    /// Decodes `b` as request type `index` (as the gRPC layer does with a
    /// body), returning the message and its re-encoded length.
    fn decode(index: u8, b: &[u8]) -> Result<Req, prost::DecodeError> {
        Ok(match index % 15 {
            0 => Req::Open(pb::OpenRequest::decode(b)?),
            1 => Req::Close(pb::CloseRequest::decode(b)?),
            2 => Req::Set(pb::SetRequest::decode(b)?),
            3 => Req::Get(pb::GetRequest::decode(b)?),
            4 => Req::TryGet(pb::TryGetRequest::decode(b)?),
            5 => Req::Add(pb::AddRequest::decode(b)?),
            6 => Req::Cas(pb::CompareAndSetRequest::decode(b)?),
            7 => Req::Wait(pb::WaitRequest::decode(b)?),
            8 => Req::Check(pb::CheckRequest::decode(b)?),
            9 => Req::Delete(pb::DeleteRequest::decode(b)?),
            10 => Req::MultiGet(pb::MultiGetRequest::decode(b)?),
            11 => Req::MultiSet(pb::MultiSetRequest::decode(b)?),
            12 => Req::Append(pb::AppendRequest::decode(b)?),
            13 => Req::NumKeys(pb::NumKeysRequest::decode(b)?),
            _ => Req::Ping(pb::PingRequest::decode(b)?),
        })
    }
}

/// One edit of a valid encoding; positions are taken modulo the length.
#[derive(Debug, Clone)]
enum Mutation {
    FlipBit(usize, u8),
    SetByte(usize, u8),
    /// A varint of an interesting value (a length prefix lands on one).
    Varint(usize, u64),
    Truncate(usize),
    Insert(usize, Vec<u8>),
    Duplicate(usize, usize),
}

fn mutations() -> impl Strategy<Value = Vec<Mutation>> {
    let one = prop_oneof![
        (any::<usize>(), 0u8..8).prop_map(|(p, b)| Mutation::FlipBit(p, b)),
        (any::<usize>(), any::<u8>()).prop_map(|(p, v)| Mutation::SetByte(p, v)),
        (
            any::<usize>(),
            prop_oneof![
                Just(0u64),
                Just(127),
                Just(128),
                Just(u64::from(u32::MAX)),
                Just(u64::MAX),
                any::<u64>()
            ]
        )
            .prop_map(|(p, v)| Mutation::Varint(p, v)),
        any::<usize>().prop_map(Mutation::Truncate),
        (any::<usize>(), proptest::collection::vec(any::<u8>(), 1..12))
            .prop_map(|(p, v)| Mutation::Insert(p, v)),
        (any::<usize>(), 1usize..24).prop_map(|(p, n)| Mutation::Duplicate(p, n)),
    ];
    proptest::collection::vec(one, 1..4)
}

fn varint(mut v: u64) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let b = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            out.push(b);
            return out;
        }
        out.push(b | 0x80);
    }
}

fn apply(bytes: &mut Vec<u8>, edits: &[Mutation]) {
    for m in edits {
        let len = bytes.len();
        match m {
            Mutation::FlipBit(p, b) if len > 0 => bytes[p % len] ^= 1 << b,
            Mutation::SetByte(p, v) if len > 0 => bytes[p % len] = *v,
            Mutation::Varint(p, v) => {
                let at = p % (len + 1);
                bytes.splice(at..at, varint(*v));
            }
            Mutation::Truncate(n) => bytes.truncate(n % (len + 1)),
            Mutation::Insert(p, v) => {
                let at = p % (len + 1);
                bytes.splice(at..at, v.iter().copied());
            }
            Mutation::Duplicate(p, n) if len > 0 => {
                let at = p % len;
                let piece: Vec<u8> = bytes[at..(at + n).min(len)].to_vec();
                bytes.splice(at..at, piece);
            }
            _ => {}
        }
    }
}

/// Decodes arbitrary bytes as one request type: a typed error, or a message
/// that re-encodes to no more than its input (nothing is made up from a
/// declared length).
fn decode_checked(index: u8, b: &[u8]) -> Result<Option<Req>, TestCaseError> {
    match Req::decode(index, b) {
        Ok(r) => {
            prop_assert!(r.encode().len() <= b.len(), "{:?} from {} bytes", r, b.len());
            Ok(Some(r))
        }
        Err(e) => {
            prop_assert!(!e.to_string().is_empty());
            Ok(None)
        }
    }
}

proptest! {
    #![proptest_config(fuzz_config(1000))]

    #[test]
    fn requests_from_arbitrary_bytes(index in 0u8..15, b in proptest::collection::vec(any::<u8>(), 0..200)) {
        decode_checked(index, &b)?;
    }

    #[test]
    fn requests_round_trip(r in request()) {
        let b = r.encode();
        let back = Req::decode(r.index(), &b).unwrap();
        prop_assert_eq!(back.encode(), b);
    }

    #[test]
    fn requests_from_mutated_encodings(r in request(), edits in mutations(), as_other in proptest::option::of(0u8..15)) {
        let mut b = r.encode();
        apply(&mut b, &edits);
        decode_checked(as_other.unwrap_or(r.index()), &b)?;
    }
}

// ---------------------------------------------------------------------------
// Decoded requests against the table, with a model.

fn small_limits() -> Limits {
    Limits {
        max_key_len: 64,
        max_value_len: 256,
        max_keys: 12,
        max_total_bytes: 1024,
        max_keys_per_request: 5,
        max_waiters_per_client: 3,
        max_waiters_per_world: 5,
        max_reply_bytes: 300,
        default_timeout: Duration::from_millis(300),
        max_timeout: Duration::from_secs(2),
    }
}

/// The table and what it should hold.
struct Harness {
    table: WorldTable<u32>,
    model: HashMap<Bytes, Bytes>,
    now: Instant,
    next_token: u32,
    /// Pending waits by token: their keys, whether they want values, and
    /// their id.
    pending: HashMap<u32, (Vec<Bytes>, bool, WaiterId)>,
    closed: bool,
}

impl Harness {
    fn new() -> Harness {
        Harness {
            table: WorldTable::new("w", small_limits()),
            model: HashMap::new(),
            now: Instant::now(),
            next_token: 0,
            pending: HashMap::new(),
            closed: false,
        }
    }

    fn bytes_of(model: &HashMap<Bytes, Bytes>) -> usize {
        model.iter().map(|(k, v)| k.len() + v.len()).sum()
    }

    /// The table agrees with the model and every bound holds.
    fn check(&self) -> Result<(), TestCaseError> {
        let l = self.table.limits();
        let s = self.table.stats();
        prop_assert_eq!(s.keys, self.model.len());
        prop_assert_eq!(s.bytes, Self::bytes_of(&self.model));
        prop_assert!(s.keys <= l.max_keys && s.bytes <= l.max_total_bytes);
        prop_assert!(s.waiters <= l.max_waiters_per_world);
        prop_assert_eq!(s.waiters, self.pending.len());
        if !self.closed {
            for (k, v) in &self.model {
                let got = self.table.try_get(k).unwrap();
                prop_assert_eq!(got.as_ref(), Some(v));
            }
        }
        Ok(())
    }

    /// Checks completions handed back by an operation.
    fn completed(&mut self, done: Vec<Completion<u32>>) -> Result<(), TestCaseError> {
        for c in done {
            let Some((keys, want_values, _)) = self.pending.remove(&c.token) else {
                return Err(TestCaseError::fail(format!(
                    "unknown or repeated token {}",
                    c.token
                )));
            };
            match c.result {
                Ok(values) if want_values => {
                    prop_assert_eq!(values.len(), keys.len());
                    let size: usize = values.iter().map(|v| v.len()).sum();
                    prop_assert!(size <= self.table.limits().max_reply_bytes);
                    for (k, v) in keys.iter().zip(&values) {
                        prop_assert!(self.model.get(k) == Some(v), "{:?}: {:?}", k, v);
                    }
                }
                Ok(values) => prop_assert!(values.is_empty()),
                Err(e) => prop_assert!(
                    matches!(
                        e,
                        StoreError::Timeout { .. }
                            | StoreError::Closed { .. }
                            | StoreError::LimitExceeded { .. }
                    ),
                    "wait ended with {:?}",
                    e
                ),
            }
        }
        Ok(())
    }

    fn refused(&self, e: &StoreError) -> Result<(), TestCaseError> {
        prop_assert!(
            matches!(
                e,
                StoreError::InvalidArgument(_) | StoreError::LimitExceeded { .. } | StoreError::Closed { .. }
            ),
            "unexpected refusal {e:?}"
        );
        if matches!(e, StoreError::Closed { .. }) {
            prop_assert!(self.closed);
        }
        Ok(())
    }

    fn wait(&mut self, keys: Vec<Bytes>, want_values: bool, timeout_ms: u64) -> Result<(), TestCaseError> {
        let token = self.next_token;
        self.next_token += 1;
        let timeout = self.table.limits().timeout(timeout_ms);
        prop_assert!(timeout <= self.table.limits().max_timeout);
        let client = ClientId(u64::from(token % 2));
        match self
            .table
            .wait(client, keys.clone(), want_values, self.now, timeout, token)
        {
            Ok(WaitPoll::Ready(values, t)) => {
                prop_assert_eq!(t, token);
                prop_assert!(keys.iter().all(|k| self.model.contains_key(k)));
                if want_values {
                    prop_assert_eq!(values.len(), keys.len());
                    for (k, v) in keys.iter().zip(&values) {
                        prop_assert_eq!(self.model.get(k), Some(v));
                    }
                } else {
                    prop_assert!(values.is_empty());
                }
            }
            Ok(WaitPoll::Pending(id)) => {
                prop_assert!(!keys.iter().all(|k| self.model.contains_key(k)));
                self.pending.insert(token, (keys, want_values, id));
            }
            Err(e) => self.refused(&e)?,
        }
        Ok(())
    }

    /// Applies one request the way the service does (the world was
    /// resolved already) and checks the outcome against the model.
    fn apply(&mut self, r: Req) -> Result<(), TestCaseError> {
        match r {
            Req::Open(_) | Req::Ping(_) => {}
            Req::Close(_) => {
                let done = self.table.close();
                self.closed = true;
                self.model.clear();
                prop_assert_eq!(done.len(), self.pending.len());
                self.completed(done)?;
            }
            Req::Set(m) => match self.table.set(m.key.clone(), m.value.clone()) {
                Ok(done) => {
                    self.model.insert(m.key, m.value);
                    self.completed(done)?;
                }
                Err(e) => self.refused(&e)?,
            },
            Req::Get(m) => self.wait(vec![m.key], true, m.timeout_ms)?,
            Req::TryGet(m) => match self.table.try_get(&m.key) {
                Ok(v) => prop_assert_eq!(v.as_ref(), self.model.get(&m.key)),
                Err(e) => self.refused(&e)?,
            },
            Req::Add(m) => match self.table.add(m.key.clone(), m.delta) {
                Ok((n, done)) => {
                    let before = match self.model.get(&m.key) {
                        None => 0,
                        Some(v) => std::str::from_utf8(v).unwrap().parse::<i64>().unwrap(),
                    };
                    prop_assert_eq!(Some(n), before.checked_add(m.delta));
                    self.model.insert(m.key, Bytes::from(n.to_string()));
                    self.completed(done)?;
                }
                Err(e) => self.refused(&e)?,
            },
            Req::Cas(m) => {
                match self
                    .table
                    .compare_and_set(m.key.clone(), m.expected.as_deref(), m.desired.clone())
                {
                    Ok((outcome, done)) => {
                        let current = self.model.get(&m.key);
                        prop_assert_eq!(outcome.swapped, current.map(|v| &v[..]) == m.expected.as_deref());
                        if outcome.swapped {
                            self.model.insert(m.key, m.desired);
                        } else {
                            prop_assert_eq!(outcome.current.as_ref(), current);
                        }
                        self.completed(done)?;
                    }
                    Err(e) => self.refused(&e)?,
                }
            }
            Req::Wait(m) => self.wait(m.keys, false, m.timeout_ms)?,
            Req::Check(m) => match self.table.check(&m.keys) {
                Ok(all) => prop_assert_eq!(all, m.keys.iter().all(|k| self.model.contains_key(k))),
                Err(e) => self.refused(&e)?,
            },
            Req::Delete(m) => match self.table.delete(&m.key) {
                Ok(existed) => prop_assert_eq!(existed, self.model.remove(&m.key).is_some()),
                Err(e) => self.refused(&e)?,
            },
            Req::MultiGet(m) => self.wait(m.keys, true, m.timeout_ms)?,
            Req::MultiSet(m) => {
                let entries: Vec<(Bytes, Bytes)> =
                    m.entries.into_iter().map(|kv| (kv.key, kv.value)).collect();
                match self.table.multi_set(entries.clone()) {
                    Ok(done) => {
                        self.model.extend(entries);
                        self.completed(done)?;
                    }
                    Err(e) => self.refused(&e)?,
                }
            }
            Req::Append(m) => match self.table.append(m.key.clone(), &m.value) {
                Ok((len, done)) => {
                    let mut v = self.model.get(&m.key).map_or_else(Vec::new, |v| v.to_vec());
                    v.extend_from_slice(&m.value);
                    prop_assert_eq!(len, v.len());
                    self.model.insert(m.key, Bytes::from(v));
                    self.completed(done)?;
                }
                Err(e) => self.refused(&e)?,
            },
            Req::NumKeys(_) => match self.table.num_keys() {
                Ok(n) => prop_assert_eq!(n, self.model.len()),
                Err(e) => self.refused(&e)?,
            },
        }
        Ok(())
    }

    fn advance(&mut self, ms: u64) -> Result<(), TestCaseError> {
        self.now += Duration::from_millis(ms);
        let done = self.table.expire(self.now);
        for c in &done {
            prop_assert!(
                matches!(c.result, Err(StoreError::Timeout { .. })),
                "{:?}",
                c.result
            );
        }
        self.completed(done)
    }
}

/// One step of a session: a request (valid, mutated, or arbitrary bytes
/// decoded as some request type), the clock moving, or a wait cancelled.
#[derive(Debug, Clone)]
enum Step {
    Valid(Req),
    Mutated(Req, Vec<Mutation>),
    Bytes(u8, Vec<u8>),
    Advance(u64),
    /// Cancels the i-th pending wait (in token order), as a dropped request does.
    Cancel(usize),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        8 => request().prop_map(Step::Valid),
        4 => (request(), mutations()).prop_map(|(r, m)| Step::Mutated(r, m)),
        1 => (0u8..15, proptest::collection::vec(any::<u8>(), 0..64)).prop_map(|(i, b)| Step::Bytes(i, b)),
        2 => (0u64..3000).prop_map(Step::Advance),
        1 => any::<usize>().prop_map(Step::Cancel),
    ]
}

proptest! {
    #![proptest_config(fuzz_config(256))]

    #[test]
    fn decoded_requests_against_the_table(steps in proptest::collection::vec(step(), 1..40)) {
        let mut h = Harness::new();
        for s in steps {
            match s {
                Step::Valid(r) => h.apply(r)?,
                Step::Mutated(r, edits) => {
                    let mut b = r.encode();
                    apply(&mut b, &edits);
                    if let Some(r) = decode_checked(r.index(), &b)? {
                        h.apply(r)?;
                    }
                }
                Step::Bytes(i, b) => {
                    if let Some(r) = decode_checked(i, &b)? {
                        h.apply(r)?;
                    }
                }
                Step::Advance(ms) => h.advance(ms)?,
                Step::Cancel(i) => {
                    let mut tokens: Vec<u32> = h.pending.keys().copied().collect();
                    tokens.sort();
                    if let Some(&t) = tokens.get(i % tokens.len().max(1)) {
                        let (_, _, id) = h.pending.remove(&t).unwrap();
                        prop_assert_eq!(h.table.cancel(id), Some(t));
                        prop_assert_eq!(h.table.cancel(id), None);
                    }
                }
            }
            h.check()?;
        }
        // Every wait ends by the longest timeout.
        h.advance(h.table.limits().max_timeout.as_millis() as u64 + 1)?;
        prop_assert!(h.pending.is_empty());
        h.check()?;
    }
}

// ---------------------------------------------------------------------------
// The gate.

/// The methods the gate knows, plus an empty and an unknown one.
fn methods() -> Vec<&'static str> {
    let mut m = crate::gate::WORLD_METHODS.to_vec();
    m.extend(["", "Bogus"]);
    m
}

/// An `mw-world` header value: hex of a name, or garbage.
fn world_header() -> impl Strategy<Value = Option<Vec<u8>>> {
    proptest::option::of(prop_oneof![
        "[wx]{1,3}".prop_map(|w| encode_world(&w).into_bytes()),
        ".{1,20}".prop_map(|w| encode_world(&w).into_bytes()),
        proptest::collection::vec(any::<u8>(), 0..40),
        "[0-9a-fA-F]{0,600}".prop_map(String::into_bytes),
    ])
}

/// An `mw-auth` value: a right proof for some world under some secret, a
/// mutated one, or garbage.
fn proof_header() -> impl Strategy<Value = Option<String>> {
    proptest::option::of(prop_oneof![
        ("[wx]{1,3}", any::<bool>())
            .prop_map(|(w, right)| { Secret::new(if right { "world" } else { "server" }).proof(&w) }),
        ("[wx]{1,3}", any::<usize>(), any::<char>()).prop_map(|(w, at, c)| {
            let mut p: Vec<char> = Secret::new("world").proof(&w).chars().collect();
            let at = at % p.len();
            p[at] = c;
            p.into_iter().collect()
        }),
        ".{0,120}",
        "v1\\.[0-9a-f]{0,40}\\.[0-9a-f]{0,70}",
    ])
}

fn verdict_kind(v: &Verdict) -> String {
    match v {
        Verdict::Admit => "admit".into(),
        Verdict::PreAuth => "pre-auth".into(),
        Verdict::Refuse(e) => format!("{}: {e}", e.kind()),
    }
}

proptest! {
    #![proptest_config(fuzz_config(1000))]

    #[test]
    fn the_gate_judges_any_header_set(
        method in prop_oneof![proptest::sample::select(methods()).prop_map(String::from), ".{0,20}"],
        world in world_header(),
        proof in proof_header(),
        max_name_len in prop_oneof![Just(256usize), 0usize..8],
    ) {
        let world_secret = Secret::new("world");
        let server_secret = Secret::new("server");
        // What the front does with the headers.
        let name = match world.as_deref().map(|v| decode_world(v, max_name_len)) {
            None => None,
            Some(Ok(n)) => {
                prop_assert!(!n.is_empty() && n.len() <= max_name_len);
                prop_assert_eq!(decode_world(encode_world(&n).as_bytes(), max_name_len), Ok(n.clone()));
                Some(n)
            }
            // Refused as an invalid argument before the gate.
            Some(Err(why)) => {
                prop_assert!(!why.is_empty());
                return Ok(());
            }
        };
        let proof = proof.as_deref();
        let w = name.as_deref();
        let open_secret = judge(&method, w, proof, WorldState::Open(Some(&world_secret)), None);
        let open_public = judge(&method, w, proof, WorldState::Open(None), None);
        let missing_judged = judge(&method, w, proof, WorldState::Missing, Some(&server_secret));
        let missing = judge(&method, w, proof, WorldState::Missing, None);
        let Some(w) = w else {
            // No world: the same answer whatever is open.
            for v in [&open_secret, &open_public, &missing_judged] {
                prop_assert_eq!(verdict_kind(v), verdict_kind(&missing));
            }
            return Ok(());
        };
        prop_assert!(matches!(open_public, Verdict::Admit));
        let proves_world = world_secret.verify(w, proof).is_ok();
        let proves_server = server_secret.verify(w, proof).is_ok();
        prop_assert_eq!(matches!(open_secret, Verdict::Admit), proves_world);
        if !proves_world && !proves_server {
            // A stranger cannot tell a secret world from a missing one.
            prop_assert_eq!(verdict_kind(&open_secret), verdict_kind(&missing_judged));
            prop_assert!(
                matches!(open_secret, Verdict::Refuse(StoreError::Unauthenticated { .. })),
                "{}",
                verdict_kind(&open_secret)
            );
        }
        if proves_server {
            prop_assert!(
                matches!(missing_judged, Verdict::Admit | Verdict::Refuse(StoreError::WorldNotFound { .. })),
                "{}",
                verdict_kind(&missing_judged)
            );
        }
        prop_assert!(!matches!(missing, Verdict::Admit));
    }

    #[test]
    fn proofs_of_any_shape_are_checked_without_panicking(proof in ".{0,200}", w in ".{0,20}") {
        prop_assert!(Secret::new("world").verify(&w, Some(&proof)).is_err());
    }
}

/// Found by `decoded_requests_against_the_table` in the long run: a waiter
/// on a key that a multi-set names twice is woken with the first of the two
/// values, which the batch (atomic to every reader) overwrote: the table
/// wakes waiters only after storing the whole batch.
#[test]
fn multi_set_with_duplicate_keys_wakes_waiters_with_the_final_value() {
    let mut t: WorldTable<u32> = WorldTable::new("w", Limits::default());
    let now = Instant::now();
    let WaitPoll::Pending(_) = t
        .wait(
            ClientId(1),
            vec![Bytes::from("b")],
            true,
            now,
            Duration::from_secs(1),
            7,
        )
        .unwrap()
    else {
        panic!("nothing set yet")
    };
    let done = t
        .multi_set(vec![
            (Bytes::from("b"), Bytes::from("first")),
            (Bytes::from("b"), Bytes::from("last")),
        ])
        .unwrap();
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].result.as_ref().unwrap(), &vec![Bytes::from("last")]);
}
