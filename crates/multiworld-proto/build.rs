//! Compiles `proto/` with protox (a pure-Rust protobuf compiler), so building
//! the workspace needs no `protoc` binary.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("../../proto");
    let file = "multiworld/store/v1/store.proto";
    println!("cargo:rerun-if-changed={}", root.join(file).display());
    let fds = protox::compile([file], [&root])?;
    tonic_prost_build::configure()
        .bytes(".")
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    Ok(())
}
