//! One index entry: a distinct block hash (or exact-prefix hash) in a scope, the
//! replicas holding it with per-replica reference counts, its lastSeen stamp and
//! its access count.
//!
//! Memory is the budget here (bytes per (block, replica) pair with the table
//! around it): one holder is stored inline, several spill to a list the store
//! keeps, and the whole entry is 24 bytes (a stored block with its hash, 32).

use std::sync::atomic::{AtomicU32, Ordering};

use smallvec::SmallVec;

use super::event::Tier;

/// A holder's slot carries its tier in the top two bits: 0 is the GPU pool, so
/// a GPU holder's slot is the replica's slot and the lookup's GPU walk never sees
/// a lower tier (such a holder is outside every slot bitset). Replica slots stay
/// below 2^30.
const TIER_SHIFT: u32 = 30;
pub(crate) const SLOT_MASK: u32 = (1 << TIER_SHIFT) - 1;

/// The holder slot of `slot`'s copy in `tier`.
pub(crate) fn tier_slot(slot: u32, tier: Tier) -> u32 {
    (slot & SLOT_MASK) | tier.code() << TIER_SHIFT
}

/// `(replica slot, tier code)` of a holder slot (code 0 = GPU).
#[inline]
pub(crate) fn split_slot(holder: u32) -> (u32, u32) {
    (holder & SLOT_MASK, holder >> TIER_SHIFT)
}

/// A replica (by its slot in the scope's replica table) and how many times it has
/// stored the hash without removing it. Engines do not deduplicate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Holder {
    pub slot: u32,
    pub refs: u32,
}

/// The holder slot that marks a spilled entry (tier code 3 is no tier).
const SPILLED: u32 = u32::MAX - 1;

/// The replicas holding an entry: one holder inline, or (`slot` = [`SPILLED`]) the
/// index of a [`ManyHolders`] in the store's [`HolderLists`]. Eight bytes, so an
/// entry is 24 and a stored block 32; several holders are the rare shared block.
/// Never empty while stored: an entry whose last holder goes is removed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Holders(Holder);

/// Several holders, with a bitmask of those in slots 0..64 so that the lookup
/// walk tests membership with one AND instead of a loop.
#[derive(Debug, Default)]
pub(crate) struct ManyHolders {
    pub mask: u64,
    /// Holders outside the mask (slots from 64, lower tiers): kept so that the
    /// walk knows the mask is all of them without a popcount, which this
    /// target compiles to some twenty instructions per shared block.
    high: u32,
    pub list: Vec<Holder>,
}

impl ManyHolders {
    fn rebuild_mask(&mut self) {
        self.mask = self
            .list
            .iter()
            .filter(|h| h.slot < 64)
            .fold(0, |m, h| m | 1 << h.slot);
        self.high = self.list.iter().filter(|h| h.slot >= 64).count() as u32;
    }
}

/// The holder lists of a store's spilled entries, by index; freed lists are reused.
#[derive(Debug, Default)]
pub(crate) struct HolderLists {
    lists: Vec<ManyHolders>,
    free: Vec<u32>,
}

impl HolderLists {
    fn get(&self, i: u32) -> Option<&ManyHolders> {
        self.lists.get(i as usize)
    }

    /// The slot mask of spilled holders when no holder is outside it (no slot
    /// from 64, no lower tier): two such with one mask hold for the very same
    /// replicas, though they are different lists (the blocks of a shared
    /// prefix each have their own). `None` for inline holders.
    #[inline]
    pub fn list_mask(&self, holders: Holders) -> Option<u64> {
        match holders.0 {
            Holder {
                slot: SPILLED,
                refs,
            } => self.get(refs).filter(|v| v.high == 0).map(|v| v.mask),
            _ => None,
        }
    }

    fn get_mut(&mut self, i: u32) -> Option<&mut ManyHolders> {
        self.lists.get_mut(i as usize)
    }

    fn alloc(&mut self, many: ManyHolders) -> u32 {
        match self.free.pop() {
            Some(i) => {
                self.lists[i as usize] = many;
                i
            }
            None => {
                self.lists.push(many);
                (self.lists.len() - 1) as u32
            }
        }
    }

    fn release(&mut self, i: u32) -> ManyHolders {
        let many = self
            .lists
            .get_mut(i as usize)
            .map(std::mem::take)
            .unwrap_or_default();
        self.free.push(i);
        many
    }

    #[cfg(test)]
    pub fn in_use(&self) -> usize {
        self.lists.len() - self.free.len()
    }
}

