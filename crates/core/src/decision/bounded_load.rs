//! The load rule (contract §12 `loadAwareness`): consistent hashing with bounded
//! loads over the seed's own candidates.
//!
//! The seed's decision orders the candidates (the ranked PREFIX_MATCH survivors,
//! or the one TENANT_HOT or affinity pick). A replica is *overloaded* when placing
//! this request would take it past `factor × mean + slack`, the mean being over the
//! scope's serving replicas and counting this request. If the first candidate is
//! not overloaded nothing changes, so with balanced load every answer is the
//! seed's. Otherwise the request walks down the remaining candidates, then every
//! serving replica in rendezvous order of a seed: for a prefix match the deepest
//! matched block, so the overflow of one shared prefix lands on the same next
//! replica (which then holds the prefix too) instead of scattering.

use smallvec::SmallVec;

use super::affinity;
use crate::index::ServingSet;
use crate::policy::LoadBalancing;

/// The member the request goes to instead, and the member the cache preferred.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Spill {
    pub member: usize,
    pub from: usize,
}

/// `preferred` are serving-set members in the seed's order (never empty for a
/// hint). `None`: keep the seed's answer.
pub(crate) fn place(
    serving: &ServingSet,
    preferred: impl Iterator<Item = usize> + Clone,
    seed: u64,
    lb: &LoadBalancing,
    now: u64,
) -> Option<Spill> {
    let first = preferred.clone().next()?;
    let n = serving.len();
    if n < 2 {
        return None;
    }
    let max_age = lb.stats_max_age_nanos();
    let load_of = |m: usize| {
        serving
            .replica(m)
            .map_or(0, |r| r.live.current_load(now, max_age))
    };
    // The bound is never below `slack`: a pick that fits under it needs no mean
    // (the common, lightly loaded case reads one replica's atomics, not all).
    if load_of(first) as f64 + 1.0 <= f64::from(lb.slack) {
        return None;
    }
    let loads: SmallVec<[u64; 32]> = (0..n).map(load_of).collect();
    let total = loads.iter().fold(0u64, |a, &l| a.saturating_add(l));
    let mean = (total as f64 + 1.0) / n as f64;
    let bound = lb.factor * mean + f64::from(lb.slack);
    let fits = |m: usize| loads[m] as f64 + 1.0 <= bound;
    if fits(first) {
        return None;
    }
    let spill = |member| {
        Some(Spill {
            member,
            from: first,
        })
    };
    if let Some(m) = preferred.clone().skip(1).find(|&m| fits(m)) {
        return spill(m);
    }
    let mut order: SmallVec<[(u64, usize); 32]> = (0..n)
        .filter(|&m| !preferred.clone().any(|p| p == m))
        .filter_map(|m| {
            serving
                .replica(m)
                .map(|r| (affinity::weight(seed, r.id_hash), m))
        })
        .collect();
    // Highest weight first; members are in replica-id order, so ties (a 64-bit
    // collision) go to the smaller id.
    order.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    order
        .into_iter()
        .map(|(_, m)| m)
        .find(|&m| fits(m))
        .and_then(spill)
}
