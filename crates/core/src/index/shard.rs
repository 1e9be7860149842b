//! One shard of a scope's store: a [`Store`] behind its own [`ReaderFirst`] lock,
//! and the bounded holds every write, sweep and scan takes on it.
//!
//! A scope splits its entries over [`SHARDS`] shards by the chain's first block
//! (`scope.rs` places runs), so a lookup reads one shard and a writer storing
//! another chain's blocks never meets it. Within a shard the holds are bounded: a
//! writer takes the write lock for at most [`WRITE_BATCH`] blocks and lets go after
//! the current block as soon as a lookup waits (see `lock.rs`); sweeps and clears
//! take it for at most [`SWEEP_BATCH`] keys and let go the same way; scans hold the
//! read lock for at most [`SCAN_CHUNK`] slots.

use std::time::Instant;

use parking_lot::{RwLockReadGuard, RwLockWriteGuard};
use smallvec::SmallVec;

use super::lock::{ReaderFirst, Timeout, Turn};
use super::store::{Cursor, EntryKeyRef, EntryRef, Padded, Store};

/// How many shards a scope's store is split into. A lookup meets a writer only
/// when both chains hash to one shard, about one time in sixteen; more shards
/// cost an empty [`Store`] each in every scope.
pub(crate) const SHARDS: usize = 16;

/// The shard after the root shards: runs whose chain is in no shard (their
/// parent was swept or evicted while the engine kept it, or its events were
/// lost). Lookups read it beside their chain's shard while it has entries.
pub(crate) const ORPHANS: usize = SHARDS;

/// How many keys a sweep removes per write-lock hold.
pub(crate) const SWEEP_BATCH: usize = 256;

/// How many slots a scan visits per read-lock hold (a few µs), so a writer that
/// finds no opening and queues makes lookups wait one chunk, not a whole shard.
pub(crate) const SCAN_CHUNK: usize = 1024;

/// The most blocks of an event stored or removed per write-lock hold; a hold
/// ends sooner when a lookup is waiting. A planned block costs ~10 ns under the
/// lock (`Shard::write_planned`), so a whole batch is still a short hold.
pub(crate) const WRITE_BATCH: usize = 64;

/// How many blocks of an event are looked up per read-lock hold before they are
/// written (see `Shard::write_planned`).
const PLAN_BATCH: usize = 64;

/// The shard a chain starting with block `root` lives in.
pub(crate) fn shard_of_root(root: u64) -> usize {
    // Engine hashes are well mixed, own values too; the multiply guards
    // against a scheme whose low bits are not.
    (root.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 60) as usize % SHARDS
}

/// One shard: its store and lock, on a cache line of its own.
#[derive(Default)]
pub(crate) struct Shard(Padded<ReaderFirst<Store>>);

