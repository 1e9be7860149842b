//! The index benchmark workload run on inferencecache and on the indexes other
//! routers ship, in one process, rounds interleaved, every answer checked.
//!
//! Workload (the same as `benches/index.rs`): 32 replicas; 16,000 sequences of 64
//! blocks (blocks 0..15 one of 50 shared groups, 16..63 unique), each stored once
//! on a random replica; 100,000 decisions on 64-block chains (half an exact stored
//! sequence, half a group prefix + 48 unseen blocks); a writer thread storing and
//! removing other sequences during a second pass of decisions; then removals of
//! the unique tails (tail first) of random sequences until 10% of the stored
//! blocks are gone.
//!
//! Indexes, each called as its own router calls it:
//! - inferencecache: the whole LookupRoute decision (`Router::lookup`), events
//!   through `Router::ingest`.
//! - Dynamo `dynamo-kv-router` 1.6.1, `ThreadPoolIndexer<ConcurrentRadixTreeCompressed>`
//!   with one event thread (its router's default): events enqueued to the event
//!   thread, lookups inline on the caller's thread (`find_matches`, no early exit)
//!   plus an argmax.
//! - SMG `kv-index` 2.0.0, `ShardedChainIndex::new(1, 1024)` + `find_matches`
//!   (its gateway's call) plus an argmax; and the lean configuration (256 worker
//!   slots, `score_into` into a fixed array).
//!
//! Bytes per (block, replica) pair are measured in a fresh child process per index
//! (this binary re-run with `--memory NAME`), so one index's freed memory never
//! hides another's growth.
//!
//! Environment: IC_PEERS_ROUNDS (default 5), IC_PEERS_LOOKUPS (default 100000),
//! IC_PEERS_ONLY (a comma-separated list of index names, to profile one alone).

#![forbid(unsafe_code)]

use std::hint::black_box;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

mod ours;
mod peers;

pub const REPLICAS: usize = 32;
pub const SEQUENCES: usize = 16_000;
pub const BLOCKS: usize = 64;
pub const SHARED: usize = 16;
pub const GROUPS: usize = 50;

/// splitmix64: a seeded, well-mixed generator.
pub struct Rng(pub u64);
impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix(self.0)
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// One sequence's blocks: chain hashes (what the engines publish and our router
/// reads) and position-independent content hashes (what Dynamo and SMG look up by).
pub struct Seq {
    pub chain: Vec<u64>,
    pub content: Vec<u64>,
}

/// Blocks 0..15 of group `seq % GROUPS`, 16..63 keyed by `(seq, salt)`.
pub fn sequence(seq: usize, salt: u64) -> Seq {
    let group = (seq % GROUPS) as u64;
    let mut chain = Vec::with_capacity(BLOCKS);
    let mut content = Vec::with_capacity(BLOCKS);
    let mut parent = 0u64;
    for i in 0..BLOCKS {
        let key = if i < SHARED {
            group + 1
        } else {
            (seq as u64 + 1) << 20 | salt
        };
        let c = mix(key.wrapping_mul(0x1000_0000_01b3) ^ (i as u64).rotate_left(29));
        let h = mix(parent ^ c);
        chain.push(h);
        content.push(c);
        parent = h;
    }
    Seq { chain, content }
}

/// A decision to make and its expected answer.
pub struct Query {
    pub seq: Seq,
    /// The replica holding the whole chain (an exact stored sequence), or None (a
    /// group prefix: the group's holders share the best overlap, 16 blocks).
    pub owner: Option<usize>,
    pub group: usize,
}

/// What the workload's ground truth says a best match is.
pub struct Truth<'a> {
    pub group_holders: &'a [u32],
}

impl Truth<'_> {
    /// The best overlap (blocks) and the replicas sharing it, as a bit set.
    pub fn expected(&self, q: &Query) -> (u32, u32) {
        match q.owner {
            Some(r) => (BLOCKS as u32, 1 << r),
            None => (SHARED as u32, self.group_holders[q.group]),
        }
    }
}

