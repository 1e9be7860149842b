//! What each object's `status` should say: pure functions from the objects, the
//! resolution (ignored / rejected), the snapshot in force and the index view to
//! status values. [`super::publish`] only sends them.
//!
//! ```text
//!  CachePolicy / CacheTenant / CacheBackend ─▶ Ready (+ Ignored), observedGeneration
//!      CacheTenant  + IndexView.tenants   ─▶ indexEntries (effective tenant only)
//!      CacheBackend + IndexView.replicas  ─▶ indexParticipation (declared replicas)
//!  PromptTemplate ─▶ templateRevision (hash of the spec), PrefixStable
//!  PDTopology     ─▶ Ready (pools name declared accelerator types)
//!  IndexView + snapshot ─▶ CacheIndex status (docs/kubernetes.md)
//! ```
//!
//! Conditions keep their `lastTransitionTime` while their status does not change,
//! so a status that says the same thing produces the same body (and no write).

use std::collections::{BTreeMap, HashSet};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use serde_json::{Map, Value};

use crate::adapters::resolve::{DEFAULT_NAMESPACE, Ignored, PoolBinding, Rejected};
use crate::core::index::{IndexView, ReplicaView};
use crate::core::scope::PROBE_TENANT;
use crate::core::snapshot::PolicySnapshot;
use crate::core::tenant_report::tenant_reports;
use crate::core::time::Timestamp;
use crate::crd::Condition;
use crate::crd::cache_backend::{
    CacheBackend, CacheBackendStatus, IndexParticipation, ParticipatingReplica,
};
use crate::crd::cache_index::{CacheIndexStatus, IndexReplica, IndexTenant};
use crate::crd::cache_policy::{CachePolicy, CachePolicyStatus};
use crate::crd::cache_tenant::{CacheTenant, CacheTenantStatus};
use crate::crd::pd_topology::{PDTopology, PDTopologyStatus};
use crate::crd::prompt_template::{PromptTemplate, PromptTemplateStatus, SlotType};

/// Condition type present on every reconciled object.
pub const READY: &str = "Ready";
/// Condition type present (True) on an object that lost "oldest in the namespace".
pub const IGNORED: &str = "Ignored";
/// Condition type of a CacheBackend with `spec.inferencePoolRef`: did the pool
/// supply its replicas?
pub const POOL_RESOLVED: &str = "InferencePoolResolved";
/// Condition type of a PromptTemplate: does the body keep Stable slots first?
pub const PREFIX_STABLE: &str = "PrefixStable";

/// What the resolution made of one object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Standing {
    /// In force.
    Effective,
    /// Valid, but an older object of its kind in the namespace is in force.
    Ignored(String),
    /// Unusable; every offending field with its message.
    Invalid(Vec<String>),
}

/// The objects left out of the snapshot in force.
#[derive(Clone, Debug, Default)]
pub struct Verdicts {
    pub ignored: Vec<Ignored>,
    pub rejected: Vec<Rejected>,
    /// How each `inferencePoolRef` resolved.
    pub pool_bindings: Vec<PoolBinding>,
}

impl Verdicts {
    /// The standing of a `kind` object with this metadata.
    pub fn standing(&self, kind: &str, meta: &ObjectMeta) -> Standing {
        let ns = namespace(meta);
        let name = meta.name.as_deref().unwrap_or("");
        let same = |k: &str, n: &str, m: &str| k == kind && n == ns && m == name;
        if let Some(i) = self
            .ignored
            .iter()
            .find(|i| same(i.kind, &i.namespace, &i.name))
        {
            return Standing::Ignored(i.reason.clone());
        }
        let problems: Vec<String> = self
            .rejected
            .iter()
            .filter(|r| same(r.kind, &r.namespace, &r.name))
            .map(|r| format!("{}: {}", r.field, r.message))
            .collect();
        if problems.is_empty() {
            Standing::Effective
        } else {
            Standing::Invalid(problems)
        }
    }
}

fn namespace(meta: &ObjectMeta) -> &str {
    meta.namespace.as_deref().unwrap_or(DEFAULT_NAMESPACE)
}

/// A Kubernetes `Time` from a core timestamp.
pub fn time(ts: Timestamp) -> Time {
    Time(jiff::Timestamp::from_nanosecond(i128::from(ts.as_nanos())).unwrap_or_default())
}

/// A rate in 0..1 as the CRDs spell it: decimal, at most 4 places, no trailing
/// zeros ("0.25", "1", "0").
pub fn rate(value: f64) -> String {
    let v = if value.is_finite() {
        value.clamp(0.0, 1.0)
    } else {
        0.0
    };
    let text = format!("{v:.4}");
    let text = text.trim_end_matches('0').trim_end_matches('.');
    if text.is_empty() {
        "0".into()
    } else {
        text.into()
    }
}

