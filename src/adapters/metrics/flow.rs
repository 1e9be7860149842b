//! Flow control's metrics: held requests by priority band, how long they waited,
//! and the requests shed, by reason.
//!
//! The band label is the request's priority clamped to ±[`BAND_LABEL_LIMIT`]
//! (bands beyond are counted at the edge), so a client cannot mint series.

use std::collections::BTreeSet;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::core::flow::ShedReason;

/// Priority bands beyond ±this share the edge label.
pub const BAND_LABEL_LIMIT: i64 = 16;

const SHED_REASONS: [ShedReason; 4] = [
    ShedReason::QueueFull,
    ShedReason::QueueTimeout,
    ShedReason::ExpectedTimeout,
    ShedReason::Priority,
];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BandLabels {
    priority: i64,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ShedLabels {
    reason: &'static str,
}

/// Registered with the process's metrics; the ext_proc flow gate updates it.
#[derive(Debug)]
pub struct FlowMetrics {
    depth: Family<BandLabels, Gauge>,
    /// The band labels given a depth so far: set back to 0 when they empty.
    bands_seen: parking_lot::Mutex<BTreeSet<i64>>,
    wait: Histogram,
    shed_family: Family<ShedLabels, Counter>,
    /// `shed_family`'s series in [`SHED_REASONS`] order, all present from the start.
    sheds: [Counter; 4],
    held: Counter,
    peer_yields: Counter,
}

impl Default for FlowMetrics {
    fn default() -> Self {
        let shed_family = Family::<ShedLabels, Counter>::default();
        let sheds = SHED_REASONS.map(|r| {
            shed_family
                .get_or_create(&ShedLabels { reason: r.label() })
                .clone()
        });
        Self {
            depth: Family::default(),
            bands_seen: parking_lot::Mutex::new(BTreeSet::new()),
            // 1 ms .. ~33 s.
            wait: Histogram::new(exponential_buckets(0.001, 2.0, 16)),
            shed_family,
            sheds,
            held: Counter::default(),
            peer_yields: Counter::default(),
        }
    }
}

impl FlowMetrics {
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "flow_queued_requests",
            "Requests flow control holds now, by priority band (clamped to -16..16)",
            self.depth.clone(),
        );
        registry.register(
            "flow_queue_wait_seconds",
            "How long a held request waited before it was released to a replica",
            self.wait.clone(),
        );
        registry.register(
            "flow_held",
            "Requests flow control held because every eligible replica was saturated",
            self.held.clone(),
        );
        registry.register(
            "flow_peer_yields",
            "Times a queue left a replica's room to a fleet peer holding a tenant \
             owed service first",
            self.peer_yields.clone(),
        );
        registry.register(
            "flow_shed",
            "Requests answered 429 by flow control, by reason \
             (queue-full, queue-timeout, expected-timeout, priority)",
            self.shed_family.clone(),
        );
    }

    /// The held requests per band now (`(priority, count)`, any order).
    pub fn set_depth(&self, bands: impl IntoIterator<Item = (i64, usize)>) {
        let mut now = std::collections::BTreeMap::<i64, usize>::new();
        for (priority, n) in bands {
            let label = priority.clamp(-BAND_LABEL_LIMIT, BAND_LABEL_LIMIT);
            *now.entry(label).or_default() += n;
        }
        let mut seen = self.bands_seen.lock();
        seen.extend(now.keys().copied());
        for &label in seen.iter() {
            let n = now.get(&label).copied().unwrap_or(0);
            self.depth
                .get_or_create(&BandLabels { priority: label })
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
    }

    pub fn record_held(&self) {
        self.held.inc();
    }

    pub fn record_peer_yield(&self) {
        self.peer_yields.inc();
    }

    pub fn record_released(&self, waited: std::time::Duration) {
        self.wait.observe(waited.as_secs_f64());
    }

    pub fn record_shed(&self, reason: ShedReason) {
        let i = SHED_REASONS.iter().position(|r| *r == reason).unwrap_or(0);
        self.sheds[i].inc();
    }
}

#[cfg(test)]
mod tests;
