//! `inferencecache.v1.CacheService` on tonic: LookupRoute, IngestEvents, ReportStats.
//!
//! `serve` runs it twice: [`CacheApi::lookup_only`] next to ext_proc on
//! `--grpc-addr`, where the ingest RPCs answer UNIMPLEMENTED naming `--ingest-addr`;
//! and [`CacheApi::ingest_only`] on `--ingest-addr`, where every call passes the
//! [`IngestGuard`] (bearer token, per-caller limits) and LookupRoute answers
//! UNIMPLEMENTED naming `--grpc-addr`. [`CacheApi::new`] serves all three RPCs
//! without a guard (in-process use and tests).
//!
//! This is the one place where proto messages and core types meet: requests are
//! borrowed into core requests (the chain is never copied on LookupRoute), and
//! every core error becomes a `tonic::Status` in `ingest_status`. Input the core
//! cannot mean anything by is refused with `InvalidArgument` and a message naming
//! the field; structurally odd but harmless input (unequal chain arrays, empty keys
//! on LookupRoute) is decided by the core, which answers NO_HINT.

use std::sync::Arc;
use std::time::Instant;

use tonic::{Request, Response, Status};

use crate::adapters::MAX_CHAIN_BLOCKS;
use crate::adapters::apply::{ApplyError, apply};
use crate::adapters::ingest::{Cost, IngestGuard};
use crate::adapters::metrics::{DecisionPath, Metrics};
use crate::core::Router;
use crate::core::chain::content_v2::MAX_IDENTITY_LEN;
use crate::core::decision::outcome::{Decision, ReasonCode, Strategy};
use crate::core::decision::request::LookupRequest;
use crate::core::index::{IndexEvent, IngestError, ReplicaStats, StatsReport};
use crate::core::scope::ScopeRef;
use crate::core::time::Timestamp;
use crate::proto::v1 as pb;
use crate::proto::v1::cache_service_server::{CacheService, CacheServiceServer};

/// The most `candidate_replicas` one LookupRoute may name.
pub const MAX_CANDIDATES: usize = 4096;

/// Which RPCs a [`CacheApi`] answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// All three, no guard.
    All,
    /// LookupRoute only (the ext_proc port).
    Lookup,
    /// IngestEvents and ReportStats, behind the guard (the ingest listener).
    Ingest,
}

/// The CacheService implementation.
#[derive(Clone)]
pub struct CacheApi {
    router: Arc<Router>,
    metrics: Arc<Metrics>,
    role: Role,
    guard: Option<Arc<IngestGuard>>,
}

impl CacheApi {
    /// Every RPC, unguarded.
    pub fn new(router: Arc<Router>, metrics: Arc<Metrics>) -> Self {
        Self {
            router,
            metrics,
            role: Role::All,
            guard: None,
        }
    }

    /// LookupRoute; the ingest RPCs are refused with a pointer to `--ingest-addr`.
    pub fn lookup_only(router: Arc<Router>, metrics: Arc<Metrics>) -> Self {
        Self {
            role: Role::Lookup,
            ..Self::new(router, metrics)
        }
    }

    /// IngestEvents and ReportStats behind `guard`; LookupRoute is refused with a
    /// pointer to `--grpc-addr`.
    pub fn ingest_only(
        router: Arc<Router>,
        metrics: Arc<Metrics>,
        guard: Arc<IngestGuard>,
    ) -> Self {
        Self {
            role: Role::Ingest,
            guard: Some(guard),
            ..Self::new(router, metrics)
        }
    }

    pub fn role(&self) -> Role {
        self.role
    }

    /// Refuses an ingest RPC on the lookup port; runs the guard on the ingest
    /// listener. Returns the caller (for logs), if there is a guard.
    fn admit_ingest<T>(
        &self,
        rpc: &'static str,
        req: &Request<T>,
        cost: Cost,
    ) -> Result<Option<String>, Status> {
        if self.role == Role::Lookup {
            self.metrics.record_ingest_outcome(rpc, "wrong_listener");
            return Err(Status::unimplemented(format!(
                "{rpc} is not served on this port (ext_proc and LookupRoute, --grpc-addr): \
                 send it to the ingest listener, `serve --ingest-addr` (default 127.0.0.1:50052)"
            )));
        }
        match &self.guard {
            Some(g) => g.admit(rpc, req, cost).map(Some),
            None => Ok(None),
        }
    }

    fn record_caller(&self, caller: Option<&str>, rpc: &'static str, ok: bool) {
        if let Some(c) = caller {
            self.metrics
                .record_ingest_caller(c, rpc, if ok { "ok" } else { "invalid" });
        }
    }

    /// The tonic service, ready to add to a server.
    pub fn into_server(self) -> CacheServiceServer<Self> {
        CacheServiceServer::new(self)
    }
}

