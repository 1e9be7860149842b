//! Scope keys: (tenant_id, model_id, hash_scheme).
//!
//! Nothing crosses a scope: a chain hashed one way never matches a replica that
//! hashes another way, and tenant A never sees tenant B's entries.

use std::fmt;
use std::sync::Arc;

/// The reserved tenant id of the server's functional self-test. No real tenant may
/// use it (admission rejects it), and it never shows in `/snapshot`, tenant metrics
/// or any status.
pub const PROBE_TENANT: &str = "inferencecache.io/probe";

/// A borrowed scope key, as requests carry it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ScopeRef<'a> {
    pub tenant: &'a str,
    pub model: &'a str,
    pub hash_scheme: &'a str,
}

impl<'a> ScopeRef<'a> {
    pub fn new(tenant: &'a str, model: &'a str, hash_scheme: &'a str) -> Self {
        Self {
            tenant,
            model,
            hash_scheme,
        }
    }

    /// All three keys are required; an empty one makes the request malformed.
    pub fn is_well_formed(&self) -> bool {
        !self.tenant.is_empty() && !self.model.is_empty() && !self.hash_scheme.is_empty()
    }

    pub fn to_owned(self) -> ScopeKey {
        ScopeKey {
            tenant: Arc::from(self.tenant),
            model: Arc::from(self.model),
            hash_scheme: Arc::from(self.hash_scheme),
        }
    }
}

/// An owned scope key. `Arc<str>` because every replica row and snapshot line
/// shares these strings.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ScopeKey {
    pub tenant: Arc<str>,
    pub model: Arc<str>,
    pub hash_scheme: Arc<str>,
}

impl ScopeKey {
    pub fn as_ref(&self) -> ScopeRef<'_> {
        ScopeRef::new(&self.tenant, &self.model, &self.hash_scheme)
    }
}

impl fmt::Display for ScopeKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}/{}", self.tenant, self.model, self.hash_scheme)
    }
}
