//! What writers hand the index: KV-cache events of one replica in one scope, and
//! engine statistics. Adapters (gRPC IngestEvents, the ZMQ subscribers) translate
//! their wire formats into these.

use thiserror::Error;

use crate::scope::ScopeRef;

/// One KV-cache event, applied in order.
#[derive(Clone, Debug, PartialEq)]
pub enum IndexEvent {
    /// A run of blocks, block hashes already chained. `parent` is informative: the
    /// hashes themselves identify their prefix.
    Stored {
        parent: Option<u64>,
        hashes: Vec<u64>,
        /// Parallel to `hashes`; empty means every block is full.
        token_counts: Vec<u32>,
    },
    Removed {
        hashes: Vec<u64>,
    },
    /// The replica dropped its whole cache (engine reset).
    Cleared,
    /// Legacy exact-prefix key.
    PrefixStored {
        prefix_hash: String,
        token_count: u32,
    },
    /// Blocks (already chained hashes) the replica keeps in a slower tier, e.g.
    /// offloaded to CPU memory. They count with the tier's policy weight.
    TierStored {
        tier: Tier,
        hashes: Vec<u64>,
    },
    /// Blocks that left a slower tier.
    TierRemoved {
        tier: Tier,
        hashes: Vec<u64>,
    },
}

/// A memory tier below the GPU pool (the GPU pool is what `Stored` speaks of).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Tier {
    /// Host memory (vLLM `medium: "CPU"`, SGLang `CPU_PINNED`).
    Cpu,
    /// Local disk or another storage backend.
    Disk,
}

impl Tier {
    /// Its code in a holder's slot (see `entry.rs`).
    pub(crate) fn code(self) -> u32 {
        match self {
            Self::Cpu => 1,
            Self::Disk => 2,
        }
    }
}

impl IndexEvent {
    /// Structural validity; an invalid event is counted as rejected and changes nothing.
    pub fn is_valid(&self) -> bool {
        match self {
            Self::Stored {
                hashes,
                token_counts,
                ..
            } => {
                !hashes.is_empty()
                    && (token_counts.is_empty() || token_counts.len() == hashes.len())
            }
            Self::Removed { hashes }
            | Self::TierStored { hashes, .. }
            | Self::TierRemoved { hashes, .. } => !hashes.is_empty(),
            Self::Cleared => true,
            Self::PrefixStored { prefix_hash, .. } => !prefix_hash.is_empty(),
        }
    }
}

/// The events of one replica in one scope.
#[derive(Clone, Copy, Debug)]
pub struct IngestBatch<'a> {
    pub scope: ScopeRef<'a>,
    pub replica_id: &'a str,
    /// Non-empty: register (or refresh) the replica as serving at this `host:port`.
    pub endpoint: &'a str,
    pub events: &'a [IndexEvent],
}

/// How many events of a batch were applied and rejected as malformed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IngestOutcome {
    pub applied: u32,
    pub rejected: u32,
}

/// A batch whose header is unusable; nothing of it was applied.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum IngestError {
    #[error("tenant_id, model_id and hash_scheme must all be non-empty")]
    MalformedScope,
    #[error("replica_id must be non-empty")]
    MissingReplica,
    #[error("tenant id {0:?} is reserved for the server's self-test")]
    ReservedTenant(String),
}

/// Engine statistics of one replica (ReportStats).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ReplicaStats {
    /// Engine total, not per tenant.
    pub cache_memory_bytes: u64,
    /// 0..1
    pub hit_rate: f64,
    pub waiting_requests: u32,
    pub running_requests: u32,
    /// 0..1
    pub kv_cache_usage: f64,
    /// The engine's count of requests that reached their first token since it
    /// started (a scrape of its TTFT histogram), when known: what other
    /// sidecars route there shows up in it (`load/fleet_routes.rs`).
    pub first_tokens_total: Option<u64>,
}

/// A ReportStats call.
#[derive(Clone, Copy, Debug)]
pub struct StatsReport<'a> {
    pub scope: ScopeRef<'a>,
    pub replica_id: &'a str,
    pub endpoint: &'a str,
    pub stats: ReplicaStats,
}
