//! Body mode on the stream: held headers, FULL_DUPLEX_STREAMED and BUFFERED
//! replies, the size limit, trailers, the subset hint. The body router here is a
//! test double (a tiny JSON reader), not body mode's real one.

use super::*;
use crate::adapters::ext_proc::body::{BodyMiss, BodyRouter};
use crate::adapters::ext_proc::held::CHUNK_BYTES;
use crate::adapters::ext_proc::subset::{SUBSET_KEY, SUBSET_NAMESPACE};
use envoy_types::pb::envoy::config::core::v3::Metadata;
use envoy_types::pb::envoy::service::ext_proc::v3::ProtocolConfiguration;
use envoy_types::pb::google::protobuf::ListValue;

/// Test double: `{"model": "...", "chain": [u64, ...]}` on `/v1/*`, each block
/// 16 tokens, tenant acme, hash scheme vllm. Wants a body only when the headers
/// carry no chain.
struct JsonChainDouble {
    limit: usize,
}

impl BodyRouter for JsonChainDouble {
    fn wants_body(&self, path: &str, headers: &RoutingFields) -> bool {
        path.starts_with("/v1/") && headers.block_hashes.is_empty()
    }
    fn max_body_bytes(&self) -> usize {
        self.limit
    }
    fn route(
        &self,
        _path: &str,
        headers: &RoutingFields,
        body: &[u8],
    ) -> Result<RoutingFields, BodyMiss> {
        let v: serde_json::Value =
            serde_json::from_slice(body).map_err(|e| BodyMiss::InvalidJson(e.to_string()))?;
        let model = v["model"]
            .as_str()
            .ok_or_else(|| BodyMiss::NotOpenAi("no model".into()))?;
        let chain: Vec<u64> = v["chain"]
            .as_array()
            .ok_or_else(|| BodyMiss::NotOpenAi("no chain".into()))?
            .iter()
            .filter_map(serde_json::Value::as_u64)
            .collect();
        Ok(RoutingFields {
            tenant: "acme".into(),
            model: model.into(),
            hash_scheme: "vllm".into(),
            block_token_counts: vec![16; chain.len()],
            block_hashes: chain,
            ..headers.clone()
        })
    }
}

fn body_service(limit: usize) -> ExtProc {
    mk_service(ExtProcConfig::default()).with_body_router(Arc::new(JsonChainDouble { limit }))
}

fn body_json() -> Vec<u8> {
    let chain: Vec<String> = CHAIN.iter().map(u64::to_string).collect();
    format!(
        "{{\"model\": \"llama\", \"chain\": [{}], \"pad\": \"{}\"}}",
        chain.join(","),
        "x".repeat(200)
    )
    .into_bytes()
}

/// [`body_json`] padded to at least `len` bytes.
fn padded_body_json(len: usize) -> Vec<u8> {
    let chain: Vec<String> = CHAIN.iter().map(u64::to_string).collect();
    format!(
        "{{\"model\": \"llama\", \"chain\": [{}], \"pad\": \"{}\"}}",
        chain.join(","),
        "x".repeat(len)
    )
    .into_bytes()
}

fn protocol(mode: BodySendMode) -> ProtocolConfiguration {
    ProtocolConfiguration {
        request_body_mode: mode as i32,
        response_body_mode: BodySendMode::None as i32,
        ..ProtocolConfiguration::default()
    }
}

/// The first message of a body-mode stream: headers, not the end of the request.
fn headers_msg(
    mode: BodySendMode,
    pairs: &[(&str, &str)],
    subset: Option<&[&str]>,
) -> ProcessingRequest {
    let mut all: Vec<(&str, &str)> = vec![(":path", "/v1/completions"), (":method", "POST")];
    all.extend_from_slice(pairs);
    let mut msg = mk_request(&all);
    if let Some(Message::RequestHeaders(h)) = &mut msg.request {
        h.end_of_stream = false;
    }
    msg.protocol_config = Some(protocol(mode));
    msg.metadata_context = subset.map(|addrs| {
        let list = Value {
            kind: Some(Kind::ListValue(ListValue {
                values: addrs.iter().map(|a| string_value(a)).collect(),
            })),
        };
        let inner = Struct {
            fields: [(SUBSET_KEY.to_string(), list)].into(),
        };
        Metadata {
            filter_metadata: [(SUBSET_NAMESPACE.to_string(), inner)].into(),
            ..Metadata::default()
        }
    });
    msg
}

