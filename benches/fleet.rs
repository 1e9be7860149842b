//! Fleet sync's cost per routed request and its lag.
//!
//! 1. In process (no NATS): the bytes of one routed request's facts (routed,
//!    prefill ended, released) and the CPU both ends spend on them: the
//!    publisher's encoding, and the receiver's decoding, checks and ledger
//!    update ([`subscriber::receive`], which writes the peer load every
//!    decision reads); then again with flow control on for the tenant, where
//!    the receiver also charges each route to the tenant's share.
//! 2. Through a real nats-server on loopback: a routed fact published by a raw
//!    client until the receiving sidecar's saturation check
//!    ([`Router::pressures`], the same load cells the decision reads) shows its
//!    tokens, and its release until they are gone; p50/p99/max.
//!
//! Run: `INFERENCECACHE_NATS_SERVER=$(bash e2e/nats/install.sh) cargo bench --bench fleet`.
//! Without the variable only part 1 runs (part 2 says so). Environment:
//! IC_BENCH_FLEET_REQUESTS (default 200,000), IC_BENCH_FLEET_SAMPLES (default 2,000).

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use inferencecache::adapters::ext_proc::flow::FlowGate;
use inferencecache::adapters::fleet::metrics::FleetMetrics;
use inferencecache::adapters::fleet::subjects::Subjects;
use inferencecache::adapters::fleet::subscriber::{Received, receive};
use inferencecache::adapters::fleet::{self, FleetConfig, NatsAccess, wire};
use inferencecache::adapters::metrics::flow::FlowMetrics;
use inferencecache::core::Router;
use inferencecache::core::flow::saturation::Thresholds;
use inferencecache::core::index::{IndexConfig, IndexEvent, IngestBatch};
use inferencecache::core::load::RouteFacts;
use inferencecache::core::load::peer_ledger::{Fact, Message};
use inferencecache::core::policy::{FlowControl, ResolvedPolicy};
use inferencecache::core::scope::ScopeRef;
use inferencecache::core::snapshot::PolicySnapshot;
use inferencecache::core::time::Timestamp;

const FLEET: &str = "bench";
const SCOPE: (&str, &str, &str) = ("tenant-a", "llama-3-8b", "vllm-sha256-cbor");
const REPLICA: &str = "llama-3-8b-7d9f8c6b5-x2k4q";
/// A start's epoch is its time in nanoseconds, as a publisher's is.
const EPOCH: u64 = 1_800_000_000_000_000_000;
const TOKENS: u64 = 1536;
const PROMPT_TOKENS: u64 = 2048;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn scope() -> ScopeRef<'static> {
    ScopeRef::new(SCOPE.0, SCOPE.1, SCOPE.2)
}

/// A router that knows the replica the peer routes to; `join`: in a fleet as
/// `b` with nowhere to publish (part 2 joins through the fleet adapter).
fn receiver(join: bool) -> Arc<Router> {
    receiver_under(join, PolicySnapshot::empty())
}

/// [`receiver`] (joined) with flow control on for every tenant, and a flow
/// gate, as the ext_proc service sets one up, charging the peers' routes.
fn receiver_with_flow() -> (Arc<Router>, Arc<FlowGate>) {
    let policy = ResolvedPolicy {
        flow_control: FlowControl {
            enabled: true,
            ..FlowControl::default()
        },
        ..ResolvedPolicy::default()
    };
    let router = receiver_under(true, PolicySnapshot::new(policy, Vec::new(), Vec::new()));
    let gate = Arc::new(FlowGate::new(
        router.clone(),
        Arc::new(FlowMetrics::default()),
        Thresholds::default(),
    ));
    router.share_fleet_service(Arc::downgrade(&gate) as std::sync::Weak<_>);
    (router, gate)
}

