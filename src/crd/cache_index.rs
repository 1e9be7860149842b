//! `CacheIndex` (cluster-scoped, status-only singleton): the server's in-memory
//! cache aggregate for `kubectl get cacheindex`. It is observability, not a routing
//! substrate; it never stores KV tensors or prompt text.
//!
//! There is no writable spec. For v1alpha1 compatibility an object may omit `spec`
//! or carry the older `spec: {}`: the schema does not require it (see [`crd`]) and
//! the Rust type reads a missing or null spec as empty.

use std::fmt;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::{CustomResource, CustomResourceExt, KubeSchema};
use schemars::JsonSchema;
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde::{Deserialize, Serialize};

use super::Condition;

/// The (empty) spec of the CacheIndex.
// The repeated `printcolumn(type_ = ..)` keys are separate columns, not duplicates.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Serialize, JsonSchema, Clone, Debug, Default, PartialEq, Eq)]
#[kube(
    group = "inferencecache.io",
    version = "v1alpha1",
    doc = "The cluster-wide cache index aggregate (status only, written by the controller).",
    kind = "CacheIndex",
    plural = "cacheindexes",
    status = "CacheIndexStatus",
    derive = "PartialEq",
    derive = "Default",
    shortname = "cindex",
    category = "inferencecache",
    printcolumn(
        name = "Entries",
        type_ = "integer",
        json_path = ".status.totalEntries"
    ),
    printcolumn(name = "Generated", type_ = "date", json_path = ".status.generatedAt"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
pub struct CacheIndexSpec {}

/// Reads an absent or `null` spec, and `{}`, as the empty spec. Unknown keys of a
/// an older spec are ignored, as the apiserver prunes them.
impl<'de> Deserialize<'de> for CacheIndexSpec {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct EmptySpec;
        impl<'de> Visitor<'de> for EmptySpec {
            type Value = CacheIndexSpec;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an empty object or nothing")
            }
            fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(CacheIndexSpec {})
            }
            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(CacheIndexSpec {})
            }
            fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
                d.deserialize_map(self)
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(CacheIndexSpec {})
            }
        }
        deserializer.deserialize_option(EmptySpec)
    }
}

/// The CacheIndex CRD as it must be installed: `spec` is optional and defaults to
/// `{}`. Use this rather than `CacheIndex::crd()`, which marks `spec` required.
pub fn crd() -> CustomResourceDefinition {
    let mut crd = CacheIndex::crd();
    for version in &mut crd.spec.versions {
        let Some(schema) = version
            .schema
            .as_mut()
            .and_then(|s| s.open_api_v3_schema.as_mut())
        else {
            continue;
        };
        if let Some(required) = schema.required.as_mut() {
            required.retain(|f| f != "spec");
            if required.is_empty() {
                schema.required = None;
            }
        }
        if let Some(spec) = schema.properties.as_mut().and_then(|p| p.get_mut("spec")) {
            spec.default = Some(
                k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::JSON(
                    serde_json::json!({}),
                ),
            );
        }
    }
    crd
}

/// Status of the CacheIndex, written only by the controller.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct CacheIndexStatus {
    /// When the scraped `/snapshot` was generated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generated_at: Option<Time>,
    /// Distinct entries in the whole index (all tenants).
    #[serde(default)]
    pub total_entries: i64,
    /// Replicas that have reported stats; keyed on id (see `tenant`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["id".into()]))]
    pub replicas: Vec<IndexReplica>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["tenant".into()]))]
    pub tenants: Vec<IndexTenant>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["type".into()]))]
    pub conditions: Vec<Condition>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// One of `status.replicas[]`.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct IndexReplica {
    pub id: String,
    /// Which tenant's replica this row is; on an id collision across namespaces
    /// the lexicographically-later tenant is published.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hash_scheme: Option<String>,
    #[serde(default)]
    pub prefix_count: i64,
    /// Absent: not yet reported (distinct from "0").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hit_rate: Option<String>,
    /// The engine's total KV cache memory (shared by every tenant on the engine).
    #[serde(default)]
    pub cache_memory_bytes: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_update: Option<Time>,
}

/// One of `status.tenants[]`.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct IndexTenant {
    pub tenant: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// Absent: not yet computed (distinct from a present 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index_entries: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hit_rate: Option<String>,
    /// Deprecated, always 0 and always serialized (v1alpha1 shape); removed at
    /// v1beta1. Read `replicas[].cacheMemoryBytes` for a memory signal.
    #[serde(default)]
    pub memory_used: i64,
}

#[cfg(test)]
mod tests;