fn body_msg(chunk: &[u8], end_of_stream: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(Message::RequestBody(HttpBody {
            body: chunk.to_vec(),
            end_of_stream,
            ..HttpBody::default()
        })),
        ..ProcessingRequest::default()
    }
}

fn send(svc: &ExtProc, st: &mut StreamState, msg: ProcessingRequest) -> Vec<ProcessingResponse> {
    let mut out = Vec::new();
    svc.answer_into(msg, st, &mut out);
    out
}

/// The streamed body chunks of replies, with their end_of_stream flags.
fn streamed(replies: &[ProcessingResponse]) -> Vec<(Vec<u8>, bool)> {
    replies
        .iter()
        .filter_map(|r| match &r.response {
            Some(Reply::RequestBody(b)) => match b
                .response
                .as_ref()?
                .body_mutation
                .as_ref()?
                .mutation
                .as_ref()?
            {
                Mutation::StreamedResponse(s) => Some((s.body.clone(), s.end_of_stream)),
                _ => None,
            },
            _ => None,
        })
        .collect()
}

fn echo_value(st: &StreamState, name: &str) -> Option<String> {
    st.echo.iter().find_map(|o| {
        let h = o.header.as_ref()?;
        (h.key == name).then(|| String::from_utf8_lossy(&h.raw_value).into_owned())
    })
}

#[test]
fn full_duplex_holds_the_headers_until_the_body_is_complete_then_routes_on_it() {
    let svc = body_service(1 << 20);
    let mut st = StreamState::default();
    let body = body_json();
    let (a, b) = body.split_at(37);
    assert!(
        send(
            &svc,
            &mut st,
            headers_msg(
                BodySendMode::FullDuplexStreamed,
                &[(DEBUG, "1"), ("content-length", "999")],
                None
            )
        )
        .is_empty()
    );
    assert!(
        send(&svc, &mut st, body_msg(a, false)).is_empty(),
        "nothing before the decision"
    );
    let out = send(&svc, &mut st, body_msg(b, true));
    // Headers first, carrying the decision made on the body's chain.
    let c = common(&out[0]);
    assert_eq!(set_value(c, REASON).as_deref(), Some("PREFIX_MATCH"));
    assert_eq!(
        set_value(c, DEFAULT_DESTINATION_HEADER).as_deref(),
        Some("127.0.0.1:8001")
    );
    assert!(c.clear_route_cache);
    let md = out[0].dynamic_metadata.as_ref().unwrap();
    let Some(Kind::StructValue(lb)) = md.fields[LB_METADATA_NAMESPACE].kind.as_ref() else {
        panic!("no envoy.lb")
    };
    assert_eq!(
        lb.fields[LB_METADATA_KEY].kind,
        Some(Kind::StringValue("127.0.0.1:8001".into()))
    );
    assert!(
        out[0].mode_override.is_none(),
        "no mode override in FULL_DUPLEX_STREAMED"
    );
    // Then the body, byte for byte, ending the stream.
    let chunks = streamed(&out[1..]);
    assert_eq!(chunks.len(), out.len() - 1);
    assert_eq!(
        chunks
            .iter()
            .flat_map(|(b, _)| b.clone())
            .collect::<Vec<u8>>(),
        body
    );
    assert_eq!(chunks.last().map(|c| c.1), Some(true));
    assert!(st.held.is_none(), "nothing kept after the decision");
    assert_eq!(inflight_of(&svc, "r1"), 1);
    send(
        &svc,
        &mut st,
        ProcessingRequest {
            request: Some(Message::ResponseHeaders(HttpHeaders::default())),
            ..ProcessingRequest::default()
        },
    );
    assert_eq!(
        inflight_of(&svc, "r1"),
        0,
        "released on the response headers"
    );
}

