//! Seeded, reproducible request schedules for the routing benchmark.
//!
//! Each workload is a list of requests with arrival times (an open loop: a slow
//! router does not slow the arrivals down, it builds queues, as real traffic does).
//! Prompts are token ids drawn from a seeded generator per *segment* (a group's
//! system prompt, a document, one question), so two requests share a prefix exactly
//! when the workload says they do, and the same seed always gives the same bytes.

use std::time::Duration;

use anyhow::bail;

use crate::engine::BatchCosts;
use rand::{RngExt, SeedableRng};
use rand_xorshift::XorShiftRng;

/// Each tenant index's `CacheTenant.spec.weight` when a run has several tenants
/// (all in `isolationMode: Fairness`): tenants 0 and 1 weigh the same, tenant 2
/// three times as much (the weighted flood's 1:3 pair is tenants 0 and 2).
pub const TENANT_WEIGHTS: [u32; 3] = [1, 1, 3];

/// The `family` of a burst workload's burst requests.
pub const BURST_FAMILY: u32 = u32::MAX;

/// Token ids are drawn from a Llama-3-sized vocabulary.
const VOCAB: u32 = 128_000;

/// One request of a schedule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    /// Arrival time from the start of the run.
    pub at: Duration,
    pub prompt: Vec<u32>,
    pub max_tokens: u32,
    /// The prefix family it belongs to (group, session or document), for reports.
    pub family: u32,
    /// Which of the workload's tenants sends it (0: the only one of a
    /// single-tenant workload); see [`TENANT_WEIGHTS`].
    pub tenant: u8,
    /// Its `x-inferencecache-priority` (0: the header is not sent).
    pub priority: i32,
}

/// The routing benchmark's workload shapes (docs/benchmarks.md).
#[derive(Clone, Debug, PartialEq)]
pub enum Workload {
    /// G groups × P prompts: a long group system prompt and a short question (the
    /// shape of llm-d's prefix-cache benchmark). Prompts arrive in a seeded shuffle.
    SharedPrefix {
        groups: u32,
        prompts_per_group: u32,
        system_tokens: u32,
        question_tokens: u32,
        output_tokens: u32,
    },
    /// Chat sessions: one shared system prompt, then each turn appends the previous
    /// reply and a new user message, so a session grows its own prefix.
    MultiTurn {
        sessions: u32,
        turns: u32,
        system_tokens: u32,
        user_tokens: u32,
        reply_tokens: u32,
        think: Duration,
    },
    /// RAG: a shared instruction header, one of K documents (Zipf-popular, so one
    /// document is hot) and a question. `rag-hot` is the same shape with few, very
    /// popular documents.
    Rag {
        name: &'static str,
        requests: u32,
        documents: u32,
        zipf_s: f64,
        header_tokens: u32,
        document_tokens: u32,
        question_tokens: u32,
        output_tokens: u32,
    },
    /// Steady shared-prefix traffic (`groups` × `prompts_per_group`), and at its
    /// midpoint a burst: `burst_requests` requests of one new `burst_tokens`-token
    /// prompt (each with its own 16-token question) within `burst_window`.
    Burst {
        groups: u32,
        prompts_per_group: u32,
        system_tokens: u32,
        question_tokens: u32,
        output_tokens: u32,
        burst_requests: u32,
        burst_tokens: u32,
        burst_window: Duration,
    },
    /// Several tenants (or priority bands), each its own shared-prefix stream
    /// (`groups` system prompts of its own) at its own rate: see [`FloodKind`].
    /// `requests` is one stream's count at rate 1 × the load; a stream at n × the
    /// load sends n × as many, so every stream spans the same time.
    Flood {
        kind: FloodKind,
        requests: u32,
        groups: u32,
        system_tokens: u32,
        question_tokens: u32,
        output_tokens: u32,
    },
}

/// The tenants and bands of a [`Workload::Flood`]: (tenant index, priority,
/// rate as a multiple of the load × the fleet's no-cache capacity).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FloodKind {
    /// Tenant 0 at half the load (its fair share of two), tenant 1 at ten times
    /// that, both weight 1.
    Flood,
    /// Tenant 0 of `Flood` alone: the baseline its p90 is compared with.
    FloodAlone,
    /// Tenants 0 (weight 1) and 2 (weight 3), each at the load.
    Weights,
    /// One tenant, two priority bands (1 and 0), each at the load.
    Priority,
}

