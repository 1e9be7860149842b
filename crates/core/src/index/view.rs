//! Read-only views of the index for `/snapshot`, status and metrics, and the
//! counters of everything evicted or refused.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::event::ReplicaStats;
use crate::scope::PROBE_TENANT;
use crate::time::Timestamp;

/// One replica row of `/snapshot`, keyed by (tenant, replica id, model, scheme).
#[derive(Clone, Debug, PartialEq)]
pub struct ReplicaView {
    pub tenant: String,
    pub replica_id: String,
    pub model: String,
    pub hash_scheme: String,
    /// Where it is routed to; `None` for a prefix-only replica.
    pub endpoint: Option<String>,
    pub serving: bool,
    pub prefix_count: u64,
    pub last_event_at: Option<Timestamp>,
    /// The last ReportStats and when it came.
    pub stats: Option<(ReplicaStats, Timestamp)>,
    /// Requests this sidecar routed here whose prefill has not ended, and their
    /// uncached prompt tokens (the load rule's own signal).
    pub inflight_requests: u64,
    pub inflight_tokens: u64,
    /// With fleet sync: the other sidecars' routes in flight here, and the
    /// uncached tokens of those still prefilling (the load rule adds them to
    /// this sidecar's own).
    pub peer_inflight_requests: u64,
    pub peer_inflight_tokens: u64,
    /// Requests routed here lately (this sidecar's, and other sidecars' as the
    /// engine's scrapes show them), a count halving every 10 s (the load rule's
    /// share bound reads it).
    pub recent_requests: f64,
}

/// One tenant's entry count.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TenantEntries {
    pub tenant: String,
    pub index_entries: u64,
}

/// The whole index as `/snapshot` shows it. The probe tenant is never included.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct IndexView {
    pub total_entries: u64,
    /// Of those, entries stored before their chain's parent (the orphan shards,
    /// see `scope.rs`): while a scope has any, its lookups read that shard too.
    pub orphan_entries: u64,
    pub replicas: Vec<ReplicaView>,
    pub tenants: Vec<TenantEntries>,
}

/// Monotonic counters, by cause.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub stored_blocks: AtomicU64,
    pub removed_blocks: AtomicU64,
    pub evicted_ttl: AtomicU64,
    pub evicted_cap: AtomicU64,
    pub evicted_quota: AtomicU64,
    pub refused_quota: AtomicU64,
    pub dropped_cleared: AtomicU64,
    pub rejected_events: AtomicU64,
    pub inflight_ended_by_event: AtomicU64,
    pub inflight_aged_out: AtomicU64,
}

impl Counters {
    pub fn add(counter: &AtomicU64, n: u64) {
        if n > 0 {
            counter.fetch_add(n, Ordering::Relaxed);
        }
    }

    /// Lowers a count (entries) by `n`, never below 0.
    pub fn sub(counter: &AtomicU64, n: u64) {
        if n > 0 {
            let _ = counter.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |c| {
                Some(c.saturating_sub(n))
            });
        }
    }

    pub fn view(&self) -> CountersView {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        CountersView {
            stored_blocks: get(&self.stored_blocks),
            removed_blocks: get(&self.removed_blocks),
            evicted_ttl: get(&self.evicted_ttl),
            evicted_cap: get(&self.evicted_cap),
            evicted_quota: get(&self.evicted_quota),
            refused_quota: get(&self.refused_quota),
            dropped_cleared: get(&self.dropped_cleared),
            rejected_events: get(&self.rejected_events),
            inflight_ended_by_event: get(&self.inflight_ended_by_event),
            inflight_aged_out: get(&self.inflight_aged_out),
        }
    }
}

/// A copy of the counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CountersView {
    /// Blocks in applied BlocksStored events (including refreshes).
    pub stored_blocks: u64,
    /// Blocks in applied BlocksRemoved events.
    pub removed_blocks: u64,
    /// Entries removed by the TTL sweep.
    pub evicted_ttl: u64,
    /// Entries removed by the cap sweep.
    pub evicted_cap: u64,
    /// Entries a tenant at quota evicted to make room for its own new ones.
    pub evicted_quota: u64,
    /// New entries refused because the tenant's quota is 0.
    pub refused_quota: u64,
    /// Entries dropped by AllBlocksCleared or a replica's removal.
    pub dropped_cleared: u64,
    /// Malformed events counted and ignored.
    pub rejected_events: u64,
    /// Routed requests whose in-flight count their engine's event ended (it
    /// stored the request's last block: `Router::admit_until_prefill_end`).
    pub inflight_ended_by_event: u64,
    /// Such requests whose event never came within `INFLIGHT_AGE_OUT`.
    pub inflight_aged_out: u64,
}

impl super::Index {
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
                view.orphan_entries += s.orphan_entries();
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
                        inflight_requests: r.live.load.inflight_requests(),
                        inflight_tokens: r.live.load.own_inflight_tokens(),
                        peer_inflight_requests: r.live.load.peer_requests(),
                        peer_inflight_tokens: r.live.load.peer_tokens(),
                        recent_requests: r.live.load.recent_requests(now),
                    });
                }
            }
        }
        view
    }
}
