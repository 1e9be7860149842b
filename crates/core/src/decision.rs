//! The LookupRoute decision, the steps of docs/decision.md, in that order.
//!
//! ```text
//! request ─▶ 1 drop chain if matching is off ─▶ 2 requireChain ─▶ 3 malformed?
//!         ─▶ 4 minimumPrefixTokens gate ─▶ 5 index lookup under the budget
//!         ─▶ 6 classify (UNKNOWN_*) ─▶ 7 rank + floors / TENANT_HOT
//!         ─▶ 8 tiny downgrade ─▶ 9 affinity or NO_HINT ─▶ 10 LFU credit
//! ```
//!
//! `rank.rs` holds the scoring math, `affinity.rs` the rendezvous hash; the index
//! is only read here, except for LFU credits on a delivered PREFIX_MATCH.

pub mod affinity;
mod bounded_load;
pub use bounded_load::SpillCheck;
pub mod outcome;
mod rank;
pub mod request;

#[cfg(test)]
mod tests;

use std::time::Instant;

use smallvec::SmallVec;

use bounded_load::Spill;
use outcome::{Decision, ReasonCode, ScoredSlot, Strategy};
use rank::{Floors, Ranking, Row};
use request::{Chain, LookupRequest};

use crate::index::{Classified, Index, Pending, ServingSet, prefix_seed};
use crate::policy::EvictionAlgorithm;
use crate::scope::ScopeRef;
use crate::snapshot::PolicySnapshot;
use crate::time::Timestamp;

