//! The decoder this module had before the typed one: the payload parsed into an
//! `rmpv::Value` tree, then read. Kept for tests only, as the reference the typed
//! decoder must agree with (results and errors) on every input.

use rmpv::Value;

use super::{DecodeError, EngineBatch, EngineEvent, ExtraKey, MAX_CHAIN_BLOCKS, StoredIdentity};

/// Nesting deeper than this is not an engine payload.
const MAX_DEPTH: usize = 16;

/// Decodes one payload frame.
pub fn decode_batch(payload: &[u8]) -> Result<EngineBatch, DecodeError> {
    let mut rd = payload;
    let value = rmpv::decode::read_value_with_max_depth(&mut rd, MAX_DEPTH)
        .map_err(|e| DecodeError::Msgpack(e.to_string()))?;
    if !rd.is_empty() {
        return Err(DecodeError::Trailing);
    }
    let (ts, events, rank) = match value {
        Value::Array(slots) => {
            let mut it = slots.into_iter();
            (it.next(), it.next(), it.next())
        }
        Value::Map(entries) => {
            let (mut ts, mut events, mut rank) = (None, None, None);
            for (k, v) in entries {
                match k.as_str() {
                    Some("ts") => ts = Some(v),
                    Some("events") => events = Some(v),
                    Some("data_parallel_rank") => rank = Some(v),
                    _ => {}
                }
            }
            (ts, events, rank)
        }
        _ => return Err(DecodeError::Batch("neither an array nor a map")),
    };
    let ts = match ts {
        Some(Value::F64(t)) => t,
        Some(Value::F32(t)) => f64::from(t),
        Some(Value::Integer(i)) => i.as_f64().unwrap_or(0.0),
        Some(Value::Nil) | None => 0.0,
        Some(_) => return Err(DecodeError::Batch("ts is not a number")),
    };
    let Some(Value::Array(raw_events)) = events else {
        return Err(DecodeError::Batch("events is missing or not an array"));
    };
    let data_parallel_rank = match rank {
        Some(Value::Integer(i)) => i.as_i64(),
        Some(Value::Nil) | None => None,
        Some(_) => return Err(DecodeError::Batch("data_parallel_rank is not an integer")),
    };
    let mut batch = EngineBatch {
        ts,
        events: Vec::with_capacity(raw_events.len()),
        data_parallel_rank,
        skipped: 0,
        too_long: 0,
    };
    for (index, raw) in raw_events.into_iter().enumerate() {
        match decode_event(raw).map_err(|(tag, what)| DecodeError::Event { index, tag, what })? {
            Some(e) if run_len(&e) > MAX_CHAIN_BLOCKS => batch.too_long += 1,
            Some(e) => batch.events.push(e),
            None => batch.skipped += 1,
        }
    }
    Ok(batch)
}

/// Blocks named by one event.
fn run_len(e: &EngineEvent) -> usize {
    match e {
        EngineEvent::BlockStored { block_hashes, .. }
        | EngineEvent::BlockRemoved { block_hashes, .. } => block_hashes.len(),
        EngineEvent::AllBlocksCleared => 0,
    }
}

