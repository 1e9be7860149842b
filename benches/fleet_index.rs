//! The fleet's index: snapshots and the KV event stream.
//!
//! 1. In process (no NATS): a fleet index of IC_BENCH_FLEET_INDEX_BLOCKS
//!    (default 1,000,000) blocks over eight engines, in chains of 32: the
//!    snapshot's size, writing it (log → events → bytes) and loading it into a
//!    new sidecar's index (bytes → events → index and log). Medians of three.
//! 2. Through a real nats-server (JetStream, loopback): the same blocks
//!    published as relayed batches of 16 blocks; a sidecar started with no
//!    snapshot reads the whole stream (stream ingest per consuming sidecar,
//!    blocks/s from its first block applied to its last); then, with the snapshot written to the object store, a sidecar
//!    started late answers PREFIX_MATCH on the cached chains (warm start: from
//!    `fleet::start` until every block is in its index and a lookup matches).
//!
//! Run: `INFERENCECACHE_NATS_SERVER=$(bash e2e/nats/install.sh) cargo bench --bench fleet_index`.
//! Without the variable only part 1 runs (part 2 says so).

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use inferencecache::adapters::fleet::index_log::IndexLog;
use inferencecache::adapters::fleet::index_stream;
use inferencecache::adapters::fleet::kv_wire::{self, EngineId, KvBatch};
use inferencecache::adapters::fleet::metrics::FleetMetrics;
use inferencecache::adapters::fleet::subjects::Subjects;
use inferencecache::adapters::fleet::{self, FleetConfig, NatsAccess};
use inferencecache::core::Router;
use inferencecache::core::decision::outcome::ReasonCode;
use inferencecache::core::decision::request::LookupRequest;
use inferencecache::core::index::{IndexConfig, IndexEvent};
use inferencecache::core::scope::ScopeRef;
use inferencecache::core::snapshot::PolicySnapshot;
use inferencecache::core::time::Timestamp;

const FLEET: &str = "bench";
const ENGINES: usize = 8;
const CHAIN: usize = 32;
const BATCH_BLOCKS: usize = 16;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn engine(i: usize) -> EngineId {
    EngineId {
        scope: ScopeRef::new("tenant-a", "llama-3-8b", "vllm-sha256-cbor").to_owned(),
        replica: format!("llama-3-8b-{i}"),
        rank: 0,
    }
}

/// SplitMix64: distinct, uniformly spread block hashes.
fn hashes(seed: u64, n: usize) -> Vec<u64> {
    let mut x = seed;
    (0..n)
        .map(|_| {
            x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        })
        .collect()
}

/// Per engine, its chains: `blocks` in all.
fn chains(blocks: usize) -> Vec<Vec<Vec<u64>>> {
    let all = hashes(7, blocks);
    let per_engine = blocks / ENGINES;
    (0..ENGINES)
        .map(|e| {
            all[e * per_engine..(e + 1) * per_engine]
                .chunks(CHAIN)
                .map(<[u64]>::to_vec)
                .collect()
        })
        .collect()
}

fn router() -> Arc<Router> {
    Arc::new(Router::new(
        IndexConfig::default(),
        PolicySnapshot::empty(),
        Timestamp::now(),
    ))
}

