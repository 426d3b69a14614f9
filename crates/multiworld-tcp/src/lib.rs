//! `multiworld-tcp`: the TCP backend of multiworld for host memory. One
//! [`Communicator`] is one rank's membership of one world: its listener, its
//! authenticated connections to every peer, its tasks, and the point-to-point
//! operations over them. Nothing is shared between communicators, so a world is a
//! fault domain of its own.
//!
//! This crate is the transport only. The vocabulary it carries (ranks, tags,
//! generations, world names, secrets, dtypes, tensors) is `multiworld-types`'
//! (re-exported here for the transport's users); the collectives built on its
//! public API are `multiworld-collectives`; its benchmarks are in
//! `multiworld-bench`.
//!
//! Map of the modules:
//!
//! | module | what | I/O |
//! |---|---|---|
//! | `frame` | data-frame header codec and limits | none |
//! | `handshake` | hello/challenge/proof messages, HMAC-SHA256 challenge-response | none |
//! | `error` | [`Error`], the crate's one error type | none |
//! | `config` | [`CommConfig`] | none |
//! | `rendezvous` | the [`Rendezvous`] trait and [`MemoryRendezvous`] | in-process |
//! | `mesh` | listen, publish, connect, authenticate; refuse strangers | TCP |
//! | `matching` | receive matching: posted receives, early messages, where an arriving payload goes (budget, eager reads, any-source order, cancel while arriving) | none |
//! | `link` | the byte stream under one peer connection: an enum of a TCP socket's halves and (feature `memory`) an in-process pipe, dispatched statically | TCP, in-process |
//! | `parking` | where a reader leaves its link while it holds back a frame, so that the thread posting the frame's receive can read the payload itself | none |
//! | `comm` | [`Communicator`]: send/recv/isend/irecv, failure handling, abort, health, heartbeats | through `link` |
//! | `memory` | (feature `memory`) `MemoryWorld` and `Communicator::memory_world`: a whole world in this process over pipes, for tests | in-process |
//!
//! Features: `memory` builds worlds in memory (every member in this process,
//! connected by pipes, no sockets or handshake) so that the communicator and
//! what is built on it can be tested without ports; the test kit
//! (`multiworld-testkit`) enables it. Without it the link enums have their
//! TCP variant only, and the TCP path is exactly the socket calls. `wire`
//! makes the wire internals public for tests that forge frames.
//!
//! The wire protocol is described in `docs/protocol.md` at the repository's
//! root.

// Tensor payloads go on the wire as their in-memory bytes, and the wire format is
// little-endian.
#[cfg(target_endian = "big")]
compile_error!("multiworld-tcp supports little-endian targets only");

mod comm;
mod config;
mod error;
mod limiter;
mod link;
mod matching;
#[cfg(feature = "memory")]
mod memory;
mod parking;
mod rendezvous;

// The wire internals: public only with the `wire` feature, which the crate's
// own tests enable to forge frames and handshakes; users never need them.
#[cfg(feature = "wire")]
pub mod frame;
#[cfg(not(feature = "wire"))]
mod frame;
#[cfg(feature = "wire")]
pub mod handshake;
#[cfg(not(feature = "wire"))]
mod handshake;
#[cfg(feature = "wire")]
pub mod mesh;
#[cfg(not(feature = "wire"))]
mod mesh;

pub use comm::{
    CLOSE_LIMIT, Communicator, Health, HealthEvent, PeerLiveness, PeerStats, Received, RecvFailed,
    RecvHandle, SendHandle, as_blocking_caller, on_blocking_caller, without_pacing,
};
pub use config::{CommConfig, DEFAULT_EAGER_LIMIT, DEFAULT_HELLO_TIMEOUT, DEFAULT_RECV_SPIN};
pub use error::{Error, MessageDesc, Result, Side};
pub use frame::FrameLimits;
pub use handshake::RejectCode;
#[cfg(feature = "memory")]
pub use memory::{DEFAULT_PIPE_CAPACITY, MemoryWorld};
/// The rendezvous key under which a rank publishes its address (what a
/// store-backed rendezvous holds: an owner may look for it, e.g. to tell a
/// generation some member already joined).
pub use mesh::{addr_key, published_addr};
pub use multiworld_types::{
    DType, Element, Generation, Identity, Rank, Secret, Source, Tag, Tensor, TensorView, WorldName, bf16, f16,
};
pub use rendezvous::{BoxFuture, MemoryRendezvous, Rendezvous, RendezvousError};
