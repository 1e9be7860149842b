//! The simulated inference engine: an OpenAI-style completions server over
//! token ids with a [`PrefixCache`], vLLM-format KV events, vLLM-named Prometheus
//! gauges on `GET /metrics`, and one of two cost models. The routing benchmark runs
//! a fleet of these behind Envoy.
//!
//! The default cost model is continuous batching (`batch`, `--cost-model
//! batched`): requests share engine steps whose time grows with the prefill tokens
//! and decoding sequences in them. The simple model (`--cost-model simple`) is
//! below.
//!
//! ```text
//!  POST /v1/completions ─▶ FIFO queue ─▶ one of max_running slots
//!     ─▶ admit (cache lock: hits counted, blocks touched/inserted/evicted, ticket)
//!     ─▶ sleep prefill = prefill_us_per_token × uncached prompt tokens
//!     ─▶ publish the admission's events (removed + stored, one batch)
//!     ─▶ sleep decode = decode_us_per_token × max_tokens ─▶ 200 + usage + timings
//! ```
//!
//! Simple cost model: a request's service time depends only on its own prompt and
//! output length. Running requests do not slow each other down (there is no
//! batching model); the only contention is for the `max_running` slots, which
//! are handed out in arrival order (tokio's semaphore is fair). Reported
//! `prefill_ms`/`decode_ms` are the modelled times; `queue_ms` is measured (the
//! timer rounds sleeps up to the next millisecond, so it can only be longer).
//!
//! Events leave at the end of prefill, when the new blocks become reusable, but
//! in admission order (see [`super::events`]), so they always describe this
//! cache. A request whose client disconnects still runs to completion: its
//! cache change has happened and its events must be published.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::{Context, bail};
use axum::Json;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use inferencecache::adapters::body::request::{self as body_request, Endpoint};
use inferencecache::adapters::body::tokenizer::ModelTokenizer;
use parking_lot::Mutex;
use serde::Deserialize;
use serde_json::{Value, json};
use thiserror::Error;
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, oneshot};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::cache::PrefixCache;
use super::events::{EventFormat, EventPublisher, KvEvent, PublisherConfig, admission_events};

mod batch;
pub use batch::BatchCosts;

/// The response header naming the replica that served a completion.
pub const REPLICA_HEADER: &str = "x-sim-replica";
/// `max_tokens` when a request does not say (OpenAI's default).
pub const DEFAULT_MAX_TOKENS: u32 = 16;
/// Largest cost per token accepted, in microseconds (10 s).
const MAX_US_PER_TOKEN: f64 = 1e7;
/// Request bodies up to this size (long prompts as JSON integer arrays).
const MAX_BODY_BYTES: usize = 64 << 20;
/// The served model name the metrics carry when none is configured.
pub const DEFAULT_MODEL_NAME: &str = "sim-model";

/// How the engine turns work into time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum CostModel {
    /// Each request alone: prefill per uncached token + decode per output token,
    /// `max_running` at once, no interference.
    Simple,
    /// Continuous batching with chunked prefill (vLLM V1's scheduler shape).
    Batched,
}

/// One simulated engine.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineConfig {
    /// Replica id, reported on every response.
    pub id: String,
    /// HTTP listen address (port 0: any free port).
    pub http_addr: SocketAddr,
    /// ZMQ PUB endpoint the KV events bind (`tcp://host:port`, port 0 allowed).
    pub events_endpoint: String,
    /// ZMQ ROUTER endpoint of the replay socket.
    pub replay_endpoint: String,
    /// ZMQ topic of every message.
    pub topic: String,
    /// Tokens per KV block.
    pub block_size: u32,
    /// KV cache size in blocks.
    pub capacity_blocks: usize,
    /// Requests served at once; the rest wait in a FIFO queue.
    pub max_running: usize,
    /// Modelled prefill time per uncached prompt token, microseconds (simple model).
    pub prefill_us_per_token: f64,
    /// Modelled decode time per output token, microseconds (simple model).
    pub decode_us_per_token: f64,
    /// The continuous-batching model's step costs; `None`: the simple model.
    pub batch: Option<BatchCosts>,
    /// The `model_name` label of the metrics (vLLM's served model name).
    pub model_name: String,
    /// The engine's `PYTHONHASHSEED` (block hashes are vLLM `sha256_cbor`).
    pub hash_seed: String,
    pub event_format: EventFormat,
    /// Tokenizer files (as CacheBackend `spec.tokenizer.path`): text prompts and
    /// chat `messages` are tokenized with them, by the product's own body-mode
    /// code, so the engine caches the ids the sidecar routes on.
    pub tokenizer: Option<std::path::PathBuf>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            id: "sim-0".into(),
            http_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            events_endpoint: "tcp://127.0.0.1:0".into(),
            replay_endpoint: "tcp://127.0.0.1:0".into(),
            topic: String::new(),
            block_size: 16,
            capacity_blocks: 2048,
            max_running: 4,
            prefill_us_per_token: 50.0,
            decode_us_per_token: 2000.0,
            batch: None,
            model_name: DEFAULT_MODEL_NAME.into(),
            hash_seed: "0".into(),
            event_format: EventFormat::Map,
            tokenizer: None,
        }
    }
}

