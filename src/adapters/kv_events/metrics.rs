//! KV event subscriber metrics (registered into the process registry by
//! [`crate::adapters::metrics::Metrics::new`]). Labels are fixed strings only.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Kind {
    kind: &'static str,
}

/// Counters and the lag histogram of every subscriber.
#[derive(Debug)]
pub struct KvEventMetrics {
    batches: Counter,
    events: Family<Kind, Counter>,
    decode_errors: Family<Kind, Counter>,
    gaps: Counter,
    replays: Family<Kind, Counter>,
    resets: Family<Kind, Counter>,
    connects: Family<Kind, Counter>,
    lag: Histogram,
    subscribers: Gauge,
}

impl Default for KvEventMetrics {
    fn default() -> Self {
        Self {
            batches: Counter::default(),
            events: Family::default(),
            decode_errors: Family::default(),
            gaps: Counter::default(),
            replays: Family::default(),
            resets: Family::default(),
            connects: Family::default(),
            // 100 µs .. ~50 s
            lag: Histogram::new(exponential_buckets(1e-4, 2.0, 20)),
            subscribers: Gauge::default(),
        }
    }
}

impl KvEventMetrics {
    /// Registers every series under `kv_events_*`.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "kv_events_batches",
            "Engine KV event batches decoded",
            self.batches.clone(),
        );
        registry.register(
            "kv_events_events",
            "Engine KV events by result: applied, rejected by the index, skipped (other medium, unknown parent or type)",
            self.events.clone(),
        );
        registry.register(
            "kv_events_decode_errors",
            "Engine messages not understood: kind=frame (not [topic, seq, payload]) or payload (not a KV event batch)",
            self.decode_errors.clone(),
        );
        registry.register(
            "kv_events_gaps",
            "Sequence gaps (lost batches) seen",
            self.gaps.clone(),
        );
        registry.register(
            "kv_events_replays",
            "Replays of missed batches by outcome (ok or failed)",
            self.replays.clone(),
        );
        registry.register(
            "kv_events_resets",
            "Replicas cleared by cause: restart (seq went back), replay_failed, overflow, engine (AllBlocksCleared), start",
            self.resets.clone(),
        );
        registry.register(
            "kv_events_connects",
            "Subscriber socket set-ups by outcome (ok or failed)",
            self.connects.clone(),
        );
        registry.register(
            "kv_events_lag_seconds",
            "From the engine's batch timestamp to applied in the index",
            self.lag.clone(),
        );
        registry.register(
            "kv_events_subscribers",
            "Running KV event subscribers (one per replica)",
            self.subscribers.clone(),
        );
    }

    /// Batches decoded so far (benchmarks and tests wait on it).
    pub fn batches(&self) -> u64 {
        self.batches.get()
    }

    /// Sequence gaps seen so far.
    pub fn gaps(&self) -> u64 {
        self.gaps.get()
    }

    pub fn batch(&self) {
        self.batches.inc();
    }

    pub fn events(&self, result: &'static str, n: u64) {
        if n > 0 {
            self.events.get_or_create(&Kind { kind: result }).inc_by(n);
        }
    }

    pub fn decode_error(&self, kind: &'static str) {
        self.decode_errors.get_or_create(&Kind { kind }).inc();
    }

    pub fn gap(&self) {
        self.gaps.inc();
    }

    pub fn replay(&self, ok: bool) {
        let kind = if ok { "ok" } else { "failed" };
        self.replays.get_or_create(&Kind { kind }).inc();
    }

    pub fn reset(&self, cause: &'static str) {
        self.resets.get_or_create(&Kind { kind: cause }).inc();
    }

    pub fn connect(&self, ok: bool) {
        let kind = if ok { "ok" } else { "failed" };
        self.connects.get_or_create(&Kind { kind }).inc();
    }

    pub fn lag(&self, seconds: f64) {
        if seconds.is_finite() {
            self.lag.observe(seconds.max(0.0));
        }
    }

    pub fn subscriber_started(&self) {
        self.subscribers.inc();
    }

    pub fn subscriber_stopped(&self) {
        self.subscribers.dec();
    }
}
