//! The prefill half of the load rule (`decision/bounded_load.rs::by_prefill`,
//! `index/prefills.rs`): a pick whose queued prefill work (plus this request's
//! own uncached tokens) exceeds the cheapest replica's by more than
//! `prefillSlackTokens` spills there, and the backlog follows the engine: it goes
//! when the engine stores the request's last block, once.

use super::*;
use crate::load::Inflight;

/// Routes `chain` (`tokens` a block) to `replica` as ext_proc does (decide,
/// then admit) and returns its guard: one request in flight there whose
/// uncached tokens wait for the engine.
fn route(router: &Router, replica: &str, chain: &[u64], tokens: u32) -> Inflight {
    let r = Req {
        counts: vec![tokens; chain.len()],
        ..req(chain).candidates(&[replica])
    };
    let d = lookup(router, &r);
    assert_eq!(picked(&d).as_deref(), Some(replica));
    router
        .admit(&d, &r.as_lookup(), t0())
        .expect("a pick to admit")
}

/// (requests in flight, uncached tokens queued) of `id`, as `/snapshot` says.
fn backlog(router: &Router, id: &str) -> (u64, u64) {
    let view = router.view(t0());
    let r = view
        .replicas
        .iter()
        .find(|v| v.replica_id == id)
        .expect("replica");
    (r.inflight_requests, r.inflight_tokens)
}

fn slack_tokens(p: ResolvedPolicy, tokens: u32) -> ResolvedPolicy {
    let mut p = p;
    p.load_balancing.prefill_slack_tokens = tokens;
    p
}

#[test]
fn a_pick_with_a_long_prefill_queue_spills_to_the_cheapest_replica() {
    let (router, r) = fleet(ResolvedPolicy::default());
    // One request in flight: the request count leaves r1 alone.
    let _queued = route(&router, "r1", &[900], 3000);
    assert_eq!(backlog(&router, "r1"), (1, 3000));
    let d = lookup(&router, &r);
    // r1: 3000 queued + 32 uncached; r2: 0 + 48, the cheapest by more than 128.
    assert_eq!(d.reason, ReasonCode::PrefixMatch);
    assert_eq!(picked(&d).as_deref(), Some("r2"));
    assert_eq!(d.spilled_from(), Some("r1"));
}

#[test]
fn a_prefill_queue_within_the_slack_or_with_the_rule_off_keeps_the_pick() {
    let (router, r) = fleet(ResolvedPolicy::default());
    // r1 costs 100 + 32, r2 48: less than 128 apart.
    let _queued = route(&router, "r1", &[900], 100);
    let d = lookup(&router, &r);
    assert_eq!(picked(&d).as_deref(), Some("r1"));
    assert_eq!(d.spilled_from(), None);

    let (router, r) = fleet(slack_tokens(ResolvedPolicy::default(), 0));
    let _queued = route(&router, "r1", &[900], 30_000);
    let d = lookup(&router, &r);
    assert_eq!(picked(&d).as_deref(), Some("r1"));
    assert_eq!(d.spilled_from(), None);
}

#[test]
fn equal_prefill_queues_give_the_seeds_answer() {
    let (router, r) = fleet(ResolvedPolicy::default());
    let seed = rows(&lookup(&router, &r));
    let _queued: Vec<_> = FLEET
        .iter()
        .enumerate()
        .map(|(i, id)| route(&router, id, &[900 + i as u64], 5000))
        .collect();
    let d = lookup(&router, &r);
    assert_prefix(&d, &seed);
    assert_eq!(d.spilled_from(), None);
}

#[test]
fn a_no_match_pick_compares_whole_prompts() {
    // Affinity: every replica would prefill the whole prompt, so only the queues
    // differ; the spill goes to the cheapest.
    let router = mk_router(ResolvedPolicy::default());
    for id in FLEET {
        register(&router, acme(), id, t0());
    }
    let seed = seed_owned_by("r2", &FLEET, &[900, 901, 902, 903]);
    let r = req(&[seed]);
    assert_affinity(&lookup(&router, &r), "r2");
    let _queued = [
        route(&router, "r1", &[900], 2500),
        route(&router, "r2", &[901], 4000),
        route(&router, "r3", &[902], 1000),
        route(&router, "r4", &[903], 2500),
    ];
    let d = lookup(&router, &r);
    assert_affinity(&d, "r3");
    assert_eq!(d.spilled_from(), Some("r2"));
}

#[test]
fn the_backlog_goes_when_the_engine_stores_the_last_block_and_only_once() {
    let (router, _) = fleet(ResolvedPolicy::default());
    let first = route(&router, "r3", &[900, 901], 1000);
    let second = route(&router, "r3", &[910, 911], 700);
    assert_eq!(backlog(&router, "r3"), (2, 3400));
    // A block that is not a request's last ends nothing.
    store(&router, "r3", &[900]);
    assert_eq!(backlog(&router, "r3"), (2, 3400));
    // Another replica storing the same block ends nothing here either.
    store(&router, "r4", &[900, 901]);
    assert_eq!(backlog(&router, "r3"), (2, 3400));
    // The engine stored the first request's last block: its prefill is over,
    // the request itself (decoding) still counts.
    store(&router, "r3", &[900, 901]);
    assert_eq!(backlog(&router, "r3"), (2, 1400));
    // Its response ends it: nothing is taken off twice.
    drop(first);
    assert_eq!(backlog(&router, "r3"), (1, 1400));
    // A response before the event lets the tokens go; the late event is a no-op.
    drop(second);
    assert_eq!(backlog(&router, "r3"), (0, 0));
    let third = route(&router, "r3", &[920], 500);
    store(&router, "r3", &[910, 911]);
    assert_eq!(backlog(&router, "r3"), (1, 500));
    drop(third);
}

#[test]
fn cleared_or_purged_prefills_stop_waiting_and_still_end_with_their_request() {
    let (router, _) = fleet(ResolvedPolicy::default());
    let scope = || router.index().scope(acme()).expect("scope");
    let guard = route(&router, "r3", &[900], 800);
    assert_eq!(scope().prefills.len(), 1);
    ingest(
        &router,
        acme(),
        "r3",
        &endpoint_of("r3"),
        &[IndexEvent::Cleared],
        t0(),
    );
    assert_eq!(scope().prefills.len(), 0);
    assert_eq!(backlog(&router, "r3"), (1, 800));
    drop(guard);
    assert_eq!(backlog(&router, "r3"), (0, 0));
    // A request that ended before its block came is purged by maintenance.
    drop(route(&router, "r3", &[930], 600));
    assert_eq!(scope().prefills.len(), 1);
    router.maintain(t0());
    assert_eq!(scope().prefills.len(), 0);
}

#[test]
fn a_query_or_a_fully_cached_prompt_waits_for_nothing() {
    let (router, r) = fleet(ResolvedPolicy::default());
    let scope = || router.index().scope(acme()).expect("scope");
    // A LookupRoute is a query: decided, never admitted.
    let _ = lookup(&router, &r);
    assert_eq!(scope().prefills.len(), 0);
    // Everything cached: no prefill backlog to let go. (Two candidates: with r1
    // alone no block would distinguish it.)
    let cached = req(&[1, 2, 3, 4, 5, 6]).candidates(&["r1", "r3"]);
    let d = lookup(&router, &cached);
    assert_eq!(d.reason, ReasonCode::PrefixMatch);
    let held = router.admit(&d, &cached.as_lookup(), t0()).expect("a pick");
    assert_eq!(backlog(&router, "r1"), (1, 0));
    assert_eq!(scope().prefills.len(), 0);
    drop(held);
}
