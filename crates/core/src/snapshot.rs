//! The immutable policy snapshot: tenant → namespace → resolved policy, plus the
//! declared backends (scopes and their static or discovered replicas).
//!
//! A snapshot is built whole by a policy source (file or Kubernetes), then swapped
//! in atomically by [`super::Router`]; a request reads exactly one snapshot from
//! start to end, and its revision is echoed on every decision.

use std::collections::{BTreeMap, HashMap};
use std::hash::BuildHasher;
use std::sync::Arc;

use super::policy::ResolvedPolicy;
use super::scope::{PROBE_TENANT, ScopeKey};

/// One namespace as the policy sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct NamespacePolicy {
    pub namespace: String,
    /// The effective CacheTenant's `spec.tenantID`, if the namespace has one.
    pub tenant_id: Option<String>,
    /// The effective CachePolicy's name; `None` means the server defaults apply.
    pub policy_name: Option<String>,
    pub policy: Arc<ResolvedPolicy>,
    /// `spec.quota.maxIndexEntries`; `None` means unlimited.
    pub max_index_entries: Option<u64>,
    /// The tenant's `spec.weight` when its `isolationMode` is `Fairness`: its
    /// share of held requests' tokens under flow control. `None` (no tenant, or
    /// no isolation mode) queues its held requests first come, first served.
    pub fair_weight: Option<u32>,
}

/// A replica declared by configuration (static endpoint or discovered pod).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct DeclaredReplica {
    pub id: String,
    /// `host:port` written into the routing header.
    pub address: String,
    /// Where the engine's KV events come from (`tcp://host:port`), if any.
    pub kv_events_endpoint: Option<String>,
    pub kv_replay_endpoint: Option<String>,
    /// Data-parallel ranks behind the replica (1 without DP): rank r publishes on
    /// the event endpoint's port + r and replays on the replay endpoint's port + r.
    /// The replica holds the union of its ranks' blocks.
    pub data_parallel_size: u32,
}

/// A CacheBackend resolved to its scope.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct BackendDecl {
    pub namespace: String,
    pub name: String,
    pub scope: ScopeKey,
    pub engine: String,
    pub block_size: u32,
    pub kv_events_topic: String,
    pub replicas: Vec<DeclaredReplica>,
    /// `spec.loraAdapters`: model names that are adapters of this backend's model.
    pub lora_adapters: Vec<String>,
}

/// What the decision needs to know about one tenant.
#[derive(Clone, Debug)]
pub struct TenantView<'a> {
    /// `None` when no CacheTenant claims the tenant id (server defaults apply).
    pub namespace: Option<&'a str>,
    pub policy: &'a Arc<ResolvedPolicy>,
    pub max_index_entries: Option<u64>,
    /// The tenant's weight under `isolationMode: Fairness` (see
    /// [`NamespacePolicy::fair_weight`]).
    pub fair_weight: Option<u32>,
}

/// An immutable, complete view of the configuration.
#[derive(Debug)]
pub struct PolicySnapshot {
    revision: Arc<str>,
    defaults: Arc<ResolvedPolicy>,
    probe_policy: Arc<ResolvedPolicy>,
    namespaces: BTreeMap<String, NamespacePolicy>,
    by_tenant: HashMap<String, String>,
    backends: Vec<BackendDecl>,
}

impl PolicySnapshot {
    /// Builds a snapshot; the revision is a stable hash of the content, so the same
    /// configuration always carries the same revision.
    pub fn new(
        defaults: ResolvedPolicy,
        namespaces: Vec<NamespacePolicy>,
        backends: Vec<BackendDecl>,
    ) -> Self {
        let mut by_tenant = HashMap::new();
        let mut map = BTreeMap::new();
        for ns in namespaces {
            if let Some(t) = &ns.tenant_id {
                by_tenant.insert(t.clone(), ns.namespace.clone());
            }
            map.insert(ns.namespace.clone(), ns);
        }
        let mut backends = backends;
        backends.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
        let revision = Self::revision_of(&defaults, &map, &backends);
        // The self-test probe scores a synthetic overlap: it runs with the floors
        // opened so the result does not depend on the operator's floors.
        let probe_policy = ResolvedPolicy {
            minimum_matched_tokens: 0,
            routing_floor_score: "0".parse().unwrap_or_default(),
            ..ResolvedPolicy::default()
        };
        Self {
            revision: Arc::from(revision),
            defaults: Arc::new(defaults),
            probe_policy: Arc::new(probe_policy),
            namespaces: map,
            by_tenant,
            backends,
        }
    }

    /// A snapshot with only server defaults: no tenants, no backends.
    pub fn empty() -> Self {
        Self::new(ResolvedPolicy::default(), Vec::new(), Vec::new())
    }

    fn revision_of(
        defaults: &ResolvedPolicy,
        namespaces: &BTreeMap<String, NamespacePolicy>,
        backends: &[BackendDecl],
    ) -> String {
        // Debug output of plain data is deterministic; a fixed-seed hash of it is a
        // stable content revision.
        let text = format!("{defaults:?}|{namespaces:?}|{backends:?}");
        let h = foldhash::fast::FixedState::with_seed(0x1c_ac4e).hash_one(&text);
        format!("r{h:016x}")
    }

    pub fn revision(&self) -> &Arc<str> {
        &self.revision
    }

    pub fn defaults(&self) -> &Arc<ResolvedPolicy> {
        &self.defaults
    }

    pub fn namespaces(&self) -> impl Iterator<Item = &NamespacePolicy> {
        self.namespaces.values()
    }

    pub fn namespace(&self, name: &str) -> Option<&NamespacePolicy> {
        self.namespaces.get(name)
    }

    pub fn backends(&self) -> &[BackendDecl] {
        &self.backends
    }

    /// Tenant → namespace → policy. Unknown tenants get the server defaults and no
    /// quota; the probe tenant gets its fixed self-test policy.
    pub fn tenant(&self, tenant_id: &str) -> TenantView<'_> {
        if tenant_id == PROBE_TENANT {
            return TenantView {
                namespace: None,
                policy: &self.probe_policy,
                max_index_entries: None,
                fair_weight: None,
            };
        }
        match self
            .by_tenant
            .get(tenant_id)
            .and_then(|ns| self.namespaces.get(ns))
        {
            Some(ns) => TenantView {
                namespace: Some(&ns.namespace),
                policy: &ns.policy,
                max_index_entries: ns.max_index_entries,
                fair_weight: ns.fair_weight,
            },
            None => TenantView {
                namespace: None,
                policy: &self.defaults,
                max_index_entries: None,
                fair_weight: None,
            },
        }
    }

    /// The namespace whose CacheTenant claims `tenant_id`.
    pub fn namespace_of(&self, tenant_id: &str) -> Option<&str> {
        self.by_tenant.get(tenant_id).map(String::as_str)
    }
}

#[cfg(test)]
mod tests;
