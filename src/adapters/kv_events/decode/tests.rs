use rmpv::Value;

use super::*;

fn s(x: &str) -> Value {
    Value::from(x)
}

fn arr(items: Vec<Value>) -> Value {
    Value::Array(items)
}

fn map(items: Vec<(&str, Value)>) -> Value {
    Value::Map(items.into_iter().map(|(k, v)| (s(k), v)).collect())
}

fn ints(xs: &[u64]) -> Value {
    arr(xs.iter().map(|&x| Value::from(x)).collect())
}

fn bytes(v: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).unwrap();
    out
}

fn tokens(n: u64) -> Vec<u64> {
    (0..n).collect()
}

fn stored(hashes: Vec<u64>, parent: Option<u64>, n_tokens: u64) -> EngineEvent {
    EngineEvent::BlockStored {
        block_hashes: hashes,
        parent_block_hash: parent,
        token_ids: (0..n_tokens as u32).collect(),
        block_size: 4,
        medium: Some("GPU".into()),
    }
}

#[test]
fn array_generation_with_every_slot_and_extras() {
    let payload = arr(vec![
        Value::F64(1.5),
        arr(vec![
            arr(vec![
                s("BlockStored"),
                ints(&[10, 11]),
                Value::Nil,
                ints(&tokens(8)),
                Value::from(4),
                Value::Nil,
                s("GPU"),
                Value::Nil,
                Value::Nil,
                Value::from(0),
                s("full_attention"),
                Value::Nil,
                s("a slot from the future"),
            ]),
            arr(vec![
                s("BlockRemoved"),
                ints(&[10]),
                s("GPU"),
                Value::from(0),
            ]),
            arr(vec![s("AllBlocksCleared")]),
        ]),
        Value::Nil,
    ]);
    let batch = decode_batch(&bytes(&payload)).unwrap();
    assert_eq!(batch.ts, 1.5);
    assert_eq!(batch.data_parallel_rank, None);
    assert_eq!(
        batch.events,
        vec![
            stored(vec![10, 11], None, 8),
            EngineEvent::BlockRemoved {
                block_hashes: vec![10],
                medium: Some("GPU".into())
            },
            EngineEvent::AllBlocksCleared,
        ]
    );
}

#[test]
fn old_engines_omit_trailing_slots() {
    let payload = arr(vec![
        Value::F64(2.0),
        arr(vec![
            arr(vec![
                s("BlockStored"),
                ints(&[7]),
                Value::from(6),
                ints(&tokens(4)),
                Value::from(4),
            ]),
            arr(vec![s("BlockRemoved"), ints(&[7])]),
        ]),
    ]);
    let batch = decode_batch(&bytes(&payload)).unwrap();
    assert_eq!(
        batch.events,
        vec![
            EngineEvent::BlockStored {
                block_hashes: vec![7],
                parent_block_hash: Some(6),
                token_ids: vec![0, 1, 2, 3],
                block_size: 4,
                medium: None,
            },
            EngineEvent::BlockRemoved {
                block_hashes: vec![7],
                medium: None
            },
        ]
    );
}

#[test]
fn map_generation_with_unknown_keys_and_omitted_defaults() {
    let payload = map(vec![
        ("ts", Value::F64(3.0)),
        (
            "events",
            arr(vec![
                map(vec![
                    ("type", s("BlockStored")),
                    ("block_hashes", ints(&[1, 2])),
                    ("parent_block_hash", Value::Nil),
                    ("token_ids", ints(&tokens(8))),
                    ("block_size", Value::from(4)),
                    ("lora_id", Value::Nil),
                    ("medium", s("GPU")),
                    ("brand_new_field", map(vec![("x", Value::from(1))])),
                ]),
                map(vec![
                    ("type", s("BlockRemoved")),
                    ("block_hashes", ints(&[2])),
                ]),
                map(vec![("type", s("AllBlocksCleared"))]),
                map(vec![("type", s("SomethingNew")), ("x", Value::from(1))]),
            ]),
        ),
        ("data_parallel_rank", Value::from(1)),
        ("extra", s("ignored")),
    ]);
    let batch = decode_batch(&bytes(&payload)).unwrap();
    assert_eq!(batch.data_parallel_rank, Some(1));
    assert_eq!(batch.skipped, 1);
    assert_eq!(
        batch.events,
        vec![
            stored(vec![1, 2], None, 8),
            EngineEvent::BlockRemoved {
                block_hashes: vec![2],
                medium: None
            },
            EngineEvent::AllBlocksCleared,
        ]
    );
}

