//! The admin HTTP side (docs/reference.md, "Admin HTTP"): `/healthz`, `/readyz`, `/metrics`,
//! `/snapshot`, `/policy`.
//!
//! Handlers only read: the router's snapshot and index view, the metrics registry
//! and the policy source's status. The JSON shapes are built by plain functions
//! ([`snapshot_json`], [`policy_json`]) so they are tested without a server.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::{Value, json};

use crate::adapters::body::store::TokenizerStore;
use crate::adapters::drain::Drain;
use crate::adapters::kv_events::metrics::KvEventMetrics;
use crate::adapters::metrics::Metrics;
use crate::adapters::policy_file::SourceStatus;
use crate::core::Router;
use crate::core::index::IndexView;
use crate::core::policy::{ResolvedPolicy, format_duration};
use crate::core::scope::PROBE_TENANT;
use crate::core::snapshot::PolicySnapshot;
use crate::core::tenant_report::tenant_reports;
use crate::core::time::Timestamp;

/// What the admin handlers read.
#[derive(Clone)]
pub struct AdminState {
    pub router: Arc<Router>,
    pub metrics: Arc<Metrics>,
    pub source: Arc<SourceStatus>,
    /// Where the policy comes from, for `/policy` (e.g. the `--config` path).
    pub source_name: String,
    /// Once draining, `/readyz` answers 503 whatever else holds.
    pub drain: Drain,
    /// Body mode's tokenizers: their errors are configuration errors.
    pub tokenizers: Arc<TokenizerStore>,
}

/// The admin routes.
pub fn routes(state: AdminState) -> axum::Router {
    axum::Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/snapshot", get(snapshot))
        .route("/policy", get(policy))
        .with_state(state)
}

async fn healthz() -> &'static str {
    "ok\n"
}

/// Ready when a policy snapshot is loaded, the self-test passes and the process
/// is not draining. The policy source's last error is shown even when ready (a
/// bad reload keeps the last good snapshot in force). A broken tokenizer is listed
/// under `tokenizerErrors` but does not make the sidecar unready: body requests
/// for that backend fall back to no hint (fail-open), everything else routes.
/// Neither does a fleet view lost (`fleet`, with `--fleet-nats`): without its
/// NATS the sidecar routes on its own view, as one alone does.
async fn readyz(State(s): State<AdminState>) -> Response {
    let loaded = s.source.last_good_revision();
    let self_test = s.router.self_test(Timestamp::now());
    let draining = s.drain.is_draining();
    let ready = loaded.is_some() && self_test.is_ok() && !draining;
    let body = json!({
        "ready": ready,
        "draining": draining,
        "policyLoaded": loaded.is_some(),
        "policyRevision": loaded.as_deref(),
        "policyLastError": s.source.last_error(),
        "selfTest": match &self_test { Ok(()) => "ok".to_string(), Err(e) => e.clone() },
        "tokenizerErrors": s.tokenizers.problems(),
        "fleet": s.metrics.fleet().condition(),
    });
    let code = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, Json(body)).into_response()
}

async fn metrics(State(s): State<AdminState>) -> Response {
    match s.metrics.encode() {
        Ok(text) => (
            [(
                header::CONTENT_TYPE,
                "text/plain; version=0.0.4; charset=utf-8",
            )],
            text,
        )
            .into_response(),
        Err(_) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            "metrics encoding failed\n",
        )
            .into_response(),
    }
}

async fn snapshot(State(s): State<AdminState>) -> Json<Value> {
    let now = Timestamp::now();
    let view = s.router.view(now);
    let mut body = snapshot_json(&view, &s.router.snapshot(), now);
    mark_stale(&mut body, s.metrics.kv_events());
    Json(body)
}

/// Adds `kvEventsStale` to every replica of a `/snapshot` body: true when the
/// replica's KV event stream lost batches that could not be replayed, so its
/// entries may be out of date (they are kept; see `kv_events::subscriber`).
pub fn mark_stale(body: &mut Value, kv: &KvEventMetrics) {
    let Some(replicas) = body.get_mut("replicas").and_then(Value::as_array_mut) else {
        return;
    };
    for r in replicas {
        let field = |k: &str| r.get(k).and_then(Value::as_str).unwrap_or("");
        let stale = kv.is_stale(
            field("tenant"),
            field("model"),
            field("hashScheme"),
            field("replicaId"),
        );
        if let Some(obj) = r.as_object_mut() {
            obj.insert("kvEventsStale".into(), Value::Bool(stale));
        }
    }
}

async fn policy(State(s): State<AdminState>) -> Json<Value> {
    let mut body = policy_json(&s.router.snapshot());
    add_tokenizers(&mut body, &s.tokenizers);
    body["source"] = json!({
        "name": s.source_name,
        "lastGoodRevision": s.source.last_good_revision().as_deref(),
        "loadedAt": s.source.loaded_at().map(Timestamp::to_rfc3339),
        "lastError": s.source.last_error(),
        "reloads": s.source.reload_ok_count(),
        "errors": s.source.reload_error_count(),
    });
    Json(body)
}

/// `/policy`: each backend's `tokenizer` (`path`, `state`: ready, loading or
/// error, and the `error`), and every error again under `tokenizerErrors`.
pub fn add_tokenizers(body: &mut Value, store: &TokenizerStore) {
    let described = store.describe();
    if let Some(backends) = body.get_mut("backends").and_then(Value::as_array_mut) {
        for b in backends {
            let key = (
                b["namespace"].as_str().unwrap_or("").to_string(),
                b["name"].as_str().unwrap_or("").to_string(),
            );
            let tokenizer = described
                .iter()
                .find(|(k, _, _)| *k == key)
                .map(|(_, path, state)| match state {
                    Ok(s) => json!({"path": path.display().to_string(), "state": s}),
                    Err(e) => {
                        json!({"path": path.display().to_string(), "state": "error", "error": e})
                    }
                });
            b["tokenizer"] = tokenizer.unwrap_or(Value::Null);
        }
    }
    body["tokenizerErrors"] = json!(store.problems());
}

