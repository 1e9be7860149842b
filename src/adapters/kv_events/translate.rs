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
mod tests {
    use super::*;
    use crate::core::chain::{IC_CONTENT_V1, VLLM_SHA256_CBOR, compute_chain};

    fn stored(hashes: &[u64], parent: Option<u64>, tokens: std::ops::Range<u32>) -> EngineEvent {
        EngineEvent::BlockStored {
            block_hashes: hashes.to_vec(),
            parent_block_hash: parent,
            token_ids: tokens.collect(),
            block_size: 4,
            medium: Some("GPU".into()),
            identity: None,
        }
    }

    fn removed(hashes: &[u64]) -> EngineEvent {
        EngineEvent::BlockRemoved {
            block_hashes: hashes.to_vec(),
            medium: None,
        }
    }

    #[test]
    fn content_chain_matches_what_a_client_computes() {
        let mut r = ReplicaChains::new(IC_CONTENT_V1, 100);
        let mut out = Vec::new();
        // Two events: the second continues from the first's last engine hash.
        let skipped = r.translate(
            &[
                stored(&[900, 901], None, 0..8),
                stored(&[902], Some(901), 8..12),
            ],
            &mut out,
        );
        assert_eq!(skipped, Skipped::default());
        let client =
            compute_chain(Scheme::ContentV1, &(0..12).collect::<Vec<_>>(), 4, None).unwrap();
        assert_eq!(
            out,
            vec![
                IndexEvent::Stored {
                    parent: None,
                    hashes: client[..2].to_vec(),
                    token_counts: vec![]
                },
                IndexEvent::Stored {
                    parent: Some(client[1]),
                    hashes: vec![client[2]],
                    token_counts: vec![]
                },
            ]
        );
        assert_eq!(r.mappings(), 3);
    }

    #[test]
    fn removals_use_the_own_values_and_are_reference_counted() {
        let mut r = ReplicaChains::new(IC_CONTENT_V1, 100);
        let mut out = Vec::new();
        r.translate(
            &[stored(&[1], None, 0..4), stored(&[1], None, 0..4)],
            &mut out,
        );
        let own = content_block_of(0..4);
        out.clear();
        r.translate(&[removed(&[1])], &mut out);
        assert_eq!(out, vec![IndexEvent::Removed { hashes: vec![own] }]);
        assert_eq!(r.mappings(), 1, "still referenced once");
        out.clear();
        r.translate(&[removed(&[1])], &mut out);
        assert_eq!(out, vec![IndexEvent::Removed { hashes: vec![own] }]);
        assert_eq!(r.mappings(), 0);
        // A third removal knows nothing: skipped, nothing emitted.
        out.clear();
        assert_eq!(r.translate(&[removed(&[1])], &mut out).events, 1);
        assert!(out.is_empty());
    }

    fn content_block_of(t: std::ops::Range<u32>) -> u64 {
        chain::content_block(None, &t.collect::<Vec<_>>())
    }

    #[test]
    fn unknown_parent_short_tokens_and_unmapped_or_unknown_media_are_skipped() {
        let mut r = ReplicaChains::new(IC_CONTENT_V1, 100);
        let mut out = Vec::new();
        let cpu = EngineEvent::BlockStored {
            block_hashes: vec![5],
            parent_block_hash: None,
            token_ids: (0..4).collect(),
            block_size: 4,
            medium: Some("CPU".into()),
            identity: None,
        };
        let unknown = EngineEvent::BlockRemoved {
            block_hashes: vec![5],
            medium: Some("TAPE".into()),
        };
        // The CPU block was never stored on GPU here: its own value is unknown.
        let s = r.translate(
            &[
                stored(&[2], Some(77), 0..4),
                stored(&[3, 4], None, 0..7),
                cpu,
                unknown,
            ],
            &mut out,
        );
        assert_eq!(s.events, 4);
        assert!(out.is_empty());
        assert_eq!(r.mappings(), 0);
    }

    fn on(medium: &str, stored: bool, hashes: &[u64]) -> EngineEvent {
        if stored {
            EngineEvent::BlockStored {
                block_hashes: hashes.to_vec(),
                parent_block_hash: None,
                token_ids: Vec::new(),
                block_size: 4,
                medium: Some(medium.into()),
                identity: None,
            }
        } else {
            EngineEvent::BlockRemoved {
                block_hashes: hashes.to_vec(),
                medium: Some(medium.into()),
            }
        }
    }

