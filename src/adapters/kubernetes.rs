//! The Kubernetes policy source (`serve --kubernetes`): the CRDs and the engine
//! pods in the cluster become the policy snapshot, and the elected replica writes
//! back what it observed into each object's status.
//!
//! ```text
//!  apiserver ──list/watch──▶ watch (reflector stores, debounced)
//!                              │ resolve_in_cluster ─▶ Router::install(snapshot)
//!                              ▼ Cluster state (objects + ignored/rejected)
//!  Lease ──▶ leader ──is leader──▶ publish (every 10 s and after changes)
//!                                    │ status::* (pure) + Router::view
//!                                    ▼ merge patches on the status subresources
//! ```

pub mod leader;
pub mod publish;
pub mod status;
pub mod watch;

#[cfg(test)]
mod mock;
