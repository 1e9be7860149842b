//! Load signals of a replica, read by the bounded-load rule
//! (`decision/bounded_load.rs`).
//!
//! Two sources, both kept in the replica's shared atomics so a decision reads no
//! lock:
//! - the sidecar's own accounting: every request routed on the ext_proc path holds
//!   an [`Inflight`] until its prefill ends (the adapter drops it on the response
//!   headers, on stream end, or when its age-out timer fires), so decisions made
//!   milliseconds apart see each other with no engine cooperation;
//! - the engine's own waiting + running count (ReportStats, scraped metrics), the
//!   shared truth when several sidecars route to the same engines, ignored once
//!   older than the policy's `statsMaxAge`.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use crate::index::ReplicaLive;

/// One routed request counted against its replica until dropped.
///
/// Dropping it releases the count exactly once, so every exit path of the
/// adapter (response headers, stream error, timeout) releases by construction.
#[derive(Debug)]
pub struct Inflight {
    live: Arc<ReplicaLive>,
    tokens: u64,
}

impl Inflight {
    pub(crate) fn begin(live: Arc<ReplicaLive>, uncached_tokens: u64) -> Self {
        live.inflight.fetch_add(1, Ordering::Relaxed);
        live.inflight_tokens
            .fetch_add(uncached_tokens, Ordering::Relaxed);
        Self {
            live,
            tokens: uncached_tokens,
        }
    }

    /// The uncached prompt tokens this request brought to its replica.
    pub fn uncached_tokens(&self) -> u64 {
        self.tokens
    }
}

impl Drop for Inflight {
    fn drop(&mut self) {
        let sub = |c: &std::sync::atomic::AtomicU64, n: u64| {
            let _ = c.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
                Some(v.saturating_sub(n))
            });
        };
        sub(&self.live.inflight, 1);
        sub(&self.live.inflight_tokens, self.tokens);
    }
}
