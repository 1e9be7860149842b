//! Steps 5–6: the lookup budget and the classification of the request's scope.

use std::sync::mpsc;
use std::time::Instant;

use super::*;

/// r1 holds [1, 2, 3, 4] and the exact prefix `p-sys`; r2 serves with nothing.
fn two_replicas(policy: ResolvedPolicy) -> Router {
    let router = mk_router(policy);
    store(&router, "r1", &[1, 2, 3, 4]);
    store_exact_prefix(&router, "r1", "p-sys", 64);
    register(&router, acme(), "r2", t0());
    router
}

#[test]
fn step5_lookup_over_budget_is_timeout_with_empty_scores() {
    let router = two_replicas(budget(open()));
    let chain = req(&[1, 2, 3, 4]);
    let started = Instant::now();
    assert_none(
        &lookup_while_held(&router, acme(), &chain),
        ReasonCode::Timeout,
    );
    assert!(started.elapsed() >= Duration::from_millis(20));
    assert_none(
        &lookup_while_held(&router, acme(), &exact_prefix("p-sys", 64)),
        ReasonCode::Timeout,
    );
    // Once the writer lets go, the same lookups are answered.
    assert_prefix(&lookup(&router, &chain), &[row("r1", 2.0, 64, 4)]);
    assert_prefix(
        &lookup(&router, &exact_prefix("p-sys", 64)),
        &[row("r1", 2.0, 64, 1)],
    );
}

#[test]
fn step5_timeout_keeps_precedence_over_affinity() {
    // Affinity is enabled and the request has a seed and serving replicas.
    let router = two_replicas(budget(ResolvedPolicy::default()));
    assert_none(
        &lookup_while_held(&router, acme(), &req(&[77])),
        ReasonCode::Timeout,
    );
}

#[test]
fn step5_zero_budget_waits_for_the_index() {
    let router = two_replicas(open());
    let held = router.index().scope(acme()).expect("scope exists");
    let (tx, rx) = mpsc::channel();
    std::thread::scope(|s| {
        let writer = s.spawn(|| {
            let guards = held.hold_writes();
            tx.send(()).expect("test thread waits");
            std::thread::sleep(Duration::from_millis(50));
            let released = Instant::now();
            drop(guards);
            released
        });
        rx.recv().expect("writer holds the shards");
        let d = lookup(&router, &req(&[1, 2, 3, 4]));
        let answered = Instant::now();
        let released = writer.join().expect("writer thread");
        // No budget: no TIMEOUT, the lookup waited for the writer.
        assert!(answered >= released);
        assert_prefix(&d, &[row("r1", 2.0, 64, 4)]);
    });
}

#[test]
fn step6_globally_empty_index_is_no_hint_even_with_affinity() {
    let router = mk_router(ResolvedPolicy::default());
    let r = req(&[1, 2]).prefix("p-sys", 32);
    assert_none(&lookup(&router, &r), ReasonCode::NoHint);
    // A replica anywhere (another tenant) makes acme an unknown tenant instead.
    register(&router, scope_of(WALK_IN, VLLM), "w1", t0());
    assert_none(&lookup(&router, &r), ReasonCode::UnknownTenant);
}

#[test]
fn step6_unknown_tenant_model_and_hash_scheme_take_precedence_over_affinity() {
    let router = mk_router(ResolvedPolicy::default());
    store(&router, "r1", &[1, 2]);
    register(&router, acme(), "r2", t0());
    let r = req(&[1, 2]).prefix("p-sys", 32);
    // Every affinity precondition holds in the right scope.
    assert_affinity(&lookup(&router, &r), &owner(2, &["r1", "r2"]));
    assert_none(
        &lookup(&router, &r.clone().tenant("globex")),
        ReasonCode::UnknownTenant,
    );
    assert_none(
        &lookup(&router, &r.clone().model("mistral")),
        ReasonCode::UnknownModel,
    );
    assert_none(
        &lookup(&router, &r.scheme(SGLANG)),
        ReasonCode::UnknownHashScheme,
    );
}

#[test]
fn step6_unknown_tenant_also_for_a_tenant_without_policy() {
    let router = mk_router(ResolvedPolicy::default());
    store(&router, "r1", &[1, 2]);
    assert_none(
        &lookup(&router, &req(&[1, 2]).tenant(WALK_IN)),
        ReasonCode::UnknownTenant,
    );
}

#[test]
fn step6_a_declared_replica_alone_makes_the_scope_known() {
    let router = mk_router(ResolvedPolicy::default());
    let snapshot = mk_snapshot(
        ResolvedPolicy::default(),
        None,
        vec![backend(&[("d1", "10.1.0.1:8000"), ("d2", "10.1.0.2:8000")])],
    );
    router.install(snapshot, t0());
    let d = lookup(&router, &req(&[5]));
    assert_affinity(&d, &owner(5, &["d1", "d2"]));
    let address = d.pick().map(|p| p.endpoint.to_string());
    let expected = if owner(5, &["d1", "d2"]) == "d1" {
        "10.1.0.1:8000"
    } else {
        "10.1.0.2:8000"
    };
    assert_eq!(address.as_deref(), Some(expected));
}

#[test]
fn step6_a_scope_with_only_expired_entries_and_no_serving_replica_is_unknown() {
    let router = mk_router(ResolvedPolicy::default());
    store_prefix_only(&router, acme(), "p1", &[1, 2]);
    // Fresh: known through its usable entries, but nobody serves: NO_HINT.
    assert_none(
        &lookup_at(&router, &req(&[1, 2]), at(60)),
        ReasonCode::NoHint,
    );
    // After evictionTTL (10m) the entries are unusable, even before a sweep.
    assert_none(
        &lookup_at(&router, &req(&[1, 2]), at(660)),
        ReasonCode::UnknownTenant,
    );
    // Another scheme of the same tenant and model serves: the scheme is unknown.
    register(&router, scope_of(TENANT, SGLANG), "s1", at(650));
    assert_none(
        &lookup_at(&router, &req(&[1, 2]), at(660)),
        ReasonCode::UnknownHashScheme,
    );
}

#[test]
fn step5_a_walk_past_its_budget_stops_at_the_next_stride() {
    // The budget is checked every 1,024 blocks of the walk: a chain that long
    // runs out of a 1 ns budget there, a shorter one is never interrupted.
    let long: Vec<u64> = (1..=2_048).collect();
    let router = mk_router(ResolvedPolicy {
        lookup_timeout: Duration::from_nanos(1),
        ..open()
    });
    store(&router, "r1", &long);
    register(&router, acme(), "r2", t0());
    assert_none(&lookup(&router, &req(&long)), ReasonCode::Timeout);
    let short = lookup(&router, &req(&long[..1_000]));
    assert_eq!(short.reason, ReasonCode::PrefixMatch);
    assert_eq!(picked(&short).as_deref(), Some("r1"));
}
