use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde_json::{Value, json};

use super::*;
use crate::crd::cache_backend::CacheBackend;

fn mk<T: serde::de::DeserializeOwned>(
    kind: &str,
    ns: &str,
    name: &str,
    age: Option<i64>,
    spec: Value,
) -> T {
    let mut meta = json!({"name": name, "namespace": ns});
    if let Some(secs) = age {
        let ts = jiff::Timestamp::from_second(1_700_000_000 + secs).unwrap();
        meta["creationTimestamp"] = serde_json::to_value(Time(ts)).unwrap();
    }
    serde_json::from_value(json!({
        "apiVersion": "inferencecache.io/v1alpha1", "kind": kind, "metadata": meta, "spec": spec,
    }))
    .unwrap()
}

fn policy(ns: &str, name: &str, age: Option<i64>, spec: Value) -> CachePolicy {
    mk("CachePolicy", ns, name, age, spec)
}

fn tenant(ns: &str, name: &str, age: Option<i64>, id: &str) -> CacheTenant {
    mk("CacheTenant", ns, name, age, json!({"tenantID": id}))
}

fn backend(ns: &str, name: &str, spec: Value) -> CacheBackend {
    mk("CacheBackend", ns, name, None, spec)
}

fn messages(r: &Resolution) -> Vec<String> {
    r.rejected.iter().map(ToString::to_string).collect()
}

#[test]
fn tenant_resolves_to_its_namespace_policy() {
    let r = resolve(
        &[policy(
            "team-a",
            "p",
            None,
            json!({"eviction": "LFU", "minimumMatchedTokens": 0,
            "routingFloorScore": "0", "lookupTimeoutMs": 5, "evictionTTL": "90s",
            "affinityRouting": "Disabled", "strategy": {"requireChain": true}}),
        )],
        &[tenant("team-a", "t", None, "acme")],
        &[],
    );
    assert!(r.rejected.is_empty() && r.ignored.is_empty(), "{r:?}");
    let view = r.snapshot.tenant("acme");
    assert_eq!(view.namespace, Some("team-a"));
    let p = view.policy;
    assert_eq!(p.eviction, EvictionAlgorithm::Lfu);
    assert_eq!(p.eviction_ttl, Duration::from_secs(90));
    assert_eq!(p.minimum_matched_tokens, 0);
    assert_eq!(p.routing_floor_score.value(), 0.0);
    assert_eq!(p.lookup_timeout, Duration::from_millis(5));
    assert!(p.strategy.require_chain);
    assert_eq!(p.affinity_routing, AffinityRouting::Disabled);
    let ns = r.snapshot.namespace("team-a").unwrap();
    assert_eq!(ns.policy_name.as_deref(), Some("p"));
}

#[test]
fn tenant_without_policy_gets_server_defaults() {
    let mut t = tenant("team-b", "t", None, "beta");
    t.spec.quota = Some(crate::crd::cache_tenant::TenantQuota {
        max_index_entries: Some(100),
    });
    let r = resolve(&[], &[t], &[]);
    let ns = r.snapshot.namespace("team-b").unwrap();
    assert_eq!(ns.policy_name, None);
    assert_eq!(*ns.policy, ResolvedPolicy::default());
    assert_eq!(r.snapshot.tenant("beta").max_index_entries, Some(100));
}

#[test]
fn oldest_policy_wins_and_the_others_are_ignored() {
    let r = resolve(
        &[
            policy(
                "team-a",
                "newer",
                Some(20),
                json!({"minimumMatchedTokens": 1}),
            ),
            policy(
                "team-a",
                "older",
                Some(10),
                json!({"minimumMatchedTokens": 2}),
            ),
            policy(
                "team-a",
                "undated",
                None,
                json!({"minimumMatchedTokens": 3}),
            ),
        ],
        &[tenant("team-a", "t", None, "acme")],
        &[],
    );
    assert_eq!(r.snapshot.tenant("acme").policy.minimum_matched_tokens, 2);
    let ignored: Vec<_> = r.ignored.iter().map(|i| i.name.as_str()).collect();
    assert_eq!(ignored, ["newer", "undated"]);
    assert!(r.ignored[0].reason.contains("team-a/older"));
    assert_eq!(r.ignored[0].kind, "CachePolicy");
}

