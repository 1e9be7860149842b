//! Fleet sync: several sidecars route as one. Each publishes the routing facts
//! it keeps for its own routes (routed, prefill ended, released; heartbeats;
//! leave on shutdown) on core NATS subjects under `<fleet-name>.`, and folds its
//! peers' facts into the same load signals it keeps for its own routes, so every
//! decision sees the fleet's traffic as it happens instead of a scrape later.
//!
//! ```text
//!  Router::admit ─▶ SharedRoute ─▶ publisher (bounded queue ─▶ task) ─▶ NATS
//!  NATS ─▶ subscriber (subject, wire, peer checks) ─▶ Router::apply_peer ─▶ PeerLedger
//!                                                      └─▶ ReplicaLoad (peer counts)
//! ```
//!
//! The routing path never waits on NATS: facts go through a bounded queue that
//! drops when full. NATS down or unreachable (at start or later): the sidecar
//! routes on its own view, as one alone does, and says so (`/readyz` `fleet`,
//! `inferencecache_fleet_connected`); the client reconnects by itself and the
//! peers' state rebuilds from their next messages.
//!
//! Engine KV events enter the fleet once, through JetStream: the sidecar
//! holding an engine's lease relays what its ZMQ subscriber reads onto the
//! stream `<fleet-name>-kv` ([`relay`]), every sidecar applies the stream to its
//! index ([`index_stream`]), and one writes the fleet's index as a snapshot
//! every `--fleet-snapshot-interval` ([`index_log`]), from which a new sidecar
//! starts warm before it reads the stream on.
//!
//! ```text
//!  engine ZMQ ─▶ subscriber (every sidecar) ─▶ relay: lease holder publishes (fenced)
//!  stream <fleet>.kv.* ─▶ index_stream ─▶ Router::ingest + IndexLog ─▶ snapshot
//! ```
//!
//! [`wire`] and [`kv_wire`] are the message formats, [`subjects`] the subject
//! names, [`transport`] the connection, [`publisher`] and [`subscriber`] the two
//! directions of the routing facts, [`metrics`] what is counted.

pub mod index_log;
pub mod index_stream;
pub mod kv_wire;
pub mod metrics;
pub mod publisher;
pub mod relay;
pub mod subjects;
pub mod subscriber;
pub mod transport;
pub mod wire;

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio::task::JoinHandle;

use crate::core::Router;
use metrics::FleetMetrics;
use publisher::Leave;
use subjects::{Subjects, check_token};
pub use transport::NatsAccess;

/// `--fleet-name` when not given.
pub const DEFAULT_NAME: &str = "inferencecache";

/// One sidecar's fleet sync settings.
#[derive(Clone, Debug)]
pub struct FleetConfig {
    pub access: NatsAccess,
    /// This sidecar's id in the fleet (one subject token).
    pub id: String,
    /// The fleet's name: namespaces every subject.
    pub name: String,
    /// Engine KV events through the fleet's stream (one relay per engine), or
    /// each sidecar's own ZMQ subscription only.
    pub relay_kv_events: bool,
    /// How often the fleet's index snapshot is written.
    pub snapshot_interval: Duration,
}

/// `--fleet-id` when not given: `$POD_NAME`, else `$HOSTNAME`, else the
/// kernel's host name, made into a subject token.
pub fn default_id() -> String {
    let name = ["POD_NAME", "HOSTNAME"]
        .iter()
        .find_map(|v| std::env::var(v).ok().filter(|s| !s.trim().is_empty()))
        .or_else(|| {
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .ok()
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
        })
        .unwrap_or_else(|| "inferencecache".to_string());
    subjects::token_from(name.trim())
}

/// The running fleet sync.
pub struct FleetSync {
    leave: Leave,
    publisher: JoinHandle<()>,
    subscriber: JoinHandle<()>,
    relay: Option<(relay::KvRelay, [JoinHandle<()>; 2])>,
}

/// Joins the fleet: checks the settings (a bad id, name or auth file is an
/// error), then connects in the background and returns at once, NATS
/// reachable or not.
pub async fn start(
    config: &FleetConfig,
    router: Arc<Router>,
    metrics: Arc<FleetMetrics>,
) -> anyhow::Result<FleetSync> {
    check_token(&config.id).with_context(|| format!("--fleet-id {:?}", config.id))?;
    check_token(&config.name).with_context(|| format!("--fleet-name {:?}", config.name))?;
    let subjects = Subjects::new(&config.name);
    let client_name = format!("inferencecache {}/{}", config.name, config.id);
    let client = transport::connect(
        &config.access,
        &client_name,
        router.clone(),
        metrics.clone(),
    )
    .await?;
    metrics.enable();
    let (publisher, outbox) =
        publisher::queue(&config.id, subjects.routes_of(&config.id), metrics.clone());
    if !router.join_fleet(&config.id, Arc::new(publisher)) {
        anyhow::bail!("this router is already in a fleet");
    }
    let (leave, publisher) = outbox.run(client.clone(), Duration::from_secs(1));
    let subscription = subscriber::subscribe(&client, &subjects).await?;
    let subscriber = tokio::spawn(subscriber::run(
        subscription,
        router.clone(),
        subjects.clone(),
        config.id.clone(),
        metrics.clone(),
    ));
    if config.relay_kv_events {
        metrics.enable_kv_stream();
    }
    let relay = config.relay_kv_events.then(|| {
        let epoch = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
        let (relay, publishing) =
            relay::KvRelay::start(&config.id, epoch, subjects, client.clone(), metrics);
        let stream = tokio::spawn(index_stream::run(
            relay.shared().clone(),
            router,
            Arc::new(tokio::sync::Mutex::new(index_log::IndexLog::default())),
            config.snapshot_interval,
        ));
        (relay, [publishing, stream])
    });
    tracing::info!(fleet = %config.name, id = %config.id, nats = %config.access.url,
        relay_kv_events = config.relay_kv_events, "fleet sync on");
    Ok(FleetSync {
        leave,
        publisher,
        subscriber,
        relay,
    })
}

impl FleetSync {
    /// What the engine KV event subscribers offer their batches to (`None`
    /// when each sidecar follows its engines on its own).
    pub fn kv_relay(&self) -> Option<Arc<dyn crate::adapters::kv_events::relay::Relay>> {
        self.relay
            .as_ref()
            .map(|(r, _)| Arc::new(r.clone()) as Arc<dyn crate::adapters::kv_events::relay::Relay>)
    }

    /// Leaves the fleet: publishes Leave (the peers release this sidecar's
    /// routes at once) and stops, within `timeout`.
    pub async fn leave(self, timeout: Duration) {
        self.leave.send();
        let mut publisher = self.publisher;
        if tokio::time::timeout(timeout, &mut publisher).await.is_err() {
            publisher.abort();
        }
        self.subscriber.abort();
        // The relay's tasks stop with the process: the KV subscribers, closed
        // after this, still hand their engines' leases back.
    }

    /// Stops at once, without a word to the peers (they expire this sidecar).
    pub fn abort(&self) {
        self.publisher.abort();
        self.subscriber.abort();
        if let Some((_, tasks)) = &self.relay {
            for t in tasks {
                t.abort();
            }
        }
    }
}

#[cfg(test)]
mod tests;
