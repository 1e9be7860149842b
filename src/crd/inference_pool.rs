//! `InferencePool` (`inference.networking.k8s.io/v1`, owned by the Gateway API
//! Inference Extension): a set of model-server pods a GIE gateway routes to, and
//! the endpoint picker it asks. Read-only for us: a CacheBackend may take its
//! replicas from a pool (`spec.inferencePoolRef`) instead of its own selector.
//!
//! Only the fields we read are modelled; every other field (`appProtocol`,
//! `status.parents`, whatever later versions add) is ignored on deserialization,
//! and enum-like fields stay strings so a new value never makes a pool unreadable.
//! The CRD is GIE's: it is not part of [`super::all`] and we never install it.

use std::collections::BTreeMap;

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// API group of InferencePool.
pub const GROUP: &str = "inference.networking.k8s.io";

/// Spec of an InferencePool, as far as we read it.
#[derive(CustomResource, Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq)]
#[kube(
    group = "inference.networking.k8s.io",
    version = "v1",
    kind = "InferencePool",
    namespaced,
    derive = "PartialEq"
)]
#[serde(rename_all = "camelCase")]
pub struct InferencePoolSpec {
    /// Pods of the pool: same namespace, labels match (`matchLabels` only in v1).
    #[serde(default)]
    pub selector: PoolSelector,
    /// Every port is a distinct endpoint `podIP:number` (GIE: at most 8, unique).
    #[serde(default)]
    pub target_ports: Vec<PoolPort>,
    /// The picker the gateway calls for this pool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint_picker_ref: Option<EndpointPickerRef>,
}

/// `spec.selector`.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct PoolSelector {
    #[serde(default)]
    pub match_labels: BTreeMap<String, String>,
}

/// One of `spec.targetPorts[]`, and `spec.endpointPickerRef.port`.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolPort {
    #[serde(default)]
    pub number: i32,
}

/// `spec.endpointPickerRef`: read for logs and docs only; the gateway, not us,
/// acts on it.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct EndpointPickerRef {
    #[serde(default)]
    pub name: String,
    /// Default `Service`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<PoolPort>,
    /// `FailOpen` or `FailClose` (GIE's default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_mode: Option<String>,
}

#[cfg(test)]
mod tests;
