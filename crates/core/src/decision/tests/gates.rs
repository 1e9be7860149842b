//! Steps 1–4 and 8: what is decided before (or instead of) the index lookup, and
//! the tiny-request downgrade after it.

use super::*;

/// r1 holds the exact prefix `p-sys` (128 tokens), r2 the chain [1, 2, 3, 4].
fn exact_prefix_and_chain(policy: ResolvedPolicy) -> Router {
    let router = mk_router(policy);
    store_exact_prefix(&router, "r1", "p-sys", 128);
    store(&router, "r2", &[1, 2, 3, 4]);
    router
}

fn matching_off() -> ResolvedPolicy {
    ResolvedPolicy {
        strategy: gates(false, false, true),
        ..open()
    }
}

fn require_chain() -> ResolvedPolicy {
    ResolvedPolicy {
        strategy: gates(true, true, true),
        ..open()
    }
}

#[test]
fn step1_chain_matching_off_uses_the_exact_prefix_path() {
    let r = req(&[1, 2, 3, 4]).prefix("p-sys", 128);
    // Off: only the exact prefix counts. N = 2, d = 1/2, score = 128/16 × 1/2.
    let off = exact_prefix_and_chain(matching_off());
    assert_prefix(&lookup(&off, &r), &[row("r1", 4.0, 128, 1)]);
    // On (control): the chain path is used and r2 wins with 4 blocks at d = 1/2.
    let on = exact_prefix_and_chain(open());
    assert_prefix(&lookup(&on, &r), &[row("r2", 2.0, 64, 4)]);
}

#[test]
fn step1_chain_matching_off_drops_an_unequal_chain_instead_of_calling_it_malformed() {
    let r = req(&[1, 2, 3]).tokens(&[16]).prefix("p-sys", 128);
    let off = exact_prefix_and_chain(matching_off());
    assert_prefix(&lookup(&off, &r), &[row("r1", 4.0, 128, 1)]);
    // With matching on, the same request is structurally malformed (step 3).
    let on = exact_prefix_and_chain(open());
    assert_none(&lookup(&on, &r), ReasonCode::NoHint);
}

#[test]
fn step2_require_chain_without_chain_is_policy_requires_chain() {
    let router = exact_prefix_and_chain(require_chain());
    // A exact-prefix-only request that would otherwise be a PREFIX_MATCH on r1.
    assert_none(
        &lookup(&router, &exact_prefix("p-sys", 128)),
        ReasonCode::PolicyRequiresChain,
    );
    // Nothing at all.
    assert_none(&lookup(&router, &req(&[])), ReasonCode::PolicyRequiresChain);
    // A scope the index does not know: the index is not consulted, so no UNKNOWN_*.
    assert_none(
        &lookup(&router, &exact_prefix("p-sys", 128).model("mistral")),
        ReasonCode::PolicyRequiresChain,
    );
}

#[test]
fn step2_require_chain_rejects_before_the_index_is_touched() {
    let router = exact_prefix_and_chain(budget(require_chain()));
    // The index is held by a writer: touching it would time out.
    let d = lookup_while_held(&router, acme(), &exact_prefix("p-sys", 128));
    assert_none(&d, ReasonCode::PolicyRequiresChain);
    let d = lookup_while_held(&router, acme(), &req(&[1, 2, 3, 4]));
    assert_none(&d, ReasonCode::Timeout);
}

#[test]
fn step2_require_chain_with_a_valid_chain_reaches_the_index() {
    let router = exact_prefix_and_chain(require_chain());
    assert_prefix(
        &lookup(&router, &req(&[1, 2, 3, 4])),
        &[row("r2", 2.0, 64, 4)],
    );
}

#[test]
fn step2_require_chain_with_a_malformed_chain_is_policy_requires_chain() {
    let router = exact_prefix_and_chain(require_chain());
    for r in [
        req(&[1, 2, 3, 4]).tokens(&[16, 16]),
        req(&[]).tokens(&[16]),
        req(&[1, 2, 3, 4]).tokens(&[]).prefix("p-sys", 128),
    ] {
        assert_none(&lookup(&router, &r), ReasonCode::PolicyRequiresChain);
    }
}

#[test]
fn step3_empty_contract_keys_are_no_hint_even_with_affinity() {
    let router = mk_router(ResolvedPolicy::default());
    store(&router, "r1", &[1, 2]);
    register(&router, acme(), "r2", t0());
    // Control: a well-formed request gets an affinity pick (the floors drop the match).
    assert_eq!(
        lookup(&router, &req(&[1, 2])).reason,
        ReasonCode::AffinityHint
    );
    for r in [
        req(&[1, 2]).tenant(""),
        req(&[1, 2]).model(""),
        req(&[1, 2]).scheme(""),
        exact_prefix("p-sys", 64).scheme(""),
    ] {
        assert_none(&lookup(&router, &r), ReasonCode::NoHint);
    }
}

#[test]
fn step3_unequal_chain_arrays_are_no_hint_even_with_affinity() {
    let router = mk_router(ResolvedPolicy::default());
    store(&router, "r1", &[1, 2, 3]);
    register(&router, acme(), "r2", t0());
    // Each carries a usable seed (prefix_hash), so only malformedness stops affinity.
    for r in [
        req(&[1, 2, 3]).tokens(&[16, 16]).prefix("p-x", 64),
        req(&[]).tokens(&[16]).prefix("p-x", 64),
        req(&[1, 2, 3]).tokens(&[16, 16, 16, 16]),
    ] {
        assert_none(&lookup(&router, &r), ReasonCode::NoHint);
    }
}

fn tiny_gate(affinity: bool) -> ResolvedPolicy {
    let p = ResolvedPolicy {
        minimum_prefix_tokens: 100,
        ..open()
    };
    if affinity { p } else { no_affinity(p) }
}

