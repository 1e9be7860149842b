use super::*;

fn at(ms: u64) -> Timestamp {
    Timestamp::from_millis(ms)
}

fn msg(peer: &str, epoch: u64, seq: u64, fact: Fact) -> Message {
    Message {
        peer: peer.into(),
        epoch,
        seq,
        fact,
    }
}

fn scope() -> ScopeRef<'static> {
    ScopeRef::new("acme", "llama", "vllm-v1")
}

fn routed(route: u64, replica: &str, tokens: u64) -> Fact {
    Fact::Routed {
        route,
        scope: scope().to_owned(),
        replica: replica.into(),
        uncached_tokens: tokens,
        prompt_tokens: 0,
        priority: 0,
        held: false,
        pending: Vec::new(),
    }
}

fn load(in_flight: u64, prefill_tokens: u64) -> PeerLoad {
    PeerLoad {
        in_flight,
        prefill_tokens,
    }
}

#[test]
fn routed_prefill_end_and_release_move_the_totals() {
    let mut l = PeerLedger::new("me");
    assert_eq!(
        l.apply(msg("b", 1, 1, routed(7, "r1", 300)), at(0)),
        Outcome::Applied
    );
    assert_eq!(
        l.apply(msg("b", 1, 2, routed(8, "r1", 100)), at(1)),
        Outcome::Applied
    );
    assert_eq!(l.load(scope(), "r1"), load(2, 400));
    assert_eq!(
        l.apply(msg("b", 1, 3, Fact::PrefillEnded { route: 7 }), at(2)),
        Outcome::Applied
    );
    assert_eq!(l.load(scope(), "r1"), load(2, 100));
    assert_eq!(
        l.apply(msg("b", 1, 4, Fact::Released { route: 7 }), at(3)),
        Outcome::Applied
    );
    assert_eq!(l.load(scope(), "r1"), load(1, 100));
    assert_eq!(
        l.apply(msg("b", 1, 5, Fact::Released { route: 8 }), at(4)),
        Outcome::Applied
    );
    assert_eq!(l.load(scope(), "r1"), PeerLoad::default());
    assert_eq!(l.load(scope(), "r2"), PeerLoad::default());
}

#[test]
fn own_echo_changes_nothing() {
    let mut l = PeerLedger::new("me");
    assert_eq!(
        l.apply(msg("me", 1, 1, routed(1, "r1", 10)), at(0)),
        Outcome::Rejected(Rejection::Own)
    );
    assert_eq!(l.load(scope(), "r1"), PeerLoad::default());
    assert_eq!(l.peers(), 0);
}

#[test]
fn duplicate_and_reordered_late_messages_are_dropped() {
    let mut l = PeerLedger::new("me");
    l.apply(msg("b", 1, 1, routed(1, "r1", 10)), at(0));
    l.apply(msg("b", 1, 2, routed(2, "r1", 10)), at(0));
    // The same message again, and an older one arriving late.
    assert_eq!(
        l.apply(msg("b", 1, 2, routed(2, "r1", 10)), at(1)),
        Outcome::Rejected(Rejection::StaleSeq)
    );
    assert_eq!(
        l.apply(msg("b", 1, 1, Fact::Released { route: 1 }), at(1)),
        Outcome::Rejected(Rejection::StaleSeq)
    );
    assert_eq!(l.load(scope(), "r1"), load(2, 20));
}

#[test]
fn a_gap_drops_the_peer_contributions_and_counts_again_from_there() {
    let mut l = PeerLedger::new("me");
    l.apply(msg("b", 1, 1, routed(1, "r1", 10)), at(0));
    l.apply(msg("b", 1, 2, routed(2, "r2", 10)), at(0));
    // Seq 3 (perhaps route 1's release) was lost.
    assert_eq!(
        l.apply(msg("b", 1, 4, routed(3, "r2", 5)), at(1)),
        Outcome::AppliedAfterGap
    );
    assert_eq!(l.load(scope(), "r1"), PeerLoad::default());
    assert_eq!(l.load(scope(), "r2"), load(1, 5));
    // A release of a route dropped at the gap is refused, but the order goes on.
    assert_eq!(
        l.apply(msg("b", 1, 5, Fact::Released { route: 2 }), at(2)),
        Outcome::Rejected(Rejection::UnknownRoute)
    );
    assert_eq!(
        l.apply(msg("b", 1, 6, Fact::Heartbeat), at(2)),
        Outcome::Applied
    );
    assert_eq!(l.load(scope(), "r2"), load(1, 5));
}

