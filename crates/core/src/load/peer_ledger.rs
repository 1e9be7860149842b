//! What the other sidecars of a fleet have routed and not yet released, kept from
//! the routing facts they publish.
//!
//! Each sidecar publishes the facts it keeps for its own routes: a request routed
//! (to which replica, how much prefill it brings), its prefill's end, its release.
//! The ledger folds a peer's facts into per-replica totals the load signals read
//! next to the sidecar's own counts.
//!
//! Invariants:
//! - A peer's facts apply in its publishing order. Each message carries the
//!   publisher's epoch (new at every start) and a sequence number that grows by
//!   one per message. A repeated or older sequence is dropped. A gap means facts
//!   were lost, possibly releases: the peer's contributions are dropped at once
//!   and counting starts again from the message after the gap. Undercounting a
//!   peer for a moment is safe; a lost release counted for good is not.
//! - An older epoch than the one known is dropped (a restarted peer's stale
//!   messages, or a forger replaying them); a newer one replaces the peer's state.
//! - A peer silent past [`HEARTBEAT_TIMEOUT`] loses its contributions
//!   ([`PeerLedger::expire`]); a peer that leaves cleanly loses them at once.
//! - Totals are always the sum of the contributions held: every add and remove
//!   goes through one place, and a peer's contributions are bounded
//!   ([`MAX_IN_FLIGHT_PER_PEER`]) so garbage cannot grow memory without limit.
//!
//! Pure bookkeeping: the caller passes the clock and the decoded messages.

use std::collections::HashMap;
use std::time::Duration;

use crate::scope::{ScopeKey, ScopeRef};
use crate::time::Timestamp;

/// How often a sidecar with nothing else to say publishes a heartbeat.
pub const HEARTBEAT_INTERVAL: Duration = Duration::from_millis(500);
/// A peer heard from neither fact nor heartbeat for this long is gone.
pub const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(2);
/// A peer's in-flight routes the ledger keeps at most; more are refused.
pub const MAX_IN_FLIGHT_PER_PEER: usize = 65_536;

/// The longest pending chain a routed fact carries (8 bytes a block on the
/// wire): siblings share a prefix, so its first blocks are what counts.
pub const MAX_SHARED_PENDING: usize = 512;

/// One routing fact a sidecar publishes about its own routes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fact {
    /// A request of `scope` routed to `replica`.
    Routed {
        /// The publisher's id for this route, unique within its epoch.
        route: u64,
        scope: ScopeKey,
        replica: String,
        /// Tokens the replica has to prefill for it (not cached there).
        uncached_tokens: u64,
        /// Its prompt tokens and flow-control priority: what the receivers'
        /// flow control charges its tenant (0 tokens: a publisher that does
        /// not say, charged nothing).
        prompt_tokens: u64,
        priority: i64,
        /// The publisher's flow control held it first: the receivers take the
        /// tenant to have more held there for a while.
        held: bool,
        /// The chain the publisher recorded as pending for the replica (its
        /// first [`MAX_SHARED_PENDING`] blocks; empty when its policy keeps no
        /// pending entries): the receivers record it too.
        pending: Vec<u64>,
    },
    /// The route's prefill ended: its backlog on the replica is gone, the
    /// request is still in flight.
    PrefillEnded { route: u64 },
    /// The route finished (or failed): nothing of it remains on the replica.
    Released { route: u64 },
    /// Nothing happened; the publisher is alive.
    Heartbeat,
    /// The publisher is leaving: everything it routed is released.
    Leave,
}

/// A fact as published: who, which run of it, and where in its order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    pub peer: String,
    pub epoch: u64,
    pub seq: u64,
    pub fact: Fact,
}

/// What the ledger did with a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Applied,
    /// Applied after a gap: the peer's earlier contributions were dropped.
    AppliedAfterGap,
    /// Dropped, state unchanged.
    Rejected(Rejection),
}

/// Why a message changed nothing. Bounded: used as a metric label.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Rejection {
    /// This sidecar's own message, echoed back.
    Own,
    /// A sequence already applied (duplicate or reordered late).
    StaleSeq,
    /// An epoch older than the peer's current one.
    StaleEpoch,
    /// A prefill end or release for a route the ledger does not hold.
    UnknownRoute,
    /// A route id already in flight for this peer.
    DuplicateRoute,
    /// The peer already holds [`MAX_IN_FLIGHT_PER_PEER`] routes.
    Full,
}

impl Rejection {
    pub fn as_str(self) -> &'static str {
        match self {
            Rejection::Own => "own",
            Rejection::StaleSeq => "stale_seq",
            Rejection::StaleEpoch => "stale_epoch",
            Rejection::UnknownRoute => "unknown_route",
            Rejection::DuplicateRoute => "duplicate_route",
            Rejection::Full => "full",
        }
    }
}

/// One replica's load from the peers' routes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PeerLoad {
    /// Routes in flight there.
    pub in_flight: u64,
    /// Tokens still to prefill for those routes whose prefill has not ended.
    pub prefill_tokens: u64,
}

/// A replica of a scope: where the peers' totals are kept.
type ReplicaKey = (ScopeKey, String);

#[derive(Debug)]
struct Route {
    replica: ReplicaKey,
    /// Zero once the prefill ended.
    prefill_tokens: u64,
}

#[derive(Debug)]
struct Peer {
    epoch: u64,
    /// The last sequence applied.
    seq: u64,
    heard: Timestamp,
    routes: HashMap<u64, Route>,
}

/// The fleet's peers and what each holds on every replica.
#[derive(Debug)]
pub struct PeerLedger {
    me: String,
    peers: HashMap<String, Peer>,
    totals: HashMap<ReplicaKey, PeerLoad>,
}

