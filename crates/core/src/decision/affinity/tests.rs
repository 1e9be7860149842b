use super::*;
use crate::index::ReplicaTable;
use proptest::prelude::*;

fn ids(n: usize) -> Vec<(u64, String)> {
    (0..n)
        .map(|i| {
            let id = format!("replica-{i}");
            (crate::index::replica_id_hash(&id), id)
        })
        .collect()
}

fn owner(seed: u64, replicas: &[(u64, String)]) -> String {
    let i = pick(seed, replicas.iter().map(|(h, id)| (*h, id.as_str()))).unwrap_or(0);
    replicas[i].1.clone()
}

#[test]
fn empty_set_has_no_pick() {
    assert_eq!(pick(1, std::iter::empty()), None);
    let _ = ReplicaTable::default();
}

proptest! {
    /// The hash-slice pick answers as the pick over (hash, id) pairs, ties
    /// included (a few hashes repeated under different ids).
    #[test]
    fn the_pick_by_hash_equals_the_pick(
        seed in any::<u64>(),
        members in proptest::collection::vec((0u64..4, 0u8..6), 0..12),
    ) {
        let ids: Vec<String> = members.iter().map(|(_, id)| format!("r{id}")).collect();
        let hashes: Vec<u64> = members.iter().map(|(h, _)| *h).collect();
        let want = pick(seed, hashes.iter().copied().zip(ids.iter().map(String::as_str)));
        let got = pick_by_hash(seed, &hashes, |i| ids[i].as_str());
        prop_assert_eq!(got, want);
    }
}

#[test]
fn picks_are_stable() {
    let r = ids(8);
    for seed in 0..100u64 {
        assert_eq!(owner(seed, &r), owner(seed, &r));
    }
}

#[test]
fn load_spreads_over_replicas() {
    let r = ids(4);
    let mut counts = std::collections::HashMap::new();
    for seed in 0..4000u64 {
        *counts
            .entry(owner(seed.wrapping_mul(0x9e37_79b9), &r))
            .or_insert(0) += 1;
    }
    assert_eq!(counts.len(), 4);
    for (_, c) in counts {
        assert!((800..1200).contains(&c), "unbalanced: {c}");
    }
}

proptest! {
    /// When one of N replicas leaves, only the seeds it owned move, about 1/N.
    #[test]
    fn removing_one_of_n_moves_about_one_nth(n in 3usize..24, leaving in 0usize..24, salt in any::<u64>()) {
        let leaving = leaving % n;
        let all = ids(n);
        let mut rest = all.clone();
        let gone = rest.remove(leaving).1;
        let seeds = 3000u64;
        let mut moved = 0u64;
        for s in 0..seeds {
            let seed = weight(s, salt);
            let before = owner(seed, &all);
            let after = owner(seed, &rest);
            if before != after {
                // Only keys of the leaving replica may move.
                prop_assert_eq!(&before, &gone);
                moved += 1;
            }
        }
        let expected = seeds as f64 / n as f64;
        prop_assert!((moved as f64) < expected * 1.5 + 30.0, "moved {} of {}, expected ~{}", moved, seeds, expected);
        prop_assert!((moved as f64) > expected * 0.5 - 30.0, "moved {} of {}, expected ~{}", moved, seeds, expected);
    }
}
