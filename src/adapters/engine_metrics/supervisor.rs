//! Keeps one [`Scraper`] running per declared replica of a backend with scraping
//! on, following policy snapshots and `spec.metrics` changes: new replicas start
//! one, removed or changed replicas stop theirs (as the KV event subscribers do).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use super::metrics::EngineMetricsMetrics;
use super::scraper::Scraper;
use super::{ScrapeConfig, Specs};
use crate::core::Router;
use crate::core::snapshot::PolicySnapshot;

/// The running scrapers, keyed by their whole configuration.
pub struct Scrapers {
    router: Arc<Router>,
    metrics: Arc<EngineMetricsMetrics>,
    specs: Arc<Specs>,
    running: Mutex<HashMap<ScrapeConfig, Scraper>>,
}

impl Scrapers {
    pub fn new(router: Arc<Router>, metrics: Arc<EngineMetricsMetrics>, specs: Arc<Specs>) -> Self {
        Self {
            router,
            metrics,
            specs,
            running: Mutex::new(HashMap::new()),
        }
    }

    /// Starts and stops scrapers to match `snapshot` and the current specs
    /// (needs a Tokio runtime).
    pub fn sync(&self, snapshot: &PolicySnapshot) {
        let wanted = self.specs.wanted(snapshot);
        let mut running = self.running.lock();
        running.retain(|config, _| wanted.contains(config));
        for config in wanted {
            if let std::collections::hash_map::Entry::Vacant(slot) = running.entry(config) {
                let config = slot.key().clone();
                tracing::info!(replica = %config.replica_id, url = %config.url,
                    scope = %config.scope, interval = ?config.interval,
                    "starting engine metrics scraper");
                slot.insert(Scraper::spawn(
                    config,
                    self.router.clone(),
                    self.metrics.clone(),
                ));
            }
        }
    }

    /// How many scrapers run.
    pub fn len(&self) -> usize {
        self.running.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The running configurations (tests, `/policy`-like inspection).
    pub fn configs(&self) -> Vec<ScrapeConfig> {
        self.running.lock().keys().cloned().collect()
    }
}

/// Re-syncs the scrapers whenever the installed snapshot's revision or the
/// backends' `spec.metrics` change.
pub async fn follow(router: Arc<Router>, scrapers: Arc<Scrapers>) {
    let mut seen: Option<(Arc<str>, u64)> = None;
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let snapshot = router.snapshot();
        let now = (snapshot.revision().clone(), scrapers.specs.generation());
        if seen.as_ref() != Some(&now) {
            scrapers.sync(&snapshot);
            seen = Some(now);
        }
    }
}
