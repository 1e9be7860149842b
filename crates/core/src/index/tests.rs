//! Tests of the index (docs/reference.md, "Scopes, replicas, entries" and "Eviction and quota"): victim order, TTL, quota, the cap
//! sweep, clears and replica removal, reference counts, malformed events and the
//! `/snapshot` view. `props` checks the same rules over random event sequences
//! against a naive model.
//!
//! Fixtures work on the index directly with one scope per tenant (llama, vLLM);
//! time is `s(n)`, n seconds after a fixed epoch, and every TTL is 10 minutes.

use std::collections::{BTreeMap, BTreeSet};

use super::store::{EntryKey, EntryKeyRef};
use super::*;
use crate::policy::EvictionAlgorithm::{self, Lfu, Lru};
use crate::scope::PROBE_TENANT;
use crate::time::Timestamp;

mod props;

// ----- fixtures -----

const MODEL: &str = "llama";
const VLLM: &str = "vllm-sha256-cbor";
const TTL: u64 = 600 * 1_000_000_000;

fn mk_index(cap: u64) -> Index {
    Index::new(IndexConfig { max_entries: cap })
}

fn limits(eviction: EvictionAlgorithm, quota: Option<u64>) -> TenantLimits {
    TenantLimits {
        ttl_nanos: TTL,
        eviction,
        max_entries: quota,
    }
}

const LRU: TenantLimits = TenantLimits {
    ttl_nanos: TTL,
    eviction: Lru,
    max_entries: None,
};

/// `n` seconds after the fixtures' epoch.
fn s(n: u64) -> Timestamp {
    Timestamp::from_secs(1_700_000_000 + n)
}

fn scope(tenant: &str) -> ScopeRef<'_> {
    ScopeRef::new(tenant, MODEL, VLLM)
}

fn stored(hashes: &[u64]) -> IndexEvent {
    IndexEvent::Stored {
        parent: None,
        hashes: hashes.to_vec(),
        token_counts: Vec::new(),
    }
}

fn removed(hashes: &[u64]) -> IndexEvent {
    IndexEvent::Removed {
        hashes: hashes.to_vec(),
    }
}

fn apply(
    ix: &Index,
    l: &TenantLimits,
    tenant: &str,
    replica: &str,
    events: &[IndexEvent],
    now: Timestamp,
) -> IngestOutcome {
    let endpoint = format!("{replica}.pods:8000");
    ix.ingest(
        &IngestBatch {
            scope: scope(tenant),
            replica_id: replica,
            endpoint: &endpoint,
            events,
        },
        l,
        now,
    )
    .expect("well-formed batch")
}

fn store(
    ix: &Index,
    l: &TenantLimits,
    tenant: &str,
    replica: &str,
    hashes: &[u64],
    now: Timestamp,
) {
    apply(ix, l, tenant, replica, &[stored(hashes)], now);
}

/// `[a]`, `[b]`, ... each in its own event, one second apart from `s(first)`.
fn store_each(ix: &Index, l: &TenantLimits, tenant: &str, hashes: &[u64], first: u64) {
    for (i, h) in hashes.iter().enumerate() {
        store(ix, l, tenant, "r1", &[*h], s(first + i as u64));
    }
}

/// Which of `hashes` the tenant's scope still holds.
fn survivors(ix: &Index, tenant: &str, hashes: &[u64]) -> Vec<u64> {
    let Some(sc) = ix.scope(scope(tenant)) else {
        return Vec::new();
    };
    hashes
        .iter()
        .copied()
        .filter(|h| sc.contains(&EntryKey::Block(*h)))
        .collect()
}

fn credit(ix: &Index, tenant: &str, hash: u64, times: usize) {
    let sc = ix.scope(scope(tenant)).expect("scope exists");
    for _ in 0..times {
        sc.credit_chain(&[hash]);
    }
}

fn view(ix: &Index, now: Timestamp) -> IndexView {
    ix.view(now, &|_| TTL)
}

fn prefix_count(ix: &Index, tenant: &str, replica: &str) -> Option<u64> {
    view(ix, s(0))
        .replicas
        .into_iter()
        .find(|r| r.tenant == tenant && r.replica_id == replica)
        .map(|r| r.prefix_count)
}

