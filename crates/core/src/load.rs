//! The load signals of a replica, read by the load rule
//! (`decision/bounded_load.rs`), all in one [`ReplicaLoad`] per replica.
//!
//! ```text
//!  ext_proc routes ──▶ Inflight ──▶ inflight, inflight_tokens, sent since report
//!                         └──▶ Prefill ─ prefills.rs ◀── BlockStored (prefill ended)
//!  ReportStats / scrapes ──▶ engine queue, waiting, report epoch
//!                        └──▶ fleet_routes.rs (other sidecars, first-token counts)
//!                                  └──▶ recent_routes.rs (share bound, decayed)
//!  peer sidecars' facts ──▶ peer_ledger.rs ──▶ peer in flight, peer tokens,
//!                                                peer sent since report, share
//!  own routes ──▶ shared_route.rs ──▶ the fleet publisher (peers' ledgers)
//! ```
//!
//! Two sources, both kept in atomics so a decision reads no lock:
//! - the sidecar's own accounting: every request routed on the ext_proc path is
//!   counted against its replica until its prefill ends (`inflight.rs`), so
//!   decisions made milliseconds apart see each other with no engine
//!   cooperation;
//! - the engine's own waiting + running count (ReportStats, scraped metrics), the
//!   shared truth when several sidecars route to the same engines, plus the
//!   requests this sidecar sent since that report, ignored once older than the
//!   policy's `statsMaxAge`.
//!
//! With fleet sync on, a third: the routes the other sidecars of the fleet
//! published (`peer_ledger.rs`), counted next to this sidecar's own, so a
//! decision sees the fleet's traffic at once, not a scrape later.
//!
//! This module knows nothing of the index: the index keeps one [`ReplicaLoad`]
//! inline in each replica's event-path values, which it hands to each
//! [`Inflight`] as a [`LoadCell`].

mod fleet_routes;
mod inflight;
pub mod peer_ledger;
mod prefills;
mod recent_routes;
mod shared_route;

use std::sync::atomic::{AtomicU64, Ordering};

pub use fleet_routes::FleetRoutes;
pub(crate) use inflight::Prefill;
pub use inflight::{EVENT_FEED_LIVE, INFLIGHT_AGE_OUT, Inflight, event_feed_is_live};
pub use prefills::MAX_PREFILLS;
pub(crate) use prefills::Prefills;
pub use recent_routes::{HALF_LIFE, RecentRoutes};
pub use shared_route::{RouteFacts, SharedRoute};

/// What holds a replica's [`ReplicaLoad`] (the index's per-replica values keep
/// it inline, so the decision's load rule reads it with no extra pointer to
/// follow); each [`Inflight`] keeps its holder alive until it lets go.
pub trait LoadCell: Send + Sync + std::fmt::Debug {
    fn load(&self) -> &ReplicaLoad;
}

/// One replica's load signals, shared by every version of its scope's replica
/// table and by the [`Inflight`] guards of the requests routed there.
#[derive(Debug, Default)]
pub struct ReplicaLoad {
    /// Requests this sidecar routed here (ext_proc) whose prefill has not ended,
    /// and their uncached prompt tokens: see [`Inflight`].
    pub(crate) inflight: AtomicU64,
    pub(crate) inflight_tokens: AtomicU64,
    /// The engine's own waiting + running count from its last report (ReportStats
    /// or a metrics scrape) and when it came, ns (0 = never).
    engine_queue: AtomicU64,
    engine_queue_at: AtomicU64,
    /// The waiting part of that report: a request sent there now queues behind
    /// them, whatever its own prefill (the load rule's quick start).
    engine_waiting: AtomicU64,
    /// Bumped by every engine report: tells a request admitted before the report
    /// (which the engine's count already includes) from one admitted after.
    pub(crate) report_epoch: AtomicU64,
    /// Requests this sidecar admitted here since the last report and still in
    /// flight: the engine's count cannot include them yet.
    pub(crate) inflight_since_report: AtomicU64,
    /// Those of them whose prefill has not ended: waiting for, or in, their
    /// prefill. Flow control's waiting bound adds these to the engine's reported
    /// waiting count; a request past its prefill is decoding, not waiting.
    pub(crate) prefilling_since_report: AtomicU64,
    /// Requests routed here lately (the share bound): this sidecar's, and
    /// other sidecars' as the engine's scrapes show them.
    pub(crate) recent: RecentRoutes,
    /// What this sidecar sent here against what the engine shows started.
    pub(crate) fleet: FleetRoutes,
    /// The fleet's other sidecars' routes here (fleet sync), as their ledger
    /// totals: in flight, and the uncached tokens of those still prefilling.
    peer_inflight: AtomicU64,
    peer_tokens: AtomicU64,
    /// Peers' routes here since the engine's last report. Not decremented on
    /// release: a peer's request that ends before the next report still counts
    /// until that report, at most one scrape interval of overcount.
    peer_since_report: AtomicU64,
}

