use super::*;
use prometheus_client::encoding::text::encode;
use prometheus_client::registry::Registry;

#[test]
fn encodes_like_prometheus_client_histograms() {
    use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
    let ours = LatencyHistogram::exponential(Duration::from_micros(1), 2.0, 20);
    let theirs = Histogram::new(exponential_buckets(1e-6, 2.0, 20));
    for us in [0, 1, 3, 700, 5_000, 2_000_000, 10_000_000] {
        let d = Duration::from_micros(us);
        ours.observe(d);
        theirs.observe(d.as_secs_f64());
    }
    fn text(m: impl prometheus_client::registry::Metric) -> String {
        let mut r = Registry::default();
        r.register("x", "latency", m);
        let mut out = String::new();
        encode(&mut out, &r).expect("encodes");
        out
    }
    assert_eq!(text(ours), text(theirs));
}

#[test]
fn an_observation_on_a_bound_counts_in_that_bucket() {
    let h = LatencyHistogram::exponential(Duration::from_micros(1), 2.0, 3);
    h.observe(Duration::from_micros(2));
    h.observe(Duration::from_micros(5));
    let (sum, count, buckets) = h.read();
    assert_eq!(count, 2);
    assert!((sum - 7e-6).abs() < 1e-12);
    let counts: Vec<u64> = buckets.iter().map(|(_, n)| *n).collect();
    assert_eq!(counts, [0, 1, 0, 1], "le=1µs, 2µs, 4µs, +Inf");
}

#[test]
fn observations_from_many_threads_are_all_counted() {
    let h = LatencyHistogram::exponential(Duration::from_micros(1), 2.0, 20);
    std::thread::scope(|s| {
        for t in 0..4 {
            let h = h.clone();
            s.spawn(move || {
                for i in 0..10_000u64 {
                    h.observe(Duration::from_nanos(i * (t + 1)));
                }
            });
        }
    });
    assert_eq!(h.read().1, 40_000);
}
