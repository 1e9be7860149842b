//! What a run is worth: hit rate, time to first token, throughput and balance,
//! per router, and the table that compares them.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

use super::drive::Outcome;
use super::router::Router;

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
    /// inferencecache's reason codes and how often each came back.
    pub reasons: BTreeMap<String, usize>,
    /// Every TTFT, sorted (for the chart).
    #[serde(skip)]
    pub ttfts_ms: Vec<f64>,
}

impl RunSummary {
    pub fn of(
        workload: &str,
        router: Router,
        engine_ids: &[String],
        outcome: &Outcome,
        peak_queue: u64,
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
        let max = per_engine.values().copied().max().unwrap_or(0) as f64;
        let mean = s.len() as f64 / per_engine.len().max(1) as f64;
        let secs = outcome.elapsed.as_secs_f64();
        Self {
            workload: workload.to_string(),
            router: router.name().to_string(),
            requests: s.len() + outcome.errors,
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
            peak_queue,
            reasons,
            ttfts_ms: ttfts,
        }
    }
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
        "| router | hit rate | TTFT p50 ms | p90 ms | p99 ms | req/s | imbalance (max/mean) | peak queue | errors |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|---|---|---|");
    for r in runs {
        let _ = writeln!(
            out,
            "| {} | {:.1}% | {:.1} | {:.1} | {:.1} | {:.1} | {:.2} | {} | {} |",
            r.router,
            r.hit_rate * 100.0,
            r.ttft_p50_ms,
            r.ttft_p90_ms,
            r.ttft_p99_ms,
            r.throughput_rps,
            r.imbalance,
            r.peak_queue,
            r.errors
        );
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
                "{} vs round-robin: {} the hit rate; TTFT p50 {} lower, p90 {} lower.",
                ic.router,
                ratio(ic.hit_rate, rr.hit_rate),
                ratio(rr.ttft_p50_ms, ic.ttft_p50_ms),
                ratio(rr.ttft_p90_ms, ic.ttft_p90_ms),
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

fn ratio(a: f64, b: f64) -> String {
    if b > 0.0 {
        format!("{:.1}×", a / b)
    } else {
        "∞×".to_string()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::drive::Sample;

    fn sample(replica: &str, ttft: f64, prompt: u64, cached: u64) -> Sample {
        Sample {
            ttft_ms: ttft,
            latency_ms: ttft + 10.0,
            prompt_tokens: prompt,
            cached_tokens: cached,
            replica: replica.to_string(),
            reason: Some("PREFIX_MATCH".to_string()),
            family: 0,
        }
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.5), 50.0);
        assert_eq!(percentile(&v, 0.9), 90.0);
        assert_eq!(percentile(&v, 0.99), 99.0);
        assert_eq!(percentile(&[7.0], 0.99), 7.0);
        assert_eq!(percentile(&[], 0.5), 0.0);
    }

    #[test]
    fn summary_counts_tokens_balance_and_idle_engines() {
        let outcome = Outcome {
            samples: vec![
                sample("a", 10.0, 100, 50),
                sample("a", 30.0, 100, 0),
                sample("b", 20.0, 200, 150),
            ],
            errors: 1,
            first_error: None,
            elapsed: Duration::from_secs(2),
        };
        let ids = ["a", "b", "c"].map(String::from);
        let s = RunSummary::of("w", Router::InferenceCache, &ids, &outcome, 4);
        assert_eq!(s.requests, 4);
        assert!((s.hit_rate - 0.5).abs() < 1e-9);
        assert_eq!(s.ttft_p50_ms, 20.0);
        assert_eq!(s.ttft_p99_ms, 30.0);
        assert!((s.throughput_rps - 1.5).abs() < 1e-9);
        // a served 2 of 3 over 3 engines (c idle): max 2 / mean 1.
        assert!((s.imbalance - 2.0).abs() < 1e-9);
        assert_eq!(s.per_engine["c"], 0);
        assert_eq!(s.reasons["PREFIX_MATCH"], 3);
        let t = table("w", "d", &[s]);
        assert!(
            t.contains(
                "inferencecache decisions: PREFIX_MATCH 3; requests per engine: a 2, b 1, c 0."
            ),
            "{t}"
        );
        assert!(
            t.contains("| inferencecache | 50.0% | 20.0 | 30.0 | 30.0 | 1.5 | 2.00 | 4 | 1 |"),
            "{t}"
        );
    }
}
