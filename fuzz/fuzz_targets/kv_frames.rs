//! ZMQ multipart messages → the subscriber's framing (`frames::published` for the
//! PUB stream, `frames::replay_reply` for the replay socket) → `decode_batch` of
//! the payload.
//!
//! Input: frames of `[len: u16 BE][len bytes]` (see `common::split_frames`).

#![no_main]

#[path = "common.rs"]
mod common;

use bytes::Bytes;
use inferencecache::adapters::kv_events::decode::decode_batch;
use inferencecache::adapters::kv_events::frames;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let parts: Vec<Bytes> = common::split_frames(data)
        .into_iter()
        .map(Bytes::copy_from_slice)
        .collect();
    let shaped = parts.len() == 3 && parts[1].len() == 8;
    let want_seq = shaped.then(|| frames::seq_of(&parts[1]));

    match frames::published(parts.clone()) {
        Some((seq, payload)) => {
            assert!(shaped);
            assert_eq!(Some(Some(seq)), want_seq);
            assert_eq!(payload, parts[2]);
            let _ = decode_batch(&payload);
        }
        None => assert!(!shaped),
    }
    // Replay replies: ["", seq, payload] (older engines) or ["", topic, seq,
    // payload] (current ones), told apart by the frame count.
    let replay_at = match parts.len() {
        3 => Some(1),
        4 => Some(2),
        _ => None,
    }
    .filter(|&i| parts[0].is_empty() && parts[i].len() == 8);
    match frames::replay_reply(&parts) {
        Ok((seq, payload)) => {
            let i = replay_at.expect("accepted only in one of the two shapes");
            assert_eq!(Some(seq), frames::seq_of(&parts[i]));
            assert_eq!(payload, parts[i + 1]);
            let _ = decode_batch(&payload);
        }
        Err(why) => {
            assert!(replay_at.is_none());
            assert!(!why.is_empty());
        }
    }
});
