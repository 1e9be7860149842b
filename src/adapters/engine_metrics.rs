//! Engine Prometheus metrics (vLLM, SGLang) → the load rule's engine queue: the
//! scraper adapter.
//!
//! ```text
//!  CacheBackend spec.metrics ─▶ Specs (per backend, set by the policy source)
//!  installed PolicySnapshot ─┴─▶ Scrapers::sync ─▶ one Scraper task per replica
//!  Scraper: GET http://host:port/metrics every interval (short timeout)
//!        ──text──▶ parse (strict line parser, the three gauges of spec.engine)
//!        ──EngineSample──▶ Router::report_stats (waiting + running, KV usage)
//! ```
//!
//! A failed or unparsable scrape changes nothing and is counted; the last good
//! sample keeps its scrape time, so the core stops trusting it once it is older
//! than the policy's `loadBalancing.statsMaxAge`.

pub mod metrics;
pub mod parse;
pub mod scraper;
pub mod supervisor;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::RwLock;

use crate::core::policy::parse_duration;
use crate::core::scope::ScopeKey;
use crate::core::snapshot::PolicySnapshot;
use crate::crd::cache_backend::{CacheBackend, CacheBackendSpec};

/// `spec.metrics.path` when unset.
pub const DEFAULT_PATH: &str = "/metrics";
/// `spec.metrics.interval` when unset. Several sidecars see each other's
/// requests only through the engines' counts, so the shorter the interval the
/// less they herd between two scrapes (at 1 s they visibly move conversations
/// back and forth); the cost is one small HTTP request per engine per interval.
/// GIE's endpoint picker refreshes every 50 ms.
pub const DEFAULT_INTERVAL: Duration = Duration::from_millis(250);
/// The shortest and longest intervals accepted.
pub const MIN_INTERVAL: Duration = Duration::from_millis(100);
pub const MAX_INTERVAL: Duration = Duration::from_secs(60);
/// A scrape gives up after this long (or the interval, if shorter).
pub const MAX_TIMEOUT: Duration = Duration::from_secs(1);

/// Which metric names to read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EngineKind {
    Vllm,
    Sglang,
}

impl EngineKind {
    /// From `BackendDecl::engine` (the CRD's spelling).
    pub fn from_decl(engine: &str) -> Option<Self> {
        match engine {
            "vLLM" => Some(Self::Vllm),
            "SGLang" => Some(Self::Sglang),
            _ => None,
        }
    }
}

/// `spec.metrics` of one backend, checked and defaulted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackendMetrics {
    pub enabled: bool,
    /// `None`: each replica's own port.
    pub port: Option<u16>,
    pub path: String,
    pub interval: Duration,
    /// Static endpoints' `metricsEndpoint` overrides, by replica id.
    pub endpoints: HashMap<String, String>,
}

impl Default for BackendMetrics {
    fn default() -> Self {
        Self {
            enabled: true,
            port: None,
            path: DEFAULT_PATH.to_string(),
            interval: DEFAULT_INTERVAL,
            endpoints: HashMap::new(),
        }
    }
}

/// One invalid field: (dotted path, reason).
pub type FieldError = (String, String);

/// Checks and defaults `spec.metrics` and the endpoints' `metricsEndpoint`.
pub fn backend_metrics(spec: &CacheBackendSpec) -> Result<BackendMetrics, Vec<FieldError>> {
    let mut errors = Vec::new();
    let mut out = BackendMetrics::default();
    if let Some(m) = &spec.metrics {
        out.enabled = m.enabled.unwrap_or(true);
        if let Some(p) = m.port {
            match u16::try_from(p).ok().filter(|p| *p > 0) {
                Some(p) => out.port = Some(p),
                None => errors.push((
                    "spec.metrics.port".into(),
                    format!("{p} is not a port (1-65535)"),
                )),
            }
        }
        if let Some(path) = &m.path {
            if !path.starts_with('/') || path.chars().any(|c| c.is_whitespace() || c.is_control()) {
                errors.push((
                    "spec.metrics.path".into(),
                    format!("{path:?} must start with '/' and contain no spaces"),
                ));
            } else {
                out.path = path.clone();
            }
        }
        if let Some(i) = &m.interval {
            match parse_duration(i) {
                Ok(d) if (MIN_INTERVAL..=MAX_INTERVAL).contains(&d) => out.interval = d,
                Ok(_) => errors.push((
                    "spec.metrics.interval".into(),
                    format!("{i:?} is outside 100ms..60s"),
                )),
                Err(e) => errors.push(("spec.metrics.interval".into(), e.to_string())),
            }
        }
    }
    for (i, ep) in spec.endpoints.iter().enumerate() {
        if let Some(url) = &ep.metrics_endpoint {
            if url_ok(url) {
                out.endpoints.insert(ep.id.clone(), url.clone());
            } else {
                errors.push((
                    format!("spec.endpoints[{i}].metricsEndpoint"),
                    format!("{url:?} is not an http://host:port/path URL"),
                ));
            }
        }
    }
    if errors.is_empty() {
        Ok(out)
    } else {
        Err(errors)
    }
}