fn receiver_under(join: bool, snapshot: PolicySnapshot) -> Arc<Router> {
    let router = Arc::new(Router::new(
        IndexConfig::default(),
        snapshot,
        Timestamp::now(),
    ));
    let events = [IndexEvent::Stored {
        parent: None,
        hashes: vec![1],
        token_counts: Vec::new(),
    }];
    router
        .ingest(
            &IngestBatch {
                scope: scope(),
                replica_id: REPLICA,
                endpoint: "10.12.7.31:8000",
                events: &events,
            },
            Timestamp::now(),
        )
        .expect("register the replica");
    if join {
        assert!(
            router.join_fleet("b", Arc::new(Nowhere)),
            "a new router joins once"
        );
    }
    router
}

/// The receiver's own routes go nowhere: only its peers' facts are measured.
#[derive(Debug)]
struct Nowhere;
impl RouteFacts for Nowhere {
    fn publish(&self, _: Fact) {}
}

/// One routed request's facts from peer `a`, numbered from `seq`.
fn request_facts(route: u64, seq: u64) -> [Message; 3] {
    let msg = |seq, fact| Message {
        peer: "a".into(),
        epoch: EPOCH,
        seq,
        fact,
    };
    [
        msg(
            seq,
            Fact::Routed {
                route,
                scope: scope().to_owned(),
                replica: REPLICA.into(),
                uncached_tokens: TOKENS,
                prompt_tokens: PROMPT_TOKENS,
                priority: 0,
                held: false,
                pending: Vec::new(),
            },
        ),
        msg(seq + 1, Fact::PrefillEnded { route }),
        msg(seq + 2, Fact::Released { route }),
    ]
}

/// `flow`: flow control on for the tenant (each route charged to its share).
fn cpu_per_request(requests: usize, flow: bool) {
    let (router, _gate) = match flow {
        true => {
            let (router, gate) = receiver_with_flow();
            (router, Some(gate))
        }
        false => (receiver(true), None),
    };
    let subjects = Subjects::new(FLEET);
    let subject = subjects.routes_of("a");
    let (mut encode_ns, mut receive_ns, mut bytes) = (0u128, 0u128, 0usize);
    const CHUNK: usize = 1000;
    let mut seq = 1;
    let mut route = 1 << 40;
    for _ in 0..requests.div_ceil(CHUNK) {
        let t = Instant::now();
        let mut encoded = Vec::with_capacity(CHUNK * 3);
        for _ in 0..CHUNK {
            for msg in request_facts(route, seq) {
                encoded.push(wire::encode(&msg));
            }
            route += 1;
            seq += 3;
        }
        encode_ns += t.elapsed().as_nanos();
        bytes += encoded.iter().map(Vec::len).sum::<usize>();
        let t = Instant::now();
        for payload in &encoded {
            let outcome = receive(&router, &subjects, "b", &subject, payload, Timestamp::now());
            assert_eq!(outcome, Received::Applied);
        }
        receive_ns += t.elapsed().as_nanos();
    }
    let n = (requests.div_ceil(CHUNK) * CHUNK) as f64;
    let flow = if flow {
        ", flow control on (each route charged to its tenant)"
    } else {
        ""
    };
    println!(
        "fleet sync per routed request (routed + prefill ended + released), {n} requests{flow}:"
    );
    println!(
        "  payload bytes: {:.1} (routed {}, prefill ended {}, released {}; plus the subject, {} bytes a message)",
        bytes as f64 / n,
        wire::encode(&request_facts(1 << 40, 1 << 20)[0]).len(),
        wire::encode(&request_facts(1 << 40, 1 << 20)[1]).len(),
        wire::encode(&request_facts(1 << 40, 1 << 20)[2]).len(),
        subject.len(),
    );
    println!(
        "  publisher, encoding: {:.2} µs",
        encode_ns as f64 / n / 1e3
    );
    println!(
        "  each receiving peer, decode + checks + ledger: {:.2} µs",
        receive_ns as f64 / n / 1e3
    );
    let left = router.pressures(scope(), &[], Timestamp::now());
    assert_eq!(left[0].backlog_tokens, 0, "every route released");
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

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1e6
}

