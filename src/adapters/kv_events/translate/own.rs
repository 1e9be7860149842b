//! The engine hash → own positions map of one replica ([`OwnTable`]).
//!
//! Written for ingest's access pattern: every stored block inserts one engine hash
//! (an engine's pool is millions of blocks, so the table is far larger than the
//! processor's caches and each insert is a cache miss), and lookups are rarer (one
//! parent per event, one per removed block). A `HashMap<u64, SmallVec<[Position;
//! 1]>>` touched two distant cache lines per insert (its control bytes, then a
//! 40-byte bucket in another array). Here one open-addressing array of 32-byte
//! buckets holds the engine hash and its position inline: an insert reads and
//! writes one line (two when the probe crosses one), and the table has no
//! per-entry heap part to drop.
//!
//! Linear probing, at most 5/8 full, removal by backward shift (no tombstones),
//! hashed with foldhash seeded at random per process (as the maps before it). An
//! engine hash with more than one position (SGLang 0.5.3 names a page by its own
//! tokens, so one hash can sit under several parents) keeps them in a side map,
//! in the order the module docs of `translate` give; its bucket only says so.

use std::collections::HashMap;
use std::hash::BuildHasher;

use smallvec::SmallVec;

use super::{Hasher, Position};

/// An empty bucket.
const EMPTY: u32 = 0;
/// The engine hash has one position, inline.
const ONE: u32 = 1;
/// The engine hash has several positions, in `several`.
const SEVERAL: u32 = 2;

/// One bucket: an engine hash and, when it has one position, that position.
#[derive(Clone, Copy, Debug, Default)]
struct Bucket {
    key: u64,
    content: u64,
    identity: u64,
    refs: u32,
    state: u32,
}

impl Bucket {
    fn position(&self) -> Position {
        Position {
            content: self.content,
            identity: self.identity,
            refs: self.refs,
        }
    }

    fn set(&mut self, p: Position) {
        self.content = p.content;
        self.identity = p.identity;
        self.refs = p.refs;
    }
}

/// Engine hash → its own positions, least recently stored first.
#[derive(Debug, Default)]
pub(super) struct OwnTable {
    /// A power of two long (or empty).
    buckets: Vec<Bucket>,
    /// Occupied buckets (engine hashes).
    len: usize,
    /// The positions of engine hashes with more than one.
    several: HashMap<u64, SmallVec<[Position; 2]>, Hasher>,
    hasher: Hasher,
}

/// What [`OwnTable::store`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Stored {
    /// A position the engine hash did not have (a new mapping).
    New,
    /// One more reference to a position it had.
    Again,
}

