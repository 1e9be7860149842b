use std::time::Duration;

use super::*;
use crate::drive::Sample;

fn sample(replica: &str, ttft: f64, prompt: u64, cached: u64) -> Sample {
    Sample {
        at_ms: 0.0,
        ttft_ms: ttft,
        latency_ms: ttft + 10.0,
        prompt_tokens: prompt,
        cached_tokens: cached,
        replica: replica.to_string(),
        reason: Some("PREFIX_MATCH".to_string()),
        predicted_cached: Some(cached),
        spilled_from: None,
        spilled_by: None,
        family: 0,
        tenant: 0,
        priority: 0,
        queued_ms: 0.0,
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
        shed: Vec::new(),
        errors: 1,
        first_error: None,
        elapsed: Duration::from_secs(2),
    };
    let ids = ["a", "b", "c"].map(String::from);
    let stats = EngineStats {
        peak_queue: 4,
        clock_resets: 1,
        max_lag_ms: 1200.0,
    };
    let s = RunSummary::of("w", Router::InferenceCache, &ids, &outcome, stats);
    assert_eq!(s.requests, 4);
    assert!((s.hit_rate - 0.5).abs() < 1e-9);
    assert_eq!(s.ttft_p50_ms, 20.0);
    assert_eq!(s.ttft_p99_ms, 30.0);
    assert!((s.throughput_rps - 1.5).abs() < 1e-9);
    // a served 2 of 3 over 3 engines (c idle): max 2 / mean 1.
    assert!((s.imbalance - 2.0).abs() < 1e-9);
    assert_eq!(s.per_engine["c"], 0);
    assert_eq!(s.reasons["PREFIX_MATCH"], 3);
    assert_eq!((s.clock_resets, s.max_lag_ms), (1, 1200.0));
    let t = table("w", "d", &[s]);
    assert!(
        t.contains("restarted in: inferencecache (1 resets); those rows depend"),
        "{t}"
    );
    assert!(
        t.contains("inferencecache decisions: PREFIX_MATCH 3; requests per engine: a 2, b 1, c 0."),
        "{t}"
    );
    assert!(
        t.contains(
            "| inferencecache | 50.0% | 20.0 | 30.0 | 30.0 | 1.5 | 2.00 | 4 | 1.00 (0) | 1 |"
        ),
        "{t}"
    );
    assert!(
            t.contains("predicted 1.00× the cached tokens the engines reported, mean error 0 tokens per decision, 100% exact; on PREFIX_MATCH decisions 1.00×."),
            "{t}"
        );
}

#[test]
fn losing_reads_as_higher_and_winning_as_lower() {
    assert_eq!(lower_or_higher(10.0, 100.0), "10.0× lower");
    assert_eq!(lower_or_higher(846.0, 109.0), "7.8× higher");
    assert_eq!(lower_or_higher(5.0, 5.0), "the same");
    assert_eq!(lower_or_higher(0.0, 5.0), "∞× lower");
    let rr = RunSummary::of(
        "w",
        Router::RoundRobin,
        &["a".to_string()],
        &Outcome {
            samples: vec![Sample {
                predicted_cached: None,
                ..sample("a", 100.0, 100, 0)
            }],
            shed: Vec::new(),
            errors: 0,
            first_error: None,
            elapsed: Duration::from_secs(1),
        },
        EngineStats::default(),
    );
    assert_eq!(rr.cached_prediction_ratio, None);
    let ic = RunSummary::of(
        "w",
        Router::InferenceCache,
        &["a".to_string()],
        &Outcome {
            samples: vec![
                Sample {
                    predicted_cached: Some(96),
                    ..sample("a", 400.0, 100, 64)
                },
                Sample {
                    predicted_cached: Some(0),
                    ..sample("a", 400.0, 100, 32)
                },
            ],
            shed: Vec::new(),
            errors: 0,
            first_error: None,
            elapsed: Duration::from_secs(1),
        },
        EngineStats::default(),
    );
    // 96 predicted over 96 reported in total, but off by 32 on each decision.
    assert_eq!(ic.cached_prediction_ratio, Some(1.0));
    assert_eq!(ic.cached_prediction_mae, Some(32.0));
    assert_eq!(ic.cached_prediction_exact, Some(0.0));
    let t = table("w", "d", &[rr, ic]);
    assert!(
        t.contains("TTFT p50 4.0× higher, p90 4.0× higher, p99 4.0× higher"),
        "{t}"
    );
    assert!(!t.contains("0.0× lower"), "{t}");
    assert!(
        t.contains("| round-robin | 0.0% | 100.0 | 100.0 | 100.0 | 1.0 | 1.00 | 0 | — | 0 |"),
        "{t}"
    );
}
