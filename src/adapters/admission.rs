//! The validating admission webhook (docs/reference.md, "Kubernetes"): AdmissionReview v1 in, an
//! allowed/denied AdmissionReview out. Each rule's message
//! names the field it is about (`spec.strategy.requireChain: ...`).
//!
//! ```text
//!  apiserver ─HTTPS POST /validate─▶ server.rs (rustls, axum)
//!      AdmissionReview ─▶ review() ─▶ problems(kind, object) ─▶ allowed / denied
//!                                       1. openAPI schema   (crd::openapi: types, enums,
//!                                                            patterns, minimums, unknown fields)
//!                                       2. typed object     (serde, field path on error)
//!                                       3. the policy rules (below, field-named)
//!                                       4. the CRD's CEL     (validate_cel, a safety net)
//! ```
//!
//! UPDATE: the reserved tenant id `inferencecache.io/probe` is refused only when the
//! update introduces it, so an unchanged older CacheTenant still admits unrelated
//! edits (`filterIntroducedErrors`). Every other rule applies to every
//! CREATE and UPDATE. The CEL net follows the apiserver's ratcheting: a CEL error
//! the old object already had is not the update's doing.
//!
//! Kinds that are not ours, DELETE and CONNECT are allowed untouched: the webhook
//! configuration only sends our kinds, and refusing what we do not understand would
//! block the cluster for no benefit.

use std::collections::BTreeSet;

use kube::core::DynamicObject;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview, Operation};
use kube::{CustomResourceExt, Resource};
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::core::scope::PROBE_TENANT;
use crate::crd::cache_backend::CacheBackend;
use crate::crd::cache_policy::CachePolicy;
use crate::crd::cache_tenant::CacheTenant;
use crate::crd::openapi;
use crate::crd::pd_topology::{PDTopology, Pool};
use crate::crd::prompt_template::PromptTemplate;

mod server;
#[cfg(test)]
mod tests;

pub use server::{WebhookArgs, run, serve, tls_config};

/// Answers one AdmissionReview. A review without a request gets an "invalid"
/// answer (the apiserver never sends one).
pub fn review(review: AdmissionReview<DynamicObject>) -> AdmissionReview<DynamicObject> {
    let request: AdmissionRequest<DynamicObject> = match review.try_into() {
        Ok(r) => r,
        Err(_) => {
            return AdmissionResponse::invalid("AdmissionReview has no request").into_review();
        }
    };
    let response = AdmissionResponse::from(&request);
    let problems = admit(&request);
    if problems.is_empty() {
        return response.into_review();
    }
    let kind = &request.kind.kind;
    let name = if request.name.is_empty() {
        "(generated name)"
    } else {
        request.name.as_str()
    };
    tracing::info!(kind = %kind, namespace = ?request.namespace, name, ?problems, "admission denied");
    response
        .deny(format!("{kind} {name}: {}", problems.join("; ")))
        .into_review()
}

/// The problems that deny `request`; empty admits it.
fn admit(request: &AdmissionRequest<DynamicObject>) -> Vec<String> {
    if request.kind.group != crate::crd::GROUP || request.sub_resource.is_some() {
        return Vec::new();
    }
    let (object, old) = match request.operation {
        Operation::Create => (request.object.as_ref(), None),
        Operation::Update => (request.object.as_ref(), request.old_object.as_ref()),
        Operation::Delete | Operation::Connect => return Vec::new(),
    };
    let Some(object) = object else {
        return vec!["the request carries no object".into()];
    };
    let to_value = |o: &DynamicObject| serde_json::to_value(o).unwrap_or(Value::Null);
    problems(
        &request.kind.kind,
        &to_value(object),
        old.map(to_value).as_ref(),
    )
}

/// The problems of `object` of `kind`; `old` is the stored object on UPDATE.
pub fn problems(kind: &str, object: &Value, old: Option<&Value>) -> Vec<String> {
    match kind {
        "CachePolicy" => check::<CachePolicy>(object, old, policy_rules),
        "CacheTenant" => check::<CacheTenant>(object, old, tenant_rules),
        "CacheBackend" => check::<CacheBackend>(object, old, backend_rules),
        "PromptTemplate" => check::<PromptTemplate>(object, old, template_rules),
        "PDTopology" => check::<PDTopology>(object, old, topology_rules),
        _ => Vec::new(),
    }
}

