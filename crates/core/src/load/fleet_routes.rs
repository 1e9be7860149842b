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
mod tests {
    use super::*;

    fn sent(f: &FleetRoutes, n: u64) {
        for _ in 0..n {
            f.note_sent();
        }
    }

    #[test]
    fn the_first_scrape_sets_the_baseline() {
        let f = FleetRoutes::default();
        sent(&f, 3);
        assert_eq!(f.others_in(1_000), 0);
        assert_eq!(f.others_in(1_004), 4);
    }

    #[test]
    fn one_sidecar_is_never_counted_twice_however_late_its_requests_start() {
        let f = FleetRoutes::default();
        f.others_in(0);
        // 10 sent; the engine shows 6 of them by this scrape, the rest by the next.
        sent(&f, 10);
        assert_eq!(f.others_in(6), 0);
        sent(&f, 5);
        assert_eq!(f.others_in(6 + 4 + 5), 0);
        assert_eq!(f.others_in(15), 0);
    }

    #[test]
    fn other_sidecars_requests_are_what_the_engine_started_beyond_ours() {
        let f = FleetRoutes::default();
        f.others_in(0);
        sent(&f, 10);
        // Ours (10) and 7 others started.
        assert_eq!(f.others_in(17), 7);
        // Ours lag: 4 of 8 start now, with 5 others; the other 4 next time with
        // 2. Which started request was whose is not known, so ours are taken
        // first: the 7 others show up a scrape late, but all of them and no more.
        sent(&f, 8);
        let now = f.others_in(17 + 4 + 5);
        assert_eq!(now, 1);
        assert_eq!(now + f.others_in(26 + 4 + 2), 7);
    }

    #[test]
    fn a_request_that_never_starts_is_carried_for_two_scrapes_only() {
        let f = FleetRoutes::default();
        f.others_in(0);
        sent(&f, 5); // never shown by the engine
        assert_eq!(f.others_in(0), 0);
        assert_eq!(f.others_in(0), 0);
        // Two scrapes later, nothing of ours is left to hide others' requests.
        assert_eq!(f.others_in(0), 0);
        assert_eq!(f.others_in(3), 3);
    }

    #[test]
    fn a_count_that_goes_down_is_a_restart_and_only_resets_the_baseline() {
        let f = FleetRoutes::default();
        f.others_in(500);
        sent(&f, 2);
        assert_eq!(f.others_in(10), 0);
        assert_eq!(f.others_in(13), 3);
        f.reset();
        assert_eq!(f.others_in(2), 0);
        assert_eq!(f.others_in(4), 2);
    }
}
