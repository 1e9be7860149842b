use super::*;

#[test]
fn the_cached_oldest_registration_answers_as_every_replica_would() {
    let mut table = ReplicaTable::default();
    let mut lives = Vec::new();
    for (id, at) in [("a", 100), ("b", 300)] {
        let mut r = ReplicaSlot::new(id);
        r.registered = Some(Arc::from("10.0.0.1:8000"));
        r.live.registered_at.store(at, Ordering::Relaxed);
        lives.push(r.live.clone());
        table.insert(r, 0);
    }
    table.seal();
    let everyone = table.everyone.as_ref().expect("sealed");
    let direct = |now: u64, ttl: u64| {
        lives
            .iter()
            .all(|l| now.saturating_sub(l.registered_at.load(Ordering::Relaxed)) <= ttl)
    };
    let ttl = 1_000;
    for (now, refresh) in [(50, None), (1_050, None), (1_101, None), (1_101, Some(900))]
        .into_iter()
        .chain([
            (1_200, None),
            (1_301, None),
            (1_900, Some(1_400)),
            (2_301, None),
        ])
    {
        if let Some(at) = refresh {
            lives[0].registered_at.fetch_max(at, Ordering::Relaxed);
        }
        assert_eq!(everyone.all_serving(now, ttl), direct(now, ttl), "at {now}");
    }
}
