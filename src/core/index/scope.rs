//! One scope's slice of the index: its sharded entries and its replica table.
//!
//! ```text
//! ScopeIndex (tenant, model, hash_scheme)
//!  ├─ table: ArcSwap<ReplicaTable>   slot → replica (id, endpoint, live counters)
//!  └─ shards[0..S]: RwLock<Shard>     block hash → Entry { holders(slot, refs), lastSeen, accesses }
//! ```
//!
//! Writers (always under their tenant's writer lock, see `index/mod.rs`) take one
//! shard's write lock at a time for the blocks of an event that land there.
//! Readers take the read locks of the shards a chain touches, in ascending order,
//! once per lookup, and then walk the chain with no further synchronisation, which
//! lets the CPU overlap the hash-table misses of consecutive blocks.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

use arc_swap::ArcSwap;
use hashbrown::hash_map::Entry as MapEntry;
use parking_lot::{Mutex, RwLock, RwLockReadGuard};
use smallvec::SmallVec;

use super::entry::{Entry, Release};
use super::replica::{ReplicaLive, ReplicaSlot, ReplicaTable, ServingSet};
use super::shard::{EntryKey, EntryKeyRef, Padded, PrefixEntry, Shard, prefix_seed, shard_of};
use crate::core::scope::ScopeKey;

/// The lookup budget ran out before the index could be read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Timeout;

/// How many keys a sweep removes per write-lock hold: bounds how long one
/// shard's readers can wait behind it.
const SWEEP_BATCH: usize = 256;

/// Blocks probed ahead before their results are used (and how often a long
/// chain walk checks its deadline).
const PROBE_WINDOW: usize = 16;

/// The result of matching a legacy prefix.
pub(crate) struct PrefixMatch {
    /// Serving members holding the prefix.
    pub holders: SmallVec<[u16; 32]>,
    /// Token count stored with the prefix (0 when the engine gave none).
    pub token_count: u32,
}

/// One scope of the index.
pub struct ScopeIndex {
    pub(crate) key: ScopeKey,
    shards: Box<[Padded<RwLock<Shard>>]>,
    table: ArcSwap<ReplicaTable>,
    table_lock: Mutex<()>,
    entries: AtomicU64,
    /// Newest stamp that stored an entry here (ns).
    last_store: AtomicU64,
    round_robin: AtomicUsize,
}

impl ScopeIndex {
    pub(crate) fn new(key: ScopeKey, shards: usize) -> Self {
        Self {
            key,
            shards: (0..shards.clamp(1, 64))
                .map(|_| Padded::default())
                .collect(),
            table: ArcSwap::from_pointee(ReplicaTable::default()),
            table_lock: Mutex::new(()),
            entries: AtomicU64::new(0),
            last_store: AtomicU64::new(0),
            round_robin: AtomicUsize::new(0),
        }
    }

    pub fn key(&self) -> &ScopeKey {
        &self.key
    }

    pub(crate) fn table(&self) -> Arc<ReplicaTable> {
        self.table.load_full()
    }

    pub(crate) fn entries(&self) -> u64 {
        self.entries.load(Ordering::Relaxed)
    }

    fn shard_count(&self) -> usize {
        self.shards.len()
    }

    fn shard_for(&self, key: &EntryKey) -> usize {
        match key {
            EntryKey::Block(h) => shard_of(*h, self.shard_count()),
            EntryKey::Prefix(p) => shard_of(prefix_seed(p), self.shard_count()),
        }
    }

    /// Known to the index: a declared replica, a live registration, or a usable entry.
    pub(crate) fn is_known(&self, now: u64, ttl: u64) -> bool {
        let table = self.table.load();
        let has_replica = table.iter().any(|(_, r)| r.is_serving(now, ttl));
        has_replica
            || (self.entries() > 0
                && now.saturating_sub(self.last_store.load(Ordering::Relaxed)) <= ttl)
    }

    // ----- replicas (callers hold the tenant's writer lock) -----

    fn update_table<R>(&self, f: impl FnOnce(&mut ReplicaTable) -> R) -> R {
        let _guard = self.table_lock.lock();
        let mut table = ReplicaTable::clone(&self.table.load());
        let out = f(&mut table);
        self.table.store(Arc::new(table));
        out
    }

