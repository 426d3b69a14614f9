//! Identity newtypes: who is talking ([`Rank`]), in which world ([`WorldName`] +
//! [`Generation`]), on which message stream ([`Tag`]), and the shared [`Secret`] that
//! proves membership. A world is `(name, generation)`; every handshake carries the
//! full [`Identity`] so a peer of an older generation, or of another world, can never
//! be mistaken for a member.

use std::fmt;
use std::sync::Arc;

use crate::error::InvalidArgument as Error;

/// Longest world name accepted, in bytes (UTF-8). Bounded so a handshake never
/// allocates more than this for a name read from the network.
pub const MAX_WORLD_NAME_LEN: usize = 255;

/// The position of a member inside its world, `0..size`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Rank(pub u32);

impl Rank {
    /// The rank as an index into per-rank tables.
    pub const fn index(self) -> usize {
        self.0 as usize
    }
}

impl From<u32> for Rank {
    fn from(r: u32) -> Self {
        Rank(r)
    }
}

impl fmt::Display for Rank {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// A user-chosen message stream label. Messages between two ranks on the same tag
/// are delivered in the order they were sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Tag(pub u32);

impl From<u32> for Tag {
    fn from(t: u32) -> Self {
        Tag(t)
    }
}

impl fmt::Display for Tag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// The incarnation of a world name. Re-creating a world under the same name uses a
/// new generation, so traffic of the old one can never reach the new one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Generation(pub u64);

impl From<u64> for Generation {
    fn from(g: u64) -> Self {
        Generation(g)
    }
}

impl fmt::Display for Generation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// A validated world name: 1 to [`MAX_WORLD_NAME_LEN`] bytes of UTF-8 without
/// control characters. Cheap to clone.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorldName(Arc<str>);

impl WorldName {
    /// Validates and wraps a name.
    pub fn new(name: impl AsRef<str>) -> Result<Self, Error> {
        let name = name.as_ref();
        if name.is_empty() {
            return Err(Error::new("world name is empty"));
        }
        if name.len() > MAX_WORLD_NAME_LEN {
            return Err(Error::new(format!(
                "world name is {} bytes, the limit is {MAX_WORLD_NAME_LEN}",
                name.len()
            )));
        }
        if name.chars().any(char::is_control) {
            return Err(Error::new("world name contains a control character"));
        }
        Ok(WorldName(Arc::from(name)))
    }

    /// The name as a string slice.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Lookups by `&str` in maps keyed by names (the hash of a name is the hash
/// of its string).
impl std::borrow::Borrow<str> for WorldName {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl AsRef<str> for WorldName {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

/// A name compares equal to the string it wraps (so tests and lookups can
/// write `name == "w"`).
impl PartialEq<str> for WorldName {
    fn eq(&self, other: &str) -> bool {
        &*self.0 == other
    }
}

impl PartialEq<&str> for WorldName {
    fn eq(&self, other: &&str) -> bool {
        &*self.0 == *other
    }
}

impl std::str::FromStr for WorldName {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        WorldName::new(s)
    }
}

impl TryFrom<&str> for WorldName {
    type Error = Error;
    fn try_from(s: &str) -> Result<Self, Error> {
        WorldName::new(s)
    }
}

impl TryFrom<String> for WorldName {
    type Error = Error;
    fn try_from(s: String) -> Result<Self, Error> {
        WorldName::new(s)
    }
}

impl fmt::Debug for WorldName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for WorldName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Where a receive accepts a message from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Source {
    /// Only from this rank.
    Rank(Rank),
    /// From whichever rank's message on the tag arrives first.
    Any,
}

impl Source {
    /// Whether a message from `rank` satisfies this source.
    pub fn matches(self, rank: Rank) -> bool {
        match self {
            Source::Rank(r) => r == rank,
            Source::Any => true,
        }
    }
}

impl From<Rank> for Source {
    fn from(r: Rank) -> Self {
        Source::Rank(r)
    }
}

/// The full identity of one member: world, generation, rank and world size.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Identity {
    /// World name.
    pub world: WorldName,
    /// World generation.
    pub generation: Generation,
    /// This member's rank.
    pub rank: Rank,
    /// Number of members in the world.
    pub size: u32,
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}#{} rank {}/{}",
            self.world, self.generation, self.rank, self.size
        )
    }
}

/// The world's shared secret. Only used as an HMAC key; it never crosses the wire
/// and its `Debug` output is redacted.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(Arc<[u8]>);

impl Secret {
    /// Wraps secret bytes.
    pub fn new(bytes: impl AsRef<[u8]>) -> Self {
        Secret(Arc::from(bytes.as_ref()))
    }

    /// The key bytes.
    pub fn expose(&self) -> &[u8] {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Secret(<{} bytes redacted>)", self.0.len())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn world_name_bounds() {
        assert!(WorldName::new("").is_err());
        assert!(WorldName::new("a\nb").is_err());
        assert!(WorldName::new("x".repeat(MAX_WORLD_NAME_LEN)).is_ok());
        assert!(WorldName::new("x".repeat(MAX_WORLD_NAME_LEN + 1)).is_err());
        assert_eq!(WorldName::new("w-1").unwrap().as_str(), "w-1");
    }

    #[test]
    fn secret_debug_is_redacted() {
        let s = Secret::new(b"hunter2");
        assert!(!format!("{s:?}").contains("hunter2"));
    }

    #[test]
    fn source_matching() {
        assert!(Source::Any.matches(Rank(3)));
        assert!(Source::Rank(Rank(3)).matches(Rank(3)));
        assert!(!Source::Rank(Rank(2)).matches(Rank(3)));
    }
}
