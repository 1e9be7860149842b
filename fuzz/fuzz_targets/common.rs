//! Shared by the fuzz targets: a router on the standalone example's policy, and
//! the byte formats the targets read their input in.

#![allow(dead_code)] // each target uses part of this

use std::path::PathBuf;
use std::sync::Arc;

use inferencecache::adapters::policy_file::{self, Source};
use inferencecache::core::Router;
use inferencecache::core::index::IndexConfig;
use inferencecache::core::time::Timestamp;

/// The example configuration every target that needs a policy starts from.
pub const POLICY_YAML: &str = include_str!("../../examples/standalone/policy.yaml");
pub const TENANT: &str = "demo";
pub const MODEL: &str = "demo-model";
pub const SCHEME: &str = "ic-content-v1";
/// The example backend's replicas, `(id, address)`.
pub const REPLICAS: [(&str, &str); 3] = [
    ("replica-a", "127.0.0.1:18001"),
    ("replica-b", "127.0.0.1:18002"),
    ("replica-c", "127.0.0.1:18003"),
];

/// A fresh router on the example policy (a fresh one per input keeps every
/// input reproducible on its own).
pub fn example_router() -> Arc<Router> {
    let sources = [Source {
        path: PathBuf::from("examples/standalone/policy.yaml"),
        text: POLICY_YAML.to_string(),
    }];
    let loaded = match policy_file::parse(&sources) {
        Ok(l) => l,
        Err(e) => panic!("the example policy no longer loads: {e}"),
    };
    Arc::new(Router::new(
        IndexConfig::default(),
        loaded.snapshot,
        Timestamp::now(),
    ))
}

/// Multipart input: frames of `[len: u16 BE][len bytes]`; a frame whose length
/// runs past the input takes what is left.
pub fn split_frames(mut data: &[u8]) -> Vec<&[u8]> {
    let mut frames = Vec::new();
    while data.len() >= 2 {
        let len = usize::from(u16::from_be_bytes([data[0], data[1]]));
        let rest = &data[2..];
        let (frame, tail) = rest.split_at(len.min(rest.len()));
        frames.push(frame);
        data = tail;
    }
    frames
}
