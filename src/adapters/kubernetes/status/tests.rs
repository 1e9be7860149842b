use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde_json::{Value, json};

use super::*;
use crate::adapters::resolve::{Resolution, resolve_with_pods};
use crate::core::index::{ReplicaStats, TenantEntries};

fn mk<T: serde::de::DeserializeOwned>(
    kind: &str,
    ns: &str,
    name: &str,
    age: i64,
    spec: Value,
) -> T {
    let ts = jiff::Timestamp::from_second(1_700_000_000 + age).unwrap();
    serde_json::from_value(json!({
        "apiVersion": "inferencecache.io/v1alpha1", "kind": kind,
        "metadata": {"name": name, "namespace": ns, "generation": 3,
                     "creationTimestamp": serde_json::to_value(Time(ts)).unwrap()},
        "spec": spec,
    }))
    .unwrap()
}

fn now() -> Time {
    time(Timestamp::from_secs(1_800_000_000))
}

fn verdicts(r: &Resolution) -> Verdicts {
    Verdicts {
        ignored: r.ignored.clone(),
        rejected: r.rejected.clone(),
        pool_bindings: r.pool_bindings.clone(),
    }
}

fn stats(hit_rate: f64) -> Option<(ReplicaStats, Timestamp)> {
    Some((
        ReplicaStats {
            cache_memory_bytes: 1 << 30,
            hit_rate,
            waiting_requests: 0,
            running_requests: 0,
            kv_cache_usage: 0.5,
            first_tokens_total: None,
        },
        Timestamp::from_secs(1_799_999_990),
    ))
}

fn replica(
    tenant: &str,
    id: &str,
    prefixes: u64,
    st: Option<(ReplicaStats, Timestamp)>,
) -> ReplicaView {
    ReplicaView {
        tenant: tenant.into(),
        replica_id: id.into(),
        model: "m".into(),
        hash_scheme: "s".into(),
        endpoint: Some("10.0.0.1:8000".into()),
        serving: true,
        prefix_count: prefixes,
        last_event_at: Some(Timestamp::from_secs(1_799_999_000)),
        stats: st,
        inflight_requests: 0,
        inflight_tokens: 0,
        peer_inflight_requests: 0,
        peer_inflight_tokens: 0,
        recent_requests: 0.0,
    }
}

#[test]
fn rates_are_short_decimals() {
    assert_eq!(rate(0.25), "0.25");
    assert_eq!(rate(1.0), "1");
    assert_eq!(rate(0.0), "0");
    assert_eq!(rate(0.123456), "0.1235");
    assert_eq!(rate(f64::NAN), "0");
}

#[test]
fn oldest_policy_is_ready_and_the_other_is_ignored_naming_the_winner() {
    let old: CachePolicy = mk("CachePolicy", "team-a", "old", 0, json!({}));
    let new: CachePolicy = mk("CachePolicy", "team-a", "new", 10, json!({}));
    let r = resolve_with_pods(&[new.clone(), old.clone()], &[], &[], &[]);
    let v = verdicts(&r);

    let s = policy_status(&old, &v, &now());
    assert_eq!(s.observed_generation, Some(3));
    assert_eq!(s.conditions.len(), 1);
    assert_eq!(
        (
            s.conditions[0].type_.as_str(),
            s.conditions[0].status.as_str()
        ),
        (READY, "True")
    );
    assert_eq!(s.conditions[0].observed_generation, Some(3));

    let s = policy_status(&new, &v, &now());
    let types: Vec<(&str, &str)> = s
        .conditions
        .iter()
        .map(|c| (c.type_.as_str(), c.status.as_str()))
        .collect();
    assert_eq!(types, [(READY, "False"), (IGNORED, "True")]);
    assert!(
        s.conditions[1].message.contains("team-a/old"),
        "{:?}",
        s.conditions[1]
    );
}

#[test]
fn invalid_policy_names_the_field() {
    let p: CachePolicy = mk(
        "CachePolicy",
        "team-a",
        "p",
        0,
        json!({"routingFloorScore": "high"}),
    );
    let r = resolve_with_pods(std::slice::from_ref(&p), &[], &[], &[]);
    let s = policy_status(&p, &verdicts(&r), &now());
    assert_eq!(s.conditions[0].reason, "Invalid");
    assert!(
        s.conditions[0].message.contains("spec.routingFloorScore"),
        "{:?}",
        s.conditions
    );
}