    #[test]
    fn an_offload_after_its_gpu_removal_keeps_the_own_value() {
        let mut r = ReplicaChains::new(IC_CONTENT_V1, 100);
        let mut out = Vec::new();
        r.translate(&[stored(&[1, 2], None, 0..8)], &mut out);
        let own = compute_chain(Scheme::ContentV1, &(0..8).collect::<Vec<_>>(), 4, None).unwrap();
        out.clear();
        // vLLM: BlockRemoved GPU, then BlockStored CPU (no tokens).
        let s = r.translate(&[removed(&[2]), on("CPU", true, &[2])], &mut out);
        assert_eq!(s, Skipped::default());
        assert_eq!(
            out,
            vec![
                IndexEvent::Removed {
                    hashes: vec![own[1]]
                },
                IndexEvent::TierStored {
                    tier: Tier::Cpu,
                    hashes: vec![own[1]]
                },
            ]
        );
        assert_eq!(r.mappings(), 2, "the CPU copy holds the mapping again");
        out.clear();
        // SGLang's spelling, offloaded while still on GPU; then both go.
        r.translate(
            &[
                on("CPU_PINNED", true, &[1]),
                on("cpu_pinned", false, &[1]),
                on("CPU", false, &[2]),
            ],
            &mut out,
        );
        assert_eq!(
            out,
            vec![
                IndexEvent::TierStored {
                    tier: Tier::Cpu,
                    hashes: vec![own[0]]
                },
                IndexEvent::TierRemoved {
                    tier: Tier::Cpu,
                    hashes: vec![own[0]]
                },
                IndexEvent::TierRemoved {
                    tier: Tier::Cpu,
                    hashes: vec![own[1]]
                },
            ]
        );
        assert_eq!(r.mappings(), 1, "block 1 is still on GPU");
    }

    /// Media as the engines' own msgpack carries them: vLLM's array generation
    /// (`"CPU"`) and SGLang's map generation (`"CPU_PINNED"`), pass-through scheme.
    #[test]
    fn media_in_both_wire_shapes_become_tiers() {
        use rmpv::Value;
        let ints = |xs: &[u64]| Value::Array(xs.iter().map(|&x| Value::from(x)).collect());
        let map = |kv: Vec<(&str, Value)>| {
            Value::Map(kv.into_iter().map(|(k, v)| (Value::from(k), v)).collect())
        };
        let events = Value::Array(vec![
            // vLLM: ["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium]
            Value::Array(vec![
                Value::from("BlockStored"),
                ints(&[11, 12]),
                Value::Nil,
                ints(&[]),
                Value::from(16),
                Value::Nil,
                Value::from("CPU"),
            ]),
            Value::Array(vec![
                Value::from("BlockRemoved"),
                ints(&[11]),
                Value::from("CPU"),
            ]),
            // SGLang: tagged maps.
            map(vec![
                ("type", Value::from("BlockStored")),
                ("block_hashes", ints(&[21])),
                ("parent_block_hash", Value::Nil),
                ("token_ids", ints(&(0..16).collect::<Vec<_>>())),
                ("block_size", Value::from(16)),
                ("medium", Value::from("CPU_PINNED")),
            ]),
            map(vec![
                ("type", Value::from("BlockRemoved")),
                ("block_hashes", ints(&[21])),
                ("medium", Value::from("CPU_PINNED")),
            ]),
            map(vec![
                ("type", Value::from("BlockStored")),
                ("block_hashes", ints(&[31])),
                ("token_ids", ints(&(0..16).collect::<Vec<_>>())),
                ("block_size", Value::from(16)),
                ("medium", Value::from("DISK")),
            ]),
        ]);
        let batch = Value::Array(vec![Value::F64(1.0), events, Value::Nil]);
        let mut bytes = Vec::new();
        rmpv::encode::write_value(&mut bytes, &batch).unwrap();
        let decoded = crate::adapters::kv_events::decode::decode_batch(&bytes).unwrap();
        let mut r = ReplicaChains::new(VLLM_SHA256_CBOR, 100);
        let mut out = Vec::new();
        assert_eq!(r.translate(&decoded.events, &mut out), Skipped::default());
        let tier = |tier, stored: bool, h: &[u64]| {
            let hashes = h.to_vec();
            if stored {
                IndexEvent::TierStored { tier, hashes }
            } else {
                IndexEvent::TierRemoved { tier, hashes }
            }
        };
        assert_eq!(
            out,
            vec![
                tier(Tier::Cpu, true, &[11, 12]),
                tier(Tier::Cpu, false, &[11]),
                tier(Tier::Cpu, true, &[21]),
                tier(Tier::Cpu, false, &[21]),
                tier(Tier::Disk, true, &[31]),
            ]
        );
    }

