use std::collections::HashMap;
use std::time::Duration;

use proptest::prelude::*;

use super::*;

fn limits(max_queued: usize, wait_ms: u64) -> QueueLimits {
    QueueLimits {
        max_queued,
        max_wait: Duration::from_millis(wait_ms),
    }
}

fn fifo(priority: i64) -> Request<'static> {
    Request {
        priority,
        tenant: "t",
        fair_weight: None,
        tokens: 100,
    }
}

fn held(a: Admission) -> Ticket {
    match a {
        Admission::Held(t) | Admission::HeldEvicting { held: t, .. } => t,
        other => panic!("expected the request to be held, got {other:?}"),
    }
}

const T0: Timestamp = Timestamp(1_000_000_000);

#[test]
fn higher_priority_first_then_arrival_order() {
    let mut q = FlowQueue::new(limits(10, 1000));
    let a = held(q.enqueue(fifo(0), T0));
    let b = held(q.enqueue(fifo(0), T0));
    let c = held(q.enqueue(fifo(5), T0));
    let d = held(q.enqueue(fifo(-1), T0));
    let order: Vec<Ticket> = std::iter::from_fn(|| q.release(T0).map(|h| h.ticket)).collect();
    assert_eq!(order, vec![c, a, b, d]);
    assert!(q.is_empty());
    assert!(q.depth_by_band().is_empty());
}

#[test]
fn release_reports_priority_and_wait() {
    let mut q = FlowQueue::new(limits(10, 5000));
    let a = held(q.enqueue(fifo(3), T0));
    let h = q.release(T0.plus(Duration::from_millis(250))).unwrap();
    assert_eq!(h.ticket, a);
    assert_eq!(h.priority, 3);
    assert_eq!(h.waited, Duration::from_millis(250));
    assert_eq!(q.release(T0), None);
}

#[test]
fn weights_share_tokens_one_to_three_under_backlog() {
    let mut q = FlowQueue::new(limits(100_000, 60_000));
    let mut owner = HashMap::new();
    // Different request sizes per tenant: the share is in tokens, not requests.
    for _ in 0..2000 {
        let t = held(q.enqueue(
            Request {
                priority: 0,
                tenant: "light",
                fair_weight: Some(1),
                tokens: 300,
            },
            T0,
        ));
        owner.insert(t, ("light", 300u64));
        let t = held(q.enqueue(
            Request {
                priority: 0,
                tenant: "heavy",
                fair_weight: Some(3),
                tokens: 500,
            },
            T0,
        ));
        owner.insert(t, ("heavy", 500u64));
    }
    // Serve while both stay backlogged.
    let mut served: HashMap<&str, u64> = HashMap::new();
    for _ in 0..1500 {
        let h = q.release(T0).unwrap();
        let (tenant, tokens) = owner[&h.ticket];
        *served.entry(tenant).or_default() += tokens;
    }
    let ratio = served["heavy"] as f64 / served["light"] as f64;
    assert!((2.7..=3.3).contains(&ratio), "heavy:light = {ratio}");
}

#[test]
fn requests_removed_before_their_turn_are_not_charged() {
    // Under overload the lighter tenant's requests time out (or their clients
    // leave) while they wait: half of them here. It is still served a quarter
    // of the tokens, as its weight says, not less for what it never got.
    let mut q = FlowQueue::new(limits(100_000, 60_000));
    let mut owner = HashMap::new();
    let mut doomed = Vec::new();
    for i in 0..2000 {
        let t = held(q.enqueue(
            Request {
                priority: 0,
                tenant: "light",
                fair_weight: Some(1),
                tokens: 400,
            },
            T0,
        ));
        owner.insert(t, "light");
        if i % 2 == 1 {
            doomed.push(t);
        }
        let t = held(q.enqueue(
            Request {
                priority: 0,
                tenant: "heavy",
                fair_weight: Some(3),
                tokens: 400,
            },
            T0,
        ));
        owner.insert(t, "heavy");
    }
    let mut served: HashMap<&str, u64> = HashMap::new();
    for round in 0..1200 {
        if round % 10 == 0 {
            // A few of the doomed leave between releases, oldest first.
            for t in doomed.drain(..doomed.len().min(40)) {
                assert!(q.cancel(t));
            }
        }
        let h = q.release(T0).unwrap();
        *served.entry(owner[&h.ticket]).or_default() += 400;
    }
    let ratio = served["heavy"] as f64 / served["light"] as f64;
    assert!((2.7..=3.3).contains(&ratio), "heavy:light = {ratio}");
}

