//! Flow control through the ext_proc service (streams as Envoy opens them, the
//! pump task running) and, for the release order across tenants, through the
//! gate with the pump driven by hand.

use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpHeaders, ProcessingRequest, ProcessingResponse,
};
use futures::StreamExt;
use futures::channel::mpsc;
use tonic::Status;

use super::super::headers::*;
use super::super::{ExtProc, ExtProcConfig, InflightRelease, Message, Reply, StreamState, replies};
use super::*;
use crate::adapters::metrics::Metrics;
use crate::adapters::policy_file::SourceStatus;
use crate::core::flow::saturation::Thresholds;
use crate::core::index::{IndexConfig, IndexEvent, IngestBatch, ReplicaStats, StatsReport};
use crate::core::policy::{FlowControl, ResolvedPolicy};
use crate::core::scope::ScopeKey;
use crate::core::snapshot::{BackendDecl, DeclaredReplica, NamespacePolicy, PolicySnapshot};

const CHAIN: [u64; 4] = [0xb1, 0xb2, 0xb3, 0xb4];
/// Generous: CI runs on two loaded cores.
const PATIENCE: Duration = Duration::from_secs(10);

fn flow_policy(max_queued: u32, max_wait: Duration) -> ResolvedPolicy {
    ResolvedPolicy {
        flow_control: FlowControl {
            enabled: true,
            max_queue_wait: max_wait,
            max_queued,
            max_backlog_tokens: FlowControl::DEFAULT_MAX_BACKLOG_TOKENS,
        },
        ..ResolvedPolicy::default()
    }
}

fn backend(tenant: &str, replicas: &[(&str, &str)]) -> BackendDecl {
    BackendDecl {
        namespace: format!("ns-{tenant}"),
        name: "llama".into(),
        scope: ScopeKey {
            tenant: tenant.into(),
            model: "llama".into(),
            hash_scheme: "vllm".into(),
        },
        engine: "vLLM".into(),
        block_size: 16,
        kv_events_topic: String::new(),
        lora_adapters: Vec::new(),
        replicas: replicas
            .iter()
            .map(|(id, addr)| DeclaredReplica {
                id: (*id).into(),
                address: (*addr).into(),
                kv_events_endpoint: None,
                kv_replay_endpoint: None,
                data_parallel_size: 1,
            })
            .collect(),
    }
}

/// Tenants (id, fair weight) each in its own namespace under `policy`, every
/// one served by `replicas`, r1 holding CHAIN for each.
fn mk_router(
    tenants: &[(&str, Option<u32>)],
    replicas: &[(&str, &str)],
    policy: ResolvedPolicy,
) -> Arc<Router> {
    let policy = Arc::new(policy);
    let tenants: Vec<_> = tenants
        .iter()
        .map(|&(t, w)| (t, w, policy.clone()))
        .collect();
    mk_router_of(&tenants, replicas)
}

/// [`mk_router`] with a policy per tenant.
fn mk_router_of(
    tenants: &[(&str, Option<u32>, Arc<ResolvedPolicy>)],
    replicas: &[(&str, &str)],
) -> Arc<Router> {
    declared_router(tenants, replicas, true)
}

/// The tenants' namespaces and backends; `with_events`: r1's engine has just
/// stored CHAIN for each (its event feed is live).
fn declared_router(
    tenants: &[(&str, Option<u32>, Arc<ResolvedPolicy>)],
    replicas: &[(&str, &str)],
    with_events: bool,
) -> Arc<Router> {
    let namespaces = tenants
        .iter()
        .map(|(t, w, policy)| NamespacePolicy {
            namespace: format!("ns-{t}"),
            tenant_id: Some((*t).into()),
            policy_name: Some("p".into()),
            policy: policy.clone(),
            max_index_entries: None,
            fair_weight: *w,
        })
        .collect();
    let backends = tenants
        .iter()
        .map(|(t, _, _)| backend(t, replicas))
        .collect();
    let snapshot = PolicySnapshot::new(ResolvedPolicy::default(), namespaces, backends);
    let now = Timestamp::now();
    let router = Arc::new(Router::new(IndexConfig::default(), snapshot, now));
    if !with_events {
        return router;
    }
    for (t, _, _) in tenants {
        let events = [IndexEvent::Stored {
            parent: None,
            hashes: CHAIN.to_vec(),
            token_counts: vec![],
        }];
        let batch = IngestBatch {
            scope: ScopeRef::new(t, "llama", "vllm"),
            replica_id: "r1",
            endpoint: "",
            events: &events,
        };
        router.ingest(&batch, now).unwrap();
    }
    router
}

fn mk_service(router: Arc<Router>, saturation: Thresholds) -> ExtProc {
    let metrics = Arc::new(Metrics::new(router.clone(), Arc::new(SourceStatus::new())));
    ExtProc::new(
        router,
        metrics,
        ExtProcConfig {
            saturation,
            inflight_release: InflightRelease::ResponseHeaders,
            ..ExtProcConfig::default()
        },
    )
}

/// One request sent since the engine's report (the report must be fresh)
/// saturates a replica: freeing it is a response beginning.
const ONE_IN_FLIGHT: Thresholds = Thresholds {
    max_waiting: 1,
    kv_usage_limit: 0.95,
    max_backlog_tokens: 0,
};

