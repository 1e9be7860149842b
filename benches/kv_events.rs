//! KV event ingestion through a real ZMQ socket on loopback: a Rust PUB publishes
//! vLLM-style batches (64 full blocks of 16 tokens each, array generation) to one
//! [`Subscriber`]. Prints decode + apply throughput in blocks/s for the
//! pass-through scheme, `ic-content-v1` and `ic-content-v2` (own chain recomputed
//! from the tokens), and `ic-content-v2+lora` (every event names a LoRA adapter and
//! carries vLLM's per-block `extra_keys`, the salt on block 0 of each request), then
//! publish → visible-in-LookupRoute lag p50/p99.
//!
//! Run: `cargo bench --bench kv_events`. Environment: IC_BENCH_BLOCKS (default
//! 524,288 per scheme), IC_BENCH_LAG_SAMPLES (default 500), IC_BENCH_SCHEMES
//! (comma-separated subset and order of the four above), IC_BENCH_LAG_POLL
//! (`spin`: the lag poller never gives up its core, as before; default: it
//! `sched_yield`s between lookups), IC_BENCH_POOL (blocks: each batch also removes
//! the blocks stored that many blocks before, as an engine with a full pool of that
//! size evicts; default 0, nothing removed: the maps grow from empty).

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use inferencecache::adapters::kv_events::metrics::KvEventMetrics;
use inferencecache::adapters::kv_events::subscriber::{Subscriber, SubscriberConfig};
use inferencecache::core::Router;
use inferencecache::core::chain::{self, Scheme};
use inferencecache::core::decision::outcome::ReasonCode;
use inferencecache::core::decision::request::LookupRequest;
use inferencecache::core::index::{IndexConfig, IndexEvent, IngestBatch};
use inferencecache::core::scope::ScopeRef;
use inferencecache::core::snapshot::PolicySnapshot;
use inferencecache::core::time::Timestamp;
use rmpv::Value;
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

const BLOCK: usize = 16;
const BLOCKS_PER_EVENT: usize = 16;
const EVENTS_PER_BATCH: usize = 4;
const BLOCKS_PER_BATCH: usize = BLOCKS_PER_EVENT * EVENTS_PER_BATCH;
const IN_FLIGHT: u64 = 256;

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn now_secs() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

const LORA: &str = "sql-adapter";
const SALT: &str = "tenant-7";

/// Token `t` of the event whose first engine hash is `h` (throughput batches).
fn token(h: u64, t: u64) -> u64 {
    (h.wrapping_mul(31) + t) % 150_000
}

/// Token `t` of lag sample `i`: above the throughput batches' tokens, and a
/// first block of its own for each of 150,000 samples (527 is prime to
/// 150,000), so no sample is visible before it is published.
fn lag_token(i: u64, t: u64) -> u64 {
    150_000 + (i * 527 + t) % 150_000
}

/// One batch of `events` BlockStored events continuing a chain of engine hashes;
/// with `identity`, as vLLM publishes a LoRA request with a cache salt.
fn batch(first_hash: u64, events: usize, blocks_per_event: usize, identity: bool) -> Vec<u8> {
    batch_of(first_hash, events, blocks_per_event, identity, &token, None)
}

/// [`batch`] with the tokens of `token(first engine hash of the event, t)`.
fn batch_of(
    first_hash: u64,
    events: usize,
    blocks_per_event: usize,
    identity: bool,
    token: &dyn Fn(u64, u64) -> u64,
    removed: Option<std::ops::Range<u64>>,
) -> Vec<u8> {
    let mut evs = Vec::new();
    let mut h = first_hash;
    for e in 0..events {
        let hashes: Vec<Value> = (0..blocks_per_event as u64)
            .map(|i| Value::from(h + i))
            .collect();
        let parent = if e == 0 {
            Value::Nil
        } else {
            Value::from(h - 1)
        };
        let tokens: Vec<Value> = (0..(blocks_per_event * BLOCK) as u64)
            .map(|t| Value::from(token(h, t)))
            .collect();
        let mut event = vec![
            Value::from("BlockStored"),
            Value::Array(hashes),
            parent,
            Value::Array(tokens),
            Value::from(BLOCK as u64),
            Value::Nil,
            Value::from("GPU"),
        ];
        if identity {
            // lora_id, lora_name, extra_keys: the adapter on every block, the salt
            // on block 0 of the request.
            event[5] = Value::from(1);
            event.push(Value::from(LORA));
            let extra = (0..blocks_per_event)
                .map(|i| {
                    let mut keys = vec![Value::from(LORA)];
                    if e == 0 && i == 0 {
                        keys.push(Value::from(SALT));
                    }
                    Value::Array(keys)
                })
                .collect();
            event.push(Value::Array(extra));
        }
        evs.push(Value::Array(event));
        h += blocks_per_event as u64;
    }
    if let Some(gone) = removed {
        let hashes = gone.map(Value::from).collect();
        evs.push(Value::Array(vec![
            Value::from("BlockRemoved"),
            Value::Array(hashes),
            Value::from("GPU"),
        ]));
    }
    let v = Value::Array(vec![Value::F64(now_secs()), Value::Array(evs), Value::Nil]);
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &v).expect("encode");
    out
}

