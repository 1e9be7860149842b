//! The index: which replica holds which block-hash chains, per scope.
//!
//! ```text
//! Index
//!  └─ tenants: ArcSwap<map tenant → TenantIndex>      lock-free for lookups
//!      TenantIndex
//!       ├─ writer: Mutex<TenantWriter>   serialises this tenant's mutations
//!       │    (stamp clock, victim cache); lookups never take it
//!       ├─ entries: AtomicU64             what quota and status speak of
//!       └─ scopes: ArcSwap<[ScopeIndex]>  one per (model, hash_scheme)
//! ```
//!
//! Locking, in the only order ever taken: a tenant's writer lock, then a scope's
//! store lock (lookups take only the store's read lock, once). So a tenant's ingest
//! never waits for another tenant's, and readers wait at most for one batch of 4
//! blocks written or 256 keys swept, since writers release the lock between batches.
//!
//! Stamps: each stored entry gets a per-tenant strictly increasing nanosecond stamp
//! (the event's time, bumped past the previous stamp). Within one BlocksStored the
//! tail gets the oldest stamp, so at equal time LRU evicts leaves before the blocks
//! they extend, as the engines themselves do.

mod entry;
pub mod event;
mod eviction;
mod leading_run;
mod lock;
mod replica;
pub mod scope;
mod store;
pub mod view;

#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use arc_swap::ArcSwap;
use hashbrown::HashMap;
use parking_lot::Mutex;

pub use event::{IndexEvent, IngestBatch, IngestError, IngestOutcome, ReplicaStats, StatsReport};
pub use replica::{ReplicaTable, replica_id_hash};
pub use scope::ScopeIndex;
pub use view::{CountersView, IndexView, ReplicaView, TenantEntries};

pub(crate) use replica::{ReplicaLive, ServingSet};
pub(crate) use store::prefix_seed;

use eviction::VictimCache;
use store::EntryKey;
use view::Counters;

use crate::policy::EvictionAlgorithm;
use crate::scope::{PROBE_TENANT, ScopeRef};
use crate::time::Timestamp;

/// Index-wide settings (server flags).
#[derive(Clone, Copy, Debug)]
pub struct IndexConfig {
    /// The entry cap; the cap sweep evicts down to it. `u64::MAX` = no cap.
    pub max_entries: u64,
}

impl Default for IndexConfig {
    fn default() -> Self {
        Self {
            max_entries: 10_000_000,
        }
    }
}

/// What ingest and sweeps need from a tenant's policy.
#[derive(Clone, Copy, Debug)]
pub struct TenantLimits {
    pub ttl_nanos: u64,
    pub eviction: EvictionAlgorithm,
    /// `spec.quota.maxIndexEntries`; `None` = unlimited.
    pub max_entries: Option<u64>,
}

/// Where a request's scope stands in the index (contract §4 step 6).
pub(crate) enum Classified {
    GloballyEmpty,
    UnknownTenant,
    UnknownModel,
    UnknownHashScheme,
    Known(Arc<ScopeIndex>),
}

pub(crate) struct TenantWriter {
    clock: u64,
    victims: VictimCache,
}

impl TenantWriter {
    /// Reserves `n` strictly increasing stamps at or after `now`; returns the first.
    fn reserve(&mut self, now: u64, n: usize) -> u64 {
        let base = now.max(self.clock.saturating_add(1));
        self.clock = base.saturating_add(n as u64).saturating_sub(1);
        base
    }
}

/// One tenant's part of the index.
pub(crate) struct TenantIndex {
    id: Arc<str>,
    scopes: ArcSwap<Vec<Arc<ScopeIndex>>>,
    writer: Mutex<TenantWriter>,
    entries: AtomicU64,
}

impl TenantIndex {
    fn new(id: &str) -> Self {
        Self {
            id: Arc::from(id),
            scopes: ArcSwap::from_pointee(Vec::new()),
            writer: Mutex::new(TenantWriter {
                clock: 0,
                victims: VictimCache::default(),
            }),
            entries: AtomicU64::new(0),
        }
    }

    fn entries(&self) -> u64 {
        self.entries.load(Ordering::Relaxed)
    }

    fn find_scope(&self, model: &str, hash_scheme: &str) -> Option<Arc<ScopeIndex>> {
        self.scopes
            .load()
            .iter()
            .find(|s| &*s.key.model == model && &*s.key.hash_scheme == hash_scheme)
            .cloned()
    }
}

