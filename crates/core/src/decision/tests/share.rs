//! The share bound of the load rule (`decision/bounded_load.rs::by_share`,
//! `load/recent_routes.rs`): a pick that took more than `shareFactor × mean + slack`
//! of the requests this sidecar routed lately spills though nothing is in flight
//! there, to a candidate under both this bound and the request-count one; off
//! or with balanced shares the answer is the cache pick.

use super::*;

fn share(factor: f64) -> ResolvedPolicy {
    let mut p = ResolvedPolicy::default();
    p.load_balancing.share_factor = factor;
    p
}

/// The cache pick's ranking of [`fleet`]'s request (share bound off).
fn seed_rows() -> Vec<Row> {
    let (router, r) = fleet(share(0.0));
    rows(&lookup(&router, &r))
}

/// The answer is the cache pick's ranking, unmoved by the load rule.
#[track_caller]
fn assert_seed_answer(d: &Decision) {
    assert_prefix(d, &seed_rows());
    assert_eq!(d.spilled_from(), None);
}

#[test]
fn a_trickle_is_left_alone() {
    let (router, r) = fleet(share(1.2));
    // r1 took all 60 recent requests, but the mean (61 / 4 = 15.25) is below
    // SHARE_MIN_MEAN: nothing to balance yet.
    routed(&router, "r1", 60, t0());
    let d = lookup(&router, &r);
    assert_seed_answer(&d);
    // Four more and it is traffic: r1 (64 + 1) is far over 1.2 × 16.25 + 2.
    routed(&router, "r1", 4, t0());
    assert_eq!(lookup(&router, &r).spilled_from(), Some("r1"));
}

#[test]
fn off_a_busy_recent_past_changes_nothing() {
    let (router, r) = fleet(share(0.0));
    routed(&router, "r1", 100, t0());
    let d = lookup(&router, &r);
    assert_seed_answer(&d);
}

#[test]
fn a_pick_over_its_share_spills_to_the_next_survivor_with_nothing_in_flight() {
    let (router, r) = fleet(share(1.2));
    // Balanced shares: the cache pick.
    for id in FLEET {
        routed(&router, id, 20, t0());
    }
    let d = lookup(&router, &r);
    assert_seed_answer(&d);
    // r1 at 20 + 20: mean (40 + 60 + 1) / 4 = 25.25, bound 1.2 × 25.25 + 2 = 32.3.
    routed(&router, "r1", 20, t0());
    let d = lookup(&router, &r);
    let seed = seed_rows();
    assert_prefix(&d, &[seed[1].clone(), seed[0].clone()]);
    assert_eq!(d.spilled_from(), Some("r1"));
    assert_eq!(d.spilled_by(), Some(SpillCheck::Share));
}

/// `replica`'s engine shows `total` requests that reached their first token
/// (a metrics scrape of its TTFT histogram).
fn report_started(router: &Router, replica: &str, total: u64) {
    let report = StatsReport {
        scope: acme(),
        replica_id: replica,
        endpoint: &endpoint_of(replica),
        stats: ReplicaStats {
            first_tokens_total: Some(total),
            ..ReplicaStats::default()
        },
    };
    router.report_stats(&report, t0()).expect("stats");
}

#[test]
fn other_sidecars_requests_count_in_the_share_once_the_engine_shows_them() {
    let (router, r) = fleet(share(1.2));
    for id in FLEET {
        report_started(&router, id, 1_000);
        routed(&router, id, 20, t0());
    }
    // The engines show exactly this sidecar's requests: nothing counted twice.
    for id in FLEET {
        report_started(&router, id, 1_020);
    }
    assert_eq!(recent(&router, "r1"), 20.0);
    assert_seed_answer(&lookup(&router, &r));
    // Another sidecar sent r1 30 more: mean (50 + 60 + 1) / 4 = 27.75, bound
    // 1.2 × 27.75 + 2 = 35.3, and r1 is at 50.
    report_started(&router, "r1", 1_050);
    assert_eq!(recent(&router, "r1"), 50.0);
    let d = lookup(&router, &r);
    let seed = seed_rows();
    assert_prefix(&d, &[seed[1].clone(), seed[0].clone()]);
    assert_eq!(d.spilled_by(), Some(SpillCheck::Share));
}

