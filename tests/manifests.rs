//! Every document under `manifests/` is parsed into its typed Kubernetes object,
//! because no apiserver runs in CI to reject a typo for us:
//!
//! - built-in kinds deserialize into their k8s-openapi type, and a field the type
//!   does not know (a misspelt key, silently dropped by serde) is an error;
//! - our kinds are checked against the generated CRD's openAPI schema, deserialized
//!   into the CRD type and run through its CEL rules;
//! - `manifests/crds/inferencecache.io.yaml` is exactly `inferencecache crds`.

use std::path::{Path, PathBuf};

use inferencecache::crd::{self, openapi};
use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Service, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

const CRD_FILE: &str = "manifests/crds/inferencecache.io.yaml";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn crd_manifest_is_up_to_date() {
    let want = crd::render_yaml().unwrap();
    let have = std::fs::read_to_string(root().join(CRD_FILE)).unwrap_or_default();
    assert!(
        have == want,
        "{CRD_FILE} is out of date with src/crd; regenerate it with\n    \
         cargo run -- crds > {CRD_FILE}"
    );
}

fn yaml_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            yaml_files(&path, out);
        } else if matches!(
            path.extension().and_then(|e| e.to_str()),
            Some("yaml" | "yml")
        ) {
            out.push(path);
        }
    }
}

/// Every (file, document index, document) under `manifests/`.
fn documents() -> Vec<(String, usize, Value)> {
    let mut files = Vec::new();
    yaml_files(&root().join("manifests"), &mut files);
    let mut docs = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        let name = file.strip_prefix(root()).unwrap().display().to_string();
        let parsed: Vec<Value> = serde_saphyr::from_multiple(&text)
            .unwrap_or_else(|e| panic!("{name}: invalid YAML: {e}"));
        for (i, doc) in parsed.into_iter().enumerate() {
            if !doc.is_null() {
                docs.push((name.clone(), i + 1, doc));
            }
        }
    }
    docs
}

/// Keys present in `original` but missing from the typed round trip: fields the
/// type does not have. Empty maps/lists may be dropped by the serializer.
fn lost_fields(original: &Value, typed: &Value, path: &str, out: &mut Vec<String>) {
    match (original, typed) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, v) in a {
                let p = format!("{path}.{k}");
                match b.get(k) {
                    Some(w) => lost_fields(v, w, &p, out),
                    None if is_empty(v) => {}
                    None => out.push(format!("{}: unknown field", &p[1..])),
                }
            }
        }
        (Value::Array(a), Value::Array(b)) => {
            for (i, (v, w)) in a.iter().zip(b).enumerate() {
                lost_fields(v, w, &format!("{path}[{i}]"), out);
            }
        }
        _ => {}
    }
}

fn is_empty(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Object(m) => m.is_empty(),
        Value::Array(a) => a.is_empty(),
        _ => false,
    }
}

fn builtin<T: DeserializeOwned + Serialize>(doc: &Value) -> Result<(), Vec<String>> {
    let typed: T = serde_path_to_error::deserialize(doc.clone())
        .map_err(|e| vec![format!("{}: {}", e.path(), e.inner())])?;
    let back = serde_json::to_value(&typed).map_err(|e| vec![e.to_string()])?;
    let mut lost = Vec::new();
    lost_fields(doc, &back, "", &mut lost);
    if lost.is_empty() { Ok(()) } else { Err(lost) }
}

fn custom<K>(doc: &Value, cel: fn(&K) -> Result<(), String>) -> Result<(), Vec<String>>
where
    K: DeserializeOwned + CustomResourceExt,
{
    let schema = openapi::schema_of(&K::crd()).ok_or_else(|| vec!["no schema".to_string()])?;
    let violations: Vec<String> = openapi::validate(&schema, doc)
        .iter()
        .map(ToString::to_string)
        .collect();
    if !violations.is_empty() {
        return Err(violations);
    }
    let typed: K = serde_path_to_error::deserialize(doc.clone())
        .map_err(|e| vec![format!("{}: {}", e.path(), e.inner())])?;
    cel(&typed).map_err(|e| vec![e])
}

macro_rules! cel {
    ($t:ty) => {
        |o: &$t| o.validate_cel().map_err(|e| e.to_string())
    };
}

