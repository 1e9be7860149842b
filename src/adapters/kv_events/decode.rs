//! Engine KV event payloads (msgpack, as vLLM and SGLang publish them) → typed
//! [`EngineBatch`]es. Pure: no sockets, no index.
//!
//! Both generations are accepted (docs/operations.md, "Engine KV event streams"): a batch is an
//! array `[ts, events, dp_rank]` or a map with those keys; an event is an array
//! with its tag first (missing trailing slots are defaults, extra slots ignored) or
//! a map with a `type` key (unknown keys ignored). A hash is a u64, an i64 (old
//! builds; its two's complement bits) or bytes (the last 8, big-endian).
//!
//! Block identity beyond the tokens (vLLM: `lora_name`, `lora_id`, `extra_keys`;
//! SGLang 0.5.23: `lora_name`, `cache_salt`) is read into [`StoredIdentity`], so the
//! `ic-content-v2` translation can key the blocks the way the engine does.
//!
//! The payload is read in one walk over its bytes ([`msgpack`](super::msgpack):
//! no value tree; tokens and hashes go straight into their vectors), depth-limited
//! as before. Anything malformed is a [`DecodeError`], never a panic; an event of an
//! unknown type is skipped and counted, since newer engines add event types. The
//! errors are the ones the earlier `rmpv::Value` decoder gave, in its order (bad
//! msgpack anywhere first, then trailing bytes, then the batch's fields, then the
//! first bad event, its fields in a fixed order): when the walk meets a wrong field
//! it checks the whole payload again to report what that order reports first.

use thiserror::Error;

use super::msgpack::{Cursor, Head, Malformed};

use crate::core::chain;

pub use crate::adapters::MAX_CHAIN_BLOCKS;

/// Nesting deeper than this is not an engine payload.
const MAX_DEPTH: u16 = 16;

/// One published batch.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineBatch {
    /// The engine's wall clock at publish time, seconds since the Unix epoch.
    pub ts: f64,
    pub events: Vec<EngineEvent>,
    pub data_parallel_rank: Option<i64>,
    /// Events of a type this decoder does not know, skipped.
    pub skipped: u32,
    /// Events over [`MAX_CHAIN_BLOCKS`] blocks, skipped (the gRPC path refuses
    /// the same runs).
    pub too_long: u32,
}

/// One engine event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EngineEvent {
    BlockStored {
        block_hashes: Vec<u64>,
        /// `None`: the run starts at block 0.
        parent_block_hash: Option<u64>,
        /// Covers every stored block: `block_hashes.len() × block_size`.
        token_ids: Vec<u32>,
        block_size: u32,
        /// `None` when absent; "GPU" is the main pool.
        medium: Option<String>,
        /// `None`: no adapter, salt or extra keys (the common case, kept small).
        identity: Option<Box<StoredIdentity>>,
    },
    BlockRemoved {
        block_hashes: Vec<u64>,
        medium: Option<String>,
    },
    AllBlocksCleared,
}

/// What besides the tokens names the blocks of one `BlockStored`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StoredIdentity {
    /// The adapter's name (vLLM, SGLang 0.5.23); empty is none.
    pub lora_name: Option<String>,
    /// The engine's numeric adapter id (vLLM 0.11 sends only this).
    pub lora_id: Option<i64>,
    /// The request's salt: SGLang's `cache_salt`, or the salt in vLLM's extra keys
    /// of block 0 (vLLM hashes it into the first block only).
    pub cache_salt: Option<String>,
    /// Per block (empty, or one entry per block hash), the extra keys besides the
    /// adapter name and the salt, in the engine's order.
    pub extras: Vec<Vec<ExtraKey>>,
}

/// One extra key of one block, as vLLM publishes them untagged.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExtraKey {
    /// `(mm_identifier, offset)`: a multimodal input, offset relative to the block.
    Mm { identifier: String, offset: i64 },
    /// A prompt-embeds digest (bytes).
    Embeds(Vec<u8>),
    /// Any other shape, as its msgpack bytes: matches no client chain.
    Opaque(Vec<u8>),
}