/// Builds conditions, keeping `lastTransitionTime` of a previous condition of the
/// same type and status.
struct Conditions<'a> {
    previous: &'a [Condition],
    generation: Option<i64>,
    now: &'a Time,
    out: Vec<Condition>,
}

impl<'a> Conditions<'a> {
    fn new(previous: &'a [Condition], meta: &ObjectMeta, now: &'a Time) -> Self {
        Self {
            previous,
            generation: meta.generation,
            now,
            out: Vec::new(),
        }
    }

    fn set(mut self, type_: &str, status: bool, reason: &str, message: String) -> Self {
        let status = if status { "True" } else { "False" };
        let since = self
            .previous
            .iter()
            .find(|c| c.type_ == type_ && c.status == status)
            .map_or_else(|| self.now.clone(), |c| c.last_transition_time.clone());
        self.out.push(Condition {
            type_: type_.into(),
            status: status.into(),
            reason: reason.into(),
            message,
            last_transition_time: since,
            observed_generation: self.generation,
        });
        self
    }

    /// Ready (and Ignored when it applies) from the standing.
    fn standing(self, standing: &Standing, effective: String) -> Self {
        match standing {
            Standing::Effective => self.set(READY, true, "Effective", effective),
            Standing::Ignored(why) => self.set(READY, false, "Ignored", why.clone()).set(
                IGNORED,
                true,
                "OlderObjectEffective",
                why.clone(),
            ),
            Standing::Invalid(problems) => self.set(READY, false, "Invalid", problems.join("; ")),
        }
    }
}

/// Status of a CachePolicy.
pub fn policy_status(p: &CachePolicy, verdicts: &Verdicts, now: &Time) -> CachePolicyStatus {
    let previous = p.status.as_ref().map_or(&[][..], |s| &s.conditions[..]);
    let standing = verdicts.standing("CachePolicy", &p.metadata);
    let ns = namespace(&p.metadata);
    CachePolicyStatus {
        conditions: Conditions::new(previous, &p.metadata, now)
            .standing(&standing, format!("in force for namespace {ns}"))
            .out,
        observed_generation: p.metadata.generation,
    }
}

/// Status of a CacheTenant. `indexEntries` is set only for the tenant in force
/// (the index counts by tenant id, which an ignored object does not own).
pub fn tenant_status(
    t: &CacheTenant,
    verdicts: &Verdicts,
    view: &IndexView,
    now: &Time,
) -> CacheTenantStatus {
    let previous = t.status.as_ref().map_or(&[][..], |s| &s.conditions[..]);
    let standing = verdicts.standing("CacheTenant", &t.metadata);
    let id = &t.spec.tenant_id;
    let index_entries = (standing == Standing::Effective).then(|| {
        view.tenants
            .iter()
            .find(|e| &e.tenant == id)
            .map_or(0, |e| i64::try_from(e.index_entries).unwrap_or(i64::MAX))
    });
    CacheTenantStatus {
        index_entries,
        conditions: Conditions::new(previous, &t.metadata, now)
            .standing(
                &standing,
                format!(
                    "tenant {id:?} in force for namespace {}",
                    namespace(&t.metadata)
                ),
            )
            .out,
        observed_generation: t.metadata.generation,
    }
}

