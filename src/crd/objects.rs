//! The routing objects a policy source yields: a policy file or directory, the
//! cluster's watches, or both in `serve --config --kubernetes`. Every adapter that
//! reads CachePolicies, CacheTenants or CacheBackends takes them in this one shape.

use std::sync::Arc;

use super::cache_backend::CacheBackend;
use super::cache_policy::CachePolicy;
use super::cache_tenant::CacheTenant;

/// CachePolicies, CacheTenants and CacheBackends as a source gave them (not yet
/// resolved: conflicts and invalid objects are the resolver's to judge).
/// Shared, so handing a source's objects to another task copies no spec.
#[derive(Clone, Debug, Default)]
pub struct PolicyObjects {
    pub policies: Vec<Arc<CachePolicy>>,
    pub tenants: Vec<Arc<CacheTenant>>,
    pub backends: Vec<Arc<CacheBackend>>,
}

impl PolicyObjects {
    /// Each CacheBackend, borrowed.
    pub fn each_backend(&self) -> impl Iterator<Item = &CacheBackend> {
        self.backends.iter().map(|b| &**b)
    }

    /// This source's CacheBackends followed by `other`'s: what the engine-side
    /// adapters (metrics scrapers, tokenizers) follow when two sources combine.
    pub fn backends_with<'a>(
        &'a self,
        other: &'a PolicyObjects,
    ) -> impl Iterator<Item = &'a CacheBackend> {
        self.backends
            .iter()
            .chain(other.backends.iter())
            .map(|b| &**b)
    }
}
