//! `CacheBackend` (namespaced; docs/reference.md, "Kubernetes"): one model served by one set of engine
//! pods. Its namespace's tenant, `modelID` and `hashScheme` form the scope its
//! replicas serve; replicas are discovered pods (`selector`) or static `endpoints`
//! (file mode, or engines outside the cluster).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, Time};
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::Condition;

/// Spec of a CacheBackend.
// The repeated `printcolumn(type_ = ..)` keys are separate columns, not duplicates.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "inferencecache.io",
    version = "v1alpha1",
    doc = "One model served by one set of engine pods (or static endpoints).",
    kind = "CacheBackend",
    namespaced,
    status = "CacheBackendStatus",
    derive = "PartialEq",
    shortname = "cbackend",
    category = "inferencecache",
    cel,
    printcolumn(name = "Engine", type_ = "string", json_path = ".spec.engine"),
    printcolumn(name = "Model", type_ = "string", json_path = ".spec.modelID"),
    printcolumn(name = "Scheme", type_ = "string", json_path = ".spec.hashScheme"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[x_kube(
    validation = Rule::new("!has(self.inferencePoolRef) || (!has(self.selector) && !has(self.targetPort) && (!has(self.endpoints) || size(self.endpoints) == 0))")
        .message("inferencePoolRef excludes selector, targetPort and endpoints (the pool is the replica set)")
        .field_path(".inferencePoolRef")
)]
#[serde(rename_all = "camelCase")]
pub struct CacheBackendSpec {
    pub engine: Engine,

    /// The model id requests carry (`x-inferencecache-model`).
    #[serde(rename = "modelID")]
    #[x_kube(validation = Rule::new("self != ''").message("modelID must be non-empty"))]
    pub model_id: String,

    /// How the engine's block-hash chains are computed; part of the scope key.
    #[x_kube(validation = Rule::new("self != ''").message("hashScheme must be non-empty"))]
    pub hash_scheme: String,

    /// Tokens per KV block of the engine.
    #[serde(default = "default_block_size")]
    #[schemars(range(min = 1))]
    pub block_size: i32,

    /// Pods of this backend (Kubernetes discovery).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<LabelSelector>,

    /// Take the replicas from a Gateway API Inference Extension `InferencePool`
    /// of this namespace (its selector and targetPorts) instead of a selector of
    /// our own. Excludes `selector`, `targetPort` and `endpoints`; Kubernetes mode
    /// only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inference_pool_ref: Option<InferencePoolRef>,

    /// Port written into the routing header for discovered pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535))]
    pub target_port: Option<i32>,

    /// Where the engines publish KV events.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_events: Option<KvEventsSpec>,

    /// Static replicas, serving from the start.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["id".into()]))]
    pub endpoints: Vec<StaticEndpoint>,

    /// Data-parallel ranks per engine pod (default 1). Rank r publishes KV events on
    /// `kvEvents.port + r` and replays on `kvEvents.replayPort + r` (vLLM's and
    /// SGLang's convention); the pod stays one replica holding the union of its
    /// ranks' blocks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 256))]
    pub data_parallel_size: Option<i32>,

    /// Where the engines serve Prometheus metrics (waiting / running requests, KV
    /// usage), scraped for the load rule. On by default: vLLM and SGLang serve
    /// `/metrics` on their serving port.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics: Option<MetricsSpec>,

    /// The model's tokenizer files, for body mode: requests without a chain are
    /// routed on their tokenized OpenAI body.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<TokenizerSpec>,

    /// The LoRA adapters the engines serve beside `modelID` (vLLM's
    /// `--lora-modules NAME=PATH` names). A body-mode request whose `model` is one
    /// of them is routed in this backend's scope with the adapter as its block
    /// identity (`ic-content-v2`), as the engine stores its blocks.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 256))]
    #[x_kube(validation = Rule::new("self.all(a, a != '')").message("loraAdapters entries must be non-empty"))]
    pub lora_adapters: Vec<String>,
}

/// `spec.inferencePoolRef`: an InferencePool in the backend's own namespace.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct InferencePoolRef {
    #[x_kube(validation = Rule::new("self != ''").message("inferencePoolRef.name must be non-empty"))]
    pub name: String,
}

/// `spec.tokenizer` (body mode).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct TokenizerSpec {
    /// A directory on the sidecar's filesystem (in Kubernetes a mounted volume)
    /// holding `tokenizer.json` and optionally `tokenizer_config.json` (its
    /// `chat_template`) or `chat_template.jinja`. Reloaded when its files change.
    #[x_kube(validation = Rule::new("self != ''").message("tokenizer.path must be non-empty"))]
    pub path: String,
}

/// `spec.metrics`: the engines' Prometheus endpoint. Every field is optional; the
/// metric names follow `spec.engine`.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct MetricsSpec {
    /// `false` turns scraping off for this backend (default `true`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
    /// Port on each replica's host; default the replica's own port (the pod's
    /// `targetPort`, the static endpoint's port).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535))]
    pub port: Option<i32>,
    /// HTTP path (default `/metrics`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// Scrape interval, a Go duration between 100ms and 60s (default `250ms`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interval: Option<String>,
}

fn default_block_size() -> i32 {
    16
}

/// `spec.engine`.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Engine {
    #[serde(rename = "vLLM")]
    Vllm,
    #[serde(rename = "SGLang")]
    Sglang,
}

impl Engine {
    /// The spelling of the CRD.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Vllm => "vLLM",
            Self::Sglang => "SGLang",
        }
    }
}

/// `spec.kvEvents`: ports on each engine pod (or static endpoint host).
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct KvEventsSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535))]
    pub port: Option<i32>,
    /// The engine's replay (catch-up) socket on the same host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535))]
    pub replay_port: Option<i32>,
    /// ZMQ topic filter; empty subscribes to everything.
    #[serde(default)]
    pub topic: String,
}

/// One of `spec.endpoints[]`.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct StaticEndpoint {
    /// Replica id, unique within the backend.
    #[x_kube(validation = Rule::new("self != ''").message("id must be non-empty"))]
    pub id: String,
    /// `host:port` written into the routing header.
    #[x_kube(validation = Rule::new("self != ''").message("address must be non-empty"))]
    pub address: String,
    /// The engine's KV event socket, e.g. `tcp://10.0.0.7:5557`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_events_endpoint: Option<String>,
    /// The engine's replay socket, e.g. `tcp://10.0.0.7:5558`; default
    /// `kvEvents.replayPort` on the event socket's host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_replay_endpoint: Option<String>,
    /// Data-parallel ranks behind this endpoint; overrides `spec.dataParallelSize`.
    /// Rank r's sockets are the event and replay endpoints with their port + r.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 256))]
    pub data_parallel_size: Option<i32>,
    /// The engine's Prometheus metrics URL, e.g. `http://10.0.0.7:8000/metrics`;
    /// overrides `spec.metrics.port` and `path` for this replica.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics_endpoint: Option<String>,
}

/// Status of a CacheBackend.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct CacheBackendStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index_participation: Option<IndexParticipation>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// `status.indexParticipation`: what the index holds per replica of this backend.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct IndexParticipation {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["id".into()]))]
    pub replicas: Vec<ParticipatingReplica>,
}

/// One of `status.indexParticipation.replicas[]`.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ParticipatingReplica {
    pub id: String,
    #[serde(default)]
    pub prefix_count: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_event_at: Option<Time>,
    /// Absent: stats not yet reported (distinct from "0").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hit_rate: Option<String>,
}

#[cfg(test)]
mod tests;
