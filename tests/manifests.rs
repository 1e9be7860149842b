//! Every document under `manifests/` is parsed into its typed Kubernetes object,
//! because no apiserver runs in CI to reject a typo for us:
//!
//! - built-in kinds deserialize into their k8s-openapi type, and a field the type
//!   does not know (a misspelt key, silently dropped by serde) is an error;
//! - our kinds are checked against the generated CRD's openAPI schema, deserialized
//!   into the CRD type and run through its CEL rules;
//! - `manifests/crds/inferencecache.io.yaml` is exactly `inferencecache crds`;
//! - the router replicas act as one fleet over the NATS defined beside them: the
//!   `--fleet-nats` host is a Service of `manifests/` reaching a nats-server whose
//!   config enables JetStream on a persistent volume, each replica has its own
//!   fleet id, both sides hold the same token and no NetworkPolicy shuts the
//!   routers out.

use std::path::{Path, PathBuf};

use inferencecache::crd::{self, openapi};
use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::core::v1::{
    ConfigMap, Container, Namespace, PodSpec, Service, ServiceAccount,
};
use k8s_openapi::api::networking::v1::NetworkPolicy;
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
        ("apps/v1", "StatefulSet") => builtin::<StatefulSet>(doc),
        ("networking.k8s.io/v1", "NetworkPolicy") => builtin::<NetworkPolicy>(doc),
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

// --- fleet sync: the router replicas and their NATS ----------------------------

type Labels = std::collections::BTreeMap<String, String>;

/// A nats-server configuration file as JSON: maps, arrays, and every scalar as
/// the string written (`$VAR` references and units kept), keys lower-cased. Only
/// the syntax a shipped file uses; `include` is refused.
fn parse_nats_conf(text: &str) -> Result<Value, String> {
    let mut conf = NatsConf {
        s: text.chars().collect(),
        i: 0,
    };
    conf.map(None).map(Value::Object)
}

struct NatsConf {
    s: Vec<char>,
    i: usize,
}

impl NatsConf {
    fn peek(&self) -> Option<char> {
        self.s.get(self.i).copied()
    }

    /// Skips blanks, newlines, separators (`,` `;`) and comments (`#`, `//`).
    fn skip(&mut self) {
        while let Some(c) = self.peek() {
            if c.is_whitespace() || c == ',' || c == ';' {
                self.i += 1;
            } else if c == '#' || (c == '/' && self.s.get(self.i + 1) == Some(&'/')) {
                while self.peek().is_some_and(|c| c != '\n') {
                    self.i += 1;
                }
            } else {
                break;
            }
        }
    }

    fn map(&mut self, close: Option<char>) -> Result<serde_json::Map<String, Value>, String> {
        let mut map = serde_json::Map::new();
        loop {
            self.skip();
            match self.peek() {
                None if close.is_none() => return Ok(map),
                None => return Err("a block is not closed".into()),
                Some(c) if Some(c) == close => {
                    self.i += 1;
                    return Ok(map);
                }
                Some(_) => {}
            }
            let key = match self.peek() {
                Some('"' | '\'') => self.quoted()?,
                _ => self.bare(|c| c.is_whitespace() || ":={[".contains(c))?,
            }
            .to_lowercase();
            if key == "include" {
                return Err("include is not supported here".into());
            }
            while self.peek().is_some_and(|c| c == ' ' || c == '\t') {
                self.i += 1;
            }
            if matches!(self.peek(), Some(':' | '=')) {
                self.i += 1;
            }
            self.skip();
            let value = self.value()?;
            map.insert(key, value);
        }
    }

    fn value(&mut self) -> Result<Value, String> {
        match self.peek() {
            Some('{') => {
                self.i += 1;
                self.map(Some('}')).map(Value::Object)
            }
            Some('[') => {
                self.i += 1;
                let mut items = Vec::new();
                loop {
                    self.skip();
                    match self.peek() {
                        None => return Err("a list is not closed".into()),
                        Some(']') => {
                            self.i += 1;
                            return Ok(Value::Array(items));
                        }
                        Some(_) => items.push(self.value()?),
                    }
                }
            }
            Some('"' | '\'') => self.quoted().map(Value::String),
            _ => self
                .bare(|c| c.is_whitespace() || ",;}]#".contains(c))
                .map(Value::String),
        }
    }

