//! The Envoy ext_proc v3 server (docs/reference.md, "Envoy ext_proc"): headers-only, and body mode as the
//! Gateway API Inference Extension's endpoint-picker protocol uses it.
//!
//! ```text
//!  Envoy ──ProcessingRequest──▶ stream loop ──request headers──▶ headers::RoutingHeaders::parse
//!                                   │        (+ body, when a BodyRouter wants it: held::HeldRequest)
//!                                   │                                   │
//!                                   │                         verdict::Verdict::decide_input (router)
//!                                   │                                   │
//!        ◀──ProcessingResponse──────┴──── header mutation, envoy.lb metadata, clear_route_cache,
//!                                          the body streamed back unchanged, or ImmediateResponse 503
//! ```
//!
//! One stream is one HTTP request. Headers-only (the fast path): the decision is
//! the reply to the request headers. Body mode (Envoy's `request_body_mode`,
//! announced in the first message's `protocol_config`):
//! - `FULL_DUPLEX_STREAMED`: the headers reply waits until the body is complete
//!   (its last chunk, or the trailers) or crosses the body router's limit; then the
//!   headers reply goes out, followed by the held body as `StreamedBodyResponse`
//!   chunks, byte for byte, and every later chunk is echoed as it comes.
//! - `BUFFERED`: Envoy sends the body only after the headers reply, so that reply is
//!   an empty "continue" and the decision rides on the body reply (Envoy still
//!   holds the headers then and applies its mutation).
//!
//! Routing a body (tokenizing up to a million tokens: ~0.1 s for 32k) runs on
//! tokio's blocking pool once the body is over [`BLOCKING_ROUTE_BYTES`], so the
//! async workers keep serving the other streams meanwhile.
//!
//! Above capacity (the tenant's `spec.flowControl`, see `flow` and
//! docs/flow-control.md), a request about to be decided may instead be held: Envoy
//! is asked to wait longer for this message, the stream loop awaits the release
//! beside the inbound messages (their end is the client gone), and the decision
//! runs at release; or it is shed with an ImmediateResponse 429.
//!
//! The gateway's endpoint subset (filter metadata, see `subset`) narrows the pick.
//! What to echo on the response headers for a debugging client is kept across the
//! stream; a message with nothing in it gets no reply, and the stream never fails
//! on what it does not use.

pub mod body;
pub mod flow;
pub mod headers;
pub mod held;
pub mod subset;
pub mod verdict;

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::{
    HeaderMap, HeaderValue, HeaderValueOption, header_value_option::HeaderAppendAction,
};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::{
    ProcessingMode,
    processing_mode::{BodySendMode, HeaderSendMode},
};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, HttpBody,
    HttpHeaders, ImmediateResponse, ProcessingRequest, ProcessingResponse, StreamedBodyResponse,
    TrailersResponse,
    body_mutation::Mutation,
    external_processor_server::{ExternalProcessor, ExternalProcessorServer},
    processing_request::Request as Message,
    processing_response::Response as Reply,
};
use envoy_types::pb::envoy::r#type::v3::{HttpStatus, StatusCode};
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};
use futures::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};

use crate::adapters::drain::{Drain, StreamGuard};
use crate::adapters::metrics::Metrics;
use crate::core::Router;
use crate::core::load::{INFLIGHT_AGE_OUT, Inflight};
use crate::core::time::Timestamp;
use body::{BodyMiss, BodyRouter};
use headers::RoutingHeaders;
use held::{Collect, HeldRequest};
pub use verdict::{DestinationMode, ExtProcConfig, InflightRelease, Verdict};

/// The dynamic metadata namespace and key Envoy's load balancers read the
/// destination from (docs/reference.md, "Envoy ext_proc"; fixed whatever the header is named).
pub const LB_METADATA_NAMESPACE: &str = "envoy.lb";
pub const LB_METADATA_KEY: &str = "x-gateway-destination-endpoint";

/// The ext_proc service.
#[derive(Clone)]
pub struct ExtProc {
    router: Arc<Router>,
    metrics: Arc<Metrics>,
    config: Arc<ExtProcConfig>,
    drain: Drain,
    /// Body mode: turns an OpenAI body into routing fields (None: headers only).
    body_router: Option<Arc<dyn BodyRouter>>,
    /// Flow control: holds requests while every eligible replica is saturated.
    flow: Arc<flow::FlowGate>,
}

/// One open stream, counted in the drain and the `ext_proc_streams` gauge.
struct OpenStream {
    _guard: StreamGuard,
    metrics: Arc<Metrics>,
}

