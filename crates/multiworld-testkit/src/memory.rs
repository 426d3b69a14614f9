//! In-memory worlds (the transport's `memory` feature): every member in this
//! process, connected by pipes instead of sockets, ready at once (no ports,
//! no rendezvous, no handshake). Same communicator and collectives as over
//! TCP, so tests of what is built on the transport need no network.

use std::sync::Arc;

use multiworld_collectives::Group;
use multiworld_tcp::{CommConfig, Communicator, MemoryWorld};

use crate::{config, init_tracing, world};

/// The communicators of a world of `size` members named `name` built in
/// memory (generation 1, [`SECRET`](crate::SECRET), default settings), in rank order.
pub fn memory_mesh(name: &str, size: u32) -> Vec<Communicator> {
    memory_mesh_with(name, size, |c| c)
}

/// A world of two built in memory, as [`pair`](crate::pair) joins one over TCP.
pub fn memory_pair(name: &str) -> (Communicator, Communicator) {
    let mut v = memory_mesh(name, 2);
    let b = v.pop().expect("two members");
    let a = v.pop().expect("two members");
    (a, b)
}

/// [`memory_mesh`] with `tweak` adjusting the members' config (its rank is
/// ignored: each member gets its own). Must run within a Tokio runtime.
pub fn memory_mesh_with(
    name: &str,
    size: u32,
    tweak: impl FnOnce(CommConfig) -> CommConfig,
) -> Vec<Communicator> {
    init_tracing();
    let spec = MemoryWorld::new(world(name), size).with_config(tweak(config(name, 0, size)));
    Communicator::memory_world(&spec).expect("memory world")
}

/// World groups of `n` members built in memory (like [`coll::groups`](crate::coll::groups)
/// over TCP).
pub fn memory_groups(name: &str, n: u32) -> Vec<Group> {
    memory_mesh(name, n)
        .into_iter()
        .map(|c| Group::world(&Arc::new(c)))
        .collect()
}
