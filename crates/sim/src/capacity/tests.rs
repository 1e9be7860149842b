use std::time::Duration;

use super::*;
use crate::drive::{Outcome, Sample, Shed};
use crate::engine::BatchCosts;
use crate::report::{EngineStats, Offered};

fn point(load: f64, p90_ms: f64) -> Point {
    Point {
        load,
        p90_ms,
        served: 100,
    }
}

#[test]
fn capacity_interpolates_between_the_last_pass_and_the_first_miss() {
    let points = [
        point(0.5, 50.0),
        point(1.0, 80.0),
        point(1.5, 150.0),
        point(2.0, 400.0),
        point(3.0, 900.0),
    ];
    // 100 ms lies (100 − 80) / (150 − 80) = 2/7 of the way from 1.0× to 1.5×.
    let c = capacity_at_slo(&points, 100.0).unwrap();
    let Capacity::Between {
        passing,
        failing,
        interpolated,
    } = c
    else {
        panic!("{c:?}")
    };
    assert_eq!((passing, failing), (1.0, 1.5));
    assert!((interpolated - (1.0 + 0.5 * 20.0 / 70.0)).abs() < 1e-9);
    assert_eq!(c.passing(), 1.0);
    // Order does not matter.
    let mut shuffled = points;
    shuffled.reverse();
    assert_eq!(capacity_at_slo(&shuffled, 100.0), Some(c));
}

#[test]
fn capacity_stops_at_the_first_miss_even_if_a_higher_load_passes_again() {
    // Noise: 2× passes after 1.5× missed; the capacity is still below 1.5×.
    let points = [point(1.0, 90.0), point(1.5, 120.0), point(2.0, 95.0)];
    let c = capacity_at_slo(&points, 100.0).unwrap();
    assert_eq!(c.passing(), 1.0);
    assert!(c.value() < 1.5);
}

#[test]
fn capacity_bounds_when_every_or_no_step_meets_the_slo() {
    let all = [point(0.5, 10.0), point(3.0, 99.0)];
    assert_eq!(
        capacity_at_slo(&all, 100.0),
        Some(Capacity::AtLeast { highest: 3.0 })
    );
    let none = [point(0.5, 101.0), point(1.0, 300.0)];
    let c = capacity_at_slo(&none, 100.0).unwrap();
    assert_eq!(c, Capacity::Below { lowest: 0.5 });
    assert_eq!(c.value(), 0.0);
    assert_eq!(capacity_at_slo(&[], 100.0), None);
    // Exactly at the objective meets it.
    assert_eq!(
        capacity_at_slo(&[point(1.0, 100.0)], 100.0),
        Some(Capacity::AtLeast { highest: 1.0 })
    );
}

#[test]
fn a_step_that_served_nothing_misses_and_gives_no_slope() {
    let points = [
        point(1.0, 40.0),
        Point {
            load: 2.0,
            p90_ms: 0.0,
            served: 0,
        },
    ];
    assert_eq!(
        capacity_at_slo(&points, 100.0),
        Some(Capacity::Between {
            passing: 1.0,
            failing: 2.0,
            interpolated: 1.0
        })
    );
}

#[test]
fn capacity_ratios_say_when_a_side_is_only_a_bound() {
    let between = |x| Capacity::Between {
        passing: 1.0,
        failing: 1.5,
        interpolated: x,
    };
    assert_eq!(capacity_ratio(between(2.0), between(1.0)), "2.00×");
    assert_eq!(
        capacity_ratio(Capacity::AtLeast { highest: 3.0 }, between(1.5)),
        "≥ 2.00×"
    );
    assert_eq!(
        capacity_ratio(between(1.5), Capacity::AtLeast { highest: 3.0 }),
        "≤ 0.50×"
    );
    assert_eq!(
        capacity_ratio(between(1.5), Capacity::Below { lowest: 0.5 }),
        "∞×"
    );
    assert!(
        capacity_ratio(
            Capacity::AtLeast { highest: 3.0 },
            Capacity::AtLeast { highest: 3.0 }
        )
        .starts_with('—')
    );
}

#[test]
fn the_slo_is_a_multiple_of_the_solo_no_cache_ttft() {
    let fleet = Fleet {
        engines: 4,
        max_running: 256,
        prefill_us_per_token: 50.0,
        decode_us_per_token: 2000.0,
        batch: Some(BatchCosts::DEFAULT),
        mixed: false,
    };
    let request = |len: usize| crate::workload::Request {
        at: Duration::ZERO,
        prompt: vec![1; len],
        max_tokens: 32,
        family: 0,
        tenant: 0,
        priority: 0,
    };
    // 2,176 tokens at 2,048 per step: two steps of 5 ms + 30 µs per token.
    let solo = 2.0 * 5.0 + 2176.0 * 0.03;
    assert!((fleet.solo_ttft_ms(&[request(2176)]) - solo).abs() < 1e-9);
    let slo = slo_ms(&fleet, &[request(2176)]);
    assert!((slo - SLO_TTFT_MULTIPLE * solo).abs() < 1e-9);
    // The mean over the requests.
    let mixed = slo_ms(&fleet, &[request(100), request(2000)]);
    let want = SLO_TTFT_MULTIPLE * ((5.0 + 3.0) + (5.0 + 60.0)) / 2.0;
    assert!((mixed - want).abs() < 1e-9, "{mixed} vs {want}");
}

