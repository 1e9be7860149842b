//! One index entry: a distinct block hash (or legacy prefix hash) in a scope, the
//! replicas holding it with per-replica reference counts, its lastSeen stamp and
//! its access count.
//!
//! Memory is the budget here (≤ 80 bytes per (block, replica) pair with the table
//! around it): one holder is stored inline, several spill to a boxed vector, and
//! the whole entry is 32 bytes.

use std::sync::atomic::{AtomicU32, Ordering};

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

/// The replicas holding an entry. Never empty: an entry whose last holder goes is
/// removed from its scope's store.
#[derive(Debug)]
pub(crate) enum Holders {
    One(Holder),
    /// A thin Box keeps the enum (and so each entry) small for the rare shared block.
    Many(Box<ManyHolders>),
}

/// Several holders, with a bitmask of those in slots 0..64 so that the lookup
/// walk tests membership with one AND instead of a loop.
#[derive(Debug)]
pub(crate) struct ManyHolders {
    pub mask: u64,
    pub list: Vec<Holder>,
}

impl ManyHolders {
    fn rebuild_mask(&mut self) {
        self.mask = self
            .list
            .iter()
            .filter(|h| h.slot < 64)
            .fold(0, |m, h| m | 1 << h.slot);
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

impl Holders {
    pub fn new(slot: u32) -> Self {
        Self::One(Holder { slot, refs: 1 })
    }

    /// The holders of a vacated slot: none.
    pub fn vacant() -> Self {
        Self::One(Holder {
            slot: u32::MAX,
            refs: 0,
        })
    }

    pub fn contains(&self, slot: u32) -> bool {
        match self {
            Self::One(h) => h.slot == slot,
            Self::Many(v) => v.list.iter().any(|h| h.slot == slot),
        }
    }

    /// The holders in slots 0..64 as a bitmask, when that is all of them.
    #[inline]
    pub fn low_mask(&self) -> Option<u64> {
        match self {
            Self::One(h) if h.slot < 64 && h.refs > 0 => Some(1 << h.slot),
            Self::One(h) if h.refs == 0 => Some(0),
            Self::One(_) => None,
            Self::Many(v) => (v.mask.count_ones() as usize == v.list.len()).then_some(v.mask),
        }
    }

    pub fn slots(&self) -> impl Iterator<Item = u32> + '_ {
        let (one, many) = match self {
            Self::One(h) => (Some(h.slot), &[][..]),
            Self::Many(v) => (None, v.list.as_slice()),
        };
        one.into_iter().chain(many.iter().map(|h| h.slot))
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        match self {
            Self::One(_) => 1,
            Self::Many(v) => v.list.len(),
        }
    }

    /// Adds one reference; returns true when the replica newly holds the entry.
    pub fn add(&mut self, slot: u32) -> bool {
        match self {
            Self::One(h) if h.slot == slot => {
                h.refs = h.refs.saturating_add(1);
                false
            }
            Self::One(h) => {
                let first = *h;
                let mut many = ManyHolders {
                    mask: 0,
                    list: vec![first, Holder { slot, refs: 1 }],
                };
                many.rebuild_mask();
                *self = Self::Many(Box::new(many));
                true
            }
            Self::Many(v) => match v.list.iter_mut().find(|h| h.slot == slot) {
                Some(h) => {
                    h.refs = h.refs.saturating_add(1);
                    false
                }
                None => {
                    v.list.push(Holder { slot, refs: 1 });
                    v.rebuild_mask();
                    true
                }
            },
        }
    }

    /// Drops one reference of `slot`. The caller removes the entry when
    /// [`Holders::is_empty_after`] says so.
    pub fn release(&mut self, slot: u32) -> Release {
        match self {
            Self::One(h) if h.slot == slot => {
                h.refs = h.refs.saturating_sub(1);
                if h.refs == 0 {
                    Release::Released
                } else {
                    Release::StillHeld
                }
            }
            Self::One(_) => Release::NotHeld,
            Self::Many(v) => {
                let Some(pos) = v.list.iter().position(|h| h.slot == slot) else {
                    return Release::NotHeld;
                };
                v.list[pos].refs = v.list[pos].refs.saturating_sub(1);
                if v.list[pos].refs > 0 {
                    return Release::StillHeld;
                }
                v.list.swap_remove(pos);
                v.rebuild_mask();
                self.shrink();
                Release::Released
            }
        }
    }

    /// Removes `slot` whatever its count; returns whether it held the entry.
    pub fn remove_all(&mut self, slot: u32) -> bool {
        match self {
            Self::One(h) if h.slot == slot => {
                h.refs = 0;
                true
            }
            Self::One(_) => false,
            Self::Many(v) => {
                let Some(pos) = v.list.iter().position(|h| h.slot == slot) else {
                    return false;
                };
                v.list.swap_remove(pos);
                v.rebuild_mask();
                self.shrink();
                true
            }
        }
    }

    /// True when no replica holds the entry any more (a `One` with zero refs, or
    /// an empty `Many`).
    pub fn is_empty(&self) -> bool {
        match self {
            Self::One(h) => h.refs == 0,
            Self::Many(v) => v.list.is_empty(),
        }
    }

    /// Goes back to the inline form when one holder is left.
    fn shrink(&mut self) {
        if let Self::Many(v) = self
            && v.list.len() == 1
        {
            *self = Self::One(v.list[0]);
        }
    }
}

/// One entry. `accesses` is atomic because LFU crediting happens on the lookup
/// path under a shared lock.
#[derive(Debug)]
pub(crate) struct Entry {
    pub holders: Holders,
    /// Index stamp (nanoseconds since the epoch, made strictly increasing per
    /// tenant) of the newest event that stored this entry.
    pub last_seen: u64,
    pub accesses: AtomicU32,
}

impl Entry {
    pub fn new(slot: u32, stamp: u64) -> Self {
        Self {
            holders: Holders::new(slot),
            last_seen: stamp,
            accesses: AtomicU32::new(0),
        }
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
        now.saturating_sub(self.last_seen) <= ttl
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_stays_small() {
        assert!(
            std::mem::size_of::<Entry>() <= 32,
            "{}",
            std::mem::size_of::<Entry>()
        );
    }

    #[test]
    fn references_are_counted_per_replica() {
        let mut h = Holders::new(1);
        assert!(!h.add(1));
        assert!(h.add(2));
        assert_eq!(h.len(), 2);
        assert_eq!(h.low_mask(), Some(0b110));
        assert!(h.add(70));
        assert_eq!(h.low_mask(), None);
        assert!(h.remove_all(70));
        assert_eq!(h.release(1), Release::StillHeld);
        assert_eq!(h.release(1), Release::Released);
        assert!(!h.contains(1));
        assert_eq!(h.release(1), Release::NotHeld);
        assert!(matches!(h, Holders::One(Holder { slot: 2, refs: 1 })));
        assert_eq!(h.low_mask(), Some(1 << 2));
        assert_eq!(h.release(2), Release::Released);
        assert!(h.is_empty());
    }

    #[test]
    fn remove_all_ignores_counts() {
        let mut h = Holders::new(3);
        h.add(3);
        h.add(4);
        assert!(h.remove_all(3));
        assert!(!h.remove_all(3));
        assert_eq!(h.slots().collect::<Vec<_>>(), vec![4]);
    }

    #[test]
    fn credit_saturates() {
        let e = Entry::new(0, 0);
        e.accesses.store(u32::MAX, Ordering::Relaxed);
        e.credit();
        assert_eq!(e.accesses(), u32::MAX);
    }
}
