//! The Envoy ext_proc v3 server (contract §7), headers-only.
//!
//! ```text
//!  Envoy ──ProcessingRequest──▶ stream loop ──request headers──▶ headers::RoutingHeaders::parse
//!                                   │                                   │
//!                                   │                         verdict::Verdict::decide (router)
//!                                   │                                   │
//!        ◀──ProcessingResponse──────┴──── envoy_reply: header mutation, envoy.lb metadata,
//!                                          clear_route_cache, or ImmediateResponse 503
//! ```
//!
//! One stream is one HTTP request. The only state kept across its messages is what
//! to echo on the response headers for a debugging client; when there is nothing
//! to echo, the reply asks Envoy (via `mode_override`) not to send response headers
//! at all. Any other message (bodies, trailers) gets an empty "continue" reply, and
//! a message with nothing in it gets none: the stream never fails on what it does
//! not use.

pub mod body;
pub mod headers;
pub mod verdict;

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::{
    HeaderMap, HeaderValue, HeaderValueOption, header_value_option::HeaderAppendAction,
};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::{
    ProcessingMode, processing_mode::HeaderSendMode,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, ImmediateResponse,
    ProcessingRequest, ProcessingResponse, TrailersResponse,
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
use crate::core::load::Inflight;
use crate::core::time::Timestamp;
use headers::RoutingHeaders;
pub use verdict::{DestinationMode, ExtProcConfig, Verdict};

/// The dynamic metadata namespace and key Envoy's load balancers read the
/// destination from (contract §7; fixed whatever the header is named).
pub const LB_METADATA_NAMESPACE: &str = "envoy.lb";
pub const LB_METADATA_KEY: &str = "x-gateway-destination-endpoint";

/// The ext_proc service.
#[derive(Clone)]
pub struct ExtProc {
    router: Arc<Router>,
    metrics: Arc<Metrics>,
    config: Arc<ExtProcConfig>,
    drain: Drain,
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
        Self {
            router,
            metrics,
            config: Arc::new(config),
            drain: Drain::new(),
        }
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

    /// Answers one message. `stream` carries what lives from request to response:
    /// the debug headers to echo and the routed request's in-flight count.
    fn answer(
        &self,
        msg: ProcessingRequest,
        stream: &mut StreamState,
    ) -> Option<ProcessingResponse> {
        let echo = &mut stream.echo;
        let reply = match msg.request? {
            Message::RequestHeaders(h) => {
                let parsed = RoutingHeaders::parse(header_pairs(h.headers.as_ref()));
                let (verdict, inflight) = Verdict::decide_and_admit(
                    &self.router,
                    &self.metrics,
                    &self.config,
                    &parsed,
                    Timestamp::now(),
                );
                *echo = verdict
                    .debug_echo
                    .iter()
                    .map(|(k, v)| set_header(k, v))
                    .collect();
                // A counted request needs the response headers (the end of its
                // prefill) to be released; otherwise skip that round trip.
                let skip_response = echo.is_empty() && inflight.is_none();
                stream.inflight = inflight;
                return Some(self.request_headers_reply(&verdict, skip_response));
            }
            Message::ResponseHeaders(_) => {
                // The first byte of the response: prefill is over.
                stream.inflight = None;
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
            Message::RequestBody(_) => Reply::RequestBody(BodyResponse::default()),
            Message::ResponseBody(_) => Reply::ResponseBody(BodyResponse::default()),
            Message::RequestTrailers(_) => Reply::RequestTrailers(TrailersResponse::default()),
            Message::ResponseTrailers(_) => Reply::ResponseTrailers(TrailersResponse::default()),
        };
        Some(ProcessingResponse {
            response: Some(reply),
            ..ProcessingResponse::default()
        })
    }

    /// The reply to request headers: the verdict in Envoy's terms.
    fn request_headers_reply(
        &self,
        verdict: &Verdict,
        skip_response_headers: bool,
    ) -> ProcessingResponse {
        if let Some(body) = &verdict.refusal {
            return immediate_503(body, &verdict.debug_echo);
        }
        let dest_header = self.config.destination_header.as_str();
        let mut set_headers: Vec<HeaderValueOption> = Vec::with_capacity(5);
        if let Some(dest) = &verdict.destination {
            set_headers.push(set_header(dest_header, dest));
        }
        for (k, v) in &verdict.upstream {
            set_headers.push(set_header(k, v));
        }
        // A client never chooses its upstream: every routing or decision header
        // the verdict does not set is removed.
        let mut remove_headers: Vec<String> = verdict::DECISION_HEADERS
            .iter()
            .filter(|h| !verdict.upstream.iter().any(|(k, _)| k == *h))
            .map(|h| (*h).to_string())
            .collect();
        if verdict.destination.is_none() {
            remove_headers.push(dest_header.to_string());
        }
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
            dynamic_metadata: verdict.destination.as_deref().map(lb_metadata),
            mode_override: skip_response_headers.then(|| ProcessingMode {
                response_header_mode: HeaderSendMode::Skip as i32,
                ..ProcessingMode::default()
            }),
            ..ProcessingResponse::default()
        }
    }
}

type ReplyStream = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

/// How long a routed request may count as in flight without its response headers
/// arriving: a lost stream must never inflate a replica's load for good.
pub const INFLIGHT_AGE_OUT: Duration = Duration::from_secs(60);

/// What one ext_proc stream keeps between its messages.
#[derive(Default)]
struct StreamState {
    echo: Vec<HeaderValueOption>,
    /// Released on the response headers, when the stream ends (dropped with the
    /// state), or after [`INFLIGHT_AGE_OUT`].
    inflight: Option<Inflight>,
    admitted_at: Option<tokio::time::Instant>,
    /// Counts the stream for the drain and the gauge until it ends.
    _open: Option<OpenStream>,
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
        let inbound = request.into_inner();
        let state = (
            inbound,
            self.clone(),
            StreamState {
                _open: Some(open),
                ..StreamState::default()
            },
        );
        let replies = futures::stream::unfold(state, |(mut inbound, this, mut st)| async move {
            loop {
                // A reset or closed stream just ends ours (and drops its in-flight
                // count with the state): Envoy has moved on.
                let msg = next_message(&mut st, &mut inbound).await?;
                let had = st.inflight.is_some();
                if let Some(reply) = this.answer(msg, &mut st) {
                    if !had && st.inflight.is_some() {
                        st.admitted_at = Some(tokio::time::Instant::now());
                    }
                    return Some((Ok(reply), (inbound, this, st)));
                }
            }
        });
        Ok(Response::new(Box::pin(replies)))
    }
}

