//! A byte-bounded LRU map from a text segment to its token ids, for one tokenizer.
//!
//! A Hugging Face tokenizer first splits its input on the added (special) tokens
//! and tokenizes each segment between them on its own, so a segment's ids do not
//! depend on its neighbours: a chat whose messages are delimited by special tokens
//! (Qwen's `<|im_start|>`…`<|im_end|>`, Llama 3's header tokens) reuses the ids of
//! a repeated system prompt instead of re-running BPE on it. When that holds for a
//! tokenizer is [`super::tokenizer`]'s business; this module only keeps entries.
//!
//! The bound is on bytes (key text + ids + a fixed overhead per entry), not on
//! entries: one 100 KB system prompt weighs as much as a thousand short ones.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use lru::LruCache;
use parking_lot::Mutex;

/// Default bound of one tokenizer's cache: room for a few hundred long system
/// prompts (a 32k-token prompt weighs ~260 KB: ~130 KB of text, 128 KB of ids).
pub const DEFAULT_CACHE_BYTES: usize = 64 << 20;

/// Bookkeeping bytes counted per entry on top of its text and ids (hash-map
/// slot, list links, the `Arc` header).
const ENTRY_OVERHEAD: usize = 96;

/// Hit and miss counts and the current size, for `/metrics` and `/policy`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub hits: u64,
    pub misses: u64,
    pub entries: u64,
    pub bytes: u64,
}

#[derive(Debug)]
struct Entries {
    map: LruCache<Box<str>, Arc<[u32]>>,
    bytes: usize,
}

/// See the module docs. Shared by every request using the tokenizer; the lock is
/// held for a lookup or an insert, never while tokenizing.
#[derive(Debug)]
pub struct SegmentCache {
    entries: Mutex<Entries>,
    capacity: usize,
    hits: AtomicU64,
    misses: AtomicU64,
}

fn weight(segment: &str, ids: &[u32]) -> usize {
    segment.len() + std::mem::size_of_val(ids) + ENTRY_OVERHEAD
}

impl SegmentCache {
    /// A cache holding at most `capacity` bytes. A segment weighing more than a
    /// quarter of it is not cached (it would evict everything for one request).
    pub fn new(capacity: usize) -> Self {
        Self {
            entries: Mutex::new(Entries {
                map: LruCache::unbounded(),
                bytes: 0,
            }),
            capacity,
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        }
    }

    /// The ids of `segment`, or `encode`'s (then kept). An error of `encode` is
    /// returned and nothing is kept.
    pub fn get_or_encode<E>(
        &self,
        segment: &str,
        encode: impl FnOnce(&str) -> Result<Vec<u32>, E>,
    ) -> Result<Arc<[u32]>, E> {
        if let Some(ids) = self.entries.lock().map.get(segment) {
            self.hits.fetch_add(1, Ordering::Relaxed);
            return Ok(ids.clone());
        }
        self.misses.fetch_add(1, Ordering::Relaxed);
        let ids: Arc<[u32]> = encode(segment)?.into();
        let w = weight(segment, &ids);
        if w <= self.capacity / 4 {
            let mut e = self.entries.lock();
            // Another request may have put it meanwhile: replace, counting once.
            if let Some(old) = e.map.put(segment.into(), ids.clone()) {
                e.bytes -= weight(segment, &old);
            }
            e.bytes += w;
            while e.bytes > self.capacity {
                let Some((k, v)) = e.map.pop_lru() else { break };
                e.bytes -= weight(&k, &v);
            }
        }
        Ok(ids)
    }

    pub fn stats(&self) -> CacheStats {
        let e = self.entries.lock();
        CacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            entries: e.map.len() as u64,
            bytes: e.bytes as u64,
        }
    }
}

#[cfg(test)]
mod tests;