fn matches(router: &Router, chain: &[u64]) -> bool {
    let counts = vec![16u32; chain.len()];
    let req = LookupRequest {
        tenant_id: "tenant-a",
        model_id: "llama-3-8b",
        hash_scheme: "vllm-sha256-cbor",
        block_hashes: chain,
        block_token_counts: &counts,
        ..LookupRequest::default()
    };
    router.lookup(&req, Timestamp::now()).reason == ReasonCode::PrefixMatch
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Part 1; returns the log (part 2 writes its snapshot).
fn in_process(blocks: usize) -> IndexLog {
    let chains = chains(blocks);
    let mut log = IndexLog::default();
    for (e, engine_chains) in chains.iter().enumerate() {
        let events: Vec<IndexEvent> = engine_chains
            .iter()
            .map(|c| IndexEvent::Stored {
                parent: None,
                hashes: c.clone(),
                token_counts: Vec::new(),
            })
            .collect();
        log.apply(&engine(e), "10.0.0.1:8000", &events);
    }
    let (mut write, mut load, mut bytes) = (Vec::new(), Vec::new(), 0);
    for _ in 0..3 {
        let t = Instant::now();
        let encoded = kv_wire::encode_snapshot(&log.snapshot("w"));
        write.push(t.elapsed().as_secs_f64());
        bytes = encoded.len();
        let r = router();
        let mut fresh = IndexLog::default();
        let t = Instant::now();
        let snapshot = kv_wire::decode_snapshot(&encoded).expect("decodes");
        let loaded = index_stream::load(&r, &mut fresh, &snapshot);
        load.push(t.elapsed().as_secs_f64());
        assert_eq!(loaded, blocks);
        assert_eq!(r.index().total_entries(), blocks as u64);
        assert!(matches(&r, &chains[ENGINES - 1][0]));
    }
    println!(
        "fleet index snapshot of {blocks} blocks ({ENGINES} engines, chains of {CHAIN}), in process, median of 3:"
    );
    println!(
        "  size {:.1} MB ({:.1} bytes/block); write {:.0} ms; load {:.0} ms ({:.2} M blocks/s)",
        bytes as f64 / 1e6,
        bytes as f64 / blocks as f64,
        median(write) * 1e3,
        median(load.clone()) * 1e3,
        blocks as f64 / median(load) / 1e6
    );
    log
}

struct NatsServer(Child);

impl Drop for NatsServer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

fn config(url: &str, id: &str) -> FleetConfig {
    FleetConfig {
        access: NatsAccess {
            url: url.to_string(),
            ..NatsAccess::default()
        },
        id: id.into(),
        name: FLEET.into(),
        relay_kv_events: true,
        // Snapshots are written by the benchmark itself.
        snapshot_interval: Duration::from_secs(3600),
    }
}

/// Starts a sidecar's fleet sync on a new router; returns when `done` holds
/// for it, with the time taken.
async fn start_until(
    url: &str,
    id: &str,
    done: impl Fn(&Router) -> bool,
) -> (Duration, Arc<Router>, fleet::FleetSync, Arc<FleetMetrics>) {
    let r = router();
    let metrics = Arc::new(FleetMetrics::default());
    let t = Instant::now();
    let sync = fleet::start(&config(url, id), r.clone(), metrics.clone())
        .await
        .expect("fleet sync");
    while !done(&r) {
        assert!(t.elapsed() < Duration::from_secs(120), "{id} never done");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    (t.elapsed(), r, sync, metrics)
}

async fn through_nats(server: &str, blocks: usize, log: &IndexLog) {
    let port = free_port();
    let store = std::env::temp_dir().join(format!("ic-bench-fleet-index-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&store);
    let _server = NatsServer(
        Command::new(server)
            .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
            .arg(&store)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start nats-server"),
    );
    let url = format!("nats://127.0.0.1:{port}");
    // A first sidecar sets the stream and buckets up.
    let subjects = Subjects::new(FLEET);
    let client = loop {
        if let Ok(c) = async_nats::connect(url.as_str()).await {
            break c;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let js = jetstream::new(client.clone());
    let (_, _, first, _) = start_until(&url, "setup", |_| true).await;
    while js.get_stream(subjects.kv_stream()).await.is_err()
        || js
            .get_object_store(subjects.snapshot_bucket())
            .await
            .is_err()
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    first.abort();
    // The stream: every block once, as relays publish them.
    let chains = chains(blocks);
    let mut batches = 0u64;
    for (e, engine_chains) in chains.iter().enumerate() {
        let id = engine(e);
        let subject = subjects.kv_of(&id.token());
        for chain in engine_chains {
            for (i, piece) in chain.chunks(BATCH_BLOCKS).enumerate() {
                let parent = (i > 0).then(|| chain[i * BATCH_BLOCKS - 1]);
                let bytes = kv_wire::encode_batch(&KvBatch {
                    origin: "relay".into(),
                    epoch: 1,
                    fence: 1,
                    engine: id.clone(),
                    endpoint: "10.0.0.1:8000".into(),
                    events: vec![IndexEvent::Stored {
                        parent,
                        hashes: piece.to_vec(),
                        token_counts: Vec::new(),
                    }],
                });
                js.publish(subject.clone(), bytes.into())
                    .await
                    .expect("publish")
                    .await
                    .expect("stored");
                batches += 1;
            }
        }
    }
    let last = chains[ENGINES - 1].last().cloned().unwrap_or_default();
    // Timed from the first block applied to the last: the connection, the
    // setup and the consumer's creation are not ingest.
    let first = std::sync::Mutex::new(None::<Instant>);
    let (_, _, reader, metrics) = start_until(&url, "reader", |r| {
        let n = r.index().total_entries();
        let mut first = first.lock().expect("not poisoned");
        if n > 0 && first.is_none() {
            *first = Some(Instant::now());
        }
        n == blocks as u64
    })
    .await;
    let took = first
        .lock()
        .expect("not poisoned")
        .map_or(Duration::ZERO, |t| t.elapsed());
    reader.abort();
    println!("fleet index through nats-server 2.9 (JetStream, loopback):");
    println!(
        "  stream ingest: {batches} batches of {BATCH_BLOCKS} blocks read and applied by a new sidecar in {:.2} s from its first block: {:.2} M blocks/s ({} batches applied)",
        took.as_secs_f64(),
        blocks as f64 / took.as_secs_f64() / 1e6,
        metrics_applied(&metrics),
    );
    // The snapshot of those blocks, at the stream's end: a late sidecar loads
    // it and reads nothing more.
    let mut snapshot = log.snapshot("bench");
    snapshot.stream_seq = batches;
    let bytes = kv_wire::encode_snapshot(&snapshot);
    let objects = js
        .get_object_store(subjects.snapshot_bucket())
        .await
        .expect("object store");
    objects
        .put("snapshot", &mut bytes.as_slice())
        .await
        .expect("snapshot written");
    let mut warm = Vec::new();
    for i in 0..3 {
        let (took, _, late, _) = start_until(&url, &format!("late-{i}"), |r| {
            r.index().total_entries() == blocks as u64 && matches(r, &last)
        })
        .await;
        warm.push(took.as_secs_f64());
        late.abort();
    }
    let times = warm;
    println!(
        "  warm start: fleet::start → every block loaded and PREFIX_MATCH on the last chain: {:.2} s median of 3 ({:.2}–{:.2}); snapshot {:.1} MB",
        median(times.clone()),
        times.iter().copied().fold(f64::INFINITY, f64::min),
        times.iter().copied().fold(0.0, f64::max),
        bytes.len() as f64 / 1e6
    );
    let _ = std::fs::remove_dir_all(&store);
}

fn metrics_applied(m: &FleetMetrics) -> String {
    let mut registry = prometheus_client::registry::Registry::default();
    m.register(&mut registry);
    let mut text = String::new();
    let _ = prometheus_client::encoding::text::encode(&mut text, &registry);
    text.lines()
        .find(|l| l.starts_with("fleet_kv_batches_applied_total "))
        .and_then(|l| l.split(' ').nth(1))
        .unwrap_or("?")
        .to_string()
}

fn main() {
    let blocks = env_usize("IC_BENCH_FLEET_INDEX_BLOCKS", 1_000_000);
    let log = in_process(blocks);
    match std::env::var("INFERENCECACHE_NATS_SERVER") {
        Ok(server) if !server.is_empty() => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime")
            .block_on(through_nats(&server, blocks, &log)),
        _ => println!(
            "through nats-server: not measured (set INFERENCECACHE_NATS_SERVER=$(bash e2e/nats/install.sh))"
        ),
    }
}
