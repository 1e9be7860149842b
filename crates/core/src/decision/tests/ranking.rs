//! Step 7: the distinguishing-power ranker, both result-side floors and TENANT_HOT.

use super::*;

/// N = 4 serving: r1 holds [1, 2, 3, 4], r2 [1, 2], r3 [9], r4 nothing.
/// For the request [1, 2, 3, 4]: h = 2, 2, 1, 1, so d = 1/2, 1/2, 3/4, 3/4.
fn four_replicas(policy: ResolvedPolicy) -> Router {
    let router = mk_router(policy);
    store(&router, "r1", &[1, 2, 3, 4]);
    store(&router, "r2", &[1, 2]);
    store(&router, "r3", &[9]);
    register(&router, acme(), "r4", t0());
    router
}

#[test]
fn step7_score_sums_token_weighted_distinguishing_power() {
    let router = four_replicas(open());
    let d = lookup(&router, &req(&[1, 2, 3, 4]));
    // r1: 1/2 + 1/2 + 3/4 + 3/4; r2: 1/2 + 1/2. r3 and r4 matched nothing.
    assert_prefix(&d, &[row("r1", 2.5, 64, 4), row("r2", 1.0, 32, 2)]);
    let best = d.pick().expect("a pick");
    assert_eq!(best.endpoint, "r1.pods:8000");
}

#[test]
fn step7_partial_blocks_weigh_by_their_token_count() {
    let router = four_replicas(open());
    let d = lookup(&router, &req(&[1, 2, 3, 4]).tokens(&[16, 16, 16, 8]));
    // The last block weighs 8/16 × 3/4.
    assert_prefix(&d, &[row("r1", 2.125, 56, 4), row("r2", 1.0, 32, 2)]);
}

#[test]
fn step7_matched_tokens_use_the_request_token_counts() {
    let router = mk_router(open());
    let event = IndexEvent::Stored {
        parent: None,
        hashes: vec![1, 2],
        token_counts: vec![8, 8],
    };
    ingest(&router, acme(), "r1", &endpoint_of("r1"), &[event], t0());
    register(&router, acme(), "r2", t0());
    let d = lookup(&router, &req(&[1, 2]).tokens(&[32, 32]));
    assert_prefix(&d, &[row("r1", 2.0, 64, 2)]);
}

#[test]
fn step7_equal_scores_rank_by_replica_id() {
    let router = mk_router(open());
    // r2 first, so slot order differs from id order.
    store(&router, "r2", &[1, 2]);
    store(&router, "r1", &[1, 2]);
    register(&router, acme(), "r3", t0());
    register(&router, acme(), "r4", t0());
    let d = lookup(&router, &req(&[1, 2]));
    assert_prefix(&d, &[row("r1", 1.0, 32, 2), row("r2", 1.0, 32, 2)]);
}

#[test]
fn step7_only_replicas_with_a_matched_block_are_ranked_even_with_a_zero_floor() {
    let router = four_replicas(open());
    let d = lookup(&router, &req(&[1]));
    // r3 and r4 matched nothing and are not listed, though both floors are 0.
    assert_prefix(&d, &[row("r1", 0.5, 16, 1), row("r2", 0.5, 16, 1)]);
}

#[test]
fn step7_exact_prefix_counts_as_one_block_of_its_stored_tokens() {
    let router = mk_router(open());
    store_exact_prefix(&router, "r1", "p-sys", 128);
    store_exact_prefix(&router, "r1", "p-doc", 0);
    register(&router, acme(), "r2", t0());
    // The stored count wins over the request's.
    assert_prefix(
        &lookup(&router, &exact_prefix("p-sys", 40)),
        &[row("r1", 4.0, 128, 1)],
    );
    // Stored without a count: the request's prefix_token_count.
    assert_prefix(
        &lookup(&router, &exact_prefix("p-doc", 48)),
        &[row("r1", 1.5, 48, 1)],
    );
}

#[test]
fn step7_chain_path_wins_when_both_chain_and_prefix_are_given() {
    let router = mk_router(open());
    store(&router, "r1", &[1, 2, 3, 4]);
    store_exact_prefix(&router, "r2", "p-sys", 128);
    let d = lookup(&router, &req(&[1, 2, 3, 4]).prefix("p-sys", 128));
    assert_prefix(&d, &[row("r1", 2.0, 64, 4)]);
}

