//! The requests other sidecars sent to a replica, from its engine's own count of
//! requests that reached their first token (`vllm:time_to_first_token_seconds`,
//! `sglang:time_to_first_token_seconds`: a histogram whose `_count` grows by one
//! per request once its prefill ends).
//!
//! The share bound (`recent_routes.rs`) counts what this sidecar routed at once.
//! Between two scrapes the engine's count grows by every sidecar's requests that
//! started there, this one's included; what this sidecar sent and the engine has
//! not shown yet is carried to the next scrape, so with one sidecar nothing is
//! ever counted twice. A request sent more than two scrapes ago that the engine
//! never showed (it failed before its first token) stops being carried, so a
//! lost request cannot hide other sidecars' traffic for good.

use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

/// One replica's tally of what this sidecar sent against what its engine shows.
#[derive(Debug, Default)]
pub struct FleetRoutes {
    /// Requests this sidecar sent since the last scrape (no lock on the routing
    /// path).
    sent: AtomicU64,
    seen: Mutex<Seen>,
}

#[derive(Debug, Default)]
struct Seen {
    /// The engine's count at the last scrape; `None` before the first one.
    total: Option<u64>,
    /// This sidecar's requests the engine has not shown yet.
    carried: u64,
    /// What this sidecar sent in the interval before the last scrape.
    sent_before: u64,
}

impl FleetRoutes {
    /// One request sent by this sidecar.
    pub fn note_sent(&self) {
        self.sent.fetch_add(1, Ordering::Relaxed);
    }

    /// The engine now shows `total` requests started; returns how many of those
    /// since the last scrape other sidecars (or clients) sent. The first scrape,
    /// and one whose count went down (the engine restarted), only set the
    /// baseline.
    pub fn others_in(&self, total: u64) -> u64 {
        let sent = self.sent.swap(0, Ordering::Relaxed);
        let mut seen = self.seen.lock();
        let before = seen.total.replace(total);
        let sent_before = std::mem::replace(&mut seen.sent_before, sent);
        let Some(before) = before.filter(|&b| b <= total) else {
            seen.carried = 0;
            return 0;
        };
        let started = total - before;
        let ours = seen.carried.saturating_add(sent);
        seen.carried = ours
            .saturating_sub(started)
            .min(sent.saturating_add(sent_before));
        started.saturating_sub(ours)
    }

    /// Forgets the baseline and what was carried (the replica was cleared or
    /// removed: its engine's count may start over).
    pub fn reset(&self) {
        self.sent.store(0, Ordering::Relaxed);
        *self.seen.lock() = Seen::default();
    }
}

#[cfg(test)]
mod tests;