type EventResult = Result<Option<EngineEvent>, (&'static str, String)>;

/// The fields of an event, by name, whichever generation carried them.
#[derive(Default)]
struct Fields {
    block_hashes: Option<Value>,
    parent_block_hash: Option<Value>,
    token_ids: Option<Value>,
    block_size: Option<Value>,
    lora_id: Option<Value>,
    medium: Option<Value>,
    lora_name: Option<Value>,
    extra_keys: Option<Value>,
    cache_salt: Option<Value>,
}

const STORED: &str = "BlockStored";
const REMOVED: &str = "BlockRemoved";
const CLEARED: &str = "AllBlocksCleared";

fn decode_event(raw: Value) -> EventResult {
    let mut f = Fields::default();
    let tag = match raw {
        Value::Array(slots) => {
            let mut it = slots.into_iter();
            let tag = tag_of(it.next())?;
            match tag {
                Some(STORED) => {
                    // block_hashes, parent_block_hash, token_ids, block_size,
                    // lora_id, medium, ...
                    f.block_hashes = it.next();
                    f.parent_block_hash = it.next();
                    f.token_ids = it.next();
                    f.block_size = it.next();
                    f.lora_id = it.next();
                    f.medium = it.next();
                    f.lora_name = it.next();
                    f.extra_keys = it.next();
                }
                Some(REMOVED) => {
                    f.block_hashes = it.next();
                    f.medium = it.next();
                }
                _ => {}
            }
            tag
        }
        Value::Map(entries) => {
            let mut tag = None;
            for (k, v) in entries {
                let Some(key) = k.as_str() else { continue };
                let slot = match key {
                    "type" => {
                        tag = tag_of(Some(v))?;
                        continue;
                    }
                    "block_hashes" => &mut f.block_hashes,
                    "parent_block_hash" => &mut f.parent_block_hash,
                    "token_ids" => &mut f.token_ids,
                    "block_size" => &mut f.block_size,
                    "lora_id" => &mut f.lora_id,
                    "medium" => &mut f.medium,
                    "lora_name" => &mut f.lora_name,
                    "extra_keys" => &mut f.extra_keys,
                    "cache_salt" => &mut f.cache_salt,
                    _ => continue,
                };
                *slot = Some(v);
            }
            tag
        }
        _ => return Err(("?", "neither an array nor a map".into())),
    };
    match tag {
        Some(STORED) => stored(f),
        Some(REMOVED) => Ok(Some(EngineEvent::BlockRemoved {
            block_hashes: hashes(f.block_hashes).map_err(|w| (REMOVED, w))?,
            medium: medium(f.medium).map_err(|w| (REMOVED, w))?,
        })),
        Some(CLEARED) => Ok(Some(EngineEvent::AllBlocksCleared)),
        Some(_) => Ok(None),
        None => Err(("?", "no type tag".into())),
    }
}

/// The tag as one of ours (`Some(other)` maps to an unknown type, `None` to no tag).
fn tag_of(v: Option<Value>) -> Result<Option<&'static str>, (&'static str, String)> {
    match v {
        Some(Value::String(s)) => Ok(Some(match s.as_str() {
            Some(STORED) => STORED,
            Some(REMOVED) => REMOVED,
            Some(CLEARED) => CLEARED,
            _ => "unknown",
        })),
        None | Some(Value::Nil) => Ok(None),
        Some(_) => Err(("?", "the type tag is not a string".into())),
    }
}

fn stored(f: Fields) -> EventResult {
    let err = |w: String| (STORED, w);
    let block_hashes = hashes(f.block_hashes).map_err(err)?;
    let parent_block_hash = match f.parent_block_hash {
        None | Some(Value::Nil) => None,
        Some(v) => Some(hash(&v).ok_or_else(|| err("parent_block_hash is not a hash".into()))?),
    };
    let token_ids = match f.token_ids {
        Some(Value::Array(items)) => items
            .iter()
            .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
            .collect::<Option<Vec<u32>>>()
            .ok_or_else(|| err("a token id is not a u32".into()))?,
        _ => return Err(err("token_ids is missing or not an array".into())),
    };
    let block_size = f
        .block_size
        .as_ref()
        .and_then(Value::as_u64)
        .and_then(|b| u32::try_from(b).ok())
        .filter(|b| *b > 0)
        .ok_or_else(|| err("block_size is missing or not a positive u32".into()))?;
    let medium = medium(f.medium).map_err(err)?;
    let identity = stored_identity(
        f.lora_name,
        f.lora_id,
        f.cache_salt,
        f.extra_keys,
        block_hashes.len(),
        parent_block_hash.is_none(),
    )
    .map_err(err)?;
    Ok(Some(EngineEvent::BlockStored {
        block_hashes,
        parent_block_hash,
        token_ids,
        block_size,
        medium,
        identity,
    }))
}

fn opt_string(v: Option<Value>, what: &str) -> Result<Option<String>, String> {
    match v {
        None | Some(Value::Nil) => Ok(None),
        Some(Value::String(s)) => match s.into_str() {
            Some(s) if s.is_empty() => Ok(None),
            Some(s) => Ok(Some(s)),
            None => Err(format!("{what} is not UTF-8")),
        },
        Some(_) => Err(format!("{what} is not a string")),
    }
}

