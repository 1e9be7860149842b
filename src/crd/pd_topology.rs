//! `PDTopology` (namespaced): prefill/decode pools and accelerator classes for
//! phase-disaggregated serving. The reconciler is future work; the type ships now so
//! clients can reference the contract. A pool's `acceleratorType` must name a
//! declared `acceleratorTypes[].name` (checked in CEL).

use std::collections::BTreeMap;

use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

use super::Condition;

// The lists and names carry maxItems/maxLength so the apiserver's CEL cost
// estimate of the nested all/exists stays within its budget.

/// CEL for "every pool of `list` names a declared accelerator type".
macro_rules! pool_accelerator_rule {
    ($list:literal) => {
        concat!(
            "!has(self.",
            $list,
            ") || self.",
            $list,
            ".all(p, !has(p.acceleratorType) || (has(self.acceleratorTypes) && ",
            "self.acceleratorTypes.exists(a, a.name == p.acceleratorType)))"
        )
    };
}

/// Spec of a PDTopology.
// The repeated `printcolumn(type_ = ..)` keys are separate columns, not duplicates.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[kube(
    group = "inferencecache.io",
    version = "v1alpha1",
    doc = "Prefill/decode pools and accelerator classes for disaggregated serving.",
    kind = "PDTopology",
    plural = "pdtopologies",
    namespaced,
    status = "PDTopologyStatus",
    derive = "PartialEq",
    shortname = "pdtopo",
    category = "inferencecache",
    cel,
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[x_kube(
    validation = Rule::new(pool_accelerator_rule!("prefillPools"))
        .message("every prefillPools[].acceleratorType must name a declared acceleratorTypes[].name")
        .field_path(".prefillPools"),
    validation = Rule::new(pool_accelerator_rule!("decodePools"))
        .message("every decodePools[].acceleratorType must name a declared acceleratorTypes[].name")
        .field_path(".decodePools")
)]
#[serde(rename_all = "camelCase")]
pub struct PDTopologySpec {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["name".into()]))]
    #[schemars(length(max = 64))]
    pub prefill_pools: Vec<Pool>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["name".into()]))]
    #[schemars(length(max = 64))]
    pub decode_pools: Vec<Pool>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["name".into()]))]
    #[schemars(length(max = 64))]
    pub accelerator_types: Vec<AcceleratorType>,
}

/// One of `spec.prefillPools[]` / `spec.decodePools[]`.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Pool {
    #[x_kube(validation = Rule::new("self != ''").message("name must be non-empty"))]
    #[schemars(length(max = 253))]
    pub name: String,
    /// Selects the pool's pods or nodes.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub match_labels: BTreeMap<String, String>,
    /// Desired pool size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub replicas: Option<i32>,
    /// References `spec.acceleratorTypes[].name`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 253))]
    pub accelerator_type: Option<String>,
}

/// One of `spec.acceleratorTypes[]`.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct AcceleratorType {
    #[x_kube(validation = Rule::new("self != ''").message("name must be non-empty"))]
    #[schemars(length(max = 253))]
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vendor: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub match_labels: BTreeMap<String, String>,
}

/// Status of a PDTopology; reserved for future topology reconciliation.
#[derive(Serialize, Deserialize, schemars::JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PDTopologyStatus {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

#[cfg(test)]
mod tests;
