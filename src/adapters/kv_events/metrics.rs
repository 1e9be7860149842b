//! KV event subscriber metrics (registered into the process registry by
//! [`crate::adapters::metrics::Metrics::new`]). Labels are fixed strings only.

use std::collections::HashSet;

use parking_lot::Mutex;
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
    oversized: Counter,
    dropped_connections: Family<Kind, Counter>,
    duplicates: Counter,
    warm_starts: Family<Kind, Counter>,
    stale_replicas: Gauge,
    /// (tenant, model, hash scheme, replica, data-parallel rank) of the event
    /// streams marked possibly stale.
    stale: Mutex<HashSet<StaleKey>>,
}

/// Which replica: (tenant, model, hash scheme, replica id).
pub type StaleKey = (String, String, String, String, u32);

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
            oversized: Counter::default(),
            dropped_connections: Family::default(),
            duplicates: Counter::default(),
            warm_starts: Family::default(),
            stale_replicas: Gauge::default(),
            stale: Mutex::new(HashSet::new()),
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
            "Replicas cleared by cause: restart (seq went back), overflow, engine (AllBlocksCleared), warm_start (a replay from seq 0 rebuilt it)",
            self.resets.clone(),
        );
        registry.register(
            "kv_events_oversized_frames",
            "ZMQ frames whose header announced more than the message-size limit (the connection was dropped)",
            self.oversized.clone(),
        );
        registry.register(
            "kv_events_dropped_connections",
            "ZMQ connections dropped by us, by kind: oversized, protocol (not ZMTP 3, bad frames), handshake (timed out)",
            self.dropped_connections.clone(),
        );
        registry.register(
            "kv_events_duplicate_batches",
            "Live batches dropped because the warm-start replay already applied them",
            self.duplicates.clone(),
        );
        registry.register(
            "kv_events_warm_starts",
            "Replays from seq 0 (at subscriber start, and resyncs of a stale replica) by outcome: exact (the buffer reached seq 0), partial (it did not), failed",
            self.warm_starts.clone(),
        );
        registry.register(
            "kv_events_stale_replicas",
            "Replicas whose entries may be stale (a lost batch could not be replayed); see kvEventsStale in /snapshot",
            self.stale_replicas.clone(),
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

    /// A connection dropped by us: `kind` is oversized, protocol or handshake.
    pub fn dropped_connection(&self, kind: &'static str) {
        if kind == "oversized" {
            self.oversized.inc();
        }
        self.dropped_connections.get_or_create(&Kind { kind }).inc();
    }

    /// Frames refused for their announced size so far.
    pub fn oversized(&self) -> u64 {
        self.oversized.get()
    }

    pub fn duplicate(&self) {
        self.duplicates.inc();
    }

    /// `kind`: exact, partial or failed.
    pub fn warm_start(&self, kind: &'static str) {
        self.warm_starts.get_or_create(&Kind { kind }).inc();
    }

    /// Marks (or unmarks) a replica as possibly stale.
    pub fn set_stale(&self, key: &StaleKey, stale: bool) {
        let mut set = self.stale.lock();
        let changed = if stale {
            set.insert(key.clone())
        } else {
            set.remove(key)
        };
        if changed {
            // Replicas, not streams: a replica with two stale ranks counts once.
            let replicas: HashSet<(&str, &str, &str, &str)> = set
                .iter()
                .map(|(t, m, h, r, _)| (t.as_str(), m.as_str(), h.as_str(), r.as_str()))
                .collect();
            self.stale_replicas.set(replicas.len() as i64);
        }
    }

    /// Is this replica (any of its data-parallel ranks) marked possibly stale?
    pub fn is_stale(&self, tenant: &str, model: &str, hash_scheme: &str, replica: &str) -> bool {
        let set = self.stale.lock();
        if set.is_empty() {
            return false;
        }
        set.iter()
            .any(|(t, m, h, r, _)| t == tenant && m == model && h == hash_scheme && r == replica)
    }
}
