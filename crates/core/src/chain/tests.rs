use super::*;

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn vllm_none_hash_matches_the_golden_vector() {
    assert_eq!(
        hex(&vllm_none_hash("0")),
        "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e"
    );
}

#[test]
fn vllm_block_digests_match_the_golden_vectors() {
    let none = vllm_none_hash("0");
    let tokens0: Vec<u32> = (1..=16).collect();
    let d0 = vllm_block_digest(&none, &tokens0);
    assert_eq!(
        hex(&d0),
        "202da172482d928bbc42ab25b0151e2b895f13f41002e27b2ceabcfae6d332ea"
    );
    assert_eq!(digest_value(&d0), 3_236_607_068_019_569_386);
    let mut tokens1 = vec![100, 1000, 70000, 128_000];
    tokens1.extend(200..212);
    let d1 = vllm_block_digest(&d0, &tokens1);
    assert_eq!(
        hex(&d1),
        "04cf9d2875f68b24f69d974d17b803b447aa8078dc75ceda10bda449b958b80e"
    );
    assert_eq!(digest_value(&d1), 1_206_300_911_754_328_078);

    let mut all = tokens0.clone();
    all.extend(&tokens1);
    all.extend([7, 7, 7]); // a partial block is not hashed
    let chain = compute_chain(Scheme::VllmSha256Cbor, &all, 16, Some("0")).unwrap();
    assert_eq!(
        chain,
        vec![3_236_607_068_019_569_386, 1_206_300_911_754_328_078]
    );
}

#[test]
fn cbor_heads_are_shortest() {
    let mut v = Vec::new();
    for arg in [23, 24, 255, 256, 65_535, 65_536, u64::from(u32::MAX) + 1] {
        cbor_head(&mut v, 0, arg);
    }
    assert_eq!(
        hex(&v),
        "17181818ff19010019ffff1a000100001b0000000100000000"
    );
    let mut t = Vec::new();
    cbor_head(&mut t, 4, 30);
    assert_eq!(t, [0x98, 30]);
}

#[test]
fn content_chain_continues_from_the_parent_value() {
    let tokens: Vec<u32> = (0..40).collect();
    let chain = compute_chain(Scheme::ContentV1, &tokens, 16, None).unwrap();
    assert_eq!(chain.len(), 2);
    assert_eq!(chain[0], content_block(None, &tokens[..16]));
    assert_eq!(chain[1], content_block(Some(chain[0]), &tokens[16..32]));
    // The same block under another parent is another value.
    assert_ne!(content_block(None, &tokens[16..32]), chain[1]);
    // Fixed vector, so other implementations can check themselves.
    let ones: Vec<u32> = (1..=16).collect();
    assert_eq!(
        header_value(&compute_chain(Scheme::ContentV1, &ones, 16, None).unwrap()),
        "6b231ce80a6f7313"
    );
}

/// The vectors of docs/hash-schemes.md (also computed there in Python).
#[test]
fn content_v2_matches_the_documented_vectors() {
    let tokens: Vec<u32> = (1..=32).collect();
    let hex = |c: &[u64]| header_value(c);
    let plain = compute_chain(Scheme::ContentV2, &tokens, 16, None).unwrap();
    assert_eq!(hex(&plain), "c435cf40cf0291b0,ad19b8574e4e6a10");
    let own = |lora, salt, mm| {
        hex(&own_chain(
            Scheme::ContentV2,
            16,
            &tokens,
            &BlockIdentity { lora, salt, mm },
        )
        .unwrap())
    };
    assert_eq!(
        own("", "", &[]),
        hex(&plain),
        "no identity: keys are the chain"
    );
    assert_eq!(
        own("sql-adapter", "", &[]),
        "35d55187f7dd8aa9,2098b74b4fad7bd2"
    );
    assert_eq!(
        own("", "tenant-7", &[]),
        "7c04193dec580da2,4d305575f3f992b0"
    );
    assert_eq!(
        own("sql-adapter", "tenant-7", &[]),
        "ae4c1ae04f1fba83,e28e97d1f08eddb5"
    );
    assert_eq!(
        content_v2::identity_digest("sql-adapter", "tenant-7"),
        Some(0xfdf4_6a07_1aaa_ba3a)
    );
    let image = [MmInput {
        identifier: "img-abc",
        offset: 10,
        length: 20,
    }];
    assert_eq!(own("", "", &image), "ded813868196dc69,874e475c093fc697");
    assert_eq!(
        hex(&client_chain(Scheme::ContentV2, &tokens, 16, None, &image).unwrap()),
        "ded813868196dc69,874e475c093fc697"
    );
    // The router's keys for a request are the same as own_chain's.
    assert_eq!(
        request_keys(IC_CONTENT_V2, &plain, "sql-adapter", "tenant-7").map(|k| hex(&k)),
        Some(own("sql-adapter", "tenant-7", &[]))
    );
    assert_eq!(request_keys(IC_CONTENT_V2, &plain, "", ""), None);
    assert_eq!(request_keys(IC_CONTENT_V1, &plain, "a", ""), None);
    // ic-content-v1 keeps its values.
    assert_eq!(
        hex(&compute_chain(Scheme::ContentV1, &tokens[..16], 16, None).unwrap()),
        "6b231ce80a6f7313"
    );
}

