//! The loopback suite of `loopback.rs` with clients speaking gRPC over
//! HTTP/2 instead of the framed protocol: the server answers both on one
//! port, with the same operations, bounds and errors.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

const PROTOCOL: multiworld_store::WireProtocol = multiworld_store::WireProtocol::Grpc;

include!("loopback/suite.rs");
