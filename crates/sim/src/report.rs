//! What a run is worth: hit rate, time to first token, throughput and balance,
//! per router, and the table that compares them.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

use super::drive::Outcome;
use super::router::Router;
use super::workload::BURST_FAMILY;

/// One router on one workload.
#[derive(Clone, Debug, Serialize)]
pub struct RunSummary {
    pub workload: String,
    pub router: String,
    pub requests: usize,
    pub errors: usize,
    /// Cached prompt tokens ÷ prompt tokens, over all answered requests.
    pub hit_rate: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p90_ms: f64,
    pub ttft_p99_ms: f64,
    /// Answered requests per second of wall time (first send to last answer).
    pub throughput_rps: f64,
    /// max ÷ mean requests per engine (1.0 = perfectly even).
    pub imbalance: f64,
    /// Requests each engine served, by engine id.
    pub per_engine: BTreeMap<String, usize>,
    /// The longest queue any engine had.
    pub peak_queue: u64,
    /// Times a simulated engine's modelled clock fell more than its catch-up bound
    /// behind real time and restarted (0: the modelled times are this machine's
    /// load-independent figures), and the largest lag, ms.
    pub clock_resets: u64,
    pub max_lag_ms: f64,
    /// inferencecache's reason codes and how often each came back.
    pub reasons: BTreeMap<String, usize>,
    /// Closed-loop accuracy (inferencecache rows only): the prompt tokens the
    /// sidecar predicted cached on its pick (`x-inferencecache-matched-tokens`),
    /// summed, ÷ the tokens the engines reported cached (`cached_tokens`).
    pub cached_prediction_ratio: Option<f64>,
    /// Mean |predicted − reported| cached tokens per decision.
    pub cached_prediction_mae: Option<f64>,
    /// Decisions whose prediction was exactly what the engine reported.
    pub cached_prediction_exact: Option<f64>,
    /// The ratio over PREFIX_MATCH decisions only (the index's accuracy: other
    /// picks carry 0 matched tokens by construction, whatever the index knows).
    pub prefix_match_prediction_ratio: Option<f64>,
    /// Every TTFT, sorted (for the chart).
    #[serde(skip)]
    pub ttfts_ms: Vec<f64>,
    /// The offered load (× the fleet's no-cache capacity) and its request rate.
    pub load: f64,
    pub offered_rps: f64,
    /// The workload's TTFT objective, ms (see `capacity::slo_ms`).
    pub slo_ms: f64,
    /// Requests the sidecar shed with 429 (neither served nor failed), by reason.
    pub shed: usize,
    pub shed_reasons: BTreeMap<String, usize>,
    /// How long shed requests waited for their 429 (p50, p90), ms; 0 when none.
    pub shed_latency_p50_ms: f64,
    pub shed_latency_p90_ms: f64,
    /// Served requests whose TTFT met the objective, per second of wall time.
    pub goodput_rps: f64,
    /// Served requests whose TTFT met the objective.
    pub good: usize,
    /// The same accounting per (tenant, priority) present in the run.
    pub classes: Vec<ClassSummary>,
    /// The burst workload's burst requests' TTFT p90, ms (`None` without a burst).
    pub burst_ttft_p90_ms: Option<f64>,
}

/// One (tenant, priority) class of a run's requests.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ClassSummary {
    pub tenant: u8,
    pub priority: i32,
    pub served: usize,
    pub shed: usize,
    pub good: usize,
    pub goodput_rps: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p90_ms: f64,
}

/// What a run was offered, for [`RunSummary::with_slo`].
#[derive(Clone, Copy, Debug)]
pub struct Offered {
    pub load: f64,
    pub rate: f64,
    pub slo_ms: f64,
}

