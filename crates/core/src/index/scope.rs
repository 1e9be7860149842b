//! One scope's slice of the index: its entries and its replica table.
//!
//! ```text
//! ScopeIndex (tenant, model, hash_scheme)
//!  ├─ table: ArcSwap<ReplicaTable>   slot → replica (id, endpoint, live counters)
//!  └─ shards: [Shard; 16 + 1]        each a RwLock<Store>:
//!                                    block hash → Entry { holders(slot, refs), lastSeen, accesses }
//! ```
//!
//! A chain lives in one shard, chosen by its first block: a run stored with no
//! parent starts a chain and goes to `shard_of_root`; a run with a parent goes
//! where its parent is. So a lookup takes one shard's read lock once and walks the
//! chain (see `store.rs` for why that walk touches few cache lines), and a writer
//! storing or removing another chain's blocks never meets it (see `shard.rs` for
//! the bounded holds within a shard).
//!
//! A run whose parent is in no shard goes where its first block already is, or
//! was last removed from (`Departed`: a lower tier's copy follows its GPU
//! removal), or else to the orphan shard (`ORPHANS`). While that has entries a
//! lookup holds its lock too and walks on in it from a block its chain's shard
//! lacks (`leading_run.rs`), so a run stored before its parent counts once the
//! parent comes. A block already stored stays where it is (`ScopeIndex::targets`),
//! so for hashes that name one chain position no block is in two shards and every
//! count is exact. Sweeps, clears and scans visit the shards in turn.

use std::cell::Cell;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

use arc_swap::ArcSwap;
use parking_lot::Mutex;
#[cfg(test)]
use parking_lot::RwLockWriteGuard;
use smallvec::SmallVec;

use super::entry::{Entry, Release, split_slot, tier_slot};
use super::event::Tier;
use super::leading_run::LeadingRuns;
use super::lock::Timeout;
use super::pending::Pending;
use super::replica::{ReplicaLive, ReplicaSlot, ReplicaTable, ServingSet};
use super::shard::{Departed, ORPHANS, SHARDS, Shard, shard_of_root};
use super::store::{
    EntryKey, EntryKeyRef, EntryRef, Loc, Padded, Planned, PrefixEntry, Slot, Store,
};
use super::view::Counters;
use crate::load::Prefills;
use crate::scope::ScopeKey;

/// The shard exact-prefix entries live in (they form no chains).
const PREFIX_SHARD: usize = 0;

/// What brought a replica in: KV events move its lastEventAt, stats do not.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Touch {
    Event,
    Stats,
}

/// The result of matching an exact-prefix key.
pub(crate) struct PrefixMatch {
    /// Serving members holding the prefix.
    pub holders: SmallVec<[u16; 32]>,
    /// Token count stored with the prefix (0 when the engine gave none).
    pub token_count: u32,
}

/// One scope of the index.
pub struct ScopeIndex {
    pub(crate) key: ScopeKey,
    /// The root shards, then the orphan shard, inline: a lookup finds its
    /// shard's lock at a fixed offset, with no pointer to follow.
    shards: [Shard; SHARDS + 1],
    /// Where the last few emptied blocks were (writers only).
    departed: Mutex<Departed>,
    /// Entries in the orphan shard ([`ORPHANS`]): while there are any, lookups
    /// read it beside their chain's shard.
    orphan_entries: AtomicU64,
    table: ArcSwap<ReplicaTable>,
    table_lock: Mutex<()>,
    /// What writers bump on every event, on cache lines of its own: lookups
    /// read the fields around it on every call.
    writes: Padded<Writes>,
    round_robin: AtomicUsize,
    /// Chains just routed here, held until the engine confirms (`pending.rs`).
    pub(crate) pending: Pending,
    /// Prefill backlogs waiting for the engine to store their last block
    /// (`prefills.rs`).
    pub(crate) prefills: Prefills,
    /// Set for good once a replica reports a block in a lower tier: until then
    /// lookups take the GPU-only walk, and pay nothing for tiers.
    lower_tiers: AtomicBool,
}

/// A scope's counters that every event's writer bumps.
#[derive(Default)]
struct Writes {
    entries: AtomicU64,
    /// Newest stamp that stored an entry here (ns).
    last_store: AtomicU64,
    /// The shard last written: where the next event's parent usually is.
    recent: AtomicUsize,
}

