//! The resolved cache policy of one namespace: every CachePolicy field,
//! with the defaults (docs/reference.md, "Defaults") applied.
//!
//! CRD objects (file mode or Kubernetes) are converted into [`ResolvedPolicy`] by the
//! adapters; the decision and the index only ever read this type.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use thiserror::Error;

/// Why a policy value was rejected. The message names the offending value; the
/// adapters add the document and field path.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum PolicyError {
    #[error("routingFloorScore {0:?} is not a non-negative decimal (e.g. \"0.1\", \"5\", \"0\")")]
    FloorScore(String),
    #[error("duration {0:?} is not a duration like \"10m\", \"90s\" or \"1h30m\"")]
    Duration(String),
    #[error("evictionTTL must be greater than zero")]
    ZeroTtl,
    #[error("strategy.requireChain: true needs strategy.enableChainMatching: true")]
    RequireChainWithoutMatching,
    #[error("eviction {0:?} is not LRU or LFU")]
    Eviction(String),
    #[error("affinityRouting {0:?} is not Enabled or Disabled")]
    Affinity(String),
    #[error("loadAwareness {0:?} is not Enabled or Disabled")]
    LoadAwareness(String),
    #[error("loadBalancing.factor {0:?} is not a decimal of at least 1 (e.g. \"1.25\")")]
    LoadFactor(String),
    #[error(
        "loadBalancing.shareFactor {0:?} is not \"0\" (off) or a decimal of at least 1 (e.g. \"1.2\")"
    )]
    ShareFactor(String),
}

/// Which entries the cap sweep (and a tenant at quota) evicts first.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum EvictionAlgorithm {
    /// Oldest lastSeen first.
    #[default]
    Lru,
    /// Lowest access count first, ties on the oldest lastSeen. Counts never age.
    Lfu,
}

impl EvictionAlgorithm {
    /// The lower-cased form the controller propagates on the resolved policy.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Lru => "lru",
            Self::Lfu => "lfu",
        }
    }
}

impl FromStr for EvictionAlgorithm {
    type Err = PolicyError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "lru" => Ok(Self::Lru),
            "lfu" => Ok(Self::Lfu),
            _ => Err(PolicyError::Eviction(s.to_string())),
        }
    }
}

/// The consistent-hash fallback on the StrategyNone branch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum AffinityRouting {
    #[default]
    Enabled,
    Disabled,
}

impl AffinityRouting {
    pub fn is_enabled(self) -> bool {
        self == Self::Enabled
    }
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Enabled => "Enabled",
            Self::Disabled => "Disabled",
        }
    }
}

impl FromStr for AffinityRouting {
    type Err = PolicyError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "Enabled" => Ok(Self::Enabled),
            "Disabled" => Ok(Self::Disabled),
            _ => Err(PolicyError::Affinity(s.to_string())),
        }
    }
}

/// `routingFloorScore`: a non-negative decimal carried as a string in the CRD.
///
/// The accepted form is exactly `^[0-9]+(\.[0-9]+)?$`, the pattern admission
/// enforces, so file mode and Kubernetes accept the same values.
#[derive(Clone, Copy, Debug, PartialEq, PartialOrd)]
pub struct FloorScore(f64);

impl FloorScore {
    pub const DEFAULT_STR: &'static str = "0.1";

    pub fn value(self) -> f64 {
        self.0
    }

    /// Whether `s` has the accepted form (also used by admission).
    pub fn is_valid(s: &str) -> bool {
        let (int, frac) = match s.split_once('.') {
            Some((i, f)) => (i, Some(f)),
            None => (s, None),
        };
        let digits = |p: &str| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit());
        digits(int) && frac.is_none_or(digits)
    }
}

impl Default for FloorScore {
    fn default() -> Self {
        Self(0.1)
    }
}

impl FromStr for FloorScore {
    type Err = PolicyError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if !Self::is_valid(s) {
            return Err(PolicyError::FloorScore(s.to_string()));
        }
        s.parse::<f64>()
            .ok()
            .filter(|v| v.is_finite())
            .map(Self)
            .ok_or_else(|| PolicyError::FloorScore(s.to_string()))
    }
}

