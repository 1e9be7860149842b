use rmpv::Value;

use super::reference;

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
        identity: None,
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
                identity: None,
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

fn identity_of(e: &EngineEvent) -> Option<&StoredIdentity> {
    match e {
        EngineEvent::BlockStored { identity, .. } => identity.as_deref(),
        _ => None,
    }
}

fn one_event(event: Value) -> Result<EngineEvent, DecodeError> {
    let payload = arr(vec![Value::F64(1.0), arr(vec![event]), Value::Nil]);
    decode_batch(&bytes(&payload)).map(|mut b| b.events.remove(0))
}

/// vLLM 0.33's map form (its `to_event_extra_keys`: untagged, in order the adapter
/// name, `(mm_identifier, offset)` pairs, the salt on block 0, embeds digests).
fn vllm_033_stored(parent: Value, extra_keys: Value) -> Value {
    map(vec![
        ("type", s("BlockStored")),
        ("block_hashes", ints(&[1, 2])),
        ("parent_block_hash", parent),
        ("token_ids", ints(&tokens(8))),
        ("block_size", Value::from(4)),
        ("lora_id", Value::from(3)),
        ("medium", s("GPU")),
        ("lora_name", s("sql")),
        ("extra_keys", extra_keys),
        ("group_idx", Value::from(0)),
    ])
}

#[test]
fn vllm_033_lora_salt_mm_and_embeds_are_read_per_block() {
    let extra = arr(vec![
        arr(vec![
            s("sql"),
            arr(vec![s("img-1"), Value::from(2)]),
            s("salt-7"),
            Value::Binary(vec![9; 32]),
        ]),
        arr(vec![s("sql"), arr(vec![s("img-1"), Value::from(-2)])]),
    ]);
    let e = one_event(vllm_033_stored(Value::Nil, extra)).unwrap();
    assert_eq!(
        identity_of(&e),
        Some(&StoredIdentity {
            lora_name: Some("sql".into()),
            lora_id: Some(3),
            cache_salt: Some("salt-7".into()),
            extras: vec![
                vec![
                    ExtraKey::Mm {
                        identifier: "img-1".into(),
                        offset: 2
                    },
                    ExtraKey::Embeds(vec![9; 32]),
                ],
                vec![ExtraKey::Mm {
                    identifier: "img-1".into(),
                    offset: -2
                }],
            ],
        })
    );
}

#[test]
fn a_salt_is_read_only_from_block_0_of_a_run_starting_at_block_0() {
    // vLLM hashes the salt into the first block only; a string anywhere else is a
    // key this decoder does not know: kept opaque, so the block matches no client.
    let later = arr(vec![arr(vec![s("sql"), s("odd")]), Value::Nil]);
    let e = one_event(vllm_033_stored(Value::from(5), later)).unwrap();
    let id = identity_of(&e).unwrap();
    assert_eq!(id.cache_salt, None);
    assert!(matches!(id.extras[0].as_slice(), [ExtraKey::Opaque(_)]));
    assert!(id.extras[1].is_empty());
    // No lora_name: a leading string on block 0 is the salt.
    let salt_only = map(vec![
        ("type", s("BlockStored")),
        ("block_hashes", ints(&[1])),
        ("parent_block_hash", Value::Nil),
        ("token_ids", ints(&tokens(4))),
        ("block_size", Value::from(4)),
        ("extra_keys", arr(vec![arr(vec![s("s1")])])),
    ]);
    let e = one_event(salt_only).unwrap();
    assert_eq!(
        identity_of(&e),
        Some(&StoredIdentity {
            cache_salt: Some("s1".into()),
            ..StoredIdentity::default()
        })
    );
}

#[test]
fn the_array_form_carries_lora_name_and_extra_keys_in_slots_7_and_8() {
    let e = one_event(arr(vec![
        s("BlockStored"),
        ints(&[1]),
        Value::Nil,
        ints(&tokens(4)),
        Value::from(4),
        Value::from(1),
        s("GPU"),
        s("sql"),
        arr(vec![arr(vec![s("sql"), s("salt")])]),
        Value::from(0),
    ]))
    .unwrap();
    assert_eq!(
        identity_of(&e),
        Some(&StoredIdentity {
            lora_name: Some("sql".into()),
            lora_id: Some(1),
            cache_salt: Some("salt".into()),
            extras: vec![],
        })
    );
}

#[test]
fn vllm_011_names_an_adapter_only_by_its_id() {
    // vLLM 0.11: [tag, hashes, parent, tokens, block_size, lora_id, medium].
    let e = one_event(arr(vec![
        s("BlockStored"),
        ints(&[1]),
        Value::Nil,
        ints(&tokens(4)),
        Value::from(4),
        Value::from(2),
        s("GPU"),
    ]))
    .unwrap();
    assert_eq!(
        identity_of(&e),
        Some(&StoredIdentity {
            lora_id: Some(2),
            ..StoredIdentity::default()
        })
    );
}

