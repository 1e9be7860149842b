use std::time::Duration;

use super::headers::*;
use super::*;
use crate::core::index::{IndexConfig, IndexEvent, IngestBatch};
use crate::core::policy::ResolvedPolicy;
use crate::core::scope::ScopeKey;
use crate::core::snapshot::{BackendDecl, DeclaredReplica, PolicySnapshot};
use envoy_types::pb::envoy::service::ext_proc::v3::{HttpBody, HttpHeaders, HttpTrailers};

const CHAIN: [u64; 6] = [0xa1, 0xa2, 0xa3, 0xa4, 0xa5, 0xa6];

fn mk_snapshot_with(replicas: &[(&str, &str)], policy: ResolvedPolicy) -> PolicySnapshot {
    let backend = BackendDecl {
        namespace: "team-a".into(),
        name: "llama".into(),
        scope: ScopeKey {
            tenant: "acme".into(),
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
    };
    PolicySnapshot::new(policy, vec![], vec![backend])
}

/// Three declared replicas; r1 holds CHAIN.
fn mk_service(config: ExtProcConfig) -> ExtProc {
    mk_service_with(config, ResolvedPolicy::default())
}

/// The cache pick alone: the load rule off (no in-flight counting either).
fn cache_pick_policy() -> ResolvedPolicy {
    ResolvedPolicy {
        load_awareness: crate::core::policy::LoadAwareness::Disabled,
        ..ResolvedPolicy::default()
    }
}

fn mk_service_with(config: ExtProcConfig, policy: ResolvedPolicy) -> ExtProc {
    let now = Timestamp::now();
    let snapshot = mk_snapshot_with(
        &[
            ("r1", "127.0.0.1:8001"),
            ("r2", "127.0.0.1:8002"),
            ("r3", "127.0.0.1:8003"),
        ],
        policy,
    );
    let router = Arc::new(Router::new(IndexConfig::default(), snapshot, now));
    store_on(&router, "r1", None, &CHAIN, now);
    let metrics = Arc::new(Metrics::new(router.clone(), Arc::new(SourceStatus::new())));
    ExtProc::new(router, metrics, config)
}

use crate::adapters::policy_file::SourceStatus;
use crate::core::scope::ScopeRef;

fn mk_request(pairs: &[(&str, &str)]) -> ProcessingRequest {
    let headers = pairs
        .iter()
        .map(|(k, v)| HeaderValue {
            key: (*k).into(),
            value: String::new(),
            raw_value: v.as_bytes().to_vec(),
        })
        .collect();
    ProcessingRequest {
        request: Some(Message::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap { headers }),
            ..HttpHeaders::default()
        })),
        ..ProcessingRequest::default()
    }
}

fn chain_headers(extra: &[(&'static str, &'static str)]) -> Vec<(&'static str, String)> {
    let mut h: Vec<(&'static str, String)> = vec![
        (TENANT, "acme".into()),
        (MODEL, "llama".into()),
        (HASH_SCHEME, "vllm".into()),
        (BLOCK_HASHES, format_chain(&CHAIN)),
        (BLOCK_TOKEN_COUNTS, vec!["16"; CHAIN.len()].join(",")),
    ];
    h.extend(extra.iter().map(|(k, v)| (*k, (*v).to_string())));
    h
}

