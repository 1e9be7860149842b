//! Prefills in progress: the uncached prompt tokens the sidecar routed to a
//! replica, keyed by the request's last block, until that engine's own event
//! stores the block (its prefill has ended) or the request ends.
//!
//! This is what makes the load rule's prefill backlog (`inflightTokens`) follow
//! the engine: a non-streamed completion's response headers come only after its
//! whole decode, hundreds of milliseconds after its prefill stopped costing
//! anyone anything. A ticket may also carry its request's count
//! (`Inflight::ends_with_prefill`): then this is the only place that lets the
//! request go, so clearing a replica releases its tickets, and maintenance
//! releases those older than `INFLIGHT_AGE_OUT`. Nothing here is an entry: quota, `/snapshot` counts, CRD
//! status and LFU never see it.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use hashbrown::HashMap;
use parking_lot::Mutex;
use smallvec::SmallVec;

use super::Prefill;
use crate::time::Timestamp;

/// Prefills tracked per scope at most; past it a request's backlog is let go with
/// its response instead (the signal is coarser, never unbounded memory).
pub const MAX_PREFILLS: usize = 1 << 14;

/// (slot, last block hash) → the prefills waiting on that block there.
type Waiting = HashMap<(u32, u64), SmallVec<[Arc<Prefill>; 1]>>;

#[derive(Debug, Default)]
pub(crate) struct Prefills {
    waiting: Mutex<Waiting>,
    /// Keys in `waiting`: lets the event path skip the lock when none are.
    len: AtomicUsize,
}

impl Prefills {
    /// Lets `prefill` go when `slot`'s engine stores `last` (the routed chain's
    /// last block). `false` when it is not tracked (full): the request lets its
    /// backlog go when it ends instead.
    pub fn track(&self, slot: u32, last: u64, prefill: &Arc<Prefill>) -> bool {
        if !prefill.is_open() {
            return false;
        }
        let mut waiting = self.waiting.lock();
        if waiting.len() >= MAX_PREFILLS {
            waiting.retain(|_, ps| {
                ps.retain(|p| p.is_open());
                !ps.is_empty()
            });
            if waiting.len() >= MAX_PREFILLS {
                self.len.store(waiting.len(), Ordering::Relaxed);
                return false;
            }
        }
        waiting
            .entry((slot, last))
            .or_default()
            .push(prefill.clone());
        self.len.store(waiting.len(), Ordering::Relaxed);
        true
    }

    /// `slot`'s engine stored `hashes`: the prefills ending in one of them are
    /// done. Returns the requests let go with them (their tickets carried them).
    pub fn stored(&self, slot: u32, hashes: &[u64]) -> u64 {
        if self.len.load(Ordering::Relaxed) == 0 {
            return 0;
        }
        let mut waiting = self.waiting.lock();
        let mut requests = 0;
        for &h in hashes {
            if let Some(ps) = waiting.remove(&(slot, h)) {
                requests += ps.iter().filter(|p| p.release()).count() as u64;
            }
        }
        self.len.store(waiting.len(), Ordering::Relaxed);
        requests
    }

    /// AllBlocksCleared or removal of `slot`: stop waiting on its blocks. A
    /// ticket carrying its request's count is let go now (its last block will
    /// never be reported); the others still let their backlog go when their
    /// requests end.
    pub fn forget_slot(&self, slot: u32) {
        if self.len.load(Ordering::Relaxed) == 0 {
            return;
        }
        let mut waiting = self.waiting.lock();
        waiting.retain(|&(s, _), ps| {
            if s == slot {
                ps.iter().filter(|p| p.carries_request()).for_each(|p| {
                    p.release();
                });
            }
            s != slot
        });
        self.len.store(waiting.len(), Ordering::Relaxed);
    }

    /// Maintenance: lets go the tickets whose event has not come within
    /// `INFLIGHT_AGE_OUT` while they carry their request's count, and drops the
    /// tickets already let go. Returns the requests aged out.
    pub fn purge(&self, now: Timestamp) -> u64 {
        if self.len.load(Ordering::Relaxed) == 0 {
            return 0;
        }
        let mut waiting = self.waiting.lock();
        let mut aged_out = 0;
        waiting.retain(|_, ps| {
            aged_out += ps
                .iter()
                .filter(|p| p.is_overdue(now) && p.release())
                .count() as u64;
            ps.retain(|p| p.is_open());
            !ps.is_empty()
        });
        self.len.store(waiting.len(), Ordering::Relaxed);
        aged_out
    }

    /// Prefills waiting (including released ones not yet purged).
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.len.load(Ordering::Relaxed)
    }
}