/// The cache size and cost-model flags, shared by `sim-engine` and `bench-routing`
/// (whose engines are built from them).
#[derive(Clone, Copy, Debug, clap::Args)]
pub struct CostArgs {
    /// KV cache size in blocks.
    #[arg(long, default_value_t = 2048)]
    pub capacity_blocks: usize,
    /// batched: continuous batching with chunked prefill (vLLM V1); simple: each
    /// request alone, max-running at once.
    #[arg(long, value_enum, default_value_t = CostModel::Batched)]
    pub cost_model: CostModel,
    /// Requests served at once (vLLM's max_num_seqs); the rest queue in arrival
    /// order. Default: 256 batched (vLLM's default), 4 simple.
    #[arg(long)]
    pub max_running: Option<usize>,
    /// simple: modelled prefill time per uncached prompt token, microseconds.
    #[arg(long, default_value_t = 50.0)]
    pub prefill_us_per_token: f64,
    /// simple: modelled decode time per output token, microseconds.
    #[arg(long, default_value_t = 2000.0)]
    pub decode_us_per_token: f64,
    /// batched: tokens per engine step (vLLM's max_num_batched_tokens).
    #[arg(long, default_value_t = BatchCosts::DEFAULT.max_num_batched_tokens)]
    pub max_num_batched_tokens: usize,
    /// batched: fixed time of every step, microseconds.
    #[arg(long, default_value_t = BatchCosts::DEFAULT.step_base_us)]
    pub step_base_us: f64,
    /// batched: time per prefill token in a step, microseconds.
    #[arg(long, default_value_t = BatchCosts::DEFAULT.prefill_us_per_token)]
    pub step_prefill_us_per_token: f64,
    /// batched: time per decoding sequence in a step, microseconds.
    #[arg(long, default_value_t = BatchCosts::DEFAULT.decode_us_per_seq)]
    pub step_decode_us_per_seq: f64,
}

impl CostArgs {
    /// `--max-running`, or the cost model's default.
    pub fn max_running(&self) -> usize {
        self.max_running.unwrap_or(match self.cost_model {
            CostModel::Simple => 4,
            CostModel::Batched => 256,
        })
    }

    /// The batched model's costs, `None` for the simple model.
    pub fn batch(&self) -> Option<BatchCosts> {
        (self.cost_model == CostModel::Batched).then_some(BatchCosts {
            max_num_batched_tokens: self.max_num_batched_tokens,
            step_base_us: self.step_base_us,
            prefill_us_per_token: self.step_prefill_us_per_token,
            decode_us_per_seq: self.step_decode_us_per_seq,
        })
    }
}

/// `inferencecache sim-engine` flags (see [`EngineConfig`] for their meaning).
#[derive(Clone, Debug, clap::Args)]
pub struct EngineArgs {
    /// Replica id, reported in every response and its x-sim-replica header.
    #[arg(long, default_value = "sim-0")]
    pub id: String,
    /// HTTP listen address (port 0: any free port; the bound one is printed).
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:0")]
    pub http: SocketAddr,
    /// ZMQ PUB endpoint for KV events (binds; `tcp://*:5557` for all interfaces).
    #[arg(long, value_name = "ENDPOINT", default_value = "tcp://127.0.0.1:0")]
    pub kv_events: String,
    /// ZMQ ROUTER endpoint for KV event replay (binds).
    #[arg(long, value_name = "ENDPOINT", default_value = "tcp://127.0.0.1:0")]
    pub kv_replay: String,
    /// ZMQ topic of the KV event messages.
    #[arg(long, default_value = "")]
    pub topic: String,
    /// The model_name label of /metrics (vLLM's --served-model-name).
    #[arg(long, default_value = DEFAULT_MODEL_NAME)]
    pub served_model_name: String,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,
    #[command(flatten)]
    pub costs: CostArgs,
    /// The engine's PYTHONHASHSEED: block hashes are vLLM sha256_cbor under it.
    #[arg(long, default_value = "0")]
    pub hash_seed: String,
    /// KV event layout: map (current vLLM) or array (older vLLM).
    #[arg(long, value_enum, default_value_t = EventFormat::Map)]
    pub event_format: EventFormat,
    /// A tokenizer directory (tokenizer.json, tokenizer_config.json): accept text
    /// prompts and /v1/chat/completions, tokenized as the sidecar's body mode does.
    #[arg(long, value_name = "DIR")]
    pub tokenizer: Option<std::path::PathBuf>,
}

