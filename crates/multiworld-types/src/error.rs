//! [`InvalidArgument`], the one error of the vocabulary: a value that breaks a
//! rule of its type (an empty world name, a shape that does not match the data,
//! a tensor read as the wrong element type, a reserved tag). Every backend's
//! error converts from it into its own "this call was wrong" variant.

use std::sync::Arc;

/// A value that breaks a rule of its type. The message says which rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid argument: {0}")]
pub struct InvalidArgument(Arc<str>);

impl InvalidArgument {
    /// An error with this message.
    pub fn new(msg: impl Into<String>) -> Self {
        InvalidArgument(Arc::from(msg.into()))
    }

    /// The message, without the "invalid argument" prefix.
    pub fn message(&self) -> &Arc<str> {
        &self.0
    }
}

/// Shorthand for results of this crate.
pub type Result<T, E = InvalidArgument> = std::result::Result<T, E>;
