use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::*;
use crate::adapters::kubernetes::mock::{ApiServer, Scenario, timeout_after_1s};

const API: &str = "inferencecache.io/v1alpha1";

fn obj(kind: &str, ns: &str, name: &str, age: i64, spec: Value) -> Value {
    let ts = jiff::Timestamp::from_second(1_700_000_000 + age).unwrap();
    json!({"apiVersion": API, "kind": kind,
           "metadata": {"name": name, "namespace": ns, "resourceVersion": "1", "generation": 1,
                        "creationTimestamp": ts.to_string()},
           "spec": spec})
}

fn tenant(ns: &str, name: &str, age: i64, id: &str) -> Value {
    obj("CacheTenant", ns, name, age, json!({"tenantID": id}))
}

fn pod(ns: &str, name: &str, ip: &str, ready: bool) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": ns, "resourceVersion": "1",
                        "labels": {"app": "llama"}},
           "spec": {"containers": [{"name": "engine", "image": "vllm"}]},
           "status": {"podIP": ip, "conditions": [
               {"type": "Ready", "status": if ready { "True" } else { "False" }}]}})
}

fn selector_backend(ns: &str) -> Value {
    obj(
        "CacheBackend",
        ns,
        "llama",
        0,
        json!({
        "engine": "vLLM", "modelID": "m", "hashScheme": "s", "targetPort": 8000,
        "selector": {"matchLabels": {"app": "llama"}},
        "kvEvents": {"port": 5557}}),
    )
}

struct Running {
    server: ApiServer,
    snapshots: mpsc::UnboundedReceiver<PolicySnapshot>,
    observed: latest::Receiver<Arc<Observed>>,
}

fn start(scenario: Scenario) -> Running {
    let (_, no_file) = latest::channel(Arc::default());
    start_with_file(scenario, no_file)
}

fn start_with_file(scenario: Scenario, file: latest::Receiver<Arc<PolicyObjects>>) -> Running {
    let (client, server) = ApiServer::start(scenario);
    let (tx, snapshots) = mpsc::unbounded_channel();
    let (otx, observed) = latest::channel(Arc::new(Observed::default()));
    tokio::spawn(run(
        client,
        Duration::from_millis(10),
        move |s| {
            let _ = tx.send(s);
        },
        otx,
        file,
    ));
    Running {
        server,
        snapshots,
        observed,
    }
}

fn replicas(s: &PolicySnapshot) -> Vec<(String, String, Option<String>)> {
    s.backends()
        .iter()
        .flat_map(|b| b.replicas.iter())
        .map(|r| {
            (
                r.id.clone(),
                r.address.clone(),
                r.kv_events_endpoint.clone(),
            )
        })
        .collect()
}

#[tokio::test]
async fn lists_and_watches_every_kind_in_all_namespaces() {
    let mut scenario = Scenario::default();
    scenario
        .lists
        .insert("cachetenants", vec![tenant("team-a", "t", 0, "acme")]);
    let mut r = start(scenario);
    let snapshot = timeout_after_1s(r.snapshots.recv()).await.unwrap();
    assert_eq!(snapshot.tenant("acme").namespace, Some("team-a"));
    // Let the watches start after the lists.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let seen = r.server.requests();
    for path in [
        "/apis/inferencecache.io/v1alpha1/cachepolicies?",
        "/apis/inferencecache.io/v1alpha1/cachetenants?",
        "/apis/inferencecache.io/v1alpha1/cachebackends?",
        "/api/v1/pods?",
        "/apis/inferencecache.io/v1alpha1/prompttemplates?",
        "/apis/inferencecache.io/v1alpha1/pdtopologies?",
        "/apis/inference.networking.k8s.io/v1/inferencepools?",
    ] {
        let of_path: Vec<&str> = seen
            .iter()
            .filter(|s| s.method == http::Method::GET && s.uri.starts_with(path))
            .map(|s| s.uri.as_str())
            .collect();
        assert!(
            of_path.iter().any(|u| !u.contains("watch=true")),
            "no LIST of {path}: {of_path:?}"
        );
        assert!(
            of_path.iter().any(|u| u.contains("watch=true")),
            "no WATCH of {path}: {of_path:?}"
        );
    }
    // Nothing but reads, and never a namespaced path (all namespaces).
    assert!(seen.iter().all(|s| s.method == http::Method::GET));
    assert!(
        seen.iter().all(|s| !s.uri.contains("/namespaces/")),
        "{seen:?}"
    );
}

