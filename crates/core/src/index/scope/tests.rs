use super::*;
use crate::index::shard::{SCAN_CHUNK, SWEEP_BATCH};
use crate::index::store::Cursor;
use crate::scope::ScopeRef;

fn spread_chain(n: u64, salt: u64) -> Vec<u64> {
    (1..=n)
        .map(|i: u64| (i ^ salt << 20).wrapping_mul(0x9e37_79b9_7f4a_7c15))
        .collect()
}

/// How far `chain` walks through the shards a lookup reads, held by `slot`.
fn walked(scope: &ScopeIndex, chain: &[u64], slot: u32) -> usize {
    let store = scope.chain_shard(chain).read();
    let orphans = scope.has_orphans().then(|| scope.shards[ORPHANS].read());
    let mut n = 0;
    walk_either(&store, orphans.as_deref(), chain, |i, e| {
        n = i + 1;
        e.holders().contains(slot)
    });
    n
}

#[test]
fn a_run_before_its_parent_waits_in_the_orphan_shard_and_counts_once() {
    let scope = ScopeIndex::new(ScopeRef::new("t", "m", "s").to_owned());
    let (a, b) = (ReplicaLive::default(), ReplicaLive::default());
    let chain = spread_chain(6, 1);
    // Blocks 3.. first, their parent unknown: the orphan shard.
    assert_eq!(
        scope.insert_blocks(0, &a, Some(chain[2]), &chain[3..], |_| 1),
        3
    );
    assert_eq!(scope.orphan_entries.load(Ordering::Relaxed), 3);
    assert_eq!(walked(&scope, &chain, 0), 0, "no block 0 yet");
    // The chain's start: its root's shard. Lookups read both: the whole chain.
    assert_eq!(scope.insert_blocks(0, &a, None, &chain[..3], |_| 1), 3);
    assert_eq!(
        scope.chain_shard(&chain).read().walk(&chain, |_, _| true),
        3
    );
    assert_eq!(walked(&scope, &chain, 0), 6);
    // Another replica stores the whole chain from its root: the blocks stay
    // where they are, one entry each.
    assert_eq!(scope.insert_blocks(1, &b, None, &chain, |_| 1), 0);
    assert_eq!(scope.entries(), 6);
    assert_eq!(scope.orphan_entries.load(Ordering::Relaxed), 3);
    assert_eq!(walked(&scope, &chain, 1), 6);
    // Removals find them there; once the orphan shard is empty lookups read
    // their chain's shard alone.
    assert_eq!(scope.remove_blocks(0, &a, &chain[3..]), 0);
    assert_eq!(scope.remove_blocks(1, &b, &chain), 3);
    assert!(!scope.has_orphans());
    assert_eq!(walked(&scope, &chain, 0), 3);
    assert_eq!(
        (scope.entries(), a.prefix_count(), b.prefix_count()),
        (3, 3, 0)
    );
}

#[test]
fn a_lower_tier_copy_after_its_gpu_removal_goes_back_to_its_chains_shard() {
    let scope = ScopeIndex::new(ScopeRef::new("t", "m", "s").to_owned());
    let live = ReplicaLive::default();
    let chain = spread_chain(4, 2);
    scope.insert_blocks(0, &live, None, &chain, |_| 1);
    // vLLM: BlockRemoved (GPU) for the tail, then BlockStored (CPU), no parent.
    assert_eq!(scope.remove_blocks(0, &live, &chain[2..]), 2);
    let cpu = tier_slot(0, Tier::Cpu);
    let tier_live = ReplicaLive::default();
    assert_eq!(
        scope.insert_blocks(cpu, &tier_live, None, &chain[2..], |_| 2),
        2
    );
    assert!(!scope.has_orphans());
    assert_eq!(
        walked(&scope, &chain, 0),
        3,
        "GPU 0..2, then block 2 on CPU only"
    );
    assert_eq!(walked(&scope, &chain[..2], 0), 2);
    let store = scope.chain_shard(&chain).read();
    assert!(chain.iter().all(|&h| store.block(h).is_some()));
}

#[test]
fn a_lookup_reads_only_its_chains_shard() {
    let scope = ScopeIndex::new(ScopeRef::new("t", "m", "s").to_owned());
    let (slot, live) = scope.resolve_replica("r0", "10.0.0.1:8000", 1, Touch::Event);
    let chain = spread_chain(8, 3);
    scope.insert_blocks(slot, &live, None, &chain, |_| 1);
    let serving = scope.serving(1, 100, &[]);
    // Writers hold every other shard: the lookup does not wait for them.
    let home = shard_of_root(chain[0]);
    let _held: Vec<_> = (0..=SHARDS)
        .filter(|&s| s != home)
        .map(|s| scope.shards[s].write())
        .collect();
    let deadline = Instant::now() + std::time::Duration::from_millis(50);
    let mut runs = [0u32; 1];
    let got = scope.match_chain(&chain, &serving, 1, 100, Some(deadline), &mut runs);
    assert_eq!((got, runs), (Ok(()), [8]));
}

