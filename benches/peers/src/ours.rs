//! inferencecache: the whole LookupRoute decision, events through `Router::ingest`.

use inferencecache_core::Router;
use inferencecache_core::decision::outcome::ReasonCode;
use inferencecache_core::decision::request::LookupRequest;
use inferencecache_core::index::{IndexConfig, IndexEvent, IngestBatch};
use inferencecache_core::scope::ScopeRef;
use inferencecache_core::snapshot::PolicySnapshot;
use inferencecache_core::time::Timestamp;

use crate::{BLOCKS, Index, Query, REPLICAS, Seq, Truth};

const TENANT: &str = "bench";
const MODEL: &str = "model";
const SCHEME: &str = "scheme";

pub struct Ours {
    router: Router,
    ids: Vec<String>,
    endpoints: Vec<String>,
    counts: Vec<u32>,
    now: Timestamp,
}

impl Ours {
    pub fn new() -> Self {
        let now = Timestamp::from_secs(1_800_000_000);
        let config = IndexConfig {
            max_entries: u64::MAX,
        };
        Self {
            router: Router::new(config, PolicySnapshot::empty(), now),
            ids: (0..REPLICAS).map(|r| format!("replica-{r}")).collect(),
            endpoints: (0..REPLICAS).map(|r| format!("10.0.0.{r}:8000")).collect(),
            counts: vec![16; BLOCKS],
            now,
        }
    }

    fn ingest(&self, replica: usize, events: &[IndexEvent]) {
        let batch = IngestBatch {
            scope: ScopeRef::new(TENANT, MODEL, SCHEME),
            replica_id: &self.ids[replica],
            endpoint: &self.endpoints[replica],
            events,
        };
        std::hint::black_box(self.router.ingest(&batch, self.now).ok());
    }

    fn lookup(&self, q: &Query) -> inferencecache_core::decision::outcome::Decision {
        let request = LookupRequest {
            tenant_id: TENANT,
            model_id: MODEL,
            hash_scheme: SCHEME,
            block_hashes: &q.seq.chain,
            block_token_counts: &self.counts,
            ..LookupRequest::default()
        };
        self.router.lookup(&request, self.now)
    }
}

impl Index for Ours {
    fn store(&self, seq: &Seq, replica: usize) {
        self.ingest(
            replica,
            &[IndexEvent::Stored {
                parent: None,
                hashes: seq.chain.clone(),
                token_counts: Vec::new(),
            }],
        );
    }

    fn remove(&self, seq: &Seq, from: usize, replica: usize, reversed: bool) {
        let mut hashes = seq.chain[from..].to_vec();
        if reversed {
            hashes.reverse();
        }
        self.ingest(replica, &[IndexEvent::Removed { hashes }]);
    }

    fn decide(&self, q: &Query) -> u64 {
        let d = self.lookup(q);
        d.pick().map_or(0, |p| p.replica_id.len() as u64)
    }

    /// Ours answers with one replica: an exact chain goes to its owner; a group
    /// prefix goes to one of the group's holders, or, when every replica holds the
    /// prefix (nothing to tell them apart by cache), by the affinity hint.
    fn check(&self, q: &Query, truth: &Truth<'_>) -> bool {
        let d = self.lookup(q);
        let pick = d
            .pick()
            .and_then(|p| p.replica_id.strip_prefix("replica-")?.parse::<usize>().ok());
        let (_, holders) = truth.expected(q);
        match (q.owner, d.reason) {
            (Some(r), ReasonCode::PrefixMatch) => pick == Some(r),
            (None, ReasonCode::PrefixMatch) => {
                holders != u32::MAX && pick.is_some_and(|p| holders & (1 << p) != 0)
            }
            (None, ReasonCode::AffinityHint) => holders == u32::MAX,
            _ => false,
        }
    }
}
