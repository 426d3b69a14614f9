//! `multiworld-bench`: the benchmarks of the transport and the collectives, as
//! library functions so that both `cargo bench -p multiworld-bench` and the
//! command-line tool (`m8d bench p2p`, `m8d bench collectives`) run them. No
//! library of the runtime contains benchmark code; it all lives here.
//!
//! Each benchmark measures a physical reference in the same run (a raw TCP
//! stream and ping-pong between two threads, memory copies) and reports ratios
//! against it.
//!
//! Map of the modules:
//!
//! | module | what |
//! |---|---|
//! | [`p2p`] | streaming and ping-pong between two ranks, with raw-TCP references |
//! | [`collectives`] | every collective for several world sizes and buffer sizes, with the raw-TCP floor and memory-copy references |
//! | [`ranks`] | one process per rank through the `multiworld` facade (the `mw-rank-bench` binary, the Rust reference of `python -m multiworld_rs.bench`), with raw-TCP references between processes |
//!
//! The ranks of these benchmarks run as threads of one process, each with its
//! own runtime, which hides some costs that appear between processes; the
//! [`ranks`] benchmark and the `m8d bench worlds` / `failover` / `join`
//! benchmarks run real processes.

pub mod collectives;
pub mod p2p;
pub mod ranks;

/// A zeroed byte buffer for the raw socket references, laid out like the
/// runtime's own large tensors ([`multiworld::Tensor::zeros`]: 64-byte
/// aligned from [`multiworld_types::ALIGNED_FROM`] bytes), so that the
/// reference and the runtime pay the kernel's copies alike.
pub fn raw_buffer(len: usize) -> multiworld::Tensor {
    multiworld::Tensor::zeros(multiworld::DType::U8, [len])
        // One dimension of `len` bytes: its size cannot overflow.
        .unwrap_or_default()
}

/// A [`raw_buffer`] whose every byte is written (ones): what a benchmark
/// sends. A large zeroed allocation that is only ever read maps the
/// kernel's shared zero page, which stays in the caches and makes reading
/// it nearly free (64 MiB copied out in 5.5 ms here, against 7.5 ms out of
/// written memory), so a sender of never-written memory would look faster
/// than a peer whose tensors hold data.
pub fn raw_ones(len: usize) -> multiworld::Tensor {
    let mut t = raw_buffer(len);
    t.bytes_mut().fill(1);
    t
}
