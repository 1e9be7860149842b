//! Engine events → [`IndexEvent`]s for one replica, per the scope's hash scheme.
//!
//! - `ic-content-v1`: the engine's hashes are not what clients compute, so each
//!   stored block gets its own content value ([`chain::content_block`]) from the
//!   event's `token_ids`, continuing from the parent's *own* value. The engine hash →
//!   own values map is kept (reference-counted, as engines store and remove the same
//!   hash more than once) to translate removals and later parents; removals and
//!   clears drop mappings, and a map over its bound clears the replica rather than
//!   grow without limit.
//!
//!   An engine hash is not always a chain position: SGLang 0.5.3 names a page by a
//!   hash of its own tokens only, so the same engine hash arrives under different
//!   parents. The own value is therefore always recomputed from the resolved own
//!   parent and the tokens (so it *is* the position), and an engine hash maps to
//!   every own value it was stored as, each with its own count, most recently
//!   stored last:
//!   - a parent resolves to the engine hash's most recently stored own value (an
//!     engine publishes one request's pages in order, so that is the page stored
//!     just before this one);
//!   - a removal, which names only the engine hash, takes one reference from the
//!     *least* recently stored own value (engines evict least recently used pages
//!     first). When one engine hash has several positions this is a guess; a wrong
//!     guess leaves one entry that the TTL removes. Engines whose hashes chain
//!     (vLLM, SGLang ≥ 0.5.4) never have more than one position per hash.
//! - `ic-content-v2`: the same, with the content value of
//!   [`content_v2::block_value`] (the block's multimodal and other extra keys in it)
//!   and the index key of [`content_v2::identity_key`]: a run starting at block 0
//!   takes its identity from the event (`lora_name`, else the unnamed `lora_id`,
//!   and the salt: SGLang's `cache_salt`, vLLM's in block 0's extra keys); a run
//!   continuing a parent inherits the parent's (vLLM hashes the salt into block 0
//!   only, so later events do not carry it). Each position keeps content value and
//!   identity digest, so continuations chain on content and key on identity, as a
//!   client's request does.
//! - any other scheme (`vllm-sha256-cbor`, `engine-raw`, …): the engine's hashes
//!   are the chain; they pass through.
//!
//! Media: "GPU" (or none) is the main pool. CPU (vLLM `"CPU"`, SGLang
//! `"CPU_PINNED"`) and disk media become [`IndexEvent::TierStored`] /
//! [`IndexEvent::TierRemoved`]; other media are skipped. An offloaded block
//! rarely carries tokens (vLLM's offload events have none), so under
//! `ic-content-v1` it takes the own value of its GPU store: its mapping, or, when
//! the GPU removal came first (vLLM sends BlockRemoved GPU, then BlockStored CPU),
//! the value that removal just retired. A lower-tier copy holds a mapping
//! reference like a GPU one.

use std::collections::HashMap;

/// The maps' hasher: a lookup or two per block, so the default SipHash is a cost
/// worth avoiding; foldhash is still seeded at random per process.
type Hasher = foldhash::fast::RandomState;

use smallvec::SmallVec;

mod own;
use own::{OwnTable, Stored};

use crate::adapters::kv_events::decode::{EngineEvent, StoredIdentity};
use crate::core::chain::{self, Extra, Scheme, content_v2};
use crate::core::index::{IndexEvent, Tier};

/// Default bound on engine → own mappings per replica (a few million blocks is far
/// beyond one engine's GPU pool).
pub const DEFAULT_MAX_MAPPINGS: usize = 1 << 22;

/// What one translation left out.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Skipped {
    /// Other media, an unknown parent, or tokens that do not cover the blocks.
    pub events: u32,
    /// The mapping bound was hit and the replica was cleared.
    pub overflowed: bool,
}

/// Translation state of one replica.
#[derive(Debug)]
pub struct ReplicaChains {
    /// `ic-content-v1` or `-v2` (own chain); `None`: pass through.
    content: Option<Scheme>,
    /// engine hash → its own values (positions), least recently stored first.
    own: OwnTable,
    /// Positions over all engine hashes.
    positions: usize,
    max_mappings: usize,
    /// engine hash → own value of positions whose last reference went, newest
    /// generation first; a generation fills to [`RETIRED_GENERATION`] and then
    /// replaces the older one, so an offload right after its GPU removal still
    /// resolves.
    retired: [HashMap<u64, (u64, u64), Hasher>; 2],
    /// Scratch: one event's content values (kept to allocate once).
    contents: Vec<u64>,
}

/// Retired mappings kept per generation.
const RETIRED_GENERATION: usize = 1 << 12;

/// One own-chain position an engine hash was stored as, and how many times.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Position {
    /// The content value (what a client's chain holds; children chain on it).
    content: u64,
    /// The identity digest (`ic-content-v2`), 0 for none (digests are never 0).
    identity: u64,
    refs: u32,
}

impl Position {
    /// The index key.
    fn value(&self) -> u64 {
        content_v2::identity_key((self.identity != 0).then_some(self.identity), self.content)
    }
}

