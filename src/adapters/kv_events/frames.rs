//! The ZMQ framing of engine KV events (docs/operations.md, "Engine KV event streams"), pure:
//! which multipart messages the subscriber accepts, split into `(seq, payload)`.
//! No sockets; the fuzz targets call these directly.

use bytes::Bytes;

/// A published message `[topic, seq (8 bytes BE), payload]` → `(seq, payload)`;
/// anything else is malformed.
pub fn published(mut frames: Vec<Bytes>) -> Option<(u64, Bytes)> {
    if frames.len() != 3 {
        return None;
    }
    let payload = frames.pop()?;
    let seq = seq_of(frames.get(1)?)?;
    Some((seq, payload))
}

/// `(seq, payload)` of one replay reply, in either shape the engines send:
/// current (vLLM 0.33, SGLang 0.5.23) `["", topic, seq, payload]`, end marker
/// `["", "", u64::MAX, ""]`; older (vLLM 0.11, SGLang 0.5.3) `["", seq, payload]`,
/// end marker `["", u64::MAX, ""]`. Told apart by the frame count.
pub fn replay_reply(frames: &[Bytes]) -> Result<(u64, Bytes), String> {
    let (seq, payload) = match frames {
        [empty, _topic, seq, payload] if empty.is_empty() => (seq, payload),
        [empty, seq, payload] if empty.is_empty() => (seq, payload),
        _ => {
            return Err(format!(
                "a replay reply of {} frames is neither [\"\", topic, seq, payload] nor [\"\", seq, payload]",
                frames.len()
            ));
        }
    };
    let seq = seq_of(seq).ok_or("a replay reply's seq is not 8 bytes")?;
    Ok((seq, payload.clone()))
}

/// A sequence number frame: exactly 8 bytes, big-endian.
pub fn seq_of(b: &[u8]) -> Option<u64> {
    Some(u64::from_be_bytes(b.try_into().ok()?))
}

#[cfg(test)]
mod tests;