    /// The slot of `id`, created on first sight. A non-empty `endpoint` registers
    /// (or refreshes) the replica as serving there.
    pub(crate) fn resolve_replica(
        &self,
        id: &str,
        endpoint: &str,
        now: u64,
    ) -> (u32, Arc<ReplicaLive>) {
        let current = self.table.load();
        let found = current
            .slot_of(id)
            .and_then(|s| current.get(s).map(|r| (s, r)));
        let (slot, live) = match found {
            Some((slot, r)) if endpoint.is_empty() || r.registered.as_deref() == Some(endpoint) => {
                (slot, r.live.clone())
            }
            _ => self.update_table(|t| {
                let slot = match t.slot_of(id) {
                    Some(s) => s,
                    None => t.insert(ReplicaSlot::new(id), now),
                };
                let r = t.get_mut(slot).map(|r| {
                    if !endpoint.is_empty() {
                        r.registered = Some(Arc::from(endpoint));
                    }
                    r.live.clone()
                });
                (slot, r.unwrap_or_default())
            }),
        };
        if !endpoint.is_empty() {
            live.registered_at.fetch_max(now, Ordering::Relaxed);
        }
        live.last_event_at.fetch_max(now, Ordering::Relaxed);
        (slot, live)
    }

    /// Replaces the declared replicas (id, address). Returns the slots that are no
    /// longer declared; the caller drops their entries and then their slots.
    pub(crate) fn set_declared(&self, declared: &[(String, String)], now: u64) -> Vec<u32> {
        self.update_table(|t| {
            let mut dropped = Vec::new();
            let stale: Vec<u32> = t
                .iter()
                .filter(|(_, r)| {
                    r.declared.is_some() && !declared.iter().any(|(id, _)| **id == *r.id)
                })
                .map(|(s, _)| s)
                .collect();
            for slot in stale {
                if let Some(r) = t.get_mut(slot) {
                    r.declared = None;
                    dropped.push(slot);
                }
            }
            for (id, address) in declared {
                let slot = match t.slot_of(id) {
                    Some(s) => s,
                    None => t.insert(ReplicaSlot::new(id), now),
                };
                if let Some(r) = t.get_mut(slot)
                    && r.declared.as_deref() != Some(address.as_str())
                {
                    r.declared = Some(Arc::from(address.as_str()));
                }
            }
            dropped
        })
    }

    pub(crate) fn remove_slot(&self, slot: u32, now: u64) {
        self.update_table(|t| t.remove(slot, now));
    }

    /// Slots that can be forgotten: not declared, registration stale, no entries.
    pub(crate) fn idle_slots(&self, now: u64, ttl: u64) -> Vec<u32> {
        self.table
            .load()
            .iter()
            .filter(|(_, r)| {
                !r.is_serving(now, ttl)
                    && r.live.prefix_count() == 0
                    && now.saturating_sub(r.live.last_event_at()) > ttl
            })
            .map(|(s, _)| s)
            .collect()
    }

    // ----- writes (callers hold the tenant's writer lock) -----

    fn note_store(&self, stamp: u64) {
        self.last_store.fetch_max(stamp, Ordering::Relaxed);
    }

    fn add_entries(&self, n: u64) {
        if n > 0 {
            self.entries.fetch_add(n, Ordering::Relaxed);
        }
    }