#[test]
fn the_count_halves_every_half_life_and_the_pick_comes_back() {
    let (router, r) = fleet(share(1.2));
    routed(&router, "r1", 100, t0());
    // mean (100 + 1) / 4 = 25.25, bound 32.3: r1 is over.
    assert_eq!(lookup(&router, &r).spilled_from(), Some("r1"));
    // Two half-lives later r1's 100 are 25: mean 6.5, a trickle the bound
    // leaves alone (below SHARE_MIN_MEAN).
    let later = t0().plus(crate::load::HALF_LIFE * 2);
    for id in FLEET {
        register(&router, acme(), id, later);
    }
    let d = lookup_at(&router, &r, later);
    assert_seed_answer(&d);
}

#[test]
fn the_walk_skips_candidates_over_either_bound() {
    let (router, r) = fleet(share(1.2));
    routed(&router, "r1", 100, t0());
    // r2, the next survivor, is under its share but over the request count:
    // mean (6 + 1) / 4, bound 1.25 × 1.75 + 2 = 4.19, and r2 runs 6.
    let probe = req(&[]).candidates(&["r2"]).prefix("busy", 16);
    let _held: Vec<_> = (0..6)
        .map(|_| {
            let d = lookup(&router, &probe);
            router
                .admit(&d, &probe.as_lookup(), t0())
                .expect("admitted")
        })
        .collect();
    let d = lookup(&router, &r);
    // r1 matched six blocks: the walk goes on in rendezvous order of block 6.
    assert_eq!(rows(&d)[0].0, owner(6, &["r3", "r4"]));
    assert_eq!(d.spilled_from(), Some("r1"));
}

/// `id`'s recent count as `/snapshot` shows it.
fn recent(router: &Router, id: &str) -> f64 {
    let view = router.view(t0());
    view.replicas
        .iter()
        .find(|v| v.replica_id == id)
        .expect("replica")
        .recent_requests
}

#[test]
fn a_gateway_query_counts_nothing_and_all_blocks_cleared_starts_the_share_over() {
    let (router, r) = fleet(share(1.2));
    // LookupRoute (a query): decided, never admitted.
    for _ in 0..5 {
        lookup(&router, &r);
    }
    assert_eq!(recent(&router, "r1"), 0.0);
    routed(&router, "r1", 10, t0());
    routed(&router, "r2", 3, t0());
    assert!((recent(&router, "r1") - 10.0).abs() < 0.01);
    clear(&router, "r1");
    assert_eq!(recent(&router, "r1"), 0.0);
    assert!((recent(&router, "r2") - 3.0).abs() < 0.01);
}

#[test]
fn with_no_other_holder_under_its_share_a_copy_waits_for_the_copy_bound() {
    let (router, r) = fleet(share(1.2));
    // r2, the other holder, is over its share too; r3 and r4 hold nothing.
    // mean (24 + 30 + 10 + 10 + 1) / 4 = 18.75: bound 1.2 × 18.75 + 2 = 24.5,
    // copy bound 26.5. r1 (24 + 1) is over the bound, short of the copy bound:
    // a copy would be a full prefill, so the hit stays.
    routed(&router, "r2", 30, t0());
    routed(&router, "r3", 10, t0());
    routed(&router, "r4", 10, t0());
    routed(&router, "r1", 24, t0());
    let d = lookup(&router, &r);
    assert_seed_answer(&d);
}