#[test]
fn a_large_body_comes_back_in_chunks_no_larger_than_the_limit() {
    let svc = body_service(1 << 20);
    let mut st = StreamState::default();
    let mut body = body_json();
    body.truncate(body.len() - 2);
    body.extend(std::iter::repeat_n(b'y', 3 * CHUNK_BYTES));
    body.extend_from_slice(b"\"}");
    send(
        &svc,
        &mut st,
        headers_msg(BodySendMode::FullDuplexStreamed, &[], None),
    );
    for piece in body
        .chunks(16_384)
        .collect::<Vec<_>>()
        .split_last()
        .map(|(l, rest)| {
            let mut v: Vec<&[u8]> = rest.to_vec();
            v.push(l);
            v
        })
        .unwrap()
    {
        let last = piece.as_ptr_range().end == body.as_ptr_range().end;
        let out = send(&svc, &mut st, body_msg(piece, last));
        if last {
            assert_eq!(set_value(common(&out[0]), REPLICA).as_deref(), Some("r1"));
            let chunks = streamed(&out[1..]);
            assert!(chunks.len() >= 4 && chunks.iter().all(|(c, _)| c.len() <= CHUNK_BYTES));
            assert_eq!(chunks.concat_bytes(), body);
            assert!(chunks[..chunks.len() - 1].iter().all(|(_, eos)| !eos));
        } else {
            assert!(out.is_empty());
        }
    }
}

trait ConcatBytes {
    fn concat_bytes(&self) -> Vec<u8>;
}
impl ConcatBytes for Vec<(Vec<u8>, bool)> {
    fn concat_bytes(&self) -> Vec<u8> {
        self.iter().flat_map(|(b, _)| b.clone()).collect()
    }
}

#[test]
fn over_the_limit_decides_without_the_body_and_streams_every_byte_on() {
    let svc = body_service(100);
    let mut st = StreamState::default();
    send(
        &svc,
        &mut st,
        headers_msg(
            BodySendMode::FullDuplexStreamed,
            &[
                (DEBUG, "1"),
                (TENANT, "acme"),
                (MODEL, "llama"),
                (HASH_SCHEME, "vllm"),
            ],
            None,
        ),
    );
    assert!(send(&svc, &mut st, body_msg(&[b'a'; 60], false)).is_empty());
    let out = send(&svc, &mut st, body_msg(&[b'b'; 60], false));
    let c = common(&out[0]);
    assert_ne!(set_value(c, REASON).as_deref(), Some("PREFIX_MATCH"));
    let detail = echo_value(&st, DETAIL).unwrap();
    assert!(detail.starts_with("body_too_large"), "{detail}");
    let mut got = streamed(&out[1..]).concat_bytes();
    assert!(streamed(&out[1..]).iter().all(|(_, eos)| !eos));
    // Later chunks are echoed as they come; the buffer is gone.
    assert!(st.held.is_none());
    let out = send(&svc, &mut st, body_msg(b"tail", true));
    assert_eq!(out.len(), 1);
    let tail = streamed(&out);
    assert!(tail[0].1);
    got.extend(tail.concat_bytes());
    let mut want = vec![b'a'; 60];
    want.extend([b'b'; 60]);
    want.extend(b"tail");
    assert_eq!(got, want);
}

#[test]
fn trailers_complete_the_body_and_come_after_it() {
    let svc = body_service(1 << 20);
    let mut st = StreamState::default();
    let body = body_json();
    send(
        &svc,
        &mut st,
        headers_msg(BodySendMode::FullDuplexStreamed, &[], None),
    );
    assert!(send(&svc, &mut st, body_msg(&body, false)).is_empty());
    let trailers = ProcessingRequest {
        request: Some(Message::RequestTrailers(HttpTrailers::default())),
        ..ProcessingRequest::default()
    };
    let out = send(&svc, &mut st, trailers);
    assert_eq!(set_value(common(&out[0]), REPLICA).as_deref(), Some("r1"));
    let chunks = streamed(&out[1..out.len() - 1]);
    assert_eq!(chunks.concat_bytes(), body);
    assert!(
        chunks.iter().all(|(_, eos)| !eos),
        "the trailers end the stream, not the body"
    );
    assert!(matches!(
        out.last().unwrap().response,
        Some(Reply::RequestTrailers(_))
    ));
}

