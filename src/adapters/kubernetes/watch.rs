//! Watches → snapshot: reflector stores of every kind the policy is made of, and
//! a debounced rebuild through [`resolve_with_pods`](crate::adapters::resolve::resolve_with_pods) on every change.
//!
//! ```text
//!  CachePolicy  ┐ (all namespaces)
//!  CacheTenant  ├─ watcher ─▶ reflector Store ─┐ any event marks dirty
//!  CacheBackend ┤                              │ quiet for `debounce`, and the
//!  Pod          ┘ (all namespaces, trimmed)    │ four stores listed once
//!  InferencePool (GIE's; CRD may be missing) ──┤ (listed, or its watch failed)
//!  PromptTemplate, PDTopology (status only) ───┤
//!                                              ▼
//!        resolve_in_cluster(policies, tenants, backends, pods, pools)
//!          ├─▶ install(snapshot)    only when the revision changed
//!          └─▶ Observed { objects, verdicts }  for the status publisher
//! ```
//!
//! The stores always hold the cluster's current objects, so deletions, namespace
//! moves (a delete plus a create), a tenant changing its `tenantID` and several
//! objects in one namespace need no special cases: the rebuild resolves whatever
//! is there now (oldest per namespace wins, in `resolve`). Pods are watched in all
//! namespaces because the selectors are arbitrary; their spec, managed fields,
//! container statuses and annotations (but GIE's active-ports one) are dropped
//! before they are stored.
//!
//! InferencePools belong to the Gateway API Inference Extension, whose CRD may
//! not be installed: until the pools list once, their watch failing (404, 403)
//! is logged with the reason, CacheBackends with `inferencePoolRef` get no
//! replicas and an `InferencePoolResolved=False` condition, and everything else
//! works. The watch keeps retrying, so installing the CRD later is picked up.
//! Once listed, a later watch error keeps the last pools (as for every kind)
//! rather than dropping the replicas of a transient disconnect.

use std::fmt::Debug;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::WatchStreamExt;
use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client, Resource};
use serde::de::DeserializeOwned;
use tokio::sync::watch as latest;

use super::status::Verdicts;
use crate::adapters::resolve::pods::ACTIVE_PORTS_ANNOTATION;
use crate::adapters::resolve::{Cluster, DEFAULT_NAMESPACE, Pools, resolve_in_cluster};
use crate::core::snapshot::PolicySnapshot;
use crate::crd::cache_backend::CacheBackend;
use crate::crd::cache_policy::CachePolicy;
use crate::crd::cache_tenant::CacheTenant;
use crate::crd::inference_pool::InferencePool;
use crate::crd::objects::PolicyObjects;
use crate::crd::pd_topology::PDTopology;
use crate::crd::prompt_template::PromptTemplate;

/// How long the watches must be quiet before a rebuild (a rollout or a
/// `kubectl apply -f dir/` is many events; one snapshot follows them).
pub const DEFAULT_DEBOUNCE: Duration = Duration::from_millis(100);

/// What the last rebuild saw: the objects and what `resolve` made of them.
#[derive(Clone, Debug, Default)]
pub struct Observed {
    /// The cluster's own routing objects (a policy file's are not here).
    pub objects: PolicyObjects,
    pub templates: Vec<Arc<PromptTemplate>>,
    pub topologies: Vec<Arc<PDTopology>>,
    pub verdicts: Verdicts,
    /// Revision of the snapshot built from these objects.
    pub revision: String,
}

/// The reflector stores.
#[derive(Clone)]
struct Stores {
    policies: Store<CachePolicy>,
    tenants: Store<CacheTenant>,
    backends: Store<CacheBackend>,
    pods: Store<Pod>,
    templates: Store<PromptTemplate>,
    topologies: Store<PDTopology>,
    pools: Store<InferencePool>,
}

/// Whether the InferencePools can be used: listed once, or why not yet.
#[derive(Clone, Debug, Default)]
struct PoolWatch {
    listed: bool,
    /// The last watch error before the first list (the CRD missing, RBAC).
    failing: Option<String>,
}

