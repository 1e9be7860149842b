//! What the sidecar does with one request, before it is said in Envoy's terms.
//!
//! [`Verdict::decide`] turns parsed routing headers into: the destination to write
//! (if any), the decision headers for the upstream, what to echo to a debugging
//! client, or a refusal (ORIGINAL_DST with nowhere to go). It calls the router but
//! knows nothing of Envoy messages, so it is tested without a stream.

use std::fmt;
use std::str::FromStr;
use std::time::{Duration, Instant};

use super::body::BodyMiss;
use super::headers::{
    self, DETAIL, MATCHED_TOKENS, POLICY_REVISION, QUEUED_MS, REASON, REPLICA, RoutingHeaders,
    SCORE, SHED, SPILLED_BY, SPILLED_FROM,
};
use crate::adapters::metrics::{DecisionPath, Metrics};
use crate::core::Router;
use crate::core::decision::outcome::ReasonCode;
use crate::core::decision::request::LookupRequest;
use crate::core::flow::saturation::Thresholds;
use crate::core::load::Inflight;
use crate::core::scope::ScopeRef;
use crate::core::time::Timestamp;

/// What Envoy does with a request that gets no hint (docs/reference.md, "Envoy ext_proc").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DestinationMode {
    /// No hint → no destination header → the override_host cluster round-robins.
    #[default]
    OverrideHost,
    /// Always exactly one `ip:port`; 503 when the scope has no serving replica.
    OriginalDst,
}

impl DestinationMode {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::OverrideHost => "override-host",
            Self::OriginalDst => "original-dst",
        }
    }
}

impl FromStr for DestinationMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "override-host" => Ok(Self::OverrideHost),
            "original-dst" => Ok(Self::OriginalDst),
            _ => Err(format!(
                "destination mode {s:?} is not override-host or original-dst"
            )),
        }
    }
}

impl fmt::Display for DestinationMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How the ext_proc adapter behaves (server flags).
#[derive(Clone, Debug)]
pub struct ExtProcConfig {
    /// When flow control counts a replica as saturated (the policy's
    /// `spec.flowControl` says whether it holds at all).
    pub saturation: Thresholds,
    pub destination_mode: DestinationMode,
    /// Whether `x-inferencecache-debug: 1` may echo the decision to the client.
    pub debug_headers_allowed: bool,
    /// The routing header's name (lowercase).
    pub destination_header: String,
    /// When a routed request stops counting against its replica (the load
    /// rule's in-flight signal).
    pub inflight_release: InflightRelease,
}

/// When the load rule's in-flight count of a routed request ends (`serve
/// --inflight-release`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum InflightRelease {
    /// When the replica's engine stores the request's last block (the end of
    /// its prefill; a request whose blocks are all cached at once), if that
    /// engine's events and queue report are both live: Envoy skips the response
    /// headers, and the request, decoding on, is in the engine's next report.
    /// Otherwise (no live engine signals, no chain) as `response-headers`.
    #[default]
    PrefillEnd,
    /// Always at the response headers (or the stream's end): Envoy sends them
    /// to the sidecar, one more round trip on every response.
    ResponseHeaders,
}

impl Default for ExtProcConfig {
    fn default() -> Self {
        Self {
            saturation: Thresholds::default(),
            destination_mode: DestinationMode::OverrideHost,
            debug_headers_allowed: true,
            destination_header: headers::DEFAULT_DESTINATION_HEADER.to_string(),
            inflight_release: InflightRelease::default(),
        }
    }
}