    fn quoted(&mut self) -> Result<String, String> {
        let quote = self.peek();
        self.i += 1;
        let start = self.i;
        while self.peek() != quote {
            if self.peek().is_none() {
                return Err("a string is not closed".into());
            }
            self.i += 1;
        }
        self.i += 1;
        Ok(self.s[start..self.i - 1].iter().collect())
    }

    fn bare(&mut self, end: impl Fn(char) -> bool) -> Result<String, String> {
        let start = self.i;
        while self.peek().is_some_and(|c| !end(c)) {
            self.i += 1;
        }
        if self.i == start {
            return Err(format!("a value is missing at character {start}"));
        }
        Ok(self.s[start..self.i].iter().collect())
    }
}

/// Whether a nats-server configuration runs JetStream (`jetstream { ... }` or
/// `jetstream: enabled`, and not `enabled: false` inside the block).
fn jetstream_enabled(conf: &Value) -> bool {
    let on = |v: &Value| {
        v.as_str()
            .is_some_and(|s| matches!(s.to_lowercase().as_str(), "true" | "yes" | "on" | "enabled"))
    };
    match &conf["jetstream"] {
        Value::Object(block) => block.get("enabled").is_none_or(on),
        v => on(v),
    }
}

fn find<'d>(docs: &'d [Value], kind: &str, namespace: &str, name: &str) -> Option<&'d Value> {
    docs.iter().find(|d| {
        d["kind"] == kind
            && d["metadata"]["namespace"].as_str().unwrap_or_default() == namespace
            && d["metadata"]["name"] == name
    })
}

fn typed<T: DeserializeOwned>(doc: &Value) -> T {
    serde_json::from_value(doc.clone()).unwrap()
}

/// Every label of `selector` is on `labels` (an empty selector selects all).
fn selects(selector: &Labels, labels: &Labels) -> bool {
    selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

fn label_selector_selects(
    selector: &k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector,
    labels: &Labels,
) -> bool {
    selector
        .match_expressions
        .as_deref()
        .unwrap_or_default()
        .is_empty()
        && selects(&selector.match_labels.clone().unwrap_or_default(), labels)
}

/// The pods of a Deployment or StatefulSet: their labels, spec and the names of
/// the volume claim templates (persistent volumes).
struct Workload {
    labels: Labels,
    pod: PodSpec,
    claims: Vec<String>,
}

fn workloads(docs: &[Value], namespace: &str) -> Vec<(String, Workload)> {
    let mut out = Vec::new();
    for d in docs
        .iter()
        .filter(|d| d["metadata"]["namespace"] == namespace)
    {
        let name = d["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let (template, claims) = match d["kind"].as_str() {
            Some("Deployment") => (typed::<Deployment>(d).spec.unwrap().template, Vec::new()),
            Some("StatefulSet") => {
                let spec = typed::<StatefulSet>(d).spec.unwrap();
                let claims = spec
                    .volume_claim_templates
                    .unwrap_or_default()
                    .into_iter()
                    .filter_map(|c| c.metadata.name)
                    .collect();
                (spec.template, claims)
            }
            _ => continue,
        };
        let labels = template.metadata.and_then(|m| m.labels).unwrap_or_default();
        out.push((
            name,
            Workload {
                labels,
                pod: template.spec.unwrap_or_default(),
                claims,
            },
        ));
    }
    out
}

/// The volume `path` lies in, mounted in `container`, and the path inside it.
fn mounted<'p>(
    pod: &'p PodSpec,
    container: &Container,
    path: &str,
) -> Option<(&'p k8s_openapi::api::core::v1::Volume, String)> {
    container
        .volume_mounts
        .as_deref()
        .unwrap_or_default()
        .iter()
        .find_map(|m| {
            let rest = path
                .strip_prefix(m.mount_path.trim_end_matches('/'))?
                .strip_prefix('/')?;
            let volume = pod
                .volumes
                .as_deref()
                .unwrap_or_default()
                .iter()
                .find(|v| v.name == m.name)?;
            Some((volume, rest.to_string()))
        })
}