impl FloodKind {
    pub fn streams(self) -> &'static [(u8, i32, f64)] {
        match self {
            Self::Flood => &[(0, 0, 0.5), (1, 0, 5.0)],
            Self::FloodAlone => &[(0, 0, 0.5)],
            Self::Weights => &[(0, 0, 1.0), (2, 0, 1.0)],
            Self::Priority => &[(0, 1, 1.0), (0, 0, 1.0)],
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::Flood => "flood",
            Self::FloodAlone => "flood-alone",
            Self::Weights => "flood-weights",
            Self::Priority => "flood-priority",
        }
    }
}

impl Workload {
    pub const NAMES: [&'static str; 4] = ["shared-prefix", "multi-turn", "rag", "rag-hot"];

    /// Workloads run only when named: they test rules rather than compare routers
    /// on a shape (docs/benchmarks.md). `mixed-fleet` is `rag` on engines of two
    /// kinds ([`Workload::mixed_fleet`]).
    pub const EXTRA_NAMES: [&'static str; 6] = [
        "burst",
        "mixed-fleet",
        "flood",
        "flood-alone",
        "flood-weights",
        "flood-priority",
    ];

    /// Whether the benchmark runs it on a mixed fleet: half the engines prefill
    /// at half speed, the other half have half the running slots.
    pub fn mixed_fleet(&self) -> bool {
        matches!(
            self,
            Self::Rag {
                name: "mixed-fleet",
                ..
            }
        )
    }

    /// The demo's sizes: each run lasts a few seconds on 4 engines, and the shared
    /// working set fits in the fleet's caches but not in one engine's (the regime a
    /// router exists for; if it fit everywhere, every router would hit).
    pub fn default_of(name: &str) -> anyhow::Result<Self> {
        Ok(match name {
            "shared-prefix" => Self::SharedPrefix {
                groups: 32,
                prompts_per_group: 10,
                system_tokens: 2048,
                question_tokens: 128,
                output_tokens: 32,
            },
            "multi-turn" => Self::MultiTurn {
                sessions: 48,
                turns: 5,
                system_tokens: 256,
                user_tokens: 96,
                reply_tokens: 96,
                think: Duration::from_millis(600),
            },
            "rag" => Self::Rag {
                name: "rag",
                requests: 320,
                documents: 48,
                zipf_s: 1.1,
                header_tokens: 256,
                document_tokens: 1536,
                question_tokens: 64,
                output_tokens: 32,
            },
            // Hot documents: 12 documents (12 × 112 blocks, well under one engine's
            // cache, let alone the fleet's) with Zipf s = 1.5, so the top document
            // draws about half the requests: what a cache-only router sends to one
            // engine.
            "mixed-fleet" => Self::Rag {
                name: "mixed-fleet",
                requests: 320,
                documents: 48,
                zipf_s: 1.1,
                header_tokens: 256,
                document_tokens: 1536,
                question_tokens: 64,
                output_tokens: 32,
            },
            "burst" => Self::Burst {
                groups: 16,
                prompts_per_group: 10,
                system_tokens: 2048,
                question_tokens: 128,
                output_tokens: 32,
                burst_requests: 40,
                burst_tokens: 1600,
                burst_window: Duration::from_millis(200),
            },
            "flood" | "flood-alone" | "flood-weights" | "flood-priority" => Self::Flood {
                kind: match name {
                    "flood" => FloodKind::Flood,
                    "flood-alone" => FloodKind::FloodAlone,
                    "flood-weights" => FloodKind::Weights,
                    _ => FloodKind::Priority,
                },
                requests: 160,
                groups: 16,
                system_tokens: 2048,
                question_tokens: 128,
                output_tokens: 32,
            },
            "rag-hot" => Self::Rag {
                name: "rag-hot",
                requests: 320,
                documents: 12,
                zipf_s: 1.5,
                header_tokens: 256,
                document_tokens: 1536,
                question_tokens: 64,
                output_tokens: 32,
            },
            other => bail!(
                "unknown workload {other:?}; known: {}, {}",
                Self::NAMES.join(", "),
                Self::EXTRA_NAMES.join(", ")
            ),
        })
    }

    /// How many tenant indices its requests use (0..n), so the benchmark declares
    /// a namespace for each.
    pub fn tenants(&self) -> u8 {
        match self {
            Self::Flood { kind, .. } => kind.streams().iter().map(|s| s.0 + 1).max().unwrap_or(1),
            _ => 1,
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Self::SharedPrefix { .. } => "shared-prefix",
            Self::MultiTurn { .. } => "multi-turn",
            Self::Rag { name, .. } => name,
            Self::Burst { .. } => "burst",
            Self::Flood { kind, .. } => kind.name(),
        }
    }

    /// Divides every request count by `factor` (at least one of each), for smoke runs.
    pub fn shrunk(mut self, factor: u32) -> Self {
        let f = factor.max(1);
        let cut = |n: &mut u32| *n = (*n / f).max(1);
        match &mut self {
            Self::SharedPrefix { groups, .. } => cut(groups),
            Self::MultiTurn { sessions, .. } => cut(sessions),
            Self::Rag {
                requests,
                documents,
                ..
            } => {
                cut(requests);
                cut(documents);
            }
            Self::Burst { groups, .. } => cut(groups),
            Self::Flood { requests, .. } => cut(requests),
        }
        self
    }

    /// Multiplies the requests (more prompts per group, more sessions, more RAG
    /// questions) over the same prefixes, for longer, steadier runs.
    pub fn scaled(mut self, factor: u32) -> Self {
        let f = factor.max(1);
        match &mut self {
            Self::SharedPrefix {
                prompts_per_group, ..
            } => *prompts_per_group *= f,
            Self::MultiTurn { sessions, .. } => *sessions *= f,
            Self::Rag { requests, .. } => *requests *= f,
            Self::Burst {
                prompts_per_group, ..
            } => *prompts_per_group *= f,
            Self::Flood { requests, .. } => *requests *= f,
        }
        self
    }

    /// A short human description for the report.
    pub fn describe(&self) -> String {
        match self {
            Self::SharedPrefix {
                groups,
                prompts_per_group,
                system_tokens,
                question_tokens,
                output_tokens,
            } => format!(
                "{groups} groups × {prompts_per_group} prompts, {system_tokens}-token system prompt + \
                 {question_tokens}-token question, {output_tokens} output tokens"
            ),
            Self::MultiTurn {
                sessions,
                turns,
                system_tokens,
                user_tokens,
                reply_tokens,
                think,
            } => format!(
                "{sessions} sessions × {turns} turns, {system_tokens}-token shared system prompt, \
                 +{user_tokens} user / {reply_tokens} reply tokens per turn, {} ms think time",
                think.as_millis()
            ),
            Self::Rag {
                requests,
                documents,
                zipf_s,
                header_tokens,
                document_tokens,
                question_tokens,
                output_tokens,
                ..
            } => format!(
                "{requests} requests, {header_tokens}-token header + 1 of {documents} documents \
                 ({document_tokens} tokens, Zipf s={zipf_s}) + {question_tokens}-token question, \
                 {output_tokens} output tokens"
            ),
            Self::Burst {
                groups,
                prompts_per_group,
                system_tokens,
                burst_requests,
                burst_tokens,
                burst_window,
                ..
            } => format!(
                "{groups} groups × {prompts_per_group} prompts ({system_tokens}-token system prompt), \
                 and at the midpoint {burst_requests} requests of a new {burst_tokens}-token prompt \
                 within {} ms",
                burst_window.as_millis()
            ),
            Self::Flood {
                kind,
                requests,
                groups,
                system_tokens,
                ..
            } => {
                let streams: Vec<String> = kind
                    .streams()
                    .iter()
                    .map(|&(t, p, r)| {
                        format!(
                            "tenant {t} (weight {}){} at {r} × the load",
                            TENANT_WEIGHTS.get(usize::from(t)).copied().unwrap_or(1),
                            if p != 0 {
                                format!(" priority {p}")
                            } else {
                                String::new()
                            }
                        )
                    })
                    .collect();
                format!(
                    "{}; each stream {groups} groups of a {system_tokens}-token system prompt, \
                     {requests} requests per 1 × the load",
                    streams.join(", ")
                )
            }
        }
    }

    /// The schedule from `seed`, sorted by arrival, at `load` × what `fleet` serves
    /// when nothing is cached (so every workload loads the fleet alike, whatever
    /// its prompt lengths).
    pub fn generate(&self, seed: u64, fleet: &Fleet, load: f64) -> Schedule {
        let mut rng = XorShiftRng::seed_from_u64(mix(seed, 0, 0, 0));
        let mut out = self.prompts(seed, &mut rng);
        if let Self::Flood { .. } = self {
            return self.flood(out, seed, fleet, load);
        }
        let steady: Vec<Request> = out
            .iter()
            .filter(|r| r.family != BURST_FAMILY)
            .cloned()
            .collect();
        let rate = fleet.capacity(&steady) * load;
        match *self {
            Self::MultiTurn { turns, think, .. } => {
                // Sessions start at the request rate divided by the turns per
                // session, so the steady-state request rate is `rate`.
                let mut starts = Arrivals::new(rate / f64::from(turns.max(1)));
                for session in out.chunks_mut(turns.max(1) as usize) {
                    let start = starts.next(&mut rng);
                    for (t, r) in session.iter_mut().enumerate() {
                        r.at = start + think * t as u32;
                    }
                }
            }
            Self::Burst {
                burst_window,
                burst_requests,
                ..
            } => {
                let mut arrivals = Arrivals::new(rate);
                let mut end = Duration::ZERO;
                for r in out.iter_mut().filter(|r| r.family != BURST_FAMILY) {
                    r.at = arrivals.next(&mut rng);
                    end = end.max(r.at);
                }
                // The burst: evenly spread over the window from the midpoint.
                let mid = end / 2;
                let step = burst_window / burst_requests.max(1);
                for (i, r) in out
                    .iter_mut()
                    .filter(|r| r.family == BURST_FAMILY)
                    .enumerate()
                {
                    r.at = mid + step * i as u32;
                }
            }
            _ => {
                let mut arrivals = Arrivals::new(rate);
                for r in &mut out {
                    r.at = arrivals.next(&mut rng);
                }
            }
        }
        out.sort_by_key(|r| r.at);
        Schedule {
            requests: out,
            rate,
        }
    }

    /// A flood's arrivals: each stream (tenant, priority) its own Poisson process
    /// at its multiple of `load` × the fleet's no-cache capacity for the prompts.
    fn flood(&self, mut out: Vec<Request>, seed: u64, fleet: &Fleet, load: f64) -> Schedule {
        let Self::Flood { kind, .. } = *self else {
            unreachable!("flood() is only called on a flood")
        };
        let unit = fleet.capacity(&out) * load;
        let mut total = 0.0;
        for &(tenant, priority, share) in kind.streams() {
            // Each stream draws from its own generator, so a stream's arrivals
            // are the same whatever other streams run beside it.
            let mut rng = XorShiftRng::seed_from_u64(mix(seed, 20, tenant.into(), priority as u64));
            let mut arrivals = Arrivals::new(unit * share);
            total += unit * share;
            for r in out
                .iter_mut()
                .filter(|r| (r.tenant, r.priority) == (tenant, priority))
            {
                r.at = arrivals.next(&mut rng);
            }
        }
        out.sort_by_key(|r| r.at);
        Schedule {
            requests: out,
            rate: total,
        }
    }

    /// The prompts in arrival order (multi-turn: session by session, turn by
    /// turn), arrival times not yet set.
    fn prompts(&self, seed: u64, rng: &mut XorShiftRng) -> Vec<Request> {
        match *self {
            Self::SharedPrefix {
                groups,
                prompts_per_group,
                system_tokens,
                question_tokens,
                output_tokens,
                ..
            } => {
                let systems: Vec<Vec<u32>> = (0..groups)
                    .map(|g| segment(seed, 1, g, 0, system_tokens))
                    .collect();
                let mut order: Vec<(u32, u32)> = (0..groups)
                    .flat_map(|g| (0..prompts_per_group).map(move |p| (g, p)))
                    .collect();
                shuffle(&mut order, rng);
                order
                    .into_iter()
                    .map(|(g, p)| {
                        let mut prompt = systems[g as usize].clone();
                        prompt.extend(segment(seed, 2, g, p, question_tokens));
                        Request {
                            at: Duration::ZERO,
                            prompt,
                            max_tokens: output_tokens,
                            family: g,
                            tenant: 0,
                            priority: 0,
                        }
                    })
                    .collect()
            }
            Self::MultiTurn {
                sessions,
                turns,
                system_tokens,
                user_tokens,
                reply_tokens,
                ..
            } => {
                let system = segment(seed, 3, 0, 0, system_tokens);
                let mut out = Vec::with_capacity((sessions * turns) as usize);
                for s in 0..sessions {
                    let mut history = system.clone();
                    for t in 0..turns {
                        if t > 0 {
                            history.extend(segment(seed, 5, s, t - 1, reply_tokens));
                        }
                        history.extend(segment(seed, 4, s, t, user_tokens));
                        out.push(Request {
                            at: Duration::ZERO,
                            prompt: history.clone(),
                            max_tokens: reply_tokens,
                            family: s,
                            tenant: 0,
                            priority: 0,
                        });
                    }
                }
                out
            }
            Self::Rag {
                requests,
                documents,
                zipf_s,
                header_tokens,
                document_tokens,
                question_tokens,
                output_tokens,
                ..
            } => {
                let header = segment(seed, 6, 0, 0, header_tokens);
                let docs: Vec<Vec<u32>> = (0..documents)
                    .map(|d| segment(seed, 7, d, 0, document_tokens))
                    .collect();
                let zipf = Zipf::new(documents, zipf_s);
                (0..requests)
                    .map(|i| {
                        let d = zipf.sample(rng);
                        let mut prompt = header.clone();
                        prompt.extend_from_slice(&docs[d as usize]);
                        prompt.extend(segment(seed, 8, i, 0, question_tokens));
                        Request {
                            at: Duration::ZERO,
                            prompt,
                            max_tokens: output_tokens,
                            family: d,
                            tenant: 0,
                            priority: 0,
                        }
                    })
                    .collect()
            }
            Self::Burst {
                groups,
                prompts_per_group,
                system_tokens,
                question_tokens,
                output_tokens,
                burst_requests,
                burst_tokens,
                ..
            } => {
                let mut out = Self::SharedPrefix {
                    groups,
                    prompts_per_group,
                    system_tokens,
                    question_tokens,
                    output_tokens,
                }
                .prompts(seed, rng);
                let burst = segment(seed, 9, 0, 0, burst_tokens);
                out.extend((0..burst_requests).map(|i| {
                    let mut prompt = burst.clone();
                    prompt.extend(segment(seed, 10, i, 0, 16));
                    Request {
                        at: Duration::ZERO,
                        prompt,
                        max_tokens: output_tokens,
                        family: BURST_FAMILY,
                        tenant: 0,
                        priority: 0,
                    }
                }));
                out
            }
            Self::Flood {
                kind,
                requests,
                groups,
                system_tokens,
                question_tokens,
                output_tokens,
            } => {
                let mut out = Vec::new();
                for (stream, &(tenant, priority, share)) in kind.streams().iter().enumerate() {
                    // Each stream its own system prompts (kind 11 + stream index).
                    let kind_id = 11 + 2 * stream as u64;
                    let systems: Vec<Vec<u32>> = (0..groups.max(1))
                        .map(|g| segment(seed, kind_id, g, 0, system_tokens))
                        .collect();
                    let n = (f64::from(requests) * share).round().max(1.0) as u32;
                    let mut rng =
                        XorShiftRng::seed_from_u64(mix(seed, 21, tenant.into(), priority as u64));
                    for i in 0..n {
                        let g = rng.random_range(0..groups.max(1));
                        let mut prompt = systems[g as usize].clone();
                        prompt.extend(segment(seed, kind_id + 1, g, i, question_tokens));
                        out.push(Request {
                            at: Duration::ZERO,
                            prompt,
                            max_tokens: output_tokens,
                            family: g,
                            tenant,
                            priority,
                        });
                    }
                }
                out
            }
        }
    }
}

/// A generated schedule and the request rate it was generated at.
pub struct Schedule {
    pub requests: Vec<Request>,
    /// Requests per second.
    pub rate: f64,
}

/// What the arrival rate is derived from: the fleet's size and modeled costs.
#[derive(Clone, Copy, Debug)]
pub struct Fleet {
    pub engines: usize,
    pub max_running: usize,
    pub prefill_us_per_token: f64,
    pub decode_us_per_token: f64,
    /// The continuous-batching model's costs; `None`: the simple model.
    pub batch: Option<BatchCosts>,
    /// A mixed fleet ([`Fleet::engine`]); `false`: every engine has the costs above.
    pub mixed: bool,
}

/// One engine's costs in a [`Fleet`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EngineCosts {
    pub max_running: usize,
    pub prefill_us_per_token: f64,
    pub batch: Option<BatchCosts>,
}