#[tokio::test]
async fn ready_pods_become_replicas_and_the_oldest_tenant_wins() {
    let mut scenario = Scenario::default();
    scenario.lists.insert(
        "cachetenants",
        vec![
            tenant("team-a", "newer", 10, "other"),
            tenant("team-a", "older", 0, "acme"),
        ],
    );
    scenario
        .lists
        .insert("cachebackends", vec![selector_backend("team-a")]);
    scenario.lists.insert(
        "pods",
        vec![
            pod("team-a", "llama-0", "10.0.0.1", true),
            pod("team-a", "llama-1", "10.0.0.2", false),
            pod("team-b", "llama-2", "10.0.0.3", true),
        ],
    );
    let mut r = start(scenario);
    let snapshot = timeout_after_1s(r.snapshots.recv()).await.unwrap();
    assert_eq!(snapshot.tenant("acme").namespace, Some("team-a"));
    assert_eq!(snapshot.tenant("other").namespace, None);
    assert_eq!(
        replicas(&snapshot),
        [(
            "llama-0".to_string(),
            "10.0.0.1:8000".to_string(),
            Some("tcp://10.0.0.1:5557".to_string())
        )]
    );
    assert_eq!(&*snapshot.backends()[0].scope.tenant, "acme");
    let observed = r.observed.borrow().clone();
    assert_eq!(observed.revision, snapshot.revision().to_string());
    assert_eq!(observed.verdicts.ignored.len(), 1);
    assert_eq!(observed.verdicts.ignored[0].name, "newer");
    assert_eq!(observed.objects.tenants.len(), 2);
}

#[tokio::test]
async fn changes_rebuild_deletion_tenant_id_change_and_pod_readiness() {
    let mut scenario = Scenario::default();
    scenario.lists.insert(
        "cachepolicies",
        vec![obj(
            "CachePolicy",
            "team-a",
            "p",
            0,
            json!({"eviction": "LFU"}),
        )],
    );
    scenario
        .lists
        .insert("cachetenants", vec![tenant("team-a", "t", 0, "acme")]);
    scenario
        .lists
        .insert("cachebackends", vec![selector_backend("team-a")]);
    scenario
        .lists
        .insert("pods", vec![pod("team-a", "llama-0", "10.0.0.1", false)]);
    let mut modified_tenant = tenant("team-a", "t", 0, "acme-2");
    modified_tenant["metadata"]["resourceVersion"] = json!("2");
    scenario.events.insert(
        "cachetenants",
        vec![json!({"type": "MODIFIED", "object": modified_tenant})],
    );
    scenario.events.insert(
        "cachepolicies",
        vec![json!({"type": "DELETED",
                     "object": obj("CachePolicy", "team-a", "p", 0, json!({"eviction": "LFU"}))})],
    );
    scenario.events.insert(
        "pods",
        vec![json!({"type": "MODIFIED", "object": pod("team-a", "llama-0", "10.0.0.1", true)})],
    );
    let mut r = start(scenario);

    let before = timeout_after_1s(r.snapshots.recv()).await.unwrap();
    assert_eq!(before.tenant("acme").namespace, Some("team-a"));
    assert_eq!(
        before.namespace("team-a").unwrap().policy_name.as_deref(),
        Some("p")
    );
    assert!(replicas(&before).is_empty(), "the pod is not ready yet");

    r.server.release();
    // Events may arrive in one or several debounce windows; wait for the last.
    let mut after = timeout_after_1s(r.snapshots.recv()).await.unwrap();
    while !(after.tenant("acme-2").namespace.is_some()
        && after
            .namespace("team-a")
            .and_then(|n| n.policy_name.clone())
            .is_none()
        && !replicas(&after).is_empty())
    {
        after = timeout_after_1s(r.snapshots.recv()).await.unwrap();
    }
    assert_eq!(after.tenant("acme").namespace, None, "the old id is gone");
    assert_eq!(&*after.backends()[0].scope.tenant, "acme-2");
    assert_eq!(replicas(&after)[0].0, "llama-0");
}

#[tokio::test]
async fn unchanged_objects_do_not_reinstall() {
    let mut scenario = Scenario::default();
    scenario
        .lists
        .insert("cachetenants", vec![tenant("team-a", "t", 0, "acme")]);
    // A status-only change of the same object: same snapshot revision.
    let mut same = tenant("team-a", "t", 0, "acme");
    same["metadata"]["resourceVersion"] = json!("2");
    same["status"] = json!({"indexEntries": 3});
    scenario.events.insert(
        "cachetenants",
        vec![json!({"type": "MODIFIED", "object": same})],
    );
    let mut r = start(scenario);
    timeout_after_1s(r.snapshots.recv()).await.unwrap();
    r.server.release();
    timeout_after_1s(async {
        loop {
            r.observed.changed().await.unwrap();
            let o = r.observed.borrow().clone();
            if o.objects.tenants.iter().any(|t| t.status.is_some()) {
                break;
            }
        }
    })
    .await;
    assert!(r.snapshots.try_recv().is_err(), "no second install");
}

