//! Compiles `proto/inferencecache/v1/cache.proto` with the vendored protoc (so no
//! system protoc is needed) and writes the file descriptor set gRPC reflection serves.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    // Handing the path to prost-build's config is the same as setting PROTOC, without
    // mutating the process environment.
    let mut config = tonic_prost_build::Config::new();
    config.protoc_executable(protoc_bin_vendored::protoc_bin_path()?);
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .file_descriptor_set_path(out_dir.join("inferencecache_v1_descriptor.bin"))
        .compile_with_config(config, &["proto/inferencecache/v1/cache.proto"], &["proto"])?;
    println!("cargo:rerun-if-changed=proto");
    Ok(())
}
