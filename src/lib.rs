//! inferencecache: a KV-cache-aware router for LLM inference.
//!
//! The crate is a pure routing [`core`] with adapters around it (see `docs/architecture.md`).
#![forbid(unsafe_code)]

pub mod adapters;
pub mod chain_command;
pub mod core;
pub mod crd;
pub mod proto;
pub mod serve;
pub mod sim;
