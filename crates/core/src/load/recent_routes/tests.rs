use super::*;

const S: u64 = 1_000_000_000;

#[test]
fn counts_and_halves_every_half_life() {
    let r = RecentRoutes::default();
    let t0 = 100 * S;
    for _ in 0..8 {
        r.note(t0);
    }
    assert!((r.at(t0) - 8.0).abs() < 0.01);
    let h = HALF_LIFE.as_nanos() as u64;
    assert!((r.at(t0 + h) - 4.0).abs() < 0.01);
    assert!((r.at(t0 + 2 * h) - 2.0).abs() < 0.01);
    r.note(t0 + h);
    assert!((r.at(t0 + h) - 5.0).abs() < 0.01);
}

#[test]
fn a_reader_slightly_behind_the_last_update_sees_no_decay() {
    let r = RecentRoutes::default();
    r.note(50 * S);
    r.note(50 * S);
    assert!((r.at(50 * S - 3_000_000) - 2.0).abs() < 0.01);
    // An update stamped behind the last one keeps the later stamp.
    r.note(50 * S - 5_000_000);
    assert!((r.at(50 * S) - 3.0).abs() < 0.01);
}

#[test]
fn a_count_untouched_past_the_stamps_wrap_is_gone_not_frozen() {
    let r = RecentRoutes::default();
    r.note(S);
    // ~30 days later the stamp difference is past half the range.
    let later = S + 30 * 24 * 3600 * S;
    assert!(r.at(later) < 1e-6);
}

#[test]
fn saturates_instead_of_wrapping() {
    let r = RecentRoutes(AtomicU64::new(pack(0, 5_000_000.0)));
    r.note(0);
    assert!(r.at(0) >= 4_000_000.0);
}
