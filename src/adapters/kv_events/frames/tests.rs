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