fn message(seq: u64, payload: Vec<u8>) -> ZmqMessage {
    ZmqMessage::try_from(vec![
        Bytes::new(),
        Bytes::copy_from_slice(&seq.to_be_bytes()),
        Bytes::from(payload),
    ])
    .expect("frames")
}

struct Rig {
    router: Arc<Router>,
    metrics: Arc<KvEventMetrics>,
    publisher: PubSocket,
    _subscriber: Subscriber,
    seq: u64,
    scheme: &'static str,
    identity: bool,
    name: &'static str,
    /// IC_BENCH_LAG_POLL=spin: poll for visibility without ever giving up the
    /// core (the bench before this change), to compare.
    spin_poll: bool,
}

impl Rig {
    async fn new(name: &'static str) -> Self {
        let (scheme, identity) = match name.strip_suffix("+lora") {
            Some(s) => (s, true),
            None => (name, false),
        };
        let router = Arc::new(Router::new(
            IndexConfig {
                max_entries: 50_000_000,
            },
            PolicySnapshot::empty(),
            Timestamp::now(),
        ));
        // A second serving replica: with only one there is no choice to make and
        // the decision is never PREFIX_MATCH.
        let other = [IndexEvent::Stored {
            parent: None,
            hashes: vec![u64::MAX - 1],
            token_counts: Vec::new(),
        }];
        router
            .ingest(
                &IngestBatch {
                    scope: ScopeRef::new("bench", "model", scheme),
                    replica_id: "r1",
                    endpoint: "10.0.0.2:8000",
                    events: &other,
                },
                Timestamp::now(),
            )
            .expect("register r1");
        let metrics = Arc::new(KvEventMetrics::default());
        let mut publisher = PubSocket::new();
        let endpoint = publisher.bind("tcp://127.0.0.1:0").await.expect("bind");
        let subscriber = Subscriber::spawn(
            SubscriberConfig {
                scope: ScopeRef::new("bench", "model", scheme).to_owned(),
                replica_id: "r0".into(),
                address: "10.0.0.1:8000".into(),
                endpoint: endpoint.to_string(),
                replay_endpoint: None,
                topic: String::new(),
                queue_capacity: 1024,
                replay_timeout: Duration::from_secs(1),
                max_mappings: 1 << 24,
                rank: 0,
                ranks: 1,
            },
            router.clone(),
            metrics.clone(),
        );
        let mut rig = Self {
            router,
            metrics,
            publisher,
            _subscriber: subscriber,
            seq: 0,
            scheme,
            identity,
            name,
            spin_poll: std::env::var("IC_BENCH_LAG_POLL").is_ok_and(|v| v == "spin"),
        };
        // PUB drops until the subscription arrives.
        while rig.metrics.batches() == 0 {
            rig.send(batch(u64::MAX / 2, 0, 0, false)).await;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        rig
    }

    async fn send(&mut self, payload: Vec<u8>) {
        let seq = self.seq;
        self.seq += 1;
        self.publisher
            .send(message(seq, payload))
            .await
            .expect("send");
    }

    async fn throughput(&mut self, blocks: usize, pool: usize) -> f64 {
        let batches = blocks.div_ceil(BLOCKS_PER_BATCH);
        let pool_batches = pool.div_ceil(BLOCKS_PER_BATCH);
        let payloads: Vec<Vec<u8>> = (0..batches)
            .map(|i| {
                let first = 1 + (i * BLOCKS_PER_BATCH) as u64;
                // With a pool: the blocks of the batch `pool_batches` back go.
                let removed = (pool_batches > 0 && i >= pool_batches).then(|| {
                    let at = first - (pool_batches * BLOCKS_PER_BATCH) as u64;
                    at..at + BLOCKS_PER_BATCH as u64
                });
                batch_of(
                    first,
                    EVENTS_PER_BATCH,
                    BLOCKS_PER_EVENT,
                    self.identity,
                    &token,
                    removed,
                )
            })
            .collect();
        let base = self.metrics.batches();
        let start = Instant::now();
        // Waits sleep rather than spin: on a small machine a spinning publisher
        // takes the CPU the subscriber is being measured on. IN_FLIGHT batches
        // are several milliseconds of work, more than one timer tick.
        for (i, p) in payloads.into_iter().enumerate() {
            while i as u64 - (self.metrics.batches() - base) > IN_FLIGHT {
                tokio::time::sleep(Duration::from_micros(200)).await;
            }
            self.send(p).await;
        }
        while self.metrics.batches() - base < batches as u64 {
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
        let secs = start.elapsed().as_secs_f64();
        assert_eq!(self.metrics.gaps(), 0, "batches were lost on the wire");
        let held = self.router.view(Timestamp::now()).total_entries;
        println!(
            "{:>18}: {} blocks sent, {held} index entries afterwards",
            self.name,
            batches * BLOCKS_PER_BATCH
        );
        (batches * BLOCKS_PER_BATCH) as f64 / secs
    }

    fn visible(&self, chain: &[u64], counts: &[u32]) -> bool {
        let req = LookupRequest {
            tenant_id: "bench",
            model_id: "model",
            hash_scheme: self.scheme,
            block_hashes: chain,
            block_token_counts: counts,
            lora_adapter: if self.identity { LORA } else { "" },
            cache_salt: if self.identity { SALT } else { "" },
            ..LookupRequest::default()
        };
        let d = self.router.lookup(&req, Timestamp::now());
        d.reason == ReasonCode::PrefixMatch
    }

    /// Publish → visible in a lookup, polled by lookups back to back (a storm of
    /// lookups on the index lock): p50, p99 and the largest.
    async fn lag(&mut self, samples: usize) -> (Duration, Duration, Duration) {
        let mut lags = Vec::with_capacity(samples);
        for i in 0..samples {
            let first = (1u64 << 40) + (i as u64) * 1000;
            let tokens_of = |_h: u64, t: u64| lag_token(i as u64, t);
            let payload = batch_of(first, 1, 8, self.identity, &tokens_of, None);
            let chain: Vec<u64> = match Scheme::from_name(self.scheme) {
                Some(s @ (Scheme::ContentV1 | Scheme::ContentV2)) => {
                    let tokens: Vec<u32> = (0..(8 * BLOCK) as u64)
                        .map(|t| lag_token(i as u64, t) as u32)
                        .collect();
                    chain::compute_chain(s, &tokens, BLOCK as u32, None).expect("chain")
                }
                _ => (first..first + 8).collect(),
            };
            let counts = vec![BLOCK as u32; chain.len()];
            assert!(
                !self.visible(&chain, &counts),
                "lag sample {i} is visible before it was published"
            );
            let start = Instant::now();
            self.send(payload).await;
            while !self.visible(&chain, &counts) {
                if self.spin_poll {
                    tokio::task::yield_now().await;
                } else {
                    // Leaves the core to a runnable subscriber thread: a poller that
                    // never gives it up holds the core it shares with one for its
                    // whole scheduler slice (2-4 ms), and that was the lag measured.
                    std::thread::yield_now();
                }
                if start.elapsed() > Duration::from_secs(5) {
                    panic!("batch {i} never became visible");
                }
            }
            lags.push(start.elapsed());
        }
        lags.sort();
        let at = |q: f64| lags[((lags.len() as f64 * q) as usize).min(lags.len() - 1)];
        (at(0.50), at(0.99), lags[lags.len() - 1])
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let blocks = env("IC_BENCH_BLOCKS", 1 << 19);
    let pool = env("IC_BENCH_POOL", 0);
    let samples = env("IC_BENCH_LAG_SAMPLES", 500);
    println!(
        "kv_events bench: {blocks} blocks per scheme, {BLOCKS_PER_BATCH} blocks per batch, real ZMQ socket on loopback{}",
        if pool > 0 {
            format!(", a pool of {pool} blocks (older ones removed)")
        } else {
            String::new()
        }
    );
    let schemes = std::env::var("IC_BENCH_SCHEMES").unwrap_or_else(|_| {
        "engine-raw,ic-content-v1,ic-content-v2,ic-content-v2+lora".to_string()
    });
    for scheme in schemes.split(',') {
        let scheme: &'static str = match scheme.trim() {
            "engine-raw" => "engine-raw",
            "ic-content-v1" => "ic-content-v1",
            "ic-content-v2" => "ic-content-v2",
            "ic-content-v2+lora" => "ic-content-v2+lora",
            other => panic!("IC_BENCH_SCHEMES: unknown {other:?}"),
        };
        let mut rig = Rig::new(scheme).await;
        let rate = rig.throughput(blocks, pool).await;
        let (p50, p99, max) = rig.lag(samples).await;
        // Targets: the xxh3 scheme 3M blocks/s; the others 500k.
        let target = if scheme.starts_with("ic-content-v2") {
            3_000_000.0
        } else {
            500_000.0
        };
        println!(
            "{scheme:>18}: decode+apply {:>10.0} blocks/s ({} {target}), publish→visible lag p50 {:?} p99 {:?} max {:?}",
            rate,
            if rate >= target {
                "target met:"
            } else {
                "BELOW target"
            },
            p50,
            p99,
            max
        );
    }
}