#[test]
fn floor_minimum_matched_tokens_0_keeps_a_one_block_match() {
    let router = mk_router(open());
    store(&router, "r1", &[1]);
    register(&router, acme(), "r2", t0());
    assert_prefix(&lookup(&router, &req(&[1])), &[row("r1", 0.5, 16, 1)]);
}

#[test]
fn floor_minimum_matched_tokens_64_drops_shorter_matches() {
    let policy = no_affinity(ResolvedPolicy {
        minimum_matched_tokens: 64,
        ..open()
    });
    let router = mk_router(policy);
    store(&router, "r1", &[1, 2, 3, 4]);
    store(&router, "r2", &[1, 2, 3]);
    register(&router, acme(), "r3", t0());
    register(&router, acme(), "r4", t0());
    // r2 (48 tokens, score 1.5) is filtered; r1 (64 tokens) survives.
    let d = lookup(&router, &req(&[1, 2, 3, 4]));
    assert_prefix(&d, &[row("r1", 2.25, 64, 4)]);
    // Nobody reaches 64: StrategyNone, and NO_HINT without affinity.
    assert_none(&lookup(&router, &req(&[1, 2, 3])), ReasonCode::NoHint);
}

#[test]
fn floor_minimum_matched_tokens_below_the_floor_lands_on_affinity_when_enabled() {
    let router = mk_router(ResolvedPolicy {
        minimum_matched_tokens: 64,
        ..open()
    });
    store(&router, "r1", &[1, 2, 3]);
    register(&router, acme(), "r2", t0());
    let d = lookup(&router, &req(&[1, 2, 3]));
    assert_affinity(&d, &owner(3, &["r1", "r2"]));
}

#[test]
fn floor_minimum_matched_tokens_omitted_is_64_for_a_tenant_without_policy() {
    let router = mk_router(open());
    let walk_in = scope_of(WALK_IN, VLLM);
    assert_eq!(
        router
            .snapshot()
            .tenant(WALK_IN)
            .policy
            .minimum_matched_tokens,
        64
    );
    store_at(&router, walk_in, "r1", &[1, 2, 3, 4], t0());
    register(&router, walk_in, "r2", t0());
    // 48 matched tokens < 64: downgraded, affinity (the default) answers.
    let d = lookup(&router, &req(&[1, 2, 3]).tenant(WALK_IN));
    assert_affinity(&d, &owner(3, &["r1", "r2"]));
    // 64 matched tokens, score 2.0 ≥ 0.1.
    let d = lookup(&router, &req(&[1, 2, 3, 4]).tenant(WALK_IN));
    assert_prefix(&d, &[row("r1", 2.0, 64, 4)]);
}

#[test]
fn floor_minimum_matched_tokens_omitted_on_a_policy_materialises_64() {
    // A CachePolicy that omits the field resolves to the CRD default.
    let router = mk_router(no_affinity(ResolvedPolicy {
        routing_floor_score: floor("0"),
        ..ResolvedPolicy::default()
    }));
    store(&router, "r1", &[1, 2, 3, 4]);
    register(&router, acme(), "r2", t0());
    assert_none(&lookup(&router, &req(&[1, 2, 3])), ReasonCode::NoHint);
    assert_prefix(
        &lookup(&router, &req(&[1, 2, 3, 4])),
        &[row("r1", 2.0, 64, 4)],
    );
}

/// r1 and r2 both hold [1..=5]: an overlap every serving replica holds (score 0).
fn shared_overlap(policy: ResolvedPolicy) -> Router {
    let router = mk_router(policy);
    store(&router, "r1", &[1, 2, 3, 4, 5]);
    store(&router, "r2", &[1, 2, 3, 4, 5]);
    router
}

#[test]
fn floor_routing_score_0_1_catches_an_overlap_every_replica_holds() {
    let floor_0_1 = ResolvedPolicy {
        minimum_matched_tokens: 0,
        ..ResolvedPolicy::default()
    };
    let r = req(&[1, 2, 3, 4, 5]);
    let router = shared_overlap(no_affinity(floor_0_1.clone()));
    assert_none(&lookup(&router, &r), ReasonCode::NoHint);
    let router = shared_overlap(floor_0_1);
    assert_affinity(&lookup(&router, &r), &owner(5, &["r1", "r2"]));
}