/// Every entry of the tenant's scope and the ids of the replicas holding it,
/// read from the shards themselves.
fn holdings(ix: &Index, tenant: &str) -> BTreeMap<String, BTreeSet<String>> {
    let mut out = BTreeMap::new();
    let Some(sc) = ix.scope(scope(tenant)) else {
        return out;
    };
    let table = sc.table();
    sc.scan(|key, e| {
        let name = match key {
            EntryKeyRef::Block(h) => format!("b{h}"),
            EntryKeyRef::Prefix(p) => format!("p:{p}"),
        };
        let ids = e
            .holders()
            .slots()
            .map(|slot| {
                table
                    .get(slot)
                    .map_or("?".to_string(), |r| r.id.to_string())
            })
            .collect();
        out.insert(name, ids);
    });
    out
}

// ----- victim order -----

#[test]
fn lru_cap_sweep_evicts_the_oldest_last_seen_first() {
    let ix = mk_index(3);
    store_each(&ix, &LRU, "a", &[1, 2, 3, 4], 1);
    ix.sweep_cap(&|_| Lru);
    assert_eq!(survivors(&ix, "a", &[1, 2, 3, 4]), [2, 3, 4]);
    store(&ix, &LRU, "a", "r1", &[5], s(5));
    ix.sweep_cap(&|_| Lru);
    assert_eq!(survivors(&ix, "a", &[1, 2, 3, 4, 5]), [3, 4, 5]);
    assert_eq!(ix.counters().evicted_cap, 2);
    assert_eq!(ix.total_entries(), 3);
}

#[test]
fn lru_ties_within_one_stored_event_evict_the_tail_first() {
    let ix = mk_index(2);
    store(&ix, &LRU, "a", "r1", &[1, 2, 3], s(1));
    ix.sweep_cap(&|_| Lru);
    // Same event time: the block extending the others goes first.
    assert_eq!(survivors(&ix, "a", &[1, 2, 3]), [1, 2]);
}

#[test]
fn lru_a_refreshed_entry_moves_behind_the_others() {
    let ix = mk_index(3);
    store_each(&ix, &LRU, "a", &[1, 2, 3, 4], 1);
    ix.sweep_cap(&|_| Lru);
    assert_eq!(survivors(&ix, "a", &[1, 2, 3, 4]), [2, 3, 4]);
    // 2, first in line, is stored again (by another replica); then 5 arrives and
    // one entry must go: 3 is now the oldest.
    store(&ix, &LRU, "a", "r2", &[2], s(5));
    store(&ix, &LRU, "a", "r1", &[5], s(6));
    ix.sweep_cap(&|_| Lru);
    assert_eq!(survivors(&ix, "a", &[1, 2, 3, 4, 5]), [2, 4, 5]);
}

#[test]
fn lru_cap_sweep_in_batches_evicts_exactly_the_oldest_across_shards() {
    // 300 one-block chains (their roots spread over every shard), a second apart.
    let hashes: Vec<u64> = (1..=300).collect();
    let ix = mk_index(200);
    store_each(&ix, &LRU, "a", &hashes, 1);
    ix.sweep_cap(&|_| Lru);
    assert_eq!(
        survivors(&ix, "a", &hashes),
        (101..=300).collect::<Vec<_>>()
    );
    assert_eq!(ix.counters().evicted_cap, 100);
    // The victim cache now holds the next oldest, 101.. . Refresh every third of
    // 101..=160 and store 60 new blocks: the 60 oldest of the rest go, the
    // refreshed ones stay although the cache listed them first.
    let refreshed: Vec<u64> = (101..=160).step_by(3).collect();
    for (i, h) in refreshed.iter().enumerate() {
        store(&ix, &LRU, "a", "r2", &[*h], s(400 + i as u64));
    }
    let fresh: Vec<u64> = (1001..=1060).collect();
    store_each(&ix, &LRU, "a", &fresh, 500);
    ix.sweep_cap(&|_| Lru);
    assert_eq!(ix.total_entries(), 200);
    assert_eq!(ix.counters().evicted_cap, 160);
    let kept: Vec<u64> = (101..=300)
        .filter(|h| refreshed.contains(h) || *h > 100 + 60 + refreshed.len() as u64)
        .chain(fresh.iter().copied())
        .collect();
    let all: Vec<u64> = hashes.iter().chain(fresh.iter()).copied().collect();
    assert_eq!(survivors(&ix, "a", &all), kept);
}

