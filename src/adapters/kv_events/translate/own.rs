//! The engine hash → own positions map of one replica ([`OwnTable`]).
//!
//! Written for ingest's access pattern: every stored block inserts one engine hash
//! (an engine's pool is millions of blocks, so the map is far larger than the
//! processor's caches and each insert is a cache miss), and lookups are rarer (one
//! parent per event, one per removed block). A `HashMap<u64, SmallVec<[Position;
//! 1]>>` kept each position in its bucket: 40 bytes, half of them across two
//! cache lines, written at a random place per block, and moved whole whenever the
//! map grew. Here the hash map holds only engine hash → slot (16-byte buckets, four
//! to a line, never across two), and the positions sit in a slot array that a
//! new event's blocks fill in order (freed slots are reused first).
//!
//! An engine hash with more than one position (SGLang 0.5.3 names a page by its
//! own tokens, so one hash can sit under several parents) keeps them in a side
//! map, in the order the module docs of `translate` give; its slot says so.

use std::collections::HashMap;
use std::collections::hash_map::Entry;

use smallvec::SmallVec;

use super::{Hasher, Position};

/// The slot of an engine hash whose positions are in `several`.
const SEVERAL: u32 = u32::MAX;

/// Engine hash → its own positions, least recently stored first.
#[derive(Debug, Default)]
pub(super) struct OwnTable {
    /// engine hash → its position's index in `slots`, or [`SEVERAL`].
    index: HashMap<u64, u32, Hasher>,
    /// Positions of engine hashes with one (free ones are stale).
    slots: Vec<Position>,
    /// Free indices in `slots`, reused last freed first.
    free: Vec<u32>,
    /// The positions of engine hashes with more than one (or, should `slots`
    /// ever run out of indices, with any number).
    several: HashMap<u64, SmallVec<[Position; 2]>, Hasher>,
}

/// What [`OwnTable::store`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Stored {
    /// A position the engine hash did not have (a new mapping).
    New,
    /// One more reference to a position it had.
    Again,
}

/// A slot for `p`: a free one, else a new one; `None` past the last index.
fn place(slots: &mut Vec<Position>, free: &mut Vec<u32>, p: Position) -> Option<u32> {
    if let Some(i) = free.pop()
        && let Some(slot) = slots.get_mut(i as usize)
    {
        *slot = p;
        return Some(i);
    }
    let i = u32::try_from(slots.len()).ok().filter(|i| *i != SEVERAL)?;
    slots.push(p);
    Some(i)
}

