use super::*;

fn chain(n: u64) -> Vec<u64> {
    (1..=n).map(|i| i * 0x9e37_79b9).collect()
}

fn store_chain(s: &mut Store, hashes: &[u64], holder: u32, parent: Option<u64>) {
    let mut prev = parent;
    for (i, &h) in hashes.iter().enumerate() {
        s.store_block(h, prev, holder, 1, hashes.len() - i);
        prev = Some(h);
    }
}

#[test]
fn a_stored_block_is_32_bytes_and_its_bucket_10() {
    assert_eq!(std::mem::size_of::<Slot>(), 28);
    assert_eq!(std::mem::size_of::<Bucket>(), 10);
}

#[test]
fn blocks_whose_tags_collide_stay_apart() {
    let mut s = Store::default();
    // Two blocks with the same 32-bit tag (a birthday search, ~2^16 tries).
    let mut seen = HashMap::new();
    let (a, b) = (1u64..)
        .find_map(|h| seen.insert(s.tag(h), h).map(|first| (first, h)))
        .unwrap();
    s.store_block(a, None, 0, 1, 1);
    assert_eq!(s.block(b).map(|_| ()), None, "a tag alone is no match");
    s.store_block(b, None, 1, 1, 1);
    let holders =
        |s: &Store, h| -> Vec<u32> { s.block(h).unwrap().holders.with(&s.lists).slots().collect() };
    assert_eq!(holders(&s, a), [0]);
    assert_eq!(holders(&s, b), [1]);
    // A removal plan names the first bucket with the tag: the same for both,
    // so one of the two releases must find its block by the exact lookup.
    let (pa, pb) = (s.plan_removal(a), s.plan_removal(b));
    assert_eq!(pa.bucket, pb.bucket);
    assert_eq!(s.release_planned(b, pb, 0), (Release::NotHeld, false));
    assert_eq!(s.release_planned(a, pa, 0), (Release::Released, true));
    assert!(s.block(a).is_none());
    assert_eq!(holders(&s, b), [1]);
    assert_eq!(s.release_planned(b, pb, 1), (Release::Released, true));
    assert_eq!(s.len(), 0);
}

#[test]
fn an_event_longer_than_a_run_continues_in_a_fresh_one() {
    let mut s = Store::default();
    let c = chain(RUN_SLOTS as u64 + 10);
    store_chain(&mut s, &c, 0, None);
    assert_eq!(s.runs.iter().flatten().count(), 2);
    assert_eq!(s.walk(&c, |_, _| true), c.len());
    for &h in &c[RUN_SLOTS - 5..] {
        s.take(&EntryKey::Block(h));
    }
    assert_eq!(s.walk(&c, |_, _| true), RUN_SLOTS - 5);
}

#[test]
fn walk_follows_runs_and_falls_back_to_the_table() {
    let mut s = Store::default();
    let c = chain(8);
    store_chain(&mut s, &c[..4], 0, None);
    // A second event continues the chain: appended to the same run.
    store_chain(&mut s, &c[4..], 0, Some(c[3]));
    assert_eq!(s.runs.iter().flatten().count(), 1);
    assert_eq!(s.walk(&c, |_, _| true), 8);
    // A hole in the middle stops the walk there.
    s.take(&EntryKey::Block(c[5]));
    assert_eq!(s.walk(&c, |_, _| true), 5);
    // Re-stored elsewhere (a new run), the walk finds it through the table.
    store_chain(&mut s, &c[5..6], 1, Some(c[4]));
    assert_eq!(s.walk(&c, |_, _| true), 8);
}

#[test]
fn runs_are_freed_and_compacted() {
    let mut s = Store::default();
    let c = chain(32);
    store_chain(&mut s, &c, 0, None);
    for &h in &c[..25] {
        s.take(&EntryKey::Block(h));
    }
    assert!(s.has_sparse());
    let _ = s.settle();
    assert!(!s.has_sparse());
    // Compacted: 7 live slots left, still walkable from block 25.
    assert_eq!(s.walk(&c[25..], |_, _| true), 7);
    let run_len: usize = s.runs.iter().flatten().map(|r| r.slots.len()).sum();
    assert!(run_len < 16, "{run_len}");
    for &h in &c[25..] {
        s.take(&EntryKey::Block(h));
    }
    assert_eq!(s.runs.iter().flatten().count(), 0);
    assert_eq!(s.len(), 0);
}
