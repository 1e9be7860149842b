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
    let client = compute_chain(Scheme::ContentV1, &(0..12).collect::<Vec<_>>(), 4, None).unwrap();
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
    let client = compute_chain(Scheme::ContentV2, &(0..12).collect::<Vec<_>>(), 4, None).unwrap();
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
    let client = compute_chain(Scheme::ContentV2, &(0..8).collect::<Vec<_>>(), 4, None).unwrap();
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
