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

/// Why an engine KV batch was dropped, on either side.
pub const KV_DROP_REASONS: [&str; 8] = [
    // Publishing.
    "queue_full",
    "publish_error",
    // Receiving: the wire format's refusals.
    "oversized",
    "foreign_version",
    "malformed",
    // Receiving: the body names another engine than its subject.
    "engine_mismatch",
    // Receiving: from a relay whose lease a newer relay holds.
    "fenced",
    // Receiving: the index refused the batch.
    "rejected",
];

/// Fleet sync counters and gauges.
#[derive(Debug, Default)]
pub struct FleetMetrics {
    enabled: AtomicBool,
    kv_stream_enabled: AtomicBool,
    kv_stream_ready: Gauge,
    connected: Gauge,
    peers: Gauge,
    published: Counter,
    published_bytes: Counter,
    received: Counter,
    dropped: Family<ReasonLabels, Counter>,
    gaps: Counter,
    expired: Counter,
    kv_published: Counter,
    kv_published_bytes: Counter,
    kv_applied: Counter,
    kv_dropped: Family<ReasonLabels, Counter>,
    kv_relays: Gauge,
    kv_takeovers: Counter,
    kv_gaps: Counter,
    snapshot_loaded_blocks: Gauge,
    snapshot_load_ms: Gauge,
    snapshots_written: Counter,
    snapshot_bytes: Gauge,
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
        registry.register(
            "fleet_kv_stream_ready",
            "1 once the fleet's KV event stream, lease bucket and snapshot store are set up (0 before, or without JetStream: every engine is then followed directly)",
            self.kv_stream_ready.clone(),
        );
        registry.register(
            "fleet_kv_batches_published",
            "Engine KV event batches this sidecar relayed to the fleet's stream",
            self.kv_published.clone(),
        );
        registry.register(
            "fleet_kv_published_bytes",
            "Bytes of engine KV event batches relayed (payload and subject)",
            self.kv_published_bytes.clone(),
        );
        registry.register(
            "fleet_kv_batches_applied",
            "Engine KV event batches read from the fleet's stream and applied (own batches only recorded)",
            self.kv_applied.clone(),
        );
        registry.register(
            "fleet_kv_batches_dropped",
            "Engine KV event batches dropped, by reason: queue_full, publish_error (relaying); oversized, foreign_version, malformed, engine_mismatch, fenced, rejected (reading)",
            self.kv_dropped.clone(),
        );
        registry.register(
            "fleet_kv_relayed_engines",
            "Engines whose KV events this sidecar relays (holds the lease of)",
            self.kv_relays.clone(),
        );
        registry.register(
            "fleet_kv_takeovers",
            "Engine relay leases this sidecar took",
            self.kv_takeovers.clone(),
        );
        registry.register(
            "fleet_kv_stream_gaps",
            "Times the fleet's stream had lost batches this sidecar had not read (aged out)",
            self.kv_gaps.clone(),
        );
        registry.register(
            "fleet_index_snapshot_loaded_blocks",
            "Blocks loaded from the fleet's index snapshot at start",
            self.snapshot_loaded_blocks.clone(),
        );
        registry.register(
            "fleet_index_snapshot_load_milliseconds",
            "How long loading the fleet's index snapshot took at start",
            self.snapshot_load_ms.clone(),
        );
        registry.register(
            "fleet_index_snapshots_written",
            "Index snapshots this sidecar wrote for the fleet",
            self.snapshots_written.clone(),
        );
        registry.register(
            "fleet_index_snapshot_bytes",
            "Size of the last index snapshot this sidecar wrote",
            self.snapshot_bytes.clone(),
        );
        for reason in KV_DROP_REASONS {
            let _ = self.kv_dropped.get_or_create(&ReasonLabels { reason });
        }
    }

    /// Engine KV events go through the fleet's stream (`--fleet-kv-events stream`).
    pub fn enable_kv_stream(&self) {
        self.kv_stream_enabled.store(true, Ordering::Relaxed);
    }

    pub fn set_kv_stream_ready(&self) {
        self.kv_stream_ready.set(1);
    }

    pub fn kv_published(&self, bytes: usize) {
        self.kv_published.inc();
        self.kv_published_bytes.inc_by(bytes as u64);
    }

    pub fn kv_applied(&self) {
        self.kv_applied.inc();
    }

    /// `reason` is one of [`KV_DROP_REASONS`].
    pub fn kv_dropped(&self, reason: &'static str) {
        self.kv_dropped
            .get_or_create(&ReasonLabels { reason })
            .inc();
    }

    pub fn kv_relays(&self, delta: i64) {
        self.kv_relays.inc_by(delta);
    }

    pub fn kv_takeover(&self) {
        self.kv_takeovers.inc();
    }

    pub fn kv_gap(&self) {
        self.kv_gaps.inc();
    }

    pub fn snapshot_loaded(&self, blocks: usize, took: std::time::Duration) {
        self.snapshot_loaded_blocks
            .set(i64::try_from(blocks).unwrap_or(i64::MAX));
        self.snapshot_load_ms
            .set(i64::try_from(took.as_millis()).unwrap_or(i64::MAX));
    }

    pub fn snapshot_written(&self, bytes: usize) {
        self.snapshots_written.inc();
        self.snapshot_bytes
            .set(i64::try_from(bytes).unwrap_or(i64::MAX));
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
            "relayedEngines": self.kv_relays.get(),
            "kvEvents": match (
                self.kv_stream_enabled.load(Ordering::Relaxed),
                self.kv_stream_ready.get() == 1,
            ) {
                (false, _) => "direct",
                (true, true) => "stream",
                (true, false) => "stream-unavailable",
            },
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
        assert_eq!(m.condition()["kvEvents"], "direct");
        m.enable_kv_stream();
        assert_eq!(m.condition()["kvEvents"], "stream-unavailable");
        m.set_kv_stream_ready();
        assert_eq!(m.condition()["kvEvents"], "stream");
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