impl Drop for OpenStream {
    fn drop(&mut self) {
        self.metrics.ext_proc_stream(-1);
    }
}

impl ExtProc {
    pub fn new(router: Arc<Router>, metrics: Arc<Metrics>, config: ExtProcConfig) -> Self {
        let flow = Arc::new(flow::FlowGate::new(
            router.clone(),
            metrics.flow().clone(),
            config.saturation,
        ));
        // With fleet sync, the peers' routes count in this gate's tenant shares.
        let shares = Arc::downgrade(&flow);
        router.share_fleet_service(shares);
        // Held requests go the moment an engine's events or report show room.
        let watch = Arc::downgrade(&flow);
        router.watch_room(watch);
        Self {
            flow,
            router,
            metrics,
            config: Arc::new(config),
            drain: Drain::new(),
            body_router: None,
        }
    }

    /// Reads request bodies the router wants (when Envoy sends them) and decides
    /// on the chain it makes of them.
    pub fn with_body_router(mut self, body_router: Arc<dyn BodyRouter>) -> Self {
        self.body_router = Some(body_router);
        self
    }

    /// Follows `drain`: once it starts, new streams are refused with UNAVAILABLE
    /// (Envoy's `failure_mode_allow` then lets the request through unrouted) and
    /// open ones run to their end.
    pub fn with_drain(mut self, drain: Drain) -> Self {
        self.drain = drain;
        self
    }

    pub fn into_server(self) -> ExternalProcessorServer<Self> {
        ExternalProcessorServer::new(self)
    }

    /// Answers the messages of one stream in order, in process, without a
    /// transport: what the serving benchmark counts allocations on. The stream's
    /// state (in-flight count, held body) ends with the call.
    pub fn answer_stream(
        &self,
        messages: impl IntoIterator<Item = ProcessingRequest>,
    ) -> Vec<ProcessingResponse> {
        let mut stream = StreamState::default();
        let mut out = Vec::new();
        for msg in messages {
            self.answer_into(msg, &mut stream, &mut out);
        }
        out
    }

    /// Answers one message with one reply (the headers-only exchange; tests).
    #[cfg(test)]
    fn answer(
        &self,
        msg: ProcessingRequest,
        stream: &mut StreamState,
    ) -> Option<ProcessingResponse> {
        let mut out = Vec::new();
        self.answer_into(msg, stream, &mut out);
        assert!(out.len() <= 1, "more than one reply: {out:?}");
        out.pop()
    }

    /// Answers one message: none, one or several replies, in the order Envoy must
    /// get them. `stream` carries what lives from message to message: the body
    /// modes, a request held for its body, the debug headers to echo and the
    /// routed request's in-flight count.
    fn answer_into(
        &self,
        msg: ProcessingRequest,
        stream: &mut StreamState,
        out: &mut Vec<ProcessingResponse>,
    ) {
        if let Some(pc) = &msg.protocol_config {
            stream.request_body_mode = BodySendMode::try_from(pc.request_body_mode).ok();
            stream.response_body_mode = BodySendMode::try_from(pc.response_body_mode).ok();
        }
        if stream.closed {
            // An immediate response ended the exchange; Envoy sends no more.
            return;
        }
        let Some(request) = msg.request else { return };
        let reply = match request {
            Message::RequestHeaders(h) => {
                return self.request_headers(h, msg.metadata_context.as_ref(), stream, out);
            }
            Message::RequestBody(b) => return self.request_body(b, stream, out),
            Message::RequestTrailers(_) => {
                if let Some(held) = stream.held.take() {
                    // The trailers say the body is complete (no end_of_stream on it);
                    // their reply follows the body's.
                    return self.held_ready(held, false, None, true, stream, out);
                }
                Reply::RequestTrailers(TrailersResponse::default())
            }
            Message::ResponseHeaders(_) => {
                // The first byte of the response: prefill is over.
                if stream.inflight.take().is_some() {
                    self.flow.nudge();
                }
                let echo = &mut stream.echo;
                Reply::ResponseHeaders(HeadersResponse {
                    response: Some(CommonResponse {
                        header_mutation: (!echo.is_empty()).then(|| HeaderMutation {
                            set_headers: std::mem::take(echo),
                            remove_headers: Vec::new(),
                        }),
                        ..CommonResponse::default()
                    }),
                })
            }
            Message::ResponseBody(b) => {
                if stream.response_body_mode == Some(BodySendMode::FullDuplexStreamed) {
                    Reply::ResponseBody(streamed_body(b.body, b.end_of_stream))
                } else {
                    Reply::ResponseBody(BodyResponse::default())
                }
            }
            Message::ResponseTrailers(_) => Reply::ResponseTrailers(TrailersResponse::default()),
        };
        out.push(reply_of(reply));
    }

