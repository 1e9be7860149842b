//! Which entry goes first: the victim order of LRU and LFU, and the per-tenant
//! victim cache that makes "evict my next victim" cheap for a tenant at quota.
//!
//! Order keys (smallest is evicted first):
//! - LRU: (lastSeen, tiebreak)
//! - LFU: (accesses, lastSeen, tiebreak) — counts never age; the TTL sweep, not
//!   LFU, removes hot-but-stale entries.
//!
//! Keeping an ordered structure per entry would cost memory on every block; instead
//! a scan of the tenant's entries collects the K smallest keys into a cache (K about
//! 1/64 of the tenant), so each victim costs O(64) entries scanned amortised.
//! The cache stays exact: in LRU a newer stamp can only move an entry later, and a
//! changed entry is skipped; in LFU any change, or a new entry while the cache still
//! holds an entry with accesses, forces a rescan.

use std::collections::{BinaryHeap, VecDeque};
use std::sync::Arc;

use super::scope::ScopeIndex;
use super::store::EntryKey;
use crate::policy::EvictionAlgorithm;

/// Sort key of one entry; smaller is evicted first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct VictimOrder {
    /// Access count under LFU, always 0 under LRU.
    pub accesses: u32,
    pub last_seen: u64,
    pub tiebreak: u64,
}

impl VictimOrder {
    pub fn new(algo: EvictionAlgorithm, accesses: u32, last_seen: u64, tiebreak: u64) -> Self {
        let accesses = match algo {
            EvictionAlgorithm::Lru => 0,
            EvictionAlgorithm::Lfu => accesses,
        };
        Self {
            accesses,
            last_seen,
            tiebreak,
        }
    }
}

/// A cached victim candidate.
struct Victim {
    order: VictimOrder,
    /// (accesses, lastSeen) when scanned, to detect a change since.
    seen: (u32, u64),
    scope: Arc<ScopeIndex>,
    /// The shard the scan saw it in, where finding it again starts.
    shard: usize,
    key: EntryKey,
}

impl PartialEq for Victim {
    fn eq(&self, other: &Self) -> bool {
        self.order == other.order
    }
}
impl Eq for Victim {}
impl PartialOrd for Victim {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Victim {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.order.cmp(&other.order)
    }
}

/// The next victims of one tenant, smallest order first.
#[derive(Default)]
pub(crate) struct VictimCache {
    algo: Option<EvictionAlgorithm>,
    queue: VecDeque<Victim>,
    inserted_since_scan: bool,
}

impl VictimCache {
    /// Tell the cache that the tenant stored a new entry.
    pub fn note_insert(&mut self) {
        self.inserted_since_scan = true;
    }

    /// Drops the cache (policy change, replica removal).
    pub fn invalidate(&mut self) {
        self.queue.clear();
        self.algo = None;
    }

    /// Scans the tenant's scopes and keeps the `k` smallest entries.
    fn rescan(&mut self, scopes: &[Arc<ScopeIndex>], algo: EvictionAlgorithm, k: usize) {
        let mut heap: BinaryHeap<Victim> = BinaryHeap::with_capacity(k + 1);
        for scope in scopes {
            scope.scan_shards(|shard, key, e| {
                let accesses = e.accesses();
                let order = VictimOrder::new(algo, accesses, e.last_seen(), key.tiebreak());
                if heap.len() < k {
                    heap.push(Victim {
                        order,
                        seen: (accesses, e.last_seen()),
                        scope: scope.clone(),
                        shard,
                        key: key.to_owned(),
                    });
                } else if heap.peek().is_some_and(|top| order < top.order) {
                    heap.pop();
                    heap.push(Victim {
                        order,
                        seen: (accesses, e.last_seen()),
                        scope: scope.clone(),
                        shard,
                        key: key.to_owned(),
                    });
                }
            });
        }
        self.queue = heap.into_sorted_vec().into();
        self.algo = Some(algo);
        self.inserted_since_scan = false;
    }

    /// Evicts the tenant's next victim. Returns its scope, or `None` when the
    /// tenant holds nothing.
    pub fn evict_next(
        &mut self,
        scopes: &[Arc<ScopeIndex>],
        algo: EvictionAlgorithm,
        tenant_entries: u64,
        wanted: u64,
    ) -> Option<Arc<ScopeIndex>> {
        const ROUNDS: usize = 4;
        if self.algo != Some(algo) {
            self.invalidate();
        }
        let lfu = algo == EvictionAlgorithm::Lfu;
        let k = (tenant_entries / 64)
            .clamp(64, 65_536)
            .max(wanted.min(1 << 20)) as usize;
        for round in 0..ROUNDS {
            // Lookups credit LFU entries concurrently; after a few rescans, take the
            // best candidate as scanned rather than chase a moving target.
            let last_round = round == ROUNDS - 1;
            if self.algo.is_none() || self.queue.is_empty() {
                self.rescan(scopes, algo, k);
                if self.queue.is_empty() {
                    return None;
                }
            }
            while let Some(v) = self.queue.pop_front() {
                let Some(current) = v.scope.order_of(&v.key, v.shard) else {
                    continue;
                };
                let unchanged = current == v.seen;
                // In LFU a new entry (0 accesses) precedes any entry with accesses.
                let overtaken = lfu && self.inserted_since_scan && v.seen.0 > 0;
                if (unchanged && !overtaken) || last_round {
                    if v.scope.evict(&v.key, v.shard) {
                        return Some(v.scope);
                    }
                    continue;
                }
                if !lfu && !unchanged {
                    // LRU: a refreshed entry only moved later; skip it.
                    continue;
                }
                self.invalidate();
                break;
            }
        }
        None
    }
}
