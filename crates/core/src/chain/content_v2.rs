//! [`IC_CONTENT_V2`](super::IC_CONTENT_V2): block identity beyond token ids.
//!
//! vLLM names a block by its tokens *and* the request's LoRA adapter, its cache salt
//! (first block only, so the whole chain differs) and the multimodal inputs and
//! prompt-embedding digests inside the block. Two requests with the same tokens under
//! another adapter or salt must never share blocks here either.
//!
//! Two parts, kept apart so a client chain says only what the prompt is and the
//! request says under which identity it runs (headers `x-inferencecache-lora-adapter`
//! / `x-inferencecache-cache-salt`, `LookupRouteRequest.lora_adapter` / `cache_salt`):
//!
//! - the **content chain** (what clients compute and send): per block, xxh3-64 of an
//!   unambiguous, length-prefixed encoding of the parent value, the tokens and the
//!   block's extra keys ([`block_value`]);
//! - the **index key** of a block: the content value itself when the request has no
//!   identity, else xxh3-64 of the identity digest and the content value
//!   ([`identity_key`]). The sidecar applies it to requests (from their identity) and
//!   to engine events (from `lora_name` / the salt in `extra_keys`, inherited along
//!   the chain), so no client can get it wrong.
//!
//! The encodings and test vectors are in `docs/hash-schemes.md`.

use smallvec::SmallVec;
use xxhash_rust::xxh3::xxh3_64;

/// The longest LoRA adapter name or cache salt accepted (bytes). Length prefixes are
/// u32, and `UNNAMED_ADAPTER` (`u32::MAX`) is reserved as one.
pub const MAX_IDENTITY_LEN: usize = 4096;

/// A length prefix no name can have: marks an adapter known only by the engine's
/// numeric id (vLLM 0.11 publishes `lora_id` but no name).
const UNNAMED_ADAPTER: u32 = u32::MAX;

/// Extra-key tags in a block's encoding.
const TAG_MM: u8 = 1;
const TAG_EMBEDS: u8 = 2;
const TAG_OPAQUE: u8 = 3;

/// One multimodal input of a prompt, as vLLM's `mm_features` name it: its identifier
/// (vLLM's `identifier`, the processor's content hash) and the token range its
/// placeholder occupies, in prompt positions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MmInput<'a> {
    pub identifier: &'a str,
    pub offset: u32,
    pub length: u32,
}

/// What besides the tokens names a request's blocks. Empty strings mean "none"
/// (vLLM treats an empty salt as no salt).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BlockIdentity<'a> {
    pub lora: &'a str,
    pub salt: &'a str,
    /// Sorted by offset, as vLLM keeps them.
    pub mm: &'a [MmInput<'a>],
}

