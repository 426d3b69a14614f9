//! The connection handshake, pure and I/O-free: message codecs, the identity check
//! and the HMAC-SHA256 challenge-response. The connecting side (the higher rank)
//! sends [`Hello`]; the accepting side checks it against its own [`Identity`]
//! ([`check_hello`]) and answers with a [`Challenge`] (its nonce and its own proof)
//! or a [`Reject`]; the connecting side verifies the server's proof and answers with
//! its proof ([`encode_proof`]); the accepting side verifies it and sends `Accept` or `Reject`.
//! Both proofs are HMACs keyed by the world secret over a [`transcript`] that binds
//! both nonces, the protocol version, world name, generation, both ranks and the
//! world size, with distinct role labels, so the secret never crosses the wire and
//! a proof cannot be replayed or reflected. Proofs are compared in constant time.
//! Every length read from the network is bounded before anything is allocated.
//!
//! Wire format (little-endian; the first byte of every message is its type):
//!
//! | message | layout |
//! |---|---|
//! | Hello (1) | magic `b"MWHS"`, version u16, generation u64, from u32, to u32, size u32, nonce \[32\], name_len u16, name |
//! | Challenge (2) | nonce \[32\], server mac \[32\] |
//! | Proof (3) | client mac \[32\] |
//! | Accept (4) | (empty) |
//! | Reject (5) | code u8, detail_len u8, detail (UTF-8) |

use std::fmt;

use hmac::{Hmac, Mac};
use sha2::Sha256;
use subtle::ConstantTimeEq;

use multiworld_types::{Generation, Identity, MAX_WORLD_NAME_LEN, Rank, WorldName};

/// Handshake magic, right after the Hello type byte.
pub const HANDSHAKE_MAGIC: [u8; 4] = *b"MWHS";
/// Version of the TCP protocol (handshake and framing).
pub const PROTOCOL_VERSION: u16 = 2;
/// Length of a nonce in bytes.
pub const NONCE_LEN: usize = 32;
/// Length of a proof (HMAC-SHA256) in bytes.
pub const MAC_LEN: usize = 32;
/// Longest reject detail sent, in bytes (a received one may be up to 255,
/// all its `u8` length allows).
pub const MAX_DETAIL_LEN: usize = 200;

/// Message type: Hello.
pub const MSG_HELLO: u8 = 1;
/// Message type: Challenge.
pub const MSG_CHALLENGE: u8 = 2;
/// Message type: Proof.
pub const MSG_PROOF: u8 = 3;
/// Message type: Accept.
pub const MSG_ACCEPT: u8 = 4;
/// Message type: Reject.
pub const MSG_REJECT: u8 = 5;

/// Length of a Hello up to (excluding) the name.
pub const HELLO_FIXED_LEN: usize = 1 + 4 + 2 + 8 + 4 + 4 + 4 + NONCE_LEN + 2;
/// Length of a Challenge after its type byte.
pub const CHALLENGE_BODY_LEN: usize = NONCE_LEN + MAC_LEN;
/// Length of a Proof after its type byte.
pub const PROOF_BODY_LEN: usize = MAC_LEN;

type HmacSha256 = Hmac<Sha256>;

/// Why a connection was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RejectCode {
    /// Bytes that are not a handshake message.
    Malformed,
    /// Wrong handshake magic.
    BadMagic,
    /// Unsupported protocol version.
    Version,
    /// Different world name.
    World,
    /// Different world generation.
    Generation,
    /// Rank out of range, addressed to another rank, or against the connect rule.
    Rank,
    /// Different world size.
    Size,
    /// The proof of the secret was wrong.
    Auth,
    /// This rank is already connected.
    Duplicate,
    /// The handshake did not finish in time.
    Timeout,
    /// Too many handshakes in progress.
    Busy,
}

impl RejectCode {
    /// Wire code.
    pub const fn code(self) -> u8 {
        match self {
            RejectCode::Malformed => 1,
            RejectCode::BadMagic => 2,
            RejectCode::Version => 3,
            RejectCode::World => 4,
            RejectCode::Generation => 5,
            RejectCode::Rank => 6,
            RejectCode::Size => 7,
            RejectCode::Auth => 8,
            RejectCode::Duplicate => 9,
            RejectCode::Timeout => 10,
            RejectCode::Busy => 11,
        }
    }

