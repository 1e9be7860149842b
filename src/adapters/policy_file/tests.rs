use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use super::*;
use crate::core::policy::EvictionAlgorithm;
use crate::core::scope::PROBE_TENANT;

/// A scratch directory removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Self {
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "ic-policy-file-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }
    fn write(&self, name: &str, text: &str) -> PathBuf {
        let p = self.0.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }
    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

const TENANT: &str = "apiVersion: inferencecache.io/v1alpha1
kind: CacheTenant
metadata: {name: t, namespace: team-a}
spec: {tenantID: acme}
";

fn policy(spec: &str) -> String {
    format!(
        "apiVersion: inferencecache.io/v1alpha1\nkind: CachePolicy\nmetadata: {{name: default, namespace: team-a}}\nspec: {spec}\n"
    )
}

const BACKEND: &str = "apiVersion: inferencecache.io/v1alpha1
kind: CacheBackend
metadata: {name: llama, namespace: team-a}
spec:
  engine: vLLM
  modelID: m
  hashScheme: s
  endpoints: [{id: r1, address: '127.0.0.1:9001'}]
";

/// Loads a directory holding `files` and returns the error text.
fn load_err(files: &[(&str, &str)]) -> String {
    let dir = TempDir::new();
    for (name, text) in files {
        dir.write(name, text);
    }
    match load(dir.path()) {
        Ok(l) => panic!("expected an error, loaded {:?}", l.snapshot.revision()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn good_directory_loads_every_file_in_name_order() {
    let dir = TempDir::new();
    dir.write("10-tenant.yaml", TENANT);
    dir.write("20-policy.yml", &policy("{eviction: LFU}"));
    dir.write("30-backend.yaml", BACKEND);
    dir.write("README.md", "not yaml: [");
    let loaded = load(dir.path()).unwrap();
    let snap = &loaded.snapshot;
    assert_eq!(snap.tenant("acme").policy.eviction, EvictionAlgorithm::Lfu);
    assert_eq!(snap.backends().len(), 1);
    assert_eq!(snap.backends()[0].replicas[0].address, "127.0.0.1:9001");
}

#[test]
fn namespace_defaults_to_default() {
    let dir = TempDir::new();
    let file = dir.write(
        "a.yaml",
        "apiVersion: inferencecache.io/v1alpha1\nkind: CacheTenant\nmetadata: {name: t}\nspec: {tenantID: x}\n",
    );
    let loaded = load(&file).unwrap();
    assert_eq!(loaded.snapshot.namespace_of("x"), Some("default"));
}

#[test]
fn bad_yaml_names_the_file() {
    let e = load_err(&[("bad.yaml", "kind: [unclosed")]);
    assert!(e.contains("bad.yaml: invalid YAML"), "{e}");
}

#[test]
fn an_empty_file_or_directory_is_refused() {
    let e = load_err(&[("t.yaml", TENANT), ("p.yaml", "")]);
    assert!(e.contains("p.yaml: no objects"), "{e}");
    let e = load_err(&[("t.yaml", TENANT), ("p.yaml", "# nothing yet\n")]);
    assert!(e.contains("p.yaml: no objects"), "{e}");
    let e = load_err(&[]);
    assert!(e.contains("no *.yaml or *.yml files"), "{e}");
}

/// The loaded policy's `minimumMatchedTokens` for tenant `acme`.
fn minimum(loaded: Result<Loaded, LoadError>) -> u32 {
    let snapshot = loaded.unwrap().snapshot;
    snapshot.tenant("acme").policy.minimum_matched_tokens
}

#[test]
fn a_file_caught_mid_write_is_read_again_before_it_is_parsed() {
    let dir = TempDir::new();
    dir.write("t.yaml", TENANT);
    let file = dir.write("p.yaml", &policy("{minimumMatchedTokens: 10}"));
    let (first, loaded) = watch::poll(dir.path(), None, || {}).unwrap();
    assert_eq!(minimum(loaded), 10);

    // The poll reads the file truncated; the writer finishes while it settles.
    std::fs::write(&file, "").unwrap();
    let write = || std::fs::write(&file, policy("{minimumMatchedTokens: 20}")).unwrap();
    assert!(
        watch::poll(dir.path(), Some(first), write).is_none(),
        "a changing file waits"
    );
    let (second, loaded) = watch::poll(dir.path(), Some(first), || {}).unwrap();
    assert_eq!(minimum(loaded), 20);
    assert!(
        watch::poll(dir.path(), Some(second), || {}).is_none(),
        "unchanged"
    );

    // A file that stays empty is an error, and the caller keeps its last good load.
    std::fs::write(&file, "").unwrap();
    let (_, outcome) = watch::poll(dir.path(), Some(second), || {}).unwrap();
    assert!(
        outcome
            .unwrap_err()
            .to_string()
            .contains("p.yaml: no objects")
    );
}

#[test]
fn unknown_kind_is_an_error() {
    let e = load_err(&[(
        "a.yaml",
        &format!(
            "{TENANT}---\napiVersion: inferencecache.io/v1alpha1\nkind: CacheThing\nmetadata: {{name: x}}\n"
        ),
    )]);
    assert!(
        e.contains("a.yaml: document 2: unknown kind \"CacheThing\""),
        "{e}"
    );
}

#[test]
fn unknown_fields_are_reported_with_their_path() {
    let e = load_err(&[(
        "a.yaml",
        &policy("{evictionTtl: 5m, strategy: {requireChains: true}}"),
    )]);
    assert!(
        e.contains("document 1: CachePolicy team-a/default: spec.evictionTtl: unknown field"),
        "{e}"
    );
    assert!(
        e.contains("spec.strategy.requireChains: unknown field"),
        "{e}"
    );
    let e = load_err(&[(
        "a.yaml",
        &TENANT.replace("metadata: {", "metadata: {labelz: {}, "),
    )]);
    assert!(e.contains("metadata.labelz: unknown field"), "{e}");
}

#[test]
fn bad_routing_floor_score_is_rejected() {
    let e = load_err(&[
        ("t.yaml", TENANT),
        ("p.yaml", &policy("{routingFloorScore: \"-1\"}")),
    ]);
    assert!(
        e.contains(r#"p.yaml: document 1: CachePolicy team-a/default: spec.routingFloorScore: "-1" is not a non-negative decimal"#),
        "{e}"
    );
    // An unquoted number is a type error, as the apiserver would say.
    let e = load_err(&[("p.yaml", &policy("{routingFloorScore: 0.5}"))]);
    assert!(e.contains("spec.routingFloorScore: invalid type"), "{e}");
}

#[test]
fn bad_duration_and_negative_minimum_are_rejected() {
    let e = load_err(&[
        ("t.yaml", TENANT),
        ("p.yaml", &policy("{evictionTTL: 10 minutes}")),
    ]);
    assert!(e.contains("spec.evictionTTL:"), "{e}");
    let e = load_err(&[("p.yaml", &policy("{minimumMatchedTokens: -1}"))]);
    assert!(
        e.contains("spec.minimumMatchedTokens: -1 is below the minimum 0"),
        "{e}"
    );
}

#[test]
fn require_chain_without_chain_matching_is_rejected() {
    let e = load_err(&[(
        "p.yaml",
        &policy("{strategy: {requireChain: true, enableChainMatching: false}}"),
    )]);
    assert!(
        e.contains("CachePolicy team-a/default") && e.contains("requireChain"),
        "{e}"
    );
}

#[test]
fn missing_name_is_rejected() {
    let e = load_err(&[(
        "a.yaml",
        "apiVersion: inferencecache.io/v1alpha1\nkind: CacheTenant\nmetadata: {namespace: x}\nspec: {tenantID: y}\n",
    )]);
    assert!(
        e.contains("a.yaml: document 1: CacheTenant: metadata.name: required"),
        "{e}"
    );
}

#[test]
fn duplicate_tenant_id_is_rejected() {
    let other = TENANT.replace("team-a", "team-b");
    let e = load_err(&[("a.yaml", TENANT), ("b.yaml", &other)]);
    assert!(
        e.contains(r#"b.yaml: document 1: CacheTenant team-b/t: spec.tenantID: tenant id "acme" is already claimed by CacheTenant team-a/t"#),
        "{e}"
    );
}

#[test]
fn probe_tenant_id_is_rejected() {
    let e = load_err(&[("a.yaml", &TENANT.replace("acme", PROBE_TENANT))]);
    assert!(
        e.contains("CacheTenant team-a/t") && e.contains("reserved"),
        "{e}"
    );
}

#[test]
fn same_object_twice_is_rejected() {
    let e = load_err(&[("a.yaml", TENANT), ("b.yaml", TENANT)]);
    assert!(e.contains("duplicate of"), "{e}");
}

#[test]
fn oldest_of_several_policies_wins() {
    let dir = TempDir::new();
    dir.write("t.yaml", TENANT);
    dir.write(
        "p.yaml",
        "apiVersion: inferencecache.io/v1alpha1
kind: CachePolicy
metadata: {name: newer, namespace: team-a, creationTimestamp: '2025-02-01T00:00:00Z'}
spec: {minimumMatchedTokens: 1}
---
apiVersion: inferencecache.io/v1alpha1
kind: CachePolicy
metadata: {name: older, namespace: team-a, creationTimestamp: '2025-01-01T00:00:00Z'}
spec: {minimumMatchedTokens: 2}
",
    );
    let loaded = load(dir.path()).unwrap();
    assert_eq!(
        loaded.snapshot.tenant("acme").policy.minimum_matched_tokens,
        2
    );
    assert_eq!(loaded.ignored.len(), 1);
    assert_eq!(loaded.ignored[0].name, "newer");
}

#[test]
fn the_standalone_example_loads() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/standalone/policy.yaml");
    let loaded = load(&path).unwrap();
    let snap = &loaded.snapshot;
    assert_eq!(snap.namespace_of("demo"), Some("demo"));
    let ns = snap.namespace("demo").unwrap();
    assert_eq!(ns.policy_name.as_deref(), Some("default"));
    let b = &snap.backends()[0];
    assert_eq!(b.scope.to_string(), "demo/demo-model/ic-content-v1");
    let ids: Vec<_> = b
        .replicas
        .iter()
        .map(|r| (r.id.as_str(), r.address.as_str()))
        .collect();
    assert_eq!(
        ids,
        [
            ("replica-a", "127.0.0.1:18001"),
            ("replica-b", "127.0.0.1:18002"),
            ("replica-c", "127.0.0.1:18003")
        ]
    );
}

/// Waits until `cond` holds, polling briefly.
async fn eventually(what: &str, cond: impl Fn() -> bool) {
    for _ in 0..400 {
        if cond() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out waiting for {what}");
}

#[tokio::test]
async fn watch_reloads_on_change_and_keeps_the_last_good_on_a_bad_edit() {
    let dir = TempDir::new();
    dir.write("t.yaml", TENANT);
    let file = dir.write("p.yaml", &policy("{minimumMatchedTokens: 10}"));
    let seen: Arc<parking_lot::Mutex<Vec<u32>>> = Arc::default();
    let status = Arc::new(SourceStatus::new());
    let sink = seen.clone();
    let task = tokio::spawn(watch(
        dir.path().to_path_buf(),
        Duration::from_millis(20),
        move |snap: PolicySnapshot| {
            sink.lock()
                .push(snap.tenant("acme").policy.minimum_matched_tokens)
        },
        status.clone(),
    ));

    eventually("first load", || seen.lock().len() == 1).await;
    assert_eq!(seen.lock()[0], 10);
    let first_rev = status.last_good_revision().unwrap();
    assert!(status.loaded_at().is_some());

    std::fs::write(&file, policy("{minimumMatchedTokens: 20}")).unwrap();
    eventually("reload", || seen.lock().len() == 2).await;
    assert_eq!(seen.lock()[1], 20);
    let second_rev = status.last_good_revision().unwrap();
    assert_ne!(first_rev, second_rev);

    std::fs::write(&file, policy("{routingFloorScore: \"-1\"}")).unwrap();
    eventually("error recorded", || status.reload_error_count() == 1).await;
    assert!(
        status
            .last_error()
            .unwrap()
            .contains("spec.routingFloorScore")
    );
    tokio::time::sleep(Duration::from_millis(80)).await;
    assert_eq!(seen.lock().len(), 2, "a bad edit must not reach the router");
    assert_eq!(
        status.reload_error_count(),
        1,
        "an unchanged bad file counts once"
    );
    assert_eq!(status.last_good_revision().unwrap(), second_rev);

    std::fs::write(&file, policy("{minimumMatchedTokens: 30}")).unwrap();
    eventually("recovery", || seen.lock().len() == 3).await;
    assert_eq!(seen.lock()[2], 30);
    assert_eq!(status.last_error(), None);
    assert_eq!(status.reload_ok_count(), 3);
    task.abort();
}

#[test]
fn load_awareness_and_its_tuning_load_from_yaml() {
    let dir = TempDir::new();
    dir.write("t.yaml", TENANT);
    dir.write(
        "p.yaml",
        &policy("{loadAwareness: Disabled, loadBalancing: {factor: \"1.5\", slack: 4, statsMaxAge: 2s, pendingTTL: 3s, prefillSlackTokens: 512}}"),
    );
    let loaded = load(dir.path()).unwrap();
    let p = &loaded.snapshot.tenant("acme").policy;
    assert_eq!(
        p.load_awareness,
        crate::core::policy::LoadAwareness::Disabled
    );
    assert_eq!(p.load_balancing.factor, 1.5);
    assert_eq!(p.load_balancing.slack, 4);
    assert_eq!(p.load_balancing.prefill_slack_tokens, 512);
    assert_eq!(
        p.load_balancing.stats_max_age,
        std::time::Duration::from_secs(2)
    );
    // No CachePolicy field at all: the rule is on with its defaults.
    let dir = TempDir::new();
    dir.write("t.yaml", TENANT);
    dir.write("p.yaml", &policy("{}"));
    let loaded = load(dir.path()).unwrap();
    let p = &loaded.snapshot.tenant("acme").policy;
    assert_eq!(
        p.load_awareness,
        crate::core::policy::LoadAwareness::Enabled
    );
    assert_eq!(
        p.load_balancing,
        crate::core::policy::LoadBalancing::default()
    );
}

#[test]
fn bad_load_tuning_is_rejected_with_its_field() {
    let e = load_err(&[
        ("t.yaml", TENANT),
        ("p.yaml", &policy("{loadBalancing: {factor: \"0.5\"}}")),
    ]);
    assert!(e.contains("spec.loadBalancing.factor"), "{e}");
    let e = load_err(&[("p.yaml", &policy("{loadBalancing: {slack: -1}}"))]);
    assert!(
        e.contains("spec.loadBalancing.slack: -1 is below the minimum 0"),
        "{e}"
    );
    let e = load_err(&[(
        "p.yaml",
        &policy("{loadBalancing: {prefillSlackTokens: -5}}"),
    )]);
    assert!(
        e.contains("spec.loadBalancing.prefillSlackTokens: -5 is below the minimum 0"),
        "{e}"
    );
    let e = load_err(&[("p.yaml", &policy("{loadBalancing: {statsMaxAge: soon}}"))]);
    assert!(e.contains("spec.loadBalancing.statsMaxAge"), "{e}");
    let e = load_err(&[("p.yaml", &policy("{loadAwareness: Sometimes}"))]);
    assert!(e.contains("loadAwareness"), "{e}");
}

#[test]
fn data_parallel_ranks_load_from_yaml_and_bad_sizes_are_named() {
    let dir = TempDir::new();
    dir.write("t.yaml", TENANT);
    dir.write(
        "b.yaml",
        "apiVersion: inferencecache.io/v1alpha1
kind: CacheBackend
metadata: {name: llama, namespace: team-a}
spec:
  engine: vLLM
  modelID: m
  hashScheme: s
  dataParallelSize: 2
  kvEvents: {port: 5557, replayPort: 5558}
  endpoints:
  - {id: r1, address: '127.0.0.1:9001'}
  - {id: r2, address: '127.0.0.1:9002', dataParallelSize: 4,
     kvEventsEndpoint: 'tcp://127.0.0.1:6000', kvReplayEndpoint: 'tcp://127.0.0.1:6100'}
",
    );
    let loaded = load(dir.path()).unwrap();
    let r = &loaded.snapshot.backends()[0].replicas;
    assert_eq!((r[0].data_parallel_size, r[1].data_parallel_size), (2, 4));
    assert_eq!(
        r[1].kv_replay_endpoint.as_deref(),
        Some("tcp://127.0.0.1:6100")
    );
    let e = load_err(&[
        ("t.yaml", TENANT),
        (
            "b.yaml",
            &BACKEND.replace("hashScheme: s", "hashScheme: s\n  dataParallelSize: 300"),
        ),
    ]);
    assert!(e.contains("spec.dataParallelSize"), "{e}");
}

#[test]
fn tier_weights_load_from_yaml_and_out_of_range_is_named() {
    let dir = TempDir::new();
    dir.write("t.yaml", TENANT);
    dir.write(
        "p.yaml",
        &policy("{tierWeights: {cpu: \"0.75\", disk: \"0\"}}"),
    );
    let loaded = load(dir.path()).unwrap();
    let w = loaded.snapshot.tenant("acme").policy.tier_weights;
    assert_eq!((w.cpu, w.disk), (0.75, 0.0));
    // Omitted: the defaults (CPU 0.8, disk 0.25).
    dir.write("p.yaml", &policy("{tierWeights: {}}"));
    let w = load(dir.path())
        .unwrap()
        .snapshot
        .tenant("acme")
        .policy
        .tier_weights;
    assert_eq!((w.cpu, w.disk), (0.8, 0.25));
    let e = load_err(&[
        ("t.yaml", TENANT),
        ("p.yaml", &policy("{tierWeights: {disk: \"2\"}}")),
    ]);
    assert!(
        e.contains("spec.tierWeights.disk: 2 is outside 0..1"),
        "{e}"
    );
}

#[test]
fn lora_adapters_load_from_yaml_and_bad_ones_are_named() {
    let with = |adapters: &str| {
        BACKEND.replace(
            "hashScheme: s",
            &format!("hashScheme: s\n  loraAdapters: {adapters}"),
        )
    };
    let dir = TempDir::new();
    dir.write("t.yaml", TENANT);
    dir.write("b.yaml", &with("[sql-lora, chat-lora]"));
    let loaded = load(dir.path()).unwrap();
    assert_eq!(
        loaded.snapshot.backends()[0].lora_adapters,
        vec!["sql-lora".to_string(), "chat-lora".to_string()]
    );
    for (adapters, says) in [
        ("[a, a]", "spec.loraAdapters[1]: duplicate adapter \"a\""),
        (
            "[m]",
            "spec.loraAdapters[0]: \"m\" is the backend's modelID, not an adapter",
        ),
        // The CRD's own rule answers first, as the apiserver would.
        (
            "['']",
            "spec.loraAdapters: loraAdapters entries must be non-empty",
        ),
    ] {
        let e = load_err(&[("t.yaml", TENANT), ("b.yaml", &with(adapters))]);
        assert!(e.contains(says), "{adapters}: {e}");
    }
}

/// File mode has no cluster: a CacheBackend naming an InferencePool fails the
/// load, naming the file, the field and the way out.
#[test]
fn an_inference_pool_ref_is_an_error_in_a_policy_file() {
    let pooled = BACKEND.replace(
        "  endpoints: [{id: r1, address: '127.0.0.1:9001'}]\n",
        "  inferencePoolRef: {name: llama}\n",
    );
    let e = load_err(&[("10-tenant.yaml", TENANT), ("30-backend.yaml", &pooled)]);
    assert!(e.contains("30-backend.yaml: document 1"), "{e}");
    assert!(
        e.contains("spec.inferencePoolRef: InferencePool team-a/llama: a pool reference needs serve --kubernetes"),
        "{e}"
    );
}

#[test]
fn flow_control_loads_from_yaml_with_defaults_and_bad_values_are_named() {
    let dir = TempDir::new();
    dir.write("t.yaml", TENANT);
    // Omitted: disabled, one second, 1024 held requests.
    dir.write("p.yaml", &policy("{}"));
    let fc = load(dir.path())
        .unwrap()
        .snapshot
        .tenant("acme")
        .policy
        .flow_control;
    assert_eq!(fc, crate::core::policy::FlowControl::default());
    assert!(!fc.enabled);
    assert_eq!(fc.max_queue_wait, Duration::from_secs(1));
    assert_eq!(fc.max_queued, 1024);
    assert_eq!(fc.max_backlog_tokens, 2048);
    dir.write(
        "p.yaml",
        &policy(
            "{flowControl: {enabled: true, maxQueueWait: 250ms, maxQueuedRequests: 7, maxPrefillBacklogTokens: 0}}",
        ),
    );
    let fc = load(dir.path())
        .unwrap()
        .snapshot
        .tenant("acme")
        .policy
        .flow_control;
    assert!(fc.enabled);
    assert_eq!(fc.max_queue_wait, Duration::from_millis(250));
    assert_eq!(fc.max_queued, 7);
    assert_eq!(fc.max_backlog_tokens, 0, "0 leaves the backlog bound out");
    let e = load_err(&[
        ("t.yaml", TENANT),
        (
            "p.yaml",
            &policy("{flowControl: {maxPrefillBacklogTokens: -1}}"),
        ),
    ]);
    assert!(
        e.contains("spec.flowControl.maxPrefillBacklogTokens: -1 is below the minimum 0"),
        "{e}"
    );
    let e = load_err(&[
        ("t.yaml", TENANT),
        ("p.yaml", &policy("{flowControl: {maxQueueWait: 0s}}")),
    ]);
    assert!(
        e.contains("spec.flowControl.maxQueueWait") && e.contains("must be positive"),
        "{e}"
    );
    let e = load_err(&[
        ("t.yaml", TENANT),
        ("p.yaml", &policy("{flowControl: {maxQueuedRequests: 0}}")),
    ]);
    assert!(
        e.contains("spec.flowControl.maxQueuedRequests: 0 is below the minimum 1"),
        "{e}"
    );
}

#[test]
fn tenant_weight_is_its_fair_share_only_under_fairness() {
    let dir = TempDir::new();
    dir.write("p.yaml", &policy("{}"));
    // No isolation mode: first come, first served (no fair weight).
    dir.write(
        "t.yaml",
        &TENANT.replace("{tenantID: acme}", "{tenantID: acme, weight: 3}"),
    );
    let snap = load(dir.path()).unwrap().snapshot;
    assert_eq!(snap.tenant("acme").fair_weight, None);
    dir.write(
        "t.yaml",
        &TENANT.replace(
            "{tenantID: acme}",
            "{tenantID: acme, isolationMode: Fairness, weight: 3}",
        ),
    );
    let snap = load(dir.path()).unwrap().snapshot;
    assert_eq!(snap.tenant("acme").fair_weight, Some(3));
    // Weight omitted: 1.
    dir.write(
        "t.yaml",
        &TENANT.replace(
            "{tenantID: acme}",
            "{tenantID: acme, isolationMode: Fairness}",
        ),
    );
    let snap = load(dir.path()).unwrap().snapshot;
    assert_eq!(snap.tenant("acme").fair_weight, Some(1));
    assert_eq!(snap.tenant("someone-else").fair_weight, None);
    let e = load_err(&[
        ("p.yaml", &policy("{}")),
        (
            "t.yaml",
            &TENANT.replace("{tenantID: acme}", "{tenantID: acme, weight: 0}"),
        ),
    ]);
    assert!(e.contains("spec.weight: 0 is below the minimum 1"), "{e}");
}
