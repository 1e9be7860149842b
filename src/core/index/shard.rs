//! A shard of one scope's entries, and the key that names an entry.
//!
//! A scope's entries are split over a fixed number of shards by block hash, each
//! behind its own `RwLock`, so a writer only ever blocks the readers of one shard
//! for the few inserts of one event that land there.

use std::hash::BuildHasher;

use hashbrown::HashMap;

use super::entry::Entry;

pub(crate) type Hasher64 = foldhash::fast::RandomState;

/// A legacy exact-prefix entry: an entry plus the token count it covers.
#[derive(Debug)]
pub(crate) struct PrefixEntry {
    pub entry: Entry,
    pub token_count: u32,
}

/// The entries of one shard.
#[derive(Debug, Default)]
pub(crate) struct Shard {
    pub blocks: HashMap<u64, Entry, Hasher64>,
    pub prefixes: HashMap<Box<str>, PrefixEntry, Hasher64>,
}

impl Shard {
    pub fn get(&self, key: &EntryKey) -> Option<&Entry> {
        match key {
            EntryKey::Block(h) => self.blocks.get(h),
            EntryKey::Prefix(p) => self.prefixes.get(&**p).map(|p| &p.entry),
        }
    }

    /// Removes a whole entry, returning it.
    pub fn take(&mut self, key: &EntryKey) -> Option<Entry> {
        match key {
            EntryKey::Block(h) => self.blocks.remove(h),
            EntryKey::Prefix(p) => self.prefixes.remove(&**p).map(|p| p.entry),
        }
    }

    pub fn get_mut(&mut self, key: &EntryKey) -> Option<&mut Entry> {
        match key {
            EntryKey::Block(h) => self.blocks.get_mut(h),
            EntryKey::Prefix(p) => self.prefixes.get_mut(&**p).map(|p| &mut p.entry),
        }
    }

    /// Every entry with its key, for sweeps and victim scans (read lock held).
    pub fn for_each(&self, mut f: impl FnMut(EntryKeyRef<'_>, &Entry)) {
        for (h, e) in &self.blocks {
            f(EntryKeyRef::Block(*h), e);
        }
        for (p, e) in &self.prefixes {
            f(EntryKeyRef::Prefix(p), &e.entry);
        }
    }
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

/// A fixed (process-independent) hash of a legacy prefix string: picks its shard,
/// and seeds affinity so the same prompt pins the same replica on every sidecar.
pub fn prefix_seed(prefix: &str) -> u64 {
    foldhash::fast::FixedState::with_seed(0x1e6a_c9e0_0000_0001).hash_one(prefix)
}

/// Which shard a 64-bit key lands in. Block hashes are already well mixed, but a
/// multiply keeps adversarial low bits from piling every key into one shard.
#[inline]
pub(crate) fn shard_of(key: u64, shards: usize) -> usize {
    ((key.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40) as usize) % shards
}

/// A value alone on its cache lines, so readers of one shard's lock never share a
/// line with another shard's writer.
#[derive(Debug, Default)]
#[repr(align(128))]
pub(crate) struct Padded<T>(pub T);