    /// Decodes a wire code; unknown codes read as [`RejectCode::Malformed`].
    pub const fn from_code(c: u8) -> RejectCode {
        match c {
            2 => RejectCode::BadMagic,
            3 => RejectCode::Version,
            4 => RejectCode::World,
            5 => RejectCode::Generation,
            6 => RejectCode::Rank,
            7 => RejectCode::Size,
            8 => RejectCode::Auth,
            9 => RejectCode::Duplicate,
            10 => RejectCode::Timeout,
            11 => RejectCode::Busy,
            _ => RejectCode::Malformed,
        }
    }
}

impl fmt::Display for RejectCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RejectCode::Malformed => "malformed handshake",
            RejectCode::BadMagic => "bad magic",
            RejectCode::Version => "protocol version mismatch",
            RejectCode::World => "world name mismatch",
            RejectCode::Generation => "generation mismatch",
            RejectCode::Rank => "rank mismatch",
            RejectCode::Size => "world size mismatch",
            RejectCode::Auth => "authentication failed",
            RejectCode::Duplicate => "rank already connected",
            RejectCode::Timeout => "handshake timed out",
            RejectCode::Busy => "too many pending handshakes",
        })
    }
}

/// A refusal with its reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reject {
    /// Machine-readable reason.
    pub code: RejectCode,
    /// Human-readable detail (at most [`MAX_DETAIL_LEN`] bytes on the wire).
    pub detail: String,
}

impl Reject {
    /// A refusal.
    pub fn new(code: RejectCode, detail: impl Into<String>) -> Self {
        Reject {
            code,
            detail: detail.into(),
        }
    }

    /// What may be told to the other end, which has not proven the secret
    /// (refusals are sent before it has, or because it failed to): the code
    /// alone, so a stranger learns nothing of this world's name, generation,
    /// size or ranks. The full detail stays in the refusing side's log.
    pub fn for_the_wire(&self) -> Reject {
        Reject::new(self.code, "details in the refusing side's log")
    }

    /// Encodes the message, truncating the detail at a character boundary.
    pub fn encode(&self) -> Vec<u8> {
        let mut end = self.detail.len().min(MAX_DETAIL_LEN);
        while !self.detail.is_char_boundary(end) {
            end -= 1;
        }
        let detail = &self.detail.as_bytes()[..end];
        let mut b = Vec::with_capacity(3 + detail.len());
        b.push(MSG_REJECT);
        b.push(self.code.code());
        b.push(detail.len() as u8); // end <= MAX_DETAIL_LEN < 256
        b.extend_from_slice(detail);
        b
    }

    /// Decodes the body after the type byte, code and length byte were read.
    pub fn decode(code: u8, detail: &[u8]) -> Self {
        Reject {
            code: RejectCode::from_code(code),
            detail: String::from_utf8_lossy(detail).into_owned(),
        }
    }
}

impl fmt::Display for Reject {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.code, self.detail)
    }
}

/// The first message, from the connecting (higher) rank to the accepting one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// Protocol version.
    pub version: u16,
    /// World name.
    pub world: WorldName,
    /// World generation.
    pub generation: Generation,
    /// Sender's rank.
    pub from: Rank,
    /// Rank the sender believes it is talking to.
    pub to: Rank,
    /// World size.
    pub size: u32,
    /// Sender's fresh random nonce.
    pub nonce: [u8; NONCE_LEN],
}

impl Hello {
    /// The Hello `local` sends to `to`.
    pub fn new(local: &Identity, to: Rank, nonce: [u8; NONCE_LEN]) -> Self {
        Hello {
            version: PROTOCOL_VERSION,
            world: local.world.clone(),
            generation: local.generation,
            from: local.rank,
            to,
            size: local.size,
            nonce,
        }
    }

    /// Encodes the message.
    pub fn encode(&self) -> Vec<u8> {
        let name = self.world.as_str().as_bytes();
        let mut b = Vec::with_capacity(HELLO_FIXED_LEN + name.len());
        b.push(MSG_HELLO);
        b.extend_from_slice(&HANDSHAKE_MAGIC);
        b.extend_from_slice(&self.version.to_le_bytes());
        b.extend_from_slice(&self.generation.0.to_le_bytes());
        b.extend_from_slice(&self.from.0.to_le_bytes());
        b.extend_from_slice(&self.to.0.to_le_bytes());
        b.extend_from_slice(&self.size.to_le_bytes());
        b.extend_from_slice(&self.nonce);
        // WorldName guarantees len <= MAX_WORLD_NAME_LEN < u16::MAX.
        b.extend_from_slice(&(name.len() as u16).to_le_bytes());
        b.extend_from_slice(name);
        b
    }
}