#[test]
fn past_the_copy_bound_the_copy_goes_to_the_replica_with_the_fewest_recent_requests() {
    let (router, r) = fleet(share(1.2));
    // The walk's rendezvous order (block 6) puts `first` before `other`; give
    // `first` more recent requests, so only the fewest-requests rule picks `other`.
    let first = owner(6, &["r3", "r4"]);
    let other = if first == "r3" { "r4" } else { "r3" };
    routed(&router, "r2", 30, t0());
    routed(&router, &first, 12, t0());
    routed(&router, other, 4, t0());
    // mean (30 + 30 + 12 + 4 + 1) / 4 = 19.25: bound 25.1, copy bound 27.1;
    // r1 (30 + 1) is past it and r2 over its share.
    routed(&router, "r1", 30, t0());
    let d = lookup(&router, &r);
    assert_eq!(picked(&d).as_deref(), Some(other));
    assert_eq!(d.spilled_from(), Some("r1"));
    assert_eq!(d.spilled_by(), Some(SpillCheck::Share));
}

#[test]
fn a_hot_document_most_replicas_hold_goes_to_another_holder_before_a_copy() {
    let router = mk_router(share(1.2));
    for id in ["r1", "r2", "r3"] {
        store(&router, id, &[11, 12, 13, 14, 15, 16]);
    }
    register(&router, acme(), "r4", t0());
    // A 600-token document and a 16-token question.
    let r = req(&[11, 12, 13, 14, 15, 16, 17]).tokens(&[100, 100, 100, 100, 100, 100, 16]);
    assert_eq!(picked(&lookup(&router, &r)).as_deref(), Some("r1"));
    // mean (31 + 30 + 14 + 4 + 1) / 4 = 20: bound 26, copy bound 28. r1 is past
    // the copy bound and r2 over its share; r4, without the document, has the
    // fewest recent requests, but r3 holds it and is under: a hit, not a copy.
    routed(&router, "r2", 30, t0());
    routed(&router, "r3", 14, t0());
    routed(&router, "r4", 4, t0());
    routed(&router, "r1", 31, t0());
    let d = lookup(&router, &r);
    assert_eq!(picked(&d).as_deref(), Some("r3"));
    assert_eq!(d.spilled_from(), Some("r1"));
    assert_eq!(d.spilled_by(), Some(SpillCheck::Share));
}

#[test]
fn a_quick_start_stays_on_its_holder_whatever_the_count_while_the_share_bound_is_on() {
    let (router, r) = fleet(share(1.2));
    // Below the gate the count is the only balance there is: it moves the hit.
    // Six decodes in flight on r1 (16 uncached tokens each, 96 queued): over
    // the request-count bound (1.25 × 1.75 + 2), nothing left to prefill there.
    let held = in_flight(&router, "r1", 6, 16);
    let d = lookup(&router, &r);
    assert_eq!(d.spilled_from(), Some("r1"));
    assert_eq!(d.spilled_by(), Some(SpillCheck::Requests));
    // Balanced recent shares put the share bound on: the request's 32 uncached
    // tokens start at once on r1, so the count no longer moves it.
    for id in FLEET {
        routed(&router, id, 20, t0());
    }
    let d = lookup(&router, &r);
    assert_seed_answer(&d);
    // A long prompt (616 uncached tokens) is a full prefill anywhere: moved.
    let d = lookup(&router, &long(r.clone()));
    assert_eq!(picked(&d).as_deref(), Some("r2"));
    assert_eq!(d.spilled_by(), Some(SpillCheck::Requests));
    // So is a short one behind a queued prefill: eight more requests of 64
    // uncached tokens put 96 + 512 tokens ahead of it.
    let _more = in_flight(&router, "r1", 8, 64);
    let d = lookup(&router, &r);
    assert_eq!(d.spilled_by(), Some(SpillCheck::Requests));
    drop(held);
}

#[test]
fn an_engine_reporting_requests_waiting_is_no_quick_start() {
    let (router, r) = fleet(share(1.2));
    for id in FLEET {
        routed(&router, id, 20, t0());
    }
    let _held = in_flight(&router, "r1", 6, 16);
    assert_eq!(lookup(&router, &r).spilled_from(), None);
    // r1's engine says 3 wait in its queue: the hit would wait behind them.
    report_queue(&router, "r1", 3, 6, t0());
    let d = lookup(&router, &r);
    assert_eq!(d.spilled_from(), Some("r1"));
    assert_eq!(d.spilled_by(), Some(SpillCheck::Requests));
}
