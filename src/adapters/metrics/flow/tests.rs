use super::*;

fn encoded(m: &FlowMetrics) -> String {
    let mut registry = Registry::default();
    m.register(&mut registry);
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, &registry).unwrap();
    out
}

#[test]
fn depth_is_per_clamped_band_and_an_emptied_band_reads_zero() {
    let m = FlowMetrics::default();
    m.set_depth([(0, 2), (3, 1), (40, 1), (17, 2), (-99, 1)]);
    let text = encoded(&m);
    for line in [
        "flow_queued_requests{priority=\"0\"} 2",
        "flow_queued_requests{priority=\"3\"} 1",
        "flow_queued_requests{priority=\"16\"} 3",
        "flow_queued_requests{priority=\"-16\"} 1",
    ] {
        assert!(text.lines().any(|l| l == line), "{line} missing:\n{text}");
    }
    m.set_depth([(3, 4)]);
    let text = encoded(&m);
    for line in [
        "flow_queued_requests{priority=\"0\"} 0",
        "flow_queued_requests{priority=\"3\"} 4",
        "flow_queued_requests{priority=\"16\"} 0",
    ] {
        assert!(text.lines().any(|l| l == line), "{line} missing:\n{text}");
    }
}

#[test]
fn every_shed_reason_is_a_series_from_the_start() {
    let m = FlowMetrics::default();
    m.record_shed(ShedReason::Priority);
    let text = encoded(&m);
    for line in [
        "flow_shed_total{reason=\"queue-full\"} 0",
        "flow_shed_total{reason=\"queue-timeout\"} 0",
        "flow_shed_total{reason=\"expected-timeout\"} 0",
        "flow_shed_total{reason=\"priority\"} 1",
    ] {
        assert!(text.lines().any(|l| l == line), "{line} missing:\n{text}");
    }
}