/// The key a file of a Secret or ConfigMap volume holds.
fn key_of(items: Option<&[k8s_openapi::api::core::v1::KeyToPath]>, file: &str) -> String {
    match items {
        Some(items) => items
            .iter()
            .find(|i| i.path == file)
            .map(|i| i.key.clone())
            .unwrap_or_else(|| format!("<no item at {file}>")),
        None => file.to_string(),
    }
}

/// The (Secret, key) the file at `path` of `container` comes from.
fn secret_file(pod: &PodSpec, container: &Container, path: &str) -> Option<(String, String)> {
    let (volume, file) = mounted(pod, container, path)?;
    let secret = volume.secret.as_ref()?;
    Some((
        secret.secret_name.clone()?,
        key_of(secret.items.as_deref(), &file),
    ))
}

const SYSTEM_NS: &str = "inferencecache-system";

/// What keeps the router replicas of `docs` from acting as one fleet over the
/// NATS defined beside them (empty: nothing).
fn fleet_problems(docs: &[Value]) -> Vec<String> {
    let mut problems = Vec::new();
    let Some(router) = find(docs, "Deployment", SYSTEM_NS, "inferencecache") else {
        return vec![format!("no Deployment {SYSTEM_NS}/inferencecache")];
    };
    let router: Deployment = typed(router);
    let spec = router.spec.unwrap();
    let replicas = spec.replicas.unwrap_or(1);
    if replicas < 2 {
        problems.push(format!(
            "the router runs {replicas} replica(s): a fleet needs at least 2"
        ));
    }
    let router_labels = spec
        .template
        .metadata
        .and_then(|m| m.labels)
        .unwrap_or_default();
    let pod = spec.template.spec.unwrap_or_default();
    let Some(sidecar) = pod.containers.iter().find(|c| c.name == "inferencecache") else {
        return vec!["the router has no container inferencecache".into()];
    };
    let args = sidecar.args.clone().unwrap_or_default();
    let flag = |name: &str| {
        let prefix = format!("--{name}=");
        args.iter()
            .find_map(|a| a.strip_prefix(prefix.as_str()))
            .map(str::to_string)
    };

    // Each replica publishes under its own fleet id: the pod name.
    let env = sidecar.env.clone().unwrap_or_default();
    match flag("fleet-id") {
        None => {} // $POD_NAME, then the host name: the pod's own.
        Some(id) => match id.strip_prefix("$(").and_then(|v| v.strip_suffix(')')) {
            Some(var) => {
                let from_pod_name = env.iter().any(|e| {
                    e.name == var
                        && e.value_from
                            .as_ref()
                            .and_then(|f| f.field_ref.as_ref())
                            .is_some_and(|f| f.field_path == "metadata.name")
                });
                if !from_pod_name {
                    problems.push(format!(
                        "--fleet-id={id}: {var} is not an env var set to the pod name"
                    ));
                }
            }
            None => problems.push(format!(
                "--fleet-id={id}: every replica would publish as the same fleet id"
            )),
        },
    }

    let Some(url) = flag("fleet-nats") else {
        problems.push("the sidecar has no --fleet-nats".into());
        return problems;
    };
    for server in url.split(',').map(str::trim) {
        let Some(address) = server
            .strip_prefix("nats://")
            .or_else(|| server.strip_prefix("tls://"))
        else {
            problems.push(format!("--fleet-nats {server}: not nats:// or tls://"));
            continue;
        };
        if address.contains('@') {
            problems.push(format!(
                "--fleet-nats {server}: credentials in the URL are not used; \
                 use --fleet-nats-creds or --fleet-nats-token-file"
            ));
            continue;
        }
        let (host, port) = match address.rsplit_once(':') {
            Some((h, p)) => (h, p.parse::<i32>().unwrap_or(-1)),
            None => (address, 4222),
        };
        let parts: Vec<&str> = host.split('.').collect();
        let (name, namespace) = (parts[0], parts.get(1).copied().unwrap_or(SYSTEM_NS));
        let suffix = parts.get(2..).unwrap_or_default();
        if !matches!(suffix, [] | ["svc"] | ["svc", "cluster", "local"]) {
            problems.push(format!(
                "--fleet-nats {server}: {host} is not a cluster Service name"
            ));
            continue;
        }
        let Some(service) = find(docs, "Service", namespace, name) else {
            problems.push(format!(
                "--fleet-nats {server}: no Service {namespace}/{name} in manifests/"
            ));
            continue;
        };
        let service: Service = typed(service);
        let service_spec = service.spec.unwrap_or_default();
        let Some(service_port) = service_spec
            .ports
            .unwrap_or_default()
            .into_iter()
            .find(|p| p.port == port)
        else {
            problems.push(format!("Service {namespace}/{name} has no port {port}"));
            continue;
        };
        let selector = service_spec.selector.unwrap_or_default();
        let backends: Vec<_> = workloads(docs, namespace)
            .into_iter()
            .filter(|(_, w)| !selector.is_empty() && selects(&selector, &w.labels))
            .collect();
        let [(workload_name, nats)] = backends.as_slice() else {
            problems.push(format!(
                "Service {namespace}/{name} selects {} workloads in manifests/, not one",
                backends.len()
            ));
            continue;
        };
        use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
        let target = service_port.target_port.unwrap_or(IntOrString::Int(port));
        let served = nats.pod.containers.iter().find_map(|c| {
            c.ports.as_deref().unwrap_or_default().iter().find_map(|p| {
                let hit = match &target {
                    IntOrString::Int(n) => p.container_port == *n,
                    IntOrString::String(s) => p.name.as_deref() == Some(s.as_str()),
                };
                hit.then_some((c, p.container_port, p.name.clone()))
            })
        });
        let Some((server_container, client_port, port_name)) = served else {
            problems.push(format!(
                "{workload_name}: no container port for Service {namespace}/{name} port {port}"
            ));
            continue;
        };
        let server = NatsServer {
            docs,
            namespace,
            workload: nats,
            container: server_container,
            client_port,
        };
        problems.extend(
            server
                .problems(&pod, sidecar)
                .into_iter()
                .map(|p| format!("{namespace}/{workload_name}: {p}")),
        );
        problems.extend(network_policy_problems(
            docs,
            namespace,
            &nats.labels,
            (client_port, port_name.as_deref()),
            &router_labels,
        ));
    }
    problems
}

