//! The load rule (`spec.loadAwareness`, `decision/bounded_load.rs`): with
//! balanced or absent load every answer is the cache pick; an overloaded first choice
//! spills to the next candidate the cache pick would consider, the reason stays the
//! cache pick's and the decision names the replica the cache preferred.

use super::*;
use crate::policy::LoadAwareness;

fn disabled(p: ResolvedPolicy) -> ResolvedPolicy {
    ResolvedPolicy {
        load_awareness: LoadAwareness::Disabled,
        ..p
    }
}

/// The cache pick's ranking of [`fleet`]'s request, from a router with the rule off
/// (the ranking tests pin the formula itself).
fn expected_seed_rows() -> Vec<Row> {
    let (router, r) = fleet(disabled(ResolvedPolicy::default()));
    rows(&lookup(&router, &r))
}

#[test]
fn balanced_or_absent_load_gives_the_seeds_answer() {
    let seed = expected_seed_rows();
    assert_eq!(seed[0].0, "r1");
    let (router, r) = fleet(ResolvedPolicy::default());
    let d = lookup(&router, &r);
    assert_prefix(&d, &seed);
    assert_eq!(d.spilled_from(), None);
    // Everyone equally busy: still the cache pick.
    let _held: Vec<_> = FLEET
        .iter()
        .flat_map(|id| in_flight(&router, id, 5, 16))
        .collect();
    let d = lookup(&router, &r);
    assert_prefix(&d, &seed);
    assert_eq!(d.spilled_from(), None);
}

#[test]
fn an_overloaded_first_choice_spills_to_the_next_survivor() {
    let (router, r) = fleet(ResolvedPolicy::default());
    let r = long(r);
    // mean (6 + 1) / 4 = 1.75, bound 1.25 × 1.75 + 2 = 4.19: r1 at 7 is over.
    let _held = in_flight(&router, "r1", 6, 16);
    let d = lookup(&router, &r);
    let seed = expected_seed_rows();
    assert_prefix(&d, &[seed[1].clone(), seed[0].clone()]);
    assert_eq!(d.spilled_from(), Some("r1"));
    assert_eq!(d.spilled_by(), Some(SpillCheck::Requests));
    // Within the bound: one in flight gives mean (1 + 1) / 4 = 0.5, bound 2.625,
    // and r1 with this request (2) stays under it.
    drop(_held);
    let _one = in_flight(&router, "r1", 1, 16);
    let d = lookup(&router, &r);
    assert_prefix(&d, &seed);
    assert_eq!(d.spilled_from(), None);
}

#[test]
fn all_survivors_overloaded_walk_the_rendezvous_order_of_the_deepest_matched_block() {
    let (router, r) = fleet(ResolvedPolicy::default());
    let r = long(r);
    let _held: Vec<_> = ["r1", "r2"]
        .iter()
        .flat_map(|id| in_flight(&router, id, 6, 16))
        .collect();
    let d = lookup(&router, &r);
    // r1 matched six blocks: the spill order is rendezvous on block 6.
    let target = owner(6, &["r3", "r4"]);
    assert_eq!(d.reason, ReasonCode::PrefixMatch);
    assert_eq!(rows(&d)[0], row(&target, 0.0, 0, 0));
    assert_eq!(d.spilled_from(), Some("r1"));
    // The cache's ranking is still listed after the pick.
    let seed = expected_seed_rows();
    assert_eq!(rows(&d)[1..], seed[..]);
}

#[test]
fn disabled_reproduces_the_seed_under_any_load() {
    let (router, r) = fleet(disabled(ResolvedPolicy::default()));
    // Nothing is counted in flight with the rule off; the engine says it is swamped.
    let d = lookup(&router, &r);
    assert!(d.admit(16).is_none());
    report_queue(&router, "r1", 500, 8, t0());
    let d = lookup(&router, &r);
    assert_prefix(&d, &expected_seed_rows());
    assert_eq!(d.spilled_from(), None);
}