    #[test]
    fn clear_forgets_mappings() {
        let mut r = ReplicaChains::new(IC_CONTENT_V1, 100);
        let mut out = Vec::new();
        r.translate(
            &[stored(&[1, 2], None, 0..8), EngineEvent::AllBlocksCleared],
            &mut out,
        );
        assert_eq!(out.last(), Some(&IndexEvent::Cleared));
        assert_eq!(r.mappings(), 0);
    }

    #[test]
    fn the_mapping_bound_clears_the_replica() {
        let mut r = ReplicaChains::new(IC_CONTENT_V1, 2);
        let mut out = Vec::new();
        let s = r.translate(&[stored(&[1, 2, 3], None, 0..12)], &mut out);
        assert!(s.overflowed);
        assert_eq!(out.last(), Some(&IndexEvent::Cleared));
        assert_eq!(r.mappings(), 0);
    }

    #[test]
    fn other_schemes_pass_engine_hashes_through() {
        for scheme in [VLLM_SHA256_CBOR, "engine-raw", "vllm"] {
            let mut r = ReplicaChains::new(scheme, 100);
            let mut out = Vec::new();
            r.translate(
                &[
                    stored(&[1, 2], Some(9), 0..8),
                    removed(&[2]),
                    EngineEvent::AllBlocksCleared,
                ],
                &mut out,
            );
            assert_eq!(
                out,
                vec![
                    IndexEvent::Stored {
                        parent: Some(9),
                        hashes: vec![1, 2],
                        token_counts: vec![]
                    },
                    IndexEvent::Removed { hashes: vec![2] },
                    IndexEvent::Cleared,
                ]
            );
            assert_eq!(r.mappings(), 0);
        }
    }

    /// SGLang 0.5.3: one BlockStored per page, the engine hash a hash of the page's
    /// own tokens only, the parent the previous page's engine hash.
    fn sglang_053_pages(pages: &[Vec<u32>]) -> Vec<EngineEvent> {
        let page_hash = |t: &[u32]| chain::content_block(None, t) ^ 0x5e5e;
        let mut parent = None;
        pages
            .iter()
            .map(|t| {
                let h = page_hash(t);
                let e = EngineEvent::BlockStored {
                    block_hashes: vec![h],
                    parent_block_hash: parent,
                    token_ids: t.clone(),
                    block_size: 4,
                    medium: None,
                    identity: None,
                };
                parent = Some(h);
                e
            })
            .collect()
    }

    fn own_chain(pages: &[Vec<u32>]) -> Vec<u64> {
        let tokens: Vec<u32> = pages.concat();
        compute_chain(Scheme::ContentV1, &tokens, 4, None).unwrap()
    }

    fn stored_values(out: &[IndexEvent]) -> Vec<u64> {
        out.iter()
            .flat_map(|e| match e {
                IndexEvent::Stored { hashes, .. } => hashes.clone(),
                _ => vec![],
            })
            .collect()
    }

