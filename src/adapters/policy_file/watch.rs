//! Polling reload of the policy files, and the source's health for `/readyz`,
//! `/policy` and metrics.
//!
//! Polling a content fingerprint (not mtimes, not inotify) works the same on every
//! filesystem, including ConfigMap volumes whose files are swapped through
//! symlinks. A failed reload never reaches the router: the last good snapshot
//! stays installed, and the error is recorded here until a later reload succeeds.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;

use super::{LoadError, Loaded, fingerprint, parse, read_sources};
use crate::core::snapshot::PolicySnapshot;
use crate::core::time::Timestamp;

/// The file source's health. Shared between the watcher and the serving adapters.
#[derive(Debug, Default)]
pub struct SourceStatus {
    reload_ok: AtomicU64,
    reload_errors: AtomicU64,
    // One lock for the strings so a reader never sees a revision from one reload
    // with the time of another; held only for a copy.
    state: Mutex<State>,
}

#[derive(Debug, Default, Clone)]
struct State {
    last_error: Option<String>,
    last_good_revision: Option<Arc<str>>,
    loaded_at: Option<Timestamp>,
}

impl SourceStatus {
    pub fn new() -> Self {
        Self::default()
    }

    /// Records a successful load of the snapshot with `revision`.
    pub fn record_success(&self, revision: Arc<str>, at: Timestamp) {
        self.reload_ok.fetch_add(1, Ordering::Relaxed);
        let mut s = self.state.lock();
        s.last_error = None;
        s.last_good_revision = Some(revision);
        s.loaded_at = Some(at);
    }

    /// Records a failed load; the last good snapshot stays in place.
    pub fn record_error(&self, error: String) {
        self.reload_errors.fetch_add(1, Ordering::Relaxed);
        self.state.lock().last_error = Some(error);
    }

    /// The error of the latest load if it failed; cleared by a successful load.
    pub fn last_error(&self) -> Option<String> {
        self.state.lock().last_error.clone()
    }

    pub fn reload_ok_count(&self) -> u64 {
        self.reload_ok.load(Ordering::Relaxed)
    }

    pub fn reload_error_count(&self) -> u64 {
        self.reload_errors.load(Ordering::Relaxed)
    }

    /// Revision of the snapshot currently in force from this source.
    pub fn last_good_revision(&self) -> Option<Arc<str>> {
        self.state.lock().last_good_revision.clone()
    }

    /// When the snapshot in force was loaded.
    pub fn loaded_at(&self) -> Option<Timestamp> {
        self.state.lock().loaded_at
    }
}

/// Polls `path` every `interval`; on a change reloads it. A good load is handed
/// to `on_snapshot` and recorded in `status`; a bad one leaves the last good
/// snapshot in place and is recorded in `status`.
pub async fn watch(
    path: PathBuf,
    interval: Duration,
    on_snapshot: impl Fn(PolicySnapshot) + Send + Sync + 'static,
    status: Arc<SourceStatus>,
) {
    let recorder = status.clone();
    let on_load = move |l: Loaded| {
        let revision = l.snapshot.revision().clone();
        on_snapshot(l.snapshot);
        recorder.record_success(revision, Timestamp::now());
    };
    watch_loaded(path, interval, on_load, status).await;
}

/// [`watch`], handing over the whole [`Loaded`] (objects included). Only errors
/// are recorded in `status`: what a good load means is the caller's to record
/// (with `--kubernetes` as well, only the combined snapshot counts).
pub async fn watch_loaded(
    path: PathBuf,
    interval: Duration,
    on_load: impl Fn(Loaded) + Send + Sync + 'static,
    status: Arc<SourceStatus>,
) {
    let mut last: Option<u64> = None;
    loop {
        let p = path.clone();
        let seen = last;
        let polled =
            tokio::task::spawn_blocking(move || poll(&p, seen, || std::thread::sleep(SETTLE)))
                .await;
        match polled {
            Ok(Some((fp, outcome))) => {
                last = Some(fp);
                apply(outcome, &on_load, &status);
            }
            Ok(None) => {}
            Err(e) => status.record_error(format!("policy reload task failed: {e}")),
        }
        tokio::time::sleep(interval).await;
    }
}

/// How long a changed configuration must stay unchanged before it is parsed.
/// Writers truncate and then write, so a poll can catch a file empty or half
/// written; a valid prefix of a multi-document file (or an empty file in a
/// directory) would otherwise load as a smaller, wrong policy.
pub(super) const SETTLE: Duration = Duration::from_millis(50);

/// Reads the files; when their fingerprint differs from `seen` and a second read
/// after `settle` (waiting [`SETTLE`]) agrees, parses them. `None`: nothing to
/// apply yet (unchanged, or still being written; the next poll looks again). A
/// read error is fingerprinted by its text, so a lasting error counts once.
pub(super) fn poll(
    path: &std::path::Path,
    seen: Option<u64>,
    settle: impl FnOnce(),
) -> Option<(u64, Result<Loaded, LoadError>)> {
    let (fp, _) = read(path);
    if seen == Some(fp) {
        return None;
    }
    settle();
    let (again, outcome) = read(path);
    (again == fp).then(|| (fp, outcome.and_then(|sources| parse(&sources))))
}

/// The configuration's fingerprint, with its sources or the read error.
fn read(path: &std::path::Path) -> (u64, Result<Vec<super::Source>, LoadError>) {
    match read_sources(path) {
        Ok(sources) => (fingerprint(&sources), Ok(sources)),
        Err(e) => {
            let text = format!("{}: {e}", path.display());
            let fp = fingerprint(&[super::Source {
                path: path.to_path_buf(),
                text: text.clone(),
            }]);
            (
                fp,
                Err(LoadError {
                    problems: vec![text],
                }),
            )
        }
    }
}

fn apply(outcome: Result<Loaded, LoadError>, on_load: &impl Fn(Loaded), status: &SourceStatus) {
    match outcome {
        Ok(loaded) => {
            let revision = loaded.snapshot.revision().clone();
            tracing::info!(target: "inferencecache::policy_file", %revision, "policy loaded");
            on_load(loaded);
        }
        Err(e) => {
            tracing::warn!(target: "inferencecache::policy_file", error = %e,
                "policy reload failed; keeping the last good snapshot");
            status.record_error(e.to_string());
        }
    }
}