impl ExtraKey {
    pub fn as_extra(&self) -> chain::Extra<'_> {
        match self {
            Self::Mm { identifier, offset } => chain::Extra::Mm {
                identifier,
                offset: *offset,
            },
            Self::Embeds(b) => chain::Extra::Embeds(b),
            Self::Opaque(b) => chain::Extra::Opaque(b),
        }
    }
}

/// Why a payload could not be decoded; nothing of it is applied.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("not msgpack: {0}")]
    Msgpack(String),
    #[error("trailing bytes after the batch")]
    Trailing,
    #[error("batch: {0}")]
    Batch(&'static str),
    #[error("event {index} ({tag}): {what}")]
    Event {
        index: usize,
        tag: &'static str,
        what: String,
    },
}

/// Decodes one payload frame.
pub fn decode_batch(payload: &[u8]) -> Result<EngineBatch, DecodeError> {
    match walk(payload) {
        Ok(batch) => Ok(batch),
        Err(Fail::Msgpack(m)) => Err(DecodeError::Msgpack(m.to_string())),
        Err(Fail::Trailing) => Err(DecodeError::Trailing),
        // A wrong field: anything malformed after it, or a wrong batch field
        // after the events, is what the reference order reports first.
        Err(Fail::Field(e)) => {
            let mut all = Cursor::new(payload);
            all.skip(MAX_DEPTH)
                .map_err(|m| DecodeError::Msgpack(m.to_string()))?;
            if !all.rest().is_empty() {
                return Err(DecodeError::Trailing);
            }
            match batch_fields(payload) {
                Ok(_) => Err(e),
                Err(Fail::Field(first)) => Err(first),
                Err(_) => Err(e),
            }
        }
    }
}

/// How the one walk stopped.
enum Fail {
    Msgpack(Malformed),
    Trailing,
    Field(DecodeError),
}

impl From<Malformed> for Fail {
    fn from(m: Malformed) -> Self {
        Self::Msgpack(m)
    }
}

impl From<DecodeError> for Fail {
    fn from(e: DecodeError) -> Self {
        Self::Field(e)
    }
}

/// Reads the whole payload once, checking every byte.
fn walk(payload: &[u8]) -> Result<EngineBatch, Fail> {
    let mut cur = Cursor::new(payload);
    let start = cur;
    let (head, inner) = cur.head(MAX_DEPTH)?;
    let mut batch = EngineBatch {
        ts: 0.0,
        events: Vec::new(),
        data_parallel_rank: None,
        skipped: 0,
        too_long: 0,
    };
    match head {
        // [ts, events, data_parallel_rank, ...]: events read where they lie.
        Head::Array(n) => {
            if n >= 1 {
                batch.ts = ts_of(cur.item(inner)?)?;
            }
            if n < 2 {
                return Err(no_events().into());
            }
            events(&mut cur, inner, &mut batch)?;
            if n >= 3 {
                batch.data_parallel_rank = rank_of(cur.item(inner)?)?;
            }
            for _ in 3..n {
                cur.skip(inner)?;
            }
        }
        // Keys in any order, the last of a repeated key wins: the fields first.
        Head::Map(_) => {
            let (fields, rest) = batch_fields(start.rest())?;
            cur = rest;
            batch.ts = fields.ts;
            batch.data_parallel_rank = fields.rank;
            let mut events_at = Cursor::new(fields.events);
            events(&mut events_at, inner, &mut batch)?;
        }
        _ => return Err(DecodeError::Batch("neither an array nor a map").into()),
    }
    if !cur.rest().is_empty() {
        return Err(Fail::Trailing);
    }
    Ok(batch)
}

fn no_events() -> DecodeError {
    DecodeError::Batch("events is missing or not an array")
}