/// What dropping one reference did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Release {
    /// The replica did not hold the entry (a double removal).
    NotHeld,
    /// The replica still holds it (it had stored it more than once).
    StillHeld,
    /// The replica no longer holds it.
    Released,
}

/// An entry's holders as readers see them (the entry and its store's lists).
#[derive(Clone, Copy)]
pub(crate) struct HoldersRef<'a> {
    holders: Holders,
    lists: &'a HolderLists,
}

impl<'a> HoldersRef<'a> {
    fn many(&self) -> Option<&'a ManyHolders> {
        match self.holders.0 {
            Holder {
                slot: SPILLED,
                refs,
            } => self.lists.get(refs),
            _ => None,
        }
    }

    pub fn contains(&self, slot: u32) -> bool {
        match self.many() {
            // The mask is exactly the listed slots below 64.
            Some(v) if slot < 64 => v.mask & (1 << slot) != 0,
            Some(v) => v.list.iter().any(|h| h.slot == slot),
            None => self.holders.0.slot == slot && self.holders.0.refs > 0,
        }
    }

    /// The holders in slots 0..64 as a bitmask, when that is all of them.
    #[inline]
    pub fn low_mask(&self) -> Option<u64> {
        let h = self.holders.0;
        if h.slot == SPILLED {
            let v = self.many()?;
            return (v.high == 0).then_some(v.mask);
        }
        if h.refs == 0 {
            Some(0)
        } else if h.slot < 64 {
            Some(1 << h.slot)
        } else {
            None
        }
    }

    pub fn slots(&self) -> impl Iterator<Item = u32> + 'a {
        let (one, many) = match self.many() {
            Some(v) => (None, v.list.as_slice()),
            None if self.holders.0.refs > 0 => (Some(self.holders.0.slot), &[][..]),
            None => (None, &[][..]),
        };
        one.into_iter().chain(many.iter().map(|h| h.slot))
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        match self.many() {
            Some(v) => v.list.len(),
            None => usize::from(self.holders.0.refs > 0),
        }
    }
}

impl Holders {
    pub fn new(slot: u32) -> Self {
        Self(Holder { slot, refs: 1 })
    }

    /// The holders of a vacated slot: none.
    pub fn vacant() -> Self {
        Self(Holder {
            slot: u32::MAX,
            refs: 0,
        })
    }

    /// Read access, with the store's lists.
    pub fn with<'a>(&self, lists: &'a HolderLists) -> HoldersRef<'a> {
        HoldersRef {
            holders: *self,
            lists,
        }
    }

    /// Adds one reference; returns true when the replica newly holds the entry.
    pub fn add(&mut self, lists: &mut HolderLists, slot: u32) -> bool {
        match self.0 {
            Holder {
                slot: SPILLED,
                refs,
            } => {
                let Some(v) = lists.get_mut(refs) else {
                    return false;
                };
                // A slot 0..64 missing from the mask is not in the list.
                if (slot >= 64 || v.mask & (1 << slot) != 0)
                    && let Some(h) = v.list.iter_mut().find(|h| h.slot == slot)
                {
                    h.refs = h.refs.saturating_add(1);
                    return false;
                }
                v.list.push(Holder { slot, refs: 1 });
                if slot < 64 {
                    v.mask |= 1 << slot;
                } else {
                    v.high += 1;
                }
                true
            }
            Holder { slot: s, refs } if s == slot && refs > 0 => {
                self.0.refs = refs.saturating_add(1);
                false
            }
            Holder { refs: 0, .. } => {
                *self = Self::new(slot);
                true
            }
            first => {
                let mut many = ManyHolders {
                    mask: 0,
                    high: 0,
                    list: vec![first, Holder { slot, refs: 1 }],
                };
                many.rebuild_mask();
                *self = Self(Holder {
                    slot: SPILLED,
                    refs: lists.alloc(many),
                });
                true
            }
        }
    }

    /// Drops one reference of `slot`. The caller removes the entry when
    /// [`Holders::is_empty`] says so.
    pub fn release(&mut self, lists: &mut HolderLists, slot: u32) -> Release {
        self.let_go(lists, slot, 1)
    }

    /// Removes `slot` whatever its count; returns whether it held the entry.
    pub fn remove_all(&mut self, lists: &mut HolderLists, slot: u32) -> bool {
        self.let_go(lists, slot, u32::MAX) != Release::NotHeld
    }

    /// Drops up to `refs` references of `slot`.
    fn let_go(&mut self, lists: &mut HolderLists, slot: u32, refs: u32) -> Release {
        match self.0 {
            Holder {
                slot: SPILLED,
                refs: list,
            } => {
                let Some(v) = lists.get_mut(list) else {
                    return Release::NotHeld;
                };
                let Some(pos) = v.list.iter().position(|h| h.slot == slot) else {
                    return Release::NotHeld;
                };
                v.list[pos].refs = v.list[pos].refs.saturating_sub(refs);
                if v.list[pos].refs > 0 {
                    return Release::StillHeld;
                }
                v.list.swap_remove(pos);
                v.rebuild_mask();
                self.shrink(lists);
                Release::Released
            }
            Holder {
                slot: s,
                refs: held,
            } if s == slot && held > 0 => {
                self.0.refs = held.saturating_sub(refs);
                if self.0.refs == 0 {
                    Release::Released
                } else {
                    Release::StillHeld
                }
            }
            _ => Release::NotHeld,
        }
    }

    /// True when no replica holds the entry any more. A spilled entry has at
    /// least two holders (it goes back inline at one).
    pub fn is_empty(&self) -> bool {
        self.0.slot != SPILLED && self.0.refs == 0
    }

    /// Takes the holders out (the entry is going), freeing a spilled list: the
    /// slots that held it.
    pub fn take(&mut self, lists: &mut HolderLists) -> SmallVec<[u32; 4]> {
        let out = match self.0 {
            Holder {
                slot: SPILLED,
                refs,
            } => lists.release(refs).list.iter().map(|h| h.slot).collect(),
            Holder { refs: 0, .. } => SmallVec::new(),
            Holder { slot, .. } => SmallVec::from_elem(slot, 1),
        };
        *self = Self::vacant();
        out
    }

    /// Goes back inline when one holder is left.
    fn shrink(&mut self, lists: &mut HolderLists) {
        if let Holder {
            slot: SPILLED,
            refs,
        } = self.0
            && lists.get(refs).is_some_and(|v| v.list.len() == 1)
        {
            let one = lists.release(refs).list[0];
            *self = Self(one);
        }
    }
}