fn report(router: &Router, tenant: &str, replica: &str, address: &str, waiting: u32) {
    let report = StatsReport {
        scope: ScopeRef::new(tenant, "llama", "vllm"),
        replica_id: replica,
        endpoint: address,
        stats: ReplicaStats {
            waiting_requests: waiting,
            ..ReplicaStats::default()
        },
    };
    router.report_stats(&report, Timestamp::now()).unwrap();
}

/// A stream as Envoy opens it: messages in, replies out, through the service's
/// own stream loop (so holds, the pump and cancellation are the real ones),
/// polled on its own task as tonic does.
struct Client {
    tx: Option<mpsc::UnboundedSender<Result<ProcessingRequest, Status>>>,
    rx: mpsc::UnboundedReceiver<Result<ProcessingResponse, Status>>,
}

impl Client {
    fn open(svc: &ExtProc) -> Self {
        let (tx, inbound) = mpsc::unbounded();
        let (out, rx) = mpsc::unbounded();
        let mut stream = Box::pin(replies(svc.clone(), inbound, StreamState::default()));
        tokio::spawn(async move {
            while let Some(r) = stream.next().await {
                if out.unbounded_send(r).is_err() {
                    return;
                }
            }
        });
        Self { tx: Some(tx), rx }
    }

    fn send(&self, msg: ProcessingRequest) {
        self.tx.as_ref().unwrap().unbounded_send(Ok(msg)).unwrap();
    }

    fn send_headers(&self, tenant: &str, extra: &[(&str, &str)]) {
        self.send_chain(tenant, &CHAIN, extra);
    }

    /// A request for `chain` (16 tokens a block).
    fn send_chain(&self, tenant: &str, chain: &[u64], extra: &[(&str, &str)]) {
        let counts = vec!["16"; chain.len()].join(",");
        let chain = format_chain(chain);
        let mut pairs = vec![
            (TENANT, tenant),
            (MODEL, "llama"),
            (HASH_SCHEME, "vllm"),
            (BLOCK_HASHES, chain.as_str()),
            (BLOCK_TOKEN_COUNTS, counts.as_str()),
        ];
        pairs.extend_from_slice(extra);
        let headers = pairs
            .iter()
            .map(|(k, v)| HeaderValue {
                key: (*k).into(),
                value: String::new(),
                raw_value: v.as_bytes().to_vec(),
            })
            .collect();
        self.send(ProcessingRequest {
            request: Some(Message::RequestHeaders(HttpHeaders {
                headers: Some(HeaderMap { headers }),
                end_of_stream: true,
                ..HttpHeaders::default()
            })),
            ..ProcessingRequest::default()
        });
    }

    /// The response began: the request stops counting in flight.
    fn respond(&self) {
        self.send(ProcessingRequest {
            request: Some(Message::ResponseHeaders(HttpHeaders::default())),
            ..ProcessingRequest::default()
        });
    }

    /// The client goes away: the inbound stream ends.
    fn hang_up(&mut self) {
        self.tx = None;
    }

    async fn next(&mut self) -> ProcessingResponse {
        tokio::time::timeout(PATIENCE, self.rx.next())
            .await
            .expect("a reply in time")
            .expect("the stream is open")
            .expect("not an error")
    }

    /// The next reply, skipping the message-timeout extension a hold sends.
    async fn decision(&mut self) -> ProcessingResponse {
        loop {
            let r = self.next().await;
            if r.response.is_some() {
                return r;
            }
        }
    }

    /// Nothing is answered within `d` (beyond the hold's timeout extension).
    async fn silent_for(&mut self, d: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + d;
        loop {
            match tokio::time::timeout_at(deadline, self.rx.next()).await {
                Err(_) => return true,
                Ok(Some(Ok(r))) if r.response.is_none() => continue,
                Ok(_) => return false,
            }
        }
    }
}

/// A header the reply sets toward the upstream (or on an immediate response).
fn header(r: &ProcessingResponse, name: &str) -> Option<String> {
    let set = match &r.response {
        Some(Reply::RequestHeaders(h)) => {
            &h.response.as_ref()?.header_mutation.as_ref()?.set_headers
        }
        Some(Reply::ImmediateResponse(i)) => &i.headers.as_ref()?.set_headers,
        _ => return None,
    };
    set.iter().find_map(|o| {
        let h = o.header.as_ref()?;
        (h.key == name).then(|| String::from_utf8_lossy(&h.raw_value).into_owned())
    })
}

fn removed(r: &ProcessingResponse, name: &str) -> bool {
    match &r.response {
        Some(Reply::RequestHeaders(h)) => h
            .response
            .as_ref()
            .and_then(|c| c.header_mutation.as_ref())
            .is_some_and(|m| m.remove_headers.iter().any(|h| h == name)),
        _ => false,
    }
}

fn status(r: &ProcessingResponse) -> Option<i32> {
    match &r.response {
        Some(Reply::ImmediateResponse(i)) => i.status.as_ref().map(|s| s.code),
        _ => None,
    }
}