impl From<EngineArgs> for EngineConfig {
    fn from(a: EngineArgs) -> Self {
        Self {
            id: a.id,
            http_addr: a.http,
            events_endpoint: a.kv_events,
            replay_endpoint: a.kv_replay,
            topic: a.topic,
            block_size: a.block_size,
            capacity_blocks: a.costs.capacity_blocks,
            max_running: a.costs.max_running(),
            prefill_us_per_token: a.costs.prefill_us_per_token,
            decode_us_per_token: a.costs.decode_us_per_token,
            batch: a.costs.batch(),
            model_name: a.served_model_name,
            hash_seed: a.hash_seed,
            event_format: a.event_format,
            tokenizer: a.tokenizer,
        }
    }
}

/// `inferencecache sim-engine`: serves until SIGINT/SIGTERM. Prints the bound
/// addresses as one JSON line on stdout first:
/// `{"id":..,"http":"ip:port","kv_events":"tcp://..","kv_replay":"tcp://.."}`.
pub async fn run(args: EngineArgs) -> anyhow::Result<()> {
    let handle = spawn(args.into()).await?;
    println!(
        "{}",
        json!({
            "id": handle.id,
            "http": handle.http_addr.to_string(),
            "kv_events": handle.events_endpoint,
            "kv_replay": handle.replay_endpoint,
        })
    );
    inferencecache::serve::shutdown_signal().await;
    handle.shutdown().await;
    Ok(())
}

/// A running engine; dropping it stops it (its sockets close).
#[derive(Debug)]
pub struct EngineHandle {
    pub id: String,
    pub http_addr: SocketAddr,
    pub events_endpoint: String,
    pub replay_endpoint: String,
    engine: Arc<Engine>,
    server: JoinHandle<()>,
    /// The batched model's scheduler.
    scheduler: Option<JoinHandle<()>>,
}

impl EngineHandle {
    /// Stops serving and publishing and waits for the HTTP server to close.
    pub async fn shutdown(mut self) {
        self.server.abort();
        if let Some(s) = &self.scheduler {
            s.abort();
        }
        self.engine.publisher.stop();
        let _ = (&mut self.server).await;
    }
}

impl Drop for EngineHandle {
    fn drop(&mut self) {
        self.server.abort();
        if let Some(s) = &self.scheduler {
            s.abort();
        }
        self.engine.publisher.stop();
    }
}

