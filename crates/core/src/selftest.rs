//! The functional self-test behind `/readyz`: ingest a synthetic chain for one of
//! two synthetic replicas under the reserved probe tenant, look it up, expect
//! PREFIX_MATCH on that replica, and remove both replicas again.
//!
//! Two replicas, because a chain held by the only serving replica has no
//! distinguishing power (score 0); the probe tenant also runs under a fixed policy
//! with open floors (see `PolicySnapshot::tenant`), so the operator's floors cannot
//! fail it.

use super::decision::{self, outcome::ReasonCode, request::LookupRequest};
use super::index::{Index, IndexEvent, IngestBatch, TenantLimits};
use super::policy::EvictionAlgorithm;
use super::scope::{PROBE_TENANT, ScopeRef};
use super::snapshot::PolicySnapshot;
use super::time::Timestamp;

const MODEL: &str = "probe-model";
const SCHEME: &str = "probe-scheme";
const HOLDER: &str = "probe-holder";
const OTHER: &str = "probe-other";

pub(crate) fn run(index: &Index, snapshot: &PolicySnapshot, now: Timestamp) -> Result<(), String> {
    let scope = ScopeRef::new(PROBE_TENANT, MODEL, SCHEME);
    let chain: Vec<u64> = (0..4u64)
        .map(|i| 0x1c_0000_0000 ^ (now.as_nanos().rotate_left(17) + i))
        .collect();
    let limits = TenantLimits {
        ttl_nanos: u64::MAX,
        eviction: EvictionAlgorithm::Lru,
        max_entries: None,
    };
    let stored = [IndexEvent::Stored {
        parent: None,
        hashes: chain.clone(),
        token_counts: Vec::new(),
    }];
    let result = (|| {
        index
            .ingest(
                &IngestBatch {
                    scope,
                    replica_id: HOLDER,
                    endpoint: "127.0.0.1:1",
                    events: &stored,
                },
                &limits,
                now,
            )
            .map_err(|e| format!("probe ingest failed: {e}"))?;
        index
            .ingest(
                &IngestBatch {
                    scope,
                    replica_id: OTHER,
                    endpoint: "127.0.0.1:2",
                    events: &[],
                },
                &limits,
                now,
            )
            .map_err(|e| format!("probe ingest failed: {e}"))?;
        let counts = vec![16u32; chain.len()];
        let req = LookupRequest {
            tenant_id: PROBE_TENANT,
            model_id: MODEL,
            hash_scheme: SCHEME,
            block_hashes: &chain,
            block_token_counts: &counts,
            ..LookupRequest::default()
        };
        let d = decision::decide(index, snapshot, &req, now);
        match (d.reason, d.pick().map(|p| p.replica_id)) {
            (ReasonCode::PrefixMatch, Some(HOLDER)) => Ok(()),
            (reason, pick) => Err(format!(
                "probe lookup returned {} (pick {:?}), expected PREFIX_MATCH on {HOLDER}",
                reason.as_str(),
                pick
            )),
        }
    })();
    index.remove_replica(scope, HOLDER, now);
    index.remove_replica(scope, OTHER, now);
    result
}
