//! The load rule (`loadAwareness`): consistent hashing with bounded loads over
//! the seed decision's own candidates. If the pick fits its bounds, nothing
//! changes; otherwise the request walks to the first candidate that fits.
//!
//! Three checks, each a [`SpillCheck`]:
//! - requests: in-flight count against `factor × mean + slack` (mean over the
//!   scope's serving replicas, counting this request);
//! - share: recently routed requests against `shareFactor × mean + slack`;
//! - prefill: queued uncached tokens plus this request's, against the cheapest
//!   serving replica's plus `prefillSlackTokens` (TTFT waits on prefill, which a
//!   request count cannot see).
//!
//! Invariants and trade-offs:
//! - The walk after the pick: survivors holding more than the common prefix
//!   (blocks held by over half the serving replicas), then every serving replica
//!   in rendezvous order of the deepest matched block, so one prefix's overflow
//!   lands on one next replica instead of scattering.
//! - A hot common prefix (more than [`QUICK_START_TOKENS`], little beyond it)
//!   walks its holders first: there the request is still a hit.
//! - A spill prefers another holder (deepest match, then fewest recent
//!   requests); a new copy goes to the replica with the fewest recent requests,
//!   which has the most room for the prefix's later overflow.
//! - A share-bound copy waits until the pick is a second `slack` past the bound:
//!   a copy is a full prefill.
//! - A quick-start pick (a hit with at most [`QUICK_START_TOKENS`] of prefill
//!   ahead and nothing reported waiting) stays while the share bound is on:
//!   moving it only slows the request.
//! - Tokens a replica is still prefilling for a sibling (pending entries) that
//!   this request matches do not count against it: it would wait for them
//!   anywhere else too.

use std::cell::OnceCell;

use smallvec::SmallVec;

use super::affinity;
use super::rank::Row;
use crate::index::ServingSet;
use crate::policy::LoadBalancing;

/// The member the request goes to instead, the member the cache preferred, and
/// the check that moved it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Spill {
    pub member: usize,
    pub from: usize,
    pub by: SpillCheck,
}

/// Which of the load rule's checks moved a pick: an operator tuning the rule
/// needs to know which knob is at work (`x-inferencecache-spilled-by`,
/// `LookupRouteResponse.spilled_by`, `inferencecache_load_spill_checks_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpillCheck {
    /// The pick's requests in flight (`factor`, `slack`).
    Requests,
    /// The pick's recently routed requests (`shareFactor`).
    Share,
    /// The pick's queued prefill tokens (`prefillSlackTokens`).
    Prefill,
}

impl SpillCheck {
    pub const ALL: [SpillCheck; 3] = [Self::Requests, Self::Share, Self::Prefill];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Requests => "requests",
            Self::Share => "share",
            Self::Prefill => "prefill",
        }
    }
}

/// The cache pick's candidates for one request, from which the walk is built only when
/// a spill needs it (most decisions stop at the pick).
pub(crate) struct Candidates<'a> {
    /// The cache pick's rows, the pick first (one row for TENANT_HOT and affinity).
    pub rows: &'a [Row],
    /// PREFIX_MATCH: survivors holding only the common prefix are walked like
    /// any other replica.
    pub prefix_match: bool,
    /// The pick's deepest matched block (a chain PREFIX_MATCH), else `None`.
    pub deepest: Option<u64>,
    /// The request's affinity seed (its last block, else its exact-prefix key).
    pub request_seed: u64,
    /// The request's prompt tokens.
    pub requested: u64,
    /// Per member, the tokens of the request's match there that are still being
    /// prefilled for a sibling routed there moments ago (pending entries), if any.
    pub riding: Option<&'a [u64]>,
}

