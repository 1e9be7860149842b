//! Block identity: under `ic-content-v2` a request without a LoRA
//! adapter or cache salt never matches blocks stored with them, and the other way
//! round; the router keys the client's chain with the request's identity.

use super::*;
use crate::chain::{self, BlockIdentity, IC_CONTENT_V2, Scheme};

const V2: &str = IC_CONTENT_V2;

fn tokens() -> Vec<u32> {
    (0..64).collect()
}

/// What an engine's events for `tokens` under this identity become in the index.
fn stored_as(lora: &str, salt: &str) -> Vec<u64> {
    chain::own_chain(
        Scheme::ContentV2,
        16,
        &tokens(),
        &BlockIdentity {
            lora,
            salt,
            mm: &[],
        },
    )
    .expect("v2 chain")
}

/// What a client sends for `tokens`: the content chain, identity beside it.
fn client() -> Req {
    let chain = chain::compute_chain(Scheme::ContentV2, &tokens(), 16, None).expect("chain");
    req(&chain).scheme(V2)
}

/// Chain matching only: no TENANT_HOT or affinity answer hides a miss.
fn chain_only() -> Router {
    mk_router(no_affinity(ResolvedPolicy {
        strategy: gates(false, true, false),
        ..open()
    }))
}

/// A PREFIX_MATCH of all 64 tokens on `holder`.
fn assert_holder(d: &Decision, holder: &str) {
    assert_eq!(d.reason, ReasonCode::PrefixMatch, "rows: {:?}", rows(d));
    assert_eq!(picked(d).as_deref(), Some(holder));
    let best = d.scores().next().expect("a scored replica");
    assert_eq!((best.matched_tokens, rows(d).len()), (64, 1));
}

fn fleet() -> Router {
    let router = chain_only();
    let v2 = scope_of(TENANT, V2);
    store_at(&router, v2, "r1", &stored_as("", ""), t0());
    store_at(&router, v2, "r2", &stored_as("sql", ""), t0());
    store_at(&router, v2, "r3", &stored_as("", "tenant-7"), t0());
    store_at(&router, v2, "r4", &stored_as("sql", "tenant-7"), t0());
    router
}

#[test]
fn each_identity_matches_only_blocks_stored_under_it() {
    let router = fleet();
    for (lora, salt, holder) in [
        ("", "", "r1"),
        ("sql", "", "r2"),
        ("", "tenant-7", "r3"),
        ("sql", "tenant-7", "r4"),
    ] {
        assert_holder(&lookup(&router, &client().identity(lora, salt)), holder);
    }
}

#[test]
fn an_identity_nobody_stored_matches_nothing() {
    let router = fleet();
    for (lora, salt) in [("other", ""), ("", "other"), ("sql", "other")] {
        assert_none(
            &lookup(&router, &client().identity(lora, salt)),
            ReasonCode::NoHint,
        );
    }
}

#[test]
fn keys_sent_as_a_chain_are_a_chain_and_keyed_again_with_an_identity() {
    // Keys already carrying an identity, sent as a chain with that identity again,
    // are keyed twice: they match nothing. Without the identity they are just a
    // chain, and a chain that equals r2's keys is r2's (the client then *is*
    // claiming that identity; the header is the documented way).
    let router = fleet();
    let keyed = req(&stored_as("sql", "")).scheme(V2);
    assert_none(
        &lookup(&router, &keyed.clone().identity("sql", "")),
        ReasonCode::NoHint,
    );
    assert_holder(&lookup(&router, &keyed), "r2");
}

#[test]
fn other_schemes_look_the_chain_up_as_sent() {
    // The engine's own hash carries the identity there (vLLM); the router cannot
    // see it in a client chain, so the fields do not change the lookup.
    let router = chain_only();
    store(&router, "r1", &[1, 2, 3, 4]);
    register(&router, acme(), "r2", t0());
    assert_holder(
        &lookup(&router, &req(&[1, 2, 3, 4]).identity("sql", "s")),
        "r1",
    );
}