#[test]
fn floor_routing_score_0_lets_a_zero_score_overlap_through() {
    let router = shared_overlap(open());
    let d = lookup(&router, &req(&[1, 2, 3, 4, 5]));
    assert_prefix(&d, &[row("r1", 0.0, 80, 5), row("r2", 0.0, 80, 5)]);
}

#[test]
fn floor_routing_score_gates_only_the_best_survivor() {
    let at_0_6 = no_affinity(ResolvedPolicy {
        minimum_matched_tokens: 0,
        routing_floor_score: floor("0.6"),
        ..ResolvedPolicy::default()
    });
    let router = mk_router(at_0_6.clone());
    store(&router, "r1", &[1, 2, 3, 4]);
    store(&router, "r2", &[1]);
    register(&router, acme(), "r3", t0());
    register(&router, acme(), "r4", t0());
    // r1: 1/2 + 3 × 3/4 = 2.75; r2: 1/2 < 0.6 but stays listed.
    let d = lookup(&router, &req(&[1, 2, 3, 4]));
    assert_prefix(&d, &[row("r1", 2.75, 64, 4), row("r2", 0.5, 16, 1)]);
    // The best alone below the floor downgrades the whole response.
    assert_none(&lookup(&router, &req(&[1])), ReasonCode::NoHint);
}

#[test]
fn floors_downgrade_independently() {
    let policy = |tokens: u32, score: &str| {
        no_affinity(ResolvedPolicy {
            minimum_matched_tokens: tokens,
            routing_floor_score: floor(score),
            ..ResolvedPolicy::default()
        })
    };
    // A distinctive 32-token match (score 1.0) and a 128-token overlap all hold (score 0).
    let data = |router: &Router| {
        store(router, "r1", &[1, 2]);
        store(router, "r1", &[10, 11, 12, 13, 14, 15, 16, 17]);
        store(router, "r2", &[10, 11, 12, 13, 14, 15, 16, 17]);
    };
    let short = req(&[1, 2]);
    let shared = req(&[10, 11, 12, 13, 14, 15, 16, 17]);
    // Only the matched-tokens floor is on: it alone catches the short match.
    let router = mk_router(policy(64, "0"));
    data(&router);
    assert_none(&lookup(&router, &short), ReasonCode::NoHint);
    assert_eq!(lookup(&router, &shared).reason, ReasonCode::PrefixMatch);
    // Only the score floor is on: it alone catches the shared overlap.
    let router = mk_router(policy(0, "0.1"));
    data(&router);
    assert_prefix(&lookup(&router, &short), &[row("r1", 1.0, 32, 2)]);
    assert_none(&lookup(&router, &shared), ReasonCode::NoHint);
    // Both opted out: both surface.
    let router = mk_router(policy(0, "0"));
    data(&router);
    assert_eq!(lookup(&router, &short).reason, ReasonCode::PrefixMatch);
    assert_eq!(lookup(&router, &shared).reason, ReasonCode::PrefixMatch);
    // Both on (the defaults): both downgraded.
    let router = mk_router(policy(64, "0.1"));
    data(&router);
    assert_none(&lookup(&router, &short), ReasonCode::NoHint);
    assert_none(&lookup(&router, &shared), ReasonCode::NoHint);
}

#[test]
fn step7_tenant_hot_picks_the_serving_replica_holding_most_entries() {
    let router = mk_router(ResolvedPolicy::default());
    store(&router, "r1", &[1, 2, 3]);
    store(&router, "r2", &[7]);
    assert_tenant_hot(&lookup(&router, &req(&[50, 51])), "r1");
    assert_tenant_hot(&lookup(&router, &exact_prefix("p-none", 64)), "r1");
}

#[test]
fn step7_tenant_hot_ties_break_on_latest_event_then_replica_id() {
    let router = mk_router(ResolvedPolicy::default());
    store_at(&router, acme(), "r1", &[1, 2], t0());
    store_at(&router, acme(), "r2", &[7, 8], at(1));
    assert_tenant_hot(&lookup_at(&router, &req(&[50]), at(2)), "r2");
    // Same count, same last event: the smaller id.
    let router = mk_router(ResolvedPolicy::default());
    store(&router, "r2", &[7, 8]);
    store(&router, "r1", &[1, 2]);
    assert_tenant_hot(&lookup(&router, &req(&[50])), "r1");
}