#[tokio::test]
async fn a_tenant_moving_namespace_takes_its_id_along() {
    let mut scenario = Scenario::default();
    scenario
        .lists
        .insert("cachetenants", vec![tenant("team-a", "t", 0, "acme")]);
    scenario.events.insert(
        "cachetenants",
        vec![
            json!({"type": "DELETED", "object": tenant("team-a", "t", 0, "acme")}),
            json!({"type": "ADDED", "object": tenant("team-b", "t", 20, "acme")}),
        ],
    );
    let mut r = start(scenario);
    let before = timeout_after_1s(r.snapshots.recv()).await.unwrap();
    assert_eq!(before.tenant("acme").namespace, Some("team-a"));
    r.server.release();
    let mut after = timeout_after_1s(r.snapshots.recv()).await.unwrap();
    while after.tenant("acme").namespace != Some("team-b") {
        after = timeout_after_1s(r.snapshots.recv()).await.unwrap();
    }
    assert_eq!(
        after.namespace("team-a").and_then(|n| n.tenant_id.clone()),
        None
    );
}

/// `serve --config --kubernetes`: the file's objects join the cluster's; in a
/// namespace both define, the cluster's (dated, so older) tenant wins; a file
/// change rebuilds.
#[tokio::test]
async fn file_objects_are_resolved_with_the_cluster() {
    let mut scenario = Scenario::default();
    scenario
        .lists
        .insert("cachetenants", vec![tenant("team-a", "t", 0, "acme")]);
    let undated = |v: Value| -> CacheTenant {
        let mut t: CacheTenant = serde_json::from_value(v).unwrap();
        t.metadata.creation_timestamp = None;
        t
    };
    let file = PolicyObjects {
        tenants: vec![
            Arc::new(undated(tenant("team-a", "from-file", 0, "shadow"))),
            Arc::new(undated(tenant("team-f", "from-file", 0, "filed"))),
        ],
        ..PolicyObjects::default()
    };
    let (file_tx, file_rx) = latest::channel(Arc::new(file.clone()));
    let mut r = start_with_file(scenario, file_rx);
    let snapshot = timeout_after_1s(r.snapshots.recv()).await.unwrap();
    assert_eq!(snapshot.tenant("acme").namespace, Some("team-a"));
    assert_eq!(snapshot.tenant("filed").namespace, Some("team-f"));
    assert_eq!(snapshot.tenant("shadow").namespace, None);

    // The file changes: the next snapshot follows it.
    let mut edited = file;
    edited.tenants[1] = Arc::new(undated(tenant("team-f", "from-file", 0, "renamed")));
    file_tx.send_replace(Arc::new(edited));
    let snapshot = timeout_after_1s(r.snapshots.recv()).await.unwrap();
    assert_eq!(snapshot.tenant("renamed").namespace, Some("team-f"));
    assert_eq!(snapshot.tenant("filed").namespace, None);
}

fn app_pod(ns: &str, name: &str, app: &str, ip: &str) -> Value {
    let mut p = pod(ns, name, ip, true);
    p["metadata"]["labels"] = json!({"app": app});
    p
}

fn inference_pool(ns: &str, name: &str, app: &str, ports: &[i64], version: &str) -> Value {
    let ports: Vec<Value> = ports.iter().map(|p| json!({"number": p})).collect();
    json!({"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
           "metadata": {"name": name, "namespace": ns, "resourceVersion": version},
           "spec": {"selector": {"matchLabels": {"app": app}}, "targetPorts": ports,
                    "endpointPickerRef": {"name": "inferencecache", "port": {"number": 50051},
                                          "failureMode": "FailClose"}},
           "status": {"parents": []}})
}

fn pool_backend(ns: &str, pool: &str) -> Value {
    obj(
        "CacheBackend",
        ns,
        "pooled",
        0,
        json!({"engine": "vLLM", "modelID": "pm", "hashScheme": "s",
               "inferencePoolRef": {"name": pool}, "kvEvents": {"port": 5557}}),
    )
}

fn binding_of(o: &Observed, backend: &str) -> Option<crate::adapters::resolve::PoolBinding> {
    o.verdicts
        .pool_bindings
        .iter()
        .find(|b| b.backend == backend)
        .cloned()
}