impl PoolWatch {
    /// The pools as resolution sees them.
    fn pools<'a>(&'a self, listed: &'a [InferencePool]) -> Pools<'a> {
        match (&self.listed, &self.failing) {
            (true, _) => Pools::Listed(listed),
            (false, Some(why)) => Pools::Unavailable(why),
            (false, None) => Pools::Unavailable("not listed yet"),
        }
    }

    /// Whether the first snapshot may be built: the pools are known, or known
    /// to be unreadable (a missing GIE CRD never holds the policy back).
    fn settled(&self) -> bool {
        self.listed || self.failing.is_some()
    }
}

/// Why the InferencePools cannot be read, in words for a condition message: the
/// apiserver's answer without the client's debug dump (a missing CRD answers a
/// plain-text 404 that the client wraps in a synthetic `Status`).
fn pool_watch_problem(e: &watcher::Error) -> String {
    let api = match e {
        watcher::Error::InitialListFailed(kube::Error::Api(s))
        | watcher::Error::WatchStartFailed(kube::Error::Api(s))
        | watcher::Error::WatchFailed(kube::Error::Api(s)) => Some(s.as_ref()),
        watcher::Error::WatchError(s) => Some(s.as_ref()),
        _ => None,
    };
    match api {
        Some(s) if s.code == 404 => {
            "the InferencePool CRD (inferencepools.inference.networking.k8s.io, \
             v1) is not installed"
                .to_string()
        }
        Some(s) if s.code == 403 => format!(
            "listing inferencepools is forbidden ({}); the ClusterRole needs get/list/watch on \
             inferencepools.inference.networking.k8s.io",
            s.message
        ),
        Some(s) => format!(
            "the InferencePool watch fails: {} {}: {}",
            s.code, s.reason, s.message
        ),
        None => format!("the InferencePool watch fails: {e}"),
    }
}

/// Which watch an event came from; the first four make up the routing policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Source {
    Policies = 0,
    Tenants = 1,
    Backends = 2,
    Pods = 3,
    Templates = 4,
    Topologies = 5,
    Pools = 6,
}

/// A store event reduced to what the rebuild loop needs.
enum Signal {
    /// Something changed (or a relist finished).
    Changed {
        listed: bool,
    },
    Failed(watcher::Error),
}

type Signals = Pin<Box<dyn Stream<Item = (Source, Signal)> + Send>>;

fn watch_kind<K>(client: &Client, source: Source, trim: fn(&mut K)) -> (Store<K>, Signals)
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
{
    let (store, writer) = reflector::store();
    let stream = watcher::watcher(Api::<K>::all(client.clone()), watcher::Config::default())
        .default_backoff()
        .modify(trim);
    let signals = reflector::reflector(writer, stream).map(move |event| {
        let signal = match event {
            Ok(Event::InitDone) => Signal::Changed { listed: true },
            Ok(_) => Signal::Changed { listed: false },
            Err(e) => Signal::Failed(e),
        };
        (source, signal)
    });
    (store, signals.boxed())
}

/// Managed fields are large and never read.
fn trim_meta<K: Resource>(k: &mut K) {
    k.meta_mut().managed_fields = None;
}

/// A pod is only read for its namespace, name, labels, IP, Ready condition and
/// GIE's active-ports annotation.
fn trim_pod(p: &mut Pod) {
    p.metadata.managed_fields = None;
    if let Some(a) = p.metadata.annotations.as_mut() {
        a.retain(|k, _| k == ACTIVE_PORTS_ANNOTATION);
        if a.is_empty() {
            p.metadata.annotations = None;
        }
    }
    p.spec = None;
    if let Some(s) = p.status.as_mut() {
        s.container_statuses = None;
        s.init_container_statuses = None;
        s.ephemeral_container_statuses = None;
    }
}

