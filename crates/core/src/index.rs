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
//! Locking, in the only order ever taken: a tenant's writer lock, then one shard
//! lock of a scope at a time (lookups take only their chain's shard's read lock,
//! once, and the orphan shard's while it has entries; see `scope.rs`). So a
//! tenant's ingest never waits for another tenant's, lookups never wait for
//! writers of other chains, and a lookup waits at most for the block or key a
//! writer or sweep of its own shard is on (see `shard.rs`).
//!
//! Stamps: each stored entry gets a per-tenant strictly increasing nanosecond stamp
//! (the event's time, bumped past the previous stamp). Within one BlocksStored the
//! tail gets the oldest stamp, so at equal time LRU evicts leaves before the blocks
//! they extend, as the engines themselves do.
//!
//! Where things are: `tenant` (the directory and entry counts), `ingest` (events,
//! quota on the way in), `membership` (declared replicas, dropping one), `sweep`
//! (TTL, quota trims, the entry cap), `view` (what `/snapshot` and status read);
//! below them `scope` (one scope: its shards, where a run goes), `shard` (one
//! store and its lock, the bounded holds), `store`, `entry`, `eviction`
//! (LRU/LFU victims), `leading_run`, `pending` and `lock` (`ReaderFirst`).

mod entry;
pub mod event;
mod eviction;
mod ingest;
mod leading_run;
mod lock;
mod membership;
mod pending;
mod replica;
pub mod scope;
mod shard;
mod store;
mod sweep;
mod tenant;
pub mod view;

#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use arc_swap::ArcSwap;
use hashbrown::HashMap;
use parking_lot::Mutex;

use store::Padded;

pub use event::{
    IndexEvent, IngestBatch, IngestError, IngestOutcome, ReplicaStats, StatsReport, Tier,
};
pub use lock::contended_reads;
pub use pending::{MAX_PENDING_BLOCKS, PENDING_TTL_NANOS};
pub use replica::{ReplicaTable, replica_id_hash};
pub use scope::ScopeIndex;
pub use view::{CountersView, IndexView, ReplicaView, TenantEntries};

pub(crate) use pending::Pending;
pub(crate) use replica::ServingSet;
pub(crate) use store::prefix_seed;
pub use tenant::TenantLimits;

use tenant::TenantIndex;
use view::Counters;

use crate::scope::{PROBE_TENANT, ScopeRef};

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

/// Where a request's scope stands in the index (docs/decision.md, "The steps", step 6).
pub(crate) enum Classified {
    GloballyEmpty,
    UnknownTenant,
    UnknownModel,
    UnknownHashScheme,
    Known(Arc<ScopeIndex>),
}

/// The index of every scope.
pub struct Index {
    config: IndexConfig,
    tenants: ArcSwap<HashMap<Arc<str>, Arc<TenantIndex>>>,
    directory_lock: Mutex<()>,
    /// Bumped by writers, so on cache lines of their own: lookups load `tenants`.
    total_entries: Padded<AtomicU64>,
    counters: Padded<Counters>,
    cap_sweep: Mutex<()>,
}

impl Index {
    pub fn new(config: IndexConfig) -> Self {
        Self {
            config,
            tenants: ArcSwap::from_pointee(HashMap::new()),
            directory_lock: Mutex::new(()),
            total_entries: Padded(AtomicU64::new(0)),
            counters: Padded::default(),
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
        let tenants = self.tenants.load();
        let tenant = tenants.get(scope.tenant);
        // The usual answer first: a known scope has a serving replica or usable
        // entries, so the index is not globally empty and the rest is moot.
        let known = |s: &&Arc<ScopeIndex>| {
            &*s.key.model == scope.model
                && &*s.key.hash_scheme == scope.hash_scheme
                && s.is_known(now, ttl)
        };
        if let Some(s) = tenant.and_then(|t| t.scopes.load().iter().find(known).cloned()) {
            return Classified::Known(s);
        }
        if self.is_globally_empty(scope.tenant) {
            return Classified::GloballyEmpty;
        }
        let Some(tenant) = tenant else {
            return Classified::UnknownTenant;
        };
        let (mut tenant_known, mut model_known) = (false, false);
        for s in tenant.scopes.load().iter() {
            if !s.is_known(now, ttl) {
                continue;
            }
            // (A known scope with the requested scheme was answered above.)
            tenant_known = true;
            model_known |= &*s.key.model == scope.model;
        }
        match (tenant_known, model_known) {
            (false, _) => Classified::UnknownTenant,
            (true, false) => Classified::UnknownModel,
            (true, true) => Classified::UnknownHashScheme,
        }
    }
}
