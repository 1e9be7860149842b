//! One scope's slice of the index: its entries and its replica table.
//!
//! ```text
//! ScopeIndex (tenant, model, hash_scheme)
//!  ├─ table: ArcSwap<ReplicaTable>   slot → replica (id, endpoint, live counters)
//!  └─ store: RwLock<Store>            block hash → Entry { holders(slot, refs), lastSeen, accesses }
//! ```
//!
//! A lookup takes the read lock once and walks the chain (see `store.rs` for why
//! that walk touches few cache lines). Writers (always under their tenant's writer
//! lock, see `index/mod.rs`) take the write lock for at most [`WRITE_BATCH`] blocks
//! at a time, and let go after the current block as soon as a lookup waits (see
//! `lock.rs`); sweeps and clears take it for at most [`SWEEP_BATCH`] keys and let
//! go the same way when a lookup waits, and scans (sweep
//! candidates, clears, victim rescans) hold the read lock for at most
//! [`SCAN_CHUNK`] slots. So a lookup waits behind one block of an event's writing,
//! one key of a sweep, or one scan chunk, whatever the scope's size.

use std::cell::Cell;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

use arc_swap::ArcSwap;
use parking_lot::{Mutex, RwLockReadGuard, RwLockWriteGuard};
use smallvec::SmallVec;

use super::entry::{Entry, Release, split_slot, tier_slot};
use super::event::Tier;
use super::leading_run::LeadingRuns;
use super::lock::{ReaderFirst, Timeout, Turn};
use super::pending::Pending;
use super::prefills::Prefills;
use super::replica::{ReplicaLive, ReplicaSlot, ReplicaTable, ServingSet};
use super::store::{
    Cursor, EntryKey, EntryKeyRef, EntryRef, Loc, Padded, Planned, PrefixEntry, Slot, Store,
};
use crate::scope::ScopeKey;

/// How many keys a sweep removes per write-lock hold.
pub(crate) const SWEEP_BATCH: usize = 256;

/// How many slots a scan visits per read-lock hold (a few µs), so a writer that
/// finds no opening and queues makes lookups wait one chunk, not a whole scope.
pub(crate) const SCAN_CHUNK: usize = 1024;

/// The most blocks of an event stored or removed per write-lock hold; a hold
/// ends sooner when a lookup is waiting. A planned block costs ~10 ns under the
/// lock (`ScopeIndex::write_planned`), so a whole batch is still a short hold.
pub(crate) const WRITE_BATCH: usize = 64;

/// How many blocks of an event are looked up per read-lock hold before they are
/// written (see `ScopeIndex::write_planned`).
const PLAN_BATCH: usize = 64;

