//! Step 10: in LFU namespaces a delivered PREFIX_MATCH, and nothing else, credits
//! one access to the matched entries of the first-ranked replica. Credits are
//! observed through the victim order of a cap sweep or a quota eviction.

use super::*;

/// How the probe pushes the tenant past a limit.
#[derive(Clone, Copy, Debug)]
enum Pressure {
    /// The index cap is 4 entries.
    Cap,
    /// acme's `maxIndexEntries` is 4.
    Quota,
}

/// r1 stores [10, 11] at t0, r2 stores [20, 21] a second later; `between` runs
/// lookups at `at(2)`; then r2 stores [30], one entry over the limit, and one entry
/// is evicted. Returns the prefix counts of (r1, r2) afterwards: (2, 2) when
/// [10, 11] were credited (21, the oldest uncredited, goes), (1, 3) when they were
/// not (11, the oldest, goes).
fn victims_after(
    policy: ResolvedPolicy,
    pressure: Pressure,
    between: impl FnOnce(&Router),
) -> (u64, u64) {
    let router = match pressure {
        Pressure::Cap => mk_router_with(policy, None, 4),
        Pressure::Quota => mk_router_with(policy, Some(4), u64::MAX),
    };
    store_at(&router, acme(), "r1", &[10, 11], t0());
    store_at(&router, acme(), "r2", &[20, 21], at(1));
    between(&router);
    store_at(&router, acme(), "r2", &[30], at(3));
    assert_eq!(router.index().tenant_entries(TENANT), 4);
    let view = router.view(at(3));
    let count = |id: &str| {
        view.replicas
            .iter()
            .find(|r| r.replica_id == id)
            .map_or(0, |r| r.prefix_count)
    };
    (count("r1"), count("r2"))
}

const CREDITED: (u64, u64) = (2, 2);
const UNCREDITED: (u64, u64) = (1, 3);

fn lookup_now(router: &Router, r: &Req) -> Decision {
    lookup_at(router, r, at(2))
}

#[test]
fn step10_lfu_credits_a_delivered_prefix_match() {
    for pressure in [Pressure::Cap, Pressure::Quota] {
        let counts = victims_after(lfu(open()), pressure, |router| {
            let d = lookup_now(router, &req(&[10, 11]));
            assert_prefix(&d, &[row("r1", 1.0, 32, 2)]);
        });
        assert_eq!(counts, CREDITED, "{pressure:?}");
    }
}

#[test]
fn step10_without_credits_lfu_evicts_the_oldest_last_seen() {
    for pressure in [Pressure::Cap, Pressure::Quota] {
        assert_eq!(
            victims_after(lfu(open()), pressure, |_| {}),
            UNCREDITED,
            "{pressure:?}"
        );
    }
}

#[test]
fn step10_lru_lookups_credit_nothing_and_never_refresh_last_seen() {
    for pressure in [Pressure::Cap, Pressure::Quota] {
        let counts = victims_after(open(), pressure, |router| {
            for _ in 0..3 {
                let d = lookup_now(router, &req(&[10, 11]));
                assert_eq!(d.reason, ReasonCode::PrefixMatch);
            }
        });
        assert_eq!(counts, UNCREDITED, "{pressure:?}");
    }
}

#[test]
fn step10_tenant_hot_credits_nothing() {
    let counts = victims_after(lfu(open()), Pressure::Cap, |router| {
        // Equal counts; r2 has the later event.
        assert_tenant_hot(&lookup_now(router, &req(&[99])), "r2");
        assert_tenant_hot(&lookup_now(router, &req(&[99, 10, 11])), "r2");
    });
    assert_eq!(counts, UNCREDITED);
}

#[test]
fn step10_a_tiny_downgraded_match_credits_nothing() {
    let tiny = lfu(ResolvedPolicy {
        minimum_prefix_tokens: 100,
        ..open()
    });
    let counts = victims_after(tiny, Pressure::Cap, |router| {
        let d = lookup_now(router, &req(&[10, 11]));
        assert_affinity(&d, &owner(11, &["r1", "r2"]));
    });
    assert_eq!(counts, UNCREDITED);
}

#[test]
fn step10_a_floor_downgraded_match_credits_nothing() {
    let strict = lfu(ResolvedPolicy {
        minimum_matched_tokens: 64,
        ..open()
    });
    let counts = victims_after(strict, Pressure::Quota, |router| {
        let d = lookup_now(router, &req(&[10, 11]));
        assert_eq!(d.reason, ReasonCode::AffinityHint);
    });
    assert_eq!(counts, UNCREDITED);
}

#[test]
fn step10_a_timed_out_lookup_credits_nothing() {
    let counts = victims_after(budget(lfu(open())), Pressure::Cap, |router| {
        let held = router.index().scope(acme()).expect("scope exists");
        let guards = held.hold_writes();
        let d = std::thread::scope(|s| {
            s.spawn(|| lookup_now(router, &req(&[10, 11])))
                .join()
                .expect("lookup thread")
        });
        drop(guards);
        assert_none(&d, ReasonCode::Timeout);
    });
    assert_eq!(counts, UNCREDITED);
}

#[test]
fn step10_lfu_credits_the_matched_run_of_a_longer_request() {
    // The request runs past what r1 holds: the two blocks it matched are credited.
    let counts = victims_after(lfu(open()), Pressure::Cap, |router| {
        let d = lookup_now(router, &req(&[10, 11, 12]));
        assert_prefix(&d, &[row("r1", 1.0, 32, 2)]);
    });
    assert_eq!(counts, CREDITED);
}

#[test]
fn with_a_maintenance_worker_the_cap_sweep_leaves_the_ingest_path() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};
    let router = mk_router_with(open(), None, 4);
    let wakes = Arc::new(AtomicU32::new(0));
    let seen = wakes.clone();
    assert!(router.on_over_cap(Box::new(move || {
        seen.fetch_add(1, Ordering::Relaxed);
    })));
    assert!(!router.on_over_cap(Box::new(|| {})), "set once");
    store_at(&router, acme(), "r1", &[10, 11, 12, 13], t0());
    assert_eq!(wakes.load(Ordering::Relaxed), 0, "at the cap, not over it");
    store_at(&router, acme(), "r1", &[20, 21], at(1));
    // The ingest only woke the worker: nothing was evicted on its thread.
    assert_eq!(wakes.load(Ordering::Relaxed), 1);
    assert_eq!(router.index().tenant_entries(TENANT), 6);
    router.sweep_cap();
    assert_eq!(router.index().tenant_entries(TENANT), 4);
    // LRU: the oldest two went (at equal time, the tail of the first chain).
    let d = lookup_at(&router, &req(&[10, 11, 12, 13]), at(2));
    assert_prefix(&d, &[row("r1", 0.0, 32, 2)]);
    let d = lookup_at(&router, &req(&[20, 21]), at(2));
    assert_prefix(&d, &[row("r1", 0.0, 32, 2)]);
    router.sweep_cap();
    assert_eq!(
        router.index().tenant_entries(TENANT),
        4,
        "nothing to do under the cap"
    );
}
