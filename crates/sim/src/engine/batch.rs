//! The continuous-batching cost model (`--cost-model batched`, the default): the
//! shape of vLLM V1's scheduler with chunked prefill, driven by a step-time model.
//!
//! ```text
//!  POST ─▶ waiting (FIFO) ─┐ at each step boundary, in order:
//!                          │  1. every running request: decoding → 1 token of the budget,
//!                          │     prefilling → its next chunk (what is left of the budget)
//!                          │  2. waiting requests join (admit: cache hit counted, blocks
//!                          │     stored) while budget, max_running and KV blocks allow
//!                          ▼
//!  step time = base + prefill_us_per_token × prefill tokens + decode_us_per_seq × decoding
//!  the step that runs a request's last prefill chunk samples its first token (TTFT) and
//!  publishes its KV events; each later step decodes one token.
//! ```
//!
//! So a burst of prefills lengthens every running request's steps (its decode
//! slows down), a request's TTFT grows with the prefill work queued ahead of it,
//! and cached prompt tokens cost nothing (at least one token is always computed,
//! as in vLLM). The clock advances by the modelled step times; the real sleeps only
//! follow it (a timer that wakes late does not make the next step longer).

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::time::Instant;

use super::{Engine, RequestError, Served};
use crate::events::KvEvent;
use crate::events::{Ticket, admission_events};

/// If the scheduler wakes more than this after its modelled clock, the clock
/// restarts from now. Short of that, a late wake (a busy machine: the benchmark
/// shares two cores with Envoy and the sidecar) is caught up by running the next
/// steps back to back, so the modelled times do not depend on this machine.
const MAX_LAG: Duration = Duration::from_secs(1);

/// The step-time model's parameters (the default model: docs/benchmarks.md, "The engines").
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BatchCosts {
    /// Tokens scheduled per step at most (vLLM's `max_num_batched_tokens`): prefill
    /// chunks plus one per decoding sequence.
    pub max_num_batched_tokens: usize,
    /// Fixed time of every step (reading the weights once), microseconds.
    pub step_base_us: f64,
    /// Time per prefill token scheduled in a step, microseconds.
    pub prefill_us_per_token: f64,
    /// Time per decoding sequence in a step (its KV reads), microseconds.
    pub decode_us_per_seq: f64,
}

impl BatchCosts {
    /// An 8B model on one H100 with vLLM V1's 2048-token budget (an approximation).
    pub const DEFAULT: Self = Self {
        max_num_batched_tokens: 2048,
        step_base_us: 5000.0,
        prefill_us_per_token: 30.0,
        decode_us_per_seq: 100.0,
    };

    /// One step's modelled time.
    pub fn step(&self, prefill_tokens: usize, decoding: usize) -> Duration {
        let us = self.step_base_us
            + self.prefill_us_per_token * prefill_tokens as f64
            + self.decode_us_per_seq * decoding as f64;
        Duration::try_from_secs_f64(us / 1e6).unwrap_or(Duration::MAX)
    }

    /// Engine time one request costs when the engine is saturated (every step's
    /// budget full, decodes riding along with other requests' prefill chunks), µs:
    /// what the benchmark's arrival rates are derived from.
    pub fn request_us(&self, prompt: usize, output: usize) -> f64 {
        let tokens = (prompt + output) as f64;
        tokens * self.prefill_us_per_token
            + output as f64 * self.decode_us_per_seq
            + tokens / self.max_num_batched_tokens.max(1) as f64 * self.step_base_us
    }

    /// Predicted time to first token of a request with `uncached` prompt tokens
    /// behind `pending` prefill tokens already queued or running, with `decoding`
    /// sequences in the batch, µs.
    pub fn predict_ttft_us(&self, pending: usize, uncached: usize, decoding: usize) -> f64 {
        let tokens = pending + uncached.max(1);
        let budget = self.max_num_batched_tokens.saturating_sub(decoding).max(1);
        let steps = tokens.div_ceil(budget).max(1) as f64;
        steps * (self.step_base_us + self.decode_us_per_seq * decoding as f64)
            + tokens as f64 * self.prefill_us_per_token
    }
}

/// A request waiting to join the batch.
pub(super) struct Job {
    prompt: Vec<u32>,
    max_tokens: u32,
    arrived: Instant,
    /// Its uncached prompt tokens when it arrived (the queue's pending estimate).
    estimate: usize,
    /// Told when the first token is out (a streamed response's headers).
    first: Option<oneshot::Sender<()>>,
    done: oneshot::Sender<Served>,
}