    /// Request headers: decide now, or hold the request for its body.
    fn request_headers(
        &self,
        h: HttpHeaders,
        metadata: Option<&envoy_types::pb::envoy::config::core::v3::Metadata>,
        stream: &mut StreamState,
        out: &mut Vec<ProcessingResponse>,
    ) {
        let parsed = RoutingHeaders::parse(header_pairs(h.headers.as_ref()));
        let subset = subset::subset_hint(metadata);
        let body_mode = stream.request_body_mode;
        let body_follows = !h.end_of_stream
            && matches!(
                body_mode,
                Some(BodySendMode::FullDuplexStreamed | BodySendMode::Buffered)
            );
        let wanted = body_follows && parsed.malformed.is_none();
        let router = self.body_router.as_ref().filter(|_| wanted);
        let path = header_text(h.headers.as_ref(), ":path");
        if let Some(router) = router.filter(|r| r.wants_body(path.unwrap_or(""), &parsed.fields)) {
            let held = HeldRequest::new(
                path.unwrap_or("").to_string(),
                parsed,
                subset,
                header_text(h.headers.as_ref(), "content-length"),
                router.max_body_bytes(),
            );
            stream.held = Some(Box::new(held));
            if body_mode == Some(BodySendMode::Buffered) {
                // Envoy holds the body until the headers are answered.
                out.push(reply_of(Reply::RequestHeaders(HeadersResponse::default())));
            }
            return;
        }
        if parsed.malformed.is_none()
            && self.hold_or_shed(
                &parsed.fields,
                parsed.priority,
                subset.as_deref(),
                parsed.debug,
                stream,
                out,
            )
        {
            if !stream.closed {
                stream.parked = Some(Parked::Headers { parsed, subset });
            }
            return;
        }
        self.decide_headers(&parsed, subset.as_deref(), stream, out);
    }

    /// Decides a request on its headers alone (headers-only, or a body the
    /// router does not want).
    fn decide_headers(
        &self,
        parsed: &RoutingHeaders,
        subset: Option<&[String]>,
        stream: &mut StreamState,
        out: &mut Vec<ProcessingResponse>,
    ) {
        let input = verdict::Input {
            parsed,
            subset,
            body_miss: None,
            held: false,
        };
        let fdx = stream.request_body_mode == Some(BodySendMode::FullDuplexStreamed);
        out.push(self.decide(&input, stream, !fdx, Placement::Headers));
    }

    /// Flow control's turn, once per request, on the async path only (the
    /// in-process [`Self::answer_stream`] never holds): `false` lets the
    /// decision run now. `true`: the request is held ([`StreamState::pending`],
    /// and Envoy is asked to wait for it) or was shed (the 429 is in `out` and
    /// the stream closed).
    fn hold_or_shed(
        &self,
        fields: &headers::RoutingFields,
        priority: i64,
        subset: Option<&[String]>,
        debug: bool,
        stream: &mut StreamState,
        out: &mut Vec<ProcessingResponse>,
    ) -> bool {
        if !stream.offload || stream.flow_seen {
            return false;
        }
        stream.flow_seen = true;
        if !self.flow.applies_to(&fields.tenant) {
            return false;
        }
        let scope =
            crate::core::scope::ScopeRef::new(&fields.tenant, &fields.model, &fields.hash_scheme);
        let candidates = subset.map(|addrs| {
            let addrs: Vec<&str> = addrs.iter().map(String::as_str).collect();
            self.router.replicas_at(scope, &addrs)
        });
        if candidates.as_ref().is_some_and(Vec::is_empty) {
            // Nothing eligible: the decision's own 503 applies.
            return false;
        }
        let candidates = candidates.unwrap_or_default();
        let debugging = debug && self.config.debug_headers_allowed;
        match self
            .flow
            .admit(fields, priority, &candidates, Timestamp::now())
        {
            flow::Gate::Pass => false,
            flow::Gate::Shed(shed) => {
                out.push(immediate_429(&shed, debugging));
                stream.closed = true;
                true
            }
            flow::Gate::Held(pending) => {
                out.push(ProcessingResponse {
                    override_message_timeout: protobuf_duration(pending.message_timeout),
                    ..ProcessingResponse::default()
                });
                stream.pending = Some(pending);
                true
            }
        }
    }

