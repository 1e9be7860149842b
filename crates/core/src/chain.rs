//! Hash schemes: how a chain of block hashes is computed from token ids, so the
//! sidecar, clients and gateways all produce the same `x-inferencecache-block-hashes`.
//!
//! A scope's `hash_scheme` names one of these. Chains cover full blocks only: a
//! trailing partial block is never hashed (engines do not cache it either). The
//! exact algorithms, for clients in other languages, are in `docs/hash-schemes.md`.
//!
//! - [`IC_CONTENT_V1`]: our own content chain. The KV event subscriber recomputes it
//!   from each event's `token_ids`, so it matches whatever the engine's own hash
//!   algorithm or seed. Token ids only.
//! - [`IC_CONTENT_V2`]: our own content chain with vLLM's block identity: multimodal
//!   inputs in the chain, the LoRA adapter and cache salt in the index key
//!   ([`content_v2`]); xxh3-64, so cheap enough to recompute for every stored block.
//! - [`VLLM_SHA256_CBOR`]: vLLM's `sha256_cbor` block hash, byte for byte; needs the
//!   engine's `PYTHONHASHSEED`.
//! - [`ENGINE_RAW`]: the engine's hashes as published; the client computes them.

pub mod content_v2;

use sha2::{Digest, Sha256};
use thiserror::Error;

pub use content_v2::{BlockIdentity, Extra, MmInput};

/// Our own content chain (SHA-256 over parent value and token ids).
pub const IC_CONTENT_V1: &str = "ic-content-v1";
/// Our own content chain with block identity (xxh3-64; LoRA adapter, cache salt,
/// multimodal inputs).
pub const IC_CONTENT_V2: &str = "ic-content-v2";
/// vLLM `--prefix-caching-hash-algo sha256_cbor` with a fixed `PYTHONHASHSEED`.
pub const VLLM_SHA256_CBOR: &str = "vllm-sha256-cbor";
/// The engine's published hashes, used as they are.
pub const ENGINE_RAW: &str = "engine-raw";

/// A known hash scheme.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Scheme {
    ContentV1,
    ContentV2,
    VllmSha256Cbor,
    EngineRaw,
}

impl Scheme {
    pub const ALL: [Scheme; 4] = [
        Self::ContentV1,
        Self::ContentV2,
        Self::VllmSha256Cbor,
        Self::EngineRaw,
    ];

    /// The scheme of a scope's `hash_scheme`, if it is one of ours.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.name() == name)
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::ContentV1 => IC_CONTENT_V1,
            Self::ContentV2 => IC_CONTENT_V2,
            Self::VllmSha256Cbor => VLLM_SHA256_CBOR,
            Self::EngineRaw => ENGINE_RAW,
        }
    }
}

