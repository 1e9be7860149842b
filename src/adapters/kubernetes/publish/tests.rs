use serde_json::{Value, json};

use super::*;
use crate::adapters::kubernetes::mock::{ApiServer, Scenario, Seen, timeout_after_1s};
use crate::adapters::kubernetes::status::Verdicts;
use crate::adapters::resolve::resolve_with_pods;
use crate::core::index::{IndexConfig, ReplicaStats, StatsReport};
use crate::core::scope::ScopeRef;
use crate::crd::cache_backend::CacheBackend;
use crate::crd::cache_policy::CachePolicy;
use crate::crd::cache_tenant::CacheTenant;
use crate::crd::objects::PolicyObjects;
use tokio::time::Instant;

const API: &str = "inferencecache.io/v1alpha1";

fn obj(kind: &str, ns: &str, name: &str, age: i64, spec: Value) -> Value {
    let ts = jiff::Timestamp::from_second(1_700_000_000 + age).unwrap();
    json!({"apiVersion": API, "kind": kind,
           "metadata": {"name": name, "namespace": ns, "generation": 4,
                        "creationTimestamp": ts.to_string()},
           "spec": spec})
}

struct World {
    router: Arc<Router>,
    observed: Observed,
    lists: Vec<(&'static str, Vec<Value>)>,
}

/// team-a: two policies (p-old wins), a tenant "acme", a backend with two static
/// replicas, one of which reported stats.
fn world() -> World {
    let policies = vec![
        obj("CachePolicy", "team-a", "p-old", 0, json!({})),
        obj("CachePolicy", "team-a", "p-new", 9, json!({})),
    ];
    let tenants = vec![obj(
        "CacheTenant",
        "team-a",
        "t",
        0,
        json!({"tenantID": "acme"}),
    )];
    let backends = vec![obj(
        "CacheBackend",
        "team-a",
        "llama",
        0,
        json!({"engine": "vLLM", "modelID": "m", "hashScheme": "s", "endpoints": [
            {"id": "r0", "address": "10.0.0.1:8000"}, {"id": "r1", "address": "10.0.0.2:8000"}]}),
    )];
    let p: Vec<CachePolicy> = policies
        .iter()
        .map(|v| serde_json::from_value(v.clone()).unwrap())
        .collect();
    let t: Vec<CacheTenant> = tenants
        .iter()
        .map(|v| serde_json::from_value(v.clone()).unwrap())
        .collect();
    let b: Vec<CacheBackend> = backends
        .iter()
        .map(|v| serde_json::from_value(v.clone()).unwrap())
        .collect();
    let r = resolve_with_pods(&p, &t, &b, &[]);
    let now = Timestamp::from_secs(1_800_000_000);
    let revision = r.snapshot.revision().to_string();
    let router = Arc::new(Router::new(IndexConfig::default(), r.snapshot, now));
    router
        .report_stats(
            &StatsReport {
                scope: ScopeRef::new("acme", "m", "s"),
                replica_id: "r0",
                endpoint: "10.0.0.1:8000",
                stats: ReplicaStats {
                    cache_memory_bytes: 4096,
                    hit_rate: 0.75,
                    waiting_requests: 0,
                    running_requests: 1,
                    kv_cache_usage: 0.1,
                    first_tokens_total: None,
                },
            },
            now,
        )
        .unwrap();
    let observed = Observed {
        objects: PolicyObjects {
            policies: p.into_iter().map(Arc::new).collect(),
            tenants: t.into_iter().map(Arc::new).collect(),
            backends: b.into_iter().map(Arc::new).collect(),
        },
        templates: vec![],
        topologies: vec![],
        verdicts: Verdicts {
            ignored: r.ignored,
            rejected: r.rejected,
            pool_bindings: r.pool_bindings,
        },
        revision,
    };
    World {
        router,
        observed,
        lists: vec![
            ("cachepolicies", policies),
            ("cachetenants", tenants),
            ("cachebackends", backends),
        ],
    }
}

fn scenario(w: &World, cache_index_exists: bool) -> Scenario {
    let mut s = Scenario {
        cache_index_exists,
        ..Scenario::default()
    };
    for (k, v) in &w.lists {
        s.lists.insert(k, v.clone());
    }
    s
}

fn patch_to<'a>(seen: &'a [Seen], path: &str) -> &'a Value {
    let s = seen
        .iter()
        .find(|s| s.method == http::Method::PATCH && s.uri.starts_with(path))
        .unwrap_or_else(|| panic!("no PATCH {path}: {seen:#?}"));
    s.body.as_ref().unwrap()
}

const NS: &str = "/apis/inferencecache.io/v1alpha1/namespaces/team-a";