/// A chain's match with memory tiers: per serving member its run through blocks
/// held on any weighted tier, and the blocks of those runs it holds only in a
/// lower tier, as (member, block index, that tier's weight).
pub(crate) struct TieredMatch {
    pub runs: SmallVec<[u32; 32]>,
    pub lower: Vec<(usize, u32, f64)>,
}

impl ScopeIndex {
    pub(crate) fn new(key: ScopeKey) -> Self {
        Self {
            key,
            shards: std::array::from_fn(|_| Shard::default()),
            departed: Mutex::default(),
            orphan_entries: AtomicU64::new(0),
            table: ArcSwap::from_pointee(ReplicaTable::default()),
            table_lock: Mutex::new(()),
            writes: Padded::default(),
            round_robin: AtomicUsize::new(0),
            pending: Pending::default(),
            prefills: Prefills::default(),
            lower_tiers: AtomicBool::new(false),
        }
    }

    pub fn key(&self) -> &ScopeKey {
        &self.key
    }

    pub(crate) fn table(&self) -> Arc<ReplicaTable> {
        self.table.load_full()
    }

    pub(crate) fn entries(&self) -> u64 {
        self.writes.entries.load(Ordering::Relaxed)
    }

    /// The shard holding block `hash`, looking in `first` before the others.
    fn find_block(&self, hash: u64, first: usize) -> Option<usize> {
        self.find_where(first, |store| store.block(hash).is_some())
    }

    /// The first shard, from `first` on, where `found` holds.
    fn find_where(&self, first: usize, found: impl Fn(&Store) -> bool) -> Option<usize> {
        let n = self.shards.len();
        (0..n)
            .map(|k| (first + k) % n)
            .find(|&s| found(&self.shards[s].read()))
    }

    /// The shard an entry is in (for a block, wherever it is; absent blocks
    /// have none).
    fn shard_of_key(&self, key: &EntryKey) -> Option<usize> {
        self.shard_of_key_from(key, self.writes.recent.load(Ordering::Relaxed))
    }

    /// [`Self::shard_of_key`], looking in `seen` (where a scan saw it) first.
    fn shard_of_key_from(&self, key: &EntryKey, seen: usize) -> Option<usize> {
        match key {
            EntryKey::Block(h) => self.find_block(*h, seen),
            EntryKey::Prefix(_) => Some(PREFIX_SHARD),
        }
    }

    /// The shard a chain's lookups read: its first block's.
    fn chain_shard(&self, chain: &[u64]) -> &Shard {
        &self.shards[chain.first().map_or(PREFIX_SHARD, |&h| shard_of_root(h))]
    }

    /// Entries in the orphan shard.
    pub(crate) fn orphan_entries(&self) -> u64 {
        self.orphan_entries.load(Ordering::Relaxed)
    }

    /// Whether lookups must read the orphan shard too.
    fn has_orphans(&self) -> bool {
        self.orphan_entries.load(Ordering::Relaxed) > 0
    }

    /// `n` entries were created in `shard`.
    fn created_in(&self, shard: usize, n: u64) {
        if shard == ORPHANS && n > 0 {
            self.orphan_entries.fetch_add(n, Ordering::Relaxed);
        }
    }

    /// `n` entries were removed from `shard`.
    fn removed_from(&self, shard: usize, n: u64) {
        if shard == ORPHANS {
            Counters::sub(&self.orphan_entries, n);
        }
    }

    /// Where a run of blocks stored for `slot` goes (see the module docs): a
    /// GPU run without a parent starts a chain, in its root's shard unless its
    /// first block is already stored elsewhere; a run with a parent, or a lower
    /// tier's run (which never names one), goes where its chain already is, and
    /// to the orphan shard when that is nowhere to be found.
    fn home(&self, slot: u32, parent: Option<u64>, first: u64) -> usize {
        let lower_tier = split_slot(slot).1 != 0;
        if parent.is_none() && !lower_tier {
            let root = shard_of_root(first);
            return self.find_block(first, root).unwrap_or(root);
        }
        let hint = self.writes.recent.load(Ordering::Relaxed);
        let home = parent
            .and_then(|p| self.find_block(p, hint))
            .or_else(|| self.find_block(first, hint))
            .or_else(|| {
                let departed = self.departed.lock();
                parent
                    .and_then(|p| departed.shard_of(p))
                    .or_else(|| departed.shard_of(first))
            })
            .unwrap_or(ORPHANS);
        self.writes.recent.store(home, Ordering::Relaxed);
        home
    }

