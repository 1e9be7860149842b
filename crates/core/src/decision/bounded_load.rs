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
//!
//! A survivor whose match is only a *common* prefix (blocks held by more than half
//! of the serving replicas: a shared system prompt or RAG header) is no better a
//! spill target than any other replica: walking to it first kept the overflow of
//! every new conversation on the header's few holders, and a replica that never
//! got the header never got anything. So the walk takes only survivors that hold
//! more than the common prefix, then everyone else in rendezvous order, seeded by
//! the request's own last block when the pick itself holds only the common part.
//!
//! A request count cannot tell a replica running two full prefills from one
//! running two cheap decodes, and prefill is what a request's TTFT waits on. So
//! when the count leaves the pick alone, its *prefill cost* is compared too: the
//! uncached prompt tokens queued there (`load.rs`, let go when the engine stores
//! each request's last block) plus this request's own uncached tokens there. If
//! that exceeds the cheapest serving replica's by more than `prefillSlackTokens`
//! (128 by default, a few milliseconds of prefill), the request goes to the
//! cheapest, ties in the same walk order.

use std::sync::atomic::Ordering;

use smallvec::SmallVec;

use super::affinity;
use super::rank::Row;
use crate::index::ServingSet;
use crate::policy::LoadBalancing;

/// The member the request goes to instead, and the member the cache preferred.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Spill {
    pub member: usize,
    pub from: usize,
}

/// `preferred` are serving-set members in the seed's order (never empty for a
/// hint); `uncached(m)` is this request's prompt tokens member `m` does not hold.
/// `None`: keep the seed's answer.
pub(crate) fn place(
    serving: &ServingSet,
    preferred: impl Iterator<Item = usize> + Clone,
    seed: u64,
    lb: &LoadBalancing,
    now: u64,
    uncached: impl Fn(usize) -> u64,
) -> Option<Spill> {
    if serving.len() < 2 {
        return None;
    }
    by_requests(serving, preferred.clone(), seed, lb, now)
        .or_else(|| by_prefill(serving, preferred, seed, lb, uncached))
}

/// The request-count bound.
fn by_requests(
    serving: &ServingSet,
    preferred: impl Iterator<Item = usize> + Clone,
    seed: u64,
    lb: &LoadBalancing,
    now: u64,
) -> Option<Spill> {
    let first = preferred.clone().next()?;
    let n = serving.len();
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
    let member = preferred.clone().skip(1).find(|&m| fits(m)).or_else(|| {
        rest(serving, preferred, seed)
            .into_iter()
            .find(|&m| fits(m))
    })?;
    Some(Spill {
        member,
        from: first,
    })
}

/// The prefill-cost comparison.
fn by_prefill(
    serving: &ServingSet,
    preferred: impl Iterator<Item = usize> + Clone,
    seed: u64,
    lb: &LoadBalancing,
    uncached: impl Fn(usize) -> u64,
) -> Option<Spill> {
    let slack = u64::from(lb.prefill_slack_tokens);
    let first = preferred.clone().next()?;
    let cost = |m: usize| {
        let queued = serving
            .replica(m)
            .map_or(0, |r| r.live.inflight_tokens.load(Ordering::Relaxed));
        queued.saturating_add(uncached(m))
    };
    let first_cost = cost(first);
    // No replica costs less than nothing: a pick within the slack always stays
    // (and the common case reads one replica's atomics).
    if slack == 0 || first_cost <= slack {
        return None;
    }
    let mut best = (first, first_cost);
    for m in preferred
        .clone()
        .skip(1)
        .chain(rest(serving, preferred, seed))
    {
        let c = cost(m);
        if c < best.1 {
            best = (m, c);
        }
    }
    (best.1.saturating_add(slack) < first_cost).then_some(Spill {
        member: best.0,
        from: first,
    })
}

/// The leading blocks of the request held by more than half of the `serving`
/// replicas (by the ranked rows' matched blocks): the part of a match that does
/// not tell replicas apart.
pub(crate) fn common_blocks(rows: &[Row], serving: usize) -> u32 {
    let need = serving / 2 + 1;
    if rows.len() < need {
        return 0;
    }
    let mut blocks: SmallVec<[u32; 32]> = rows.iter().map(|r| r.matched_blocks).collect();
    blocks.sort_unstable_by(|a, b| b.cmp(a));
    blocks[need - 1]
}

/// The serving members not in `preferred`, in rendezvous order of `seed`.
fn rest(
    serving: &ServingSet,
    preferred: impl Iterator<Item = usize> + Clone,
    seed: u64,
) -> SmallVec<[usize; 32]> {
    let mut order: SmallVec<[(u64, usize); 32]> = (0..serving.len())
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
    order.into_iter().map(|(_, m)| m).collect()
}