    #[test]
    fn sglang_053_page_hashes_under_two_parents_give_both_chains() {
        let page = |i: u32| (i * 4..i * 4 + 4).collect::<Vec<u32>>();
        // P1 = pages 0..8; P2 = another first page + P1's pages 1..8.
        let p1: Vec<Vec<u32>> = (0..8).map(page).collect();
        let mut p2 = vec![page(100)];
        p2.extend(p1[1..].iter().cloned());
        let mut r = ReplicaChains::new(IC_CONTENT_V1, 100);
        let mut out = Vec::new();
        assert_eq!(
            r.translate(&sglang_053_pages(&p1), &mut out),
            Skipped::default()
        );
        assert_eq!(stored_values(&out), own_chain(&p1));
        out.clear();
        assert_eq!(
            r.translate(&sglang_053_pages(&p2), &mut out),
            Skipped::default()
        );
        // Every page of P2 gets P2's own chain value, not P1's.
        assert_eq!(stored_values(&out), own_chain(&p2));
        assert_eq!(r.mappings(), 16, "pages 1..8 have two positions each");

        // A third prompt continuing P2 resolves its parent to P2's position.
        let mut p3 = p2.clone();
        p3.push(page(200));
        out.clear();
        let mut events = sglang_053_pages(&p3);
        let last = events.pop().unwrap();
        r.translate(&[last], &mut out);
        assert_eq!(stored_values(&out), own_chain(&p3)[8..].to_vec());

        // Evicting P1's pages 1..8 (the engine names them by hash only) removes
        // P1's positions, the least recently stored, and keeps P2's.
        let removed_hashes: Vec<u64> = sglang_053_pages(&p1)[1..]
            .iter()
            .map(|e| match e {
                EngineEvent::BlockStored { block_hashes, .. } => block_hashes[0],
                _ => unreachable!(),
            })
            .collect();
        out.clear();
        r.translate(&[removed(&removed_hashes)], &mut out);
        assert_eq!(
            out,
            vec![IndexEvent::Removed {
                hashes: own_chain(&p1)[1..].to_vec()
            }]
        );
        assert_eq!(r.mappings(), 10, "P1's first page, P2's 8 pages, P3's last");
        // And again: now P2's positions go.
        out.clear();
        r.translate(&[removed(&removed_hashes)], &mut out);
        assert_eq!(
            out,
            vec![IndexEvent::Removed {
                hashes: own_chain(&p2)[1..].to_vec()
            }]
        );
        assert_eq!(r.mappings(), 3);
    }

    #[test]
    fn a_position_stored_twice_counts_twice_even_between_other_positions() {
        let mut r = ReplicaChains::new(IC_CONTENT_V1, 100);
        let mut out = Vec::new();
        // Engine hash 7 stored as (no parent, tokens 0..4), then under parent 1, then
        // again as the first: the first position now has two references.
        r.translate(
            &[
                stored(&[7], None, 0..4),
                stored(&[1], None, 100..104),
                stored(&[7], Some(1), 0..4),
                stored(&[7], None, 0..4),
            ],
            &mut out,
        );
        let a = content_block_of(0..4);
        let b = chain::content_block(
            Some(content_block_of(100..104)),
            &(0..4).collect::<Vec<_>>(),
        );
        assert_eq!(r.mappings(), 3);
        out.clear();
        // Least recently stored first: b (a moved to the end when stored again).
        r.translate(&[removed(&[7]), removed(&[7]), removed(&[7])], &mut out);
        assert_eq!(
            out,
            vec![
                IndexEvent::Removed { hashes: vec![b] },
                IndexEvent::Removed { hashes: vec![a] },
                IndexEvent::Removed { hashes: vec![a] },
            ]
        );
        assert_eq!(r.mappings(), 1, "only engine hash 1 is left");
    }

    // ----- ic-content-v2: block identity -----

    use crate::adapters::kv_events::decode::ExtraKey;
    use crate::core::chain::{BlockIdentity, IC_CONTENT_V2, MmInput};