#[test]
fn invalid_json_is_served_with_the_reason_when_debugging() {
    let svc = body_service(1 << 20);
    let mut st = StreamState::default();
    send(
        &svc,
        &mut st,
        headers_msg(BodySendMode::FullDuplexStreamed, &[(DEBUG, "1")], None),
    );
    let out = send(&svc, &mut st, body_msg(b"{not json", true));
    assert_eq!(
        set_value(common(&out[0]), REASON).as_deref(),
        Some("NO_HINT")
    );
    assert!(echo_value(&st, DETAIL).unwrap().starts_with("invalid_json"));
    assert_eq!(streamed(&out[1..]), vec![(b"{not json".to_vec(), true)]);
}

#[test]
fn a_body_it_does_not_want_is_echoed_after_an_immediate_decision() {
    let svc = body_service(1 << 20);
    let mut st = StreamState::default();
    // A chain in the headers: the body is not needed.
    let pairs = chain_headers(&[]);
    let borrowed: Vec<(&str, &str)> = pairs.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let out = send(
        &svc,
        &mut st,
        headers_msg(BodySendMode::FullDuplexStreamed, &borrowed, None),
    );
    assert_eq!(out.len(), 1);
    assert_eq!(set_value(common(&out[0]), REPLICA).as_deref(), Some("r1"));
    let out = send(&svc, &mut st, body_msg(b"abc", false));
    assert_eq!(streamed(&out), vec![(b"abc".to_vec(), false)]);
    let out = send(&svc, &mut st, body_msg(b"", true));
    assert_eq!(streamed(&out), vec![(Vec::new(), true)]);
}

#[test]
fn without_a_body_router_full_duplex_bodies_are_still_echoed() {
    let svc = mk_service(ExtProcConfig::default());
    let mut st = StreamState::default();
    let out = send(
        &svc,
        &mut st,
        headers_msg(BodySendMode::FullDuplexStreamed, &[], None),
    );
    assert!(matches!(out[0].response, Some(Reply::RequestHeaders(_))));
    let out = send(&svc, &mut st, body_msg(b"{}", true));
    assert_eq!(streamed(&out), vec![(b"{}".to_vec(), true)]);
}

#[test]
fn headers_that_end_the_request_are_decided_at_once_in_body_mode() {
    let svc = body_service(1 << 20);
    let mut st = StreamState::default();
    let mut msg = headers_msg(BodySendMode::FullDuplexStreamed, &[], None);
    if let Some(Message::RequestHeaders(h)) = &mut msg.request {
        h.end_of_stream = true;
    }
    let out = send(&svc, &mut st, msg);
    assert_eq!(out.len(), 1);
    assert!(matches!(out[0].response, Some(Reply::RequestHeaders(_))));
}

#[test]
fn buffered_answers_the_headers_then_decides_in_the_body_reply() {
    let svc = body_service(1 << 20);
    let mut st = StreamState::default();
    let out = send(
        &svc,
        &mut st,
        headers_msg(BodySendMode::Buffered, &[(REPLICA, "forged")], None),
    );
    assert_eq!(
        out.len(),
        1,
        "Envoy waits for this reply before sending the body"
    );
    assert!(matches!(&out[0].response, Some(Reply::RequestHeaders(h)) if h.response.is_none()));
    let out = send(&svc, &mut st, body_msg(&body_json(), true));
    assert_eq!(out.len(), 1);
    let Some(Reply::RequestBody(b)) = &out[0].response else {
        panic!("not a body reply: {:?}", out[0])
    };
    let c = b.response.as_ref().unwrap();
    assert_eq!(
        set_value(c, DEFAULT_DESTINATION_HEADER).as_deref(),
        Some("127.0.0.1:8001")
    );
    assert_eq!(
        set_value(c, REPLICA).as_deref(),
        Some("r1"),
        "the forged copy is overwritten"
    );
    assert!(c.clear_route_cache);
    assert!(
        c.body_mutation.is_none(),
        "the buffered body goes on unchanged"
    );
    assert!(out[0].dynamic_metadata.is_some());
}

