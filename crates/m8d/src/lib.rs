//! The library half of `m8d`: pieces shared by its commands and its tests.
//!
//! Module map:
//! - [`fleet`]: a leader and its worker processes, one world each, with real
//!   fault injection (SIGKILL, SIGSTOP) and respawn.
//! - [`stream`]: checksummed tensor streams between a leader and its workers
//!   (what the demo, the failover benchmark and the fault-injection tests
//!   send), with live counters of messages, bytes, corruption, losses and
//!   pauses.

pub mod fleet;
pub mod stream;