    /// A request body chunk (or, in BUFFERED mode, the whole body).
    fn request_body(
        &self,
        b: HttpBody,
        stream: &mut StreamState,
        out: &mut Vec<ProcessingResponse>,
    ) {
        let fdx = stream.request_body_mode == Some(BodySendMode::FullDuplexStreamed);
        let Some(mut held) = stream.held.take() else {
            out.push(reply_of(Reply::RequestBody(if fdx {
                streamed_body(b.body, b.end_of_stream)
            } else {
                BodyResponse::default()
            })));
            return;
        };
        if !fdx {
            // BUFFERED: the whole body in one message; the decision is its reply.
            let limit = held.limit;
            let too_large = b.body.len() > limit;
            held.body = b.body;
            let miss = too_large.then_some(BodyMiss::TooLarge { limit });
            self.held_ready(held, b.end_of_stream, miss, false, stream, out);
            return;
        }
        match held.collect(b.body, b.end_of_stream) {
            Collect::More => stream.held = Some(held),
            Collect::Complete => self.held_ready(held, b.end_of_stream, None, false, stream, out),
            Collect::TooLarge => {
                let limit = held.limit;
                self.held_ready(
                    held,
                    b.end_of_stream,
                    Some(BodyMiss::TooLarge { limit }),
                    false,
                    stream,
                    out,
                );
            }
        }
    }

    /// A held request is ready for its decision: decide now, or, when the stream
    /// runs on the async workers ([`StreamState::offload`]) and the body is large,
    /// leave it in [`StreamState::deferred`] for the stream loop to route on the
    /// blocking pool and finish with [`finish_held`](Self::finish_held).
    fn held_ready(
        &self,
        held: Box<HeldRequest>,
        end_of_stream: bool,
        miss: Option<BodyMiss>,
        trailers: bool,
        stream: &mut StreamState,
        out: &mut Vec<ProcessingResponse>,
    ) {
        if stream.offload
            && miss.is_none()
            && self.body_router.is_some()
            && held.body.len() >= BLOCKING_ROUTE_BYTES
        {
            stream.deferred = Some(Deferred {
                held,
                end_of_stream,
                trailers,
            });
            return;
        }
        let routed = self.route_held(&held, miss);
        self.finish_held(held, end_of_stream, routed, trailers, stream, out);
    }

    /// The body's routing fields, or why there are none (`miss`: known already).
    fn route_held(
        &self,
        held: &HeldRequest,
        miss: Option<BodyMiss>,
    ) -> Result<headers::RoutingFields, BodyMiss> {
        match (miss, self.body_router.as_ref()) {
            (None, Some(r)) => r.route(&held.path, &held.parsed.fields, &held.body),
            (Some(m), _) => Err(m),
            (None, None) => Err(BodyMiss::NotOpenAi("no body router".into())),
        }
    }

    /// Decides a held request on `routed` and sends the replies its body mode
    /// needs: in FULL_DUPLEX_STREAMED the headers reply and then the body,
    /// unchanged; in BUFFERED the body reply carrying the decision. `trailers`:
    /// the request trailers completed the body, their reply comes last.
    fn finish_held(
        &self,
        held: Box<HeldRequest>,
        end_of_stream: bool,
        routed: Result<headers::RoutingFields, BodyMiss>,
        trailers: bool,
        stream: &mut StreamState,
        out: &mut Vec<ProcessingResponse>,
    ) {
        let fields = match &routed {
            Ok(f) => f,
            Err(_) => &held.parsed.fields,
        };
        if held.parsed.malformed.is_none() || routed.is_ok() {
            let (priority, debug) = (held.parsed.priority, held.parsed.debug);
            let subset = held.subset.clone();
            if self.hold_or_shed(fields, priority, subset.as_deref(), debug, stream, out) {
                if !stream.closed {
                    stream.parked = Some(Parked::Body {
                        held,
                        end_of_stream,
                        routed,
                        trailers,
                    });
                }
                return;
            }
        }
        let HeldRequest {
            parsed,
            subset,
            body,
            ..
        } = *held;
        let (body_parsed, body_miss) = match routed {
            Ok(fields) => (
                RoutingHeaders {
                    debug: parsed.debug,
                    fields,
                    malformed: None,
                    priority: parsed.priority,
                },
                None,
            ),
            Err(m) => (parsed, Some(m)),
        };
        self.metrics
            .record_body(body_miss.as_ref().map(BodyMiss::reason));
        let input = verdict::Input {
            parsed: &body_parsed,
            subset: subset.as_deref(),
            body_miss: body_miss.as_ref(),
            held: false,
        };
        let fdx = stream.request_body_mode == Some(BodySendMode::FullDuplexStreamed);
        if !fdx {
            out.push(self.decide(&input, stream, false, Placement::Body));
        } else {
            out.push(self.decide(&input, stream, false, Placement::Headers));
            if !stream.closed {
                let parts = held::chunks(body);
                let last = parts.len() - 1;
                for (i, part) in parts.into_iter().enumerate() {
                    let eos = end_of_stream && i == last;
                    out.push(reply_of(Reply::RequestBody(streamed_body(part, eos))));
                }
            }
        }
        if trailers && !stream.closed {
            out.push(reply_of(
                Reply::RequestTrailers(TrailersResponse::default()),
            ));
        }
    }

