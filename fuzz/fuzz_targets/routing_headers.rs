//! Request headers → `RoutingHeaders::parse` → `Verdict::decide` (the core's
//! lookup), as ext_proc does for every request.
//!
//! Input: header lines `name:value` separated by `\n` (the value is raw bytes, as
//! Envoy's `raw_value`). A name of one digit `0`-`7` stands for a routing header,
//! so mutations reach every combination of them quickly.

#![no_main]

#[path = "common.rs"]
mod common;

use std::sync::{Arc, LazyLock};

use inferencecache::adapters::MAX_CHAIN_BLOCKS;
use inferencecache::adapters::ext_proc::headers::{self, MalformedHeader, RoutingHeaders};
use inferencecache::adapters::ext_proc::{DestinationMode, ExtProcConfig, Verdict};
use inferencecache::adapters::metrics::Metrics;
use inferencecache::adapters::policy_file::SourceStatus;
use inferencecache::core::Router;
use inferencecache::core::index::{IndexEvent, IngestBatch};
use inferencecache::core::scope::ScopeRef;
use inferencecache::core::time::Timestamp;
use libfuzzer_sys::fuzz_target;

const NAMES: [&str; 8] = [
    headers::TENANT,
    headers::MODEL,
    headers::HASH_SCHEME,
    headers::BLOCK_HASHES,
    headers::BLOCK_TOKEN_COUNTS,
    headers::PREFIX_HASH,
    headers::PREFIX_TOKENS,
    headers::DEBUG,
];

/// The README's example chain, held by replica-a, so that inputs near the seeds
/// get PREFIX_MATCH decisions and not only AFFINITY_HINT.
const HELD: [u64; 4] = [
    0x1a2b3c4d5e6f7a8b,
    0x2b3c4d5e6f7a8b9c,
    0x3c4d5e6f7a8b9cad,
    0x4d5e6f7a8b9cadbe,
];

struct Service {
    router: Arc<Router>,
    metrics: Metrics,
}

/// One router for all inputs: lookups only read the index (and touch access
/// stamps), so a decision never depends on earlier inputs' outcomes.
static SERVICE: LazyLock<Service> = LazyLock::new(|| {
    let router = common::example_router();
    let events = [IndexEvent::Stored {
        parent: None,
        hashes: HELD.to_vec(),
        token_counts: vec![16; HELD.len()],
    }];
    let batch = IngestBatch {
        scope: ScopeRef::new(common::TENANT, common::MODEL, common::SCHEME),
        replica_id: common::REPLICAS[0].0,
        endpoint: common::REPLICAS[0].1,
        events: &events,
    };
    if let Err(e) = router.ingest(&batch, Timestamp::now()) {
        panic!("seeding the index failed: {e}");
    }
    let metrics = Metrics::new(router.clone(), Arc::new(SourceStatus::new()));
    Service { router, metrics }
});

fn header_pairs(data: &[u8]) -> Vec<(String, &[u8])> {
    data.split(|&b| b == b'\n')
        .filter_map(|line| {
            let colon = line.iter().position(|&b| b == b':')?;
            let (name, value) = (&line[..colon], &line[colon + 1..]);
            let name = match name {
                [d @ b'0'..=b'7'] => NAMES[usize::from(d - b'0')].to_string(),
                _ => String::from_utf8_lossy(name).into_owned(),
            };
            Some((name, value))
        })
        .collect()
}

/// The value the parser keeps for `name`: the first one that is text, trimmed
/// (a value that is not text is reported and does not take the slot).
fn first<'a>(pairs: &'a [(String, &'a [u8])], name: &str) -> Option<&'a str> {
    pairs
        .iter()
        .filter(|(n, _)| n.eq_ignore_ascii_case(name))
        .find_map(|(_, v)| std::str::from_utf8(v).ok())
        .map(str::trim)
}

fuzz_target!(|data: &[u8]| {
    let pairs = header_pairs(data);
    let parsed = RoutingHeaders::parse(pairs.iter().map(|(n, v)| (n.as_str(), *v)));
    let f = &parsed.fields;

    // The debug flag is read on its own, whatever else is wrong.
    let debug = first(&pairs, headers::DEBUG) == Some("1");
    assert_eq!(parsed.debug, debug, "debug flag");

    assert!(f.block_hashes.len() <= MAX_CHAIN_BLOCKS);
    assert!(f.block_token_counts.len() <= MAX_CHAIN_BLOCKS);
    assert_eq!(
        parsed.chain_mismatch().is_some(),
        f.block_hashes.len() != f.block_token_counts.len()
    );
    // The scope keys survive a malformed chain (ORIGINAL_DST needs them).
    for (name, value) in [
        (headers::TENANT, &f.tenant),
        (headers::MODEL, &f.model),
        (headers::HASH_SCHEME, &f.hash_scheme),
    ] {
        if let Some(v) = first(&pairs, name) {
            assert_eq!(value, v, "{name}");
        }
    }
    match &parsed.malformed {
        Some(m) => {
            // Nothing of a half-read chain reaches the decision.
            assert!(f.block_hashes.is_empty() && f.block_token_counts.is_empty());
            assert!(f.prefix_hash.is_empty() && f.prefix_tokens == 0);
            assert!(!matches!(m, MalformedHeader::Unequal { .. }));
            assert!(!m.to_string().is_empty());
        }
        None => {
            // What the sidecar would send on is read back the same.
            let hashes = headers::format_chain(&f.block_hashes);
            let counts: Vec<String> = f.block_token_counts.iter().map(u32::to_string).collect();
            let counts = counts.join(",");
            let prefix_tokens = f.prefix_tokens.to_string();
            let again = RoutingHeaders::parse([
                (headers::TENANT, f.tenant.as_bytes()),
                (headers::MODEL, f.model.as_bytes()),
                (headers::HASH_SCHEME, f.hash_scheme.as_bytes()),
                (headers::PREFIX_HASH, f.prefix_hash.as_bytes()),
                (headers::PREFIX_TOKENS, prefix_tokens.as_bytes()),
                (headers::BLOCK_HASHES, hashes.as_bytes()),
                (headers::BLOCK_TOKEN_COUNTS, counts.as_bytes()),
            ]);
            assert_eq!(again.malformed, None);
            assert_eq!(&again.fields, f, "round trip");
        }
    }

    let service = &*SERVICE;
    let addresses = common::REPLICAS.map(|(_, a)| a);
    for mode in [DestinationMode::OverrideHost, DestinationMode::OriginalDst] {
        let config = ExtProcConfig {
            destination_mode: mode,
            ..ExtProcConfig::default()
        };
        let v = Verdict::decide(
            &service.router,
            &service.metrics,
            &config,
            &parsed,
            Timestamp::now(),
        );
        assert_eq!(v.upstream.first().map(|(k, _)| *k), Some(headers::REASON));
        if parsed.malformed.is_some() {
            assert_eq!(v.upstream[0].1, "NO_HINT");
        }
        if let Some(dest) = &v.destination {
            assert!(addresses.contains(&dest.as_str()), "destination {dest}");
        }
        match mode {
            DestinationMode::OverrideHost => assert!(v.refusal.is_none()),
            // Exactly one of: somewhere to go, or a 503.
            DestinationMode::OriginalDst => {
                assert_ne!(v.destination.is_some(), v.refusal.is_some())
            }
        }
        assert_eq!(!v.debug_echo.is_empty(), parsed.debug);
    }
});
