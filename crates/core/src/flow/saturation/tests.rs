use super::*;

fn p(engine_waiting: u64, sent: u64, kv: Option<f64>) -> Pressure {
    Pressure {
        engine_waiting,
        sent_since_report: sent,
        kv_usage: kv,
        backlog_tokens: 0,
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

#[test]
fn a_prefill_backlog_saturates_alone_and_zero_leaves_the_bound_out() {
    let t = Thresholds::default().with_backlog(4096);
    let backlog = |tokens| Pressure {
        backlog_tokens: tokens,
        ..p(0, 1, None)
    };
    assert!(!backlog(4095).is_saturated(&t));
    assert!(backlog(4096).is_saturated(&t));
    let off = t.with_backlog(0);
    assert!(!backlog(1 << 40).is_saturated(&off));
    assert!(
        p(8, 0, None).is_saturated(&off),
        "the count bound still applies"
    );
}
