//! Step 9 (affinity or NO_HINT), scope isolation, the candidate subset and which
//! replicas can be picked at all.

use std::collections::BTreeSet;

use super::*;

/// Serving replicas in acme/llama/vLLM that hold nothing.
fn serving(policy: ResolvedPolicy, ids: &[&str]) -> Router {
    let router = mk_router(policy);
    for id in ids {
        register(&router, acme(), id, t0());
    }
    router
}

#[test]
fn step9_affinity_hint_pins_the_rendezvous_owner_of_the_last_chain_block() {
    let ids = ["r1", "r2", "r3"];
    let router = serving(ResolvedPolicy::default(), &ids);
    let mut chosen = BTreeSet::new();
    for seed in 0..64u64 {
        let r = req(&[100, seed]);
        let d = lookup(&router, &r);
        let expected = owner(seed, &ids);
        assert_affinity(&d, &expected);
        assert_eq!(
            d.pick().map(|p| p.endpoint.to_string()),
            Some(endpoint_of(&expected))
        );
        // Repeat prompts pin to the same replica.
        assert_eq!(picked(&lookup(&router, &r)), Some(expected.clone()));
        chosen.insert(expected);
    }
    assert_eq!(chosen.len(), ids.len(), "every replica owns some seeds");
}

#[test]
fn step9_affinity_seed_is_the_prefix_hash_without_a_chain() {
    let ids = ["r1", "r2", "r3"];
    let router = serving(ResolvedPolicy::default(), &ids);
    for i in 0..32 {
        let prefix = format!("p-{i}");
        let d = lookup(&router, &exact_prefix(&prefix, 64));
        let seed = crate::index::prefix_seed(&prefix);
        assert_affinity(&d, &owner(seed, &ids));
    }
}

#[test]
fn step9_chain_seeds_affinity_when_chain_and_prefix_are_both_given() {
    let ids = ["r1", "r2", "r3"];
    let router = serving(ResolvedPolicy::default(), &ids);
    for seed in 0..32u64 {
        let prefix = format!("p-{seed}");
        let d = lookup(&router, &req(&[100, seed]).prefix(&prefix, 64));
        assert_affinity(&d, &owner(seed, &ids));
    }
}

#[test]
fn step9_no_seed_is_no_hint_even_with_affinity() {
    let router = serving(ResolvedPolicy::default(), &["r1", "r2"]);
    assert_none(&lookup(&router, &req(&[])), ReasonCode::NoHint);
}

#[test]
fn step9_no_serving_replica_is_no_hint_even_with_affinity() {
    let router = mk_router(ResolvedPolicy::default());
    store_prefix_only(&router, acme(), "p1", &[1, 2]);
    assert_none(&lookup(&router, &req(&[50])), ReasonCode::NoHint);
    assert_none(&lookup(&router, &req(&[1, 2])), ReasonCode::NoHint);
}

#[test]
fn step9_affinity_disabled_is_no_hint() {
    let router = serving(no_affinity(ResolvedPolicy::default()), &["r1", "r2"]);
    assert_none(&lookup(&router, &req(&[50])), ReasonCode::NoHint);
    assert_none(
        &lookup(&router, &exact_prefix("p-x", 64)),
        ReasonCode::NoHint,
    );
}

#[test]
fn affinity_never_preempts_a_prefix_match() {
    let ids = ["r1", "r2"];
    // A last block whose affinity owner is r2, while r1 holds the chain.
    let last = seed_owned_by("r2", &ids, &[1]);
    let router = serving(open(), &ids);
    store(&router, "r1", &[1, last]);
    let d = lookup(&router, &req(&[1, last]));
    assert_prefix(&d, &[row("r1", 1.0, 32, 2)]);
}

#[test]
fn affinity_never_preempts_tenant_hot() {
    let ids = ["r1", "r2"];
    let seed = seed_owned_by("r2", &ids, &[1, 2]);
    let router = serving(ResolvedPolicy::default(), &ids);
    store(&router, "r1", &[1, 2]);
    assert_tenant_hot(&lookup(&router, &req(&[seed])), "r1");
}

#[test]
fn a_vllm_request_is_never_pinned_to_an_sglang_replica() {
    let router = mk_router(ResolvedPolicy::default());
    let sglang = scope_of(TENANT, SGLANG);
    // The SGLang replicas hold the very chain the vLLM request carries.
    for id in ["s1", "s2", "s3"] {
        store_at(&router, sglang, id, &[1, 2, 3, 4, 5], t0());
    }
    register(&router, acme(), "v1", t0());
    register(&router, acme(), "v2", t0());
    for seed in 0..64u64 {
        let d = lookup(&router, &req(&[1, 2, 3, 4, seed + 10]));
        assert_affinity(&d, &owner(seed + 10, &["v1", "v2"]));
    }
    // TENANT_HOT too stays in the scheme.
    store(&router, "v2", &[77]);
    assert_tenant_hot(&lookup(&router, &req(&[1, 2, 3, 4, 5])), "v2");
    // The same chain under the SGLang scheme matches there (N = 3, h = 3: score 0).
    let d = lookup(&router, &req(&[1, 2, 3, 4, 5]).scheme(SGLANG));
    assert_affinity(&d, &owner(5, &["s1", "s2", "s3"]));
}

/// r1 holds [1, 2, 3, 4], r2 [1, 2], r3 [9], r4 nothing.
fn four_replicas(policy: ResolvedPolicy) -> Router {
    let router = mk_router(policy);
    store(&router, "r1", &[1, 2, 3, 4]);
    store(&router, "r2", &[1, 2]);
    store(&router, "r3", &[9]);
    register(&router, acme(), "r4", t0());
    router
}

