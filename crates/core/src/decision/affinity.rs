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
mod tests;
