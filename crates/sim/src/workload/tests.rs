use super::*;

const FLEET: Fleet = Fleet {
    engines: 4,
    max_running: 4,
    prefill_us_per_token: 50.0,
    decode_us_per_token: 2000.0,
    batch: None,
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