    /// Decides `input` and records what the stream keeps: the debug echo and the
    /// in-flight count. `may_skip_response`: the reply may ask Envoy to skip the
    /// response headers (headers replies only, never in FULL_DUPLEX_STREAMED).
    fn decide(
        &self,
        input: &verdict::Input<'_>,
        stream: &mut StreamState,
        may_skip_response: bool,
        placement: Placement,
    ) -> ProcessingResponse {
        let input = verdict::Input {
            held: stream.queued.is_some(),
            ..*input
        };
        let (mut verdict, inflight) = Verdict::decide_input(
            &self.router,
            &self.metrics,
            &self.config,
            &input,
            Timestamp::now(),
        );
        if let Some(waited) = stream.queued.take() {
            let ms = waited.as_millis().to_string();
            if input.parsed.debug && self.config.debug_headers_allowed {
                verdict.debug_echo.push((headers::QUEUED_MS, ms.clone()));
            }
            if verdict.refusal.is_none() {
                verdict.upstream.push((headers::QUEUED_MS, ms));
            }
        }
        stream.echo = verdict
            .debug_echo
            .iter()
            .map(|(k, v)| set_header(k, v.as_str()))
            .collect();
        // A request counted until its guard drops needs the response headers to
        // be released; one its engine's event releases (or none) lets the reply
        // skip that round trip on every response.
        let inflight = inflight.filter(|i| !i.ends_with_prefill());
        let skip_response = may_skip_response && stream.echo.is_empty() && inflight.is_none();
        stream.inflight = inflight;
        if verdict.refusal.is_some() {
            stream.closed = true;
        }
        let mut reply = self.request_headers_reply(verdict, skip_response);
        if placement == Placement::Body
            && let Some(Reply::RequestHeaders(h)) = reply.response.take()
        {
            reply.response = Some(Reply::RequestBody(BodyResponse {
                response: h.response,
            }));
        }
        reply
    }

    /// The reply to request headers: the verdict in Envoy's terms. Its header
    /// values move into the reply, uncopied.
    fn request_headers_reply(
        &self,
        verdict: Verdict,
        skip_response_headers: bool,
    ) -> ProcessingResponse {
        if let Some(body) = &verdict.refusal {
            return immediate_503(body, &verdict.debug_echo);
        }
        let dest_header = self.config.destination_header.as_str();
        // A client never chooses its upstream: every routing or decision header
        // the verdict does not set is removed. (Envoy's message owns its names,
        // so each is one small allocation.)
        let unset = || {
            verdict::DECISION_HEADERS
                .into_iter()
                .filter(|h| !verdict.upstream.iter().any(|(k, _)| k == h))
        };
        let mut remove_headers = Vec::with_capacity(unset().count() + 2);
        remove_headers.extend(unset().map(str::to_owned));
        // The priority is the sidecar's to read, not the engine's.
        remove_headers.push(headers::PRIORITY.to_owned());
        if verdict.destination.is_none() {
            remove_headers.push(dest_header.to_owned());
        }
        let mut set_headers = Vec::with_capacity(verdict.upstream.len() + 1);
        if let Some(dest) = &verdict.destination {
            set_headers.push(set_header(dest_header, dest.as_str()));
        }
        set_headers.extend(verdict.upstream.into_iter().map(|(k, v)| set_header(k, v)));
        ProcessingResponse {
            response: Some(Reply::RequestHeaders(HeadersResponse {
                response: Some(CommonResponse {
                    header_mutation: Some(HeaderMutation {
                        set_headers,
                        remove_headers,
                    }),
                    clear_route_cache: verdict.destination.is_some(),
                    ..CommonResponse::default()
                }),
            })),
            dynamic_metadata: verdict.destination.map(lb_metadata),
            mode_override: skip_response_headers.then(|| ProcessingMode {
                response_header_mode: HeaderSendMode::Skip as i32,
                ..ProcessingMode::default()
            }),
            ..ProcessingResponse::default()
        }
    }
}