impl RunSummary {
    pub fn of(
        workload: &str,
        router: Router,
        engine_ids: &[String],
        outcome: &Outcome,
        engines: EngineStats,
    ) -> Self {
        let s = &outcome.samples;
        let prompt: u64 = s.iter().map(|x| x.prompt_tokens).sum();
        let cached: u64 = s.iter().map(|x| x.cached_tokens).sum();
        let mut ttfts: Vec<f64> = s.iter().map(|x| x.ttft_ms).collect();
        ttfts.sort_by(f64::total_cmp);
        let mut per_engine: BTreeMap<String, usize> =
            engine_ids.iter().map(|id| (id.clone(), 0)).collect();
        let mut reasons = BTreeMap::new();
        for x in s {
            *per_engine.entry(x.replica.clone()).or_default() += 1;
            if let Some(r) = &x.reason {
                *reasons.entry(r.clone()).or_default() += 1;
            }
        }
        let predicted: Vec<(u64, u64)> = s
            .iter()
            .filter_map(|x| x.predicted_cached.map(|p| (p, x.cached_tokens)))
            .collect();
        let prefix_match_prediction_ratio = {
            let (p, a, n) = s
                .iter()
                .filter(|x| x.reason.as_deref() == Some("PREFIX_MATCH"))
                .filter_map(|x| x.predicted_cached.map(|p| (p, x.cached_tokens)))
                .fold((0u64, 0u64, 0usize), |(p, a, n), (x, y)| {
                    (p + x, a + y, n + 1)
                });
            (n > 0 && a > 0).then(|| p as f64 / a as f64)
        };
        let (cached_prediction_ratio, cached_prediction_mae, cached_prediction_exact) =
            if predicted.is_empty() {
                (None, None, None)
            } else {
                let n = predicted.len() as f64;
                let (p_sum, a_sum) = predicted
                    .iter()
                    .fold((0u64, 0u64), |(p, a), &(x, y)| (p + x, a + y));
                let abs: u64 = predicted.iter().map(|&(p, a)| p.abs_diff(a)).sum();
                let exact = predicted.iter().filter(|&&(p, a)| p == a).count();
                (
                    Some(if a_sum > 0 {
                        p_sum as f64 / a_sum as f64
                    } else if p_sum == 0 {
                        1.0
                    } else {
                        f64::INFINITY
                    }),
                    Some(abs as f64 / n),
                    Some(exact as f64 / n),
                )
            };
        let max = per_engine.values().copied().max().unwrap_or(0) as f64;
        let mean = s.len() as f64 / per_engine.len().max(1) as f64;
        let secs = outcome.elapsed.as_secs_f64();
        let mut shed_latencies: Vec<f64> = outcome.shed.iter().map(|x| x.latency_ms).collect();
        shed_latencies.sort_by(f64::total_cmp);
        Self {
            workload: workload.to_string(),
            router: router.name().to_string(),
            requests: s.len() + outcome.shed.len() + outcome.errors,
            errors: outcome.errors,
            hit_rate: if prompt == 0 {
                0.0
            } else {
                cached as f64 / prompt as f64
            },
            ttft_p50_ms: percentile(&ttfts, 0.50),
            ttft_p90_ms: percentile(&ttfts, 0.90),
            ttft_p99_ms: percentile(&ttfts, 0.99),
            throughput_rps: if secs > 0.0 {
                s.len() as f64 / secs
            } else {
                0.0
            },
            imbalance: if mean > 0.0 { max / mean } else { 0.0 },
            per_engine,
            peak_queue: engines.peak_queue,
            clock_resets: engines.clock_resets,
            max_lag_ms: engines.max_lag_ms,
            reasons,
            cached_prediction_ratio,
            cached_prediction_mae,
            cached_prediction_exact,
            prefix_match_prediction_ratio,
            ttfts_ms: ttfts,
            load: 0.0,
            offered_rps: 0.0,
            slo_ms: 0.0,
            shed: outcome.shed.len(),
            shed_reasons: outcome.shed.iter().fold(BTreeMap::new(), |mut m, x| {
                *m.entry(x.reason.clone()).or_default() += 1;
                m
            }),
            shed_latency_p50_ms: percentile(&shed_latencies, 0.50),
            shed_latency_p90_ms: percentile(&shed_latencies, 0.90),
            goodput_rps: 0.0,
            good: 0,
            classes: Vec::new(),
            burst_ttft_p90_ms: {
                let mut burst: Vec<f64> = s
                    .iter()
                    .filter(|x| x.family == BURST_FAMILY)
                    .map(|x| x.ttft_ms)
                    .collect();
                burst.sort_by(f64::total_cmp);
                (!burst.is_empty()).then(|| percentile(&burst, 0.90))
            },
        }
    }

