//! What a decision returns: the strategy, the reason code and the ranked replicas.
//! Names and numbers mirror `inferencecache.v1` (contract §2).

use std::sync::Arc;

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

/// One ranked replica.
#[derive(Clone, Debug, PartialEq)]
pub struct ReplicaScore {
    pub replica_id: Arc<str>,
    /// `host:port` the request should go to.
    pub endpoint: Arc<str>,
    pub score: f64,
    pub matched_tokens: u32,
    pub matched_blocks: u32,
}

/// The outcome of one LookupRoute decision.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    /// Best first; empty when no hint is given.
    pub scores: Vec<ReplicaScore>,
    pub strategy: Strategy,
    pub reason: ReasonCode,
    pub policy_revision: Arc<str>,
}

impl Decision {
    pub(crate) fn none(reason: ReasonCode, policy_revision: &Arc<str>) -> Self {
        Self {
            scores: Vec::new(),
            strategy: Strategy::None,
            reason,
            policy_revision: policy_revision.clone(),
        }
    }

    /// The picked replica, if the decision gives a hint.
    pub fn pick(&self) -> Option<&ReplicaScore> {
        self.scores.first()
    }
}
