//! Keeps one [`Subscriber`] running per declared replica with a KV event endpoint,
//! following policy snapshots: new replicas start one, removed or changed replicas
//! stop theirs (the core drops a no-longer-declared replica's entries on
//! `Router::install`).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use super::metrics::KvEventMetrics;
use super::relay::Relay;
use super::subscriber::{Subscriber, SubscriberConfig};
use super::translate::DEFAULT_MAX_MAPPINGS;
use crate::core::Router;
use crate::core::snapshot::PolicySnapshot;
use crate::crd::data_parallel::rank_endpoint;

/// Queue depth per replica, in batches.
pub const DEFAULT_QUEUE_CAPACITY: usize = 1024;

/// The running subscribers, keyed by their whole configuration.
pub struct Subscribers {
    router: Arc<Router>,
    metrics: Arc<KvEventMetrics>,
    running: Mutex<HashMap<SubscriberConfig, Subscriber>>,
    relay: Option<Arc<dyn Relay>>,
}

impl Subscribers {
    pub fn new(router: Arc<Router>, metrics: Arc<KvEventMetrics>) -> Self {
        Self {
            router,
            metrics,
            running: Mutex::new(HashMap::new()),
            relay: None,
        }
    }

    /// Subscribers whose batches are offered to the fleet's relay first.
    pub fn with_relay(
        router: Arc<Router>,
        metrics: Arc<KvEventMetrics>,
        relay: Option<Arc<dyn Relay>>,
    ) -> Self {
        Self {
            relay,
            ..Self::new(router, metrics)
        }
    }

    /// What `snapshot` asks for: one subscriber per (backend, replica, data-parallel
    /// rank) with an endpoint; rank r's sockets are the replica's with port + r.
    pub fn wanted(snapshot: &PolicySnapshot) -> Vec<SubscriberConfig> {
        let mut out = Vec::new();
        for backend in snapshot.backends() {
            for r in &backend.replicas {
                let Some(endpoint) = &r.kv_events_endpoint else {
                    continue;
                };
                let ranks = r.data_parallel_size.max(1);
                for rank in 0..ranks {
                    let derived = rank_endpoint(endpoint, rank).and_then(|e| {
                        let replay = r
                            .kv_replay_endpoint
                            .as_deref()
                            .map(|p| rank_endpoint(p, rank))
                            .transpose()?;
                        Ok((e, replay))
                    });
                    let (endpoint, replay_endpoint) = match derived {
                        Ok(d) => d,
                        Err(why) => {
                            // Admission rejects these; a snapshot built otherwise skips the rank.
                            tracing::error!(replica = %r.id, rank, why, "KV event rank endpoint unusable");
                            continue;
                        }
                    };
                    out.push(SubscriberConfig {
                        scope: backend.scope.clone(),
                        replica_id: r.id.clone(),
                        address: r.address.clone(),
                        endpoint,
                        replay_endpoint,
                        topic: backend.kv_events_topic.clone(),
                        queue_capacity: DEFAULT_QUEUE_CAPACITY,
                        replay_timeout: Duration::from_secs(2),
                        max_mappings: DEFAULT_MAX_MAPPINGS,
                        rank,
                        ranks,
                    });
                }
            }
        }
        out
    }

    /// Starts and stops subscribers to match `snapshot` (needs a Tokio runtime).
    pub fn sync(&self, snapshot: &PolicySnapshot) {
        let wanted = Self::wanted(snapshot);
        let mut running = self.running.lock();
        running.retain(|config, _| wanted.contains(config));
        for config in wanted {
            if let std::collections::hash_map::Entry::Vacant(slot) = running.entry(config) {
                let config = slot.key().clone();
                tracing::info!(replica = %config.replica_id, rank = config.rank,
                    endpoint = %config.endpoint, scope = %config.scope, "starting KV event subscriber");
                slot.insert(Subscriber::spawn_relayed(
                    config,
                    self.router.clone(),
                    self.metrics.clone(),
                    self.relay.as_deref(),
                ));
            }
        }
    }

    /// Stops every subscriber cleanly (see [`Subscriber::close`]), all at once,
    /// within `timeout`. Returns how many did not end on their own.
    pub async fn close(&self, timeout: Duration) -> usize {
        let all: Vec<Subscriber> = self.running.lock().drain().map(|(_, s)| s).collect();
        let n = all.len();
        let clean = futures::future::join_all(all.into_iter().map(|s| s.close(timeout))).await;
        let cut = clean.iter().filter(|ok| !**ok).count();
        tracing::info!(subscribers = n, cut, "KV event subscribers closed");
        cut
    }

    /// How many subscribers run.
    pub fn len(&self) -> usize {
        self.running.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
