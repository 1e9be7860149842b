use super::*;

fn v(cached: u64, load: u64, ttft: f64) -> EngineView {
    EngineView {
        cached,
        load,
        predicted_ttft_ms: ttft,
        full: false,
    }
}

#[test]
fn the_ledger_counts_only_requests_the_engine_has_not_received() {
    let mut l = Ledger::new(2);
    l.record(0, 100);
    l.record(0, 50);
    l.record(1, 7);
    assert_eq!(l.in_transit(0, 0), 150);
    assert_eq!(l.in_transit(0, 1), 50);
    assert_eq!(l.in_transit(1, 0), 7);
    l.record(0, 20);
    assert_eq!(l.in_transit(0, 1), 70);
    assert_eq!(l.in_transit(0, 3), 0);
    // A count that runs ahead of the ledger (not ours) changes nothing more.
    assert_eq!(l.in_transit(0, 9), 0);
    l.record(0, 5);
    assert_eq!(l.in_transit(0, 3), 5);
}

#[test]
fn the_cache_oracle_takes_the_longest_prefix_however_busy() {
    let views = [v(0, 0, 10.0), v(512, 9, 900.0), v(512, 3, 700.0)];
    assert_eq!(oracle_choice(Router::Oracle, &views), Some(2));
    assert_eq!(oracle_choice(Router::Oracle, &[]), None);
}

#[test]
fn the_load_oracle_takes_the_lowest_predicted_ttft_then_the_longest_prefix() {
    let views = [v(0, 0, 60.0), v(512, 9, 900.0), v(256, 1, 60.0)];
    assert_eq!(oracle_choice(Router::OracleLoad, &views), Some(2));
    let idle = [v(0, 0, 60.0), v(0, 0, 60.0)];
    assert_eq!(oracle_choice(Router::OracleLoad, &idle), Some(0));
}

#[test]
fn the_balanced_oracle_skips_full_engines_unless_every_one_is() {
    let mut full = v(512, 0, 10.0);
    full.full = true;
    let views = [full, v(0, 0, 60.0), v(0, 0, 50.0)];
    assert_eq!(oracle_choice(Router::OracleBalanced, &views), Some(2));
    // The other oracles do not look at it.
    assert_eq!(oracle_choice(Router::OracleLoad, &views), Some(0));
    let mut other = v(0, 0, 5.0);
    other.full = true;
    assert_eq!(
        oracle_choice(Router::OracleBalanced, &[full, other]),
        Some(1)
    );
}

#[test]
fn the_balanced_cap_is_the_acceptance_bound_with_room_for_every_request() {
    assert_eq!(balanced_cap(320, 8), 52); // 1.3 × 40
    assert_eq!(balanced_cap(320, 4), 104); // 1.3 × 80
    assert_eq!(balanced_cap(5, 4), 2); // 1.3 × 1.25 rounds to 1: too few
    assert_eq!(balanced_cap(0, 4), 0);
    assert!(balanced_cap(7, 3) * 3 >= 7);
}
