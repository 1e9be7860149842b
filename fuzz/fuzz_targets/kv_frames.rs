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
    match frames::replay_reply(&parts) {
        Ok((seq, payload)) => {
            assert!(shaped);
            assert_eq!(Some(Some(seq)), want_seq);
            assert_eq!(payload, parts[2]);
            let _ = decode_batch(&payload);
        }
        Err(why) => {
            assert!(!shaped);
            assert!(!why.is_empty());
        }
    }
});
