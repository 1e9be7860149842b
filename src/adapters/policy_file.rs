//! The standalone policy source (docs/reference.md, "File mode"): CachePolicy, CacheTenant and
//! CacheBackend objects in a YAML file or a directory of `*.yaml`/`*.yml` files are
//! a complete configuration, reloaded when they change.
//!
//! ```text
//!  read_sources ──▶ document::parse_file (per file, every document) ──▶ resolve ──▶ PolicySnapshot
//!        ▲                                                                              │
//!        └────────── watch::watch polls a content hash, keeps the last good ◀───────────┘
//! ```
//!
//! A load is all or nothing: any problem in any document fails it with every
//! problem listed (file, document, object, field), and the caller keeps what it
//! had. Duplicate objects, rejected objects and cross-object conflicts are
//! problems too; objects that lose "oldest in the namespace" are only logged.

mod document;
mod watch;

use std::collections::HashMap;
use std::fmt;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use thiserror::Error;

use crate::adapters::resolve::{Ignored, resolve};
use crate::core::snapshot::PolicySnapshot;
use crate::crd::objects::PolicyObjects;

pub use document::{Object, Origin};
pub use watch::{SourceStatus, watch, watch_loaded};

/// One configuration file, read whole.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Source {
    pub path: PathBuf,
    pub text: String,
}

/// A successfully loaded configuration.
#[derive(Debug)]
pub struct Loaded {
    pub snapshot: PolicySnapshot,
    /// Objects that are valid but not effective (a sibling is older).
    pub ignored: Vec<Ignored>,
    /// The routing objects themselves, for `serve --config --kubernetes`, where
    /// they are resolved together with the cluster's.
    pub objects: PolicyObjects,
}

/// Why a load failed: every problem found, one per line.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub struct LoadError {
    pub problems: Vec<String>,
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.problems.join("\n"))
    }
}

impl LoadError {
    fn one(problem: String) -> Self {
        Self {
            problems: vec![problem],
        }
    }
}

/// Reads and resolves the configuration at `path` (a file, or a directory whose
/// `*.yaml`/`*.yml` files are read in name order).
pub fn load(path: &Path) -> Result<Loaded, LoadError> {
    let sources =
        read_sources(path).map_err(|e| LoadError::one(format!("{}: {e}", path.display())))?;
    parse(&sources)
}

/// The files of the configuration, read whole, in name order.
pub fn read_sources(path: &Path) -> io::Result<Vec<Source>> {
    let files = if path.is_dir() {
        let mut files = Vec::new();
        for entry in std::fs::read_dir(path)? {
            let p = entry?.path();
            let is_yaml = p
                .extension()
                .and_then(|e| e.to_str())
                .is_some_and(|e| e == "yaml" || e == "yml");
            if is_yaml && p.is_file() {
                files.push(p);
            }
        }
        files.sort();
        if files.is_empty() {
            // Like an empty file: nothing to route by, so never a good load.
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                "no *.yaml or *.yml files in the directory",
            ));
        }
        files
    } else {
        vec![path.to_path_buf()]
    };
    files
        .into_iter()
        .map(|p| {
            let text = std::fs::read_to_string(&p)
                .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", p.display())))?;
            Ok(Source { path: p, text })
        })
        .collect()
}

/// A fingerprint of the configuration's names and contents.
pub fn fingerprint(sources: &[Source]) -> u64 {
    let mut h = DefaultHasher::new();
    sources.hash(&mut h);
    h.finish()
}

/// Parses and resolves already-read sources.
pub fn parse(sources: &[Source]) -> Result<Loaded, LoadError> {
    let mut problems = Vec::new();
    let mut objects = Vec::new();
    for s in sources {
        objects.extend(document::parse_file(&s.path, &s.text, &mut problems));
    }

    let mut seen: HashMap<String, &Origin> = HashMap::new();
    let (mut policies, mut tenants, mut backends) = (Vec::new(), Vec::new(), Vec::new());
    for (origin, object) in &objects {
        if let Some(first) = seen.insert(origin.object(), origin) {
            problems.push(format!(
                "{}: document {}: {}: duplicate of {} document {}",
                origin.file,
                origin.document,
                origin.object(),
                first.file,
                first.document
            ));
            continue;
        }
        match object {
            Object::CachePolicy(p) => policies.push(p.clone()),
            Object::CacheTenant(t) => tenants.push(t.clone()),
            Object::CacheBackend(b) => backends.push(b.clone()),
            Object::PromptTemplate(_) | Object::PdTopology(_) => {}
        }
    }
    if !problems.is_empty() {
        return Err(LoadError { problems });
    }

    let resolution = resolve(&policies, &tenants, &backends);
    for r in &resolution.rejected {
        let key = format!("{} {}/{}", r.kind, r.namespace, r.name);
        let at = seen
            .get(&key)
            .map(|o| format!("{}: document {}: ", o.file, o.document))
            .unwrap_or_default();
        problems.push(format!("{at}{r}"));
    }
    if !problems.is_empty() {
        return Err(LoadError { problems });
    }
    for i in &resolution.ignored {
        tracing::warn!(target: "inferencecache::policy_file", "{i}");
    }
    Ok(Loaded {
        snapshot: resolution.snapshot,
        ignored: resolution.ignored,
        objects: PolicyObjects {
            policies: policies.into_iter().map(Arc::new).collect(),
            tenants: tenants.into_iter().map(Arc::new).collect(),
            backends: backends.into_iter().map(Arc::new).collect(),
        },
    })
}

#[cfg(test)]
mod tests;