/// Four entries 1..=4 stored a second apart; 1 credited twice, 2 and 3 once.
fn credited_four(ix: &Index, l: &TenantLimits) {
    store_each(ix, l, "a", &[1, 2, 3, 4], 1);
    credit(ix, "a", 1, 2);
    credit(ix, "a", 2, 1);
    credit(ix, "a", 3, 1);
}

#[test]
fn lfu_quota_trim_evicts_the_lowest_access_count_ties_on_oldest_last_seen() {
    let ix = mk_index(u64::MAX);
    credited_four(&ix, &limits(Lfu, None));
    let trim = |quota| ix.sweep(&|_| limits(Lfu, Some(quota)), s(10));
    trim(3);
    assert_eq!(survivors(&ix, "a", &[1, 2, 3, 4]), [1, 2, 3]);
    trim(2);
    assert_eq!(survivors(&ix, "a", &[1, 2, 3, 4]), [1, 3]);
    trim(1);
    assert_eq!(survivors(&ix, "a", &[1, 2, 3, 4]), [1]);
    assert_eq!(ix.counters().evicted_quota, 3);
}

#[test]
fn lru_quota_trim_ignores_access_counts() {
    let ix = mk_index(u64::MAX);
    credited_four(&ix, &LRU);
    let trim = |quota| ix.sweep(&|_| limits(Lru, Some(quota)), s(10));
    trim(3);
    assert_eq!(survivors(&ix, "a", &[1, 2, 3, 4]), [2, 3, 4]);
    trim(2);
    assert_eq!(survivors(&ix, "a", &[1, 2, 3, 4]), [3, 4]);
    trim(1);
    assert_eq!(survivors(&ix, "a", &[1, 2, 3, 4]), [4]);
}

#[test]
fn lfu_cap_sweep_evicts_the_lowest_access_count_first() {
    let ix = mk_index(3);
    credited_four(&ix, &limits(Lfu, None));
    ix.sweep_cap(&|_| Lfu);
    assert_eq!(survivors(&ix, "a", &[1, 2, 3, 4]), [1, 2, 3]);
    // A new entry has no accesses: it precedes the credited entries already
    // lined up as victims.
    store(&ix, &limits(Lfu, None), "a", "r1", &[5], s(5));
    ix.sweep_cap(&|_| Lfu);
    assert_eq!(survivors(&ix, "a", &[1, 2, 3, 4, 5]), [1, 2, 3]);
}

#[test]
fn lfu_a_credit_after_victims_were_lined_up_is_respected() {
    let ix = mk_index(3);
    let l = limits(Lfu, None);
    store_each(&ix, &l, "a", &[1, 2, 3, 4], 1);
    ix.sweep_cap(&|_| Lfu);
    assert_eq!(survivors(&ix, "a", &[1, 2, 3, 4]), [2, 3, 4]);
    // 2 was next in line; two lookups credit it.
    credit(&ix, "a", 2, 2);
    store(&ix, &l, "a", "r1", &[5], s(5));
    ix.sweep_cap(&|_| Lfu);
    assert_eq!(survivors(&ix, "a", &[1, 2, 3, 4, 5]), [2, 4, 5]);
}

#[test]
fn lfu_quota_at_ingest_evicts_the_lowest_access_count() {
    let ix = mk_index(u64::MAX);
    let l = limits(Lfu, Some(4));
    credited_four(&ix, &l);
    credit(&ix, "a", 4, 3);
    // At quota: 2 (one access, older than 3) makes room for 5.
    store(&ix, &l, "a", "r1", &[5], s(5));
    assert_eq!(survivors(&ix, "a", &[1, 2, 3, 4, 5]), [1, 3, 4, 5]);
}

// ----- TTL -----

#[test]
fn ttl_sweep_is_independent_of_the_algorithm_and_access_counts() {
    for algo in [Lru, Lfu] {
        let ix = mk_index(u64::MAX);
        let l = limits(algo, None);
        store(&ix, &l, "a", "r1", &[1], s(0));
        credit(&ix, "a", 1, 100);
        store(&ix, &l, "a", "r1", &[2], s(500));
        ix.sweep(&|_| l, s(599));
        assert_eq!(survivors(&ix, "a", &[1, 2]), [1, 2], "{algo:?}");
        ix.sweep(&|_| l, s(700));
        assert_eq!(survivors(&ix, "a", &[1, 2]), [2], "{algo:?}");
        assert_eq!(ix.counters().evicted_ttl, 1);
        assert_eq!(ix.tenant_entries("a"), 1);
        assert_eq!(prefix_count(&ix, "a", "r1"), Some(1));
    }
}

