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
mod tests;