#[test]
fn sglang_0523_sends_lora_name_and_cache_salt_on_every_event() {
    let e = one_event(map(vec![
        ("type", s("BlockStored")),
        ("block_hashes", ints(&[1])),
        ("parent_block_hash", Value::from(9)),
        ("token_ids", ints(&tokens(4))),
        ("block_size", Value::from(4)),
        ("lora_id", Value::Nil),
        ("medium", s("GPU")),
        ("cache_salt", s("s")),
        ("session_id", s("abc")),
        ("lora_name", s("sql")),
    ]))
    .unwrap();
    assert_eq!(
        identity_of(&e),
        Some(&StoredIdentity {
            lora_name: Some("sql".into()),
            cache_salt: Some("s".into()),
            ..StoredIdentity::default()
        })
    );
}

#[test]
fn no_identity_fields_or_all_nil_extra_keys_are_no_identity() {
    let e = one_event(vllm_033_stored(
        Value::Nil,
        arr(vec![Value::Nil, Value::Nil]),
    ));
    // lora_name is set there; without it and with nil extras there is nothing.
    assert!(identity_of(&e.unwrap()).is_some());
    let plain = map(vec![
        ("type", s("BlockStored")),
        ("block_hashes", ints(&[1, 2])),
        ("parent_block_hash", Value::Nil),
        ("token_ids", ints(&tokens(8))),
        ("block_size", Value::from(4)),
        ("lora_name", Value::Nil),
        ("lora_id", Value::Nil),
        ("cache_salt", s("")),
        ("extra_keys", arr(vec![Value::Nil, arr(vec![])])),
    ]);
    assert_eq!(identity_of(&one_event(plain).unwrap()), None);
}

#[test]
fn malformed_identity_fields_are_errors() {
    let bad = [
        (
            vllm_033_stored(Value::Nil, arr(vec![Value::Nil])),
            "extra_keys has 1 entries for 2 blocks",
        ),
        (
            vllm_033_stored(Value::Nil, s("x")),
            "extra_keys is not an array",
        ),
        (
            vllm_033_stored(Value::Nil, arr(vec![Value::from(1), Value::Nil])),
            "extra_keys[0] is not an array",
        ),
    ];
    for (event, what) in bad {
        let err = one_event(event).unwrap_err().to_string();
        assert!(err.contains(what), "{err}");
    }
    let mut m = match vllm_033_stored(Value::Nil, Value::Nil) {
        Value::Map(m) => m,
        _ => unreachable!(),
    };
    m.push((s("lora_name"), Value::from(1)));
    // The later key wins in the decoder's map walk: a non-string name is an error.
    let err = one_event(Value::Map(m)).unwrap_err().to_string();
    assert!(err.contains("lora_name is not a string"), "{err}");
}

/// Errors compared by kind and text, except msgpack errors, whose text names the
/// reader that found them.
fn comparable(r: Result<EngineBatch, DecodeError>) -> Result<EngineBatch, DecodeError> {
    r.map_err(|e| match e {
        DecodeError::Msgpack(_) => DecodeError::Msgpack(String::new()),
        e => e,
    })
}

fn agree(raw: &[u8]) {
    assert_eq!(
        comparable(decode_batch(raw)),
        comparable(reference::decode_batch(raw)),
        "payload {raw:02x?}"
    );
}

#[test]
fn the_typed_decoder_agrees_with_the_value_tree_decoder_on_every_mutation_of_the_seeds() {
    // Every cut, and every byte of every seed replaced by markers that change a
    // value's kind or length: results and errors (and their order) as before.
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds/kv_payload");
    for entry in std::fs::read_dir(&dir).unwrap() {
        let good = std::fs::read(entry.unwrap().path()).unwrap();
        agree(&good);
        for cut in 0..good.len() {
            agree(&good[..cut]);
        }
        for at in 0..good.len() {
            for b in [
                0x00, 0x01, 0x7f, 0x80, 0x81, 0x90, 0x91, 0x93, 0xa0, 0xa3, 0xc0, 0xc1, 0xc2, 0xc4,
                0xca, 0xcb, 0xcc, 0xce, 0xcf, 0xd0, 0xd3, 0xd4, 0xdc, 0xde, 0xff,
            ] {
                let mut bad = good.clone();
                bad[at] = b;
                agree(&bad);
            }
        }
        let mut longer = good.clone();
        longer.push(0xc0);
        agree(&longer);
    }
}

mod agreement {
    use proptest::prelude::*;
    use rmpv::Value;

    use super::{agree, bytes};

    const WORDS: &[&str] = &[
        "BlockStored",
        "BlockRemoved",
        "AllBlocksCleared",
        "Other",
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "cache_salt",
        "ts",
        "events",
        "data_parallel_rank",
        "GPU",
        "CPU",
        "",
        "sql-adapter",
        "salt",
    ];