    /// Per block of a run bound for `home`, the shard it goes to: a block
    /// already stored stays where it is, so no block is ever in two shards.
    /// Only the orphan shard can hold a chain's block outside the chain's root
    /// shard, so a run bound for a root shard looks there (when it has entries)
    /// and an orphan run looks in every root shard (rare: its chain was lost).
    fn targets(&self, home: usize, hashes: &[u64]) -> SmallVec<[u8; 64]> {
        let mut out: SmallVec<[u8; 64]> = SmallVec::from_elem(home as u8, hashes.len());
        let others: SmallVec<[usize; 16]> = if home == ORPHANS {
            (0..SHARDS).collect()
        } else if self.has_orphans() {
            SmallVec::from_elem(ORPHANS, 1)
        } else {
            return out;
        };
        for s in others {
            let store = self.shards[s].read();
            for (t, &h) in out.iter_mut().zip(hashes) {
                if usize::from(*t) == home && store.block(h).is_some() {
                    *t = s as u8;
                }
            }
        }
        out
    }

    /// Known to the index: a declared replica, a live registration, or a usable entry.
    pub(crate) fn is_known(&self, now: u64, ttl: u64) -> bool {
        let table = self.table.load();
        let has_replica = table.iter().any(|(_, r)| r.is_serving(now, ttl));
        has_replica || self.may_hold_usable_entries(now, ttl)
    }

    /// False when no entry of the scope can be usable: every entry's lastSeen is
    /// at most the newest store, so once that is older than `ttl` all of them have
    /// expired, even before the sweep removes them.
    pub(crate) fn may_hold_usable_entries(&self, now: u64, ttl: u64) -> bool {
        self.entries() > 0
            && now.saturating_sub(self.writes.last_store.load(Ordering::Relaxed)) <= ttl
    }

    // ----- replicas (callers hold the tenant's writer lock) -----

    fn update_table<R>(&self, f: impl FnOnce(&mut ReplicaTable) -> R) -> R {
        let _guard = self.table_lock.lock();
        let mut table = ReplicaTable::clone(&self.table.load());
        let out = f(&mut table);
        table.seal();
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
        touch: Touch,
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
        // Contract §3: a registration stays fresh while the replica sends events
        // or stats, with or without repeating its endpoint.
        let registered = !endpoint.is_empty()
            || self
                .table
                .load()
                .get(slot)
                .is_some_and(|r| r.registered.is_some());
        if registered {
            live.registered_at.fetch_max(now, Ordering::Relaxed);
        }
        if touch == Touch::Event {
            live.last_event_at.fetch_max(now, Ordering::Relaxed);
        }
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
        self.writes.last_store.fetch_max(stamp, Ordering::Relaxed);
    }

    fn add_entries(&self, n: u64) {
        if n > 0 {
            self.writes.entries.fetch_add(n, Ordering::Relaxed);
        }
    }

    fn sub_entries(&self, n: u64) {
        Counters::sub(&self.writes.entries, n);
    }

    /// Lowers the prefix counts of every holder of a removed entry.
    fn release_holders(&self, holders: &[u32]) {
        let table = self.table.load();
        for &slot in holders {
            if let Some(r) = table.get(slot) {
                r.live.sub_prefixes(1);
            }
        }
    }

    /// Stores a run of blocks for `slot` (the event's parent first, if any).
    /// Block `i` gets stamp `stamp_of(i)`. Returns how many new entries were created.
    pub(crate) fn insert_blocks(
        &self,
        slot: u32,
        live: &ReplicaLive,
        parent: Option<u64>,
        hashes: &[u64],
        stamp_of: impl Fn(usize) -> u64,
    ) -> u64 {
        let Some(&first) = hashes.first() else {
            return 0;
        };
        let home = self.home(slot, parent, first);
        let targets = self.targets(home, hashes);
        let mut created = 0;
        let mut i = 0;
        // Stretches bound for one shard, each after the block before it.
        for stretch in targets.chunk_by(|a, b| a == b) {
            let end = i + stretch.len();
            let after = if i == 0 { parent } else { Some(hashes[i - 1]) };
            let shard = usize::from(stretch[0]);
            let n = self.insert_in(shard, slot, live, after, &hashes[i..end], |j| {
                stamp_of(i + j)
            });
            self.created_in(shard, n);
            created += n;
            i = end;
        }
        created
    }