/// The outcome for one request.
#[derive(Clone, Debug, PartialEq)]
pub struct Verdict {
    /// `host:port` for the routing header and the `envoy.lb` metadata.
    pub destination: Option<String>,
    /// Decision headers set toward the upstream, lowercase names.
    pub upstream: Vec<(&'static str, String)>,
    /// Headers to echo on the response (empty unless debugging is asked and allowed).
    pub debug_echo: Vec<(&'static str, String)>,
    /// ORIGINAL_DST with no serving replica: answer 503 with this body instead.
    pub refusal: Option<String>,
}

impl Verdict {
    /// Decides one request. Never fails: malformed headers give NO_HINT.
    pub fn decide(
        router: &Router,
        metrics: &Metrics,
        config: &ExtProcConfig,
        parsed: &RoutingHeaders,
        now: Timestamp,
    ) -> Self {
        Self::decide_and_admit(router, metrics, config, parsed, now).0
    }

    /// [`Verdict::decide`] for a request that really goes where the verdict says:
    /// also counts it against the picked replica (the load rule's in-flight
    /// signal; see `crate::core::load`): until the returned guard drops, or, with
    /// [`InflightRelease::PrefillEnd`] and [`Inflight::ends_with_prefill`], until
    /// its engine's event stores the request's last block.
    pub fn decide_and_admit(
        router: &Router,
        metrics: &Metrics,
        config: &ExtProcConfig,
        parsed: &RoutingHeaders,
        now: Timestamp,
    ) -> (Self, Option<Inflight>) {
        let input = Input {
            parsed,
            subset: None,
            body_miss: None,
            held: false,
        };
        Self::decide_input(router, metrics, config, &input, now)
    }

    /// [`Verdict::decide_and_admit`] with what the stream learnt beyond the
    /// headers: the gateway's endpoint subset and why the body gave no chain.
    pub fn decide_input(
        router: &Router,
        metrics: &Metrics,
        config: &ExtProcConfig,
        input: &Input<'_>,
        now: Timestamp,
    ) -> (Self, Option<Inflight>) {
        let parsed = input.parsed;
        let f = &parsed.fields;
        let scope = ScopeRef::new(&f.tenant, &f.model, &f.hash_scheme);
        // A body request whose body gave no scope the index knows (invalid JSON,
        // over the limit, an unknown model) has no scope to fall back on: under a
        // must-pick mode it falls back on the fleet (`Router::fallback_in_fleet`).
        let in_fleet = input.body_miss.is_some() && router.index().scope(scope).is_none();
        // The subset as replica ids; a subset naming no replica of the scope
        // leaves nothing eligible (an empty candidate list would mean "all").
        let candidates = input.subset.filter(|_| !in_fleet).map(|addrs| {
            let addrs: Vec<&str> = addrs.iter().map(String::as_str).collect();
            router.replicas_at(scope, &addrs)
        });
        if let Some(c) = &candidates
            && c.is_empty()
        {
            return (
                Self::outside_the_scope(router, metrics, config, input, now),
                None,
            );
        }
        let candidates: &[String] = candidates.as_deref().unwrap_or(&[]);
        // The detail and the policy revision are only ever echoed to a
        // debugging client: neither is built for anyone else.
        let debugging = parsed.debug && config.debug_headers_allowed;
        let mut upstream = Vec::with_capacity(5);
        let mut detail = None;
        let mut revision = None;
        let mut destination = None;
        let mut inflight = None;
        let reason = match &parsed.malformed {
            Some(m) => {
                // Counted like any decision, so malformed traffic shows in metrics.
                detail = debugging.then(|| m.to_string());
                metrics.record_decision(DecisionPath::ExtProc, ReasonCode::NoHint, Duration::ZERO);
                ReasonCode::NoHint
            }
            None => {
                let req = LookupRequest {
                    tenant_id: &f.tenant,
                    model_id: &f.model,
                    hash_scheme: &f.hash_scheme,
                    prefix_hash: &f.prefix_hash,
                    prefix_token_count: f.prefix_tokens,
                    block_hashes: &f.block_hashes,
                    block_token_counts: &f.block_token_counts,
                    candidate_replicas: candidates,
                    lora_adapter: &f.lora_adapter,
                    cache_salt: &f.cache_salt,
                    priority: parsed.priority,
                    held: input.held,
                };
                let started = Instant::now();
                let decision = router.lookup(&req, now);
                metrics.record_decision(DecisionPath::ExtProc, decision.reason, started.elapsed());
                if let Some(pick) = decision.pick().filter(|p| !p.endpoint.is_empty()) {
                    destination = Some(pick.endpoint.to_string());
                    upstream.push((REPLICA, pick.replica_id.to_string()));
                    upstream.push((SCORE, format!("{:.4}", pick.score)));
                    upstream.push((MATCHED_TOKENS, pick.matched_tokens.to_string()));
                    if let Some(from) = decision.spilled_from() {
                        upstream.push((SPILLED_FROM, from.to_string()));
                        metrics.record_spill(decision.reason);
                    }
                    if let Some(by) = decision.spilled_by() {
                        upstream.push((SPILLED_BY, by.as_str().to_string()));
                        metrics.record_spill_check(by);
                    }
                    inflight = match config.inflight_release {
                        InflightRelease::ResponseHeaders => router.admit(&decision, &req, now),
                        InflightRelease::PrefillEnd => {
                            router.admit_until_prefill_end(&decision, &req, now)
                        }
                    };
                }
                if debugging {
                    revision = Some(decision.policy_revision.to_string());
                    if decision.reason == ReasonCode::NoHint {
                        detail = parsed.chain_mismatch().map(|m| m.to_string());
                    }
                }
                decision.reason
            }
        };
        upstream.insert(0, (REASON, reason.as_str().to_string()));

        if let Some(miss) = input.body_miss.filter(|_| debugging) {
            detail = Some(format!("{}: {miss}", miss.reason()));
        }

        // A gateway's subset must be obeyed whatever the destination mode: with no
        // hint, a serving replica of the subset, or 503 (GIE's protocol).
        let mut refusal = None;
        let must_pick =
            config.destination_mode == DestinationMode::OriginalDst || input.subset.is_some();
        if destination.is_none() && must_pick {
            let fallback = if in_fleet {
                let subset: Option<Vec<&str>> = input
                    .subset
                    .map(|addrs| addrs.iter().map(String::as_str).collect());
                router.fallback_in_fleet(&f.model, subset.as_deref(), now)
            } else {
                router.fallback_endpoint(scope, candidates, now)
            };
            match fallback {
                Some(ep) => destination = Some(ep.to_string()),
                None if input.subset.is_some() => {
                    let subset = input.subset.unwrap_or(&[]);
                    match subset_member(router, &f.model, subset, now) {
                        Some(ep) => destination = Some(ep),
                        None => {
                            return (Self::no_eligible_endpoint(metrics, config, input), None);
                        }
                    }
                }
                None => {
                    refusal = Some(format!(
                        "inferencecache: no serving replica for tenant {:?}, model {:?}, hash scheme {:?} (reason {})\n",
                        f.tenant,
                        f.model,
                        f.hash_scheme,
                        reason.as_str()
                    ));
                }
            }
        }

        let mut debug_echo = Vec::new();
        if debugging {
            debug_echo = upstream.clone();
            if let Some(d) = detail {
                debug_echo.push((DETAIL, d));
            }
            if let Some(r) = revision {
                debug_echo.push((POLICY_REVISION, r));
            }
        }
        let verdict = Self {
            destination,
            upstream,
            debug_echo,
            refusal,
        };
        (verdict, inflight)
    }

    /// The gateway's subset names no replica of the request's scope (a bodiless
    /// `GET /health` has no model and no chain; a new pool has no KV events yet):
    /// a subset member the fleet or the policy knows still serves it, with no
    /// hint; only a subset with no such member gets the 503.
    fn outside_the_scope(
        router: &Router,
        metrics: &Metrics,
        config: &ExtProcConfig,
        input: &Input<'_>,
        now: Timestamp,
    ) -> Self {
        let subset = input.subset.unwrap_or(&[]);
        let Some(destination) = subset_member(router, &input.parsed.fields.model, subset, now)
        else {
            return Self::no_eligible_endpoint(metrics, config, input);
        };
        metrics.record_decision(DecisionPath::ExtProc, ReasonCode::NoHint, Duration::ZERO);
        let upstream = vec![(REASON, ReasonCode::NoHint.as_str().to_string())];
        let debug_echo = if input.parsed.debug && config.debug_headers_allowed {
            upstream.clone()
        } else {
            Vec::new()
        };
        Self {
            destination: Some(destination),
            upstream,
            debug_echo,
            refusal: None,
        }
    }

    /// The gateway's subset holds no serving replica of the request's scope: the
    /// protocol's 503, with the subset named in the body.
    fn no_eligible_endpoint(metrics: &Metrics, config: &ExtProcConfig, input: &Input<'_>) -> Self {
        metrics.record_decision(DecisionPath::ExtProc, ReasonCode::NoHint, Duration::ZERO);
        let f = &input.parsed.fields;
        let subset = input.subset.unwrap_or(&[]);
        let mut debug_echo = Vec::new();
        if input.parsed.debug && config.debug_headers_allowed {
            debug_echo.push((REASON, ReasonCode::NoHint.as_str().to_string()));
            debug_echo.push((DETAIL, NO_ELIGIBLE_ENDPOINT.to_string()));
        }
        Self {
            destination: None,
            upstream: Vec::new(),
            debug_echo,
            refusal: Some(format!(
                "inferencecache: {NO_ELIGIBLE_ENDPOINT}: none of the gateway's subset {subset:?} is a serving replica for tenant {:?}, model {:?}, hash scheme {:?}\n",
                f.tenant, f.model, f.hash_scheme
            )),
        }
    }
}

/// The last resort among a gateway's subset: an endpoint serving any scope (the
/// request model's scopes first, least loaded), else the first endpoint the policy
/// declares as a replica (an InferencePool member that reported nothing yet).
/// `None` when no subset endpoint is a replica at all.
fn subset_member(
    router: &Router,
    model: &str,
    subset: &[String],
    now: Timestamp,
) -> Option<String> {
    let addrs: Vec<&str> = subset.iter().map(String::as_str).collect();
    if let Some(ep) = router.fallback_in_fleet(model, Some(&addrs), now) {
        return Some(ep.to_string());
    }
    let snapshot = router.snapshot();
    let declared = |a: &str| {
        snapshot
            .backends()
            .iter()
            .any(|b| b.replicas.iter().any(|r| r.address == a))
    };
    addrs.into_iter().find(|a| declared(a)).map(str::to_string)
}

/// The debug detail of a 503 for an empty eligible subset.
pub const NO_ELIGIBLE_ENDPOINT: &str = "no_eligible_endpoint_in_subset";

/// One request as the stream knows it when it decides.
#[derive(Clone, Copy, Debug)]
pub struct Input<'a> {
    pub parsed: &'a RoutingHeaders,
    /// `envoy.lb.subset_hint` / `x-gateway-destination-endpoint-subset`: the only
    /// `ip:port` endpoints the pick may be.
    pub subset: Option<&'a [String]>,
    /// Why the body gave no chain (the request is still served).
    pub body_miss: Option<&'a BodyMiss>,
    /// Flow control held the request before this decision (`ExtProc::decide`
    /// sets it from the stream; the constructors leave it false).
    pub held: bool,
}

/// Every decision header a client might forge; removed unless the verdict sets it.
pub const DECISION_HEADERS: [&str; 10] = [
    REASON,
    REPLICA,
    SCORE,
    MATCHED_TOKENS,
    SPILLED_FROM,
    SPILLED_BY,
    DETAIL,
    POLICY_REVISION,
    SHED,
    QUEUED_MS,
];