/// Checks one document; returns its `kind`.
fn check(doc: &Value) -> Result<String, Vec<String>> {
    let api_version = doc["apiVersion"].as_str().unwrap_or_default();
    let kind = doc["kind"].as_str().unwrap_or_default();
    if doc["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .is_empty()
    {
        return Err(vec!["metadata.name: required".into()]);
    }
    use inferencecache::crd::{
        cache_backend::CacheBackend, cache_policy::CachePolicy, cache_tenant::CacheTenant,
        pd_topology::PDTopology, prompt_template::PromptTemplate,
    };
    match (api_version, kind) {
        ("v1", "Namespace") => builtin::<Namespace>(doc),
        ("v1", "ServiceAccount") => builtin::<ServiceAccount>(doc),
        ("v1", "Service") => builtin::<Service>(doc),
        ("v1", "ConfigMap") => builtin::<ConfigMap>(doc),
        ("apps/v1", "Deployment") => builtin::<Deployment>(doc),
        ("rbac.authorization.k8s.io/v1", "ClusterRole") => builtin::<ClusterRole>(doc),
        ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding") => {
            builtin::<ClusterRoleBinding>(doc)
        }
        ("rbac.authorization.k8s.io/v1", "Role") => builtin::<Role>(doc),
        ("rbac.authorization.k8s.io/v1", "RoleBinding") => builtin::<RoleBinding>(doc),
        ("admissionregistration.k8s.io/v1", "ValidatingWebhookConfiguration") => {
            builtin::<ValidatingWebhookConfiguration>(doc)
        }
        ("apiextensions.k8s.io/v1", "CustomResourceDefinition") => {
            builtin::<CustomResourceDefinition>(doc)
        }
        (crd::API_VERSION, "CachePolicy") => custom::<CachePolicy>(doc, cel!(CachePolicy)),
        (crd::API_VERSION, "CacheTenant") => custom::<CacheTenant>(doc, cel!(CacheTenant)),
        (crd::API_VERSION, "CacheBackend") => custom::<CacheBackend>(doc, cel!(CacheBackend)),
        (crd::API_VERSION, "PromptTemplate") => custom::<PromptTemplate>(doc, cel!(PromptTemplate)),
        (crd::API_VERSION, "PDTopology") => custom::<PDTopology>(doc, cel!(PDTopology)),
        (crd::API_VERSION, "CacheIndex") => {
            let schema = openapi::schema_of(&crd::cache_index::crd()).unwrap();
            let v: Vec<String> = openapi::validate(&schema, doc)
                .iter()
                .map(ToString::to_string)
                .collect();
            if v.is_empty() { Ok(()) } else { Err(v) }
        }
        _ => Err(vec![format!(
            "{api_version} {kind}: no typed check for this kind; add one to tests/manifests.rs"
        )]),
    }
    .map(|()| kind.to_string())
}

#[test]
fn every_manifest_document_parses_into_its_typed_object() {
    let docs = documents();
    assert!(!docs.is_empty(), "no documents under manifests/");
    let mut errors = Vec::new();
    let mut kinds = std::collections::BTreeSet::new();
    for (file, index, doc) in &docs {
        match check(doc) {
            Ok(kind) => {
                kinds.insert(kind);
            }
            Err(errs) => {
                let name = doc["metadata"]["name"].as_str().unwrap_or("?");
                for e in errs {
                    errors.push(format!("{file}: document {index} ({name}): {e}"));
                }
            }
        }
    }
    assert!(errors.is_empty(), "\n{}", errors.join("\n"));
    for kind in [
        "CustomResourceDefinition",
        "CachePolicy",
        "CacheTenant",
        "CacheBackend",
        "PromptTemplate",
        "PDTopology",
    ] {
        assert!(kinds.contains(kind), "manifests/ has no {kind}");
    }
}

#[test]
fn a_typo_in_a_manifest_is_caught() {
    let typo: Value = serde_json::json!({
        "apiVersion": "inferencecache.io/v1alpha1", "kind": "CachePolicy",
        "metadata": {"name": "p", "namespace": "ns"},
        "spec": {"routingFloorScor": "0.2"},
    });
    let errs = check(&typo).unwrap_err();
    assert!(
        errs[0].contains("spec.routingFloorScor: unknown field"),
        "{errs:?}"
    );
    let deployment: Value = serde_json::json!({
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d"},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"a": "b"}},
                 "template": {"spec": {"containers": [{"name": "c", "imagee": "x"}]}}},
    });
    let errs = check(&deployment).unwrap_err();
    assert!(
        errs.iter()
            .any(|e| e.contains("spec.template.spec.containers[0].imagee")),
        "{errs:?}"
    );
    let wrong_type: Value = serde_json::json!({
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "s"},
        "spec": {"ports": [{"port": "eighty"}]},
    });
    assert!(check(&wrong_type).is_err());
}

