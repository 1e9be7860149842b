//! The simulated engine's prefix KV cache: a fixed number of blocks keyed by
//! vLLM's `sha256_cbor` block hashes, evicted least recently used first.
//!
//! Pure and synchronous; the engine calls it once per request under its lock and
//! turns each [`Admission`] into KV events, so the events it publishes describe
//! exactly what this cache holds.
//!
//! ```text
//!  prompt tokens ──chain (sha256_cbor, seed)──▶ h0 h1 h2 h3 …
//!  lookup: longest run h0..hk present            (no side effects)
//!  admit:  touch h0..hk, evict LRU tails, insert hk+1..  ──▶ Admission
//!
//!  recency list  front (MRU) ◀── h0 h1 … hk hk+1 … ──▶ back (evicted first)
//! ```
//!
//! Like vLLM, a request's blocks are released tail first, so when a prompt
//! touches blocks `0..n` its later blocks are older than its earlier ones: a
//! parent is always at least as recent as its children and eviction takes
//! tails before heads. Blocks are never shared by value here (one node per
//! hash; re-storing a present hash is not modelled), so every store is
//! matched by exactly one removal.
//!
//! Lookups walk the chain from block 0, so a block whose parent is gone is
//! unreachable even though it still occupies a slot until evicted (as in vLLM).
//! Every operation is O(1) per block: a hash map to slab slots plus an
//! intrusive doubly linked recency list.

use hashbrown::HashMap;
use thiserror::Error;

use inferencecache_core::chain::{digest_value, vllm_block_digest, vllm_none_hash};

/// End of the recency list.
const NIL: usize = usize::MAX;

/// What one admitted prompt did to the cache.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Admission {
    /// Prompt tokens served from the cache (whole blocks; at least one prompt
    /// token is always computed).
    pub cached_tokens: usize,
    /// The blocks inserted for this prompt, if any.
    pub stored: Option<StoredRun>,
    /// Blocks evicted to make room, in eviction order.
    pub removed: Vec<u64>,
}

/// A run of consecutive blocks inserted by one admission: what a `BlockStored`
/// event carries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredRun {
    /// Event values of the blocks' digests, in chain order.
    pub block_hashes: Vec<u64>,
    /// The block before the run; `None` when the run starts at block 0.
    pub parent: Option<u64>,
    /// Exactly the run's tokens: `block_hashes.len() × block_size`.
    pub token_ids: Vec<u32>,
    pub block_size: u32,
}

/// Why a cache could not be built.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum CacheError {
    #[error("block size must be at least 1 token")]
    ZeroBlockSize,
}

#[derive(Clone, Copy, Debug)]
struct Node {
    hash: u64,
    /// Towards the front (more recent).
    prev: usize,
    /// Towards the back (older).
    next: usize,
}

/// A fixed-capacity prefix cache of full blocks.
#[derive(Clone, Debug)]
pub struct PrefixCache {
    block_size: u32,
    capacity: usize,
    /// vLLM's `NONE_HASH` for the seed: the parent digest of block 0.
    none_hash: [u8; 32],
    slots: HashMap<u64, usize>,
    nodes: Vec<Node>,
    free: Vec<usize>,
    front: usize,
    back: usize,
}

impl PrefixCache {
    /// An empty cache of `capacity_blocks` blocks of `block_size` tokens, hashing
    /// like a vLLM engine started with `PYTHONHASHSEED=hash_seed`. A capacity of 0
    /// caches nothing.
    pub fn new(
        capacity_blocks: usize,
        block_size: u32,
        hash_seed: &str,
    ) -> Result<Self, CacheError> {
        if block_size == 0 {
            return Err(CacheError::ZeroBlockSize);
        }
        // Preallocated up to a bound: a huge capacity is a limit, not a size.
        let reserve = capacity_blocks.min(1 << 20);
        Ok(Self {
            block_size,
            capacity: capacity_blocks,
            none_hash: vllm_none_hash(hash_seed),
            slots: HashMap::with_capacity(reserve),
            nodes: Vec::with_capacity(reserve),
            free: Vec::new(),
            front: NIL,
            back: NIL,
        })
    }

    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Blocks held (reachable or not).
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Whether the block with this event value is held.
    pub fn contains(&self, hash: u64) -> bool {
        self.slots.contains_key(&hash)
    }