/// The index of every scope.
pub struct Index {
    config: IndexConfig,
    tenants: ArcSwap<HashMap<Arc<str>, Arc<TenantIndex>>>,
    directory_lock: Mutex<()>,
    total_entries: AtomicU64,
    counters: Counters,
    cap_sweep: Mutex<()>,
}

impl Index {
    pub fn new(config: IndexConfig) -> Self {
        Self {
            config,
            tenants: ArcSwap::from_pointee(HashMap::new()),
            directory_lock: Mutex::new(()),
            total_entries: AtomicU64::new(0),
            counters: Counters::default(),
            cap_sweep: Mutex::new(()),
        }
    }

    pub fn config(&self) -> &IndexConfig {
        &self.config
    }

    /// Distinct entries across every scope.
    pub fn total_entries(&self) -> u64 {
        self.total_entries.load(Ordering::Relaxed)
    }

    /// A tenant's entry count (0 when unknown).
    pub fn tenant_entries(&self, tenant: &str) -> u64 {
        self.tenants.load().get(tenant).map_or(0, |t| t.entries())
    }

    pub fn counters(&self) -> CountersView {
        self.counters.view()
    }

    fn tenant(&self, id: &str) -> Option<Arc<TenantIndex>> {
        self.tenants.load().get(id).cloned()
    }

