//! Acceptance tests of the LookupRoute decision: one test per rule of
//! docs/decision.md, named after the rule.
//!
//! Every test goes through [`Router`] as an adapter would. The fixtures below build a
//! router whose snapshot maps tenant `acme` (namespace `team-a`) to the policy the test
//! gives; `walk-in` is a tenant without any CachePolicy (server defaults). Replicas
//! `r1`..`r4` register with an endpoint through their own events; `p1` is prefix-only.
//!
//! Topics: `gates` (steps 1–4, 8), `classify` (steps 5–6), `ranking` (step 7, both
//! floors, TENANT_HOT), `fallback` (step 9, scopes, candidates, replicas), `lfu`
//! (step 10), `lifecycle` (registrations, TTL, self-test, revision), `identity`
//! (LoRA adapter and cache salt under `ic-content-v2`).

use std::time::Duration;

use super::SpillCheck;
use super::affinity;
use super::outcome::{Decision, ReasonCode, Strategy};
use super::request::LookupRequest;
use crate::Router;
use crate::index::{
    IndexConfig, IndexEvent, IngestBatch, ReplicaStats, StatsReport, replica_id_hash,
};
use crate::load::Inflight;
use crate::policy::{
    AffinityRouting, EvictionAlgorithm, FloorScore, ResolvedPolicy, StrategyGates,
};
use crate::scope::ScopeRef;
use crate::snapshot::{BackendDecl, DeclaredReplica, NamespacePolicy, PolicySnapshot};
use crate::time::Timestamp;

mod classify;
mod fallback;
mod fleet;
mod gates;
mod identity;
mod lfu;
mod lifecycle;
mod load;
mod pending;
mod prefill;
mod ranking;
mod share;
mod tiers;

// ----- fixtures -----

/// The tenant with a CachePolicy (namespace `team-a`).
const TENANT: &str = "acme";
/// A tenant without any CachePolicy: the server defaults apply.
const WALK_IN: &str = "walk-in";
const MODEL: &str = "llama";
const VLLM: &str = "vllm-sha256-cbor";
const SGLANG: &str = "sglang-sha256";

fn t0() -> Timestamp {
    Timestamp::from_secs(1_700_000_000)
}

/// `secs` seconds after [`t0`].
fn at(secs: u64) -> Timestamp {
    t0().plus(Duration::from_secs(secs))
}

fn floor(s: &str) -> FloorScore {
    s.parse().expect("valid routingFloorScore")
}

/// Both floors opted out (`minimumMatchedTokens: 0`, `routingFloorScore: "0"`), the
/// rest at its defaults: every matched block counts.
fn open() -> ResolvedPolicy {
    ResolvedPolicy {
        minimum_matched_tokens: 0,
        routing_floor_score: floor("0"),
        ..ResolvedPolicy::default()
    }
}

fn no_affinity(p: ResolvedPolicy) -> ResolvedPolicy {
    ResolvedPolicy {
        affinity_routing: AffinityRouting::Disabled,
        ..p
    }
}

fn lfu(p: ResolvedPolicy) -> ResolvedPolicy {
    ResolvedPolicy {
        eviction: EvictionAlgorithm::Lfu,
        ..p
    }
}

fn gates(
    require_chain: bool,
    enable_chain_matching: bool,
    enable_tenant_hot: bool,
) -> StrategyGates {
    StrategyGates {
        enable_chain_matching,
        require_chain,
        enable_tenant_hot,
    }
}

/// 20 ms of lookup budget.
fn budget(p: ResolvedPolicy) -> ResolvedPolicy {
    ResolvedPolicy {
        lookup_timeout: Duration::from_millis(20),
        ..p
    }
}

fn mk_snapshot(
    policy: ResolvedPolicy,
    quota: Option<u64>,
    backends: Vec<BackendDecl>,
) -> PolicySnapshot {
    PolicySnapshot::new(
        ResolvedPolicy::default(),
        vec![NamespacePolicy {
            namespace: "team-a".into(),
            tenant_id: Some(TENANT.into()),
            policy_name: Some("cache".into()),
            policy: std::sync::Arc::new(policy),
            max_index_entries: quota,
            fair_weight: None,
        }],
        backends,
    )
}

fn mk_router(policy: ResolvedPolicy) -> Router {
    mk_router_with(policy, None, u64::MAX)
}

