//! One YAML file → typed objects, checked as strictly as the apiserver would:
//! the apiVersion and kind must be ours, `metadata.name` is required, unknown
//! fields and values under a schema minimum/maximum are errors (strict field
//! validation), types and enums come from serde, and the CRD's CEL rules run
//! client-side. Every problem names the file, the document and the field.

use std::path::Path;

use kube::CustomResourceExt;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use crate::adapters::resolve::DEFAULT_NAMESPACE;
use crate::crd::API_VERSION;
use crate::crd::cache_backend::CacheBackend;
use crate::crd::cache_policy::CachePolicy;
use crate::crd::cache_tenant::CacheTenant;
use crate::crd::pd_topology::PDTopology;
use crate::crd::prompt_template::PromptTemplate;

/// A configuration object read from a file.
#[derive(Clone, Debug)]
pub enum Object {
    CachePolicy(CachePolicy),
    CacheTenant(CacheTenant),
    CacheBackend(CacheBackend),
    /// Validated and kept for completeness; nothing routes on it yet.
    PromptTemplate(PromptTemplate),
    /// Validated and kept for completeness; nothing routes on it yet.
    PdTopology(PDTopology),
}

/// Where an object came from, for error messages.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Origin {
    pub file: String,
    /// 1-based among the file's non-empty documents.
    pub document: usize,
    pub kind: String,
    pub namespace: String,
    pub name: String,
}

impl Origin {
    pub fn object(&self) -> String {
        format!("{} {}/{}", self.kind, self.namespace, self.name)
    }
}

const KINDS: &str = "CachePolicy, CacheTenant, CacheBackend, PromptTemplate, PDTopology";

/// Keys of `metadata` a config file may carry (those of ObjectMeta).
const METADATA_KEYS: &[&str] = &[
    "name",
    "namespace",
    "labels",
    "annotations",
    "creationTimestamp",
    "uid",
    "resourceVersion",
    "generation",
    "generateName",
    "finalizers",
    "ownerReferences",
    "managedFields",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "selfLink",
];

/// Parses every document of one file; problems are appended to `problems`.
pub fn parse_file(path: &Path, text: &str, problems: &mut Vec<String>) -> Vec<(Origin, Object)> {
    let file = path.display().to_string();
    let docs: Vec<Value> = match serde_saphyr::from_multiple(text) {
        Ok(docs) => docs,
        Err(e) => {
            problems.push(format!("{file}: invalid YAML: {e}"));
            return Vec::new();
        }
    };
    if docs.is_empty() {
        // Most likely a file caught between a writer's truncate and its write; an
        // intentionally empty file has no use, so refusing it loses nothing.
        problems.push(format!("{file}: no objects (an empty file is refused)"));
    }
    let mut objects = Vec::new();
    for (i, doc) in docs.into_iter().enumerate() {
        let at = format!("{file}: document {}", i + 1);
        match parse_document(doc) {
            Ok((kind, namespace, name, object)) => objects.push((
                Origin {
                    file: file.clone(),
                    document: i + 1,
                    kind,
                    namespace,
                    name,
                },
                object,
            )),
            Err(errs) => problems.extend(errs.into_iter().map(|e| format!("{at}: {e}"))),
        }
    }
    objects
}

type Parsed = (String, String, String, Object);

fn parse_document(mut doc: Value) -> Result<Parsed, Vec<String>> {
    let Some(obj) = doc.as_object_mut() else {
        return Err(vec!["not a mapping (expected a Kubernetes object)".into()]);
    };
    let kind = obj
        .get("kind")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    let api_version = obj.get("apiVersion").and_then(Value::as_str).unwrap_or("");
    if api_version != API_VERSION {
        return Err(vec![format!(
            "{kind}: apiVersion {api_version:?} is not {API_VERSION:?}"
        )]);
    }
    let meta = obj
        .entry("metadata")
        .or_insert_with(|| Value::Object(Map::new()));
    let Some(meta) = meta.as_object_mut() else {
        return Err(vec![format!("{kind}: metadata: must be a mapping")]);
    };
    let name = meta
        .get("name")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    if name.is_empty() {
        return Err(vec![format!("{kind}: metadata.name: required")]);
    }
    let namespace = meta
        .entry("namespace")
        .or_insert_with(|| Value::String(DEFAULT_NAMESPACE.into()))
        .as_str()
        .unwrap_or(DEFAULT_NAMESPACE)
        .to_string();
    let object = format!("{kind} {namespace}/{name}");
    let mut errors: Vec<String> = meta
        .keys()
        .filter(|k| !METADATA_KEYS.contains(&k.as_str()))
        .map(|k| format!("{object}: metadata.{k}: unknown field"))
        .collect();
    let parsed = match kind.as_str() {
        "CachePolicy" => typed(doc, &object, &mut errors).map(Object::CachePolicy),
        "CacheTenant" => typed(doc, &object, &mut errors).map(Object::CacheTenant),
        "CacheBackend" => typed(doc, &object, &mut errors).map(Object::CacheBackend),
        "PromptTemplate" => typed(doc, &object, &mut errors).map(Object::PromptTemplate),
        "PDTopology" => typed(doc, &object, &mut errors).map(Object::PdTopology),
        "CacheIndex" => {
            return Err(vec![format!(
                "{object}: CacheIndex is status-only (written by the controller), not configuration"
            )]);
        }
        "" => return Err(vec!["kind: required".into()]),
        other => {
            return Err(vec![format!(
                "unknown kind {other:?} (expected one of {KINDS})"
            )]);
        }
    };
    match parsed {
        Some(object) if errors.is_empty() => Ok((kind, namespace, name, object)),
        _ => Err(errors),
    }
}

