//! CRD objects → [`PolicySnapshot`]: the one place where CachePolicy, CacheTenant
//! and CacheBackend become core policy. Pure and synchronous; file mode and the
//! Kubernetes watcher both call [`resolve`] with whatever objects they hold.
//!
//! ```text
//!  CacheTenant  ─ oldest per namespace ─▶ namespace → tenantID (first claim wins)
//!  CachePolicy  ─ oldest per namespace ─▶ namespace → ResolvedPolicy (or defaults)
//!  CacheBackend ─ namespace's tenant    ─▶ BackendDecl { scope, static replicas }
//!      + selector        ─▶ the namespace's ready matching pods   (pods.rs)
//!      + inferencePoolRef ─▶ the pool's ready pods × targetPorts  (pods.rs)
//! ```
//!
//! Nothing is silently dropped: objects that lose the "oldest in the namespace"
//! rule come back as [`Ignored`], invalid ones as [`Rejected`] (kind, object,
//! field path, reason) so callers can log them or put conditions on them. A
//! rejected policy leaves its namespace on the server defaults; a rejected tenant
//! leaves its namespace without a tenant (and its backends unscoped).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use thiserror::Error;

use crate::core::policy::{
    AffinityRouting, EvictionAlgorithm, FloorScore, LoadAwareness, LoadBalancing, PolicyError,
    ResolvedPolicy, StrategyGates, parse_duration,
};
use crate::core::scope::{PROBE_TENANT, ScopeRef};
use crate::core::snapshot::{BackendDecl, DeclaredReplica, NamespacePolicy, PolicySnapshot};
use crate::crd::cache_backend::{CacheBackend, CacheBackendSpec};
use crate::crd::cache_policy::{self, CachePolicy, CachePolicySpec};
use crate::crd::cache_tenant::CacheTenant;
use crate::crd::inference_pool::InferencePool;
pub use pods::PoolProblem;

/// The namespace an object without `metadata.namespace` belongs to.
pub const DEFAULT_NAMESPACE: &str = "default";

/// An object that is valid but not effective (another one of its kind in the same
/// namespace is older).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ignored {
    pub kind: &'static str,
    pub namespace: String,
    pub name: String,
    pub reason: String,
}

impl fmt::Display for Ignored {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {}/{} ignored: {}",
            self.kind, self.namespace, self.name, self.reason
        )
    }
}

/// An object (or one field of it) that cannot be used.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error("{kind} {namespace}/{name}: {field}: {message}")]
pub struct Rejected {
    pub kind: &'static str,
    pub namespace: String,
    pub name: String,
    /// Dotted path of the offending field, e.g. `spec.routingFloorScore`.
    pub field: String,
    pub message: String,
}

/// The outcome of [`resolve`]: always a usable snapshot, plus what was left out.
#[derive(Debug)]
pub struct Resolution {
    pub snapshot: PolicySnapshot,
    pub ignored: Vec<Ignored>,
    pub rejected: Vec<Rejected>,
    /// One per CacheBackend with an `inferencePoolRef` (Kubernetes mode).
    pub pool_bindings: Vec<PoolBinding>,
}

/// Where a resolution may take InferencePools from.
#[derive(Clone, Copy, Debug)]
pub enum Pools<'a> {
    /// File mode: no cluster, so a pool reference is invalid.
    NoCluster,
    /// Kubernetes mode, but the pools cannot be read (the message says why, e.g.
    /// the GIE CRD is not installed): referencing backends get no replicas.
    Unavailable(&'a str),
    /// Kubernetes mode: every InferencePool of the cluster.
    Listed(&'a [InferencePool]),
}

/// What the cluster holds besides our own kinds.
#[derive(Clone, Copy, Debug)]
pub struct Cluster<'a> {
    pub pods: &'a [Pod],
    pub pools: Pools<'a>,
}

/// How a CacheBackend's `inferencePoolRef` resolved.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolBinding {
    /// The backend's (and the pool's) namespace.
    pub namespace: String,
    pub backend: String,
    pub pool: String,
    /// The replicas it supplied, or why none.
    pub outcome: Result<usize, PoolProblem>,
}

