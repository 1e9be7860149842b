use super::*;

fn parse(pairs: &[(&str, &str)]) -> RoutingHeaders {
    RoutingHeaders::parse(pairs.iter().map(|(k, v)| (*k, v.as_bytes())))
}

fn mk_scope() -> Vec<(&'static str, &'static str)> {
    vec![
        (TENANT, "acme"),
        (MODEL, "llama"),
        (HASH_SCHEME, "vllm-sha256-cbor"),
    ]
}

#[test]
fn reads_scope_chain_and_debug() {
    let mut h = mk_scope();
    h.push((BLOCK_HASHES, "a, ff ,ffffffffffffffff"));
    h.push((BLOCK_TOKEN_COUNTS, "16,16,3"));
    h.push((DEBUG, "1"));
    let got = parse(&h);
    assert_eq!(got.malformed, None);
    assert!(got.debug);
    assert_eq!(got.fields.tenant, "acme");
    assert_eq!(got.fields.model, "llama");
    assert_eq!(got.fields.hash_scheme, "vllm-sha256-cbor");
    assert_eq!(got.fields.block_hashes, vec![0xa, 0xff, u64::MAX]);
    assert_eq!(got.fields.block_token_counts, vec![16, 16, 3]);
}

#[test]
fn names_are_case_insensitive_and_absent_headers_are_empty() {
    let got = parse(&[("X-InferenceCache-Tenant", "acme")]);
    assert_eq!(got.malformed, None);
    assert!(!got.debug);
    assert_eq!(got.fields.tenant, "acme");
    assert!(got.fields.block_hashes.is_empty());
    assert_eq!(got.fields.prefix_tokens, 0);
}

#[test]
fn exact_prefix_headers() {
    let mut h = mk_scope();
    h.push((PREFIX_HASH, "sys-prompt-7"));
    h.push((PREFIX_TOKENS, "128"));
    let got = parse(&h);
    assert_eq!(got.malformed, None);
    assert_eq!(got.fields.prefix_hash, "sys-prompt-7");
    assert_eq!(got.fields.prefix_tokens, 128);
}

#[test]
fn debug_needs_exactly_one() {
    assert!(!parse(&[(DEBUG, "true")]).debug);
    assert!(!parse(&[(DEBUG, "0")]).debug);
    assert!(parse(&[(DEBUG, " 1 ")]).debug);
}

#[test]
fn rejects_non_canonical_hashes() {
    for bad in ["0xff", "FF", "-1", "", "g1", "11111111111111111", "1 2"] {
        let mut h = mk_scope();
        let chain = format!("a,{bad}");
        h.push((BLOCK_HASHES, chain.as_str()));
        h.push((BLOCK_TOKEN_COUNTS, "16,16"));
        let got = parse(&h);
        assert!(
            matches!(
                got.malformed,
                Some(MalformedHeader::BadHash { index: 1, .. })
            ),
            "{bad:?}: {:?}",
            got.malformed
        );
        assert!(got.fields.block_hashes.is_empty(), "half a chain leaked");
        // The scope survives so ORIGINAL_DST can still pick a replica.
        assert_eq!(got.fields.tenant, "acme");
    }
}

#[test]
fn rejects_bad_counts() {
    for bad in ["-1", "1.5", "4294967296", "x", ""] {
        let mut h = mk_scope();
        h.push((BLOCK_HASHES, "a,b"));
        let counts = format!("16,{bad}");
        h.push((BLOCK_TOKEN_COUNTS, counts.as_str()));
        let got = parse(&h);
        assert!(
            matches!(
                got.malformed,
                Some(MalformedHeader::BadCount { index: 1, .. })
            ),
            "{bad:?}"
        );
    }
    let got = parse(&[(PREFIX_HASH, "p"), (PREFIX_TOKENS, "lots")]);
    assert!(matches!(
        got.malformed,
        Some(MalformedHeader::BadCount {
            header: PREFIX_TOKENS,
            ..
        })
    ));
    assert_eq!(
        got.fields.prefix_hash, "",
        "exact-prefix key dropped with its count"
    );
}

#[test]
fn unequal_chain_arrays_reach_the_core_with_a_note() {
    let got = parse(&[(BLOCK_HASHES, "a,b,c"), (BLOCK_TOKEN_COUNTS, "16,16")]);
    assert_eq!(got.malformed, None);
    assert_eq!(got.fields.block_hashes, vec![0xa, 0xb, 0xc]);
    assert_eq!(
        got.chain_mismatch(),
        Some(MalformedHeader::Unequal {
            hashes: 3,
            counts: 2
        })
    );
    let got = parse(&[(BLOCK_HASHES, "a")]);
    assert_eq!(
        got.chain_mismatch(),
        Some(MalformedHeader::Unequal {
            hashes: 1,
            counts: 0
        })
    );
    let got = parse(&[(BLOCK_HASHES, "a"), (BLOCK_TOKEN_COUNTS, "16")]);
    assert_eq!(got.chain_mismatch(), None);
}

#[test]
fn rejects_repeated_headers_but_keeps_debug() {
    let got = parse(&[(TENANT, "a"), (TENANT, "b"), (DEBUG, "1")]);
    assert_eq!(got.malformed, Some(MalformedHeader::Repeated(TENANT)));
    assert!(got.debug);
}

#[test]
fn a_repeat_in_another_spelling_is_still_a_repeat() {
    let got = parse(&[(TENANT, "a"), ("X-INFERENCECACHE-TENANT", "b")]);
    assert_eq!(got.malformed, Some(MalformedHeader::Repeated(TENANT)));
    assert_eq!(got.fields.tenant, "a");
}

