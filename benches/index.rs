//! The fixed index benchmark ("peer workload", docs/benchmarks.md),
//! printing every figure it lists. Run: `cargo bench --bench index`.
//!
//! 32 replicas in one scope; 16,000 sequences of 64 blocks (blocks 0..15 one of 50
//! shared groups, 16..63 unique), each stored once on a random replica; 100,000
//! full LookupRoute decisions (half exact sequences, half a group prefix + 48
//! unseen blocks), checked for correctness; then removals of the unique tails of
//! random sequences until 10% of the stored blocks are gone. Then the lock-hold
//! rows: the same decisions while a TTL sweep, a cap sweep and an AllBlocksCleared
//! each remove a 1M-entry replica from the scope being looked up.
//!
//! Environment: IC_BENCH_LOOKUPS (default 100000); IC_BENCH_PROFILE_HOT=N only
//! repeats one lookup N times (for a profiler); IC_BENCH_PROFILE_MIXED=N makes N
//! mixed decisions and N writer iterations on one thread (for callgrind); IC_BENCH_WRITER_OTHER_SCOPE=1 makes
//! the concurrent writer write to another scope (separates lock contention from
//! memory interference); IC_BENCH_TIERS=1 adds one CPU-tier block to the scope
//! (lookups then take the tiered walk); IC_BENCH_ORPHANS=1 adds one block stored
//! after an unknown parent (lookups then read the orphan shard too);
//! IC_BENCH_SWEEP_OTHER_SCOPE=1 puts the swept replica in another scope (the
//! maintenance rows' twin of the writer knob);
//! IC_BENCH_LOAD=disabled runs the decision with
//! `loadAwareness: Disabled` (the cache pick alone), to price the load rule.
//! The CPU-time row gives the write rates per CPU-second of the writing thread
//! (Linux schedstat), which leaves out waits for a core on a shared host.

use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use inferencecache_core::Router;
use inferencecache_core::decision::outcome::ReasonCode;
use inferencecache_core::decision::request::LookupRequest;
use inferencecache_core::index::{IndexConfig, IndexEvent, IngestBatch, contended_reads};
use inferencecache_core::policy::{LoadAwareness, ResolvedPolicy};
use inferencecache_core::scope::ScopeRef;
use inferencecache_core::snapshot::PolicySnapshot;
use inferencecache_core::time::Timestamp;

const REPLICAS: usize = 32;
const SEQUENCES: usize = 16_000;
const BLOCKS: usize = 64;
const SHARED: usize = 16;
const GROUPS: usize = 50;
/// The replica the sweep rows remove (a multiple of BLOCKS).
const SWEEP_ENTRIES: usize = 1_024_000;
const TENANT: &str = "bench";
const MODEL: &str = "model";
const SCHEME: &str = "scheme";

/// splitmix64: a seeded, well-mixed generator without a dependency.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix(self.0)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Chain hash of a block: parent value mixed with the block's content key.
fn chain(parent: u64, a: u64, b: u64) -> u64 {
    mix(parent ^ mix(a.wrapping_mul(0x1000_0000_01b3) ^ b.rotate_left(29)))
}

fn sequence(seq: usize, salt: u64) -> Vec<u64> {
    let group = (seq % GROUPS) as u64;
    let mut out = Vec::with_capacity(BLOCKS);
    let mut parent = 0u64;
    for i in 0..BLOCKS {
        let h = if i < SHARED {
            chain(parent, group + 1, i as u64)
        } else {
            chain(parent, (seq as u64 + 1) << 20 | salt, i as u64)
        };
        out.push(h);
        parent = h;
    }
    out
}

fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with("VmRSS:")).and_then(|l| {
                l.split_whitespace()
                    .nth(1)
                    .and_then(|v| v.parse::<u64>().ok())
            })
        })
        .map_or(0, |kb| kb * 1024)
}

