//! The Prometheus registry: what the sidecar counts, in one place.
//!
//! Request-path metrics (decisions, latency, ingest calls) are updated as things
//! happen. The index's own state (entries per tenant, evictions and refusals by
//! cause, stored/removed blocks) and the policy source's reload counts are read at
//! scrape time by `IndexCollector`, so the hot path never touches a metric for them.
//!
//! Every label is bounded: reason codes and causes are fixed `&'static str`s, and
//! the tenant label only takes tenant ids that the policy snapshot declares (all
//! other tenants are summed under `tenant="_undeclared"`).

pub mod flow;
mod latency;

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::adapters::engine_metrics::metrics::EngineMetricsMetrics;
use crate::adapters::fleet::metrics::FleetMetrics;
use crate::adapters::ingest::MAX_CALLER_LABELS;
use crate::adapters::kv_events::metrics::KvEventMetrics;
use crate::adapters::policy_file::SourceStatus;
use crate::core::Router;
use crate::core::decision::SpillCheck;
use crate::core::decision::outcome::ReasonCode;
use crate::core::time::Timestamp;
use latency::LatencyHistogram;

/// Where a decision was asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DecisionPath {
    ExtProc,
    Grpc,
}

impl DecisionPath {
    /// In discriminant order (the index of the pre-resolved handles).
    const ALL: [DecisionPath; 2] = [Self::ExtProc, Self::Grpc];