#[test]
fn ttl_sweep_uses_each_tenants_own_ttl() {
    let ix = mk_index(u64::MAX);
    store(&ix, &LRU, "a", "r1", &[1], s(0));
    store(&ix, &LRU, "b", "r1", &[1], s(0));
    let short = TenantLimits {
        ttl_nanos: 60 * 1_000_000_000,
        ..LRU
    };
    ix.sweep(&|t| if t == "a" { short } else { LRU }, s(120));
    assert_eq!((ix.tenant_entries("a"), ix.tenant_entries("b")), (0, 1));
}

// ----- quota -----

#[test]
fn quota_is_never_exceeded_and_evicts_the_tenants_own_victims() {
    let ix = mk_index(u64::MAX);
    store(&ix, &LRU, "b", "r1", &[100, 101], s(0));
    let l = limits(Lru, Some(3));
    for (i, event) in [&[1][..], &[2], &[3], &[4, 5], &[6, 7, 8, 9]]
        .iter()
        .enumerate()
    {
        store(&ix, &l, "a", "r1", event, s(1 + i as u64));
        assert!(ix.tenant_entries("a") <= 3);
    }
    // A run longer than the quota keeps its leading blocks: within one event the
    // tail is the oldest, so it is the tenant's own next victim.
    assert_eq!(survivors(&ix, "a", &[1, 2, 3, 4, 5, 6, 7, 8, 9]), [6, 7, 8]);
    // The other tenant's older entries were never displaced.
    assert_eq!(survivors(&ix, "b", &[100, 101]), [100, 101]);
    assert_eq!(ix.counters().evicted_quota, 6);
    assert_eq!(ix.counters().refused_quota, 0);
}

#[test]
fn quota_counts_only_new_entries() {
    let ix = mk_index(u64::MAX);
    let l = limits(Lru, Some(2));
    store(&ix, &l, "a", "r1", &[1, 2], s(1));
    // Refreshing held entries, or a second holder, needs no room.
    store(&ix, &l, "a", "r1", &[1, 2], s(2));
    store(&ix, &l, "a", "r2", &[1, 2], s(3));
    assert_eq!(survivors(&ix, "a", &[1, 2]), [1, 2]);
    assert_eq!(ix.counters().evicted_quota, 0);
}

#[test]
fn quota_zero_keeps_nothing_and_counts_refusals() {
    let ix = mk_index(u64::MAX);
    let l = limits(Lru, Some(0));
    let prefix = IndexEvent::PrefixStored {
        prefix_hash: "p-sys".into(),
        token_count: 64,
    };
    let outcome = apply(&ix, &l, "a", "r1", &[stored(&[1, 2, 3]), prefix], s(1));
    assert_eq!(
        outcome,
        IngestOutcome {
            applied: 2,
            rejected: 0
        }
    );
    assert_eq!((ix.tenant_entries("a"), ix.total_entries()), (0, 0));
    assert_eq!(ix.counters().refused_quota, 4);
    assert_eq!(ix.counters().evicted_quota, 0);
    assert_eq!(prefix_count(&ix, "a", "r1"), Some(0));
}

#[test]
fn a_lowered_quota_is_trimmed_by_the_sweep() {
    let ix = mk_index(u64::MAX);
    store_each(&ix, &LRU, "a", &[1, 2, 3, 4, 5], 1);
    ix.sweep(&|_| limits(Lru, Some(2)), s(10));
    assert_eq!(survivors(&ix, "a", &[1, 2, 3, 4, 5]), [4, 5]);
    assert_eq!(ix.tenant_entries("a"), 2);
    assert_eq!(ix.counters().evicted_quota, 3);
    assert_eq!(prefix_count(&ix, "a", "r1"), Some(2));
}

// ----- cap sweep -----

#[test]
fn cap_sweep_evicts_from_the_largest_tenant_first() {
    let ix = mk_index(6);
    store(&ix, &LRU, "b", "r1", &[200, 201], s(0));
    store(&ix, &LRU, "c", "r1", &[300], s(1));
    store_each(&ix, &LRU, "a", &[1, 2, 3, 4, 5, 6], 2);
    ix.sweep_cap(&|_| Lru);
    // b and c hold older entries, but a is the largest.
    assert_eq!(survivors(&ix, "a", &[1, 2, 3, 4, 5, 6]), [4, 5, 6]);
    assert_eq!((ix.tenant_entries("b"), ix.tenant_entries("c")), (2, 1));
    assert_eq!(ix.counters().evicted_cap, 3);
}

