//! Burst siblings (`index/pending.rs`): a chain routed on the ext_proc path counts
//! for its replica until the engine confirms it or a few seconds pass, so prompts
//! sharing its prefix that arrive during its first prefill land together.

use super::*;
use crate::index::PENDING_TTL_NANOS;
use crate::policy::LoadAwareness;
use std::sync::Arc;

const FLEET: [&str; 4] = ["r1", "r2", "r3", "r4"];
const FIRST: [u64; 8] = [1, 2, 3, 4, 5, 6, 7, 8];
/// Shares FIRST's six leading blocks (96 tokens), then differs.
const SIBLING: [u64; 8] = [1, 2, 3, 4, 5, 6, 90, 91];

/// `policy` with burst siblings on (`loadBalancing.pendingTTL` 5 s).
fn siblings(policy: ResolvedPolicy) -> ResolvedPolicy {
    let mut p = policy;
    p.load_balancing.pending_ttl = Duration::from_nanos(PENDING_TTL_NANOS);
    p
}

fn fleet(policy: ResolvedPolicy) -> Router {
    let router = mk_router(siblings(policy));
    for id in FLEET {
        register(&router, acme(), id, t0());
    }
    router
}

/// Routes FIRST as ext_proc does (decide, then admit); returns the pick and the
/// request's in-flight guard (its response has not started).
fn route_first(router: &Router, now: Timestamp) -> (String, Option<Inflight>) {
    let r = req(&FIRST);
    let d = lookup_at(router, &r, now);
    let pick = picked(&d).expect("a pick");
    (pick, router.admit(&d, &r.as_lookup(), now))
}

#[test]
fn a_sibling_arriving_during_the_first_prefill_lands_with_it() {
    let router = fleet(ResolvedPolicy::default());
    let (first, _inflight) = route_first(&router, t0());
    let d = lookup(&router, &req(&SIBLING));
    assert_eq!(d.reason, ReasonCode::PrefixMatch, "rows {:?}", rows(&d));
    assert_eq!(picked(&d), Some(first));
    assert_eq!(d.pick().map(|p| p.matched_tokens), Some(96));
}

#[test]
fn pending_entries_are_not_entries() {
    let router = fleet(ResolvedPolicy::default());
    let _routed = route_first(&router, t0());
    let view = router.view(t0());
    assert_eq!(view.total_entries, 0);
    assert!(view.replicas.iter().all(|r| r.prefix_count == 0));
    assert_eq!(router.index().tenant_entries(TENANT), 0);
}

#[test]
fn pending_entries_expire() {
    let router = fleet(ResolvedPolicy::default());
    let (first, _inflight) = route_first(&router, t0());
    let later = t0().plus(Duration::from_nanos(PENDING_TTL_NANOS + 1));
    let d = lookup_at(&router, &req(&SIBLING), later);
    assert_eq!(d.reason, ReasonCode::AffinityHint);
    assert_eq!(picked(&d), Some(owner(91, &FLEET)));
    assert!(FLEET.contains(&first.as_str()));
}

#[test]
fn the_engines_events_take_over_and_a_clear_drops_them() {
    let router = fleet(ResolvedPolicy::default());
    let (first, _inflight) = route_first(&router, t0());
    // The engine stores the blocks: real entries now, nothing pending.
    store(&router, &first, &FIRST);
    let d = lookup(&router, &req(&SIBLING));
    assert_eq!(picked(&d).as_deref(), Some(first.as_str()));
    assert_eq!(
        router.index().scope(acme()).map(|s| s.pending.len()),
        Some(0)
    );
    // A fresh routed chain, then the replica clears its cache: nothing survives.
    let other: Vec<u64> = (200..208).collect();
    let r = req(&other);
    let d = lookup(&router, &r);
    let to = picked(&d).expect("pick");
    let _inflight2 = router.admit(&d, &r.as_lookup(), t0());
    clear(&router, &to);
    let sibling: Vec<u64> = (200..206).chain([300, 301]).collect();
    let d = lookup(&router, &req(&sibling));
    assert_eq!(d.reason, ReasonCode::AffinityHint, "rows {:?}", rows(&d));
}

#[test]
fn pending_never_outweighs_a_replica_that_really_holds_more() {
    let router = fleet(ResolvedPolicy::default());
    let (first, _inflight) = route_first(&router, t0());
    let other = FLEET
        .iter()
        .copied()
        .find(|id| *id != first)
        .expect("4 replicas");
    store(&router, other, &FIRST[..6]);
    let d = lookup(&router, &req(&SIBLING));
    assert_eq!(picked(&d).as_deref(), Some(other), "rows {:?}", rows(&d));
}

#[test]
fn off_by_default() {
    let router = mk_router(ResolvedPolicy::default());
    for id in FLEET {
        register(&router, acme(), id, t0());
    }
    let (_, _inflight) = route_first(&router, t0());
    let d = lookup(&router, &req(&SIBLING));
    assert_eq!(d.reason, ReasonCode::AffinityHint);
}