#[test]
fn engine_reported_load_counts_until_it_is_stale() {
    let (router, r) = fleet(ResolvedPolicy::default());
    // A cheap hit, but 30 requests wait at r1's engine: no quick start.
    report_queue(&router, "r1", 30, 8, t0());
    let d = lookup_at(&router, &r, at(1));
    assert_eq!(picked(&d).as_deref(), Some("r2"));
    assert_eq!(d.spilled_from(), Some("r1"));
    // Past statsMaxAge (5 s) the report is ignored: back to the cache's pick.
    let d = lookup_at(&router, &r, at(6));
    assert_eq!(picked(&d).as_deref(), Some("r1"));
    assert_eq!(d.spilled_from(), None);
}

#[test]
fn in_flight_counts_are_released_when_the_guard_drops() {
    let (router, _) = fleet(ResolvedPolicy::default());
    let inflight = |id: &str| {
        router
            .view(t0())
            .replicas
            .iter()
            .find(|v| v.replica_id == id)
            .map(|v| (v.inflight_requests, v.inflight_tokens))
    };
    let held = in_flight(&router, "r3", 3, 16);
    assert_eq!(inflight("r3"), Some((3, 48)));
    drop(held);
    assert_eq!(inflight("r3"), Some((0, 0)));
    // Matched tokens are not prefill work: only the uncached rest is counted.
    let (r1, r) = (
        "r1",
        req(&[1, 2, 3, 4, 5, 6, 7, 8]).candidates(&["r1", "r2"]),
    );
    let d = lookup(&router, &r);
    assert_eq!(picked(&d).as_deref(), Some(r1));
    let guard = d.admit(128).expect("pick");
    assert_eq!(guard.uncached_tokens(), 128 - 96);
    assert_eq!(inflight("r1"), Some((1, 32)));
}

#[test]
fn an_overloaded_affinity_pick_spills_in_rendezvous_order() {
    let router = mk_router(ResolvedPolicy::default());
    for id in FLEET {
        register(&router, acme(), id, t0());
    }
    let seed = seed_owned_by("r2", &FLEET, &[]);
    let r = long(req(&[seed]));
    assert_affinity(&lookup(&router, &r), "r2");
    let _held = in_flight(&router, "r2", 6, 16);
    let d = lookup(&router, &r);
    let rest: Vec<&str> = FLEET.iter().copied().filter(|id| *id != "r2").collect();
    assert_affinity(&d, &owner(seed, &rest));
    assert_eq!(d.spilled_from(), Some("r2"));
}

#[test]
fn an_overloaded_tenant_hot_pick_spills() {
    let router = mk_router(ResolvedPolicy::default());
    store(&router, "r1", &[100, 101, 102]);
    for id in ["r2", "r3", "r4"] {
        register(&router, acme(), id, t0());
    }
    let r = long(req(&[7, 8, 9]));
    assert_tenant_hot(&lookup(&router, &r), "r1");
    let _held = in_flight(&router, "r1", 6, 16);
    let d = lookup(&router, &r);
    assert_eq!(d.reason, ReasonCode::TenantHot);
    assert_ne!(picked(&d).as_deref(), Some("r1"));
    assert_eq!(d.spilled_from(), Some("r1"));
}

#[test]
fn one_serving_replica_never_spills() {
    let router = mk_router(ResolvedPolicy::default());
    register(&router, acme(), "r1", t0());
    let r = req(&[42]);
    let _held = in_flight(&router, "r1", 20, 16);
    let d = lookup(&router, &r);
    assert_affinity(&d, "r1");
    assert_eq!(d.spilled_from(), None);
}