type ReplyStream = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

/// Bodies of at least this many bytes (about 200 tokens, ~0.5 ms to tokenize
/// cold) are routed on the blocking pool; smaller ones cost less than the hop.
pub const BLOCKING_ROUTE_BYTES: usize = 1024;

/// A held request whose body is complete, waiting to be routed off the async
/// workers (see [`ExtProc::held_ready`]).
struct Deferred {
    held: Box<HeldRequest>,
    end_of_stream: bool,
    trailers: bool,
}

/// Which reply carries a decision: the request headers' (headers-only and
/// FULL_DUPLEX_STREAMED) or the body's (BUFFERED).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Placement {
    Headers,
    Body,
}

/// What one ext_proc stream keeps between its messages.
#[derive(Default)]
struct StreamState {
    /// The body modes Envoy announced (first message); `None`: not said.
    request_body_mode: Option<BodySendMode>,
    response_body_mode: Option<BodySendMode>,
    /// A request waiting for its body before the decision.
    held: Option<Box<HeldRequest>>,
    /// Large bodies are routed on the blocking pool (set by the stream loop;
    /// off in the synchronous tests).
    offload: bool,
    /// A complete body to route off the async workers, then finish.
    deferred: Option<Deferred>,
    /// An immediate response was sent: nothing more is answered.
    closed: bool,
    echo: Vec<HeaderValueOption>,
    /// Released on the response headers, when the stream ends (dropped with the
    /// state), or after [`INFLIGHT_AGE_OUT`].
    inflight: Option<Inflight>,
    admitted_at: Option<tokio::time::Instant>,
    /// Flow control was consulted for this request (it is, once).
    flow_seen: bool,
    /// Held by flow control: the decision waits for this.
    pending: Option<flow::Pending>,
    /// What to decide when the held request is released.
    parked: Option<Parked>,
    /// How long flow control held the request (`x-inferencecache-queued-ms`).
    queued: Option<Duration>,
    /// Messages that came while the request was held, answered after it.
    stash: VecDeque<ProcessingRequest>,
    /// Counts the stream for the drain and the gauge until it ends.
    _open: Option<OpenStream>,
}

/// A request held by flow control, as it is decided on release.
enum Parked {
    Headers {
        parsed: RoutingHeaders,
        subset: Option<Vec<String>>,
    },
    Body {
        held: Box<HeldRequest>,
        end_of_stream: bool,
        routed: Result<headers::RoutingFields, BodyMiss>,
        trailers: bool,
    },
}

#[tonic::async_trait]
impl ExternalProcessor for ExtProc {
    type ProcessStream = ReplyStream;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        if self.drain.is_draining() {
            return Err(Status::unavailable(
                "inferencecache is draining (shutting down): no new ext_proc streams",
            ));
        }
        self.metrics.ext_proc_stream(1);
        let open = OpenStream {
            _guard: self.drain.stream(),
            metrics: self.metrics.clone(),
        };
        let state = StreamState {
            _open: Some(open),
            ..StreamState::default()
        };
        Ok(Response::new(Box::pin(replies(
            self.clone(),
            request.into_inner(),
            state,
        ))))
    }
}

/// The replies of one stream, in order: each message answered, a large body
/// routed on the blocking pool in between.
fn replies<S, E>(
    this: ExtProc,
    inbound: S,
    state: StreamState,
) -> impl Stream<Item = Result<ProcessingResponse, Status>> + Send + 'static
where
    S: Stream<Item = Result<ProcessingRequest, E>> + Unpin + Send + 'static,
{
    let state = (
        inbound,
        this,
        StreamState {
            offload: true,
            ..state
        },
    );
    futures::stream::unfold(state, |(mut inbound, this, mut st)| async move {
        let mut out = Vec::new();
        loop {
            // A reset or closed stream just ends ours (and drops its in-flight
            // count and any held body with the state): Envoy has moved on.
            let had = st.inflight.is_some();
            if st.pending.is_some() {
                this.await_release(&mut st, &mut inbound, &mut out).await?;
            } else {
                let msg = next_message(&mut st, &mut inbound).await?;
                this.answer_into(msg, &mut st, &mut out);
                if let Some(d) = st.deferred.take() {
                    let (held, routed) = this.route_blocking(d.held).await?;
                    this.finish_held(held, d.end_of_stream, routed, d.trailers, &mut st, &mut out);
                }
            }
            if !had && st.inflight.is_some() {
                st.admitted_at = Some(tokio::time::Instant::now());
            }
            if !out.is_empty() {
                let batch = futures::stream::iter(out.into_iter().map(Ok));
                return Some((batch, (inbound, this, st)));
            }
        }
    })
    .flatten()
}

