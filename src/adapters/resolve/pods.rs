//! Pod discovery for a CacheBackend with a `selector` or an `inferencePoolRef`:
//! which pods are replicas, and at which addresses. Pure; the Kubernetes watcher
//! hands in the pods (and pools) it holds.
//!
//! ```text
//!  Pod (backend's namespace, labels match the selector, Ready=True, has an IP,
//!       not being deleted)
//!    ─▶ DeclaredReplica { id: pod name, address: podIP:targetPort,
//!                         kvEventsEndpoint: tcp://podIP:kvEvents.port,
//!                         replay: tcp://podIP:kvEvents.replayPort }
//! ```
//!
//! A pod that is not ready is simply not a replica yet: when it turns ready (or
//! stops being ready) the next snapshot declares (or drops) it, and the index
//! forgets an undeclared replica's entries.

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::core::{Selector, SelectorExt};

use super::DEFAULT_NAMESPACE;
use crate::core::snapshot::DeclaredReplica;
use crate::crd::cache_backend::CacheBackendSpec;
use crate::crd::data_parallel;
use crate::crd::inference_pool::InferencePool;

/// Why a backend's selector cannot discover anything.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiscoveryError {
    pub field: &'static str,
    pub message: String,
}

/// The replicas a backend in `namespace` with `selector` declares among `pods`,
/// sorted by id.
pub fn discovered(
    namespace: &str,
    selector: &LabelSelector,
    spec: &CacheBackendSpec,
    pods: &[Pod],
) -> Result<Vec<DeclaredReplica>, DiscoveryError> {
    let selector = Selector::try_from(selector.clone()).map_err(|e| DiscoveryError {
        field: "spec.selector",
        message: e.to_string(),
    })?;
    let Some(port) = spec.target_port else {
        return Err(DiscoveryError {
            field: "spec.targetPort",
            message: "is required when spec.selector is set (pod IP + targetPort is the \
                      replica address)"
                .into(),
        });
    };
    let data_parallel_size = data_parallel::declared_size(spec, None)
        .clamp(1, data_parallel::MAX_DATA_PARALLEL_SIZE) as u32;
    let endpoints = Endpoints {
        ports: vec![port],
        follow_active_ports: false,
        data_parallel_size,
    };
    Ok(members(namespace, &selector, &endpoints, spec, pods))
}

/// Pod annotation (GIE's) listing which of a pool's `targetPorts` a pod serves
/// on, comma-separated; absent means all of them.
pub const ACTIVE_PORTS_ANNOTATION: &str = "inference.networking.k8s.io/active-ports";

/// Why a pool cannot supply replicas (the backend stays declared, without them).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolProblem {
    /// `NotFound`, `Invalid`, `Unavailable` or `Conflict` (condition reasons).
    pub reason: &'static str,
    pub message: String,
}

/// The replicas a backend in `namespace` takes from `pool` (same namespace),
/// sorted by id. As GIE's endpoint picker does, every ready pod the pool's
/// selector matches is one endpoint per target port (`podIP:number`), narrowed by
/// the pod's [`ACTIVE_PORTS_ANNOTATION`]. With one target port the replica id is
/// the pod name; with several it is GIE's `<pod>-rank-<i>` (i = index in
/// `targetPorts`), and rank i follows `kvEvents.port + i` / `replayPort + i`.
pub fn pool_members(
    pool: &InferencePool,
    spec: &CacheBackendSpec,
    pods: &[Pod],
) -> Result<Vec<DeclaredReplica>, PoolProblem> {
    let namespace = pool
        .metadata
        .namespace
        .as_deref()
        .unwrap_or(DEFAULT_NAMESPACE);
    let name = pool.metadata.name.as_deref().unwrap_or("");
    let invalid = |message: String| PoolProblem {
        reason: "Invalid",
        message: format!("InferencePool {namespace}/{name}: {message}"),
    };
    let labels = &pool.spec.selector.match_labels;
    if labels.is_empty() {
        return Err(invalid("spec.selector.matchLabels is empty".into()));
    }
    if pool.spec.target_ports.is_empty() {
        return Err(invalid("spec.targetPorts is empty".into()));
    }
    let mut ports = Vec::with_capacity(pool.spec.target_ports.len());
    for (i, p) in pool.spec.target_ports.iter().enumerate() {
        if !(1..=65535).contains(&p.number) {
            return Err(invalid(format!(
                "spec.targetPorts[{i}].number {} is not a port (1-65535)",
                p.number
            )));
        }
        if ports.contains(&p.number) {
            return Err(invalid(format!(
                "spec.targetPorts[{i}].number {} is listed twice",
                p.number
            )));
        }
        ports.push(p.number);
    }
    let declared = data_parallel::declared_size(spec, None);
    if ports.len() > 1 && declared != 1 {
        return Err(PoolProblem {
            reason: "Conflict",
            message: format!(
                "InferencePool {namespace}/{name} has {} targetPorts (one endpoint, one \
                 data-parallel rank, per port); spec.dataParallelSize {declared} would \
                 subscribe overlapping KV event ports; leave it unset",
                ports.len()
            ),
        });
    }
    if let Some(k) = &spec.kv_events {
        for (field, port) in [
            ("kvEvents.port", k.port),
            ("kvEvents.replayPort", k.replay_port),
        ] {
            if let Some(p) = port
                && i64::from(p) + ports.len() as i64 - 1 > 65535
            {
                return Err(PoolProblem {
                    reason: "Conflict",
                    message: format!(
                        "spec.{field} {p} + {} target ports of InferencePool \
                         {namespace}/{name} passes 65535",
                        ports.len() - 1
                    ),
                });
            }
        }
    }
    let selector: Selector = labels.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    let endpoints = Endpoints {
        ports,
        follow_active_ports: true,
        data_parallel_size: declared.clamp(1, data_parallel::MAX_DATA_PARALLEL_SIZE) as u32,
    };
    Ok(members(namespace, &selector, &endpoints, spec, pods))
}