#[test]
fn cap_sweep_takes_turns_between_tenants_of_equal_size() {
    let ix = mk_index(6);
    store(&ix, &LRU, "a", "r1", &[1, 2, 3, 4], s(0));
    store(&ix, &LRU, "b", "r1", &[11, 12, 13, 14], s(1));
    ix.sweep_cap(&|_| Lru);
    assert_eq!((ix.tenant_entries("a"), ix.tenant_entries("b")), (3, 3));
    assert_eq!(ix.total_entries(), 6);
}

#[test]
fn cap_sweep_uses_each_tenants_own_order() {
    let ix = mk_index(4);
    let l = limits(Lfu, None);
    store_each(&ix, &l, "a", &[1, 2, 3, 4], 1);
    credit(&ix, "a", 1, 1);
    store(&ix, &LRU, "b", "r1", &[10], s(0));
    ix.sweep_cap(&|t| if t == "a" { Lfu } else { Lru });
    assert_eq!(survivors(&ix, "a", &[1, 2, 3, 4]), [1, 3, 4]);
    assert_eq!(survivors(&ix, "b", &[10]), [10]);
}

// ----- clears, removals, reference counts -----

#[test]
fn all_blocks_cleared_drops_only_that_replicas_holdings() {
    let ix = mk_index(u64::MAX);
    store(&ix, &LRU, "a", "r1", &[1, 2, 3], s(1));
    store(&ix, &LRU, "a", "r1", &[2], s(2));
    store(&ix, &LRU, "a", "r2", &[2, 3, 4], s(3));
    apply(&ix, &LRU, "a", "r1", &[IndexEvent::Cleared], s(4));
    assert_eq!(survivors(&ix, "a", &[1, 2, 3, 4]), [2, 3, 4]);
    assert_eq!(prefix_count(&ix, "a", "r1"), Some(0));
    assert_eq!(prefix_count(&ix, "a", "r2"), Some(3));
    assert_eq!(ix.counters().dropped_cleared, 1);
    // r1's two references on 2 went with the clear: r2's one removal drops it.
    apply(&ix, &LRU, "a", "r2", &[removed(&[2])], s(5));
    assert_eq!(survivors(&ix, "a", &[1, 2, 3, 4]), [3, 4]);
    assert_eq!(ix.tenant_entries("a"), 2);
}

#[test]
fn declare_makes_replicas_serving_and_undeclaring_drops_their_entries() {
    let ix = mk_index(u64::MAX);
    let declared = |ids: &[&str]| -> Vec<(String, String)> {
        ids.iter()
            .map(|id| ((*id).to_string(), format!("10.0.0.{}:8000", id.len())))
            .collect()
    };
    ix.declare(scope("a"), &declared(&["d1", "d22"]), s(0));
    let engine = |replica: &str, hashes: &[u64]| {
        let batch = IngestBatch {
            scope: scope("a"),
            replica_id: replica,
            endpoint: "",
            events: &[stored(hashes)],
        };
        ix.ingest(&batch, &LRU, s(1)).expect("well-formed batch");
    };
    engine("d1", &[1, 2]);
    engine("d22", &[2, 3]);
    let rows = view(&ix, s(1)).replicas;
    let summary: Vec<_> = rows
        .iter()
        .map(|r| {
            (
                r.replica_id.as_str(),
                r.endpoint.as_deref(),
                r.serving,
                r.prefix_count,
            )
        })
        .collect();
    assert_eq!(
        summary,
        [
            ("d1", Some("10.0.0.2:8000"), true, 2),
            ("d22", Some("10.0.0.3:8000"), true, 2)
        ]
    );
    ix.declare(scope("a"), &declared(&["d22"]), s(2));
    assert_eq!(survivors(&ix, "a", &[1, 2, 3]), [2, 3]);
    assert_eq!(prefix_count(&ix, "a", "d1"), None);
    assert_eq!(prefix_count(&ix, "a", "d22"), Some(2));
    ix.declare(scope("a"), &[], s(3));
    assert_eq!(ix.tenant_entries("a"), 0);
    assert!(view(&ix, s(3)).replicas.is_empty());
    assert_eq!(ix.counters().dropped_cleared, 3);
    assert!(ix.declared_scopes().is_empty());
}