/// The fixed part of a Hello, decoded; tells how long the name is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HelloPrefix {
    generation: Generation,
    from: Rank,
    to: Rank,
    size: u32,
    nonce: [u8; NONCE_LEN],
    name_len: usize,
}

impl HelloPrefix {
    /// Decodes the fixed part. Type byte, magic and version are checked first (so
    /// random bytes and future versions are told apart), then the name length is
    /// bounded by [`MAX_WORLD_NAME_LEN`] before the caller reads the name.
    pub fn decode(b: &[u8; HELLO_FIXED_LEN]) -> Result<HelloPrefix, Reject> {
        if b[0] != MSG_HELLO {
            return Err(Reject::new(
                RejectCode::Malformed,
                format!("expected a hello message, got type byte {:#04x}", b[0]),
            ));
        }
        if b[1..5] != HANDSHAKE_MAGIC {
            return Err(Reject::new(
                RejectCode::BadMagic,
                format!("bad handshake magic {:02x?}", &b[1..5]),
            ));
        }
        let version = u16::from_le_bytes([b[5], b[6]]);
        if version != PROTOCOL_VERSION {
            return Err(Reject::new(
                RejectCode::Version,
                format!("peer speaks version {version}, this side {PROTOCOL_VERSION}"),
            ));
        }
        let mut at = 7;
        let mut take = move |n: usize| {
            let s = &b[at..at + n];
            at += n;
            s
        };
        let mut g = [0u8; 8];
        g.copy_from_slice(take(8));
        let mut r = [0u8; 4];
        r.copy_from_slice(take(4));
        let from = Rank(u32::from_le_bytes(r));
        r.copy_from_slice(take(4));
        let to = Rank(u32::from_le_bytes(r));
        r.copy_from_slice(take(4));
        let size = u32::from_le_bytes(r);
        let mut nonce = [0u8; NONCE_LEN];
        nonce.copy_from_slice(take(NONCE_LEN));
        let l = take(2);
        let name_len = usize::from(u16::from_le_bytes([l[0], l[1]]));
        if name_len == 0 || name_len > MAX_WORLD_NAME_LEN {
            return Err(Reject::new(
                RejectCode::Malformed,
                format!("declared world name length {name_len} is outside 1..={MAX_WORLD_NAME_LEN}"),
            ));
        }
        Ok(HelloPrefix {
            generation: Generation(u64::from_le_bytes(g)),
            from,
            to,
            size,
            nonce,
            name_len,
        })
    }

    /// Bytes of world name that follow the fixed part.
    pub fn name_len(&self) -> usize {
        self.name_len
    }

    /// Completes the Hello with its name bytes.
    pub fn finish(self, name: &[u8]) -> Result<Hello, Reject> {
        if name.len() != self.name_len {
            return Err(Reject::new(RejectCode::Malformed, "world name length"));
        }
        let world = std::str::from_utf8(name)
            .ok()
            .and_then(|s| WorldName::new(s).ok())
            .ok_or_else(|| Reject::new(RejectCode::Malformed, "world name is not valid"))?;
        Ok(Hello {
            version: PROTOCOL_VERSION,
            world,
            generation: self.generation,
            from: self.from,
            to: self.to,
            size: self.size,
            nonce: self.nonce,
        })
    }
}

/// Checks a Hello against the accepting side's identity. The connect rule is that
/// the higher rank connects to the lower one, so `from` must be above `local.rank`.
pub fn check_hello(h: &Hello, local: &Identity) -> Result<(), Reject> {
    if h.world != local.world {
        return Err(Reject::new(
            RejectCode::World,
            format!("peer is in world {:?}, this is {:?}", h.world, local.world),
        ));
    }
    if h.generation != local.generation {
        return Err(Reject::new(
            RejectCode::Generation,
            format!(
                "peer is in generation {}, this is {}",
                h.generation, local.generation
            ),
        ));
    }
    if h.size != local.size {
        return Err(Reject::new(
            RejectCode::Size,
            format!("peer says world size {}, this is {}", h.size, local.size),
        ));
    }
    if h.to != local.rank {
        return Err(Reject::new(
            RejectCode::Rank,
            format!("peer wants rank {}, this is rank {}", h.to, local.rank),
        ));
    }
    if h.from.0 >= local.size || h.from <= local.rank {
        return Err(Reject::new(
            RejectCode::Rank,
            format!(
                "rank {} may not connect to rank {} in a world of {} (higher ranks connect to lower ones)",
                h.from, local.rank, local.size
            ),
        ));
    }
    Ok(())
}

