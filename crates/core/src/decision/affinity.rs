//! Rendezvous (highest-random-weight) hashing of a request's seed over the serving
//! replicas: repeat prompts pin to the same replica, and when one of N replicas
//! joins or leaves only about 1/N of the seeds move.

/// A well-mixed weight for (seed, replica). Deterministic across processes: two
/// sidecars must agree on the pick.
#[inline]
pub fn weight(seed: u64, replica_hash: u64) -> u64 {
    // splitmix64 finaliser over the combined value.
    let mut z = seed ^ replica_hash.rotate_left(32) ^ 0x9e37_79b9_7f4a_7c15;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The index (into `replicas`) of the replica with the highest weight; ties (which
/// need a 64-bit collision) go to the smaller id.
pub fn pick<'a>(seed: u64, replicas: impl Iterator<Item = (u64, &'a str)>) -> Option<usize> {
    let mut best: Option<(u64, &str, usize)> = None;
    for (i, (hash, id)) in replicas.enumerate() {
        let w = weight(seed, hash);
        let better = match best {
            None => true,
            Some((bw, bid, _)) => w > bw || (w == bw && id < bid),
        };
        if better {
            best = Some((w, id, i));
        }
    }
    best.map(|(_, _, i)| i)
}

/// [`pick`] over the replicas' id hashes in member order, the id looked up
/// (`id_of(index)`) only to break a tie: the same answer without reading every
/// replica's row.
pub fn pick_by_hash<'a>(
    seed: u64,
    hashes: &[u64],
    id_of: impl Fn(usize) -> &'a str,
) -> Option<usize> {
    let mut best: Option<(u64, usize)> = None;
    for (i, &hash) in hashes.iter().enumerate() {
        let w = weight(seed, hash);
        let better = match best {
            None => true,
            Some((bw, b)) => w > bw || (w == bw && id_of(i) < id_of(b)),
        };
        if better {
            best = Some((w, i));
        }
    }
    best.map(|(_, i)| i)
}

#[cfg(test)]
mod tests {
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
}