#[test]
fn remove_replica_drops_its_entries_once() {
    let ix = mk_index(u64::MAX);
    store(&ix, &LRU, "a", "r1", &[1, 2], s(1));
    store(&ix, &LRU, "a", "r2", &[2], s(2));
    assert!(ix.remove_replica(scope("a"), "r1", s(3)));
    assert_eq!(survivors(&ix, "a", &[1, 2]), [2]);
    assert_eq!(prefix_count(&ix, "a", "r1"), None);
    assert!(!ix.remove_replica(scope("a"), "r1", s(4)));
    assert!(!ix.remove_replica(scope("nobody"), "r2", s(4)));
    assert_eq!(ix.tenant_entries("a"), 1);
}

#[test]
fn duplicate_stores_and_removals_are_reference_counted() {
    let ix = mk_index(u64::MAX);
    store(&ix, &LRU, "a", "r1", &[1], s(1));
    store(&ix, &LRU, "a", "r1", &[1], s(2));
    store(&ix, &LRU, "a", "r2", &[1], s(3));
    let remove = |replica| apply(&ix, &LRU, "a", replica, &[removed(&[1])], s(4));
    remove("r1");
    assert_eq!(prefix_count(&ix, "a", "r1"), Some(1));
    remove("r1");
    assert_eq!(prefix_count(&ix, "a", "r1"), Some(0));
    assert_eq!(survivors(&ix, "a", &[1]), [1]);
    // A double removal changes nothing.
    remove("r1");
    assert_eq!(prefix_count(&ix, "a", "r1"), Some(0));
    assert_eq!(
        (ix.tenant_entries("a"), prefix_count(&ix, "a", "r2")),
        (1, Some(1))
    );
    remove("r2");
    assert_eq!((ix.tenant_entries("a"), ix.total_entries()), (0, 0));
    // Within one event too.
    store(&ix, &LRU, "a", "r1", &[7, 7], s(5));
    apply(&ix, &LRU, "a", "r1", &[removed(&[7])], s(6));
    assert_eq!(survivors(&ix, "a", &[7]), [7]);
    apply(&ix, &LRU, "a", "r1", &[removed(&[7])], s(7));
    assert!(survivors(&ix, "a", &[7]).is_empty());
}

#[test]
fn a_removal_releases_only_what_its_replica_holds_across_long_events() {
    let ix = mk_index(u64::MAX);
    // 150 blocks (past one 64-block plan batch) on r1; r2 holds the first 70
    // and, elsewhere in the scope, a chain of its own.
    let chain: Vec<u64> = (1..=150).collect();
    let own: Vec<u64> = (1_000..1_100).collect();
    store(&ix, &LRU, "a", "r1", &chain, s(1));
    store(&ix, &LRU, "a", "r2", &chain[..70], s(2));
    store(&ix, &LRU, "a", "r2", &own, s(3));
    assert_eq!(ix.tenant_entries("a"), 250);
    // r2 removes the whole chain, its own chain's middle and blocks nobody
    // stored, in one event: its 70 and its 40 go, r1 keeps all of its 150.
    let mut hashes = chain.clone();
    hashes.extend(&own[30..70]);
    hashes.extend(5_000..5_010);
    apply(&ix, &LRU, "a", "r2", &[removed(&hashes)], s(4));
    assert_eq!(prefix_count(&ix, "a", "r2"), Some(60));
    assert_eq!(prefix_count(&ix, "a", "r1"), Some(150));
    assert_eq!(survivors(&ix, "a", &chain), chain);
    let kept: Vec<u64> = own[..30].iter().chain(&own[70..]).copied().collect();
    assert_eq!(survivors(&ix, "a", &own), kept);
    assert_eq!(ix.tenant_entries("a"), 210);
    // r1 removes its tail, last block first: 80 entries go.
    let tail: Vec<u64> = chain[70..].iter().rev().copied().collect();
    apply(&ix, &LRU, "a", "r1", &[removed(&tail)], s(5));
    assert_eq!(survivors(&ix, "a", &chain), chain[..70]);
    assert_eq!(ix.tenant_entries("a"), 130);
}

// ----- malformed input -----