#[test]
fn a_flood_whose_requests_time_out_keeps_what_it_was_served_charged() {
    // A flooding tenant is served one request, then its next waiting request
    // times out: the refund must not wipe what it was served, so a tenant of
    // the same weight arriving now goes before the flood's next request.
    let mut q = FlowQueue::new(limits(1000, 60_000));
    let req = |tenant| Request {
        priority: 0,
        tenant,
        fair_weight: Some(1),
        tokens: 2000,
    };
    let flood: Vec<Ticket> = (0..50).map(|_| held(q.enqueue(req("flood"), T0))).collect();
    assert_eq!(q.release(T0).map(|h| h.ticket), Some(flood[0]));
    assert!(q.cancel(flood[1]), "timed out");
    let victim = held(q.enqueue(req("victim"), T0));
    assert_eq!(q.release(T0).map(|h| h.ticket), Some(victim));
    assert_eq!(q.release(T0).map(|h| h.ticket), Some(flood[2]));
}

#[test]
fn fifo_lane_ignores_tenant_and_weight() {
    let mut q = FlowQueue::new(limits(10, 1000));
    let a = held(q.enqueue(
        Request {
            priority: 0,
            tenant: "a",
            fair_weight: None,
            tokens: 10_000,
        },
        T0,
    ));
    let b = held(q.enqueue(
        Request {
            priority: 0,
            tenant: "b",
            fair_weight: None,
            tokens: 1,
        },
        T0,
    ));
    assert_eq!(q.release(T0).unwrap().ticket, a);
    assert_eq!(q.release(T0).unwrap().ticket, b);
}

#[test]
fn idle_tenant_reenters_at_band_clock_not_with_saved_credit() {
    let mut q = FlowQueue::new(limits(1000, 60_000));
    let req = |tenant| Request {
        priority: 0,
        tenant,
        fair_weight: Some(1),
        tokens: 100,
    };
    let mut busy = Vec::new();
    for _ in 0..20 {
        busy.push(held(q.enqueue(req("busy"), T0)));
    }
    for _ in 0..10 {
        q.release(T0).unwrap();
    }
    // A newcomer now alternates with the busy tenant; it does not get ten in a row.
    let n1 = held(q.enqueue(req("new"), T0));
    let n2 = held(q.enqueue(req("new"), T0));
    let next: Vec<Ticket> = (0..4).map(|_| q.release(T0).unwrap().ticket).collect();
    assert!(next.contains(&n1));
    assert!(next.contains(&n2));
    assert!(next.contains(&busy[10]));
    assert!(next.contains(&busy[11]));
}