#[tokio::test]
async fn patches_statuses_and_creates_the_cache_index() {
    let w = world();
    let (client, server) = ApiServer::start(scenario(&w, false));
    let publisher = Publisher::new(client, w.router.clone());
    let round = timeout_after_1s(publisher.publish(
        &w.observed,
        &leading(),
        Timestamp::from_secs(1_800_000_001),
    ))
    .await;
    let seen = server.requests();
    assert_eq!(
        round,
        Round {
            written: 5,
            unchanged: 0,
            failed: 0,
            not_leading: 0
        },
        "{seen:#?}"
    );

    let body = patch_to(&seen, &format!("{NS}/cachepolicies/p-old/status"));
    assert_eq!(body["status"]["observedGeneration"], 4);
    assert_eq!(body["status"]["conditions"][0]["type"], "Ready");
    assert_eq!(body["status"]["conditions"][0]["status"], "True");
    let body = patch_to(&seen, &format!("{NS}/cachepolicies/p-new/status"));
    assert_eq!(body["status"]["conditions"][1]["type"], "Ignored");
    assert!(
        body["status"]["conditions"][1]["message"]
            .as_str()
            .unwrap()
            .contains("p-old")
    );

    let body = patch_to(&seen, &format!("{NS}/cachetenants/t/status"));
    assert_eq!(body["status"]["indexEntries"], 0);

    let body = patch_to(&seen, &format!("{NS}/cachebackends/llama/status"));
    let rows = &body["status"]["indexParticipation"]["replicas"];
    assert_eq!(rows[0]["id"], "r0");
    assert_eq!(rows[0]["hitRate"], "0.75");
    assert!(rows[1].get("hitRate").is_none(), "{rows}");

    // CacheIndex: PATCH (404), POST the singleton, PATCH again.
    let index: Vec<&Seen> = seen
        .iter()
        .filter(|s| s.uri.contains("cacheindexes"))
        .collect();
    let methods: Vec<&http::Method> = index.iter().map(|s| &s.method).collect();
    assert_eq!(
        methods,
        [
            &http::Method::PATCH,
            &http::Method::POST,
            &http::Method::PATCH
        ]
    );
    assert!(
        index[0]
            .uri
            .starts_with("/apis/inferencecache.io/v1alpha1/cacheindexes/cluster/status")
    );
    assert_eq!(
        index[1].body.as_ref().unwrap()["metadata"]["name"],
        "cluster"
    );
    let status = &index[2].body.as_ref().unwrap()["status"];
    assert_eq!(status["replicas"].as_array().unwrap().len(), 1, "{status}");
    assert_eq!(status["replicas"][0]["id"], "r0");
    assert_eq!(status["replicas"][0]["tenant"], "acme");
    assert_eq!(status["replicas"][0]["cacheMemoryBytes"], 4096);
    assert_eq!(status["tenants"][0]["tenant"], "acme");
    assert_eq!(status["tenants"][0]["memoryUsed"], 0);
    assert_eq!(status["tenants"][0]["indexEntries"], 0);
    assert_eq!(status["tenants"][0]["hitRate"], "0.75");
    // Keys with nothing to say are cleared, not left behind.
    assert_eq!(status["conditions"], Value::Null);
}

#[tokio::test]
async fn a_status_that_already_says_the_same_is_not_written() {
    let mut w = world();
    let at = status::time(Timestamp::from_secs(1_800_000_001));
    let p = w.observed.objects.policies[0].clone();
    let mut with_status = (*p).clone();
    with_status.status = Some(status::policy_status(&p, &w.observed.verdicts, &at));
    w.observed.objects.policies[0] = Arc::new(with_status);
    let (client, server) = ApiServer::start(scenario(&w, true));
    let publisher = Publisher::new(client, w.router.clone());
    let round = timeout_after_1s(publisher.publish(
        &w.observed,
        &leading(),
        Timestamp::from_secs(1_800_000_050),
    ))
    .await;
    assert_eq!(round.unchanged, 1);
    assert!(
        !server
            .requests()
            .iter()
            .any(|s| s.uri.contains("cachepolicies/p-old/")),
        "{:#?}",
        server.requests()
    );
}

#[tokio::test]
async fn only_the_leader_writes() {
    let w = world();
    let (client, server) = ApiServer::start(scenario(&w, true));
    let (_otx, orx) = latest::channel(Arc::new(w.observed.clone()));
    let (ltx, lrx) = Leadership::manual();
    tokio::spawn(run(
        Publisher::new(client, w.router.clone()),
        orx,
        lrx,
        Duration::from_millis(20),
    ));
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        server.requests().is_empty(),
        "a follower wrote: {:#?}",
        server.requests()
    );
    ltx.send_replace(Some(Instant::now() + Duration::from_secs(60)));
    timeout_after_1s(async {
        while server.requests().is_empty() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    assert!(
        server
            .requests()
            .iter()
            .all(|s| s.method == http::Method::PATCH)
    );
}

/// Leading for the next minute.
fn leading() -> Leadership {
    let (tx, leadership) = Leadership::manual();
    tx.send_replace(Some(Instant::now() + Duration::from_secs(60)));
    // The sender may go: the deadline stays.
    drop(tx);
    leadership
}

/// A round that outlives the local leadership deadline writes nothing after
/// it: the deadline guards each write, not only the start of the round.
#[tokio::test]
async fn no_write_once_the_leadership_deadline_passed() {
    let w = world();
    let (client, server) = ApiServer::start(scenario(&w, true));
    let publisher = Publisher::new(client, w.router.clone());
    let (tx, leadership) = Leadership::manual();
    tx.send_replace(Some(Instant::now() - Duration::from_millis(1)));
    let round = timeout_after_1s(publisher.publish(
        &w.observed,
        &leadership,
        Timestamp::from_secs(1_800_000_001),
    ))
    .await;
    assert_eq!(round.written, 0, "{round:?}");
    assert!(round.not_leading > 0, "{round:?}");
    assert!(
        server.requests().is_empty(),
        "written after the deadline: {:#?}",
        server.requests()
    );
}
