//! `multiworld-collectives`: collective operations over a world (or a sub-group of it), with the semantics
//! of `torch.distributed`: broadcast, reduce, all-reduce, all-gather (list and
//! into one tensor), gather, scatter, reduce-scatter (list and tensor),
//! all-to-all (lists, and one tensor with uneven splits), barrier, and object
//! variants (broadcast, all-gather, gather, scatter of `serde` values), each as a
//! blocking-style `async fn` and a handle form, with every [`ReduceOp`](multiworld_types::ReduceOp) for every
//! dtype where it is defined.
//!
//! ```no_run
//! # async fn demo(comm: std::sync::Arc<multiworld_tcp::Communicator>) -> multiworld_tcp::Result<()> {
//! use multiworld_collectives::Group;
//! use multiworld_types::{Rank, ReduceOp, Tensor};
//! let world = Group::world(&comm);
//! let mut t = Tensor::from(vec![1.0f32, 2.0, 3.0]);
//! world.all_reduce(&mut t, ReduceOp::Sum).await?;
//! let pair = world.new_group(&[Rank(0), Rank(1)]).await?; // every rank calls it
//! if pair.is_member() {
//!     pair.broadcast(&mut t, Rank(1)).await?;
//! }
//! let h = world.all_reduce_handle(t, ReduceOp::Max); // runs in the background
//! let t = h.wait().await?;
//! # Ok(()) }
//! ```
//!
//! The collectives run over the TCP transport's public API only (a
//! [`multiworld_tcp::Communicator`]'s point-to-point operations, its health
//! events and its connections' liveness); the vocabulary (tensors, dtypes,
//! [`ReduceOp`](multiworld_types::ReduceOp) and its kernels, the reserved tag
//! range) is `multiworld-types`'. A new collective is a file here.
//!
//! Map of the crate (`COLLECTIVES.md` next to the crate's manifest describes the
//! protocol, algorithms and numerics):
//!
//! | file | what |
//! |---|---|
//! | `group.rs` | [`Group`], [`CollectiveConfig`]: membership, call order, agreement round, member-loss guard |
//! | `collective.rs` | the life cycle of one tensor call, written once: `Group::run_collective` |
//! | `ops.rs` | the tensor operations (each: its preparation and its body) |
//! | `object.rs` | the object operations |
//! | `algo.rs` | direct, ring and pipelined-chain algorithms |
//! | `shm.rs` | same-host shared memory: the segment, its setup, the agreement round through it, the algorithms through it (all-reduce, reduce, broadcast, all-gather, reduce-scatter, and the routes of gather, scatter and all-to-all) |
//! | `desc.rs` | call descriptors and the agreement check (pure) |
//! | `handle.rs` | [`CollectiveHandle`] |
//! | `util.rs` | scratch pool, segments, `try_join_all` |

mod algo;
mod collective;
mod desc;
#[cfg(test)]
mod fuzz_tests;
mod group;
mod handle;
mod object;
mod ops;
mod shm;
mod util;

pub use desc::Kind as CollectiveKind;
pub use group::{Algorithm, CallEnd, CallObserver, CollectiveConfig, Group};
pub use handle::CollectiveHandle;
pub use shm::{SharedMemory, copy_large};