#[test]
fn step7_tenant_hot_needs_a_seed() {
    let router = mk_router(ResolvedPolicy::default());
    store(&router, "r1", &[1, 2, 3]);
    // Neither chain nor prefix_hash: no TENANT_HOT, and no affinity seed either.
    assert_none(&lookup(&router, &req(&[])), ReasonCode::NoHint);
}

#[test]
fn step7_tenant_hot_needs_a_replica_holding_an_entry() {
    let router = mk_router(ResolvedPolicy::default());
    register(&router, acme(), "r1", t0());
    register(&router, acme(), "r2", t0());
    assert_affinity(&lookup(&router, &req(&[50])), &owner(50, &["r1", "r2"]));
    let router = mk_router(no_affinity(ResolvedPolicy::default()));
    register(&router, acme(), "r1", t0());
    assert_none(&lookup(&router, &req(&[50])), ReasonCode::NoHint);
}

#[test]
fn step7_tenant_hot_ignores_prefix_only_replicas() {
    let router = mk_router(ResolvedPolicy::default());
    store_prefix_only(&router, acme(), "p1", &[1, 2, 3, 4, 5]);
    store(&router, "r1", &[7]);
    register(&router, acme(), "r2", t0());
    assert_tenant_hot(&lookup(&router, &req(&[50])), "r1");
}

#[test]
fn enable_tenant_hot_false_turns_tenant_hot_into_affinity_or_no_hint() {
    let cold = ResolvedPolicy {
        strategy: gates(false, true, false),
        ..open()
    };
    let router = mk_router(cold.clone());
    store(&router, "r1", &[1, 2, 3]);
    store(&router, "r2", &[7]);
    assert_affinity(&lookup(&router, &req(&[50])), &owner(50, &["r1", "r2"]));
    // Prefix matches still surface (N = 2, d = 1/2 on three blocks).
    assert_prefix(&lookup(&router, &req(&[1, 2, 3])), &[row("r1", 1.5, 48, 3)]);
    let router = mk_router(no_affinity(cold));
    store(&router, "r1", &[1, 2, 3]);
    store(&router, "r2", &[7]);
    assert_none(&lookup(&router, &req(&[50])), ReasonCode::NoHint);
    // Diagnostics still behave normally.
    assert_none(
        &lookup(&router, &req(&[50]).model("mistral")),
        ReasonCode::UnknownModel,
    );
}

#[test]
fn step7_tenant_hot_ignores_entries_past_eviction_ttl() {
    let router = mk_router(ResolvedPolicy::default());
    store(&router, "r1", &[1, 2, 3]);
    // Both stay registered, but r1's entries age past the 10m evictionTTL.
    register(&router, acme(), "r1", at(650));
    register(&router, acme(), "r2", at(650));
    assert_tenant_hot(&lookup_at(&router, &req(&[50]), at(599)), "r1");
    // Before any sweep, the expired entries are absent for lookups: no TENANT_HOT.
    let d = lookup_at(&router, &req(&[50]), at(660));
    assert_affinity(&d, &owner(50, &["r1", "r2"]));
}

#[test]
fn step7_equal_scores_sort_by_replica_id_on_both_paths() {
    let router = mk_router(open());
    // Registered in reverse id order, so slot order disagrees with id order.
    for r in ["r4", "r3", "r2", "r1"] {
        register(&router, acme(), r, t0());
    }
    store(&router, "r3", &[1, 2]);
    store(&router, "r2", &[1, 2]);
    store_exact_prefix(&router, "r4", "p", 32);
    store_exact_prefix(&router, "r1", "p", 32);
    // Chain path: r2 and r3 tie (h = 2 of 4: d = 1/2 per block).
    let d = lookup(&router, &req(&[1, 2]));
    assert_prefix(&d, &[row("r2", 1.0, 32, 2), row("r3", 1.0, 32, 2)]);
    // Exact-prefix path: r1 and r4 tie on one block of 32 tokens (d = 1/2).
    let d = lookup(&router, &exact_prefix("p", 32));
    assert_prefix(&d, &[row("r1", 1.0, 32, 1), row("r4", 1.0, 32, 1)]);
}