/// The NATS server a Service of `manifests/` reaches: the pods of `workload`,
/// whose `container` listens on `client_port`.
struct NatsServer<'d> {
    docs: &'d [Value],
    namespace: &'d str,
    workload: &'d Workload,
    container: &'d Container,
    client_port: i32,
}

impl NatsServer<'_> {
    /// Its configuration: the file `--config` names, from a ConfigMap.
    fn conf(&self) -> Result<Value, String> {
        let argv: Vec<&String> = self
            .container
            .command
            .iter()
            .chain(self.container.args.iter())
            .flatten()
            .collect();
        let path = argv
            .iter()
            .enumerate()
            .find_map(|(i, a)| match a.as_str() {
                "--config" | "-c" => argv.get(i + 1).map(|p| p.to_string()),
                _ => a.strip_prefix("--config=").map(str::to_string),
            })
            .ok_or("nats-server is not given --config")?;
        let (volume, file) = mounted(&self.workload.pod, self.container, &path)
            .ok_or_else(|| format!("--config {path} is on no mounted volume"))?;
        let source = volume
            .config_map
            .as_ref()
            .ok_or_else(|| format!("--config {path} is not from a ConfigMap"))?;
        let key = key_of(source.items.as_deref(), &file);
        let config_map: ConfigMap = typed(
            find(self.docs, "ConfigMap", self.namespace, &source.name)
                .ok_or_else(|| format!("no ConfigMap {} in manifests/", source.name))?,
        );
        let text = config_map
            .data
            .unwrap_or_default()
            .remove(&key)
            .ok_or_else(|| format!("ConfigMap {} has no key {key}", source.name))?;
        parse_nats_conf(&text).map_err(|e| format!("ConfigMap {} {key}: {e}", source.name))
    }

    /// What keeps the sidecar `sidecar` of the router pod `router` from using
    /// it: its listening port, JetStream and its storage, and whether both sides
    /// hold the same credential.
    fn problems(&self, router: &PodSpec, sidecar: &Container) -> Vec<String> {
        let conf = match self.conf() {
            Ok(conf) => conf,
            Err(e) => return vec![e],
        };
        let mut problems = Vec::new();
        let listen = conf["port"]
            .as_str()
            .or_else(|| conf["listen"].as_str()?.rsplit(':').next())
            .unwrap_or("4222");
        if listen != self.client_port.to_string() {
            problems.push(format!(
                "nats.conf listens on {listen}, the Service reaches port {}",
                self.client_port
            ));
        }

        if jetstream_enabled(&conf) {
            let store = conf["jetstream"]["store_dir"].as_str().unwrap_or_default();
            let pod = &self.workload.pod;
            let persistent =
                self.container
                    .volume_mounts
                    .as_deref()
                    .unwrap_or_default()
                    .iter()
                    .any(|m| {
                        let dir = m.mount_path.trim_end_matches('/');
                        let under = store == dir || store.starts_with(&format!("{dir}/"));
                        let claim =
                            self.workload.claims.contains(&m.name)
                                || pod.volumes.as_deref().unwrap_or_default().iter().any(|v| {
                                    v.name == m.name && v.persistent_volume_claim.is_some()
                                });
                        under && claim
                    });
            if !persistent {
                problems.push(format!(
                    "JetStream's store_dir {store:?} is not on a persistent volume"
                ));
            }
        } else {
            problems.push("nats.conf does not enable JetStream".into());
        }

        let auth = &conf["authorization"];
        if let Some(token) = auth["token"].as_str() {
            problems.extend(self.token_problem(token, router, sidecar));
        } else if conf["operator"].is_null()
            && conf["accounts"].is_null()
            && auth["users"].is_null()
        {
            problems.push("nats.conf lets in clients without credentials".into());
        }
        problems
    }

    /// The server's token is a `$VARIABLE` from a Secret, and the sidecar sends
    /// the same Secret's key with `--fleet-nats-token-file`.
    fn token_problem(&self, token: &str, router: &PodSpec, sidecar: &Container) -> Option<String> {
        let Some(var) = token.strip_prefix('$') else {
            return Some("nats.conf holds the token itself, not a $VARIABLE".into());
        };
        let server_secret = self
            .container
            .env
            .as_deref()
            .unwrap_or_default()
            .iter()
            .find(|e| e.name == var)
            .and_then(|e| e.value_from.as_ref()?.secret_key_ref.as_ref())
            .map(|s| (s.name.clone(), s.key.clone()));
        let Some(server_secret) = server_secret else {
            return Some(format!("nats-server's ${var} is not from a Secret"));
        };
        let sidecar_secret = sidecar
            .args
            .as_deref()
            .unwrap_or_default()
            .iter()
            .find_map(|a| a.strip_prefix("--fleet-nats-token-file="))
            .and_then(|path| secret_file(router, sidecar, path));
        (sidecar_secret.as_ref() != Some(&server_secret)).then(|| {
            format!(
                "NATS takes the token of (Secret, key) {server_secret:?}, the sidecar's \
                 --fleet-nats-token-file is {sidecar_secret:?}"
            )
        })
    }
}

