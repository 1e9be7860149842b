//! The chain walk of a lookup: for every serving replica, how many leading blocks
//! of the request chain it holds (m_r of docs/decision.md, "The steps", step 7).
//!
//! `alive` is the set of replicas holding the whole run so far, as a bitset over
//! replica slots: each block costs one AND (shared blocks carry a slot mask, see
//! `entry.rs`), and a replica drops out at the first block it lacks. The walk
//! stops as soon as nobody is left, or at the first block the scope does not have.

use std::time::Instant;

use super::entry::fresh_from;
use super::lock::Timeout;
use super::store::{EntryRef, Store};

/// How often (in blocks) a long walk checks its deadline.
const DEADLINE_STRIDE: usize = 1024;

pub(crate) struct LeadingRuns<'a> {
    pub store: &'a Store,
    /// The scope's orphan shard while it has entries: where the walk goes on
    /// when a block is not in `store` (no block is in both; `scope.rs`).
    pub orphans: Option<&'a Store>,
    /// Serving (and candidate) replicas as a bitset over slots.
    pub serving: &'a [u64],
    pub now: u64,
    pub ttl: u64,
    pub deadline: Option<Instant>,
}

impl LeadingRuns<'_> {
    /// Fills `slot_runs[slot]` with the run length of every serving slot (others
    /// are left alone). `alive` and `held` are scratch bitsets of the serving
    /// set's width.
    #[inline]
    pub fn run<B: AsMut<[u64]> + AsRef<[u64]>>(
        &self,
        alive: B,
        held: B,
        chain: &[u64],
        slot_runs: &mut [u32],
    ) -> Result<(), Timeout> {
        // A chain shorter than the stride never reaches a deadline check: its
        // walk is compiled without one.
        if self.deadline.is_some() && chain.len() >= DEADLINE_STRIDE {
            self.run_timed::<true, B>(alive, held, chain, slot_runs)
        } else {
            self.run_timed::<false, B>(alive, held, chain, slot_runs)
        }
    }

    #[inline]
    fn run_timed<const TIMED: bool, B: AsMut<[u64]> + AsRef<[u64]>>(
        &self,
        mut alive: B,
        mut held: B,
        chain: &[u64],
        slot_runs: &mut [u32],
    ) -> Result<(), Timeout> {
        let (alive_w, held_w) = (alive.as_mut(), held.as_mut());
        // Same width as the scratch sets, so the per-word loop has a known length.
        let serving = &self.serving[..alive_w.len()];
        let mut timed_out = false;
        // The holders of the block before: a block with the very same holders (most
        // of a run stored by one event) cannot drop anyone, so it needs no mask.
        // (Per store: a spilled holder list is an index into its store's lists.)
        let mut previous = None;
        let mut visit = |i: usize, e: EntryRef<'_>, previous: &mut Option<_>| {
            if TIMED
                && i % DEADLINE_STRIDE == DEADLINE_STRIDE - 1
                && self.deadline.is_some_and(|d| Instant::now() >= d)
            {
                timed_out = true;
                return false;
            }
            if !e.is_fresh(self.now, self.ttl) {
                return false;
            }
            if *previous == Some(e.holders) {
                return true;
            }
            *previous = Some(e.holders);
            holders_into(e, held_w);
            let mut any = 0u64;
            for (w, ((a, h), s)) in alive_w
                .iter_mut()
                .zip(held_w.iter())
                .zip(serving)
                .enumerate()
            {
                let holding = h & s;
                let kept = if i == 0 { holding } else { *a & holding };
                let mut dropped = *a & !kept;
                while dropped != 0 {
                    let bit = dropped.trailing_zeros() as usize;
                    slot_runs[w * 64 + bit] = i as u32;
                    dropped &= dropped - 1;
                }
                *a = kept;
                any |= kept;
            }
            any != 0
        };
        // The untimed walk passes over blocks that repeat the holders before them
        // (the visit would return at once); the timed one visits every block, for
        // the deadline checks. A walk that ends at a block its store lacks goes on
        // in the orphan shard when that has the block, and back.
        let (mut store, mut other) = (self.store, self.orphans);
        let mut from = 0;
        let end = loop {
            let mut stopped = false;
            let step = |i: usize, e: EntryRef<'_>| {
                let go = visit(from + i, e, &mut previous);
                stopped |= !go;
                go
            };
            let part = &chain[from..];
            let end = from
                + if TIMED {
                    store.walk(part, step)
                } else {
                    store.walk_grouped(part, fresh_from(self.now, self.ttl), step)
                };
            match other {
                Some(o) if !stopped && end < chain.len() && o.block(chain[end]).is_some() => {
                    (store, other, from, previous) = (o, Some(store), end, None);
                }
                _ => break end,
            }
        };
        finish(timed_out, alive_w, end, slot_runs)
    }
}

/// The members still alive where the walk ended hold the chain up to `end`.
#[inline]
fn finish(
    timed_out: bool,
    alive: &[u64],
    end: usize,
    slot_runs: &mut [u32],
) -> Result<(), Timeout> {
    if timed_out {
        return Err(Timeout);
    }
    for (w, &word) in alive.iter().enumerate() {
        let mut bits = word;
        while bits != 0 {
            let bit = bits.trailing_zeros() as usize;
            slot_runs[w * 64 + bit] = end as u32;
            bits &= bits - 1;
        }
    }
    Ok(())
}

/// The entry's holders as a bitset over slots.
#[inline]
fn holders_into(e: EntryRef<'_>, held: &mut [u64]) {
    let holders = e.holders();
    match holders.low_mask() {
        Some(mask) if held.len() == 1 => held[0] = mask,
        _ => {
            held.iter_mut().for_each(|w| *w = 0);
            for slot in holders.slots() {
                if let Some(w) = held.get_mut(slot as usize / 64) {
                    *w |= 1 << (slot % 64);
                }
            }
        }
    }
}