#[test]
fn without_timestamps_the_name_decides() {
    let r = resolve(
        &[],
        &[
            tenant("ns", "b", None, "second"),
            tenant("ns", "a", None, "first"),
        ],
        &[],
    );
    assert_eq!(r.snapshot.namespace_of("first"), Some("ns"));
    assert_eq!(r.snapshot.namespace_of("second"), None);
    assert_eq!(r.ignored.len(), 1);
}

#[test]
fn a_tenant_id_claimed_twice_is_rejected_for_the_later_claim() {
    let r = resolve(
        &[],
        &[
            tenant("late", "t", Some(50), "acme"),
            tenant("early", "t", Some(1), "acme"),
        ],
        &[],
    );
    assert_eq!(r.snapshot.namespace_of("acme"), Some("early"));
    assert_eq!(
        messages(&r),
        [
            r#"CacheTenant late/t: spec.tenantID: tenant id "acme" is already claimed by CacheTenant early/t"#
        ]
    );
    assert_eq!(r.snapshot.namespace("late").unwrap().tenant_id, None);
}

#[test]
fn probe_and_empty_tenant_ids_are_rejected() {
    let r = resolve(
        &[],
        &[
            tenant("a", "t", None, PROBE_TENANT),
            tenant("b", "t", None, ""),
        ],
        &[],
    );
    let m = messages(&r);
    assert!(
        m[0].starts_with("CacheTenant a/t: spec.tenantID:") && m[0].contains("reserved"),
        "{m:?}"
    );
    assert_eq!(m[1], "CacheTenant b/t: spec.tenantID: must be non-empty");
    assert_eq!(r.snapshot.namespace_of(PROBE_TENANT), None);
}

