//! Adapters: each translates one outside world into calls on the pure [`crate::core`].
//!
//! ```text
//!  Envoy ──ext_proc──▶ ext_proc ─┐
//!  clients ──gRPC───▶ grpc ──────┼──▶ core::Router ◀──install── policy_file (resolve)
//!  operators ─HTTP──▶ admin ─────┘         │  ▲ ◀──────install── kubernetes (resolve)
//!                                          │  └──view──▶ kubernetes::publish (status)
//!                     metrics ◀────────────┘ (read at scrape time)
//! ```
//!
//! - [`resolve`]: typed CRD objects → a [`crate::core::snapshot::PolicySnapshot`]
//!   (pure; shared by file mode and Kubernetes).
//! - [`policy_file`]: the standalone policy source (docs/reference.md, "File mode"): YAML on disk,
//!   polled and reloaded.
//! - [`kubernetes`]: the cluster policy source (`serve --kubernetes`): watches into
//!   snapshots, and the Lease holder's status writer.
//! - [`admission`]: the validating admission webhook (HTTPS, AdmissionReview v1).
//! - [`ext_proc`], [`grpc`], [`admin`], [`metrics`]: the serving side; [`ingest`]
//!   guards the ingest listener (tokens, per-caller limits), [`drain`] is the
//!   shutdown flag they all read; [`apply`] moves heavy event batches off the
//!   async workers; [`tls`] holds the listeners' certificates.

pub mod admin;
pub mod admission;
pub mod apply;
pub mod body;
pub mod drain;
pub mod engine_metrics;
pub mod ext_proc;
pub mod fleet;
pub mod grpc;
pub mod ingest;
pub mod kubernetes;
pub mod kv_events;
pub mod metrics;
pub mod policy_file;
pub mod resolve;
pub mod tls;

/// The longest chain (in blocks) a request may carry, on any transport: 65,536
/// blocks of 16 tokens is a million-token prompt. Longer chains are refused before
/// anything is allocated for them.
pub const MAX_CHAIN_BLOCKS: usize = 65_536;