/// One rule's finding. `introduced_only` findings are dropped on an UPDATE whose
/// old object had the same finding.
struct Finding {
    message: String,
    introduced_only: bool,
}

impl Finding {
    fn always(message: String) -> Self {
        Self {
            message,
            introduced_only: false,
        }
    }
}

/// The typed kinds' generated CEL validation, behind one trait.
trait Cel: DeserializeOwned + CustomResourceExt + Resource {
    fn cel(&self) -> Vec<String>;
}

macro_rules! cel {
    ($($t:ty),*) => {$(
        impl Cel for $t {
            fn cel(&self) -> Vec<String> {
                match self.validate_cel() {
                    Ok(()) => Vec::new(),
                    Err(errs) => errs.iter().map(ToString::to_string).collect(),
                }
            }
        }
    )*};
}
cel!(
    CachePolicy,
    CacheTenant,
    CacheBackend,
    PromptTemplate,
    PDTopology
);

fn check<K: Cel>(
    object: &Value,
    old: Option<&Value>,
    rules: fn(&K) -> Vec<Finding>,
) -> Vec<String> {
    let (findings, cel) = match evaluate(object, rules) {
        Ok(found) => found,
        Err(structural) => return structural,
    };
    // The old object is only consulted to forgive what it already had; one that
    // no longer parses forgives nothing.
    let old = old.and_then(|o| evaluate(o, rules).ok());
    let old_rules: BTreeSet<&str> = old
        .as_ref()
        .map(|(f, _)| f.iter().map(|f| f.message.as_str()).collect())
        .unwrap_or_default();
    let mut out: Vec<String> = findings
        .iter()
        .filter(|f| !(f.introduced_only && old_rules.contains(f.message.as_str())))
        .map(|f| f.message.clone())
        .collect();
    // The CEL rules say the same things as the rules above; they only speak when
    // the rules found nothing, in case the CRD gained a rule the webhook lacks.
    if findings.is_empty() {
        let old_cel: BTreeSet<&String> = old
            .as_ref()
            .map(|(_, c)| c.iter().collect())
            .unwrap_or_default();
        out.extend(
            cel.into_iter()
                .filter(|e| !old_cel.contains(e))
                .map(|e| format!("{e} (CEL)")),
        );
    }
    out
}

/// Schema and typing problems are `Err` (nothing further can be checked);
/// otherwise the rule findings and the CEL errors.
fn evaluate<K: Cel>(
    object: &Value,
    rules: fn(&K) -> Vec<Finding>,
) -> Result<(Vec<Finding>, Vec<String>), Vec<String>> {
    let structural: Vec<String> = openapi::schema_of(&K::crd())
        .map(|schema| openapi::validate(&schema, object))
        .unwrap_or_default()
        .iter()
        .filter(|v| !v.path.starts_with("metadata"))
        .map(ToString::to_string)
        .collect();
    if !structural.is_empty() {
        return Err(structural);
    }
    let typed: K = serde_path_to_error::deserialize(object)
        .map_err(|e| vec![format!("{}: {}", e.path(), e.inner())])?;
    Ok((rules(&typed), typed.cel()))
}

fn non_empty(path: &str, value: &str, out: &mut Vec<Finding>) {
    if value.is_empty() {
        out.push(Finding::always(format!("{path}: must be non-empty")));
    }
}