fn rfc3339(ts: Option<Timestamp>) -> Value {
    ts.map_or(Value::Null, |t| Value::String(t.to_rfc3339()))
}

/// `/snapshot` (docs/reference.md, "Admin HTTP"). Every tenant the policy declares is listed (0 when it
/// holds nothing); the probe tenant never is; `memoryUsed` is always 0; a
/// `hitRate` is `null` until stats were reported.
pub fn snapshot_json(view: &IndexView, policy: &PolicySnapshot, now: Timestamp) -> Value {
    let replicas: Vec<Value> = view
        .replicas
        .iter()
        .filter(|r| r.tenant != PROBE_TENANT)
        .map(|r| {
            let stats = r.stats.as_ref();
            json!({
                "tenant": r.tenant,
                "replicaId": r.replica_id,
                "model": r.model,
                "hashScheme": r.hash_scheme,
                "endpoint": r.endpoint.as_deref().unwrap_or(""),
                "prefixCount": r.prefix_count,
                "lastEventAt": rfc3339(r.last_event_at),
                "statsReported": stats.is_some(),
                "inflightRequests": r.inflight_requests,
                "inflightTokens": r.inflight_tokens,
                "peerInflightRequests": r.peer_inflight_requests,
                "peerInflightTokens": r.peer_inflight_tokens,
                "recentRequests": (r.recent_requests * 100.0).round() / 100.0,
                "hitRate": stats.map(|(s, _)| s.hit_rate),
                "cacheMemoryBytes": stats.map(|(s, _)| s.cache_memory_bytes),
                "lastUpdate": rfc3339(stats.map(|(_, at)| *at)),
            })
        })
        .collect();

    let tenants: Vec<Value> = tenant_reports(view, policy)
        .into_iter()
        .map(|t| {
            json!({
                "tenant": t.tenant,
                "namespace": t.namespace.unwrap_or(""),
                "indexEntries": t.index_entries,
                "hitRate": t.hit_rate,
                "memoryUsed": 0,
            })
        })
        .collect();

    json!({
        "generatedAt": now.to_rfc3339(),
        "totalEntries": view.total_entries,
        "orphanEntries": view.orphan_entries,
        "replicas": replicas,
        "tenants": tenants,
    })
}

/// One resolved policy in CRD field names.
pub fn resolved_policy_json(p: &ResolvedPolicy) -> Value {
    json!({
        "eviction": p.eviction.as_str(),
        "evictionTTL": format_duration(p.eviction_ttl),
        "minimumPrefixTokens": p.minimum_prefix_tokens,
        "minimumMatchedTokens": p.minimum_matched_tokens,
        "routingFloorScore": p.routing_floor_score.to_string(),
        "lookupTimeoutMs": u64::try_from(p.lookup_timeout.as_millis()).unwrap_or(u64::MAX),
        "strategy": {
            "enableChainMatching": p.strategy.enable_chain_matching,
            "requireChain": p.strategy.require_chain,
            "enableTenantHot": p.strategy.enable_tenant_hot,
        },
        "affinityRouting": p.affinity_routing.as_str(),
        "loadAwareness": p.load_awareness.as_str(),
        "loadBalancing": {
            "factor": p.load_balancing.factor.to_string(),
            "slack": p.load_balancing.slack,
            "statsMaxAge": format_duration(p.load_balancing.stats_max_age),
            "pendingTTL": format_duration(p.load_balancing.pending_ttl),
            "prefillSlackTokens": p.load_balancing.prefill_slack_tokens,
            "shareFactor": p.load_balancing.share_factor.to_string(),
        },
        "tierWeights": {
            "cpu": p.tier_weights.cpu.to_string(),
            "disk": p.tier_weights.disk.to_string(),
        },
        "flowControl": {
            "enabled": p.flow_control.enabled,
            "maxQueueWait": format_duration(p.flow_control.max_queue_wait),
            "maxQueuedRequests": p.flow_control.max_queued,
            "maxPrefillBacklogTokens": p.flow_control.max_backlog_tokens,
        },
    })
}

/// `/policy`: the snapshot's revision, the server defaults, the resolved policy
/// of every namespace and the declared backends.
pub fn policy_json(snapshot: &PolicySnapshot) -> Value {
    let namespaces: Vec<Value> = snapshot
        .namespaces()
        .map(|ns| {
            json!({
                "namespace": ns.namespace,
                "tenantID": ns.tenant_id,
                "policyName": ns.policy_name,
                "maxIndexEntries": ns.max_index_entries,
                "fairWeight": ns.fair_weight,
                "policy": resolved_policy_json(&ns.policy),
            })
        })
        .collect();
    let backends: Vec<Value> = snapshot
        .backends()
        .iter()
        .map(|b| {
            json!({
                "namespace": b.namespace,
                "name": b.name,
                "tenantID": &*b.scope.tenant,
                "modelID": &*b.scope.model,
                "hashScheme": &*b.scope.hash_scheme,
                "engine": b.engine,
                "blockSize": b.block_size,
                "endpoints": b.replicas.iter()
                    .map(|r| json!({"id": r.id, "address": r.address}))
                    .collect::<Vec<_>>(),
            })
        })
        .collect();
    json!({
        "revision": &**snapshot.revision(),
        "defaults": resolved_policy_json(snapshot.defaults()),
        "namespaces": namespaces,
        "backends": backends,
    })
}

#[cfg(test)]
mod tests;