    /// Adds what the run was offered and the goodput against `offered.slo_ms`: a
    /// served request counts when its TTFT is at most the objective; shed and
    /// failed requests never count. Rates are per second of the run's wall time
    /// (first send to last answer), as `throughput_rps`.
    pub fn with_slo(mut self, outcome: &Outcome, offered: Offered) -> Self {
        let secs = outcome.elapsed.as_secs_f64();
        let per_sec = |n: usize| if secs > 0.0 { n as f64 / secs } else { 0.0 };
        let good = |ttft: f64| ttft <= offered.slo_ms;
        self.load = offered.load;
        self.offered_rps = offered.rate;
        self.slo_ms = offered.slo_ms;
        self.good = outcome.samples.iter().filter(|x| good(x.ttft_ms)).count();
        self.goodput_rps = per_sec(self.good);
        let mut keys: Vec<(u8, i32)> = outcome
            .samples
            .iter()
            .map(|x| (x.tenant, x.priority))
            .chain(outcome.shed.iter().map(|x| (x.tenant, x.priority)))
            .collect();
        keys.sort_unstable();
        keys.dedup();
        self.classes = keys
            .into_iter()
            .map(|(tenant, priority)| {
                let mut ttfts: Vec<f64> = outcome
                    .samples
                    .iter()
                    .filter(|x| (x.tenant, x.priority) == (tenant, priority))
                    .map(|x| x.ttft_ms)
                    .collect();
                ttfts.sort_by(f64::total_cmp);
                let g = ttfts.iter().filter(|&&t| good(t)).count();
                ClassSummary {
                    tenant,
                    priority,
                    served: ttfts.len(),
                    shed: outcome
                        .shed
                        .iter()
                        .filter(|x| (x.tenant, x.priority) == (tenant, priority))
                        .count(),
                    good: g,
                    goodput_rps: per_sec(g),
                    ttft_p50_ms: percentile(&ttfts, 0.50),
                    ttft_p90_ms: percentile(&ttfts, 0.90),
                }
            })
            .collect();
        self
    }
}

/// What the simulated engines report about a run (`/stats`).
#[derive(Clone, Copy, Debug, Default)]
pub struct EngineStats {
    pub peak_queue: u64,
    pub clock_resets: u64,
    pub max_lag_ms: f64,
}

