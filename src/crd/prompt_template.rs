//! `PromptTemplate` (namespaced): a template body plus the slots that matter for
//! prefix stability. Stable slots keep the rendered prefix cacheable; mutable slots
//! do not. `status.templateRevision` lets renderers invalidate on change.

use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::Condition;

/// Spec of a PromptTemplate.
// The repeated `printcolumn(type_ = ..)` keys are separate columns, not duplicates.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "inferencecache.io",
    version = "v1alpha1",
    doc = "A prompt template body and its cache-relevant slots.",
    kind = "PromptTemplate",
    namespaced,
    status = "PromptTemplateStatus",
    derive = "PartialEq",
    shortname = "ptpl",
    category = "inferencecache",
    cel,
    printcolumn(
        name = "Revision",
        type_ = "string",
        json_path = ".status.templateRevision"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct PromptTemplateSpec {
    /// Template text.
    #[x_kube(validation = Rule::new("self != ''").message("body must be non-empty"))]
    pub body: String,

    /// Slot declarations keyed by name.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["name".into()]))]
    pub slots: Vec<TemplateSlot>,
}

/// One of `spec.slots[]`.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct TemplateSlot {
    /// Slot identifier used by the template body.
    #[x_kube(validation = Rule::new("self != ''").message("name must be non-empty"))]
    pub name: String,
    #[serde(rename = "type")]
    pub slot_type: SlotType,
    /// Whether callers must provide the slot.
    #[serde(default)]
    pub required: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
}

/// `spec.slots[].type`.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotType {
    /// Participates in prefix stability.
    Stable,
    /// Does not.
    Mutable,
}

/// Status of a PromptTemplate.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PromptTemplateStatus {
    /// Stable revision identifier for cache invalidation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template_revision: Option<String>,
    /// `PrefixStable`: False when a Mutable slot precedes a Stable slot in the body.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

#[cfg(test)]
mod tests;