impl fmt::Display for FloorScore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Parses durations of the Kubernetes/Go form: one or more `<number><unit>` with
/// units `h`, `m`, `s`, `ms`, `us`, `ns` (e.g. `10m`, `90s`, `1h30m`, `1.5h`).
/// A bare `0` is accepted as zero, as Go does.
pub fn parse_duration(s: &str) -> Result<Duration, PolicyError> {
    let err = || PolicyError::Duration(s.to_string());
    if s == "0" {
        return Ok(Duration::ZERO);
    }
    if s.is_empty() {
        return Err(err());
    }
    let mut total = 0f64;
    let mut rest = s;
    while !rest.is_empty() {
        let num_len = rest
            .bytes()
            .take_while(|b| b.is_ascii_digit() || *b == b'.')
            .count();
        if num_len == 0 {
            return Err(err());
        }
        let (num, after) = rest.split_at(num_len);
        let value: f64 = num.parse().map_err(|_| err())?;
        let unit_len = after
            .bytes()
            .take_while(|b| b.is_ascii_alphabetic())
            .count();
        let (unit, after) = after.split_at(unit_len);
        let scale = match unit {
            "h" => 3600.0,
            "m" => 60.0,
            "s" => 1.0,
            "ms" => 1e-3,
            "us" | "µs" => 1e-6,
            "ns" => 1e-9,
            _ => return Err(err()),
        };
        total += value * scale;
        rest = after;
    }
    if !total.is_finite() || total > 1e12 {
        return Err(err());
    }
    Ok(Duration::from_secs_f64(total))
}

/// Formats a duration back in the `1h30m5s` form for `/policy`.
pub fn format_duration(d: Duration) -> String {
    let mut secs = d.as_secs();
    let ms = d.subsec_millis();
    if secs == 0 && ms == 0 {
        return "0s".into();
    }
    let mut out = String::new();
    let h = secs / 3600;
    secs %= 3600;
    let m = secs / 60;
    secs %= 60;
    if h > 0 {
        out.push_str(&format!("{h}h"));
    }
    if m > 0 {
        out.push_str(&format!("{m}m"));
    }
    if secs > 0 || ms > 0 {
        if ms > 0 {
            out.push_str(&format!("{secs}.{ms:03}s"));
        } else {
            out.push_str(&format!("{secs}s"));
        }
    }
    out
}

/// Which lookup strategies may surface.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StrategyGates {
    pub enable_chain_matching: bool,
    pub require_chain: bool,
    pub enable_tenant_hot: bool,
}

impl Default for StrategyGates {
    fn default() -> Self {
        Self {
            enable_chain_matching: true,
            require_chain: false,
            enable_tenant_hot: true,
        }
    }
}

/// `spec.loadAwareness`: whether replica load may move a pick off
/// the cache's first choice. Disabled reproduces the cache pick exactly.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum LoadAwareness {
    #[default]
    Enabled,
    Disabled,
}

impl LoadAwareness {
    pub fn is_enabled(self) -> bool {
        self == Self::Enabled
    }
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Enabled => "Enabled",
            Self::Disabled => "Disabled",
        }
    }
}

impl FromStr for LoadAwareness {
    type Err = PolicyError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "Enabled" => Ok(Self::Enabled),
            "Disabled" => Ok(Self::Disabled),
            _ => Err(PolicyError::LoadAwareness(s.to_string())),
        }
    }
}

/// The bounded-load rule's tuning (`spec.loadBalancing`).
///
/// A replica is overloaded when its load exceeds `factor × mean + slack`, where the
/// mean is over the scope's serving replicas counting the request being placed.
/// With `factor ≥ 1` the least-loaded replica is never over the bound, so a walk
/// down the candidates always ends.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LoadBalancing {
    pub factor: f64,
    /// Requests a replica may run above `factor × mean` before it counts as
    /// overloaded: small fleets and light traffic must not spill on noise.
    pub slack: u32,
    /// Engine-reported load (ReportStats, scraped metrics) older than this is
    /// ignored; the sidecar's own in-flight count still applies.
    pub stats_max_age: Duration,
    /// How long a chain routed on the ext_proc path counts for its replica before
    /// the engine confirms it (burst siblings, `index/pending.rs`); zero = off.
    /// Off by default until the routing benchmark has measured it.
    pub pending_ttl: Duration,
    /// Uncached prompt tokens the pick's prefill backlog (plus this request's own
    /// uncached tokens there) may exceed the cheapest serving replica's before
    /// the request goes to that one instead; zero = off. A request count cannot
    /// see that a replica has two full prefills queued.
    pub prefill_slack_tokens: u32,
    /// How far above the scope's mean a replica's share of the requests this
    /// sidecar routed lately (`load/recent_routes.rs`) may run, plus `slack`, before
    /// it counts as overloaded; zero = off. The request count sees only this
    /// moment, so a hot prefix's bursts could each fit it and still add up.
    pub share_factor: f64,
}