#[test]
fn buffered_over_the_limit_is_decided_without_the_body() {
    let svc = body_service(10);
    let mut st = StreamState::default();
    send(
        &svc,
        &mut st,
        headers_msg(BodySendMode::Buffered, &[(DEBUG, "1")], None),
    );
    let out = send(&svc, &mut st, body_msg(&body_json(), true));
    assert!(matches!(out[0].response, Some(Reply::RequestBody(_))));
    assert!(
        echo_value(&st, DETAIL)
            .unwrap()
            .starts_with("body_too_large")
    );
}

#[test]
fn the_subset_hint_narrows_the_pick() {
    // r1 holds the chain, but the gateway allows only r2's endpoint.
    let svc = body_service(1 << 20);
    let mut st = StreamState::default();
    send(
        &svc,
        &mut st,
        headers_msg(
            BodySendMode::FullDuplexStreamed,
            &[],
            Some(&["127.0.0.1:8002", "10.9.9.9:1"]),
        ),
    );
    let out = send(&svc, &mut st, body_msg(&body_json(), true));
    let c = common(&out[0]);
    assert_eq!(
        set_value(c, DEFAULT_DESTINATION_HEADER).as_deref(),
        Some("127.0.0.1:8002")
    );
    assert_eq!(set_value(c, REPLICA).as_deref(), Some("r2"));
}

#[test]
fn the_subset_hint_gets_a_destination_even_without_a_hint() {
    // Headers-only, no chain: override-host would leave the pick to Envoy, but a
    // subset must be obeyed.
    let svc = mk_service(ExtProcConfig::default());
    let mut st = StreamState::default();
    let mut msg = headers_msg(
        BodySendMode::None,
        &[(TENANT, "acme"), (MODEL, "llama"), (HASH_SCHEME, "vllm")],
        Some(&["127.0.0.1:8003"]),
    );
    msg.protocol_config = None;
    let out = send(&svc, &mut st, msg);
    assert_eq!(
        set_value(common(&out[0]), DEFAULT_DESTINATION_HEADER).as_deref(),
        Some("127.0.0.1:8003")
    );
}

#[test]
fn an_empty_eligible_subset_is_a_503() {
    for subset in [&["10.9.9.9:1"][..], &[][..]] {
        let svc = body_service(1 << 20);
        let mut st = StreamState::default();
        send(
            &svc,
            &mut st,
            headers_msg(BodySendMode::FullDuplexStreamed, &[], Some(subset)),
        );
        let out = send(&svc, &mut st, body_msg(&body_json(), true));
        assert_eq!(out.len(), 1, "no body after an immediate response");
        let Some(Reply::ImmediateResponse(im)) = &out[0].response else {
            panic!("expected 503, got {:?}", out[0])
        };
        assert_eq!(im.status.as_ref().map(|s| s.code), Some(503));
        assert!(String::from_utf8_lossy(&im.body).contains("subset"));
        assert_eq!(inflight_of(&svc, "r1") + inflight_of(&svc, "r2"), 0);
        assert!(send(&svc, &mut st, body_msg(b"late", true)).is_empty());
    }
}

fn original_dst_body_service() -> ExtProc {
    mk_service(ExtProcConfig {
        destination_mode: DestinationMode::OriginalDst,
        ..ExtProcConfig::default()
    })
    .with_body_router(Arc::new(JsonChainDouble { limit: 1 << 20 }))
}

/// A full-duplex request with no headers of its own: the replies to its body.
fn full_duplex_body(
    svc: &ExtProc,
    subset: Option<&[&str]>,
    body: &[u8],
) -> Vec<ProcessingResponse> {
    let mut st = StreamState::default();
    send(
        svc,
        &mut st,
        headers_msg(BodySendMode::FullDuplexStreamed, &[], subset),
    );
    send(svc, &mut st, body_msg(body, true))
}