/// A router whose `acme` tenant has `quota` and whose index has `cap` entries at most.
fn mk_router_with(policy: ResolvedPolicy, quota: Option<u64>, cap: u64) -> Router {
    let config = IndexConfig { max_entries: cap };
    Router::new(config, mk_snapshot(policy, quota, Vec::new()), t0())
}

/// A CacheBackend of `acme` in (llama, vLLM) with static endpoints `(id, address)`.
fn backend(replicas: &[(&str, &str)]) -> BackendDecl {
    BackendDecl {
        namespace: "team-a".into(),
        name: "llama".into(),
        scope: acme().to_owned(),
        engine: "vLLM".into(),
        block_size: 16,
        kv_events_topic: String::new(),
        lora_adapters: Vec::new(),
        replicas: replicas
            .iter()
            .map(|(id, address)| DeclaredReplica {
                id: (*id).into(),
                address: (*address).into(),
                kv_events_endpoint: None,
                kv_replay_endpoint: None,
                data_parallel_size: 1,
            })
            .collect(),
    }
}

fn acme() -> ScopeRef<'static> {
    ScopeRef::new(TENANT, MODEL, VLLM)
}

fn scope_of(tenant: &'static str, scheme: &'static str) -> ScopeRef<'static> {
    ScopeRef::new(tenant, MODEL, scheme)
}

/// The address a replica registers with its events.
fn endpoint_of(replica: &str) -> String {
    format!("{replica}.pods:8000")
}

fn stored(chain: &[u64]) -> IndexEvent {
    IndexEvent::Stored {
        parent: None,
        hashes: chain.to_vec(),
        token_counts: Vec::new(),
    }
}

fn ingest(
    router: &Router,
    scope: ScopeRef<'_>,
    replica: &str,
    endpoint: &str,
    events: &[IndexEvent],
    now: Timestamp,
) {
    let outcome = router
        .ingest(
            &IngestBatch {
                scope,
                replica_id: replica,
                endpoint,
                events,
            },
            now,
        )
        .expect("well-formed batch");
    assert_eq!(outcome.rejected, 0, "fixture events must be valid");
}

/// `replica` reports AllBlocksCleared in acme/llama/vLLM at t0.
fn clear(router: &Router, replica: &str) {
    ingest(
        router,
        acme(),
        replica,
        &endpoint_of(replica),
        &[IndexEvent::Cleared],
        t0(),
    );
}

/// `replica` (serving at its endpoint) stores `chain` in acme/llama/vLLM at t0.
fn store(router: &Router, replica: &str, chain: &[u64]) {
    store_at(router, acme(), replica, chain, t0());
}

fn store_at(router: &Router, scope: ScopeRef<'_>, replica: &str, chain: &[u64], now: Timestamp) {
    ingest(
        router,
        scope,
        replica,
        &endpoint_of(replica),
        &[stored(chain)],
        now,
    );
}

/// `replica` registers as serving in `scope` without storing anything.
fn register(router: &Router, scope: ScopeRef<'_>, replica: &str, now: Timestamp) {
    ingest(router, scope, replica, &endpoint_of(replica), &[], now);
}

/// The load-rule tests' fleet.
const FLEET: [&str; 4] = ["r1", "r2", "r3", "r4"];

/// r1 holds six blocks of the chain, r2 five, r3 and r4 nothing (all serving).
fn fleet(policy: ResolvedPolicy) -> (Router, Req) {
    let router = mk_router(policy);
    store(&router, "r1", &[1, 2, 3, 4, 5, 6]);
    store(&router, "r2", &[1, 2, 3, 4, 5]);
    register(&router, acme(), "r3", t0());
    register(&router, acme(), "r4", t0());
    (router, req(&[1, 2, 3, 4, 5, 6, 7, 8]))
}

/// `r` with a 600-token last block: a full prefill anywhere, never a quick start
/// (`QUICK_START_TOKENS`), so the request count decides alone.
fn long(mut r: Req) -> Req {
    if let Some(last) = r.counts.last_mut() {
        *last = 600;
    }
    r
}

/// Puts `n` requests of `uncached` prompt tokens in flight on `replica`, through
/// real decisions that picked it (as the ext_proc adapter admits them).
fn in_flight(router: &Router, replica: &str, n: usize, uncached: u32) -> Vec<Inflight> {
    let probe = req(&[])
        .candidates(&[replica])
        .prefix("in-flight-probe", uncached);
    (0..n)
        .map(|_| {
            let d = lookup(router, &probe);
            assert_eq!(picked(&d).as_deref(), Some(replica));
            d.admit(u64::from(uncached)).expect("a pick to admit")
        })
        .collect()
}