    fn with_identity(
        hashes: &[u64],
        parent: Option<u64>,
        tokens: std::ops::Range<u32>,
        identity: StoredIdentity,
    ) -> EngineEvent {
        match stored(hashes, parent, tokens) {
            EngineEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                medium,
                ..
            } => EngineEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                medium,
                identity: Some(Box::new(identity)),
            },
            _ => unreachable!(),
        }
    }

    fn named(lora: &str, salt: &str) -> StoredIdentity {
        StoredIdentity {
            lora_name: (!lora.is_empty()).then(|| lora.to_string()),
            cache_salt: (!salt.is_empty()).then(|| salt.to_string()),
            ..StoredIdentity::default()
        }
    }

    fn v2_keys(tokens: std::ops::Range<u32>, identity: BlockIdentity<'_>) -> Vec<u64> {
        let t: Vec<u32> = tokens.collect();
        chain::own_chain(Scheme::ContentV2, 4, &t, &identity).unwrap()
    }

    #[test]
    fn v2_keys_a_run_with_its_identity_and_continuations_inherit_it() {
        // vLLM: the salt only on block 0 of the first event; the continuation
        // names the adapter but carries no salt.
        let mut r = ReplicaChains::new(IC_CONTENT_V2, 100);
        let mut out = Vec::new();
        let s = r.translate(
            &[
                with_identity(&[1, 2], None, 0..8, named("sql", "t7")),
                with_identity(&[3], Some(2), 8..12, named("sql", "")),
            ],
            &mut out,
        );
        assert_eq!(s, Skipped::default());
        let want = v2_keys(
            0..12,
            BlockIdentity {
                lora: "sql",
                salt: "t7",
                mm: &[],
            },
        );
        assert_eq!(stored_values(&out), want);
        assert_eq!(
            out[1],
            IndexEvent::Stored {
                parent: Some(want[1]),
                hashes: vec![want[2]],
                token_counts: vec![]
            }
        );
        // Removal emits the key, not the content value.
        out.clear();
        r.translate(&[removed(&[3])], &mut out);
        assert_eq!(
            out,
            vec![IndexEvent::Removed {
                hashes: vec![want[2]]
            }]
        );
    }

    #[test]
    fn v2_without_identity_is_the_client_chain() {
        let mut r = ReplicaChains::new(IC_CONTENT_V2, 100);
        let mut out = Vec::new();
        r.translate(&[stored(&[1, 2, 3], None, 0..12)], &mut out);
        let client =
            compute_chain(Scheme::ContentV2, &(0..12).collect::<Vec<_>>(), 4, None).unwrap();
        assert_eq!(stored_values(&out), client);
    }

    #[test]
    fn v2_same_tokens_under_other_identities_are_other_blocks() {
        let idents = [
            named("", ""),
            named("sql", ""),
            named("chat", ""),
            named("", "t7"),
            named("sql", "t7"),
            StoredIdentity {
                lora_id: Some(1),
                ..StoredIdentity::default()
            },
        ];
        let mut seen = std::collections::HashSet::new();
        for (i, id) in idents.into_iter().enumerate() {
            let mut r = ReplicaChains::new(IC_CONTENT_V2, 100);
            let mut out = Vec::new();
            r.translate(&[with_identity(&[1, 2], None, 0..8, id)], &mut out);
            for v in stored_values(&out) {
                assert!(seen.insert(v), "identity {i} repeats a key");
            }
        }
        // And the named ones are exactly what a request with that identity looks up.
        let mut r = ReplicaChains::new(IC_CONTENT_V2, 100);
        let mut out = Vec::new();
        r.translate(
            &[with_identity(&[1, 2], None, 0..8, named("chat", ""))],
            &mut out,
        );
        let client =
            compute_chain(Scheme::ContentV2, &(0..8).collect::<Vec<_>>(), 4, None).unwrap();
        assert_eq!(
            Some(stored_values(&out)),
            chain::request_keys(IC_CONTENT_V2, &client, "chat", "")
        );
    }

    #[test]
    fn v2_multimodal_extra_keys_enter_the_content_value() {
        // An image at prompt positions 2..6, blocks of 4: vLLM's extra keys are
        // ("img", 2) on block 0 and ("img", -2) on block 1.
        let mut id = named("", "");
        id.extras = vec![
            vec![ExtraKey::Mm {
                identifier: "img".into(),
                offset: 2,
            }],
            vec![ExtraKey::Mm {
                identifier: "img".into(),
                offset: -2,
            }],
            vec![],
        ];
        let mut r = ReplicaChains::new(IC_CONTENT_V2, 100);
        let mut out = Vec::new();
        r.translate(&[with_identity(&[1, 2, 3], None, 0..12, id)], &mut out);
        let mm = [MmInput {
            identifier: "img",
            offset: 2,
            length: 4,
        }];
        assert_eq!(
            stored_values(&out),
            v2_keys(
                0..12,
                BlockIdentity {
                    mm: &mm,
                    ..BlockIdentity::default()
                }
            )
        );
        assert_ne!(
            stored_values(&out),
            v2_keys(0..12, BlockIdentity::default())
        );
    }

    #[test]
    fn v1_keeps_ignoring_identity() {
        let mut r = ReplicaChains::new(IC_CONTENT_V1, 100);
        let mut out = Vec::new();
        r.translate(
            &[with_identity(&[1, 2], None, 0..8, named("sql", "t7"))],
            &mut out,
        );
        assert_eq!(
            stored_values(&out),
            compute_chain(Scheme::ContentV1, &(0..8).collect::<Vec<_>>(), 4, None).unwrap()
        );
    }
}