#[test]
fn requests_sent_since_the_engines_report_add_to_it() {
    let (router, r) = fleet(ResolvedPolicy::default());
    let r = long(r);
    // Every engine reports 8 running: r1's 8 + 1 is under 1.25 × 8.25 + 2.
    for id in FLEET {
        report_queue(&router, id, 0, 8, t0());
    }
    assert_eq!(picked(&lookup(&router, &r)).as_deref(), Some("r1"));
    // Six more sent to r1 since its report: the engine cannot count them yet, so
    // r1 is at 8 + 6 (not max(8, 6)), over 1.25 × 9.75 + 2 with this request.
    let held = in_flight(&router, "r1", 6, 16);
    let d = lookup(&router, &r);
    assert_eq!(picked(&d).as_deref(), Some("r2"));
    assert_eq!(d.spilled_from(), Some("r1"));
    // Requests that ended before the next report leave the sum: 8 + 3 + 1 fits.
    let mut held = held;
    held.truncate(3);
    assert_eq!(picked(&lookup(&router, &r)).as_deref(), Some("r1"));
    drop(held);
    // The next report includes whatever is still running; the rest ending after
    // it takes nothing off the new report's share.
    let held = in_flight(&router, "r1", 3, 16);
    report_queue(&router, "r1", 0, 8, t0());
    drop(held);
    let _more = in_flight(&router, "r1", 4, 16);
    let d = lookup(&router, &r);
    assert_eq!(
        picked(&d).as_deref(),
        Some("r1"),
        "8 + 4 + 1 fits 1.25 × 9.25 + 2"
    );
    assert_eq!(d.spilled_from(), None);
}

/// r1, r2 and r3 hold a four-block header; r1 also holds a conversation on it.
fn header_fleet() -> Router {
    let router = mk_router(ResolvedPolicy::default());
    store(&router, "r1", &[1, 2, 3, 4, 5, 6]);
    store(&router, "r2", &[1, 2, 3, 4]);
    store(&router, "r3", &[1, 2, 3, 4]);
    register(&router, acme(), "r4", t0());
    router
}

#[test]
fn a_spill_from_a_common_header_skips_its_other_holders() {
    let router = header_fleet();
    // A new conversation matches only the header, which three of four hold: the
    // seed ranks its holders, r1 first.
    let last = seed_owned_by("r4", &["r2", "r3", "r4"], &[1, 2, 3, 4, 5, 6]);
    let new_chat = long(req(&[1, 2, 3, 4, last]));
    let d = lookup(&router, &new_chat);
    assert_eq!(d.reason, ReasonCode::PrefixMatch);
    assert_eq!(picked(&d).as_deref(), Some("r1"));
    // r1 overloaded: the overflow goes by the request's own last block over every
    // other replica, here the one that lacks the header, not the next holder.
    let _held = in_flight(&router, "r1", 6, 16);
    let d = lookup(&router, &new_chat);
    assert_eq!(d.reason, ReasonCode::PrefixMatch);
    assert_eq!(picked(&d).as_deref(), Some("r4"));
    assert_eq!(d.spilled_from(), Some("r1"));
}

#[test]
fn a_spilled_conversation_walks_everyone_by_its_deepest_block() {
    let router = header_fleet();
    let chat = long(req(&[1, 2, 3, 4, 5, 6, 7]));
    assert_eq!(picked(&lookup(&router, &chat)).as_deref(), Some("r1"));
    let _held = in_flight(&router, "r1", 6, 16);
    let d = lookup(&router, &chat);
    // r2 and r3 hold only the header: no better than r4, so the walk is the
    // rendezvous order of block 6 over all three (not r2, the next survivor).
    let target = owner(6, &["r2", "r3", "r4"]);
    assert_ne!(target, "r2", "fixture: block 6 must not favour r2");
    assert_eq!(picked(&d), Some(target));
    assert_eq!(d.spilled_from(), Some("r1"));
}

/// r1, r2 and r3 hold a hot six-block document; r4 holds nothing.
fn hot_document_fleet() -> Router {
    let router = mk_router(ResolvedPolicy::default());
    for id in ["r1", "r2", "r3"] {
        store(&router, id, &[11, 12, 13, 14, 15, 16]);
    }
    register(&router, acme(), "r4", t0());
    router
}