/// The state the HTTP handlers share with the scheduler.
#[derive(Default)]
pub(super) struct QueueState {
    waiting: VecDeque<Job>,
    /// Prefill tokens still to compute: waiting requests' estimates plus running
    /// requests' remaining chunks.
    pub(super) pending_prefill: usize,
    /// Sequences in the decode phase after the last step.
    pub(super) decoding: usize,
}

/// The batched model's shared half.
pub(super) struct Batcher {
    pub(super) costs: BatchCosts,
    pub(super) queue: parking_lot::Mutex<QueueState>,
    wake: tokio::sync::Notify,
}

impl std::fmt::Debug for Batcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batcher")
            .field("costs", &self.costs)
            .finish_non_exhaustive()
    }
}

impl Batcher {
    pub(super) fn new(costs: BatchCosts) -> Self {
        Self {
            costs,
            queue: parking_lot::Mutex::new(QueueState::default()),
            wake: tokio::sync::Notify::new(),
        }
    }
}

/// A request in the batch.
struct Active {
    job: Job,
    admitted: Instant,
    cached_tokens: usize,
    prefill_left: usize,
    decode_left: u32,
    first_token: Option<Instant>,
    blocks: usize,
    /// Its admission's events, published when its prefill completes.
    events: Option<(Ticket, Vec<KvEvent>)>,
    /// This step: the prefill chunk scheduled (0: none) or a decode.
    chunk: usize,
    decodes: bool,
}

impl Engine {
    /// The batched model's `serve`: queue the request and wait for the scheduler.
    pub(super) async fn serve_batched(
        &self,
        batcher: &Batcher,
        prompt: &[u32],
        max_tokens: u32,
        first: Option<oneshot::Sender<()>>,
    ) -> Result<Served, RequestError> {
        let arrived = Instant::now();
        let estimate = prompt.len() - self.cache.lock().lookup(prompt);
        let (tx, rx) = oneshot::channel();
        {
            let mut q = batcher.queue.lock();
            q.waiting.push_back(Job {
                prompt: prompt.to_vec(),
                max_tokens,
                arrived,
                estimate,
                first,
                done: tx,
            });
            q.pending_prefill += estimate;
            // Counted under the queue lock, so whoever reads `received` with the
            // queue's pending work sees this request in exactly one of them.
            self.counters.received.fetch_add(1, Ordering::Relaxed);
            let waiting = q.waiting.len();
            self.counters.queued.store(waiting, Ordering::Relaxed);
            self.counters
                .peak_queued
                .fetch_max(waiting, Ordering::Relaxed);
        }
        batcher.wake.notify_one();
        rx.await.map_err(|_| RequestError::Unavailable)
    }
}

fn blocks_of(tokens: usize, block_size: u32) -> usize {
    tokens.div_ceil(block_size.max(1) as usize)
}