/// Routes `n` requests to `replica` at `now` as ext_proc does (decide, admit),
/// each ended at once: nothing stays in flight, only the recent count.
fn routed(router: &Router, replica: &str, n: usize, now: Timestamp) {
    let probe = req(&[]).candidates(&[replica]).prefix("share-probe", 16);
    for _ in 0..n {
        let d = lookup_at(router, &probe, now);
        assert_eq!(picked(&d).as_deref(), Some(replica));
        drop(router.admit(&d, &probe.as_lookup(), now).expect("admitted"));
    }
}

/// `replica`'s engine reports `waiting` queued and `running` running requests
/// (ReportStats, as a metrics scrape would).
fn report_queue(router: &Router, replica: &str, waiting: u32, running: u32, now: Timestamp) {
    let stats = ReplicaStats {
        waiting_requests: waiting,
        running_requests: running,
        ..ReplicaStats::default()
    };
    let report = StatsReport {
        scope: acme(),
        replica_id: replica,
        endpoint: &endpoint_of(replica),
        stats,
    };
    router.report_stats(&report, now).expect("stats");
}

/// `replica` sends events without an endpoint: prefix-only.
fn store_prefix_only(router: &Router, scope: ScopeRef<'_>, replica: &str, chain: &[u64]) {
    ingest(router, scope, replica, "", &[stored(chain)], t0());
}

/// `replica` stores a exact-prefix key in acme/llama/vLLM.
fn store_exact_prefix(router: &Router, replica: &str, prefix: &str, token_count: u32) {
    let event = IndexEvent::PrefixStored {
        prefix_hash: prefix.into(),
        token_count,
    };
    ingest(
        router,
        acme(),
        replica,
        &endpoint_of(replica),
        &[event],
        t0(),
    );
}

/// A LookupRoute request, owned so tests can build it step by step.
#[derive(Clone, Debug)]
struct Req {
    tenant: &'static str,
    model: &'static str,
    scheme: &'static str,
    prefix_hash: String,
    prefix_tokens: u32,
    hashes: Vec<u64>,
    counts: Vec<u32>,
    candidates: Vec<String>,
    lora: &'static str,
    salt: &'static str,
}

/// A chain request in acme/llama/vLLM, 16 tokens a block.
fn req(chain: &[u64]) -> Req {
    Req {
        tenant: TENANT,
        model: MODEL,
        scheme: VLLM,
        prefix_hash: String::new(),
        prefix_tokens: 0,
        hashes: chain.to_vec(),
        counts: vec![16; chain.len()],
        candidates: Vec::new(),
        lora: "",
        salt: "",
    }
}

/// A exact-prefix request in acme/llama/vLLM.
fn exact_prefix(prefix: &str, tokens: u32) -> Req {
    req(&[]).prefix(prefix, tokens)
}

impl Req {
    fn tokens(mut self, counts: &[u32]) -> Self {
        self.counts = counts.to_vec();
        self
    }
    fn prefix(mut self, prefix: &str, tokens: u32) -> Self {
        self.prefix_hash = prefix.into();
        self.prefix_tokens = tokens;
        self
    }
    fn tenant(mut self, tenant: &'static str) -> Self {
        self.tenant = tenant;
        self
    }
    fn model(mut self, model: &'static str) -> Self {
        self.model = model;
        self
    }
    fn scheme(mut self, scheme: &'static str) -> Self {
        self.scheme = scheme;
        self
    }
    fn identity(mut self, lora: &'static str, salt: &'static str) -> Self {
        self.lora = lora;
        self.salt = salt;
        self
    }
    fn candidates(mut self, ids: &[&str]) -> Self {
        self.candidates = ids.iter().map(|s| (*s).to_string()).collect();
        self
    }
    fn as_lookup(&self) -> LookupRequest<'_> {
        LookupRequest {
            tenant_id: self.tenant,
            model_id: self.model,
            hash_scheme: self.scheme,
            prefix_hash: &self.prefix_hash,
            prefix_token_count: self.prefix_tokens,
            block_hashes: &self.hashes,
            block_token_counts: &self.counts,
            candidate_replicas: &self.candidates,
            lora_adapter: self.lora,
            cache_salt: self.salt,
            priority: 0,
            held: false,
        }
    }
}

