//! The tokenizers of all backends: one [`ModelTokenizer`] per directory, shared
//! by every backend that names it, loaded off the request path and reloaded when
//! the directory's files change (size or modification time of `tokenizer.json`,
//! `tokenizer_config.json`, `chat_template.jinja`, polled).
//!
//! A directory that cannot be loaded is kept as its error: body requests for its
//! backends fall back (fail-open) and `/readyz` and `/policy` show the error. A
//! reload that fails keeps nothing of the old tokenizer: the files on disk are
//! what the engine uses too, so an old tokenizer could route on wrong ids.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use parking_lot::RwLock;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

use super::segment_cache::CacheStats;
use super::tokenizer::{CHAT_TEMPLATE_JINJA, ModelTokenizer, TOKENIZER_CONFIG, TOKENIZER_JSON};
use crate::adapters::resolve::DEFAULT_NAMESPACE;
use crate::crd::cache_backend::CacheBackend;

/// How often the tokenizer directories are checked for changes.
pub const DEFAULT_POLL: Duration = Duration::from_secs(5);

/// (namespace, name) of a CacheBackend.
pub type BackendKey = (String, String);

/// What a backend's tokenizer is, for a request.
#[derive(Clone, Debug)]
pub enum TokenizerState {
    Ready(Arc<ModelTokenizer>),
    /// The backend has no `spec.tokenizer`.
    NotConfigured,
    /// Configured, not loaded yet (the first load runs in the background).
    Loading,
    Broken(String),
}

/// Sizes and modification times of a directory's tokenizer files.
type Fingerprint = Vec<Option<(u64, SystemTime)>>;

#[derive(Debug)]
struct Entry {
    fingerprint: Fingerprint,
    loaded: Result<Arc<ModelTokenizer>, String>,
}

#[derive(Debug, Default)]
struct State {
    paths: Arc<BTreeMap<BackendKey, PathBuf>>,
    dirs: HashMap<PathBuf, Entry>,
}

/// Every backend's tokenizer; see the module docs.
#[derive(Debug, Default)]
pub struct TokenizerStore {
    state: RwLock<State>,
    changed: tokio::sync::Notify,
}