    /// [`Self::insert_blocks`] into one shard.
    fn insert_in(
        &self,
        shard: usize,
        slot: u32,
        live: &ReplicaLive,
        parent: Option<u64>,
        hashes: &[u64],
        stamp_of: impl Fn(usize) -> u64,
    ) -> u64 {
        let shard = &self.shards[shard];
        let (mut created, mut newly_held, mut newest) = (0u64, 0u64, 0u64);
        let mut prev: Option<Loc> = None;
        // A fresh run's vector, allocated off the lock when a hold may need one.
        let spare: Cell<Option<Vec<Slot>>> = Cell::new(None);
        shard.write_planned(
            hashes,
            Store::plan_store,
            |i, plans| {
                let mut s = spare.take();
                // Sized like the run the first new block would start.
                if s.is_none()
                    && let Some(first) = plans.iter().position(Planned::is_new)
                {
                    s = Some(Vec::with_capacity(hashes.len() - i - first));
                }
                spare.set(s);
            },
            |store, i, planned| {
                if i == 0 {
                    prev = parent.and_then(|p| store.loc_of(p));
                }
                let stamp = stamp_of(i);
                newest = newest.max(stamp);
                let mut run = spare.take();
                let stored = store.store_planned(
                    hashes[i],
                    planned,
                    &mut prev,
                    slot,
                    stamp,
                    hashes.len() - i,
                    &mut run,
                );
                spare.set(run);
                created += u64::from(stored.created);
                newly_held += u64::from(stored.newly_held);
            },
        );
        self.add_entries(created);
        live.add_prefixes(newly_held);
        self.note_store(newest);
        created
    }

    /// Whether an entry exists (usable or not).
    pub(crate) fn contains(&self, key: &EntryKey) -> bool {
        self.shard_of_key(key)
            .is_some_and(|s| self.shards[s].read().get(key).is_some())
    }

