//! One replica's scrape loop: GET its metrics URL every interval, parse, report.
//!
//! The task does I/O and nothing else of note (parsing one vLLM body takes
//! microseconds, measured in `tests.rs`). A failed scrape leaves the last good
//! sample, with its scrape time, where it is: the core ignores it once older than
//! the policy's `statsMaxAge`. Dropping the [`Scraper`] stops the task.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::task::JoinHandle;
use tracing::Instrument;

use super::ScrapeConfig;
use super::metrics::{EngineMetricsMetrics, Outcome, ReplicaLabels};
use super::parse::{self, EngineSample};
use crate::core::Router;
use crate::core::index::{ReplicaStats, StatsReport};
use crate::core::time::Timestamp;

/// The largest body read: a vLLM `/metrics` with every histogram is ~100 KiB.
pub const MAX_BODY_BYTES: usize = 4 << 20;

/// A running scraper; dropping it stops it.
#[derive(Debug)]
pub struct Scraper {
    task: JoinHandle<()>,
    labels: ReplicaLabels,
    metrics: Arc<EngineMetricsMetrics>,
}

impl Drop for Scraper {
    fn drop(&mut self) {
        self.task.abort();
        self.metrics.scraper_stopped(&self.labels);
    }
}

impl Scraper {
    /// Starts the loop (needs a Tokio runtime).
    pub fn spawn(
        config: ScrapeConfig,
        router: Arc<Router>,
        metrics: Arc<EngineMetricsMetrics>,
    ) -> Self {
        let labels = ReplicaLabels {
            tenant: config.scope.tenant.to_string(),
            model: config.scope.model.to_string(),
            replica: config.replica_id.clone(),
        };
        metrics.scraper_started();
        let span = tracing::info_span!("engine_scrape",
            tenant = %config.scope.tenant, model = %config.scope.model,
            replica = %config.replica_id, endpoint = %config.url);
        let task =
            tokio::spawn(run(config, router, metrics.clone(), labels.clone()).instrument(span));
        Self {
            task,
            labels,
            metrics,
        }
    }
}

/// Why one scrape failed.
#[derive(Debug)]
enum Failure {
    Fetch(String),
    Parse(String),
}

async fn run(
    config: ScrapeConfig,
    router: Arc<Router>,
    metrics: Arc<EngineMetricsMetrics>,
    labels: ReplicaLabels,
) {
    let uri: hyper::Uri = match config.url.parse() {
        Ok(u) => u,
        Err(e) => {
            // The resolver checked the URL; a replica address that still does not
            // parse is reported once and never scraped.
            tracing::warn!(error = %e, "engine metrics URL does not parse; not scraping");
            return;
        }
    };
    let mut connector = HttpConnector::new();
    connector.set_connect_timeout(Some(config.timeout));
    connector.set_nodelay(true);
    let client: Client<HttpConnector, Empty<Bytes>> =
        Client::builder(TokioExecutor::new()).build(connector);
    let started = Instant::now();
    let mut last_ok: Option<Instant> = None;
    let mut healthy: Option<bool> = None;
    let mut tick = tokio::time::interval(config.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let result = match tokio::time::timeout(config.timeout, fetch(&client, &uri)).await {
            Ok(Ok(body)) => apply(&config, &router, &body),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(Failure::Fetch(format!(
                "no answer within {:?}",
                config.timeout
            ))),
        };
        match &result {
            Ok(sample) => {
                metrics.scrape(Outcome::Ok);
                last_ok = Some(Instant::now());
                if healthy != Some(true) {
                    tracing::info!(
                        waiting = sample.waiting,
                        running = sample.running,
                        kv_usage = sample.kv_usage,
                        "engine metrics scraped"
                    );
                }
            }
            Err(f) => {
                let (outcome, text) = match f {
                    Failure::Fetch(t) => (Outcome::Error, t),
                    Failure::Parse(t) => (Outcome::ParseError, t),
                };
                metrics.scrape(outcome);
                // Log the change of state, not every failed tick.
                if healthy != Some(false) {
                    tracing::warn!(error = %text, "engine metrics scrape failed; its last sample ages out after statsMaxAge");
                } else {
                    tracing::debug!(error = %text, "engine metrics scrape failed");
                }
            }
        }
        healthy = Some(result.is_ok());
        let since = last_ok.unwrap_or(started);
        metrics.set_age(&labels, since.elapsed().as_secs_f64());
    }
}

/// One GET: the body of a 200 answer, at most [`MAX_BODY_BYTES`].
async fn fetch(
    client: &Client<HttpConnector, Empty<Bytes>>,
    uri: &hyper::Uri,
) -> Result<Bytes, Failure> {
    let req = http::Request::get(uri.clone())
        .header(http::header::ACCEPT, "text/plain")
        .body(Empty::<Bytes>::new())
        .map_err(|e| Failure::Fetch(e.to_string()))?;
    let resp = client
        .request(req)
        .await
        .map_err(|e| Failure::Fetch(format!("request failed: {e}")))?;
    if resp.status() != http::StatusCode::OK {
        return Err(Failure::Fetch(format!("HTTP status {}", resp.status())));
    }
    let body = Limited::new(resp.into_body(), MAX_BODY_BYTES)
        .collect()
        .await
        .map_err(|e| Failure::Fetch(format!("reading the body: {e}")))?;
    Ok(body.to_bytes())
}

/// Parses a body and reports it to the router; a bad body changes nothing.
fn apply(config: &ScrapeConfig, router: &Router, body: &[u8]) -> Result<EngineSample, Failure> {
    let sample = parse_body(body, config.engine).map_err(Failure::Parse)?;
    report(config, router, sample, Timestamp::now()).map_err(Failure::Parse)?;
    Ok(sample)
}

/// UTF-8 check and [`parse::parse`].
pub fn parse_body(body: &[u8], engine: super::EngineKind) -> Result<EngineSample, String> {
    let text = std::str::from_utf8(body).map_err(|e| format!("body is not UTF-8: {e}"))?;
    parse::parse(text, engine).map_err(|e| e.to_string())
}

/// Feeds one sample to the router as of `now`: waiting + running become the
/// replica's engine queue, KV usage goes into its stats. The empty endpoint
/// leaves the replica's registration alone (it is declared, not self-registered).
pub fn report(
    config: &ScrapeConfig,
    router: &Router,
    sample: EngineSample,
    now: Timestamp,
) -> Result<(), String> {
    router
        .report_stats(
            &StatsReport {
                scope: config.scope.as_ref(),
                replica_id: &config.replica_id,
                endpoint: "",
                stats: ReplicaStats {
                    waiting_requests: sample.waiting,
                    running_requests: sample.running,
                    kv_cache_usage: sample.kv_usage,
                    hit_rate: sample.hit_rate.unwrap_or(0.0),
                    first_tokens_total: sample.first_tokens,
                    ..ReplicaStats::default()
                },
            },
            now,
        )
        .map_err(|e| format!("not applied: {e}"))
}