impl LoadBalancing {
    pub const DEFAULT_FACTOR_STR: &'static str = "1.25";
    pub const DEFAULT_SLACK: u32 = 2;
    pub const DEFAULT_STATS_MAX_AGE: Duration = Duration::from_secs(5);
    /// A few milliseconds of prefill: the best of 32, 128, 256, 768 and 2048 on
    /// the routing benchmark (docs/benchmarks.md). Larger values keep a pick that
    /// queues a whole prefill ahead of a cheap hit.
    pub const DEFAULT_PREFILL_SLACK_TOKENS: u32 = 128;
    /// 1.1 and 1.2 both kept every benchmark cell's max/mean ≤ 1.3; 1.2 costs
    /// less hit rate and p99 on the routing benchmark.
    pub const DEFAULT_SHARE_FACTOR_STR: &'static str = "1.2";
    pub const DEFAULT_SHARE_FACTOR: f64 = 1.2;

    /// Parses a factor: the floor-score decimal form, at least 1.
    pub fn parse_factor(s: &str) -> Result<f64, PolicyError> {
        let err = || PolicyError::LoadFactor(s.to_string());
        let v = s.parse::<FloorScore>().map_err(|_| err())?.value();
        if v < 1.0 { Err(err()) } else { Ok(v) }
    }

    /// Parses a share factor: "0" (off) or a factor as [`Self::parse_factor`].
    pub fn parse_share_factor(s: &str) -> Result<f64, PolicyError> {
        let err = || PolicyError::ShareFactor(s.to_string());
        let v = s.parse::<FloorScore>().map_err(|_| err())?.value();
        if v == 0.0 || v >= 1.0 {
            Ok(v)
        } else {
            Err(err())
        }
    }

    pub fn pending_ttl_nanos(&self) -> u64 {
        u64::try_from(self.pending_ttl.as_nanos()).unwrap_or(u64::MAX)
    }

    pub fn stats_max_age_nanos(&self) -> u64 {
        u64::try_from(self.stats_max_age.as_nanos()).unwrap_or(u64::MAX)
    }
}

impl Default for LoadBalancing {
    fn default() -> Self {
        Self {
            factor: 1.25,
            slack: Self::DEFAULT_SLACK,
            stats_max_age: Self::DEFAULT_STATS_MAX_AGE,
            pending_ttl: Duration::ZERO,
            prefill_slack_tokens: Self::DEFAULT_PREFILL_SLACK_TOKENS,
            share_factor: Self::DEFAULT_SHARE_FACTOR,
        }
    }
}

/// One namespace's policy with every default applied (docs/reference.md, "Defaults").
#[derive(Clone, Debug, PartialEq)]
pub struct ResolvedPolicy {
    pub eviction: EvictionAlgorithm,
    pub eviction_ttl: Duration,
    pub minimum_prefix_tokens: u32,
    pub minimum_matched_tokens: u32,
    pub routing_floor_score: FloorScore,
    /// Zero means no budget.
    pub lookup_timeout: Duration,
    pub strategy: StrategyGates,
    pub affinity_routing: AffinityRouting,
    /// `Disabled` routes by the cache pick alone.
    pub load_awareness: LoadAwareness,
    pub load_balancing: LoadBalancing,
    /// CachePolicy `spec.tierWeights`.
    pub tier_weights: TierWeights,
    /// CachePolicy `spec.flowControl`.
    pub flow_control: FlowControl,
}

/// `spec.flowControl`: holding requests while every eligible replica is saturated.
///
/// Off by default. A second of holding is about one prefill of a long prompt on a
/// busy engine; it bounds a client's wait, not its TTFT: under sustained overload
/// served requests wait up to it, so an operator holding a TTFT objective sets a
/// shorter one (docs/flow-control.md). 1024 held requests bound the sidecar's
/// queue state to a few hundred KiB.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlowControl {
    pub enabled: bool,
    pub max_queue_wait: Duration,
    pub max_queued: u32,
    /// A replica whose prefill backlog (uncached tokens routed there, prefill
    /// not ended) reaches this is saturated; 0: only the request-count and KV
    /// bounds apply.
    pub max_backlog_tokens: u64,
}

