//! Flow control above capacity: which held request goes next, and which is shed.
//!
//! When every eligible replica is saturated ([`saturation::all_saturated`]) the
//! ext_proc adapter holds a request in a [`FlowQueue`] instead of sending it to an
//! engine where it would wait anyway. Holding lets the sidecar choose the order:
//!
//! 1. priority bands, higher first (`x-inferencecache-priority`, default 0);
//! 2. within a band, weighted fair queuing across tenants by tokens when the
//!    tenant's isolation mode is `Fairness` (each tenant's share follows its
//!    `CacheTenant.spec.weight`), otherwise first come, first served.
//!
//! The queue is bounded (`maxQueuedRequests`): when full, the lowest-priority
//! request is shed — the newcomer when nothing queued is lower, else the newest
//! entry of the lowest band. A request waiting longer than `maxQueueWait` is shed
//! as `queue-timeout`, and so is one that would, by the queue's recent pace, when
//! it arrives ([`FlowQueue::foresees_timeout`]); a client that goes away
//! leaves at once ([`FlowQueue::cancel`]).
//!
//! Pure and synchronous: time is passed in, the adapter owns timers and wake-ups.
//! Below saturation nothing here is consulted, so no decision changes.

mod queue;
pub mod saturation;

use crate::scope::ScopeRef;
use crate::time::Timestamp;

/// A request's cost under fair queuing: its prompt tokens, the larger of its
/// chain's token counts and its prefix token count, at least 1. What the
/// ext_proc path costs a request and what its route tells the fleet's peers.
pub fn prompt_tokens(block_token_counts: &[u32], prefix_tokens: u32) -> u64 {
    let chain: u64 = block_token_counts.iter().map(|&c| u64::from(c)).sum();
    chain.max(u64::from(prefix_tokens)).max(1)
}

/// Fleet sync's share of flow control: every route a peer sidecar publishes is
/// charged to its tenant here as if this sidecar had served it, so tenant shares
/// are the fleet's, not one sidecar's (the adapter's queues implement it; the
/// router hands it the peers' routes, [`crate::Router::share_fleet_service`]).
pub trait FleetShares: Send + Sync {
    /// A peer routed a request of `scope` with `prompt_tokens` (at least 1) at
    /// `priority`; `held`: its flow control held the request first (taken as
    /// the tenant having more held there for a while).
    fn peer_served(
        &self,
        scope: ScopeRef<'_>,
        priority: i64,
        prompt_tokens: u64,
        held: bool,
        now: Timestamp,
    );
}

/// Flow control's wake-up from the engines' side: told after the router applied
/// an engine's KV events, a queue report or a peer's routing fact, any of which
/// may end a prefill and so free room at a saturated replica. Held requests then
/// go as soon as an engine's signals show room, not at the queue's next timer
/// tick ([`crate::Router::watch_room`]).
pub trait RoomWatch: Send + Sync {
    /// The replicas' load signals changed. Called on the ingesting thread:
    /// must be cheap and must not block.
    fn signals_changed(&self);
}

pub use queue::{
    Admission, FAIRNESS_HALF_LIFE, FAIRNESS_MEMORY, FlowQueue, Held, MAX_REMEMBERED_BANDS,
    MIN_RELEASES_TO_FORESEE, PEER_BACKLOG_WINDOW, PRUNE_INTERVAL, QueueLimits, Request, ShedReason,
    Ticket,
};