/// A backend referencing a pool gets the pool's ready pods (not the other
/// pods of the namespace); the pool's selector and ports changing moves them.
#[tokio::test]
async fn a_pool_backend_follows_the_pools_selector_and_ports() {
    let mut scenario = Scenario::default();
    scenario
        .lists
        .insert("cachetenants", vec![tenant("team-a", "t", 0, "acme")]);
    scenario
        .lists
        .insert("cachebackends", vec![pool_backend("team-a", "llama")]);
    scenario.lists.insert(
        "pods",
        vec![
            app_pod("team-a", "vllm-0", "vllm", "10.0.0.1"),
            app_pod("team-a", "sglang-0", "sglang", "10.0.0.2"),
        ],
    );
    scenario.lists.insert(
        "inferencepools",
        vec![inference_pool("team-a", "llama", "vllm", &[8000], "1")],
    );
    scenario.events.insert(
        "inferencepools",
        vec![json!({"type": "MODIFIED",
                     "object": inference_pool("team-a", "llama", "sglang", &[9000, 9001], "2")})],
    );
    let mut r = start(scenario);
    let before = timeout_after_1s(r.snapshots.recv()).await.unwrap();
    assert_eq!(
        replicas(&before),
        [(
            "vllm-0".to_string(),
            "10.0.0.1:8000".to_string(),
            Some("tcp://10.0.0.1:5557".to_string())
        )]
    );
    let seen = r.observed.borrow().clone();
    assert_eq!(binding_of(&seen, "pooled").unwrap().outcome, Ok(1));

    r.server.release();
    let after = timeout_after_1s(r.snapshots.recv()).await.unwrap();
    assert_eq!(
        replicas(&after),
        [
            (
                "sglang-0-rank-0".to_string(),
                "10.0.0.2:9000".to_string(),
                Some("tcp://10.0.0.2:5557".to_string())
            ),
            (
                "sglang-0-rank-1".to_string(),
                "10.0.0.2:9001".to_string(),
                Some("tcp://10.0.0.2:5558".to_string())
            ),
        ]
    );
}

/// The referenced pool missing, then deleted: no replicas, and a binding (the
/// backend's InferencePoolResolved condition) naming the pool.
#[tokio::test]
async fn a_missing_or_deleted_pool_leaves_no_replicas_and_names_the_pool() {
    let mut scenario = Scenario::default();
    scenario
        .lists
        .insert("cachetenants", vec![tenant("team-a", "t", 0, "acme")]);
    let mut other = pool_backend("team-a", "absent");
    other["metadata"]["name"] = json!("orphan");
    other["spec"]["modelID"] = json!("om");
    scenario.lists.insert(
        "cachebackends",
        vec![pool_backend("team-a", "llama"), other],
    );
    scenario.lists.insert(
        "pods",
        vec![app_pod("team-a", "vllm-0", "vllm", "10.0.0.1")],
    );
    let live = inference_pool("team-a", "llama", "vllm", &[8000], "1");
    scenario.lists.insert("inferencepools", vec![live.clone()]);
    scenario.events.insert(
        "inferencepools",
        vec![json!({"type": "DELETED", "object": live})],
    );
    let mut r = start(scenario);
    let before = timeout_after_1s(r.snapshots.recv()).await.unwrap();
    assert_eq!(replicas(&before).len(), 1);
    let seen = r.observed.borrow().clone();
    let orphan = binding_of(&seen, "orphan").unwrap().outcome.unwrap_err();
    assert_eq!(orphan.reason, "NotFound");
    assert_eq!(orphan.message, "InferencePool team-a/absent not found");
    // Its scope is still declared, with no replicas.
    assert!(
        before
            .backends()
            .iter()
            .any(|b| b.name == "orphan" && b.replicas.is_empty())
    );

    r.server.release();
    let after = timeout_after_1s(r.snapshots.recv()).await.unwrap();
    assert!(replicas(&after).is_empty(), "{:?}", replicas(&after));
    let seen = r.observed.borrow().clone();
    let gone = binding_of(&seen, "pooled").unwrap().outcome.unwrap_err();
    assert_eq!(gone.message, "InferencePool team-a/llama not found");
}