impl FlowControl {
    pub const DEFAULT_MAX_QUEUE_WAIT: Duration = Duration::from_secs(1);
    /// The longest `maxQueueWait`: the shipped Envoy configs grant a held
    /// request at most this plus a second (`max_message_timeout: 30s`).
    pub const MAX_QUEUE_WAIT: Duration = Duration::from_secs(29);
    pub const DEFAULT_MAX_QUEUED: u32 = 1024;
    pub const DEFAULT_MAX_BACKLOG_TOKENS: u64 = 2048;
}

impl Default for FlowControl {
    fn default() -> Self {
        Self {
            enabled: false,
            max_queue_wait: Self::DEFAULT_MAX_QUEUE_WAIT,
            max_queued: Self::DEFAULT_MAX_QUEUED,
            max_backlog_tokens: Self::DEFAULT_MAX_BACKLOG_TOKENS,
        }
    }
}

/// How much a block held in a slower memory tier counts in the score, relative
/// to the same block on GPU (1.0). A weight of 0 ignores the tier.
///
/// Defaults from the peers, not measured here: CPU 0.8 is llm-d's (Dynamo uses
/// 0.75 for host memory), disk 0.25 is Dynamo's. Loading an offloaded block costs
/// a copy, not a recompute, so it is worth most of a GPU hit.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TierWeights {
    pub cpu: f64,
    pub disk: f64,
}

impl TierWeights {
    pub const DEFAULT_CPU: f64 = 0.8;
    pub const DEFAULT_DISK: f64 = 0.25;

    /// Weights by tier code: GPU (1.0), CPU, disk.
    pub fn by_code(&self) -> [f64; 3] {
        [1.0, self.cpu, self.disk]
    }

    /// Whether any lower tier counts at all.
    pub fn any_lower(&self) -> bool {
        self.cpu > 0.0 || self.disk > 0.0
    }

    /// A weight from its CRD spelling: a decimal in [0, 1].
    pub fn parse_weight(field: &str, text: &str) -> Result<f64, String> {
        let w: f64 = text
            .trim()
            .parse()
            .map_err(|_| format!("{field}: {text:?} is not a decimal"))?;
        if !(0.0..=1.0).contains(&w) {
            return Err(format!("{field}: {text} is outside 0..1 (GPU is 1)"));
        }
        Ok(w)
    }
}

impl Default for TierWeights {
    fn default() -> Self {
        Self {
            cpu: Self::DEFAULT_CPU,
            disk: Self::DEFAULT_DISK,
        }
    }
}

impl ResolvedPolicy {
    pub const DEFAULT_EVICTION_TTL: Duration = Duration::from_secs(600);
    pub const DEFAULT_MINIMUM_MATCHED_TOKENS: u32 = 64;

    /// Cross-field rules the CRD schema cannot fully express.
    pub fn validate(&self) -> Result<(), PolicyError> {
        if self.eviction_ttl.is_zero() {
            return Err(PolicyError::ZeroTtl);
        }
        if self.strategy.require_chain && !self.strategy.enable_chain_matching {
            return Err(PolicyError::RequireChainWithoutMatching);
        }
        Ok(())
    }

    /// The TTL in nanoseconds, the unit the index compares stamps in.
    pub fn ttl_nanos(&self) -> u64 {
        u64::try_from(self.eviction_ttl.as_nanos()).unwrap_or(u64::MAX)
    }
}

impl Default for ResolvedPolicy {
    fn default() -> Self {
        Self {
            eviction: EvictionAlgorithm::Lru,
            eviction_ttl: Self::DEFAULT_EVICTION_TTL,
            minimum_prefix_tokens: 0,
            minimum_matched_tokens: Self::DEFAULT_MINIMUM_MATCHED_TOKENS,
            routing_floor_score: FloorScore::default(),
            lookup_timeout: Duration::ZERO,
            strategy: StrategyGates::default(),
            affinity_routing: AffinityRouting::Enabled,
            load_awareness: LoadAwareness::Enabled,
            load_balancing: LoadBalancing::default(),
            tier_weights: TierWeights::default(),
            flow_control: FlowControl::default(),
        }
    }
}

#[cfg(test)]
mod tests;