    fn leaf() -> impl Strategy<Value = Value> {
        prop_oneof![
            Just(Value::Nil),
            any::<bool>().prop_map(Value::from),
            (0u64..20).prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            (1u64 << 31..1 << 33).prop_map(Value::from),
            any::<f64>().prop_map(Value::F64),
            any::<f32>().prop_map(Value::F32),
            proptest::sample::select(WORDS).prop_map(Value::from),
            proptest::collection::vec(any::<u8>(), 0..10).prop_map(Value::Binary),
            // A string that is not UTF-8.
            Just(rmpv::decode::read_value(&mut &[0xa2u8, 0xff, 0xfe][..]).unwrap()),
            Just(Value::Ext(1, vec![1, 2])),
        ]
    }

    fn value() -> impl Strategy<Value = Value> {
        leaf().prop_recursive(4, 24, 6, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                proptest::collection::vec(
                    (
                        proptest::sample::select(WORDS).prop_map(Value::from),
                        inner.clone()
                    ),
                    0..6
                )
                .prop_map(Value::Map),
            ]
        })
    }

    /// A small token or hash array, sometimes with a wrong item.
    fn ints() -> impl Strategy<Value = Value> {
        prop_oneof![
            4 => proptest::collection::vec(0u64..200_000, 0..9)
                .prop_map(|v| Value::Array(v.into_iter().map(Value::from).collect())),
            1 => proptest::collection::vec(leaf(), 0..5).prop_map(Value::Array),
            1 => leaf(),
        ]
    }

    /// One slot: mostly a plausible value, sometimes anything.
    fn slot(plausible: impl Strategy<Value = Value> + 'static) -> BoxedStrategy<Value> {
        prop_oneof![3 => plausible, 1 => value()].boxed()
    }

    fn extra_keys() -> BoxedStrategy<Value> {
        let key = prop_oneof![
            proptest::sample::select(WORDS).prop_map(Value::from),
            ("[a-c]{1,3}", -3i64..300)
                .prop_map(|(id, off)| Value::Array(vec![Value::from(id), Value::from(off)])),
            proptest::collection::vec(any::<u8>(), 1..4).prop_map(Value::Binary),
            leaf(),
        ];
        let entry = prop_oneof![
            Just(Value::Nil),
            proptest::collection::vec(key, 0..4).prop_map(Value::Array),
        ];
        slot(proptest::collection::vec(entry, 0..4).prop_map(Value::Array))
    }

    fn event() -> impl Strategy<Value = Value> {
        let tag = slot(proptest::sample::select(&WORDS[..4]).prop_map(Value::from));
        let fields = (
            tag,
            slot(ints()),
            slot(prop_oneof![
                Just(Value::Nil),
                (0u64..9).prop_map(Value::from)
            ]),
            slot(ints()),
            slot((0u64..5).prop_map(Value::from)),
            slot(prop_oneof![
                Just(Value::Nil),
                (0i64..3).prop_map(Value::from)
            ]),
            slot(proptest::sample::select(&WORDS[17..20]).prop_map(Value::from)),
            slot(proptest::sample::select(&WORDS[19..]).prop_map(Value::from)),
            extra_keys(),
            0usize..11,
            any::<bool>(),
        );
        fields.prop_map(|(tag, h, p, t, bs, lid, med, lname, extra, len, as_map)| {
            let names = [
                "type",
                "block_hashes",
                "parent_block_hash",
                "token_ids",
                "block_size",
                "lora_id",
                "medium",
                "lora_name",
                "extra_keys",
                "cache_salt",
            ];
            let salt = lname.clone();
            let slots = vec![tag, h, p, t, bs, lid, med, lname, extra, salt];
            if as_map {
                Value::Map(
                    names
                        .iter()
                        .zip(slots)
                        .take(len)
                        .map(|(k, v)| (Value::from(*k), v))
                        .collect(),
                )
            } else {
                Value::Array(slots.into_iter().take(len).collect())
            }
        })
    }

    fn batch() -> impl Strategy<Value = Value> {
        (
            slot(any::<f64>().prop_map(Value::F64)),
            slot(proptest::collection::vec(event(), 0..4).prop_map(Value::Array)),
            slot(prop_oneof![
                Just(Value::Nil),
                (0i64..4).prop_map(Value::from)
            ]),
            0usize..5,
            any::<bool>(),
        )
            .prop_map(|(ts, events, rank, len, as_map)| {
                let slots = vec![ts, events, rank, Value::from("future")];
                if as_map {
                    let names = ["ts", "events", "data_parallel_rank", "other"];
                    Value::Map(
                        names
                            .iter()
                            .zip(slots)
                            .take(len)
                            .map(|(k, v)| (Value::from(*k), v))
                            .collect(),
                    )
                } else {
                    Value::Array(slots.into_iter().take(len).collect())
                }
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(3000))]

        /// Random engine-shaped batches (and random byte changes to them) decode
        /// to what the value-tree decoder gave, errors included.
        #[test]
        fn the_typed_decoder_agrees_with_the_value_tree_decoder(
            batch in batch(),
            flip in proptest::option::of((any::<prop::sample::Index>(), any::<u8>())),
        ) {
            let mut raw = bytes(&batch);
            if let Some((at, b)) = flip && !raw.is_empty() {
                let at = at.index(raw.len());
                raw[at] = b;
            }
            agree(&raw);
        }
    }
}
