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

use std::collections::VecDeque;
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

/// The most victims one scan keeps (a scan holds up to twice as many, ~70
/// bytes each): a sweep evicting more scans again.
const MAX_CACHED: u64 = 1 << 18;

/// A cached victim candidate.
struct Victim {
    order: VictimOrder,
    /// (accesses, lastSeen) when scanned, to detect a change since.
    seen: (u32, u64),
    /// Its scope's place in [`VictimCache::scopes`]: not an `Arc` per victim,
    /// whose reference count every lookup of the scope also bumps.
    scope: u32,
    /// The shard the scan saw it in, where finding it again starts.
    shard: u32,
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
    /// The scopes the last scan visited.
    scopes: Vec<Arc<ScopeIndex>>,
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
        self.scopes.clear();
        self.algo = None;
    }

    /// Scans the tenant's scopes and keeps the `k` smallest entries. Candidates
    /// go into a vector cut back to the `k` smallest whenever it reaches `2k`
    /// (a selection, then entries not below the cut are skipped): linear
    /// passes over memory, where a heap of `k` victims sifts through tens of
    /// megabytes at random and evicts the lookups' cache lines meanwhile.
    fn rescan(&mut self, scopes: &[Arc<ScopeIndex>], algo: EvictionAlgorithm, k: usize) {
        let mut kept: Vec<Victim> = Vec::new();
        let mut cut: Option<VictimOrder> = None;
        for (i, scope) in scopes.iter().enumerate() {
            scope.scan_shards(|shard, key, e| {
                let accesses = e.accesses();
                let order = VictimOrder::new(algo, accesses, e.last_seen(), key.tiebreak());
                if cut.is_some_and(|c| order >= c) {
                    return;
                }
                kept.push(Victim {
                    order,
                    seen: (accesses, e.last_seen()),
                    scope: i as u32,
                    shard: shard as u32,
                    key: key.to_owned(),
                });
                if kept.len() >= 2 * k {
                    kept.select_nth_unstable(k - 1);
                    kept.truncate(k);
                    cut = Some(kept[k - 1].order);
                }
            });
        }
        if kept.len() > k {
            kept.select_nth_unstable(k - 1);
            kept.truncate(k);
        }
        kept.sort_unstable();
        self.queue = kept.into();
        self.scopes = scopes.to_vec();
        self.algo = Some(algo);
        self.inserted_since_scan = false;
    }

    /// Evicts up to `wanted` (at least one) of the tenant's next LRU victims,
    /// those of one shard together in bounded write holds. Returns how many
    /// went; 0 when the tenant holds nothing. Under LRU the order is exact
    /// without a hold per victim: every victim taken is among the `wanted`
    /// oldest, and one refreshed since the scan only moved later, so it is
    /// skipped (kept) rather than evicted.
    pub fn evict_lru_batch(
        &mut self,
        scopes: &[Arc<ScopeIndex>],
        tenant_entries: u64,
        wanted: u64,
    ) -> u64 {
        const ROUNDS: usize = 4;
        /// Victims taken per call: the cap sweep rechecks the cap between calls.
        const BATCH: usize = 4096;
        if self.algo != Some(EvictionAlgorithm::Lru) {
            self.invalidate();
        }
        let k = (tenant_entries / 64)
            .clamp(64, 65_536)
            .max(wanted.min(MAX_CACHED)) as usize;
        let mut rescans = 0;
        loop {
            if self.algo.is_none() || self.queue.is_empty() {
                if rescans == ROUNDS {
                    return 0;
                }
                rescans += 1;
                self.rescan(scopes, EvictionAlgorithm::Lru, k);
                if self.queue.is_empty() {
                    return 0;
                }
            }
            let n = self.queue.len().min(BATCH).min(wanted.max(1) as usize);
            let mut batch: Vec<Victim> = self.queue.drain(..n).collect();
            batch.sort_unstable_by_key(|v| (v.scope, v.shard));
            let mut evicted = 0;
            let mut items = Vec::new();
            for group in batch.chunk_by(|a, b| (a.scope, a.shard) == (b.scope, b.shard)) {
                items.clear();
                items.extend(group.iter().map(|v| (v.key.clone(), v.seen)));
                let scope = &self.scopes[group[0].scope as usize];
                evicted += scope.evict_unchanged(group[0].shard as usize, &items);
            }
            if evicted > 0 {
                return evicted;
            }
        }
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
            .max(wanted.min(MAX_CACHED)) as usize;
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
                let scope = &self.scopes[v.scope as usize];
                let Some(current) = scope.order_of(&v.key, v.shard as usize) else {
                    continue;
                };
                let unchanged = current == v.seen;
                // In LFU a new entry (0 accesses) precedes any entry with accesses.
                let overtaken = lfu && self.inserted_since_scan && v.seen.0 > 0;
                if (unchanged && !overtaken) || last_round {
                    if scope.evict(&v.key, v.shard as usize) {
                        return Some(scope.clone());
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