/// The ports each selected pod serves on.
struct Endpoints {
    ports: Vec<i32>,
    /// Narrow `ports` by the pod's [`ACTIVE_PORTS_ANNOTATION`] (pools only).
    follow_active_ports: bool,
    data_parallel_size: u32,
}

/// Ready pods of `namespace` matching `selector`, one replica per port.
fn members(
    namespace: &str,
    selector: &Selector,
    endpoints: &Endpoints,
    spec: &CacheBackendSpec,
    pods: &[Pod],
) -> Vec<DeclaredReplica> {
    let kv = spec.kv_events.as_ref();
    let ranked = endpoints.ports.len() > 1;
    let empty = Default::default();
    let mut replicas: Vec<DeclaredReplica> = Vec::new();
    for p in pods
        .iter()
        .filter(|p| p.metadata.namespace.as_deref().unwrap_or(DEFAULT_NAMESPACE) == namespace)
        .filter(|p| selector.matches(p.metadata.labels.as_ref().unwrap_or(&empty)))
    {
        let Some(name) = p.metadata.name.as_deref().filter(|n| !n.is_empty()) else {
            continue;
        };
        let Some(ip) = ready_ip(p) else { continue };
        // IPv6 addresses go in brackets in host:port and URLs.
        let host = if ip.contains(':') {
            format!("[{ip}]")
        } else {
            ip.to_string()
        };
        let active = endpoints
            .follow_active_ports
            .then(|| active_ports(p))
            .flatten();
        for (i, port) in endpoints.ports.iter().enumerate() {
            if active.as_ref().is_some_and(|a| !a.contains(port)) {
                continue;
            }
            let offset = i as i32;
            replicas.push(DeclaredReplica {
                id: if ranked {
                    format!("{name}-rank-{i}")
                } else {
                    name.to_string()
                },
                address: format!("{host}:{port}"),
                kv_events_endpoint: kv
                    .and_then(|k| k.port)
                    .map(|p| format!("tcp://{host}:{}", p + offset)),
                kv_replay_endpoint: kv
                    .filter(|k| k.port.is_some())
                    .and_then(|k| k.replay_port)
                    .map(|p| format!("tcp://{host}:{}", p + offset)),
                data_parallel_size: endpoints.data_parallel_size,
            });
        }
    }
    replicas.sort_by(|a, b| a.id.cmp(&b.id));
    replicas
}

/// The ports of the pod's [`ACTIVE_PORTS_ANNOTATION`], if it has one (entries
/// that are not numbers are skipped, as GIE does).
fn active_ports(pod: &Pod) -> Option<Vec<i32>> {
    let text = pod
        .metadata
        .annotations
        .as_ref()?
        .get(ACTIVE_PORTS_ANNOTATION)?;
    Some(
        text.split(',')
            .filter_map(|p| p.trim().parse::<i32>().ok())
            .filter(|p| *p > 0)
            .collect(),
    )
}

/// The pod's IP if it is ready to serve: condition `Ready=True`, an IP assigned,
/// and no deletion in progress (a terminating pod may still report ready).
fn ready_ip(pod: &Pod) -> Option<&str> {
    if pod.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let status = pod.status.as_ref()?;
    let ready = status
        .conditions
        .as_deref()
        .unwrap_or_default()
        .iter()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    if !ready {
        return None;
    }
    status.pod_ip.as_deref().filter(|ip| !ip.is_empty())
}

#[cfg(test)]
mod tests;