#[test]
fn invalid_policy_fields_are_named_and_the_namespace_keeps_defaults() {
    let r = resolve(
        &[policy(
            "team-a",
            "default",
            None,
            json!({"routingFloorScore": "-1",
            "evictionTTL": "ten minutes", "minimumPrefixTokens": -3}),
        )],
        &[tenant("team-a", "t", None, "acme")],
        &[],
    );
    let m = messages(&r);
    assert!(m.contains(&r#"CachePolicy team-a/default: spec.routingFloorScore: "-1" is not a non-negative decimal (e.g. "0.1", "5", "0")"#.to_string()), "{m:?}");
    assert!(
        m.iter()
            .any(|e| e.starts_with("CachePolicy team-a/default: spec.evictionTTL:"))
    );
    assert!(
        m.contains(
            &"CachePolicy team-a/default: spec.minimumPrefixTokens: -3 is below the minimum 0"
                .to_string()
        )
    );
    let ns = r.snapshot.namespace("team-a").unwrap();
    assert_eq!(ns.policy_name, None);
    assert_eq!(*ns.policy, ResolvedPolicy::default());
}

#[test]
fn cross_field_policy_rules_are_enforced() {
    let bad = |spec: Value| resolve_policy(&policy("n", "p", None, spec).spec).unwrap_err();
    let e = bad(json!({"strategy": {"requireChain": true, "enableChainMatching": false}}));
    assert_eq!(e[0].0, "spec.strategy.requireChain");
    let e = bad(json!({"evictionTTL": "0s"}));
    assert_eq!(
        e,
        [("spec.evictionTTL", "must be greater than zero".to_string())]
    );
}

#[test]
fn backend_gets_its_namespace_scope_and_static_replicas() {
    let r = resolve(
        &[],
        &[tenant("team-a", "t", None, "acme")],
        &[backend(
            "team-a",
            "llama",
            json!({
                "engine": "vLLM", "modelID": "m", "hashScheme": "s", "blockSize": 32,
                "kvEvents": {"port": 5557, "replayPort": 5558, "topic": "kv"},
                "endpoints": [
                    {"id": "r1", "address": "10.0.0.1:8000"},
                    {"id": "r2", "address": "10.0.0.2:8000", "kvEventsEndpoint": "tcp://10.9.9.9:6000"},
                ],
            }),
        )],
    );
    assert!(r.rejected.is_empty(), "{:?}", r.rejected);
    let b = &r.snapshot.backends()[0];
    assert_eq!(b.scope.to_string(), "acme/m/s");
    assert_eq!(
        (b.engine.as_str(), b.block_size, b.kv_events_topic.as_str()),
        ("vLLM", 32, "kv")
    );
    assert_eq!(
        b.replicas[0].kv_events_endpoint.as_deref(),
        Some("tcp://10.0.0.1:5557")
    );
    assert_eq!(
        b.replicas[0].kv_replay_endpoint.as_deref(),
        Some("tcp://10.0.0.1:5558")
    );
    assert_eq!(
        b.replicas[1].kv_events_endpoint.as_deref(),
        Some("tcp://10.9.9.9:6000")
    );
    assert_eq!(
        b.replicas[1].kv_replay_endpoint.as_deref(),
        Some("tcp://10.9.9.9:5558")
    );
}

#[test]
fn data_parallel_sizes_and_own_replay_endpoints_reach_the_snapshot() {
    let r = resolve(
        &[],
        &[tenant("team-a", "t", None, "acme")],
        &[backend(
            "team-a",
            "llama",
            json!({
                "engine": "vLLM", "modelID": "m", "hashScheme": "s", "dataParallelSize": 4,
                "kvEvents": {"port": 5557, "replayPort": 5558},
                "endpoints": [
                    {"id": "r1", "address": "10.0.0.1:8000"},
                    {"id": "r2", "address": "10.0.0.2:8000", "dataParallelSize": 1,
                     "kvEventsEndpoint": "tcp://10.9.9.9:6000",
                     "kvReplayEndpoint": "tcp://10.9.9.8:7000"},
                ],
            }),
        )],
    );
    assert!(r.rejected.is_empty(), "{:?}", r.rejected);
    let b = &r.snapshot.backends()[0];
    assert_eq!(b.replicas[0].data_parallel_size, 4);
    assert_eq!(b.replicas[1].data_parallel_size, 1);
    assert_eq!(
        b.replicas[1].kv_replay_endpoint.as_deref(),
        Some("tcp://10.9.9.8:7000")
    );
    // The last rank would publish above port 65535: rejected, by field.
    let r = resolve(
        &[],
        &[tenant("team-a", "t", None, "acme")],
        &[backend(
            "team-a",
            "llama",
            json!({
                "engine": "vLLM", "modelID": "m", "hashScheme": "s", "dataParallelSize": 8,
                "kvEvents": {"port": 65530},
                "endpoints": [{"id": "r1", "address": "10.0.0.1:8000"}],
            }),
        )],
    );
    assert!(r.snapshot.backends().is_empty());
    let m = messages(&r);
    assert!(
        m[0].starts_with("CacheBackend team-a/llama: spec.kvEvents.port: 65530 + data-parallel ranks reaches port 65537"),
        "{m:?}"
    );
}

#[test]
fn backend_without_tenant_or_with_bad_endpoints_is_rejected() {
    let spec = json!({"engine": "SGLang", "modelID": "m", "hashScheme": "s",
        "endpoints": [{"id": "r", "address": "nohost"}, {"id": "r", "address": "h:1"}]});
    let r = resolve(
        &[],
        &[tenant("team-a", "t", None, "acme")],
        &[
            backend(
                "orphan",
                "b",
                json!({"engine": "vLLM", "modelID": "m", "hashScheme": "s"}),
            ),
            backend("team-a", "b", spec),
        ],
    );
    assert!(r.snapshot.backends().is_empty());
    let m = messages(&r);
    assert!(m[0].starts_with("CacheBackend orphan/b: metadata.namespace: namespace orphan has no effective CacheTenant"), "{m:?}");
    assert!(
        m.contains(
            &r#"CacheBackend team-a/b: spec.endpoints[0].address: "nohost" is not host:port"#
                .to_string()
        ),
        "{m:?}"
    );
    assert!(
        m.contains(&r#"CacheBackend team-a/b: spec.endpoints[1].id: duplicate id "r""#.to_string()),
        "{m:?}"
    );
}

#[test]
fn host_of_handles_ipv6_and_rejects_bad_ports() {
    assert_eq!(host_of("[::1]:8000"), Some("[::1]"));
    assert_eq!(host_of("a.b:1"), Some("a.b"));
    assert_eq!(host_of("a.b:0"), None);
    assert_eq!(host_of("a.b:70000"), None);
    assert_eq!(host_of(":80"), None);
}

fn ready_pod(ns: &str, name: &str, ip: &str, ready: bool) -> k8s_openapi::api::core::v1::Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "labels": {"app": "llama"}},
        "status": {"podIP": ip, "conditions": [
            {"type": "Ready", "status": if ready { "True" } else { "False" }}]},
    }))
    .unwrap()
}