impl ReplicaLoad {
    /// The load the bounded-load rule compares: the larger of this sidecar's
    /// in-flight count and the engine's reported waiting + running plus what
    /// this sidecar sent since (still in flight), the latter only while the
    /// report is younger than `max_age` ns. The report is the only thing that
    /// shows other sidecars' requests; adding our own since it keeps a sidecar
    /// from reading an engine it just filled as idle until the next scrape.
    ///
    /// With fleet sync, the peers' routes count as this sidecar's own: their
    /// in-flight routes next to its in-flight count, their routes since the
    /// report next to its own.
    pub fn current_load(&self, now: u64, max_age: u64) -> u64 {
        let own = self
            .inflight
            .load(Ordering::Relaxed)
            .saturating_add(self.peer_inflight.load(Ordering::Relaxed));
        if !self.report_is_fresh(now, max_age) {
            return own;
        }
        let since = self
            .inflight_since_report
            .load(Ordering::Relaxed)
            .saturating_add(self.peer_since_report.load(Ordering::Relaxed));
        own.max(
            self.engine_queue
                .load(Ordering::Relaxed)
                .saturating_add(since),
        )
    }

    /// Records the engine's reported queue (ReportStats, scrapes).
    pub fn set_engine_queue(&self, waiting: u64, running: u64, at: u64) {
        self.engine_queue
            .store(waiting.saturating_add(running), Ordering::Relaxed);
        self.engine_waiting.store(waiting, Ordering::Relaxed);
        self.engine_queue_at.store(at.max(1), Ordering::Relaxed);
        self.report_epoch.fetch_add(1, Ordering::Relaxed);
        self.inflight_since_report.store(0, Ordering::Relaxed);
        self.prefilling_since_report.store(0, Ordering::Relaxed);
        self.peer_since_report.store(0, Ordering::Relaxed);
    }

    /// The peers' routes in flight here and their prefill backlog (their
    /// ledger's totals, replaced whole).
    pub(crate) fn set_peer_load(&self, in_flight: u64, tokens: u64) {
        self.peer_inflight.store(in_flight, Ordering::Relaxed);
        self.peer_tokens.store(tokens, Ordering::Relaxed);
    }

    /// A peer routed a request here at `now` ns: it counts as sent since the
    /// report, in the share bound, and as known traffic when the engine's
    /// first-token count grows (so it is not counted a second time).
    pub(crate) fn note_peer_routed(&self, now: u64) {
        self.peer_since_report.fetch_add(1, Ordering::Relaxed);
        if now > 0 {
            self.recent.note(now);
            self.fleet.note_sent();
        }
    }

    /// The peers' routes in flight here (fleet sync).
    pub fn peer_requests(&self) -> u64 {
        self.peer_inflight.load(Ordering::Relaxed)
    }

    /// The uncached tokens of the peers' routes still prefilling here.
    pub fn peer_tokens(&self) -> u64 {
        self.peer_tokens.load(Ordering::Relaxed)
    }

    /// This sidecar's own prefill backlog here (without its peers').
    pub fn own_inflight_tokens(&self) -> u64 {
        self.inflight_tokens.load(Ordering::Relaxed)
    }

    /// When the engine's last queue report came, ns; 0 = never.
    pub fn engine_queue_at(&self) -> u64 {
        self.engine_queue_at.load(Ordering::Relaxed)
    }

    /// The engine's reported waiting requests; 0 without a report younger
    /// than `max_age`.
    pub fn engine_waiting(&self, now: u64, max_age: u64) -> u64 {
        if !self.report_is_fresh(now, max_age) {
            return 0;
        }
        self.engine_waiting.load(Ordering::Relaxed)
    }

    /// Requests this sidecar routed here whose prefill has not ended.
    pub fn inflight_requests(&self) -> u64 {
        self.inflight.load(Ordering::Relaxed)
    }

    /// Requests this sidecar admitted here since the engine's last report and
    /// still in flight (the report cannot include them yet).
    pub fn sent_since_report(&self) -> u64 {
        self.inflight_since_report.load(Ordering::Relaxed)
    }

    /// Requests this sidecar admitted here since the engine's last report whose
    /// prefill has not ended (the engine's event storing their last block, or
    /// their response, ends it): what may wait there that the report cannot show.
    pub fn prefilling_since_report(&self) -> u64 {
        self.prefilling_since_report.load(Ordering::Relaxed)
    }

    /// The uncached prompt tokens of those requests (the prefill backlog),
    /// and of the peers' routes still prefilling here.
    pub fn inflight_tokens(&self) -> u64 {
        self.inflight_tokens
            .load(Ordering::Relaxed)
            .saturating_add(self.peer_tokens.load(Ordering::Relaxed))
    }

    /// The decayed count of requests routed here lately, at `now` ns.
    pub fn recent_requests(&self, now: u64) -> f64 {
        self.recent.at(now)
    }

    /// The engine's count of requests that reached their first token: what it
    /// grew by beyond this sidecar's own requests counts as other sidecars'
    /// routes in the share bound (`fleet_routes.rs`).
    pub fn note_first_tokens(&self, total: u64, at: u64) {
        let others = self.fleet.others_in(total);
        if others > 0 {
            self.recent.note_many(others, at);
        }
    }

    /// Forgets the routing history (the replica's cache was cleared): the share
    /// bound and the fleet tally start again.
    pub(crate) fn reset_routes(&self) {
        self.recent.reset();
        self.fleet.reset();
    }

    /// Whether the engine's last queue report exists and is at most `max_age` ns
    /// old: a stale report is ignored, never trusted forever.
    pub fn report_is_fresh(&self, now: u64, max_age: u64) -> bool {
        let at = self.engine_queue_at.load(Ordering::Relaxed);
        at != 0 && now.saturating_sub(at) <= max_age
    }
}