/// CPU time this thread has run, in ns (Linux `schedstat`; None elsewhere). Rates
/// per CPU-second leave out the time a thread waited for a core, which on a
/// shared host is most of the noise in the wall-clock rates.
fn thread_cpu_ns() -> Option<u64> {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// `n` per second of `from..to` CPU time, if both were read.
fn per_cpu_sec(n: f64, from: Option<u64>, to: Option<u64>) -> Option<f64> {
    let ns = to?.checked_sub(from?)?;
    (ns > 0).then(|| n / (ns as f64 / 1e9))
}

fn millions(rate: Option<f64>) -> String {
    rate.map_or_else(|| "n/a".to_string(), |r| format!("{:.2}M", r / 1e6))
}

fn percentile(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i] as f64 / 1000.0
}

/// One iteration of the concurrent writer: a new sequence stored on `replica`
/// (its 16 shared blocks already in the index), then its unique tail removed.
fn write_once(router: &Router, scope: ScopeRef<'_>, replica: &str, seq: usize, now: Timestamp) {
    let hashes = sequence(seq, 99);
    let stored = [IndexEvent::Stored {
        parent: None,
        hashes: hashes.clone(),
        token_counts: Vec::new(),
    }];
    let batch = IngestBatch {
        scope,
        replica_id: replica,
        endpoint: "",
        events: &stored,
    };
    let _ = router.ingest(&batch, now);
    let removed = [IndexEvent::Removed {
        hashes: hashes[SHARED..].to_vec(),
    }];
    let batch = IngestBatch {
        events: &removed,
        ..batch
    };
    let _ = router.ingest(&batch, now);
}

fn replica_id(r: usize) -> String {
    format!("replica-{r}")
}