fn print_lag(what: &str, mut lags: Vec<Duration>) {
    lags.sort();
    println!(
        "  {what}: p50 {:.0} µs, p90 {:.0} µs, p99 {:.0} µs, max {:.0} µs ({} samples)",
        percentile(&lags, 0.5),
        percentile(&lags, 0.9),
        percentile(&lags, 0.99),
        percentile(&lags, 1.0),
        lags.len()
    );
}

/// Spins (yielding) until the receiver's backlog on the replica is `tokens`.
async fn visible(router: &Router, tokens: u64, deadline: Duration) {
    let start = Instant::now();
    while router.pressures(scope(), &[], Timestamp::now())[0].backlog_tokens != tokens {
        assert!(
            start.elapsed() < deadline,
            "not visible within {deadline:?}"
        );
        // Give the core to the subscriber and nats-server (two cores, three
        // busy parties): a spinning waiter would be measured, not the sync.
        std::thread::yield_now();
        tokio::task::yield_now().await;
    }
}

async fn lag(server: &str, samples: usize) {
    let port = free_port();
    let _server = NatsServer(
        Command::new(server)
            .args(["-a", "127.0.0.1", "-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start nats-server"),
    );
    let url = format!("nats://127.0.0.1:{port}");
    let sender = {
        let start = Instant::now();
        loop {
            match async_nats::connect(url.as_str()).await {
                Ok(c) => break c,
                Err(e) if start.elapsed() < Duration::from_secs(10) => {
                    let _ = e;
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => panic!("nats-server at {url}: {e}"),
            }
        }
    };
    let router = receiver(false);
    let config = FleetConfig {
        access: NatsAccess {
            url: url.clone(),
            ..NatsAccess::default()
        },
        id: "b".into(),
        name: FLEET.into(),
        relay_kv_events: false,
        snapshot_interval: std::time::Duration::from_secs(30),
    };
    let sync = fleet::start(&config, router.clone(), Arc::new(FleetMetrics::default()))
        .await
        .expect("fleet sync");
    let subject = Subjects::new(FLEET).routes_of("a");
    let publish = |msg: Message| {
        let (sender, subject) = (sender.clone(), subject.clone());
        async move {
            sender
                .publish(subject, wire::encode(&msg).into())
                .await
                .expect("publish");
            sender.flush().await.expect("flush");
        }
    };
    // Heartbeats until the receiver has subscribed and heard the peer.
    let mut seq = 1;
    let start = Instant::now();
    while router.fleet_peers() == 0 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "peer never heard"
        );
        publish(Message {
            peer: "a".into(),
            epoch: EPOCH,
            seq,
            fact: Fact::Heartbeat,
        })
        .await;
        seq += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (mut routed, mut released) = (Vec::new(), Vec::new());
    for route in 0..samples as u64 {
        let [r, _, rel] = request_facts(route, seq);
        let rel = Message {
            seq: seq + 1,
            ..rel
        };
        seq += 2;
        let t = Instant::now();
        publish(r).await;
        visible(&router, TOKENS, Duration::from_secs(5)).await;
        routed.push(t.elapsed());
        let t = Instant::now();
        publish(rel).await;
        visible(&router, 0, Duration::from_secs(5)).await;
        released.push(t.elapsed());
    }
    println!("fleet sync through nats-server on loopback, published → visible in the peer's load:");
    print_lag("routed", routed);
    print_lag("released", released);
    sync.abort();
}

fn main() {
    let requests = env_usize("IC_BENCH_FLEET_REQUESTS", 200_000);
    cpu_per_request(requests, false);
    cpu_per_request(requests, true);
    let samples = env_usize("IC_BENCH_FLEET_SAMPLES", 2_000);
    match std::env::var("INFERENCECACHE_NATS_SERVER") {
        Ok(server) if !server.is_empty() => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime")
            .block_on(lag(&server, samples)),
        _ => println!(
            "published → visible: not measured (set INFERENCECACHE_NATS_SERVER=$(bash e2e/nats/install.sh))"
        ),
    }
}