/// Nearest-rank percentile of sorted values (0 when empty).
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// The comparison table of one workload (Markdown), with inferencecache's standing
/// against round-robin and the oracle underneath.
pub fn table(workload: &str, describe: &str, runs: &[RunSummary]) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "### {workload}: {describe}\n");
    let _ = writeln!(
        out,
        "| router | hit rate | TTFT p50 ms | p90 ms | p99 ms | req/s | imbalance (max/mean) | peak queue | predicted ÷ reported cached (MAE tokens) | errors |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|---|---|---|---|");
    for r in runs {
        let accuracy = match (r.cached_prediction_ratio, r.cached_prediction_mae) {
            (Some(ratio), Some(mae)) => format!("{ratio:.2} ({mae:.0})"),
            _ => "—".to_string(),
        };
        let _ = writeln!(
            out,
            "| {} | {:.1}% | {:.1} | {:.1} | {:.1} | {:.1} | {:.2} | {} | {} | {} |",
            r.router,
            r.hit_rate * 100.0,
            r.ttft_p50_ms,
            r.ttft_p90_ms,
            r.ttft_p99_ms,
            r.throughput_rps,
            r.imbalance,
            r.peak_queue,
            accuracy,
            r.errors
        );
    }
    let lagged: Vec<String> = runs
        .iter()
        .filter(|r| r.clock_resets > 0)
        .map(|r| format!("{} ({} resets)", r.router, r.clock_resets))
        .collect();
    if !lagged.is_empty() {
        let _ = writeln!(
            out,
            "\nWarning: a simulated engine's clock fell more than 1 s behind this machine \
             and restarted in: {}; those rows depend on the machine's load.",
            lagged.join(", ")
        );
    }
    let bursts: Vec<String> = runs
        .iter()
        .filter_map(|r| r.burst_ttft_p90_ms.map(|p| format!("{} {p:.1}", r.router)))
        .collect();
    if !bursts.is_empty() {
        let _ = writeln!(
            out,
            "\nThe burst's requests, TTFT p90 ms: {}.",
            bursts.join(", ")
        );
    }
    if runs.iter().any(|r| r.classes.len() > 1 || r.shed > 0) {
        let _ = writeln!(
            out,
            "\nPer tenant and priority (SLO {:.0} ms):\n\n| router | tenant | priority | served | shed (429) | within SLO | goodput req/s | TTFT p50 ms | p90 ms |\n|---|---|---|---|---|---|---|---|---|",
            runs.first().map_or(0.0, |r| r.slo_ms)
        );
        for r in runs {
            for c in &r.classes {
                let _ = writeln!(
                    out,
                    "| {} | {} | {} | {} | {} | {} | {:.1} | {:.1} | {:.1} |",
                    r.router,
                    c.tenant,
                    c.priority,
                    c.served,
                    c.shed,
                    c.good,
                    c.goodput_rps,
                    c.ttft_p50_ms,
                    c.ttft_p90_ms
                );
            }
        }
    }
    let find = |name: &str| runs.iter().find(|r| r.router == name);
    for ic in runs
        .iter()
        .filter(|r| r.router.starts_with("inferencecache"))
    {
        let _ = writeln!(out);
        if let Some(rr) = find(Router::RoundRobin.name()) {
            let _ = writeln!(
                out,
                "{} vs round-robin: {} the hit rate; TTFT p50 {}, p90 {}, p99 {}; throughput {}.",
                ic.router,
                ratio(ic.hit_rate, rr.hit_rate),
                lower_or_higher(ic.ttft_p50_ms, rr.ttft_p50_ms),
                lower_or_higher(ic.ttft_p90_ms, rr.ttft_p90_ms),
                lower_or_higher(ic.ttft_p99_ms, rr.ttft_p99_ms),
                ratio(ic.throughput_rps, rr.throughput_rps),
            );
        }
        if let Some(ol) = find(Router::OracleLoad.name()) {
            let _ = writeln!(
                out,
                "{} vs the load-aware oracle: TTFT p90 {}.",
                ic.router,
                lower_or_higher(ic.ttft_p90_ms, ol.ttft_p90_ms),
            );
        }
        if let (Some(ratio), Some(mae), Some(exact)) = (
            ic.cached_prediction_ratio,
            ic.cached_prediction_mae,
            ic.cached_prediction_exact,
        ) {
            let on_matches = match ic.prefix_match_prediction_ratio {
                Some(r) => format!("; on PREFIX_MATCH decisions {r:.2}×"),
                None => String::new(),
            };
            let _ = writeln!(
                out,
                "{} closed loop: predicted {ratio:.2}× the cached tokens the engines reported, \
                 mean error {mae:.0} tokens per decision, {:.0}% exact{on_matches}.",
                ic.router,
                exact * 100.0
            );
        }
        if let Some(oracle) = find(Router::Oracle.name()) {
            let _ = writeln!(
                out,
                "{} reaches {:.0}% of the oracle's hit rate.",
                ic.router,
                if oracle.hit_rate > 0.0 {
                    ic.hit_rate / oracle.hit_rate * 100.0
                } else {
                    100.0
                }
            );
        }
        let reasons: Vec<String> = ic.reasons.iter().map(|(k, v)| format!("{k} {v}")).collect();
        let per: Vec<String> = ic
            .per_engine
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect();
        let _ = writeln!(
            out,
            "{} decisions: {}; requests per engine: {}.",
            ic.router,
            reasons.join(", "),
            per.join(", ")
        );
    }
    out
}

/// `ours` against `theirs` for a lower-is-better figure: "N× lower" when we win,
/// "N× higher" when we lose, "the same" when equal.
pub fn lower_or_higher(ours: f64, theirs: f64) -> String {
    if ours == theirs {
        "the same".to_string()
    } else if ours < theirs {
        format!("{} lower", ratio(theirs, ours))
    } else {
        format!("{} higher", ratio(ours, theirs))
    }
}

fn ratio(a: f64, b: f64) -> String {
    if b > 0.0 {
        format!("{:.1}×", a / b)
    } else {
        "∞×".to_string()
    }
}

#[cfg(test)]
mod tests;