#[test]
fn candidates_narrow_ranking_and_distinguishing_power() {
    let router = four_replicas(open());
    // N = 2 (r2, r3): r2 alone holds [1, 2], d = 1/2.
    let d = lookup(&router, &req(&[1, 2, 3, 4]).candidates(&["r2", "r3"]));
    assert_prefix(&d, &[row("r2", 1.0, 32, 2)]);
    // N = 2 (r1, r2): h = 2, 2, 1, 1.
    let d = lookup(&router, &req(&[1, 2, 3, 4]).candidates(&["r1", "r2"]));
    assert_prefix(&d, &[row("r1", 1.0, 64, 4), row("r2", 0.0, 32, 2)]);
}

#[test]
fn candidates_narrow_tenant_hot() {
    let router = four_replicas(ResolvedPolicy::default());
    assert_tenant_hot(&lookup(&router, &req(&[50])), "r1");
    let d = lookup(&router, &req(&[50]).candidates(&["r3", "r4"]));
    assert_tenant_hot(&d, "r3");
    // Only a replica without entries: affinity among the candidates.
    let d = lookup(&router, &req(&[50]).candidates(&["r4"]));
    assert_affinity(&d, "r4");
}

#[test]
fn candidates_narrow_affinity() {
    let ids = ["r1", "r2", "r3", "r4"];
    let router = serving(ResolvedPolicy::default(), &ids);
    for seed in 0..64u64 {
        let d = lookup(&router, &req(&[seed]).candidates(&["r2", "r4"]));
        assert_affinity(&d, &owner(seed, &["r2", "r4"]));
    }
}

#[test]
fn unknown_candidate_ids_are_ignored() {
    let router = four_replicas(open());
    let known = lookup(&router, &req(&[1, 2, 3, 4]).candidates(&["r2", "r3"]));
    let with_ghosts = lookup(
        &router,
        &req(&[1, 2, 3, 4]).candidates(&["ghost", "r2", "r3", "p1"]),
    );
    assert_eq!(rows(&with_ghosts), rows(&known));
    assert_prefix(&with_ghosts, &[row("r2", 1.0, 32, 2)]);
}

#[test]
fn prefix_only_replicas_are_never_picked() {
    let router = mk_router(open());
    store_prefix_only(&router, acme(), "p1", &[1, 2, 3, 4]);
    store(&router, "r1", &[1, 2]);
    register(&router, acme(), "r2", t0());
    // p1 neither ranks nor counts in N or h: N = 2, h = 1.
    let d = lookup(&router, &req(&[1, 2, 3, 4]));
    assert_prefix(&d, &[row("r1", 1.0, 32, 2)]);
    // Not even when it is the only candidate asked for.
    let d = lookup(&router, &req(&[1, 2, 3, 4]).candidates(&["p1"]));
    assert_none(&d, ReasonCode::NoHint);
    // It is still listed, without an endpoint.
    let view = router.view(t0());
    let p1 = view
        .replicas
        .iter()
        .find(|r| r.replica_id == "p1")
        .expect("p1 listed");
    assert_eq!(
        (p1.endpoint.as_deref(), p1.serving, p1.prefix_count),
        (None, false, 4)
    );
}

#[test]
fn declared_replicas_via_install_serve_at_their_address() {
    let router = mk_router(open());
    let snapshot = mk_snapshot(
        open(),
        None,
        vec![backend(&[("d1", "10.1.0.1:8000"), ("d2", "10.1.0.2:8000")])],
    );
    let revision = snapshot.revision().clone();
    router.install(snapshot, t0());
    // d1's engine events carry no endpoint: the declaration makes it serving.
    ingest(&router, acme(), "d1", "", &[stored(&[1, 2, 3, 4])], t0());
    let d = lookup(&router, &req(&[1, 2, 3, 4]));
    assert_prefix(&d, &[row("d1", 2.0, 64, 4)]);
    assert_eq!(d.pick().map(|p| p.endpoint), Some("10.1.0.1:8000"));
    assert_eq!(d.policy_revision, revision);
    // The backend goes: its replicas and their entries leave the index.
    router.install(mk_snapshot(open(), None, Vec::new()), t0());
    assert_none(&lookup(&router, &req(&[1, 2, 3, 4])), ReasonCode::NoHint);
    let view = router.view(t0());
    assert!(view.replicas.is_empty(), "{:?}", view.replicas);
    assert_eq!(view.total_entries, 0);
}

#[test]
fn a_replica_dropped_from_its_backend_leaves_serving_and_loses_its_entries() {
    let router = mk_router(open());
    let both = backend(&[("d1", "10.1.0.1:8000"), ("d2", "10.1.0.2:8000")]);
    router.install(mk_snapshot(open(), None, vec![both]), t0());
    ingest(&router, acme(), "d1", "", &[stored(&[1, 2])], t0());
    ingest(&router, acme(), "d2", "", &[stored(&[1, 2, 3])], t0());
    let only_d2 = backend(&[("d2", "10.1.0.2:8000")]);
    router.install(mk_snapshot(open(), None, vec![only_d2]), t0());
    // N = 1: d2 alone holds [1, 2, 3], d = 0.
    let d = lookup(&router, &req(&[1, 2, 3]));
    assert_prefix(&d, &[row("d2", 0.0, 48, 3)]);
    assert_eq!(router.index().tenant_entries(TENANT), 3);
}
