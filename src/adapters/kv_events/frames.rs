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
mod tests {
    use super::*;

    fn frames(v: &[&[u8]]) -> Vec<Bytes> {
        v.iter().map(|f| Bytes::copy_from_slice(f)).collect()
    }

    #[test]
    fn published_is_topic_seq_payload() {
        let seq = 7u64.to_be_bytes();
        assert_eq!(
            published(frames(&[b"kv", &seq, b"p"])),
            Some((7, Bytes::from_static(b"p")))
        );
        assert_eq!(published(frames(&[b"kv", &[0; 7], b"p"])), None);
        assert_eq!(published(frames(&[b"kv", &seq])), None);
        assert_eq!(published(frames(&[b"kv", &seq, b"p", b"x"])), None);
    }

    #[test]
    fn replay_replies_come_in_both_shapes() {
        let end = u64::MAX.to_be_bytes();
        let three = 3u64.to_be_bytes();
        // Older engines: ["", seq, payload], end ["", MAX, ""].
        assert_eq!(
            replay_reply(&frames(&[b"", &three, b"p"])),
            Ok((3, Bytes::from_static(b"p")))
        );
        assert_eq!(
            replay_reply(&frames(&[b"", &end, b""])),
            Ok((u64::MAX, Bytes::new()))
        );
        // Current engines: ["", topic, seq, payload], end ["", "", MAX, ""].
        assert_eq!(
            replay_reply(&frames(&[b"", b"kv", &three, b"p"])),
            Ok((3, Bytes::from_static(b"p")))
        );
        assert_eq!(
            replay_reply(&frames(&[b"", b"", &end, b""])),
            Ok((u64::MAX, Bytes::new()))
        );
        assert!(replay_reply(&frames(&[b"", &[1, 2, 3], b"p"])).is_err());
        assert!(replay_reply(&frames(&[b"x", &three, b"p"])).is_err());
        assert!(replay_reply(&frames(&[b"", &end])).is_err());
        assert!(replay_reply(&[]).is_err());
    }
}
