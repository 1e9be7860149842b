//! Time and configuration around the decision: registrations going stale, entries
//! expiring, the `/readyz` self-test and the policy revision on every answer.

use std::collections::BTreeSet;

use super::*;
use crate::index::IngestError;
use crate::scope::PROBE_TENANT;

fn serving_ids(router: &Router, now: Timestamp) -> Vec<String> {
    router
        .view(now)
        .replicas
        .into_iter()
        .filter(|r| r.serving)
        .map(|r| r.replica_id)
        .collect()
}

#[test]
fn registrations_go_stale_after_eviction_ttl() {
    let router = mk_router(ResolvedPolicy::default());
    report_queue(&router, "r1", 0, 0, t0());
    register(&router, acme(), "r2", at(540));
    let picks = |now| {
        (0..64u64)
            .filter_map(|seed| picked(&lookup_at(&router, &req(&[seed]), now)))
            .collect::<BTreeSet<_>>()
    };
    // Within evictionTTL (10m) both serve.
    assert_eq!(serving_ids(&router, at(599)), ["r1", "r2"]);
    assert_eq!(picks(at(599)).len(), 2);
    // 11 minutes after its last report, r1 has left servingByScope.
    assert_eq!(serving_ids(&router, at(660)), ["r2"]);
    for seed in 0..64u64 {
        assert_affinity(&lookup_at(&router, &req(&[seed]), at(660)), "r2");
    }
    // A fresh report brings it back.
    report_queue(&router, "r1", 0, 0, at(660));
    assert_eq!(serving_ids(&router, at(661)), ["r1", "r2"]);
    assert_eq!(picks(at(661)).len(), 2);
}

#[test]
fn ttl_expired_entries_are_unusable_at_lookup_before_any_sweep() {
    let policy = no_affinity(ResolvedPolicy {
        strategy: gates(false, true, false),
        ..open()
    });
    let router = mk_router(policy);
    store(&router, "r1", &[1, 2, 3, 4]);
    store_exact_prefix(&router, "r1", "p-sys", 64);
    register(&router, acme(), "r2", t0());
    let chain = req(&[1, 2, 3, 4]);
    assert_prefix(
        &lookup_at(&router, &chain, at(599)),
        &[row("r1", 2.0, 64, 4)],
    );
    // Keep both replicas serving, but let the entries age past 10m.
    report_queue(&router, "r1", 0, 0, at(650));
    report_queue(&router, "r2", 0, 0, at(650));
    assert_none(&lookup_at(&router, &chain, at(660)), ReasonCode::NoHint);
    assert_none(
        &lookup_at(&router, &exact_prefix("p-sys", 64), at(660)),
        ReasonCode::NoHint,
    );
    // They are still in the index until the sweep runs.
    assert_eq!(router.index().tenant_entries(TENANT), 5);
    router.maintain(at(660));
    assert_eq!(router.index().tenant_entries(TENANT), 0);
    // A new store makes the chain usable again.
    store_at(&router, acme(), "r1", &[1, 2, 3, 4], at(670));
    assert_prefix(
        &lookup_at(&router, &chain, at(671)),
        &[row("r1", 2.0, 64, 4)],
    );
}

#[test]
fn a_re_store_refreshes_last_seen_and_keeps_the_entry_usable() {
    let router = mk_router(no_affinity(open()));
    store_at(&router, acme(), "r1", &[1, 2], t0());
    register(&router, acme(), "r2", at(500));
    store_at(&router, acme(), "r1", &[1, 2], at(500));
    let d = lookup_at(&router, &req(&[1, 2]), at(900));
    assert_prefix(&d, &[row("r1", 1.0, 32, 2)]);
}

#[test]
fn self_test_passes_under_default_floors_and_leaves_no_trace() {
    let router = mk_router(ResolvedPolicy::default());
    // Globally empty before and after.
    router.self_test(t0()).expect("self-test passes");
    assert_eq!(router.view(t0()), Default::default());
    assert_none(&lookup(&router, &req(&[1, 2])), ReasonCode::NoHint);
    // With real data: the view is unchanged by the probe.
    store(&router, "r1", &[1, 2, 3, 4]);
    register(&router, acme(), "r2", t0());
    let before = router.view(at(1));
    router.self_test(at(1)).expect("self-test passes");
    let after = router.view(at(1));
    assert_eq!(after, before);
    assert!(after.replicas.iter().all(|r| r.tenant != PROBE_TENANT));
    assert!(after.tenants.iter().all(|t| t.tenant != PROBE_TENANT));
    assert_eq!(router.index().total_entries(), 4);
}