/// The NetworkPolicies of `namespace` that select the NATS pods (`nats_labels`)
/// must let the router pods (`router_labels`, namespace inferencecache-system)
/// in on the client port (its number and name).
fn network_policy_problems(
    docs: &[Value],
    namespace: &str,
    nats_labels: &Labels,
    (port, port_name): (i32, Option<&str>),
    router_labels: &Labels,
) -> Vec<String> {
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
    let mut router_ns_labels: Labels = find(docs, "Namespace", "", SYSTEM_NS)
        .and_then(|d| typed::<Namespace>(d).metadata.labels)
        .unwrap_or_default();
    router_ns_labels.insert("kubernetes.io/metadata.name".into(), SYSTEM_NS.into());
    let mut problems = Vec::new();
    for doc in docs
        .iter()
        .filter(|d| d["kind"] == "NetworkPolicy" && d["metadata"]["namespace"] == namespace)
    {
        let policy: NetworkPolicy = typed(doc);
        let name = policy.metadata.name.unwrap_or_default();
        let spec = policy.spec.unwrap_or_default();
        let applies = spec
            .pod_selector
            .as_ref()
            .is_none_or(|s| label_selector_selects(s, nats_labels));
        let ingress_policed = spec
            .policy_types
            .as_ref()
            .is_none_or(|t| t.iter().any(|t| t == "Ingress"));
        if !applies || !ingress_policed {
            continue;
        }
        let admits = spec.ingress.unwrap_or_default().iter().any(|rule| {
            let on_port = rule.ports.as_deref().unwrap_or_default().is_empty()
                || rule
                    .ports
                    .as_deref()
                    .unwrap_or_default()
                    .iter()
                    .any(|p| match &p.port {
                        None => true,
                        Some(IntOrString::Int(n)) => {
                            *n == port || p.end_port.is_some_and(|e| (*n..=e).contains(&port))
                        }
                        Some(IntOrString::String(s)) => Some(s.as_str()) == port_name,
                    });
            let from_router = rule.from.as_deref().unwrap_or_default().is_empty()
                || rule.from.as_deref().unwrap_or_default().iter().any(|peer| {
                    peer.ip_block.is_none()
                        && match &peer.namespace_selector {
                            None => namespace == SYSTEM_NS,
                            Some(s) => label_selector_selects(s, &router_ns_labels),
                        }
                        && peer
                            .pod_selector
                            .as_ref()
                            .is_none_or(|s| label_selector_selects(s, router_labels))
                });
            on_port && from_router
        });
        if !admits {
            problems.push(format!(
                "NetworkPolicy {namespace}/{name} keeps the router pods from NATS's port {port}"
            ));
        }
    }
    problems
}