impl TokenizerStore {
    /// Takes the `spec.tokenizer.path` of `backends` (the policy source's current
    /// objects). Directories no backend names any more are dropped; new ones are
    /// loaded by the next [`refresh`](Self::refresh).
    pub fn set<'a>(&self, backends: impl IntoIterator<Item = &'a CacheBackend>) {
        let paths: BTreeMap<BackendKey, PathBuf> = backends
            .into_iter()
            .filter_map(|b| {
                let path = b.spec.tokenizer.as_ref()?.path.clone();
                let ns = b.metadata.namespace.clone();
                let ns = ns.unwrap_or_else(|| DEFAULT_NAMESPACE.to_string());
                Some((
                    (ns, b.metadata.name.clone().unwrap_or_default()),
                    PathBuf::from(path),
                ))
            })
            .collect();
        let mut state = self.state.write();
        if *state.paths == paths {
            return;
        }
        state.dirs.retain(|dir, _| paths.values().any(|p| p == dir));
        state.paths = Arc::new(paths);
        drop(state);
        self.changed.notify_one();
    }

    /// Whether any backend is configured for body mode.
    pub fn any_configured(&self) -> bool {
        !self.state.read().paths.is_empty()
    }

    /// The tokenizer of one backend.
    pub fn get(&self, namespace: &str, name: &str) -> TokenizerState {
        let state = self.state.read();
        let Some(dir) = state.paths.get(&(namespace.to_string(), name.to_string())) else {
            return TokenizerState::NotConfigured;
        };
        match state.dirs.get(dir).map(|e| &e.loaded) {
            None => TokenizerState::Loading,
            Some(Ok(t)) => TokenizerState::Ready(t.clone()),
            Some(Err(e)) => TokenizerState::Broken(e.clone()),
        }
    }

    /// Loads new directories and reloads changed ones. Blocking (reads and parses
    /// files of several MB): call it from `spawn_blocking` or at start.
    pub fn refresh(&self) {
        let paths = self.state.read().paths.clone();
        let mut dirs: Vec<&PathBuf> = paths.values().collect();
        dirs.sort();
        dirs.dedup();
        for dir in dirs {
            let fingerprint = fingerprint(dir);
            let current = self
                .state
                .read()
                .dirs
                .get(dir)
                .map(|e| e.fingerprint.clone());
            if current.as_ref() == Some(&fingerprint) {
                continue;
            }
            let loaded = ModelTokenizer::load(dir).map(Arc::new);
            match &loaded {
                Ok(_) => {
                    tracing::info!(dir = %dir.display(), reload = current.is_some(), "tokenizer loaded")
                }
                Err(e) => tracing::warn!(dir = %dir.display(), error = %e, "tokenizer not loaded"),
            }
            let mut state = self.state.write();
            // The paths may have changed meanwhile; keep only what is still named.
            if state.paths.values().any(|p| p == dir) {
                state.dirs.insert(
                    dir.clone(),
                    Entry {
                        fingerprint,
                        loaded,
                    },
                );
            }
        }
    }

    /// Configuration errors, one line per backend whose tokenizer is broken (for
    /// `/readyz` and `/policy`).
    pub fn problems(&self) -> Vec<String> {
        let state = self.state.read();
        state
            .paths
            .iter()
            .filter_map(|((ns, name), dir)| match state.dirs.get(dir) {
                Some(Entry { loaded: Err(e), .. }) => Some(format!(
                    "CacheBackend {ns}/{name}: spec.tokenizer.path {}: {e}",
                    dir.display()
                )),
                _ => None,
            })
            .collect()
    }

    /// Per backend: its path and state (`ready`, `loading`, or the error).
    pub fn describe(&self) -> Vec<(BackendKey, PathBuf, Result<&'static str, String>)> {
        let state = self.state.read();
        state
            .paths
            .iter()
            .map(|(key, dir)| {
                let s = match state.dirs.get(dir).map(|e| &e.loaded) {
                    None => Ok("loading"),
                    Some(Ok(_)) => Ok("ready"),
                    Some(Err(e)) => Err(e.clone()),
                };
                (key.clone(), dir.clone(), s)
            })
            .collect()
    }

    /// Keeps the tokenizers current: refreshes at once when the paths change and
    /// every `poll` otherwise, off the async workers. Runs until aborted.
    pub async fn follow(self: Arc<Self>, poll: Duration) {
        loop {
            let store = self.clone();
            if let Err(e) = tokio::task::spawn_blocking(move || store.refresh()).await {
                tracing::error!(error = %e, "tokenizer refresh failed");
            }
            tokio::select! {
                () = tokio::time::sleep(poll) => {}
                () = self.changed.notified() => {}
            }
        }
    }
}

impl TokenizerStore {
    /// The segment caches of every loaded tokenizer, added up (tokenizers whose
    /// files do not allow an exact cache count nothing).
    pub fn cache_stats(&self) -> CacheStats {
        let state = self.state.read();
        let mut total = CacheStats::default();
        for s in state
            .dirs
            .values()
            .filter_map(|e| e.loaded.as_ref().ok()?.cache_stats().ok())
        {
            total.hits += s.hits;
            total.misses += s.misses;
            total.entries += s.entries;
            total.bytes += s.bytes;
        }
        total
    }
}

/// `/metrics`: the tokenizers' segment caches (read at scrape time).
#[derive(Debug)]
pub struct CacheCollector(pub Arc<TokenizerStore>);

impl Collector for CacheCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        #[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
        struct ResultLabels {
            result: &'static str,
        }
        let s = self.0.cache_stats();
        let mut family = encoder.encode_descriptor(
            "body_tokenizer_cache_lookups",
            "Body mode's tokenizer segment-cache lookups (text between special tokens), by result",
            None,
            MetricType::Counter,
        )?;
        for (result, n) in [("hit", s.hits), ("miss", s.misses)] {
            ConstCounter::new(n).encode(family.encode_family(&ResultLabels { result })?)?;
        }
        let family = encoder.encode_descriptor(
            "body_tokenizer_cache_bytes",
            "Bytes held by body mode's tokenizer segment caches (text, ids, overhead)",
            None,
            MetricType::Gauge,
        )?;
        ConstGauge::new(s.bytes as i64).encode(family)?;
        Ok(())
    }
}

fn fingerprint(dir: &Path) -> Fingerprint {
    [TOKENIZER_JSON, TOKENIZER_CONFIG, CHAT_TEMPLATE_JINJA]
        .iter()
        .map(|f| {
            let m = std::fs::metadata(dir.join(f)).ok()?;
            Some((m.len(), m.modified().ok()?))
        })
        .collect()
}
