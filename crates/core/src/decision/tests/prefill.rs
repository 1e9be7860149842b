//! The prefill half of the load rule (`decision/bounded_load.rs::by_prefill`,
//! `load/prefills.rs`): a pick whose queued prefill work (plus this request's
//! own uncached tokens) exceeds the cheapest replica's by more than
//! `prefillSlackTokens` spills there, and the backlog follows the engine: it goes
//! when the engine stores the request's last block, once.

use super::*;

/// Routes `chain` (`tokens` a block) to `replica` as ext_proc does (decide,
/// then admit) and returns its guard: one request in flight there whose
/// uncached tokens wait for the engine.
fn route(router: &Router, replica: &str, chain: &[u64], tokens: u32) -> Inflight {
    let (r, d) = decided_for(router, replica, chain, tokens, t0());
    router
        .admit(&d, &r.as_lookup(), t0())
        .expect("a pick to admit")
}

/// `chain` (`tokens` a block) with `replica` its only candidate, decided at `now`.
fn decided_for(
    router: &Router,
    replica: &str,
    chain: &[u64],
    tokens: u32,
    now: Timestamp,
) -> (Req, Decision) {
    let r = Req {
        counts: vec![tokens; chain.len()],
        ..req(chain).candidates(&[replica])
    };
    let d = router.lookup(&r.as_lookup(), now);
    assert_eq!(picked(&d).as_deref(), Some(replica));
    (r, d)
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
    assert_eq!(d.spilled_by(), Some(SpillCheck::Prefill));
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
    clear(&router, "r3");
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

/// Routes as ext_proc does when Envoy may skip the response headers: the count
/// rides with the prefill ticket when the replica's event feed is live.
fn route_until_prefill_end(
    router: &Router,
    replica: &str,
    chain: &[u64],
    tokens: u32,
    now: Timestamp,
) -> Inflight {
    let (r, d) = decided_for(router, replica, chain, tokens, now);
    router
        .admit_until_prefill_end(&d, &r.as_lookup(), now)
        .expect("a pick to admit")
}

/// A prompt r1 holds whole (blocks 1–6; r3 the other candidate).
fn cached_on_r1() -> Req {
    req(&[1, 2, 3, 4, 5, 6]).candidates(&["r1", "r3"])
}

/// [`cached_on_r1`] decided and admitted on r1 until its prefill's end, which
/// is at once (every block cached, r1's signals live).
fn admit_cached_on_r1(router: &Router) -> Inflight {
    let cached = cached_on_r1();
    let d = lookup(router, &cached);
    assert_eq!(picked(&d).as_deref(), Some("r1"));
    let held = router
        .admit_until_prefill_end(&d, &cached.as_lookup(), t0())
        .expect("a pick to admit");
    assert!(held.ends_with_prefill());
    held
}

/// [`fleet`] whose engines all reported an empty queue at t0.
fn reported_fleet() -> Router {
    let (router, _) = fleet(ResolvedPolicy::default());
    for id in FLEET {
        report_queue(&router, id, 0, 0, t0());
    }
    router
}

#[test]
fn with_a_live_event_feed_the_request_ends_with_its_prefill() {
    let router = reported_fleet();
    // r1 stored and reported at t0: both engine signals are live. The guard no
    // longer holds the count.
    let guard = route_until_prefill_end(&router, "r1", &[899, 900], 50, t0());
    assert!(guard.ends_with_prefill());
    drop(guard);
    assert_eq!(
        backlog(&router, "r1"),
        (1, 100),
        "the response does not end it"
    );
    // Neither does another replica's event, nor a block that is not its last.
    store(&router, "r2", &[899, 900]);
    store(&router, "r1", &[899]);
    assert_eq!(backlog(&router, "r1"), (1, 100));
    // The engine stores its last block: the request and its tokens go, once.
    store(&router, "r1", &[899, 900]);
    assert_eq!(backlog(&router, "r1"), (0, 0));
    store(&router, "r1", &[899, 900]);
    assert_eq!(backlog(&router, "r1"), (0, 0));
    let c = router.index().counters();
    assert_eq!((c.inflight_ended_by_event, c.inflight_aged_out), (1, 0));
}

#[test]
fn without_live_engine_signals_the_guard_keeps_the_count() {
    let router = reported_fleet();
    // r1's last event is older than EVENT_FEED_LIVE: its prefill end may never
    // be seen, so the response (the guard) ends the request.
    let later = t0().plus(crate::load::EVENT_FEED_LIVE + Duration::from_secs(1));
    report_queue(&router, "r1", 0, 0, later);
    let guard = route_until_prefill_end(&router, "r1", &[900], 100, later);
    assert!(!guard.ends_with_prefill());
    assert_eq!(backlog(&router, "r1"), (1, 100));
    drop(guard);
    assert_eq!(backlog(&router, "r1"), (0, 0));
    // No queue report (or one older than statsMaxAge): the decode after the
    // prefill would be invisible, so the response ends the request.
    let (unreported, _) = fleet(ResolvedPolicy::default());
    let guard = route_until_prefill_end(&unreported, "r1", &[900], 100, t0());
    assert!(!guard.ends_with_prefill());
    report_queue(&router, "r1", 0, 0, t0());
    let stale = t0().plus(Duration::from_secs(6));
    store_at(&router, acme(), "r1", &[1], stale);
    let guard = route_until_prefill_end(&router, "r1", &[901], 100, stale);
    assert!(!guard.ends_with_prefill());
    drop(guard);
}

#[test]
fn a_fully_cached_request_has_no_prefill_to_wait_for() {
    let router = reported_fleet();
    let (_, r) = fleet(ResolvedPolicy::default());
    let r = long(r);
    // Every block cached: out of our count at once, but in "sent since the
    // report" until the engine's next one. Three make r1 overloaded among four
    // (over 1.25 × 0.75 + 2).
    for _ in 0..3 {
        drop(admit_cached_on_r1(&router));
    }
    assert_eq!(backlog(&router, "r1"), (0, 0));
    assert_eq!(lookup(&router, &r).spilled_from(), Some("r1"));
    report_queue(&router, "r1", 0, 0, t0());
    assert_eq!(lookup(&router, &r).spilled_from(), None);
    // Without a fresh report it counts until its guard drops, as before.
    let (unreported, _) = fleet(ResolvedPolicy::default());
    let cached = cached_on_r1();
    let d = lookup(&unreported, &cached);
    let held = unreported
        .admit_until_prefill_end(&d, &cached.as_lookup(), t0())
        .expect("a pick");
    assert!(!held.ends_with_prefill());
    assert_eq!(backlog(&unreported, "r1"), (1, 0));
    drop(held);
    assert_eq!(backlog(&unreported, "r1"), (0, 0));
}

#[test]
fn a_carried_request_is_let_go_by_clearing_its_replica_or_after_the_age_out() {
    let router = reported_fleet();
    let scope = || router.index().scope(acme()).expect("scope");
    drop(route_until_prefill_end(&router, "r1", &[900], 300, t0()));
    drop(route_until_prefill_end(&router, "r2", &[901], 200, t0()));
    assert_eq!(scope().prefills.len(), 2);
    // AllBlocksCleared: r1 will never report the block, so its request goes now.
    clear(&router, "r1");
    assert_eq!(backlog(&router, "r1"), (0, 0));
    assert_eq!(backlog(&router, "r2"), (1, 200));
    // Maintenance before the age-out keeps waiting; after it, lets go.
    router.maintain(at(crate::load::INFLIGHT_AGE_OUT.as_secs() - 1));
    assert_eq!(backlog(&router, "r2"), (1, 200));
    router.maintain(at(crate::load::INFLIGHT_AGE_OUT.as_secs()));
    assert_eq!(backlog(&router, "r2"), (0, 0));
    let c = router.index().counters();
    assert_eq!((c.inflight_ended_by_event, c.inflight_aged_out), (0, 1));
    assert_eq!(scope().prefills.len(), 0);
}

#[test]
fn a_ticket_that_cannot_be_tracked_gives_the_count_back_to_the_guard() {
    let router = reported_fleet();
    let scope = router.index().scope(acme()).expect("scope");
    // Fill the scope's prefill table with open tickets of other requests.
    let guards: Vec<Inflight> = (0..crate::load::MAX_PREFILLS as u64)
        .map(|i| route(&router, "r4", &[10_000 + i], 16))
        .collect();
    assert_eq!(scope.prefills.len(), crate::load::MAX_PREFILLS);
    let guard = route_until_prefill_end(&router, "r1", &[900], 100, t0());
    assert!(
        !guard.ends_with_prefill(),
        "untracked: no event would end it"
    );
    drop(guard);
    assert_eq!(backlog(&router, "r1"), (0, 0));
    drop(guards);
}

#[test]
fn a_request_past_its_prefill_still_loads_its_replica_until_the_next_report() {
    let router = reported_fleet();
    let (_, r) = fleet(ResolvedPolicy::default());
    let r = long(r);
    // Six requests to r1 end their prefills: none is in flight by our count,
    // but each is still decoding there, so "sent since the report" keeps them
    // until the engine's next report: r1 (6) is over 1.25 × mean (1.5) + 2.
    for i in 0..6 {
        drop(route_until_prefill_end(&router, "r1", &[900 + i], 16, t0()));
        store(&router, "r1", &[900 + i]);
    }
    assert_eq!(backlog(&router, "r1"), (0, 0));
    let d = lookup(&router, &r);
    assert_eq!(
        d.spilled_from(),
        Some("r1"),
        "decoding requests still load r1"
    );
    // The engine's report now says what runs there (here: nothing any more).
    report_queue(&router, "r1", 0, 0, t0());
    let d = lookup(&router, &r);
    assert_eq!(picked(&d).as_deref(), Some("r1"));
    assert_eq!(d.spilled_from(), None);
}

/// What flow control's waiting bound reads for `id`: (the engine's reported
/// waiting count, requests sent since that report still prefilling).
fn waiting_pressure(router: &Router, id: &str) -> (u64, u64) {
    let serving: Vec<String> = vec![id.to_owned()];
    let p = router.pressures(acme(), &serving, t0());
    assert_eq!(p.len(), 1);
    (p[0].engine_waiting, p[0].sent_since_report)
}

#[test]
fn a_request_past_its_prefill_stops_counting_as_waiting_at_once() {
    let router = reported_fleet();
    // Three requests to r1 since its report, all prefilling: three waiting.
    let guards: Vec<Inflight> = (0..3)
        .map(|i| route_until_prefill_end(&router, "r1", &[900 + i], 16, t0()))
        .collect();
    assert_eq!(waiting_pressure(&router, "r1"), (0, 3));
    // The engine stores the first one's last block: it decodes, it no longer
    // waits, though the load rule still counts it until the next report.
    store(&router, "r1", &[900]);
    assert_eq!(waiting_pressure(&router, "r1"), (0, 2));
    // Its response ending changes nothing more; ended twice, it counts once.
    drop(guards);
    store(&router, "r1", &[900]);
    assert_eq!(waiting_pressure(&router, "r1"), (0, 2));
    // A report: the engine's own count takes over; the two still prefilling
    // were admitted before it, so their ends do not take from later requests.
    report_queue(&router, "r1", 2, 1, t0());
    let later = route_until_prefill_end(&router, "r1", &[950], 16, t0());
    assert_eq!(waiting_pressure(&router, "r1"), (2, 1));
    store(&router, "r1", &[901]);
    store(&router, "r1", &[902]);
    assert_eq!(waiting_pressure(&router, "r1"), (2, 1));
    store(&router, "r1", &[950]);
    assert_eq!(waiting_pressure(&router, "r1"), (2, 0));
    drop(later);
}

#[test]
fn a_fully_cached_request_or_one_ended_by_its_response_stops_counting_as_waiting() {
    let router = reported_fleet();
    // Admitted to be let go by its response (not by the engine's event): the
    // guard dropping ends its prefill too.
    let guard = route(&router, "r3", &[960], 16);
    assert_eq!(waiting_pressure(&router, "r3").1, 1);
    drop(guard);
    assert_eq!(waiting_pressure(&router, "r3").1, 0);
    // A prompt r1 holds whole brings no prefill: it never waits for one.
    let held = admit_cached_on_r1(&router);
    assert_eq!(held.uncached_tokens(), 0);
    assert_eq!(waiting_pressure(&router, "r1").1, 0);
    drop(held);
    assert_eq!(waiting_pressure(&router, "r1").1, 0);
}

/// What flow control's saturation bounds read for `id` at `now`: (waiting
/// requests, prefill backlog tokens).
fn flow_reads(router: &Router, id: &str, now: Timestamp) -> (u64, u64) {
    let p = router.pressures(acme(), &[id.to_owned()], now);
    assert_eq!(p.len(), 1);
    (p[0].waiting(), p[0].backlog_tokens)
}

#[test]
fn flow_control_counts_only_the_signals_that_show_a_prefill_end() {
    // r1 stored blocks at t0, so its event feed is live until EVENT_FEED_LIVE
    // later; its engine never reported its queue.
    let (router, _) = fleet(ResolvedPolicy::default());
    let later = t0().plus(crate::load::EVENT_FEED_LIVE + Duration::from_secs(1));
    let _sent = [
        route(&router, "r1", &[900], 100),
        route(&router, "r1", &[901], 100),
    ];
    // Without a report nothing stands in for the waiting count (a request in
    // flight may be decoding). While r1's events are live they will show its
    // prefills end, so its backlog counts.
    assert_eq!(flow_reads(&router, "r1", t0()), (0, 200));
    // Once they are not, a request ends only with its response, which a
    // non-streaming one sends when its generation is done: no backlog.
    assert_eq!(flow_reads(&router, "r1", later), (0, 0));
    // The engine reports 3 waiting: that, plus what was sent since.
    report_queue(&router, "r1", 3, 0, later);
    let _more = route(&router, "r1", &[902], 100);
    assert_eq!(flow_reads(&router, "r1", later), (4, 0));
}
