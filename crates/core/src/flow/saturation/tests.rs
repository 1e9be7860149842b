use super::*;

fn p(engine_waiting: u64, sent: u64, kv: Option<f64>) -> Pressure {
    Pressure {
        engine_waiting,
        sent_since_report: sent,
        kv_usage: kv,
    }
}

#[test]
fn waiting_counts_engine_report_plus_what_was_sent_since() {
    let t = Thresholds::default();
    assert!(!p(7, 0, None).is_saturated(&t));
    assert!(p(7, 1, None).is_saturated(&t));
    assert!(p(0, 8, None).is_saturated(&t));
}

#[test]
fn full_kv_cache_saturates_only_with_work_waiting() {
    let t = Thresholds::default();
    assert!(!p(0, 0, Some(0.99)).is_saturated(&t));
    assert!(p(1, 0, Some(0.99)).is_saturated(&t));
    assert!(!p(1, 0, Some(0.5)).is_saturated(&t));
}

#[test]
fn one_replica_with_room_means_not_saturated() {
    let t = Thresholds::default();
    assert!(all_saturated([p(9, 0, None), p(0, 9, None)], &t));
    assert!(!all_saturated([p(9, 0, None), p(0, 1, None)], &t));
    assert!(!all_saturated(std::iter::empty(), &t));
}