/// An `http://` URL with an authority that hyper can request.
fn url_ok(url: &str) -> bool {
    url.starts_with("http://")
        && url
            .parse::<hyper::Uri>()
            .is_ok_and(|u| u.authority().is_some_and(|a| !a.host().is_empty()))
}

/// Everything one scraper needs; any change means a new scraper.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ScrapeConfig {
    pub scope: ScopeKey,
    pub replica_id: String,
    /// `http://host:port/path`.
    pub url: String,
    pub engine: EngineKind,
    pub interval: Duration,
    pub timeout: Duration,
}

/// The checked `spec.metrics` of every backend, keyed by (namespace, name), as
/// the policy source last saw them. Kept beside the core's snapshot (which has
/// no metrics fields); a backend missing here scrapes with the defaults.
#[derive(Debug, Default)]
pub struct Specs {
    map: RwLock<Arc<HashMap<(String, String), BackendMetrics>>>,
    generation: AtomicU64,
}

impl Specs {
    /// Replaces the specs with those of `backends`; an invalid spec (which the
    /// resolver rejects, so its backend is not in the snapshot) is left out.
    pub fn set<'a>(&self, backends: impl IntoIterator<Item = &'a CacheBackend>) {
        let map: HashMap<_, _> = backends
            .into_iter()
            .filter_map(|b| {
                let ns = b
                    .metadata
                    .namespace
                    .clone()
                    .unwrap_or_else(|| crate::adapters::resolve::DEFAULT_NAMESPACE.to_string());
                let name = b.metadata.name.clone().unwrap_or_default();
                backend_metrics(&b.spec).ok().map(|m| ((ns, name), m))
            })
            .collect();
        let mut current = self.map.write();
        if **current != map {
            *current = Arc::new(map);
            self.generation.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Bumped on every change, so followers re-sync.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Relaxed)
    }

    fn get(&self) -> Arc<HashMap<(String, String), BackendMetrics>> {
        self.map.read().clone()
    }

    /// What `snapshot` asks for: one scraper per declared replica of a backend
    /// whose scraping is on.
    pub fn wanted(&self, snapshot: &PolicySnapshot) -> Vec<ScrapeConfig> {
        let specs = self.get();
        let default = BackendMetrics::default();
        let mut out = Vec::new();
        for backend in snapshot.backends() {
            let Some(engine) = EngineKind::from_decl(&backend.engine) else {
                continue;
            };
            let m = specs
                .get(&(backend.namespace.clone(), backend.name.clone()))
                .unwrap_or(&default);
            if !m.enabled {
                continue;
            }
            for r in &backend.replicas {
                let url = match m.endpoints.get(&r.id) {
                    Some(url) => url.clone(),
                    None => match url_for(&r.address, m.port, &m.path) {
                        Some(url) => url,
                        None => continue,
                    },
                };
                out.push(ScrapeConfig {
                    scope: backend.scope.clone(),
                    replica_id: r.id.clone(),
                    url,
                    engine,
                    interval: m.interval,
                    timeout: m.interval.min(MAX_TIMEOUT),
                });
            }
        }
        out
    }
}

/// `http://host:port/path` from a replica's `host:port` address.
fn url_for(address: &str, port: Option<u16>, path: &str) -> Option<String> {
    let (host, own) = address.rsplit_once(':')?;
    let own = own.parse::<u16>().ok().filter(|p| *p > 0)?;
    if host.is_empty() {
        return None;
    }
    Some(format!("http://{host}:{}{path}", port.unwrap_or(own)))
}

#[cfg(test)]
mod tests;