    /// Stores one block (after `prev`) or prefix for `slot`; returns true when the
    /// entry is new.
    pub(crate) fn insert_one(
        &self,
        slot: u32,
        live: &ReplicaLive,
        key: &EntryKey,
        prev: Option<u64>,
        token_count: u32,
        stamp: u64,
    ) -> bool {
        let home = match key {
            EntryKey::Block(h) => usize::from(self.targets(self.home(slot, prev, *h), &[*h])[0]),
            EntryKey::Prefix(_) => PREFIX_SHARD,
        };
        let mut guard = self.shards[home].write();
        let store = &mut *guard;
        let (created, newly_held) = match key {
            EntryKey::Block(h) => {
                let s = store.store_block(*h, prev, slot, stamp, 1);
                (s.created, s.newly_held)
            }
            EntryKey::Prefix(p) => match store.prefixes.get_mut(&**p) {
                Some(pe) => {
                    pe.entry.refresh(stamp);
                    if token_count > 0 {
                        pe.token_count = token_count;
                    }
                    (false, pe.entry.holders.add(&mut store.lists, slot))
                }
                None => {
                    store.prefixes.insert(
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
        drop(guard);
        self.created_in(home, u64::from(created));
        self.add_entries(u64::from(created));
        live.add_prefixes(u64::from(newly_held));
        self.note_store(stamp);
        created
    }

    /// Drops one reference of `slot` on each block. Returns the entries removed
    /// because their last holder went.
    pub(crate) fn remove_blocks(&self, slot: u32, live: &ReplicaLive, hashes: &[u64]) -> u64 {
        let (mut removed, mut released) = (0u64, 0u64);
        let mut gone: SmallVec<[(u64, usize); 16]> = SmallVec::new();
        let mut hint = self.writes.recent.load(Ordering::Relaxed);
        let mut i = 0;
        while i < hashes.len() {
            // Where `slot` holds the block (hashes that do not name one chain
            // position can be in several shards); nowhere: nothing to remove.
            let held = |store: &Store, h: u64| {
                store
                    .block_ref(h)
                    .is_some_and(|e| e.holders().contains(slot))
            };
            let Some(s) = self.find_where(hint, |store| held(store, hashes[i])) else {
                i += 1;
                continue;
            };
            hint = s;
            let shard = &self.shards[s];
            // The blocks that follow in the same shard (usually the rest of the
            // event: one chain's tail) are removed together.
            let end = {
                let store = shard.read();
                let more = hashes[i + 1..].iter();
                i + 1 + more.take_while(|&&h| held(&store, h)).count()
            };
            let stretch = &hashes[i..end];
            let (mut sparse, before) = (false, removed);
            shard.write_planned(
                stretch,
                Store::plan_removal,
                |_, _| {},
                |store, j, planned| {
                    let (release, emptied) = store.release_planned(stretch[j], planned, slot);
                    released += u64::from(release == Release::Released);
                    if emptied {
                        removed += 1;
                        gone.push((stretch[j], s));
                    }
                    sparse = store.has_sparse();
                },
            );
            // Runs this event left mostly vacant (rather than empty) are compacted now.
            if sparse {
                shard.settle_in_turns();
            }
            self.removed_from(s, removed - before);
            i = end;
        }
        if !gone.is_empty() {
            let mut departed = self.departed.lock();
            for &(h, s) in &gone {
                departed.note(h, s);
            }
        }
        self.writes.recent.store(hint, Ordering::Relaxed);
        self.sub_entries(removed);
        live.sub_prefixes(released);
        removed
    }

    /// Removes `slot` from every entry (AllBlocksCleared, replica removal), a
    /// bounded batch per write-lock hold. Returns the entries removed.
    pub(crate) fn clear_replica(&self, slot: u32, live: &ReplicaLive) -> u64 {
        self.pending.forget_slot(slot);
        self.prefills.forget_slot(slot);
        // Every tier of the replica goes (its GPU slot and its lower-tier slots).
        let tiers = [Tier::Cpu, Tier::Disk].map(|t| tier_slot(slot, t));
        let lower = self.has_lower_tiers();
        let mut removed = 0u64;
        let mut keys = Vec::new();
        for (s, shard) in self.shards.iter().enumerate() {
            keys.clear();
            let before = removed;
            shard.scan(&mut |k, e| {
                let holders = e.holders();
                if holders.contains(slot) || (lower && tiers.iter().any(|&t| holders.contains(t))) {
                    keys.push(k.to_owned());
                }
            });
            shard.remove_in_turns(
                &keys,
                |store, key, _: &mut Vec<()>| {
                    let Some((holders, lists)) = store.holders_mut(key) else {
                        return;
                    };
                    let mut held = holders.remove_all(lists, slot);
                    if lower {
                        for &t in &tiers {
                            held |= holders.remove_all(lists, t);
                        }
                    }
                    if held && holders.is_empty() {
                        store.take(key);
                        removed += 1;
                    }
                },
                |_| {},
            );
            self.removed_from(s, removed - before);
        }
        self.sub_entries(removed);
        live.prefix_count.store(0, Ordering::Relaxed);
        // The engine starts over (a restart, a cache reset): what was routed
        // there before placed prefixes it no longer holds.
        live.load.reset_routes();
        removed
    }

    /// Removes a whole entry, whoever holds it, looking for it in shard `seen`
    /// first (where a scan saw it). Returns false when it was gone.
    pub(crate) fn evict(&self, key: &EntryKey, seen: usize) -> bool {
        let Some(s) = self.shard_of_key_from(key, seen) else {
            return false;
        };
        let taken = {
            let mut store = self.shards[s].write();
            let taken = store.take(key);
            let emptied = store.settle();
            drop(store);
            drop(emptied);
            taken
        };
        let Some(holders) = taken else { return false };
        self.release_holders(&holders);
        self.removed_from(s, 1);
        self.sub_entries(1);
        true
    }

    /// Removes from shard `s` each victim that is still as the victim scan saw
    /// it (same accesses and lastSeen), in bounded write holds that let go when
    /// a lookup waits; returns how many went. The cap sweep's path: a hold per
    /// victim made every victim a lock round trip for its shard's lookups.
    pub(crate) fn evict_unchanged(&self, s: usize, victims: &[(EntryKey, (u32, u64))]) -> u64 {
        let evicted = self.take_still_due(
            s,
            victims,
            |(key, _)| key,
            |(_, seen), e| (e.accesses(), e.last_seen()) == *seen,
        );
        self.sub_entries(evicted);
        evicted
    }

    /// Removes every entry older than `ttl`, a bounded batch per write-lock hold.
    pub(crate) fn sweep_expired(&self, now: u64, ttl: u64) -> u64 {
        let mut evicted = 0u64;
        let mut keys = Vec::new();
        for (s, shard) in self.shards.iter().enumerate() {
            keys.clear();
            shard.scan(&mut |k, e| {
                if !e.is_fresh(now, ttl) {
                    keys.push(k.to_owned());
                }
            });
            evicted += self.take_still_due(s, &keys, |k| k, |_, e| !e.is_fresh(now, ttl));
        }
        self.sub_entries(evicted);
        evicted
    }

    /// Takes from shard `s` each entry of `items` that is still `due` under the
    /// write lock (a scan saw it off the lock), in [`Shard::remove_in_turns`]
    /// holds, and lets go of its holders off the lock. Returns how many went.
    fn take_still_due<K>(
        &self,
        s: usize,
        items: &[K],
        key_of: impl Fn(&K) -> &EntryKey,
        due: impl Fn(&K, &Entry) -> bool,
    ) -> u64 {
        let mut taken_n = 0u64;
        self.shards[s].remove_in_turns(
            items,
            |store, item, taken| {
                let key = key_of(item);
                if store.get(key).is_some_and(|e| due(item, e))
                    && let Some(h) = store.take(key)
                {
                    taken.push(h);
                }
            },
            |taken| {
                for h in taken.iter() {
                    self.release_holders(h);
                }
                taken_n += taken.len() as u64;
            },
        );
        self.removed_from(s, taken_n);
        taken_n
    }

    /// Visits every entry, shard by shard, a bounded chunk per read-lock hold
    /// (sweep candidates, victim rescans). The caller holds the tenant's writer
    /// lock, so no shard's layout changes between chunks.
    #[cfg(test)]
    pub(crate) fn scan(&self, mut f: impl FnMut(EntryKeyRef<'_>, EntryRef<'_>)) {
        self.scan_shards(|_, k, e| f(k, e));
    }

    /// [`Self::scan`], telling `f` the shard of each entry.
    pub(crate) fn scan_shards(&self, mut f: impl FnMut(usize, EntryKeyRef<'_>, EntryRef<'_>)) {
        for (s, shard) in self.shards.iter().enumerate() {
            shard.scan(&mut |k, e| f(s, k, e));
        }
    }

    /// (accesses, lastSeen) of an entry, to check a cached victim is still
    /// current; looked for in shard `seen` first.
    pub(crate) fn order_of(&self, key: &EntryKey, seen: usize) -> Option<(u32, u64)> {
        let s = self.shard_of_key_from(key, seen)?;
        self.shards[s]
            .read()
            .get(key)
            .map(|e| (e.accesses(), e.last_seen()))
    }

    // ----- reads (the lookup path) -----

    /// servingByScope now, narrowed by the candidate subset.
    pub(crate) fn serving(&self, now: u64, ttl: u64, candidates: &[String]) -> ServingSet {
        ServingSet::new(self.table.load_full(), now, ttl, candidates)
    }

    /// For every serving member, the length of the longest leading run of `chain`
    /// it holds (usable entries only), into `runs` (zeroed, one per member: the
    /// caller's buffer, so no vector is built and copied out).
    pub(crate) fn match_chain(
        &self,
        chain: &[u64],
        serving: &ServingSet,
        now: u64,
        ttl: u64,
        deadline: Option<Instant>,
        runs: &mut [u32],
    ) -> Result<(), Timeout> {
        if serving.is_empty() || chain.is_empty() {
            return Ok(());
        }
        let store = self.chain_shard(chain).read_within(deadline)?;
        let orphans = match self.has_orphans() {
            true => Some(self.shards[ORPHANS].read_within(deadline)?),
            false => None,
        };
        let words = serving.slot_bits().len();
        let walk = LeadingRuns {
            store: &store,
            orphans: orphans.as_deref(),
            serving: serving.slot_bits(),
            now,
            ttl,
            deadline,
        };
        // One word covers tables of up to 64 replicas, the common case; fixed-size
        // arrays let the compiler drop the per-word loop there (and are zeroed
        // by one memset, where a `SmallVec` is filled item by item).
        let members = serving.members();
        if words == 1 {
            let mut slot_runs = [0u32; 64];
            walk.run([0u64; 1], [0u64; 1], chain, &mut slot_runs)?;
            // One word of slot bits: the table has at most 64 slots, so every
            // member's slot indexes the array as it is (no bounds test).
            debug_assert!(members.iter().all(|&slot| slot < 64));
            for (r, &slot) in runs.iter_mut().zip(members) {
                *r = slot_runs[slot as usize % 64];
            }
        } else {
            let mut slot_runs = vec![0u32; words * 64];
            walk.run(vec![0u64; words], vec![0u64; words], chain, &mut slot_runs)?;
            member_runs(members, &slot_runs, runs);
        }
        Ok(())
    }

    pub(crate) fn note_lower_tier(&self) {
        if !self.lower_tiers.load(Ordering::Relaxed) {
            self.lower_tiers.store(true, Ordering::Relaxed);
        }
    }

    /// Whether any replica ever reported a lower-tier block here.
    pub(crate) fn has_lower_tiers(&self) -> bool {
        self.lower_tiers.load(Ordering::Relaxed)
    }

    /// [`Self::match_chain`] with memory tiers: a block counts for a member when
    /// it holds it in any tier whose weight (`weights[code]`, GPU = code 0 = 1.0)
    /// is positive. Per block it visits every holder, so it is slower than the
    /// GPU walk; it runs only in scopes with lower-tier blocks.
    pub(crate) fn match_chain_tiered(
        &self,
        chain: &[u64],
        serving: &ServingSet,
        now: u64,
        ttl: u64,
        deadline: Option<Instant>,
        weights: [f64; 3],
    ) -> Result<TieredMatch, Timeout> {
        let n = serving.len();
        let mut out = TieredMatch {
            runs: SmallVec::from_elem(0, n),
            lower: Vec::new(),
        };
        if n == 0 || chain.is_empty() {
            return Ok(out);
        }
        let store = self.chain_shard(chain).read_within(deadline)?;
        let orphans = match self.has_orphans() {
            true => Some(self.shards[ORPHANS].read_within(deadline)?),
            false => None,
        };
        // slot → member + 1 (0: not serving), built once per lookup.
        let members = serving.members();
        let width = members.iter().map(|&s| s as usize + 1).max().unwrap_or(0);
        let mut member_of: SmallVec<[u16; 64]> = SmallVec::from_elem(0, width);
        for (m, &slot) in members.iter().enumerate() {
            member_of[slot as usize] = m as u16 + 1;
        }
        // Members whose run is still going; after block 0 usually a few.
        let mut alive: SmallVec<[u16; 32]> = (0..n as u16).collect();
        let mut best: SmallVec<[f64; 32]> = SmallVec::from_elem(0.0, n);
        let mut timed_out = false;
        walk_either(&store, orphans.as_deref(), chain, |i, e| {
            if i % 1024 == 1023 && deadline.is_some_and(|d| Instant::now() >= d) {
                timed_out = true;
                return false;
            }
            if !e.is_fresh(now, ttl) {
                return false;
            }
            // Only GPU holders in slots 0..64 (most entries): one mask test each.
            if let Some(mask) = e.holders().low_mask() {
                alive.retain(|m| {
                    let held = mask & (1u64 << (members[*m as usize] % 64)) != 0
                        && members[*m as usize] < 64;
                    if held {
                        out.runs[*m as usize] = i as u32 + 1;
                    }
                    held
                });
                return !alive.is_empty();
            }
            for holder in e.holders().slots() {
                let (slot, code) = split_slot(holder);
                let w = weights.get(code as usize).copied().unwrap_or(0.0);
                match member_of.get(slot as usize) {
                    Some(&m) if m > 0 && w > 0.0 => {
                        let b = &mut best[m as usize - 1];
                        *b = b.max(w);
                    }
                    _ => {}
                }
            }
            alive.retain(|m| {
                let m = *m as usize;
                let w = std::mem::take(&mut best[m]);
                if w > 0.0 {
                    out.runs[m] = i as u32 + 1;
                    if w < 1.0 {
                        out.lower.push((m, i as u32, w));
                    }
                }
                w > 0.0
            });
            // Holders that were not alive leave their weight behind: clear it.
            for holder in e.holders().slots() {
                if let Some(&m) = member_of.get(split_slot(holder).0 as usize)
                    && m > 0
                {
                    best[m as usize - 1] = 0.0;
                }
            }
            !alive.is_empty()
        });
        if timed_out {
            return Err(Timeout);
        }
        Ok(out)
    }

    /// The serving members holding an exact-prefix key, and its stored token count.
    pub(crate) fn match_prefix(
        &self,
        prefix: &str,
        serving: &ServingSet,
        now: u64,
        ttl: u64,
        deadline: Option<Instant>,
    ) -> Result<PrefixMatch, Timeout> {
        let store = self.shards[PREFIX_SHARD].read_within(deadline)?;
        let mut out = PrefixMatch {
            holders: SmallVec::new(),
            token_count: 0,
        };
        if let Some(pe) = store
            .prefixes
            .get(prefix)
            .filter(|p| p.entry.is_fresh(now, ttl))
        {
            out.token_count = pe.token_count;
            out.holders.extend(
                pe.entry
                    .holders
                    .with(&store.lists)
                    .slots()
                    .filter_map(|s| serving.member_of(s))
                    .map(|m| m as u16),
            );
            // Member order is replica-id order, the ranker's final tie-breaker.
            out.holders.sort_unstable();
        }
        Ok(out)
    }

    /// LFU: one access to each of the given chain blocks.
    pub(crate) fn credit_chain(&self, chain: &[u64]) {
        let store = self.chain_shard(chain).read();
        let orphans = self.has_orphans().then(|| self.shards[ORPHANS].read());
        walk_either(&store, orphans.as_deref(), chain, |_, e| {
            e.credit();
            true
        });
    }

    /// LFU: one access to an exact-prefix key entry.
    pub(crate) fn credit_prefix(&self, prefix: &str) {
        if let Some(p) = self.shards[PREFIX_SHARD].read().prefixes.get(prefix) {
            p.entry.credit();
        }
    }

    /// A serving replica for the ORIGINAL_DST fallback: least loaded by reported
    /// stats, ties broken round-robin.
    /// The ids of the replicas whose endpoint is one of `addresses` (a gateway's
    /// subset hint names endpoints, the decision takes replica ids).
    pub(crate) fn replicas_at(&self, addresses: &[&str]) -> Vec<String> {
        let table = self.table.load();
        table
            .iter()
            .filter(|(_, r)| r.endpoint().is_some_and(|e| addresses.contains(&&**e)))
            .map(|(_, r)| r.id.to_string())
            .collect()
    }

    /// Every replica of this scope with an address, and its live values.
    pub(crate) fn for_each_endpoint(&self, mut f: impl FnMut(&Arc<str>, &ReplicaLive)) {
        let table = self.table.load();
        for (_, r) in table.iter() {
            if let Some(e) = r.endpoint() {
                f(e, &r.live);
            }
        }
    }

    /// Each serving member's live load and endpoint (members without one left out).
    pub(crate) fn serving_endpoints(&self, serving: &ServingSet) -> Vec<(u64, Arc<str>)> {
        (0..serving.len())
            .filter_map(|m| serving.replica(m))
            .filter_map(|r| r.endpoint().map(|e| (r.live.reported_load(), e.clone())))
            .collect()
    }

    pub(crate) fn least_loaded(&self, serving: &ServingSet) -> Option<Arc<str>> {
        let loads: SmallVec<[u64; 32]> = (0..serving.len())
            .map(|m| {
                serving
                    .replica(m)
                    .map_or(u64::MAX, |r| r.live.reported_load())
            })
            .collect();
        let min = loads.iter().copied().min()?;
        let tied: SmallVec<[usize; 32]> = (0..loads.len()).filter(|&m| loads[m] == min).collect();
        let turn = self.round_robin.fetch_add(1, Ordering::Relaxed);
        let member = tied[turn % tied.len()];
        serving.replica(member).and_then(|r| r.endpoint().cloned())
    }

    /// Test hook: pretend `n` lookups wait on every shard.
    #[cfg(test)]
    fn set_waiting(&self, n: u32) {
        self.shards.iter().for_each(|s| s.set_waiting(n));
    }

    /// Test hook: holds the write lock, as a long writer would.
    #[cfg(test)]
    pub(crate) fn hold_writes(&self) -> Vec<RwLockWriteGuard<'_, Store>> {
        self.shards.iter().map(Shard::write).collect()
    }
}

/// Calls `visit(i, entry)` for the chain's blocks while they exist and `visit`
/// returns true: in `store` (the chain's shard) and, while there are orphans,
/// on in `orphans` from a block `store` lacks, and back (no block is in both).
fn walk_either(
    store: &Store,
    orphans: Option<&Store>,
    chain: &[u64],
    mut visit: impl FnMut(usize, EntryRef<'_>) -> bool,
) {
    let (mut store, mut other) = (store, orphans);
    let mut from = 0;
    loop {
        let mut stopped = false;
        let end = from
            + store.walk(&chain[from..], |i, e| {
                let go = visit(from + i, e);
                stopped |= !go;
                go
            });
        match other {
            Some(o) if !stopped && end < chain.len() && o.block(chain[end]).is_some() => {
                (store, other, from) = (o, Some(store), end);
            }
            _ => return,
        }
    }
}

/// Each member's run, in member order, from the runs by slot.
fn member_runs(members: &[u32], slot_runs: &[u32], runs: &mut [u32]) {
    for (r, &slot) in runs.iter_mut().zip(members) {
        *r = slot_runs.get(slot as usize).copied().unwrap_or(0);
    }
}

#[cfg(test)]
mod tests;