impl Candidates<'_> {
    fn first(&self) -> Option<usize> {
        self.rows.first().map(|r| r.member)
    }

    /// The walk after the pick: survivors holding more than the common prefix,
    /// then every other serving member in rendezvous order of the seed.
    fn walk(&self, serving: &ServingSet) -> SmallVec<[usize; 32]> {
        self.walk_split(serving).0
    }

    /// [`Self::walk`] and how many of its first members are survivors holding
    /// more than the common prefix (where the request is still a hit).
    fn walk_split(&self, serving: &ServingSet) -> (SmallVec<[usize; 32]>, usize) {
        let common = if self.prefix_match {
            common_blocks(self.rows, serving.len())
        } else {
            0
        };
        let mut order: SmallVec<[usize; 32]> = self
            .rows
            .iter()
            .skip(1)
            .filter(|r| r.matched_blocks > common)
            .map(|r| r.member)
            .collect();
        let seed = match (self.deepest, self.rows.first()) {
            (Some(deepest), Some(pick)) if pick.matched_blocks > common => deepest,
            _ => self.request_seed,
        };
        let first = self.first();
        let by_weight = |members: &mut dyn Iterator<Item = usize>| {
            let mut weighed: SmallVec<[(u64, usize); 32]> = members
                .filter_map(|m| {
                    serving
                        .replica(m)
                        .map(|r| (affinity::weight(seed, r.id_hash), m))
                })
                .collect();
            // Highest weight first; members are in replica-id order, so ties (a
            // 64-bit collision) go to the smaller id.
            weighed.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
            weighed
        };
        if common > 0 && self.common_is_nearly_all(common) {
            let at_common = by_weight(
                &mut self
                    .rows
                    .iter()
                    .skip(1)
                    .filter(|r| r.matched_blocks == common)
                    .map(|r| r.member),
            );
            order.extend(at_common.into_iter().map(|(_, m)| m));
        }
        let rest =
            by_weight(&mut (0..serving.len()).filter(|&m| Some(m) != first && !order.contains(&m)));
        let holders = order.len();
        order.extend(rest.into_iter().map(|(_, m)| m));
        (order, holders)
    }

    /// The `common` blocks are more than [`QUICK_START_TOKENS`] and the request
    /// has at most that many beyond them: the "common prefix" is then a hot
    /// document or prompt most of the fleet holds, not a header, and its holders
    /// are where the request is still a hit worth a real prefill. (A 256-token
    /// system prompt is no such hit: walking its holders first moved new
    /// conversations off the replicas without it, and eight-engine multi-turn
    /// lost 7% of its hit rate.)
    fn common_is_nearly_all(&self, common: u32) -> bool {
        self.rows
            .iter()
            .find(|r| r.matched_blocks == common)
            .is_some_and(|r| {
                let held = u64::from(r.matched_tokens);
                held > QUICK_START_TOKENS
                    && self.requested.saturating_sub(held) <= QUICK_START_TOKENS
            })
    }

    /// Of the walk's `held` members that pass `ok`, those with the deepest
    /// match, and of them the one with the fewest recent requests (the first
    /// of equals). Every one is a hit there, so the emptiest has the most room;
    /// walk order would pile a hot document's overflow on one holder at a time.
    fn emptiest_holder(
        &self,
        held: &[usize],
        shares: &Shares,
        ok: impl Fn(usize) -> bool,
    ) -> Option<usize> {
        let depth = |m: usize| {
            self.rows
                .iter()
                .find(|r| r.member == m)
                .map_or(0, |r| r.matched_blocks)
        };
        let deepest = held.iter().copied().filter(|&m| ok(m)).map(depth).max()?;
        shares.fewest_recent(held, |m| depth(m) == deepest && ok(m))
    }

    /// The tokens of the request's match on `m` that a sibling routed there
    /// moments ago is still prefilling (pending entries).
    fn riding(&self, m: usize) -> u64 {
        self.riding.and_then(|r| r.get(m).copied()).unwrap_or(0)
    }
}