#[test]
fn a_fleet_wider_than_one_word_of_slots_ranks_every_replica() {
    // 100 replicas (two 64-bit words of slots, more than 32 members): replica i
    // holds the first i % 7 blocks of the chain, registered out of id order.
    let router = mk_router(open());
    let ids: Vec<String> = (0..100).map(|i| format!("w{i:03}")).collect();
    for i in (0..100).rev() {
        let held: Vec<u64> = (1..=(i % 7) as u64).collect();
        if held.is_empty() {
            register(&router, acme(), &ids[i], t0());
        } else {
            store(&router, &ids[i], &held);
        }
    }
    let chain: Vec<u64> = (1..=8).collect();
    let d = lookup(&router, &req(&chain));
    let got = rows(&d);
    // The model: longest run first, ids ascending among equals; the replicas
    // holding nothing are not ranked.
    let mut want: Vec<(String, u32)> = (0..100)
        .filter(|i| i % 7 > 0)
        .map(|i| (ids[i].clone(), (i % 7) as u32))
        .collect();
    want.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    let got_runs: Vec<(String, u32)> = got.iter().map(|r| (r.0.clone(), r.3)).collect();
    assert_eq!(got_runs, want);
    assert_eq!(got[0].2, 6 * 16);
}

/// One replica's event over blocks 1..=12 of the request chain.
#[derive(Clone, Debug)]
enum Op {
    /// Stores blocks from..to (a run continuing block from − 1 when from > 1).
    Store(usize, u64, u64),
    /// Removes the listed blocks.
    Remove(usize, Vec<u64>),
}

impl Op {
    /// Applies the op to the model (per replica, block → references) and
    /// returns the replica and the event that tells the index the same.
    fn apply(&self, held: &mut [std::collections::HashMap<u64, u32>; 5]) -> (usize, IndexEvent) {
        match self {
            Op::Store(r, from, to) => {
                let hashes: Vec<u64> = (*from..=*to).collect();
                for h in &hashes {
                    *held[*r].entry(*h).or_default() += 1;
                }
                let parent = (*from > 1).then(|| from - 1);
                (
                    *r,
                    IndexEvent::Stored {
                        parent,
                        hashes,
                        token_counts: Vec::new(),
                    },
                )
            }
            Op::Remove(r, hashes) => {
                for h in hashes {
                    if let Some(n) = held[*r].get_mut(h) {
                        *n -= 1;
                        if *n == 0 {
                            held[*r].remove(h);
                        }
                    }
                }
                (
                    *r,
                    IndexEvent::Removed {
                        hashes: hashes.clone(),
                    },
                )
            }
        }
    }
}

fn op() -> impl proptest::strategy::Strategy<Value = Op> {
    use proptest::prelude::*;
    prop_oneof![
        3 => (0..5usize, 1u64..=12, 0u64..6).prop_map(|(r, from, len)| Op::Store(r, from, (from + len).min(12))),
        1 => (0..5usize, proptest::collection::vec(1u64..=12, 1..4)).prop_map(|(r, h)| Op::Remove(r, h)),
    ]
}

proptest::proptest! {
    /// Whatever runs, parents and removals the replicas' events leave, every
    /// replica's matched blocks are the longest leading run of the chain it holds
    /// (a naive per-replica model), so the walk's shortcuts (run continuation, a
    /// block with its predecessor's holders) never change an answer.
    #[test]
    fn matched_blocks_are_each_replicas_longest_leading_run(
        ops in proptest::collection::vec(op(), 1..40),
    ) {
        const IDS: [&str; 5] = ["p0", "p1", "p2", "p3", "p4"];
        let router = mk_router(open());
        let mut held: [std::collections::HashMap<u64, u32>; 5] = Default::default();
        for id in IDS {
            register(&router, acme(), id, t0());
        }
        for op in &ops {
            let (r, event) = op.apply(&mut held);
            let id = IDS[r];
            router
                .ingest(&IngestBatch { scope: acme(), replica_id: id, endpoint: &endpoint_of(id), events: &[event] }, t0())
                .expect("well-formed batch");
        }
        let chain: Vec<u64> = (1..=12).collect();
        let d = lookup(&router, &req(&chain));
        // (No match at all answers by affinity or TENANT_HOT: rows of 0 blocks.)
        let got: std::collections::HashMap<String, u32> =
            rows(&d).into_iter().filter(|r| r.3 > 0).map(|r| (r.0, r.3)).collect();
        for (r, id) in IDS.iter().enumerate() {
            let run = chain.iter().take_while(|h| held[r].contains_key(h)).count() as u32;
            let want = (run > 0).then_some(run);
            proptest::prop_assert_eq!(got.get(*id).copied(), want, "replica {}", id);
        }
    }
}