/// The scheduler: runs until its task is aborted (the engine's shutdown).
pub(super) async fn run(engine: Arc<Engine>, batcher: Arc<Batcher>) {
    let costs = batcher.costs;
    let max_running = engine.config.max_running;
    let block_size = engine.config.block_size;
    let c = &engine.counters;
    let mut running: Vec<Active> = Vec::new();
    let mut used_blocks = 0usize;
    let mut clock = Instant::now();
    loop {
        if running.is_empty() {
            loop {
                let notified = batcher.wake.notified();
                if !batcher.queue.lock().waiting.is_empty() {
                    break;
                }
                notified.await;
            }
            clock = Instant::now();
        } else {
            let now = Instant::now();
            let lag = now.saturating_duration_since(clock);
            c.max_lag_us.fetch_max(
                u64::try_from(lag.as_micros()).unwrap_or(u64::MAX),
                Ordering::Relaxed,
            );
            if lag > MAX_LAG {
                // The modelled clock gave up catching up: reported, so a run that
                // hit it is not quoted as a modelled result.
                c.clock_resets.fetch_add(1, Ordering::Relaxed);
                clock = now;
            }
        }

        // Plan the step: running requests first, in the order they joined.
        let mut budget = costs.max_num_batched_tokens;
        let (mut prefill_tokens, mut decoding) = (0usize, 0usize);
        for a in &mut running {
            a.chunk = 0;
            a.decodes = false;
            if a.prefill_left == 0 {
                if budget > 0 {
                    a.decodes = true;
                    budget -= 1;
                    decoding += 1;
                }
            } else {
                a.chunk = a.prefill_left.min(budget);
                budget -= a.chunk;
                prefill_tokens += a.chunk;
            }
        }
        // Then waiting requests join while the budget, the batch and the KV blocks
        // allow. A step cannot start before a request in it arrived (the scheduler
        // may wake after its modelled clock).
        let joined = running.len();
        {
            let mut q = batcher.queue.lock();
            while budget > 0 && running.len() < max_running {
                let Some(front) = q.waiting.front() else {
                    break;
                };
                // The batch is bounded by max_running only: the simulated cache is
                // sized for cache pressure (a few engines' worth of prefixes), far
                // below a real GPU's KV memory, so it does not bound the batch.
                let blocks = blocks_of(front.prompt.len() + front.max_tokens as usize, block_size);
                let Some(job) = q.waiting.pop_front() else {
                    break;
                };
                let (admission, ticket) = {
                    let mut cache = engine.cache.lock();
                    let admission = cache.admit(&job.prompt);
                    (admission, engine.publisher.ticket())
                };
                let uncached = job.prompt.len() - admission.cached_tokens;
                q.pending_prefill = q.pending_prefill.saturating_sub(job.estimate) + uncached;
                let chunk = uncached.min(budget);
                budget -= chunk;
                prefill_tokens += chunk;
                used_blocks += blocks;
                clock = clock.max(job.arrived);
                running.push(Active {
                    admitted: clock,
                    cached_tokens: admission.cached_tokens,
                    prefill_left: uncached,
                    decode_left: 0,
                    first_token: None,
                    blocks,
                    events: Some((
                        ticket,
                        admission_events(admission.removed, admission.stored),
                    )),
                    chunk,
                    decodes: false,
                    job,
                });
            }
            c.queued.store(q.waiting.len(), Ordering::Relaxed);
            c.running.store(running.len(), Ordering::Relaxed);
            c.used_blocks.store(used_blocks, Ordering::Relaxed);
        }
        for a in &mut running[joined..] {
            a.admitted = clock;
        }

        clock += costs.step(prefill_tokens, decoding);
        tokio::time::sleep_until(clock).await;

        // Apply the step.
        let mut done_prefill = 0usize;
        for a in &mut running {
            if a.chunk > 0 {
                a.prefill_left -= a.chunk;
                done_prefill += a.chunk;
                if a.prefill_left == 0 {
                    // This step's forward pass sampled the first token.
                    a.first_token = Some(clock);
                    c.note_first_token(clock.saturating_duration_since(a.job.arrived));
                    if let Some(first) = a.job.first.take() {
                        let _ = first.send(());
                    }
                    a.decode_left = a.job.max_tokens.saturating_sub(1);
                    if let Some((ticket, events)) = a.events.take() {
                        ticket.publish(events);
                    }
                }
            } else if a.decodes {
                a.decode_left = a.decode_left.saturating_sub(1);
            }
        }
        let mut i = 0;
        while i < running.len() {
            let a = &running[i];
            if a.prefill_left == 0 && a.decode_left == 0 {
                let mut a = running.remove(i);
                used_blocks -= a.blocks;
                if let Some(first) = a.job.first.take() {
                    let _ = first.send(());
                }
                let first = a.first_token.unwrap_or(clock);
                c.served.fetch_add(1, Ordering::Relaxed);
                // The client may have gone; the work (and its events) happened anyway.
                let _ = a.job.done.send(Served {
                    cached_tokens: a.cached_tokens,
                    queue: a.admitted.saturating_duration_since(a.job.arrived),
                    prefill: first.saturating_duration_since(a.admitted),
                    decode: clock.saturating_duration_since(first),
                });
            } else {
                i += 1;
            }
        }
        let mut q = batcher.queue.lock();
        q.pending_prefill = q.pending_prefill.saturating_sub(done_prefill);
        q.decoding = running.iter().filter(|a| a.prefill_left == 0).count();
        c.running.store(running.len(), Ordering::Relaxed);
        c.used_blocks.store(used_blocks, Ordering::Relaxed);
    }
}
