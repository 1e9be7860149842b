//! Fleet sync: the routes another sidecar publishes count in this one's load
//! rule as its own would, and leave it when the peer releases them, leaves, or
//! falls silent.

use std::sync::Arc;

use parking_lot::Mutex;

use super::*;
use crate::load::RouteFacts;
use crate::load::peer_ledger::{Fact, HEARTBEAT_TIMEOUT, Message, Outcome};

/// What a router published, in order.
#[derive(Debug, Default)]
struct Outbox(Mutex<Vec<Fact>>);

impl RouteFacts for Outbox {
    fn publish(&self, fact: Fact) {
        self.0.lock().push(fact);
    }
}

/// A router's place in the fleet: its published facts, numbered as the fleet
/// publisher numbers them.
struct Member {
    id: &'static str,
    outbox: Arc<Outbox>,
    seq: u64,
}

impl Member {
    fn join(router: &Router, id: &'static str) -> Self {
        let outbox = Arc::new(Outbox::default());
        assert!(router.join_fleet(id, outbox.clone()));
        assert!(!router.join_fleet(id, outbox.clone()), "set once");
        Self { id, outbox, seq: 0 }
    }

    fn message(&mut self, fact: Fact) -> Message {
        self.seq += 1;
        Message {
            peer: self.id.into(),
            epoch: 1,
            seq: self.seq,
            fact,
        }
    }

    /// Delivers everything published so far to `to`.
    fn relay(&mut self, to: &Router, now: Timestamp) -> Vec<Fact> {
        let facts: Vec<Fact> = std::mem::take(&mut *self.outbox.0.lock());
        for fact in &facts {
            let msg = self.message(fact.clone());
            assert_eq!(to.apply_peer(msg, now), Some(Outcome::Applied), "{fact:?}");
        }
        facts
    }
}

/// `n` long requests admitted to `replica` on `router` as ext_proc admits them.
fn admitted(router: &Router, replica: &str, n: usize) -> Vec<Inflight> {
    let probe = req(&[]).candidates(&[replica]).prefix("fleet-probe", 600);
    (0..n)
        .map(|_| {
            let d = lookup(router, &probe);
            assert_eq!(picked(&d).as_deref(), Some(replica));
            router
                .admit(&d, &probe.as_lookup(), t0())
                .expect("admitted")
        })
        .collect()
}

#[test]
fn a_peers_routes_spill_the_holder_only_it_loaded() {
    let (a, r) = fleet(ResolvedPolicy::default());
    let (b, _) = fleet(ResolvedPolicy::default());
    let r = long(r);
    let mut ma = Member::join(&a, "a");
    let _mb = Member::join(&b, "b");
    assert_eq!(picked(&lookup(&b, &r)).as_deref(), Some("r1"));

    let held = admitted(&a, "r1", 6);
    // Before the facts arrive b sees nothing of a's routes.
    assert_eq!(lookup(&b, &r).spilled_from(), None);
    let facts = ma.relay(&b, t0());
    assert_eq!(facts.len(), 6);
    assert!(
        facts.iter().all(
            |f| matches!(f, Fact::Routed { replica, uncached_tokens: 600, .. } if replica == "r1")
        ),
        "{facts:?}"
    );
    assert_eq!(b.fleet_peers(), 1);
    let d = lookup(&b, &r);
    assert_eq!(d.spilled_from(), Some("r1"));
    assert_eq!(d.spilled_by(), Some(SpillCheck::Requests));

    // a's requests end: each is released once, and b goes back to the holder.
    drop(held);
    let facts = ma.relay(&b, t0());
    assert_eq!(facts.len(), 6, "{facts:?}");
    assert!(facts.iter().all(|f| matches!(f, Fact::Released { .. })));
    assert_eq!(lookup(&b, &r).spilled_from(), None);
}