fn ask(
    svc: &ExtProc,
    pairs: &[(&'static str, String)],
) -> (ProcessingResponse, Vec<HeaderValueOption>) {
    let (reply, stream) = on_new_stream(svc, pairs);
    (reply, stream.echo)
}

/// Sends request headers `pairs` on a new stream: the reply and what the stream keeps.
fn on_new_stream(
    svc: &ExtProc,
    pairs: &[(&'static str, String)],
) -> (ProcessingResponse, StreamState) {
    let borrowed: Vec<(&str, &str)> = pairs.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let mut stream = StreamState::default();
    let reply = svc.answer(mk_request(&borrowed), &mut stream).unwrap();
    (reply, stream)
}

/// `replica` stores `hashes` under `parent` (an engine event), now.
fn store_on(router: &Router, replica: &str, parent: Option<u64>, hashes: &[u64], now: Timestamp) {
    let events = [IndexEvent::Stored {
        parent,
        hashes: hashes.to_vec(),
        token_counts: vec![],
    }];
    let batch = IngestBatch {
        scope: ScopeRef::new("acme", "llama", "vllm"),
        replica_id: replica,
        endpoint: "",
        events: &events,
    };
    router.ingest(&batch, now).unwrap();
}

fn common(reply: &ProcessingResponse) -> &CommonResponse {
    match &reply.response {
        Some(Reply::RequestHeaders(h)) => h.response.as_ref().unwrap(),
        other => panic!("not a request headers reply: {other:?}"),
    }
}

fn set_value(c: &CommonResponse, name: &str) -> Option<String> {
    let m = c.header_mutation.as_ref()?;
    m.set_headers.iter().find_map(|o| {
        let h = o.header.as_ref()?;
        (h.key == name).then(|| String::from_utf8_lossy(&h.raw_value).into_owned())
    })
}

fn removed(c: &CommonResponse, name: &str) -> bool {
    c.header_mutation
        .as_ref()
        .is_some_and(|m| m.remove_headers.iter().any(|h| h == name))
}

#[test]
fn a_held_chain_routes_to_its_holder_with_every_write() {
    let svc = mk_service(ExtProcConfig::default());
    let (reply, echo) = ask(&svc, &chain_headers(&[]));
    let c = common(&reply);
    assert_eq!(
        set_value(c, DEFAULT_DESTINATION_HEADER).as_deref(),
        Some("127.0.0.1:8001")
    );
    assert_eq!(set_value(c, REASON).as_deref(), Some("PREFIX_MATCH"));
    assert_eq!(set_value(c, REPLICA).as_deref(), Some("r1"));
    assert_eq!(set_value(c, MATCHED_TOKENS).as_deref(), Some("96"));
    assert!(set_value(c, SCORE).is_some());
    assert!(c.clear_route_cache);
    let all_overwrite = c
        .header_mutation
        .as_ref()
        .unwrap()
        .set_headers
        .iter()
        .all(|o| o.append_action == HeaderAppendAction::OverwriteIfExistsOrAdd as i32);
    assert!(all_overwrite);
    let md = reply.dynamic_metadata.as_ref().unwrap();
    let Some(Kind::StructValue(lb)) = md.fields[LB_METADATA_NAMESPACE].kind.as_ref() else {
        panic!("no envoy.lb struct")
    };
    assert_eq!(
        lb.fields[LB_METADATA_KEY].kind,
        Some(Kind::StringValue("127.0.0.1:8001".into()))
    );
    // No debug asked, but the routed request counts as in flight until its
    // response headers: Envoy must send them (no mode override).
    assert!(echo.is_empty());
    assert!(reply.mode_override.is_none());
}

#[test]
fn with_the_load_rule_off_envoy_skips_the_response_headers() {
    let svc = mk_service_with(ExtProcConfig::default(), cache_pick_policy());
    let (reply, echo) = ask(&svc, &chain_headers(&[]));
    assert_eq!(set_value(common(&reply), REPLICA).as_deref(), Some("r1"));
    assert!(echo.is_empty());
    assert_eq!(
        reply.mode_override.map(|m| m.response_header_mode),
        Some(HeaderSendMode::Skip as i32)
    );
}

fn inflight_of(svc: &ExtProc, id: &str) -> u64 {
    svc.router
        .view(Timestamp::now())
        .replicas
        .iter()
        .find(|r| r.replica_id == id)
        .map_or(0, |r| r.inflight_requests)
}

/// Sends the chain request on a new stream and returns the stream's state.
fn routed(svc: &ExtProc) -> (ProcessingResponse, StreamState) {
    on_new_stream(svc, &chain_headers(&[]))
}

#[test]
fn a_routed_request_is_in_flight_until_its_response_headers_or_stream_end() {
    let svc = mk_service(ExtProcConfig::default());
    let (_, mut first) = routed(&svc);
    let (_, second) = routed(&svc);
    assert_eq!(inflight_of(&svc, "r1"), 2);
    let resp = ProcessingRequest {
        request: Some(Message::ResponseHeaders(HttpHeaders::default())),
        ..ProcessingRequest::default()
    };
    svc.answer(resp, &mut first).unwrap();
    assert_eq!(inflight_of(&svc, "r1"), 1, "released on response headers");
    drop(second);
    assert_eq!(inflight_of(&svc, "r1"), 0, "released when the stream ends");
    drop(first);
    assert_eq!(inflight_of(&svc, "r1"), 0, "released once");
}

/// CHAIN plus two blocks nobody holds: r1 is picked with 32 uncached tokens.
fn longer_chain_headers(extra: &[(&'static str, &'static str)]) -> Vec<(&'static str, String)> {
    let mut chain = CHAIN.to_vec();
    chain.extend([0xb1, 0xb2]);
    let mut h = chain_headers(extra);
    for (k, v) in &mut h {
        if *k == BLOCK_HASHES {
            *v = format_chain(&chain);
        } else if *k == BLOCK_TOKEN_COUNTS {
            *v = vec!["16"; chain.len()].join(",");
        }
    }
    h
}

/// r1's engine reports an empty queue now (as its metrics scrape does).
fn report_r1_idle(svc: &ExtProc) {
    let report = crate::core::index::StatsReport {
        scope: ScopeRef::new("acme", "llama", "vllm"),
        replica_id: "r1",
        endpoint: "",
        stats: crate::core::index::ReplicaStats::default(),
    };
    svc.router.report_stats(&report, Timestamp::now()).unwrap();
}

/// The request of [`longer_chain_headers`] on a new stream.
fn routed_longer(
    svc: &ExtProc,
    extra: &[(&'static str, &'static str)],
) -> (ProcessingResponse, StreamState) {
    on_new_stream(svc, &longer_chain_headers(extra))
}

fn response_headers(svc: &ExtProc, stream: &mut StreamState) {
    let resp = ProcessingRequest {
        request: Some(Message::ResponseHeaders(HttpHeaders::default())),
        ..ProcessingRequest::default()
    };
    svc.answer(resp, stream).unwrap();
}

#[test]
fn with_live_engine_signals_a_request_ends_with_its_prefill_and_envoy_skips_the_response() {
    let svc = mk_service(ExtProcConfig::default());
    // r1's engine sent an event and a queue report just now; the request
    // brings uncached blocks.
    report_r1_idle(&svc);
    let (reply, stream) = routed_longer(&svc, &[]);
    assert_eq!(set_value(common(&reply), REPLICA).as_deref(), Some("r1"));
    assert_eq!(
        reply.mode_override.map(|m| m.response_header_mode),
        Some(HeaderSendMode::Skip as i32),
        "no response-headers round trip"
    );
    assert!(stream.inflight.is_none(), "the stream keeps no guard");
    // Envoy ends the stream after the routing reply: the request still counts.
    drop(stream);
    assert_eq!(inflight_of(&svc, "r1"), 1);
    // Its engine stores the prompt's last block: the prefill is over.
    store_on_r1(&svc, &[0xb1]);
    assert_eq!(inflight_of(&svc, "r1"), 1, "not its last block");
    store_on_r1(&svc, &[0xb1, 0xb2]);
    assert_eq!(inflight_of(&svc, "r1"), 0);
}

#[test]
fn without_an_engine_queue_report_a_request_ends_at_its_response() {
    // r1 sends events but its queue was never reported: the decode after the
    // prefill would be invisible to the load rule, so the response ends it.
    let svc = mk_service(ExtProcConfig::default());
    let (reply, mut stream) = routed_longer(&svc, &[]);
    assert!(
        reply.mode_override.is_none(),
        "Envoy must send the response headers"
    );
    store_on_r1(&svc, &[0xb1, 0xb2]);
    assert_eq!(
        inflight_of(&svc, "r1"),
        1,
        "its prefill ended, not the request"
    );
    response_headers(&svc, &mut stream);
    assert_eq!(inflight_of(&svc, "r1"), 0);
}

#[test]
fn inflight_release_response_headers_always_waits_for_the_response() {
    let svc = mk_service(ExtProcConfig {
        inflight_release: InflightRelease::ResponseHeaders,
        ..ExtProcConfig::default()
    });
    report_r1_idle(&svc);
    let (reply, mut stream) = routed_longer(&svc, &[]);
    assert!(reply.mode_override.is_none());
    store_on_r1(&svc, &[0xb1, 0xb2]);
    assert_eq!(inflight_of(&svc, "r1"), 1);
    response_headers(&svc, &mut stream);
    assert_eq!(inflight_of(&svc, "r1"), 0);
}

#[test]
fn a_debugging_request_still_gets_its_echo_and_ends_with_its_prefill() {
    let svc = mk_service(ExtProcConfig::default());
    report_r1_idle(&svc);
    let (reply, mut stream) = routed_longer(&svc, &[(DEBUG, "1")]);
    assert!(
        reply.mode_override.is_none(),
        "the echo needs the response headers"
    );
    assert!(!stream.echo.is_empty());
    response_headers(&svc, &mut stream);
    drop(stream);
    // One signal for every request: the end of its prefill, not its response.
    assert_eq!(inflight_of(&svc, "r1"), 1);
    store_on_r1(&svc, &[0xb1, 0xb2]);
    assert_eq!(inflight_of(&svc, "r1"), 0);
}

/// r1's engine stores `hashes` after CHAIN.
fn store_on_r1(svc: &ExtProc, hashes: &[u64]) {
    store_on(&svc.router, "r1", Some(0xa6), hashes, Timestamp::now());
}

#[tokio::test(start_paused = true)]
async fn a_response_that_never_comes_ages_out() {
    let svc = mk_service(ExtProcConfig::default());
    let (_, mut st) = routed(&svc);
    st.admitted_at = Some(tokio::time::Instant::now());
    assert_eq!(inflight_of(&svc, "r1"), 1);
    let mut silent = futures::stream::pending::<Result<ProcessingRequest, Status>>();
    let waited = tokio::time::timeout(
        INFLIGHT_AGE_OUT + Duration::from_secs(1),
        next_message(&mut st, &mut silent),
    )
    .await;
    assert!(waited.is_err(), "the stream itself stays open");
    assert!(st.inflight.is_none());
    assert_eq!(inflight_of(&svc, "r1"), 0);
}

#[test]
fn an_overloaded_holder_spills_and_says_where_from() {
    let svc = mk_service(ExtProcConfig::default());
    // r1 holds the chain; three replicas: mean (k + 1) / 3, bound 1.25 × mean + 2.
    let held: Vec<StreamState> = (0..6).map(|_| routed(&svc).1).collect();
    // A hit with nothing left to prefill would start at once even there (a
    // quick start stays); this one brings a 600-token tail nobody holds.
    let mut tail = CHAIN.to_vec();
    tail.push(0xc1);
    let mut counts = vec!["16"; CHAIN.len()];
    counts.push("600");
    let mut long = chain_headers(&[]);
    for (k, v) in &mut long {
        if *k == BLOCK_HASHES {
            *v = format_chain(&tail);
        } else if *k == BLOCK_TOKEN_COUNTS {
            *v = counts.join(",");
        }
    }
    let (reply, _spilled) = on_new_stream(&svc, &long);
    let c = common(&reply);
    assert_eq!(set_value(c, REASON).as_deref(), Some("PREFIX_MATCH"));
    assert_eq!(set_value(c, SPILLED_FROM).as_deref(), Some("r1"));
    assert_eq!(set_value(c, SPILLED_BY).as_deref(), Some("requests"));
    let to = set_value(c, REPLICA).expect("a pick");
    assert_ne!(to, "r1");
    assert_ne!(
        set_value(c, DEFAULT_DESTINATION_HEADER).as_deref(),
        Some("127.0.0.1:8001")
    );
    // Every routed request is counted where it went; r1 stopped at its bound.
    let total: u64 = ["r1", "r2", "r3"]
        .iter()
        .map(|id| inflight_of(&svc, id))
        .sum();
    assert_eq!(total, 7);
    assert!(inflight_of(&svc, "r1") < 7 && inflight_of(&svc, &to) >= 1);
    drop(held);
    // Balanced again: the holder, and a forged spilled-from header is removed.
    let (reply, _) = ask(
        &svc,
        &chain_headers(&[(SPILLED_FROM, "r9"), (SPILLED_BY, "share")]),
    );
    let c = common(&reply);
    assert_eq!(set_value(c, REPLICA).as_deref(), Some("r1"));
    assert!(removed(c, SPILLED_FROM));
    assert!(removed(c, SPILLED_BY));
}

#[test]
fn spoofed_routing_headers_are_removed_when_there_is_no_hint() {
    let svc = mk_service(ExtProcConfig::default());
    let pairs = vec![
        (TENANT, "nobody".to_string()),
        (MODEL, "llama".into()),
        (HASH_SCHEME, "vllm".into()),
        (DEFAULT_DESTINATION_HEADER, "10.9.9.9:80".into()),
        (REPLICA, "forged".into()),
    ];
    let (reply, _) = ask(&svc, &pairs);
    let c = common(&reply);
    assert_eq!(set_value(c, REASON).as_deref(), Some("UNKNOWN_TENANT"));
    assert!(removed(c, DEFAULT_DESTINATION_HEADER));
    for h in [REPLICA, SCORE, MATCHED_TOKENS] {
        assert!(removed(c, h), "{h} not removed");
    }
    assert!(reply.dynamic_metadata.is_none());
    assert!(!c.clear_route_cache);
}

#[test]
fn flow_control_headers_a_client_sends_are_removed() {
    let svc = mk_service(ExtProcConfig::default());
    let (reply, _) = ask(
        &svc,
        &chain_headers(&[(SHED, "queue-full"), (QUEUED_MS, "5"), (PRIORITY, "9")]),
    );
    let c = common(&reply);
    assert_eq!(set_value(c, REASON).as_deref(), Some("PREFIX_MATCH"));
    for h in [SHED, QUEUED_MS, PRIORITY] {
        assert!(removed(c, h), "{h} not removed");
        assert_eq!(set_value(c, h), None, "{h} set");
    }
}

#[test]
fn malformed_headers_give_no_hint_and_say_why_when_debugging() {
    let svc = mk_service(ExtProcConfig::default());
    let mut pairs = chain_headers(&[(DEBUG, "1")]);
    pairs[3].1 = "0xa1,zz".into();
    pairs[4].1 = "16,16".into();
    let (reply, echo) = ask(&svc, &pairs);
    let c = common(&reply);
    assert_eq!(set_value(c, REASON).as_deref(), Some("NO_HINT"));
    assert!(removed(c, DEFAULT_DESTINATION_HEADER));
    let detail = echo
        .iter()
        .filter_map(|o| o.header.as_ref())
        .find(|h| h.key == DETAIL)
        .map(|h| String::from_utf8_lossy(&h.raw_value).into_owned());
    assert!(detail.is_some_and(|d| d.contains(BLOCK_HASHES)));
    assert!(
        reply.mode_override.is_none(),
        "response headers are needed for the echo"
    );

    // The echo goes out on the response headers, once.
    let resp = ProcessingRequest {
        request: Some(Message::ResponseHeaders(HttpHeaders::default())),
        ..ProcessingRequest::default()
    };
    let mut stream = StreamState {
        echo,
        ..StreamState::default()
    };
    let out = svc.answer(resp, &mut stream).unwrap();
    let Some(Reply::ResponseHeaders(h)) = out.response else {
        panic!("not a response headers reply")
    };
    let m = h.response.unwrap().header_mutation.unwrap();
    assert!(
        m.set_headers
            .iter()
            .any(|o| o.header.as_ref().unwrap().key == REASON)
    );
}

#[test]
fn debug_echo_can_be_disabled_by_the_operator() {
    let svc = mk_service_with(
        ExtProcConfig {
            debug_headers_allowed: false,
            ..ExtProcConfig::default()
        },
        cache_pick_policy(),
    );
    let (reply, echo) = ask(&svc, &chain_headers(&[(DEBUG, "1")]));
    assert!(echo.is_empty());
    assert!(reply.mode_override.is_some());
}

#[test]
fn original_dst_falls_back_to_a_serving_replica() {
    let svc = mk_service(ExtProcConfig {
        destination_mode: DestinationMode::OriginalDst,
        ..ExtProcConfig::default()
    });
    let pairs = vec![
        (TENANT, "acme".to_string()),
        (MODEL, "llama".into()),
        (HASH_SCHEME, "vllm".into()),
    ];
    let (reply, _) = ask(&svc, &pairs);
    let c = common(&reply);
    let dest = set_value(c, DEFAULT_DESTINATION_HEADER).unwrap();
    assert!(dest.starts_with("127.0.0.1:800"), "{dest}");
    assert_eq!(set_value(c, REASON).as_deref(), Some("NO_HINT"));
    assert!(c.clear_route_cache);
}

#[test]
fn original_dst_without_a_serving_replica_answers_503_with_the_reason() {
    let svc = mk_service(ExtProcConfig {
        destination_mode: DestinationMode::OriginalDst,
        ..ExtProcConfig::default()
    });
    let pairs = vec![
        (TENANT, "acme".to_string()),
        (MODEL, "other-model".into()),
        (HASH_SCHEME, "vllm".into()),
    ];
    let (reply, _) = ask(&svc, &pairs);
    let Some(Reply::ImmediateResponse(im)) = reply.response else {
        panic!("expected an immediate response")
    };
    assert_eq!(im.status.map(|s| s.code), Some(503));
    let body = String::from_utf8(im.body).unwrap();
    assert!(body.contains("UNKNOWN_MODEL"), "{body}");
}

#[test]
fn configured_destination_header_name_is_used() {
    let svc = mk_service(ExtProcConfig {
        destination_header: "x-route-to".into(),
        ..ExtProcConfig::default()
    });
    let (reply, _) = ask(&svc, &chain_headers(&[]));
    assert_eq!(
        set_value(common(&reply), "x-route-to").as_deref(),
        Some("127.0.0.1:8001")
    );
}

#[test]
fn messages_it_does_not_use_get_an_empty_continue() {
    let svc = mk_service(ExtProcConfig::default());
    let mut echo = StreamState::default();
    let bodies = [
        Message::RequestBody(HttpBody::default()),
        Message::ResponseBody(HttpBody::default()),
        Message::RequestTrailers(HttpTrailers::default()),
        Message::ResponseTrailers(HttpTrailers::default()),
        Message::ResponseHeaders(HttpHeaders::default()),
    ];
    for m in bodies {
        let req = ProcessingRequest {
            request: Some(m),
            ..ProcessingRequest::default()
        };
        let reply = svc.answer(req, &mut echo).unwrap();
        assert!(reply.response.is_some());
        assert!(reply.dynamic_metadata.is_none());
    }
    // A message that carries nothing (e.g. only protocol config) gets no reply.
    assert!(
        svc.answer(ProcessingRequest::default(), &mut echo)
            .is_none()
    );
}

#[test]
fn unequal_chain_headers_follow_the_tenant_policy() {
    let now = Timestamp::now();
    let require = ResolvedPolicy {
        strategy: crate::core::policy::StrategyGates {
            require_chain: true,
            ..Default::default()
        },
        ..ResolvedPolicy::default()
    };
    let router = Arc::new(Router::new(
        IndexConfig::default(),
        PolicySnapshot::new(require, vec![], vec![]),
        now,
    ));
    let metrics = Metrics::new(router.clone(), Arc::new(SourceStatus::new()));
    let parsed = RoutingHeaders::parse([
        (TENANT, &b"acme"[..]),
        (MODEL, &b"llama"[..]),
        (HASH_SCHEME, &b"vllm"[..]),
        (BLOCK_HASHES, &b"a1,a2"[..]),
        (BLOCK_TOKEN_COUNTS, &b"16"[..]),
        (DEBUG, &b"1"[..]),
    ]);
    let verdict =
        verdict::Verdict::decide(&router, &metrics, &ExtProcConfig::default(), &parsed, now);
    // Under requireChain a malformed chain is "no valid chain", not NO_HINT.
    assert!(
        verdict
            .debug_echo
            .iter()
            .any(|(k, v)| *k == REASON && v == "POLICY_REQUIRES_CHAIN"),
        "{:?}",
        verdict.debug_echo
    );
}

/// Block identity through the ext_proc path: under ic-content-v2, r2 holds the
/// prompt under adapter "sql", r3 without an adapter; the request's adapter header
/// picks which blocks it matches.
#[test]
fn the_lora_adapter_header_selects_the_blocks_of_that_adapter() {
    use crate::core::chain::{self, BlockIdentity, IC_CONTENT_V2, Scheme};
    let svc = mk_service_with(ExtProcConfig::default(), cache_pick_policy());
    let tokens: Vec<u32> = (0..96).collect();
    let now = Timestamp::now();
    for (replica, endpoint, lora) in [
        ("r2", "127.0.0.1:8002", "sql"),
        ("r3", "127.0.0.1:8003", ""),
    ] {
        let keys = chain::own_chain(
            Scheme::ContentV2,
            16,
            &tokens,
            &BlockIdentity {
                lora,
                ..BlockIdentity::default()
            },
        )
        .unwrap();
        let events = [IndexEvent::Stored {
            parent: None,
            hashes: keys,
            token_counts: vec![],
        }];
        let batch = IngestBatch {
            scope: ScopeRef::new("acme", "llama", IC_CONTENT_V2),
            replica_id: replica,
            endpoint,
            events: &events,
        };
        svc.router.ingest(&batch, now).unwrap();
    }
    let chain = chain::compute_chain(Scheme::ContentV2, &tokens, 16, None).unwrap();
    let request = |extra: &[(&'static str, &'static str)]| {
        let mut h = chain_headers(extra);
        h[2].1 = IC_CONTENT_V2.into();
        h[3].1 = format_chain(&chain);
        h
    };
    for (extra, want) in [(&[(LORA_ADAPTER, "sql")][..], "r2"), (&[][..], "r3")] {
        let (reply, _) = ask(&svc, &request(extra));
        let c = common(&reply);
        assert_eq!(set_value(c, REASON).as_deref(), Some("PREFIX_MATCH"));
        assert_eq!(set_value(c, REPLICA).as_deref(), Some(want));
    }
    // An adapter nobody holds: no match (not the adapter-less r3's blocks).
    let (reply, _) = ask(&svc, &request(&[(LORA_ADAPTER, "chat")]));
    assert_ne!(
        set_value(common(&reply), REASON).as_deref(),
        Some("PREFIX_MATCH")
    );
    // A repeated adapter header: NO_HINT, and the debug echo says why.
    let (reply, echo) = ask(
        &svc,
        &request(&[(LORA_ADAPTER, "sql"), (LORA_ADAPTER, "chat"), (DEBUG, "1")]),
    );
    assert_eq!(
        set_value(common(&reply), REASON).as_deref(),
        Some("NO_HINT")
    );
    let detail = echo
        .iter()
        .filter_map(|o| o.header.as_ref())
        .find(|h| h.key == DETAIL)
        .map(|h| String::from_utf8_lossy(&h.raw_value).into_owned());
    assert_eq!(
        detail.as_deref(),
        Some("x-inferencecache-lora-adapter appears more than once")
    );
}

mod body;