fn fair(tenant: &'static str, weight: u32) -> Request<'static> {
    Request {
        priority: 0,
        tenant,
        fair_weight: Some(weight),
        tokens: 100,
    }
}

/// Enqueues `a` and `b` alternately, `n` each, and returns the order the queue
/// releases them in as tenant names.
fn alternate(
    q: &mut FlowQueue,
    a: &'static str,
    b: &'static str,
    n: usize,
    now: Timestamp,
) -> String {
    let mut owner = HashMap::new();
    for _ in 0..n {
        owner.insert(held(q.enqueue(fair(a, 1), now)), a);
        owner.insert(held(q.enqueue(fair(b, 1), now)), b);
    }
    std::iter::from_fn(|| q.release(now))
        .map(|h| owner[&h.ticket])
        .collect::<Vec<_>>()
        .join(" ")
}

#[test]
fn requests_served_without_being_held_are_charged_to_their_tenant() {
    let mut q = FlowQueue::new(limits(1000, 60_000));
    // While nothing was held, "busy" was served four requests and "quiet" none.
    for _ in 0..4 {
        q.charge(fair("busy", 1), T0);
    }
    assert!(q.is_empty());
    assert!(q.depth_by_band().is_empty());
    // When the queue fills, "quiet" goes first until it has caught up.
    let order = alternate(&mut q, "busy", "quiet", 6, T0);
    assert_eq!(
        order,
        "quiet quiet quiet quiet busy quiet busy quiet busy busy busy busy"
    );
}

/// Enqueues one request per name of `tenants`, in order, then releases
/// everything: the tenants in release order ("busy" for those held before).
fn release_all(q: &mut FlowQueue, tenants: &[&'static str]) -> String {
    let mut owner = HashMap::new();
    for &t in tenants {
        owner.insert(held(q.enqueue(fair(t, 1), T0)), t);
    }
    std::iter::from_fn(|| q.release(T0))
        .map(|h| owner.get(&h.ticket).copied().unwrap_or("busy"))
        .collect::<Vec<_>>()
        .join(" ")
}

#[test]
fn service_charged_after_a_held_request_stays_charged_when_it_leaves() {
    // "busy" has two requests held here when the fleet's peers serve it four
    // more; then its second held request leaves (its client went away). Only
    // that request is refunded: the four stay charged, so "quiet" is served
    // five requests before "busy"'s next one.
    let mut q = FlowQueue::new(limits(1000, 60_000));
    let _first = held(q.enqueue(fair("busy", 1), T0));
    let second = held(q.enqueue(fair("busy", 1), T0));
    for _ in 0..4 {
        q.charge(fair("busy", 1), T0);
    }
    assert!(q.cancel(second));
    let order = release_all(
        &mut q,
        &["busy", "quiet", "quiet", "quiet", "quiet", "quiet", "quiet"],
    );
    assert_eq!(order, "busy quiet quiet quiet quiet quiet busy quiet");
}

#[test]
fn a_held_request_queued_behind_charged_service_moves_up_when_one_ahead_leaves() {
    // "busy": one request held, four served by peers, one more held behind
    // them. The first leaves: the second moves up by exactly that request
    // (it now finishes five requests in, not six).
    let mut q = FlowQueue::new(limits(1000, 60_000));
    let first = held(q.enqueue(fair("busy", 1), T0));
    for _ in 0..4 {
        q.charge(fair("busy", 1), T0);
    }
    let _behind = held(q.enqueue(fair("busy", 1), T0));
    assert!(q.cancel(first));
    let order = release_all(&mut q, &["quiet"; 5]);
    assert_eq!(order, "quiet quiet quiet quiet busy quiet");
}

#[test]
fn charges_to_ever_new_priorities_remember_a_bounded_number_of_bands() {
    // Nothing is ever held, so nothing else forgets: a client sending a new
    // priority value on every request must not grow the queue without bound.
    let mut q = FlowQueue::new(limits(1000, 60_000));
    let req = |priority| Request {
        priority,
        tenant: "t",
        fair_weight: Some(1),
        tokens: 100,
    };
    for p in 0..(MAX_REMEMBERED_BANDS as i64 * 4) {
        q.charge(req(p), T0);
    }
    assert_eq!(q.bands.len(), MAX_REMEMBERED_BANDS);
    // A band already remembered is still charged; a held request always gets
    // its band.
    q.charge(req(0), T0);
    held(q.enqueue(req(-1), T0));
    assert_eq!(q.bands.len(), MAX_REMEMBERED_BANDS + 1);
    // Once the remembered lanes age out, a new band is remembered again
    // (the idle ones forgotten on the way).
    let later = T0.plus(FAIRNESS_MEMORY);
    q.charge(req(-2), later);
    assert_eq!(q.bands.len(), 2, "the held request's band and the new one");
}

#[test]
fn a_tenant_that_emptied_its_lane_keeps_what_it_was_served() {
    let mut q = FlowQueue::new(limits(1000, 60_000));
    // "busy" alone: three held and released, the queue empties.
    for _ in 0..3 {
        held(q.enqueue(fair("busy", 1), T0));
    }
    while q.release(T0).is_some() {}
    assert!(q.is_empty());
    // The band kept its clock (the last release's start) and "busy"'s last
    // finish one request past it: a newcomer goes first. Forgetting the band
    // would have tied them, and "busy" enqueued first.
    let order = alternate(&mut q, "busy", "other", 3, T0);
    assert_eq!(order, "other busy other busy other busy");
}

#[test]
fn what_a_tenant_was_served_fades_by_half_each_half_life() {
    let mut q = FlowQueue::new(limits(1000, 60_000));
    for _ in 0..8 {
        q.charge(fair("busy", 1), T0);
    }
    // Two half-lives later a lead of eight requests counts as two.
    let later = T0.plus(FAIRNESS_HALF_LIFE * 2);
    let order = alternate(&mut q, "busy", "quiet", 4, later);
    assert_eq!(order, "quiet quiet busy quiet busy quiet busy busy");
}

#[test]
fn an_idle_lane_is_forgotten_after_the_fairness_memory() {
    let mut q = FlowQueue::new(limits(1000, 60_000));
    q.charge(fair("busy", 1), T0);
    let a = held(q.enqueue(fair("held", 1), T0));
    q.prune(T0.plus(FAIRNESS_MEMORY * 2));
    // A lane holding a request is kept whatever its age; the idle one goes.
    assert!(!q.is_forgotten());
    assert_eq!(q.release(T0).map(|h| h.ticket), Some(a));
    q.prune(T0.plus(FAIRNESS_MEMORY / 2));
    assert!(!q.is_forgotten(), "remembered for the fairness memory");
    q.prune(T0.plus(FAIRNESS_MEMORY));
    assert!(q.is_forgotten());
}

#[test]
fn timeout_sheds_only_the_overdue() {
    let mut q = FlowQueue::new(limits(10, 100));
    let a = held(q.enqueue(fifo(0), T0));
    let b = held(q.enqueue(fifo(9), T0.plus(Duration::from_millis(50))));
    assert_eq!(q.next_deadline(), Some(T0.plus(Duration::from_millis(100))));
    assert!(q.expire(T0.plus(Duration::from_millis(99))).is_empty());
    assert_eq!(q.expire(T0.plus(Duration::from_millis(100))), vec![a]);
    assert!(!q.contains(a));
    assert!(q.contains(b));
    assert_eq!(q.len(), 1);
    assert_eq!(q.expire(T0.plus(Duration::from_secs(1))), vec![b]);
    assert!(q.is_empty());
    assert_eq!(q.next_deadline(), None);
}

#[test]
fn full_queue_sheds_a_newcomer_no_higher_than_the_lowest() {
    let mut q = FlowQueue::new(limits(2, 1000));
    held(q.enqueue(fifo(1), T0));
    held(q.enqueue(fifo(2), T0));
    assert_eq!(q.enqueue(fifo(1), T0), Admission::Shed);
    assert_eq!(q.enqueue(fifo(0), T0), Admission::Shed);
    assert_eq!(q.len(), 2);
}

#[test]
fn full_queue_evicts_the_newest_of_the_lowest_band_for_a_higher_newcomer() {
    let mut q = FlowQueue::new(limits(3, 1000));
    let old_low = held(q.enqueue(fifo(0), T0));
    let new_low = held(q.enqueue(fifo(0), T0));
    let mid = held(q.enqueue(fifo(1), T0));
    let hi = match q.enqueue(fifo(5), T0) {
        Admission::HeldEvicting { held, evicted } => {
            assert_eq!(evicted, new_low);
            held
        }
        other => panic!("expected an eviction, got {other:?}"),
    };
    assert!(!q.contains(new_low));
    assert_eq!(q.len(), 3);
    assert_eq!(q.depth_by_band(), vec![(5, 1), (1, 1), (0, 1)]);
    let order: Vec<Ticket> = std::iter::from_fn(|| q.release(T0).map(|h| h.ticket)).collect();
    assert_eq!(order, vec![hi, mid, old_low]);
}

#[test]
fn eviction_picks_newest_across_fair_lanes() {
    let mut q = FlowQueue::new(limits(2, 1000));
    let r = |tenant| Request {
        priority: 0,
        tenant,
        fair_weight: Some(1),
        tokens: 10,
    };
    let first = held(q.enqueue(r("a"), T0));
    let newest = held(q.enqueue(r("b"), T0));
    match q.enqueue(fifo(1), T0) {
        Admission::HeldEvicting { evicted, .. } => assert_eq!(evicted, newest),
        other => panic!("expected an eviction, got {other:?}"),
    }
    assert!(q.contains(first));
}

#[test]
fn cancel_leaves_at_once_and_only_once() {
    let mut q = FlowQueue::new(limits(10, 1000));
    let a = held(q.enqueue(fifo(0), T0));
    let b = held(q.enqueue(fifo(0), T0));
    assert!(q.cancel(a));
    assert!(!q.cancel(a));
    assert_eq!(q.len(), 1);
    assert_eq!(q.depth_by_band(), vec![(0, 1)]);
    assert_eq!(q.release(T0).unwrap().ticket, b);
    assert!(!q.cancel(b));
    assert!(q.depth_by_band().is_empty());
    // A cancelled request no longer times out.
    assert!(q.expire(T0.plus(Duration::from_secs(10))).is_empty());
}

#[test]
fn retry_after_is_one_queue_wait_rounded_up() {
    assert_eq!(limits(1, 100).retry_after_secs(), 1);
    assert_eq!(limits(1, 2500).retry_after_secs(), 3);
    assert_eq!(ShedReason::QueueFull.as_str(), "queue-full");
    assert_eq!(ShedReason::QueueTimeout.as_str(), "queue-timeout");
    assert_eq!(ShedReason::Priority.as_str(), "priority");
}

#[derive(Clone, Debug)]
enum Op {
    Enqueue {
        priority: i64,
        tenant: u8,
        fair: bool,
        tokens: u64,
    },
    Release,
    Pass(u8),
    PeerRelease(u8),
    Cancel(usize),
    Advance(u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (-2i64..3, 0u8..3, any::<bool>(), 1u64..2000).prop_map(
            |(priority, tenant, fair, tokens)| {
                Op::Enqueue {
                    priority,
                    tenant,
                    fair,
                    tokens,
                }
            }
        ),
        Just(Op::Release),
        (0u8..3).prop_map(Op::Pass),
        (0u8..3).prop_map(Op::PeerRelease),
        (0usize..64).prop_map(Op::Cancel),
        (0u64..300).prop_map(Op::Advance),
    ]
}

proptest! {
    /// Whatever happens: the queue never exceeds its bound, its depth metric adds
    /// up, a release is always from the highest band held and is what `peek` said,
    /// and every ticket ends exactly once (released, cancelled, expired or shed).
    #[test]
    fn invariants_hold_under_any_sequence(ops in proptest::collection::vec(op(), 1..200)) {
        let names = ["a", "b", "c"];
        let mut q = FlowQueue::new(limits(8, 500));
        let mut now = T0;
        let mut live: Vec<(Ticket, i64)> = Vec::new();
        let mut last_peer_release: Option<Timestamp> = None;
        for op in ops {
            match op {
                Op::Enqueue { priority, tenant, fair, tokens } => {
                    let req = Request {
                        priority,
                        tenant: names[tenant as usize],
                        fair_weight: fair.then_some(u32::from(tenant) + 1),
                        tokens,
                    };
                    match q.enqueue(req, now) {
                        Admission::Held(t) => live.push((t, priority)),
                        Admission::HeldEvicting { held, evicted } => {
                            let pos = live.iter().position(|(t, _)| *t == evicted);
                            prop_assert!(pos.is_some());
                            let (_, p) = live.remove(pos.unwrap_or(0));
                            prop_assert!(live.iter().all(|(_, q)| *q >= p));
                            prop_assert!(p < priority);
                            live.push((held, priority));
                        }
                        Admission::ShedExpectedTimeout { ahead, released } => {
                            prop_assert!(ahead >= released);
                            prop_assert!(released >= MIN_RELEASES_TO_FORESEE);
                            prop_assert!(ahead <= live.len());
                        }
                        Admission::Shed => {
                            prop_assert_eq!(q.len(), 8);
                            prop_assert!(live.iter().all(|(_, p)| *p >= priority));
                        }
                    }
                }
                Op::Release => match (q.peek(), q.release(now)) {
                    (peeked, Some(h)) => {
                        prop_assert_eq!(peeked, Some(h.ticket));
                        let top = live.iter().map(|(_, p)| *p).max();
                        prop_assert_eq!(Some(h.priority), top);
                        let pos = live.iter().position(|(t, _)| *t == h.ticket);
                        prop_assert!(pos.is_some());
                        live.remove(pos.unwrap_or(0));
                    }
                    (peeked, None) => {
                        prop_assert!(live.is_empty());
                        prop_assert_eq!(peeked, None);
                    }
                },
                Op::Pass(tenant) => q.charge(
                    Request {
                        priority: 0,
                        tenant: names[tenant as usize],
                        fair_weight: Some(1),
                        tokens: 100,
                    },
                    now,
                ),
                Op::PeerRelease(tenant) => {
                    q.charge_peer_release(
                        Request {
                            priority: 0,
                            tenant: names[tenant as usize],
                            fair_weight: Some(u32::from(tenant) + 1),
                            tokens: 100,
                        },
                        now,
                    );
                    last_peer_release = Some(now);
                }
                Op::Cancel(i) => {
                    if !live.is_empty() {
                        let (t, _) = live.remove(i % live.len());
                        prop_assert!(q.cancel(t));
                    }
                }
                Op::Advance(ms) => {
                    now = now.plus(Duration::from_millis(ms));
                    for t in q.expire(now) {
                        let pos = live.iter().position(|(x, _)| *x == t);
                        prop_assert!(pos.is_some());
                        live.remove(pos.unwrap_or(0));
                    }
                }
            }
            // Room is left to a peer only within a window of its last held
            // release, and only while something is held here.
            if q.yields_to_peer(now) {
                prop_assert!(!live.is_empty());
                prop_assert!(last_peer_release.is_some_and(|t| now.since(t) < PEER_BACKLOG_WINDOW));
            }
            prop_assert!(q.len() <= 8);
            prop_assert_eq!(q.len(), live.len());
            let depth: usize = q.depth_by_band().iter().map(|(_, n)| n).sum();
            prop_assert_eq!(depth, live.len());
        }
    }
}

#[test]
fn under_overload_with_timeouts_weights_hold_and_a_light_tenant_is_served() {
    // Releases at a fixed pace; requests time out after 14 releases. Two
    // tenants of weights 1 and 3 each offered 1.15 requests per release share
    // the releases 1:3; a tenant of weight 1 offered 0.1 per release beside a
    // flood of 2 per release is served all it asks.
    let run = |streams: &[(&'static str, u32, f64)]| {
        let mut q = FlowQueue::new(limits(100_000, 14));
        let mut owner = HashMap::new();
        let mut served: HashMap<&str, u64> = HashMap::new();
        let mut offered: HashMap<&str, u64> = HashMap::new();
        let mut shed_on_arrival: HashMap<&str, u64> = HashMap::new();
        let mut acc = vec![0.0; streams.len()];
        for tick in 0..20_000u64 {
            let now = Timestamp(T0.0 + tick * 1_000_000);
            for (k, &(tenant, weight, rate)) in streams.iter().enumerate() {
                acc[k] += rate;
                while acc[k] >= 1.0 {
                    acc[k] -= 1.0;
                    let admission = q.enqueue(
                        Request {
                            priority: 0,
                            tenant,
                            fair_weight: Some(weight),
                            tokens: 2176,
                        },
                        now,
                    );
                    *offered.entry(tenant).or_default() += 1;
                    // The flood's excess is shed on arrival, not after its wait.
                    if let Admission::ShedExpectedTimeout { .. } = admission {
                        *shed_on_arrival.entry(tenant).or_default() += 1;
                        continue;
                    }
                    owner.insert(held(admission), tenant);
                }
            }
            q.expire(now);
            if let Some(h) = q.release(now) {
                *served.entry(owner[&h.ticket]).or_default() += 1;
            }
        }
        (served, offered, shed_on_arrival)
    };
    let (served, _, shed) = run(&[("light", 1, 1.15), ("heavy", 3, 1.15)]);
    let ratio = served["heavy"] as f64 / served["light"] as f64;
    assert!((2.9..=3.1).contains(&ratio), "{served:?}");
    // Most of the excess hears its 429 on arrival: over 2,300 requests of each
    // tenant are not served.
    assert!(shed.values().sum::<u64>() > 2_000, "{shed:?}");
    let (served, offered, shed) = run(&[("victim", 1, 0.1), ("flood", 1, 2.0)]);
    assert!(
        served["victim"] >= offered["victim"] - 1,
        "{served:?} of {offered:?}"
    );
    assert!(!shed.contains_key("victim"), "{shed:?}");
    assert!(shed["flood"] > 10_000, "{shed:?}");
}

/// A queue under a `wait_ms` maxQueueWait holding `n` requests of priority 0
/// (FIFO lane) from T0, then `releases` of them released one every 10 ms
/// (100 a second). Returns the queue and the time 5 ms after the last release.
fn draining(n: usize, releases: usize, wait_ms: u64) -> (FlowQueue, Timestamp) {
    let mut q = FlowQueue::new(limits(10_000, wait_ms));
    for _ in 0..n {
        held(q.enqueue(fifo(0), T0));
    }
    let mut now = T0;
    for _ in 0..releases {
        now = now.plus(Duration::from_millis(10));
        assert!(q.release(now).is_some());
    }
    (q, now.plus(Duration::from_millis(5)))
}

fn foreseen(a: Admission) -> (usize, usize) {
    match a {
        Admission::ShedExpectedTimeout { ahead, released } => (ahead, released),
        other => panic!("expected a shed on arrival, got {other:?}"),
    }
}

#[test]
fn a_request_with_more_ahead_than_one_wait_releases_is_shed_on_arrival() {
    // 100 ms wait, 100 releases a second: 10 released in the last wait.
    let (mut q, now) = draining(29, 20, 100);
    assert_eq!(q.len(), 9);
    // With 9 ahead a newcomer is held ...
    held(q.enqueue(fifo(0), now));
    // ... with 10 ahead it would need 11 releases within its wait: shed, and
    // nothing changes.
    let depth = q.depth_by_band();
    assert_eq!(foreseen(q.enqueue(fifo(0), now)), (10, 10));
    assert_eq!(q.len(), 10);
    assert_eq!(q.depth_by_band(), depth);
    // A tenant whose policy waits 200 ms counts the 20 released in 200 ms.
    q.set_limits(limits(10_000, 200));
    held(q.enqueue(fifo(0), now));
}

#[test]
fn only_what_would_be_released_first_counts_ahead() {
    let (mut q, now) = draining(200, 20, 100);
    // A higher band has nothing ahead of it; a lower one everything.
    assert_eq!(q.foresees_timeout(&fifo(1), now), None);
    held(q.enqueue(fifo(1), now));
    assert_eq!(foreseen(q.enqueue(fifo(-1), now)), (181, 10));
    // Under fair queuing a tenant under its share goes before a flood's
    // backlog: the flood's newcomer is shed, another tenant's is held.
    let mut q = FlowQueue::new(limits(10_000, 100));
    for _ in 0..200 {
        held(q.enqueue(fair("flood", 1), T0));
    }
    let mut now = T0;
    for _ in 0..20 {
        now = now.plus(Duration::from_millis(10));
        assert!(q.release(now).is_some());
    }
    assert_eq!(foreseen(q.enqueue(fair("flood", 1), now)), (180, 11));
    // The band clock is at the last released request's start: a newcomer
    // of an idle tenant finishes before the flood's next one.
    assert_eq!(q.foresees_timeout(&fair("quiet", 1), now), None);
    let quiet = held(q.enqueue(fair("quiet", 1), now));
    assert_eq!(q.peek(), Some(quiet));
}

#[test]
fn without_a_pace_shown_over_a_whole_wait_nothing_is_shed_on_arrival() {
    // Backlogged for less than one wait (95 ms of 100): no foresight yet.
    let (mut q, now) = draining(200, 9, 100);
    assert!(now.since(T0) < Duration::from_millis(100));
    assert_eq!(q.foresees_timeout(&fifo(0), now), None);
    held(q.enqueue(fifo(0), now));
    // A stall: fewer than MIN_RELEASES_TO_FORESEE in the last wait. The old
    // pace is not trusted; newcomers are held (and time out if it goes on).
    let (mut q, now) = draining(200, 20, 100);
    assert!(matches!(
        q.enqueue(fifo(0), now),
        Admission::ShedExpectedTimeout { .. }
    ));
    let stalled = now.plus(Duration::from_millis(70));
    assert_eq!(q.foresees_timeout(&fifo(0), stalled), None);
    held(q.enqueue(fifo(0), stalled));
    // A queue that emptied starts again: its new backlog is younger than a wait.
    let (mut q, now) = draining(20, 20, 100);
    assert!(q.is_empty());
    for _ in 0..50 {
        held(q.enqueue(fifo(0), now));
    }
}

#[test]
fn a_queue_yields_to_a_tenant_a_peer_holds_by_its_weight() {
    // "light" (weight 1, 100-token requests) is held here; "heavy" (weight 3,
    // 70-token requests: no tags tie) only at a peer, which releases one of
    // its requests whenever this queue yields. Alone, this queue would release
    // "light" every time; across both queues the tokens go 3:1.
    let heavy = Request {
        tokens: 70,
        ..fair("heavy", 3)
    };
    let mut q = FlowQueue::new(limits(1000, 60_000));
    for _ in 0..40 {
        held(q.enqueue(fair("light", 1), T0));
    }
    q.charge_peer_release(heavy, T0);
    let (mut light_tokens, mut heavy_tokens) = (0u64, 70u64);
    while light_tokens < 2000 {
        if q.yields_to_peer(T0) {
            q.charge_peer_release(heavy, T0);
            heavy_tokens += 70;
        } else {
            assert!(q.release(T0).is_some());
            light_tokens += 100;
        }
    }
    let share = heavy_tokens as f64 / light_tokens as f64;
    assert!(
        (2.9..=3.1).contains(&share),
        "{heavy_tokens} : {light_tokens}"
    );
}

#[test]
fn a_peer_is_taken_to_hold_its_tenant_for_one_window_after_its_release() {
    let mut q = FlowQueue::new(limits(1000, 60_000));
    let light = held(q.enqueue(fair("light", 1), T0));
    q.charge_peer_release(fair("heavy", 3), T0);
    assert!(q.yields_to_peer(T0));
    let almost = T0.plus(PEER_BACKLOG_WINDOW - Duration::from_millis(1));
    assert!(q.yields_to_peer(almost));
    assert!(!q.yields_to_peer(T0.plus(PEER_BACKLOG_WINDOW)));
    // Releasing is the caller's call: the queue itself never withholds.
    assert_eq!(q.release(T0).map(|h| h.ticket), Some(light));
}

#[test]
fn a_peer_route_that_was_not_held_is_charged_but_not_yielded_to() {
    let mut q = FlowQueue::new(limits(1000, 60_000));
    let light = held(q.enqueue(fair("light", 1), T0));
    q.charge(fair("heavy", 3), T0);
    assert!(!q.yields_to_peer(T0));
    assert_eq!(q.release(T0).map(|h| h.ticket), Some(light));
}

#[test]
fn a_tenant_held_here_too_competes_by_its_own_requests() {
    // "heavy" is held at the peer and here: its own head here stands for it,
    // and the queue releases by the heads' tags as always. Once it has none
    // here, the peer's backlog stands for it again (70-token requests: its
    // next one at the peer finishes clearly before "light"'s head).
    let heavy_req = Request {
        tokens: 70,
        ..fair("heavy", 3)
    };
    let mut q = FlowQueue::new(limits(1000, 60_000));
    let light = held(q.enqueue(fair("light", 1), T0));
    q.charge_peer_release(heavy_req, T0);
    let heavy = held(q.enqueue(heavy_req, T0));
    assert!(!q.yields_to_peer(T0));
    assert_eq!(q.release(T0).map(|h| h.ticket), Some(heavy));
    assert!(q.yields_to_peer(T0));
    assert_eq!(q.release(T0).map(|h| h.ticket), Some(light));
}

#[test]
fn a_peer_held_tenant_in_a_lower_band_is_not_yielded_to() {
    let mut q = FlowQueue::new(limits(1000, 60_000));
    let light = held(q.enqueue(fair("light", 1), T0));
    q.charge_peer_release(
        Request {
            priority: -1,
            ..fair("heavy", 3)
        },
        T0,
    );
    assert!(!q.yields_to_peer(T0));
    assert_eq!(q.release(T0).map(|h| h.ticket), Some(light));
}

#[test]
fn a_peer_release_of_a_tenant_without_fairness_is_charged_but_marks_nothing() {
    let mut q = FlowQueue::new(limits(1000, 60_000));
    let light = held(q.enqueue(fair("light", 1), T0));
    q.charge_peer_release(fifo(0), T0);
    assert!(!q.yields_to_peer(T0));
    assert_eq!(q.release(T0).map(|h| h.ticket), Some(light));
}
