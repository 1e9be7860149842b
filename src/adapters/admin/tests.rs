use super::*;
use crate::core::index::{IndexConfig, IndexEvent, IngestBatch, ReplicaStats, StatsReport};
use crate::core::scope::ScopeRef;
use crate::core::snapshot::NamespacePolicy;

fn mk_router() -> (Router, Timestamp) {
    let now = Timestamp::from_secs(1_700_000_000);
    let ns = NamespacePolicy {
        namespace: "team-a".into(),
        tenant_id: Some("acme".into()),
        policy_name: Some("default".into()),
        policy: Arc::new(ResolvedPolicy::default()),
        max_index_entries: Some(100),
        fair_weight: None,
    };
    let snap = PolicySnapshot::new(ResolvedPolicy::default(), vec![ns], vec![]);
    let router = Router::new(IndexConfig::default(), snap, now);
    let scope = ScopeRef::new("acme", "llama", "vllm");
    let events = [IndexEvent::Stored {
        parent: None,
        hashes: vec![1, 2, 3],
        token_counts: vec![],
    }];
    let batch = IngestBatch {
        scope,
        replica_id: "r1",
        endpoint: "127.0.0.1:8001",
        events: &events,
    };
    router.ingest(&batch, now).unwrap();
    let report = StatsReport {
        scope,
        replica_id: "r1",
        endpoint: "127.0.0.1:8001",
        stats: ReplicaStats {
            hit_rate: 0.25,
            cache_memory_bytes: 4096,
            ..ReplicaStats::default()
        },
    };
    router.report_stats(&report, now).unwrap();
    // A prefix-only replica without stats, in another tenant.
    let batch = IngestBatch {
        scope: ScopeRef::new("other", "llama", "vllm"),
        replica_id: "p1",
        endpoint: "",
        events: &events,
    };
    router.ingest(&batch, now).unwrap();
    router.self_test(now).unwrap();
    (router, now)
}

#[test]
fn snapshot_has_the_contract_shape() {
    let (router, now) = mk_router();
    let v = snapshot_json(&router.view(now), &router.snapshot(), now);
    assert_eq!(v["generatedAt"], "2023-11-14T22:13:20.000Z");
    assert_eq!(v["totalEntries"], 6);
    assert_eq!(v["orphanEntries"], 0);
    let replicas = v["replicas"].as_array().unwrap();
    assert_eq!(replicas.len(), 2, "{v}");
    let r1 = replicas.iter().find(|r| r["replicaId"] == "r1").unwrap();
    assert_eq!(r1["tenant"], "acme");
    assert_eq!(r1["model"], "llama");
    assert_eq!(r1["hashScheme"], "vllm");
    assert_eq!(r1["endpoint"], "127.0.0.1:8001");
    assert_eq!(r1["prefixCount"], 3);
    assert_eq!(r1["statsReported"], true);
    assert_eq!(r1["hitRate"], 0.25);
    assert_eq!(r1["cacheMemoryBytes"], 4096);
    assert!(r1["lastEventAt"].is_string());
    assert!(r1["lastUpdate"].is_string());
    let p1 = replicas.iter().find(|r| r["replicaId"] == "p1").unwrap();
    assert_eq!(p1["endpoint"], "");
    assert_eq!(p1["statsReported"], false);
    assert!(
        p1["hitRate"].is_null() && p1["cacheMemoryBytes"].is_null() && p1["lastUpdate"].is_null()
    );

    let tenants = v["tenants"].as_array().unwrap();
    let acme = tenants.iter().find(|t| t["tenant"] == "acme").unwrap();
    assert_eq!(acme["namespace"], "team-a");
    assert_eq!(acme["indexEntries"], 3);
    assert_eq!(acme["hitRate"], 0.25);
    assert_eq!(acme["memoryUsed"], 0);
    let other = tenants.iter().find(|t| t["tenant"] == "other").unwrap();
    assert_eq!(other["namespace"], "");
    assert!(other["hitRate"].is_null());
    let text = v.to_string();
    assert!(!text.contains(PROBE_TENANT), "probe leaked: {text}");
}

#[test]
fn replicas_whose_kv_events_were_lost_are_marked_stale() {
    let (router, now) = mk_router();
    let mut v = snapshot_json(&router.view(now), &router.snapshot(), now);
    let kv = KvEventMetrics::default();
    let key = ("acme".into(), "llama".into(), "vllm".into(), "r1".into(), 0);
    kv.set_stale(&key, true);
    mark_stale(&mut v, &kv);
    let replicas = v["replicas"].as_array().unwrap();
    let r1 = replicas.iter().find(|r| r["replicaId"] == "r1").unwrap();
    let p1 = replicas.iter().find(|r| r["replicaId"] == "p1").unwrap();
    assert_eq!(
        (&r1["kvEventsStale"], &p1["kvEventsStale"]),
        (&json!(true), &json!(false))
    );
    // The other keys are untouched.
    assert_eq!(r1["prefixCount"], 3);
    kv.set_stale(&key, false);
    mark_stale(&mut v, &kv);
    assert_eq!(v["replicas"][0]["kvEventsStale"], false);
    assert_eq!(v["replicas"][1]["kvEventsStale"], false);
}