#[test]
fn malformed_events_are_rejected_and_change_nothing() {
    let ix = mk_index(u64::MAX);
    store(&ix, &LRU, "a", "r1", &[1, 2], s(1));
    let before = (view(&ix, s(1)), holdings(&ix, "a"));
    let bad = [
        stored(&[]),
        IndexEvent::Stored {
            parent: Some(2),
            hashes: vec![3, 4],
            token_counts: vec![16],
        },
        removed(&[]),
        IndexEvent::PrefixStored {
            prefix_hash: String::new(),
            token_count: 64,
        },
    ];
    let outcome = apply(&ix, &LRU, "a", "r1", &bad, s(1));
    assert_eq!(
        outcome,
        IngestOutcome {
            applied: 0,
            rejected: 4
        }
    );
    assert_eq!((view(&ix, s(1)), holdings(&ix, "a")), before);
    assert_eq!(ix.counters().rejected_events, 4);
    // Valid events around a bad one still apply, in order.
    let mixed = [stored(&[5]), stored(&[]), removed(&[1])];
    let outcome = apply(&ix, &LRU, "a", "r1", &mixed, s(2));
    assert_eq!(
        outcome,
        IngestOutcome {
            applied: 2,
            rejected: 1
        }
    );
    assert_eq!(survivors(&ix, "a", &[1, 2, 5]), [2, 5]);
}

#[test]
fn malformed_batches_are_refused_whole() {
    let ix = mk_index(u64::MAX);
    let events = [stored(&[1])];
    for (sc, replica, err) in [
        (
            ScopeRef::new("", MODEL, VLLM),
            "r1",
            IngestError::MalformedScope,
        ),
        (
            ScopeRef::new("a", "", VLLM),
            "r1",
            IngestError::MalformedScope,
        ),
        (
            ScopeRef::new("a", MODEL, ""),
            "r1",
            IngestError::MalformedScope,
        ),
        (scope("a"), "", IngestError::MissingReplica),
    ] {
        let batch = IngestBatch {
            scope: sc,
            replica_id: replica,
            endpoint: "x:1",
            events: &events,
        };
        assert_eq!(ix.ingest(&batch, &LRU, s(1)), Err(err));
    }
    assert_eq!(view(&ix, s(1)), IndexView::default());
    assert_eq!(ix.total_entries(), 0);
}

// ----- the view -----

#[test]
fn view_reports_prefix_counts_per_replica_and_entries_per_tenant() {
    let ix = mk_index(u64::MAX);
    store(&ix, &LRU, "a", "r1", &[1, 2, 3], s(1));
    store(&ix, &LRU, "a", "r2", &[3, 4], s(2));
    let prefix_only = IngestBatch {
        scope: scope("a"),
        replica_id: "p1",
        endpoint: "",
        events: &[stored(&[5])],
    };
    ix.ingest(&prefix_only, &LRU, s(3)).expect("well-formed");
    // The same replica id in another tenant is another replica.
    store(&ix, &LRU, "b", "r1", &[1], s(4));
    let v = view(&ix, s(5));
    assert_eq!(v.total_entries, 6);
    let tenants: Vec<_> = v
        .tenants
        .iter()
        .map(|t| (t.tenant.as_str(), t.index_entries))
        .collect();
    assert_eq!(tenants, [("a", 5), ("b", 1)]);
    let rows: Vec<_> = v
        .replicas
        .iter()
        .map(|r| {
            (
                r.tenant.as_str(),
                r.replica_id.as_str(),
                r.endpoint.as_deref(),
                r.serving,
                r.prefix_count,
                r.last_event_at,
            )
        })
        .collect();
    assert_eq!(
        rows,
        [
            ("a", "r1", Some("r1.pods:8000"), true, 3, Some(s(1))),
            ("a", "r2", Some("r2.pods:8000"), true, 2, Some(s(2))),
            ("a", "p1", None, false, 1, Some(s(3))),
            ("b", "r1", Some("r1.pods:8000"), true, 1, Some(s(4))),
        ]
    );
    assert!(
        v.replicas
            .iter()
            .all(|r| r.model == MODEL && r.hash_scheme == VLLM)
    );
}

#[test]
fn the_view_counts_entries_stored_before_their_parent() {
    let ix = mk_index(u64::MAX);
    store(&ix, &LRU, "a", "r1", &[1, 2], s(1));
    let after = |parent: u64, hashes: &[u64]| IndexEvent::Stored {
        parent: Some(parent),
        hashes: hashes.to_vec(),
        token_counts: Vec::new(),
    };
    // After a known parent: the chain's shard. After an unknown one: orphans.
    apply(&ix, &LRU, "a", "r1", &[after(2, &[3])], s(2));
    apply(&ix, &LRU, "a", "r2", &[after(7, &[8, 9])], s(3));
    let v = view(&ix, s(4));
    assert_eq!((v.total_entries, v.orphan_entries), (5, 2));
    apply(&ix, &LRU, "a", "r2", &[removed(&[8, 9])], s(5));
    assert_eq!(view(&ix, s(6)).orphan_entries, 0);
}