#[test]
fn step4_tiny_request_with_affinity_disabled_is_no_hint_even_for_an_unknown_tenant() {
    let router = mk_router(tiny_gate(false));
    // Only walk-in is in the index: acme is unknown to it.
    store_at(&router, scope_of(WALK_IN, VLLM), "r1", &[1, 2], t0());
    assert_none(&lookup(&router, &req(&[1, 2])), ReasonCode::NoHint);
    // Above the gate the same request reaches classification.
    let big = req(&[1, 2]).tokens(&[64, 64]);
    assert_none(&lookup(&router, &big), ReasonCode::UnknownTenant);
}

#[test]
fn step4_tiny_request_with_affinity_disabled_never_touches_the_index() {
    let router = mk_router(budget(tiny_gate(false)));
    store(&router, "r1", &[1, 2]);
    register(&router, acme(), "r2", t0());
    assert_none(
        &lookup_while_held(&router, acme(), &req(&[1, 2])),
        ReasonCode::NoHint,
    );
    let big = req(&[1, 2]).tokens(&[64, 64]);
    assert_none(
        &lookup_while_held(&router, acme(), &big),
        ReasonCode::Timeout,
    );
}

#[test]
fn step4_tiny_request_with_affinity_enabled_downgrades_prefix_match_to_affinity_hint() {
    let router = mk_router(tiny_gate(true));
    store(&router, "r1", &[1, 2]);
    register(&router, acme(), "r2", t0());
    // 32 requested tokens < 100: the match on r1 is filtered, affinity answers.
    let tiny = lookup(&router, &req(&[1, 2]));
    assert_affinity(&tiny, &owner(2, &["r1", "r2"]));
    // 128 requested tokens: the match surfaces. d = 1/2 on both 64-token blocks.
    let big = lookup(&router, &req(&[1, 2]).tokens(&[64, 64]));
    assert_prefix(&big, &[row("r1", 4.0, 128, 2)]);
}

#[test]
fn step4_tiny_request_with_affinity_enabled_still_surfaces_diagnostics() {
    let router = mk_router(tiny_gate(true));
    store_at(&router, scope_of(WALK_IN, VLLM), "w1", &[1, 2], t0());
    assert_none(&lookup(&router, &req(&[1, 2])), ReasonCode::UnknownTenant);
    store(&router, "r1", &[1, 2]);
    let tiny = req(&[1, 2]);
    assert_none(
        &lookup(&router, &tiny.clone().model("mistral")),
        ReasonCode::UnknownModel,
    );
    assert_none(
        &lookup(&router, &tiny.scheme(SGLANG)),
        ReasonCode::UnknownHashScheme,
    );
}

#[test]
fn step4_gate_counts_requested_tokens_and_admits_the_gate_value() {
    let policy = no_affinity(ResolvedPolicy {
        minimum_prefix_tokens: 64,
        ..open()
    });
    let router = mk_router(policy);
    store(&router, "r1", &[1, 2, 3, 4]);
    store_exact_prefix(&router, "r1", "p-sys", 0);
    register(&router, acme(), "r2", t0());
    // Chain: the sum of block_token_counts; exactly at the gate passes.
    assert_prefix(
        &lookup(&router, &req(&[1, 2, 3, 4])),
        &[row("r1", 2.0, 64, 4)],
    );
    assert_none(
        &lookup(&router, &req(&[1, 2, 3, 4]).tokens(&[16, 16, 16, 15])),
        ReasonCode::NoHint,
    );
    // Exact prefix: prefix_token_count.
    assert_prefix(
        &lookup(&router, &exact_prefix("p-sys", 64)),
        &[row("r1", 2.0, 64, 1)],
    );
    assert_none(
        &lookup(&router, &exact_prefix("p-sys", 63)),
        ReasonCode::NoHint,
    );
}

#[test]
fn step4_gate_counts_prefix_tokens_when_chain_matching_is_off() {
    let policy = no_affinity(ResolvedPolicy {
        minimum_prefix_tokens: 64,
        strategy: gates(false, false, true),
        ..open()
    });
    let router = mk_router(policy);
    store_exact_prefix(&router, "r1", "p-sys", 128);
    register(&router, acme(), "r2", t0());
    // The dropped chain's 128 tokens do not count; the prefix's 10 do.
    let r = req(&[1, 2, 3, 4, 5, 6, 7, 8]).prefix("p-sys", 10);
    assert_none(&lookup(&router, &r), ReasonCode::NoHint);
    let r = req(&[1, 2, 3, 4, 5, 6, 7, 8]).prefix("p-sys", 64);
    assert_prefix(&lookup(&router, &r), &[row("r1", 4.0, 128, 1)]);
}

#[test]
fn step8_tiny_request_downgrades_tenant_hot_to_affinity_hint() {
    let router = mk_router(tiny_gate(true));
    store(&router, "r1", &[1, 2, 3]);
    store(&router, "r2", &[9]);
    // Nothing matches block 50: TENANT_HOT on r1 above the gate...
    let big = lookup(&router, &req(&[50]).tokens(&[128]));
    assert_tenant_hot(&big, "r1");
    // ...and AFFINITY_HINT below it.
    let tiny = lookup(&router, &req(&[50]));
    assert_affinity(&tiny, &owner(50, &["r1", "r2"]));
}

#[test]
fn step8_tiny_request_without_affinity_never_surfaces_tenant_hot() {
    let router = mk_router(tiny_gate(false));
    store(&router, "r1", &[1, 2, 3]);
    store(&router, "r2", &[9]);
    assert_none(&lookup(&router, &req(&[50])), ReasonCode::NoHint);
    assert_tenant_hot(&lookup(&router, &req(&[50]).tokens(&[128])), "r1");
}