    fn tenant_or_create(&self, id: &str) -> Arc<TenantIndex> {
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

    fn scope_or_create(&self, tenant: &TenantIndex, scope: ScopeRef<'_>) -> Arc<ScopeIndex> {
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

    /// The scope, if it exists (known or not).
    pub fn scope(&self, scope: ScopeRef<'_>) -> Option<Arc<ScopeIndex>> {
        self.tenant(scope.tenant)?
            .find_scope(scope.model, scope.hash_scheme)
    }

    /// No replica and no entry, the self-test's probe tenant aside (a probe
    /// running concurrently must not change a real request's answer).
    fn is_globally_empty(&self, requester: &str) -> bool {
        let tenants = self.tenants.load();
        let probe_entries = match requester {
            PROBE_TENANT => 0,
            _ => tenants.get(PROBE_TENANT).map_or(0, |t| t.entries()),
        };
        if self.total_entries() > probe_entries {
            return false;
        }
        !tenants
            .values()
            .filter(|t| requester == PROBE_TENANT || &*t.id != PROBE_TENANT)
            .any(|t| t.scopes.load().iter().any(|s| s.table().len() > 0))
    }

    /// Contract §4 step 6. `ttl` is the requesting tenant's evictionTTL (ns).
    pub(crate) fn classify(&self, scope: ScopeRef<'_>, now: u64, ttl: u64) -> Classified {
        if self.is_globally_empty(scope.tenant) {
            return Classified::GloballyEmpty;
        }
        let tenants = self.tenants.load();
        let Some(tenant) = tenants.get(scope.tenant) else {
            return Classified::UnknownTenant;
        };
        let (mut tenant_known, mut model_known) = (false, false);
        for s in tenant.scopes.load().iter() {
            if !s.is_known(now, ttl) {
                continue;
            }
            tenant_known = true;
            if &*s.key.model == scope.model {
                model_known = true;
                if &*s.key.hash_scheme == scope.hash_scheme {
                    return Classified::Known(s.clone());
                }
            }
        }
        match (tenant_known, model_known) {
            (false, _) => Classified::UnknownTenant,
            (true, false) => Classified::UnknownModel,
            (true, true) => Classified::UnknownHashScheme,
        }
    }

    /// Applies one replica's events in order (IngestEvents, engine subscribers).
    pub fn ingest(
        &self,
        batch: &IngestBatch<'_>,
        limits: &TenantLimits,
        now: Timestamp,
    ) -> Result<IngestOutcome, IngestError> {
        if !batch.scope.is_well_formed() {
            return Err(IngestError::MalformedScope);
        }
        if batch.replica_id.is_empty() {
            return Err(IngestError::MissingReplica);
        }
        let now = now.as_nanos();
        let tenant = self.tenant_or_create(batch.scope.tenant);
        let scope = self.scope_or_create(&tenant, batch.scope);
        let mut outcome = IngestOutcome::default();
        let mut writer = tenant.writer.lock();
        let (slot, live) =
            scope.resolve_replica(batch.replica_id, batch.endpoint, now, scope::Touch::Event);
        for event in batch.events {
            if !event.is_valid() {
                outcome.rejected += 1;
                continue;
            }
            outcome.applied += 1;
            match event {
                IndexEvent::Stored { parent, hashes, .. } => {
                    Counters::add(&self.counters.stored_blocks, hashes.len() as u64);
                    self.store_blocks(
                        &tenant,
                        &mut writer,
                        &scope,
                        slot,
                        &live,
                        *parent,
                        hashes,
                        limits,
                        now,
                    );
                }
                IndexEvent::Removed { hashes } => {
                    Counters::add(&self.counters.removed_blocks, hashes.len() as u64);
                    let removed = scope.remove_blocks(slot, &live, hashes);
                    self.sub_entries(&tenant, removed);
                }
                IndexEvent::Cleared => {
                    let removed = scope.clear_replica(slot, &live);
                    Counters::add(&self.counters.dropped_cleared, removed);
                    self.sub_entries(&tenant, removed);
                }
                IndexEvent::PrefixStored {
                    prefix_hash,
                    token_count,
                } => {
                    let key = EntryKey::Prefix(prefix_hash.as_str().into());
                    self.store_keys(
                        &tenant,
                        &mut writer,
                        &scope,
                        slot,
                        &live,
                        None,
                        std::slice::from_ref(&key),
                        *token_count,
                        limits,
                        now,
                    );
                }
            }
        }
        drop(writer);
        Counters::add(&self.counters.rejected_events, u64::from(outcome.rejected));
        Ok(outcome)
    }

    #[allow(clippy::too_many_arguments)]
    fn store_blocks(
        &self,
        tenant: &TenantIndex,
        writer: &mut TenantWriter,
        scope: &ScopeIndex,
        slot: u32,
        live: &replica::ReplicaLive,
        parent: Option<u64>,
        hashes: &[u64],
        limits: &TenantLimits,
        now: u64,
    ) {
        let fits = limits
            .max_entries
            .is_none_or(|q| tenant.entries().saturating_add(hashes.len() as u64) <= q);
        if fits {
            let n = hashes.len();
            let base = writer.reserve(now, n);
            let created =
                scope.insert_blocks(slot, live, parent, hashes, |i| base + (n - 1 - i) as u64);
            if created > 0 {
                writer.victims.note_insert();
            }
            self.add_entries(tenant, created);
            return;
        }
        let keys: Vec<EntryKey> = hashes.iter().map(|&h| EntryKey::Block(h)).collect();
        self.store_keys(
            tenant, writer, scope, slot, live, parent, &keys, 0, limits, now,
        );
    }

    /// The slow path near quota: one key at a time, evicting the tenant's own next
    /// victim before each new entry, so the quota is never exceeded.
    #[allow(clippy::too_many_arguments)]
    fn store_keys(
        &self,
        tenant: &TenantIndex,
        writer: &mut TenantWriter,
        scope: &ScopeIndex,
        slot: u32,
        live: &replica::ReplicaLive,
        parent: Option<u64>,
        keys: &[EntryKey],
        token_count: u32,
        limits: &TenantLimits,
        now: u64,
    ) {
        let n = keys.len();
        let base = writer.reserve(now, n);
        // Tail first: at equal time the tail is the oldest, so a tenant at quota
        // evicts the tail of its own chain before the blocks it extends.
        for (i, key) in keys.iter().enumerate().rev() {
            let stamp = base + (n - 1 - i) as u64;
            if let Some(quota) = limits.max_entries
                && !scope.contains(key)
            {
                if quota == 0 {
                    Counters::add(&self.counters.refused_quota, 1);
                    continue;
                }
                let mut refused = false;
                while tenant.entries() >= quota {
                    if !self.evict_one(
                        tenant,
                        writer,
                        limits.eviction,
                        1,
                        &self.counters.evicted_quota,
                    ) {
                        refused = true;
                        break;
                    }
                }
                if refused {
                    Counters::add(&self.counters.refused_quota, 1);
                    continue;
                }
            }
            // The chain's previous block (the parent for block 0) lets a block
            // join its predecessor's run.
            let prev = match i {
                0 => parent,
                _ => match &keys[i - 1] {
                    EntryKey::Block(h) => Some(*h),
                    EntryKey::Prefix(_) => None,
                },
            };
            if scope.insert_one(slot, live, key, prev, token_count, stamp) {
                writer.victims.note_insert();
                self.add_entries(tenant, 1);
            }
        }
    }

    fn evict_one(
        &self,
        tenant: &TenantIndex,
        writer: &mut TenantWriter,
        algo: EvictionAlgorithm,
        wanted: u64,
        cause: &AtomicU64,
    ) -> bool {
        let scopes = tenant.scopes.load_full();
        match writer
            .victims
            .evict_next(&scopes, algo, tenant.entries(), wanted)
        {
            Some(_) => {
                self.sub_entries(tenant, 1);
                Counters::add(cause, 1);
                true
            }
            None => false,
        }
    }

    fn add_entries(&self, tenant: &TenantIndex, n: u64) {
        if n > 0 {
            tenant.entries.fetch_add(n, Ordering::Relaxed);
            self.total_entries.fetch_add(n, Ordering::Relaxed);
        }
    }

    fn sub_entries(&self, tenant: &TenantIndex, n: u64) {
        if n > 0 {
            let sub = |c: &AtomicU64| {
                let _ = c.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
                    Some(v.saturating_sub(n))
                });
            };
            sub(&tenant.entries);
            sub(&self.total_entries);
        }
    }