/// Builds the policy snapshot from the objects of all namespaces (file mode: no
/// pods, static endpoints only).
pub fn resolve(
    policies: &[CachePolicy],
    tenants: &[CacheTenant],
    backends: &[CacheBackend],
) -> Resolution {
    let cluster = Cluster {
        pods: &[],
        pools: Pools::NoCluster,
    };
    resolve_in_cluster(policies, tenants, backends, &cluster)
}

/// [`resolve`] plus pod discovery: a backend with a `selector` also declares the
/// ready pods of its namespace that the selector matches (see [`pods`]). No
/// InferencePool exists.
pub fn resolve_with_pods(
    policies: &[CachePolicy],
    tenants: &[CacheTenant],
    backends: &[CacheBackend],
    pods: &[Pod],
) -> Resolution {
    let cluster = Cluster {
        pods,
        pools: Pools::Listed(&[]),
    };
    resolve_in_cluster(policies, tenants, backends, &cluster)
}

/// Kubernetes mode: pods for selectors, InferencePools for `inferencePoolRef`.
pub fn resolve_in_cluster(
    policies: &[CachePolicy],
    tenants: &[CacheTenant],
    backends: &[CacheBackend],
    cluster: &Cluster<'_>,
) -> Resolution {
    let mut out = Outcome::default();

    let tenant_of = resolve_tenants(tenants, &mut out);
    let policy_of = resolve_policies(policies, &mut out);

    let names: std::collections::BTreeSet<&str> = tenants
        .iter()
        .map(|t| namespace(&t.metadata))
        .chain(policies.iter().map(|p| namespace(&p.metadata)))
        .collect();
    let namespaces = names
        .into_iter()
        .map(|ns| {
            let tenant = tenant_of.get(ns);
            let policy = policy_of.get(ns);
            NamespacePolicy {
                namespace: ns.to_string(),
                tenant_id: tenant.map(|t| t.tenant_id.clone()),
                policy_name: policy.map(|(name, _)| name.clone()),
                policy: policy
                    .map(|(_, p)| p.clone())
                    .unwrap_or_else(|| Arc::new(ResolvedPolicy::default())),
                max_index_entries: tenant.and_then(|t| t.max_index_entries),
                fair_weight: tenant.and_then(|t| t.fair_weight),
            }
        })
        .collect();

    let decls = backends
        .iter()
        .filter_map(|b| resolve_backend(b, &tenant_of, cluster, &mut out))
        .collect();

    Resolution {
        snapshot: PolicySnapshot::new(ResolvedPolicy::default(), namespaces, decls),
        ignored: out.ignored,
        rejected: out.rejected,
        pool_bindings: out.pool_bindings,
    }
}

#[derive(Default)]
struct Outcome {
    ignored: Vec<Ignored>,
    rejected: Vec<Rejected>,
    pool_bindings: Vec<PoolBinding>,
}

impl Outcome {
    fn reject(&mut self, kind: &'static str, meta: &ObjectMeta, field: &str, message: String) {
        self.rejected.push(Rejected {
            kind,
            namespace: namespace(meta).to_string(),
            name: name(meta).to_string(),
            field: field.to_string(),
            message,
        });
    }
}

fn namespace(meta: &ObjectMeta) -> &str {
    meta.namespace.as_deref().unwrap_or(DEFAULT_NAMESPACE)
}

fn name(meta: &ObjectMeta) -> &str {
    meta.name.as_deref().unwrap_or("")
}

/// Oldest first: creationTimestamp, then name. Objects without a timestamp (file
/// mode) sort after those with one, by name among themselves.
fn age_key(meta: &ObjectMeta) -> (bool, Option<jiff::Timestamp>, &str) {
    let ts = meta.creation_timestamp.as_ref().map(|t| t.0);
    (ts.is_none(), ts, name(meta))
}

/// Groups objects by namespace, oldest first, and reports all but the oldest of
/// each namespace as ignored.
fn effective_per_namespace<'a, T>(
    objects: &'a [T],
    meta: impl Fn(&T) -> &ObjectMeta,
    kind: &'static str,
    out: &mut Outcome,
) -> Vec<&'a T> {
    let mut groups: BTreeMap<&str, Vec<&T>> = BTreeMap::new();
    for o in objects {
        groups.entry(namespace(meta(o))).or_default().push(o);
    }
    let mut effective = Vec::new();
    for (ns, mut group) in groups {
        group.sort_by(|a, b| age_key(meta(a)).cmp(&age_key(meta(b))));
        let winner = name(meta(group[0]));
        for other in &group[1..] {
            out.ignored.push(Ignored {
                kind,
                namespace: ns.to_string(),
                name: name(meta(other)).to_string(),
                reason: format!("{kind} {ns}/{winner} is older and is the effective one"),
            });
        }
        effective.push(group[0]);
    }
    effective
}