#[test]
fn look_alike_and_unrelated_names_are_passed_over() {
    let got = parse(&[
        ("x-inferencecache-tenantx", "a"),
        ("x-inferencecache-", "b"),
        ("x-inferencecach", "c"),
        ("x-inférencecache-tenant", "d"),
        (":path", "/v1/completions"),
        (MODEL, "m"),
    ]);
    assert_eq!(got.malformed, None);
    assert_eq!(got.fields.tenant, "");
    assert_eq!(got.fields.model, "m");
}

#[test]
fn rejects_non_utf8() {
    let got = RoutingHeaders::parse([(MODEL, &[0xff, 0xfe][..])]);
    assert_eq!(got.malformed, Some(MalformedHeader::NotText(MODEL)));
}

#[test]
fn refuses_huge_chains_before_parsing() {
    let chain = vec!["a"; MAX_CHAIN_BLOCKS + 1].join(",");
    let got = parse(&[(BLOCK_HASHES, chain.as_str())]);
    assert_eq!(
        got.malformed,
        Some(MalformedHeader::TooLong {
            blocks: MAX_CHAIN_BLOCKS + 1
        })
    );
}

#[test]
fn messages_name_the_header() {
    let got = parse(&[(BLOCK_HASHES, "zz"), (BLOCK_TOKEN_COUNTS, "1")]);
    let msg = got.malformed.map(|m| m.to_string()).unwrap_or_default();
    assert!(msg.contains(BLOCK_HASHES), "{msg}");
    assert!(msg.contains("\"zz\""), "{msg}");
}

#[test]
fn format_chain_round_trips() {
    let chain = [0u64, 1, 0xdead_beef, u64::MAX];
    let counts = "1,1,1,1";
    let text = format_chain(&chain);
    let got = parse(&[(BLOCK_HASHES, text.as_str()), (BLOCK_TOKEN_COUNTS, counts)]);
    assert_eq!(got.fields.block_hashes, chain);
}

#[test]
fn reads_lora_adapter_and_cache_salt() {
    let mut h = mk_scope();
    h.push((LORA_ADAPTER, " sql-adapter "));
    h.push(("X-InferenceCache-Cache-Salt", "tenant-7"));
    let got = parse(&h);
    assert_eq!(got.malformed, None);
    assert_eq!(got.fields.lora_adapter, "sql-adapter");
    assert_eq!(got.fields.cache_salt, "tenant-7");
    // Absent or empty: none.
    let got = parse(&[(LORA_ADAPTER, "")]);
    assert_eq!(
        (got.malformed, got.fields.lora_adapter.as_str()),
        (None, "")
    );
    assert_eq!(parse(&mk_scope()).fields.cache_salt, "");
}

#[test]
fn malformed_identity_headers_are_refused_and_clear_everything() {
    let long = "s".repeat(MAX_IDENTITY_LEN + 1);
    type Pairs<'a> = Vec<(&'a str, &'a [u8])>;
    let cases: [(Pairs, MalformedHeader); 3] = [
        (
            vec![(LORA_ADAPTER, b"a"), (LORA_ADAPTER, b"b")],
            MalformedHeader::Repeated(LORA_ADAPTER),
        ),
        (
            vec![(CACHE_SALT, b"\xff\xfe")],
            MalformedHeader::NotText(CACHE_SALT),
        ),
        (
            vec![(CACHE_SALT, long.as_bytes()), (LORA_ADAPTER, b"ok")],
            MalformedHeader::TooLongValue {
                header: CACHE_SALT,
                bytes: MAX_IDENTITY_LEN + 1,
            },
        ),
    ];
    for (mut pairs, want) in cases {
        pairs.push((BLOCK_HASHES, b"a1,a2"));
        pairs.push((BLOCK_TOKEN_COUNTS, b"16,16"));
        let got = RoutingHeaders::parse(pairs.iter().map(|(k, v)| (*k, *v)));
        assert_eq!(got.malformed.as_ref(), Some(&want));
        assert!(got.fields.block_hashes.is_empty());
        assert_eq!(got.fields.lora_adapter, "");
        assert_eq!(got.fields.cache_salt, "");
    }
    assert_eq!(
        MalformedHeader::TooLongValue {
            header: CACHE_SALT,
            bytes: 5000
        }
        .to_string(),
        format!("{CACHE_SALT} has 5000 bytes; at most {MAX_IDENTITY_LEN} are accepted")
    );
    // Exactly at the limit is fine.
    let edge = "s".repeat(MAX_IDENTITY_LEN);
    assert_eq!(parse(&[(LORA_ADAPTER, edge.as_str())]).malformed, None);
}

#[test]
fn priority_is_an_integer_defaulting_to_zero_and_never_malformed() {
    for (value, want) in [
        ("7", 7),
        ("-3", -3),
        (" 12 ", 12),
        ("high", 0),
        ("1.5", 0),
        ("", 0),
    ] {
        let mut h = mk_scope();
        h.push((PRIORITY, value));
        let got = parse(&h);
        assert_eq!(got.priority, want, "{value:?}");
        assert_eq!(got.malformed, None, "{value:?}");
    }
    assert_eq!(parse(&mk_scope()).priority, 0);
    let mut h = mk_scope();
    h.push(("X-InferenceCache-Priority", "4"));
    assert_eq!(parse(&h).priority, 4);
}