/// The server's answer to a good Hello: its nonce and its proof.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Challenge {
    /// Server's fresh nonce.
    pub nonce: [u8; NONCE_LEN],
    /// Server's proof: [`mac`] with [`Role::Server`].
    pub mac: [u8; MAC_LEN],
}

impl Challenge {
    /// Encodes the message (with type byte).
    pub fn encode(&self) -> [u8; 1 + CHALLENGE_BODY_LEN] {
        let mut b = [0u8; 1 + CHALLENGE_BODY_LEN];
        b[0] = MSG_CHALLENGE;
        b[1..1 + NONCE_LEN].copy_from_slice(&self.nonce);
        b[1 + NONCE_LEN..].copy_from_slice(&self.mac);
        b
    }

    /// Decodes the body after the type byte.
    pub fn decode(b: &[u8; CHALLENGE_BODY_LEN]) -> Self {
        let mut nonce = [0u8; NONCE_LEN];
        nonce.copy_from_slice(&b[..NONCE_LEN]);
        let mut mac = [0u8; MAC_LEN];
        mac.copy_from_slice(&b[NONCE_LEN..]);
        Challenge { nonce, mac }
    }
}

/// Encodes the client's Proof message (with type byte).
pub fn encode_proof(mac: &[u8; MAC_LEN]) -> [u8; 1 + PROOF_BODY_LEN] {
    let mut b = [0u8; 1 + PROOF_BODY_LEN];
    b[0] = MSG_PROOF;
    b[1..].copy_from_slice(mac);
    b
}

/// Which side computes a proof; part of the MAC input so one side's proof is never
/// valid as the other's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The accepting (lower) rank.
    Server,
    /// The connecting (higher) rank.
    Client,
}

/// The canonical bytes both sides authenticate: protocol version, world name,
/// generation, both ranks, world size and both nonces.
pub fn transcript(hello: &Hello, server_nonce: &[u8; NONCE_LEN]) -> Vec<u8> {
    let name = hello.world.as_str().as_bytes();
    let mut t = Vec::with_capacity(64 + name.len() + 2 * NONCE_LEN);
    t.extend_from_slice(b"multiworld-tcp handshake\0");
    t.extend_from_slice(&hello.version.to_le_bytes());
    t.extend_from_slice(&(name.len() as u16).to_le_bytes());
    t.extend_from_slice(name);
    t.extend_from_slice(&hello.generation.0.to_le_bytes());
    t.extend_from_slice(&hello.from.0.to_le_bytes());
    t.extend_from_slice(&hello.to.0.to_le_bytes());
    t.extend_from_slice(&hello.size.to_le_bytes());
    t.extend_from_slice(&hello.nonce);
    t.extend_from_slice(server_nonce);
    t
}

/// HMAC-SHA256 of the role label and the transcript, keyed by the world secret
/// (empty when the world has none: then the handshake still binds identities but
/// proves nothing).
pub fn mac(secret: &[u8], role: Role, transcript: &[u8]) -> [u8; MAC_LEN] {
    let mut m = match <HmacSha256 as Mac>::new_from_slice(secret) {
        Ok(m) => m,
        // HMAC accepts keys of any length; this arm is unreachable but keeps the
        // function panic-free.
        Err(_) => return [0u8; MAC_LEN],
    };
    m.update(match role {
        Role::Server => b"server\0",
        Role::Client => b"client\0",
    });
    m.update(transcript);
    m.finalize().into_bytes().into()
}