impl OwnTable {
    /// Engine hashes mapped.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.index.len()
    }

    /// Room for `additional` more engine hashes without growing.
    pub(super) fn reserve(&mut self, additional: usize) {
        self.index.reserve(additional);
        self.slots
            .reserve(additional.saturating_sub(self.free.len()));
    }

    /// The most recently stored position of `engine`.
    pub(super) fn last(&self, engine: u64) -> Option<Position> {
        match *self.index.get(&engine)? {
            SEVERAL => self.several.get(&engine)?.last().copied(),
            i => self.slots.get(i as usize).copied(),
        }
    }

    /// One more reference to the most recently stored position of `engine`, which
    /// is returned.
    pub(super) fn bump_last(&mut self, engine: u64) -> Option<Position> {
        let p = match *self.index.get(&engine)? {
            SEVERAL => self.several.get_mut(&engine)?.last_mut()?,
            i => self.slots.get_mut(i as usize)?,
        };
        p.refs = p.refs.saturating_add(1);
        Some(*p)
    }

    /// `engine` stored as (content, identity): one more reference to that position
    /// (now the most recently stored), or a new one after the others.
    pub(super) fn store(&mut self, engine: u64, content: u64, identity: u64) -> Stored {
        let pos = Position {
            content,
            identity,
            refs: 1,
        };
        let mut at = match self.index.entry(engine) {
            // The common case: an engine hash not seen before.
            Entry::Vacant(v) => {
                match place(&mut self.slots, &mut self.free, pos) {
                    Some(i) => {
                        v.insert(i);
                    }
                    None => {
                        v.insert(SEVERAL);
                        self.several.insert(engine, smallvec::smallvec![pos]);
                    }
                }
                return Stored::New;
            }
            Entry::Occupied(o) => o,
        };
        let i = *at.get();
        if i != SEVERAL
            && let Some(p) = self.slots.get_mut(i as usize)
        {
            if (p.content, p.identity) == (content, identity) {
                p.refs = p.refs.saturating_add(1);
                return Stored::Again;
            }
            // A second position: both move to the side map.
            let first = *p;
            self.free.push(i);
            *at.get_mut() = SEVERAL;
            self.several.insert(engine, smallvec::smallvec![first, pos]);
            return Stored::New;
        }
        let slots = self.several.entry(engine).or_default();
        match slots
            .iter()
            .position(|p| (p.content, p.identity) == (content, identity))
        {
            Some(i) if i + 1 == slots.len() => {
                slots[i].refs = slots[i].refs.saturating_add(1);
                Stored::Again
            }
            Some(i) => {
                let mut p = slots.remove(i);
                p.refs = p.refs.saturating_add(1);
                slots.push(p);
                Stored::Again
            }
            None => {
                slots.push(pos);
                Stored::New
            }
        }
    }

    /// Takes one reference from the least recently stored position of `engine`:
    /// that position (as it was), and whether it had no reference left and went.
    pub(super) fn release_first(&mut self, engine: u64) -> Option<(Position, bool)> {
        let Entry::Occupied(at) = self.index.entry(engine) else {
            return None;
        };
        let i = *at.get();
        if i != SEVERAL {
            let slot = self.slots.get_mut(i as usize)?;
            let p = *slot;
            slot.refs -= 1;
            if slot.refs > 0 {
                return Some((p, false));
            }
            self.free.push(i);
            at.remove();
            return Some((p, true));
        }
        let slots = self.several.get_mut(&engine)?;
        let first = slots.first_mut()?;
        let p = *first;
        first.refs -= 1;
        if first.refs > 0 {
            return Some((p, false));
        }
        slots.remove(0);
        if slots.is_empty() {
            self.several.remove(&engine);
            at.remove();
        }
        Some((p, true))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pos(content: u64, identity: u64, refs: u32) -> Position {
        Position {
            content,
            identity,
            refs,
        }
    }

    /// The map this table replaced, with its operations as `translate` used them:
    /// the reference the table is checked against.
    #[derive(Default)]
    struct Model {
        own: HashMap<u64, SmallVec<[Position; 1]>>,
    }

    impl Model {
        fn store(&mut self, engine: u64, content: u64, identity: u64) -> Stored {
            let slots = self.own.entry(engine).or_default();
            match slots
                .iter()
                .position(|p| (p.content, p.identity) == (content, identity))
            {
                Some(i) => {
                    let mut p = slots.remove(i);
                    p.refs = p.refs.saturating_add(1);
                    slots.push(p);
                    Stored::Again
                }
                None => {
                    slots.push(pos(content, identity, 1));
                    Stored::New
                }
            }
        }

        fn release_first(&mut self, engine: u64) -> Option<(Position, bool)> {
            let slots = self.own.get_mut(&engine)?;
            let first = slots.first_mut()?;
            let p = *first;
            first.refs -= 1;
            if first.refs > 0 {
                return Some((p, false));
            }
            slots.remove(0);
            if slots.is_empty() {
                self.own.remove(&engine);
            }
            Some((p, true))
        }

        fn bump_last(&mut self, engine: u64) -> Option<Position> {
            let p = self.own.get_mut(&engine)?.last_mut()?;
            p.refs = p.refs.saturating_add(1);
            Some(*p)
        }
    }

    #[test]
    fn freed_slots_are_reused_and_a_second_position_frees_the_first_slot() {
        let mut t = OwnTable::default();
        for k in 0..4 {
            assert_eq!(t.store(k, 10 + k, 0), Stored::New);
        }
        assert_eq!(t.slots.len(), 4);
        // Removal frees a slot; the next new hash takes it, the others keep theirs.
        assert_eq!(t.release_first(1), Some((pos(11, 0, 1), true)));
        assert_eq!(t.store(9, 19, 0), Stored::New);
        assert_eq!(t.slots.len(), 4);
        // A second position for hash 2 moves both to the side map and frees its
        // slot, which hash 8 then takes.
        assert_eq!(t.store(2, 99, 0), Stored::New);
        assert_eq!(t.store(8, 18, 0), Stored::New);
        assert_eq!(t.slots.len(), 4);
        for (k, v) in [(0, 10), (2, 99), (3, 13), (8, 18), (9, 19)] {
            assert_eq!(t.last(k).map(|p| p.content), Some(v), "{k}");
        }
        assert_eq!(t.last(1), None);
        assert_eq!(t.release_first(2), Some((pos(12, 0, 1), true)));
        assert_eq!(t.release_first(2), Some((pos(99, 0, 1), true)));
        assert_eq!(t.last(2), None);
        assert!(t.several.is_empty());
        assert_eq!(t.len(), 4);
    }

    #[test]
    fn a_position_stored_again_counts_and_an_overwrite_is_a_second_position() {
        let mut t = OwnTable::default();
        assert_eq!(t.store(7, 100, 0), Stored::New);
        assert_eq!(t.store(7, 100, 0), Stored::Again);
        assert_eq!(t.last(7), Some(pos(100, 0, 2)));
        // The same engine hash under another parent (or identity): a second
        // position, the most recent; the first is released first.
        assert_eq!(t.store(7, 200, 0), Stored::New);
        assert_eq!(t.store(7, 100, 9), Stored::New);
        assert_eq!(t.last(7), Some(pos(100, 9, 1)));
        assert_eq!(t.release_first(7), Some((pos(100, 0, 2), false)));
        assert_eq!(t.release_first(7), Some((pos(100, 0, 1), true)));
        assert_eq!(t.release_first(7), Some((pos(200, 0, 1), true)));
        assert_eq!(t.bump_last(7), Some(pos(100, 9, 2)));
        assert_eq!(t.release_first(7), Some((pos(100, 9, 2), false)));
        assert_eq!(t.release_first(7), Some((pos(100, 9, 1), true)));
        assert_eq!(t.last(7), None);
        assert_eq!(t.len(), 0);
        assert!(t.several.is_empty());
        assert_eq!(t.release_first(7), None);
        assert_eq!(t.bump_last(7), None);
    }

    #[test]
    fn agrees_with_the_map_it_replaced() {
        // Random stores, removals and lower-tier bumps over a small key space (so
        // hashes repeat, collide, go and come back), through several growths.
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for keys in [3u64, 40, 3000] {
            let mut t = OwnTable::default();
            let mut m = Model::default();
            for step in 0..40_000 {
                let k = next() % keys;
                match next() % 8 {
                    0..=3 => {
                        // Few distinct values per hash, so positions repeat.
                        let (c, id) = (next() % 3, next() % 2);
                        assert_eq!(t.store(k, c, id), m.store(k, c, id), "step {step}");
                    }
                    4..=6 => assert_eq!(t.release_first(k), m.release_first(k), "step {step}"),
                    _ => assert_eq!(t.bump_last(k), m.bump_last(k), "step {step}"),
                }
                assert_eq!(
                    t.last(k),
                    m.own.get(&k).and_then(|v| v.last().copied()),
                    "step {step}"
                );
                assert_eq!(t.len(), m.own.len(), "step {step}");
            }
            for k in 0..keys {
                assert_eq!(t.last(k), m.own.get(&k).and_then(|v| v.last().copied()));
            }
        }
    }
}