#[test]
fn a_peer_that_leaves_or_falls_silent_stops_counting() {
    let (a, r) = fleet(ResolvedPolicy::default());
    let (b, _) = fleet(ResolvedPolicy::default());
    let r = long(r);
    let mut ma = Member::join(&a, "a");
    let _mb = Member::join(&b, "b");

    let _held = admitted(&a, "r1", 6);
    ma.relay(&b, t0());
    assert_eq!(lookup(&b, &r).spilled_from(), Some("r1"));
    let leave = ma.message(Fact::Leave);
    assert_eq!(b.apply_peer(leave, t0()), Some(Outcome::Applied));
    assert_eq!(lookup(&b, &r).spilled_from(), None, "released at once");
    assert_eq!(b.fleet_peers(), 0);

    // A new run of a (new epoch) routes again, then goes silent.
    let _again = admitted(&a, "r1", 6);
    let facts: Vec<Fact> = std::mem::take(&mut *ma.outbox.0.lock());
    for (i, fact) in facts.into_iter().enumerate() {
        let msg = Message {
            peer: "a".into(),
            epoch: 2,
            seq: i as u64 + 1,
            fact,
        };
        assert_eq!(b.apply_peer(msg, t0()), Some(Outcome::Applied));
    }
    assert_eq!(lookup(&b, &r).spilled_from(), Some("r1"));
    assert_eq!(b.expire_peers(t0()), 0);
    let later = t0().plus(HEARTBEAT_TIMEOUT + Duration::from_millis(1));
    assert_eq!(b.expire_peers(later), 1);
    assert_eq!(lookup(&b, &r).spilled_from(), None);
}

#[test]
fn forgetting_the_peers_drops_their_load_and_a_stray_peer_changes_nothing() {
    let (a, r) = fleet(ResolvedPolicy::default());
    let (b, _) = fleet(ResolvedPolicy::default());
    let r = long(r);
    let mut ma = Member::join(&a, "a");
    let _mb = Member::join(&b, "b");
    let _held = admitted(&a, "r1", 6);
    ma.relay(&b, t0());
    assert_eq!(lookup(&b, &r).spilled_from(), Some("r1"));
    b.forget_peers();
    assert_eq!(lookup(&b, &r).spilled_from(), None);

    // b's own echo is refused.
    let echo = Message {
        peer: "b".into(),
        epoch: 1,
        seq: 1,
        fact: Fact::Heartbeat,
    };
    assert!(matches!(
        b.apply_peer(echo, t0()),
        Some(Outcome::Rejected(_))
    ));
    // Outside a fleet nothing is applied.
    let (c, _) = fleet(ResolvedPolicy::default());
    assert_eq!(c.apply_peer(ma.message(Fact::Heartbeat), t0()), None);
}

/// Counts how often the router said its replicas' signals changed.
#[derive(Default)]
struct Watch(std::sync::atomic::AtomicUsize);

impl crate::flow::RoomWatch for Watch {
    fn signals_changed(&self) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

impl Watch {
    fn told(&self) -> usize {
        self.0.load(std::sync::atomic::Ordering::Relaxed)
    }
}

#[test]
fn flow_control_hears_of_every_applied_signal_that_can_free_room_and_of_nothing_refused() {
    // A prefill ends through an event batch, a queue report or a peer's fact:
    // after each one applied the watch is told, so held requests need not wait
    // for the queue's timer; what the router refused changed nothing and is not.
    let (a, _) = fleet(ResolvedPolicy::default());
    let (b, _) = fleet(ResolvedPolicy::default());
    let watch = Arc::new(Watch::default());
    let weak = Arc::downgrade(&watch);
    b.watch_room(weak);
    assert_eq!(watch.told(), 0);

    store(&b, "r3", &[40, 41]);
    assert_eq!(watch.told(), 1, "an event batch");
    report_queue(&b, "r3", 2, 1, t0());
    assert_eq!(watch.told(), 2, "a queue report");

    let probe = crate::scope::PROBE_TENANT;
    let refused = IngestBatch {
        scope: ScopeRef::new(probe, "llama", "vllm"),
        replica_id: "r3",
        endpoint: &endpoint_of("r3"),
        events: &[stored(&[42])],
    };
    assert!(b.ingest(&refused, t0()).is_err());
    assert_eq!(watch.told(), 2, "a refused batch");

    let mut ma = Member::join(&a, "a");
    let _mb = Member::join(&b, "b");
    let _held = admitted(&a, "r1", 1);
    let facts = ma.relay(&b, t0());
    assert_eq!(watch.told(), 2 + facts.len(), "each applied peer fact");
    let stale = Message {
        peer: "a".into(),
        epoch: 1,
        seq: 1,
        fact: Fact::Leave,
    };
    assert!(matches!(
        b.apply_peer(stale, t0()),
        Some(Outcome::Rejected(_))
    ));
    assert_eq!(watch.told(), 2 + facts.len(), "a stale peer message");

    // The watch is weak: once its owner is gone nothing is called.
    drop(watch);
    store(&b, "r3", &[43]);
}
