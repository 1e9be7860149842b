//! Plays one schedule through one router and records what every request got.
//!
//! Requests leave at their scheduled times whatever happened to earlier ones (an
//! open loop), carrying the inferencecache headers for every router (the plain
//! balancers ignore them), so each router sees byte-identical traffic. With
//! `--clients openai` they carry none: the sidecar reads the body instead.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use futures::future::join_all;
use serde_json::{Value, json};
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::engine::BatchCosts;
use super::envoy::UPSTREAM_HEADER;
use super::http::Http;
use super::router::Router;
use super::text::TextRendering;
use super::workload::Request;
use inferencecache::adapters::ext_proc::headers;
use inferencecache_core::chain::{Scheme, compute_chain, header_value};

/// The model and hash scheme of every benchmark request (the tenant is the router's).
pub const MODEL: &str = "sim-model";
pub const SCHEME: Scheme = Scheme::ContentV1;

/// One engine as the driver sees it.
#[derive(Clone, Debug)]
pub struct EngineRef {
    pub id: String,
    /// `http://host:port`
    pub base: String,
}

/// How the benchmark's clients ask for a completion.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Clients {
    /// With inferencecache's routing headers: the block-hash chain the client
    /// computed, the model and the hash scheme (the headers-only fast path).
    Headers,
    /// Plain OpenAI requests: a text prompt and the model in the body, no routing
    /// headers; the sidecar reads the body (body mode) and tokenizes it itself.
    /// Needs `--tokenizer`.
    Openai,
}

/// A request ready to send: the body and routing headers computed once.
pub struct Prepared {
    /// The request; with a text workload its prompt is the ids the engine
    /// tokenizes the text into (what the oracles ask the engines about).
    pub request: Request,
    body: Value,
    headers: Vec<(&'static str, String)>,
}

/// Computes each request's chain and body. With `text`, prompts go out as text
/// (each synthetic id one word of the model's vocabulary) and the chain is
/// computed from the text's real token ids. With `stream`, each body asks for a
/// streamed completion (its response headers come with the first token).
pub fn prepare(
    schedule: Vec<Request>,
    block_size: u32,
    clients: Clients,
    text: Option<&TextRendering>,
    stream: bool,
) -> anyhow::Result<Vec<Prepared>> {
    if clients == Clients::Openai && text.is_none() {
        bail!("--clients openai sends text prompts: give --tokenizer DIR");
    }
    schedule
        .into_iter()
        .map(|mut request| {
            let prompt = match text {
                Some(t) => {
                    let s = t.text(&request.prompt);
                    request.prompt = t.prompt_ids(&s)?;
                    Value::String(s)
                }
                None => json!(request.prompt),
            };
            let mut body = json!({
                "model": MODEL,
                "prompt": prompt,
                "max_tokens": request.max_tokens,
            });
            if stream {
                body["stream"] = Value::Bool(true);
            }
            // The debug header only asks the sidecar to explain its decision (the
            // reason column); it carries nothing the decision reads.
            let mut headers = vec![(headers::DEBUG, "1".to_string())];
            if clients == Clients::Headers {
                let chain = compute_chain(SCHEME, &request.prompt, block_size, None)?;
                let counts = vec![block_size.to_string(); chain.len()].join(",");
                headers.extend([
                    (headers::MODEL, MODEL.to_string()),
                    (headers::HASH_SCHEME, SCHEME.name().to_string()),
                    (headers::BLOCK_HASHES, header_value(&chain)),
                    (headers::BLOCK_TOKEN_COUNTS, counts),
                ]);
            }
            Ok(Prepared {
                request,
                body,
                headers,
            })
        })
        .collect()
}

/// What one request got (one line of `bench-routing --trace`).
#[derive(Clone, Debug, serde::Serialize)]
pub struct Sample {
    /// Its arrival time from the start of the run, ms.
    pub at_ms: f64,
    /// The engine's modeled time to first token (queue + prefill); the client's
    /// whole latency for engines that do not report it.
    pub ttft_ms: f64,
    pub latency_ms: f64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub replica: String,
    /// inferencecache's reason code (debug header), if it routed the request.
    pub reason: Option<String>,
    /// The prompt tokens inferencecache predicted cached on its pick (the
    /// `x-inferencecache-matched-tokens` debug header; 0 when it decided without a
    /// pick), if it routed the request.
    pub predicted_cached: Option<u64>,
    /// The replica the cache preferred when the load rule moved the pick.
    pub spilled_from: Option<String>,
    /// The load rule's check that moved it (`requests`, `share`, `prefill`).
    pub spilled_by: Option<String>,
    pub family: u32,
    /// The workload's tenant that sent it.
    pub tenant: u8,
    pub priority: i32,
    /// How long the sidecar's flow control held it before routing it
    /// (`x-inferencecache-queued-ms`; 0 when not held). Part of `ttft_ms`.
    pub queued_ms: f64,
}

/// A request answered 429 by the sidecar's flow control: not a failure, not served.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Shed {
    pub at_ms: f64,
    pub tenant: u8,
    pub priority: i32,
    /// `x-inferencecache-shed` (`queue-full`, `queue-timeout`, `priority`).
    pub reason: String,
    /// From sending the request to its 429, ms.
    pub latency_ms: f64,
}