/// The checks every kind shares: schema walk, typed deserialization with the
/// field path on error, then the CRD's CEL rules.
fn typed<T>(doc: Value, object: &str, errors: &mut Vec<String>) -> Option<T>
where
    T: DeserializeOwned + CustomResourceExt + Celled,
{
    let crd = T::crd();
    if let Some(schema) = crd.spec.versions[0]
        .schema
        .as_ref()
        .and_then(|s| s.open_api_v3_schema.as_ref())
        .and_then(|s| serde_json::to_value(s).ok())
    {
        let mut found = Vec::new();
        strict_walk(&schema, &doc, "", &mut found);
        // metadata is checked against ObjectMeta's keys instead.
        found.retain(|(path, _)| !path.starts_with("metadata."));
        errors.extend(
            found
                .into_iter()
                .map(|(p, m)| format!("{object}: {p}: {m}")),
        );
    }
    let value: T = match serde_path_to_error::deserialize(doc) {
        Ok(v) => v,
        Err(e) => {
            let path = e.path().to_string();
            errors.push(format!("{object}: {path}: {}", e.inner()));
            return None;
        }
    };
    if let Err(cel) = value.cel_errors() {
        errors.extend(cel.into_iter().map(|e| format!("{object}: {e}")));
    }
    Some(value)
}

/// The kinds' generated `validate_cel`, behind one trait for [`typed`].
pub trait Celled {
    fn cel_errors(&self) -> Result<(), Vec<String>>;
}

macro_rules! celled {
    ($($t:ty),*) => {$(
        impl Celled for $t {
            fn cel_errors(&self) -> Result<(), Vec<String>> {
                self.validate_cel()
                    .map_err(|errs| errs.iter().map(ToString::to_string).collect())
            }
        }
    )*};
}
celled!(
    CachePolicy,
    CacheTenant,
    CacheBackend,
    PromptTemplate,
    PDTopology
);

/// Unknown fields and numeric bounds, against a structural schema. Returns
/// (dotted path, message) pairs.
fn strict_walk(schema: &Value, value: &Value, path: &str, out: &mut Vec<(String, String)>) {
    if schema.get("x-kubernetes-preserve-unknown-fields") == Some(&Value::Bool(true)) {
        return;
    }
    let join = |k: &str| {
        if path.is_empty() {
            k.to_string()
        } else {
            format!("{path}.{k}")
        }
    };
    match value {
        Value::Object(map) => {
            let props = schema.get("properties").and_then(Value::as_object);
            let additional = schema.get("additionalProperties");
            for (k, v) in map {
                match (props.and_then(|p| p.get(k)), additional) {
                    (Some(s), _) => strict_walk(s, v, &join(k), out),
                    (None, Some(a)) if a.is_object() => strict_walk(a, v, &join(k), out),
                    (None, Some(Value::Bool(true))) => {}
                    // Top-level apiVersion/kind/metadata are not in the CRD schema.
                    (None, _)
                        if path.is_empty()
                            && ["apiVersion", "kind", "metadata"].contains(&k.as_str()) => {}
                    (None, _) => out.push((join(k), "unknown field".into())),
                }
            }
        }
        Value::Array(items) => {
            if let Some(s) = schema.get("items") {
                for (i, v) in items.iter().enumerate() {
                    strict_walk(s, v, &format!("{path}[{i}]"), out);
                }
            }
        }
        Value::Number(n) => {
            let Some(x) = n.as_f64() else { return };
            if let Some(min) = schema
                .get("minimum")
                .and_then(Value::as_f64)
                .filter(|m| x < *m)
            {
                out.push((path.to_string(), format!("{n} is below the minimum {min}")));
            }
            if let Some(max) = schema
                .get("maximum")
                .and_then(Value::as_f64)
                .filter(|m| x > *m)
            {
                out.push((path.to_string(), format!("{n} is above the maximum {max}")));
            }
        }
        _ => {}
    }
}
