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
mod tests {
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
}
