//! Adapters: each translates one outside world into calls on the pure core.
//!
//! - [`resolve`]: typed CRD objects → a [`crate::core::snapshot::PolicySnapshot`]
//!   (pure; shared by file mode and Kubernetes).
//! - [`policy_file`]: the standalone policy source (contract §10): YAML on disk,
//!   polled and reloaded.

pub mod policy_file;
pub mod resolve;