/// Makes the decision for one request against one policy snapshot.
pub fn decide(
    index: &Index,
    snapshot: &PolicySnapshot,
    req: &LookupRequest<'_>,
    now: Timestamp,
) -> Decision {
    let policy = &**snapshot.tenant(req.tenant_id).policy;
    let revision = snapshot.revision();
    let none = |reason| Decision::none(reason, revision);

    // 1. Chain matching off: the exact-prefix path only.
    let chain = Chain::from_request(req, policy.strategy.enable_chain_matching);
    // 2. requireChain: no valid chain, no index.
    if policy.strategy.require_chain && !chain.is_valid() {
        return none(ReasonCode::PolicyRequiresChain);
    }
    // 3. Structurally malformed: never papered over by affinity.
    let scope = ScopeRef::new(req.tenant_id, req.model_id, req.hash_scheme);
    if !scope.is_well_formed() || !chain.is_balanced() {
        return none(ReasonCode::NoHint);
    }
    // 4. Request-side gate.
    let affinity = policy.affinity_routing.is_enabled();
    let requested = if chain.is_present() {
        chain.token_total()
    } else {
        u64::from(req.prefix_token_count)
    };
    let tiny = requested < u64::from(policy.minimum_prefix_tokens);
    if tiny && !affinity {
        return none(ReasonCode::NoHint);
    }
    // 5. The budget covers everything that waits on the index.
    let deadline =
        (!policy.lookup_timeout.is_zero()).then(|| Instant::now() + policy.lookup_timeout);
    let (now, ttl) = (now.as_nanos(), policy.ttl_nanos());

    // 6. Diagnostics.
    let scope_index = match index.classify(scope, now, ttl) {
        // StrategyNone with no replica anywhere: affinity has nothing to pick.
        Classified::GloballyEmpty => return none(ReasonCode::NoHint),
        Classified::UnknownTenant => return none(ReasonCode::UnknownTenant),
        Classified::UnknownModel => return none(ReasonCode::UnknownModel),
        Classified::UnknownHashScheme => return none(ReasonCode::UnknownHashScheme),
        Classified::Known(s) => s,
    };
    let serving = scope_index.serving(now, ttl, req.candidate_replicas);
    let floors = Floors {
        minimum_matched_tokens: policy.minimum_matched_tokens,
        routing_floor_score: policy.routing_floor_score.value(),
    };

    // 7. Rank. With the load rule on, chains routed moments ago count for the
    // replica they went to until its engine confirms them (`index/pending.rs`).
    let load_aware = policy.load_awareness.is_enabled();
    let has_seed = chain.is_present() || !req.prefix_hash.is_empty();
    // Memory tiers cost nothing until a replica of the scope reports a block in one.
    let tiered = policy.tier_weights.any_lower() && scope_index.has_lower_tiers();
    // Per member, the tokens of its match that are pending (being prefilled for a
    // sibling routed there moments ago), when any are.
    let mut riding = None;
    let ranking = if chain.is_present() && tiered {
        let weights = policy.tier_weights.by_code();
        match scope_index.match_chain_tiered(chain.hashes, &serving, now, ttl, deadline, weights) {
            Ok(mut m) => {
                if load_aware {
                    riding =
                        extend_by_pending(&scope_index.pending, &chain, &serving, &mut m.runs, now);
                }
                rank::rank_chain_tiered(&m.runs, &m.lower, chain.token_counts, floors)
            }
            Err(_) => return none(ReasonCode::Timeout),
        }
    } else if chain.is_present() {
        // The runs in a stack buffer for up to 32 replicas, filled in place.
        let (mut inline, mut spilled) = ([0u32; 32], Vec::new());
        let runs: &mut [u32] = match inline.get_mut(..serving.len()) {
            Some(runs) => runs,
            None => {
                spilled.resize(serving.len(), 0);
                &mut spilled
            }
        };
        match scope_index.match_chain(chain.hashes, &serving, now, ttl, deadline, &mut *runs) {
            Ok(()) => {
                if load_aware {
                    riding = extend_by_pending(&scope_index.pending, &chain, &serving, runs, now);
                }
                rank::rank_chain(runs, chain.token_counts, floors)
            }
            Err(_) => return none(ReasonCode::Timeout),
        }
    } else if !req.prefix_hash.is_empty() {
        match scope_index.match_prefix(req.prefix_hash, &serving, now, ttl, deadline) {
            Ok(m) => {
                let tokens = if m.token_count > 0 {
                    m.token_count
                } else {
                    req.prefix_token_count
                };
                rank::rank_prefix(&m.holders, serving.len(), tokens, floors)
            }
            Err(_) => return none(ReasonCode::Timeout),
        }
    } else {
        Ranking::NoMatch
    };
    let mut hint = match ranking {
        Ranking::Prefix(rows) => Some((Strategy::PrefixMatch, ReasonCode::PrefixMatch, rows)),
        Ranking::BelowFloor => None,
        // Expired entries are absent for lookups: no TENANT_HOT on entries the
        // sweep has not removed yet.
        Ranking::NoMatch
            if has_seed
                && policy.strategy.enable_tenant_hot
                && scope_index.may_hold_usable_entries(now, ttl) =>
        {
            tenant_hot(&serving).map(|row| (Strategy::TenantHot, ReasonCode::TenantHot, vec![row]))
        }
        Ranking::NoMatch => None,
    };

    // 8. Tiny prompts never surface a positive hint.
    if tiny {
        hint = None;
    }

    // The affinity seed: the chain's last block, else the exact prefix.
    let affinity_seed = || match chain.hashes.last() {
        Some(&h) => h,
        None => prefix_seed(req.prefix_hash),
    };
    match hint {
        Some((strategy, reason, mut rows)) => {
            // The load rule: may move the pick among the cache pick's candidates. A prefix
            // match spills in rendezvous order of its deepest matched block, so one
            // prefix's overflow stays together.
            let mut spilled = None;
            if load_aware {
                let deepest = match (reason, chain.is_present()) {
                    (ReasonCode::PrefixMatch, true) => {
                        let deepest =
                            (rows[0].matched_blocks as usize).clamp(1, chain.hashes.len());
                        Some(chain.hashes[deepest - 1])
                    }
                    _ => None,
                };
                let candidates = bounded_load::Candidates {
                    rows: &rows,
                    prefix_match: reason == ReasonCode::PrefixMatch,
                    deepest,
                    request_seed: affinity_seed(),
                    requested,
                    riding: riding.as_deref(),
                };
                spilled = bounded_load::place(&serving, &candidates, &policy.load_balancing, now);
                if let Some(sp) = spilled {
                    promote(&mut rows, sp, strategy);
                }
            }
            // 10. LFU credits only a delivered PREFIX_MATCH, on the replica it goes to.
            if reason == ReasonCode::PrefixMatch && policy.eviction == EvictionAlgorithm::Lfu {
                let matched = rows[0].matched_blocks as usize;
                if chain.is_present() {
                    scope_index.credit_chain(&chain.hashes[..matched.min(chain.hashes.len())]);
                } else if matched > 0 {
                    scope_index.credit_prefix(req.prefix_hash);
                }
            }
            finish(
                strategy, reason, revision, rows, &serving, load_aware, spilled,
            )
        }
        // 9. StrategyNone: affinity or NO_HINT.
        None if affinity && has_seed && !serving.is_empty() => {
            let seed = affinity_seed();
            let pick = match serving.id_hashes() {
                Some(hashes) => affinity::pick_by_hash(seed, hashes, |m| {
                    serving.replica(m).map_or("", |r| &*r.id)
                }),
                None => affinity::pick(seed, serving.replicas().map(|r| (r.id_hash, &*r.id))),
            };
            match pick {
                Some(member) => {
                    let mut rows = vec![Row {
                        member,
                        score: 0.0,
                        matched_tokens: 0,
                        matched_blocks: 0,
                    }];
                    let spilled = load_aware
                        .then(|| {
                            let candidates = bounded_load::Candidates {
                                rows: &rows,
                                prefix_match: false,
                                deepest: None,
                                request_seed: seed,
                                requested,
                                riding: None,
                            };
                            bounded_load::place(&serving, &candidates, &policy.load_balancing, now)
                        })
                        .flatten();
                    if let Some(sp) = spilled {
                        promote(&mut rows, sp, Strategy::Affinity);
                    }
                    finish(
                        Strategy::Affinity,
                        ReasonCode::AffinityHint,
                        revision,
                        rows,
                        &serving,
                        load_aware,
                        spilled,
                    )
                }
                None => none(ReasonCode::NoHint),
            }
        }
        None => none(ReasonCode::NoHint),
    }
}