/// The best overlap and the replicas sharing it, from (replica, score) pairs.
pub fn best(scores: impl IntoIterator<Item = (usize, u32)>) -> (u32, u32) {
    let (mut top, mut set) = (0u32, 0u32);
    for (r, s) in scores {
        if s > top {
            top = s;
            set = 1 << r;
        } else if s == top && s > 0 {
            set |= 1 << r;
        }
    }
    (top, set)
}

/// An index under test.
pub trait Index: Sync {
    /// Store `seq` on `replica` as one 64-block stored event.
    fn store(&self, seq: &Seq, replica: usize);
    /// Remove the blocks of `seq` from position `from` on `replica`, tail first when `reversed`.
    fn remove(&self, seq: &Seq, from: usize, replica: usize, reversed: bool);
    /// Wait until every event sent so far is applied (a queue-fed index).
    fn settle(&self) {}
    /// The routing decision the index's router makes for `q`; a value to keep.
    fn decide(&self, q: &Query) -> u64;
    /// Whether the decision for `q` is the ground truth's answer.
    fn check(&self, q: &Query, truth: &Truth<'_>) -> bool;
}

pub fn make(name: &str) -> Box<dyn Index> {
    match name {
        "inferencecache" => Box::new(ours::Ours::new()),
        "dynamo" => Box::new(peers::Dynamo::new()),
        "smg" => Box::new(peers::Smg::new(1024, false)),
        "smg-lean" => Box::new(peers::Smg::new(256, true)),
        "dynamo-positional" => Box::new(peers::Dynamo::positional()),
        other => panic!("unknown index {other}"),
    }
}

const NAMES: [&str; 5] = [
    "inferencecache",
    "dynamo",
    "smg",
    "smg-lean",
    "dynamo-positional",
];
const LABELS: [&str; 5] = [
    "inferencecache (whole decision)",
    "Dynamo 1.6.1 ThreadPoolIndexer<ConcurrentRadixTreeCompressed>, 1 event thread",
    "SMG kv-index 2.0.0 ShardedChainIndex::new(1, 1024) + find_matches",
    "SMG kv-index 2.0.0 lean (256 slots + score_into)",
    "Dynamo 1.6.1 ThreadPoolIndexer<PositionalIndexer> (jump 32), 1 event thread",
];

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

fn percentile(sorted: &[u64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i] as f64 / 1000.0
}

struct Workload {
    seqs: Vec<Seq>,
    owner: Vec<usize>,
    group_holders: Vec<u32>,
    pairs: u64,
    queries: Vec<Query>,
    removals: Vec<usize>,
    removed_blocks: usize,
}

fn workload(lookups: usize) -> Workload {
    let mut rng = Rng(42);
    let seqs: Vec<Seq> = (0..SEQUENCES).map(|s| sequence(s, 0)).collect();
    let owner: Vec<usize> = (0..SEQUENCES).map(|_| rng.below(REPLICAS)).collect();
    let mut group_holders = vec![0u32; GROUPS];
    for (s, &r) in owner.iter().enumerate() {
        group_holders[s % GROUPS] |= 1 << r;
    }
    let pairs = (SEQUENCES * (BLOCKS - SHARED)) as u64
        + group_holders
            .iter()
            .map(|h| u64::from(h.count_ones()) * SHARED as u64)
            .sum::<u64>();
    let queries = (0..lookups)
        .map(|q| {
            let s = rng.below(SEQUENCES);
            if q % 2 == 0 {
                Query {
                    seq: sequence(s, 0),
                    owner: Some(owner[s]),
                    group: s % GROUPS,
                }
            } else {
                Query {
                    seq: sequence(s, 1 + q as u64),
                    owner: None,
                    group: s % GROUPS,
                }
            }
        })
        .collect();
    let target = SEQUENCES * BLOCKS / 10;
    let mut chosen = vec![false; SEQUENCES];
    let (mut removals, mut removed_blocks) = (Vec::new(), 0);
    while removed_blocks < target {
        let s = rng.below(SEQUENCES);
        if !chosen[s] {
            chosen[s] = true;
            removals.push(s);
            removed_blocks += BLOCKS - SHARED;
        }
    }
    Workload {
        seqs,
        owner,
        group_holders,
        pairs,
        queries,
        removals,
        removed_blocks,
    }
}

fn insert(index: &dyn Index, w: &Workload) -> f64 {
    let start = Instant::now();
    for (s, seq) in w.seqs.iter().enumerate() {
        index.store(seq, w.owner[s]);
    }
    index.settle();
    start.elapsed().as_secs_f64()
}

/// One round's figures for one index.
#[derive(Default, Clone)]
struct Figures {
    median: f64,
    p99: f64,
    per_sec: f64,
    busy_median: f64,
    busy_p99: f64,
    writer: f64,
    insert: f64,
    remove: f64,
    bytes: f64,
}

fn round(name: &str, w: &Workload) -> Figures {
    let index = make(name);
    let index = &*index;
    let insert_secs = insert(index, w);
    let truth = Truth {
        group_holders: &w.group_holders,
    };
    let wrong = w.queries.iter().filter(|q| !index.check(q, &truth)).count();
    if wrong > 0 {
        eprintln!(
            "error: {name}: {wrong} of {} answers wrong",
            w.queries.len()
        );
        std::process::exit(1);
    }
    let timed = || {
        let mut lat: Vec<u64> = w
            .queries
            .iter()
            .map(|q| {
                let t = Instant::now();
                black_box(index.decide(q));
                t.elapsed().as_nanos() as u64
            })
            .collect();
        lat.sort_unstable();
        lat
    };
    let quiet = timed();
    let start = Instant::now();
    for q in &w.queries {
        black_box(index.decide(q));
    }
    let per_sec = w.queries.len() as f64 / start.elapsed().as_secs_f64();

    // A writer storing new sequences (their shared blocks already indexed) and
    // removing their unique tails, while the same decisions are timed.
    let stop = AtomicBool::new(false);
    let written = AtomicU64::new(0);
    let (busy, busy_secs) = std::thread::scope(|s| {
        s.spawn(|| {
            let mut rng = Rng(7);
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                let seq = sequence(SEQUENCES + n, 99);
                let r = rng.below(REPLICAS);
                index.store(&seq, r);
                index.remove(&seq, SHARED, r, false);
                n += 1;
                if n % 16 == 0 {
                    index.settle();
                    written.store((n * (2 * BLOCKS - SHARED)) as u64, Ordering::Relaxed);
                }
            }
        });
        let start = Instant::now();
        let busy = timed();
        let secs = start.elapsed().as_secs_f64();
        stop.store(true, Ordering::Relaxed);
        (busy, secs)
    });
    index.settle();
    let writer = written.load(Ordering::Relaxed) as f64 / busy_secs;
    // Every answer still right after the writer's churn.
    let wrong = w.queries.iter().filter(|q| !index.check(q, &truth)).count();
    if wrong > 0 {
        eprintln!("error: {name}: {wrong} answers wrong after the writer");
        std::process::exit(1);
    }

