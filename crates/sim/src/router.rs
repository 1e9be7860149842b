//! The routers the benchmark compares.

use anyhow::bail;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Router {
    RoundRobin,
    Random,
    LeastRequest,
    /// inferencecache with the server's default policy.
    InferenceCache,
    /// inferencecache with the policy an operator would set for these workloads
    /// (`bench::TUNED_POLICY_SPEC`), as its own tenant in the same sidecar.
    InferenceCacheTuned,
    /// inferencecache with flow control on (`bench::FLOW_POLICY_SPEC`), as its own
    /// tenant in the same sidecar: above capacity it holds requests and sheds
    /// with 429 what it cannot hold. Not in the default set.
    InferenceCacheFlow,
    /// Knows every engine's cache exactly (asks each engine before every request)
    /// and sends the request to the longest cached prefix, ties to the least loaded.
    /// Not a real router: the ceiling the hit rate is judged against.
    Oracle,
    /// Knows every engine's cache *and* queue (asks each engine for its cached
    /// prefix and its cost model's predicted TTFT for this prompt: the prefill work
    /// queued ahead of it plus its own uncached prefill) and sends the request where
    /// that prediction is lowest. Not a real router: the latency ceiling.
    OracleLoad,
    /// The load-aware oracle held to the acceptance's balance: it knows how many
    /// requests the run sends and never gives an engine more than 1.3 × the mean.
    /// Not in the default set; it answers whether a router can meet the
    /// load-aware oracle's p90 *and* max/mean ≤ 1.3 on the same workload.
    OracleBalanced,
}

/// Where a router's traffic goes in Envoy.
pub struct EnvoyCluster {
    pub cluster: &'static str,
    pub ext_proc: bool,
}

impl Router {
    /// The routers a benchmark runs unless told otherwise.
    pub const ALL: [Router; 7] = [
        Self::RoundRobin,
        Self::Random,
        Self::LeastRequest,
        Self::InferenceCache,
        Self::InferenceCacheTuned,
        Self::Oracle,
        Self::OracleLoad,
    ];

    /// Every router: the default set, then the ones a benchmark runs only when
    /// named.
    pub fn known() -> impl Iterator<Item = Router> {
        Self::ALL
            .into_iter()
            .chain([Self::InferenceCacheFlow, Self::OracleBalanced])
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::RoundRobin => "round-robin",
            Self::Random => "random",
            Self::LeastRequest => "least-request",
            Self::InferenceCache => "inferencecache",
            Self::InferenceCacheTuned => "inferencecache-tuned",
            Self::InferenceCacheFlow => "inferencecache-flow",
            Self::Oracle => "oracle",
            Self::OracleLoad => "oracle-load",
            Self::OracleBalanced => "oracle-balanced",
        }
    }

    pub fn parse(name: &str) -> anyhow::Result<Self> {
        match Self::known().find(|r| r.name() == name) {
            Some(r) => Ok(r),
            None => bail!(
                "unknown router {name:?}; known: {}",
                Self::known().map(Self::name).collect::<Vec<_>>().join(", ")
            ),
        }
    }

    /// The tenant its requests carry (each inferencecache variant is its own tenant,
    /// with its own policy, in the one sidecar).
    pub fn tenant(self) -> &'static str {
        match self {
            Self::InferenceCacheTuned => "bench-tuned",
            Self::InferenceCacheFlow => "bench-flow",
            _ => "bench",
        }
    }

    /// The tenant a workload's tenant `index` speaks as: index 0 is
    /// [`Router::tenant`], the others a namespace of their own beside it.
    pub fn tenant_of(self, index: u8) -> String {
        match index {
            0 => self.tenant().to_string(),
            i => format!("{}-t{i}", self.tenant()),
        }
    }

    /// An oracle: goes to the engines directly, asking them first.
    pub fn is_oracle(self) -> bool {
        matches!(self, Self::Oracle | Self::OracleLoad | Self::OracleBalanced)
    }

    /// Whether the sidecar decides (the inferencecache rows).
    pub fn is_inferencecache(self) -> bool {
        matches!(
            self,
            Self::InferenceCache | Self::InferenceCacheTuned | Self::InferenceCacheFlow
        )
    }

    /// The Envoy cluster serving this router, `None` for the oracles (direct).
    pub fn envoy_cluster(self) -> Option<EnvoyCluster> {
        let (cluster, ext_proc) = match self {
            Self::RoundRobin => ("round_robin", false),
            Self::Random => ("random", false),
            Self::LeastRequest => ("least_request", false),
            Self::InferenceCache | Self::InferenceCacheTuned | Self::InferenceCacheFlow => {
                ("replicas", true)
            }
            Self::Oracle | Self::OracleLoad | Self::OracleBalanced => return None,
        };
        Some(EnvoyCluster { cluster, ext_proc })
    }
}

#[cfg(test)]
mod tests;