impl ExtProc {
    /// Waits for flow control to release or shed the held request, then decides
    /// it (released) or answers 429 (shed). Messages arriving meanwhile are kept
    /// for after; the inbound stream ending is the client gone: `None`, and the
    /// request leaves the queue with the state.
    async fn await_release<S, E>(
        &self,
        st: &mut StreamState,
        inbound: &mut S,
        out: &mut Vec<ProcessingResponse>,
    ) -> Option<()>
    where
        S: Stream<Item = Result<ProcessingRequest, E>> + Unpin,
    {
        let mut pending = st.pending.take()?;
        let outcome = loop {
            tokio::select! {
                outcome = pending.outcome() => break outcome,
                msg = inbound.next() => match msg {
                    Some(Ok(m)) => st.stash.push_back(m),
                    _ => return None,
                },
            }
        };
        let parked = st.parked.take()?;
        let debugging = parked_debug(&parked) && self.config.debug_headers_allowed;
        let _transit = match outcome {
            Some(flow::Outcome::Shed(shed)) => {
                out.push(immediate_429(&shed, debugging));
                st.closed = true;
                return Some(());
            }
            Some(flow::Outcome::Released { waited, transit }) => {
                st.queued = Some(waited);
                Some(transit)
            }
            None => None,
        };
        match parked {
            Parked::Headers { parsed, subset } => {
                self.decide_headers(&parsed, subset.as_deref(), st, out);
            }
            Parked::Body {
                held,
                end_of_stream,
                routed,
                trailers,
            } => self.finish_held(held, end_of_stream, routed, trailers, st, out),
        }
        Some(())
    }

    /// Routes a held body on the blocking pool and hands it back with the result.
    /// `None` if routing panicked (as on the async worker, the stream ends and
    /// Envoy's `failure_mode_allow` serves the request unrouted) or the runtime
    /// is shutting down.
    async fn route_blocking(
        &self,
        held: Box<HeldRequest>,
    ) -> Option<(Box<HeldRequest>, Result<headers::RoutingFields, BodyMiss>)> {
        let this = self.clone();
        match tokio::task::spawn_blocking(move || {
            let routed = this.route_held(&held, None);
            (held, routed)
        })
        .await
        {
            Ok(done) => Some(done),
            Err(e) => {
                tracing::error!(error = %e, "body routing failed; the stream ends");
                None
            }
        }
    }
}

/// The stream's next message. A counted request whose response headers have not
/// come within [`INFLIGHT_AGE_OUT`] is released first, and the wait goes on.
/// An error or the end of the inbound stream is `None`.
async fn next_message<S, E>(st: &mut StreamState, inbound: &mut S) -> Option<ProcessingRequest>
where
    S: Stream<Item = Result<ProcessingRequest, E>> + Unpin,
{
    if let Some(m) = st.stash.pop_front() {
        return Some(m);
    }
    if let (Some(_), Some(at)) = (&st.inflight, st.admitted_at) {
        match tokio::time::timeout_at(at + INFLIGHT_AGE_OUT, inbound.next()).await {
            Ok(m) => return m?.ok(),
            Err(_) => st.inflight = None,
        }
    }
    inbound.next().await?.ok()
}

/// Header name/value pairs of an Envoy header map; Envoy may send either the text
/// `value` or the bytes `raw_value`.
fn header_pairs(map: Option<&HeaderMap>) -> impl Iterator<Item = (&str, &[u8])> {
    map.into_iter().flat_map(|m| m.headers.iter()).map(|h| {
        let value = if h.raw_value.is_empty() {
            h.value.as_bytes()
        } else {
            h.raw_value.as_slice()
        };
        (h.key.as_str(), value)
    })
}

/// The text of one request header (pseudo-headers such as `:path` included).
fn header_text<'a>(map: Option<&'a HeaderMap>, name: &str) -> Option<&'a str> {
    header_pairs(map)
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .and_then(|(_, v)| std::str::from_utf8(v).ok())
}