impl ReplicaChains {
    pub fn new(hash_scheme: &str, max_mappings: usize) -> Self {
        Self {
            content: Scheme::from_name(hash_scheme)
                .filter(|s| matches!(s, Scheme::ContentV1 | Scheme::ContentV2)),
            own: OwnTable::default(),
            positions: 0,
            max_mappings,
            retired: Default::default(),
            contents: Vec::new(),
        }
    }

    /// (engine hash, own value) positions currently mapped (always 0 for
    /// pass-through schemes).
    pub fn mappings(&self) -> usize {
        self.positions
    }

    /// Forgets everything (the replica was cleared or restarted).
    pub fn reset(&mut self) {
        self.own = OwnTable::default();
        self.positions = 0;
        self.retired = Default::default();
    }

    /// Appends the index events of `events` to `out`, in order.
    pub fn translate(&mut self, events: &[EngineEvent], out: &mut Vec<IndexEvent>) -> Skipped {
        let mut skipped = Skipped::default();
        for event in events {
            let applied = match event {
                EngineEvent::AllBlocksCleared => {
                    self.reset();
                    out.push(IndexEvent::Cleared);
                    true
                }
                EngineEvent::BlockStored {
                    medium,
                    block_hashes,
                    ..
                } if !main_pool(medium.as_deref()) => {
                    self.lower_tier(medium.as_deref(), block_hashes, Held::Stored, out)
                }
                EngineEvent::BlockRemoved {
                    medium,
                    block_hashes,
                } if !main_pool(medium.as_deref()) => {
                    self.lower_tier(medium.as_deref(), block_hashes, Held::Removed, out)
                }
                EngineEvent::BlockStored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    block_size,
                    identity,
                    ..
                } => {
                    if let Some(scheme) = self.content {
                        self.store_content(
                            scheme,
                            block_hashes,
                            *parent_block_hash,
                            token_ids,
                            *block_size,
                            identity.as_deref(),
                            out,
                        )
                    } else if block_hashes.is_empty() {
                        false
                    } else {
                        out.push(IndexEvent::Stored {
                            parent: *parent_block_hash,
                            hashes: block_hashes.clone(),
                            token_counts: Vec::new(),
                        });
                        true
                    }
                }
                EngineEvent::BlockRemoved { block_hashes, .. } => {
                    let hashes = if self.content.is_some() {
                        self.remove_content(block_hashes)
                    } else {
                        block_hashes.clone()
                    };
                    let any = !hashes.is_empty();
                    if any {
                        out.push(IndexEvent::Removed { hashes });
                    }
                    any
                }
            };
            if !applied {
                skipped.events += 1;
            }
            if self.positions > self.max_mappings {
                self.reset();
                out.push(IndexEvent::Cleared);
                skipped.overflowed = true;
            }
        }
        skipped
    }

    #[allow(clippy::too_many_arguments)]
    fn store_content(
        &mut self,
        scheme: Scheme,
        block_hashes: &[u64],
        parent: Option<u64>,
        token_ids: &[u32],
        block_size: u32,
        identity: Option<&StoredIdentity>,
        out: &mut Vec<IndexEvent>,
    ) -> bool {
        let bs = block_size as usize;
        if block_hashes.is_empty() || token_ids.len() != block_hashes.len() * bs {
            return false;
        }
        let v2 = scheme == Scheme::ContentV2;
        // (content, identity) of the parent position.
        let (mut own_parent, digest, first_parent) = match parent {
            None => (None, if v2 { root_identity(identity) } else { 0 }, None),
            // The most recently stored position of the parent's engine hash.
            Some(p) => match self.own.last(p) {
                Some(pos) => (Some(pos.content), pos.identity, Some(pos.value())),
                // The parent was stored before we listened: its own value is unknown.
                None => return false,
            },
        };
        let extras = identity.map_or(&[][..], |i| i.extras.as_slice());
        let mut keys: SmallVec<[Extra<'_>; 4]> = SmallVec::new();
        // Two passes. First the values, which need only the parent and the tokens
        // (the map is not read): xxh3 or SHA-256 per block, compute only. Then the
        // map, in a loop of nothing but map updates, so the processor can overlap
        // one block's cache misses in the table (an entry per engine hash, as large
        // as the engine's pool) with the next blocks'; interleaved with the hashing
        // they were paid one after another. The updates are in the same order as
        // before, so the map ends the same.
        let mut contents = std::mem::take(&mut self.contents);
        contents.clear();
        let mut hashes = Vec::with_capacity(block_hashes.len());
        for (i, tokens) in token_ids.chunks_exact(bs).enumerate() {
            // Recomputed every time: the value names the position (parent + tokens),
            // whatever the engine hash does.
            let content = if v2 {
                keys.clear();
                if let Some(block) = extras.get(i) {
                    keys.extend(block.iter().map(|k| k.as_extra()));
                }
                content_v2::block_value(own_parent, tokens, &keys)
            } else {
                chain::content_block(own_parent, tokens)
            };
            contents.push(content);
            hashes.push(
                Position {
                    content,
                    identity: digest,
                    refs: 1,
                }
                .value(),
            );
            own_parent = Some(content);
        }
        // One growth for the whole event rather than one per threshold crossed.
        self.own.reserve(block_hashes.len());
        for (engine, &content) in block_hashes.iter().zip(&contents) {
            if self.own.store(*engine, content, digest) == Stored::New {
                self.positions += 1;
            }
        }
        self.contents = contents;
        out.push(IndexEvent::Stored {
            parent: first_parent,
            hashes,
            token_counts: Vec::new(),
        });
        true
    }

    fn remove_content(&mut self, block_hashes: &[u64]) -> Vec<u64> {
        let mut hashes = Vec::with_capacity(block_hashes.len());
        let mut retired = Vec::new();
        for engine in block_hashes {
            // The least recently stored position (see the module docs).
            let Some((first, went)) = self.own.release_first(*engine) else {
                continue;
            };
            hashes.push(first.value());
            if went {
                retired.push((*engine, (first.content, first.identity)));
                self.positions -= 1;
            }
        }
        for (engine, value) in retired {
            self.retire(engine, value);
        }
        hashes
    }
}

