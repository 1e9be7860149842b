//! Memory tiers: blocks a replica holds in a slower tier (CPU, disk) count with
//! the policy's tier weight; GPU decisions are those of a scope without tiers.

use super::*;
use crate::index::Tier;
use crate::policy::TierWeights;

fn tier_stored(tier: Tier, chain: &[u64]) -> IndexEvent {
    IndexEvent::TierStored {
        tier,
        hashes: chain.to_vec(),
    }
}

fn events(router: &Router, replica: &str, events: &[IndexEvent]) {
    ingest(router, acme(), replica, &endpoint_of(replica), events, t0());
}

fn weights(cpu: f64, disk: f64) -> ResolvedPolicy {
    no_affinity(ResolvedPolicy {
        tier_weights: TierWeights { cpu, disk },
        ..open()
    })
}

#[track_caller]
fn assert_rows_close(d: &Decision, expected: &[Row]) {
    let got = rows(d);
    assert_eq!(got.len(), expected.len(), "{got:?}");
    for (g, e) in got.iter().zip(expected) {
        assert_eq!((&g.0, g.2, g.3), (&e.0, e.2, e.3), "{got:?}");
        assert!((g.1 - e.1).abs() < 1e-9, "{got:?} vs {expected:?}");
    }
}

#[test]
fn a_cpu_only_match_ranks_below_an_equal_gpu_match_and_above_no_match() {
    let router = mk_router(weights(0.8, 0.25));
    store(&router, "r1", &[1, 2, 3, 4]);
    events(&router, "r2", &[tier_stored(Tier::Cpu, &[1, 2, 3, 4])]);
    register(&router, acme(), "r3", t0());
    // Two of three hold each block: d = 1/3 per 16-token block.
    let d = lookup(&router, &req(&[1, 2, 3, 4]));
    assert_eq!(d.strategy, Strategy::PrefixMatch);
    assert_rows_close(
        &d,
        &[
            row("r1", 4.0 / 3.0, 64, 4),
            row("r2", 0.8 * 4.0 / 3.0, 64, 4),
        ],
    );
}

#[test]
fn a_run_continues_through_lower_tiers_at_their_weight() {
    let router = mk_router(weights(0.8, 0.25));
    // r1: blocks 1, 2 on GPU, 3 on CPU, 4 on disk; r2 holds nothing.
    store(&router, "r1", &[1, 2]);
    events(
        &router,
        "r1",
        &[tier_stored(Tier::Cpu, &[3]), tier_stored(Tier::Disk, &[4])],
    );
    register(&router, acme(), "r2", t0());
    // d = 1/2 per block; weights 1, 1, 0.8, 0.25.
    let d = lookup(&router, &req(&[1, 2, 3, 4]));
    assert_rows_close(&d, &[row("r1", 0.5 * (1.0 + 1.0 + 0.8 + 0.25), 64, 4)]);
    // A block on GPU and on CPU counts as GPU.
    events(&router, "r1", &[stored(&[3])]);
    let d = lookup(&router, &req(&[1, 2, 3, 4]));
    assert_rows_close(&d, &[row("r1", 0.5 * (3.0 + 0.25), 64, 4)]);
}

#[test]
fn weight_zero_disables_a_tier() {
    let router = mk_router(weights(0.0, 0.0));
    store(&router, "r1", &[1, 2]);
    events(&router, "r1", &[tier_stored(Tier::Cpu, &[3, 4])]);
    events(&router, "r2", &[tier_stored(Tier::Cpu, &[1, 2, 3, 4])]);
    register(&router, acme(), "r3", t0());
    // As if the CPU blocks were not there: r1 matches its two GPU blocks only.
    let d = lookup(&router, &req(&[1, 2, 3, 4]));
    assert_rows_close(&d, &[row("r1", 2.0 * (2.0 / 3.0), 32, 2)]);
    // CPU counts, disk does not: a disk block ends the run.
    let router = mk_router(weights(0.8, 0.0));
    store(&router, "r1", &[1]);
    events(&router, "r1", &[tier_stored(Tier::Disk, &[2])]);
    register(&router, acme(), "r2", t0());
    assert_rows_close(&lookup(&router, &req(&[1, 2])), &[row("r1", 0.5, 16, 1)]);
}

#[test]
fn gpu_decisions_are_unchanged_once_the_scope_has_lower_tiers() {
    let router = mk_router(weights(0.8, 0.25));
    store(&router, "r1", &[1, 2, 3, 4]);
    store(&router, "r2", &[1, 2]);
    register(&router, acme(), "r3", t0());
    let before = rows(&lookup(&router, &req(&[1, 2, 3, 4, 5])));
    // Another chain's CPU block switches the scope to the tiered walk.
    events(&router, "r3", &[tier_stored(Tier::Cpu, &[99])]);
    assert!(router.index().scope(acme()).unwrap().has_lower_tiers());
    let after = rows(&lookup(&router, &req(&[1, 2, 3, 4, 5])));
    assert_eq!(before, after);
}

#[test]
fn an_offload_moves_the_block_and_clears_drop_every_tier() {
    let router = mk_router(weights(0.8, 0.25));
    store(&router, "r1", &[1, 2, 3, 4]);
    register(&router, acme(), "r2", t0());
    // vLLM's offload: BlockRemoved on GPU, then BlockStored on CPU.
    events(
        &router,
        "r1",
        &[
            IndexEvent::Removed { hashes: vec![3, 4] },
            tier_stored(Tier::Cpu, &[3, 4]),
        ],
    );
    let d = lookup(&router, &req(&[1, 2, 3, 4]));
    assert_rows_close(&d, &[row("r1", 0.5 * (2.0 + 1.6), 64, 4)]);
    // prefixCount stays the GPU pool's.
    let view = router.view(t0());
    let r1 = view.replicas.iter().find(|r| r.replica_id == "r1").unwrap();
    assert_eq!(r1.prefix_count, 2);
    // Evicted from CPU too: the run ends at block 2.
    events(
        &router,
        "r1",
        &[IndexEvent::TierRemoved {
            tier: Tier::Cpu,
            hashes: vec![4],
        }],
    );
    assert_rows_close(
        &lookup(&router, &req(&[1, 2, 3, 4])),
        &[row("r1", 0.5 * 2.8, 48, 3)],
    );
    // AllBlocksCleared drops the replica's blocks in every tier.
    events(&router, "r1", &[IndexEvent::Cleared]);
    assert_eq!(router.index().total_entries(), 0);
}
