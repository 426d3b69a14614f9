//! multiworld: one process, many independent communication worlds.
//!
//! A process joins any number of worlds, each with its own store and its own
//! communicator; the world is the fault domain. This crate is the facade that
//! will own them (the `WorldManager`); so far it holds the pure cores the
//! manager is built on.
//!
//! Module map:
//! - [`config`]: [`WorldConfig`] (how to join one world) and `from_env()`.
//! - [`lifecycle`]: a world's state machine (joining → ready → broken →
//!   removed) and the causes of a break.
//! - [`watchdog`]: the watchdog's decisions as pure functions of
//!   `(now, observations, config)` with a human-readable reason, and the
//!   process monitor's "which watchdog is stuck" decision.

pub mod config;
pub mod lifecycle;
pub mod watchdog;

pub use config::{Backend, ConfigError, WorldConfig};
pub use lifecycle::{BreakCause, Lifecycle, WorldState};
pub use watchdog::{Decision, Verdict, WatchdogConfig};