fn destination_of(reply: &ProcessingResponse) -> Option<String> {
    set_value(common(reply), DEFAULT_DESTINATION_HEADER)
}

#[test]
fn original_dst_serves_a_body_that_names_no_scope_on_the_fleet() {
    // GIE style: no scope headers, and the body gives none (invalid JSON, an
    // unknown model). There is no scope to fall back on, so a serving replica of
    // the fleet gets it: served, never a 503; ties go round-robin.
    let svc = original_dst_body_service();
    let mut picked = std::collections::BTreeSet::new();
    for body in [&b"{not json"[..], b"{\"model\": \"gpt-9\"}"].repeat(3) {
        let out = full_duplex_body(&svc, None, body);
        let dest = destination_of(&out[0]).expect("a destination, not a 503");
        assert_eq!(streamed(&out[1..]), vec![(body.to_vec(), true)]);
        picked.insert(dest);
    }
    let all: std::collections::BTreeSet<String> =
        ["127.0.0.1:8001", "127.0.0.1:8002", "127.0.0.1:8003"]
            .map(String::from)
            .into();
    assert_eq!(picked, all, "equally loaded replicas take turns");
}

#[test]
fn original_dst_fleet_fallback_obeys_the_subset() {
    let svc = original_dst_body_service();
    for _ in 0..3 {
        let out = full_duplex_body(&svc, Some(&["127.0.0.1:8002", "10.9.9.9:1"]), b"{not json");
        assert_eq!(destination_of(&out[0]).as_deref(), Some("127.0.0.1:8002"));
    }
    // A subset naming nothing of the fleet: the protocol's 503.
    let out = full_duplex_body(&svc, Some(&["10.9.9.9:1"]), b"{not json");
    let Some(Reply::ImmediateResponse(im)) = &out[0].response else {
        panic!("expected 503, got {:?}", out[0])
    };
    assert_eq!(im.status.as_ref().map(|s| s.code), Some(503));
}

#[test]
fn original_dst_still_refuses_a_named_scope_without_replicas() {
    // Headers that name a scope nobody serves stay a 503 (docs/reference.md, "Envoy ext_proc"): the
    // fleet is only for requests whose scope is unknown because the body gave none.
    let svc = original_dst_body_service();
    let mut st = StreamState::default();
    let mut msg = headers_msg(
        BodySendMode::None,
        &[
            (TENANT, "acme"),
            (MODEL, "other-model"),
            (HASH_SCHEME, "vllm"),
        ],
        None,
    );
    msg.protocol_config = None;
    let out = send(&svc, &mut st, msg);
    let Some(Reply::ImmediateResponse(im)) = &out[0].response else {
        panic!("expected 503, got {:?}", out[0])
    };
    assert_eq!(im.status.as_ref().map(|s| s.code), Some(503));
    assert!(String::from_utf8_lossy(&im.body).contains("no serving replica"));
}

#[test]
fn full_duplex_response_bodies_are_echoed() {
    let svc = mk_service(ExtProcConfig::default());
    let mut st = StreamState::default();
    let mut msg = headers_msg(BodySendMode::FullDuplexStreamed, &[], None);
    msg.protocol_config = Some(ProtocolConfiguration {
        request_body_mode: BodySendMode::FullDuplexStreamed as i32,
        response_body_mode: BodySendMode::FullDuplexStreamed as i32,
        ..ProtocolConfiguration::default()
    });
    send(&svc, &mut st, msg);
    let resp = ProcessingRequest {
        request: Some(Message::ResponseBody(HttpBody {
            body: b"data: hi\n\n".to_vec(),
            end_of_stream: true,
            ..HttpBody::default()
        })),
        ..ProcessingRequest::default()
    };
    let out = send(&svc, &mut st, resp);
    let Some(Reply::ResponseBody(b)) = &out[0].response else {
        panic!()
    };
    let Some(Mutation::StreamedResponse(s)) = b
        .response
        .as_ref()
        .unwrap()
        .body_mutation
        .as_ref()
        .unwrap()
        .mutation
        .as_ref()
    else {
        panic!()
    };
    assert_eq!(
        (s.body.as_slice(), s.end_of_stream),
        (&b"data: hi\n\n"[..], true)
    );
}