#[test]
fn a_spill_of_a_hot_document_most_replicas_hold_walks_its_other_holders_first() {
    let router = hot_document_fleet();
    // The question's block would send a walk over everyone to r4, the replica
    // without the document (a full prefill there).
    let doc = [11, 12, 13, 14, 15, 16];
    let question = seed_owned_by("r4", &["r2", "r3", "r4"], &doc);
    // A 600-token document and a 16-token question.
    let r = req(&[11, 12, 13, 14, 15, 16, question]).tokens(&[100, 100, 100, 100, 100, 100, 16]);
    assert_eq!(picked(&lookup(&router, &r)).as_deref(), Some("r1"));
    let _held = in_flight(&router, "r1", 6, 16);
    // Three of four hold the document, so it is "common", but it is all of the
    // request but 16 tokens: its other holders are where it is still a hit, and
    // the overflow spreads over them by the question's block.
    let d = lookup(&router, &r);
    assert_eq!(d.reason, ReasonCode::PrefixMatch);
    assert_eq!(picked(&d), Some(owner(question, &["r2", "r3"])));
    assert_eq!(d.spilled_from(), Some("r1"));
    assert_eq!(d.spilled_by(), Some(SpillCheck::Requests));
    // With a 600-token question it would prefill most of itself anywhere: the
    // document is a header then, and the walk goes over everyone.
    let d = lookup(&router, &long(r));
    assert_eq!(picked(&d).as_deref(), Some("r4"));
    assert_eq!(d.spilled_from(), Some("r1"));
    // A 96-token "document" (a short system prompt) saves too little to stay
    // among its holders: the walk goes over everyone too.
    let d = lookup(&router, &req(&[11, 12, 13, 14, 15, 16, question]));
    assert_eq!(picked(&d).as_deref(), Some("r4"));
    assert_eq!(d.spilled_from(), Some("r1"));
}

/// r1, r3 and r4 at 2 requests each, r2 at 3: above the fleet's mean (2.25),
/// under `factor × mean + slack` (1.25 × 2.5 + 2).
fn uneven_by_one(router: &Router) -> Vec<Inflight> {
    FLEET
        .iter()
        .flat_map(|id| in_flight(router, id, if *id == "r2" { 3 } else { 2 }, 16))
        .collect()
}

#[test]
fn a_pick_above_the_mean_but_under_the_bound_keeps_the_seeds_answer() {
    // r2 holds six blocks nobody else does: the ranking puts it first.
    let router = mk_router(ResolvedPolicy::default());
    store(&router, "r2", &[71, 72, 73, 74, 75, 76]);
    for id in ["r1", "r3", "r4"] {
        register(&router, acme(), id, t0());
    }
    let r = req(&[71, 72, 73, 74, 75, 76, 77]);
    let d = lookup(&router, &r);
    assert_eq!(d.reason, ReasonCode::PrefixMatch);
    assert_eq!(picked(&d).as_deref(), Some("r2"));
    let _held = uneven_by_one(&router);
    // 3 + 1 is under 1.25 × 2.5 + 2: the hit stays where it is cached.
    let d = lookup(&router, &r);
    assert_eq!(d.reason, ReasonCode::PrefixMatch);
    assert_eq!(picked(&d).as_deref(), Some("r2"));
    assert_eq!(d.spilled_from(), None);
    // So does r2 as TENANT_HOT's pick, which holds no hit for the request: moving
    // such picks as soon as their replica is above the mean bought balance with
    // worse tails (docs/decision.md, "Why the rule is shaped so").
    let d = lookup(&router, &req(&[9, 10, 11]));
    assert_tenant_hot(&d, "r2");
    assert_eq!(d.spilled_from(), None);
}

