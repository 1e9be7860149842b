//! The tenant directory: each tenant's scopes, its writer (stamp clock and victim
//! cache) and its entry count, which quota and status speak of.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use arc_swap::ArcSwap;
use hashbrown::HashMap;
use parking_lot::Mutex;

use super::Index;
use super::eviction::VictimCache;
use super::scope::ScopeIndex;
use super::store::Padded;
use super::view::Counters;
use crate::policy::EvictionAlgorithm;
use crate::scope::ScopeRef;

/// What ingest and sweeps need from a tenant's policy.
#[derive(Clone, Copy, Debug)]
pub struct TenantLimits {
    pub ttl_nanos: u64,
    pub eviction: EvictionAlgorithm,
    /// `spec.quota.maxIndexEntries`; `None` = unlimited.
    pub max_entries: Option<u64>,
}

pub(crate) struct TenantWriter {
    clock: u64,
    pub(super) victims: VictimCache,
}

impl TenantWriter {
    /// Reserves `n` strictly increasing stamps at or after `now`; returns the first.
    pub(super) fn reserve(&mut self, now: u64, n: usize) -> u64 {
        let base = now.max(self.clock.saturating_add(1));
        self.clock = base.saturating_add(n as u64).saturating_sub(1);
        base
    }
}

/// One tenant's part of the index.
pub(crate) struct TenantIndex {
    pub(super) id: Arc<str>,
    pub(super) scopes: ArcSwap<Vec<Arc<ScopeIndex>>>,
    /// Taken by every event, so on cache lines of its own: lookups load `scopes`.
    pub(super) writer: Padded<Mutex<TenantWriter>>,
    entries: Padded<AtomicU64>,
}

impl TenantIndex {
    pub(super) fn new(id: &str) -> Self {
        Self {
            id: Arc::from(id),
            scopes: ArcSwap::from_pointee(Vec::new()),
            writer: Padded(Mutex::new(TenantWriter {
                clock: 0,
                victims: VictimCache::default(),
            })),
            entries: Padded(AtomicU64::new(0)),
        }
    }

    pub(super) fn entries(&self) -> u64 {
        self.entries.load(Ordering::Relaxed)
    }

    pub(super) fn find_scope(&self, model: &str, hash_scheme: &str) -> Option<Arc<ScopeIndex>> {
        self.scopes
            .load()
            .iter()
            .find(|s| &*s.key.model == model && &*s.key.hash_scheme == hash_scheme)
            .cloned()
    }
}

impl Index {
    pub(super) fn tenant(&self, id: &str) -> Option<Arc<TenantIndex>> {
        self.tenants.load().get(id).cloned()
    }

    pub(super) fn tenant_or_create(&self, id: &str) -> Arc<TenantIndex> {
        if let Some(t) = self.tenant(id) {
            return t;
        }
        let _guard = self.directory_lock.lock();
        let current = self.tenants.load();
        if let Some(t) = current.get(id) {
            return t.clone();
        }
        let tenant = Arc::new(TenantIndex::new(id));
        let mut next = HashMap::clone(&current);
        next.insert(tenant.id.clone(), tenant.clone());
        self.tenants.store(Arc::new(next));
        tenant
    }

    pub(super) fn scope_or_create(
        &self,
        tenant: &TenantIndex,
        scope: ScopeRef<'_>,
    ) -> Arc<ScopeIndex> {
        if let Some(s) = tenant.find_scope(scope.model, scope.hash_scheme) {
            return s;
        }
        let _guard = self.directory_lock.lock();
        if let Some(s) = tenant.find_scope(scope.model, scope.hash_scheme) {
            return s;
        }
        let created = Arc::new(ScopeIndex::new(scope.to_owned()));
        let mut next = Vec::clone(&tenant.scopes.load());
        next.push(created.clone());
        tenant.scopes.store(Arc::new(next));
        created
    }

    /// Every scope of every tenant but the self-test's: the fleet, for a request
    /// that names no scope (ORIGINAL_DST's last resort).
    pub fn fleet_scopes(&self) -> Vec<Arc<ScopeIndex>> {
        self.tenants
            .load()
            .values()
            .filter(|t| &*t.id != crate::scope::PROBE_TENANT)
            .flat_map(|t| t.scopes.load().iter().cloned().collect::<Vec<_>>())
            .collect()
    }

    /// The scope, if it exists (known or not).
    pub fn scope(&self, scope: ScopeRef<'_>) -> Option<Arc<ScopeIndex>> {
        self.tenant(scope.tenant)?
            .find_scope(scope.model, scope.hash_scheme)
    }

    pub(super) fn add_entries(&self, tenant: &TenantIndex, n: u64) {
        if n > 0 {
            tenant.entries.fetch_add(n, Ordering::Relaxed);
            self.total_entries.fetch_add(n, Ordering::Relaxed);
        }
    }

    pub(super) fn sub_entries(&self, tenant: &TenantIndex, n: u64) {
        Counters::sub(&tenant.entries, n);
        Counters::sub(&self.total_entries, n);
    }
}