struct TenantDecl {
    tenant_id: String,
    max_index_entries: Option<u64>,
    fair_weight: Option<u32>,
}

const TENANT: &str = "CacheTenant";
const POLICY: &str = "CachePolicy";
const BACKEND: &str = "CacheBackend";

/// namespace → the effective, valid tenant of that namespace.
fn resolve_tenants(tenants: &[CacheTenant], out: &mut Outcome) -> HashMap<String, TenantDecl> {
    let mut effective = effective_per_namespace(tenants, |t| &t.metadata, TENANT, out);
    // Across namespaces the first claim of a tenant id wins, by the same age order.
    effective.sort_by(|a, b| {
        let ka = (age_key(&a.metadata), namespace(&a.metadata));
        ka.cmp(&(age_key(&b.metadata), namespace(&b.metadata)))
    });
    let mut claimed: HashMap<String, String> = HashMap::new();
    let mut by_namespace = HashMap::new();
    for t in effective {
        let meta = &t.metadata;
        let id = t.spec.tenant_id.as_str();
        if id.is_empty() {
            out.reject(TENANT, meta, "spec.tenantID", "must be non-empty".into());
            continue;
        }
        if id == PROBE_TENANT {
            out.reject(
                TENANT,
                meta,
                "spec.tenantID",
                format!("{id:?} is reserved for the server's self-test"),
            );
            continue;
        }
        let max = t.spec.quota.as_ref().and_then(|q| q.max_index_entries);
        let max_index_entries = match max.map(u64::try_from).transpose() {
            Ok(m) => m,
            Err(_) => {
                let v = max.unwrap_or_default();
                out.reject(
                    TENANT,
                    meta,
                    "spec.quota.maxIndexEntries",
                    format!("{v} is below the minimum 0"),
                );
                continue;
            }
        };
        let weight = match u32::try_from(t.spec.weight) {
            Ok(w) if w >= 1 => w,
            _ => {
                out.reject(
                    TENANT,
                    meta,
                    "spec.weight",
                    format!("{} is below the minimum 1", t.spec.weight),
                );
                continue;
            }
        };
        let fair_weight = t.spec.isolation_mode.map(|m| match m {
            crate::crd::cache_tenant::IsolationMode::Fairness => weight,
        });
        if let Some(first) = claimed.get(id) {
            out.reject(
                TENANT,
                meta,
                "spec.tenantID",
                format!("tenant id {id:?} is already claimed by {TENANT} {first}"),
            );
            continue;
        }
        claimed.insert(
            id.to_string(),
            format!("{}/{}", namespace(meta), name(meta)),
        );
        by_namespace.insert(
            namespace(meta).to_string(),
            TenantDecl {
                tenant_id: id.to_string(),
                max_index_entries,
                fair_weight,
            },
        );
    }
    by_namespace
}

/// namespace → (policy name, resolved policy) for effective, valid policies.
fn resolve_policies(
    policies: &[CachePolicy],
    out: &mut Outcome,
) -> HashMap<String, (String, Arc<ResolvedPolicy>)> {
    let mut by_namespace = HashMap::new();
    for p in effective_per_namespace(policies, |p| &p.metadata, POLICY, out) {
        match resolve_policy(&p.spec) {
            Ok(policy) => {
                by_namespace.insert(
                    namespace(&p.metadata).to_string(),
                    (name(&p.metadata).to_string(), Arc::new(policy)),
                );
            }
            Err(errors) => {
                for (field, message) in errors {
                    out.reject(POLICY, &p.metadata, field, message);
                }
            }
        }
    }
    by_namespace
}