#[test]
fn selector_backends_declare_ready_pods_next_to_static_endpoints() {
    let b = backend(
        "team-a",
        "llama",
        json!({"engine": "vLLM", "modelID": "m", "hashScheme": "s", "targetPort": 8000,
               "selector": {"matchLabels": {"app": "llama"}},
               "endpoints": [{"id": "static-0", "address": "10.9.9.9:8000"},
                             {"id": "pod-a", "address": "10.9.9.8:8000"}]}),
    );
    let pods = [
        ready_pod("team-a", "pod-a", "10.0.0.1", true),
        ready_pod("team-a", "pod-b", "10.0.0.2", true),
        ready_pod("team-a", "pod-c", "10.0.0.3", false),
    ];
    let r = resolve_with_pods(&[], &[tenant("team-a", "t", None, "acme")], &[b], &pods);
    assert!(r.rejected.is_empty(), "{:?}", messages(&r));
    let decl = &r.snapshot.backends()[0];
    let got: Vec<(&str, &str)> = decl
        .replicas
        .iter()
        .map(|r| (r.id.as_str(), r.address.as_str()))
        .collect();
    // The static endpoint keeps its id and address; the not-ready pod is absent.
    assert_eq!(
        got,
        [
            ("static-0", "10.9.9.9:8000"),
            ("pod-a", "10.9.9.8:8000"),
            ("pod-b", "10.0.0.2:8000")
        ]
    );
}

#[test]
fn a_selector_backend_without_target_port_is_rejected_by_field() {
    let b = backend(
        "team-a",
        "llama",
        json!({"engine": "vLLM", "modelID": "m", "hashScheme": "s",
               "selector": {"matchLabels": {"app": "llama"}}}),
    );
    let r = resolve_with_pods(&[], &[tenant("team-a", "t", None, "acme")], &[b], &[]);
    assert_eq!(r.rejected.len(), 1);
    assert_eq!(r.rejected[0].field, "spec.targetPort");
    assert!(r.snapshot.backends().is_empty());
}

fn pool(ns: &str, name: &str, app: &str, ports: &[i32]) -> InferencePool {
    let ports: Vec<Value> = ports.iter().map(|p| json!({"number": p})).collect();
    serde_json::from_value(json!({
        "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"selector": {"matchLabels": {"app": app}}, "targetPorts": ports,
                 "endpointPickerRef": {"name": "inferencecache", "port": {"number": 50051}}},
    }))
    .unwrap()
}

fn pool_backend(ns: &str, pool: &str, extra: Value) -> CacheBackend {
    let mut spec = json!({"engine": "vLLM", "modelID": "m", "hashScheme": "s",
                          "inferencePoolRef": {"name": pool},
                          "kvEvents": {"port": 5557, "replayPort": 5600}});
    for (k, v) in extra.as_object().unwrap() {
        spec[k] = v.clone();
    }
    backend(ns, "llama", spec)
}

fn labelled_pod(ns: &str, name: &str, app: &str, ip: &str) -> Pod {
    let mut p = ready_pod(ns, name, ip, true);
    p.metadata.labels = Some([("app".to_string(), app.to_string())].into());
    p
}

fn in_cluster(backends: &[CacheBackend], pods: &[Pod], pools: Pools<'_>) -> Resolution {
    resolve_in_cluster(
        &[],
        &[tenant("team-a", "t", None, "acme")],
        backends,
        &Cluster { pods, pools },
    )
}