/// How one request ended.
enum Answer {
    Served(Sample),
    Shed(Shed),
}

/// Everything a run produced.
pub struct Outcome {
    /// The requests served (2xx).
    pub samples: Vec<Sample>,
    /// The requests shed with 429.
    pub shed: Vec<Shed>,
    /// The requests that failed otherwise (any other status, or no answer).
    pub errors: usize,
    pub first_error: Option<String>,
    pub elapsed: Duration,
}

/// How the clients send.
#[derive(Clone, Copy, Debug, Default)]
pub struct Sending {
    /// Requests name their tenant (`x-inferencecache-tenant`).
    pub tenant_header: bool,
    /// Every request of this tenant index goes to the first Envoy (the others
    /// are split round-robin over all of them).
    pub pinned_tenant: Option<u8>,
}

/// Sends `schedule` through `router`: `listeners` are its Envoy base URLs (one per
/// Envoy; request i goes to listener i mod n, so several Envoys split the traffic
/// round-robin, except a pinned tenant's); the oracles go to the engines directly.
pub async fn run(
    http: &Http,
    router: Router,
    listeners: &[String],
    engines: &[EngineRef],
    schedule: Arc<Vec<Prepared>>,
    costs: &[Option<BatchCosts>],
    sending: Sending,
) -> anyhow::Result<Outcome> {
    let tenant_header = sending.tenant_header;
    let costs: Arc<Vec<Option<BatchCosts>>> = Arc::new(costs.to_vec());
    if !router.is_oracle() && listeners.is_empty() {
        bail!("{} needs an Envoy listener", router.name());
    }
    let by_addr: Arc<HashMap<String, String>> = Arc::new(
        engines
            .iter()
            .map(|e| {
                (
                    e.base.trim_start_matches("http://").to_string(),
                    e.id.clone(),
                )
            })
            .collect(),
    );
    let engines: Arc<Vec<EngineRef>> = Arc::new(engines.to_vec());
    let listeners: Arc<Vec<String>> = Arc::new(
        listeners
            .iter()
            .map(|l| format!("{l}/v1/completions"))
            .collect(),
    );
    let ledger = Arc::new(tokio::sync::Mutex::new(Ledger::new(engines.len())));
    let cap =
        (router == Router::OracleBalanced).then(|| balanced_cap(schedule.len(), engines.len()));
    let start = Instant::now();
    let mut tasks = JoinSet::new();
    for i in 0..schedule.len() {
        let (http, schedule, engines, by_addr, listeners, ledger, costs) = (
            http.clone(),
            schedule.clone(),
            engines.clone(),
            by_addr.clone(),
            listeners.clone(),
            ledger.clone(),
            costs.clone(),
        );
        tasks.spawn(async move {
            let p = &schedule[i];
            tokio::time::sleep_until(start + p.request.at).await;
            let url = if router.is_oracle() {
                format!(
                    "{}/v1/completions",
                    oracle_pick(&http, &engines, p, router, &ledger, &costs, cap).await?
                )
            } else if sending.pinned_tenant == Some(p.request.tenant) {
                listeners[0].clone()
            } else {
                listeners[i % listeners.len()].clone()
            };
            send(&http, &url, router, p, &by_addr, tenant_header).await
        });
    }
    let mut samples = Vec::with_capacity(schedule.len());
    let mut shed = Vec::new();
    let (mut errors, mut first_error) = (0, None);
    while let Some(joined) = tasks.join_next().await {
        match joined.context("request task")? {
            Ok(Answer::Served(s)) => samples.push(s),
            Ok(Answer::Shed(s)) => shed.push(s),
            Err(e) => {
                errors += 1;
                first_error.get_or_insert_with(|| format!("{e:#}"));
            }
        }
    }
    Ok(Outcome {
        samples,
        shed,
        errors,
        first_error,
        elapsed: start.elapsed(),
    })
}