/// The stream's next message. A counted request whose response headers have not
/// come within [`INFLIGHT_AGE_OUT`] is released first, and the wait goes on.
/// An error or the end of the inbound stream is `None`.
async fn next_message<S, E>(st: &mut StreamState, inbound: &mut S) -> Option<ProcessingRequest>
where
    S: Stream<Item = Result<ProcessingRequest, E>> + Unpin,
{
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

/// Overwrites (or adds) a header: never appends to what a client sent.
fn set_header(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_string(),
            value: String::new(),
            raw_value: value.as_bytes().to_vec(),
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..HeaderValueOption::default()
    }
}

fn string_value(s: &str) -> Value {
    Value {
        kind: Some(Kind::StringValue(s.to_string())),
    }
}

/// `{"envoy.lb": {"x-gateway-destination-endpoint": dest}}`
fn lb_metadata(dest: &str) -> Struct {
    let inner = Struct {
        fields: [(LB_METADATA_KEY.to_string(), string_value(dest))].into(),
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

/// ORIGINAL_DST with nowhere to send the request: 503 with the reason as the body.
fn immediate_503(body: &str, debug_echo: &[(&'static str, String)]) -> ProcessingResponse {
    let mut set_headers = vec![set_header("content-type", "text/plain; charset=utf-8")];
    set_headers.extend(debug_echo.iter().map(|(k, v)| set_header(k, v)));
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
