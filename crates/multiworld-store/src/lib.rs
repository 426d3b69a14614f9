//! The per-world rendezvous store of multiworld.
//!
//! Every world owns a small key-value store through which its members find
//! each other (transport addresses, NCCL ids) and agree on things (counters,
//! barriers, "this world is broken"). One server, on one port, hosts the
//! stores of many worlds, each with its own table, waiters, bounds, secret
//! and lifetime.
//!
//! Module map (all private; every public item is re-exported once at the root):
//! - `table`: the I/O-free table of one world (every operation, waits with
//!   deadlines, close), tested with a fake clock.
//! - `limits`: the bounds a world's store enforces, with their defaults.
//! - `auth`: shared-secret proofs (HMAC-SHA256; the secret never crosses
//!   the wire).
//! - `server`: the server hosting many worlds' tables ([`StoreServer`]),
//!   embedded in a process or run standalone; the store's operations,
//!   written once for both wire protocols, and the gRPC service over them.
//! - `front` (private): the accept loop, which tells a connection's protocol
//!   from its first byte, and each connection's driver (HTTP/2, or
//!   `front::framed` for the framed protocol); bounds connections, their
//!   deadlines, request bodies and request memory before a request reaches
//!   an operation.
//! - `framed` (private): the framed protocol's codec (pure) and the I/O
//!   pieces both of its ends share.
//! - `framed_conn` (private): the client's framed connection (the caller
//!   writes its request, a driver task reads the answers), keepalive, cancel,
//!   redial.
//! - `gate` (private): the pure decision about a request from its headers
//!   alone (admit, pre-authentication bounds, or refuse without reading the
//!   body), and the rate limit on refusal log lines.
//! - `conn` (private): the client's HTTP/2 connection on `h2` directly
//!   (one write per request, no task hand-off before it), keepalive, redial.
//! - `client`: [`StoreClient`] (one connection in either protocol,
//!   [`WireProtocol`], retrying with backoff) and [`WorldStore`] (one
//!   world's store over it).
//! - `error`: [`StoreError`] and its mapping to gRPC statuses.
//!
//! ```
//! use std::time::Duration;
//! use multiworld_store::*;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // Rank 0 hosts the store of world "w" in-process (one port can host many worlds).
//! let server = StoreServer::bind("127.0.0.1:0".parse()?, ServerConfig::default()).await?;
//! let secret = Secret::new("s3cret");
//! server.open_world("w", WorldOptions { secret: Some(secret.clone()), limits: None })?;
//!
//! // Any rank, in any process, connects (retrying until the server is up) and opens it.
//! let client = StoreClient::connect(&server.local_addr().to_string(), ClientConfig::default()).await?;
//! let w = client.open("w", OpenOptions { secret: Some(secret), ..Default::default() }).await?;
//! w.set("rank0/addr", "127.0.0.1:4000").await?;
//! let addr = w.get("rank0/addr", Duration::from_secs(5)).await?;
//! let arrived = w.add("arrived", 1).await?;
//! assert_eq!((&addr[..], arrived), (&b"127.0.0.1:4000"[..], 1));
//! # Ok(())
//! # }
//! ```

mod auth;
mod client;
mod conn;
mod error;
mod framed;
mod framed_conn;
mod front;
mod gate;
mod limits;
mod server;
mod table;

#[cfg(test)]
mod fuzz_tests;

pub use auth::StoreProof;
pub use client::{ClientConfig, OpenOptions, StoreClient, WireProtocol, WorldStore};
pub use error::{Limit, StoreError};
pub use limits::Limits;
pub use multiworld_types::Secret;
pub use server::{ServerConfig, ServerStats, StoreServer, WorldOptions, WorldStats};
pub use table::CasOutcome;
