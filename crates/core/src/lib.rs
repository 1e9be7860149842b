//! The pure routing core: the index, the policy model and the LookupRoute decision.
//!
//! Everything here is synchronous and does no I/O. It knows nothing of gRPC, Envoy,
//! Kubernetes or ZMQ: adapters translate those worlds into calls on [`Router`],
//! [`index::Index`] and [`snapshot::PolicySnapshot`].
//!
//! ```text
//!  adapters ──ingest/declare──▶ index::Index ◀──lookup── decision::decide ◀── adapters
//!                                   ▲                          ▲
//!  policy sources ──swap──▶ router::Router (ArcSwap<PolicySnapshot>)
//! ```
//!
//! Time is always passed in as a [`time::Timestamp`] so tests control the clock.
//!
//! This crate's `Cargo.toml` is the boundary: no tokio, tonic, kube, axum or Envoy
//! types can be imported here because none is a dependency.
#![forbid(unsafe_code)]

pub mod chain;
pub mod decision;
pub mod flow;
pub mod index;
pub mod load;
pub mod peers;
pub mod policy;
pub mod router;
pub mod scope;
pub mod selftest;
pub mod snapshot;
pub mod tenant_report;
pub mod time;

pub use router::Router;