/// Runs the watches until they end (never, unless the client is gone), calling
/// `install` with each new snapshot and publishing what was observed.
///
/// `file` carries the objects of a policy file given with `--config` as well
/// (empty otherwise): they are resolved together with the cluster's, and where
/// both define a namespace's policy or tenant, the cluster's (dated) object is
/// the older one and wins.
pub async fn run(
    client: Client,
    debounce: Duration,
    mut install: impl FnMut(PolicySnapshot) + Send,
    observed: latest::Sender<Arc<Observed>>,
    mut file: latest::Receiver<Arc<PolicyObjects>>,
) {
    let (policies, s0) = watch_kind(&client, Source::Policies, trim_meta::<CachePolicy>);
    let (tenants, s1) = watch_kind(&client, Source::Tenants, trim_meta::<CacheTenant>);
    let (backends, s2) = watch_kind(&client, Source::Backends, trim_meta::<CacheBackend>);
    let (pods, s3) = watch_kind(&client, Source::Pods, trim_pod);
    let (templates, s4) = watch_kind(&client, Source::Templates, trim_meta::<PromptTemplate>);
    let (topologies, s5) = watch_kind(&client, Source::Topologies, trim_meta::<PDTopology>);
    let (pools, s6) = watch_kind(&client, Source::Pools, trim_meta::<InferencePool>);
    let stores = Stores {
        policies,
        tenants,
        backends,
        pods,
        templates,
        topologies,
        pools,
    };
    let mut signals = futures::stream::select_all([s0, s1, s2, s3, s4, s5, s6]);

    let mut file_open = true;
    let mut listed = [false; 7];
    let mut pool_watch = PoolWatch::default();
    let mut dirty_since: Option<tokio::time::Instant> = None;
    let mut last_revision: Option<String> = None;
    let mut last_problems: Vec<String> = Vec::new();
    loop {
        // The policy is complete once the four routing kinds were listed; the
        // status-only kinds (whose CRDs may be missing) never hold it back.
        let ready = listed[..4].iter().all(|l| *l) && pool_watch.settled();
        let due = dirty_since.filter(|_| ready).map(|t| t + debounce);
        tokio::select! {
            next = signals.next() => match next {
                None => return,
                Some((source, Signal::Changed { listed: done })) => {
                    if done {
                        listed[source as usize] = true;
                        if source == Source::Pools && !pool_watch.listed {
                            pool_watch = PoolWatch { listed: true, failing: None };
                            tracing::info!("InferencePools listed");
                        }
                    }
                    // Debounce from the latest event: wait for a quiet period.
                    dirty_since = Some(tokio::time::Instant::now());
                }
                Some((Source::Pools, Signal::Failed(e))) => {
                    let why = pool_watch_problem(&e);
                    if !pool_watch.listed && pool_watch.failing.as_deref() != Some(why.as_str()) {
                        tracing::warn!(
                            error = %e,
                            "InferencePool watch failed (GIE CRD not installed, or RBAC); \
                             CacheBackends with inferencePoolRef get no replicas until the \
                             pools list; retrying"
                        );
                        pool_watch.failing = Some(why);
                        dirty_since = Some(tokio::time::Instant::now());
                    } else {
                        tracing::debug!(error = %e, "InferencePool watch failed; retrying");
                    }
                }
                Some((source, Signal::Failed(e))) => {
                    tracing::warn!(?source, error = %e, "kubernetes watch failed; retrying");
                }
            },
            changed = file_changed(&mut file, file_open) => match changed {
                true => dirty_since = Some(tokio::time::Instant::now()),
                // The file source is gone: keep its last objects, stop listening.
                false => file_open = false,
            },
            () = sleep_until(due) => {
                dirty_since = None;
                let extra = file.borrow().clone();
                let (snapshot, seen) = rebuild(&stores, &pool_watch, &extra);
                let problems: Vec<String> = seen
                    .verdicts
                    .rejected
                    .iter()
                    .map(ToString::to_string)
                    .chain(seen.verdicts.ignored.iter().map(ToString::to_string))
                    .chain(seen.verdicts.pool_bindings.iter().filter_map(|b| {
                        let problem = b.outcome.as_ref().err()?;
                        Some(format!(
                            "CacheBackend {}/{}: no replicas: {}",
                            b.namespace, b.backend, problem.message
                        ))
                    }))
                    .collect();
                if problems != last_problems {
                    for p in &problems {
                        tracing::warn!(problem = %p, "kubernetes policy object left out");
                    }
                    last_problems = problems;
                }
                if last_revision.as_deref() != Some(seen.revision.as_str()) {
                    tracing::info!(revision = %seen.revision, "kubernetes policy installed");
                    last_revision = Some(seen.revision.clone());
                    install(snapshot);
                }
                observed.send_replace(Arc::new(seen));
            }
        }
    }
}