type Row = (String, String, Option<String>, Option<String>);

fn rows(r: &Resolution) -> Vec<Row> {
    r.snapshot.backends()[0]
        .replicas
        .iter()
        .map(|r| {
            (
                r.id.clone(),
                r.address.clone(),
                r.kv_events_endpoint.clone(),
                r.kv_replay_endpoint.clone(),
            )
        })
        .collect()
}

fn row(id: &str, addr: &str, kv: &str, replay: &str) -> Row {
    (id.into(), addr.into(), Some(kv.into()), Some(replay.into()))
}

#[test]
fn a_pool_backend_declares_the_pools_ready_pods_at_its_target_port() {
    let pods = [
        labelled_pod("team-a", "vllm-0", "vllm", "10.0.0.1"),
        labelled_pod("team-a", "other-0", "other", "10.0.0.2"),
        // Same labels, another namespace: not the pool's.
        labelled_pod("team-b", "vllm-9", "vllm", "10.0.0.9"),
    ];
    let pools = [
        pool("team-a", "llama", "vllm", &[8000]),
        // Same name in another namespace: never the one referenced.
        pool("team-b", "llama", "other", &[7000]),
    ];
    let r = in_cluster(
        &[pool_backend("team-a", "llama", json!({}))],
        &pods,
        Pools::Listed(&pools),
    );
    assert!(r.rejected.is_empty(), "{:?}", messages(&r));
    assert_eq!(
        rows(&r),
        [row(
            "vllm-0",
            "10.0.0.1:8000",
            "tcp://10.0.0.1:5557",
            "tcp://10.0.0.1:5600"
        )]
    );
    assert_eq!(r.pool_bindings.len(), 1);
    assert_eq!(r.pool_bindings[0].pool, "llama");
    assert_eq!(r.pool_bindings[0].outcome, Ok(1));
}

/// GIE: every target port is a distinct endpoint `<pod>-rank-<i>`, narrowed by
/// the pod's active-ports annotation; rank i follows KV ports + i.
#[test]
fn several_target_ports_are_ranked_endpoints_narrowed_by_active_ports() {
    let mut narrowed = labelled_pod("team-a", "vllm-1", "vllm", "10.0.0.2");
    narrowed.metadata.annotations = Some(
        [(
            pods::ACTIVE_PORTS_ANNOTATION.to_string(),
            "8001, junk".to_string(),
        )]
        .into(),
    );
    let pods = [
        labelled_pod("team-a", "vllm-0", "vllm", "10.0.0.1"),
        narrowed,
    ];
    let pools = [pool("team-a", "llama", "vllm", &[8000, 8001])];
    let r = in_cluster(
        &[pool_backend("team-a", "llama", json!({}))],
        &pods,
        Pools::Listed(&pools),
    );
    assert!(r.rejected.is_empty(), "{:?}", messages(&r));
    assert_eq!(
        rows(&r),
        [
            row(
                "vllm-0-rank-0",
                "10.0.0.1:8000",
                "tcp://10.0.0.1:5557",
                "tcp://10.0.0.1:5600"
            ),
            row(
                "vllm-0-rank-1",
                "10.0.0.1:8001",
                "tcp://10.0.0.1:5558",
                "tcp://10.0.0.1:5601"
            ),
            row(
                "vllm-1-rank-1",
                "10.0.0.2:8001",
                "tcp://10.0.0.2:5558",
                "tcp://10.0.0.2:5601"
            ),
        ]
    );
    assert_eq!(r.pool_bindings[0].outcome, Ok(3));
}