#[tonic::async_trait]
impl CacheService for CacheApi {
    async fn lookup_route(
        &self,
        request: Request<pb::LookupRouteRequest>,
    ) -> Result<Response<pb::LookupRouteResponse>, Status> {
        if self.role == Role::Ingest {
            return Err(Status::unimplemented(
                "LookupRoute is not served on the ingest listener (--ingest-addr): \
                 ask the ext_proc/LookupRoute port, `serve --grpc-addr` (default 127.0.0.1:50051)",
            ));
        }
        let req = request.into_inner();
        check_lookup_limits(&req)?;
        let started = Instant::now();
        let decision = self.router.lookup(&lookup_request(&req), Timestamp::now());
        self.metrics
            .record_decision(DecisionPath::Grpc, decision.reason, started.elapsed());
        Ok(Response::new(lookup_response(&decision)))
    }

    async fn ingest_events(
        &self,
        request: Request<pb::IngestEventsRequest>,
    ) -> Result<Response<pb::IngestEventsResponse>, Status> {
        let cost = Cost::of_ingest(request.get_ref());
        let caller = self.admit_ingest("IngestEvents", &request, cost)?;
        let req = request.into_inner();
        let (events, undecodable) = index_events(req.events);
        let scope = ScopeRef::new(&req.tenant_id, &req.model_id, &req.hash_scheme).to_owned();
        let result = apply(&self.router, scope, req.replica_id, req.endpoint, events).await;
        self.metrics
            .record_ingest_call("IngestEvents", result.is_ok());
        self.record_caller(caller.as_deref(), "IngestEvents", result.is_ok());
        let outcome = result.map_err(|e| match e {
            ApplyError::Ingest(e) => ingest_status(e),
            ApplyError::ShuttingDown => Status::unavailable(e.to_string()),
        })?;
        let rejected = outcome.rejected.saturating_add(undecodable);
        self.metrics.record_ingest_events(outcome.applied, rejected);
        Ok(Response::new(pb::IngestEventsResponse {
            applied: outcome.applied,
            rejected,
        }))
    }

    async fn report_stats(
        &self,
        request: Request<pb::ReportStatsRequest>,
    ) -> Result<Response<pb::ReportStatsResponse>, Status> {
        let caller = self.admit_ingest("ReportStats", &request, Cost::STATS)?;
        let req = request.into_inner();
        let result = replica_stats(req.stats.as_ref()).and_then(|stats| {
            let report = StatsReport {
                scope: ScopeRef::new(&req.tenant_id, &req.model_id, &req.hash_scheme),
                replica_id: &req.replica_id,
                endpoint: &req.endpoint,
                stats,
            };
            self.router
                .report_stats(&report, Timestamp::now())
                .map_err(ingest_status)
        });
        self.metrics
            .record_ingest_call("ReportStats", result.is_ok());
        self.record_caller(caller.as_deref(), "ReportStats", result.is_ok());
        result.map(|()| Response::new(pb::ReportStatsResponse {}))
    }
}

/// Refuses chains and candidate lists too large to mean anything.
fn check_lookup_limits(req: &pb::LookupRouteRequest) -> Result<(), Status> {
    let longest = req.block_hashes.len().max(req.block_token_counts.len());
    if longest > MAX_CHAIN_BLOCKS {
        return Err(Status::invalid_argument(format!(
            "block_hashes/block_token_counts have {longest} items; at most {MAX_CHAIN_BLOCKS} are accepted"
        )));
    }
    if req.candidate_replicas.len() > MAX_CANDIDATES {
        return Err(Status::invalid_argument(format!(
            "candidate_replicas has {} items; at most {MAX_CANDIDATES} are accepted",
            req.candidate_replicas.len()
        )));
    }
    for (field, v) in [
        ("lora_adapter", &req.lora_adapter),
        ("cache_salt", &req.cache_salt),
    ] {
        if v.len() > MAX_IDENTITY_LEN {
            return Err(Status::invalid_argument(format!(
                "{field} has {} bytes; at most {MAX_IDENTITY_LEN} are accepted",
                v.len()
            )));
        }
    }
    Ok(())
}

/// Borrows a proto request as a core request.
pub fn lookup_request(req: &pb::LookupRouteRequest) -> LookupRequest<'_> {
    LookupRequest {
        tenant_id: &req.tenant_id,
        model_id: &req.model_id,
        hash_scheme: &req.hash_scheme,
        prefix_hash: &req.prefix_hash,
        prefix_token_count: req.prefix_token_count,
        block_hashes: &req.block_hashes,
        block_token_counts: &req.block_token_counts,
        candidate_replicas: &req.candidate_replicas,
        lora_adapter: &req.lora_adapter,
        cache_salt: &req.cache_salt,
        // A LookupRoute is a query: nothing is admitted, no priority applies.
        priority: 0,
        held: false,
    }
}

