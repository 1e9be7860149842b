//! Reads the fleet's routing facts and applies them to the router, and drops
//! the peers that fell silent.
//!
//! Every message is checked before anything changes: its subject must name a
//! peer of this fleet, its bytes must decode ([`wire::decode`]: size, version,
//! shape), and the peer it claims must be the one its subject names. The ledger
//! then refuses stale epochs and sequences. A refused message is counted by
//! reason and changes nothing.

use std::sync::Arc;
use std::time::Duration;

use async_nats::{Client, Subscriber};
use futures::StreamExt;

use super::metrics::FleetMetrics;
use super::subjects::Subjects;
use super::wire;
use crate::core::Router;
use crate::core::load::peer_ledger::Outcome;
use crate::core::time::Timestamp;

/// How often silent peers are looked for: a peer killed without a word is gone
/// within the heartbeat timeout plus this.
pub const EXPIRY_TICK: Duration = Duration::from_millis(250);

/// What became of one message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Received {
    /// This sidecar's own subject (never applied).
    Own,
    Applied,
    AppliedAfterGap,
    /// Dropped for this reason (a metric label).
    Dropped(&'static str),
}

/// Checks one message and applies it.
pub fn receive(
    router: &Router,
    subjects: &Subjects,
    me: &str,
    subject: &str,
    payload: &[u8],
    now: Timestamp,
) -> Received {
    let Some(peer) = subjects.peer_of(subject) else {
        return Received::Dropped("peer_mismatch");
    };
    if peer == me {
        return Received::Own;
    }
    let msg = match wire::decode(payload) {
        Ok(msg) => msg,
        Err(refusal) => return Received::Dropped(refusal.as_str()),
    };
    if msg.peer != peer {
        return Received::Dropped("peer_mismatch");
    }
    match router.apply_peer(msg, now) {
        Some(Outcome::Applied) => Received::Applied,
        Some(Outcome::AppliedAfterGap) => Received::AppliedAfterGap,
        Some(Outcome::Rejected(r)) => Received::Dropped(r.as_str()),
        None => Received::Dropped("own"),
    }
}

/// Subscribes to the fleet's routing facts (resubscribed by the client after
/// every reconnection).
pub async fn subscribe(client: &Client, subjects: &Subjects) -> anyhow::Result<Subscriber> {
    client
        .subscribe(subjects.all_routes())
        .await
        .map_err(|e| anyhow::anyhow!("subscribing to {}: {e}", subjects.all_routes()))
}

/// Applies every message of `subscription` until it ends, and expires silent
/// peers every [`EXPIRY_TICK`].
pub async fn run(
    mut subscription: Subscriber,
    router: Arc<Router>,
    subjects: Subjects,
    me: String,
    metrics: Arc<FleetMetrics>,
) {
    let mut ticker = tokio::time::interval(EXPIRY_TICK);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            msg = subscription.next() => {
                let Some(msg) = msg else { return };
                let outcome = receive(&router, &subjects, &me, msg.subject.as_str(), &msg.payload, Timestamp::now());
                if outcome != Received::Own {
                    metrics.received();
                }
                match outcome {
                    Received::Dropped(reason) => metrics.dropped(reason),
                    Received::AppliedAfterGap => metrics.gap(),
                    Received::Applied | Received::Own => {}
                }
                metrics.set_peers(router.fleet_peers());
            }
            _ = ticker.tick() => {
                let expired = router.expire_peers(Timestamp::now());
                if expired > 0 {
                    tracing::info!(expired, "fleet peers silent past the heartbeat timeout: their routes dropped");
                    metrics.expired(expired);
                }
                metrics.set_peers(router.fleet_peers());
            }
        }
    }
}