/// One CachePolicy spec → the core policy, or every offending field.
pub fn resolve_policy(
    spec: &CachePolicySpec,
) -> Result<ResolvedPolicy, Vec<(&'static str, String)>> {
    let mut errors = Vec::new();
    let mut non_negative = |field: &'static str, v: i32| {
        u32::try_from(v).unwrap_or_else(|_| {
            errors.push((field, format!("{v} is below the minimum 0")));
            0
        })
    };
    let minimum_prefix_tokens =
        non_negative("spec.minimumPrefixTokens", spec.minimum_prefix_tokens);
    let minimum_matched_tokens =
        non_negative("spec.minimumMatchedTokens", spec.minimum_matched_tokens);
    let lookup_timeout_ms = non_negative("spec.lookupTimeoutMs", spec.lookup_timeout_ms);
    let load_slack = non_negative("spec.loadBalancing.slack", spec.load_balancing.slack);
    let prefill_slack_tokens = non_negative(
        "spec.loadBalancing.prefillSlackTokens",
        spec.load_balancing.prefill_slack_tokens,
    );

    let routing_floor_score = spec
        .routing_floor_score
        .parse::<FloorScore>()
        .unwrap_or_else(|_| {
            errors.push((
                "spec.routingFloorScore",
                format!(
                    "{:?} is not a non-negative decimal (e.g. \"0.1\", \"5\", \"0\")",
                    spec.routing_floor_score
                ),
            ));
            FloorScore::default()
        });
    let eviction_ttl = parse_duration(&spec.eviction_ttl).unwrap_or_else(|e| {
        errors.push(("spec.evictionTTL", e.to_string()));
        ResolvedPolicy::DEFAULT_EVICTION_TTL
    });
    let lb = &spec.load_balancing;
    let load_balancing = LoadBalancing {
        factor: LoadBalancing::parse_factor(&lb.factor).unwrap_or_else(|e| {
            errors.push(("spec.loadBalancing.factor", e.to_string()));
            LoadBalancing::default().factor
        }),
        slack: load_slack,
        stats_max_age: parse_duration(&lb.stats_max_age).unwrap_or_else(|e| {
            errors.push(("spec.loadBalancing.statsMaxAge", e.to_string()));
            LoadBalancing::DEFAULT_STATS_MAX_AGE
        }),
        pending_ttl: parse_duration(&lb.pending_ttl).unwrap_or_else(|e| {
            errors.push(("spec.loadBalancing.pendingTTL", e.to_string()));
            Duration::ZERO
        }),
        prefill_slack_tokens,
        share_factor: LoadBalancing::parse_share_factor(&lb.share_factor).unwrap_or_else(|e| {
            errors.push(("spec.loadBalancing.shareFactor", e.to_string()));
            LoadBalancing::DEFAULT_SHARE_FACTOR
        }),
    };

    let mut weight = |field: &'static str, text: &str, default: f64| {
        crate::core::policy::TierWeights::parse_weight(field, text).unwrap_or_else(|e| {
            let message = e
                .split_once(": ")
                .map_or(e.as_str(), |(_, m)| m)
                .to_string();
            errors.push((field, message));
            default
        })
    };
    let tier_weights = crate::core::policy::TierWeights {
        cpu: weight(
            "spec.tierWeights.cpu",
            &spec.tier_weights.cpu,
            crate::core::policy::TierWeights::DEFAULT_CPU,
        ),
        disk: weight(
            "spec.tierWeights.disk",
            &spec.tier_weights.disk,
            crate::core::policy::TierWeights::DEFAULT_DISK,
        ),
    };

    let fc = &spec.flow_control;
    use crate::core::policy::FlowControl;
    let flow_control = FlowControl {
        enabled: fc.enabled,
        max_queue_wait: match parse_duration(&fc.max_queue_wait) {
            Ok(d) if !d.is_zero() && d <= FlowControl::MAX_QUEUE_WAIT => d,
            Ok(d) if d.is_zero() => {
                errors.push(("spec.flowControl.maxQueueWait", "must be positive".into()));
                crate::core::policy::FlowControl::DEFAULT_MAX_QUEUE_WAIT
            }
            Ok(_) => {
                errors.push(("spec.flowControl.maxQueueWait", MAX_WAIT_MESSAGE.into()));
                crate::core::policy::FlowControl::DEFAULT_MAX_QUEUE_WAIT
            }
            Err(e) => {
                errors.push(("spec.flowControl.maxQueueWait", e.to_string()));
                crate::core::policy::FlowControl::DEFAULT_MAX_QUEUE_WAIT
            }
        },
        max_queued: match u32::try_from(fc.max_queued_requests) {
            Ok(n) if n >= 1 => n,
            _ => {
                errors.push((
                    "spec.flowControl.maxQueuedRequests",
                    format!("{} is below the minimum 1", fc.max_queued_requests),
                ));
                crate::core::policy::FlowControl::DEFAULT_MAX_QUEUED
            }
        },
        max_backlog_tokens: match u64::try_from(fc.max_prefill_backlog_tokens) {
            Ok(n) => n,
            Err(_) => {
                errors.push((
                    "spec.flowControl.maxPrefillBacklogTokens",
                    format!("{} is below the minimum 0", fc.max_prefill_backlog_tokens),
                ));
                crate::core::policy::FlowControl::DEFAULT_MAX_BACKLOG_TOKENS
            }
        },
    };
    let policy = ResolvedPolicy {
        eviction: match spec.eviction {
            cache_policy::Eviction::Lru => EvictionAlgorithm::Lru,
            cache_policy::Eviction::Lfu => EvictionAlgorithm::Lfu,
        },
        eviction_ttl,
        minimum_prefix_tokens,
        minimum_matched_tokens,
        routing_floor_score,
        lookup_timeout: Duration::from_millis(u64::from(lookup_timeout_ms)),
        strategy: StrategyGates {
            enable_chain_matching: spec.strategy.enable_chain_matching,
            require_chain: spec.strategy.require_chain,
            enable_tenant_hot: spec.strategy.enable_tenant_hot,
        },
        affinity_routing: match spec.affinity_routing {
            cache_policy::AffinityRouting::Enabled => AffinityRouting::Enabled,
            cache_policy::AffinityRouting::Disabled => AffinityRouting::Disabled,
        },
        load_awareness: match spec.load_awareness {
            cache_policy::LoadAwareness::Enabled => LoadAwareness::Enabled,
            cache_policy::LoadAwareness::Disabled => LoadAwareness::Disabled,
        },
        load_balancing,
        tier_weights,
        flow_control,
    };
    if errors.is_empty() {
        match policy.validate() {
            Ok(()) => {}
            Err(PolicyError::ZeroTtl) => {
                errors.push(("spec.evictionTTL", "must be greater than zero".into()))
            }
            Err(e @ PolicyError::RequireChainWithoutMatching) => {
                errors.push(("spec.strategy.requireChain", e.to_string()))
            }
            Err(e) => errors.push(("spec", e.to_string())),
        }
    }
    if errors.is_empty() {
        Ok(policy)
    } else {
        Err(errors)
    }
}