#[test]
fn self_test_passes_whatever_the_operators_floors() {
    let strict = ResolvedPolicy {
        minimum_matched_tokens: 100_000,
        routing_floor_score: floor("1000"),
        minimum_prefix_tokens: 100_000,
        affinity_routing: AffinityRouting::Disabled,
        ..ResolvedPolicy::default()
    };
    let snapshot = PolicySnapshot::new(strict, Vec::new(), Vec::new());
    let router = Router::new(IndexConfig::default(), snapshot, t0());
    router.self_test(t0()).expect("self-test passes");
    router.self_test(at(1)).expect("and again");
    assert_eq!(router.view(at(1)), Default::default());
}

#[test]
fn the_probe_tenant_is_reserved_for_the_self_test() {
    let router = mk_router(ResolvedPolicy::default());
    let probe = ScopeRef::new(PROBE_TENANT, MODEL, VLLM);
    let batch = IngestBatch {
        scope: probe,
        replica_id: "r1",
        endpoint: "r1.pods:8000",
        events: &[stored(&[1])],
    };
    assert!(matches!(
        router.ingest(&batch, t0()),
        Err(IngestError::ReservedTenant(_))
    ));
    let stats = StatsReport {
        scope: probe,
        replica_id: "r1",
        endpoint: "r1.pods:8000",
        stats: ReplicaStats::default(),
    };
    assert!(matches!(
        router.report_stats(&stats, t0()),
        Err(IngestError::ReservedTenant(_))
    ));
    assert_eq!(router.index().total_entries(), 0);
}

#[test]
fn policy_revision_is_echoed_on_every_decision() {
    let policy = ResolvedPolicy {
        strategy: gates(true, true, true),
        ..open()
    };
    let router = mk_router(policy.clone());
    let first = router.snapshot().revision().clone();
    store(&router, "r1", &[1, 2]);
    register(&router, acme(), "r2", t0());
    let requests = [
        req(&[1, 2]),               // PREFIX_MATCH
        req(&[50]),                 // TENANT_HOT
        req(&[1, 2]).tokens(&[16]), // POLICY_REQUIRES_CHAIN
        req(&[1]).model("mistral"), // UNKNOWN_MODEL
        req(&[1]).tenant(WALK_IN),  // UNKNOWN_TENANT
        req(&[1]).tenant(""),       // NO_HINT
    ];
    for r in &requests {
        assert_eq!(lookup(&router, r).policy_revision, first, "{r:?}");
    }
    // A new snapshot: a new revision, echoed from then on.
    router.install(mk_snapshot(no_affinity(policy), Some(10), Vec::new()), t0());
    let second = router.snapshot().revision().clone();
    assert_ne!(first, second);
    for r in &requests {
        assert_eq!(lookup(&router, r).policy_revision, second, "{r:?}");
    }
}

#[test]
fn fallback_endpoint_picks_the_least_loaded_serving_replica_then_round_robins() {
    let router = mk_router(ResolvedPolicy::default());
    for (id, waiting) in [("r1", 5), ("r2", 1), ("r3", 0)] {
        report_queue(&router, id, waiting, u32::from(id == "r3"), t0());
    }
    store_prefix_only(&router, acme(), "p1", &[1]);
    let pick = |candidates: &[String], now| {
        router
            .fallback_endpoint(acme(), candidates, now)
            .map(|e| e.to_string())
    };
    // r2 and r3 tie at load 1: they take turns; r1 (5) and p1 (prefix-only) never.
    let picks: BTreeSet<_> = (0..4).filter_map(|_| pick(&[], at(1))).collect();
    let expected: BTreeSet<_> = ["r2", "r3"].iter().map(|id| endpoint_of(id)).collect();
    assert_eq!(picks, expected);
    assert_eq!(pick(&["r1".to_string()], at(1)), Some(endpoint_of("r1")));
    // No serving replica (stale registrations, unknown scope): none.
    assert_eq!(pick(&[], at(700)), None);
    assert_eq!(
        router.fallback_endpoint(scope_of(WALK_IN, VLLM), &[], at(1)),
        None
    );
}