/// A batch's own fields, checked in the reference order (ts, events, rank).
struct BatchFields<'a> {
    ts: f64,
    /// The events array's bytes.
    events: &'a [u8],
    rank: Option<i64>,
}

/// The batch's fields (either generation) and the cursor after the batch.
fn batch_fields(payload: &[u8]) -> Result<(BatchFields<'_>, Cursor<'_>), Fail> {
    let mut cur = Cursor::new(payload);
    let (head, inner) = cur.head(MAX_DEPTH)?;
    let (mut ts, mut events, mut rank) = (None, None, None);
    match head {
        Head::Array(n) => {
            for i in 0..n {
                let at = cur;
                let value = cur.value(inner)?;
                match i {
                    0 => ts = Some(at),
                    1 => events = Some(value),
                    2 => rank = Some(at),
                    _ => {}
                }
            }
        }
        Head::Map(n) => {
            for _ in 0..n {
                let key = cur.item(inner)?;
                let at = cur;
                let value = cur.value(inner)?;
                match key {
                    Head::Str(b"ts") => ts = Some(at),
                    Head::Str(b"events") => events = Some(value),
                    Head::Str(b"data_parallel_rank") => rank = Some(at),
                    _ => {}
                }
            }
        }
        _ => return Err(DecodeError::Batch("neither an array nor a map").into()),
    }
    let ts = match ts {
        Some(mut at) => ts_of(at.item(inner)?)?,
        None => 0.0,
    };
    let events = match events {
        Some(raw) if matches!(Cursor::new(raw).head(inner)?.0, Head::Array(_)) => raw,
        _ => return Err(no_events().into()),
    };
    let rank = match rank {
        Some(mut at) => rank_of(at.item(inner)?)?,
        None => None,
    };
    Ok((BatchFields { ts, events, rank }, cur))
}

fn ts_of(head: Head<'_>) -> Result<f64, DecodeError> {
    match head {
        Head::F64(t) => Ok(t),
        Head::F32(t) => Ok(f64::from(t)),
        Head::Int(i) => Ok(i.as_f64()),
        Head::Nil => Ok(0.0),
        _ => Err(DecodeError::Batch("ts is not a number")),
    }
}

fn rank_of(head: Head<'_>) -> Result<Option<i64>, DecodeError> {
    match head {
        Head::Int(i) => Ok(i.as_i64()),
        Head::Nil => Ok(None),
        _ => Err(DecodeError::Batch("data_parallel_rank is not an integer")),
    }
}

/// The events array at `cur` (its head included) into `batch`.
fn events(cur: &mut Cursor<'_>, depth: u16, batch: &mut EngineBatch) -> Result<(), Fail> {
    let (Head::Array(n), inner) = cur.head(depth)? else {
        return Err(no_events().into());
    };
    // Every event takes at least one byte.
    batch.events = Vec::with_capacity((n as usize).min(cur.rest().len()));
    for index in 0..n as usize {
        match event(cur, inner)?.map_err(|(tag, what)| DecodeError::Event { index, tag, what })? {
            Some(e) if run_len(&e) > MAX_CHAIN_BLOCKS => batch.too_long += 1,
            Some(e) => batch.events.push(e),
            None => batch.skipped += 1,
        }
    }
    Ok(())
}

/// Blocks named by one event.
fn run_len(e: &EngineEvent) -> usize {
    match e {
        EngineEvent::BlockStored { block_hashes, .. }
        | EngineEvent::BlockRemoved { block_hashes, .. } => block_hashes.len(),
        EngineEvent::AllBlocksCleared => 0,
    }
}