#[test]
fn hashes_as_u64_i64_and_bytes() {
    let mut digest = vec![0xaa; 24];
    digest.extend_from_slice(&0x0102_0304_0506_0708u64.to_be_bytes());
    let payload = arr(vec![
        Value::F64(0.0),
        arr(vec![arr(vec![
            s("BlockRemoved"),
            arr(vec![
                Value::from(u64::MAX),
                Value::from(-2i64),
                Value::Binary(digest),
                Value::Binary(vec![1, 0]),
            ]),
        ])]),
        Value::Nil,
    ]);
    let batch = decode_batch(&bytes(&payload)).unwrap();
    assert_eq!(
        batch.events,
        vec![EngineEvent::BlockRemoved {
            block_hashes: vec![u64::MAX, (-2i64) as u64, 0x0102_0304_0506_0708, 256],
            medium: None
        }]
    );
}

#[test]
fn literal_bytes_of_a_minimal_batch() {
    // [0.0, [["AllBlocksCleared"]], nil] written by hand.
    let mut raw = vec![0x93, 0xcb];
    raw.extend_from_slice(&0f64.to_be_bytes());
    raw.extend_from_slice(&[0x91, 0x91, 0xb0]);
    raw.extend_from_slice(b"AllBlocksCleared");
    raw.push(0xc0);
    let batch = decode_batch(&raw).unwrap();
    assert_eq!(batch.events, vec![EngineEvent::AllBlocksCleared]);
}

#[test]
fn garbage_is_an_error_never_a_panic() {
    let cases: Vec<Vec<u8>> = vec![
        vec![],
        vec![0xc1],
        vec![0x93],
        b"hello world".to_vec(),
        bytes(&Value::from(5)),
        bytes(&arr(vec![Value::F64(0.0), Value::from(3)])),
        bytes(&arr(vec![s("x"), arr(vec![])])),
        bytes(&arr(vec![Value::F64(0.0), arr(vec![Value::from(1)])])),
        bytes(&arr(vec![Value::F64(0.0), arr(vec![arr(vec![])])])),
        bytes(&arr(vec![
            Value::F64(0.0),
            arr(vec![arr(vec![Value::from(1)])]),
        ])),
        // stored without tokens, with a bad hash, with a zero block size
        bytes(&arr(vec![
            Value::F64(0.0),
            arr(vec![arr(vec![s("BlockStored"), ints(&[1])])]),
        ])),
        bytes(&arr(vec![
            Value::F64(0.0),
            arr(vec![arr(vec![
                s("BlockStored"),
                arr(vec![s("nope")]),
                Value::Nil,
                ints(&tokens(4)),
                Value::from(4),
            ])]),
        ])),
        bytes(&arr(vec![
            Value::F64(0.0),
            arr(vec![arr(vec![
                s("BlockStored"),
                ints(&[1]),
                Value::Nil,
                ints(&tokens(4)),
                Value::from(0),
            ])]),
        ])),
        // a token id beyond u32
        bytes(&arr(vec![
            Value::F64(0.0),
            arr(vec![arr(vec![
                s("BlockStored"),
                ints(&[1]),
                Value::Nil,
                ints(&[1 << 40]),
                Value::from(1),
            ])]),
        ])),
        // removal with a non-array
        bytes(&map(vec![
            ("ts", Value::F64(0.0)),
            (
                "events",
                arr(vec![map(vec![
                    ("type", s("BlockRemoved")),
                    ("block_hashes", Value::from(1)),
                ])]),
            ),
        ])),
    ];
    for (i, raw) in cases.iter().enumerate() {
        assert!(decode_batch(raw).is_err(), "case {i} decoded");
    }
    // Trailing bytes and deep nesting.
    let mut trailing = bytes(&arr(vec![Value::F64(0.0), arr(vec![])]));
    trailing.push(0);
    assert_eq!(decode_batch(&trailing), Err(DecodeError::Trailing));
    let deep = vec![0x91; 10_000];
    assert!(matches!(decode_batch(&deep), Err(DecodeError::Msgpack(_))));
    // Every truncation of a valid payload fails cleanly.
    let good = bytes(&arr(vec![
        Value::F64(1.0),
        arr(vec![arr(vec![
            s("BlockStored"),
            ints(&[1, 2]),
            Value::Nil,
            ints(&tokens(8)),
            Value::from(4),
        ])]),
        Value::Nil,
    ]));
    assert!(decode_batch(&good).is_ok());
    for cut in 0..good.len() {
        assert!(decode_batch(&good[..cut]).is_err(), "cut {cut}");
    }
}

#[test]
fn the_fuzz_seed_payloads_decode() {
    // fuzz/seeds/kv_payload: real engine shapes encoded by msgspec (vLLM with
    // extra_keys and every slot, SGLang pages, byte and signed hashes). A seed
    // that stopped decoding would leave the fuzzer starting from nothing.
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds/kv_payload");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let batch = decode_batch(&std::fs::read(&path).unwrap())
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert!(!batch.events.is_empty(), "{}", path.display());
        seen += 1;
    }
    assert!(seen >= 5, "only {seen} seeds in {}", dir.display());
}
