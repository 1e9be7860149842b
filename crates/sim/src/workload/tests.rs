use super::*;
use crate::engine::BatchCosts;

const FLEET: Fleet = Fleet {
    engines: 4,
    max_running: 4,
    prefill_us_per_token: 50.0,
    decode_us_per_token: 2000.0,
    batch: None,
    mixed: false,
};

fn schedule(w: &Workload, seed: u64) -> Vec<Request> {
    w.generate(seed, &FLEET, 0.85).requests
}

fn all() -> Vec<Workload> {
    Workload::NAMES
        .iter()
        .map(|n| Workload::default_of(n).unwrap())
        .collect()
}

#[test]
fn same_seed_same_schedule_other_seed_other_prompts() {
    for w in all() {
        let a = schedule(&w, 7);
        assert_eq!(a, schedule(&w, 7), "{}", w.name());
        let b = schedule(&w, 8);
        assert_ne!(a[0].prompt, b[0].prompt, "{}", w.name());
    }
}

#[test]
fn schedules_are_sorted_and_sized() {
    for w in all() {
        let s = schedule(&w, 1);
        assert!(s.windows(2).all(|p| p[0].at <= p[1].at), "{}", w.name());
        let expected = match &w {
            Workload::SharedPrefix {
                groups,
                prompts_per_group,
                ..
            } => groups * prompts_per_group,
            Workload::MultiTurn {
                sessions, turns, ..
            } => sessions * turns,
            Workload::Rag { requests, .. } => *requests,
            other => unreachable!("not a default workload: {}", other.name()),
        };
        assert_eq!(s.len(), expected as usize, "{}", w.name());
    }
}

#[test]
fn shared_prefix_groups_share_exactly_the_system_prompt() {
    let w = Workload::default_of("shared-prefix").unwrap();
    let s = schedule(&w, 3);
    let (a, b): (Vec<_>, Vec<_>) = s.iter().partition(|r| r.family == s[0].family);
    let (x, y) = (a[0], a[1]);
    assert_eq!(x.prompt[..2048], y.prompt[..2048]);
    assert_ne!(x.prompt[2048..], y.prompt[2048..]);
    assert_eq!(x.prompt.len(), 2048 + 128);
    // Another group's prompt differs from the first token on.
    assert_ne!(x.prompt[..16], b[0].prompt[..16]);
}

#[test]
fn multi_turn_prompts_extend_the_previous_turn() {
    let w = Workload::default_of("multi-turn").unwrap();
    let s = schedule(&w, 5);
    let session: Vec<_> = s.iter().filter(|r| r.family == 3).collect();
    assert_eq!(session.len(), 5);
    for pair in session.windows(2) {
        assert!(pair[1].prompt.starts_with(&pair[0].prompt));
        assert_eq!(pair[1].prompt.len(), pair[0].prompt.len() + 96 + 96);
        assert_eq!(pair[1].at - pair[0].at, Duration::from_millis(600));
    }
    // Every session starts with the shared system prompt.
    let other = s.iter().find(|r| r.family == 9).unwrap();
    assert_eq!(other.prompt[..256], session[0].prompt[..256]);
}

#[test]
fn rag_documents_are_zipf_popular() {
    let w = Workload::default_of("rag").unwrap();
    let s = schedule(&w, 11);
    let mut counts = vec![0u32; 48];
    for r in &s {
        counts[r.family as usize] += 1;
    }
    // With s = 1.1 over 48 documents the top one draws about a fifth.
    assert!(counts[0] > counts[10] * 3, "{counts:?}");
    assert!(counts[0] as usize > s.len() / 8, "{counts:?}");
}

#[test]
fn arrival_rate_is_the_load_times_the_no_cache_capacity() {
    let w = Workload::default_of("shared-prefix").unwrap();
    // 2176 prompt tokens × 50 µs + 32 × 2 ms = 172.8 ms per request; 16 slots.
    let capacity = 16.0 / 0.1728;
    let s = w.generate(2, &FLEET, 0.85);
    assert!((s.rate - 0.85 * capacity).abs() < 1e-6, "{}", s.rate);
    // 320 Poisson arrivals at ~78.7/s span about 4 s.
    let span = s.requests.last().unwrap().at.as_secs_f64();
    assert!((3.4..4.8).contains(&span), "{span}");
    // Twice the engines, twice the rate.
    let eight = Fleet {
        engines: 8,
        ..FLEET
    };
    assert!((w.generate(2, &eight, 0.85).rate - 2.0 * s.rate).abs() < 1e-6);
}

#[test]
fn scaling_multiplies_requests_not_prefixes() {
    let w = Workload::default_of("shared-prefix").unwrap().scaled(2);
    let s = schedule(&w, 4);
    assert_eq!(s.len(), 640);
    let groups: std::collections::HashSet<u32> = s.iter().map(|r| r.family).collect();
    assert_eq!(groups.len(), 32);
}

#[test]
fn unknown_workload_is_an_error() {
    let err = Workload::default_of("chat").unwrap_err().to_string();
    assert!(err.contains("shared-prefix"), "{err}");
}

#[test]
fn shrinking_keeps_at_least_one() {
    let w = Workload::default_of("rag").unwrap().shrunk(1000);
    assert_eq!(schedule(&w, 1).len(), 1);
}

const BATCHED: Fleet = Fleet {
    engines: 4,
    max_running: 256,
    prefill_us_per_token: 50.0,
    decode_us_per_token: 2000.0,
    batch: Some(BatchCosts::DEFAULT),
    mixed: false,
};

