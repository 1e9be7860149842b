//! The fleet's other sidecars as this router sees them (fleet sync): their
//! published routing facts go through one [`PeerLedger`], whose per-replica
//! totals are written into each replica's load signals, and this sidecar's own
//! routes are handed to the fleet publisher ([`RouteFacts`]).
//!
//! Invariants:
//! - The load signals hold exactly the ledger's totals after every change: each
//!   change rewrites every replica the peers hold routes on, and zeroes those
//!   they held before and no longer do (a peer's gap, timeout or leave drops
//!   several replicas' routes at once).
//! - A replica this sidecar does not know yet (no event, not declared) gets its
//!   peers' load once it appears, at the next change.
//! - The ledger's lock is taken by the fleet subscriber and by maintenance,
//!   never by a decision: decisions read the atomics.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use crate::index::Index;
use crate::load::peer_ledger::{Fact, Message, Outcome, PeerLedger};
use crate::load::{RouteFacts, SharedRoute};
use crate::scope::{ScopeKey, ScopeRef};
use crate::time::Timestamp;

/// What one route of this sidecar asks of its replica, as the peers are told.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RouteWork {
    /// Tokens the replica has to prefill (not cached there).
    pub uncached_tokens: u64,
    /// The request's prompt tokens and flow-control priority: what the peers'
    /// flow control charges its tenant.
    pub prompt_tokens: u64,
    pub priority: i64,
    /// Flow control held the request before it was routed.
    pub held: bool,
}

/// This sidecar's place in its fleet.
#[derive(Debug)]
pub(crate) struct Fleet {
    facts: Arc<dyn RouteFacts>,
    /// The next route id (unique within this process, the publisher's epoch).
    next_route: AtomicU64,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    ledger: PeerLedger,
    /// Replicas whose peer load was written non-zero at the last change.
    written: HashSet<(ScopeKey, String)>,
}

impl Fleet {
    pub fn new(me: &str, facts: Arc<dyn RouteFacts>) -> Self {
        Self {
            facts,
            next_route: AtomicU64::new(1),
            state: Mutex::new(State {
                ledger: PeerLedger::new(me),
                written: HashSet::new(),
            }),
        }
    }

    /// Publishes a route of `scope` to `replica` and returns its handle.
    pub fn share(
        &self,
        scope: ScopeRef<'_>,
        replica: &str,
        work: RouteWork,
        pending: Vec<u64>,
    ) -> Arc<SharedRoute> {
        let route = self.next_route.fetch_add(1, Ordering::Relaxed);
        SharedRoute::routed(
            self.facts.clone(),
            route,
            Fact::Routed {
                route,
                scope: scope.to_owned(),
                replica: replica.to_string(),
                uncached_tokens: work.uncached_tokens,
                prompt_tokens: work.prompt_tokens,
                priority: work.priority,
                held: work.held,
                pending,
            },
        )
    }

    /// Applies one peer message and brings the load signals up to date.
    pub fn apply(&self, index: &Index, msg: Message, now: Timestamp) -> Outcome {
        let routed = match &msg.fact {
            Fact::Routed { scope, replica, .. } => Some((scope.clone(), replica.clone())),
            _ => None,
        };
        let mut state = self.state.lock();
        let outcome = state.ledger.apply(msg, now);
        if matches!(outcome, Outcome::Applied | Outcome::AppliedAfterGap) {
            if let Some((scope, replica)) = routed {
                with_load(index, &scope, &replica, |l| {
                    l.note_peer_routed(now.as_nanos());
                });
            }
            state.refresh(index);
        }
        outcome
    }

    /// Drops the peers silent too long; returns how many.
    pub fn expire(&self, index: &Index, now: Timestamp) -> usize {
        let mut state = self.state.lock();
        let expired = state.ledger.expire(now);
        if expired > 0 {
            state.refresh(index);
        }
        expired
    }

    /// Drops every peer's contributions (the fleet view was lost).
    pub fn forget(&self, index: &Index) {
        let mut state = self.state.lock();
        state.ledger.clear();
        state.refresh(index);
    }

    /// Writes the peers' load again (a replica may have appeared since).
    pub fn rewrite(&self, index: &Index) {
        self.state.lock().refresh(index);
    }

    pub fn peers(&self) -> usize {
        self.state.lock().ledger.peers()
    }
}

impl State {
    fn refresh(&mut self, index: &Index) {
        let mut now_written = HashSet::with_capacity(self.written.len());
        for (scope, replica, load) in self.ledger.totals() {
            with_load(index, scope, replica, |l| {
                l.set_peer_load(load.in_flight, load.prefill_tokens);
            });
            now_written.insert((scope.clone(), replica.to_string()));
        }
        for (scope, replica) in self.written.difference(&now_written) {
            with_load(index, scope, replica, |l| l.set_peer_load(0, 0));
        }
        self.written = now_written;
    }
}

/// Runs `f` on the load signals of `replica` in `scope`, if the index knows it.
fn with_load(
    index: &Index,
    scope: &ScopeKey,
    replica: &str,
    f: impl FnOnce(&crate::load::ReplicaLoad),
) {
    let Some(s) = index.scope(scope.as_ref()) else {
        return;
    };
    let table = s.table();
    if let Some(r) = table.slot_of(replica).and_then(|slot| table.get(slot)) {
        f(&r.live.load);
    }
}
