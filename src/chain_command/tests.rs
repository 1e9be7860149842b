use super::*;

fn args(scheme: &str, seed: Option<&str>, headers: bool) -> ChainArgs {
    ChainArgs {
        scheme: scheme.into(),
        block_size: 16,
        hash_seed: seed.map(Into::into),
        headers,
        lora_adapter: String::new(),
        cache_salt: String::new(),
        mm: Vec::new(),
        index_keys: false,
    }
}

fn run_str(a: &ChainArgs, input: &str) -> anyhow::Result<String> {
    let mut out = Vec::new();
    run(a, input.as_bytes(), &mut out)?;
    Ok(String::from_utf8(out).unwrap())
}

#[test]
fn prints_the_vllm_golden_chain() {
    let input = "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16,\n100,1000,70000,128000 200 201 202 203 204 205 206 207 208 209 210 211 9";
    let out = run_str(&args("vllm-sha256-cbor", Some("0"), true), input).unwrap();
    assert_eq!(
        out,
        format!(
            "x-inferencecache-block-hashes: {:x},{:x}\nx-inferencecache-block-token-counts: 16,16\n",
            3_236_607_068_019_569_386u64, 1_206_300_911_754_328_078u64
        )
    );
}

/// The vectors of docs/hash-schemes.md, tokens 1..32.
#[test]
fn content_v2_with_identity_and_an_image() {
    let input: String = (1..=32).map(|t| format!("{t} ")).collect();
    let mut a = args("ic-content-v2", None, true);
    a.lora_adapter = "sql-adapter".into();
    a.cache_salt = "tenant-7".into();
    assert_eq!(
        run_str(&a, &input).unwrap(),
        "x-inferencecache-block-hashes: c435cf40cf0291b0,ad19b8574e4e6a10\n\
             x-inferencecache-block-token-counts: 16,16\n\
             x-inferencecache-lora-adapter: sql-adapter\n\
             x-inferencecache-cache-salt: tenant-7\n"
    );
    a.index_keys = true;
    assert_eq!(
        run_str(&a, &input).unwrap(),
        "x-inferencecache-block-hashes: ae4c1ae04f1fba83,e28e97d1f08eddb5\n\
             x-inferencecache-block-token-counts: 16,16\n"
    );
    let mut img = args("ic-content-v2", None, false);
    img.mm = vec!["img-abc:10:20".into()];
    assert_eq!(
        run_str(&img, &input).unwrap(),
        "ded813868196dc69,874e475c093fc697\n"
    );
}

#[test]
fn identity_options_need_content_v2_and_well_formed_values() {
    let input = "1 ".repeat(16);
    let mut a = args("ic-content-v1", None, false);
    a.lora_adapter = "sql".into();
    let e = run_str(&a, &input).unwrap_err();
    assert!(e.to_string().contains("ic-content-v2"), "{e}");
    let mut a = args("ic-content-v1", None, false);
    a.mm = vec!["i:0:4".into()];
    assert!(run_str(&a, &input).is_err());
    for bad in ["img", "img:1", "img:x:4", ":0:4", "img:0:-1"] {
        let mut a = args("ic-content-v2", None, false);
        a.mm = vec![bad.into()];
        let e = run_str(&a, &input).unwrap_err();
        assert!(format!("{e:#}").contains("--mm"), "{bad}: {e:#}");
    }
    let mut a = args("ic-content-v2", None, false);
    a.mm = vec!["sha:ab:cd:0:4".into()];
    assert!(run_str(&a, &input).is_ok(), "identifiers may hold colons");
}

#[test]
fn bad_input_is_a_clear_error() {
    let e = run_str(&args("ic-content-v1", None, false), "1 2 x").unwrap_err();
    assert!(format!("{e:#}").contains("token 2 \"x\""), "{e:#}");
    let e = run_str(&args("nope", None, false), "1").unwrap_err();
    assert!(e.to_string().contains("unknown --scheme"));
    let e = run_str(&args("ic-content-v1", None, false), "1 2 3").unwrap_err();
    assert!(e.to_string().contains("no full block"));
    assert!(run_str(&args("vllm-sha256-cbor", None, false), &"1 ".repeat(16)).is_err());
    assert!(run_str(&args("engine-raw", None, false), &"1 ".repeat(16)).is_err());
}
