//! One routed request counted against its replica ([`Inflight`]) and the
//! uncached prompt tokens it brought ([`Prefill`]), each let go exactly once.
//!
//! The request's prefill backlog is let go as soon as the engine's own events
//! store the request's last block (`prefills.rs`): a non-streamed completion's
//! response headers come only after its decode. The request itself is let go by
//! that same event when the replica's event feed and queue report are live
//! ([`Inflight::ends_with_prefill`]: Envoy then need not send the response
//! headers, a round trip on every response; the request, still decoding, stays
//! in "sent since the last report" until the engine's next report counts it),
//! else when the adapter drops its [`Inflight`] (response headers, stream end,
//! or its age-out timer).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use super::{LoadCell, ReplicaLoad, SharedRoute};
use crate::time::Timestamp;

/// How long a routed request may count as in flight with no sign of its end (no
/// response headers, no event storing its last block): a lost stream or event
/// must never inflate a replica's load for good.
pub const INFLIGHT_AGE_OUT: Duration = Duration::from_secs(60);

/// A replica whose engine sent an event this recently has a live event feed: the
/// end of a request's prefill will be seen, so the request may be let go by it.
pub const EVENT_FEED_LIVE: Duration = Duration::from_secs(10);

/// Whether a replica whose last event (of any kind) was at `last_event_at` ns
/// (0 = never) has a live event feed at `now` ns ([`EVENT_FEED_LIVE`]).
pub fn event_feed_is_live(last_event_at: u64, now: u64) -> bool {
    last_event_at > 0 && now.saturating_sub(last_event_at) <= EVENT_FEED_LIVE.as_nanos() as u64
}

/// One routed request counted against its replica until dropped.
///
/// Dropping it releases the count exactly once, so every exit path of the
/// adapter (response headers, stream error, timeout) releases by construction;
/// unless the count was handed to the request's prefill ticket
/// ([`Inflight::ends_with_prefill`]), which then releases it instead.
#[derive(Debug)]
pub struct Inflight {
    cell: Arc<dyn LoadCell>,
    /// `None` when the request brought no uncached tokens: nothing to let go
    /// early, so no ticket is allocated (most requests of a warm fleet).
    prefill: Option<Arc<Prefill>>,
    tokens: u64,
    /// The replica's report epoch at admission (see `ReplicaLoad::report_epoch`).
    epoch: u64,
    /// The count is no longer this guard's (its prefill ticket carries it, or it
    /// had no prefill to wait for): dropping this does nothing.
    handed_over: bool,
    /// The route as this sidecar's fleet sees it (fleet sync on).
    shared: Option<Arc<SharedRoute>>,
}

/// The uncached prompt tokens one routed request brought to its replica, let go
/// once: by the engine's event that stores its last block, or with its
/// [`Inflight`], whichever comes first. It may also carry the request's count
/// ([`Inflight::ends_with_prefill`]), let go with the tokens, or after
/// [`INFLIGHT_AGE_OUT`] if the event never comes.
#[derive(Debug)]
pub(crate) struct Prefill {
    cell: Arc<dyn LoadCell>,
    tokens: AtomicU64,
    /// Set before the ticket is shared (so no event can release it first).
    request: AtomicBool,
    admitted_at: Timestamp,
    /// The replica's report epoch at admission: the prefill's end leaves "sent
    /// since the report" prefilling only if no report came in between.
    epoch: u64,
    /// The route as the fleet sees it: its prefill end (or release, when this
    /// carries the request) is published with it.
    shared: OnceLock<Arc<SharedRoute>>,
}

impl Prefill {
    /// Takes the tokens off the replica's backlog, and the request's count if
    /// this ticket carries it (then `true`); later calls do nothing.
    pub fn release(&self) -> bool {
        let n = self.tokens.swap(0, Ordering::Relaxed);
        if n > 0 {
            let live = self.cell.load();
            saturating_sub(&live.inflight_tokens, n);
            prefill_ended(live, self.epoch);
        }
        // The request's prefill is over, not the request: it decodes on, so it
        // stays in "sent since the last report" until the engine's next report,
        // which counts it while it runs (see `ReplicaLoad::current_load`).
        let carried = self.request.swap(false, Ordering::Relaxed);
        if carried {
            saturating_sub(&self.cell.load().inflight, 1);
        }
        if let Some(shared) = self.shared.get() {
            if carried {
                shared.released();
            } else if n > 0 {
                shared.prefill_ended();
            }
        }
        carried
    }

    /// Still counted (not yet released).
    pub fn is_open(&self) -> bool {
        self.tokens.load(Ordering::Relaxed) > 0 || self.request.load(Ordering::Relaxed)
    }

    /// Carries a request's count that has waited for its event too long.
    pub fn is_overdue(&self, now: Timestamp) -> bool {
        self.request.load(Ordering::Relaxed)
            && now.as_nanos().saturating_sub(self.admitted_at.as_nanos())
                >= INFLIGHT_AGE_OUT.as_nanos() as u64
    }

    /// Carries the request's count (see [`Inflight::ends_with_prefill`]).
    pub fn carries_request(&self) -> bool {
        self.request.load(Ordering::Relaxed)
    }
}