    /// Records ReportStats (and registers the replica when an endpoint is given).
    pub fn report_stats(
        &self,
        report: &StatsReport<'_>,
        now: Timestamp,
    ) -> Result<(), IngestError> {
        if !report.scope.is_well_formed() {
            return Err(IngestError::MalformedScope);
        }
        if report.replica_id.is_empty() {
            return Err(IngestError::MissingReplica);
        }
        let tenant = self.tenant_or_create(report.scope.tenant);
        let scope = self.scope_or_create(&tenant, report.scope);
        let _writer = tenant.writer.lock();
        let (_, live) = scope.resolve_replica(
            report.replica_id,
            report.endpoint,
            now.as_nanos(),
            scope::Touch::Stats,
        );
        *live.stats.lock() = Some((report.stats, now));
        live.set_engine_queue(
            u64::from(report.stats.waiting_requests) + u64::from(report.stats.running_requests),
            now.as_nanos(),
        );
        Ok(())
    }

    /// Makes `declared` (id, address) the configured replicas of a scope. Replicas
    /// that are no longer declared lose their entries and leave the index.
    pub fn declare(&self, scope: ScopeRef<'_>, declared: &[(String, String)], now: Timestamp) {
        if !scope.is_well_formed() {
            return;
        }
        let now = now.as_nanos();
        let tenant = if declared.is_empty() {
            match self.tenant(scope.tenant) {
                Some(t) => t,
                None => return,
            }
        } else {
            self.tenant_or_create(scope.tenant)
        };
        let s = if declared.is_empty() {
            match tenant.find_scope(scope.model, scope.hash_scheme) {
                Some(s) => s,
                None => return,
            }
        } else {
            self.scope_or_create(&tenant, scope)
        };
        let mut writer = tenant.writer.lock();
        for slot in s.set_declared(declared, now) {
            self.drop_replica(&tenant, &mut writer, &s, slot, now);
        }
    }

    /// Scopes that have at least one declared replica.
    pub fn declared_scopes(&self) -> Vec<crate::scope::ScopeKey> {
        let mut out = Vec::new();
        for t in self.tenants.load().values() {
            for s in t.scopes.load().iter() {
                if s.table().iter().any(|(_, r)| r.declared.is_some()) {
                    out.push(s.key.clone());
                }
            }
        }
        out
    }

    fn drop_replica(
        &self,
        tenant: &TenantIndex,
        writer: &mut TenantWriter,
        scope: &ScopeIndex,
        slot: u32,
        now: u64,
    ) {
        let table = scope.table();
        if let Some(r) = table.get(slot) {
            let removed = scope.clear_replica(slot, &r.live);
            Counters::add(&self.counters.dropped_cleared, removed);
            self.sub_entries(tenant, removed);
        }
        scope.remove_slot(slot, now);
        writer.victims.invalidate();
    }

    /// Removes one replica (all its entries) from a scope, e.g. a ZMQ publisher
    /// that went away for good.
    pub fn remove_replica(&self, scope: ScopeRef<'_>, replica_id: &str, now: Timestamp) -> bool {
        let Some(tenant) = self.tenant(scope.tenant) else {
            return false;
        };
        let Some(s) = tenant.find_scope(scope.model, scope.hash_scheme) else {
            return false;
        };
        let mut writer = tenant.writer.lock();
        let Some(slot) = s.table().slot_of(replica_id) else {
            return false;
        };
        self.drop_replica(&tenant, &mut writer, &s, slot, now.as_nanos());
        true
    }

