//! `CachePolicy` (namespaced): how lookups and eviction behave for the namespace's
//! tenant. Every default is in the schema, equal to the serde default and to the
//! defaults in docs/reference.md.

use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{Condition, default_true};

/// Spec of a CachePolicy.
// The repeated `printcolumn(type_ = ..)` keys are separate columns, not duplicates.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "inferencecache.io",
    version = "v1alpha1",
    doc = "How lookups and eviction behave for the tenant of this namespace.",
    kind = "CachePolicy",
    namespaced,
    status = "CachePolicyStatus",
    derive = "PartialEq",
    shortname = "cpol",
    category = "inferencecache",
    cel,
    printcolumn(name = "Eviction", type_ = "string", json_path = ".spec.eviction"),
    printcolumn(name = "TTL", type_ = "string", json_path = ".spec.evictionTTL"),
    printcolumn(
        name = "MinMatched",
        type_ = "integer",
        json_path = ".spec.minimumMatchedTokens"
    ),
    printcolumn(
        name = "Floor",
        type_ = "string",
        json_path = ".spec.routingFloorScore"
    ),
    printcolumn(
        name = "Affinity",
        type_ = "string",
        json_path = ".spec.affinityRouting"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct CachePolicySpec {
    /// Which entries the cap sweep evicts first (LRU: oldest lastSeen; LFU: lowest
    /// access count, ties on the oldest lastSeen).
    #[serde(default)]
    pub eviction: Eviction,

    /// Maximum usable lifetime of a cache entry, a Go duration such as `10m`.
    #[serde(default = "default_eviction_ttl", rename = "evictionTTL")]
    #[schemars(pattern(r"^([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$"))]
    pub eviction_ttl: String,

    /// Request-side gate: prompts with fewer tokens never surface a positive hint.
    #[serde(default)]
    #[schemars(range(min = 0))]
    pub minimum_prefix_tokens: i32,

    /// Result-side floor on a replica's matched tokens for PREFIX_MATCH; 0 disables it.
    #[serde(default = "default_minimum_matched_tokens")]
    #[schemars(range(min = 0))]
    pub minimum_matched_tokens: i32,

    /// Result-side floor on the best replica's score, a non-negative decimal string;
    /// "0" disables it.
    #[serde(default = "default_routing_floor_score")]
    #[schemars(pattern(r"^[0-9]+(\.[0-9]+)?$"))]
    pub routing_floor_score: String,

    /// Lookup latency budget in milliseconds; 0 means no budget.
    #[serde(default)]
    #[schemars(range(min = 0))]
    pub lookup_timeout_ms: i32,

    /// Which lookup strategies may surface.
    #[serde(default)]
    pub strategy: PolicyStrategy,

    /// The consistent-hash fallback on the StrategyNone branch.
    #[serde(default)]
    pub affinity_routing: AffinityRouting,

    /// Whether replica load may move a pick off the cache's first choice (bounded
    /// load over the same candidates). Disabled gives exactly the cache pick.
    #[serde(default)]
    pub load_awareness: LoadAwareness,

    /// Tuning of the load rule.
    #[serde(default)]
    pub load_balancing: LoadBalancing,

    /// How much a block an engine holds in a slower memory tier counts, relative
    /// to the same block on GPU (1).
    #[serde(default)]
    pub tier_weights: TierWeights,

    /// Holding, ordering and shedding requests when every eligible replica is
    /// saturated; off by default, and below saturation it never changes a decision.
    #[serde(default)]
    pub flow_control: FlowControl,
}

/// `spec.flowControl`.
#[derive(Serialize, Deserialize, KubeSchema, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct FlowControl {
    /// Hold requests above capacity instead of sending them to a saturated engine.
    #[serde(default)]
    pub enabled: bool,
    /// Longest a request is held before it is shed as `queue-timeout` (a Go
    /// duration, above 0 and at most 29s). A held request asks Envoy to wait
    /// this plus 1s for its answer (`override_message_timeout`), which Envoy's
    /// `max_message_timeout` must allow.
    #[serde(default = "default_max_queue_wait")]
    #[schemars(pattern(r"^([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$"))]
    #[x_kube(validation = Rule::new("duration(self) > duration('0s')").message("maxQueueWait must be positive"))]
    #[x_kube(validation = Rule::new("duration(self) <= duration('29s')").message("maxQueueWait must be at most 29s (Envoy's max_message_timeout, 30s in the shipped configs, less 1s)"))]
    pub max_queue_wait: String,
    /// Requests held at once by one sidecar; when full the lowest priority is shed.
    #[serde(default = "default_max_queued_requests")]
    #[schemars(range(min = 1))]
    pub max_queued_requests: i32,
    /// A replica counts as saturated when the uncached prompt tokens routed to it
    /// whose prefill has not ended reach this many (besides 8 requests waiting at
    /// its engine, or a nearly full KV cache with requests waiting): about one
    /// engine step of prefill work, so requests are held, and ordered, before
    /// the engines' own queues grow. 0 leaves the bound out.
    #[serde(default = "default_max_prefill_backlog_tokens")]
    #[schemars(range(min = 0))]
    pub max_prefill_backlog_tokens: i64,
}