/// Kubernetes mode: hands `apply` the CacheBackends in effect, the cluster's and
/// the policy file's, after every rebuild (the engine-side adapters follow them:
/// metrics scrapers, tokenizers). Ends when the watches do.
pub async fn follow_backends(
    mut observed: latest::Receiver<Arc<Observed>>,
    file: latest::Receiver<Arc<PolicyObjects>>,
    apply: impl Fn(&[&CacheBackend]),
) {
    loop {
        {
            let o = observed.borrow_and_update().clone();
            let f = file.borrow().clone();
            let backends: Vec<&CacheBackend> = o.objects.backends_with(&f).collect();
            apply(&backends);
        }
        if observed.changed().await.is_err() {
            return;
        }
    }
}

/// Whether the file source sent new objects; never resolves once it is closed.
async fn file_changed(file: &mut latest::Receiver<Arc<PolicyObjects>>, open: bool) -> bool {
    if !open {
        std::future::pending::<()>().await;
    }
    file.changed().await.is_ok()
}

async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

fn owned<K: Clone>(v: &[Arc<K>]) -> Vec<K> {
    v.iter().map(|o| (**o).clone()).collect()
}

/// One snapshot from the stores as they are now.
fn rebuild(
    stores: &Stores,
    pool_watch: &PoolWatch,
    file: &PolicyObjects,
) -> (PolicySnapshot, Observed) {
    let policies = stores.policies.state();
    let tenants = stores.tenants.state();
    let backends = stores.backends.state();
    let mut policy_objs: Vec<CachePolicy> = owned(&policies);
    let mut tenant_objs: Vec<CacheTenant> = owned(&tenants);
    let mut backend_objs: Vec<CacheBackend> = owned(&backends);
    policy_objs.extend(owned(&file.policies));
    tenant_objs.extend(owned(&file.tenants));
    backend_objs.extend(owned(&file.backends));
    // Only pods of namespaces with a selector or pool backend can be replicas.
    let selecting: std::collections::HashSet<&str> = backend_objs
        .iter()
        .filter(|b| b.spec.selector.is_some() || b.spec.inference_pool_ref.is_some())
        .map(|b| b.metadata.namespace.as_deref().unwrap_or(DEFAULT_NAMESPACE))
        .collect();
    let pods: Vec<Pod> = stores
        .pods
        .state()
        .iter()
        .filter(|p| {
            selecting.contains(p.metadata.namespace.as_deref().unwrap_or(DEFAULT_NAMESPACE))
        })
        .map(|p| (**p).clone())
        .collect();
    let pool_objs: Vec<InferencePool> = owned(&stores.pools.state());
    let cluster = Cluster {
        pods: &pods,
        pools: pool_watch.pools(&pool_objs),
    };
    let resolution = resolve_in_cluster(&policy_objs, &tenant_objs, &backend_objs, &cluster);
    let observed = Observed {
        objects: PolicyObjects {
            policies,
            tenants,
            backends,
        },
        templates: stores.templates.state(),
        topologies: stores.topologies.state(),
        verdicts: Verdicts {
            ignored: resolution.ignored,
            rejected: resolution.rejected,
            pool_bindings: resolution.pool_bindings,
        },
        revision: resolution.snapshot.revision().to_string(),
    };
    (resolution.snapshot, observed)
}

#[cfg(test)]
mod tests;
