//! This sidecar's routes as its fleet sees them: every routing fact it keeps for
//! itself is also handed to a [`RouteFacts`] sink (the fleet publisher), which
//! the peers fold into their ledgers (`peer_ledger.rs`).
//!
//! Invariants:
//! - A route publishes Routed once, then at most one PrefillEnded, then exactly
//!   one Released: whichever of the request's own exits comes first (its
//!   [`super::Inflight`] let go, its prefill ticket carrying the request let go,
//!   or the last holder dropped) releases it, the others do nothing.
//! - The peers' view follows this sidecar's own accounting: a request leaves its
//!   peers' in-flight counts when it leaves this sidecar's own.
//! - Publishing never blocks the routing path: the sink is a bounded queue that
//!   drops (and signals a gap to its peers) when full.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use super::peer_ledger::Fact;

/// Where this sidecar's routing facts go (the fleet publisher). `publish` must
/// return at once.
pub trait RouteFacts: Send + Sync + fmt::Debug {
    fn publish(&self, fact: Fact);
}

/// One route of this sidecar, published to its fleet.
pub struct SharedRoute {
    facts: Arc<dyn RouteFacts>,
    route: u64,
    /// Its prefill backlog still counts on the peers.
    prefilling: AtomicBool,
    /// Not released yet.
    open: AtomicBool,
}

impl fmt::Debug for SharedRoute {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedRoute")
            .field("route", &self.route)
            .field("open", &self.open.load(Ordering::Relaxed))
            .finish()
    }
}

impl SharedRoute {
    /// Publishes `routed` (a [`Fact::Routed`] whose route id is `route`).
    pub fn routed(facts: Arc<dyn RouteFacts>, route: u64, routed: Fact) -> Arc<Self> {
        let prefilling =
            matches!(routed, Fact::Routed { uncached_tokens, .. } if uncached_tokens > 0);
        facts.publish(routed);
        Arc::new(Self {
            facts,
            route,
            prefilling: AtomicBool::new(prefilling),
            open: AtomicBool::new(true),
        })
    }

    /// The route's prefill ended (its backlog is gone, the request is not).
    pub fn prefill_ended(&self) {
        if self.open.load(Ordering::Relaxed) && self.prefilling.swap(false, Ordering::Relaxed) {
            self.facts.publish(Fact::PrefillEnded { route: self.route });
        }
    }

    /// The route left this sidecar's in-flight count: it leaves the peers' too.
    pub fn released(&self) {
        if self.open.swap(false, Ordering::Relaxed) {
            self.facts.publish(Fact::Released { route: self.route });
        }
    }
}

impl Drop for SharedRoute {
    fn drop(&mut self) {
        self.released();
    }
}

#[cfg(test)]
mod tests {
    use parking_lot::Mutex;

    use super::*;
    use crate::scope::ScopeRef;

    #[derive(Debug, Default)]
    struct Recorded(Mutex<Vec<Fact>>);

    impl RouteFacts for Recorded {
        fn publish(&self, fact: Fact) {
            self.0.lock().push(fact);
        }
    }

    fn routed(tokens: u64) -> Fact {
        Fact::Routed {
            route: 3,
            scope: ScopeRef::new("t", "m", "s").to_owned(),
            replica: "r".into(),
            uncached_tokens: tokens,
            prompt_tokens: 0,
            priority: 0,
            held: false,
            pending: Vec::new(),
        }
    }

    #[test]
    fn prefill_end_then_one_release() {
        let sink = Arc::new(Recorded::default());
        let r = SharedRoute::routed(sink.clone(), 3, routed(10));
        r.prefill_ended();
        r.prefill_ended();
        r.released();
        drop(r);
        assert_eq!(
            *sink.0.lock(),
            vec![
                routed(10),
                Fact::PrefillEnded { route: 3 },
                Fact::Released { route: 3 }
            ]
        );
    }

    #[test]
    fn dropping_releases_and_no_prefill_end_without_a_backlog() {
        let sink = Arc::new(Recorded::default());
        let r = SharedRoute::routed(sink.clone(), 3, routed(0));
        r.prefill_ended();
        drop(r);
        assert_eq!(*sink.0.lock(), vec![routed(0), Fact::Released { route: 3 }]);
    }

    #[test]
    fn no_prefill_end_after_release() {
        let sink = Arc::new(Recorded::default());
        let r = SharedRoute::routed(sink.clone(), 3, routed(10));
        r.released();
        r.prefill_ended();
        assert_eq!(
            *sink.0.lock(),
            vec![routed(10), Fact::Released { route: 3 }]
        );
    }
}
