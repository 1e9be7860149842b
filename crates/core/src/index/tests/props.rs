//! Property tests over random event sequences on a few replicas and small hash
//! alphabets: the index against a naive model (hash → per-replica reference
//! count), and the quota and the cap after every step.

use std::collections::HashMap;

use proptest::prelude::*;

use super::*;

const REPLICAS: [&str; 3] = ["r0", "r1", "r2"];

/// Two chains of four blocks: hashes 0..4 and 4..8. Stored runs are stretches
/// of one chain with their parent, as engines send them (docs/reference.md, "gRPC API": a run
/// without a parent starts at block 0), in any order, so a run can arrive
/// before its parent (an orphan) and its parent later.
const CHAIN_LEN: u64 = 4;

/// One event of one replica.
#[derive(Clone, Debug)]
enum Op {
    /// Replica, parent, hashes.
    Store(usize, Option<u64>, Vec<u64>),
    Remove(usize, Vec<u64>),
    Clear(usize),
    Prefix(usize, u8),
}

fn op() -> impl Strategy<Value = Op> {
    let hashes = || proptest::collection::vec(0u64..8, 1..5);
    prop_oneof![
        4 => (0..3usize, 0..2u64, 0..CHAIN_LEN, 1..=CHAIN_LEN).prop_map(|(r, c, from, len)| {
            let base = c * CHAIN_LEN;
            let to = (from + len).min(CHAIN_LEN);
            let parent = (from > 0).then(|| base + from - 1);
            Op::Store(r, parent, (base + from..base + to).collect())
        }),
        3 => (0..3usize, hashes()).prop_map(|(r, h)| Op::Remove(r, h)),
        1 => (0..3usize).prop_map(Op::Clear),
        1 => (0..3usize, 0..3u8).prop_map(|(r, p)| Op::Prefix(r, p)),
    ]
}

impl Op {
    fn replica(&self) -> &'static str {
        match self {
            Self::Store(r, _, _) | Self::Remove(r, _) | Self::Clear(r) | Self::Prefix(r, _) => {
                REPLICAS[*r]
            }
        }
    }

    fn event(&self) -> IndexEvent {
        match self {
            Self::Store(_, parent, h) => IndexEvent::Stored {
                parent: *parent,
                hashes: h.clone(),
                token_counts: Vec::new(),
            },
            Self::Remove(_, h) => removed(h),
            Self::Clear(_) => IndexEvent::Cleared,
            Self::Prefix(_, p) => IndexEvent::PrefixStored {
                prefix_hash: format!("p-{p}"),
                token_count: 16,
            },
        }
    }
}

/// The naive model: every key and how many references each replica holds on it.
/// Keys are named as [`holdings`] names them.
#[derive(Default)]
struct Model {
    refs: HashMap<String, [u32; 3]>,
}

impl Model {
    fn apply(&mut self, op: &Op) {
        match op {
            Op::Store(r, _, hashes) => {
                for h in hashes {
                    self.refs.entry(format!("b{h}")).or_default()[*r] += 1;
                }
            }
            Op::Remove(r, hashes) => {
                for h in hashes {
                    if let Some(c) = self.refs.get_mut(&format!("b{h}")) {
                        c[*r] = c[*r].saturating_sub(1);
                    }
                }
            }
            Op::Clear(r) => {
                for c in self.refs.values_mut() {
                    c[*r] = 0;
                }
            }
            Op::Prefix(r, p) => self.refs.entry(format!("p:p-{p}")).or_default()[*r] += 1,
        }
        self.refs.retain(|_, c| c.iter().any(|&n| n > 0));
    }

    fn holdings(&self) -> BTreeMap<String, BTreeSet<String>> {
        self.refs
            .iter()
            .map(|(k, c)| {
                let ids = (0..3)
                    .filter(|&r| c[r] > 0)
                    .map(|r| REPLICAS[r].to_string())
                    .collect();
                (k.clone(), ids)
            })
            .collect()
    }

    fn held_by(&self, r: usize) -> u64 {
        self.refs.values().filter(|c| c[r] > 0).count() as u64
    }
}

/// Entry counts and per-replica prefix counts agree with the shards themselves.
fn assert_consistent(ix: &Index, tenants: &[&str]) -> Result<(), TestCaseError> {
    let v = view(ix, s(0));
    let mut total = 0;
    for t in tenants {
        let held = holdings(ix, t);
        prop_assert_eq!(ix.tenant_entries(t), held.len() as u64, "tenant {}", t);
        total += held.len() as u64;
        for row in v.replicas.iter().filter(|r| r.tenant == *t) {
            let n = held
                .values()
                .filter(|ids| ids.contains(&row.replica_id))
                .count();
            prop_assert_eq!(row.prefix_count, n as u64, "{}/{}", t, row.replica_id);
        }
    }
    prop_assert_eq!(ix.total_entries(), total);
    prop_assert_eq!(v.total_entries, total);
    Ok(())
}