/// Constant-time check of a proof.
pub fn verify(secret: &[u8], role: Role, transcript: &[u8], proof: &[u8; MAC_LEN]) -> bool {
    let expected = mac(secret, role, transcript);
    bool::from(expected.ct_eq(proof))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn ident(rank: u32) -> Identity {
        Identity {
            world: WorldName::new("w").unwrap(),
            generation: Generation(5),
            rank: Rank(rank),
            size: 4,
        }
    }

    fn parse(bytes: &[u8]) -> Result<Hello, Reject> {
        let fixed: [u8; HELLO_FIXED_LEN] = bytes[..HELLO_FIXED_LEN].try_into().unwrap();
        let p = HelloPrefix::decode(&fixed)?;
        let n = p.name_len();
        p.finish(&bytes[HELLO_FIXED_LEN..HELLO_FIXED_LEN + n])
    }

    #[test]
    fn hello_roundtrip_and_check() {
        let h = Hello::new(&ident(3), Rank(1), [7; NONCE_LEN]);
        let back = parse(&h.encode()).unwrap();
        assert_eq!(back, h);
        check_hello(&back, &ident(1)).unwrap();
    }

    #[test]
    fn check_refuses_each_mismatch() {
        let base = Hello::new(&ident(3), Rank(1), [0; NONCE_LEN]);
        let local = ident(1);
        let code = |h: &Hello| check_hello(h, &local).unwrap_err().code;

        let mut h = base.clone();
        h.world = WorldName::new("other").unwrap();
        assert_eq!(code(&h), RejectCode::World);
        let mut h = base.clone();
        h.generation = Generation(4);
        assert_eq!(code(&h), RejectCode::Generation);
        let mut h = base.clone();
        h.size = 3;
        assert_eq!(code(&h), RejectCode::Size);
        let mut h = base.clone();
        h.to = Rank(2);
        assert_eq!(code(&h), RejectCode::Rank);
        let mut h = base.clone();
        h.from = Rank(0);
        assert_eq!(code(&h), RejectCode::Rank, "lower rank must not connect");
        let mut h = base.clone();
        h.from = Rank(1);
        assert_eq!(code(&h), RejectCode::Rank, "self");
        let mut h = base;
        h.from = Rank(4);
        assert_eq!(code(&h), RejectCode::Rank, "out of range");
    }

    #[test]
    fn prefix_refuses_garbage_and_long_names() {
        let good = Hello::new(&ident(3), Rank(1), [0; NONCE_LEN]).encode();
        let mut b = good.clone();
        b[0] = 0x47; // 'G', e.g. an HTTP request
        assert_eq!(parse(&b).unwrap_err().code, RejectCode::Malformed);
        let mut b = good.clone();
        b[2] ^= 0xff;
        assert_eq!(parse(&b).unwrap_err().code, RejectCode::BadMagic);
        let mut b = good.clone();
        b[5] = 9;
        assert_eq!(parse(&b).unwrap_err().code, RejectCode::Version);
        let mut b = good.clone();
        b[HELLO_FIXED_LEN - 2..HELLO_FIXED_LEN].copy_from_slice(&u16::MAX.to_le_bytes());
        let fixed: [u8; HELLO_FIXED_LEN] = b[..HELLO_FIXED_LEN].try_into().unwrap();
        assert_eq!(
            HelloPrefix::decode(&fixed).unwrap_err().code,
            RejectCode::Malformed
        );
        let mut b = good;
        let last = b.len() - 1;
        b[last] = 0xff; // invalid UTF-8 name
        assert_eq!(parse(&b).unwrap_err().code, RejectCode::Malformed);
    }

    #[test]
    fn proofs() {
        let h = Hello::new(&ident(3), Rank(1), [1; NONCE_LEN]);
        let t = transcript(&h, &[2; NONCE_LEN]);
        let s = b"secret";
        let server = mac(s, Role::Server, &t);
        let client = mac(s, Role::Client, &t);
        assert_ne!(server, client, "role separation");
        assert!(verify(s, Role::Server, &t, &server));
        assert!(verify(s, Role::Client, &t, &client));
        assert!(!verify(s, Role::Client, &t, &server), "no reflection");
        assert!(!verify(b"wrong", Role::Client, &t, &client));
        let t2 = transcript(&h, &[3; NONCE_LEN]);
        assert!(!verify(s, Role::Client, &t2, &client), "no replay");
        let mut h2 = h.clone();
        h2.generation = Generation(6);
        assert!(!verify(
            s,
            Role::Client,
            &transcript(&h2, &[2; NONCE_LEN]),
            &client
        ));
        assert!(!t.windows(s.len()).any(|w| w == s), "secret not in transcript");
    }

    #[test]
    fn reject_and_challenge_codecs() {
        let r = Reject::new(RejectCode::Auth, "é".repeat(150));
        let b = r.encode();
        assert_eq!(b[0], MSG_REJECT);
        assert!(usize::from(b[2]) <= MAX_DETAIL_LEN);
        let back = Reject::decode(b[1], &b[3..]);
        assert_eq!(back.code, RejectCode::Auth);
        assert!(back.detail.starts_with('é'));
        for c in 0..=255u8 {
            let code = RejectCode::from_code(c);
            if code != RejectCode::Malformed {
                assert_eq!(code.code(), c);
            }
        }
        let ch = Challenge {
            nonce: [4; NONCE_LEN],
            mac: [5; MAC_LEN],
        };
        let b = ch.encode();
        assert_eq!(b[0], MSG_CHALLENGE);
        assert_eq!(Challenge::decode(b[1..].try_into().unwrap()), ch);
        assert_eq!(encode_proof(&[9; MAC_LEN])[0], MSG_PROOF);
    }
}