fn reply_of(reply: Reply) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(reply),
        ..ProcessingResponse::default()
    }
}

/// A FULL_DUPLEX_STREAMED body chunk handed back unchanged.
fn streamed_body(body: Vec<u8>, end_of_stream: bool) -> BodyResponse {
    BodyResponse {
        response: Some(CommonResponse {
            body_mutation: Some(BodyMutation {
                mutation: Some(Mutation::StreamedResponse(StreamedBodyResponse {
                    body,
                    end_of_stream,
                    ..StreamedBodyResponse::default()
                })),
            }),
            ..CommonResponse::default()
        }),
    }
}

/// Overwrites (or adds) a header: never appends to what a client sent. An owned
/// value becomes the header's bytes without a copy.
fn set_header(key: &str, value: impl Into<Vec<u8>>) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_string(),
            value: String::new(),
            raw_value: value.into(),
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..HeaderValueOption::default()
    }
}

/// A protobuf string value (tests build the gateway's subset metadata with it).
#[cfg(test)]
fn string_value(s: &str) -> Value {
    Value {
        kind: Some(Kind::StringValue(s.to_string())),
    }
}

/// `{"envoy.lb": {"x-gateway-destination-endpoint": dest}}`
fn lb_metadata(dest: String) -> Struct {
    let value = Value {
        kind: Some(Kind::StringValue(dest)),
    };
    let inner = Struct {
        fields: [(LB_METADATA_KEY.to_string(), value)].into(),
    };
    Struct {
        fields: [(
            LB_METADATA_NAMESPACE.to_string(),
            Value {
                kind: Some(Kind::StructValue(inner)),
            },
        )]
        .into(),
    }
}

/// Whether the held request asked for the debug echo.
fn parked_debug(parked: &Parked) -> bool {
    match parked {
        Parked::Headers { parsed, .. } => parsed.debug,
        Parked::Body { held, .. } => held.parsed.debug,
    }
}

/// A protobuf duration (Envoy's `override_message_timeout`).
fn protobuf_duration(d: Duration) -> Option<envoy_types::pb::google::protobuf::Duration> {
    Some(envoy_types::pb::google::protobuf::Duration {
        seconds: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        nanos: i32::try_from(d.subsec_nanos()).unwrap_or(0),
    })
}

/// Flow control shed the request: 429, `retry-after` and why; how long it was
/// held under debug.
fn immediate_429(shed: &flow::Shed, debugging: bool) -> ProcessingResponse {
    let mut set_headers = vec![
        set_header("content-type", "text/plain; charset=utf-8"),
        set_header("retry-after", shed.retry_after_secs.to_string()),
        set_header(headers::SHED, shed.reason.as_str()),
    ];
    if debugging {
        set_headers.push(set_header(
            headers::QUEUED_MS,
            shed.waited.as_millis().to_string(),
        ));
    }
    ProcessingResponse {
        response: Some(Reply::ImmediateResponse(ImmediateResponse {
            status: Some(HttpStatus {
                code: StatusCode::TooManyRequests as i32,
            }),
            headers: Some(HeaderMutation {
                set_headers,
                remove_headers: Vec::new(),
            }),
            body: format!(
                "inferencecache: every replica is saturated; request shed ({})\n",
                shed.reason.label()
            )
            .into_bytes(),
            grpc_status: None,
            details: format!(
                "inferencecache_shed_{}",
                shed.reason.label().replace('-', "_")
            ),
        })),
        ..ProcessingResponse::default()
    }
}

/// ORIGINAL_DST with nowhere to send the request: 503 with the reason as the body.
fn immediate_503(body: &str, debug_echo: &[(&'static str, String)]) -> ProcessingResponse {
    let mut set_headers = vec![set_header("content-type", "text/plain; charset=utf-8")];
    set_headers.extend(debug_echo.iter().map(|(k, v)| set_header(k, v.as_str())));
    ProcessingResponse {
        response: Some(Reply::ImmediateResponse(ImmediateResponse {
            status: Some(HttpStatus {
                code: StatusCode::ServiceUnavailable as i32,
            }),
            headers: Some(HeaderMutation {
                set_headers,
                remove_headers: Vec::new(),
            }),
            body: body.as_bytes().to_vec(),
            grpc_status: None,
            details: String::from("inferencecache_no_serving_replica"),
        })),
        ..ProcessingResponse::default()
    }
}

#[cfg(test)]
mod tests;
