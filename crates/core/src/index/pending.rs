//! Pending entries: chains the sidecar has just routed, held for the replica they
//! went to until that engine's own events confirm them or a few seconds pass.
//!
//! Without them, prompts that share a prefix and arrive while its first prefill is
//! still running see no holder anywhere (the engine has not stored the blocks
//! yet) and scatter. A pending entry makes the replica count as holding the
//! routed chain for the ranker, so those siblings land together.
//!
//! They live beside the store, never in it: they are not entries, so quota,
//! `/snapshot` counts, CRD status and LFU credits never see them, and a replica's
//! AllBlocksCleared or removal drops its pending entries with its real ones.
//! Only the ext_proc path (a request really routed there) records them.

use std::sync::atomic::{AtomicUsize, Ordering};

use hashbrown::HashMap;
use parking_lot::RwLock;
use smallvec::SmallVec;

/// A sensible `loadBalancing.pendingTTL` when turned on: a few prefills long.
pub const PENDING_TTL_NANOS: u64 = 5_000_000_000;

/// Blocks pending per scope at most; past it new chains are not recorded (the
/// worst case is the cache pick's behaviour, never unbounded memory).
pub const MAX_PENDING_BLOCKS: usize = 1 << 16;

/// block hash → the slots it is pending for, each with its expiry (ns).
type Holders = SmallVec<[(u32, u64); 2]>;

#[derive(Debug, Default)]
pub(crate) struct Pending {
    blocks: RwLock<HashMap<u64, Holders>>,
    /// Blocks recorded (live or expired, until purged): lets lookups skip the
    /// lock when nothing is pending, the common case in a steady state.
    len: AtomicUsize,
}

impl Pending {
    /// Records `chain` (from block 0) as pending for `slot` until `now + ttl`.
    pub fn record(&self, slot: u32, chain: &[u64], now: u64, ttl: u64) {
        if chain.is_empty() || ttl == 0 {
            return;
        }
        let expires = now.saturating_add(ttl);
        let mut blocks = self.blocks.write();
        if blocks.len() + chain.len() > MAX_PENDING_BLOCKS {
            blocks.retain(|_, h| {
                h.retain(|(_, e)| *e > now);
                !h.is_empty()
            });
            if blocks.len() + chain.len() > MAX_PENDING_BLOCKS {
                self.len.store(blocks.len(), Ordering::Relaxed);
                return;
            }
        }
        for &hash in chain {
            let holders = blocks.entry(hash).or_default();
            match holders.iter_mut().find(|(s, _)| *s == slot) {
                Some(h) => h.1 = expires,
                None => holders.push((slot, expires)),
            }
        }
        self.len.store(blocks.len(), Ordering::Relaxed);
    }

    /// Whether any chain is recorded (live or expired, until purged).
    pub fn is_active(&self) -> bool {
        self.len.load(Ordering::Relaxed) > 0
    }

    /// Extends `runs[member]` (the leading run each serving member really holds)
    /// with the blocks of `chain` pending for it right after that run. Pending
    /// never outweighs what engines report: only members whose real run is the
    /// longest (often 0: nobody holds the prefix yet) are extended, so a replica
    /// that really holds more of the chain always keeps its lead.
    /// `slots[member]` is the member's slot.
    pub fn extend_runs(&self, chain: &[u64], slots: &[u32], runs: &mut [u32], now: u64) {
        if self.len.load(Ordering::Relaxed) == 0 || chain.is_empty() {
            return;
        }
        let longest = runs.iter().copied().max().unwrap_or(0);
        let blocks = self.blocks.read();
        for (member, &slot) in slots.iter().enumerate() {
            let Some(r) = runs.get_mut(member) else {
                continue;
            };
            if *r < longest {
                continue;
            }
            let from = *r as usize;
            let pending = chain
                .iter()
                .skip(from)
                .take_while(|h| {
                    blocks
                        .get(*h)
                        .is_some_and(|hs| hs.iter().any(|&(s, e)| s == slot && e > now))
                })
                .count();
            *r = u32::try_from(from + pending).unwrap_or(u32::MAX);
        }
    }

    /// The engine stored these blocks on `slot`: its real entries take over.
    pub fn confirm(&self, slot: u32, hashes: &[u64]) {
        if self.len.load(Ordering::Relaxed) == 0 {
            return;
        }
        let mut blocks = self.blocks.write();
        for h in hashes {
            if let Some(holders) = blocks.get_mut(h) {
                holders.retain(|(s, _)| *s != slot);
                if holders.is_empty() {
                    blocks.remove(h);
                }
            }
        }
        self.len.store(blocks.len(), Ordering::Relaxed);
    }

    /// AllBlocksCleared or removal of `slot`: nothing of it stays pending.
    pub fn forget_slot(&self, slot: u32) {
        if self.len.load(Ordering::Relaxed) == 0 {
            return;
        }
        let mut blocks = self.blocks.write();
        blocks.retain(|_, h| {
            h.retain(|(s, _)| *s != slot);
            !h.is_empty()
        });
        self.len.store(blocks.len(), Ordering::Relaxed);
    }

    /// Drops expired pending blocks (maintenance).
    pub fn purge(&self, now: u64) {
        if self.len.load(Ordering::Relaxed) == 0 {
            return;
        }
        let mut blocks = self.blocks.write();
        blocks.retain(|_, h| {
            h.retain(|(_, e)| *e > now);
            !h.is_empty()
        });
        self.len.store(blocks.len(), Ordering::Relaxed);
    }

    /// Blocks currently recorded (including expired ones not yet purged).
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.len.load(Ordering::Relaxed)
    }
}