/// Status of a CacheBackend: one participation row per replica the snapshot
/// declares for it, with what the index holds for that replica in its scope.
pub fn backend_status(
    b: &CacheBackend,
    verdicts: &Verdicts,
    snapshot: &PolicySnapshot,
    view: &IndexView,
    now: &Time,
) -> CacheBackendStatus {
    let previous = b.status.as_ref().map_or(&[][..], |s| &s.conditions[..]);
    let standing = verdicts.standing("CacheBackend", &b.metadata);
    let ns = namespace(&b.metadata);
    let name = b.metadata.name.as_deref().unwrap_or("");
    let decl = snapshot
        .backends()
        .iter()
        .find(|d| d.namespace == ns && d.name == name);
    let (participation, effective) = match decl {
        Some(decl) => {
            let rows = decl
                .replicas
                .iter()
                .map(|r| {
                    let seen = view.replicas.iter().find(|v| {
                        v.replica_id == r.id
                            && *v.tenant == *decl.scope.tenant
                            && *v.model == *decl.scope.model
                            && *v.hash_scheme == *decl.scope.hash_scheme
                    });
                    ParticipatingReplica {
                        id: r.id.clone(),
                        prefix_count: seen.map_or(0, |v| count(v.prefix_count)),
                        last_event_at: seen.and_then(|v| v.last_event_at).map(time),
                        hit_rate: seen
                            .and_then(|v| v.stats.as_ref())
                            .map(|(s, _)| rate(s.hit_rate)),
                    }
                })
                .collect();
            let message = format!(
                "scope {}/{}/{} with {} replica(s)",
                decl.scope.tenant,
                decl.scope.model,
                decl.scope.hash_scheme,
                decl.replicas.len()
            );
            (Some(IndexParticipation { replicas: rows }), message)
        }
        None => (None, String::new()),
    };
    let mut conditions = Conditions::new(previous, &b.metadata, now).standing(&standing, effective);
    let binding = verdicts
        .pool_bindings
        .iter()
        .find(|p| p.namespace == ns && p.backend == name);
    if let Some(binding) = binding {
        conditions = match &binding.outcome {
            Ok(n) => conditions.set(
                POOL_RESOLVED,
                true,
                "Resolved",
                format!("InferencePool {ns}/{}: {n} endpoint(s)", binding.pool),
            ),
            Err(problem) => conditions.set(
                POOL_RESOLVED,
                false,
                problem.reason,
                problem.message.clone(),
            ),
        };
    }
    CacheBackendStatus {
        index_participation: participation,
        conditions: conditions.out,
        observed_generation: b.metadata.generation,
    }
}