/// Why a `maxQueueWait` over [`crate::core::policy::FlowControl::MAX_QUEUE_WAIT`] is refused.
pub const MAX_WAIT_MESSAGE: &str = "must be at most 29s: a held request asks Envoy to wait \
     maxQueueWait + 1s, and the shipped configs grant at most 30s (max_message_timeout)";

fn resolve_backend(
    backend: &CacheBackend,
    tenant_of: &HashMap<String, TenantDecl>,
    cluster: &Cluster<'_>,
    out: &mut Outcome,
) -> Option<BackendDecl> {
    let meta = &backend.metadata;
    let ns = namespace(meta);
    let Some(tenant) = tenant_of.get(ns) else {
        out.reject(
            BACKEND,
            meta,
            "metadata.namespace",
            format!("namespace {ns} has no effective CacheTenant, so the backend has no scope"),
        );
        return None;
    };
    let errors_before = out.rejected.len();
    let spec = &backend.spec;
    let block_size = check_spec(spec, meta, out);
    let mut replicas = static_replicas(spec, meta, out);
    if let Some(selector) = &spec.selector {
        match pods::discovered(ns, selector, spec, cluster.pods) {
            Ok(found) => {
                // A static endpoint keeps its id; a pod of the same name is skipped.
                for r in found {
                    if !replicas.iter().any(|s| s.id == r.id) {
                        replicas.push(r);
                    }
                }
            }
            Err(pods::DiscoveryError { field, message }) => {
                out.reject(BACKEND, meta, field, message)
            }
        }
    }
    if let Some(pool_ref) = &spec.inference_pool_ref
        && out.rejected.len() == errors_before
    {
        replicas = pool_replicas(backend, &pool_ref.name, cluster, out);
    }
    if out.rejected.len() > errors_before {
        return None;
    }
    Some(BackendDecl {
        namespace: ns.to_string(),
        name: name(meta).to_string(),
        scope: ScopeRef::new(&tenant.tenant_id, &spec.model_id, &spec.hash_scheme).to_owned(),
        engine: spec.engine.as_str().to_string(),
        block_size,
        kv_events_topic: spec
            .kv_events
            .as_ref()
            .map(|k| k.topic.clone())
            .unwrap_or_default(),
        replicas,
        lora_adapters: spec.lora_adapters.clone(),
    })
}