impl Fleet {
    /// Engine `i`'s costs. In a mixed fleet the first half (rounded down) prefill
    /// at half speed (twice the time per prefill token) and the rest have half
    /// the running slots (at least 1); otherwise every engine has the fleet's.
    pub fn engine(&self, i: usize) -> EngineCosts {
        let mut c = EngineCosts {
            max_running: self.max_running,
            prefill_us_per_token: self.prefill_us_per_token,
            batch: self.batch,
        };
        if self.mixed {
            if i < self.engines / 2 {
                c.prefill_us_per_token *= 2.0;
                if let Some(b) = &mut c.batch {
                    b.prefill_us_per_token *= 2.0;
                }
            } else {
                c.max_running = (c.max_running / 2).max(1);
            }
        }
        c
    }

    /// Requests per second the fleet serves with no cache hits at all, for the
    /// mix of `requests`, summed over the engines: under the batched model, each
    /// engine's saturated step throughput ([`BatchCosts::request_us`]); under
    /// the simple model, `max_running` requests at a time each for its own
    /// prefill + decode.
    pub fn capacity(&self, requests: &[Request]) -> f64 {
        let n = requests.len().max(1) as f64;
        (0..self.engines)
            .map(|i| {
                let e = self.engine(i);
                if let Some(b) = &e.batch {
                    let mean_us = requests
                        .iter()
                        .map(|r| b.request_us(r.prompt.len(), r.max_tokens as usize))
                        .sum::<f64>()
                        / n;
                    return 1.0 / (mean_us.max(1.0) / 1e6);
                }
                let mean_us: f64 = requests
                    .iter()
                    .map(|r| {
                        r.prompt.len() as f64 * e.prefill_us_per_token
                            + f64::from(r.max_tokens) * self.decode_us_per_token
                    })
                    .sum::<f64>()
                    / n;
                e.max_running as f64 / (mean_us.max(1.0) / 1e6)
            })
            .sum()
    }
}