/// `None`: keep the cache pick.
pub(crate) fn place(
    serving: &ServingSet,
    candidates: &Candidates<'_>,
    lb: &LoadBalancing,
    now: u64,
) -> Option<Spill> {
    if serving.len() < 2 {
        return None;
    }
    let signals = Signals {
        serving,
        lb,
        now,
        loads: OnceCell::new(),
        shares: OnceCell::new(),
    };
    by_requests(&signals, candidates)
        .or_else(|| by_share(&signals, candidates))
        .or_else(|| by_prefill(&signals, candidates))
}

/// The serving replicas' load signals for one decision. Each is read on first
/// need and at most once: most decisions stop at the pick's own atomics, and a
/// spill that reaches the third check reuses what the first two read.
struct Signals<'a> {
    serving: &'a ServingSet,
    lb: &'a LoadBalancing,
    now: u64,
    loads: OnceCell<Loads>,
    shares: OnceCell<Shares>,
}

impl Signals<'_> {
    fn loads(&self) -> &Loads {
        self.loads.get_or_init(|| Loads::read(self))
    }

    fn shares(&self) -> &Shares {
        self.shares.get_or_init(|| Shares::read(self))
    }

    /// One member's requests in flight (stale reports ignored).
    fn load_of(&self, m: usize) -> u64 {
        let max_age = self.lb.stats_max_age_nanos();
        self.serving
            .replica(m)
            .map_or(0, |r| r.live.load.current_load(self.now, max_age))
    }

    /// The uncached prompt tokens queued on `m`, less the ones the request
    /// rides on: a sibling's queued prefill of the very blocks this request
    /// matches there is work it would wait for anyway, not extra.
    fn queued(&self, candidates: &Candidates<'_>, m: usize) -> u64 {
        self.serving.replica(m).map_or(0, |r| {
            r.live
                .load
                .inflight_tokens()
                .saturating_sub(candidates.riding(m))
        })
    }

    /// The prefill tokens the request would wait on at `row`'s replica: the
    /// queued ones plus its own beyond the match there.
    fn prefill_cost(&self, candidates: &Candidates<'_>, row: &Row) -> u64 {
        self.queued(candidates, row.member).saturating_add(
            candidates
                .requested
                .saturating_sub(u64::from(row.matched_tokens)),
        )
    }

    /// The request would start on its pick within [`QUICK_START_TOKENS`] of
    /// prefill, with nothing the engine reports waiting ahead of it, and the
    /// share bound is on to keep the fleet balanced without the count. Below
    /// the share bound's gate the count is the only balance, so it decides.
    fn quick_start(&self, candidates: &Candidates<'_>) -> bool {
        let Some(pick) = candidates.rows.first() else {
            return false;
        };
        let waiting = self.serving.replica(pick.member).map_or(0, |r| {
            r.live
                .load
                .engine_waiting(self.now, self.lb.stats_max_age_nanos())
        });
        waiting == 0
            && self.prefill_cost(candidates, pick) <= QUICK_START_TOKENS
            && self.shares().bound.is_finite()
    }

    /// One member's decayed count of recently routed requests.
    fn recent_of(&self, m: usize) -> f64 {
        self.serving
            .replica(m)
            .map_or(0.0, |r| r.live.load.recent_requests(self.now))
    }
}

/// Every serving member's requests in flight against `factor × mean + slack`,
/// the mean counting this request.
struct Loads {
    loads: SmallVec<[u64; 32]>,
    bound: f64,
}

impl Loads {
    fn read(signals: &Signals<'_>) -> Self {
        let n = signals.serving.len();
        let loads: SmallVec<[u64; 32]> = (0..n).map(|m| signals.load_of(m)).collect();
        let total = loads.iter().fold(0u64, |a, &l| a.saturating_add(l));
        let mean = (total as f64 + 1.0) / n.max(1) as f64;
        Self {
            loads,
            bound: signals.lb.factor * mean + f64::from(signals.lb.slack),
        }
    }

    /// Placing one more request on `m` keeps it within the bound.
    fn fits(&self, m: usize) -> bool {
        self.loads.get(m).copied().unwrap_or(0) as f64 + 1.0 <= self.bound
    }
}