#[test]
fn the_router_replicas_are_one_fleet_over_a_nats_of_the_manifests() {
    let docs: Vec<Value> = documents().into_iter().map(|(_, _, d)| d).collect();
    let problems = fleet_problems(&docs);
    assert!(problems.is_empty(), "\n{}", problems.join("\n"));
}

/// Each way of breaking the fleet's wiring is reported.
#[test]
fn a_broken_fleet_wiring_is_caught() {
    let docs: Vec<Value> = documents().into_iter().map(|(_, _, d)| d).collect();
    fn doc<'d>(docs: &'d mut [Value], kind: &str, name: &str) -> &'d mut Value {
        docs.iter_mut()
            .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
            .unwrap()
    }
    fn sidecar_args(docs: &mut [Value]) -> &mut Vec<Value> {
        let router = doc(docs, "Deployment", "inferencecache");
        let containers = router["spec"]["template"]["spec"]["containers"]
            .as_array_mut()
            .unwrap();
        let sidecar = containers
            .iter_mut()
            .find(|c| c["name"] == "inferencecache")
            .unwrap();
        sidecar["args"].as_array_mut().unwrap()
    }
    fn replace_arg(docs: &mut [Value], prefix: &str, with: &str) {
        let args = sidecar_args(docs);
        let arg = args
            .iter_mut()
            .find(|a| a.as_str().unwrap().starts_with(prefix))
            .unwrap();
        *arg = Value::from(with);
    }
    fn edit_conf(docs: &mut [Value], from: &str, to: &str) {
        let config = doc(docs, "ConfigMap", "nats-config");
        let text = config["data"]["nats.conf"].as_str().unwrap();
        assert!(text.contains(from), "{from:?} not in nats.conf");
        config["data"]["nats.conf"] = Value::from(text.replace(from, to));
    }
    type Edit = fn(&mut [Value]);
    let cases: [(Edit, &str); 11] = [
        (
            |d| doc(d, "Deployment", "inferencecache")["spec"]["replicas"] = 1.into(),
            "a fleet needs at least 2",
        ),
        (
            |d| {
                replace_arg(
                    d,
                    "--fleet-nats=",
                    "--fleet-nats=nats://nats.elsewhere.svc:4222",
                )
            },
            "no Service elsewhere/nats",
        ),
        (
            |d| replace_arg(d, "--fleet-nats=", "--fleet-nats=nats://nats.nats.svc:4223"),
            "has no port 4223",
        ),
        (
            |d| sidecar_args(d).retain(|a| !a.as_str().unwrap().starts_with("--fleet-nats=")),
            "no --fleet-nats",
        ),
        (
            |d| replace_arg(d, "--fleet-id=", "--fleet-id=router"),
            "the same fleet id",
        ),
        (
            |d| {
                let router = doc(d, "Deployment", "inferencecache");
                for c in router["spec"]["template"]["spec"]["containers"]
                    .as_array_mut()
                    .unwrap()
                {
                    if let Some(env) = c["env"].as_array_mut() {
                        env.retain(|e| e["name"] != "POD_NAME");
                    }
                }
            },
            "POD_NAME is not an env var set to the pod name",
        ),
        (
            |d| edit_conf(d, "jetstream {", "jetstream: disabled\n    unused {"),
            "does not enable JetStream",
        ),
        (
            |d| edit_conf(d, "store_dir: /data", "store_dir: /tmp"),
            "not on a persistent volume",
        ),
        (
            |d| edit_conf(d, "port: 4222", "port: 4333"),
            "listens on 4333",
        ),
        (
            |d| {
                let router = doc(d, "Deployment", "inferencecache");
                for v in router["spec"]["template"]["spec"]["volumes"]
                    .as_array_mut()
                    .unwrap()
                {
                    if v["name"] == "fleet-token" {
                        v["secret"]["secretName"] = "another-secret".into();
                    }
                }
            },
            "the sidecar's --fleet-nats-token-file",
        ),
        (
            |d| {
                doc(d, "NetworkPolicy", "nats")["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
                    ["app.kubernetes.io/name"] = "other".into()
            },
            "keeps the router pods from NATS's port 4222",
        ),
    ];
    for (i, (edit, want)) in cases.into_iter().enumerate() {
        let mut broken = docs.clone();
        edit(&mut broken);
        let problems = fleet_problems(&broken);
        assert!(
            problems.iter().any(|p| p.contains(want)),
            "case {i}: want a problem with {want:?}, got {problems:?}"
        );
    }
}

#[test]
fn nats_conf_is_read_as_nats_server_reads_it() {
    let conf = parse_nats_conf(
        "# comment\nport: 4222 // another\nJetStream {\n  store_dir = \"/data\"\n  max_file_store: 8GB\n}\n\
         authorization { token: $T, timeout: 2 }\nlist: [a, 'b c'\n d]\n",
    )
    .unwrap();
    assert_eq!(
        conf,
        serde_json::json!({
            "port": "4222",
            "jetstream": {"store_dir": "/data", "max_file_store": "8GB"},
            "authorization": {"token": "$T", "timeout": "2"},
            "list": ["a", "b c", "d"],
        })
    );
    assert!(jetstream_enabled(&conf));
    for off in [
        "jetstream: disabled",
        "jetstream { enabled: false }",
        "port: 1",
    ] {
        assert!(!jetstream_enabled(&parse_nats_conf(off).unwrap()), "{off}");
    }
    assert!(jetstream_enabled(
        &parse_nats_conf("jetstream: enabled").unwrap()
    ));
    assert!(parse_nats_conf("include auth.conf").is_err());
    assert!(parse_nats_conf("a { b: 1").is_err());
}