fn main() {
    let lookups: usize = std::env::var("IC_BENCH_LOOKUPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000);
    let now = Timestamp::from_secs(1_800_000_000);
    let config = IndexConfig {
        max_entries: u64::MAX,
    };
    let snapshot = if std::env::var("IC_BENCH_LOAD").is_ok_and(|v| v == "disabled") {
        let seed = ResolvedPolicy {
            load_awareness: LoadAwareness::Disabled,
            ..ResolvedPolicy::default()
        };
        PolicySnapshot::new(seed, Vec::new(), Vec::new())
    } else {
        PolicySnapshot::empty()
    };
    let router = Arc::new(Router::new(config, snapshot, now));
    let scope = ScopeRef::new(TENANT, MODEL, SCHEME);
    let ids: Vec<String> = (0..REPLICAS).map(replica_id).collect();
    let endpoints: Vec<String> = (0..REPLICAS).map(|r| format!("10.0.0.{r}:8000")).collect();

    // Prepare every event beforehand.
    let mut rng = Rng(42);
    let seqs: Vec<Vec<u64>> = (0..SEQUENCES).map(|s| sequence(s, 0)).collect();
    let owner: Vec<usize> = (0..SEQUENCES).map(|_| rng.below(REPLICAS)).collect();
    let events: Vec<[IndexEvent; 1]> = seqs
        .iter()
        .map(|hashes| {
            [IndexEvent::Stored {
                parent: None,
                hashes: hashes.clone(),
                token_counts: Vec::new(),
            }]
        })
        .collect();
    let mut group_holders = vec![[false; REPLICAS]; GROUPS];
    for (s, &r) in owner.iter().enumerate() {
        group_holders[s % GROUPS][r] = true;
    }
    let mut distinct_pairs = 0u64;
    {
        let mut shared_pairs = std::collections::HashSet::new();
        for (s, &r) in owner.iter().enumerate() {
            shared_pairs.insert((s % GROUPS, r));
            distinct_pairs += (BLOCKS - SHARED) as u64;
        }
        distinct_pairs += (shared_pairs.len() * SHARED) as u64;
    }

    // Insert.
    let rss_before = rss_bytes();
    let cpu = thread_cpu_ns();
    let start = Instant::now();
    for (s, ev) in events.iter().enumerate() {
        let r = owner[s];
        let batch = IngestBatch {
            scope,
            replica_id: &ids[r],
            endpoint: &endpoints[r],
            events: ev,
        };
        black_box(router.ingest(&batch, now).ok());
    }
    let insert_secs = start.elapsed().as_secs_f64();
    let insert_cpu = per_cpu_sec((SEQUENCES * BLOCKS) as f64, cpu, thread_cpu_ns());
    let rss_after = rss_bytes();
    // IC_BENCH_TIERS=1: one CPU-tier block elsewhere in the scope, so every lookup
    // takes the tiered walk (same answers: the chains are on GPU).
    // (Its GPU copy first, so the CPU copy joins its chain's shard, not the orphans.)
    let stored = |parent, hashes| IndexEvent::Stored {
        parent,
        hashes,
        token_counts: Vec::new(),
    };
    let mut extra = Vec::new();
    if std::env::var("IC_BENCH_TIERS").is_ok_and(|v| v == "1") {
        extra.push(stored(None, vec![0x7153_0000_0000_0001]));
        extra.push(IndexEvent::TierStored {
            tier: inferencecache_core::index::Tier::Cpu,
            hashes: vec![0x7153_0000_0000_0001],
        });
    }
    // IC_BENCH_ORPHANS=1: one block stored after a parent the index never saw, so
    // every lookup in the scope also holds the orphan shard's read lock and looks
    // there for the block where its chain's shard ends.
    if std::env::var("IC_BENCH_ORPHANS").is_ok_and(|v| v == "1") {
        extra.push(stored(
            Some(0x0c0f_0000_0000_0001),
            vec![0x0c0f_0000_0000_0002],
        ));
    }
    if !extra.is_empty() {
        let batch = IngestBatch {
            scope,
            replica_id: &ids[0],
            endpoint: &endpoints[0],
            events: &extra,
        };
        black_box(router.ingest(&batch, now).ok());
    }
    let blocks_inserted = (SEQUENCES * BLOCKS) as f64;
    drop(events);

    // Lookup requests: even = exact inserted sequence, odd = group prefix + 48 unseen.
    let counts = vec![16u32; BLOCKS];
    let mut queries: Vec<(Vec<u64>, Option<usize>, usize)> = Vec::with_capacity(lookups);
    for q in 0..lookups {
        let s = rng.below(SEQUENCES);
        if q % 2 == 0 {
            queries.push((seqs[s].clone(), Some(owner[s]), s % GROUPS));
        } else {
            queries.push((sequence(s, 1 + q as u64), None, s % GROUPS));
        }
    }
    fn request<'a>(chain: &'a [u64], counts: &'a [u32]) -> LookupRequest<'a> {
        LookupRequest {
            tenant_id: TENANT,
            model_id: MODEL,
            hash_scheme: SCHEME,
            block_hashes: chain,
            block_token_counts: counts,
            ..LookupRequest::default()
        }
    }

    // Profiling aid: IC_BENCH_PROFILE_HOT=N repeats one exact lookup N times and exits.
    if let Some(n) = std::env::var("IC_BENCH_PROFILE_HOT")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
    {
        for _ in 0..n {
            black_box(router.lookup(&request(&queries[0].0, &counts), now));
        }
        return;
    }

    // Profiling aid: IC_BENCH_PROFILE_MIXED=N makes the first N decisions (the
    // mixed, mostly cold queries) and then N iterations of the writer below (a
    // sequence stored, its unique tail removed) on this thread, and exits: under
    // `valgrind --tool=callgrind --cache-sim=yes` that gives instructions and
    // simulated cache misses per decision and per written block, which this
    // noisy host's clocks cannot.
    if let Some(n) = std::env::var("IC_BENCH_PROFILE_MIXED")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
    {
        for (chain, _, _) in queries.iter().take(n) {
            black_box(router.lookup(&request(chain, &counts), now));
        }
        let mut rng = Rng(7);
        for i in 0..n {
            write_once(
                &router,
                scope,
                &ids[rng.below(REPLICAS)],
                SEQUENCES + i,
                now,
            );
        }
        return;
    }

    // Correctness.
    let mut wrong = 0usize;
    for (chain, exact_owner, group) in &queries {
        let d = router.lookup(&request(chain, &counts), now);
        let pick = d.pick().map(|p| p.replica_id.to_string());
        let ok = match exact_owner {
            Some(r) => {
                d.reason == ReasonCode::PrefixMatch && pick.as_deref() == Some(ids[*r].as_str())
            }
            None => {
                let holders = &group_holders[*group];
                let all = holders.iter().all(|&h| h);
                match d.reason {
                    ReasonCode::PrefixMatch => {
                        !all && pick.is_some_and(|p| {
                            holders[p
                                .trim_start_matches("replica-")
                                .parse::<usize>()
                                .unwrap_or(0)]
                        })
                    }
                    ReasonCode::AffinityHint => all,
                    _ => false,
                }
            }
        };
        wrong += usize::from(!ok);
    }

    // Timed lookups, quiet.
    let timed = |router: &Router| -> Vec<u64> {
        let mut lat = Vec::with_capacity(queries.len());
        for (chain, _, _) in &queries {
            let t = Instant::now();
            black_box(router.lookup(&request(chain, &counts), now));
            lat.push(t.elapsed().as_nanos() as u64);
        }
        lat.sort_unstable();
        lat
    };
    let quiet = timed(&router);
    let (mut exact_lat, mut group_lat) = (Vec::new(), Vec::new());
    for (chain, exact_owner, _) in queries.iter().take(20_000) {
        let t = Instant::now();
        black_box(router.lookup(&request(chain, &counts), now));
        let ns = t.elapsed().as_nanos() as u64;
        if exact_owner.is_some() {
            exact_lat.push(ns)
        } else {
            group_lat.push(ns)
        }
    }
    exact_lat.sort_unstable();
    group_lat.sort_unstable();
    let (hot_chain, _, _) = &queries[0];
    let mut hot_lat: Vec<u64> = (0..20_000)
        .map(|_| {
            let t = Instant::now();
            black_box(router.lookup(&request(hot_chain, &counts), now));
            t.elapsed().as_nanos() as u64
        })
        .collect();
    hot_lat.sort_unstable();
    let start = Instant::now();
    for (chain, _, _) in &queries {
        black_box(router.lookup(&request(chain, &counts), now));
    }
    let per_sec = queries.len() as f64 / start.elapsed().as_secs_f64();

    // Timed lookups with a writer streaming stores and removals of other sequences.
    let stop = Arc::new(AtomicBool::new(false));
    let written = Arc::new(AtomicU64::new(0));
    let writer = {
        let (router, stop, written) = (router.clone(), stop.clone(), written.clone());
        let ids = ids.clone();
        std::thread::spawn(move || {
            let cpu = thread_cpu_ns();
            let mut rng = Rng(7);
            let mut n = 0usize;
            let scope = if std::env::var("IC_BENCH_WRITER_OTHER_SCOPE").is_ok_and(|v| v == "1") {
                ScopeRef::new("other", MODEL, SCHEME)
            } else {
                scope
            };
            while !stop.load(Ordering::Relaxed) {
                write_once(
                    &router,
                    scope,
                    &ids[rng.below(REPLICAS)],
                    SEQUENCES + n,
                    now,
                );
                written.fetch_add((BLOCKS + BLOCKS - SHARED) as u64, Ordering::Relaxed);
                n += 1;
            }
            let blocks = (n * (BLOCKS + BLOCKS - SHARED)) as f64;
            per_cpu_sec(blocks, cpu, thread_cpu_ns())
        })
    };
    let start = Instant::now();
    let waits_before = contended_reads();
    let busy = timed(&router);
    let busy_secs = start.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let busy_waits = contended_reads();
    let busy_waits = (busy_waits.0 - waits_before.0, busy_waits.1 - waits_before.1);
    let writer_cpu = writer.join().ok().flatten();
    let writer_rate = written.load(Ordering::Relaxed) as f64 / busy_secs;

    // Remove: unique tails (tail first) of random sequences until 10% of blocks are gone.
    let target = (blocks_inserted * 0.10) as usize;
    let mut removals = Vec::new();
    let mut chosen = vec![false; SEQUENCES];
    let mut planned = 0usize;
    while planned < target {
        let s = rng.below(SEQUENCES);
        if chosen[s] {
            continue;
        }
        chosen[s] = true;
        let tail: Vec<u64> = seqs[s][SHARED..].iter().rev().copied().collect();
        planned += tail.len();
        removals.push((owner[s], [IndexEvent::Removed { hashes: tail }]));
    }
    let entries_before = router.index().total_entries();
    let cpu = thread_cpu_ns();
    let start = Instant::now();
    for (r, ev) in &removals {
        let batch = IngestBatch {
            scope,
            replica_id: &ids[*r],
            endpoint: "",
            events: ev,
        };
        black_box(router.ingest(&batch, now).ok());
    }
    let remove_secs = start.elapsed().as_secs_f64();
    let remove_cpu = per_cpu_sec(planned as f64, cpu, thread_cpu_ns());
    let entries_after = router.index().total_entries();

    // Decisions while maintenance removes a 1M-entry replica from the same scope:
    // a second router holding the same workload under a cap equal to its size.
    // (Stamps only move forward per tenant, so what a row must evict is stored
    // before what it must keep.)
    let main_entries = entries_before;
    let sweeps = Router::new(
        IndexConfig {
            max_entries: main_entries,
        },
        PolicySnapshot::empty(),
        now,
    );
    // Over the cap, ingest only wakes a maintenance worker (none here): the cap row
    // runs the sweep itself.
    sweeps.on_over_cap(Box::new(|| {}));
    let insert_main = || {
        for (s, hashes) in seqs.iter().enumerate() {
            let ev = [IndexEvent::Stored {
                parent: None,
                hashes: hashes.clone(),
                token_counts: Vec::new(),
            }];
            let batch = IngestBatch {
                scope,
                replica_id: &ids[owner[s]],
                endpoint: &endpoints[owner[s]],
                events: &ev,
            };
            black_box(sweeps.ingest(&batch, now).ok());
        }
    };
    let sweeper = "replica-sweeper";
    // IC_BENCH_SWEEP_OTHER_SCOPE=1: the swept replica lives in another scope of
    // the tenant, so the operation takes no lock the lookups take; what is left
    // of the gap is the two threads sharing the host's caches.
    let sweep_scope = if std::env::var("IC_BENCH_SWEEP_OTHER_SCOPE").is_ok_and(|v| v == "1") {
        ScopeRef::new(TENANT, "other-model", SCHEME)
    } else {
        scope
    };
    let fill = |at: Timestamp| {
        for n in 0..SWEEP_ENTRIES / BLOCKS {
            let ev = [IndexEvent::Stored {
                parent: None,
                hashes: sequence(SEQUENCES * 4 + n, 7),
                token_counts: Vec::new(),
            }];
            let batch = IngestBatch {
                scope: sweep_scope,
                replica_id: sweeper,
                endpoint: "",
                events: &ev,
            };
            black_box(sweeps.ingest(&batch, at).ok());
        }
    };
    // Each row is paired with the same router's quiet decisions just before the
    // operation: this router holds twice the entries of the main one (larger
    // tables, more cache misses), so its quiet figure is the fair baseline.
    let during = |work: &(dyn Fn() + Sync)| -> (Vec<u64>, Vec<u64>, f64, u64, (u64, u64)) {
        let peak = sweeps.index().total_entries();
        let mut before: Vec<u64> = queries
            .iter()
            .cycle()
            .take(queries.len().min(50_000))
            .map(|(chain, _, _)| {
                let t = Instant::now();
                black_box(sweeps.lookup(&request(chain, &counts), now));
                t.elapsed().as_nanos() as u64
            })
            .collect();
        before.sort_unstable();
        let done = AtomicBool::new(false);
        let mut lat = Vec::new();
        let mut secs = 0.0;
        let waits_before = contended_reads();
        std::thread::scope(|s| {
            let worker = s.spawn(|| {
                let t = Instant::now();
                work();
                done.store(true, Ordering::Release);
                t.elapsed().as_secs_f64()
            });
            for (chain, _, _) in queries.iter().cycle() {
                if done.load(Ordering::Acquire) {
                    break;
                }
                let t = Instant::now();
                black_box(sweeps.lookup(&request(chain, &counts), now));
                lat.push(t.elapsed().as_nanos() as u64);
            }
            secs = worker.join().unwrap_or(0.0);
        });
        let waits_after = contended_reads();
        let waits = (
            waits_after.0 - waits_before.0,
            waits_after.1 - waits_before.1,
        );
        lat.sort_unstable();
        (before, lat, secs, peak, waits)
    };
    fill(Timestamp::from_secs(1_800_000_000 - 30 * 86_400));
    insert_main();
    let ttl_sweep = during(&|| sweeps.maintain(now));
    let ttl_left = sweeps.index().total_entries();
    fill(now);
    insert_main();
    let cap_sweep = during(&|| sweeps.sweep_cap());
    let cap_left = sweeps.index().total_entries();
    fill(now);
    let clear = during(&|| {
        let ev = [IndexEvent::Cleared];
        let batch = IngestBatch {
            scope: sweep_scope,
            replica_id: sweeper,
            endpoint: "",
            events: &ev,
        };
        black_box(sweeps.ingest(&batch, now).ok());
    });
    let clear_left = sweeps.index().total_entries();
    let sweep_rows = [
        ("a TTL sweep", ttl_sweep, ttl_left),
        ("a cap sweep", cap_sweep, cap_left),
        ("an AllBlocksCleared", clear, clear_left),
    ];

    println!("inferencecache index benchmark (the fixed peer workload)");
    println!("  distinct (block, replica) pairs  {distinct_pairs}");
    println!("  index entries after insert       {}", entries_before);
    println!(
        "  wrong decisions                  {wrong} of {}",
        queries.len()
    );
    println!("| figure | inferencecache |");
    println!("|---|---|");
    println!(
        "| insert blocks/s, one thread | {:.2}M |",
        blocks_inserted / insert_secs / 1e6
    );
    println!(
        "| bytes per (block, replica) pair | {:.1} |",
        rss_after.saturating_sub(rss_before) as f64 / distinct_pairs as f64
    );
    println!(
        "| decision median / p99, one thread | {:.2} / {:.2} µs |",
        percentile(&quiet, 0.5),
        percentile(&quiet, 0.99)
    );
    println!("| decisions/s, one thread | {:.0}k |", per_sec / 1e3);
    println!(
        "| (detail) median exact / group-prefix / same request repeated | {:.2} / {:.2} / {:.2} µs |",
        percentile(&exact_lat, 0.5),
        percentile(&group_lat, 0.5),
        percentile(&hot_lat, 0.5)
    );
    println!(
        "| decision median / p99 with a concurrent writer | {:.2} / {:.2} µs (writer {:.2}M blocks/s; {} of {} decisions waited for a lock, {:.2} µs each) |",
        percentile(&busy, 0.5),
        percentile(&busy, 0.99),
        writer_rate / 1e6,
        busy_waits.0,
        busy.len(),
        busy_waits.1 as f64 / busy_waits.0.max(1) as f64 / 1e3,
    );
    println!(
        "| (CPU time) insert / writer meanwhile / remove, blocks per CPU-second of the thread | {} / {} / {} |",
        millions(insert_cpu),
        millions(writer_cpu),
        millions(remove_cpu)
    );
    println!(
        "| remove blocks/s | {:.2}M ({} entries removed) |",
        planned as f64 / remove_secs / 1e6,
        entries_before - entries_after
    );
    for (what, (before, lat, secs, peak, waits), left) in &sweep_rows {
        println!(
            "| decision median / p99 while {what} removes {}k of the {}k entries | {:.2} / {:.2} µs (just before: {:.2} / {:.2} µs; {} decisions over {:.0} ms; {} waited for a lock, {:.2} µs each) |",
            (peak - left) / 1000,
            peak / 1000,
            percentile(lat, 0.5),
            percentile(lat, 0.99),
            percentile(before, 0.5),
            percentile(before, 0.99),
            lat.len(),
            secs * 1e3,
            waits.0,
            waits.1 as f64 / waits.0.max(1) as f64 / 1e3,
        );
        if *left != main_entries {
            eprintln!("error: {what} left {left} entries, expected {main_entries}");
            std::process::exit(1);
        }
    }
    if wrong > 0 {
        eprintln!("error: {wrong} wrong decisions");
        std::process::exit(1);
    }
}
