//! The store over loopback (127.0.0.1, port 0): real server, real clients
//! speaking the framed protocol (the default). `loopback_grpc.rs` runs the
//! same suite with clients speaking gRPC. Bounds asserted here are generous
//! (a busy 2-core machine must never make them flake); the benchmark
//! measures the real figures.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

const PROTOCOL: multiworld_store::WireProtocol = multiworld_store::WireProtocol::Framed;

include!("loopback/suite.rs");