#[test]
fn burst_is_forty_requests_of_one_new_prompt_within_200_ms_at_the_midpoint() {
    let w = Workload::default_of("burst").unwrap();
    let s = w.generate(3, &BATCHED, 0.85);
    let (burst, steady): (Vec<&Request>, Vec<&Request>) =
        s.requests.iter().partition(|r| r.family == BURST_FAMILY);
    assert_eq!((burst.len(), steady.len()), (40, 160));
    // One new 1,600-token prompt, each with its own question, shared with no
    // steady request.
    let prefix = &burst[0].prompt[..1600];
    assert!(
        burst
            .iter()
            .all(|r| r.prompt.len() == 1616 && &r.prompt[..1600] == prefix)
    );
    assert!(steady.iter().all(|r| r.prompt[..16] != prefix[..16]));
    let first = burst.iter().map(|r| r.at).min().unwrap();
    let last = burst.iter().map(|r| r.at).max().unwrap();
    assert!(
        last - first < Duration::from_millis(200),
        "{:?}",
        last - first
    );
    let end = steady.iter().map(|r| r.at).max().unwrap();
    assert_eq!(first, end / 2);
    // The rate is the steady traffic's.
    let steady_only: Vec<Request> = steady.into_iter().cloned().collect();
    assert!((s.rate - 0.85 * BATCHED.capacity(&steady_only)).abs() < 1e-6);
}

fn per_stream(s: &[Request]) -> std::collections::BTreeMap<(u8, i32), Vec<&Request>> {
    let mut m = std::collections::BTreeMap::<(u8, i32), Vec<&Request>>::new();
    for r in s {
        m.entry((r.tenant, r.priority)).or_default().push(r);
    }
    m
}

#[test]
fn flood_sends_ten_times_the_victims_rate_and_leaves_its_stream_alone() {
    let flood = Workload::default_of("flood").unwrap();
    let alone = Workload::default_of("flood-alone").unwrap();
    assert_eq!((flood.tenants(), alone.tenants()), (2, 1));
    let s = flood.generate(5, &BATCHED, 1.0);
    let streams = per_stream(&s.requests);
    let victim = &streams[&(0, 0)];
    let flooder = &streams[&(1, 0)];
    assert_eq!((victim.len(), flooder.len()), (80, 800));
    // Both streams span about the same time: ten times the rate.
    let span = |v: &[&Request]| v.last().unwrap().at.as_secs_f64();
    let ratio = span(flooder) / span(victim);
    assert!((0.7..1.4).contains(&ratio), "{ratio}");
    let unit = BATCHED.capacity(&s.requests);
    assert!((s.rate - 5.5 * unit).abs() < 1e-6);
    // The victim's requests (prompts and arrivals) are the same without the flood.
    let base = alone.generate(5, &BATCHED, 1.0);
    assert!(base.requests.iter().all(|r| r.tenant == 0));
    let theirs: Vec<&Request> = base.requests.iter().collect();
    assert_eq!(*victim, theirs);
    // No prefix is shared across tenants.
    assert!(
        victim
            .iter()
            .all(|v| flooder.iter().all(|f| v.prompt[..64] != f.prompt[..64]))
    );
}

#[test]
fn flood_weights_and_priority_streams_are_what_they_claim() {
    let w = Workload::default_of("flood-weights").unwrap();
    assert_eq!(w.tenants(), 3);
    let s = w.generate(1, &BATCHED, 1.0);
    let streams = per_stream(&s.requests);
    assert_eq!(
        streams.keys().copied().collect::<Vec<_>>(),
        [(0, 0), (2, 0)]
    );
    assert_eq!((streams[&(0, 0)].len(), streams[&(2, 0)].len()), (160, 160));
    assert_eq!((TENANT_WEIGHTS[0], TENANT_WEIGHTS[2]), (1, 3));

    let p = Workload::default_of("flood-priority").unwrap();
    assert_eq!(p.tenants(), 1);
    let s = p.generate(1, &BATCHED, 1.0);
    let streams = per_stream(&s.requests);
    assert_eq!(
        streams.keys().copied().collect::<Vec<_>>(),
        [(0, 0), (0, 1)]
    );
    assert_eq!((streams[&(0, 0)].len(), streams[&(0, 1)].len()), (160, 160));
    // Two bands at the load each: twice the load in all.
    assert!((s.rate - 2.0 * BATCHED.capacity(&s.requests)).abs() < 1e-6);
    assert!(s.requests.windows(2).all(|p| p[0].at <= p[1].at));
}

#[test]
fn a_mixed_fleet_has_slow_prefill_and_half_slot_engines_and_less_capacity() {
    let mixed = Fleet {
        mixed: true,
        ..BATCHED
    };
    let b = BatchCosts::DEFAULT;
    for i in 0..4 {
        // The default fleet's engines are the configured ones, unchanged.
        assert_eq!(
            BATCHED.engine(i),
            EngineCosts {
                max_running: 256,
                prefill_us_per_token: 50.0,
                batch: Some(b)
            }
        );
    }
    let slow = mixed.engine(0);
    assert_eq!(slow.max_running, 256);
    assert_eq!(
        slow.batch.unwrap().prefill_us_per_token,
        2.0 * b.prefill_us_per_token
    );
    assert_eq!(mixed.engine(1), slow);
    let narrow = mixed.engine(3);
    assert_eq!(narrow.max_running, 128);
    assert_eq!(narrow.batch, Some(b));
    let w = Workload::default_of("mixed-fleet").unwrap();
    assert!(w.mixed_fleet() && !Workload::default_of("rag").unwrap().mixed_fleet());
    let s = w.generate(1, &BATCHED, 1.0).requests;
    assert!(mixed.capacity(&s) < BATCHED.capacity(&s));
    assert!(mixed.capacity(&s) > 0.6 * BATCHED.capacity(&s));
    // Same prompts as rag, so the same SLO.
    assert_eq!(mixed.solo_ttft_ms(&s), BATCHED.solo_ttft_ms(&s));
}
