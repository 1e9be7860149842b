//! Engine events → [`IndexEvent`]s for one replica, per the scope's hash scheme.
//!
//! - `ic-content-v1`: the engine's hashes are not what clients compute, so each
//!   stored block gets its own content value ([`chain::content_block`]) from the
//!   event's `token_ids`, continuing from the parent's *own* value. The engine hash →
//!   own value map is kept (reference-counted, as engines store and remove the same
//!   hash more than once) to translate removals and later parents; removals and
//!   clears drop mappings, and a map over its bound clears the replica rather than
//!   grow without limit.
//! - any other scheme (`vllm-sha256-cbor`, `engine-raw`, …): the engine's hashes
//!   are the chain; they pass through.
//!
//! Only the main pool counts: events for another `medium` (CPU offload) are skipped.

use std::collections::HashMap;

use crate::adapters::kv_events::decode::EngineEvent;
use crate::core::chain::{self, Scheme};
use crate::core::index::IndexEvent;

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
    content: bool,
    /// engine hash → (own value, references)
    own: HashMap<u64, (u64, u32)>,
    max_mappings: usize,
}

impl ReplicaChains {
    pub fn new(hash_scheme: &str, max_mappings: usize) -> Self {
        Self {
            content: Scheme::from_name(hash_scheme) == Some(Scheme::ContentV1),
            own: HashMap::new(),
            max_mappings,
        }
    }

    /// Engine hashes currently mapped (always 0 for pass-through schemes).
    pub fn mappings(&self) -> usize {
        self.own.len()
    }

    /// Forgets everything (the replica was cleared or restarted).
    pub fn reset(&mut self) {
        self.own = HashMap::new();
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
                EngineEvent::BlockStored { medium, .. }
                | EngineEvent::BlockRemoved { medium, .. }
                    if !main_pool(medium.as_deref()) =>
                {
                    false
                }
                EngineEvent::BlockStored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    block_size,
                    ..
                } => {
                    if self.content {
                        self.store_content(
                            block_hashes,
                            *parent_block_hash,
                            token_ids,
                            *block_size,
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
                    let hashes = if self.content {
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
            if self.own.len() > self.max_mappings {
                self.reset();
                out.push(IndexEvent::Cleared);
                skipped.overflowed = true;
            }
        }
        skipped
    }

    fn store_content(
        &mut self,
        block_hashes: &[u64],
        parent: Option<u64>,
        token_ids: &[u32],
        block_size: u32,
        out: &mut Vec<IndexEvent>,
    ) -> bool {
        let bs = block_size as usize;
        if block_hashes.is_empty() || token_ids.len() != block_hashes.len() * bs {
            return false;
        }
        let mut own_parent = match parent {
            None => None,
            Some(p) => match self.own.get(&p) {
                Some(&(v, _)) => Some(v),
                // The parent was stored before we listened: its own value is unknown.
                None => return false,
            },
        };
        let first_parent = own_parent;
        let mut hashes = Vec::with_capacity(block_hashes.len());
        for (engine, tokens) in block_hashes.iter().zip(token_ids.chunks_exact(bs)) {
            let value = chain::content_block(own_parent, tokens);
            let slot = self.own.entry(*engine).or_insert((value, 0));
            // The same engine hash always names the same content; keep the first value.
            slot.1 = slot.1.saturating_add(1);
            let value = slot.0;
            hashes.push(value);
            own_parent = Some(value);
        }
        out.push(IndexEvent::Stored {
            parent: first_parent,
            hashes,
            token_counts: Vec::new(),
        });
        true
    }

    fn remove_content(&mut self, block_hashes: &[u64]) -> Vec<u64> {
        let mut hashes = Vec::with_capacity(block_hashes.len());
        for engine in block_hashes {
            let Some(slot) = self.own.get_mut(engine) else {
                continue;
            };
            hashes.push(slot.0);
            slot.1 -= 1;
            if slot.1 == 0 {
                self.own.remove(engine);
            }
        }
        hashes
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
    fn unknown_parent_short_tokens_and_other_media_are_skipped() {
        let mut r = ReplicaChains::new(IC_CONTENT_V1, 100);
        let mut out = Vec::new();
        let cpu = EngineEvent::BlockStored {
            block_hashes: vec![5],
            parent_block_hash: None,
            token_ids: (0..4).collect(),
            block_size: 4,
            medium: Some("CPU".into()),
        };
        let s = r.translate(
            &[
                stored(&[2], Some(77), 0..4),
                stored(&[3, 4], None, 0..7),
                cpu,
            ],
            &mut out,
        );
        assert_eq!(s.events, 3);
        assert!(out.is_empty());
        assert_eq!(r.mappings(), 0);
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
}