#[test]
fn a_lookup_walks_on_through_the_orphan_shard_and_back() {
    let scope = ScopeIndex::new(ScopeRef::new("t", "m", "s").to_owned());
    let (a, live_a) = scope.resolve_replica("a", "10.0.0.1:8000", 1, Touch::Event);
    let (b, live_b) = scope.resolve_replica("b", "10.0.0.2:8000", 1, Touch::Event);
    let chain = spread_chain(8, 4);
    // Blocks 5 and 6 before their parent: orphans. Then the whole chain from
    // its root: 0..5 and 7 in the root's shard, 5 and 6 stay where they are.
    scope.insert_blocks(a, &live_a, Some(chain[4]), &chain[5..7], |_| 1);
    scope.insert_blocks(a, &live_a, None, &chain, |_| 1);
    scope.insert_blocks(b, &live_b, None, &chain[..3], |_| 1);
    assert_eq!(scope.orphan_entries(), 2);
    let store = scope.chain_shard(&chain).read();
    assert!(store.block(chain[5]).is_none() && store.block(chain[7]).is_some());
    drop(store);
    let serving = scope.serving(1, 100, &[]);
    for deadline in [
        None,
        Some(Instant::now() + std::time::Duration::from_secs(5)),
    ] {
        let mut runs = [0u32; 2];
        scope
            .match_chain(&chain, &serving, 1, 100, deadline, &mut runs)
            .unwrap();
        assert_eq!(runs, [8, 3]);
        let mut runs = [0u32; 2];
        scope
            .match_chain(&chain[..6], &serving, 1, 100, deadline, &mut runs)
            .unwrap();
        assert_eq!(runs, [6, 3]);
    }
}

#[test]
fn events_get_written_while_lookups_keep_waiting() {
    let scope = ScopeIndex::new(ScopeRef::new("t", "m", "s").to_owned());
    let live = ReplicaLive::default();
    let chain: Vec<u64> = (1..=70)
        .map(|i: u64| i.wrapping_mul(0x9e37_79b9_7f4a_7c15))
        .collect();
    // A lookup that keeps waiting: the writer finds no opening, queues, and
    // then writes whole batches; it gets through.
    scope.set_waiting(1);
    assert_eq!(scope.insert_blocks(0, &live, None, &chain, |_| 1), 70);
    scope.set_waiting(0);
    assert_eq!(live.prefix_count(), 70);
    let end = scope
        .chain_shard(&chain)
        .read()
        .walk(&chain, |_, e| e.holders().contains(0));
    assert_eq!(end, 70);
    scope.set_waiting(1);
    assert_eq!(scope.remove_blocks(0, &live, &chain[10..]), 60);
    scope.set_waiting(0);
    assert_eq!(live.prefix_count(), 10);
    assert_eq!(
        scope.chain_shard(&chain).read().walk(&chain, |_, _| true),
        10
    );
}

#[test]
fn sweeps_and_clears_finish_while_lookups_keep_waiting() {
    let scope = ScopeIndex::new(ScopeRef::new("t", "m", "s").to_owned());
    let (a, b) = (ReplicaLive::default(), ReplicaLive::default());
    // More keys than one batch: the removals take several holds.
    let n = 3 * SWEEP_BATCH as u64 + 5;
    let chain: Vec<u64> = (1..=n).map(|i| i << 20 | 3).collect();
    assert_eq!(scope.insert_blocks(0, &a, None, &chain, |_| 1), n);
    assert_eq!(scope.insert_blocks(1, &b, None, &chain[..10], |_| 1), 0);
    // A lookup that keeps waiting: each hold is queued for, then keeps its
    // whole batch (a hold taken in an opening would let go at once).
    scope.set_waiting(1);
    assert_eq!(scope.clear_replica(0, &a), n - 10);
    scope.set_waiting(0);
    assert_eq!(scope.entries(), 10);
    // The run the clear left at 10 of its slots is compacted before it ends.
    assert!(!scope.chain_shard(&chain).read().has_sparse());
    assert_eq!(
        scope
            .chain_shard(&chain)
            .read()
            .walk(&chain, |_, e| e.holders().contains(1)),
        10
    );
    scope.set_waiting(1);
    assert_eq!(scope.sweep_expired(100, 50), 10);
    scope.set_waiting(0);
    assert_eq!(scope.entries(), 0);
}