/// Starts an engine: binds HTTP and both ZMQ sockets before returning.
pub async fn spawn(config: EngineConfig) -> anyhow::Result<EngineHandle> {
    let replica_header = HeaderValue::from_str(&config.id)
        .ok()
        .filter(|_| !config.id.is_empty())
        .with_context(|| format!("replica id {:?} is not a non-empty header value", config.id))?;
    if config.max_running == 0 {
        bail!("max_running must be at least 1");
    }
    for (name, v) in [
        ("prefill_us_per_token", config.prefill_us_per_token),
        ("decode_us_per_token", config.decode_us_per_token),
    ] {
        if !(0.0..=MAX_US_PER_TOKEN).contains(&v) {
            bail!("{name} must be between 0 and {MAX_US_PER_TOKEN} microseconds, got {v}");
        }
    }
    if let Some(b) = &config.batch {
        for (name, v) in [
            ("step_base_us", b.step_base_us),
            ("step_prefill_us_per_token", b.prefill_us_per_token),
            ("step_decode_us_per_seq", b.decode_us_per_seq),
        ] {
            if !(0.0..=MAX_US_PER_TOKEN).contains(&v) {
                bail!("{name} must be between 0 and {MAX_US_PER_TOKEN} microseconds, got {v}");
            }
        }
        if b.max_num_batched_tokens == 0 {
            bail!("max_num_batched_tokens must be at least 1");
        }
    }
    let tokenizer = match &config.tokenizer {
        Some(dir) => Some(Arc::new(
            ModelTokenizer::load(dir).map_err(|e| anyhow::anyhow!("--tokenizer: {e}"))?,
        )),
        None => None,
    };
    let cache = PrefixCache::new(config.capacity_blocks, config.block_size, &config.hash_seed)?;
    let listener = TcpListener::bind(config.http_addr)
        .await
        .with_context(|| format!("HTTP address {}", config.http_addr))?;
    let http_addr = listener.local_addr()?;
    let publisher = EventPublisher::bind(PublisherConfig {
        events_endpoint: config.events_endpoint.clone(),
        replay_endpoint: config.replay_endpoint.clone(),
        topic: config.topic.clone(),
        format: config.event_format,
    })
    .await?;
    let batcher = config.batch.map(|c| Arc::new(batch::Batcher::new(c)));
    let engine = Arc::new(Engine {
        batcher: batcher.clone(),
        slots: Semaphore::new(config.max_running),
        cache: Mutex::new(cache),
        publisher,
        replica_header,
        counters: Counters::default(),
        tokenizer,
        config,
    });
    let app = routes(engine.clone());
    let server = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "simulated engine HTTP server failed");
        }
    });
    let scheduler = batcher.map(|b| tokio::spawn(batch::run(engine.clone(), b)));
    Ok(EngineHandle {
        id: engine.config.id.clone(),
        http_addr,
        events_endpoint: engine.publisher.events_endpoint().to_string(),
        replay_endpoint: engine.publisher.replay_endpoint().to_string(),
        engine,
        server,
        scheduler,
    })
}

/// The engine's shared state.
#[derive(Debug)]
struct Engine {
    config: EngineConfig,
    /// A plain mutex: held only for one admit or lookup, never across an await.
    cache: Mutex<PrefixCache>,
    slots: Semaphore,
    /// The batched model's queue and costs (`None`: the simple model).
    batcher: Option<Arc<batch::Batcher>>,
    publisher: EventPublisher,
    replica_header: HeaderValue,
    counters: Counters,
    tokenizer: Option<Arc<ModelTokenizer>>,
}

#[derive(Debug, Default)]
struct Counters {
    /// Completions answered since start or the last reset.
    served: AtomicU64,
    /// Requests waiting for a slot now.
    queued: AtomicUsize,
    /// Requests holding a slot now.
    running: AtomicUsize,
    /// Most requests waiting at once since start or the last reset.
    peak_queued: AtomicUsize,
    /// KV blocks the running requests hold (prompt + output), for
    /// `vllm:kv_cache_usage_perc`.
    used_blocks: AtomicUsize,
    /// Completion ids.
    next_id: AtomicU64,
    /// Batched model: times the scheduler woke more than its catch-up bound after
    /// its modelled clock and restarted the clock (the run then depends on this
    /// machine's load), and the largest lag seen, µs; since start or the last reset.
    clock_resets: AtomicU64,
    max_lag_us: AtomicU64,
    /// Completion requests received since start or the last reset (the load-aware
    /// oracle tells its own requests still on the wire from those queued here).
    received: AtomicU64,
    /// Requests that reached their first token, and their summed TTFT (µs),
    /// since start: Prometheus counters, never reset (`vllm:time_to_first_token_seconds`).
    first_tokens: AtomicU64,
    ttft_sum_us: AtomicU64,
}

impl Counters {
    /// A request's first token is out, `ttft` after it arrived.
    fn note_first_token(&self, ttft: std::time::Duration) {
        self.first_tokens.fetch_add(1, Ordering::Relaxed);
        self.ttft_sum_us
            .fetch_add(ttft.as_micros() as u64, Ordering::Relaxed);
    }
}

fn routes(engine: Arc<Engine>) -> axum::Router {
    axum::Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/cached_prefix", post(cached_prefix))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .route("/stats", get(stats))
        .route("/metrics", get(metrics))
        .route("/health", get(|| async { StatusCode::OK }))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(engine)
}

/// Why a request was refused; nothing changed.
#[derive(Debug, Error, PartialEq, Eq)]
enum RequestError {
    #[error("{0}")]
    BadRequest(String),
    #[error("the engine is shutting down")]
    Unavailable,
}

