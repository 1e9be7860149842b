//! The entries of one scope, stored in runs so that a chain's consecutive blocks
//! sit next to each other in memory.
//!
//! ```text
//! blocks: block hash ──▶ Bucket { tag, run, off }   (10 bytes; the tag is the table hash)
//! runs[run].slots:  [ (hash₀, Entry) (hash₁, Entry) (hash₂, Entry) … ]
//! ```
//!
//! A lookup probes the hash table once for block 0, then checks whether the next
//! slot of the same run holds the chain's next hash; only where the run diverges
//! does it probe the table again. The table stays the single source of truth (each
//! hash has exactly one location), so the shortcut is exact: a slot is used only if
//! it is occupied and carries the very hash the chain asks for.
//!
//! New blocks of an event go to a fresh run, or are appended to the parent's run
//! when the parent is its tail (engines that publish one block per event, like
//! SGLang, still get contiguous runs). Runs are freed when their last entry goes
//! and compacted when three quarters of them are vacant (once the writer's
//! removals are done, so an event that removes a whole run never compacts it).
//!
//! Writers look blocks up under the shared lock first ([`Store::plan_store`],
//! [`Store::plan_removal`]) and pass the plans in under the write lock, so the
//! exclusive hold probes the table at most once per new block, and not at all for
//! a block that exists or is removed.

use std::hash::BuildHasher;

use hashbrown::{HashMap, HashTable};

use smallvec::SmallVec;

use super::entry::{Entry, Halves, HolderLists, Holders, HoldersRef, Release};

pub(crate) type Hasher64 = foldhash::fast::RandomState;

/// Where an entry lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Loc {
    pub run: u32,
    pub off: u32,
}

/// Slots a run holds at most, so that an offset fits a bucket's 16 bits. An event
/// with more new blocks continues in a fresh run (the walk's table fallback).
const RUN_SLOTS: usize = 1 << 16;

/// One table bucket: 32 bits of the block's table hash and its location, packed
/// into 10 bytes (a `(u64, Loc)` bucket is 16).
///
/// The tag *is* the table hash ([`spread`] widens it for hashbrown), so growing
/// the table reads no slot. It also screens comparisons: a probe reads the slot
/// (for the exact 64-bit block hash) only when the tags agree, which is the block
/// itself but for a 1-in-2³² chance. 32 bits address up to 2³² buckets.
#[derive(Clone, Copy, Debug)]
#[repr(C, packed(2))]
struct Bucket {
    tag: u32,
    run: u32,
    off: u16,
}

impl Bucket {
    #[inline]
    fn new(tag: u32, loc: Loc) -> Self {
        debug_assert!((loc.off as usize) < RUN_SLOTS);
        Self {
            tag,
            run: loc.run,
            off: loc.off as u16,
        }
    }

    #[inline]
    fn loc(self) -> Loc {
        Loc {
            run: self.run,
            off: u32::from(self.off),
        }
    }
}

/// The 64-bit hash hashbrown takes, from a 32-bit tag: the bucket index comes from
/// the low bits, the control byte from the top seven, all of them the tag's.
#[inline]
fn spread(tag: u32) -> u64 {
    u64::from(tag) | (u64::from(tag) << 32)
}

/// One stored block: its hash and its entry, 28 bytes (4-byte aligned, see
/// [`Halves`]). A vacant slot has no holders.
#[derive(Debug)]
pub(crate) struct Slot {
    hash: Halves,
    pub entry: Entry,
}

impl Slot {
    #[inline]
    pub fn hash(&self) -> u64 {
        self.hash.get()
    }

    fn is_live(&self) -> bool {
        !self.entry.holders.is_empty()
    }
}

/// An entry as readers see it: its fields, and its holders resolved against the
/// store's lists.
#[derive(Clone, Copy)]
pub(crate) struct EntryRef<'a> {
    entry: &'a Entry,
    lists: &'a HolderLists,
}

impl<'a> EntryRef<'a> {
    #[inline]
    pub fn holders(&self) -> HoldersRef<'a> {
        self.entry.holders.with(self.lists)
    }
}