#[test]
fn the_probe_tenant_is_hidden_from_the_view() {
    let ix = mk_index(u64::MAX);
    store(&ix, &LRU, "a", "r1", &[1], s(1));
    store(&ix, &LRU, PROBE_TENANT, "probe-holder", &[1, 2, 3], s(1));
    let v = view(&ix, s(1));
    assert_eq!(v.total_entries, 1);
    assert!(v.tenants.iter().all(|t| t.tenant != PROBE_TENANT));
    assert!(v.replicas.iter().all(|r| r.tenant != PROBE_TENANT));
    assert_eq!(v.replicas.len(), 1);
}

// ----- registration freshness and lastEventAt (docs/reference.md, "Scopes, replicas, entries") -----

#[test]
fn registration_stays_fresh_on_events_without_an_endpoint() {
    let ix = Index::new(IndexConfig::default());
    store(&ix, &LRU, "t", "r1", &[1], s(0));
    // Later events omit the endpoint; the registration must not go stale.
    for minute in 1..=20u64 {
        ix.ingest(
            &IngestBatch {
                scope: scope("t"),
                replica_id: "r1",
                endpoint: "",
                events: &[stored(&[1])],
            },
            &LRU,
            s(minute * 60),
        )
        .expect("well-formed batch");
    }
    let view = ix.view(s(20 * 60 + 1), &|_| TTL);
    assert!(view.replicas[0].serving, "{view:?}");
}

#[test]
fn stats_do_not_move_last_event_at() {
    let ix = Index::new(IndexConfig::default());
    store(&ix, &LRU, "t", "r1", &[1], s(0));
    ix.report_stats(
        &StatsReport {
            scope: scope("t"),
            replica_id: "r1",
            endpoint: "",
            stats: ReplicaStats::default(),
        },
        s(30),
    )
    .expect("well-formed report");
    let view = ix.view(s(31), &|_| TTL);
    assert_eq!(view.replicas[0].last_event_at, Some(s(0)));
    assert_eq!(view.replicas[0].stats.map(|(_, at)| at), Some(s(30)));
}

#[test]
fn a_running_probe_leaves_the_index_globally_empty_for_real_tenants() {
    let ix = Index::new(IndexConfig::default());
    store(&ix, &LRU, PROBE_TENANT, "probe-holder", &[1, 2], s(0));
    assert!(matches!(
        ix.classify(scope("acme"), s(1).as_nanos(), TTL),
        Classified::GloballyEmpty
    ));
    // The probe itself sees its own entries.
    assert!(matches!(
        ix.classify(scope(PROBE_TENANT), s(1).as_nanos(), TTL),
        Classified::Known(_)
    ));
}

/// Hashes that do not name one chain position (a page hash of its own tokens
/// only, passed through raw): block 3 starts r2's chain and ends r1's, so it is
/// in two shards, counted in each. A removal takes the copy its replica holds.
#[test]
fn a_hash_in_two_chains_is_removed_where_its_replica_holds_it() {
    let ix = mk_index(u64::MAX);
    store(&ix, &LRU, "a", "r2", &[3, 4], s(1));
    store(&ix, &LRU, "a", "r1", &[1, 2, 3], s(2));
    assert_eq!(ix.tenant_entries("a"), 5);
    // r1 wrote last, so its copy of 3 is looked at first: r2's removal must
    // pass it by.
    apply(&ix, &LRU, "a", "r2", &[removed(&[3])], s(3));
    assert_eq!(ix.tenant_entries("a"), 4);
    assert_eq!(prefix_count(&ix, "a", "r1"), Some(3));
    assert_eq!(prefix_count(&ix, "a", "r2"), Some(1));
    apply(&ix, &LRU, "a", "r1", &[removed(&[3])], s(4));
    apply(&ix, &LRU, "a", "r2", &[removed(&[4])], s(4));
    assert_eq!(survivors(&ix, "a", &[1, 2, 3, 4]), [1, 2]);
}