#[tokio::test]
async fn the_stream_sends_every_reply_in_order() {
    let svc = body_service(1 << 20);
    let body = body_json();
    let msgs = vec![
        Ok::<_, Status>(headers_msg(BodySendMode::FullDuplexStreamed, &[], None)),
        Ok(body_msg(&body[..10], false)),
        Ok(body_msg(&body[10..], true)),
    ];
    let mut st = StreamState::default();
    let mut inbound = futures::stream::iter(msgs);
    let mut out = Vec::new();
    while let Some(m) = next_message(&mut st, &mut inbound).await {
        svc.answer_into(m, &mut st, &mut out);
    }
    assert!(matches!(out[0].response, Some(Reply::RequestHeaders(_))));
    assert_eq!(streamed(&out[1..]).concat_bytes(), body);
}

/// Test double whose routing blocks its thread until released (or 5 s pass,
/// then it gives no chain): run on the async worker, it would stall every
/// stream of a one-thread runtime.
struct BlockingDouble {
    started: parking_lot::Mutex<Option<tokio::sync::oneshot::Sender<()>>>,
    release: parking_lot::Mutex<std::sync::mpsc::Receiver<()>>,
}

impl BodyRouter for BlockingDouble {
    fn wants_body(&self, path: &str, headers: &RoutingFields) -> bool {
        JsonChainDouble { limit: 0 }.wants_body(path, headers)
    }
    fn max_body_bytes(&self) -> usize {
        1 << 20
    }
    fn route(
        &self,
        path: &str,
        headers: &RoutingFields,
        body: &[u8],
    ) -> Result<RoutingFields, BodyMiss> {
        if let Some(s) = self.started.lock().take() {
            let _ = s.send(());
        }
        self.release
            .lock()
            .recv_timeout(std::time::Duration::from_secs(5))
            .map_err(|_| {
                BodyMiss::NotOpenAi("never released: routed on the async worker".into())
            })?;
        JsonChainDouble { limit: 1 << 20 }.route(path, headers, body)
    }
}

#[tokio::test(flavor = "current_thread")]
async fn a_large_body_is_routed_off_the_async_worker_while_other_streams_are_served() {
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let (release_tx, release_rx) = std::sync::mpsc::channel();
    let svc = mk_service(ExtProcConfig::default()).with_body_router(Arc::new(BlockingDouble {
        started: parking_lot::Mutex::new(Some(started_tx)),
        release: parking_lot::Mutex::new(release_rx),
    }));
    let body = padded_body_json(BLOCKING_ROUTE_BYTES);
    let large = vec![
        Ok::<_, Status>(headers_msg(BodySendMode::FullDuplexStreamed, &[], None)),
        Ok(body_msg(&body, true)),
    ];
    let a = tokio::spawn(
        replies(
            svc.clone(),
            futures::stream::iter(large),
            StreamState::default(),
        )
        .collect::<Vec<_>>(),
    );
    started_rx.await.unwrap();
    // Stream A is inside its body routing; on this one-thread runtime stream B
    // is answered only if that routing is not holding the thread.
    let h = chain_headers(&[]);
    let pairs: Vec<(&str, &str)> = h.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let b: Vec<_> = replies(
        svc.clone(),
        futures::stream::iter(vec![Ok::<_, Status>(mk_request(&pairs))]),
        StreamState::default(),
    )
    .collect()
    .await;
    assert_eq!(b.len(), 1);
    assert!(matches!(
        b[0].as_ref().unwrap().response,
        Some(Reply::RequestHeaders(_))
    ));
    release_tx.send(()).unwrap();
    let a: Vec<ProcessingResponse> = a.await.unwrap().into_iter().map(Result::unwrap).collect();
    let c = common(&a[0]);
    assert_eq!(set_value(c, REASON).as_deref(), Some("PREFIX_MATCH"));
    assert_eq!(
        set_value(c, DEFAULT_DESTINATION_HEADER).as_deref(),
        Some("127.0.0.1:8001")
    );
    assert_eq!(streamed(&a[1..]).concat_bytes(), body);
}