/// The GIE CRD not installed (every InferencePool request 404s): the policy is
/// still installed, selector backends keep their pods, and a pool backend has
/// no replicas with the reason (naming the CRD) on its binding.
#[tokio::test]
async fn without_the_inference_pool_crd_other_backends_keep_working() {
    let mut scenario = Scenario::default();
    scenario.missing.push("inferencepools");
    scenario.lists.insert(
        "cachetenants",
        vec![
            tenant("team-a", "t", 0, "acme"),
            tenant("team-b", "t", 0, "beta"),
        ],
    );
    scenario.lists.insert(
        "cachebackends",
        vec![selector_backend("team-a"), pool_backend("team-b", "llama")],
    );
    scenario.lists.insert(
        "pods",
        vec![
            pod("team-a", "llama-0", "10.0.0.1", true),
            app_pod("team-b", "vllm-0", "vllm", "10.0.1.1"),
        ],
    );
    let mut r = start(scenario);
    let snapshot = timeout_after_1s(r.snapshots.recv()).await.unwrap();
    assert_eq!(
        replicas(&snapshot),
        [(
            "llama-0".to_string(),
            "10.0.0.1:8000".to_string(),
            Some("tcp://10.0.0.1:5557".to_string())
        )]
    );
    let pooled = snapshot
        .backends()
        .iter()
        .find(|b| b.name == "pooled")
        .expect("the pool backend's scope is declared");
    assert!(pooled.replicas.is_empty());
    let seen = r.observed.borrow().clone();
    let problem = binding_of(&seen, "pooled").unwrap().outcome.unwrap_err();
    assert_eq!(problem.reason, "Unavailable");
    assert!(
        problem
            .message
            .contains("InferencePool team-b/llama cannot be read")
            && problem.message.contains("InferencePool CRD")
            && problem.message.contains("is not installed")
            // Words, not the client's debug dump of the 404.
            && !problem.message.contains("Status {")
            && !problem.message.contains("Failed to parse"),
        "{}",
        problem.message
    );
    // The 404 was the pools' LIST; nothing else was refused.
    let seen = r.server.requests();
    assert!(
        seen.iter().any(|s| s
            .uri
            .starts_with("/apis/inference.networking.k8s.io/v1/inferencepools?")),
        "{seen:?}"
    );
}

#[test]
fn trimmed_pods_keep_only_the_active_ports_annotation() {
    let mut p: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "p", "namespace": "ns", "annotations": {
            "inference.networking.k8s.io/active-ports": "8000", "big/annotation": "x"}},
        "spec": {"containers": [{"name": "engine", "image": "vllm"}]}}))
    .unwrap();
    trim_pod(&mut p);
    let kept: Vec<&String> = p.metadata.annotations.as_ref().unwrap().keys().collect();
    assert_eq!(kept, ["inference.networking.k8s.io/active-ports"]);
    assert!(p.spec.is_none());
    let mut bare = p.clone();
    bare.metadata.annotations = Some([("other".to_string(), "y".to_string())].into());
    trim_pod(&mut bare);
    assert_eq!(bare.metadata.annotations, None);
}

#[tokio::test]
async fn the_engine_side_follows_the_cluster_and_file_backends_together() {
    let named = |ns: &str| -> Arc<CacheBackend> {
        let mut b: CacheBackend = serde_json::from_value(selector_backend(ns)).unwrap();
        b.metadata.name = Some(format!("from-{ns}"));
        Arc::new(b)
    };
    let cluster = |names: &[&str]| Observed {
        objects: PolicyObjects {
            backends: names.iter().map(|n| named(n)).collect(),
            ..PolicyObjects::default()
        },
        ..Observed::default()
    };
    let file = PolicyObjects {
        backends: vec![named("file")],
        ..PolicyObjects::default()
    };
    let (observed_tx, observed_rx) = latest::channel(Arc::new(cluster(&["a"])));
    let (_file_tx, file_rx) = latest::channel(Arc::new(file));
    let (seen_tx, mut seen) = mpsc::unbounded_channel::<Vec<String>>();
    let follower = tokio::spawn(follow_backends(observed_rx, file_rx, move |backends| {
        let names = backends
            .iter()
            .map(|b| b.metadata.name.clone().unwrap_or_default())
            .collect();
        let _ = seen_tx.send(names);
    }));
    let first = timeout_after_1s(seen.recv()).await.unwrap();
    assert_eq!(
        first,
        ["from-a", "from-file"],
        "the cluster's, then the file's"
    );

    observed_tx.send_replace(Arc::new(cluster(&["a", "b"])));
    let next = timeout_after_1s(seen.recv()).await.unwrap();
    assert_eq!(next, ["from-a", "from-b", "from-file"]);

    drop(observed_tx);
    timeout_after_1s(follower)
        .await
        .expect("the follower ends with the watches");
}
