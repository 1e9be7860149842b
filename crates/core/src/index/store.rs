//! The entries of one scope, stored in runs so that a chain's consecutive blocks
//! sit next to each other in memory.
//!
//! ```text
//! blocks: block hash ──▶ Loc { run, off }
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
//! and compacted when three quarters of them are vacant.

use std::hash::BuildHasher;

use hashbrown::HashMap;

use super::entry::{Entry, Holders};

pub(crate) type Hasher64 = foldhash::fast::RandomState;

/// Where an entry lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Loc {
    pub run: u32,
    pub off: u32,
}

/// One stored block: its hash and its entry. A vacant slot has no holders.
#[derive(Debug)]
pub(crate) struct Slot {
    pub hash: u64,
    pub entry: Entry,
}

impl Slot {
    fn is_live(&self) -> bool {
        !self.entry.holders.is_empty()
    }
}

/// A run of slots, usually one stored event's new blocks in chain order.
#[derive(Debug, Default)]
pub(crate) struct Run {
    pub slots: Vec<Slot>,
    live: u32,
}

/// A legacy exact-prefix entry: an entry plus the token count it covers.
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

/// All entries of one scope.
#[derive(Debug, Default)]
pub(crate) struct Store {
    blocks: HashMap<u64, Loc, Hasher64>,
    runs: Vec<Option<Run>>,
    free_runs: Vec<u32>,
    pub prefixes: HashMap<Box<str>, PrefixEntry, Hasher64>,
}

