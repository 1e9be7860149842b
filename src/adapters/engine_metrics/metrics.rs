//! Scraper metrics (registered into the process registry by
//! [`crate::adapters::metrics::Metrics::new`]).

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Result_ {
    result: &'static str,
}

/// One replica (a declared replica, so the label set is bounded by the config).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReplicaLabels {
    pub tenant: String,
    pub model: String,
    pub replica: String,
}

/// How a scrape ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Ok,
    /// Connect, timeout, non-200 status, body too large.
    Error,
    /// The body was not the engine's metrics.
    ParseError,
}

impl Outcome {
    fn as_str(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::Error => "error",
            Self::ParseError => "parse_error",
        }
    }
}

/// Counters of every scraper and each replica's scrape age.
#[derive(Debug, Default)]
pub struct EngineMetricsMetrics {
    scrapes: Family<Result_, Counter>,
    age: Family<ReplicaLabels, Gauge<f64, AtomicU64>>,
    scrapers: Gauge,
}

impl EngineMetricsMetrics {
    /// Registers every series under `engine_scrape*`.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "engine_scrapes",
            "Engine /metrics scrapes by result: ok, error (connect, timeout, HTTP status), parse_error (not the engine's metrics)",
            self.scrapes.clone(),
        );
        registry.register(
            "engine_scrape_age_seconds",
            "Seconds since the replica's last good scrape (since its scraper started, if none yet); the load rule ignores it past statsMaxAge",
            self.age.clone(),
        );
        registry.register(
            "engine_scrapers",
            "Running engine metrics scrapers (one per replica)",
            self.scrapers.clone(),
        );
        for o in [Outcome::Ok, Outcome::Error, Outcome::ParseError] {
            let _ = self.scrapes.get_or_create(&Result_ { result: o.as_str() });
        }
    }

    pub fn scrape(&self, outcome: Outcome) {
        self.scrapes
            .get_or_create(&Result_ {
                result: outcome.as_str(),
            })
            .inc();
    }

    /// Scrapes so far with `outcome` (tests).
    pub fn scrapes(&self, outcome: Outcome) -> u64 {
        self.scrapes
            .get_or_create(&Result_ {
                result: outcome.as_str(),
            })
            .get()
    }

    pub fn set_age(&self, replica: &ReplicaLabels, seconds: f64) {
        self.age.get_or_create(replica).set(seconds);
    }

    /// The replica's scrape age, if its scraper runs (tests).
    pub fn age(&self, replica: &ReplicaLabels) -> Option<f64> {
        self.age.get(replica).map(|g| g.get())
    }

    pub fn scraper_started(&self) {
        self.scrapers.inc();
    }

    pub fn scraper_stopped(&self, replica: &ReplicaLabels) {
        self.scrapers.dec();
        self.age.remove(replica);
    }
}