#[test]
fn a_gap_at_one_peer_leaves_the_others_alone() {
    let mut l = PeerLedger::new("me");
    l.apply(msg("b", 1, 1, routed(1, "r1", 10)), at(0));
    l.apply(msg("c", 9, 40, routed(1, "r1", 7)), at(0));
    l.apply(msg("b", 1, 3, Fact::Heartbeat), at(1));
    assert_eq!(l.load(scope(), "r1"), load(1, 7));
}

#[test]
fn a_silent_peer_expires_after_the_heartbeat_timeout_only() {
    let mut l = PeerLedger::new("me");
    l.apply(msg("b", 1, 1, routed(1, "r1", 10)), at(0));
    l.apply(msg("c", 1, 1, routed(1, "r1", 10)), at(0));
    l.apply(msg("c", 1, 2, Fact::Heartbeat), at(1_500));
    let timeout = HEARTBEAT_TIMEOUT.as_millis() as u64;
    assert_eq!(
        l.expire(at(timeout)),
        0,
        "exactly at the timeout is not past it"
    );
    assert_eq!(l.expire(at(timeout + 1)), 1);
    assert_eq!(l.load(scope(), "r1"), load(1, 10), "c heartbeat kept it");
    assert_eq!(l.peers(), 1);
    assert!(HEARTBEAT_TIMEOUT <= Duration::from_secs(3));
    assert!(HEARTBEAT_INTERVAL * 3 <= HEARTBEAT_TIMEOUT);
}

#[test]
fn a_clean_leave_releases_everything_at_once() {
    let mut l = PeerLedger::new("me");
    l.apply(msg("b", 1, 1, routed(1, "r1", 10)), at(0));
    l.apply(msg("b", 1, 2, routed(2, "r2", 10)), at(0));
    assert_eq!(
        l.apply(msg("b", 1, 3, Fact::Leave), at(1)),
        Outcome::Applied
    );
    assert_eq!(l.load(scope(), "r1"), PeerLoad::default());
    assert_eq!(l.load(scope(), "r2"), PeerLoad::default());
    assert_eq!(l.peers(), 0);
}

#[test]
fn a_newer_epoch_replaces_the_peer_and_an_older_one_is_refused() {
    let mut l = PeerLedger::new("me");
    l.apply(msg("b", 5, 100, routed(1, "r1", 10)), at(0));
    // Restarted: sequence starts over under a newer epoch.
    assert_eq!(
        l.apply(msg("b", 6, 1, routed(1, "r2", 3)), at(1)),
        Outcome::Applied
    );
    assert_eq!(l.load(scope(), "r1"), PeerLoad::default());
    assert_eq!(l.load(scope(), "r2"), load(1, 3));
    // A message of the old run (or a forger replaying one) changes nothing.
    assert_eq!(
        l.apply(msg("b", 5, 101, Fact::Leave), at(2)),
        Outcome::Rejected(Rejection::StaleEpoch)
    );
    assert_eq!(l.load(scope(), "r2"), load(1, 3));
}

#[test]
fn a_duplicate_route_id_is_refused_without_double_counting() {
    let mut l = PeerLedger::new("me");
    l.apply(msg("b", 1, 1, routed(1, "r1", 10)), at(0));
    assert_eq!(
        l.apply(msg("b", 1, 2, routed(1, "r1", 10)), at(0)),
        Outcome::Rejected(Rejection::DuplicateRoute)
    );
    assert_eq!(l.load(scope(), "r1"), load(1, 10));
    // The refused message still advanced the order: no gap next.
    assert_eq!(
        l.apply(msg("b", 1, 3, Fact::Heartbeat), at(0)),
        Outcome::Applied
    );
}