/// One request off a replica's count. One admitted before the engine's last
/// report is in the engine's count, not in "sent since".
fn release_request(live: &ReplicaLoad, epoch: u64) {
    saturating_sub(&live.inflight, 1);
    if live.report_epoch.load(Ordering::Relaxed) == epoch {
        saturating_sub(&live.inflight_since_report, 1);
    }
}

/// A request's prefill is over: it no longer waits at the replica. One admitted
/// before the engine's last report is in the engine's count, not in "sent since".
fn prefill_ended(live: &ReplicaLoad, epoch: u64) {
    if live.report_epoch.load(Ordering::Relaxed) == epoch {
        saturating_sub(&live.prefilling_since_report, 1);
    }
}

fn saturating_sub(c: &AtomicU64, n: u64) {
    let _ = c.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
        Some(v.saturating_sub(n))
    });
}

impl Inflight {
    pub(crate) fn begin(cell: Arc<dyn LoadCell>, uncached_tokens: u64, now: Timestamp) -> Self {
        let live = cell.load();
        live.inflight.fetch_add(1, Ordering::Relaxed);
        live.inflight_tokens
            .fetch_add(uncached_tokens, Ordering::Relaxed);
        let epoch = live.report_epoch.load(Ordering::Relaxed);
        live.inflight_since_report.fetch_add(1, Ordering::Relaxed);
        live.prefilling_since_report.fetch_add(1, Ordering::Relaxed);
        if now.as_nanos() > 0 {
            live.recent.note(now.as_nanos());
            live.fleet.note_sent();
        }
        let prefill = (uncached_tokens > 0).then(|| {
            Arc::new(Prefill {
                cell: cell.clone(),
                tokens: AtomicU64::new(uncached_tokens),
                request: AtomicBool::new(false),
                admitted_at: now,
                epoch,
                shared: OnceLock::new(),
            })
        });
        Self {
            cell,
            prefill,
            tokens: uncached_tokens,
            epoch,
            handed_over: false,
            shared: None,
        }
    }

    /// Publishes this route's facts through `shared` from here on (set once,
    /// right after [`Self::begin`], before the prefill ticket is shared).
    pub(crate) fn share(&mut self, shared: Arc<SharedRoute>) {
        if let Some(p) = &self.prefill {
            let _ = p.shared.set(shared.clone());
        }
        self.shared = Some(shared);
    }

    /// Whether the request is let go by the engine's event that stores its last
    /// block (or after [`INFLIGHT_AGE_OUT`]), not when this is dropped: the
    /// adapter need not wait for the response to end it.
    pub fn ends_with_prefill(&self) -> bool {
        self.handed_over
    }

    /// Hands the request's count to its prefill ticket, which must not be shared
    /// yet (`Router::admit_until_prefill_end` calls this just before tracking it). `false` when
    /// there is no ticket.
    pub(crate) fn hand_to_prefill(&mut self) -> bool {
        match &self.prefill {
            Some(p) if Arc::strong_count(p) == 1 => {
                p.request.store(true, Ordering::Relaxed);
                self.handed_over = true;
                true
            }
            _ => false,
        }
    }

    /// The request has no prefill to wait for (every block cached): it leaves
    /// this sidecar's in-flight count now and stays in "sent since the last
    /// report" until the engine's next report, as a request past its prefill
    /// does. Nothing happens when it has a prefill ticket.
    pub(crate) fn end_prefill_now(&mut self) {
        if self.prefill.is_none() && !self.handed_over {
            let live = self.cell.load();
            saturating_sub(&live.inflight, 1);
            prefill_ended(live, self.epoch);
            self.handed_over = true;
            if let Some(shared) = &self.shared {
                shared.released();
            }
        }
    }

    /// Takes the count back from an untracked ticket (still not shared).
    pub(crate) fn take_back(&mut self) {
        if let Some(p) = &self.prefill {
            p.request.store(false, Ordering::Relaxed);
        }
        self.handed_over = false;
    }

    /// Whether the replica's engine shows both ends of a request: its events are
    /// live (an event within [`EVENT_FEED_LIVE`], so the end of the prefill will
    /// be seen) and its queue report is younger than `stats_max_age` ns (so a
    /// request still decoding after its prefill stays in the load the rule reads).
    /// `last_event_at` is the replica's last event of any kind, ns (0 = never).
    pub(crate) fn engine_is_live(
        &self,
        now: Timestamp,
        last_event_at: u64,
        stats_max_age: u64,
    ) -> bool {
        let now = now.as_nanos();
        event_feed_is_live(last_event_at, now)
            && self.cell.load().report_is_fresh(now, stats_max_age)
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
        if self.handed_over {
            return;
        }
        release_request(self.cell.load(), self.epoch);
        if let Some(shared) = &self.shared {
            shared.released();
        }
        match &self.prefill {
            Some(p) => {
                p.release();
            }
            // No ticket: the prefill (if any was left) ends with the request.
            None => prefill_ended(self.cell.load(), self.epoch),
        }
    }
}