impl Fleet {
    /// The mean time to first token of `requests` on an idle engine with nothing
    /// cached (each alone: its whole prompt prefilled, nothing else in the batch),
    /// ms, with the fleet's own costs (a mixed fleet's slow engines do not
    /// change it).
    pub fn solo_ttft_ms(&self, requests: &[Request]) -> f64 {
        let n = requests.len().max(1) as f64;
        requests
            .iter()
            .map(|r| match &self.batch {
                Some(b) => b.predict_ttft_us(0, r.prompt.len(), 0) / 1e3,
                None => r.prompt.len() as f64 * self.prefill_us_per_token / 1e3,
            })
            .sum::<f64>()
            / n
    }
}

/// Poisson arrivals: exponential gaps at `rate` per second.
struct Arrivals {
    rate: f64,
    now: f64,
}

impl Arrivals {
    fn new(rate: f64) -> Self {
        Self {
            rate: rate.max(f64::MIN_POSITIVE),
            now: 0.0,
        }
    }

    fn next(&mut self, rng: &mut XorShiftRng) -> Duration {
        let at = self.now;
        // 1 - u is in (0, 1], so the logarithm is finite.
        let u: f64 = rng.random();
        self.now += -(1.0 - u).ln() / self.rate;
        Duration::from_secs_f64(at)
    }
}

