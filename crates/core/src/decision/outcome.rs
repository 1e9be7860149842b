//! What a decision returns: the strategy, the reason code and the ranked replicas.
//! Names and numbers mirror `inferencecache.v1` (docs/reference.md, "gRPC API").

use std::sync::Arc;

use super::SpillCheck;
use crate::index::ReplicaTable;
use crate::load::Inflight;
use crate::time::Timestamp;

/// How the pick was made.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Strategy {
    None,
    PrefixMatch,
    TenantHot,
    Affinity,
}

/// Why the decision came out as it did. Every variant is a public contract name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReasonCode {
    PrefixMatch,
    TenantHot,
    AffinityHint,
    NoHint,
    UnknownTenant,
    UnknownModel,
    UnknownHashScheme,
    Timeout,
    PolicyRequiresChain,
}

impl ReasonCode {
    pub const ALL: [ReasonCode; 9] = [
        Self::PrefixMatch,
        Self::TenantHot,
        Self::AffinityHint,
        Self::NoHint,
        Self::UnknownTenant,
        Self::UnknownModel,
        Self::UnknownHashScheme,
        Self::Timeout,
        Self::PolicyRequiresChain,
    ];

    /// The contract name, used on headers and as a bounded metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::PrefixMatch => "PREFIX_MATCH",
            Self::TenantHot => "TENANT_HOT",
            Self::AffinityHint => "AFFINITY_HINT",
            Self::NoHint => "NO_HINT",
            Self::UnknownTenant => "UNKNOWN_TENANT",
            Self::UnknownModel => "UNKNOWN_MODEL",
            Self::UnknownHashScheme => "UNKNOWN_HASH_SCHEME",
            Self::Timeout => "TIMEOUT",
            Self::PolicyRequiresChain => "POLICY_REQUIRES_CHAIN",
        }
    }
}

/// One ranked replica, borrowed from the decision.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ReplicaScore<'a> {
    pub replica_id: &'a str,
    /// `host:port` the request should go to.
    pub endpoint: &'a str,
    pub score: f64,
    pub matched_tokens: u32,
    pub matched_blocks: u32,
}

/// A ranked row: the replica's slot in the scope's table and its figures.
/// `repr(C)` with the ranker's `Row` layout (the slot where its member is).
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C)]
pub(crate) struct ScoredSlot {
    pub slot: u32,
    pub score: f64,
    pub matched_tokens: u32,
    pub matched_blocks: u32,
}

/// The outcome of one LookupRoute decision.
///
/// Rows refer to the scope's replica table as it was when the decision was made
/// (one shared `Arc`), so building a decision copies no strings.
#[derive(Clone, Debug)]
pub struct Decision {
    pub strategy: Strategy,
    pub reason: ReasonCode,
    pub policy_revision: Arc<str>,
    rows: Vec<ScoredSlot>,
    replicas: Option<Arc<ReplicaTable>>,
    /// The slot the cache preferred when the load rule moved the pick, and the
    /// check that moved it.
    spilled_from: Option<(u32, SpillCheck)>,
    /// The policy's loadAwareness: only then is a routed request counted.
    load_aware: bool,
}

impl Decision {
    pub(crate) fn none(reason: ReasonCode, policy_revision: &Arc<str>) -> Self {
        Self {
            strategy: Strategy::None,
            reason,
            policy_revision: policy_revision.clone(),
            rows: Vec::new(),
            replicas: None,
            spilled_from: None,
            load_aware: false,
        }
    }

    pub(crate) fn with_rows(
        strategy: Strategy,
        reason: ReasonCode,
        policy_revision: &Arc<str>,
        rows: Vec<ScoredSlot>,
        replicas: Arc<ReplicaTable>,
    ) -> Self {
        Self {
            strategy,
            reason,
            policy_revision: policy_revision.clone(),
            rows,
            replicas: Some(replicas),
            spilled_from: None,
            load_aware: false,
        }
    }

    /// Marks a decision made with the load rule on, and where it spilled from.
    pub(crate) fn with_load(
        mut self,
        load_aware: bool,
        spilled_from: Option<(u32, SpillCheck)>,
    ) -> Self {
        self.load_aware = load_aware;
        self.spilled_from = spilled_from;
        self
    }

    /// The ranked replicas, best first; empty when no hint is given.
    pub fn scores(&self) -> impl Iterator<Item = ReplicaScore<'_>> {
        let table = self.replicas.as_deref();
        self.rows.iter().filter_map(move |row| {
            let replica = table?.get(row.slot)?;
            Some(ReplicaScore {
                replica_id: &replica.id,
                endpoint: replica.endpoint().map_or("", |e| &**e),
                score: row.score,
                matched_tokens: row.matched_tokens,
                matched_blocks: row.matched_blocks,
            })
        })
    }

    /// The picked replica, if the decision gives a hint.
    pub fn pick(&self) -> Option<ReplicaScore<'_>> {
        self.scores().next()
    }

    /// When the load rule moved the pick: the replica the cache preferred
    /// (`x-inferencecache-spilled-from`, `LookupRouteResponse.spilled_from`).
    pub fn spilled_from(&self) -> Option<&str> {
        let (slot, _) = self.spilled_from?;
        Some(&*self.replicas.as_deref()?.get(slot)?.id)
    }

    /// When the load rule moved the pick: which of its checks did
    /// (`x-inferencecache-spilled-by`, `LookupRouteResponse.spilled_by`).
    pub fn spilled_by(&self) -> Option<SpillCheck> {
        self.spilled_from.map(|(_, by)| by)
    }

    /// Counts this request against the picked replica until the returned guard is
    /// dropped (the end of its prefill; see [`crate::load`]). Only the path that
    /// really routes the request (ext_proc) calls this; a LookupRoute is a query.
    /// `requested_tokens` is the prompt's token count; the matched tokens are not
    /// prefill work, so only the rest counts. `None` without a pick, or when the
    /// policy's loadAwareness is Disabled (nothing would read the count).
    pub fn admit(&self, requested_tokens: u64) -> Option<Inflight> {
        self.admit_at(requested_tokens, Timestamp(0))
    }

    /// [`Self::admit`] at `now`, the age a prefill ticket carrying the request
    /// is measured from (`Router::admit`).
    pub(crate) fn admit_at(&self, requested_tokens: u64, now: Timestamp) -> Option<Inflight> {
        if !self.load_aware {
            return None;
        }
        let row = self.rows.first()?;
        let replica = self.replicas.as_deref()?.get(row.slot)?;
        let uncached = requested_tokens.saturating_sub(u64::from(row.matched_tokens));
        Some(Inflight::begin(replica.live.clone(), uncached, now))
    }

    /// The picked replica's last event of any kind, ns; 0 without a pick or an
    /// event.
    pub(crate) fn pick_last_event_at(&self) -> u64 {
        self.rows
            .first()
            .and_then(|row| self.replicas.as_deref()?.get(row.slot))
            .map_or(0, |r| r.live.last_event_at())
    }

    /// The picked replica's id.
    pub(crate) fn pick_replica_id(&self) -> Option<Arc<str>> {
        let row = self.rows.first()?;
        Some(self.replicas.as_deref()?.get(row.slot)?.id.clone())
    }

    /// The picked replica's slot in its scope's table.
    pub(crate) fn pick_slot(&self) -> Option<u32> {
        self.rows.first().map(|r| r.slot)
    }
}