/// Whether a lower-tier event stored or removed its blocks.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Held {
    Stored,
    Removed,
}

impl ReplicaChains {
    /// A store or removal in a lower tier (other media are skipped): own values
    /// under a content scheme, engine hashes otherwise. Returns whether anything
    /// was sent on.
    fn lower_tier(
        &mut self,
        medium: Option<&str>,
        block_hashes: &[u64],
        held: Held,
        out: &mut Vec<IndexEvent>,
    ) -> bool {
        let Some(tier) = tier_of(medium) else {
            return false;
        };
        let hashes = match (self.content.is_some(), held) {
            (false, _) => block_hashes.to_vec(),
            (true, Held::Stored) => self.store_lower(block_hashes),
            (true, Held::Removed) => self.remove_content(block_hashes),
        };
        if hashes.is_empty() {
            return false;
        }
        out.push(match held {
            Held::Stored => IndexEvent::TierStored { tier, hashes },
            Held::Removed => IndexEvent::TierRemoved { tier, hashes },
        });
        true
    }

    /// Remembers a position (content, identity) whose last reference went (see
    /// `retired`).
    fn retire(&mut self, engine: u64, position: (u64, u64)) {
        if self.retired[0].len() >= RETIRED_GENERATION {
            self.retired[1] = std::mem::take(&mut self.retired[0]);
        }
        self.retired[0].insert(engine, position);
    }

    /// Own values of blocks stored in a lower tier, by their engine hashes: the
    /// most recent position, else a just-retired one (which is mapped again).
    /// Unknown hashes are left out.
    fn store_lower(&mut self, block_hashes: &[u64]) -> Vec<u64> {
        let mut hashes = Vec::with_capacity(block_hashes.len());
        for engine in block_hashes {
            if let Some(pos) = self.own.bump_last(*engine) {
                hashes.push(pos.value());
                continue;
            }
            let retired = self.retired.iter().find_map(|g| g.get(engine).copied());
            if let Some((content, identity)) = retired {
                // Not mapped (else it had a last position): a new mapping.
                self.own.store(*engine, content, identity);
                self.positions += 1;
                hashes.push(
                    Position {
                        content,
                        identity,
                        refs: 1,
                    }
                    .value(),
                );
            }
        }
        hashes
    }
}

/// The lower tier a medium names: CPU memory (vLLM "CPU", SGLang "CPU_PINNED"
/// and other "CPU…"/"HOST…" spellings) or disk ("DISK", "SSD", "NVME", "STORAGE").
fn tier_of(medium: Option<&str>) -> Option<Tier> {
    let m = medium?.to_ascii_uppercase();
    if m.starts_with("CPU") || m.starts_with("HOST") {
        Some(Tier::Cpu)
    } else if ["DISK", "SSD", "NVME", "STORAGE"]
        .iter()
        .any(|d| m.starts_with(d))
    {
        Some(Tier::Disk)
    } else {
        None
    }
}

/// The identity digest of a run starting at block 0 (0: none): the adapter by
/// name, else by the engine's id (matching no request), and the salt.
fn root_identity(identity: Option<&StoredIdentity>) -> u64 {
    let Some(id) = identity else { return 0 };
    let salt = id.cache_salt.as_deref().unwrap_or("");
    match (id.lora_name.as_deref(), id.lora_id) {
        (Some(name), _) => content_v2::identity_digest(name, salt).unwrap_or(0),
        (None, Some(lora_id)) => content_v2::unnamed_adapter_digest(lora_id, salt),
        (None, None) => content_v2::identity_digest("", salt).unwrap_or(0),
    }
}

/// "GPU" (or no medium) is the main pool.
fn main_pool(medium: Option<&str>) -> bool {
    medium.is_none_or(|m| m.eq_ignore_ascii_case("gpu"))
}

#[cfg(test)]
mod tests;