#[test]
fn identity_needs_content_v2_and_fits_its_limit() {
    let t = [1u32; 16];
    let lora = BlockIdentity {
        lora: "a",
        ..BlockIdentity::default()
    };
    for s in [Scheme::ContentV1, Scheme::VllmSha256Cbor, Scheme::EngineRaw] {
        assert_eq!(
            own_chain(s, 16, &t, &lora),
            Err(ChainError::NoIdentity(s.name()))
        );
    }
    let image = [MmInput {
        identifier: "i",
        offset: 0,
        length: 1,
    }];
    assert_eq!(
        client_chain(Scheme::ContentV1, &t, 16, None, &image),
        Err(ChainError::NoIdentity(IC_CONTENT_V1))
    );
    let long = "x".repeat(content_v2::MAX_IDENTITY_LEN + 1);
    assert_eq!(
        check_identity(Scheme::ContentV2, "", &long),
        Err(ChainError::IdentityTooLong {
            what: "the cache salt"
        })
    );
    assert!(check_identity(Scheme::ContentV2, &long[1..], "").is_ok());
}

#[test]
fn different_identities_never_share_a_key() {
    let t: Vec<u32> = (0..64).collect();
    let img = |identifier, offset| {
        [MmInput {
            identifier,
            offset,
            length: 8,
        }]
    };
    let (a, b, c) = (img("a", 3), img("b", 3), img("a", 4));
    let ids = [
        BlockIdentity::default(),
        BlockIdentity {
            lora: "x",
            ..Default::default()
        },
        BlockIdentity {
            lora: "y",
            ..Default::default()
        },
        BlockIdentity {
            salt: "x",
            ..Default::default()
        },
        BlockIdentity {
            lora: "x",
            salt: "x",
            mm: &[],
        },
        BlockIdentity {
            mm: &a,
            ..Default::default()
        },
        BlockIdentity {
            mm: &b,
            ..Default::default()
        },
        BlockIdentity {
            mm: &c,
            ..Default::default()
        },
    ];
    let mut seen = std::collections::HashMap::new();
    for (i, id) in ids.iter().enumerate() {
        for (blk, k) in own_chain(Scheme::ContentV2, 16, &t, id)
            .unwrap()
            .into_iter()
            .enumerate()
        {
            // An image in block 0 only changes block 0's content; every later
            // block differs through its parent.
            if let Some(prev) = seen.insert(k, (i, blk)) {
                panic!("identity {i} block {blk} repeats identity {prev:?}");
            }
        }
    }
}

#[test]
fn errors_are_clear() {
    assert_eq!(
        compute_chain(Scheme::ContentV1, &[1], 0, None),
        Err(ChainError::ZeroBlockSize)
    );
    assert_eq!(
        compute_chain(Scheme::VllmSha256Cbor, &[1; 16], 16, None),
        Err(ChainError::MissingSeed)
    );
    assert_eq!(
        compute_chain(Scheme::EngineRaw, &[1; 16], 16, None),
        Err(ChainError::NotComputable)
    );
    assert!(
        compute_chain(Scheme::ContentV1, &[1; 15], 16, None)
            .unwrap()
            .is_empty()
    );
}

#[test]
fn scheme_names_round_trip() {
    for s in Scheme::ALL {
        assert_eq!(Scheme::from_name(s.name()), Some(s));
    }
    assert_eq!(Scheme::from_name("vllm"), None);
}

#[test]
fn header_value_is_lowercase_hex() {
    assert_eq!(header_value(&[0xAB, 1, u64::MAX]), "ab,1,ffffffffffffffff");
    assert_eq!(header_value(&[]), "");
}