fn policy_rules(p: &CachePolicy) -> Vec<Finding> {
    let mut out = Vec::new();
    let s = &p.spec.strategy;
    if s.require_chain && !s.enable_chain_matching {
        out.push(Finding::always(
            "spec.strategy.requireChain: true requires spec.strategy.enableChainMatching: true \
             (a required chain could never be matched)"
                .into(),
        ));
    }
    let factor = &p.spec.load_balancing.factor;
    if let Err(e) = crate::core::policy::LoadBalancing::parse_factor(factor) {
        out.push(Finding::always(format!("spec.{e}")));
    }
    let share = &p.spec.load_balancing.share_factor;
    if let Err(e) = crate::core::policy::LoadBalancing::parse_share_factor(share) {
        out.push(Finding::always(format!("spec.{e}")));
    }
    let w = &p.spec.tier_weights;
    for (field, text) in [
        ("spec.tierWeights.cpu", &w.cpu),
        ("spec.tierWeights.disk", &w.disk),
    ] {
        if let Err(e) = crate::core::policy::TierWeights::parse_weight(field, text) {
            out.push(Finding::always(e));
        }
    }
    let wait = &p.spec.flow_control.max_queue_wait;
    match crate::core::policy::parse_duration(wait) {
        Ok(d) if d.is_zero() => out.push(Finding::always(
            "spec.flowControl.maxQueueWait: must be positive".into(),
        )),
        Ok(d) if d > crate::core::policy::FlowControl::MAX_QUEUE_WAIT => {
            out.push(Finding::always(format!(
                "spec.flowControl.maxQueueWait: {}",
                crate::adapters::resolve::MAX_WAIT_MESSAGE
            )))
        }
        Ok(_) => {}
        Err(e) => out.push(Finding::always(format!(
            "spec.flowControl.maxQueueWait: {e}"
        ))),
    }
    out
}

fn tenant_rules(t: &CacheTenant) -> Vec<Finding> {
    let mut out = Vec::new();
    non_empty("spec.tenantID", &t.spec.tenant_id, &mut out);
    if t.spec.tenant_id == PROBE_TENANT {
        out.push(Finding {
            message: format!(
                "spec.tenantID: {PROBE_TENANT:?} is reserved for the server's self-test"
            ),
            introduced_only: true,
        });
    }
    out
}

fn backend_rules(b: &CacheBackend) -> Vec<Finding> {
    let mut out = Vec::new();
    non_empty("spec.modelID", &b.spec.model_id, &mut out);
    non_empty("spec.hashScheme", &b.spec.hash_scheme, &mut out);
    for (i, e) in b.spec.endpoints.iter().enumerate() {
        non_empty(&format!("spec.endpoints[{i}].id"), &e.id, &mut out);
        non_empty(
            &format!("spec.endpoints[{i}].address"),
            &e.address,
            &mut out,
        );
    }
    if let Some(r) = &b.spec.inference_pool_ref {
        non_empty("spec.inferencePoolRef.name", &r.name, &mut out);
    }
    if let Some(conflict) = crate::adapters::resolve::pool_ref_conflict(&b.spec) {
        out.push(Finding::always(format!(
            "spec.inferencePoolRef: {conflict}"
        )));
    }
    for (field, message) in crate::crd::data_parallel::backend_errors(&b.spec) {
        out.push(Finding::always(format!("{field}: {message}")));
    }
    out
}

fn template_rules(t: &PromptTemplate) -> Vec<Finding> {
    let mut out = Vec::new();
    non_empty("spec.body", &t.spec.body, &mut out);
    for (i, slot) in t.spec.slots.iter().enumerate() {
        non_empty(&format!("spec.slots[{i}].name"), &slot.name, &mut out);
    }
    out
}

fn topology_rules(t: &PDTopology) -> Vec<Finding> {
    let mut out = Vec::new();
    for (i, a) in t.spec.accelerator_types.iter().enumerate() {
        non_empty(
            &format!("spec.acceleratorTypes[{i}].name"),
            &a.name,
            &mut out,
        );
    }
    let declared: BTreeSet<&str> = t
        .spec
        .accelerator_types
        .iter()
        .map(|a| a.name.as_str())
        .collect();
    let mut pools = |list: &str, pools: &[Pool]| {
        for (i, pool) in pools.iter().enumerate() {
            non_empty(&format!("spec.{list}[{i}].name"), &pool.name, &mut out);
            if let Some(acc) = &pool.accelerator_type
                && !declared.contains(acc.as_str())
            {
                out.push(Finding::always(format!(
                    "spec.{list}[{i}].acceleratorType: {acc:?} is not a declared \
                     spec.acceleratorTypes[].name"
                )));
            }
        }
    };
    pools("prefillPools", &t.spec.prefill_pools);
    pools("decodePools", &t.spec.decode_pools);
    out
}