impl IntoResponse for RequestError {
    fn into_response(self) -> Response {
        let (status, kind) = match self {
            Self::BadRequest(_) => (StatusCode::BAD_REQUEST, "BadRequestError"),
            Self::Unavailable => (StatusCode::SERVICE_UNAVAILABLE, "ServiceUnavailableError"),
        };
        let body = json!({
            "error": { "message": self.to_string(), "type": kind, "code": status.as_u16() }
        });
        (status, Json(body)).into_response()
    }
}

/// The fields of a completion request the engine uses; others are ignored.
#[derive(Debug, Deserialize)]
struct CompletionBody {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    prompt: Option<Value>,
    #[serde(default)]
    max_tokens: Option<u32>,
    #[serde(default)]
    stream: Option<bool>,
}

/// A validated completion request.
#[derive(Debug, PartialEq, Eq)]
struct Completion {
    model: String,
    prompt: Vec<u32>,
    max_tokens: u32,
    /// `"stream": true`: the response headers go out with the first token, as a
    /// streamed completion's do; the body (one JSON document, not server-sent
    /// events: only the headers' timing is modelled) when the request is done.
    stream: bool,
    /// Came to `/v1/chat/completions`: answered in the chat shape.
    chat: bool,
}

fn parse_completion(body: &[u8]) -> Result<Completion, RequestError> {
    let b: CompletionBody = serde_json::from_slice(body)
        .map_err(|e| RequestError::BadRequest(format!("invalid request body: {e}")))?;
    Ok(Completion {
        model: b.model.unwrap_or_default(),
        prompt: prompt_tokens(b.prompt)?,
        max_tokens: b.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS),
        stream: b.stream.unwrap_or(false),
        chat: false,
    })
}

/// With a tokenizer: any OpenAI completions or chat body, its prompt tokenized
/// by the product's body-mode code (template, special tokens, first of a list).
fn parse_with_tokenizer(
    tokenizer: &ModelTokenizer,
    endpoint: Endpoint,
    body: &[u8],
) -> Result<Completion, RequestError> {
    let bad = |e: String| RequestError::BadRequest(e);
    let b: CompletionBody =
        serde_json::from_slice(body).map_err(|e| bad(format!("invalid request body: {e}")))?;
    let req = body_request::parse(endpoint, body).map_err(|e| bad(e.to_string()))?;
    let prompt = tokenizer
        .prompt_ids(&req.prompt)
        .map_err(|e| bad(e.to_string()))?;
    if prompt.is_empty() {
        return Err(bad("prompt is empty".into()));
    }
    Ok(Completion {
        model: req.model,
        prompt,
        max_tokens: b.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS),
        stream: b.stream.unwrap_or(false),
        chat: matches!(endpoint, Endpoint::ChatCompletions),
    })
}

#[derive(Debug, Deserialize)]
struct PromptBody {
    #[serde(default)]
    prompt: Option<Value>,
    /// Used for the prediction only; anything but a u32 means the default.
    #[serde(default)]
    max_tokens: Option<Value>,
}

fn parse_prompt(body: &[u8]) -> Result<(Vec<u32>, u32), RequestError> {
    let b: PromptBody = serde_json::from_slice(body)
        .map_err(|e| RequestError::BadRequest(format!("invalid request body: {e}")))?;
    let max_tokens = b
        .max_tokens
        .and_then(|v| v.as_u64())
        .and_then(|v| u32::try_from(v).ok())
        .unwrap_or(DEFAULT_MAX_TOKENS);
    Ok((prompt_tokens(b.prompt)?, max_tokens))
}

/// The prompt as token ids: a non-empty array of u32.
fn prompt_tokens(prompt: Option<Value>) -> Result<Vec<u32>, RequestError> {
    let bad = |m: &str| Err(RequestError::BadRequest(m.to_string()));
    let items = match prompt {
        None | Some(Value::Null) => {
            return bad("prompt is missing: send token ids, e.g. \"prompt\": [1, 2, 3]");
        }
        Some(Value::String(_)) => {
            return bad(
                "prompt is text: start the simulated engine with --tokenizer DIR, or send token ids \
                 (an array of integers)",
            );
        }
        Some(Value::Array(items)) => items,
        Some(_) => return bad("prompt must be an array of token ids"),
    };
    if items.is_empty() {
        return bad("prompt is empty");
    }
    items
        .iter()
        .enumerate()
        .map(|(i, t)| {
            t.as_u64()
                .and_then(|t| u32::try_from(t).ok())
                .ok_or_else(|| {
                    RequestError::BadRequest(format!(
                        "prompt[{i}] is not a token id (an integer 0..=4294967295)"
                    ))
                })
        })
        .collect()
}