/// Extends each member's run by the chain's blocks pending for it and returns,
/// per member, the tokens that extension added (`None` when it added none).
fn extend_by_pending(
    pending: &Pending,
    chain: &Chain<'_>,
    serving: &ServingSet,
    runs: &mut [u32],
    now: u64,
) -> Option<SmallVec<[u64; 32]>> {
    if !pending.is_active() {
        return None;
    }
    let before: SmallVec<[u32; 32]> = runs.iter().copied().collect();
    pending.extend_runs(chain.hashes, serving.members(), runs, now);
    let tokens = |from: u32, to: u32| -> u64 {
        chain
            .token_counts
            .get(from as usize..to as usize)
            .map_or(0, |c| c.iter().map(|&t| u64::from(t)).sum())
    };
    let riding: SmallVec<[u64; 32]> = before
        .iter()
        .zip(runs.iter())
        .map(|(&from, &to)| if to > from { tokens(from, to) } else { 0 })
        .collect();
    riding.iter().any(|&t| t > 0).then_some(riding)
}

/// Puts the spill target first. A prefix match keeps listing the cache's ranking
/// after it (its own ranked row moves up, or a row with no score goes in front);
/// TENANT_HOT and AFFINITY_HINT answer exactly one replica, so it replaces the pick.
fn promote(rows: &mut Vec<Row>, spill: Spill, strategy: Strategy) {
    if strategy != Strategy::PrefixMatch {
        rows.truncate(1);
        rows[0].member = spill.member;
        return;
    }
    match rows.iter().position(|r| r.member == spill.member) {
        Some(pos) => rows[..=pos].rotate_right(1),
        None => rows.insert(
            0,
            Row {
                member: spill.member,
                score: 0.0,
                matched_tokens: 0,
                matched_blocks: 0,
            },
        ),
    }
}

/// TENANT_HOT: the serving replica holding the most entries of the scope (ties:
/// latest event, then replica id), if it holds any.
fn tenant_hot(serving: &ServingSet) -> Option<Row> {
    let mut best: Option<(u64, u64, &str, usize)> = None;
    for m in 0..serving.len() {
        let Some(r) = serving.replica(m) else {
            continue;
        };
        let (count, last) = (r.live.prefix_count(), r.live.last_event_at());
        if count == 0 {
            continue;
        }
        let better = match best {
            None => true,
            Some((bc, bl, bid, _)) => {
                (count, last) > (bc, bl) || ((count, last) == (bc, bl) && &*r.id < bid)
            }
        };
        if better {
            best = Some((count, last, &r.id, m));
        }
    }
    best.map(|(_, _, _, member)| Row {
        member,
        score: 0.0,
        matched_tokens: 0,
        matched_blocks: 0,
    })
}

fn finish(
    strategy: Strategy,
    reason: ReasonCode,
    revision: &std::sync::Arc<str>,
    rows: Vec<Row>,
    serving: &ServingSet,
    load_aware: bool,
    spilled: Option<Spill>,
) -> Decision {
    // (By reference: the serving set is 176 bytes, copied whole when moved.)
    // Same size and alignment: `collect` reuses the ranker's allocation.
    let members = serving.members();
    let spilled_from = spilled.map(|sp| (members[sp.from], sp.by));
    let slots = rows
        .into_iter()
        .map(|r| ScoredSlot {
            slot: members[r.member],
            score: r.score,
            matched_tokens: r.matched_tokens,
            matched_blocks: r.matched_blocks,
        })
        .collect();
    Decision::with_rows(strategy, reason, revision, slots, serving.table.clone())
        .with_load(load_aware, spilled_from)
}