/// One event's outcome: the event, `None` for an unknown type, or why it is wrong.
type EventResult = Result<Option<EngineEvent>, (&'static str, String)>;

/// One field's value, or why it is wrong (reported in [`stored`]'s order).
type Field<T> = Result<T, String>;

/// The fields of an event, read (each fully) whichever generation carried them.
/// `None`: absent.
#[derive(Default)]
struct Fields<'a> {
    block_hashes: Option<Field<Vec<u64>>>,
    parent_block_hash: Option<Field<Option<u64>>>,
    token_ids: Option<Field<Vec<u32>>>,
    block_size: Option<Field<u32>>,
    lora_id: Option<Field<Option<i64>>>,
    medium: Option<Field<Option<String>>>,
    lora_name: Option<Field<Option<String>>>,
    cache_salt: Option<Field<Option<String>>>,
    /// Read last: its meaning depends on the adapter, the parent and the blocks.
    extra_keys: Option<(&'a [u8], u16)>,
}

const STORED: &str = "BlockStored";
const REMOVED: &str = "BlockRemoved";
const CLEARED: &str = "AllBlocksCleared";

/// One field of `Fields`, by its name in the map generation.
#[derive(Clone, Copy)]
enum Key {
    BlockHashes,
    Parent,
    TokenIds,
    BlockSize,
    LoraId,
    Medium,
    LoraName,
    ExtraKeys,
    CacheSalt,
}

/// The array generation's slots after the tag.
const STORED_SLOTS: [Key; 8] = [
    Key::BlockHashes,
    Key::Parent,
    Key::TokenIds,
    Key::BlockSize,
    Key::LoraId,
    Key::Medium,
    Key::LoraName,
    Key::ExtraKeys,
];
const REMOVED_SLOTS: [Key; 2] = [Key::BlockHashes, Key::Medium];

impl<'a> Fields<'a> {
    /// Reads the value at `cur` into field `key` (a repeated key replaces it).
    fn read(&mut self, key: Key, cur: &mut Cursor<'a>, depth: u16) -> Result<(), Malformed> {
        match key {
            Key::BlockHashes => self.block_hashes = Some(read_hashes(cur, depth)?),
            Key::Parent => {
                self.parent_block_hash = Some(match cur.item(depth)? {
                    Head::Nil => Ok(None),
                    h => hash(h)
                        .map(Some)
                        .ok_or_else(|| "parent_block_hash is not a hash".into()),
                })
            }
            Key::TokenIds => self.token_ids = Some(read_tokens(cur, depth)?),
            Key::BlockSize => {
                self.block_size = Some(
                    match cur.item(depth)? {
                        Head::Int(i) => i.as_u64().and_then(|b| u32::try_from(b).ok()),
                        _ => None,
                    }
                    .filter(|b| *b > 0)
                    .ok_or_else(|| "block_size is missing or not a positive u32".into()),
                )
            }
            Key::LoraId => {
                self.lora_id = Some(match cur.item(depth)? {
                    Head::Nil => Ok(None),
                    Head::Int(i) => i
                        .as_i64()
                        .map(Some)
                        .ok_or_else(|| "lora_id is not an i64".into()),
                    _ => Err("lora_id is not an integer".into()),
                })
            }
            Key::Medium => {
                self.medium = Some(match cur.item(depth)? {
                    Head::Nil => Ok(None),
                    Head::Str(b) => std::str::from_utf8(b)
                        .map(|s| Some(s.to_string()))
                        .map_err(|_| "medium is not UTF-8".into()),
                    _ => Err("medium is not a string".into()),
                })
            }
            Key::LoraName => self.lora_name = Some(opt_string(cur.item(depth)?, "lora_name")),
            Key::CacheSalt => self.cache_salt = Some(opt_string(cur.item(depth)?, "cache_salt")),
            Key::ExtraKeys => self.extra_keys = Some((cur.value(depth)?, depth)),
        }
        Ok(())
    }
}

/// The event at `cur`, read fully (a malformed byte is the outer error).
fn event(cur: &mut Cursor<'_>, depth: u16) -> Result<EventResult, Malformed> {
    let mut f = Fields::default();
    let tag = match cur.head(depth)? {
        (Head::Array(n), inner) => {
            let tag = if n == 0 {
                None
            } else {
                match tag_of(cur.item(inner)?) {
                    Ok(t) => t,
                    Err(e) => return Ok(Err(e)),
                }
            };
            let slots: &[Key] = match tag {
                Some(STORED) => &STORED_SLOTS,
                Some(REMOVED) => &REMOVED_SLOTS,
                _ => &[],
            };
            for i in 1..n as usize {
                match slots.get(i - 1) {
                    Some(&key) => f.read(key, cur, inner)?,
                    None => cur.skip(inner)?,
                }
            }
            tag
        }
        (Head::Map(n), inner) => {
            let mut tag = None;
            for _ in 0..n {
                let key = match cur.item(inner)? {
                    Head::Str(k) => std::str::from_utf8(k).ok(),
                    _ => None,
                };
                let key = match key {
                    Some("type") => {
                        match tag_of(cur.item(inner)?) {
                            Ok(t) => tag = t,
                            Err(e) => return Ok(Err(e)),
                        }
                        continue;
                    }
                    Some("block_hashes") => Key::BlockHashes,
                    Some("parent_block_hash") => Key::Parent,
                    Some("token_ids") => Key::TokenIds,
                    Some("block_size") => Key::BlockSize,
                    Some("lora_id") => Key::LoraId,
                    Some("medium") => Key::Medium,
                    Some("lora_name") => Key::LoraName,
                    Some("extra_keys") => Key::ExtraKeys,
                    Some("cache_salt") => Key::CacheSalt,
                    _ => {
                        cur.skip(inner)?;
                        continue;
                    }
                };
                f.read(key, cur, inner)?;
            }
            tag
        }
        _ => return Ok(Err(("?", "neither an array nor a map".into()))),
    };
    Ok(match tag {
        Some(STORED) => stored(f),
        Some(REMOVED) => removed(f).map(Some).map_err(|w| (REMOVED, w)),
        Some(CLEARED) => Ok(Some(EngineEvent::AllBlocksCleared)),
        Some(_) => Ok(None),
        None => Err(("?", "no type tag".into())),
    })
}

/// The tag as one of ours (`Some(other)` maps to an unknown type, `None` to no tag).
fn tag_of(head: Head<'_>) -> Result<Option<&'static str>, (&'static str, String)> {
    match head {
        Head::Str(s) => Ok(Some(match s {
            b"BlockStored" => STORED,
            b"BlockRemoved" => REMOVED,
            b"AllBlocksCleared" => CLEARED,
            _ => "unknown",
        })),
        Head::Nil => Ok(None),
        _ => Err(("?", "the type tag is not a string".into())),
    }
}

fn removed(f: Fields<'_>) -> Field<EngineEvent> {
    Ok(EngineEvent::BlockRemoved {
        block_hashes: f.block_hashes.unwrap_or_else(|| Err(no_hashes()))?,
        medium: f.medium.unwrap_or(Ok(None))?,
    })
}

fn no_hashes() -> String {
    "block_hashes is missing or not an array".into()
}

fn stored(f: Fields<'_>) -> EventResult {
    let err = |w: String| (STORED, w);
    let block_hashes = f
        .block_hashes
        .unwrap_or_else(|| Err(no_hashes()))
        .map_err(err)?;
    let parent_block_hash = f.parent_block_hash.unwrap_or(Ok(None)).map_err(err)?;
    let token_ids = f
        .token_ids
        .unwrap_or_else(|| Err("token_ids is missing or not an array".into()))
        .map_err(err)?;
    let block_size = f
        .block_size
        .unwrap_or_else(|| Err("block_size is missing or not a positive u32".into()))
        .map_err(err)?;
    let medium = f.medium.unwrap_or(Ok(None)).map_err(err)?;
    let lora_name = f.lora_name.unwrap_or(Ok(None)).map_err(err)?;
    let lora_id = f.lora_id.unwrap_or(Ok(None)).map_err(err)?;
    let mut cache_salt = f.cache_salt.unwrap_or(Ok(None)).map_err(err)?;
    let extras = match f.extra_keys {
        None => Vec::new(),
        Some((raw, depth)) => extra_keys(
            raw,
            depth,
            block_hashes.len(),
            lora_name.is_some(),
            parent_block_hash.is_none(),
            &mut cache_salt,
        )
        .map_err(err)?,
    };
    let identity =
        (lora_name.is_some() || lora_id.is_some() || cache_salt.is_some() || !extras.is_empty())
            .then(|| {
                Box::new(StoredIdentity {
                    lora_name,
                    lora_id,
                    cache_salt,
                    extras,
                })
            });
    Ok(Some(EngineEvent::BlockStored {
        block_hashes,
        parent_block_hash,
        token_ids,
        block_size,
        medium,
        identity,
    }))
}

fn opt_string(head: Head<'_>, what: &str) -> Field<Option<String>> {
    match head {
        Head::Nil => Ok(None),
        Head::Str(b) => match std::str::from_utf8(b) {
            Ok("") => Ok(None),
            Ok(s) => Ok(Some(s.to_string())),
            Err(_) => Err(format!("{what} is not UTF-8")),
        },
        _ => Err(format!("{what} is not a string")),
    }
}

/// `extra_keys` (its bytes, already checked), per block; empty when no block has
/// any. `root`: the run starts at block 0, the only block vLLM hashes the salt into.
fn extra_keys(
    raw: &[u8],
    depth: u16,
    blocks: usize,
    has_lora: bool,
    root: bool,
    salt: &mut Option<String>,
) -> Field<Vec<Vec<ExtraKey>>> {
    let checked = |m: Malformed| m.to_string();
    let mut cur = Cursor::new(raw);
    let (n, inner) = match cur.head(depth).map_err(checked)? {
        (Head::Nil, _) => return Ok(Vec::new()),
        (Head::Array(n), inner) => (n as usize, inner),
        _ => return Err("extra_keys is not an array".into()),
    };
    if n != blocks {
        return Err(format!("extra_keys has {n} entries for {blocks} blocks"));
    }
    let mut extras = Vec::with_capacity(n);
    let mut any = false;
    for i in 0..n {
        let keys = match cur.head(inner).map_err(checked)? {
            (Head::Nil, _) => Vec::new(),
            (Head::Array(m), item_depth) => {
                block_extras(&mut cur, item_depth, m, has_lora, root && i == 0, salt)
                    .map_err(checked)?
            }
            _ => return Err(format!("extra_keys[{i}] is not an array")),
        };
        any |= !keys.is_empty();
        extras.push(keys);
    }
    if !any {
        extras = Vec::new();
    }
    Ok(extras)
}

/// One block's `items` extra keys in vLLM's order: the adapter name (first, when
/// the event names one), `(mm_identifier, offset)` pairs, the salt (block 0 only),
/// prompt-embeds digests. A string anywhere else, or any other shape, is kept
/// opaque.
fn block_extras(
    cur: &mut Cursor<'_>,
    depth: u16,
    items: u32,
    has_lora: bool,
    first_block: bool,
    salt: &mut Option<String>,
) -> Result<Vec<ExtraKey>, Malformed> {
    let mut out = Vec::new();
    for j in 0..items {
        // The item read once (a string, the common case, in its head alone); its
        // bytes are re-read only for a pair or an opaque key.
        let start = *cur;
        let head = cur.item(depth)?;
        let raw = &start.rest()[..start.rest().len() - cur.rest().len()];
        match head {
            // The adapter: identity, carried by `lora_name`.
            Head::Str(_) if j == 0 && has_lora => continue,
            Head::Str(s) if first_block => {
                if let Ok(text) = std::str::from_utf8(s)
                    && !text.is_empty()
                {
                    if salt.is_none() {
                        *salt = Some(text.to_string());
                        continue;
                    }
                    if salt.as_deref() == Some(text) {
                        continue;
                    }
                }
            }
            Head::Array(2) => {
                let mut item = Cursor::new(raw);
                let (_, inner) = item.head(depth)?;
                if let (Head::Str(id), Head::Int(off)) = (item.item(inner)?, item.item(inner)?)
                    && let (Ok(identifier), Some(offset)) = (std::str::from_utf8(id), off.as_i64())
                {
                    out.push(ExtraKey::Mm {
                        identifier: identifier.to_string(),
                        offset,
                    });
                    continue;
                }
            }
            Head::Bin(b) => {
                out.push(ExtraKey::Embeds(b.to_vec()));
                continue;
            }
            _ => {}
        }
        out.push(ExtraKey::Opaque(canonical(raw)));
    }
    Ok(out)
}

/// An opaque key's msgpack in its shortest encoding (what the engine's own
/// encoder writes), so the same key always hashes the same.
fn canonical(raw: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(raw.len());
    match rmpv::decode::read_value(&mut &raw[..]) {
        // Writing to a Vec cannot fail.
        Ok(v) => {
            let _ = rmpv::encode::write_value(&mut out, &v);
        }
        Err(_) => out.extend_from_slice(raw),
    }
    out
}

fn read_hashes(cur: &mut Cursor<'_>, depth: u16) -> Result<Field<Vec<u64>>, Malformed> {
    let (n, inner) = match cur.peek_array(depth)? {
        Some(at) => at,
        None => {
            cur.skip(depth)?;
            return Ok(Err(no_hashes()));
        }
    };
    let mut out = Vec::with_capacity((n as usize).min(cur.rest().len()));
    // Unsigned hashes in one loop; the rest (if any) the general way. Items are
    // values one level down: none is readable with no depth left.
    let fast = if inner > 0 { cur.u64s(n, &mut out) } else { 0 };
    let mut bad = None;
    for i in fast as usize..n as usize {
        let head = cur.item(inner)?;
        if bad.is_none() {
            match hash(head) {
                Some(h) => out.push(h),
                None => bad = Some(i),
            }
        }
    }
    Ok(match bad {
        None => Ok(out),
        Some(i) => Err(format!("block_hashes[{i}] is not a hash")),
    })
}

fn read_tokens(cur: &mut Cursor<'_>, depth: u16) -> Result<Field<Vec<u32>>, Malformed> {
    let (n, inner) = match cur.peek_array(depth)? {
        Some(at) => at,
        None => {
            cur.skip(depth)?;
            return Ok(Err("token_ids is missing or not an array".into()));
        }
    };
    let mut out = Vec::with_capacity((n as usize).min(cur.rest().len()));
    // Items are values one level down: none is readable with no depth left.
    let fast = if inner > 0 { cur.u32s(n, &mut out) } else { 0 };
    let mut ok = true;
    for _ in fast..n {
        let token = match cur.uint(inner)? {
            Some(t) => u32::try_from(t).ok(),
            None => None,
        };
        match token {
            Some(t) if ok => out.push(t),
            _ => ok = false,
        }
    }
    Ok(if ok {
        Ok(out)
    } else {
        Err("a token id is not a u32".into())
    })
}

/// u64, i64 (its bits) or bytes (the last 8, big-endian; fewer are left-padded).
fn hash(head: Head<'_>) -> Option<u64> {
    match head {
        Head::Int(i) => Some(i.as_u64().unwrap_or_else(|| i.as_i64().unwrap_or(0) as u64)),
        Head::Bin(b) if !b.is_empty() => {
            let tail = &b[b.len().saturating_sub(8)..];
            let mut buf = [0u8; 8];
            buf[8 - tail.len()..].copy_from_slice(tail);
            Some(u64::from_be_bytes(buf))
        }
        _ => None,
    }
}

#[cfg(test)]
mod reference;
#[cfg(test)]
mod tests;