#[test]
fn a_copy_by_the_request_count_goes_to_the_replica_with_the_fewest_recent_requests() {
    let (router, r) = fleet(ResolvedPolicy::default());
    let r = long(r);
    // Both holders are over the count bound, so the request makes a copy. The
    // rendezvous order (block 6) puts `first` before `other`, but `first` took
    // more requests lately: the copy goes to `other`. (Recent means stay far
    // below the share bound's gate: only the count bound is at work.)
    let first = owner(6, &["r3", "r4"]);
    let other = if first == "r3" { "r4" } else { "r3" };
    routed(&router, &first, 5, t0());
    routed(&router, other, 1, t0());
    let held: Vec<_> = ["r1", "r2"]
        .iter()
        .flat_map(|id| in_flight(&router, id, 6, 16))
        .collect();
    let d = lookup(&router, &r);
    assert_eq!(picked(&d).as_deref(), Some(other));
    assert_eq!(d.spilled_from(), Some("r1"));
    assert_eq!(d.spilled_by(), Some(SpillCheck::Requests));
    // Another holder within the bound still comes first, however busy lately:
    // there the request is a hit, not a copy.
    routed(&router, "r2", 10, t0());
    drop(held);
    let _held = in_flight(&router, "r1", 6, 16);
    let d = lookup(&router, &r);
    assert_eq!(picked(&d).as_deref(), Some("r2"));
    assert_eq!(d.spilled_from(), Some("r1"));
}

/// Six replicas: r1, r2 and r3 hold a whole document, r4 a shorter part of it
/// (with them, more than half the fleet: the common part), r5 and r6 nothing.
/// Returns the router, a long request for the document, and its three deepest
/// holders in rank order (the pick first).
fn deep_holders() -> (Router, Req, [String; 3]) {
    let router = mk_router(ResolvedPolicy::default());
    for id in ["r1", "r2", "r3"] {
        store(&router, id, &[1, 2, 3, 4, 5, 6]);
    }
    store(&router, "r4", &[1, 2, 3, 4, 5]);
    for id in ["r5", "r6"] {
        register(&router, acme(), id, t0());
    }
    let r = long(req(&[1, 2, 3, 4, 5, 6, 7, 8]));
    let ranked: Vec<String> = rows(&lookup(&router, &r))
        .into_iter()
        .map(|r| r.0)
        .collect();
    assert!(
        ranked[..3].iter().all(|id| id != "r4"),
        "the deepest holders rank first: {ranked:?}"
    );
    let holders = [ranked[0].clone(), ranked[1].clone(), ranked[2].clone()];
    (router, r, holders)
}

#[test]
fn a_spill_to_another_holder_takes_the_emptiest_of_the_deepest_matches() {
    let (router, r, ranked) = deep_holders();
    let [pick, second, third] = &ranked;
    // The pick is over the count bound (mean 7 / 6, bound 3.46). The walk's next
    // holder took more requests lately than the other deep holder, and r4, the
    // emptiest, matches less: the spill goes to the other deep holder.
    routed(&router, second, 5, t0());
    routed(&router, third, 2, t0());
    let _held = in_flight(&router, pick, 6, 16);
    let d = lookup(&router, &r);
    assert_eq!(picked(&d).as_deref(), Some(third.as_str()));
    assert_eq!(d.spilled_from(), Some(pick.as_str()));
    assert_eq!(d.spilled_by(), Some(SpillCheck::Requests));
}

#[test]
fn a_spill_to_holders_all_over_their_share_still_takes_the_emptiest() {
    let (router, r, ranked) = deep_holders();
    let [pick, second, third] = &ranked;
    // The pick and every replica but the two other holders are over the count
    // bound (8 in flight each: mean 33 / 6, bound 8.875); both other holders
    // are over the share bound (recent 61 and 51 against 1.2 × 143 / 6 + 2 =
    // 30.6), so no candidate passes both. Of the holders under the count bound,
    // the spill takes the one with fewer recent requests, not the walk's first.
    routed(&router, second, 60, t0());
    routed(&router, third, 50, t0());
    let _held: Vec<_> = [pick.as_str(), "r4", "r5", "r6"]
        .into_iter()
        .flat_map(|id| in_flight(&router, id, 8, 16))
        .collect();
    let d = lookup(&router, &r);
    assert_eq!(picked(&d).as_deref(), Some(third.as_str()));
    assert_eq!(d.spilled_from(), Some(pick.as_str()));
    assert_eq!(d.spilled_by(), Some(SpillCheck::Requests));
}