/// The request-count bound. Its copies go where the share bound's do: to the
/// replica with the fewest recent requests, not the next in rendezvous order,
/// which may already be busy and so set off the next spill.
fn by_requests(signals: &Signals<'_>, candidates: &Candidates<'_>) -> Option<Spill> {
    let first = candidates.first()?;
    // The bound is never below `slack`: a pick that fits under it needs no mean
    // (the common, lightly loaded case reads one replica's atomics, not all).
    if signals.load_of(first) as f64 + 1.0 <= f64::from(signals.lb.slack) {
        return None;
    }
    // A quick start is no overload: one replica's atomics decide it too.
    if signals.quick_start(candidates) {
        return None;
    }
    let loads = signals.loads();
    if loads.fits(first) {
        return None;
    }
    // Another holder first (the emptiest of the deepest matches), where the
    // request is still a hit; else a copy, where the fewest requests went
    // lately (ties in walk order). Within the share bound too if any candidate
    // is; the request count comes first, and a holder over its share is still
    // taken by the same rule: the emptiest of the deepest.
    let shares = signals.shares();
    let (walk, holders) = candidates.walk_split(signals.serving);
    let (held, others) = walk.split_at(holders);
    let under = |m: usize| loads.fits(m) && shares.under(m);
    let member = candidates
        .emptiest_holder(held, shares, under)
        .or_else(|| shares.fewest_recent(others, under))
        .or_else(|| candidates.emptiest_holder(held, shares, |m| loads.fits(m)))
        .or_else(|| shares.fewest_recent(others, |m| loads.fits(m)))?;
    Some(Spill {
        member,
        from: first,
        by: SpillCheck::Requests,
    })
}

/// The share bound: the pick's decayed count of recently routed requests
/// against `share_factor × mean + slack`. The request goes to the first other
/// holder of its distinguishing prefix under both this bound and the request
/// count; with none, a copy is made once the pick is past the copy bound, on
/// the replica with the fewest recent requests (ties in walk order).
fn by_share(signals: &Signals<'_>, candidates: &Candidates<'_>) -> Option<Spill> {
    let lb = signals.lb;
    if lb.share_factor == 0.0 {
        return None;
    }
    let first = candidates.first()?;
    // While on, the bound is at least `share_factor × SHARE_MIN_MEAN + slack`: a
    // pick under that fits whatever the mean, on one replica's atomic read.
    let floor = lb.share_factor * SHARE_MIN_MEAN + f64::from(lb.slack);
    if signals.recent_of(first) + 1.0 <= floor {
        return None;
    }
    let shares = signals.shares();
    if shares.under(first) {
        return None;
    }
    let loads = signals.loads();
    let fits = |m: usize| shares.under(m) && loads.fits(m);
    let (walk, holders) = candidates.walk_split(signals.serving);
    let (held, others) = walk.split_at(holders);
    let member = match candidates.emptiest_holder(held, shares, fits) {
        Some(m) => m,
        None if !shares.past_copy_bound(first) => return None,
        None => shares.fewest_recent(others, fits)?,
    };
    Some(Spill {
        member,
        from: first,
        by: SpillCheck::Share,
    })
}

/// Below this mean of recent requests per serving replica (about one a second
/// each, at a 10 s half-life) the share bound stays out: a trickle of requests
/// needs no balancing, and a quiet fleet keeps every answer the cache pick's.
pub(crate) const SHARE_MIN_MEAN: f64 = 16.0;

/// A pick the request starts on within this many prefill tokens (its own beyond
/// the match plus those queued there: ~15 ms at the benchmark's 30 µs a token,
/// two or three engine steps) is no overload whatever its request count, while
/// the share bound is on (`Signals::quick_start`).
pub(crate) const QUICK_START_TOKENS: u64 = 512;