/// The replicas a backend takes from its InferencePool; records the binding.
/// A pool that is missing, invalid or unreadable supplies none (the backend
/// stays declared, its status says why); in file mode the reference is rejected.
fn pool_replicas(
    backend: &CacheBackend,
    pool: &str,
    cluster: &Cluster<'_>,
    out: &mut Outcome,
) -> Vec<DeclaredReplica> {
    let meta = &backend.metadata;
    let ns = namespace(meta);
    let outcome = match cluster.pools {
        Pools::NoCluster => {
            out.reject(
                BACKEND,
                meta,
                "spec.inferencePoolRef",
                format!(
                    "InferencePool {ns}/{pool}: a pool reference needs serve --kubernetes \
                     (a policy file has no cluster to read InferencePools from)"
                ),
            );
            return Vec::new();
        }
        Pools::Unavailable(why) => Err(PoolProblem {
            reason: "Unavailable",
            message: format!("InferencePool {ns}/{pool} cannot be read: {why}"),
        }),
        Pools::Listed(pools) => pools
            .iter()
            .find(|p| namespace(&p.metadata) == ns && name(&p.metadata) == pool)
            .ok_or_else(|| PoolProblem {
                reason: "NotFound",
                message: format!("InferencePool {ns}/{pool} not found"),
            })
            .and_then(|p| pods::pool_members(p, &backend.spec, cluster.pods)),
    };
    let (replicas, outcome) = match outcome {
        Ok(r) => {
            let n = r.len();
            (r, Ok(n))
        }
        Err(problem) => (Vec::new(), Err(problem)),
    };
    out.pool_bindings.push(PoolBinding {
        namespace: ns.to_string(),
        backend: name(meta).to_string(),
        pool: pool.to_string(),
        outcome,
    });
    replicas
}

/// Scalar checks of a backend spec; returns the block size.
fn check_spec(spec: &CacheBackendSpec, meta: &ObjectMeta, out: &mut Outcome) -> u32 {
    if spec.model_id.is_empty() {
        out.reject(BACKEND, meta, "spec.modelID", "must be non-empty".into());
    }
    if spec.hash_scheme.is_empty() {
        out.reject(BACKEND, meta, "spec.hashScheme", "must be non-empty".into());
    }
    if let Some(r) = &spec.inference_pool_ref {
        if r.name.is_empty() {
            out.reject(
                BACKEND,
                meta,
                "spec.inferencePoolRef.name",
                "must be non-empty".into(),
            );
        }
        if let Some(message) = pool_ref_conflict(spec) {
            out.reject(BACKEND, meta, "spec.inferencePoolRef", message);
        }
    }
    let mut port = |field: &str, p: Option<i32>| {
        if let Some(p) = p.filter(|p| !(1..=65535).contains(p)) {
            out.reject(BACKEND, meta, field, format!("{p} is not a port (1-65535)"));
        }
    };
    port("spec.targetPort", spec.target_port);
    if let Some(k) = &spec.kv_events {
        port("spec.kvEvents.port", k.port);
        port("spec.kvEvents.replayPort", k.replay_port);
    }
    for (field, message) in crate::crd::data_parallel::backend_errors(spec) {
        out.reject(BACKEND, meta, &field, message);
    }
    let mut adapters = HashSet::new();
    for (i, a) in spec.lora_adapters.iter().enumerate() {
        let field = format!("spec.loraAdapters[{i}]");
        if a.is_empty() {
            out.reject(BACKEND, meta, &field, "must be non-empty".into());
        } else if *a == spec.model_id {
            out.reject(
                BACKEND,
                meta,
                &field,
                format!("{a:?} is the backend's modelID, not an adapter"),
            );
        } else if !adapters.insert(a.as_str()) {
            out.reject(BACKEND, meta, &field, format!("duplicate adapter {a:?}"));
        }
    }
    if let Err(errors) = crate::adapters::engine_metrics::backend_metrics(spec) {
        for (field, message) in errors {
            out.reject(BACKEND, meta, &field, message);
        }
    }
    u32::try_from(spec.block_size)
        .ok()
        .filter(|b| *b >= 1)
        .unwrap_or_else(|| {
            let b = spec.block_size;
            out.reject(
                BACKEND,
                meta,
                "spec.blockSize",
                format!("{b} is below the minimum 1"),
            );
            0
        })
}