/// The identity fields, `None` when there is nothing beyond the tokens. `root`: the
/// run starts at block 0, the only block vLLM hashes the salt into.
fn stored_identity(
    lora_name: Option<Value>,
    lora_id: Option<Value>,
    cache_salt: Option<Value>,
    extra_keys: Option<Value>,
    blocks: usize,
    root: bool,
) -> Result<Option<Box<StoredIdentity>>, String> {
    let lora_name = opt_string(lora_name, "lora_name")?;
    let lora_id = match lora_id {
        None | Some(Value::Nil) => None,
        Some(Value::Integer(i)) => Some(i.as_i64().ok_or("lora_id is not an i64")?),
        Some(_) => return Err("lora_id is not an integer".into()),
    };
    let mut cache_salt = opt_string(cache_salt, "cache_salt")?;
    let mut extras = Vec::new();
    match extra_keys {
        None | Some(Value::Nil) => {}
        Some(Value::Array(entries)) => {
            if entries.len() != blocks {
                return Err(format!(
                    "extra_keys has {} entries for {blocks} blocks",
                    entries.len()
                ));
            }
            let mut any = false;
            for (i, entry) in entries.into_iter().enumerate() {
                let keys = match entry {
                    Value::Nil => Vec::new(),
                    Value::Array(items) => {
                        block_extras(items, lora_name.is_some(), root && i == 0, &mut cache_salt)
                    }
                    _ => return Err(format!("extra_keys[{i}] is not an array")),
                };
                any |= !keys.is_empty();
                extras.push(keys);
            }
            if !any {
                extras = Vec::new();
            }
        }
        Some(_) => return Err("extra_keys is not an array".into()),
    }
    if lora_name.is_none() && lora_id.is_none() && cache_salt.is_none() && extras.is_empty() {
        return Ok(None);
    }
    Ok(Some(Box::new(StoredIdentity {
        lora_name,
        lora_id,
        cache_salt,
        extras,
    })))
}

/// One block's extra keys in vLLM's order: the adapter name (first, when the event
/// names one), `(mm_identifier, offset)` pairs, the salt (block 0 only), prompt-embeds
/// digests. A string anywhere else, or any other shape, is kept opaque.
fn block_extras(
    items: Vec<Value>,
    has_lora: bool,
    first_block: bool,
    salt: &mut Option<String>,
) -> Vec<ExtraKey> {
    let mut out = Vec::new();
    for (j, item) in items.into_iter().enumerate() {
        let item = match item {
            // The adapter: identity, carried by `lora_name`.
            Value::String(_) if j == 0 && has_lora => continue,
            Value::String(s) if first_block && s.as_str().is_some_and(|s| !s.is_empty()) => {
                let text = s.as_str().unwrap_or_default().to_string();
                if salt.is_none() {
                    *salt = Some(text);
                    continue;
                }
                if salt.as_deref() == Some(text.as_str()) {
                    continue;
                }
                Value::from(text)
            }
            Value::Array(pair) => {
                if let [Value::String(id), Value::Integer(off)] = pair.as_slice()
                    && let (Some(id), Some(offset)) = (id.as_str(), off.as_i64())
                {
                    out.push(ExtraKey::Mm {
                        identifier: id.to_string(),
                        offset,
                    });
                    continue;
                }
                Value::Array(pair)
            }
            Value::Binary(b) => {
                out.push(ExtraKey::Embeds(b));
                continue;
            }
            other => other,
        };
        let mut raw = Vec::new();
        // Writing to a Vec cannot fail.
        let _ = rmpv::encode::write_value(&mut raw, &item);
        out.push(ExtraKey::Opaque(raw));
    }
    out
}

fn hashes(v: Option<Value>) -> Result<Vec<u64>, String> {
    match v {
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, h)| hash(h).ok_or_else(|| format!("block_hashes[{i}] is not a hash")))
            .collect(),
        _ => Err("block_hashes is missing or not an array".into()),
    }
}

/// u64, i64 (its bits) or bytes (the last 8, big-endian; fewer are left-padded).
fn hash(v: &Value) -> Option<u64> {
    match v {
        Value::Integer(i) => i.as_u64().or_else(|| i.as_i64().map(|s| s as u64)),
        Value::Binary(b) if !b.is_empty() => {
            let tail = &b[b.len().saturating_sub(8)..];
            let mut buf = [0u8; 8];
            buf[8 - tail.len()..].copy_from_slice(tail);
            Some(u64::from_be_bytes(buf))
        }
        _ => None,
    }
}

fn medium(v: Option<Value>) -> Result<Option<String>, String> {
    match v {
        None | Some(Value::Nil) => Ok(None),
        Some(Value::String(s)) => s
            .into_str()
            .map(Some)
            .ok_or_else(|| "medium is not UTF-8".into()),
        Some(_) => Err("medium is not a string".into()),
    }
}