#[test]
fn a_missing_or_unreadable_pool_leaves_the_backend_declared_without_replicas() {
    let pods = [labelled_pod("team-a", "vllm-0", "vllm", "10.0.0.1")];
    let b = [pool_backend("team-a", "llama", json!({}))];
    for (pools, reason, text) in [
        (
            Pools::Listed(&[]),
            "NotFound",
            "InferencePool team-a/llama not found",
        ),
        (
            Pools::Unavailable("the CRD is not installed"),
            "Unavailable",
            "InferencePool team-a/llama cannot be read: the CRD is not installed",
        ),
    ] {
        let r = in_cluster(&b, &pods, pools);
        assert!(r.rejected.is_empty(), "{:?}", messages(&r));
        assert_eq!(r.snapshot.backends().len(), 1, "the scope stays declared");
        assert!(r.snapshot.backends()[0].replicas.is_empty());
        let problem = r.pool_bindings[0].outcome.clone().unwrap_err();
        assert_eq!(problem.reason, reason);
        assert_eq!(problem.message, text);
    }
}

#[test]
fn an_invalid_pool_or_a_conflicting_backend_supplies_nothing_and_says_why() {
    let pods = [labelled_pod("team-a", "vllm-0", "vllm", "10.0.0.1")];
    let cases: [(InferencePool, Value, &str, &str); 4] = [
        (
            pool("team-a", "llama", "vllm", &[8000, 8000]),
            json!({}),
            "Invalid",
            "spec.targetPorts[1].number 8000 is listed twice",
        ),
        (
            pool("team-a", "llama", "vllm", &[0]),
            json!({}),
            "Invalid",
            "spec.targetPorts[0].number 0 is not a port",
        ),
        (
            pool("team-a", "llama", "vllm", &[8000, 8001]),
            json!({"dataParallelSize": 2}),
            "Conflict",
            "spec.dataParallelSize 2 would subscribe overlapping KV event ports",
        ),
        (
            pool("team-a", "llama", "vllm", &[8000, 8001]),
            json!({"kvEvents": {"port": 65535}}),
            "Conflict",
            "spec.kvEvents.port 65535 + 1 target ports",
        ),
    ];
    for (p, extra, reason, text) in cases {
        let r = in_cluster(
            &[pool_backend("team-a", "llama", extra)],
            &pods,
            Pools::Listed(std::slice::from_ref(&p)),
        );
        assert!(r.rejected.is_empty(), "{:?}", messages(&r));
        assert!(r.snapshot.backends()[0].replicas.is_empty());
        let problem = r.pool_bindings[0].outcome.clone().unwrap_err();
        assert_eq!(problem.reason, reason);
        assert!(problem.message.contains(text), "{}", problem.message);
    }
    let mut empty = pool("team-a", "llama", "vllm", &[8000]);
    empty.spec.selector.match_labels.clear();
    let r = in_cluster(
        &[pool_backend("team-a", "llama", json!({}))],
        &pods,
        Pools::Listed(std::slice::from_ref(&empty)),
    );
    let problem = r.pool_bindings[0].outcome.clone().unwrap_err();
    assert!(
        problem.message.contains("matchLabels is empty"),
        "{}",
        problem.message
    );
}

#[test]
fn a_pool_ref_is_an_error_in_file_mode_and_next_to_a_selector() {
    let r = resolve(
        &[],
        &[tenant("team-a", "t", None, "acme")],
        &[pool_backend("team-a", "llama", json!({}))],
    );
    assert_eq!(r.rejected.len(), 1, "{:?}", messages(&r));
    assert_eq!(r.rejected[0].field, "spec.inferencePoolRef");
    assert!(
        r.rejected[0].message.contains("needs serve --kubernetes"),
        "{}",
        r.rejected[0].message
    );
    assert!(r.snapshot.backends().is_empty());

    let pools = [pool("team-a", "llama", "vllm", &[8000])];
    let r = in_cluster(
        &[pool_backend(
            "team-a",
            "llama",
            json!({"selector": {"matchLabels": {"app": "vllm"}}, "targetPort": 8000}),
        )],
        &[],
        Pools::Listed(&pools),
    );
    assert_eq!(r.rejected.len(), 1, "{:?}", messages(&r));
    assert_eq!(r.rejected[0].field, "spec.inferencePoolRef");
    assert!(
        r.rejected[0]
            .message
            .contains("excludes spec.selector, spec.targetPort"),
        "{}",
        r.rejected[0].message
    );
    assert!(r.snapshot.backends().is_empty());
    assert!(
        r.pool_bindings.is_empty(),
        "a rejected backend binds nothing"
    );
}