    /// The chain of event values of `tokens`' full blocks, block 0 first.
    pub fn chain<'a>(&self, tokens: &'a [u32]) -> impl Iterator<Item = u64> + use<'a> {
        let mut parent = self.none_hash;
        tokens
            .chunks_exact(self.block_size as usize)
            .map(move |block| {
                parent = vllm_block_digest(&parent, block);
                digest_value(&parent)
            })
    }

    /// The prompt tokens a request for `tokens` would find cached, without
    /// touching anything: the longest leading run of present blocks × block size,
    /// leaving at least one token to compute.
    pub fn lookup(&self, tokens: &[u32]) -> usize {
        let b = self.block_size as usize;
        let hittable = &tokens[..max_hit_blocks(tokens.len(), b) * b];
        self.chain(hittable)
            .take_while(|h| self.slots.contains_key(h))
            .count()
            * b
    }

    /// Admits a prompt: touches its cached leading blocks, inserts the rest of its
    /// full blocks (as many as fit), evicting least recently used blocks of other
    /// prompts to make room.
    pub fn admit(&mut self, tokens: &[u32]) -> Admission {
        let b = self.block_size as usize;
        let full = tokens.len() / b;
        let mut chain = self.chain(tokens);
        let mut matched = Vec::new();
        let mut first_missing = None;
        for h in chain.by_ref() {
            match self.slots.get(&h) {
                Some(&slot) => matched.push(slot),
                None => {
                    first_missing = Some(h);
                    break;
                }
            }
        }
        let m = matched.len();
        let cached_tokens = m.min(max_hit_blocks(tokens.len(), b)) * b;
        // Block 0 ends up most recent, the last matched block oldest of them.
        for &slot in matched.iter().rev() {
            self.unlink(slot);
            self.push_front(slot);
        }
        let n_new = (full - m).min(self.capacity.saturating_sub(m));
        let new_hashes: Vec<u64> = first_missing.into_iter().chain(chain).take(n_new).collect();
        let mut removed = Vec::new();
        if new_hashes.is_empty() {
            return Admission {
                cached_tokens,
                stored: None,
                removed,
            };
        }
        // A hash of the run may still be held, unreachable because an ancestor was
        // evicted: it is dropped and stored again, so events stay one store per removal.
        for h in &new_hashes {
            if let Some(slot) = self.slots.remove(h) {
                self.unlink(slot);
                self.free.push(slot);
                removed.push(*h);
            }
        }
        // The matched blocks are at the front, and n_new ≤ capacity − m, so the back
        // never reaches them.
        while self.slots.len() + n_new > self.capacity {
            let Some(h) = self.evict_back() else { break };
            removed.push(h);
        }
        let parent_slot = matched.last().copied();
        let mut after = parent_slot.unwrap_or(NIL);
        for &h in &new_hashes {
            let slot = self.alloc(h);
            self.slots.insert(h, slot);
            if after == NIL {
                self.push_front(slot);
            } else {
                self.insert_after(after, slot);
            }
            after = slot;
        }
        Admission {
            cached_tokens,
            stored: Some(StoredRun {
                token_ids: tokens[m * b..(m + new_hashes.len()) * b].to_vec(),
                parent: parent_slot.map(|s| self.nodes[s].hash),
                block_hashes: new_hashes,
                block_size: self.block_size,
            }),
            removed,
        }
    }

    /// Drops every block.
    pub fn clear(&mut self) {
        self.slots.clear();
        self.nodes.clear();
        self.free.clear();
        self.front = NIL;
        self.back = NIL;
    }

    /// Held blocks from most to least recently used.
    pub fn recency(&self) -> impl Iterator<Item = u64> + '_ {
        let mut at = self.front;
        std::iter::from_fn(move || {
            let node = self.nodes.get(at)?;
            at = node.next;
            Some(node.hash)
        })
    }

    /// Drops one block as if it had been evicted, orphaning its children (tests
    /// build unreachable blocks with it).
    #[cfg(test)]
    fn forget(&mut self, hash: u64) -> bool {
        let Some(slot) = self.slots.remove(&hash) else {
            return false;
        };
        self.unlink(slot);
        self.free.push(slot);
        true
    }

    fn alloc(&mut self, hash: u64) -> usize {
        let node = Node {
            hash,
            prev: NIL,
            next: NIL,
        };
        match self.free.pop() {
            Some(slot) => {
                self.nodes[slot] = node;
                slot
            }
            None => {
                self.nodes.push(node);
                self.nodes.len() - 1
            }
        }
    }

    fn evict_back(&mut self) -> Option<u64> {
        let slot = self.back;
        let hash = self.nodes.get(slot)?.hash;
        self.unlink(slot);
        self.slots.remove(&hash);
        self.free.push(slot);
        Some(hash)
    }

    fn unlink(&mut self, slot: usize) {
        let Node { prev, next, .. } = self.nodes[slot];
        match prev {
            NIL => self.front = next,
            p => self.nodes[p].next = next,
        }
        match next {
            NIL => self.back = prev,
            n => self.nodes[n].prev = prev,
        }
        self.nodes[slot].prev = NIL;
        self.nodes[slot].next = NIL;
    }

    fn push_front(&mut self, slot: usize) {
        self.nodes[slot].prev = NIL;
        self.nodes[slot].next = self.front;
        match self.front {
            NIL => self.back = slot,
            f => self.nodes[f].prev = slot,
        }
        self.front = slot;
    }

    fn insert_after(&mut self, at: usize, slot: usize) {
        let next = self.nodes[at].next;
        self.nodes[slot].prev = at;
        self.nodes[slot].next = next;
        self.nodes[at].next = slot;
        match next {
            NIL => self.back = slot,
            n => self.nodes[n].prev = slot,
        }
    }
}

/// Whole blocks that may count as cached for a prompt of `len` tokens: at least
/// one token is always computed, so a prompt ending on a block boundary cannot
/// hit its last block.
fn max_hit_blocks(len: usize, block_size: usize) -> usize {
    len.saturating_sub(1) / block_size
}

#[cfg(test)]
mod tests;