/// A step of the limits property: an event, an LFU credit (a lookup), or upkeep.
#[derive(Clone, Debug)]
enum Step {
    Event(usize, Op),
    Credit(usize, u64),
    Maintain,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        8 => (0..2usize, op()).prop_map(|(t, o)| Step::Event(t, o)),
        2 => (0..2usize, 0u64..8).prop_map(|(t, h)| Step::Credit(t, h)),
        1 => Just(Step::Maintain),
    ]
}

const TENANTS: [&str; 2] = ["a", "b"];

proptest! {
    /// After every event, entries and who holds them are exactly what per-replica
    /// reference counting gives, and so are the per-replica prefix counts.
    #[test]
    fn entry_counts_follow_a_refcount_model(ops in proptest::collection::vec(op(), 1..60)) {
        let ix = mk_index(u64::MAX);
        let mut model = Model::default();
        for (i, op) in ops.iter().enumerate() {
            apply(&ix, &LRU, "a", op.replica(), &[op.event()], s(i as u64));
            model.apply(op);
            prop_assert_eq!(holdings(&ix, "a"), model.holdings(), "after {:?}", op);
            prop_assert_eq!(ix.tenant_entries("a"), model.refs.len() as u64);
            prop_assert_eq!(ix.total_entries(), model.refs.len() as u64);
            for (r, id) in REPLICAS.iter().enumerate() {
                let count = prefix_count(&ix, "a", id).unwrap_or(0);
                prop_assert_eq!(count, model.held_by(r), "replica {}", id);
            }
        }
    }

    /// The quota of tenant a and the index cap hold after every step, whatever
    /// the algorithms, credits, sweeps and TTL expiries in between; the counts
    /// stay consistent with the shards.
    #[test]
    fn quota_and_cap_hold_after_every_step(
        quota in 0u64..6,
        cap in 1u64..12,
        a_lfu in any::<bool>(),
        steps in proptest::collection::vec(step(), 1..80),
    ) {
        let ix = mk_index(cap);
        let a_algo = if a_lfu { Lfu } else { Lru };
        let limits_of = |t: &str| {
            if t == "a" {
                limits(a_algo, Some(quota))
            } else {
                // b: the other algorithm, no quota, a short TTL so sweeps expire.
                TenantLimits {
                    ttl_nanos: 20 * 1_000_000_000,
                    eviction: if a_lfu { Lru } else { Lfu },
                    max_entries: None,
                }
            }
        };
        let eviction_of = |t: &str| limits_of(t).eviction;
        for (i, st) in steps.iter().enumerate() {
            let now = s(i as u64);
            match st {
                Step::Event(t, op) => {
                    let tenant = TENANTS[*t];
                    apply(&ix, &limits_of(tenant), tenant, op.replica(), &[op.event()], now);
                }
                Step::Credit(t, h) => {
                    if let Some(sc) = ix.scope(scope(TENANTS[*t])) {
                        sc.credit_chain(&[*h]);
                    }
                }
                Step::Maintain => ix.sweep(&limits_of, now),
            }
            // What the router does after every ingest and every upkeep.
            if ix.over_cap() {
                ix.sweep_cap(&eviction_of);
            }
            prop_assert!(ix.tenant_entries("a") <= quota, "quota {} after {:?}", quota, st);
            prop_assert!(ix.total_entries() <= cap, "cap {} after {:?}", cap, st);
            assert_consistent(&ix, &TENANTS)?;
        }
    }

    /// A hash stored k times by one replica needs k removals from it; other
    /// replicas' references keep the entry; extra removals change nothing.
    #[test]
    fn removals_are_reference_counted(k in 1u32..5, others in 0u32..3, h in any::<u64>()) {
        let ix = mk_index(u64::MAX);
        for i in 0..k {
            store(&ix, &LRU, "a", "r0", &[h], s(u64::from(i)));
        }
        for i in 0..others {
            store(&ix, &LRU, "a", "r1", &[h], s(u64::from(i)));
        }
        let held_by = |id: &str| {
            holdings(&ix, "a")
                .get(&format!("b{h}"))
                .is_some_and(|ids| ids.contains(id))
        };
        for _ in 1..k {
            apply(&ix, &LRU, "a", "r0", &[removed(&[h])], s(10));
            prop_assert!(held_by("r0"));
        }
        apply(&ix, &LRU, "a", "r0", &[removed(&[h])], s(10));
        prop_assert!(!held_by("r0"));
        prop_assert_eq!(ix.tenant_entries("a"), u64::from(others > 0));
        apply(&ix, &LRU, "a", "r0", &[removed(&[h])], s(11));
        prop_assert_eq!(ix.tenant_entries("a"), u64::from(others > 0));
        prop_assert_eq!(prefix_count(&ix, "a", "r0"), Some(0));
        for _ in 0..others {
            prop_assert!(held_by("r1"));
            apply(&ix, &LRU, "a", "r1", &[removed(&[h])], s(12));
        }
        prop_assert_eq!(ix.total_entries(), 0);
    }
}