async fn send(
    http: &Http,
    url: &str,
    router: Router,
    p: &Prepared,
    by_addr: &HashMap<String, String>,
    tenant_header: bool,
) -> anyhow::Result<Answer> {
    let mut headers = p.headers.clone();
    if tenant_header {
        headers.push((headers::TENANT, router.tenant_of(p.request.tenant)));
    }
    if p.request.priority != 0 {
        headers.push((headers::PRIORITY, p.request.priority.to_string()));
    }
    let sent = Instant::now();
    let reply = http.post_json(url, &headers, &p.body).await?;
    let latency_ms = sent.elapsed().as_secs_f64() * 1e3;
    let at_ms = p.request.at.as_secs_f64() * 1e3;
    // Only the sidecar's flow control sheds: a 429 it did not mark is a failure.
    if let Some(reason) = reply
        .headers
        .get(headers::SHED)
        .and_then(|v| v.to_str().ok())
        .filter(|_| reply.status.as_u16() == 429)
    {
        return Ok(Answer::Shed(Shed {
            at_ms,
            tenant: p.request.tenant,
            priority: p.request.priority,
            reason: reason.to_string(),
            latency_ms,
        }));
    }
    if !reply.status.is_success() {
        bail!(
            "{url}: {} {}",
            reply.status,
            String::from_utf8_lossy(&reply.body)
        );
    }
    let body = reply.json()?;
    let usage = &body["usage"];
    let header = |name: &str| {
        reply
            .headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let replica = match body["sim"]["replica"].as_str() {
        Some(id) => id.to_string(),
        None => {
            let host = header(UPSTREAM_HEADER).unwrap_or_default();
            by_addr.get(&host).cloned().unwrap_or(host)
        }
    };
    let queued_ms: f64 = header(headers::QUEUED_MS)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    // The engine's TTFT starts when the request reaches it; a request the sidecar
    // held waited that long before, and its client saw both.
    let engine_ttft = body["sim"]["ttft_ms"].as_f64();
    Ok(Answer::Served(Sample {
        at_ms,
        ttft_ms: engine_ttft.map_or(latency_ms, |t| t + queued_ms),
        latency_ms,
        prompt_tokens: usage["prompt_tokens"]
            .as_u64()
            .context("response has no usage.prompt_tokens")?,
        cached_tokens: usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0),
        replica,
        reason: header(headers::REASON),
        predicted_cached: router.is_inferencecache().then(|| {
            header(headers::MATCHED_TOKENS)
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        }),
        spilled_from: header(headers::SPILLED_FROM),
        spilled_by: header(headers::SPILLED_BY),
        family: p.request.family,
        tenant: p.request.tenant,
        priority: p.request.priority,
        queued_ms,
    }))
}

/// The oracles' own requests still on the wire: decided, sent, not yet received by
/// their engine. Without it, decisions overlapping within one `/v1/cached_prefix`
/// round trip all see the same idle engine and herd onto it.
#[derive(Debug)]
pub struct Ledger {
    /// Per engine, the uncached prompt tokens of every request sent there this run,
    /// in sending order (trimmed to those the engine has not reported received).
    sent: Vec<std::collections::VecDeque<u64>>,
    /// Per engine, how many requests were trimmed from `sent` (received for sure).
    trimmed: Vec<u64>,
    /// Per engine, every request sent there this run (the balanced oracle's cap).
    routed: Vec<u64>,
}

impl Ledger {
    pub fn new(engines: usize) -> Self {
        Self {
            sent: vec![Default::default(); engines],
            trimmed: vec![0; engines],
            routed: vec![0; engines],
        }
    }

    /// The uncached tokens of `engine`'s requests not among the first `received`
    /// it reported (requests to one engine arrive about in the order they left).
    pub fn in_transit(&mut self, engine: usize, received: u64) -> u64 {
        let (sent, trimmed) = (&mut self.sent[engine], &mut self.trimmed[engine]);
        while *trimmed < received && sent.pop_front().is_some() {
            *trimmed += 1;
        }
        sent.iter().sum()
    }

    pub fn record(&mut self, engine: usize, uncached: u64) {
        self.sent[engine].push_back(uncached);
        self.routed[engine] += 1;
    }

    pub fn routed(&self, engine: usize) -> u64 {
        self.routed[engine]
    }
}

/// What an engine told an oracle about one prompt.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EngineView {
    pub cached: u64,
    /// Queued + running requests.
    pub load: u64,
    /// The engine's cost model's prediction of this prompt's TTFT there, ms.
    pub predicted_ttft_ms: f64,
    /// Already given its cap of requests (the balanced oracle only).
    pub full: bool,
}