impl Shard {
    pub(crate) fn read(&self) -> RwLockReadGuard<'_, Store> {
        self.0.0.read()
    }

    pub(crate) fn write(&self) -> RwLockWriteGuard<'_, Store> {
        self.0.0.write()
    }

    pub(crate) fn read_within(
        &self,
        deadline: Option<Instant>,
    ) -> Result<RwLockReadGuard<'_, Store>, Timeout> {
        match deadline {
            None => Ok(self.read()),
            Some(d) => self.0.0.try_read_until(d).ok_or(Timeout),
        }
    }

    /// Test hook: pretend `n` lookups are waiting.
    #[cfg(test)]
    pub(crate) fn set_waiting(&self, n: u32) {
        self.0.0.set_waiting(n);
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
    pub(crate) fn write_planned<P: Copy>(
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

    /// Takes the write lock and applies `step` to the indices of `range` in turn;
    /// a hold taken in an opening lets go after the current index as soon as a
    /// lookup waits, one that had to queue does the whole range. Returns the
    /// lock and the first index not done (`range` is never empty).
    fn hold_in_turn(
        &self,
        range: std::ops::Range<usize>,
        mut step: impl FnMut(&mut Store, usize),
    ) -> (RwLockWriteGuard<'_, Store>, usize) {
        let (mut store, turn) = self.0.0.write_in_turn();
        let yielding = turn == Turn::Opening;
        let mut j = range.start;
        loop {
            step(&mut store, j);
            j += 1;
            if j >= range.end || (yielding && self.0.0.readers_waiting()) {
                return (store, j);
            }
        }
    }

    /// Applies `step` to each of `keys` under the write lock, at most
    /// [`SWEEP_BATCH`] keys per hold, and — when the hold came in an opening — lets
    /// go after the current key as soon as a lookup waits, as event writers do
    /// (`write_planned`): a sweep or clear of a large shard would otherwise keep
    /// lookups out for a whole batch (tens of µs). What `step` puts in its vector
    /// is handed to `between` after each hold, off the lock, then dropped.
    pub(crate) fn remove_in_turns<K, H>(
        &self,
        keys: &[K],
        mut step: impl FnMut(&mut Store, &K, &mut Vec<H>),
        mut between: impl FnMut(&[H]),
    ) {
        let mut out = Vec::new();
        let mut j = 0;
        while j < keys.len() {
            let stop = keys.len().min(j + SWEEP_BATCH);
            let mut store;
            (store, j) = self.hold_in_turn(j..stop, |store, j| step(store, &keys[j], &mut out));
            let emptied = store.take_retired();
            drop(store);
            drop(emptied);
            between(&out);
            out.clear();
        }
        self.settle_in_turns();
    }

    /// Compacts the runs that removals left mostly vacant, a run per step (a
    /// run's compaction re-finds its live blocks and reallocates it, around a
    /// microsecond), in holds that let go as soon as a lookup waits. Compacting
    /// them all at the end of each hold made a lookup that arrived then wait
    /// for every one of them.
    pub(crate) fn settle_in_turns(&self) {
        if !self.read().has_sparse() {
            return;
        }
        loop {
            let (mut store, turn) = self.0.0.write_in_turn();
            let yielding = turn == Turn::Opening;
            let more = loop {
                if !store.compact_next() {
                    break false;
                }
                if yielding && self.0.0.readers_waiting() {
                    break true;
                }
            };
            let emptied = store.take_retired();
            drop(store);
            drop(emptied);
            if !more {
                return;
            }
        }
    }

    /// Visits every entry, [`SCAN_CHUNK`] slots per read-lock hold. The caller
    /// holds the tenant's writer lock, so the store's layout cannot change
    /// between chunks (see `Cursor`).
    pub(crate) fn scan(&self, f: &mut impl FnMut(EntryKeyRef<'_>, EntryRef<'_>)) {
        let mut cursor = Cursor::default();
        while self.read().visit(&mut cursor, SCAN_CHUNK, f) {}
    }
}

/// The last few blocks whose last holder went, and the shard they were in: a
/// lower tier's copy of a block (vLLM offloads a block right after its GPU
/// removal, with no parent) goes back to its chain's shard even when the GPU
/// entry is gone. Direct-mapped: a newer block takes an older one's place.
pub(crate) struct Departed {
    slots: Box<[(u64, u8)]>,
}

const DEPARTED_SLOTS: usize = 256;

impl Default for Departed {
    fn default() -> Self {
        Self {
            slots: vec![(0, 0); DEPARTED_SLOTS].into_boxed_slice(),
        }
    }
}

impl Departed {
    fn index(hash: u64) -> usize {
        (hash.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 56) as usize % DEPARTED_SLOTS
    }

    pub(crate) fn note(&mut self, hash: u64, shard: usize) {
        self.slots[Self::index(hash)] = (hash, shard as u8);
    }

    pub(crate) fn shard_of(&self, hash: u64) -> Option<usize> {
        let (h, s) = self.slots[Self::index(hash)];
        (h == hash && hash != 0).then_some(s as usize)
    }
}
