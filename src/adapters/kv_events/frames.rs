//! The ZMQ framing of engine KV events (see `shared/design/kv-events.md`), pure:
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

/// One replay reply `["", seq (8 bytes BE), payload]` → `(seq, payload)`, or why not.
pub fn replay_reply(frames: &[Bytes]) -> Result<(u64, Bytes), &'static str> {
    match frames {
        [_empty, seq, payload] => Ok((seq_of(seq).ok_or("bad replay seq")?, payload.clone())),
        _ => Err("replay reply is not [\"\", seq, payload]"),
    }
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
    fn replay_reply_is_empty_seq_payload() {
        let end = u64::MAX.to_be_bytes();
        assert_eq!(
            replay_reply(&frames(&[b"", &3u64.to_be_bytes(), b"p"])),
            Ok((3, Bytes::from_static(b"p")))
        );
        assert_eq!(
            replay_reply(&frames(&[b"", &end, b""])),
            Ok((u64::MAX, Bytes::new()))
        );
        assert_eq!(
            replay_reply(&frames(&[b"", &[1, 2, 3], b"p"])),
            Err("bad replay seq")
        );
        assert!(replay_reply(&frames(&[b"", &end])).is_err());
        assert!(replay_reply(&[]).is_err());
    }
}
