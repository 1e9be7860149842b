//! `inferencecache chain`: token ids in, `x-inferencecache-block-hashes` out, so a
//! client or gateway without a library can produce the chain of a prompt.

use std::io::{Read, Write};

use anyhow::{Context, bail};

use crate::core::chain::{self, Scheme};

/// `inferencecache chain` flags.
#[derive(Clone, Debug, clap::Args)]
pub struct ChainArgs {
    /// Hash scheme: ic-content-v1 or vllm-sha256-cbor (engine-raw cannot be computed here).
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
    let values = chain::compute_chain(scheme, &tokens, args.block_size, args.hash_seed.as_deref())?;
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
    } else {
        writeln!(output, "{hashes}")?;
    }
    Ok(())
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
