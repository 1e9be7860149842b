//! Leader election on a `coordination.k8s.io` Lease (`kube-lease-manager`): every
//! replica routes, but only the Lease holder writes status, so N sidecars do
//! not fight over the same status fields.
//!
//! ```text
//!  LeaseManager::watch ─ is leader? ─▶ forward ─▶ watch::Receiver<bool> (publisher)
//!         └─ ended or failed: report false, retry after a pause
//! ```

use std::time::Duration;

use kube::Client;
use kube_lease_manager::{DurationSeconds, LeaseManagerBuilder};
use tokio::sync::watch as latest;
use tracing::Instrument;

/// Which Lease to hold, and as whom.
#[derive(Clone, Debug)]
pub struct LeaseConfig {
    pub namespace: String,
    pub name: String,
    /// This replica's identity in the Lease (the pod name).
    pub identity: String,
    /// How long a Lease lasts without renewal.
    pub duration: DurationSeconds,
    /// Renewal margin before expiry.
    pub grace: DurationSeconds,
}

impl LeaseConfig {
    pub const DEFAULT_NAME: &str = "inferencecache-status";
    pub const DEFAULT_DURATION: DurationSeconds = 15;
    pub const DEFAULT_GRACE: DurationSeconds = 5;
}

/// How long to wait before trying again after the Lease could not be held.
const RETRY: Duration = Duration::from_secs(5);

/// Starts the election; the receiver says whether this replica leads now. It
/// starts false and never closes while the process runs.
pub fn elect(client: Client, config: LeaseConfig) -> latest::Receiver<bool> {
    let (tx, rx) = latest::channel(false);
    let span = tracing::info_span!("lease", namespace = %config.namespace,
        lease = %config.name, identity = %config.identity);
    tokio::spawn(async move {
        loop {
            let manager = LeaseManagerBuilder::new(client.clone(), &config.name)
                .with_namespace(&config.namespace)
                .with_identity(&config.identity)
                .with_duration(config.duration)
                .with_grace(config.grace)
                .build()
                .await;
            match manager {
                Ok(manager) => {
                    let (mut leading, task) = manager.watch().await;
                    loop {
                        let now = *leading.borrow_and_update();
                        if tx.send_replace(now) != now {
                            tracing::info!(lease = %config.name, leader = now, "leadership changed");
                        }
                        if leading.changed().await.is_err() {
                            break;
                        }
                    }
                    match task.await {
                        Ok(Err(e)) => tracing::warn!(error = %e, "lease manager stopped"),
                        Err(e) => tracing::warn!(error = %e, "lease manager task failed"),
                        Ok(Ok(_)) => {}
                    }
                }
                Err(e) => tracing::warn!(lease = %config.name, error = %e, "lease not available"),
            }
            tx.send_replace(false);
            if tx.is_closed() {
                return;
            }
            tokio::time::sleep(RETRY).await;
        }
    }.instrument(span));
    rx
}
