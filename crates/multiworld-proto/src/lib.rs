//! Generated protobuf and gRPC code for multiworld's control plane.
//!
//! Module map:
//! - [`store::v1`]: the per-world rendezvous store service
//!   (`proto/multiworld/store/v1/store.proto`), client and server stubs.
//!
//! The code is generated at build time by `tonic-prost-build` from descriptors
//! produced by `protox`, so no `protoc` binary is needed. `bytes` fields are
//! generated as [`bytes::Bytes`](prost::bytes::Bytes) so values are not copied
//! out of the receive buffer.

/// The store service, and only its generated code.
pub mod store {
    /// Version 1 of the store protocol.
    pub mod v1 {
        #![allow(missing_docs, clippy::all, clippy::unwrap_used, clippy::expect_used)]
        tonic::include_proto!("multiworld.store.v1");
    }
}