impl OwnTable {
    /// Engine hashes mapped.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.len
    }

    fn mask(&self) -> usize {
        self.buckets.len() - 1
    }

    fn home(&self, key: u64) -> usize {
        self.hasher.hash_one(key) as usize & self.mask()
    }

    /// The bucket holding `key`, or the empty one where it would go. The table is
    /// never full, so the probe ends.
    fn find(&self, key: u64) -> (usize, bool) {
        let mask = self.mask();
        let mut i = self.home(key);
        loop {
            let b = &self.buckets[i];
            if b.state == EMPTY {
                return (i, false);
            }
            if b.key == key {
                return (i, true);
            }
            i = (i + 1) & mask;
        }
    }

    fn get(&self, key: u64) -> Option<usize> {
        if self.len == 0 {
            return None;
        }
        match self.find(key) {
            (i, true) => Some(i),
            _ => None,
        }
    }

    /// Room for `additional` more engine hashes without growing.
    pub(super) fn reserve(&mut self, additional: usize) {
        let need = self.len.saturating_add(additional);
        // At most 5/8 full: linear probing's probes stay short.
        if need.saturating_mul(8) <= self.buckets.len() * 5 {
            return;
        }
        let mut cap = self.buckets.len().max(16);
        while need.saturating_mul(8) > cap * 5 {
            cap *= 2;
        }
        let old = std::mem::replace(&mut self.buckets, vec![Bucket::default(); cap]);
        for b in old.into_iter().filter(|b| b.state != EMPTY) {
            let (i, _) = self.find(b.key);
            self.buckets[i] = b;
        }
    }

    /// The most recently stored position of `engine`.
    pub(super) fn last(&self, engine: u64) -> Option<Position> {
        let b = &self.buckets[self.get(engine)?];
        match b.state {
            ONE => Some(b.position()),
            _ => self.several.get(&engine).and_then(|v| v.last().copied()),
        }
    }

    /// One more reference to the most recently stored position of `engine`, which
    /// is returned.
    pub(super) fn bump_last(&mut self, engine: u64) -> Option<Position> {
        let i = self.get(engine)?;
        let b = &mut self.buckets[i];
        let p = match b.state {
            ONE => {
                b.refs = b.refs.saturating_add(1);
                return Some(b.position());
            }
            _ => self.several.get_mut(&engine)?.last_mut()?,
        };
        p.refs = p.refs.saturating_add(1);
        Some(*p)
    }

    /// `engine` stored as (content, identity): one more reference to that position
    /// (now the most recently stored), or a new one after the others.
    pub(super) fn store(&mut self, engine: u64, content: u64, identity: u64) -> Stored {
        self.reserve(1);
        let pos = Position {
            content,
            identity,
            refs: 1,
        };
        let (i, found) = self.find(engine);
        let b = &mut self.buckets[i];
        if !found {
            *b = Bucket {
                key: engine,
                state: ONE,
                ..Bucket::default()
            };
            b.set(pos);
            self.len += 1;
            return Stored::New;
        }
        if b.state == ONE {
            if (b.content, b.identity) == (content, identity) {
                b.refs = b.refs.saturating_add(1);
                return Stored::Again;
            }
            let first = b.position();
            b.state = SEVERAL;
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
        let i = self.get(engine)?;
        let b = &mut self.buckets[i];
        if b.state == ONE {
            let p = b.position();
            b.refs -= 1;
            if b.refs > 0 {
                return Some((p, false));
            }
            self.remove_at(i);
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
            self.remove_at(i);
        }
        Some((p, true))
    }

    /// Empties bucket `i`, shifting later buckets of its probe back so every
    /// engine hash stays reachable from its home.
    fn remove_at(&mut self, i: usize) {
        let mask = self.mask();
        let mut hole = i;
        let mut j = (i + 1) & mask;
        while self.buckets[j].state != EMPTY {
            let home = self.home(self.buckets[j].key);
            // Bucket j may fill the hole if the hole lies on its probe, i.e. is
            // no farther from j than its home is.
            if (j.wrapping_sub(home) & mask) >= (j.wrapping_sub(hole) & mask) {
                self.buckets[hole] = self.buckets[j];
                hole = j;
            }
            j = (j + 1) & mask;
        }
        self.buckets[hole] = Bucket::default();
        self.len -= 1;
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

    /// Engine hashes whose home bucket is `home` in a table of `cap` buckets.
    fn colliding(t: &OwnTable, cap: usize, home: usize, n: usize) -> Vec<u64> {
        (0u64..)
            .filter(|k| t.hasher.hash_one(*k) as usize & (cap - 1) == home)
            .take(n)
            .collect()
    }

    #[test]
    fn colliding_hashes_stay_reachable_through_removals() {
        let mut t = OwnTable::default();
        t.reserve(8);
        let cap = t.buckets.len();
        // A cluster at the table's last bucket wraps around to its start, and
        // another starts where it wraps to.
        let mut keys = colliding(&t, cap, cap - 1, 5);
        keys.extend(colliding(&t, cap, 0, 3));
        for (i, k) in keys.iter().enumerate() {
            assert_eq!(t.store(*k, i as u64, 0), Stored::New);
        }
        assert_eq!(
            t.buckets.len(),
            cap,
            "no growth: the probes really collided"
        );
        // Remove from the middle of the first cluster, then its head, then the
        // head of the second: every other hash keeps its position.
        let mut left: Vec<(u64, u64)> = keys.iter().copied().zip(0..).collect();
        for gone in [keys[2], keys[0], keys[5]] {
            assert_eq!(t.release_first(gone).map(|(p, went)| (p.content, went)), {
                let i = left.iter().position(|(k, _)| *k == gone).unwrap();
                Some((left.remove(i).1, true))
            });
            assert_eq!(t.last(gone), None);
            for (k, v) in &left {
                assert_eq!(t.last(*k).map(|p| p.content), Some(*v), "{k}");
            }
            assert_eq!(t.len(), left.len());
        }
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