/// Modelled time for `tokens` tokens at `us_per_token` (bounded by the config check).
fn cost(us_per_token: f64, tokens: usize) -> Duration {
    Duration::try_from_secs_f64(us_per_token * tokens as f64 / 1e6).unwrap_or(Duration::MAX)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// What one served completion reports.
#[derive(Debug)]
struct Served {
    cached_tokens: usize,
    queue: Duration,
    prefill: Duration,
    decode: Duration,
}

impl Engine {
    /// Queue, admit, prefill, publish, decode. `first` is told when the first
    /// token is out (the end of the prefill).
    async fn serve(
        &self,
        req: &Completion,
        first: Option<oneshot::Sender<()>>,
    ) -> Result<Served, RequestError> {
        if let Some(b) = &self.batcher {
            return self
                .serve_batched(b, &req.prompt, req.max_tokens, first)
                .await;
        }
        let arrived = Instant::now();
        let c = &self.counters;
        c.received.fetch_add(1, Ordering::Relaxed);
        // Only a request that finds every slot taken waits (and counts as queued);
        // try_acquire cannot overtake waiters, released permits go to them first.
        let permit = match self.slots.try_acquire() {
            Ok(p) => p,
            Err(_) => {
                let waiting = c.queued.fetch_add(1, Ordering::Relaxed) + 1;
                c.peak_queued.fetch_max(waiting, Ordering::Relaxed);
                let p = self.slots.acquire().await;
                c.queued.fetch_sub(1, Ordering::Relaxed);
                p.map_err(|_| RequestError::Unavailable)?
            }
        };
        c.running.fetch_add(1, Ordering::Relaxed);
        let blocks = (req.prompt.len() + req.max_tokens as usize)
            .div_ceil(self.config.block_size.max(1) as usize);
        c.used_blocks.fetch_add(blocks, Ordering::Relaxed);
        let started = Instant::now();
        let (admission, ticket) = {
            let mut cache = self.cache.lock();
            let admission = cache.admit(&req.prompt);
            (admission, self.publisher.ticket())
        };
        let cached_tokens = admission.cached_tokens;
        let prefill = cost(
            self.config.prefill_us_per_token,
            req.prompt.len() - cached_tokens,
        );
        let decode = cost(self.config.decode_us_per_token, req.max_tokens as usize);
        sleep_until(started, prefill).await;
        c.note_first_token(Instant::now().saturating_duration_since(arrived));
        ticket.publish(admission_events(admission.removed, admission.stored));
        if let Some(first) = first {
            let _ = first.send(());
        }
        sleep_until(started, prefill.saturating_add(decode)).await;
        c.running.fetch_sub(1, Ordering::Relaxed);
        c.used_blocks.fetch_sub(blocks, Ordering::Relaxed);
        c.served.fetch_add(1, Ordering::Relaxed);
        drop(permit);
        Ok(Served {
            cached_tokens,
            queue: started - arrived,
            prefill,
            decode,
        })
    }

    fn completion_json(&self, req: &Completion, s: &Served) -> Value {
        let n = self.counters.next_id.fetch_add(1, Ordering::Relaxed);
        let (prompt, completion) = (req.prompt.len(), req.max_tokens as usize);
        let queue_ms = ms(s.queue);
        let prefill_ms = ms(s.prefill);
        // The engine generates no text: an empty answer of max_tokens tokens.
        let (id, object, choice) = if req.chat {
            let message = json!({ "role": "assistant", "content": "" });
            let choice = json!({ "index": 0, "message": message, "finish_reason": "length" });
            (
                format!("chatcmpl-{}-{n}", self.config.id),
                "chat.completion",
                choice,
            )
        } else {
            let choice = json!({ "index": 0, "text": "", "finish_reason": "length" });
            (
                format!("cmpl-{}-{n}", self.config.id),
                "text_completion",
                choice,
            )
        };
        let created = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        json!({
            "id": id,
            "object": object,
            "created": created,
            "model": req.model,
            "choices": [choice],
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": { "cached_tokens": s.cached_tokens },
            },
            "sim": {
                "replica": self.config.id,
                "queue_ms": queue_ms,
                "prefill_ms": prefill_ms,
                "decode_ms": ms(s.decode),
                "ttft_ms": queue_ms + prefill_ms,
            },
        })
    }
}