#[test]
fn unchanged_condition_keeps_its_transition_time() {
    let mut p: CachePolicy = mk("CachePolicy", "team-a", "p", 0, json!({}));
    let r = resolve_with_pods(std::slice::from_ref(&p), &[], &[], &[]);
    let first = policy_status(&p, &verdicts(&r), &now());
    p.status = Some(first.clone());
    let later = time(Timestamp::from_secs(1_900_000_000));
    let second = policy_status(&p, &verdicts(&r), &later);
    assert_eq!(first, second);
    // A change of status moves the transition time.
    let other: CachePolicy = mk("CachePolicy", "team-a", "older", -5, json!({}));
    let r = resolve_with_pods(&[p.clone(), other], &[], &[], &[]);
    let third = policy_status(&p, &verdicts(&r), &later);
    assert_eq!(third.conditions[0].last_transition_time, later);
}

#[test]
fn tenant_index_entries_only_for_the_effective_tenant() {
    let a: CacheTenant = mk("CacheTenant", "team-a", "a", 0, json!({"tenantID": "acme"}));
    let b: CacheTenant = mk(
        "CacheTenant",
        "team-a",
        "b",
        5,
        json!({"tenantID": "other"}),
    );
    let r = resolve_with_pods(&[], &[a.clone(), b.clone()], &[], &[]);
    let view = IndexView {
        total_entries: 7,
        orphan_entries: 0,
        replicas: vec![],
        tenants: vec![TenantEntries {
            tenant: "acme".into(),
            index_entries: 7,
        }],
    };
    let s = tenant_status(&a, &verdicts(&r), &view, &now());
    assert_eq!(s.index_entries, Some(7));
    let s = tenant_status(&b, &verdicts(&r), &view, &now());
    assert_eq!(s.index_entries, None);
    assert_eq!(s.conditions[0].reason, "Ignored");
    // An effective tenant the index has not seen yet holds a real 0.
    let r = resolve_with_pods(&[], std::slice::from_ref(&b), &[], &[]);
    let s = tenant_status(&b, &verdicts(&r), &view, &now());
    assert_eq!(s.index_entries, Some(0));
}

#[test]
fn backend_participation_per_declared_replica_with_hit_rate_only_when_reported() {
    let t: CacheTenant = mk("CacheTenant", "team-a", "t", 0, json!({"tenantID": "acme"}));
    let b: CacheBackend = mk(
        "CacheBackend",
        "team-a",
        "llama",
        0,
        json!({"engine": "vLLM", "modelID": "m", "hashScheme": "s", "endpoints": [
            {"id": "r0", "address": "10.0.0.1:8000"}, {"id": "r1", "address": "10.0.0.2:8000"},
            {"id": "r2", "address": "10.0.0.3:8000"}]}),
    );
    let r = resolve_with_pods(&[], &[t], std::slice::from_ref(&b), &[]);
    let view = IndexView {
        total_entries: 3,
        orphan_entries: 0,
        replicas: vec![
            replica("acme", "r0", 3, stats(0.5)),
            replica("acme", "r1", 2, None),
            // Same id, other tenant: not this backend's.
            replica("other", "r2", 9, stats(0.9)),
        ],
        tenants: vec![],
    };
    let s = backend_status(&b, &verdicts(&r), &r.snapshot, &view, &now());
    let body = serde_json::to_value(&s).unwrap();
    let rows = &body["indexParticipation"]["replicas"];
    assert_eq!(rows[0]["id"], "r0");
    assert_eq!(rows[0]["prefixCount"], 3);
    assert_eq!(rows[0]["hitRate"], "0.5");
    assert!(rows[0]["lastEventAt"].is_string());
    assert_eq!(rows[1]["prefixCount"], 2);
    assert!(rows[1].get("hitRate").is_none(), "{rows}");
    assert_eq!(rows[2], json!({"id": "r2", "prefixCount": 0}));
    assert_eq!(body["observedGeneration"], 3);
    assert_eq!(body["conditions"][0]["status"], "True");
}

#[test]
fn backend_without_tenant_is_not_ready_and_has_no_participation() {
    let b: CacheBackend = mk(
        "CacheBackend",
        "team-a",
        "llama",
        0,
        json!({"engine": "vLLM", "modelID": "m", "hashScheme": "s"}),
    );
    let r = resolve_with_pods(&[], &[], std::slice::from_ref(&b), &[]);
    let s = backend_status(
        &b,
        &verdicts(&r),
        &r.snapshot,
        &IndexView::default(),
        &now(),
    );
    assert_eq!(s.index_participation, None);
    assert_eq!(s.conditions[0].reason, "Invalid");
    assert!(s.conditions[0].message.contains("no effective CacheTenant"));
}

