use super::*;

fn sent(f: &FleetRoutes, n: u64) {
    for _ in 0..n {
        f.note_sent();
    }
}

#[test]
fn the_first_scrape_sets_the_baseline() {
    let f = FleetRoutes::default();
    sent(&f, 3);
    assert_eq!(f.others_in(1_000), 0);
    assert_eq!(f.others_in(1_004), 4);
}

#[test]
fn one_sidecar_is_never_counted_twice_however_late_its_requests_start() {
    let f = FleetRoutes::default();
    f.others_in(0);
    // 10 sent; the engine shows 6 of them by this scrape, the rest by the next.
    sent(&f, 10);
    assert_eq!(f.others_in(6), 0);
    sent(&f, 5);
    assert_eq!(f.others_in(6 + 4 + 5), 0);
    assert_eq!(f.others_in(15), 0);
}

#[test]
fn other_sidecars_requests_are_what_the_engine_started_beyond_ours() {
    let f = FleetRoutes::default();
    f.others_in(0);
    sent(&f, 10);
    // Ours (10) and 7 others started.
    assert_eq!(f.others_in(17), 7);
    // Ours lag: 4 of 8 start now, with 5 others; the other 4 next time with
    // 2. Which started request was whose is not known, so ours are taken
    // first: the 7 others show up a scrape late, but all of them and no more.
    sent(&f, 8);
    let now = f.others_in(17 + 4 + 5);
    assert_eq!(now, 1);
    assert_eq!(now + f.others_in(26 + 4 + 2), 7);
}

#[test]
fn a_request_that_never_starts_is_carried_for_two_scrapes_only() {
    let f = FleetRoutes::default();
    f.others_in(0);
    sent(&f, 5); // never shown by the engine
    assert_eq!(f.others_in(0), 0);
    assert_eq!(f.others_in(0), 0);
    // Two scrapes later, nothing of ours is left to hide others' requests.
    assert_eq!(f.others_in(0), 0);
    assert_eq!(f.others_in(3), 3);
}

#[test]
fn a_count_that_goes_down_is_a_restart_and_only_resets_the_baseline() {
    let f = FleetRoutes::default();
    f.others_in(500);
    sent(&f, 2);
    assert_eq!(f.others_in(10), 0);
    assert_eq!(f.others_in(13), 3);
    f.reset();
    assert_eq!(f.others_in(2), 0);
    assert_eq!(f.others_in(4), 2);
}