/// Sleeps until `start + after`; deadlines from one start do not accumulate the
/// timer's rounding.
async fn sleep_until(start: Instant, after: Duration) {
    if after.is_zero() {
        return;
    }
    if let Some(deadline) = start.checked_add(after) {
        tokio::time::sleep_until(deadline).await;
    }
}

async fn completions(State(engine): State<Arc<Engine>>, body: Bytes) -> Response {
    let parsed = match &engine.tokenizer {
        Some(t) => tokenize_off_runtime(t, Endpoint::Completions, body).await,
        None => parse_completion(&body),
    };
    serve_parsed(engine, parsed).await
}

/// Chat completions need `--tokenizer` (the messages are rendered and tokenized);
/// the answer has the completions shape.
async fn chat_completions(State(engine): State<Arc<Engine>>, body: Bytes) -> Response {
    let parsed = match &engine.tokenizer {
        Some(t) => tokenize_off_runtime(t, Endpoint::ChatCompletions, body).await,
        None => Err(RequestError::BadRequest(
            "chat completions need the engine's --tokenizer".into(),
        )),
    };
    serve_parsed(engine, parsed).await
}

/// Tokenizing a long prompt takes milliseconds: on the blocking pool, so the
/// engines' modelled clocks and the benchmark's driver (one runtime) keep time.
async fn tokenize_off_runtime(
    tokenizer: &Arc<ModelTokenizer>,
    endpoint: Endpoint,
    body: Bytes,
) -> Result<Completion, RequestError> {
    let tokenizer = tokenizer.clone();
    tokio::task::spawn_blocking(move || parse_with_tokenizer(&tokenizer, endpoint, &body))
        .await
        .unwrap_or_else(|e| Err(RequestError::BadRequest(format!("tokenizing failed: {e}"))))
}

async fn serve_parsed(engine: Arc<Engine>, parsed: Result<Completion, RequestError>) -> Response {
    let mut response = match parsed {
        Err(e) => e.into_response(),
        Ok(req) => {
            // A task of its own, so a client that goes away cannot cancel a request
            // whose cache change has happened but whose events are not yet out.
            let e = engine.clone();
            let stream = req.stream;
            let (first_tx, first_rx) = oneshot::channel();
            let served = tokio::spawn(async move {
                let s = e.serve(&req, stream.then_some(first_tx)).await;
                s.map(|s| e.completion_json(&req, &s))
            });
            if stream && first_rx.await.is_ok() {
                streamed(served)
            } else {
                match served.await {
                    Ok(Ok(body)) => Json(body).into_response(),
                    Ok(Err(e)) => e.into_response(),
                    Err(_) => RequestError::Unavailable.into_response(),
                }
            }
        }
    };
    response
        .headers_mut()
        .insert(REPLICA_HEADER, engine.replica_header.clone());
    response
}

/// A streamed completion's response: its headers now (the first token is out),
/// its body when the request is done.
fn streamed(served: JoinHandle<Result<Value, RequestError>>) -> Response {
    let body = futures::stream::once(async move {
        match served.await {
            Ok(Ok(v)) => Ok(Bytes::from(v.to_string())),
            Ok(Err(e)) => Err(std::io::Error::other(e.to_string())),
            Err(e) => Err(std::io::Error::other(e.to_string())),
        }
    });
    (
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        axum::body::Body::from_stream(body),
    )
        .into_response()
}

/// What the cache holds of a prompt and how long it would wait: the oracles' view.
/// `predicted_ttft_ms` is the cost model's estimate of this prompt's time to first
/// token if it arrived now (queued prefill work ahead of it + its own uncached
/// prefill).
async fn cached_prefix(State(engine): State<Arc<Engine>>, body: Bytes) -> Response {
    match parse_prompt(&body) {
        Err(e) => e.into_response(),
        Ok((prompt, max_tokens)) => {
            let cached = engine.cache.lock().lookup(&prompt);
            let uncached = prompt.len() - cached;
            let c = &engine.counters;
            let (queued, running) = (
                c.queued.load(Ordering::Relaxed),
                c.running.load(Ordering::Relaxed),
            );
            let mut received = c.received.load(Ordering::Relaxed);
            let (pending, decoding, predicted_us) = match &engine.batcher {
                Some(b) => {
                    let (pending, decoding) = {
                        let q = b.queue.lock();
                        received = c.received.load(Ordering::Relaxed);
                        (q.pending_prefill, q.decoding)
                    };
                    let us = b.costs.predict_ttft_us(pending, uncached, decoding);
                    (pending, decoding, us)
                }
                None => {
                    // Each request ahead beyond the free slots costs about as much as
                    // this one would uncached, shared over the slots.
                    let cfg = &engine.config;
                    let own = uncached as f64 * cfg.prefill_us_per_token;
                    let full = prompt.len() as f64 * cfg.prefill_us_per_token
                        + f64::from(max_tokens) * cfg.decode_us_per_token;
                    let excess = (queued + running + 1).saturating_sub(cfg.max_running);
                    let wait = excess as f64 / cfg.max_running as f64 * full;
                    (0, running, own + wait)
                }
            };
            Json(json!({
                "cached_tokens": cached,
                "queued": queued,
                "running": running,
                "pending_prefill_tokens": pending,
                "received": received,
                "decoding": decoding,
                "predicted_ttft_ms": predicted_us / 1e3,
            }))
            .into_response()
        }
    }
}