/// The most requests the balanced oracle gives one engine in a run of `requests`:
/// ⌊1.3 × the mean⌋, the acceptance's max/mean bound, and never less than the mean
/// rounded up, so the engines always have room for every request.
pub fn balanced_cap(requests: usize, engines: usize) -> u64 {
    let engines = engines.max(1) as u64;
    let requests = requests as u64;
    (requests * 13 / (10 * engines)).max(requests.div_ceil(engines))
}

/// The oracles' choice among the engines' answers (index; `None` when empty).
/// `oracle`: the longest cached prefix, ties to the fewest queued + running, then
/// the first. `oracle-load`: the lowest predicted TTFT, ties to the longest cached
/// prefix, then the fewest queued + running, then the first. `oracle-balanced`:
/// the same among the engines not yet `full`.
pub fn oracle_choice(router: Router, views: &[EngineView]) -> Option<usize> {
    let mut best: Option<(usize, EngineView)> = None;
    for (i, v) in views.iter().copied().enumerate() {
        let better = match best {
            None => true,
            Some((_, b)) if router == Router::OracleBalanced && v.full != b.full => b.full,
            Some((_, b)) if router != Router::Oracle => {
                match v.predicted_ttft_ms.total_cmp(&b.predicted_ttft_ms) {
                    std::cmp::Ordering::Less => true,
                    std::cmp::Ordering::Greater => false,
                    std::cmp::Ordering::Equal => {
                        v.cached > b.cached || (v.cached == b.cached && v.load < b.load)
                    }
                }
            }
            Some((_, b)) => v.cached > b.cached || (v.cached == b.cached && v.load < b.load),
        };
        if better {
            best = Some((i, v));
        }
    }
    best.map(|(i, _)| i)
}

/// An oracle: asks every engine about the prompt right now and picks by
/// [`oracle_choice`]. Decisions are serialised and each accounts the oracle's own
/// requests still on the wire (the [`Ledger`]); under the batched model the
/// load-aware oracle predicts TTFT itself from the engine's queued prefill plus
/// those in-transit tokens, with the engines' own cost model.
async fn oracle_pick(
    http: &Http,
    engines: &[EngineRef],
    p: &Prepared,
    router: Router,
    ledger: &tokio::sync::Mutex<Ledger>,
    costs: &[Option<BatchCosts>],
    cap: Option<u64>,
) -> anyhow::Result<String> {
    let mut ledger = ledger.lock().await;
    let body = json!({ "prompt": p.request.prompt, "max_tokens": p.request.max_tokens });
    let prompt_len = p.request.prompt.len() as u64;
    let answers = join_all(engines.iter().map(|e| {
        let url = format!("{}/v1/cached_prefix", e.base);
        let body = &body;
        async move {
            let reply = http.post_json(&url, &[], body).await?;
            let v = reply.json()?;
            let cached = v["cached_tokens"].as_u64().context("no cached_tokens")?;
            let load = v["queued"].as_u64().unwrap_or(0) + v["running"].as_u64().unwrap_or(0);
            let predicted_ttft_ms = v["predicted_ttft_ms"]
                .as_f64()
                .context("no predicted_ttft_ms")?;
            let queue = (
                v["pending_prefill_tokens"].as_u64().unwrap_or(0),
                v["decoding"].as_u64().unwrap_or(0),
                v["received"].as_u64().unwrap_or(0),
            );
            anyhow::Ok((
                EngineView {
                    cached,
                    load,
                    predicted_ttft_ms,
                    full: false,
                },
                queue,
            ))
        }
    }))
    .await;
    let answers = answers.into_iter().collect::<anyhow::Result<Vec<_>>>()?;
    let views: Vec<EngineView> = answers
        .iter()
        .enumerate()
        .map(|(e, &(mut view, (pending, decoding, received)))| {
            let transit = ledger.in_transit(e, received);
            view.full = cap.is_some_and(|cap| ledger.routed(e) >= cap);
            if let Some(c) = costs.get(e).copied().flatten() {
                let uncached = prompt_len.saturating_sub(view.cached);
                view.predicted_ttft_ms = c.predict_ttft_us(
                    (pending + transit) as usize,
                    uncached as usize,
                    decoding as usize,
                ) / 1e3;
            }
            view
        })
        .collect();
    match oracle_choice(router, &views) {
        Some(i) => {
            ledger.record(i, prompt_len.saturating_sub(views[i].cached));
            Ok(engines[i].base.clone())
        }
        None => bail!("the oracle has no engines"),
    }
}

#[cfg(test)]
mod tests;