fn default_max_queue_wait() -> String {
    "1s".to_string()
}

fn default_max_prefill_backlog_tokens() -> i64 {
    crate::core::policy::FlowControl::DEFAULT_MAX_BACKLOG_TOKENS as i64
}

fn default_max_queued_requests() -> i32 {
    crate::core::policy::FlowControl::DEFAULT_MAX_QUEUED as i32
}

impl Default for FlowControl {
    fn default() -> Self {
        Self {
            enabled: false,
            max_queue_wait: default_max_queue_wait(),
            max_queued_requests: default_max_queued_requests(),
            max_prefill_backlog_tokens: default_max_prefill_backlog_tokens(),
        }
    }
}

/// `spec.tierWeights`: quoted decimals in [0, 1]; `"0"` ignores the tier.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct TierWeights {
    /// CPU memory (vLLM medium `CPU`, SGLang `CPU_PINNED`).
    #[serde(default = "default_cpu_weight")]
    #[schemars(pattern(r"^[0-9]+(\.[0-9]+)?$"))]
    pub cpu: String,
    /// Disk and other storage media.
    #[serde(default = "default_disk_weight")]
    #[schemars(pattern(r"^[0-9]+(\.[0-9]+)?$"))]
    pub disk: String,
}

fn default_cpu_weight() -> String {
    "0.8".to_string()
}

fn default_disk_weight() -> String {
    "0.25".to_string()
}

impl Default for TierWeights {
    fn default() -> Self {
        Self {
            cpu: default_cpu_weight(),
            disk: default_disk_weight(),
        }
    }
}

fn default_eviction_ttl() -> String {
    "10m".to_string()
}

fn default_minimum_matched_tokens() -> i32 {
    64
}

fn default_routing_floor_score() -> String {
    "0.1".to_string()
}

impl Default for CachePolicySpec {
    /// Equal to what the apiserver materializes for `spec: {}`.
    fn default() -> Self {
        Self {
            eviction: Eviction::default(),
            eviction_ttl: default_eviction_ttl(),
            minimum_prefix_tokens: 0,
            minimum_matched_tokens: default_minimum_matched_tokens(),
            routing_floor_score: default_routing_floor_score(),
            lookup_timeout_ms: 0,
            strategy: PolicyStrategy::default(),
            affinity_routing: AffinityRouting::default(),
            load_awareness: LoadAwareness::default(),
            load_balancing: LoadBalancing::default(),
            tier_weights: TierWeights::default(),
            flow_control: FlowControl::default(),
        }
    }
}

/// `spec.loadAwareness`.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LoadAwareness {
    #[default]
    Enabled,
    Disabled,
}