#[test]
fn a_lookup_alone_records_nothing() {
    let router = fleet(ResolvedPolicy::default());
    // gRPC LookupRoute: a query, never admitted.
    let _ = lookup(&router, &req(&FIRST));
    let d = lookup(&router, &req(&SIBLING));
    assert_eq!(d.reason, ReasonCode::AffinityHint);
}

#[test]
fn with_the_load_rule_off_nothing_is_pending() {
    let router = fleet(ResolvedPolicy {
        load_awareness: LoadAwareness::Disabled,
        ..ResolvedPolicy::default()
    });
    let r = req(&FIRST);
    let d = lookup(&router, &r);
    assert!(router.admit(&d, &r.as_lookup(), t0()).is_none());
    let d = lookup(&router, &req(&SIBLING));
    assert_eq!(d.reason, ReasonCode::AffinityHint);
}

#[test]
fn a_sibling_rides_on_the_first_prefill_instead_of_prefilling_it_again() {
    let router = fleet(ResolvedPolicy::default());
    // FIRST at 1,000 tokens a block: 8,000 uncached tokens queued on its replica.
    let first = req(&FIRST).tokens(&[1000; 8]);
    let d = lookup(&router, &first);
    let to = picked(&d).expect("a pick");
    let _inflight = router.admit(&d, &first.as_lookup(), t0());
    // The sibling matches six of those blocks there (pending). Counted as extra
    // work it would cost 8,000 + 2,000 there against 8,000 anywhere else and
    // spill; the 6,000 it shares are the prefill it waits for anyway.
    let d = lookup(&router, &req(&SIBLING).tokens(&[1000; 8]));
    assert_eq!(d.reason, ReasonCode::PrefixMatch, "rows {:?}", rows(&d));
    assert_eq!(picked(&d).as_deref(), Some(to.as_str()));
    assert_eq!(d.spilled_from(), None);
}

/// Facts one router publishes, as a fleet transport would carry them.
#[derive(Debug, Default)]
struct Outbox(parking_lot::Mutex<Vec<crate::load::peer_ledger::Fact>>);

impl crate::load::RouteFacts for Outbox {
    fn publish(&self, fact: crate::load::peer_ledger::Fact) {
        self.0.lock().push(fact);
    }
}

/// Routes FIRST on sidecar "a" of a fleet; returns its pick and what it
/// published.
fn route_on_a(policy: ResolvedPolicy) -> (String, Vec<crate::load::peer_ledger::Fact>) {
    let a = fleet(policy);
    let outbox = Arc::new(Outbox::default());
    assert!(a.join_fleet("a", outbox.clone()));
    let (pick, inflight) = route_first(&a, t0());
    drop(inflight);
    let facts = outbox.0.lock().clone();
    (pick, facts)
}

fn hear(b: &Router, facts: Vec<crate::load::peer_ledger::Fact>) {
    for (seq, fact) in facts.into_iter().enumerate() {
        let msg = crate::load::peer_ledger::Message {
            peer: "a".into(),
            epoch: 1,
            seq: seq as u64 + 1,
            fact,
        };
        assert!(b.apply_peer(msg, t0()).is_some());
    }
}

#[test]
fn a_peers_route_makes_its_chain_pending_here_too() {
    let (first, facts) = route_on_a(ResolvedPolicy::default());
    let routed_chain = facts.iter().find_map(|f| match f {
        crate::load::peer_ledger::Fact::Routed { pending, .. } => Some(pending.clone()),
        _ => None,
    });
    assert_eq!(routed_chain.as_deref(), Some(&FIRST[..]));
    let b = fleet(ResolvedPolicy::default());
    assert!(b.join_fleet("b", Arc::new(Outbox::default())));
    hear(&b, facts);
    // Sidecar b never routed FIRST, yet its sibling lands where a sent it.
    let d = lookup(&b, &req(&SIBLING));
    assert_eq!(d.reason, ReasonCode::PrefixMatch, "rows {:?}", rows(&d));
    assert_eq!(picked(&d), Some(first));
    assert_eq!(b.view(t0()).total_entries, 0, "pending, not entries");
}

#[test]
fn without_pending_entries_nothing_is_shared_or_recorded() {
    // Sidecar a keeps no pending entries: its routed fact carries no chain.
    let mut off = ResolvedPolicy::default();
    off.load_balancing.pending_ttl = Duration::ZERO;
    let a = mk_router(off.clone());
    for id in FLEET {
        register(&a, acme(), id, t0());
    }
    let outbox = Arc::new(Outbox::default());
    assert!(a.join_fleet("a", outbox.clone()));
    let (_, _inflight) = route_first(&a, t0());
    assert!(outbox.0.lock().iter().all(|f| !matches!(
        f,
        crate::load::peer_ledger::Fact::Routed { pending, .. } if !pending.is_empty()
    )));
    // Sidecar b keeps none either: a peer's chain is not recorded there.
    let (_, facts) = route_on_a(ResolvedPolicy::default());
    let b = mk_router(off);
    for id in FLEET {
        register(&b, acme(), id, t0());
    }
    assert!(b.join_fleet("b", Arc::new(Outbox::default())));
    hear(&b, facts);
    assert_eq!(b.index().scope(acme()).map(|s| s.pending.len()), Some(0));
}
