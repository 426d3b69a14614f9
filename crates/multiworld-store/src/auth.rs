//! Shared-secret authentication of store requests.
//!
//! A world may have a secret. A client proves knowledge of it by sending, in
//! the `mw-auth` metadata entry of every request, a random nonce and
//! `HMAC-SHA256(secret, "multiworld-store-v1" 0x00 world 0x00 nonce)`. The
//! secret itself never crosses the wire. The proof is bound to the world name,
//! so a proof for one world is useless for another world with another secret.
//!
//! Every request that names a world also carries the name in the `mw-world`
//! metadata entry (hex of its UTF-8 bytes), so the server can check the proof
//! from the request's headers alone, before it reads a byte of its body.
//!
//! What this does not give: confidentiality or replay protection against an
//! attacker who can read the traffic (use a private network or TLS for that).
//! It does keep a stranger who can merely connect to the port from reading or
//! writing a world's keys.

use multiworld_types::Secret;

use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::Sha256;

/// The metadata entry that carries a request's proof.
pub const AUTH_METADATA: &str = "mw-auth";
/// The metadata entry that names a request's world (hex of the name's
/// bytes), so the proof can be checked before the body is read.
pub const WORLD_METADATA: &str = "mw-world";
const DOMAIN: &[u8] = b"multiworld-store-v1";
const NONCE_LEN: usize = 16;
const MAC_LEN: usize = 32;

type HmacSha256 = Hmac<Sha256>;

/// A world's shared secret is the vocabulary's [`Secret`] (the same value
/// authenticates the store and the transport); this trait gives it the
/// store's proofs. Import it (`use multiworld_store::StoreProof`) to call
/// `proof` and `verify`.
pub trait StoreProof {
    /// Builds the `mw-auth` value proving knowledge of this secret for `world`.
    fn proof(&self, world: &str) -> String;
    /// Checks an `mw-auth` value (or its absence) against this secret, in
    /// constant time. The error says why, for the refusal message.
    fn verify(&self, world: &str, proof: Option<&str>) -> Result<(), &'static str>;
}

fn mac(secret: &Secret, world: &str, nonce: &[u8]) -> HmacSha256 {
    // HMAC accepts keys of any length, so this cannot fail.
    #[allow(clippy::expect_used)]
    let mut mac = HmacSha256::new_from_slice(secret.expose()).expect("HMAC takes keys of any length");
    mac.update(DOMAIN);
    mac.update(&[0]);
    mac.update(world.as_bytes());
    mac.update(&[0]);
    mac.update(nonce);
    mac
}

impl StoreProof for Secret {
    fn proof(&self, world: &str) -> String {
        let mut nonce = [0u8; NONCE_LEN];
        rand::rng().fill_bytes(&mut nonce);
        let tag = mac(self, world, &nonce).finalize().into_bytes();
        format!("v1.{}.{}", hex::encode(nonce), hex::encode(tag))
    }

    fn verify(&self, world: &str, proof: Option<&str>) -> Result<(), &'static str> {
        let proof = proof.ok_or("this world requires a secret and the request carried no proof")?;
        let mut parts = proof.split('.');
        let (Some("v1"), Some(nonce), Some(tag), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err("malformed proof");
        };
        // Lengths are checked before decoding so nothing large is allocated.
        if nonce.len() != NONCE_LEN * 2 || tag.len() != MAC_LEN * 2 {
            return Err("malformed proof");
        }
        let nonce = hex::decode(nonce).map_err(|_| "malformed proof")?;
        let tag = hex::decode(tag).map_err(|_| "malformed proof")?;
        mac(self, world, &nonce)
            .verify_slice(&tag)
            .map_err(|_| "the proof does not match this world's secret")
    }
}

/// The `mw-world` value for a world name.
pub fn encode_world(name: &str) -> String {
    hex::encode(name.as_bytes())
}

/// Decodes an `mw-world` value, refusing one longer than `max_name_len`
/// bytes once decoded (checked before decoding, so nothing large is
/// allocated) or not hex of UTF-8.
pub fn decode_world(value: &[u8], max_name_len: usize) -> Result<String, &'static str> {
    if value.is_empty() || value.len() > max_name_len.saturating_mul(2) {
        return Err("mw-world is empty or longer than a world name may be");
    }
    let bytes = hex::decode(value).map_err(|_| "mw-world is not hex")?;
    String::from_utf8(bytes).map_err(|_| "mw-world is not UTF-8")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proof_verifies_only_with_the_same_secret_and_world() {
        let s = Secret::new("s3cret");
        let p = s.proof("w");
        assert_eq!(s.verify("w", Some(&p)), Ok(()));
        assert!(Secret::new("other").verify("w", Some(&p)).is_err());
        assert!(s.verify("w2", Some(&p)).is_err());
        assert!(s.verify("w", None).unwrap_err().contains("no proof"));
    }

    #[test]
    fn malformed_proofs_are_refused() {
        let s = Secret::new("k");
        for bad in [
            "",
            "v1",
            "v1..",
            "v2.00.00",
            "v1.zz.zz",
            &"v1.".repeat(10_000),
            &format!("v1.{}.{}", "0".repeat(32), "g".repeat(64)),
        ] {
            assert!(s.verify("w", Some(bad)).is_err(), "{bad:.20}");
        }
    }

    #[test]
    fn debug_does_not_print_the_secret() {
        assert!(!format!("{:?}", Secret::new("hunter2")).contains("hunter2"));
    }

    #[test]
    fn world_names_round_trip_through_metadata_and_bad_ones_are_refused() {
        for name in ["w", "a world/with spaces", "wörld"] {
            assert_eq!(decode_world(encode_world(name).as_bytes(), 256).unwrap(), name);
        }
        assert!(decode_world(b"", 256).is_err());
        assert!(decode_world(b"zz", 256).is_err());
        assert!(decode_world(b"ff", 256).is_err());
        assert!(decode_world(encode_world(&"x".repeat(257)).as_bytes(), 256).is_err());
    }

    #[test]
    fn two_proofs_differ() {
        let s = Secret::new("k");
        assert_ne!(s.proof("w"), s.proof("w"));
    }
}
