//! Fleet sync metrics (`inferencecache_fleet_*`, registered into the process
//! registry by [`crate::adapters::metrics::Metrics::new`]) and the fleet view's
//! condition shown on `/readyz`.
//!
//! Every label is a fixed `&'static str`: the drop reasons of the publisher,
//! the wire format's refusals and the ledger's rejections.

use std::sync::atomic::{AtomicBool, Ordering};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde_json::{Value, json};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

/// Why a routing fact was dropped, on either side.
pub const DROP_REASONS: [&str; 13] = [
    // Publishing.
    "queue_full",
    "disconnected",
    "publish_error",
    // Receiving: the wire format's refusals.
    "oversized",
    "foreign_version",
    "malformed",
    // Receiving: the body names another peer than its subject.
    "peer_mismatch",
    // Receiving: the ledger's rejections.
    "own",
    "stale_seq",
    "stale_epoch",
    "unknown_route",
    "duplicate_route",
    "full",
];

/// Fleet sync counters and gauges.
#[derive(Debug, Default)]
pub struct FleetMetrics {
    enabled: AtomicBool,
    connected: Gauge,
    peers: Gauge,
    published: Counter,
    published_bytes: Counter,
    received: Counter,
    dropped: Family<ReasonLabels, Counter>,
    gaps: Counter,
    expired: Counter,
}

impl FleetMetrics {
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "fleet_connected",
            "1 while the fleet's NATS connection is up (0 without --fleet-nats): routing uses the fleet's view only then, its own otherwise",
            self.connected.clone(),
        );
        registry.register(
            "fleet_peers",
            "Other sidecars of the fleet heard from within the heartbeat timeout",
            self.peers.clone(),
        );
        registry.register(
            "fleet_messages_published",
            "Routing facts and heartbeats published to the fleet",
            self.published.clone(),
        );
        registry.register(
            "fleet_published_bytes",
            "Bytes of routing facts and heartbeats published (payload and subject)",
            self.published_bytes.clone(),
        );
        registry.register(
            "fleet_messages_received",
            "Peers' messages received (before any check)",
            self.received.clone(),
        );
        registry.register(
            "fleet_messages_dropped",
            "Routing facts dropped, by reason: queue_full, disconnected, publish_error (publishing); oversized, foreign_version, malformed, peer_mismatch, own, stale_seq, stale_epoch, unknown_route, duplicate_route, full (receiving)",
            self.dropped.clone(),
        );
        registry.register(
            "fleet_peer_gaps",
            "Peers' messages that showed lost messages before them: that peer's routes were dropped and counted again from there",
            self.gaps.clone(),
        );
        registry.register(
            "fleet_peers_expired",
            "Peers dropped after the heartbeat timeout",
            self.expired.clone(),
        );
        for reason in DROP_REASONS {
            let _ = self.dropped.get_or_create(&ReasonLabels { reason });
        }
    }

    /// Fleet sync is configured (`--fleet-nats`).
    pub fn enable(&self) {
        self.enabled.store(true, Ordering::Relaxed);
    }

    pub fn set_connected(&self, up: bool) {
        self.connected.set(i64::from(up));
    }

    pub fn is_connected(&self) -> bool {
        self.connected.get() == 1
    }

    pub fn set_peers(&self, n: usize) {
        self.peers.set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    pub fn published(&self, bytes: usize) {
        self.published.inc();
        self.published_bytes.inc_by(bytes as u64);
    }

    pub fn received(&self) {
        self.received.inc();
    }

    /// `reason` is one of [`DROP_REASONS`].
    pub fn dropped(&self, reason: &'static str) {
        self.dropped.get_or_create(&ReasonLabels { reason }).inc();
    }

    pub fn gap(&self) {
        self.gaps.inc();
    }

    pub fn expired(&self, n: usize) {
        self.expired.inc_by(n as u64);
    }

    /// The fleet view's condition for `/readyz`: `null` without fleet sync.
    /// Never makes the sidecar unready: without its fleet it routes on its own
    /// view, as a sidecar alone does.
    pub fn condition(&self) -> Value {
        if !self.enabled.load(Ordering::Relaxed) {
            return Value::Null;
        }
        let connected = self.is_connected();
        json!({
            "connected": connected,
            "peers": self.peers.get(),
            "view": if connected { "fleet" } else { "own" },
            "message": if connected {
                "routing on the fleet's routes"
            } else {
                "degraded: the fleet's NATS is unreachable; routing on this sidecar's own routes and the engines' reports"
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_condition_says_when_the_view_is_degraded() {
        let m = FleetMetrics::default();
        assert_eq!(m.condition(), Value::Null);
        m.enable();
        assert_eq!(m.condition()["view"], "own");
        assert_eq!(m.condition()["connected"], false);
        m.set_connected(true);
        m.set_peers(2);
        assert_eq!(m.condition()["view"], "fleet");
        assert_eq!(m.condition()["peers"], 2);
    }

    #[test]
    fn every_drop_reason_is_registered_with_distinct_labels() {
        let m = FleetMetrics::default();
        let mut registry = Registry::default();
        m.register(&mut registry);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).expect("encodes");
        for reason in DROP_REASONS {
            assert!(
                text.contains(&format!(
                    "fleet_messages_dropped_total{{reason=\"{reason}\"}} 0"
                )),
                "{reason}"
            );
        }
        let set: std::collections::HashSet<_> = DROP_REASONS.iter().collect();
        assert_eq!(set.len(), DROP_REASONS.len());
    }
}