#[test]
fn planned_writes_handle_repeats_and_runs_emptied_or_thinned_mid_event() {
    let scope = ScopeIndex::new(ScopeRef::new("t", "m", "s").to_owned());
    let live = ReplicaLive::default();
    let chain: Vec<u64> = (1..=40).map(|i: u64| i << 20 | 7).collect();
    assert_eq!(scope.insert_blocks(0, &live, None, &chain, |_| 1), 40);
    // A hash named twice in one event: planned absent both times, stored once
    // with two references.
    let (a, b) = (1u64 << 50, 2u64 << 50);
    assert_eq!(scope.insert_blocks(1, &live, None, &[a, b, a], |_| 1), 2);
    assert_eq!(scope.remove_blocks(1, &live, &[a]), 0, "one reference left");
    // Removed twice in one event: the second finds it gone.
    assert_eq!(scope.remove_blocks(1, &live, &[a, a, b, b]), 2);
    assert!(!scope.contains(&EntryKey::Block(a)));
    // Thinning a run past the compaction line in one event, then further in
    // the same event: compacted once at the end, the rest still walkable.
    assert_eq!(scope.remove_blocks(0, &live, &chain[..35]), 35);
    {
        let store = scope.chain_shard(&chain).read();
        assert!(!store.has_sparse());
        assert_eq!(store.walk(&chain[35..], |_, e| e.holders().contains(0)), 5);
        assert_eq!(store.walk(&chain[34..], |_, _| true), 0);
    }
    // Emptying it frees it: nothing left to compact.
    assert_eq!(scope.remove_blocks(0, &live, &chain[35..]), 5);
    assert!(!scope.chain_shard(&chain).read().has_sparse());
    assert_eq!(scope.entries(), 0);
    assert_eq!(live.prefix_count(), 0);
}

#[test]
fn a_chunked_scan_visits_every_live_entry_once() {
    let scope = ScopeIndex::new(ScopeRef::new("t", "m", "s").to_owned());
    let live = ReplicaLive::default();
    let mut expected = std::collections::BTreeSet::new();
    // Runs of several lengths (some longer than a chunk), vacated slots, prefixes.
    for (run, len) in [
        (1u64, 3u64),
        (2, SCAN_CHUNK as u64 + 7),
        (3, 1),
        (4, 2 * SCAN_CHUNK as u64),
    ] {
        let chain: Vec<u64> = (0..len).map(|i| (run << 40) | i).collect();
        scope.insert_blocks(0, &live, None, &chain, |_| 1);
        expected.extend(chain.iter().map(|&h| format!("b{h}")));
    }
    let gone: Vec<u64> = (0..5).map(|i| (2 << 40) | i).collect();
    scope.remove_blocks(0, &live, &gone);
    for h in &gone {
        expected.remove(&format!("b{h}"));
    }
    for p in ["p1", "p2", "p3"] {
        scope.insert_one(0, &live, &EntryKey::Prefix(p.into()), None, 16, 1);
        expected.insert(format!("p{p}"));
    }
    let mut seen = Vec::new();
    scope.scan(|k, _| {
        seen.push(match k {
            EntryKeyRef::Block(h) => format!("b{h}"),
            EntryKeyRef::Prefix(p) => format!("p{p}"),
        })
    });
    assert_eq!(seen.len(), expected.len(), "no entry twice");
    assert_eq!(
        seen.into_iter().collect::<std::collections::BTreeSet<_>>(),
        expected
    );

    // One call visits at most its budget and says whether more remain: a
    // shard on its own, with runs of several lengths and vacated slots.
    let scope = ScopeIndex::new(ScopeRef::new("t", "m", "s").to_owned());
    let chain: Vec<u64> = (0..2 * SCAN_CHUNK as u64).map(|i| (9 << 40) | i).collect();
    scope.insert_blocks(0, &live, None, &chain, |_| 1);
    scope.insert_blocks(0, &live, Some(chain[9]), &[7 << 40, 8 << 40], |_| 1);
    scope.remove_blocks(0, &live, &chain[3..8]);
    // The chain less five removed, and the branch off block 9.
    let live_entries = 2 * SCAN_CHUNK - 5 + 2;
    let store = scope.chain_shard(&chain).read();
    let mut cursor = Cursor::default();
    let mut n = 0;
    assert!(store.visit(&mut cursor, 2, &mut |_, _| n += 1));
    assert_eq!(n, 2);
    let mut calls = 1;
    while store.visit(&mut cursor, 2, &mut |_, _| n += 1) {
        calls += 1;
    }
    assert_eq!(n, live_entries);
    assert!(
        calls > live_entries / 2,
        "budget counts slots, {calls} calls"
    );
}