/// `manifests/envoy-config.yaml` is a copy of `envoy/override-host.yaml` adapted to a
/// cluster (bind address, DNS-resolved engines); the routing parts must not drift.
#[test]
fn the_cluster_envoy_config_keeps_the_routing_of_envoy_override_host() {
    let read = |p: &str| std::fs::read_to_string(root().join(p)).unwrap();
    let file: Value = serde_saphyr::from_str(&read("envoy/override-host.yaml")).unwrap();
    let config_map: Value = serde_saphyr::from_str(&read("manifests/envoy-config.yaml")).unwrap();
    let embedded: Value =
        serde_saphyr::from_str(config_map["data"]["envoy.yaml"].as_str().unwrap()).unwrap();
    let listener = |v: &Value| v["static_resources"]["listeners"][0]["filter_chains"].clone();
    assert!(listener(&file).is_array());
    assert_eq!(
        listener(&embedded),
        listener(&file),
        "listener filters drifted"
    );
    let cluster = |v: &Value, name: &str| {
        v["static_resources"]["clusters"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == name)
            .cloned()
            .unwrap_or_else(|| panic!("no cluster {name}"))
    };
    assert_eq!(
        cluster(&embedded, "replicas")["load_balancing_policy"],
        cluster(&file, "replicas")["load_balancing_policy"],
        "the override_host policy drifted"
    );
    assert!(cluster(&file, "replicas")["circuit_breakers"].is_object());
    assert_eq!(
        cluster(&embedded, "replicas")["circuit_breakers"],
        cluster(&file, "replicas")["circuit_breakers"],
        "the replicas' circuit breakers drifted"
    );
    assert_eq!(
        cluster(&embedded, "inferencecache_ext_proc"),
        cluster(&file, "inferencecache_ext_proc"),
        "the ext_proc cluster drifted"
    );
}

/// When the sidecar does not answer (fail-open), Envoy passes the request on
/// unprocessed, so every shipped config strips each decision header a client
/// could forge before ext_proc runs; a header added to the sidecar must be
/// added to all of them.
#[test]
fn every_envoy_config_strips_every_decision_header() {
    use inferencecache::adapters::ext_proc::verdict::DECISION_HEADERS;
    for path in [
        "envoy/override-host.yaml",
        "envoy/original-dst.yaml",
        "envoy/gie.yaml",
        "manifests/envoy-config.yaml",
    ] {
        let text = std::fs::read_to_string(root().join(path)).unwrap();
        for header in DECISION_HEADERS {
            let line = format!("- remove: {header}");
            assert!(
                text.lines().any(|l| l.trim() == line),
                "{path} does not strip {header}"
            );
        }
    }
}

/// A request held by flow control asks Envoy to extend its message timeout to
/// `maxQueueWait` + 1s; Envoy grants that only up to `max_message_timeout`,
/// which every shipped config sets to the longest wait a policy may ask plus
/// that second.
#[test]
fn every_envoy_config_lets_a_held_request_wait_its_longest_queue_wait() {
    use inferencecache::adapters::ext_proc::flow::MESSAGE_TIMEOUT_MARGIN;
    use inferencecache::core::policy::FlowControl;
    let want = FlowControl::MAX_QUEUE_WAIT + MESSAGE_TIMEOUT_MARGIN;
    let line = format!("max_message_timeout: {}s", want.as_secs());
    for path in [
        "envoy/override-host.yaml",
        "envoy/original-dst.yaml",
        "envoy/gie.yaml",
        "manifests/envoy-config.yaml",
    ] {
        let text = std::fs::read_to_string(root().join(path)).unwrap();
        assert!(
            text.lines().any(|l| l.trim() == line),
            "{path} does not set {line}"
        );
    }
}

/// The sidecar's ClusterRole can get/list/watch every resource its watches read
/// (`serve --kubernetes`), including GIE's InferencePools.
#[test]
fn the_cluster_role_reads_every_watched_resource() {
    let role = documents()
        .into_iter()
        .find(|(_, _, d)| d["kind"] == "ClusterRole" && d["metadata"]["name"] == "inferencecache")
        .map(|(_, _, d)| serde_json::from_value::<ClusterRole>(d).unwrap())
        .expect("ClusterRole inferencecache in manifests/");
    let rules = role.rules.unwrap_or_default();
    let can = |group: &str, resource: &str, verb: &str| {
        rules.iter().any(|r| {
            r.api_groups
                .as_deref()
                .unwrap_or_default()
                .iter()
                .any(|g| g == group)
                && r.resources
                    .as_deref()
                    .unwrap_or_default()
                    .iter()
                    .any(|x| x == resource)
                && r.verbs.iter().any(|v| v == verb)
        })
    };
    for (group, resource) in [
        ("inferencecache.io", "cachepolicies"),
        ("inferencecache.io", "cachetenants"),
        ("inferencecache.io", "cachebackends"),
        ("inferencecache.io", "prompttemplates"),
        ("inferencecache.io", "pdtopologies"),
        ("", "pods"),
        ("inference.networking.k8s.io", "inferencepools"),
    ] {
        for verb in ["get", "list", "watch"] {
            assert!(
                can(group, resource, verb),
                "cannot {verb} {group}/{resource}"
            );
        }
    }
    // Read only: we never write GIE's objects.
    for verb in ["create", "update", "patch", "delete"] {
        assert!(
            !can("inference.networking.k8s.io", "inferencepools", verb),
            "{verb}"
        );
    }
}
