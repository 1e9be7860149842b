//! The generated `inferencecache.v1` gRPC types (docs/reference.md, "gRPC API"), compiled by `build.rs`.
//!
//! Only [`crate::adapters::grpc`] converts between these and the core types; clients
//! (tests, the e2e harness, benchmarks) use the generated client from here.

/// `inferencecache.v1`: messages, `CacheService` client and server.
#[allow(clippy::all, clippy::pedantic)]
pub mod v1 {
    tonic::include_proto!("inferencecache.v1");

    /// The encoded file descriptor set served by gRPC reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(
        env!("OUT_DIR"),
        "/inferencecache_v1_descriptor.bin"
    ));
}