fn count(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// The CacheIndex singleton's status:
/// - `replicas[]`: only replicas that reported stats; keyed on id, and when two
///   rows share an id the lexicographically-later tenant wins (the row names it);
/// - `tenants[]`: every tenant of the snapshot and the index, `indexEntries`
///   always present (this runs only on a real view), `hitRate` only when one of
///   its replicas reported stats, `memoryUsed` hard-zeroed;
/// - the probe tenant never appears.
pub fn cache_index_status(
    view: &IndexView,
    snapshot: &PolicySnapshot,
    now: Timestamp,
) -> CacheIndexStatus {
    let mut by_id: BTreeMap<&str, &ReplicaView> = BTreeMap::new();
    for r in view.replicas.iter().filter(|r| r.tenant != PROBE_TENANT) {
        if r.stats.is_none() {
            continue;
        }
        let key = |v: &ReplicaView| (v.tenant.clone(), v.model.clone(), v.hash_scheme.clone());
        match by_id.get(r.replica_id.as_str()) {
            Some(kept) if key(kept) >= key(r) => {}
            _ => {
                by_id.insert(r.replica_id.as_str(), r);
            }
        }
    }
    let replicas = by_id
        .into_values()
        .filter_map(|r| {
            let (stats, at) = r.stats.as_ref()?;
            Some(IndexReplica {
                id: r.replica_id.clone(),
                tenant: Some(r.tenant.clone()),
                model: Some(r.model.clone()),
                hash_scheme: Some(r.hash_scheme.clone()),
                prefix_count: count(r.prefix_count),
                hit_rate: Some(rate(stats.hit_rate)),
                cache_memory_bytes: count(stats.cache_memory_bytes),
                last_update: Some(time(*at)),
            })
        })
        .collect();

    let tenants = tenant_reports(view, snapshot)
        .into_iter()
        .map(|t| IndexTenant {
            tenant: t.tenant.to_string(),
            namespace: t.namespace.map(str::to_string),
            index_entries: Some(count(t.index_entries)),
            hit_rate: t.hit_rate.map(rate),
            // Deprecated: never the engine total, which is shared across tenants.
            memory_used: 0,
        })
        .collect();

    CacheIndexStatus {
        generated_at: Some(time(now)),
        total_entries: count(view.total_entries),
        replicas,
        tenants,
        conditions: Vec::new(),
        observed_generation: None,
    }
}

/// A stable revision of a PromptTemplate spec: equal specs, equal revisions,
/// across processes and versions (a fixed-seed hash of the canonical JSON).
pub fn template_revision(t: &PromptTemplate) -> String {
    use std::hash::BuildHasher;
    let canonical = serde_json::to_string(&t.spec).unwrap_or_default();
    let h = foldhash::fast::FixedState::with_seed(0x7e_4a1e).hash_one(canonical.as_bytes());
    format!("t{h:016x}")
}

/// Slot references in a template body, in order of first appearance.
///
/// The syntax detected is `{{name}}`, with optional spaces inside the braces
/// (`{{ name }}`); `name` is letters, digits, `_`, `-` and `.`. Anything else
/// between double braces (a filter, an expression) is not a slot reference.
pub fn slot_references(body: &str) -> Vec<&str> {
    let mut found: Vec<&str> = Vec::new();
    let mut rest = body;
    while let Some(open) = rest.find("{{") {
        let after = &rest[open + 2..];
        let Some(close) = after.find("}}") else { break };
        let name = after[..close].trim();
        let is_name = !name.is_empty()
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
        if is_name && !found.contains(&name) {
            found.push(name);
        }
        rest = &after[close + 2..];
    }
    found
}

/// Status of a PromptTemplate: the revision, and `PrefixStable` False when a
/// declared Mutable slot is referenced before a declared Stable slot (the
/// rendered prefix then changes per request and the Stable part is not reused).
pub fn template_status(t: &PromptTemplate, now: &Time) -> PromptTemplateStatus {
    let previous = t.status.as_ref().map_or(&[][..], |s| &s.conditions[..]);
    let kind_of = |name: &str| {
        t.spec
            .slots
            .iter()
            .find(|s| s.name == name)
            .map(|s| s.slot_type)
    };
    let mut first_mutable: Option<&str> = None;
    let mut broken: Option<(&str, &str)> = None;
    for name in slot_references(&t.spec.body) {
        match kind_of(name) {
            Some(SlotType::Mutable) if first_mutable.is_none() => first_mutable = Some(name),
            Some(SlotType::Stable) => {
                if let Some(m) = first_mutable {
                    broken = Some((m, name));
                    break;
                }
            }
            _ => {}
        }
    }
    let conditions = Conditions::new(previous, &t.metadata, now);
    let conditions = match broken {
        Some((mutable, stable)) => conditions.set(
            PREFIX_STABLE,
            false,
            "MutableBeforeStable",
            format!(
                "mutable slot {mutable:?} appears before stable slot {stable:?} in spec.body; \
                 the prefix changes per request, so move stable slots first"
            ),
        ),
        None => conditions.set(
            PREFIX_STABLE,
            true,
            "StableSlotsFirst",
            "no mutable slot precedes a stable slot in spec.body".into(),
        ),
    };
    PromptTemplateStatus {
        template_revision: Some(template_revision(t)),
        conditions: conditions.out,
        observed_generation: t.metadata.generation,
    }
}

/// Status of a PDTopology: `Ready` False naming every pool whose
/// `acceleratorType` is not a declared `acceleratorTypes[].name`.
pub fn topology_status(t: &PDTopology, now: &Time) -> PDTopologyStatus {
    let previous = t.status.as_ref().map_or(&[][..], |s| &s.conditions[..]);
    let declared: HashSet<&str> = t
        .spec
        .accelerator_types
        .iter()
        .map(|a| a.name.as_str())
        .collect();
    let mut problems = Vec::new();
    for (list, pools) in [
        ("prefillPools", &t.spec.prefill_pools),
        ("decodePools", &t.spec.decode_pools),
    ] {
        for p in pools.iter() {
            if let Some(a) = p.accelerator_type.as_deref()
                && !declared.contains(a)
            {
                problems.push(format!(
                    "spec.{list}[{}].acceleratorType {a:?} is not a declared acceleratorTypes[].name",
                    p.name
                ));
            }
        }
    }
    let conditions = Conditions::new(previous, &t.metadata, now);
    let conditions = if problems.is_empty() {
        conditions.set(
            READY,
            true,
            "AcceleratorTypesDeclared",
            "every pool names a declared accelerator type".into(),
        )
    } else {
        conditions.set(
            READY,
            false,
            "UndeclaredAcceleratorType",
            problems.join("; "),
        )
    };
    PDTopologyStatus {
        conditions: conditions.out,
        observed_generation: t.metadata.generation,
    }
}

/// The JSON merge patch (RFC 7386) body that turns `current` status into
/// `desired`: `{"status": desired}` plus an explicit `null` for every key the
/// current status has and the desired one lacks (a merge patch keeps absent keys).
pub fn merge_patch(current: Option<&Value>, desired: Value) -> Value {
    fn nulls(current: &Value, desired: Value) -> Value {
        match (current, desired) {
            (Value::Object(cur), Value::Object(mut want)) => {
                let mut out = Map::new();
                for (k, v) in cur {
                    match want.remove(k) {
                        Some(w) => {
                            out.insert(k.clone(), nulls(v, w));
                        }
                        None => {
                            out.insert(k.clone(), Value::Null);
                        }
                    }
                }
                out.extend(want);
                Value::Object(out)
            }
            (_, desired) => desired,
        }
    }
    let status = match current {
        Some(cur) => nulls(cur, desired),
        None => desired,
    };
    serde_json::json!({ "status": status })
}

#[cfg(test)]
mod tests;