pub fn lookup_response(decision: &Decision) -> pb::LookupRouteResponse {
    pb::LookupRouteResponse {
        scores: decision
            .scores()
            .map(|s| pb::ReplicaScore {
                replica_id: s.replica_id.to_string(),
                endpoint: s.endpoint.to_string(),
                score: s.score,
                matched_tokens: s.matched_tokens,
                matched_blocks: s.matched_blocks,
            })
            .collect(),
        strategy: strategy(decision.strategy) as i32,
        reason_code: reason_code(decision.reason) as i32,
        policy_revision: decision.policy_revision.to_string(),
        spilled_from: decision.spilled_from().unwrap_or_default().to_string(),
        spilled_by: decision.spilled_by().map_or("", |c| c.as_str()).to_string(),
    }
}

pub fn strategy(s: Strategy) -> pb::Strategy {
    match s {
        Strategy::None => pb::Strategy::None,
        Strategy::PrefixMatch => pb::Strategy::PrefixMatch,
        Strategy::TenantHot => pb::Strategy::TenantHot,
        Strategy::Affinity => pb::Strategy::Affinity,
    }
}

pub fn reason_code(r: ReasonCode) -> pb::ReasonCode {
    match r {
        ReasonCode::PrefixMatch => pb::ReasonCode::PrefixMatch,
        ReasonCode::TenantHot => pb::ReasonCode::TenantHot,
        ReasonCode::AffinityHint => pb::ReasonCode::AffinityHint,
        ReasonCode::NoHint => pb::ReasonCode::NoHint,
        ReasonCode::UnknownTenant => pb::ReasonCode::UnknownTenant,
        ReasonCode::UnknownModel => pb::ReasonCode::UnknownModel,
        ReasonCode::UnknownHashScheme => pb::ReasonCode::UnknownHashScheme,
        ReasonCode::Timeout => pb::ReasonCode::Timeout,
        ReasonCode::PolicyRequiresChain => pb::ReasonCode::PolicyRequiresChain,
    }
}

/// Converts KV events in order. Returns the events the core can judge and how many
/// were refused here: an empty `oneof`, or a run longer than [`MAX_CHAIN_BLOCKS`].
pub fn index_events(events: Vec<pb::KvEvent>) -> (Vec<IndexEvent>, u32) {
    use pb::kv_event::Event;
    let mut out = Vec::with_capacity(events.len());
    let mut refused = 0u32;
    for e in events {
        let converted = match e.event {
            Some(Event::Stored(s)) if s.block_hashes.len() <= MAX_CHAIN_BLOCKS => {
                Some(IndexEvent::Stored {
                    parent: s.parent_block_hash,
                    hashes: s.block_hashes,
                    token_counts: s.block_token_counts,
                })
            }
            Some(Event::Removed(r)) if r.block_hashes.len() <= MAX_CHAIN_BLOCKS => {
                Some(IndexEvent::Removed {
                    hashes: r.block_hashes,
                })
            }
            Some(Event::Cleared(_)) => Some(IndexEvent::Cleared),
            Some(Event::PrefixStored(p)) => Some(IndexEvent::PrefixStored {
                prefix_hash: p.prefix_hash,
                token_count: p.token_count,
            }),
            Some(Event::Stored(_) | Event::Removed(_)) | None => None,
        };
        match converted {
            Some(ev) => out.push(ev),
            None => refused = refused.saturating_add(1),
        }
    }
    (out, refused)
}

/// Checks the ratios a replica reports; the message names the field.
pub fn replica_stats(stats: Option<&pb::ReplicaStats>) -> Result<ReplicaStats, Status> {
    let s = stats.ok_or_else(|| Status::invalid_argument("stats is required"))?;
    for (field, v) in [
        ("hit_rate", s.hit_rate),
        ("kv_cache_usage", s.kv_cache_usage),
    ] {
        if !(0.0..=1.0).contains(&v) {
            return Err(Status::invalid_argument(format!(
                "stats.{field} must be between 0 and 1, got {v}"
            )));
        }
    }
    Ok(ReplicaStats {
        cache_memory_bytes: s.cache_memory_bytes,
        hit_rate: s.hit_rate,
        waiting_requests: s.waiting_requests,
        running_requests: s.running_requests,
        kv_cache_usage: s.kv_cache_usage,
        first_tokens_total: None,
    })
}

/// Core ingest errors as wire answers.
fn ingest_status(e: IngestError) -> Status {
    Status::invalid_argument(e.to_string())
}

#[cfg(test)]
mod tests;