#[tokio::test]
async fn a_small_body_is_routed_inline_and_trailers_still_come_last() {
    let svc = body_service(1 << 20);
    let body = br#"{"model": "llama", "chain": [1]}"#.to_vec();
    assert!(body.len() < BLOCKING_ROUTE_BYTES);
    for body in [body, padded_body_json(BLOCKING_ROUTE_BYTES)] {
        let trailers = ProcessingRequest {
            request: Some(Message::RequestTrailers(Default::default())),
            ..ProcessingRequest::default()
        };
        let msgs = vec![
            Ok::<_, Status>(headers_msg(BodySendMode::FullDuplexStreamed, &[], None)),
            Ok(body_msg(&body, false)),
            Ok(trailers),
        ];
        let out: Vec<ProcessingResponse> = replies(
            svc.clone(),
            futures::stream::iter(msgs),
            StreamState::default(),
        )
        .map(Result::unwrap)
        .collect()
        .await;
        assert!(matches!(out[0].response, Some(Reply::RequestHeaders(_))));
        assert_eq!(streamed(&out[1..out.len() - 1]).concat_bytes(), body);
        assert!(matches!(
            out.last().unwrap().response,
            Some(Reply::RequestTrailers(_))
        ));
    }
}

#[test]
fn a_bodiless_request_outside_any_scope_is_served_by_a_subset_member() {
    // GIE style (ORIGINAL_DST, FULL_DUPLEX_STREAMED, fail-closed gateway): a
    // `GET /health` has no model and no chain, and the pool's replicas reported
    // no KV events yet. A subset endpoint the policy declares is still a member
    // of the pool, so it serves the request; a subset of strangers is the 503.
    let now = Timestamp::now();
    let snapshot = mk_snapshot_with(
        &[
            ("r1", "127.0.0.1:8001"),
            ("r2", "127.0.0.1:8002"),
            ("r3", "127.0.0.1:8003"),
        ],
        ResolvedPolicy::default(),
    );
    let router = Arc::new(Router::new(IndexConfig::default(), snapshot, now));
    let metrics = Arc::new(Metrics::new(router.clone(), Arc::new(SourceStatus::new())));
    let svc = ExtProc::new(
        router,
        metrics,
        ExtProcConfig {
            destination_mode: DestinationMode::OriginalDst,
            ..ExtProcConfig::default()
        },
    )
    .with_body_router(Arc::new(JsonChainDouble { limit: 1 << 20 }));
    let health = |subset: &[&str]| {
        let mut st = StreamState::default();
        let mut msg = mk_request(&[(":path", "/health"), (":method", "GET")]);
        if let Some(Message::RequestHeaders(h)) = &mut msg.request {
            h.end_of_stream = true;
        }
        msg.protocol_config = Some(protocol(BodySendMode::FullDuplexStreamed));
        let mut with_subset = headers_msg(BodySendMode::FullDuplexStreamed, &[], Some(subset));
        msg.metadata_context = with_subset.metadata_context.take();
        send(&svc, &mut st, msg)
    };
    let out = health(&["127.0.0.1:8002"]);
    assert_eq!(
        destination_of(&out[0]).as_deref(),
        Some("127.0.0.1:8002"),
        "{out:?}"
    );
    let out = health(&["10.9.9.9:1", "127.0.0.1:8003"]);
    assert_eq!(destination_of(&out[0]).as_deref(), Some("127.0.0.1:8003"));
    let out = health(&["10.9.9.9:1"]);
    let Some(Reply::ImmediateResponse(im)) = &out[0].response else {
        panic!("expected 503, got {:?}", out[0])
    };
    assert_eq!(im.status.as_ref().map(|s| s.code), Some(503));
    assert!(String::from_utf8_lossy(&im.body).contains("no_eligible_endpoint_in_subset"));
}