impl PeerLedger {
    /// A ledger for the sidecar `me` (its own echoed messages are ignored).
    pub fn new(me: impl Into<String>) -> Self {
        Self {
            me: me.into(),
            peers: HashMap::new(),
            totals: HashMap::new(),
        }
    }

    /// Applies one message received at `now`.
    pub fn apply(&mut self, msg: Message, now: Timestamp) -> Outcome {
        if msg.peer == self.me {
            return Outcome::Rejected(Rejection::Own);
        }
        let mut gap = false;
        match self.peers.get(&msg.peer) {
            Some(p) if msg.epoch < p.epoch => {
                return Outcome::Rejected(Rejection::StaleEpoch);
            }
            Some(p) if msg.epoch == p.epoch && msg.seq <= p.seq => {
                return Outcome::Rejected(Rejection::StaleSeq);
            }
            Some(p) if msg.epoch == p.epoch => gap = msg.seq != p.seq + 1,
            // A new epoch: the peer restarted; what its last run held is gone.
            Some(_) => self.drop_peer(&msg.peer),
            None => {}
        }
        if gap {
            self.release_all(&msg.peer);
        }
        let peer = self.peers.entry(msg.peer.clone()).or_insert_with(|| Peer {
            epoch: msg.epoch,
            seq: msg.seq,
            heard: now,
            routes: HashMap::new(),
        });
        // The sequence advances even when the fact itself is refused below: it
        // was received, so the next message is not a gap.
        peer.seq = msg.seq;
        peer.heard = now;
        let rejected = match msg.fact {
            Fact::Routed {
                route,
                scope,
                replica,
                uncached_tokens,
                ..
            } => {
                let replica = (scope, replica);
                if peer.routes.contains_key(&route) {
                    Some(Rejection::DuplicateRoute)
                } else if peer.routes.len() >= MAX_IN_FLIGHT_PER_PEER {
                    Some(Rejection::Full)
                } else {
                    let t = self.totals.entry(replica.clone()).or_default();
                    t.in_flight += 1;
                    t.prefill_tokens = t.prefill_tokens.saturating_add(uncached_tokens);
                    peer.routes.insert(
                        route,
                        Route {
                            replica,
                            prefill_tokens: uncached_tokens,
                        },
                    );
                    None
                }
            }
            Fact::PrefillEnded { route } => match peer.routes.get_mut(&route) {
                Some(r) => {
                    let tokens = std::mem::take(&mut r.prefill_tokens);
                    subtract(&mut self.totals, &r.replica, 0, tokens);
                    None
                }
                None => Some(Rejection::UnknownRoute),
            },
            Fact::Released { route } => match peer.routes.remove(&route) {
                Some(r) => {
                    subtract(&mut self.totals, &r.replica, 1, r.prefill_tokens);
                    None
                }
                None => Some(Rejection::UnknownRoute),
            },
            Fact::Heartbeat => None,
            Fact::Leave => {
                self.drop_peer(&msg.peer);
                None
            }
        };
        match (rejected, gap) {
            (Some(r), _) => Outcome::Rejected(r),
            (None, true) => Outcome::AppliedAfterGap,
            (None, false) => Outcome::Applied,
        }
    }

    /// Drops the contributions of every peer silent since `now - HEARTBEAT_TIMEOUT`
    /// and forgets the peer; returns how many peers expired.
    pub fn expire(&mut self, now: Timestamp) -> usize {
        let silent: Vec<String> = self
            .peers
            .iter()
            .filter(|(_, p)| now.since(p.heard) > HEARTBEAT_TIMEOUT)
            .map(|(id, _)| id.clone())
            .collect();
        for id in &silent {
            self.drop_peer(id);
        }
        silent.len()
    }

    /// Drops every peer's contributions (the fleet view was lost: the bus went
    /// down and messages may be missing). Peers are relearned from their next
    /// message.
    pub fn clear(&mut self) {
        self.peers.clear();
        self.totals.clear();
    }

    /// The peers' load on `replica` of `scope`.
    pub fn load(&self, scope: ScopeRef<'_>, replica: &str) -> PeerLoad {
        self.totals
            .get(&(scope.to_owned(), replica.to_string()))
            .copied()
            .unwrap_or_default()
    }

    /// Every replica the peers hold routes on, with their load there.
    pub fn totals(&self) -> impl Iterator<Item = (&ScopeKey, &str, PeerLoad)> {
        self.totals
            .iter()
            .map(|((scope, replica), load)| (scope, replica.as_str(), *load))
    }

    /// Peers currently known.
    pub fn peers(&self) -> usize {
        self.peers.len()
    }

    fn release_all(&mut self, id: &str) {
        if let Some(p) = self.peers.get_mut(id) {
            for (_, r) in p.routes.drain() {
                subtract(&mut self.totals, &r.replica, 1, r.prefill_tokens);
            }
        }
    }

    fn drop_peer(&mut self, id: &str) {
        self.release_all(id);
        self.peers.remove(id);
    }
}

fn subtract(
    totals: &mut HashMap<ReplicaKey, PeerLoad>,
    replica: &ReplicaKey,
    routes: u64,
    tokens: u64,
) {
    if let Some(t) = totals.get_mut(replica) {
        t.in_flight = t.in_flight.saturating_sub(routes);
        t.prefill_tokens = t.prefill_tokens.saturating_sub(tokens);
        if t.in_flight == 0 {
            totals.remove(replica);
        }
    }
}

#[cfg(test)]
mod tests;