impl std::ops::Deref for EntryRef<'_> {
    type Target = Entry;
    fn deref(&self) -> &Entry {
        self.entry
    }
}

/// A run of slots, usually one stored event's new blocks in chain order.
#[derive(Debug, Default)]
pub(crate) struct Run {
    pub slots: Vec<Slot>,
    live: u32,
}

/// A exact-prefix entry: an entry plus the token count it covers.
#[derive(Debug)]
pub(crate) struct PrefixEntry {
    pub entry: Entry,
    pub token_count: u32,
}

/// What storing one block did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Stored {
    pub created: bool,
    pub newly_held: bool,
}

/// What a writer learned about one block of its event under the shared lock, so
/// that the exclusive hold that follows needs no lookup for it: the table hash,
/// and where the block already is (if it is). Exact until the writer changes the
/// store, because all of a scope's writes are made under its tenant's writer lock.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Planned {
    tag: u32,
    found: Option<Loc>,
}

impl Planned {
    /// The block was absent when planned: storing it creates an entry.
    pub fn is_new(&self) -> bool {
        self.found.is_none()
    }
}

/// A planned removal: the first table bucket with the block's tag, if any: the
/// block's own but for a 1-in-2³² chance, which [`Store::release_planned`]
/// checks against the slot (so planning reads no slot). Bucket positions do not
/// move while entries are only removed.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PlannedRemoval {
    bucket: Option<usize>,
}

/// Runs emptied under the write lock: a hold usually empties at most a few, kept
/// inline so that retiring them allocates nothing under the lock.
pub(crate) type Retired = SmallVec<[Run; 4]>;

/// All entries of one scope.
#[derive(Debug, Default)]
pub(crate) struct Store {
    /// block hash → location. Every bucket names a live slot (removals leave the
    /// table first), so the slot's hash is the key.
    blocks: HashTable<Bucket>,
    hasher: Hasher64,
    runs: Vec<Option<Run>>,
    free_runs: Vec<u32>,
    /// Runs emptied under the write lock, dropped by the writer after it lets go.
    retired: Retired,
    /// Runs that became mostly vacant, to compact in [`Store::settle`].
    sparse: Vec<u32>,
    pub prefixes: HashMap<Box<str>, PrefixEntry, Hasher64>,
    /// The holder lists of entries held by several replicas (blocks and prefixes).
    pub lists: HolderLists,
}