/// One extra key of one block, beyond the request's adapter and salt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Extra<'a> {
    /// A multimodal input in the block: its identifier and where it starts relative
    /// to the block's first token (negative when it began in an earlier block).
    Mm { identifier: &'a str, offset: i64 },
    /// vLLM's SHA-256 of the block's prompt embeddings.
    Embeds(&'a [u8]),
    /// An extra key of a shape this version does not know, as its msgpack bytes:
    /// such a block matches no client chain (a miss, never a wrong hit).
    Opaque(&'a [u8]),
}

/// The identity digest of a request: `None` without adapter and salt, so such a
/// request's keys are its content values.
pub fn identity_digest(lora: &str, salt: &str) -> Option<u64> {
    if lora.is_empty() && salt.is_empty() {
        return None;
    }
    let mut buf: SmallVec<[u8; 128]> = SmallVec::new();
    put_str(&mut buf, lora);
    put_str(&mut buf, salt);
    Some(nonzero(xxh3_64(&buf)))
}

/// The identity digest of blocks an engine stored under an adapter it names only by
/// its numeric id (vLLM 0.11). No request can carry it: those blocks match nothing,
/// which is a miss where a token-only chain would have been a wrong hit.
pub fn unnamed_adapter_digest(lora_id: i64, salt: &str) -> u64 {
    let mut buf: SmallVec<[u8; 128]> = SmallVec::new();
    buf.extend_from_slice(&UNNAMED_ADAPTER.to_le_bytes());
    buf.extend_from_slice(&lora_id.to_le_bytes());
    put_str(&mut buf, salt);
    nonzero(xxh3_64(&buf))
}

/// Digests are never 0, so 0 can stand for "no identity" in compact storage.
fn nonzero(v: u64) -> u64 {
    if v == 0 { 1 } else { v }
}

/// A block's index key: its content value, or mixed with the identity digest.
#[inline]
pub fn identity_key(identity: Option<u64>, content: u64) -> u64 {
    match identity {
        None => content,
        Some(d) => {
            let mut buf = [0u8; 16];
            buf[..8].copy_from_slice(&d.to_le_bytes());
            buf[8..].copy_from_slice(&content.to_le_bytes());
            xxh3_64(&buf)
        }
    }
}

/// One `ic-content-v2` content value: xxh3-64 (seed 0) of
/// `u8 has_parent · u64_le parent · u32_le n · n × u32_le token · u32_le k · k extras`,
/// each extra a tag byte and its fields (strings and bytes length-prefixed, u32_le).
pub fn block_value(parent: Option<u64>, tokens: &[u32], extras: &[Extra<'_>]) -> u64 {
    // The common cases (no extra keys; vLLM's 16-token blocks, pages up to 64
    // tokens): the encoding in a fixed array on the stack, with no length to keep.
    // Same bytes as the general path below.
    if extras.is_empty() {
        if tokens.len() <= 16 {
            return plain_value::<{ PLAIN_HEAD + 16 * 4 + 4 }>(parent, tokens);
        }
        if tokens.len() <= 64 {
            return plain_value::<{ PLAIN_HEAD + 64 * 4 + 4 }>(parent, tokens);
        }
    }
    general_value(parent, tokens, extras)
}

/// [`block_value`] for any block: the encoding in a growable buffer.
fn general_value(parent: Option<u64>, tokens: &[u32], extras: &[Extra<'_>]) -> u64 {
    const HEAD: usize = 1 + 8 + 4;
    /// Zeros to size the buffer with: `SmallVec::resize` writes them one by one.
    const ZEROS: [u8; 320] = [0; 320];
    let mut buf: SmallVec<[u8; 320]> = SmallVec::new();
    // Sized once and written in place: per-token pushes cost a capacity check
    // each, and this runs for every block an engine stores.
    let len = HEAD + tokens.len() * 4 + 4;
    match ZEROS.get(..len) {
        Some(zeros) => buf.extend_from_slice(zeros),
        None => buf.resize(len, 0),
    }
    buf[0] = u8::from(parent.is_some());
    buf[1..9].copy_from_slice(&parent.unwrap_or(0).to_le_bytes());
    buf[9..HEAD].copy_from_slice(&(tokens.len() as u32).to_le_bytes());
    let (body, count) = buf[HEAD..].split_at_mut(tokens.len() * 4);
    for (dst, t) in body.chunks_exact_mut(4).zip(tokens) {
        dst.copy_from_slice(&t.to_le_bytes());
    }
    count.copy_from_slice(&(extras.len() as u32).to_le_bytes());
    for e in extras {
        match *e {
            Extra::Mm { identifier, offset } => {
                buf.push(TAG_MM);
                put_str(&mut buf, identifier);
                buf.extend_from_slice(&offset.to_le_bytes());
            }
            Extra::Embeds(b) => {
                buf.push(TAG_EMBEDS);
                put_bytes(&mut buf, b);
            }
            Extra::Opaque(b) => {
                buf.push(TAG_OPAQUE);
                put_bytes(&mut buf, b);
            }
        }
    }
    xxh3_64(&buf)
}

/// `u8 has_parent · u64_le parent · u32_le n`: the head of a block's encoding.
const PLAIN_HEAD: usize = 1 + 8 + 4;

/// [`block_value`] of a block without extra keys whose encoding fits `N` bytes.
#[inline]
fn plain_value<const N: usize>(parent: Option<u64>, tokens: &[u32]) -> u64 {
    let mut buf = [0u8; N];
    let len = PLAIN_HEAD + tokens.len() * 4 + 4;
    buf[0] = u8::from(parent.is_some());
    buf[1..9].copy_from_slice(&parent.unwrap_or(0).to_le_bytes());
    buf[9..PLAIN_HEAD].copy_from_slice(&(tokens.len() as u32).to_le_bytes());
    for (dst, t) in buf[PLAIN_HEAD..].chunks_exact_mut(4).zip(tokens) {
        dst.copy_from_slice(&t.to_le_bytes());
    }
    // The extra-key count, 0, is already in place.
    xxh3_64(&buf[..len])
}

fn put_str<A: smallvec::Array<Item = u8>>(buf: &mut SmallVec<A>, s: &str) {
    put_bytes(buf, s.as_bytes());
}

fn put_bytes<A: smallvec::Array<Item = u8>>(buf: &mut SmallVec<A>, b: &[u8]) {
    buf.extend_from_slice(&(b.len() as u32).to_le_bytes());
    buf.extend_from_slice(b);
}

/// The multimodal extra keys of the block `[start, end)`, as vLLM's
/// `_gen_mm_extra_hash_keys` makes them: every input overlapping the block, with
/// its offset relative to `start`.
pub fn mm_extras<'a>(mm: &[MmInput<'a>], start: u64, end: u64) -> SmallVec<[Extra<'a>; 2]> {
    mm.iter()
        .filter(|m| {
            let (off, len) = (u64::from(m.offset), u64::from(m.length));
            end > off && start < off + len
        })
        .map(|m| Extra::Mm {
            identifier: m.identifier,
            offset: i64::from(m.offset) - start as i64,
        })
        .collect()
}

/// The content chain of `tokens` (full blocks only) with the multimodal inputs.
pub fn content_chain(block_size: usize, tokens: &[u32], mm: &[MmInput<'_>]) -> Vec<u64> {
    let mut parent = None;
    tokens
        .chunks_exact(block_size)
        .enumerate()
        .map(|(i, block)| {
            let start = (i * block_size) as u64;
            let extras = mm_extras(mm, start, start + block_size as u64);
            let v = block_value(parent, block, &extras);
            parent = Some(v);
            v
        })
        .collect()
}

#[cfg(test)]
mod tests;
