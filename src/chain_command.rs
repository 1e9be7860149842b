//! `inferencecache chain`: token ids in, `x-inferencecache-block-hashes` out, so a
//! client or gateway without a library can produce the chain of a prompt. Under
//! `ic-content-v2` the adapter, salt and multimodal inputs are options: the inputs
//! go into the chain, adapter and salt travel as their own headers (or, with
//! `--index-keys`, key the values the way the index holds them).

use std::io::{Read, Write};

use anyhow::{Context, bail};

use crate::adapters::ext_proc::headers::{CACHE_SALT, LORA_ADAPTER};
use crate::core::chain::{self, BlockIdentity, MmInput, Scheme};

/// `inferencecache chain` flags.
#[derive(Clone, Debug, clap::Args)]
pub struct ChainArgs {
    /// Hash scheme: ic-content-v1, ic-content-v2 or vllm-sha256-cbor (engine-raw cannot
    /// be computed here).
    #[arg(long, value_name = "SCHEME")]
    pub scheme: String,
    /// Tokens per block (the engine's block size / page size).
    #[arg(long, value_name = "N", default_value_t = 16)]
    pub block_size: u32,
    /// The engine's PYTHONHASHSEED (vllm-sha256-cbor only).
    #[arg(long, value_name = "SEED")]
    pub hash_seed: Option<String>,
    /// Also print `x-inferencecache-block-token-counts: ...` on a second line, and
    /// prefix each line with its header name.
    #[arg(long)]
    pub headers: bool,
    /// The request's LoRA adapter (ic-content-v2): printed as its header with
    /// `--headers`.
    #[arg(long, value_name = "NAME", default_value = "")]
    pub lora_adapter: String,
    /// The request's cache salt (ic-content-v2): printed as its header with
    /// `--headers`.
    #[arg(long, value_name = "SALT", default_value = "")]
    pub cache_salt: String,
    /// A multimodal input in the prompt (ic-content-v2), as
    /// IDENTIFIER:OFFSET:LENGTH in prompt token positions (vLLM's mm_features);
    /// repeat for several, in prompt order.
    #[arg(long = "mm", value_name = "ID:OFFSET:LEN")]
    pub mm: Vec<String>,
    /// Print the index keys (the chain keyed with adapter and salt: what an
    /// IngestEvents publisher sends) instead of the client chain.
    #[arg(long)]
    pub index_keys: bool,
}

/// Reads token ids (whitespace or comma separated) from `input` and writes the
/// chain's header value to `output`.
pub fn run(args: &ChainArgs, input: impl Read, mut output: impl Write) -> anyhow::Result<()> {
    let Some(scheme) = Scheme::from_name(&args.scheme) else {
        let known: Vec<_> = Scheme::ALL.iter().map(|s| s.name()).collect();
        bail!(
            "unknown --scheme {:?}; known: {}",
            args.scheme,
            known.join(", ")
        );
    };
    let tokens = read_tokens(input)?;
    let mm = args
        .mm
        .iter()
        .map(|m| parse_mm(m))
        .collect::<anyhow::Result<Vec<_>>>()?;
    chain::check_identity(scheme, &args.lora_adapter, &args.cache_salt)?;
    let values = if args.index_keys {
        let identity = BlockIdentity {
            lora: &args.lora_adapter,
            salt: &args.cache_salt,
            mm: &mm,
        };
        chain::own_chain(scheme, args.block_size, &tokens, &identity)?
    } else {
        chain::client_chain(
            scheme,
            &tokens,
            args.block_size,
            args.hash_seed.as_deref(),
            &mm,
        )?
    };
    if values.is_empty() {
        bail!(
            "{} token ids make no full block of {}",
            tokens.len(),
            args.block_size
        );
    }
    let hashes = chain::header_value(&values);
    if args.headers {
        let counts = vec![args.block_size.to_string(); values.len()].join(",");
        writeln!(output, "x-inferencecache-block-hashes: {hashes}")?;
        writeln!(output, "x-inferencecache-block-token-counts: {counts}")?;
        // Index keys already carry the identity: sending it again would key twice.
        if !args.index_keys {
            for (name, v) in [
                (LORA_ADAPTER, &args.lora_adapter),
                (CACHE_SALT, &args.cache_salt),
            ] {
                if !v.is_empty() {
                    writeln!(output, "{name}: {v}")?;
                }
            }
        }
    } else {
        writeln!(output, "{hashes}")?;
    }
    Ok(())
}

/// `IDENTIFIER:OFFSET:LENGTH` (the identifier may itself contain colons).
fn parse_mm(spec: &str) -> anyhow::Result<MmInput<'_>> {
    let mut parts = spec.rsplitn(3, ':');
    let (Some(len), Some(off), Some(id)) = (parts.next(), parts.next(), parts.next()) else {
        bail!("--mm {spec:?} is not IDENTIFIER:OFFSET:LENGTH");
    };
    let num = |what: &str, v: &str| {
        v.parse::<u32>()
            .with_context(|| format!("--mm {spec:?}: {what} {v:?} is not a u32"))
    };
    if id.is_empty() {
        bail!("--mm {spec:?} has an empty identifier");
    }
    Ok(MmInput {
        identifier: id,
        offset: num("offset", off)?,
        length: num("length", len)?,
    })
}

fn read_tokens(mut input: impl Read) -> anyhow::Result<Vec<u32>> {
    let mut text = String::new();
    input
        .read_to_string(&mut text)
        .context("reading token ids from stdin")?;
    text.split(|c: char| c.is_whitespace() || c == ',')
        .filter(|s| !s.is_empty())
        .enumerate()
        .map(|(i, s)| {
            s.parse::<u32>()
                .with_context(|| format!("token {i} {s:?} is not a u32 token id"))
        })
        .collect()
}

#[cfg(test)]
mod tests {
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
}