/// A `u64` kept as two `u32` halves, so that it needs only 4-byte alignment: an
/// [`Entry`] is then 20 bytes and a stored block ([`super::store::Slot`]) 28, where
/// 8-byte alignment padded them to 24 and 32 (4 bytes a block, an eighth of the
/// index's memory).
#[derive(Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Halves([u32; 2]);

impl Halves {
    #[inline]
    pub const fn new(v: u64) -> Self {
        Self([v as u32, (v >> 32) as u32])
    }

    #[inline]
    pub const fn get(self) -> u64 {
        self.0[0] as u64 | (self.0[1] as u64) << 32
    }
}

impl std::fmt::Debug for Halves {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.get().fmt(f)
    }
}

/// One entry. `accesses` is atomic because LFU crediting happens on the lookup
/// path under a shared lock.
#[derive(Debug)]
pub(crate) struct Entry {
    pub holders: Holders,
    /// Index stamp (nanoseconds since the epoch, made strictly increasing per
    /// tenant) of the newest event that stored this entry.
    last_seen: Halves,
    pub accesses: AtomicU32,
}

impl Entry {
    pub fn new(slot: u32, stamp: u64) -> Self {
        Self {
            holders: Holders::new(slot),
            last_seen: Halves::new(stamp),
            accesses: AtomicU32::new(0),
        }
    }

    #[inline]
    pub fn last_seen(&self) -> u64 {
        self.last_seen.get()
    }

    /// A newer event stored the entry again.
    pub fn refresh(&mut self, stamp: u64) {
        self.last_seen = Halves::new(self.last_seen().max(stamp));
    }

    pub fn accesses(&self) -> u32 {
        self.accesses.load(Ordering::Relaxed)
    }

    pub fn credit(&self) {
        // Saturating: a wrapped counter would make the hottest entry the first LFU victim.
        let _ = self
            .accesses
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |a| a.checked_add(1));
    }

    /// Whether the entry is still usable `now` under a TTL (both in nanoseconds).
    pub fn is_fresh(&self, now: u64, ttl: u64) -> bool {
        now.saturating_sub(self.last_seen()) <= ttl
    }
}

/// The oldest stamp [`Entry::is_fresh`] accepts at `now` under `ttl`: an entry
/// is fresh exactly when `last_seen >= fresh_from(now, ttl)` (one compare).
#[inline]
pub(crate) fn fresh_from(now: u64, ttl: u64) -> u64 {
    now.saturating_sub(ttl)
}

#[cfg(test)]
mod tests;