/// `spec.loadBalancing`: a replica is overloaded when placing a request would take
/// it past `factor × mean + slack` requests (the mean over the scope's serving
/// replicas).
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct LoadBalancing {
    /// How far above the mean a replica may run, a decimal string of at least 1.
    #[serde(default = "default_load_factor")]
    #[schemars(pattern(r"^[0-9]+(\.[0-9]+)?$"))]
    pub factor: String,
    /// Requests a replica may run above `factor × mean` before it counts as
    /// overloaded.
    #[serde(default = "default_load_slack")]
    #[schemars(range(min = 0))]
    pub slack: i32,
    /// Engine-reported load older than this (a Go duration) is ignored.
    #[serde(default = "default_stats_max_age")]
    #[schemars(pattern(r"^([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$"))]
    pub stats_max_age: String,
    /// How long a routed chain counts for its replica before the engine confirms
    /// it, so prompts sharing a new prefix land together (a Go duration; "0s" is
    /// off, the default until measured).
    #[serde(default = "default_pending_ttl", rename = "pendingTTL")]
    #[schemars(pattern(r"^(0|([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+)$"))]
    pub pending_ttl: String,
    /// Uncached prompt tokens the pick's prefill backlog (with this request's
    /// own) may exceed the cheapest replica's before the request goes there
    /// instead; 0 turns this part of the rule off.
    #[serde(default = "default_prefill_slack_tokens")]
    #[schemars(range(min = 0))]
    pub prefill_slack_tokens: i32,
    /// How far above the mean a replica's share of the requests routed lately
    /// (a count halving every 10 s) may run, plus `slack`, before it counts as
    /// overloaded: a decimal string of at least 1, or "0" for off.
    #[serde(default = "default_share_factor")]
    #[schemars(pattern(r"^[0-9]+(\.[0-9]+)?$"))]
    pub share_factor: String,
}

fn default_share_factor() -> String {
    crate::core::policy::LoadBalancing::DEFAULT_SHARE_FACTOR_STR.to_string()
}

fn default_prefill_slack_tokens() -> i32 {
    crate::core::policy::LoadBalancing::DEFAULT_PREFILL_SLACK_TOKENS as i32
}

fn default_pending_ttl() -> String {
    "0s".to_string()
}

fn default_load_factor() -> String {
    "1.25".to_string()
}

fn default_load_slack() -> i32 {
    2
}

fn default_stats_max_age() -> String {
    "5s".to_string()
}

impl Default for LoadBalancing {
    fn default() -> Self {
        Self {
            factor: default_load_factor(),
            slack: default_load_slack(),
            stats_max_age: default_stats_max_age(),
            pending_ttl: default_pending_ttl(),
            prefill_slack_tokens: default_prefill_slack_tokens(),
            share_factor: default_share_factor(),
        }
    }
}

/// `spec.eviction`.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Eviction {
    #[default]
    #[serde(rename = "LRU")]
    Lru,
    #[serde(rename = "LFU")]
    Lfu,
}

/// `spec.affinityRouting`.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AffinityRouting {
    #[default]
    Enabled,
    Disabled,
}

/// `spec.strategy`. Admission rejects `requireChain: true` with
/// `enableChainMatching: false`.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[x_kube(
    cel,
    validation = Rule::new("!self.requireChain || self.enableChainMatching")
        .message("strategy.requireChain: true needs strategy.enableChainMatching: true")
        .field_path(".requireChain")
)]
#[serde(rename_all = "camelCase")]
pub struct PolicyStrategy {
    #[serde(default = "default_true")]
    pub enable_chain_matching: bool,
    #[serde(default)]
    pub require_chain: bool,
    #[serde(default = "default_true")]
    pub enable_tenant_hot: bool,
}

impl Default for PolicyStrategy {
    fn default() -> Self {
        Self {
            enable_chain_matching: true,
            require_chain: false,
            enable_tenant_hot: true,
        }
    }
}

/// Status of a CachePolicy; reserved for controller observations (e.g. "ignored:
/// another CachePolicy in this namespace is older").
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct CachePolicyStatus {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

#[cfg(test)]
mod tests;