    fn as_str(self) -> &'static str {
        match self {
            Self::ExtProc => "ext_proc",
            Self::Grpc => "grpc",
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DecisionLabels {
    reason: &'static str,
    path: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CheckLabels {
    check: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PathLabels {
    path: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RpcLabels {
    rpc: &'static str,
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EventLabels {
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CauseLabels {
    cause: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CallerCallLabels {
    caller: String,
    rpc: &'static str,
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CallerLabels {
    caller: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LimitLabels {
    caller: String,
    limit: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TenantLabels {
    tenant: String,
}

/// All metrics of the process, and the registry that encodes them.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// Every decision series resolved once, so a decision takes no family lock:
    /// `[path][reason]`.
    decision_counters: [[Counter; ReasonCode::ALL.len()]; 2],
    latency_by_path: [LatencyHistogram; 2],
    load_spills: Family<ReasonLabels, Counter>,
    /// `load_spills`' series by reason, resolved on first use (a series appears
    /// only once a spill happens), so a spill takes no family lock after that.
    spill_counters: [OnceLock<Counter>; ReasonCode::ALL.len()],
    /// Spills by the load rule's check that moved them, every series resolved
    /// up front (three, so a dashboard sees zeros rather than nothing).
    spill_checks: [Counter; SpillCheck::ALL.len()],
    body_requests: Family<OutcomeLabels, Counter>,
    ingest_calls: Family<RpcLabels, Counter>,
    ingest_events: Family<EventLabels, Counter>,
    caller_calls: Family<CallerCallLabels, Counter>,
    caller_events: Family<CallerLabels, Counter>,
    caller_entries: Family<CallerLabels, Counter>,
    limited: Family<LimitLabels, Counter>,
    /// Caller labels handed out so far (bounded by [`MAX_CALLER_LABELS`]).
    callers_seen: parking_lot::Mutex<std::collections::HashSet<String>>,
    ext_proc_streams: Gauge,
    kv_events: Arc<KvEventMetrics>,
    engine_metrics: Arc<EngineMetricsMetrics>,
    flow: Arc<flow::FlowMetrics>,
    fleet: Arc<FleetMetrics>,
}

impl Metrics {
    /// Builds the registry; `router` and `policy` are read at scrape time.
    pub fn new(router: Arc<Router>, policy: Arc<SourceStatus>) -> Self {
        let mut registry = Registry::with_prefix("inferencecache");
        let decisions = Family::<DecisionLabels, Counter>::default();
        registry.register(
            "decisions",
            "LookupRoute decisions by reason code and by path (ext_proc or grpc)",
            decisions.clone(),
        );
        let decision_latency = Family::<PathLabels, LatencyHistogram>::new_with_constructor(
            latency_histogram as fn() -> _,
        );
        registry.register(
            "decision_latency_seconds",
            "Time to decide one request, from parsed input to answer",
            decision_latency.clone(),
        );
        let load_spills = Family::<ReasonLabels, Counter>::default();
        registry.register(
            "load_spills",
            "Routed requests the load rule moved off the cache's first choice, by reason code",
            load_spills.clone(),
        );
        let spill_check_family = Family::<CheckLabels, Counter>::default();
        registry.register(
            "load_spill_checks",
            "Routed requests the load rule moved, by the check that moved them: requests \
             (in flight), share (routed lately) or prefill (queued prefill tokens)",
            spill_check_family.clone(),
        );
        let spill_checks = SpillCheck::ALL.map(|check| {
            spill_check_family
                .get_or_create(&CheckLabels {
                    check: check.as_str(),
                })
                .clone()
        });
        let body_requests = Family::<OutcomeLabels, Counter>::default();
        registry.register(
            "body_requests",
            "Requests decided on their body (body mode), by outcome: routed, or the \
             reason the body gave no chain (body_too_large, invalid_json, ...)",
            body_requests.clone(),
        );
        let ingest_calls = Family::<RpcLabels, Counter>::default();
        registry.register(
            "ingest_calls",
            "IngestEvents and ReportStats calls by outcome (ok, invalid, wrong_listener)",
            ingest_calls.clone(),
        );
        let ingest_events = Family::<EventLabels, Counter>::default();
        registry.register(
            "ingest_events",
            "KV events received over gRPC, applied or rejected as malformed",
            ingest_events.clone(),
        );
        let caller_calls = Family::<CallerCallLabels, Counter>::default();
        registry.register(
            "ingest_caller_calls",
            "Calls on the ingest listener by caller, rpc and outcome \
             (ok, invalid, unauthenticated, limited)",
            caller_calls.clone(),
        );
        let caller_events = Family::<CallerLabels, Counter>::default();
        registry.register(
            "ingest_caller_events",
            "KV events (and ReportStats calls) admitted on the ingest listener, by caller",
            caller_events.clone(),
        );
        let caller_entries = Family::<CallerLabels, Counter>::default();
        registry.register(
            "ingest_caller_entries",
            "Index entries named by admitted ingest calls, by caller",
            caller_entries.clone(),
        );
        let limited = Family::<LimitLabels, Counter>::default();
        registry.register(
            "ingest_limited",
            "Ingest calls refused with RESOURCE_EXHAUSTED, by caller and limit (events, entries)",
            limited.clone(),
        );
        let ext_proc_streams = Gauge::default();
        registry.register(
            "ext_proc_streams",
            "ext_proc streams open now (what a drain waits for)",
            ext_proc_streams.clone(),
        );
        let kv_events = Arc::new(KvEventMetrics::default());
        kv_events.register(&mut registry);
        let engine_metrics = Arc::new(EngineMetricsMetrics::default());
        engine_metrics.register(&mut registry);
        let flow = Arc::new(flow::FlowMetrics::default());
        flow.register(&mut registry);
        let fleet = Arc::new(FleetMetrics::default());
        fleet.register(&mut registry);
        registry.register_collector(Box::new(IndexCollector { router, policy }));
        // Every series exists from the start (rates start from a known zero), and
        // its handle is kept (a clone shares the value).
        let decision_counters = DecisionPath::ALL.map(|path| {
            ReasonCode::ALL.map(|reason| {
                decisions
                    .get_or_create(&DecisionLabels {
                        reason: reason.as_str(),
                        path: path.as_str(),
                    })
                    .clone()
            })
        });
        let latency_by_path = DecisionPath::ALL.map(|path| {
            decision_latency
                .get_or_create(&PathLabels {
                    path: path.as_str(),
                })
                .clone()
        });
        Self {
            registry,
            decision_counters,
            latency_by_path,
            load_spills,
            spill_counters: Default::default(),
            spill_checks,
            body_requests,
            ingest_calls,
            ingest_events,
            caller_calls,
            caller_events,
            caller_entries,
            limited,
            callers_seen: parking_lot::Mutex::new(std::collections::HashSet::new()),
            ext_proc_streams,
            kv_events,
            engine_metrics,
            flow,
            fleet,
        }
    }

    /// Adds series read at scrape time from another part of the sidecar (e.g.
    /// body mode's tokenizer caches), under the same `inferencecache_` prefix.
    pub fn register_collector(&mut self, collector: Box<dyn Collector>) {
        self.registry.register_collector(collector);
    }

    /// The label for `caller`: itself for the first [`MAX_CALLER_LABELS`] callers,
    /// `_other` after that.
    fn caller_label(&self, caller: &str) -> String {
        let mut seen = self.callers_seen.lock();
        if seen.contains(caller) {
            return caller.to_string();
        }
        if seen.len() < MAX_CALLER_LABELS {
            seen.insert(caller.to_string());
            return caller.to_string();
        }
        String::from("_other")
    }

    /// One call on the ingest listener (`outcome`: ok, invalid, unauthenticated,
    /// limited).
    pub fn record_ingest_caller(&self, caller: &str, rpc: &'static str, outcome: &'static str) {
        self.caller_calls
            .get_or_create(&CallerCallLabels {
                caller: self.caller_label(caller),
                rpc,
                outcome,
            })
            .inc();
    }

    pub fn record_ingest_admitted(&self, caller: &str, events: u64, entries: u64) {
        let labels = CallerLabels {
            caller: self.caller_label(caller),
        };
        self.caller_events.get_or_create(&labels).inc_by(events);
        self.caller_entries.get_or_create(&labels).inc_by(entries);
    }

    pub fn record_ingest_limited(&self, caller: &str, limit: &'static str) {
        self.limited
            .get_or_create(&LimitLabels {
                caller: self.caller_label(caller),
                limit,
            })
            .inc();
    }

    /// An ext_proc stream opened (+1) or ended (-1).
    pub fn ext_proc_stream(&self, delta: i64) {
        self.ext_proc_streams.inc_by(delta);
    }

    /// The KV event subscribers' metrics.
    pub fn kv_events(&self) -> &Arc<KvEventMetrics> {
        &self.kv_events
    }

    /// Flow control's metrics.
    pub fn flow(&self) -> &Arc<flow::FlowMetrics> {
        &self.flow
    }

    /// Fleet sync's metrics and the fleet view's condition.
    pub fn fleet(&self) -> &Arc<FleetMetrics> {
        &self.fleet
    }

    /// The engine metrics scrapers' metrics.
    pub fn engine_metrics(&self) -> &Arc<EngineMetricsMetrics> {
        &self.engine_metrics
    }

    pub fn record_decision(&self, path: DecisionPath, reason: ReasonCode, elapsed: Duration) {
        let p = path as usize;
        if let Some(c) = self.decision_counters[p].get(reason as usize) {
            c.inc();
        }
        self.latency_by_path[p].observe(elapsed);
    }

    /// A request held for its body was decided: `miss` is why the body gave no
    /// chain (`BodyMiss::reason`), `None` when it did.
    pub fn record_body(&self, miss: Option<&'static str>) {
        self.body_requests
            .get_or_create(&OutcomeLabels {
                outcome: miss.unwrap_or("routed"),
            })
            .inc();
    }

    /// A routed request the load rule moved (`x-inferencecache-spilled-from`).
    pub fn record_spill(&self, reason: ReasonCode) {
        let Some(slot) = self.spill_counters.get(reason as usize) else {
            return;
        };
        slot.get_or_init(|| {
            self.load_spills
                .get_or_create(&ReasonLabels {
                    reason: reason.as_str(),
                })
                .clone()
        })
        .inc();
    }

    /// The load rule's check that moved a routed request.
    pub fn record_spill_check(&self, check: SpillCheck) {
        self.spill_checks[check as usize].inc();
    }

    /// One IngestEvents or ReportStats call (`rpc` is the RPC name).
    pub fn record_ingest_call(&self, rpc: &'static str, ok: bool) {
        self.record_ingest_outcome(rpc, if ok { "ok" } else { "invalid" });
    }

    /// An ingest RPC by outcome (`ok`, `invalid`, or `wrong_listener`: sent to the
    /// ext_proc/LookupRoute port instead of --ingest-addr).
    pub fn record_ingest_outcome(&self, rpc: &'static str, outcome: &'static str) {
        self.ingest_calls
            .get_or_create(&RpcLabels { rpc, outcome })
            .inc();
    }

    pub fn record_ingest_events(&self, applied: u32, rejected: u32) {
        for (result, n) in [("applied", applied), ("rejected", rejected)] {
            if n > 0 {
                self.ingest_events
                    .get_or_create(&EventLabels { result })
                    .inc_by(u64::from(n));
            }
        }
    }

    /// The Prometheus text exposition (format 0.0.4).
    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        let mut out = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut out, &self.registry)?;
        Ok(out)
    }
}

fn latency_histogram() -> LatencyHistogram {
    // 1 µs .. ~0.5 s, doubling.
    LatencyHistogram::exponential(Duration::from_micros(1), 2.0, 20)
}

/// A counter family read at scrape time: name, help, and a value per cause.
type CounterFamily<'a> = (&'a str, &'a str, &'a [(&'static str, u64)]);

/// Reads the index and the policy source at scrape time.
struct IndexCollector {
    router: Arc<Router>,
    policy: Arc<SourceStatus>,
}

impl std::fmt::Debug for IndexCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("IndexCollector")
    }
}

impl Collector for IndexCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let c = self.router.index().counters();
        let counters: [CounterFamily<'_>; 5] = [
            (
                "index_evictions",
                "Index entries evicted, by cause (ttl, cap, quota, cleared)",
                &[
                    ("ttl", c.evicted_ttl),
                    ("cap", c.evicted_cap),
                    ("quota", c.evicted_quota),
                    ("cleared", c.dropped_cleared),
                ],
            ),
            (
                "index_refusals",
                "New index entries refused, by cause",
                &[("quota", c.refused_quota)],
            ),
            (
                "index_blocks",
                "Blocks in applied events, by cause (stored, removed)",
                &[("stored", c.stored_blocks), ("removed", c.removed_blocks)],
            ),
            (
                "index_rejected_events",
                "Malformed events the index counted and ignored",
                &[("malformed", c.rejected_events)],
            ),
            (
                "inflight_prefill_ends",
                "Routed requests whose in-flight count waited for their engine to store their last block (serve --inflight-release prefill-end), by how it ended: event, or aged_out (no such event within 60 s; a steady rate means the engine's events do not match the routed chains)",
                &[
                    ("event", c.inflight_ended_by_event),
                    ("aged_out", c.inflight_aged_out),
                ],
            ),
        ];
        for (name, help, value) in [
            (
                "policy_reloads",
                "Policy loads that installed a snapshot (the first load included)",
                self.policy.reload_ok_count(),
            ),
            (
                "policy_errors",
                "Policy loads that failed and kept the last good snapshot",
                self.policy.reload_error_count(),
            ),
        ] {
            let family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            ConstCounter::new(value).encode(family)?;
        }
        for (name, help, series) in counters {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for (cause, value) in series {
                let labels = CauseLabels { cause };
                ConstCounter::new(*value).encode(family.encode_family(&labels)?)?;
            }
        }

        let snapshot = self.router.snapshot();
        let view = self.router.view(Timestamp::now());
        let mut per_tenant: BTreeMap<String, u64> = snapshot
            .namespaces()
            .filter_map(|ns| ns.tenant_id.clone())
            .map(|t| (t, 0))
            .collect();
        for t in &view.tenants {
            let key = if per_tenant.contains_key(&t.tenant) {
                t.tenant.clone()
            } else {
                String::from("_undeclared")
            };
            *per_tenant.entry(key).or_default() += t.index_entries;
        }
        {
            let mut family = encoder.encode_descriptor(
                "index_entries",
                "Distinct index entries held per tenant",
                None,
                MetricType::Gauge,
            )?;
            for (tenant, entries) in per_tenant {
                let labels = TenantLabels { tenant };
                family.encode_family(&labels)?.encode_gauge(&entries)?;
            }
        }
        encoder
            .encode_descriptor(
                "index_orphan_entries",
                "Index entries stored before their chain's parent; while a scope holds any, its lookups read the orphan shard too",
                None,
                MetricType::Gauge,
            )?
            .encode_gauge(&view.orphan_entries)?;
        let mut total = encoder.encode_descriptor(
            "index_entries_all",
            "All index entries, every tenant",
            None,
            MetricType::Gauge,
        )?;
        total.encode_gauge(&view.total_entries)
    }
}

#[cfg(test)]
mod handle_tests {
    use super::*;

    #[test]
    fn pre_resolved_handles_are_indexed_by_discriminant() {
        for (i, r) in ReasonCode::ALL.iter().enumerate() {
            assert_eq!(*r as usize, i, "{r:?}");
        }
        for (i, p) in DecisionPath::ALL.iter().enumerate() {
            assert_eq!(*p as usize, i, "{p:?}");
        }
        for (i, c) in SpillCheck::ALL.iter().enumerate() {
            assert_eq!(*c as usize, i, "{c:?}");
        }
    }

    #[test]
    fn spills_are_counted_by_the_check_that_moved_them() {
        let router = Arc::new(Router::new(
            crate::core::index::IndexConfig::default(),
            crate::core::snapshot::PolicySnapshot::new(
                crate::core::policy::ResolvedPolicy::default(),
                vec![],
                vec![],
            ),
            Timestamp(0),
        ));
        let m = Metrics::new(router, Arc::new(SourceStatus::new()));
        let text = m.encode().expect("encode");
        for check in ["requests", "share", "prefill"] {
            let line = format!("inferencecache_load_spill_checks_total{{check=\"{check}\"}} 0");
            assert!(text.contains(&line), "{line} in\n{text}");
        }
        m.record_spill_check(SpillCheck::Share);
        m.record_spill_check(SpillCheck::Share);
        m.record_spill_check(SpillCheck::Prefill);
        let text = m.encode().expect("encode");
        assert!(text.contains("inferencecache_load_spill_checks_total{check=\"share\"} 2"));
        assert!(text.contains("inferencecache_load_spill_checks_total{check=\"prefill\"} 1"));
        assert!(text.contains("inferencecache_load_spill_checks_total{check=\"requests\"} 0"));
    }
}