    let start = Instant::now();
    for &s in &w.removals {
        index.remove(&w.seqs[s], SHARED, w.owner[s], true);
    }
    index.settle();
    let remove_secs = start.elapsed().as_secs_f64();
    Figures {
        median: percentile(&quiet, 0.5),
        p99: percentile(&quiet, 0.99),
        per_sec,
        busy_median: percentile(&busy, 0.5),
        busy_p99: percentile(&busy, 0.99),
        writer,
        insert: (SEQUENCES * BLOCKS) as f64 / insert_secs,
        remove: w.removed_blocks as f64 / remove_secs,
        bytes: 0.0,
    }
}

/// Child mode: RSS growth over the insert phase of one index, per pair.
fn memory(name: &str) {
    let w = workload(0);
    let index = make(name);
    let before = rss_bytes();
    insert(&*index, &w);
    let after = rss_bytes();
    println!("{}", after.saturating_sub(before) as f64 / w.pairs as f64);
    black_box(&index);
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() == 3 && args[1] == "--memory" {
        memory(&args[2]);
        return;
    }
    let env = |k: &str, d: usize| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    let rounds = env("IC_PEERS_ROUNDS", 5).max(1);
    let lookups = env("IC_PEERS_LOOKUPS", 100_000).max(2);
    let only: Option<Vec<String>> = std::env::var("IC_PEERS_ONLY")
        .ok()
        .map(|v| v.split(',').map(str::to_owned).collect());
    let exe = std::env::current_exe().expect("own executable path");
    let mut bytes = [0.0f64; NAMES.len()];
    for (i, name) in NAMES.iter().enumerate() {
        let out = std::process::Command::new(&exe)
            .args(["--memory", name])
            .output()
            .expect("memory child ran");
        bytes[i] = String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .unwrap_or(f64::NAN);
    }
    let w = workload(lookups);
    eprintln!(
        "{} distinct (block, replica) pairs; {lookups} decisions, {rounds} rounds",
        w.pairs
    );
    let results: Arc<Mutex<Vec<Vec<Figures>>>> =
        Arc::new(Mutex::new(vec![Vec::new(); NAMES.len()]));
    for r in 0..rounds {
        // Interleaved, and the order rotated so no index always runs first.
        for k in 0..NAMES.len() {
            let i = (k + r) % NAMES.len();
            if !only
                .as_ref()
                .is_none_or(|o| o.iter().any(|n| n == NAMES[i]))
            {
                continue;
            }
            let mut f = round(NAMES[i], &w);
            f.bytes = bytes[i];
            eprintln!(
                "round {r} {:>15}: {:.2}/{:.2} µs, {:.2}M/s, busy {:.2}/{:.2} µs writer {:.1}M, insert {:.1}M remove {:.1}M",
                NAMES[i],
                f.median,
                f.p99,
                f.per_sec / 1e6,
                f.busy_median,
                f.busy_p99,
                f.writer / 1e6,
                f.insert / 1e6,
                f.remove / 1e6
            );
            results.lock().expect("results")[i].push(f);
        }
    }
    let results = results.lock().expect("results");
    if only.is_none() {
        report(&results);
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn report(results: &[Vec<Figures>]) {
    type Get = fn(&Figures) -> f64;
    type Show = fn(f64) -> String;
    let rows: [(&str, Get, Show); 9] = [
        ("decision median ↓", |f| f.median, |v| format!("{v:.2} µs")),
        ("decision p99 ↓", |f| f.p99, |v| format!("{v:.2} µs")),
        (
            "decisions/s, one thread ↑",
            |f| f.per_sec,
            |v| format!("{:.2}M", v / 1e6),
        ),
        (
            "median with a concurrent writer ↓",
            |f| f.busy_median,
            |v| format!("{v:.2} µs"),
        ),
        (
            "p99 with a concurrent writer ↓",
            |f| f.busy_p99,
            |v| format!("{v:.2} µs"),
        ),
        (
            "writer blocks/s meanwhile ↑",
            |f| f.writer,
            |v| format!("{:.1}M", v / 1e6),
        ),
        (
            "insert blocks/s ↑",
            |f| f.insert,
            |v| format!("{:.1}M", v / 1e6),
        ),
        (
            "remove blocks/s ↑",
            |f| f.remove,
            |v| format!("{:.1}M", v / 1e6),
        ),
        (
            "bytes per (block, replica) ↓",
            |f| f.bytes,
            |v| format!("{v:.1}"),
        ),
    ];
    println!();
    for (i, l) in LABELS.iter().enumerate().skip(1) {
        println!("- peer {i}: {l}");
    }
    println!();
    print!("| figure | ours |");
    for i in 1..NAMES.len() {
        print!(" peer {i} | ours÷peer {i} |");
    }
    println!();
    print!("|---|---|");
    for _ in 1..NAMES.len() {
        print!("---|---|");
    }
    println!();
    for (label, get, fmt) in rows {
        let med = |i: usize| median(results[i].iter().map(get).collect());
        print!("| {label} | {} |", fmt(med(0)));
        for i in 1..NAMES.len() {
            // Median of the per-round ratios (round r of ours against round r of the peer).
            let ratio = median(
                results[0]
                    .iter()
                    .zip(&results[i])
                    .map(|(a, b)| get(a) / get(b))
                    .collect(),
            );
            print!(" {} | {ratio:.2} |", fmt(med(i)));
        }
        println!();
    }
    println!();
    println!(
        "ours÷peer: the per-round ratio's median; below 1 is better for ↓ rows, above 1 for ↑ rows."
    );
}
