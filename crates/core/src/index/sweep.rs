//! Sweeps: TTL expiry, quota trims and the index-wide entry cap, and the single
//! eviction step they share with ingest near quota.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use super::Index;
use super::scope::ScopeIndex;
use super::tenant::{TenantIndex, TenantLimits, TenantWriter};
use super::view::Counters;
use crate::policy::EvictionAlgorithm;
use crate::time::Timestamp;

impl Index {
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
                scope.pending.purge(now);
                let aged_out = scope.prefills.purge(Timestamp(now));
                Counters::add(&self.counters.inflight_aged_out, aged_out);
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
                    if self.evict_some(
                        &tenant,
                        &mut writer,
                        limits.eviction,
                        excess,
                        &self.counters.evicted_quota,
                    ) == 0
                    {
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
                let excess = self.total_entries().saturating_sub(self.config.max_entries);
                let went = self.evict_some(
                    largest,
                    &mut writer,
                    algo,
                    (batch - evicted).min(excess),
                    &self.counters.evicted_cap,
                );
                if went == 0 {
                    break;
                }
                evicted += went;
            }
            if evicted == 0 {
                return;
            }
        }
    }

    /// Evicts up to `wanted` (at least one) of the tenant's next victims:
    /// under LRU a shard's victims go together in bounded holds, under LFU one
    /// at a time (a credited victim may still precede the rest of the cache,
    /// so each one is checked on its own). Returns how many went.
    fn evict_some(
        &self,
        tenant: &TenantIndex,
        writer: &mut TenantWriter,
        algo: EvictionAlgorithm,
        wanted: u64,
        cause: &AtomicU64,
    ) -> u64 {
        self.evict_with(tenant, cause, |scopes| match algo {
            EvictionAlgorithm::Lru => {
                writer
                    .victims
                    .evict_lru_batch(scopes, tenant.entries(), wanted)
            }
            EvictionAlgorithm::Lfu => u64::from(
                writer
                    .victims
                    .evict_next(scopes, algo, tenant.entries(), wanted)
                    .is_some(),
            ),
        })
    }

    pub(super) fn evict_one(
        &self,
        tenant: &TenantIndex,
        writer: &mut TenantWriter,
        algo: EvictionAlgorithm,
        wanted: u64,
        cause: &AtomicU64,
    ) -> bool {
        self.evict_with(tenant, cause, |scopes| {
            u64::from(
                writer
                    .victims
                    .evict_next(scopes, algo, tenant.entries(), wanted)
                    .is_some(),
            )
        }) > 0
    }

    /// Runs one eviction over the tenant's scopes and books what went.
    fn evict_with(
        &self,
        tenant: &TenantIndex,
        cause: &AtomicU64,
        evict: impl FnOnce(&[Arc<ScopeIndex>]) -> u64,
    ) -> u64 {
        let scopes = tenant.scopes.load_full();
        let went = evict(&scopes);
        self.sub_entries(tenant, went);
        Counters::add(cause, went);
        went
    }
}
