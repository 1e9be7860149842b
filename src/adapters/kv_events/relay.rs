//! Where a subscriber's translated batches go when several sidecars share one
//! index (the fleet's KV event stream): the hand-off between a ZMQ subscriber
//! and whatever relays its engine's events to the other sidecars.
//!
//! Without a relay (one sidecar alone, the default) every batch is applied to
//! the own index. With one, each batch is offered first: the engine's relay
//! (the sidecar holding its lease) applies it and publishes it; every other
//! sidecar leaves it to the stream, unless the stream is unreachable, when it
//! applies the batch itself (the direct subscription is the fallback).

use std::sync::Arc;

use tokio::sync::Notify;

use crate::core::index::IngestBatch;
use crate::core::scope::ScopeKey;

/// Joins engines to the fleet's event stream.
pub trait Relay: Send + Sync {
    /// A subscriber of `(scope, replica, rank)` starts; dropping what is
    /// returned (the subscriber stopped) gives up the engine's lease.
    fn join(&self, scope: &ScopeKey, replica: &str, rank: u32) -> Box<dyn EngineRelay>;
}

/// One engine's side of the relay.
pub trait EngineRelay: Send + Sync {
    /// Whether this sidecar applies `batch` to its own index now. When it holds
    /// the engine's lease the batch is published to the fleet as well.
    fn offer(&self, batch: &IngestBatch<'_>) -> bool;

    /// Notified when this sidecar becomes the engine's relay: the subscriber
    /// then replays the engine's buffer (a resync), so that what the previous
    /// relay did not publish reaches the stream.
    fn took_over(&self) -> Arc<Notify>;
}
