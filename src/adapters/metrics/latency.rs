//! A latency histogram whose observation is two relaxed atomic adds: no lock, so
//! decisions on every core record their latency without meeting each other on a
//! Mutex (prometheus-client's own `Histogram` takes one per observation).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::{MetricType, TypedMetric};

/// Cumulative buckets on the wire; per-bucket counts inside.
#[derive(Clone, Debug)]
pub struct LatencyHistogram {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    /// Upper bounds in seconds, ascending, the last one `+Inf`.
    bounds: Box<[f64]>,
    /// Upper bounds in nanoseconds, parallel to `bounds` (`u64::MAX` for `+Inf`).
    bounds_nanos: Box<[u64]>,
    counts: Box<[AtomicU64]>,
    sum_nanos: AtomicU64,
}

impl LatencyHistogram {
    /// `start`, `start × factor`, … (`length` bounds) and `+Inf`.
    pub fn exponential(start: Duration, factor: f64, length: u16) -> Self {
        let mut bounds: Vec<f64> = (0..i32::from(length))
            .map(|i| start.as_secs_f64() * factor.powi(i))
            .collect();
        bounds.push(f64::INFINITY);
        let bounds_nanos = bounds
            .iter()
            .map(|&b| {
                if b.is_finite() {
                    (b * 1e9).round() as u64
                } else {
                    u64::MAX
                }
            })
            .collect();
        let counts = bounds.iter().map(|_| AtomicU64::new(0)).collect();
        Self {
            inner: Arc::new(Inner {
                bounds: bounds.into(),
                bounds_nanos,
                counts,
                sum_nanos: AtomicU64::new(0),
            }),
        }
    }

    pub fn observe(&self, elapsed: Duration) {
        let nanos = u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX);
        let i = self.inner.bounds_nanos.partition_point(|&b| b < nanos);
        // The last bound is u64::MAX, so `i` is always in range.
        if let Some(c) = self.inner.counts.get(i) {
            c.fetch_add(1, Ordering::Relaxed);
        }
        self.inner.sum_nanos.fetch_add(nanos, Ordering::Relaxed);
    }

    /// (sum in seconds, count, per-bucket counts with their upper bounds).
    fn read(&self) -> (f64, u64, Vec<(f64, u64)>) {
        let buckets: Vec<(f64, u64)> = self
            .inner
            .bounds
            .iter()
            .zip(self.inner.counts.iter())
            .map(|(&b, c)| (b, c.load(Ordering::Relaxed)))
            .collect();
        let count = buckets.iter().map(|(_, n)| n).sum();
        let sum = self.inner.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9;
        (sum, count, buckets)
    }
}

impl TypedMetric for LatencyHistogram {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for LatencyHistogram {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let (sum, count, buckets) = self.read();
        encoder.encode_histogram::<NoLabelSet>(sum, count, &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

#[cfg(test)]
mod tests;
