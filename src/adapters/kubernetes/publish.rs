//! Sends the statuses [`super::status`] computes: JSON merge patches on the status
//! subresources, only while this replica holds the Lease, every `period` and
//! after each rebuild. Each write is checked against the local leadership
//! deadline ([`Leadership::until`]) and abandoned when it passes mid-request, so
//! a replica cut off from the apiserver never writes once another may lead.
//!
//! ```text
//!  Observed (watch) ─┐
//!  Router::view(now) ┼─▶ status::* ─▶ differs from the object's status?
//!  leader = true ────┘                 └─ yes: PATCH …/<kind>/<name>/status
//!  CacheIndex "cluster": PATCH status every round; created first if missing
//! ```
//!
//! An object whose status already says the same is not written, so a quiet
//! cluster sees only the CacheIndex write each period. A failed write is logged
//! and retried on the next round; it never stops the others.

use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

use kube::api::{Patch, PatchParams, PostParams};
use kube::core::NamespaceResourceScope;
use kube::{Api, Client, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use tokio::sync::watch as latest;

use super::leader::Leadership;
use super::status::{self, merge_patch};
use super::watch::Observed;
use crate::core::Router;
use crate::core::time::Timestamp;
use crate::crd::cache_index::{CacheIndex, CacheIndexSpec};

/// Name of the cluster-scoped CacheIndex singleton.
pub const CACHE_INDEX_NAME: &str = "cluster";
/// How often statuses are refreshed without a change.
pub const DEFAULT_PERIOD: Duration = Duration::from_secs(10);
/// The least time between two rounds, however often the cluster changes.
const MIN_GAP: Duration = Duration::from_secs(1);

/// Writes statuses with one client.
pub struct Publisher {
    client: Client,
    router: Arc<Router>,
}

/// What one round did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Round {
    pub written: usize,
    pub unchanged: usize,
    pub failed: usize,
    /// Not written because leadership ended first.
    pub not_leading: usize,
}

impl Publisher {
    pub fn new(client: Client, router: Arc<Router>) -> Self {
        Self { client, router }
    }

    /// Writes every status that differs from what the objects carry, and the
    /// CacheIndex.
    pub async fn publish(
        &self,
        observed: &Observed,
        leadership: &Leadership,
        now: Timestamp,
    ) -> Round {
        let view = self.router.view(now);
        let snapshot = self.router.snapshot();
        let at = status::time(now);
        let v = &observed.verdicts;
        let mut round = Round::default();
        for p in &observed.objects.policies {
            let s = status::policy_status(p, v, &at);
            self.write(p.as_ref(), &p.status, &s, leadership, &mut round)
                .await;
        }
        for t in &observed.objects.tenants {
            let s = status::tenant_status(t, v, &view, &at);
            self.write(t.as_ref(), &t.status, &s, leadership, &mut round)
                .await;
        }
        for b in &observed.objects.backends {
            let s = status::backend_status(b, v, &snapshot, &view, &at);
            self.write(b.as_ref(), &b.status, &s, leadership, &mut round)
                .await;
        }
        for t in &observed.templates {
            let s = status::template_status(t, &at);
            self.write(t.as_ref(), &t.status, &s, leadership, &mut round)
                .await;
        }
        for t in &observed.topologies {
            let s = status::topology_status(t, &at);
            self.write(t.as_ref(), &t.status, &s, leadership, &mut round)
                .await;
        }
        let index = status::cache_index_status(&view, &snapshot, now);
        let Some(until) = leadership.until() else {
            round.not_leading += 1;
            return round;
        };
        match tokio::time::timeout_at(until, self.write_cache_index(&index)).await {
            Err(_) => round.not_leading += 1,
            Ok(Ok(())) => round.written += 1,
            Ok(Err(e)) => {
                round.failed += 1;
                tracing::warn!(error = %e, "CacheIndex status not written");
            }
        }
        round
    }

    /// Patches one namespaced object's status if it differs.
    async fn write<K, S>(
        &self,
        obj: &K,
        current: &Option<S>,
        desired: &S,
        leadership: &Leadership,
        round: &mut Round,
    ) where
        K: Resource<DynamicType = (), Scope = NamespaceResourceScope>
            + Clone
            + DeserializeOwned
            + Debug,
        S: Serialize + PartialEq,
    {
        if current.as_ref() == Some(desired) {
            round.unchanged += 1;
            return;
        }
        let current = current.as_ref().and_then(|c| serde_json::to_value(c).ok());
        let Ok(desired) = serde_json::to_value(desired) else {
            round.failed += 1;
            return;
        };
        let body = merge_patch(current.as_ref(), desired);
        let ns = obj.namespace().unwrap_or_default();
        let name = obj.name_any();
        let api: Api<K> = Api::namespaced(self.client.clone(), &ns);
        let Some(until) = leadership.until() else {
            round.not_leading += 1;
            return;
        };
        let (params, body) = (PatchParams::default(), Patch::Merge(&body));
        let patch = api.patch_status(&name, &params, &body);
        let Ok(written) = tokio::time::timeout_at(until, patch).await else {
            round.not_leading += 1;
            return;
        };
        match written {
            Ok(_) => round.written += 1,
            // Deleted since the rebuild: nothing to report on.
            Err(kube::Error::Api(e)) if e.code == 404 => round.unchanged += 1,
            Err(e) => {
                round.failed += 1;
                tracing::warn!(kind = %K::kind(&()), namespace = %ns, name = %name,
                    error = %e, "status not written");
            }
        }
    }

    /// Patches the CacheIndex status, creating the singleton when it is missing.
    async fn write_cache_index(
        &self,
        status: &crate::crd::cache_index::CacheIndexStatus,
    ) -> Result<(), kube::Error> {
        let api: Api<CacheIndex> = Api::all(self.client.clone());
        // Every key of the status, so a list that became empty is cleared.
        let every_key = json!({"generatedAt": null, "totalEntries": 0, "replicas": [],
                               "tenants": [], "conditions": [], "observedGeneration": null});
        let desired = serde_json::to_value(status).unwrap_or(Value::Null);
        let body = merge_patch(Some(&every_key), desired);
        let params = PatchParams::default();
        match api
            .patch_status(CACHE_INDEX_NAME, &params, &Patch::Merge(&body))
            .await
        {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(e)) if e.code == 404 => {
                let singleton = CacheIndex::new(CACHE_INDEX_NAME, CacheIndexSpec {});
                api.create(&PostParams::default(), &singleton).await?;
                api.patch_status(CACHE_INDEX_NAME, &params, &Patch::Merge(&body))
                    .await
                    .map(|_| ())
            }
            Err(e) => Err(e),
        }
    }
}

/// Publishes while this replica leads: every `period`, after each rebuild, and
/// as soon as leadership is gained. Ends when the watch side is gone.
pub async fn run(
    publisher: Publisher,
    mut observed: latest::Receiver<Arc<Observed>>,
    mut leadership: Leadership,
    period: Duration,
) {
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            changed = observed.changed() => if changed.is_err() { return },
            changed = leadership.changed() => if changed.is_err() { return },
        }
        if !leadership.leads() {
            continue;
        }
        let current = observed.borrow_and_update().clone();
        // Nothing observed yet (first rebuild pending): no status to write.
        if current.revision.is_empty() {
            continue;
        }
        let round = publisher
            .publish(&current, &leadership, Timestamp::now())
            .await;
        tracing::debug!(?round, "statuses published");
        // Rebuilds can come 10 times a second during a rollout; statuses need not.
        tokio::time::sleep(MIN_GAP.min(period)).await;
    }
}

#[cfg(test)]
mod tests;