#[test]
fn a_peer_holds_a_bounded_number_of_routes() {
    let mut l = PeerLedger::new("me");
    for i in 0..MAX_IN_FLIGHT_PER_PEER as u64 {
        l.apply(msg("b", 1, i + 1, routed(i, "r1", 0)), at(0));
    }
    let n = MAX_IN_FLIGHT_PER_PEER as u64;
    assert_eq!(
        l.apply(msg("b", 1, n + 1, routed(n, "r1", 0)), at(0)),
        Outcome::Rejected(Rejection::Full)
    );
    assert_eq!(l.load(scope(), "r1").in_flight, n);
}

#[test]
fn clear_forgets_every_peer() {
    let mut l = PeerLedger::new("me");
    l.apply(msg("b", 1, 1, routed(1, "r1", 10)), at(0));
    l.clear();
    assert_eq!(l.load(scope(), "r1"), PeerLoad::default());
    // The peer is relearned from whatever sequence it sends next.
    assert_eq!(
        l.apply(msg("b", 1, 50, routed(2, "r1", 1)), at(1)),
        Outcome::Applied
    );
    assert_eq!(l.load(scope(), "r1"), load(1, 1));
}

mod random {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Whatever arrives, in any order, the totals equal the sum over the
        /// routes the ledger holds, and never underflow.
        #[test]
        fn totals_match_the_held_routes(
            ops in proptest::collection::vec((0u8..3, 0u64..3, 0u64..6, 0u64..4, 0u8..5, 0u64..50), 0..200)
        ) {
            let mut l = PeerLedger::new("me");
            let mut clock = 0;
            for (peer, epoch, seq_step, route, kind, tokens) in ops {
                clock += 100;
                let peer = ["a", "b", "me"][peer as usize];
                let seq = l.peers.get(peer).map_or(0, |p| p.seq) + seq_step;
                let fact = match kind {
                    0 | 1 => routed(route, ["r1", "r2"][(route % 2) as usize], tokens),
                    2 => Fact::PrefillEnded { route },
                    3 => Fact::Released { route },
                    _ => Fact::Heartbeat,
                };
                l.apply(msg(peer, epoch, seq, fact), at(clock));
                if clock % 700 == 0 {
                    l.expire(at(clock));
                }
                for replica in ["r1", "r2"] {
                    let mut want = PeerLoad::default();
                    for p in l.peers.values() {
                        for r in p.routes.values().filter(|r| r.replica.1 == replica) {
                            want.in_flight += 1;
                            want.prefill_tokens += r.prefill_tokens;
                        }
                    }
                    prop_assert_eq!(l.load(scope(), replica), want);
                }
            }
        }
    }
}

#[test]
fn scopes_are_kept_apart() {
    let mut l = PeerLedger::new("me");
    let other = ScopeRef::new("globex", "llama", "vllm-v1");
    l.apply(msg("b", 1, 1, routed(1, "r1", 10)), at(0));
    l.apply(
        msg(
            "b",
            1,
            2,
            Fact::Routed {
                route: 2,
                scope: other.to_owned(),
                replica: "r1".into(),
                uncached_tokens: 5,
                prompt_tokens: 0,
                priority: 0,
                held: false,
                pending: Vec::new(),
            },
        ),
        at(0),
    );
    assert_eq!(l.load(scope(), "r1"), load(1, 10));
    assert_eq!(l.load(other, "r1"), load(1, 5));
    assert_eq!(l.totals().count(), 2);
    l.apply(msg("b", 1, 3, Fact::Released { route: 2 }), at(0));
    assert_eq!(l.load(other, "r1"), PeerLoad::default());
    assert_eq!(l.totals().count(), 1);
}
