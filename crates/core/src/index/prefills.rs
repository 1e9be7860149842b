//! Prefills in progress: the uncached prompt tokens the sidecar routed to a
//! replica, keyed by the request's last block, until that engine's own event
//! stores the block (its prefill has ended) or the request ends.
//!
//! This is what makes the load rule's prefill backlog (`inflightTokens`) follow
//! the engine: a non-streamed completion's response headers come only after its
//! whole decode, hundreds of milliseconds after its prefill stopped costing
//! anyone anything. Nothing here is an entry: quota, `/snapshot` counts, CRD
//! status and LFU never see it.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use hashbrown::HashMap;
use parking_lot::Mutex;
use smallvec::SmallVec;

use crate::load::Prefill;

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
    /// last block).
    pub fn track(&self, slot: u32, last: u64, prefill: &Arc<Prefill>) {
        if !prefill.is_open() {
            return;
        }
        let mut waiting = self.waiting.lock();
        if waiting.len() >= MAX_PREFILLS {
            waiting.retain(|_, ps| {
                ps.retain(|p| p.is_open());
                !ps.is_empty()
            });
            if waiting.len() >= MAX_PREFILLS {
                self.len.store(waiting.len(), Ordering::Relaxed);
                return;
            }
        }
        waiting
            .entry((slot, last))
            .or_default()
            .push(prefill.clone());
        self.len.store(waiting.len(), Ordering::Relaxed);
    }

    /// `slot`'s engine stored `hashes`: the prefills ending in one of them are done.
    pub fn stored(&self, slot: u32, hashes: &[u64]) {
        if self.len.load(Ordering::Relaxed) == 0 {
            return;
        }
        let mut waiting = self.waiting.lock();
        for &h in hashes {
            if let Some(ps) = waiting.remove(&(slot, h)) {
                ps.iter().for_each(|p| p.release());
            }
        }
        self.len.store(waiting.len(), Ordering::Relaxed);
    }

    /// AllBlocksCleared or removal of `slot`: stop waiting on its blocks (the
    /// requests still let their backlog go when they end).
    pub fn forget_slot(&self, slot: u32) {
        if self.len.load(Ordering::Relaxed) == 0 {
            return;
        }
        let mut waiting = self.waiting.lock();
        waiting.retain(|&(s, _), _| s != slot);
        self.len.store(waiting.len(), Ordering::Relaxed);
    }

    /// Drops prefills their requests already let go (maintenance).
    pub fn purge(&self) {
        if self.len.load(Ordering::Relaxed) == 0 {
            return;
        }
        let mut waiting = self.waiting.lock();
        waiting.retain(|_, ps| {
            ps.retain(|p| p.is_open());
            !ps.is_empty()
        });
        self.len.store(waiting.len(), Ordering::Relaxed);
    }

    /// Prefills waiting (including released ones not yet purged).
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.len.load(Ordering::Relaxed)
    }
}