/// `GET /metrics`: the scheduler gauges real vLLM (V1) exports, with its names,
/// help texts, labels (`engine`, `model_name`, in that order) and float formatting.
async fn metrics(State(engine): State<Arc<Engine>>) -> Response {
    let c = &engine.counters;
    let used = c.used_blocks.load(Ordering::Relaxed) as f64;
    let usage = (used / engine.config.capacity_blocks.max(1) as f64).clamp(0.0, 1.0);
    let text = vllm_metrics_text(
        &engine.config.model_name,
        c.running.load(Ordering::Relaxed),
        c.queued.load(Ordering::Relaxed),
        usage,
        (
            c.first_tokens.load(Ordering::Relaxed),
            c.ttft_sum_us.load(Ordering::Relaxed) as f64 / 1e6,
        ),
    );
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

/// The exposition text of [`metrics`]; `ttft` is the TTFT histogram's (count,
/// sum in seconds), printed with only its `+Inf` bucket.
fn vllm_metrics_text(
    model_name: &str,
    running: usize,
    waiting: usize,
    usage: f64,
    ttft: (u64, f64),
) -> String {
    let labels = format!(
        "{{engine=\"0\",model_name=\"{}\"}}",
        model_name.replace('\\', "\\\\").replace('"', "\\\"")
    );
    let mut out = String::new();
    for (name, help, value) in [
        (
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            running as f64,
        ),
        (
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            waiting as f64,
        ),
        (
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            usage,
        ),
    ] {
        out.push_str(&format!(
            "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{labels} {value:?}\n"
        ));
    }
    let (count, sum) = ttft;
    let name = "vllm:time_to_first_token_seconds";
    let bucket = labels.replace('}', ",le=\"+Inf\"}");
    out.push_str(&format!(
        "# HELP {name} Histogram of time to first token in seconds.\n\
         # TYPE {name} histogram\n\
         {name}_sum{labels} {sum:?}\n\
         {name}_bucket{bucket} {:?}\n\
         {name}_count{labels} {:?}\n",
        count as f64, count as f64
    ));
    out
}

async fn reset_prefix_cache(State(engine): State<Arc<Engine>>) -> StatusCode {
    let ticket = {
        let mut cache = engine.cache.lock();
        cache.clear();
        engine.publisher.ticket()
    };
    ticket.publish(vec![KvEvent::Cleared]);
    let c = &engine.counters;
    c.served.store(0, Ordering::Relaxed);
    c.clock_resets.store(0, Ordering::Relaxed);
    c.received.store(0, Ordering::Relaxed);
    c.max_lag_us.store(0, Ordering::Relaxed);
    c.peak_queued
        .store(c.queued.load(Ordering::Relaxed), Ordering::Relaxed);
    StatusCode::OK
}

async fn stats(State(engine): State<Arc<Engine>>) -> Json<Value> {
    let (cached_blocks, capacity_blocks) = {
        let cache = engine.cache.lock();
        (cache.len(), cache.capacity())
    };
    let c = &engine.counters;
    Json(json!({
        "replica": engine.config.id,
        "served": c.served.load(Ordering::Relaxed),
        "queued": c.queued.load(Ordering::Relaxed),
        "running": c.running.load(Ordering::Relaxed),
        "peak_queued": c.peak_queued.load(Ordering::Relaxed),
        "clock_resets": c.clock_resets.load(Ordering::Relaxed),
        "max_lag_ms": c.max_lag_us.load(Ordering::Relaxed) as f64 / 1e3,
        "cached_blocks": cached_blocks,
        "capacity_blocks": capacity_blocks,
    }))
}

#[cfg(test)]
mod tests;
