//! Adapters: each translates one outside world into calls on the pure [`crate::core`].
//!
//! ```text
//!  Envoy ──ext_proc──▶ ext_proc ─┐
//!  clients ──gRPC───▶ grpc ──────┼──▶ core::Router ◀── policy sources (file / Kubernetes)
//!  operators ─HTTP──▶ admin ─────┘         │
//!                     metrics ◀────────────┘ (read at scrape time)
//! ```

pub mod ext_proc;
pub mod grpc;
pub mod metrics;

/// The longest chain (in blocks) a request may carry, on any transport: 65,536
/// blocks of 16 tokens is a million-token prompt. Longer chains are refused before
/// anything is allocated for them.
pub const MAX_CHAIN_BLOCKS: usize = 65_536;