proptest::proptest! {
    /// The same with time: event k comes at k × 30 s and the lookup up to 20
    /// minutes after the last, so some blocks of a run have aged past evictionTTL
    /// (10 minutes) and others were refreshed by a later event: a replica's
    /// matched blocks are its longest leading run of fresh blocks (the walk
    /// passes over blocks with their predecessor's holders only while fresh).
    #[test]
    fn matched_blocks_stop_at_the_first_expired_block(
        ops in proptest::collection::vec(op(), 1..40),
        later in 0u64..1200,
    ) {
        const IDS: [&str; 5] = ["p0", "p1", "p2", "p3", "p4"];
        let router = mk_router(open());
        let mut held: [std::collections::HashMap<u64, u32>; 5] = Default::default();
        // When each block was last stored (while some replica holds it), in s.
        let mut stored_at: std::collections::HashMap<u64, u64> = Default::default();
        for id in IDS {
            register(&router, acme(), id, t0());
        }
        for (k, op) in ops.iter().enumerate() {
            let secs = k as u64 * 30;
            let (r, event) = op.apply(&mut held);
            match op {
                Op::Store(_, from, to) => {
                    for h in *from..=*to {
                        stored_at.insert(h, secs);
                    }
                }
                Op::Remove(_, hashes) => {
                    for h in hashes {
                        if held.iter().all(|m| !m.contains_key(h)) {
                            stored_at.remove(h);
                        }
                    }
                }
            }
            let id = IDS[r];
            router
                .ingest(&IngestBatch { scope: acme(), replica_id: id, endpoint: &endpoint_of(id), events: &[event] }, at(secs))
                .expect("well-formed batch");
        }
        // Half a second past a whole second: no stamp (event time plus a few ns)
        // sits on the TTL boundary.
        let secs = ops.len() as u64 * 30 + later;
        let now = at(secs).plus(Duration::from_millis(500));
        for id in IDS {
            register(&router, acme(), id, now);
        }
        let chain: Vec<u64> = (1..=12).collect();
        let d = lookup_at(&router, &req(&chain), now);
        let got: std::collections::HashMap<String, u32> =
            rows(&d).into_iter().filter(|r| r.3 > 0).map(|r| (r.0, r.3)).collect();
        let fresh = |h: &u64| stored_at.get(h).is_some_and(|&s| secs - s < 600);
        for (r, id) in IDS.iter().enumerate() {
            let run = chain
                .iter()
                .take_while(|h| held[r].contains_key(h) && fresh(h))
                .count() as u32;
            let want = (run > 0).then_some(run);
            proptest::prop_assert_eq!(got.get(*id).copied(), want, "replica {}", id);
        }
    }
}

/// A run whose blocks share one holder but not one stamp: p1 stored and dropped
/// blocks 1–2 again later, which refreshed them and left p0 their only holder.
/// When the rest of the run has aged out, p0's match ends at block 2.
#[test]
fn a_run_with_one_holder_ends_where_its_blocks_age_out() {
    let router = mk_router(open());
    store_at(&router, acme(), "p0", &[1, 2, 3, 4, 5, 6], t0());
    store_at(&router, acme(), "p1", &[1, 2], at(30));
    ingest(
        &router,
        acme(),
        "p1",
        &endpoint_of("p1"),
        &[IndexEvent::Removed { hashes: vec![1, 2] }],
        at(60),
    );
    let now = at(615);
    register(&router, acme(), "p0", now);
    register(&router, acme(), "p1", now);
    let d = lookup_at(&router, &req(&[1, 2, 3, 4, 5, 6]), now);
    let matched: Vec<(String, u32)> = rows(&d).into_iter().map(|r| (r.0, r.3)).collect();
    assert_eq!(matched, [("p0".to_string(), 2)]);
    // Before block 3 ages out, the whole run.
    let d = lookup_at(&router, &req(&[1, 2, 3, 4, 5, 6]), at(590));
    assert_eq!(rows(&d)[0].3, 6);
}