#[test]
fn cache_index_status_follows_its_rules() {
    let t1: CacheTenant = mk("CacheTenant", "team-a", "t", 0, json!({"tenantID": "acme"}));
    let t2: CacheTenant = mk("CacheTenant", "team-b", "t", 0, json!({"tenantID": "beta"}));
    let t3: CacheTenant = mk("CacheTenant", "team-c", "t", 0, json!({"tenantID": "idle"}));
    let r = resolve_with_pods(&[], &[t1, t2, t3], &[], &[]);
    let view = IndexView {
        total_entries: 12,
        orphan_entries: 0,
        replicas: vec![
            // Same pod name in two namespaces, both reporting: "beta" > "acme" wins.
            replica("acme", "pod-0", 5, stats(0.2)),
            replica("beta", "pod-0", 7, stats(0.4)),
            // Prefix-only: never in CacheIndex.replicas.
            replica("acme", "pod-1", 3, None),
            replica(PROBE_TENANT, "probe", 1, stats(1.0)),
        ],
        tenants: vec![
            TenantEntries {
                tenant: "acme".into(),
                index_entries: 8,
            },
            TenantEntries {
                tenant: "beta".into(),
                index_entries: 4,
            },
            TenantEntries {
                tenant: PROBE_TENANT.into(),
                index_entries: 1,
            },
        ],
    };
    let s = cache_index_status(&view, &r.snapshot, Timestamp::from_secs(1_800_000_000));
    let body = serde_json::to_value(&s).unwrap();
    assert_eq!(body["totalEntries"], 12);
    assert!(body["generatedAt"].is_string());
    let replicas = body["replicas"].as_array().unwrap();
    assert_eq!(replicas.len(), 1, "{replicas:?}");
    assert_eq!(replicas[0]["id"], "pod-0");
    assert_eq!(replicas[0]["tenant"], "beta");
    assert_eq!(replicas[0]["prefixCount"], 7);
    assert_eq!(replicas[0]["hitRate"], "0.4");
    assert_eq!(replicas[0]["cacheMemoryBytes"], 1 << 30);
    let tenants = body["tenants"].as_array().unwrap();
    let names: Vec<&str> = tenants
        .iter()
        .map(|t| t["tenant"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["acme", "beta", "idle"]);
    for t in tenants {
        assert_eq!(t["memoryUsed"], 0, "{t}");
        assert!(t["indexEntries"].is_i64(), "{t}");
    }
    assert_eq!(tenants[0]["namespace"], "team-a");
    assert_eq!(tenants[0]["indexEntries"], 8);
    assert_eq!(tenants[0]["hitRate"], "0.2");
    // No stats reported: no hitRate key (not "0"), and a present 0 entries.
    assert!(tenants[2].get("hitRate").is_none());
    assert_eq!(tenants[2]["indexEntries"], 0);
}

fn template(body: &str, slots: Value) -> PromptTemplate {
    mk(
        "PromptTemplate",
        "ns",
        "t",
        0,
        json!({"body": body, "slots": slots}),
    )
}

#[test]
fn slot_references_are_double_braced_names() {
    assert_eq!(
        slot_references("{{system}} {{ q }} {{system}} {{ a | upper }} {{x"),
        ["system", "q"]
    );
}

#[test]
fn mutable_before_stable_is_flagged() {
    let slots = json!([{"name": "system", "type": "Stable"}, {"name": "q", "type": "Mutable"}]);
    let good = template_status(&template("{{system}}\n{{q}}", slots.clone()), &now());
    assert_eq!(good.conditions[0].type_, PREFIX_STABLE);
    assert_eq!(good.conditions[0].status, "True");
    let bad = template_status(&template("{{q}}\n{{ system }}", slots), &now());
    assert_eq!(bad.conditions[0].status, "False");
    assert_eq!(bad.conditions[0].reason, "MutableBeforeStable");
    assert!(
        bad.conditions[0].message.contains("\"q\"")
            && bad.conditions[0].message.contains("\"system\"")
    );
}

#[test]
fn template_revision_is_a_stable_hash_of_the_spec() {
    let slots = json!([{"name": "system", "type": "Stable"}]);
    let a = template("{{system}}", slots.clone());
    let mut b = a.clone();
    b.metadata.name = Some("renamed".into());
    assert_eq!(template_revision(&a), template_revision(&b));
    assert_eq!(
        template_revision(&a),
        template_status(&a, &now()).template_revision.unwrap()
    );
    let c = template("{{system}} more", slots);
    assert_ne!(template_revision(&a), template_revision(&c));
    // Pinned: the revision must not change across builds.
    assert_eq!(template_revision(&a), template_revision(&a.clone()));
    assert!(template_revision(&a).starts_with('t') && template_revision(&a).len() == 17);
}

#[test]
fn topology_flags_undeclared_accelerator_types() {
    let ok: PDTopology = mk(
        "PDTopology",
        "ns",
        "t",
        0,
        json!({
        "acceleratorTypes": [{"name": "h100"}],
        "prefillPools": [{"name": "p", "acceleratorType": "h100"}]}),
    );
    let s = topology_status(&ok, &now());
    assert_eq!(s.conditions[0].status, "True");
    let bad: PDTopology = mk(
        "PDTopology",
        "ns",
        "t",
        0,
        json!({
        "acceleratorTypes": [{"name": "h100"}],
        "decodePools": [{"name": "d", "acceleratorType": "mi300"}]}),
    );
    let s = topology_status(&bad, &now());
    assert_eq!(s.conditions[0].status, "False");
    assert_eq!(s.conditions[0].reason, "UndeclaredAcceleratorType");
    assert!(
        s.conditions[0].message.contains("decodePools[d]")
            && s.conditions[0].message.contains("mi300")
    );
    assert_eq!(s.observed_generation, Some(3));
}

#[test]
fn merge_patch_nulls_what_disappeared() {
    let current = json!({"indexEntries": 4, "conditions": [{"type": "Ready"}],
                         "indexParticipation": {"replicas": [{"id": "a"}]}});
    let desired = json!({"conditions": [{"type": "Ready", "status": "False"}],
                         "indexParticipation": {}});
    let patch = merge_patch(Some(&current), desired.clone());
    assert_eq!(
        patch,
        json!({"status": {
        "indexEntries": null,
        "conditions": [{"type": "Ready", "status": "False"}],
        "indexParticipation": {"replicas": null}}})
    );
    assert_eq!(
        merge_patch(None, desired.clone()),
        json!({"status": desired})
    );
}

/// `InferencePoolResolved` on a backend with `inferencePoolRef`: False naming
/// the missing pool (the backend itself stays Ready, its scope declared with no
/// replicas), True once the pool supplies endpoints; absent without a reference.
#[test]
fn pool_backend_condition_names_a_missing_pool_and_clears_when_it_appears() {
    use crate::adapters::resolve::{Cluster, Pools, resolve_in_cluster};
    use crate::crd::inference_pool::InferencePool;
    let t: CacheTenant = mk("CacheTenant", "team-a", "t", 0, json!({"tenantID": "acme"}));
    let b: CacheBackend = mk(
        "CacheBackend",
        "team-a",
        "llama",
        0,
        json!({"engine": "vLLM", "modelID": "m", "hashScheme": "s",
               "inferencePoolRef": {"name": "pool-a"}}),
    );
    let pods: Vec<k8s_openapi::api::core::v1::Pod> = vec![
        serde_json::from_value(json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "p0", "namespace": "team-a", "labels": {"app": "vllm"}},
            "status": {"podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}}))
        .unwrap(),
    ];
    let resolve = |pools: Pools<'_>| {
        resolve_in_cluster(
            &[],
            std::slice::from_ref(&t),
            std::slice::from_ref(&b),
            &Cluster { pods: &pods, pools },
        )
    };
    let condition = |s: &CacheBackendStatus, type_: &str| {
        s.conditions.iter().find(|c| c.type_ == type_).cloned()
    };

    let r = resolve(Pools::Listed(&[]));
    let s = backend_status(
        &b,
        &verdicts(&r),
        &r.snapshot,
        &IndexView::default(),
        &now(),
    );
    assert_eq!(condition(&s, READY).unwrap().status, "True");
    let c = condition(&s, POOL_RESOLVED).unwrap();
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("False", "NotFound")
    );
    assert_eq!(c.message, "InferencePool team-a/pool-a not found");
    assert!(s.index_participation.unwrap().replicas.is_empty());

    let pool: InferencePool = serde_json::from_value(json!({
        "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
        "metadata": {"name": "pool-a", "namespace": "team-a"},
        "spec": {"selector": {"matchLabels": {"app": "vllm"}}, "targetPorts": [{"number": 8000}]},
    }))
    .unwrap();
    let r = resolve(Pools::Listed(std::slice::from_ref(&pool)));
    let s = backend_status(
        &b,
        &verdicts(&r),
        &r.snapshot,
        &IndexView::default(),
        &now(),
    );
    let c = condition(&s, POOL_RESOLVED).unwrap();
    assert_eq!((c.status.as_str(), c.reason.as_str()), ("True", "Resolved"));
    assert_eq!(c.message, "InferencePool team-a/pool-a: 1 endpoint(s)");
    let rows = s.index_participation.unwrap().replicas;
    assert_eq!(rows[0].id, "p0");

    // A backend without a pool reference gets no such condition.
    let plain: CacheBackend = mk(
        "CacheBackend",
        "team-a",
        "plain",
        0,
        json!({"engine": "vLLM", "modelID": "m2", "hashScheme": "s"}),
    );
    let r = resolve_with_pods(
        &[],
        std::slice::from_ref(&t),
        std::slice::from_ref(&plain),
        &[],
    );
    let s = backend_status(
        &plain,
        &verdicts(&r),
        &r.snapshot,
        &IndexView::default(),
        &now(),
    );
    assert!(condition(&s, POOL_RESOLVED).is_none(), "{s:?}");
}
