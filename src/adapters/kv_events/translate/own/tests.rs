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