    /// TTL sweep of every tenant; `limits_of` gives each tenant's policy.
    /// Also trims tenants over a lowered quota and forgets idle replicas.
    pub fn sweep(&self, limits_of: &dyn Fn(&str) -> TenantLimits, now: Timestamp) {
        let now = now.as_nanos();
        let tenants: Vec<Arc<TenantIndex>> = self.tenants.load().values().cloned().collect();
        for tenant in tenants {
            let limits = limits_of(&tenant.id);
            for scope in tenant.scopes.load().iter() {
                // The writer lock is held per scope, not for the whole sweep, so the
                // tenant's ingest interleaves with a long sweep.
                let mut writer = tenant.writer.lock();
                let evicted = scope.sweep_expired(now, limits.ttl_nanos);
                Counters::add(&self.counters.evicted_ttl, evicted);
                self.sub_entries(&tenant, evicted);
                for slot in scope.idle_slots(now, limits.ttl_nanos) {
                    self.drop_replica(&tenant, &mut writer, scope, slot, now);
                }
            }
            if let Some(quota) = limits.max_entries {
                let mut writer = tenant.writer.lock();
                while tenant.entries() > quota {
                    let excess = tenant.entries() - quota;
                    if !self.evict_one(
                        &tenant,
                        &mut writer,
                        limits.eviction,
                        excess,
                        &self.counters.evicted_quota,
                    ) {
                        break;
                    }
                }
            }
        }
    }

    /// Whether the index holds more entries than its cap.
    pub fn over_cap(&self) -> bool {
        self.total_entries() > self.config.max_entries
    }

    /// Cap sweep: while over the cap, evict from the tenant holding the most
    /// entries, in that tenant's own order. Concurrent callers skip (one sweeper
    /// is enough).
    pub fn sweep_cap(&self, eviction_of: &dyn Fn(&str) -> EvictionAlgorithm) {
        let Some(_sweeper) = self.cap_sweep.try_lock() else {
            return;
        };
        while self.over_cap() {
            let tenants = self.tenants.load();
            let mut by_size: Vec<&Arc<TenantIndex>> = tenants.values().collect();
            // Largest first; ties on tenant id for a deterministic order.
            by_size.sort_by(|a, b| b.entries().cmp(&a.entries()).then_with(|| a.id.cmp(&b.id)));
            let Some(largest) = by_size.first() else {
                return;
            };
            let second = by_size.get(1).map_or(0, |t| t.entries());
            let excess = self.total_entries().saturating_sub(self.config.max_entries);
            // Evict from the largest until it is no longer the largest (or the
            // excess is gone), then pick again.
            let batch = excess
                .min(largest.entries().saturating_sub(second) + 1)
                .max(1);
            let algo = eviction_of(&largest.id);
            let mut writer = largest.writer.lock();
            let mut evicted = 0;
            while evicted < batch && self.over_cap() {
                if !self.evict_one(
                    largest,
                    &mut writer,
                    algo,
                    batch - evicted,
                    &self.counters.evicted_cap,
                ) {
                    break;
                }
                evicted += 1;
            }
            if evicted == 0 {
                return;
            }
        }
    }

    /// The index as `/snapshot` shows it (probe tenant excluded).
    pub fn view(&self, now: Timestamp, ttl_of: &dyn Fn(&str) -> u64) -> IndexView {
        let now = now.as_nanos();
        let mut view = IndexView::default();
        let tenants = self.tenants.load();
        let mut ids: Vec<&Arc<str>> = tenants.keys().collect();
        ids.sort();
        for id in ids {
            if &**id == PROBE_TENANT {
                continue;
            }
            let Some(t) = tenants.get(id) else { continue };
            view.total_entries += t.entries();
            view.tenants.push(TenantEntries {
                tenant: id.to_string(),
                index_entries: t.entries(),
            });
            let ttl = ttl_of(id);
            for s in t.scopes.load().iter() {
                for (_, r) in s.table().iter() {
                    let last = r.live.last_event_at();
                    view.replicas.push(ReplicaView {
                        tenant: id.to_string(),
                        replica_id: r.id.to_string(),
                        model: s.key.model.to_string(),
                        hash_scheme: s.key.hash_scheme.to_string(),
                        endpoint: r.endpoint().map(|e| e.to_string()),
                        serving: r.is_serving(now, ttl),
                        prefix_count: r.live.prefix_count(),
                        last_event_at: (last > 0).then_some(Timestamp(last)),
                        stats: *r.live.stats.lock(),
                        inflight_requests: r.live.inflight.load(Ordering::Relaxed),
                        inflight_tokens: r.live.inflight_tokens.load(Ordering::Relaxed),
                    });
                }
            }
        }
        view
    }
}