/// What brought a replica in: KV events move its lastEventAt, stats do not.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Touch {
    Event,
    Stats,
}

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
    store: Padded<ReaderFirst<Store>>,
    table: ArcSwap<ReplicaTable>,
    table_lock: Mutex<()>,
    entries: AtomicU64,
    /// Newest stamp that stored an entry here (ns).
    last_store: AtomicU64,
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
            store: Padded::default(),
            table: ArcSwap::from_pointee(ReplicaTable::default()),
            table_lock: Mutex::new(()),
            entries: AtomicU64::new(0),
            last_store: AtomicU64::new(0),
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
        self.entries.load(Ordering::Relaxed)
    }

    fn read(&self) -> RwLockReadGuard<'_, Store> {
        self.store.0.read()
    }

    fn write(&self) -> RwLockWriteGuard<'_, Store> {
        self.store.0.write()
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
        self.entries() > 0 && now.saturating_sub(self.last_store.load(Ordering::Relaxed)) <= ttl
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

    /// Lowers the prefix counts of every holder of a removed entry.
    fn release_holders(&self, holders: &[u32]) {
        let table = self.table.load();
        for &slot in holders {
            if let Some(r) = table.get(slot) {
                r.live.sub_prefixes(1);
            }
        }
    }

    /// Runs `step(store, i, plan)` for every `i` in `0..hashes.len()` under the
    /// write lock, where `plan` is what `plan(store, hash)` found for block `i`
    /// under the read lock (which lookups share), [`PLAN_BATCH`] blocks at a
    /// time: the exclusive hold then does no table lookup it can do without, and
    /// finds the table's lines in cache. Before each hold `prepare(plans)` may
    /// allocate what the hold will need (with the plans of the blocks left in the
    /// batch), so the hold does not wait on the allocator either. A hold covers at
    /// most [`WRITE_BATCH`] steps and ends early, after at least one, as soon as a
    /// lookup waits for the lock (unless the writer had to queue for it); runs
    /// emptied in it are dropped after it.
    fn write_planned<P: Copy>(
        &self,
        hashes: &[u64],
        plan: impl Fn(&Store, u64) -> P,
        mut prepare: impl FnMut(usize, &[P]),
        mut step: impl FnMut(&mut Store, usize, P),
    ) {
        let mut plans: SmallVec<[P; PLAN_BATCH]> = SmallVec::new();
        let mut base = 0;
        for batch in hashes.chunks(PLAN_BATCH) {
            plans.clear();
            {
                let store = self.read();
                plans.extend(batch.iter().map(|&h| plan(&store, h)));
            }
            let mut j = 0;
            while j < batch.len() {
                prepare(base + j, &plans[j..]);
                let stop = batch.len().min(j + WRITE_BATCH);
                let mut store;
                (store, j) = self.hold_in_turn(j..stop, |store, j| {
                    step(store, base + j, plans[j]);
                });
                let emptied = store.take_retired();
                drop(store);
                drop(emptied);
            }
            base += batch.len();
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
        let (mut created, mut newly_held, mut newest) = (0u64, 0u64, 0u64);
        let mut prev: Option<Loc> = None;
        // A fresh run's vector, allocated off the lock when a hold may need one.
        let spare: Cell<Option<Vec<Slot>>> = Cell::new(None);
        self.write_planned(
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
        self.read().get(key).is_some()
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
        let mut guard = self.write();
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
        self.add_entries(u64::from(created));
        live.add_prefixes(u64::from(newly_held));
        self.note_store(stamp);
        created
    }

    /// Drops one reference of `slot` on each block. Returns the entries removed
    /// because their last holder went.
    pub(crate) fn remove_blocks(&self, slot: u32, live: &ReplicaLive, hashes: &[u64]) -> u64 {
        let (mut removed, mut released, mut sparse) = (0u64, 0u64, false);
        self.write_planned(
            hashes,
            Store::plan_removal,
            |_, _| {},
            |store, i, planned| {
                let (release, gone) = store.release_planned(hashes[i], planned, slot);
                released += u64::from(release == Release::Released);
                removed += u64::from(gone);
                sparse = store.has_sparse();
            },
        );
        // Runs this event left mostly vacant (rather than empty) are compacted now.
        if sparse {
            let mut store = self.write();
            let emptied = store.settle();
            drop(store);
            drop(emptied);
        }
        self.sub_entries(removed);
        live.sub_prefixes(released);
        removed
    }

    /// Removes `slot` from every entry (AllBlocksCleared, replica removal), a
    /// bounded batch per write-lock hold. Returns the entries removed.
    pub(crate) fn clear_replica(&self, slot: u32, live: &ReplicaLive) -> u64 {
        self.pending.forget_slot(slot);
        self.prefills.forget_slot(slot);
        let mut keys = Vec::new();
        // Every tier of the replica goes (its GPU slot and its lower-tier slots).
        let tiers = [Tier::Cpu, Tier::Disk].map(|t| tier_slot(slot, t));
        let lower = self.has_lower_tiers();
        self.scan(|k, e| {
            let holders = e.holders();
            if holders.contains(slot) || (lower && tiers.iter().any(|&t| holders.contains(t))) {
                keys.push(k.to_owned());
            }
        });
        let mut removed = 0u64;
        self.remove_in_turns(
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
        self.sub_entries(removed);
        live.prefix_count.store(0, Ordering::Relaxed);
        removed
    }

    /// Removes a whole entry, whoever holds it. Returns false when it was gone.
    pub(crate) fn evict(&self, key: &EntryKey) -> bool {
        let taken = {
            let mut store = self.write();
            let taken = store.take(key);
            let emptied = store.settle();
            drop(store);
            drop(emptied);
            taken
        };
        let Some(holders) = taken else { return false };
        self.release_holders(&holders);
        self.sub_entries(1);
        true
    }

    /// Removes every entry older than `ttl`, a bounded batch per write-lock hold.
    pub(crate) fn sweep_expired(&self, now: u64, ttl: u64) -> u64 {
        let mut keys = Vec::new();
        self.scan(|k, e| {
            if !e.is_fresh(now, ttl) {
                keys.push(k.to_owned());
            }
        });
        let mut evicted = 0u64;
        self.remove_in_turns(
            &keys,
            |store, key, taken| {
                if store.get(key).is_some_and(|e| !e.is_fresh(now, ttl))
                    && let Some(h) = store.take(key)
                {
                    taken.push(h);
                }
            },
            |taken| {
                for h in taken.iter() {
                    self.release_holders(h);
                }
                evicted += taken.len() as u64;
            },
        );
        self.sub_entries(evicted);
        evicted
    }

    /// Takes the write lock and applies `step` to the indices of `range` in turn;
    /// a hold taken in an opening lets go after the current index as soon as a
    /// lookup waits, one that had to queue does the whole range. Returns the
    /// lock and the first index not done (`range` is never empty).
    fn hold_in_turn(
        &self,
        range: std::ops::Range<usize>,
        mut step: impl FnMut(&mut Store, usize),
    ) -> (RwLockWriteGuard<'_, Store>, usize) {
        let (mut store, turn) = self.store.0.write_in_turn();
        let yielding = turn == Turn::Opening;
        let mut j = range.start;
        loop {
            step(&mut store, j);
            j += 1;
            if j >= range.end || (yielding && self.store.0.readers_waiting()) {
                return (store, j);
            }
        }
    }

    /// Applies `step` to each of `keys` under the write lock, at most
    /// [`SWEEP_BATCH`] keys per hold, and — when the hold came in an opening — lets
    /// go after the current key as soon as a lookup waits, as event writers do
    /// (`write_planned`): a sweep or clear of a large scope would otherwise keep
    /// lookups out for a whole batch (tens of µs). What `step` puts in its vector
    /// is handed to `between` after each hold, off the lock, then dropped.
    fn remove_in_turns<H>(
        &self,
        keys: &[EntryKey],
        mut step: impl FnMut(&mut Store, &EntryKey, &mut Vec<H>),
        mut between: impl FnMut(&[H]),
    ) {
        let mut out = Vec::new();
        let mut j = 0;
        while j < keys.len() {
            let stop = keys.len().min(j + SWEEP_BATCH);
            let mut store;
            (store, j) = self.hold_in_turn(j..stop, |store, j| step(store, &keys[j], &mut out));
            let emptied = store.settle();
            drop(store);
            drop(emptied);
            between(&out);
            out.clear();
        }
    }

    /// Visits every entry, [`SCAN_CHUNK`] slots per read-lock hold (sweep
    /// candidates, clears, victim rescans). The caller holds the tenant's writer
    /// lock, so the store's layout cannot change between chunks (see `Cursor`).
    pub(crate) fn scan(&self, mut f: impl FnMut(EntryKeyRef<'_>, EntryRef<'_>)) {
        let mut cursor = Cursor::default();
        loop {
            let more = self.read().visit(&mut cursor, SCAN_CHUNK, &mut f);
            if !more {
                return;
            }
        }
    }

    /// (accesses, lastSeen) of an entry, to check a cached victim is still current.
    pub(crate) fn order_of(&self, key: &EntryKey) -> Option<(u32, u64)> {
        self.read().get(key).map(|e| (e.accesses(), e.last_seen()))
    }

    // ----- reads (the lookup path) -----

    fn read_within(
        &self,
        deadline: Option<Instant>,
    ) -> Result<RwLockReadGuard<'_, Store>, Timeout> {
        match deadline {
            None => Ok(self.read()),
            Some(d) => self.store.0.try_read_until(d).ok_or(Timeout),
        }
    }

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
        let store = self.read_within(deadline)?;
        let words = serving.slot_bits().len();
        let walk = LeadingRuns {
            store: &store,
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
        let store = self.read_within(deadline)?;
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
        store.walk(chain, |i, e| {
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

    /// The serving members holding a legacy prefix, and its stored token count.
    pub(crate) fn match_prefix(
        &self,
        prefix: &str,
        serving: &ServingSet,
        now: u64,
        ttl: u64,
        deadline: Option<Instant>,
    ) -> Result<PrefixMatch, Timeout> {
        let store = self.read_within(deadline)?;
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
        let store = self.read();
        store.walk(chain, |_, e| {
            e.credit();
            true
        });
    }

    /// LFU: one access to a legacy prefix entry.
    pub(crate) fn credit_prefix(&self, prefix: &str) {
        if let Some(p) = self.read().prefixes.get(prefix) {
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

    /// Each serving member's live load and endpoint (members without one left out).
    pub(crate) fn serving_endpoints(&self, serving: &ServingSet) -> Vec<(u64, Arc<str>)> {
        (0..serving.len())
            .filter_map(|m| serving.replica(m))
            .filter_map(|r| r.endpoint().map(|e| (r.live.load(), e.clone())))
            .collect()
    }

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

    /// Test hook: holds the write lock, as a long writer would.
    #[cfg(test)]
    pub(crate) fn hold_writes(&self) -> Vec<RwLockWriteGuard<'_, Store>> {
        vec![self.write()]
    }
}

/// Each member's run, in member order, from the runs by slot.
fn member_runs(members: &[u32], slot_runs: &[u32], runs: &mut [u32]) {
    for (r, &slot) in runs.iter_mut().zip(members) {
        *r = slot_runs.get(slot as usize).copied().unwrap_or(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scope::ScopeRef;

    #[test]
    fn events_get_written_while_lookups_keep_waiting() {
        let scope = ScopeIndex::new(ScopeRef::new("t", "m", "s").to_owned());
        let live = ReplicaLive::default();
        let chain: Vec<u64> = (1..=70)
            .map(|i: u64| i.wrapping_mul(0x9e37_79b9_7f4a_7c15))
            .collect();
        // A lookup that keeps waiting: the writer finds no opening, queues, and
        // then writes whole batches; it gets through.
        scope.store.0.set_waiting(1);
        assert_eq!(scope.insert_blocks(0, &live, None, &chain, |_| 1), 70);
        scope.store.0.set_waiting(0);
        assert_eq!(live.prefix_count(), 70);
        let end = scope.read().walk(&chain, |_, e| e.holders().contains(0));
        assert_eq!(end, 70);
        scope.store.0.set_waiting(1);
        assert_eq!(scope.remove_blocks(0, &live, &chain[10..]), 60);
        scope.store.0.set_waiting(0);
        assert_eq!(live.prefix_count(), 10);
        assert_eq!(scope.read().walk(&chain, |_, _| true), 10);
    }

    #[test]
    fn sweeps_and_clears_finish_while_lookups_keep_waiting() {
        let scope = ScopeIndex::new(ScopeRef::new("t", "m", "s").to_owned());
        let (a, b) = (ReplicaLive::default(), ReplicaLive::default());
        // More keys than one batch: the removals take several holds.
        let n = 3 * SWEEP_BATCH as u64 + 5;
        let chain: Vec<u64> = (1..=n).map(|i| i << 20 | 3).collect();
        assert_eq!(scope.insert_blocks(0, &a, None, &chain, |_| 1), n);
        assert_eq!(scope.insert_blocks(1, &b, None, &chain[..10], |_| 1), 0);
        // A lookup that keeps waiting: each hold is queued for, then keeps its
        // whole batch (a hold taken in an opening would let go at once).
        scope.store.0.set_waiting(1);
        assert_eq!(scope.clear_replica(0, &a), n - 10);
        scope.store.0.set_waiting(0);
        assert_eq!(scope.entries(), 10);
        assert_eq!(
            scope.read().walk(&chain, |_, e| e.holders().contains(1)),
            10
        );
        scope.store.0.set_waiting(1);
        assert_eq!(scope.sweep_expired(100, 50), 10);
        scope.store.0.set_waiting(0);
        assert_eq!(scope.entries(), 0);
    }

    #[test]
    fn planned_writes_handle_repeats_and_runs_emptied_or_thinned_mid_event() {
        let scope = ScopeIndex::new(ScopeRef::new("t", "m", "s").to_owned());
        let live = ReplicaLive::default();
        let chain: Vec<u64> = (1..=40).map(|i: u64| i << 20 | 7).collect();
        assert_eq!(scope.insert_blocks(0, &live, None, &chain, |_| 1), 40);
        // A hash named twice in one event: planned absent both times, stored once
        // with two references.
        let (a, b) = (1u64 << 50, 2u64 << 50);
        assert_eq!(scope.insert_blocks(1, &live, None, &[a, b, a], |_| 1), 2);
        assert_eq!(scope.remove_blocks(1, &live, &[a]), 0, "one reference left");
        // Removed twice in one event: the second finds it gone.
        assert_eq!(scope.remove_blocks(1, &live, &[a, a, b, b]), 2);
        assert!(!scope.contains(&EntryKey::Block(a)));
        // Thinning a run past the compaction line in one event, then further in
        // the same event: compacted once at the end, the rest still walkable.
        assert_eq!(scope.remove_blocks(0, &live, &chain[..35]), 35);
        {
            let store = scope.read();
            assert!(!store.has_sparse());
            assert_eq!(store.walk(&chain[35..], |_, e| e.holders().contains(0)), 5);
            assert_eq!(store.walk(&chain[34..], |_, _| true), 0);
        }
        // Emptying it frees it: nothing left to compact.
        assert_eq!(scope.remove_blocks(0, &live, &chain[35..]), 5);
        assert!(!scope.read().has_sparse());
        assert_eq!(scope.entries(), 0);
        assert_eq!(live.prefix_count(), 0);
    }

    #[test]
    fn a_chunked_scan_visits_every_live_entry_once() {
        let scope = ScopeIndex::new(ScopeRef::new("t", "m", "s").to_owned());
        let live = ReplicaLive::default();
        let mut expected = std::collections::BTreeSet::new();
        // Runs of several lengths (some longer than a chunk), vacated slots, prefixes.
        for (run, len) in [
            (1u64, 3u64),
            (2, SCAN_CHUNK as u64 + 7),
            (3, 1),
            (4, 2 * SCAN_CHUNK as u64),
        ] {
            let chain: Vec<u64> = (0..len).map(|i| (run << 40) | i).collect();
            scope.insert_blocks(0, &live, None, &chain, |_| 1);
            expected.extend(chain.iter().map(|&h| format!("b{h}")));
        }
        let gone: Vec<u64> = (0..5).map(|i| (2 << 40) | i).collect();
        scope.remove_blocks(0, &live, &gone);
        for h in &gone {
            expected.remove(&format!("b{h}"));
        }
        for p in ["p1", "p2", "p3"] {
            scope.insert_one(0, &live, &EntryKey::Prefix(p.into()), None, 16, 1);
            expected.insert(format!("p{p}"));
        }
        let mut seen = Vec::new();
        scope.scan(|k, _| {
            seen.push(match k {
                EntryKeyRef::Block(h) => format!("b{h}"),
                EntryKeyRef::Prefix(p) => format!("p{p}"),
            })
        });
        assert_eq!(seen.len(), expected.len(), "no entry twice");
        assert_eq!(
            seen.into_iter().collect::<std::collections::BTreeSet<_>>(),
            expected
        );

        // One call visits at most its budget and says whether more remain.
        let store = scope.read();
        let mut cursor = Cursor::default();
        let mut n = 0;
        assert!(store.visit(&mut cursor, 2, &mut |_, _| n += 1));
        assert_eq!(n, 2);
        let mut calls = 1;
        while store.visit(&mut cursor, 2, &mut |_, _| n += 1) {
            calls += 1;
        }
        assert_eq!(n, expected.len());
        assert!(
            calls > expected.len() / 2,
            "budget counts slots, {calls} calls"
        );
    }
}
