//! One index entry: a distinct block hash (or legacy prefix hash) in a scope, the
//! replicas holding it with per-replica reference counts, its lastSeen stamp and
//! its access count.
//!
//! Memory is the budget here (≤ 80 bytes per (block, replica) pair with the table
//! around it): one holder is stored inline, several spill to a boxed vector, and
//! the whole entry is 32 bytes.

use std::sync::atomic::{AtomicU32, Ordering};

/// A replica (by its slot in the scope's replica table) and how many times it has
/// stored the hash without removing it. Engines do not deduplicate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Holder {
    pub slot: u32,
    pub refs: u32,
}

/// The replicas holding an entry. Never empty: an entry whose last holder goes is
/// removed from its shard.
#[derive(Debug)]
pub(crate) enum Holders {
    One(Holder),
    // A thin Box keeps the enum (and so each entry) small: a plain Vec would
    // add 8 bytes to every entry for the rare shared block.
    #[allow(clippy::box_collection)]
    Many(Box<Vec<Holder>>),
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

    pub fn contains(&self, slot: u32) -> bool {
        match self {
            Self::One(h) => h.slot == slot,
            Self::Many(v) => v.iter().any(|h| h.slot == slot),
        }
    }

    pub fn slots(&self) -> impl Iterator<Item = u32> + '_ {
        let (one, many) = match self {
            Self::One(h) => (Some(h.slot), &[][..]),
            Self::Many(v) => (None, v.as_slice()),
        };
        one.into_iter().chain(many.iter().map(|h| h.slot))
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        match self {
            Self::One(_) => 1,
            Self::Many(v) => v.len(),
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
                *self = Self::Many(Box::new(vec![first, Holder { slot, refs: 1 }]));
                true
            }
            Self::Many(v) => match v.iter_mut().find(|h| h.slot == slot) {
                Some(h) => {
                    h.refs = h.refs.saturating_add(1);
                    false
                }
                None => {
                    v.push(Holder { slot, refs: 1 });
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
                let Some(pos) = v.iter().position(|h| h.slot == slot) else {
                    return Release::NotHeld;
                };
                v[pos].refs = v[pos].refs.saturating_sub(1);
                if v[pos].refs > 0 {
                    return Release::StillHeld;
                }
                v.swap_remove(pos);
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
                let Some(pos) = v.iter().position(|h| h.slot == slot) else {
                    return false;
                };
                v.swap_remove(pos);
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
            Self::Many(v) => v.is_empty(),
        }
    }

    /// Goes back to the inline form when one holder is left.
    fn shrink(&mut self) {
        if let Self::Many(v) = self
            && v.len() == 1
        {
            *self = Self::One(v[0]);
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
        assert_eq!(h.release(1), Release::StillHeld);
        assert_eq!(h.release(1), Release::Released);
        assert!(!h.contains(1));
        assert_eq!(h.release(1), Release::NotHeld);
        assert!(matches!(h, Holders::One(Holder { slot: 2, refs: 1 })));
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