/// Why a chain could not be computed.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum ChainError {
    #[error("block size must be at least 1")]
    ZeroBlockSize,
    #[error("{ENGINE_RAW} hashes come from the engine; compute them with the engine's algorithm")]
    NotComputable,
    #[error("{VLLM_SHA256_CBOR} needs the engine's PYTHONHASHSEED (--hash-seed)")]
    MissingSeed,
    #[error(
        "{0} hashes token ids only; a LoRA adapter, cache salt or multimodal input needs {IC_CONTENT_V2}"
    )]
    NoIdentity(&'static str),
    #[error("{what} is longer than {max} bytes", max = content_v2::MAX_IDENTITY_LEN)]
    IdentityTooLong { what: &'static str },
}

/// The chain of `token_ids` under `scheme`, one value per full block, block 0 first.
/// `hash_seed` is the engine's `PYTHONHASHSEED` (only [`Scheme::VllmSha256Cbor`]).
/// This is what a client sends in `x-inferencecache-block-hashes`; under
/// [`Scheme::ContentV2`] the request's adapter and salt travel beside it.
pub fn compute_chain(
    scheme: Scheme,
    token_ids: &[u32],
    block_size: u32,
    hash_seed: Option<&str>,
) -> Result<Vec<u64>, ChainError> {
    client_chain(scheme, token_ids, block_size, hash_seed, &[])
}

/// [`compute_chain`] with the prompt's multimodal inputs ([`Scheme::ContentV2`]
/// only: other schemes refuse them).
pub fn client_chain(
    scheme: Scheme,
    token_ids: &[u32],
    block_size: u32,
    hash_seed: Option<&str>,
    mm: &[MmInput<'_>],
) -> Result<Vec<u64>, ChainError> {
    if block_size == 0 {
        return Err(ChainError::ZeroBlockSize);
    }
    if !mm.is_empty() && scheme != Scheme::ContentV2 {
        return Err(ChainError::NoIdentity(scheme.name()));
    }
    let blocks = token_ids.chunks_exact(block_size as usize);
    match scheme {
        Scheme::ContentV2 => Ok(content_v2::content_chain(
            block_size as usize,
            token_ids,
            mm,
        )),
        Scheme::ContentV1 => {
            let mut parent = None;
            Ok(blocks
                .map(|block| {
                    let value = content_block(parent, block);
                    parent = Some(value);
                    value
                })
                .collect())
        }
        Scheme::VllmSha256Cbor => {
            let mut parent = vllm_none_hash(hash_seed.ok_or(ChainError::MissingSeed)?);
            Ok(blocks
                .map(|block| {
                    parent = vllm_block_digest(&parent, block);
                    digest_value(&parent)
                })
                .collect())
        }
        Scheme::EngineRaw => Err(ChainError::NotComputable),
    }
}

/// The values the index holds for a request's blocks under `scheme` (what the KV
/// event translation stores for the same blocks): the [`client_chain`] with the
/// identity's multimodal inputs, then, under [`Scheme::ContentV2`], each value keyed
/// by the adapter and salt ([`content_v2::identity_key`]).
///
/// For a lookup, send the [`client_chain`] and put the adapter and salt in the
/// request (`LookupRequest::lora_adapter` / `cache_salt`): the router applies the
/// identity itself, so these keys must not be sent as block hashes.
pub fn own_chain(
    scheme: Scheme,
    block_size: u32,
    token_ids: &[u32],
    identity: &BlockIdentity<'_>,
) -> Result<Vec<u64>, ChainError> {
    check_identity(scheme, identity.lora, identity.salt)?;
    let mut chain = client_chain(scheme, token_ids, block_size, None, identity.mm)?;
    if let Some(d) = content_v2::identity_digest(identity.lora, identity.salt) {
        for v in &mut chain {
            *v = content_v2::identity_key(Some(d), *v);
        }
    }
    Ok(chain)
}

/// Whether `scheme` can carry a request's adapter and salt, and they fit.
pub fn check_identity(scheme: Scheme, lora: &str, salt: &str) -> Result<(), ChainError> {
    for (what, v) in [("the LoRA adapter", lora), ("the cache salt", salt)] {
        if v.len() > content_v2::MAX_IDENTITY_LEN {
            return Err(ChainError::IdentityTooLong { what });
        }
    }
    if (!lora.is_empty() || !salt.is_empty()) && scheme != Scheme::ContentV2 {
        return Err(ChainError::NoIdentity(scheme.name()));
    }
    Ok(())
}

/// The index keys of a request's chain: `Some` only when the scope's scheme is
/// [`IC_CONTENT_V2`] and the request names an adapter or salt (otherwise the chain
/// is looked up as sent).
pub fn request_keys(hash_scheme: &str, chain: &[u64], lora: &str, salt: &str) -> Option<Vec<u64>> {
    if hash_scheme != IC_CONTENT_V2 {
        return None;
    }
    let d = content_v2::identity_digest(lora, salt)?;
    Some(
        chain
            .iter()
            .map(|&v| content_v2::identity_key(Some(d), v))
            .collect(),
    )
}

/// One [`IC_CONTENT_V1`] block: SHA-256 over the parent's value (8 bytes
/// big-endian, zero for block 0) then each token as u32 little-endian; the value is
/// the digest's last 8 bytes, big-endian.
pub fn content_block(parent: Option<u64>, tokens: &[u32]) -> u64 {
    let mut h = Sha256::new();
    h.update(parent.unwrap_or(0).to_be_bytes());
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    digest_value(&h.finalize().into())
}

/// The value an engine event carries for a digest: its last 8 bytes, big-endian.
pub fn digest_value(digest: &[u8; 32]) -> u64 {
    let mut tail = [0u8; 8];
    tail.copy_from_slice(&digest[24..]);
    u64::from_be_bytes(tail)
}

/// vLLM's `NONE_HASH` (the parent of block 0) for a fixed `PYTHONHASHSEED`:
/// SHA-256 of the CBOR text string of the seed.
pub fn vllm_none_hash(seed: &str) -> [u8; 32] {
    let mut cbor = Vec::with_capacity(seed.len() + 9);
    cbor_head(&mut cbor, 3, seed.len() as u64);
    cbor.extend_from_slice(seed.as_bytes());
    Sha256::digest(&cbor).into()
}

/// vLLM's `sha256_cbor` digest of one block without extra keys: SHA-256 of the
/// canonical CBOR of `(parent_digest, tuple(tokens), None)`.
pub fn vllm_block_digest(parent: &[u8; 32], tokens: &[u32]) -> [u8; 32] {
    let mut cbor = Vec::with_capacity(40 + tokens.len() * 5);
    cbor.push(0x83);
    cbor_head(&mut cbor, 2, 32);
    cbor.extend_from_slice(parent);
    cbor_head(&mut cbor, 4, tokens.len() as u64);
    for &t in tokens {
        cbor_head(&mut cbor, 0, u64::from(t));
    }
    cbor.push(0xf6);
    Sha256::digest(&cbor).into()
}

/// A canonical (shortest) CBOR head: major type and argument.
fn cbor_head(out: &mut Vec<u8>, major: u8, arg: u64) {
    let m = major << 5;
    match arg {
        0..=23 => out.push(m | arg as u8),
        24..=0xff => out.extend_from_slice(&[m | 24, arg as u8]),
        0x100..=0xffff => {
            out.push(m | 25);
            out.extend_from_slice(&(arg as u16).to_be_bytes());
        }
        0x1_0000..=0xffff_ffff => {
            out.push(m | 26);
            out.extend_from_slice(&(arg as u32).to_be_bytes());
        }
        _ => {
            out.push(m | 27);
            out.extend_from_slice(&arg.to_be_bytes());
        }
    }
}

/// The `x-inferencecache-block-hashes` value of a chain: lowercase hex, no `0x`,
/// comma-separated.
pub fn header_value(chain: &[u64]) -> String {
    let mut out = String::with_capacity(chain.len() * 17);
    for (i, v) in chain.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(&format!("{v:x}"));
    }
    out
}

#[cfg(test)]
mod tests;