impl Store {
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.blocks.len() + self.prefixes.len()
    }

    /// The block's bucket tag (its table hash).
    #[inline]
    fn tag(&self, block: u64) -> u32 {
        self.hasher.hash_one(block) as u32
    }

    #[inline]
    pub fn loc_of(&self, block: u64) -> Option<Loc> {
        let tag = self.tag(block);
        let runs = &self.runs;
        self.blocks
            .find(spread(tag), |b| holds(runs, *b, tag, block))
            .map(|b| b.loc())
    }

    fn slot(&self, loc: Loc) -> Option<&Slot> {
        slot_in(&self.runs, loc)
    }

    /// The entry of a block hash.
    pub fn block(&self, hash: u64) -> Option<&Entry> {
        let loc = self.loc_of(hash)?;
        self.slot(loc).map(|s| &s.entry)
    }

    /// The entry of a block hash, as readers see it.
    pub fn block_ref(&self, hash: u64) -> Option<EntryRef<'_>> {
        self.block(hash).map(|entry| EntryRef {
            entry,
            lists: &self.lists,
        })
    }

    pub fn get(&self, key: &EntryKey) -> Option<&Entry> {
        match key {
            EntryKey::Block(h) => self.block(*h),
            EntryKey::Prefix(p) => self.prefixes.get(&**p).map(|p| &p.entry),
        }
    }

    /// An entry's holders, to change, with the lists they may spill to.
    pub fn holders_mut(&mut self, key: &EntryKey) -> Option<(&mut Holders, &mut HolderLists)> {
        let holders = match key {
            EntryKey::Block(h) => {
                let loc = self.loc_of(*h)?;
                &mut slot_in_mut(&mut self.runs, loc)?.entry.holders
            }
            EntryKey::Prefix(p) => &mut self.prefixes.get_mut(&**p)?.entry.holders,
        };
        Some((holders, &mut self.lists))
    }

    /// Walks a chain: calls `visit(i, entry)` for each block while it exists,
    /// and stops at the first absent block or when `visit` returns false.
    /// Returns the index where the walk stopped.
    #[inline]
    pub fn walk(&self, chain: &[u64], mut visit: impl FnMut(usize, EntryRef<'_>) -> bool) -> usize {
        // The current run's slots and the offset of the last block found in it.
        let (mut run, mut off): (&[Slot], usize) = (&[], 0);
        for (i, &h) in chain.iter().enumerate() {
            // The next slot of the current run, if it carries this very hash.
            let slot = match run.get(off + 1).filter(|s| s.hash() == h && s.is_live()) {
                Some(s) => {
                    off += 1;
                    s
                }
                None => {
                    let Some(loc) = self.loc_of(h) else {
                        return i;
                    };
                    let Some(r) = self.runs.get(loc.run as usize).and_then(Option::as_ref) else {
                        return i;
                    };
                    (run, off) = (&r.slots, loc.off as usize);
                    let Some(s) = run.get(off) else { return i };
                    s
                }
            };
            let e = EntryRef {
                entry: &slot.entry,
                lists: &self.lists,
            };
            if !visit(i, e) {
                return i;
            }
        }
        chain.len()
    }

    /// [`Self::walk`] for a visitor to whom a block is news only when its holders
    /// differ from the block before's (the lookup's leading runs): a block that
    /// continues the current run with the holders of the block before (the very
    /// same, or a list of the same slots, [`HolderLists::list_mask`]) and was
    /// stored at or after `fresh_from` is passed over without a visit. Most of
    /// a chain is one event's run with one holder, its shared prefix one run of
    /// blocks every replica holds; passing a block over costs a compare of its
    /// hash, holders and stamp, a fifth of a visit.
    #[inline]
    pub fn walk_grouped(
        &self,
        chain: &[u64],
        fresh_from: u64,
        mut visit: impl FnMut(usize, EntryRef<'_>) -> bool,
    ) -> usize {
        let (mut run, mut off): (&[Slot], usize) = (&[], 0);
        let mut i = 0;
        while let Some(&h) = chain.get(i) {
            let slot = match run.get(off + 1).filter(|s| s.hash() == h && s.is_live()) {
                Some(s) => {
                    off += 1;
                    s
                }
                None => {
                    let Some(loc) = self.loc_of(h) else {
                        return i;
                    };
                    let Some(r) = self.runs.get(loc.run as usize).and_then(Option::as_ref) else {
                        return i;
                    };
                    (run, off) = (&r.slots, loc.off as usize);
                    let Some(s) = run.get(off) else { return i };
                    s
                }
            };
            let e = EntryRef {
                entry: &slot.entry,
                lists: &self.lists,
            };
            if !visit(i, e) {
                return i;
            }
            // The same holders mean a live slot: the visited one is. The first
            // test alone answers the blocks that change holders.
            let holders = slot.entry.holders;
            let mask = self.lists.list_mask(holders);
            let same_holders =
                |h: Holders| h == holders || (mask.is_some() && self.lists.list_mask(h) == mask);
            if run
                .get(off + 1)
                .is_some_and(|s| same_holders(s.entry.holders))
            {
                let same = chain
                    .get(i + 1..)
                    .unwrap_or_default()
                    .iter()
                    .zip(run.get(off + 1..).unwrap_or_default())
                    .take_while(|&(&h, s)| {
                        s.hash() == h
                            && same_holders(s.entry.holders)
                            && s.entry.last_seen() >= fresh_from
                    })
                    .count();
                i += same;
                off += same;
            }
            i += 1;
        }
        chain.len()
    }

    /// Looks a block up for a later [`Self::store_planned`] (under the shared lock).
    #[inline]
    pub fn plan_store(&self, block: u64) -> Planned {
        let tag = self.tag(block);
        let runs = &self.runs;
        Planned {
            tag,
            found: self
                .blocks
                .find(spread(tag), |b| holds(runs, *b, tag, block))
                .map(|b| b.loc()),
        }
    }

    /// Looks a block up for a later [`Self::release_planned`] (under the shared lock).
    #[inline]
    pub fn plan_removal(&self, block: u64) -> PlannedRemoval {
        let tag = self.tag(block);
        PlannedRemoval {
            bucket: self.blocks.find_bucket_index(spread(tag), |b| b.tag == tag),
        }
    }

    /// Where a new run for `capacity` slots goes; `spare` (allocated by the writer
    /// before it took the lock) becomes its vector when it is given.
    fn new_run(&mut self, capacity: usize, spare: &mut Option<Vec<Slot>>) -> u32 {
        let slots = match spare.take() {
            Some(v) if v.is_empty() => v,
            _ => Vec::with_capacity(capacity),
        };
        let run = Run { slots, live: 0 };
        match self.free_runs.pop() {
            Some(id) => {
                self.runs[id as usize] = Some(run);
                id
            }
            None => {
                self.runs.push(Some(run));
                (self.runs.len() - 1) as u32
            }
        }
    }

    /// Whether `loc` is the last slot of its run (a new block after it can join it).
    fn ends_run(&self, loc: Loc) -> bool {
        self.runs
            .get(loc.run as usize)
            .and_then(Option::as_ref)
            .is_some_and(|r| r.slots.len() == loc.off as usize + 1 && r.slots.len() < RUN_SLOTS)
    }

    /// Stores one block for `holder` after `prev` (the chain's previous block, if
    /// known). `room` is how many new blocks may follow in this event, to size a
    /// fresh run.
    pub fn store_block(
        &mut self,
        hash: u64,
        prev: Option<u64>,
        holder: u32,
        stamp: u64,
        room: usize,
    ) -> Stored {
        let planned = self.plan_store(hash);
        let mut prev = prev.and_then(|p| self.loc_of(p));
        self.store_planned(hash, planned, &mut prev, holder, stamp, room, &mut None)
    }

    /// [`Self::store_block`] with the lookups done beforehand: `planned` from
    /// [`Self::plan_store`] (made since the last change to the store, or for a
    /// block this event created), `prev` where the chain's previous block is (set
    /// to this block's location on return). A block already stored costs no table
    /// lookup; a new one one insertion.
    #[allow(clippy::too_many_arguments)]
    pub fn store_planned(
        &mut self,
        block: u64,
        planned: Planned,
        prev: &mut Option<Loc>,
        holder: u32,
        stamp: u64,
        room: usize,
        spare: &mut Option<Vec<Slot>>,
    ) -> Stored {
        if let Some(loc) = planned.found {
            return self.hold_at(loc, prev, holder, stamp);
        }
        // Absent when planned; but the event may name it twice.
        let run_id = match *prev {
            Some(l) if self.ends_run(l) => l.run,
            _ => u32::MAX,
        };
        let (tag, runs) = (planned.tag, &self.runs);
        let vacant = match self.blocks.entry(
            spread(tag),
            |b| holds(runs, *b, tag, block),
            |b| spread(b.tag),
        ) {
            hashbrown::hash_table::Entry::Occupied(o) => {
                let loc = o.get().loc();
                return self.hold_at(loc, prev, holder, stamp);
            }
            hashbrown::hash_table::Entry::Vacant(v) => v,
        };
        let run_id = if run_id == u32::MAX {
            // A fresh run: its index is only known once a slot is free or pushed,
            // so claim it with the entry still vacant (the table is borrowed).
            let id = match self.free_runs.last() {
                Some(&id) => id,
                None => self.runs.len() as u32,
            };
            vacant.insert(Bucket::new(tag, Loc { run: id, off: 0 }));
            let created = self.new_run(room.clamp(1, RUN_SLOTS), spare);
            debug_assert_eq!(created, id);
            id
        } else {
            let off = self.runs[run_id as usize]
                .as_ref()
                .map_or(0, |r| r.slots.len() as u32);
            vacant.insert(Bucket::new(tag, Loc { run: run_id, off }));
            run_id
        };
        let Some(run) = self.runs.get_mut(run_id as usize).and_then(Option::as_mut) else {
            return Stored {
                created: false,
                newly_held: false,
            };
        };
        let off = run.slots.len() as u32;
        run.slots.push(Slot {
            hash: Halves::new(block),
            entry: Entry::new(holder, stamp),
        });
        run.live += 1;
        *prev = Some(Loc { run: run_id, off });
        Stored {
            created: true,
            newly_held: true,
        }
    }

    /// One more reference to an existing block.
    fn hold_at(&mut self, loc: Loc, prev: &mut Option<Loc>, holder: u32, stamp: u64) -> Stored {
        *prev = Some(loc);
        let Some(s) = slot_in_mut(&mut self.runs, loc) else {
            return Stored {
                created: false,
                newly_held: false,
            };
        };
        s.entry.refresh(stamp);
        let newly_held = s.entry.holders.add(&mut self.lists, holder);
        Stored {
            created: false,
            newly_held,
        }
    }

    /// Drops one reference of `holder` on a block planned by
    /// [`Self::plan_removal`] (since the last insertion). Returns what the release
    /// did, and whether the entry was removed because its last holder went.
    pub fn release_planned(
        &mut self,
        block: u64,
        planned: PlannedRemoval,
        holder: u32,
    ) -> (Release, bool) {
        // The bucket holds the block unless this event removed it already (only
        // an insertion could give the bucket to another key) or the tag was
        // another block's; then the exact lookup decides.
        let at = |b: usize| {
            let loc = self.blocks.get_bucket(b)?.loc();
            (slot_in(&self.runs, loc)?.hash() == block).then_some((b, loc))
        };
        let exact = || {
            let (tag, runs) = (self.tag(block), &self.runs);
            let b = self
                .blocks
                .find_bucket_index(spread(tag), |b| holds(runs, *b, tag, block))?;
            at(b)
        };
        let Some((bucket, loc)) = planned.bucket.and_then(at).or_else(exact) else {
            return (Release::NotHeld, false);
        };
        let Some(slot) = slot_in_mut(&mut self.runs, loc) else {
            return (Release::NotHeld, false);
        };
        let released = slot.entry.holders.release(&mut self.lists, holder);
        if released != Release::Released || !slot.entry.holders.is_empty() {
            return (released, false);
        }
        if let Ok(e) = self.blocks.get_bucket_entry(bucket) {
            e.remove();
        }
        self.vacate(loc);
        (released, true)
    }

    /// Removes a whole entry, returning the slots that held it.
    pub fn take(&mut self, key: &EntryKey) -> Option<SmallVec<[u32; 4]>> {
        match key {
            EntryKey::Block(h) => self.take_block(*h),
            EntryKey::Prefix(p) => self
                .prefixes
                .remove(&**p)
                .map(|mut p| p.entry.holders.take(&mut self.lists)),
        }
    }

    fn take_block(&mut self, block: u64) -> Option<SmallVec<[u32; 4]>> {
        let tag = self.tag(block);
        let runs = &self.runs;
        let entry = self
            .blocks
            .find_entry(spread(tag), |b| holds(runs, *b, tag, block))
            .ok()?;
        let loc = entry.remove().0.loc();
        let slot = slot_in_mut(&mut self.runs, loc)?;
        let holders = slot.entry.holders.take(&mut self.lists);
        self.vacate(loc);
        Some(holders)
    }

    /// Counts a slot (already out of the table) as vacant: frees its run when it
    /// was the last, notes a run that became mostly vacant for [`Self::settle`].
    fn vacate(&mut self, loc: Loc) {
        let Some(run) = self.runs.get_mut(loc.run as usize).and_then(Option::as_mut) else {
            return;
        };
        if let Some(slot) = run.slots.get_mut(loc.off as usize) {
            // Emptied already, unless a caller vacates a slot still held.
            if slot.entry.holders.is_empty() {
                slot.entry.holders = Holders::vacant();
            } else {
                slot.entry.holders.take(&mut self.lists);
            }
        }
        run.live = run.live.saturating_sub(1);
        if run.live == 0 {
            if let Some(run) = self.runs[loc.run as usize].take() {
                self.retired.push(run);
            }
            self.free_runs.push(loc.run);
            // Freed before it was compacted (a few entries at most).
            self.sparse.retain(|&r| r != loc.run);
        } else if Self::is_sparse(run) && !Self::is_sparse_with(run.live + 1, run.slots.len()) {
            // Just crossed the line; compacted by `settle`, once the writer's
            // removals are done (an event that empties the run frees it instead).
            self.sparse.push(loc.run);
        }
    }

    fn is_sparse(run: &Run) -> bool {
        Self::is_sparse_with(run.live, run.slots.len())
    }

    /// Less than a quarter of a run of at least 16 slots is live.
    fn is_sparse_with(live: u32, len: usize) -> bool {
        (live as usize) * 4 < len && len >= 16
    }

    /// Whether runs wait for [`Self::settle`].
    pub fn has_sparse(&self) -> bool {
        !self.sparse.is_empty()
    }

    /// Compacts the runs that became mostly vacant since the last call and still
    /// are, and hands over the runs emptied meanwhile, for the caller to drop once
    /// it has let go of the lock. Every writer that removes entries calls it
    /// before it lets go of the store for good (the write lock may be let go and
    /// taken again in between).
    #[must_use = "drop the emptied runs after the lock"]
    pub fn settle(&mut self) -> Retired {
        while self.compact_next() {}
        self.take_retired()
    }

    /// Compacts one run left mostly vacant that still is; false when none is
    /// left. For a writer that compacts in holds it can cut short
    /// (`Shard::settle_in_turns`); the emptied runs still go through
    /// [`Self::take_retired`].
    pub fn compact_next(&mut self) -> bool {
        while let Some(run) = self.sparse.pop() {
            if self
                .runs
                .get(run as usize)
                .and_then(Option::as_ref)
                .is_some_and(Self::is_sparse)
            {
                self.compact(run);
                return true;
            }
        }
        false
    }

    /// The runs emptied since the last call, for the writer to drop off the lock.
    pub fn take_retired(&mut self) -> Retired {
        std::mem::take(&mut self.retired)
    }

    /// Drops the vacant slots of a mostly empty run, keeping chain order.
    fn compact(&mut self, run_id: u32) {
        let Some(run) = self.runs.get_mut(run_id as usize).and_then(Option::as_mut) else {
            return;
        };
        // Buckets are found by their old location (unique), before slots move.
        let live = run.slots.iter().enumerate().filter(|(_, s)| s.is_live());
        for (off, (old, s)) in live.enumerate() {
            let tag = self.hasher.hash_one(s.hash()) as u32;
            let old = Loc {
                run: run_id,
                off: old as u32,
            };
            if let Some(b) = self.blocks.find_mut(spread(tag), |b| b.loc() == old) {
                b.off = off as u16;
            }
        }
        run.slots.retain(Slot::is_live);
        run.slots.shrink_to_fit();
    }

    /// Every live entry with its key (victim scans, sweeps).
    /// Visits up to `budget` slots (live or vacant) from `cursor`, blocks in run
    /// order then prefixes, and moves the cursor past them. Returns whether any
    /// remain. The position is exact only while the store's layout does not change
    /// between calls — see [`Cursor`].
    pub fn visit(
        &self,
        cursor: &mut Cursor,
        budget: usize,
        f: &mut impl FnMut(EntryKeyRef<'_>, EntryRef<'_>),
    ) -> bool {
        let mut left = budget;
        while cursor.run < self.runs.len() {
            let Some(run) = &self.runs[cursor.run] else {
                cursor.run += 1;
                continue;
            };
            while cursor.off < run.slots.len() {
                if left == 0 {
                    return true;
                }
                left -= 1;
                let s = &run.slots[cursor.off];
                cursor.off += 1;
                if s.is_live() {
                    let e = EntryRef {
                        entry: &s.entry,
                        lists: &self.lists,
                    };
                    f(EntryKeyRef::Block(s.hash()), e);
                }
            }
            cursor.run += 1;
            cursor.off = 0;
        }
        // Prefixes (exact-prefix keys, few in practice) are resumed by
        // position, which costs a skip per chunk.
        let mut rest = self.prefixes.iter().skip(cursor.prefix).peekable();
        while rest.peek().is_some() {
            if left == 0 {
                return true;
            }
            left -= 1;
            if let Some((p, e)) = rest.next() {
                cursor.prefix += 1;
                let e = EntryRef {
                    entry: &e.entry,
                    lists: &self.lists,
                };
                f(EntryKeyRef::Prefix(p), e);
            }
        }
        false
    }
}

/// The slot at `loc`.
#[inline]
fn slot_in(runs: &[Option<Run>], loc: Loc) -> Option<&Slot> {
    runs.get(loc.run as usize)?
        .as_ref()?
        .slots
        .get(loc.off as usize)
}

/// The slot at `loc`, to change (a free function, so the store's other fields
/// stay borrowable beside it).
#[inline]
fn slot_in_mut(runs: &mut [Option<Run>], loc: Loc) -> Option<&mut Slot> {
    runs.get_mut(loc.run as usize)?
        .as_mut()?
        .slots
        .get_mut(loc.off as usize)
}

/// Whether `bucket` is `block`'s: the tags agree, then the slot's exact hash.
#[inline]
fn holds(runs: &[Option<Run>], bucket: Bucket, tag: u32, block: u64) -> bool {
    bucket.tag == tag && slot_in(runs, bucket.loc()).is_some_and(|s| s.hash() == block)
}

/// A resumable position in a [`Store`], so that a scan can let go of the lock
/// between chunks. Exact (every entry visited once) when nothing moves the store's
/// layout between chunks, which holds for every caller: all writes to a scope's
/// store are made under its tenant's writer lock, and every scan runs holding it;
/// concurrent lookups only read (LFU credits are atomics).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Cursor {
    run: usize,
    off: usize,
    prefix: usize,
}