/// Waits until the gate holds `n` requests.
async fn until_held(svc: &ExtProc, n: usize) {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while svc.flow.held() != n {
        assert!(
            tokio::time::Instant::now() < deadline,
            "held {} while waiting for {n}",
            svc.flow.held()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

const THREE: [(&str, &str); 3] = [
    ("r1", "127.0.0.1:8001"),
    ("r2", "127.0.0.1:8002"),
    ("r3", "127.0.0.1:8003"),
];

#[tokio::test]
async fn below_saturation_flow_control_changes_no_decision() {
    // The same requests against the same fleet, flow control off and on: the
    // replies are identical, nothing is held, no timeout extension is sent.
    let mut replies_of = Vec::new();
    for enabled in [false, true] {
        let mut policy = flow_policy(4, Duration::from_secs(1));
        policy.flow_control.enabled = enabled;
        let router = mk_router(&[("acme", None)], &THREE, policy);
        for (id, addr) in THREE {
            report(&router, "acme", id, addr, 3);
        }
        let svc = mk_service(router, Thresholds::default());
        let mut got = Vec::new();
        let mut open = Vec::new();
        for _ in 0..4 {
            let mut c = Client::open(&svc);
            c.send_headers("acme", &[]);
            let r = c.next().await;
            assert!(r.response.is_some(), "a decision, not a hold: {r:?}");
            got.push(r);
            open.push(c);
        }
        assert_eq!(svc.flow.held(), 0);
        replies_of.push(got);
    }
    assert_eq!(replies_of[0], replies_of[1]);
    assert_eq!(
        header(&replies_of[1][0], DEFAULT_DESTINATION_HEADER).as_deref(),
        Some("127.0.0.1:8001")
    );
}

/// Three replicas whose engines each report 20 waiting (all saturated) and one
/// request of acme sent with `headers` and held; its first reply (the
/// timeout extension a hold sends) is returned with it.
async fn one_held(headers: &[(&str, &str)]) -> (Arc<Router>, ExtProc, Client, ProcessingResponse) {
    let router = mk_router(
        &[("acme", None)],
        &THREE,
        flow_policy(8, Duration::from_secs(30)),
    );
    for (id, addr) in THREE {
        report(&router, "acme", id, addr, 20);
    }
    let svc = mk_service(router.clone(), Thresholds::default());
    let mut c = Client::open(&svc);
    c.send_headers("acme", headers);
    let first = c.next().await;
    assert!(first.response.is_none(), "{first:?}");
    until_held(&svc, 1).await;
    (router, svc, c, first)
}

#[tokio::test]
async fn a_held_request_goes_to_the_replica_that_frees() {
    let (router, svc, mut c, first) = one_held(&[(DEBUG, "1"), (PRIORITY, "2")]).await;
    // Held: Envoy is first asked to wait maxQueueWait plus the margin.
    let extended = first.override_message_timeout.expect("a timeout extension");
    assert_eq!(extended.seconds, 31);
    assert!(c.silent_for(Duration::from_millis(200)).await);
    // r2's engine drains: the request is decided now, and the load rule sends
    // it there rather than to r1, which holds its blocks but is still full.
    report(&router, "acme", "r2", "127.0.0.1:8002", 0);
    let r = c.decision().await;
    assert_eq!(
        header(&r, DEFAULT_DESTINATION_HEADER).as_deref(),
        Some("127.0.0.1:8002")
    );
    assert_eq!(header(&r, SPILLED_FROM).as_deref(), Some("r1"));
    let queued: u64 = header(&r, QUEUED_MS).unwrap().parse().unwrap();
    assert!(queued >= 200, "{queued}");
    assert!(removed(&r, PRIORITY), "the priority is not the engine's");
    assert_eq!(svc.flow.held(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_held_request_goes_when_an_engines_signals_show_room_not_at_the_next_tick() {
    // The clock is paused: it moves only when every task waits for a timer.
    // The engine's report that frees r2 wakes the queue at once, so the held
    // request is decided with no time passing; a queue that only looked again
    // at its next tick would let the clock run to that tick first.
    let (router, svc, mut c, _) = one_held(&[]).await;
    // Held since the pump's first look; it looks again every tick from then.
    // Half a tick off that phase, no tick is due when r2 frees.
    assert!(c.silent_for(super::TICK * 3 + super::TICK / 2).await);
    let before = tokio::time::Instant::now();
    report(&router, "acme", "r2", "127.0.0.1:8002", 0);
    let r = c.decision().await;
    assert_eq!(
        header(&r, DEFAULT_DESTINATION_HEADER).as_deref(),
        Some("127.0.0.1:8002")
    );
    assert_eq!(tokio::time::Instant::now() - before, Duration::ZERO);
    assert_eq!(svc.flow.held(), 0);
}

#[tokio::test]
async fn a_prefill_backlog_saturates_before_the_engines_queue_grows() {
    // No engine reports and far fewer than 8 requests: only the prefill backlog
    // bound can saturate. Each request brings 64 uncached tokens (a chain the
    // replica does not hold); the bound is 64, so one request fills it. The
    // second tenant is served by the same engine: the first one's backlog
    // there saturates it for both.
    for bound in [64, 0] {
        let mut policy = flow_policy(8, Duration::from_secs(30));
        policy.flow_control.max_backlog_tokens = bound;
        let router = mk_router(&[("acme", None), ("beta", None)], &THREE[..1], policy);
        let svc = mk_service(router, Thresholds::default());
        let (mut c1, mut c2) = (Client::open(&svc), Client::open(&svc));
        c1.send_chain("acme", &[0xa1, 0xa2, 0xa3, 0xa4], &[]);
        let d1 = c1.decision().await;
        assert_eq!(
            header(&d1, DEFAULT_DESTINATION_HEADER).as_deref(),
            Some("127.0.0.1:8001")
        );
        c2.send_chain("beta", &[0xc1, 0xc2, 0xc3, 0xc4], &[]);
        if bound == 0 {
            let r = c2.next().await;
            assert!(r.response.is_some(), "the bound is off: decided at once");
            assert_eq!(svc.flow.held(), 0);
            continue;
        }
        until_held(&svc, 1).await;
        assert!(c2.silent_for(Duration::from_millis(100)).await);
        // c1's response begins: its prefill is done, the engine has room again.
        c1.respond();
        let r = c2.decision().await;
        assert_eq!(
            header(&r, DEFAULT_DESTINATION_HEADER).as_deref(),
            Some("127.0.0.1:8001")
        );
        assert_eq!(svc.flow.held(), 0);
    }
}

#[tokio::test]
async fn a_replica_whose_engine_shows_no_signals_is_never_saturated() {
    // r1 sends no KV events and no queue report: the sidecar cannot tell its
    // queued requests from those decoding, so however many are in flight and
    // however low the bounds, nothing is held.
    let policy = Arc::new(flow_policy(8, Duration::from_secs(30)));
    let router = declared_router(&[("acme", None, policy)], &THREE[..1], false);
    let tight = Thresholds {
        max_waiting: 1,
        kv_usage_limit: 0.95,
        max_backlog_tokens: 1,
    };
    let svc = mk_service(router.clone(), tight);
    let mut open = Vec::new();
    for i in 0..5u64 {
        let mut c = Client::open(&svc);
        c.send_chain("acme", &[0xf0 + i, 0xf1, 0xf2, 0xf3], &[]);
        let d = c.decision().await;
        assert_eq!(
            header(&d, DEFAULT_DESTINATION_HEADER).as_deref(),
            Some("127.0.0.1:8001")
        );
        open.push(c);
    }
    assert_eq!(svc.flow.held(), 0);
    // Once the engine reports its queue, the bound has something to read:
    // what was sent since the report fills it.
    report_r1(&router, &["acme"], 0);
    let mut sent = Client::open(&svc);
    sent.send_chain("acme", &[0xe0, 0xe1, 0xe2, 0xe3], &[]);
    assert!(sent.decision().await.response.is_some());
    let next = Client::open(&svc);
    next.send_chain("acme", &[0xd0, 0xd1, 0xd2, 0xd3], &[]);
    until_held(&svc, 1).await;
}

#[tokio::test]
async fn a_full_queue_sheds_the_newcomer_with_429_and_retry_after() {
    let router = mk_router(
        &[("acme", None)],
        &THREE[..1],
        flow_policy(1, Duration::from_millis(2500)),
    );
    report_r1(&router, &["acme"], 0);
    let svc = mk_service(router, ONE_IN_FLIGHT);
    let mut busy = Client::open(&svc);
    busy.send_headers("acme", &[]);
    assert!(busy.next().await.response.is_some());
    let mut held = Client::open(&svc);
    held.send_headers("acme", &[]);
    until_held(&svc, 1).await;
    let mut late = Client::open(&svc);
    late.send_headers("acme", &[(DEBUG, "1"), (SHED, "forged")]);
    let r = late.decision().await;
    assert_eq!(status(&r), Some(429));
    assert_eq!(header(&r, "retry-after").as_deref(), Some("3"));
    assert_eq!(header(&r, SHED).as_deref(), Some("queue-full"));
    assert_eq!(header(&r, QUEUED_MS).as_deref(), Some("0"));
    // The held one is still held, and goes once the busy request's response begins.
    assert_eq!(svc.flow.held(), 1);
    busy.respond();
    let r = held.decision().await;
    assert_eq!(
        header(&r, DEFAULT_DESTINATION_HEADER).as_deref(),
        Some("127.0.0.1:8001")
    );
}

#[tokio::test]
async fn a_request_held_past_max_queue_wait_is_shed_as_timeout() {
    let router = mk_router(
        &[("acme", None)],
        &THREE[..1],
        flow_policy(4, Duration::from_millis(300)),
    );
    report_r1(&router, &["acme"], 0);
    let svc = mk_service(router, ONE_IN_FLIGHT);
    let mut busy = Client::open(&svc);
    busy.send_headers("acme", &[]);
    assert!(busy.next().await.response.is_some());
    let mut c = Client::open(&svc);
    c.send_headers("acme", &[(DEBUG, "1")]);
    let r = c.decision().await;
    assert_eq!(status(&r), Some(429));
    assert_eq!(header(&r, SHED).as_deref(), Some("queue-timeout"));
    assert_eq!(header(&r, "retry-after").as_deref(), Some("1"));
    let waited: u64 = header(&r, QUEUED_MS).unwrap().parse().unwrap();
    assert!(waited >= 300, "{waited}");
    assert_eq!(svc.flow.held(), 0);
    // The stream is over: nothing more is answered.
    c.respond();
    assert!(c.silent_for(Duration::from_millis(100)).await);
}

#[tokio::test]
async fn a_client_that_goes_away_while_held_leaves_the_queue() {
    let router = mk_router(
        &[("acme", None)],
        &THREE[..1],
        flow_policy(4, Duration::from_secs(30)),
    );
    report_r1(&router, &["acme"], 0);
    let svc = mk_service(router, ONE_IN_FLIGHT);
    let mut busy = Client::open(&svc);
    busy.send_headers("acme", &[]);
    assert!(busy.next().await.response.is_some());
    let mut gone = Client::open(&svc);
    gone.send_headers("acme", &[]);
    let mut stays = Client::open(&svc);
    stays.send_headers("acme", &[]);
    until_held(&svc, 2).await;
    gone.hang_up();
    // The stream ends once its loop sees the end of the inbound messages.
    assert!(
        tokio::time::timeout(PATIENCE, async {
            while let Some(r) = gone.rx.next().await {
                assert!(
                    r.unwrap().response.is_none(),
                    "a hung-up request was decided"
                );
            }
        })
        .await
        .is_ok()
    );
    until_held(&svc, 1).await;
    busy.respond();
    assert!(stays.decision().await.response.is_some());
    assert_eq!(svc.flow.held(), 0);
}

#[tokio::test]
async fn higher_priority_is_released_first() {
    let router = mk_router(
        &[("acme", None)],
        &THREE[..1],
        flow_policy(8, Duration::from_secs(30)),
    );
    report_r1(&router, &["acme"], 0);
    let svc = mk_service(router, ONE_IN_FLIGHT);
    let mut busy = Client::open(&svc);
    busy.send_headers("acme", &[]);
    assert!(busy.next().await.response.is_some());
    let mut clients = Vec::new();
    for (i, p) in ["0", "5", "-3", "1"].into_iter().enumerate() {
        let c = Client::open(&svc);
        c.send_headers("acme", &[(PRIORITY, p)]);
        until_held(&svc, i + 1).await;
        clients.push((p, c));
    }
    // Each response beginning frees the one replica for exactly one request.
    let mut order = Vec::new();
    let mut last = busy;
    while !clients.is_empty() {
        last.respond();
        let mut released = None;
        let deadline = tokio::time::Instant::now() + PATIENCE;
        while released.is_none() {
            assert!(tokio::time::Instant::now() < deadline, "nothing released");
            for (i, (_, c)) in clients.iter_mut().enumerate() {
                if !c.silent_for(Duration::from_millis(20)).await {
                    released = Some(i);
                    break;
                }
            }
        }
        let (p, c) = clients.remove(released.unwrap());
        order.push(p);
        last = c;
        assert_eq!(svc.flow.held(), clients.len());
    }
    assert_eq!(order, ["5", "1", "0", "-3"]);
}

/// Fairness tenants (id, weight) on one replica r1 under flow control, and a
/// gate over them with the pump driven by hand.
fn fair_gate(tenants: &[(&str, Option<u32>)]) -> (Arc<Router>, Arc<FlowGate>) {
    let router = mk_router(
        tenants,
        &THREE[..1],
        flow_policy(64, Duration::from_secs(30)),
    );
    let metrics = Arc::new(crate::adapters::metrics::flow::FlowMetrics::default());
    let gate = Arc::new(FlowGate::new(
        router.clone(),
        metrics,
        Thresholds::default(),
    ));
    (router, gate)
}

/// Every one of `tenants` sees r1's engine report `waiting` requests.
fn report_r1(router: &Router, tenants: &[&str], waiting: u32) {
    for t in tenants {
        report(router, t, "r1", "127.0.0.1:8001", waiting);
    }
}

/// A request of `tenant` for CHAIN (64 tokens).
fn chain_fields(tenant: &str) -> RoutingFields {
    RoutingFields {
        tenant: tenant.into(),
        model: "llama".into(),
        hash_scheme: "vllm".into(),
        block_hashes: CHAIN.to_vec(),
        block_token_counts: vec![16; CHAIN.len()],
        ..RoutingFields::default()
    }
}

/// Admits one request per tenant of `tenants`, in order; each must be held.
fn hold_each<'a>(
    gate: &Arc<FlowGate>,
    tenants: &[&'a str],
    now: Timestamp,
) -> Vec<(&'a str, Pending)> {
    tenants
        .iter()
        .map(|t| match gate.admit(&chain_fields(t), 0, &[], now) {
            Gate::Held(p) => (*t, p),
            _ => panic!("every replica is saturated: the request is held"),
        })
        .collect()
}

/// Pumps `n` times, each releasing exactly one request (the next waits for the
/// last to be decided): the tenants in release order.
fn release_order<'a>(
    gate: &FlowGate,
    pending: &mut [(&'a str, Pending)],
    n: usize,
) -> Vec<&'a str> {
    let mut order = Vec::new();
    for _ in 0..n {
        gate.pump_once(Timestamp::now());
        let mut released = pending
            .iter_mut()
            .filter_map(|(t, p)| match p.rx.try_recv() {
                Ok(Outcome::Released { transit, .. }) => Some((*t, transit)),
                Ok(Outcome::Shed(s)) => panic!("shed: {s:?}"),
                Err(_) => None,
            })
            .collect::<Vec<_>>();
        assert_eq!(released.len(), 1, "one release at a time");
        let (t, transit) = released.pop().unwrap();
        order.push(t);
        drop(transit);
    }
    order
}

#[test]
fn tenants_are_served_in_proportion_to_their_weight() {
    // Two Fairness tenants of weights 1 and 3, equal requests, both backlogged:
    // the release order gives the heavier three of every four.
    let (router, gate) = fair_gate(&[("light", Some(1)), ("heavy", Some(3))]);
    report_r1(&router, &["light", "heavy"], 20);
    let now = Timestamp::now();
    let mut pending = hold_each(&gate, &["light", "heavy"].repeat(8), now);
    assert_eq!(gate.held(), 16);
    // Both engines drain; each release waits for the last to be decided.
    report_r1(&router, &["light", "heavy"], 0);
    let order = release_order(&gate, &mut pending, 8);
    let heavy = order.iter().filter(|t| **t == "heavy").count();
    assert_eq!((heavy, 8 - heavy), (6, 2), "{order:?}");
}

#[test]
fn a_tenant_served_while_nothing_was_held_queues_behind_one_that_was_not() {
    let (router, gate) = fair_gate(&[("busy", Some(1)), ("quiet", Some(1))]);
    let now = Timestamp::now();
    // Below saturation "busy" is served three requests straight through.
    for _ in 0..3 {
        assert!(matches!(
            gate.admit(&chain_fields("busy"), 0, &[], now),
            Gate::Pass
        ));
    }
    assert_eq!(gate.held(), 0);
    report_r1(&router, &["busy", "quiet"], 20);
    let mut pending = hold_each(&gate, &["busy", "quiet"].repeat(2), now);
    report_r1(&router, &["busy", "quiet"], 0);
    // "quiet" catches up first; without the charge they would alternate.
    let order = release_order(&gate, &mut pending, 4);
    assert_eq!(order, ["quiet", "quiet", "busy", "busy"]);
    // The model's queue is remembered for the fairness memory, then dropped.
    drop(pending);
    let later = Timestamp::now();
    gate.pump_once(later);
    assert_eq!(gate.queues.lock().len(), 1);
    gate.pump_once(later.plus(crate::core::flow::FAIRNESS_MEMORY));
    assert!(gate.queues.lock().is_empty());
}

/// A fleet peer that publishes nowhere: the routes under test arrive through
/// `Router::apply_peer`, as the fleet subscriber delivers them.
#[derive(Debug)]
struct Nowhere;

impl crate::core::load::RouteFacts for Nowhere {
    fn publish(&self, _: crate::core::load::peer_ledger::Fact) {}
}

/// A peer's message: its `seq`-th route, a request of `tenant` for r1.
fn peer_route(
    seq: u64,
    tenant: &str,
    prompt_tokens: u64,
    held: bool,
) -> crate::core::load::peer_ledger::Message {
    crate::core::load::peer_ledger::Message {
        peer: "peer".into(),
        epoch: 1,
        seq,
        fact: crate::core::load::peer_ledger::Fact::Routed {
            route: seq,
            scope: ScopeRef::new(tenant, "llama", "vllm").to_owned(),
            replica: "r1".into(),
            uncached_tokens: 0,
            prompt_tokens,
            priority: 0,
            held,
            pending: Vec::new(),
        },
    }
}

/// One replica (r1) serving `tenants` under flow control (64 held, 30 s), in a
/// fleet whose peers hear nothing, and the ext_proc service over it.
fn fleet_service(tenants: &[(&str, Option<u32>)]) -> (Arc<Router>, ExtProc) {
    let router = mk_router(
        tenants,
        &THREE[..1],
        flow_policy(64, Duration::from_secs(30)),
    );
    assert!(router.join_fleet("me", Arc::new(Nowhere)));
    let svc = mk_service(router.clone(), Thresholds::default());
    (router, svc)
}

/// Through the ext_proc service's own gate (as `ExtProc::new` wires it): a
/// fleet peer routes three of `tenant`'s requests of `prompt_tokens` each,
/// then "busy" and "quiet" queue two requests each, "busy" first. The order
/// they are released in.
fn order_after_peer_routes(tenant: &str, prompt_tokens: u64) -> Vec<&'static str> {
    let (router, svc) = fleet_service(&[("busy", Some(1)), ("quiet", Some(1))]);
    let now = Timestamp::now();
    for seq in 1..=3 {
        let applied = router.apply_peer(peer_route(seq, tenant, prompt_tokens, false), now);
        assert_eq!(
            applied,
            Some(crate::core::load::peer_ledger::Outcome::Applied)
        );
    }
    report_r1(&router, &["busy", "quiet"], 20);
    let mut pending = hold_each(&svc.flow, &["busy", "quiet"].repeat(2), now);
    report_r1(&router, &["busy", "quiet"], 0);
    release_order(&svc.flow, &mut pending, 4)
}

#[test]
fn a_tenant_the_fleets_peers_served_queues_behind_one_they_did_not() {
    // Three requests of "busy" (64 tokens each, as its requests here) served
    // through a peer: "quiet" catches up first, as if this sidecar had
    // served them.
    assert_eq!(
        order_after_peer_routes("busy", 64),
        ["quiet", "quiet", "busy", "busy"]
    );
    // A peer that does not say a route's prompt tokens charges nothing: the
    // two tenants alternate, "busy" first as it queued first.
    assert_eq!(
        order_after_peer_routes("busy", 0),
        ["busy", "quiet", "busy", "quiet"]
    );
}

/// The facts this sidecar publishes to its fleet, kept.
#[derive(Debug, Default)]
struct Published(parking_lot::Mutex<Vec<crate::core::load::peer_ledger::Fact>>);

impl crate::core::load::RouteFacts for Published {
    fn publish(&self, fact: crate::core::load::peer_ledger::Fact) {
        self.0.lock().push(fact);
    }
}

impl Published {
    /// `held` of each route published so far.
    fn held(&self) -> Vec<bool> {
        self.0
            .lock()
            .iter()
            .filter_map(|f| match f {
                crate::core::load::peer_ledger::Fact::Routed { held, .. } => Some(*held),
                _ => None,
            })
            .collect()
    }
}

#[tokio::test]
async fn a_route_released_from_the_queue_tells_the_peers_it_was_held() {
    let router = mk_router(
        &[("acme", None)],
        &THREE[..1],
        flow_policy(4, Duration::from_secs(30)),
    );
    let published = Arc::new(Published::default());
    assert!(router.join_fleet("me", published.clone()));
    report_r1(&router, &["acme"], 0);
    let svc = mk_service(router, ONE_IN_FLIGHT);
    let mut busy = Client::open(&svc);
    busy.send_headers("acme", &[]);
    assert!(busy.next().await.response.is_some());
    let mut c = Client::open(&svc);
    c.send_headers("acme", &[]);
    until_held(&svc, 1).await;
    busy.respond();
    assert!(c.decision().await.response.is_some());
    assert_eq!(published.held(), [false, true]);
}

#[test]
fn a_queue_holding_one_tenant_leaves_room_to_a_peer_holding_one_owed_more() {
    // "quiet" (weight 1) is held here, "busy" (weight 3) only at a peer. A
    // route the peer released from its queue makes this sidecar leave r1's
    // room to it for the grace, each time it has room, while "busy" counts as
    // held there; a route the peer did not hold is charged but leaves no room.
    for peer_held in [true, false] {
        let (router, svc) = fleet_service(&[("busy", Some(3)), ("quiet", Some(1))]);
        let now = Timestamp::now();
        report_r1(&router, &["busy", "quiet"], 20);
        let mut pending = hold_each(&svc.flow, &["quiet"; 3], now);
        let applied = router.apply_peer(peer_route(1, "busy", 64, peer_held), now);
        assert_eq!(
            applied,
            Some(crate::core::load::peer_ledger::Outcome::Applied)
        );
        report_r1(&router, &["busy", "quiet"], 0);
        // Releases since the last call (each decided at once: its transit drops).
        let mut released = || {
            pending
                .iter_mut()
                .map(|(_, p)| matches!(p.rx.try_recv(), Ok(Outcome::Released { .. })))
                .filter(|r| *r)
                .count()
        };
        let wait = svc.flow.pump_once(now);
        if !peer_held {
            assert_eq!(released(), 1, "work-conserving: released");
            continue;
        }
        assert_eq!(released(), 0, "the room is the peer's");
        assert_eq!(wait, Some(PEER_YIELD_GRACE), "woken when the grace ends");
        let almost = now.plus(PEER_YIELD_GRACE - Duration::from_millis(1));
        assert_eq!(svc.flow.pump_once(almost), Some(Duration::from_millis(1)));
        assert_eq!(released(), 0, "the room is the peer's");
        // The peer did not take the room within the grace: it is taken here.
        let after = now.plus(PEER_YIELD_GRACE);
        svc.flow.pump_once(after);
        assert_eq!(released(), 1, "released after the grace");
        // The next room, while "busy" still counts as held at the peer, is
        // left to the peer again for the grace.
        svc.flow.pump_once(after);
        assert_eq!(released(), 0, "the room is the peer's again");
        // Once "busy" no longer counts as held there, rooms are taken at once.
        svc.flow
            .pump_once(now.plus(crate::core::flow::PEER_BACKLOG_WINDOW));
        assert_eq!(released(), 1, "released: the peer's mark ran out");
        assert_eq!(svc.flow.held(), 1);
    }
}

#[test]
fn a_peer_route_of_a_tenant_without_flow_control_is_not_charged() {
    // "plain" is served by the same replicas under a policy with flow control
    // off: its requests never queue, and its peers' routes leave no state.
    let flow = Arc::new(flow_policy(64, Duration::from_secs(30)));
    let router = mk_router_of(
        &[
            ("busy", Some(1), flow),
            ("plain", None, Arc::new(ResolvedPolicy::default())),
        ],
        &THREE[..1],
    );
    assert!(router.join_fleet("me", Arc::new(Nowhere)));
    let svc = mk_service(router.clone(), Thresholds::default());
    let now = Timestamp::now();
    let applied = router.apply_peer(peer_route(1, "plain", 64, false), now);
    assert_eq!(
        applied,
        Some(crate::core::load::peer_ledger::Outcome::Applied)
    );
    assert!(svc.flow.queues.lock().is_empty());
    // Its flow-controlled neighbour's route is charged (the model's queue now
    // remembers it).
    let applied = router.apply_peer(peer_route(2, "busy", 64, false), now);
    assert_eq!(
        applied,
        Some(crate::core::load::peer_ledger::Outcome::Applied)
    );
    assert_eq!(svc.flow.queues.lock().len(), 1);
}

#[test]
fn a_peer_route_of_a_model_this_sidecar_does_not_serve_leaves_no_state() {
    let (router, gate) = fair_gate(&[("busy", Some(1))]);
    assert!(router.join_fleet("me", Arc::new(Nowhere)));
    router.share_fleet_service(Arc::downgrade(&gate) as std::sync::Weak<_>);
    let now = Timestamp::now();
    let mut msg = peer_route(1, "busy", 64, false);
    if let crate::core::load::peer_ledger::Fact::Routed { scope, .. } = &mut msg.fact {
        scope.model = "unknown".into();
    }
    let applied = Some(crate::core::load::peer_ledger::Outcome::Applied);
    assert_eq!(router.apply_peer(msg, now), applied);
    assert!(gate.queues.lock().is_empty());
    // A route of the model it serves is remembered.
    assert_eq!(
        router.apply_peer(peer_route(2, "busy", 64, false), now),
        applied
    );
    assert_eq!(gate.queues.lock().len(), 1);
}

#[test]
fn a_request_for_a_model_no_backend_declares_passes_and_leaves_no_state() {
    let (_router, gate) = fair_gate(&[("busy", Some(1))]);
    let now = Timestamp::now();
    for i in 0..100 {
        let fields = RoutingFields {
            model: format!("unknown-{i}"),
            ..chain_fields("busy")
        };
        assert!(matches!(gate.admit(&fields, 0, &[], now), Gate::Pass));
    }
    assert!(gate.queues.lock().is_empty());
    // A declared model's pass is remembered.
    assert!(matches!(
        gate.admit(&chain_fields("busy"), 0, &[], now),
        Gate::Pass
    ));
    assert_eq!(gate.queues.lock().len(), 1);
}

#[test]
fn a_request_that_would_outwait_max_queue_wait_is_shed_on_arrival_as_queue_timeout() {
    // One replica under a 200 ms maxQueueWait, releasing one request every
    // 10 ms while two arrive: after 200 ms, 20 released in the last wait and
    // 23 held ahead of a newcomer.
    let router = mk_router(
        &[("acme", None)],
        &THREE[..1],
        flow_policy(64, Duration::from_millis(200)),
    );
    let metrics = Arc::new(crate::adapters::metrics::flow::FlowMetrics::default());
    let gate = Arc::new(FlowGate::new(
        router.clone(),
        metrics.clone(),
        Thresholds::default(),
    ));
    report(&router, "acme", "r1", "127.0.0.1:8001", 20);
    let t0 = Timestamp::now();
    let mut pending = hold_each(&gate, &["acme"; 5], t0);
    let mut now = t0;
    for step in 1..=20 {
        now = now.plus(Duration::from_millis(10));
        report(&router, "acme", "r1", "127.0.0.1:8001", 0);
        gate.pump_once(now);
        let transit = pending
            .iter_mut()
            .find_map(|(_, p)| match p.rx.try_recv() {
                Ok(Outcome::Released { transit, .. }) => Some(transit),
                _ => None,
            })
            .expect("a release");
        // Decided and sent: the engine's queue is full again.
        report(&router, "acme", "r1", "127.0.0.1:8001", 20);
        drop(transit);
        if step < 20 {
            pending.extend(hold_each(&gate, &["acme"; 2], now));
        }
    }
    assert_eq!(gate.held(), 23);
    now = now.plus(Duration::from_millis(5));
    match gate.admit(&chain_fields("acme"), 0, &[], now) {
        Gate::Shed(s) => {
            assert_eq!(s.reason, ShedReason::ExpectedTimeout);
            assert_eq!(s.reason.as_str(), "queue-timeout");
            assert_eq!((s.retry_after_secs, s.waited), (1, Duration::ZERO));
        }
        _ => panic!("23 ahead against 20 released in a wait is shed at once"),
    }
    assert_eq!(gate.held(), 23);
    // A higher priority has nothing ahead of it: held.
    assert!(matches!(
        gate.admit(&chain_fields("acme"), 1, &[], now),
        Gate::Held(_)
    ));
    let mut registry = prometheus_client::registry::Registry::default();
    metrics.register(&mut registry);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    assert!(
        text.lines()
            .any(|l| l == "flow_shed_total{reason=\"expected-timeout\"} 1"),
        "{text}"
    );
}
