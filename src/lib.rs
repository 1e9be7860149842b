//! inferencecache: a KV-cache-aware router for LLM inference.
//!
//! The crate is a pure routing [`core`] with adapters around it (see `docs/architecture.md`).
#![forbid(unsafe_code)]

/// The I/O-free routing core, its own crate (`crates/core`) so the compiler keeps
/// it free of gRPC, Envoy, Kubernetes and tokio; re-exported so adapters say
/// `crate::core::...`.
pub use inferencecache_core as core;

pub mod adapters;
pub mod chain_command;
pub mod crd;
pub mod proto;
pub mod serve;
pub mod tokenize_command;