/// Why `spec.inferencePoolRef` cannot stand with the other replica fields: the
/// pool is the whole replica set (its selector, its ports). Shared with admission.
pub fn pool_ref_conflict(spec: &CacheBackendSpec) -> Option<String> {
    spec.inference_pool_ref.as_ref()?;
    let mut set = Vec::new();
    if spec.selector.is_some() {
        set.push("spec.selector");
    }
    if spec.target_port.is_some() {
        set.push("spec.targetPort");
    }
    if !spec.endpoints.is_empty() {
        set.push("spec.endpoints");
    }
    (!set.is_empty()).then(|| {
        format!(
            "excludes {} (the pool's selector and targetPorts are the replica set; \
             use exactly one of spec.selector, spec.endpoints, spec.inferencePoolRef)",
            set.join(", ")
        )
    })
}

/// `spec.endpoints[]` → declared replicas. A replica's KV event socket is its
/// `kvEventsEndpoint`, else `kvEvents.port` on the address's host; the replay
/// socket is its `kvReplayEndpoint`, else `kvEvents.replayPort` on the event
/// socket's host. Both are rank 0's when the endpoint has data-parallel ranks.
fn static_replicas(
    spec: &CacheBackendSpec,
    meta: &ObjectMeta,
    out: &mut Outcome,
) -> Vec<DeclaredReplica> {
    let kv = spec.kv_events.as_ref();
    let mut seen = HashSet::new();
    let mut replicas = Vec::new();
    for (i, ep) in spec.endpoints.iter().enumerate() {
        let at = |f: &str| format!("spec.endpoints[{i}].{f}");
        if ep.id.is_empty() {
            out.reject(BACKEND, meta, &at("id"), "must be non-empty".into());
        } else if !seen.insert(ep.id.as_str()) {
            out.reject(
                BACKEND,
                meta,
                &at("id"),
                format!("duplicate id {:?}", ep.id),
            );
        }
        let Some(host) = host_of(&ep.address) else {
            out.reject(
                BACKEND,
                meta,
                &at("address"),
                format!("{:?} is not host:port", ep.address),
            );
            continue;
        };
        let events = match &ep.kv_events_endpoint {
            Some(e) if e.is_empty() => {
                out.reject(
                    BACKEND,
                    meta,
                    &at("kvEventsEndpoint"),
                    "must be non-empty when set".into(),
                );
                continue;
            }
            Some(e) => Some(e.clone()),
            None => kv.and_then(|k| k.port).map(|p| format!("tcp://{host}:{p}")),
        };
        let replay = match (&events, kv.and_then(|k| k.replay_port)) {
            _ if ep.kv_replay_endpoint.is_some() => ep.kv_replay_endpoint.clone(),
            (Some(e), Some(port)) => {
                let authority = e.split_once("://").map_or(e.as_str(), |(_, a)| a);
                host_of(authority).map(|h| format!("tcp://{h}:{port}"))
            }
            _ => None,
        };
        replicas.push(DeclaredReplica {
            id: ep.id.clone(),
            address: ep.address.clone(),
            kv_events_endpoint: events,
            kv_replay_endpoint: replay,
            data_parallel_size: data_parallel::declared_size(spec, Some(i))
                .clamp(1, data_parallel::MAX_DATA_PARALLEL_SIZE)
                as u32,
        });
    }
    replicas
}

/// The host of `host:port` (IPv6 in brackets), if the port is a valid port.
fn host_of(address: &str) -> Option<&str> {
    let (host, port) = address.rsplit_once(':')?;
    let port_ok = port.parse::<u16>().is_ok_and(|p| p > 0);
    (port_ok && !host.is_empty()).then_some(host)
}

use crate::crd::data_parallel;

pub mod pods;

#[cfg(test)]
mod tests;