fn lookup(router: &Router, r: &Req) -> Decision {
    lookup_at(router, r, t0())
}

fn lookup_at(router: &Router, r: &Req, now: Timestamp) -> Decision {
    router.lookup(&r.as_lookup(), now)
}

/// Runs the lookup on another thread while this one holds the write lock of `scope`
/// for writing, as a long writer would.
fn lookup_while_held(router: &Router, scope: ScopeRef<'_>, r: &Req) -> Decision {
    let held = router.index().scope(scope).expect("the scope exists");
    let _guards = held.hold_writes();
    std::thread::scope(|s| s.spawn(|| lookup(router, r)).join().expect("lookup thread"))
}

/// The rendezvous owner of `seed` among `ids`, computed from the weights.
fn owner(seed: u64, ids: &[&str]) -> String {
    ids.iter()
        .max_by_key(|id| {
            (
                affinity::weight(seed, replica_id_hash(id)),
                std::cmp::Reverse(**id),
            )
        })
        .map(|id| (*id).to_string())
        .expect("non-empty replica set")
}

/// A block hash whose rendezvous owner among `ids` is `wanted`, not in `avoid`.
fn seed_owned_by(wanted: &str, ids: &[&str], avoid: &[u64]) -> u64 {
    (1_000..)
        .find(|h| !avoid.contains(h) && owner(*h, ids) == wanted)
        .expect("some seed maps to every replica")
}

// ----- assertions -----

/// (replica id, score, matched tokens, matched blocks) of each row, best first.
type Row = (String, f64, u32, u32);

fn rows(d: &Decision) -> Vec<Row> {
    d.scores()
        .map(|s| {
            (
                s.replica_id.to_string(),
                s.score,
                s.matched_tokens,
                s.matched_blocks,
            )
        })
        .collect()
}

fn row(id: &str, score: f64, tokens: u32, blocks: u32) -> Row {
    (id.to_string(), score, tokens, blocks)
}

fn picked(d: &Decision) -> Option<String> {
    d.pick().map(|p| p.replica_id.to_string())
}

/// StrategyNone with `reason` and empty scores.
#[track_caller]
fn assert_none(d: &Decision, reason: ReasonCode) {
    assert_eq!(
        (d.strategy, d.reason.as_str()),
        (Strategy::None, reason.as_str()),
        "rows: {:?}",
        rows(d)
    );
    assert!(rows(d).is_empty(), "no scores expected: {:?}", rows(d));
}

/// PREFIX_MATCH with exactly these rows, in this order.
#[track_caller]
fn assert_prefix(d: &Decision, expected: &[Row]) {
    assert_eq!(
        (d.strategy, d.reason.as_str()),
        (Strategy::PrefixMatch, "PREFIX_MATCH"),
        "rows: {:?}",
        rows(d)
    );
    assert_eq!(rows(d), expected);
}

/// TENANT_HOT on `id`: one row, score 0, no matched tokens.
#[track_caller]
fn assert_tenant_hot(d: &Decision, id: &str) {
    assert_eq!(
        (d.strategy, d.reason.as_str()),
        (Strategy::TenantHot, "TENANT_HOT")
    );
    assert_eq!(rows(d), [row(id, 0.0, 0, 0)]);
}

/// AFFINITY_HINT on `id`: one row, score 0, no matched tokens.
#[track_caller]
fn assert_affinity(d: &Decision, id: &str) {
    assert_eq!(
        (d.strategy, d.reason.as_str()),
        (Strategy::Affinity, "AFFINITY_HINT"),
        "rows: {:?}",
        rows(d)
    );
    assert_eq!(rows(d), [row(id, 0.0, 0, 0)]);
}

#[test]
fn reason_codes_carry_their_contract_names() {
    let names: Vec<&str> = ReasonCode::ALL.iter().map(|r| r.as_str()).collect();
    assert_eq!(
        names,
        [
            "PREFIX_MATCH",
            "TENANT_HOT",
            "AFFINITY_HINT",
            "NO_HINT",
            "UNKNOWN_TENANT",
            "UNKNOWN_MODEL",
            "UNKNOWN_HASH_SCHEME",
            "TIMEOUT",
            "POLICY_REQUIRES_CHAIN",
        ]
    );
}
