//! Load signals of a replica, read by the bounded-load rule
//! (`decision/bounded_load.rs`).
//!
//! Two sources, both kept in the replica's shared atomics so a decision reads no
//! lock:
//! - the sidecar's own accounting: every request routed on the ext_proc path holds
//!   an [`Inflight`] until it ends (the adapter drops it on the response headers,
//!   on stream end, or when its age-out timer fires), so decisions made
//!   milliseconds apart see each other with no engine cooperation. Its uncached
//!   prompt tokens (the prefill backlog) are let go earlier, as soon as the
//!   engine's own events store the request's last block (`index/prefills.rs`):
//!   a non-streamed completion's response headers come only after its decode;
//! - the engine's own waiting + running count (ReportStats, scraped metrics), the
//!   shared truth when several sidecars route to the same engines, plus the
//!   requests this sidecar sent since that report, ignored once older than the
//!   policy's `statsMaxAge`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::index::ReplicaLive;

/// One routed request counted against its replica until dropped.
///
/// Dropping it releases the count exactly once, so every exit path of the
/// adapter (response headers, stream error, timeout) releases by construction.
#[derive(Debug)]
pub struct Inflight {
    live: Arc<ReplicaLive>,
    /// `None` when the request brought no uncached tokens: nothing to let go
    /// early, so no ticket is allocated (most requests of a warm fleet).
    prefill: Option<Arc<Prefill>>,
    tokens: u64,
    /// The replica's report epoch at admission (see `ReplicaLive::report_epoch`).
    epoch: u64,
}

/// The uncached prompt tokens one routed request brought to its replica, let go
/// once: by the engine's event that stores its last block, or with its
/// [`Inflight`], whichever comes first.
#[derive(Debug)]
pub(crate) struct Prefill {
    live: Arc<ReplicaLive>,
    tokens: AtomicU64,
}

impl Prefill {
    /// Takes the tokens off the replica's backlog; later calls do nothing.
    pub fn release(&self) {
        let n = self.tokens.swap(0, Ordering::Relaxed);
        if n > 0 {
            saturating_sub(&self.live.inflight_tokens, n);
        }
    }

    /// Still counted (not yet released).
    pub fn is_open(&self) -> bool {
        self.tokens.load(Ordering::Relaxed) > 0
    }
}

fn saturating_sub(c: &AtomicU64, n: u64) {
    let _ = c.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
        Some(v.saturating_sub(n))
    });
}

impl Inflight {
    pub(crate) fn begin(live: Arc<ReplicaLive>, uncached_tokens: u64) -> Self {
        live.inflight.fetch_add(1, Ordering::Relaxed);
        live.inflight_tokens
            .fetch_add(uncached_tokens, Ordering::Relaxed);
        let epoch = live.report_epoch.load(Ordering::Relaxed);
        live.inflight_since_report.fetch_add(1, Ordering::Relaxed);
        let prefill = (uncached_tokens > 0).then(|| {
            Arc::new(Prefill {
                live: live.clone(),
                tokens: AtomicU64::new(uncached_tokens),
            })
        });
        Self {
            live,
            prefill,
            tokens: uncached_tokens,
            epoch,
        }
    }

    /// The uncached prompt tokens this request brought to its replica.
    pub fn uncached_tokens(&self) -> u64 {
        self.tokens
    }

    /// The request's prefill backlog, for the index to let go when the engine
    /// stores the request's last block; `None` when it has none.
    pub(crate) fn prefill(&self) -> Option<&Arc<Prefill>> {
        self.prefill.as_ref()
    }
}

impl Drop for Inflight {
    fn drop(&mut self) {
        saturating_sub(&self.live.inflight, 1);
        // Admitted before the last report: the engine's count has it, not ours.
        if self.live.report_epoch.load(Ordering::Relaxed) == self.epoch {
            saturating_sub(&self.live.inflight_since_report, 1);
        }
        if let Some(p) = &self.prefill {
            p.release();
        }
    }
}
