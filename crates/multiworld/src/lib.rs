//! multiworld: one process, many independent communication worlds.
//!
//! A process joins any number of worlds through one [`WorldManager`]; each
//! world has its own store, its own communicator and its own watchdog, and is
//! its own fault domain: when a member of one world dies, freezes or is cut
//! off, that world breaks and is torn down while every other world keeps
//! running.
//!
//! Module map:
//! - [`manager`]: [`WorldManager`] (join, leave, look up, list, events, hosted
//!   stores) and the process monitor that notices a stuck watchdog.
//! - [`world`]: [`World`], one membership: its operations, its watchdog and
//!   store-watcher tasks, break and teardown.
//! - [`config`]: [`WorldConfig`] (how to join one world) and `from_env()`.
//! - [`lifecycle`]: a world's state machine (joining → ready → broken →
//!   removed) and the causes of a break.
//! - [`watchdog`]: the watchdog's decisions as pure functions of
//!   `(now, observations, config)` with a human-readable reason, and the
//!   process monitor's "which watchdog is stuck" decision.
//! - [`events`]: [`WorldEvent`] (`Joined`, `Broken`, `Removed`).
//! - [`rendezvous`]: the TCP backend's rendezvous over a world's store.
//! - [`error`]: the error type, [`WorldError`].
//!
//! Tensors, ranks and tags are the TCP backend's types, re-exported here.
//! With the `nccl` feature, the NCCL backend is re-exported as [`nccl`]
//! (`multiworld-nccl`: one non-blocking communicator per world, loaded at run
//! time); the manager does not drive it yet.

pub mod config;
pub mod error;
pub mod events;
pub mod lifecycle;
pub mod manager;
pub mod rendezvous;
pub mod watchdog;
pub mod world;

/// The NCCL backend (with the `nccl` feature).
#[cfg(feature = "nccl")]
pub use multiworld_nccl as nccl;

pub use config::{Backend, ConfigError, WorldConfig};
pub use error::WorldError;
pub use events::WorldEvent;
pub use lifecycle::{BreakCause, Lifecycle, WorldState};
pub use manager::{ManagerConfig, WorldInfo, WorldManager};
pub use multiworld_tcp::{DType, Element, Rank, Received, Tag, Tensor, TensorView, bf16, f16};
pub use watchdog::{Decision, Verdict, WatchdogConfig};
pub use world::{PendingRecv, PendingSend, World};
