//! multiworld: one process, many independent communication worlds.
//!
//! A process joins any number of worlds through one [`WorldManager`]; each
//! world has its own store, its own communicator and its own watchdog, and is
//! its own fault domain: when a member of one world dies, freezes or is cut
//! off, that world breaks and is torn down while every other world keeps
//! running.
//!
//! Module map (all private; every public item is re-exported once at the root):
//! - `manager`: [`WorldManager`] (join, leave, look up, list, events, hosted
//!   stores) and the process monitor that notices a stuck watchdog.
//! - `world`: [`World`], one membership: its operations, its watchdog and
//!   store-watcher tasks, break and teardown.
//! - `config`: [`WorldConfig`] (how to join one world) and `from_env()`.
//! - `lifecycle`: a world's state machine (joining → ready → broken →
//!   removed) and the causes of a break.
//! - `watchdog`: the watchdog's decisions as pure functions of
//!   `(now, observations, config)` with a human-readable reason, and the
//!   process monitor's "which watchdog is stuck" decision.
//! - `events`: [`WorldEvent`] (`Joined`, `Broken` with its flight record,
//!   `Removed`, ...).
//! - `recorder`: the flight recorder: each world's last operations and those
//!   pending ([`FlightRecord`], its readable timeline).
//! - `metrics`: Prometheus metrics of the process and its worlds, and the
//!   opt-in HTTP endpoint (`ManagerConfig::metrics_addr`,
//!   `MULTIWORLD_METRICS_ADDR`); [`WorldManager::metrics_text`].
//! - `rendezvous`: the TCP backend's rendezvous over a world's store.
//! - `device` (with the `nccl` feature): a world's GPU side — the NCCL
//!   communicator of an NCCL world ([`NcclWorld`], [`DeviceOp`] and its
//!   [`DeviceProbe`]), watched by
//!   the world's watchdog, and host-staged device tensors over TCP
//!   ([`World::send_device`], [`World::recv_device`]).
//! - `device_calls` (with the `nccl` feature): the agreement check of an
//!   NCCL world's collectives (`WorldConfig::check_device_calls`), pure.
//! - `error`: the error type, [`WorldError`].
//!
//! ```
//! use multiworld::{DType, Rank, Tag, Tensor, WorldConfig, WorldManager};
//!
//! # #[tokio::main(flavor = "multi_thread", worker_threads = 2)]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // Two managers stand in for two processes.
//! let (leader, worker) = (WorldManager::default(), WorldManager::default());
//! let store = leader.serve_store("127.0.0.1:0").await?.to_string();
//! let (a, b) = tokio::join!(
//!     leader.join(WorldConfig::new("w", 0, 2, &store)?), // rank 0 hosts the store
//!     worker.join(WorldConfig::new("w", 1, 2, &store)?),
//! );
//! let (a, b) = (a?, b?);
//! let mut got = Tensor::zeros(DType::F32, [3])?;
//! let (sent, received) = tokio::join!(b.send(Rank(0), Tag(0), &[1.0f32, 2.0, 3.0][..]), a.recv(Rank(1), Tag(0), &mut got));
//! sent?;
//! received?;
//! assert_eq!(got.as_slice::<f32>()?, &[1.0, 2.0, 3.0]);
//!
//! // The worker goes away: the leader's world breaks, and only it.
//! worker.shutdown().await;
//! let err = a.recv(Rank(1), Tag(0), &mut got).await.unwrap_err();
//! assert!(err.is_world_broken());
//! # Ok(())
//! # }
//! ```
//!
//! Tensors, dtypes, reduce operations, ranks, tags, generations, world names
//! and secrets are the vocabulary crate's (`multiworld-types`), re-exported
//! here: one set of types for host and device, TCP and NCCL.
//! With the `nccl` feature, the NCCL backend is re-exported as [`nccl`]
//! (`multiworld-nccl`: one non-blocking communicator per world, NCCL and CUDA
//! loaded at run time), and the manager joins NCCL worlds
//! (`Backend::Nccl`): each keeps its TCP mesh for control and host tensors
//! and gains an NCCL communicator for device tensors.

mod config;
#[cfg(feature = "nccl")]
mod device;
#[cfg(feature = "nccl")]
mod device_calls;
mod error;
mod events;
mod lifecycle;
mod manager;
mod metrics;
mod recorder;
mod rendezvous;
mod watchdog;
mod world;

/// The NCCL backend (with the `nccl` feature).
#[cfg(feature = "nccl")]
pub use multiworld_nccl as nccl;

pub use config::{Backend, ConfigError, DEFAULT_READ_AHEAD, WorldConfig};
#[cfg(feature = "nccl")]
pub use device::{DEFAULT_DEVICE_OP_TIMEOUT, DeviceOp, DeviceProbe, NcclWorld, interruptible};
pub use error::{JoinFailure, WorldError};
pub use events::WorldEvent;
pub use lifecycle::{BreakCause, WorldState};
pub use manager::{ManagerConfig, WorldInfo, WorldManager};
pub use multiworld_collectives::{CollectiveHandle, Group, SharedMemory};
pub use multiworld_tcp::Error as CommError;
pub use multiworld_tcp::Received;
pub use multiworld_tcp::{as_blocking_caller, on_blocking_caller, without_pacing};
pub use multiworld_types::{
    DType, Element, ExternalMemory, Generation, Rank, ReduceOp, Secret, Tag, Tensor, TensorView, WorldName,
    bf16, f16,
};
pub use recorder::{FlightRecord, OpRecord, Outcome as OpOutcome};
pub use watchdog::WatchdogConfig;
pub use world::{PendingRecv, PendingSend, ReceiveFailed, World};