    fn sub_entries(&self, n: u64) {
        if n > 0 {
            let _ = self
                .entries
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |c| {
                    Some(c.saturating_sub(n))
                });
        }
    }

    /// Stores a run of blocks for `slot`. Block `i` gets stamp `stamps(i)`.
    /// Returns how many new entries were created.
    pub(crate) fn insert_blocks(
        &self,
        slot: u32,
        live: &ReplicaLive,
        hashes: &[u64],
        stamp_of: impl Fn(usize) -> u64,
    ) -> u64 {
        let n = self.shard_count();
        let shard_ids: SmallVec<[u8; 64]> = hashes.iter().map(|&h| shard_of(h, n) as u8).collect();
        let (mut created, mut newly_held, mut newest) = (0u64, 0u64, 0u64);
        for s in 0..n {
            if !shard_ids.contains(&(s as u8)) {
                continue;
            }
            let mut shard = self.shards[s].0.write();
            for (i, &h) in hashes.iter().enumerate() {
                if usize::from(shard_ids[i]) != s {
                    continue;
                }
                let stamp = stamp_of(i);
                newest = newest.max(stamp);
                match shard.blocks.entry(h) {
                    MapEntry::Occupied(mut o) => {
                        let e = o.get_mut();
                        newly_held += u64::from(e.holders.add(slot));
                        e.last_seen = e.last_seen.max(stamp);
                    }
                    MapEntry::Vacant(v) => {
                        v.insert(Entry::new(slot, stamp));
                        created += 1;
                        newly_held += 1;
                    }
                }
            }
        }
        self.add_entries(created);
        live.add_prefixes(newly_held);
        self.note_store(newest);
        created
    }

    /// Whether an entry exists (usable or not).
    pub(crate) fn contains(&self, key: &EntryKey) -> bool {
        self.shards[self.shard_for(key)].0.read().get(key).is_some()
    }

    /// Stores one block or prefix for `slot`; returns true when the entry is new.
    pub(crate) fn insert_one(
        &self,
        slot: u32,
        live: &ReplicaLive,
        key: &EntryKey,
        token_count: u32,
        stamp: u64,
    ) -> bool {
        let mut shard = self.shards[self.shard_for(key)].0.write();
        let (created, newly_held) = match key {
            EntryKey::Block(h) => match shard.blocks.entry(*h) {
                MapEntry::Occupied(mut o) => {
                    let e = o.get_mut();
                    e.last_seen = e.last_seen.max(stamp);
                    (false, e.holders.add(slot))
                }
                MapEntry::Vacant(v) => {
                    v.insert(Entry::new(slot, stamp));
                    (true, true)
                }
            },
            EntryKey::Prefix(p) => match shard.prefixes.get_mut(&**p) {
                Some(pe) => {
                    pe.entry.last_seen = pe.entry.last_seen.max(stamp);
                    if token_count > 0 {
                        pe.token_count = token_count;
                    }
                    (false, pe.entry.holders.add(slot))
                }
                None => {
                    shard.prefixes.insert(
                        p.clone(),
                        PrefixEntry {
                            entry: Entry::new(slot, stamp),
                            token_count,
                        },
                    );
                    (true, true)
                }
            },
        };
        drop(shard);
        self.add_entries(u64::from(created));
        live.add_prefixes(u64::from(newly_held));
        self.note_store(stamp);
        created
    }

    /// Drops one reference of `slot` on each block. Returns the entries removed
    /// because their last holder went.
    pub(crate) fn remove_blocks(&self, slot: u32, live: &ReplicaLive, hashes: &[u64]) -> u64 {
        let n = self.shard_count();
        let shard_ids: SmallVec<[u8; 64]> = hashes.iter().map(|&h| shard_of(h, n) as u8).collect();
        let (mut removed, mut released) = (0u64, 0u64);
        for s in 0..n {
            if !shard_ids.contains(&(s as u8)) {
                continue;
            }
            let mut shard = self.shards[s].0.write();
            for (i, h) in hashes.iter().enumerate() {
                if usize::from(shard_ids[i]) != s {
                    continue;
                }
                let Some(e) = shard.blocks.get_mut(h) else {
                    continue;
                };
                if e.holders.release(slot) == Release::Released {
                    released += 1;
                    if e.holders.is_empty() {
                        shard.blocks.remove(h);
                        removed += 1;
                    }
                }
            }
        }
        self.sub_entries(removed);
        live.sub_prefixes(released);
        removed
    }

    /// Removes `slot` from every entry (AllBlocksCleared, replica removal), a
    /// bounded batch per write-lock hold. Returns the entries removed.
    pub(crate) fn clear_replica(&self, slot: u32, live: &ReplicaLive) -> u64 {
        let mut removed = 0u64;
        let mut keys = Vec::new();
        for s in 0..self.shard_count() {
            keys.clear();
            self.shards[s].0.read().for_each(|k, e| {
                if e.holders.contains(slot) {
                    keys.push(k.to_owned());
                }
            });
            for batch in keys.chunks(SWEEP_BATCH) {
                let mut shard = self.shards[s].0.write();
                for key in batch {
                    let Some(e) = shard.get_mut(key) else {
                        continue;
                    };
                    if e.holders.remove_all(slot) && e.holders.is_empty() {
                        shard.take(key);
                        removed += 1;
                    }
                }
            }
        }
        self.sub_entries(removed);
        live.prefix_count.store(0, Ordering::Relaxed);
        removed
    }

    /// Removes a whole entry, whoever holds it. Returns false when it was gone.
    pub(crate) fn evict(&self, key: &EntryKey) -> bool {
        let taken = self.shards[self.shard_for(key)].0.write().take(key);
        let Some(entry) = taken else { return false };
        let table = self.table.load();
        for slot in entry.holders.slots() {
            if let Some(r) = table.get(slot) {
                r.live.sub_prefixes(1);
            }
        }
        self.sub_entries(1);
        true
    }

    /// Removes every entry older than `ttl`, a bounded batch per write-lock hold.
    pub(crate) fn sweep_expired(&self, now: u64, ttl: u64) -> u64 {
        let mut evicted = 0u64;
        let mut keys = Vec::new();
        for s in 0..self.shard_count() {
            keys.clear();
            self.shards[s].0.read().for_each(|k, e| {
                if !e.is_fresh(now, ttl) {
                    keys.push(k.to_owned());
                }
            });
            for batch in keys.chunks(SWEEP_BATCH) {
                let table = self.table.load();
                let mut shard = self.shards[s].0.write();
                for key in batch {
                    if shard.get(key).is_some_and(|e| !e.is_fresh(now, ttl))
                        && let Some(e) = shard.take(key)
                    {
                        for slot in e.holders.slots() {
                            if let Some(r) = table.get(slot) {
                                r.live.sub_prefixes(1);
                            }
                        }
                        evicted += 1;
                    }
                }
            }
        }
        self.sub_entries(evicted);
        evicted
    }

    /// Visits every entry, shard by shard under read locks (victim scans).
    pub(crate) fn scan(&self, mut f: impl FnMut(EntryKeyRef<'_>, &Entry)) {
        for s in 0..self.shard_count() {
            self.shards[s].0.read().for_each(&mut f);
        }
    }

    /// (accesses, lastSeen) of an entry, to check a cached victim is still current.
    pub(crate) fn order_of(&self, key: &EntryKey) -> Option<(u32, u64)> {
        self.shards[self.shard_for(key)]
            .0
            .read()
            .get(key)
            .map(|e| (e.accesses(), e.last_seen))
    }

    // ----- reads (the lookup path) -----

    fn read_shard(
        &self,
        s: usize,
        deadline: Option<Instant>,
    ) -> Result<RwLockReadGuard<'_, Shard>, Timeout> {
        match deadline {
            None => Ok(self.shards[s].0.read()),
            Some(d) => self.shards[s].0.try_read_until(d).ok_or(Timeout),
        }
    }

    /// servingByScope now, narrowed by the candidate subset.
    pub(crate) fn serving(&self, now: u64, ttl: u64, candidates: &[String]) -> ServingSet {
        ServingSet::new(self.table.load_full(), now, ttl, candidates)
    }

    /// For every serving member, the length of the longest leading run of `chain`
    /// it holds (usable entries only).
    pub(crate) fn match_chain(
        &self,
        chain: &[u64],
        serving: &ServingSet,
        now: u64,
        ttl: u64,
        deadline: Option<Instant>,
    ) -> Result<SmallVec<[u32; 32]>, Timeout> {
        let mut runs: SmallVec<[u32; 32]> = SmallVec::from_elem(0, serving.len());
        if serving.is_empty() || chain.is_empty() {
            return Ok(runs);
        }
        let n = self.shard_count();
        let mut needed = 0u64;
        for &h in chain {
            needed |= 1 << shard_of(h, n);
            if needed.count_ones() as usize == n {
                break;
            }
        }
        // Ascending order: writers hold at most one shard at a time, so readers
        // holding several can never deadlock with them.
        let mut guards: SmallVec<[Option<RwLockReadGuard<'_, Shard>>; 16]> = SmallVec::new();
        for s in 0..n {
            guards.push(if needed & (1 << s) != 0 {
                Some(self.read_shard(s, deadline)?)
            } else {
                None
            });
        }
        // `alive` = members holding the whole run so far, as a bitset over member
        // indices: one AND per block whatever the number of holders.
        let words = serving.len().div_ceil(64);
        let mut alive: SmallVec<[u64; 4]> = SmallVec::from_elem(0, words);
        let mut held: SmallVec<[u64; 4]> = SmallVec::from_elem(0, words);
        let mut end = chain.len();
        // Probe a window of blocks first and process it after: the probes are
        // independent, so the CPU overlaps their cache misses instead of paying
        // them one after another.
        let mut found: [Option<&Entry>; PROBE_WINDOW] = [None; PROBE_WINDOW];
        'walk: for (w_index, window) in chain.chunks(PROBE_WINDOW).enumerate() {
            if w_index > 0 && deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(Timeout);
            }
            for (slot, h) in found.iter_mut().zip(window) {
                *slot = guards[shard_of(*h, n)]
                    .as_ref()
                    .and_then(|g| g.blocks.get(h));
            }
            for (j, e) in found[..window.len()].iter().enumerate() {
                let i = w_index * PROBE_WINDOW + j;
                let Some(e) = e.filter(|e| e.is_fresh(now, ttl)) else {
                    end = i;
                    break 'walk;
                };
                held.iter_mut().for_each(|w| *w = 0);
                for slot in e.holders.slots() {
                    if let Some(m) = serving.member_of(slot) {
                        held[m / 64] |= 1 << (m % 64);
                    }
                }
                let mut any = 0u64;
                for w in 0..words {
                    let kept = if i == 0 { held[w] } else { alive[w] & held[w] };
                    let mut dropped = alive[w] & !kept;
                    while dropped != 0 {
                        let bit = dropped.trailing_zeros() as usize;
                        runs[w * 64 + bit] = i as u32;
                        dropped &= dropped - 1;
                    }
                    alive[w] = kept;
                    any |= kept;
                }
                if any == 0 {
                    return Ok(runs);
                }
            }
        }
        for (w, &word) in alive.iter().enumerate() {
            let mut bits = word;
            while bits != 0 {
                let bit = bits.trailing_zeros() as usize;
                runs[w * 64 + bit] = end as u32;
                bits &= bits - 1;
            }
        }
        Ok(runs)
    }

    /// The serving members holding a legacy prefix, and its stored token count.
    pub(crate) fn match_prefix(
        &self,
        prefix: &str,
        serving: &ServingSet,
        now: u64,
        ttl: u64,
        deadline: Option<Instant>,
    ) -> Result<PrefixMatch, Timeout> {
        let s = shard_of(prefix_seed(prefix), self.shard_count());
        let shard = self.read_shard(s, deadline)?;
        let mut out = PrefixMatch {
            holders: SmallVec::new(),
            token_count: 0,
        };
        if let Some(pe) = shard
            .prefixes
            .get(prefix)
            .filter(|p| p.entry.is_fresh(now, ttl))
        {
            out.token_count = pe.token_count;
            out.holders.extend(
                pe.entry
                    .holders
                    .slots()
                    .filter_map(|s| serving.member_of(s))
                    .map(|m| m as u16),
            );
        }
        Ok(out)
    }

    /// LFU: one access to each of the given chain blocks.
    pub(crate) fn credit_chain(&self, chain: &[u64]) {
        let n = self.shard_count();
        for s in 0..n {
            let mut guard = None;
            for &h in chain.iter().filter(|&&h| shard_of(h, n) == s) {
                let g = guard.get_or_insert_with(|| self.shards[s].0.read());
                if let Some(e) = g.blocks.get(&h) {
                    e.credit();
                }
            }
        }
    }

    /// LFU: one access to a legacy prefix entry.
    pub(crate) fn credit_prefix(&self, prefix: &str) {
        let s = shard_of(prefix_seed(prefix), self.shard_count());
        if let Some(p) = self.shards[s].0.read().prefixes.get(prefix) {
            p.entry.credit();
        }
    }

    /// A serving replica for the ORIGINAL_DST fallback: least loaded by reported
    /// stats, ties broken round-robin.
    pub(crate) fn least_loaded(&self, serving: &ServingSet) -> Option<Arc<str>> {
        let loads: SmallVec<[u64; 32]> = (0..serving.len())
            .map(|m| serving.replica(m).map_or(u64::MAX, |r| r.live.load()))
            .collect();
        let min = loads.iter().copied().min()?;
        let tied: SmallVec<[usize; 32]> = (0..loads.len()).filter(|&m| loads[m] == min).collect();
        let turn = self.round_robin.fetch_add(1, Ordering::Relaxed);
        let member = tied[turn % tied.len()];
        serving.replica(member).and_then(|r| r.endpoint().cloned())
    }

    /// Test hook: holds every shard's write lock, as a long writer would.
    #[cfg(test)]
    pub(crate) fn hold_all_shards(&self) -> Vec<parking_lot::RwLockWriteGuard<'_, Shard>> {
        self.shards.iter().map(|s| s.0.write()).collect()
    }
}
