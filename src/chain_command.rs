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
mod tests;