/// Every serving member's recent share against the share bound; every member is
/// under it when the bound is off or traffic is below [`SHARE_MIN_MEAN`].
struct Shares {
    recent: SmallVec<[f64; 32]>,
    bound: f64,
    /// `slack` more than `bound`: where a copy is made.
    copy_bound: f64,
}

impl Shares {
    fn read(signals: &Signals<'_>) -> Self {
        let (n, lb) = (signals.serving.len(), signals.lb);
        if lb.share_factor == 0.0 {
            return Self {
                recent: SmallVec::new(),
                bound: f64::INFINITY,
                copy_bound: f64::INFINITY,
            };
        }
        let recent: SmallVec<[f64; 32]> = (0..n).map(|m| signals.recent_of(m)).collect();
        let mean = (recent.iter().sum::<f64>() + 1.0) / n.max(1) as f64;
        let bound = match mean < SHARE_MIN_MEAN {
            true => f64::INFINITY,
            false => lb.share_factor * mean + f64::from(lb.slack),
        };
        Self {
            bound,
            copy_bound: bound + f64::from(lb.slack),
            recent,
        }
    }

    fn recent_of(&self, m: usize) -> f64 {
        self.recent.get(m).copied().unwrap_or(0.0)
    }

    /// Placing one more request on `m` keeps it within the bound.
    fn under(&self, m: usize) -> bool {
        self.recent_of(m) + 1.0 <= self.bound
    }

    /// Of `members` that pass `ok`, the one with the fewest recent requests (the
    /// first of equals): where a copy of a prefix has the most room to absorb
    /// that prefix's overflow before it too needs relief.
    fn fewest_recent(&self, members: &[usize], ok: impl Fn(usize) -> bool) -> Option<usize> {
        members
            .iter()
            .copied()
            .filter(|&m| ok(m))
            .min_by(|&a, &b| self.recent_of(a).total_cmp(&self.recent_of(b)))
    }

    /// Placing one more request on `m` takes it past the copy bound.
    fn past_copy_bound(&self, m: usize) -> bool {
        self.recent_of(m) + 1.0 > self.copy_bound
    }
}

/// The prefill-cost comparison.
fn by_prefill(signals: &Signals<'_>, candidates: &Candidates<'_>) -> Option<Spill> {
    let (serving, lb) = (signals.serving, signals.lb);
    let slack = u64::from(lb.prefill_slack_tokens);
    let pick = candidates.rows.first()?;
    let requested = candidates.requested;
    let first_cost = signals.prefill_cost(candidates, pick);
    // No replica costs less than nothing, nor less than the request's tokens
    // beyond the longest match: a pick within the slack of that always stays, and
    // the common cases (an idle pick holding the best match, an idle affinity
    // pick) read one replica's atomics, not every replica's.
    if slack == 0 || first_cost <= slack {
        return None;
    }
    let longest = candidates
        .rows
        .iter()
        .map(|r| u64::from(r.matched_tokens))
        .max()
        .unwrap_or(0);
    if first_cost <= requested.saturating_sub(longest).saturating_add(slack) {
        return None;
    }
    let n = serving.len();
    let mut matched: SmallVec<[u64; 32]> = SmallVec::from_elem(0, n);
    for r in candidates.rows {
        if let Some(m) = matched.get_mut(r.member) {
            *m = u64::from(r.matched_tokens);
        }
    }
    // A replica over its share is no cheaper for it.
    let shares = signals.shares();
    let costs: SmallVec<[u64; 32]> = (0..n)
        .map(|m| match shares.under(m) {
            true => signals
                .queued(candidates, m)
                .saturating_add(requested.saturating_sub(matched[m])),
            false => u64::MAX,
        })
        .collect();
    let cheapest = costs.iter().copied().min()?;
    if cheapest.saturating_add(slack) >= first_cost {
        return None;
    }
    // Ties among the cheapest go in walk order.
    let member = candidates
        .walk(serving)
        .into_iter()
        .find(|&m| costs[m] == cheapest)?;
    Some(Spill {
        member,
        from: pick.member,
        by: SpillCheck::Prefill,
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