#[test]
fn declared_tenants_are_listed_even_when_empty() {
    let now = Timestamp::from_secs(1);
    let ns = NamespacePolicy {
        namespace: "team-b".into(),
        tenant_id: Some("beta".into()),
        policy_name: None,
        policy: Arc::new(ResolvedPolicy::default()),
        max_index_entries: None,
        fair_weight: None,
    };
    let snap = PolicySnapshot::new(ResolvedPolicy::default(), vec![ns], vec![]);
    let router = Router::new(IndexConfig::default(), snap, now);
    let v = snapshot_json(&router.view(now), &router.snapshot(), now);
    assert_eq!(v["tenants"][0]["tenant"], "beta");
    assert_eq!(v["tenants"][0]["indexEntries"], 0);
    assert_eq!(v["replicas"].as_array().map(Vec::len), Some(0));
}

#[test]
fn policy_shows_resolved_fields_per_namespace() {
    let (router, _) = mk_router();
    let v = policy_json(&router.snapshot());
    assert_eq!(v["revision"], &**router.snapshot().revision());
    let ns = &v["namespaces"][0];
    assert_eq!(ns["namespace"], "team-a");
    assert_eq!(ns["tenantID"], "acme");
    assert_eq!(ns["maxIndexEntries"], 100);
    let p = &ns["policy"];
    assert_eq!(p["eviction"], "lru");
    assert_eq!(p["evictionTTL"], "10m");
    assert_eq!(p["minimumMatchedTokens"], 64);
    assert_eq!(p["routingFloorScore"], "0.1");
    assert_eq!(p["strategy"]["enableChainMatching"], true);
    assert_eq!(p["affinityRouting"], "Enabled");
    assert_eq!(p["tierWeights"]["cpu"], "0.8");
    assert_eq!(p["tierWeights"]["disk"], "0.25");
    assert_eq!(p["flowControl"]["enabled"], false);
    assert_eq!(p["flowControl"]["maxQueueWait"], "1s");
    assert_eq!(p["flowControl"]["maxQueuedRequests"], 1024);
    assert_eq!(ns["fairWeight"], serde_json::Value::Null);
    assert_eq!(v["defaults"]["lookupTimeoutMs"], 0);
}

#[tokio::test]
async fn readyz_goes_false_once_draining() {
    let (router, now) = mk_router();
    let router = Arc::new(router);
    let source = Arc::new(SourceStatus::new());
    source.record_success(router.snapshot().revision().clone(), now);
    let drain = Drain::new();
    let state = AdminState {
        metrics: Arc::new(Metrics::new(router.clone(), source.clone())),
        router,
        source,
        source_name: "test".into(),
        drain: drain.clone(),
        tokenizers: Arc::default(),
    };
    let before = readyz(State(state.clone())).await;
    assert_eq!(before.status(), StatusCode::OK);
    drain.start();
    let after = readyz(State(state)).await;
    assert_eq!(after.status(), StatusCode::SERVICE_UNAVAILABLE);
    let body = axum::body::to_bytes(after.into_body(), 1 << 20)
        .await
        .unwrap();
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["ready"], false);
    assert_eq!(v["draining"], true);
    assert_eq!(v["selfTest"], "ok");
}

#[tokio::test]
async fn a_broken_tokenizer_is_a_configuration_error_but_not_unready() {
    use crate::crd::cache_backend::CacheBackend;
    let (router, now) = mk_router();
    let router = Arc::new(router);
    let source = Arc::new(SourceStatus::new());
    source.record_success(router.snapshot().revision().clone(), now);
    let dir = std::env::temp_dir().join(format!("ic-admin-tok-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let backend: CacheBackend = serde_json::from_value(serde_json::json!({
        "apiVersion": "inferencecache.io/v1alpha1", "kind": "CacheBackend",
        "metadata": {"name": "be", "namespace": "a"},
        "spec": {"engine": "vLLM", "modelID": "m", "hashScheme": "ic-content-v1",
                 "tokenizer": {"path": dir.display().to_string()}},
    }))
    .unwrap();
    let tokenizers = Arc::new(crate::adapters::body::store::TokenizerStore::default());
    tokenizers.set([&backend]);
    tokenizers.refresh();
    let state = AdminState {
        metrics: Arc::new(Metrics::new(router.clone(), source.clone())),
        router,
        source,
        source_name: "test".into(),
        drain: Drain::new(),
        tokenizers: tokenizers.clone(),
    };
    let r = readyz(State(state.clone())).await;
    assert_eq!(r.status(), StatusCode::OK);
    let body = axum::body::to_bytes(r.into_body(), 1 << 20).await.unwrap();
    let v: Value = serde_json::from_slice(&body).unwrap();
    let errors = v["tokenizerErrors"].as_array().unwrap();
    assert_eq!(errors.len(), 1, "{v}");
    let text = errors[0].as_str().unwrap();
    assert!(
        text.contains("CacheBackend a/be") && text.contains("tokenizer.json"),
        "{text}"
    );
    let mut policy =
        json!({"backends": [{"namespace": "a", "name": "be"}, {"namespace": "a", "name": "x"}]});
    add_tokenizers(&mut policy, &tokenizers);
    assert_eq!(policy["backends"][0]["tokenizer"]["state"], "error");
    assert_eq!(policy["backends"][1]["tokenizer"], Value::Null);
    assert_eq!(policy["tokenizerErrors"].as_array().unwrap().len(), 1);
    let _ = std::fs::remove_dir_all(&dir);
}
