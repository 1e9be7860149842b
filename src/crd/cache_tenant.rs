//! `CacheTenant` (namespaced): the namespace's external tenant identity and quota.
//!
//! `spec.tenantID` is the id gateway and engine traffic carry; the reserved probe id
//! is refused in the schema. Validation ratcheting (GA in Kubernetes 1.33) makes
//! the rule apply on CREATE and only on an UPDATE that introduces the value, which
//! is the admission rule; the webhook repeats it for older apiservers.

use std::collections::BTreeMap;

use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::Condition;

/// Spec of a CacheTenant.
// The repeated `printcolumn(type_ = ..)` keys are separate columns, not duplicates.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "inferencecache.io",
    version = "v1alpha1",
    doc = "The external tenant identity and index quota of this namespace.",
    kind = "CacheTenant",
    namespaced,
    status = "CacheTenantStatus",
    derive = "PartialEq",
    shortname = "ctenant",
    category = "inferencecache",
    cel,
    printcolumn(name = "Tenant", type_ = "string", json_path = ".spec.tenantID"),
    printcolumn(
        name = "MaxEntries",
        type_ = "integer",
        json_path = ".spec.quota.maxIndexEntries"
    ),
    printcolumn(
        name = "Entries",
        type_ = "integer",
        json_path = ".status.indexEntries"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct CacheTenantSpec {
    /// External tenant identifier used by gateway and engine traffic.
    #[serde(rename = "tenantID")]
    #[x_kube(
        validation = Rule::new("self != ''").message("tenantID must be non-empty"),
        validation = Rule::new("self != 'inferencecache.io/probe'")
            .message("tenantID inferencecache.io/probe is reserved for the server's self-test")
    )]
    pub tenant_id: String,

    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quota: Option<TenantQuota>,

    /// Isolation between tenants; Fairness is the only mode of the current phase.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "isolation_mode_schema")]
    pub isolation_mode: Option<IsolationMode>,

    /// The tenant's share of held requests' tokens under `isolationMode: Fairness`
    /// while flow control holds requests (a tenant of weight 3 is served three
    /// times the tokens of one of weight 1).
    #[serde(default = "default_weight")]
    #[schemars(range(min = 1))]
    pub weight: i32,

    /// Reserved for future cryptographic isolation settings; kept as given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "kept_as_given")]
    pub crypto: Option<BTreeMap<String, serde_json::Value>>,
}

/// `spec.isolationMode`: the modes only. An absent field is simply omitted; a
/// `null` in the enum would make the apiserver offer `"null"` as a supported
/// value in its refusal.
fn isolation_mode_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "description": "Isolation between tenants; Fairness is the only mode of the current phase.",
        "type": "string",
        "enum": ["Fairness"],
    })
}

/// An object the apiserver stores whole: `x-kubernetes-preserve-unknown-fields`
/// and no `additionalProperties` (a value schema there, even `true`, makes the
/// apiserver prune the contents of nested objects).
fn kept_as_given(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "object",
        "nullable": true,
        "x-kubernetes-preserve-unknown-fields": true,
    })
}

fn default_weight() -> i32 {
    1
}

/// `spec.quota`.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct TenantQuota {
    /// Maximum distinct index prefixes attributed to the tenant; absent = unlimited,
    /// 0 = the tenant keeps no entries.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub max_index_entries: Option<i64>,
}

/// `spec.isolationMode`.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum IsolationMode {
    #[default]
    Fairness,
}

/// Status of a CacheTenant.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct CacheTenantStatus {
    /// Index entries held by the tenant; absent until a snapshot was observed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index_entries: Option<i64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

#[cfg(test)]
mod tests;