/// Names one entry of a scope.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) enum EntryKey {
    Block(u64),
    Prefix(Box<str>),
}

/// A borrowed [`EntryKey`], as scans see it.
#[derive(Clone, Copy, Debug)]
pub(crate) enum EntryKeyRef<'a> {
    Block(u64),
    Prefix(&'a str),
}

impl EntryKeyRef<'_> {
    pub fn to_owned(self) -> EntryKey {
        match self {
            Self::Block(h) => EntryKey::Block(h),
            Self::Prefix(p) => EntryKey::Prefix(p.into()),
        }
    }

    /// A deterministic tie-breaker between entries with equal order keys.
    pub fn tiebreak(self) -> u64 {
        match self {
            Self::Block(h) => h,
            Self::Prefix(p) => prefix_seed(p),
        }
    }
}

/// A fixed (process-independent) hash of an exact-prefix key string: seeds affinity so
/// the same prompt pins the same replica on every sidecar.
pub fn prefix_seed(prefix: &str) -> u64 {
    foldhash::fast::FixedState::with_seed(0x1e6a_c9e0_0000_0001).hash_one(prefix)
}

/// A value alone on its cache lines, so the lock word of one shard never shares a
/// line with another's, and what writers bump never shares one with what lookups
/// read.
#[derive(Debug, Default)]
#[repr(align(128))]
pub(crate) struct Padded<T>(pub T);

impl<T> std::ops::Deref for Padded<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

#[cfg(test)]
mod tests;