impl Store {
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.blocks.len() + self.prefixes.len()
    }

    fn slot(&self, loc: Loc) -> Option<&Slot> {
        self.runs
            .get(loc.run as usize)?
            .as_ref()?
            .slots
            .get(loc.off as usize)
    }

    fn slot_mut(&mut self, loc: Loc) -> Option<&mut Slot> {
        self.runs
            .get_mut(loc.run as usize)?
            .as_mut()?
            .slots
            .get_mut(loc.off as usize)
    }

    /// The entry of a block hash.
    pub fn block(&self, hash: u64) -> Option<&Entry> {
        let loc = *self.blocks.get(&hash)?;
        self.slot(loc).map(|s| &s.entry)
    }

    pub fn get(&self, key: &EntryKey) -> Option<&Entry> {
        match key {
            EntryKey::Block(h) => self.block(*h),
            EntryKey::Prefix(p) => self.prefixes.get(&**p).map(|p| &p.entry),
        }
    }

    pub fn get_mut(&mut self, key: &EntryKey) -> Option<&mut Entry> {
        match key {
            EntryKey::Block(h) => {
                let loc = *self.blocks.get(h)?;
                self.slot_mut(loc).map(|s| &mut s.entry)
            }
            EntryKey::Prefix(p) => self.prefixes.get_mut(&**p).map(|p| &mut p.entry),
        }
    }

    /// Walks a chain: calls `visit(i, entry)` for each block while it exists,
    /// and stops at the first absent block or when `visit` returns false.
    /// Returns the index where the walk stopped.
    #[inline]
    pub fn walk(&self, chain: &[u64], mut visit: impl FnMut(usize, &Entry) -> bool) -> usize {
        // The current run's slots and the offset of the last block found in it.
        let (mut run, mut off): (&[Slot], usize) = (&[], 0);
        for (i, &h) in chain.iter().enumerate() {
            // The next slot of the current run, if it carries this very hash.
            let slot = match run.get(off + 1).filter(|s| s.hash == h && s.is_live()) {
                Some(s) => {
                    off += 1;
                    s
                }
                None => {
                    let Some(&loc) = self.blocks.get(&h) else {
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
            if !visit(i, &slot.entry) {
                return i;
            }
        }
        chain.len()
    }

    fn new_run(&mut self, capacity: usize) -> u32 {
        let run = Run {
            slots: Vec::with_capacity(capacity),
            live: 0,
        };
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

    /// Stores one block for `slot` after `prev` (the chain's previous block, if
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
        if let Some(&loc) = self.blocks.get(&hash)
            && let Some(s) = self.slot_mut(loc)
        {
            s.entry.last_seen = s.entry.last_seen.max(stamp);
            let newly_held = s.entry.holders.add(holder);
            return Stored {
                created: false,
                newly_held,
            };
        }
        // Append right after the previous block when it ends its run.
        let tail_of = prev
            .and_then(|p| self.blocks.get(&p).copied())
            .filter(|l| {
                self.runs
                    .get(l.run as usize)
                    .and_then(Option::as_ref)
                    .is_some_and(|r| r.slots.len() == l.off as usize + 1)
            })
            .map(|l| l.run);
        let run_id = match tail_of {
            Some(r) => r,
            None => self.new_run(room.max(1)),
        };
        let Some(run) = self.runs.get_mut(run_id as usize).and_then(Option::as_mut) else {
            return Stored {
                created: false,
                newly_held: false,
            };
        };
        let off = run.slots.len() as u32;
        run.slots.push(Slot {
            hash,
            entry: Entry::new(holder, stamp),
        });
        run.live += 1;
        self.blocks.insert(hash, Loc { run: run_id, off });
        Stored {
            created: true,
            newly_held: true,
        }
    }

    /// Removes a whole entry, returning its holders.
    pub fn take(&mut self, key: &EntryKey) -> Option<Holders> {
        match key {
            EntryKey::Block(h) => self.take_block(*h),
            EntryKey::Prefix(p) => self.prefixes.remove(&**p).map(|p| p.entry.holders),
        }
    }

    fn take_block(&mut self, hash: u64) -> Option<Holders> {
        let loc = self.blocks.remove(&hash)?;
        let run = self.runs.get_mut(loc.run as usize)?.as_mut()?;
        let slot = run.slots.get_mut(loc.off as usize)?;
        let holders = std::mem::replace(&mut slot.entry.holders, Holders::vacant());
        run.live = run.live.saturating_sub(1);
        if run.live == 0 {
            self.runs[loc.run as usize] = None;
            self.free_runs.push(loc.run);
        } else if (run.live as usize) * 4 < run.slots.len() && run.slots.len() >= 16 {
            self.compact(loc.run);
        }
        Some(holders)
    }

    /// Drops the vacant slots of a mostly empty run, keeping chain order.
    fn compact(&mut self, run_id: u32) {
        let Some(run) = self.runs.get_mut(run_id as usize).and_then(Option::as_mut) else {
            return;
        };
        run.slots.retain(Slot::is_live);
        run.slots.shrink_to_fit();
        for (off, s) in run.slots.iter().enumerate() {
            if let Some(loc) = self.blocks.get_mut(&s.hash) {
                loc.off = off as u32;
            }
        }
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
        f: &mut impl FnMut(EntryKeyRef<'_>, &Entry),
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
                    f(EntryKeyRef::Block(s.hash), &s.entry);
                }
            }
            cursor.run += 1;
            cursor.off = 0;
        }
        // Prefixes (legacy exact-prefix keys, few in practice) are resumed by
        // position, which costs a skip per chunk.
        let mut rest = self.prefixes.iter().skip(cursor.prefix).peekable();
        while rest.peek().is_some() {
            if left == 0 {
                return true;
            }
            left -= 1;
            if let Some((p, e)) = rest.next() {
                cursor.prefix += 1;
                f(EntryKeyRef::Prefix(p), &e.entry);
            }
        }
        false
    }
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

/// A fixed (process-independent) hash of a legacy prefix string: seeds affinity so
/// the same prompt pins the same replica on every sidecar.
pub fn prefix_seed(prefix: &str) -> u64 {
    foldhash::fast::FixedState::with_seed(0x1e6a_c9e0_0000_0001).hash_one(prefix)
}

/// A value alone on its cache lines, so the lock word of one scope never shares a
/// line with another's.
#[derive(Debug, Default)]
#[repr(align(128))]
pub(crate) struct Padded<T>(pub T);

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(n: u64) -> Vec<u64> {
        (1..=n).map(|i| i * 0x9e37_79b9).collect()
    }

    fn store_chain(s: &mut Store, hashes: &[u64], holder: u32, parent: Option<u64>) {
        let mut prev = parent;
        for (i, &h) in hashes.iter().enumerate() {
            s.store_block(h, prev, holder, 1, hashes.len() - i);
            prev = Some(h);
        }
    }

    #[test]
    fn walk_follows_runs_and_falls_back_to_the_table() {
        let mut s = Store::default();
        let c = chain(8);
        store_chain(&mut s, &c[..4], 0, None);
        // A second event continues the chain: appended to the same run.
        store_chain(&mut s, &c[4..], 0, Some(c[3]));
        assert_eq!(s.runs.iter().flatten().count(), 1);
        assert_eq!(s.walk(&c, |_, _| true), 8);
        // A hole in the middle stops the walk there.
        s.take(&EntryKey::Block(c[5]));
        assert_eq!(s.walk(&c, |_, _| true), 5);
        // Re-stored elsewhere (a new run), the walk finds it through the table.
        store_chain(&mut s, &c[5..6], 1, Some(c[4]));
        assert_eq!(s.walk(&c, |_, _| true), 8);
    }

    #[test]
    fn runs_are_freed_and_compacted() {
        let mut s = Store::default();
        let c = chain(32);
        store_chain(&mut s, &c, 0, None);
        for &h in &c[..25] {
            s.take(&EntryKey::Block(h));
        }
        // Compacted: 7 live slots left, still walkable from block 25.
        assert_eq!(s.walk(&c[25..], |_, _| true), 7);
        let run_len: usize = s.runs.iter().flatten().map(|r| r.slots.len()).sum();
        assert!(run_len < 16, "{run_len}");
        for &h in &c[25..] {
            s.take(&EntryKey::Block(h));
        }
        assert_eq!(s.runs.iter().flatten().count(), 0);
        assert_eq!(s.len(), 0);
    }
}
