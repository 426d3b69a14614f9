//! The library half of `m8d`: pieces shared by its commands and its tests.
//!
//! Module map:
//! - [`fleet`]: a leader and its worker processes, one world each, with real
//!   fault injection (SIGKILL, SIGSTOP) and respawn.
//! - [`launch`]: run a program once per rank with the launcher environment
//!   (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, ...), output prefixed by rank.
//! - [`progress`]: progress bars and spinners for long commands, drawn only
//!   on a terminal.
//! - [`stream`]: checksummed tensor streams between a leader and its workers
//!   (what the demo, the failover benchmark and the fault-injection tests
//!   send), with live counters of messages, bytes, corruption, losses and
//!   pauses, and a clean end that tells the receiver how many were sent.

pub mod fleet;
pub mod launch;
pub mod progress;
pub mod stream;