/// Zipf-distributed ranks 0..n by inverse CDF.
struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    fn new(n: u32, s: f64) -> Self {
        let weights: Vec<f64> = (1..=n.max(1)).map(|k| 1.0 / f64::from(k).powf(s)).collect();
        let total: f64 = weights.iter().sum();
        let mut acc = 0.0;
        let cdf = weights
            .iter()
            .map(|w| {
                acc += w / total;
                acc
            })
            .collect();
        Self { cdf }
    }

    fn sample(&self, rng: &mut XorShiftRng) -> u32 {
        let u: f64 = rng.random();
        let i = self.cdf.partition_point(|&c| c < u);
        i.min(self.cdf.len() - 1) as u32
    }
}

/// The tokens of one segment: the same (seed, kind, a, b) always gives the same ids.
fn segment(seed: u64, kind: u64, a: u32, b: u32, len: u32) -> Vec<u32> {
    let mut rng = XorShiftRng::seed_from_u64(mix(seed, kind, a.into(), b.into()));
    (0..len).map(|_| rng.random_range(1..VOCAB)).collect()
}

fn shuffle<T>(items: &mut [T], rng: &mut XorShiftRng) {
    for i in (1..items.len()).rev() {
        let j = rng.random_range(0..=i);
        items.swap(i, j);
    }
}

/// SplitMix64 finaliser over the segment coordinates: well-mixed seeds for nearby ids.
fn mix(seed: u64, kind: u64, a: u64, b: u64) -> u64 {
    let mut z = seed
        ^ kind.wrapping_mul(0x9e37_79b9_7f4a_7c15)
        ^ a.wrapping_mul(0xbf58_476d_1ce4_e5b9)
        ^ b.wrapping_mul(0x94d0_49bb_1331_11eb);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests;