fn served(ttft_ms: f64, tenant: u8, priority: i32) -> Sample {
    Sample {
        at_ms: 0.0,
        ttft_ms,
        latency_ms: ttft_ms,
        prompt_tokens: 100,
        cached_tokens: 0,
        replica: "a".into(),
        reason: None,
        predicted_cached: None,
        spilled_from: None,
        spilled_by: None,
        family: 0,
        tenant,
        priority,
        queued_ms: 0.0,
    }
}

fn shed(tenant: u8, reason: &str) -> Shed {
    Shed {
        at_ms: 0.0,
        tenant,
        priority: 0,
        reason: reason.into(),
        latency_ms: if reason == "queue-timeout" {
            100.0
        } else {
            1.0
        },
    }
}

#[test]
fn goodput_counts_served_within_the_slo_and_never_shed_or_failed() {
    let outcome = Outcome {
        samples: vec![
            served(10.0, 0, 0),
            served(100.0, 0, 0), // exactly at the objective: good
            served(100.5, 0, 0),
            served(20.0, 1, 0),
            served(500.0, 1, 0),
        ],
        shed: vec![
            shed(1, "queue-timeout"),
            shed(1, "queue-timeout"),
            shed(0, "queue-full"),
        ],
        errors: 2,
        first_error: Some("503".into()),
        elapsed: Duration::from_secs(2),
    };
    let s = RunSummary::of(
        "w",
        Router::InferenceCacheFlow,
        &["a".to_string()],
        &outcome,
        EngineStats::default(),
    )
    .with_slo(
        &outcome,
        Offered {
            load: 2.0,
            rate: 50.0,
            slo_ms: 100.0,
        },
    );
    assert_eq!(s.requests, 10);
    assert_eq!((s.shed, s.errors, s.good), (3, 2, 3));
    assert_eq!(s.shed_reasons["queue-timeout"], 2);
    assert_eq!(s.shed_reasons["queue-full"], 1);
    assert_eq!(
        (s.shed_latency_p50_ms, s.shed_latency_p90_ms),
        (100.0, 100.0)
    );
    assert_eq!(s.goodput_rps, 1.5);
    assert_eq!((s.load, s.offered_rps, s.slo_ms), (2.0, 50.0, 100.0));
    // The p90 is of served requests only.
    assert_eq!(s.ttft_p90_ms, 500.0);
    assert_eq!(s.classes.len(), 2);
    let t0 = &s.classes[0];
    assert_eq!((t0.tenant, t0.served, t0.shed, t0.good), (0, 3, 1, 2));
    assert_eq!(t0.goodput_rps, 1.0);
    let t1 = &s.classes[1];
    assert_eq!((t1.tenant, t1.served, t1.shed, t1.good), (1, 2, 2, 1));
    assert_eq!(t1.ttft_p90_ms, 500.0);
}

#[test]
fn the_sweep_table_reports_each_routers_capacity_and_the_ratios() {
    let run = |router: Router, load: f64, p90: f64, shed: usize| {
        let outcome = Outcome {
            samples: (0..10).map(|_| served(p90, 0, 0)).collect(),
            shed: (0..shed).map(|_| self::shed(0, "queue-full")).collect(),
            errors: 0,
            first_error: None,
            elapsed: Duration::from_secs(1),
        };
        RunSummary::of("w", router, &["a".into()], &outcome, EngineStats::default()).with_slo(
            &outcome,
            Offered {
                load,
                rate: 40.0 * load,
                slo_ms: 100.0,
            },
        )
    };
    let runs = vec![
        run(Router::RoundRobin, 1.0, 90.0, 0),
        run(Router::RoundRobin, 2.0, 290.0, 0),
        run(Router::LeastRequest, 1.0, 80.0, 0),
        run(Router::LeastRequest, 2.0, 120.0, 0),
        run(Router::InferenceCache, 1.0, 30.0, 0),
        run(Router::InferenceCache, 2.0, 60.0, 0),
        run(Router::InferenceCacheFlow, 2.0, 60.0, 5),
    ];
    let caps = capacities(&runs);
    let names: Vec<&str> = caps.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "round-robin",
            "least-request",
            "inferencecache",
            "inferencecache-flow"
        ]
    );
    // Round-robin crosses 100 ms a twentieth of the way from 1× to 2×.
    assert!((caps[0].1.value() - 1.05).abs() < 1e-9);
    assert!((caps[1].1.value() - 1.5).abs() < 1e-9);
    let t = table("w", "a workload", &runs);
    assert!(t.contains("p90 TTFT ≤ 100 ms"), "{t}");
    assert!(
        t.contains("| inferencecache-flow | 2× | 80.0 | 10 | 5 | 0 | 10.0 |"),
        "{t}"
    );
    assert!(t.contains("| round-robin | 1.05× | 42.0 | 1× |"), "{t}");
    assert!(t.contains("| inferencecache | ≥ 2× | 80.0 | 2× |"), "{t}");
    assert!(
        t.contains("÷ round-robin ≥ 1.90×, least-request ≥ 1.33×"),
        "{t}"
    );
}
