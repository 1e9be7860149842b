//! An engine's msgpack KV-event batch → `decode_batch` → translation (both hash
//! scheme kinds) → `Router::ingest`, as the subscriber applies every payload.
//!
//! Input: the payload frame, raw.

#![no_main]

#[path = "common.rs"]
mod common;

use std::sync::{Arc, LazyLock};

use inferencecache::adapters::kv_events::decode::{EngineBatch, EngineEvent, decode_batch};
use inferencecache::adapters::kv_events::translate::ReplicaChains;
use inferencecache::core::Router;
use inferencecache::core::index::{IndexEvent, IngestBatch};
use inferencecache::core::scope::ScopeRef;
use inferencecache::core::time::Timestamp;
use libfuzzer_sys::fuzz_target;
use rmpv::Value;

/// Small, so that inputs reach the overflow path.
const MAX_MAPPINGS: usize = 64;

static ROUTER: LazyLock<Arc<Router>> = LazyLock::new(common::example_router);

fn s(x: &str) -> Value {
    Value::from(x)
}

fn hashes(h: &[u64]) -> Value {
    Value::Array(h.iter().map(|&x| Value::from(x)).collect())
}

fn opt_str(m: &Option<String>) -> Value {
    m.as_deref().map_or(Value::Nil, Value::from)
}

/// The batch as a current engine sends it: maps, `type` tags.
fn encode_map(b: &EngineBatch) -> Value {
    let events = b
        .events
        .iter()
        .map(|e| {
            let fields = match e {
                EngineEvent::BlockStored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    block_size,
                    medium,
                    identity: _,
                } => vec![
                    (s("type"), s("BlockStored")),
                    (s("block_hashes"), hashes(block_hashes)),
                    (
                        s("parent_block_hash"),
                        parent_block_hash.map_or(Value::Nil, Value::from),
                    ),
                    (
                        s("token_ids"),
                        Value::Array(token_ids.iter().map(|&t| Value::from(t)).collect()),
                    ),
                    (s("block_size"), Value::from(*block_size)),
                    (s("medium"), opt_str(medium)),
                ],
                EngineEvent::BlockRemoved {
                    block_hashes,
                    medium,
                } => vec![
                    (s("type"), s("BlockRemoved")),
                    (s("block_hashes"), hashes(block_hashes)),
                    (s("medium"), opt_str(medium)),
                ],
                EngineEvent::AllBlocksCleared => vec![(s("type"), s("AllBlocksCleared"))],
            };
            Value::Map(fields)
        })
        .collect();
    Value::Map(vec![
        (s("ts"), Value::F64(b.ts)),
        (s("events"), Value::Array(events)),
        (
            s("data_parallel_rank"),
            b.data_parallel_rank.map_or(Value::Nil, Value::from),
        ),
    ])
}

/// The batch as an older engine sends it: arrays, tag first, every slot.
fn encode_array(b: &EngineBatch) -> Value {
    let events = b
        .events
        .iter()
        .map(|e| match e {
            EngineEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                medium,
                identity: _,
            } => Value::Array(vec![
                s("BlockStored"),
                hashes(block_hashes),
                parent_block_hash.map_or(Value::Nil, Value::from),
                Value::Array(token_ids.iter().map(|&t| Value::from(t)).collect()),
                Value::from(*block_size),
                Value::Nil, // lora_id
                opt_str(medium),
            ]),
            EngineEvent::BlockRemoved {
                block_hashes,
                medium,
            } => Value::Array(vec![
                s("BlockRemoved"),
                hashes(block_hashes),
                opt_str(medium),
            ]),
            EngineEvent::AllBlocksCleared => Value::Array(vec![s("AllBlocksCleared")]),
        })
        .collect();
    Value::Array(vec![
        Value::F64(b.ts),
        Value::Array(events),
        b.data_parallel_rank.map_or(Value::Nil, Value::from),
    ])
}

fn reencoded(v: &Value) -> EngineBatch {
    let mut bytes = Vec::new();
    if let Err(e) = rmpv::encode::write_value(&mut bytes, v) {
        panic!("encoding into a Vec failed: {e}");
    }
    match decode_batch(&bytes) {
        Ok(b) => b,
        Err(e) => panic!("a decoded batch, encoded again, does not decode: {e}"),
    }
}

/// The events with their block identity (LoRA, salt, extra keys) left out: the
/// re-encoders above do not write it yet, and decode's own tests cover it.
fn without_identity(events: &[EngineEvent]) -> Vec<EngineEvent> {
    events
        .iter()
        .cloned()
        .map(|mut e| {
            if let EngineEvent::BlockStored { identity, .. } = &mut e {
                *identity = None;
            }
            e
        })
        .collect()
}

fn same(a: &EngineBatch, b: &EngineBatch) -> bool {
    a.ts.to_bits() == b.ts.to_bits()
        && without_identity(&a.events) == without_identity(&b.events)
        && a.data_parallel_rank == b.data_parallel_rank
}

fuzz_target!(|data: &[u8]| {
    let Ok(batch) = decode_batch(data) else {
        return;
    };
    for e in &batch.events {
        if let EngineEvent::BlockStored { block_size, .. } = e {
            assert!(*block_size > 0);
        }
    }
    // Both generations carry exactly what was decoded (unknown events aside).
    for encoded in [encode_map(&batch), encode_array(&batch)] {
        let again = reencoded(&encoded);
        assert!(same(&batch, &again), "{batch:?} came back as {again:?}");
        assert_eq!(again.skipped, 0);
    }

    let router = &*ROUTER;
    for scheme in [common::SCHEME, "engine-raw"] {
        let mut chains = ReplicaChains::new(scheme, MAX_MAPPINGS);
        let mut out = Vec::new();
        let skipped = chains.translate(&batch.events, &mut out);
        assert!(chains.mappings() <= MAX_MAPPINGS);
        assert!(skipped.events as usize <= batch.events.len());
        for e in &out {
            if let IndexEvent::Stored { hashes, .. } | IndexEvent::Removed { hashes } = e {
                assert!(!hashes.is_empty(), "an empty run is never sent on");
            }
        }
        // Start the replica from empty so that every input stands on its own.
        out.insert(0, IndexEvent::Cleared);
        let (replica, address) = common::REPLICAS[0];
        let ingest = IngestBatch {
            scope: ScopeRef::new(common::TENANT, common::MODEL, scheme),
            replica_id: replica,
            endpoint: address,
            events: &out,
        };
        // Refusals are fine (an undeclared scope, a quota); panics are not.
        let _ = router.ingest(&ingest, Timestamp::now());
    }
});
