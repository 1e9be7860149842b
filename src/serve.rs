//! `inferencecache serve`: wires the policy source (a file, or the Kubernetes
//! watches and the status writer), the router, the gRPC side (ext_proc +
//! LookupRoute + health + reflection on `--grpc-addr`; IngestEvents + ReportStats +
//! health on `--ingest-addr`) and the admin HTTP side together, and runs them until
//! SIGINT/SIGTERM, then drains.
//!
//! ```text
//!  policy_file::watch ─┐
//!  kubernetes::watch ──┴install──▶ Router ◀── ExtProc, CacheApi::lookup_only (tonic, --grpc-addr)
//!                                    ▲  ◀──── CacheApi::ingest_only + IngestGuard (tonic, --ingest-addr)
//!                                    ▲  ◀── admin routes (axum, --admin-addr)
//!             maintain task (1 s) ───┘
//! ```
//!
//! Drain (SIGTERM or SIGINT): `/readyz` answers 503 and gRPC health NOT_SERVING at
//! once; ext_proc refuses new streams; both gRPC listeners stop accepting and send
//! GOAWAY; in-flight calls and streams get until `--drain-timeout`; the KV event
//! subscribers close; the admin server stops last; exit 0. A second signal cuts
//! the drain short.

use std::future::IntoFuture;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::builder::{PossibleValuesParser, TypedValueParser};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tonic::transport::ServerTlsConfig;
use tracing::Instrument;

use crate::adapters::admin::{self, AdminState};
use crate::adapters::body::{self, BodyMode, store::TokenizerStore};
use crate::adapters::drain::Drain;
use crate::adapters::engine_metrics::{self, supervisor::Scrapers};
use crate::adapters::ext_proc::headers::DEFAULT_DESTINATION_HEADER;
use crate::adapters::ext_proc::{DestinationMode, ExtProc, ExtProcConfig, InflightRelease};
use crate::adapters::fleet::{self, FleetConfig, NatsAccess};
use crate::adapters::grpc::CacheApi;
use crate::adapters::ingest::{IngestGuard, IngestLimits, IngestTokens};
use crate::adapters::kubernetes::{self, leader::LeaseConfig};
use crate::adapters::kv_events::supervisor::Subscribers;
use crate::adapters::metrics::Metrics;
use crate::adapters::policy_file::{self, SourceStatus};
use crate::adapters::tls;
use crate::core::Router;
use crate::core::index::IndexConfig;
use crate::core::snapshot::PolicySnapshot;
use crate::core::time::Timestamp;
use crate::crd::objects::PolicyObjects;
use crate::proto::v1::FILE_DESCRIPTOR_SET;

/// Whether clients may ask for the decision on their response headers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DebugHeaders {
    Allowed,
    Disabled,
}

/// `inferencecache serve` flags (docs/reference.md, "Command line").
#[derive(Clone, Debug, clap::Args)]
pub struct ServeArgs {
    /// Policy file or directory of CachePolicy, CacheTenant and CacheBackend YAML
    /// (file mode). Reloaded on change; a bad edit keeps the last good policy.
    #[arg(long, value_name = "PATH")]
    pub config: Option<PathBuf>,
    /// Watch the CRDs and the engine pods in the Kubernetes cluster (in-cluster
    /// config or kubeconfig); the replica holding the Lease writes status. With
    /// --config as well, the file's objects are resolved together with the
    /// cluster's (where both define a namespace's policy or tenant, the cluster's
    /// object wins).
    #[arg(long)]
    pub kubernetes: bool,
    /// Namespace of the status-writer Lease (Kubernetes mode).
    #[arg(
        long,
        value_name = "NS",
        env = "POD_NAMESPACE",
        default_value = "default"
    )]
    pub lease_namespace: String,
    /// Name of the status-writer Lease (Kubernetes mode).
    #[arg(long, value_name = "NAME", default_value = LeaseConfig::DEFAULT_NAME)]
    pub lease_name: String,
    /// This replica's identity in the Lease; defaults to $POD_NAME, then $HOSTNAME.
    #[arg(long, value_name = "ID", env = "POD_NAME")]
    pub lease_identity: Option<String>,
    /// How long the status-writer Lease lasts without renewal (whole seconds, at
    /// least 3s). The holder renews every fifth of it and stops writing a fifth
    /// before it would expire, even when the apiserver cannot be reached.
    #[arg(long, value_name = "DURATION", default_value = "15s", value_parser = parse_lease_duration)]
    pub lease_duration: Duration,
    /// Address of the gRPC server Envoy calls: ext_proc, CacheService/LookupRoute,
    /// gRPC health and reflection. IngestEvents and ReportStats are refused here.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:50051")]
    pub grpc_addr: SocketAddr,
    /// PEM certificate (chain) for the --grpc-addr listener: serve ext_proc and
    /// LookupRoute over TLS (GIE gateways call their endpoint picker over TLS).
    #[arg(long, value_name = "PATH", requires = "grpc_tls_key")]
    pub grpc_tls_cert: Option<PathBuf>,
    /// PEM private key for --grpc-tls-cert.
    #[arg(long, value_name = "PATH", requires = "grpc_tls_cert")]
    pub grpc_tls_key: Option<PathBuf>,
    /// Serve --grpc-addr over TLS with a certificate generated at start (what GIE's
    /// endpoint picker does; gateways do not verify it). Excludes --grpc-tls-cert.
    #[arg(long, conflicts_with = "grpc_tls_cert")]
    pub grpc_tls_self_signed: bool,
    /// Address of the ingest listener: CacheService/IngestEvents and ReportStats
    /// (and gRPC health), behind the optional token and mTLS below and the
    /// per-caller limits.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:50052")]
    pub ingest_addr: SocketAddr,
    /// Bearer tokens the ingest listener accepts, one per line as `NAME:TOKEN`
    /// (or a bare TOKEN); callers send `authorization: Bearer TOKEN`. Read at start.
    #[arg(long, value_name = "PATH")]
    pub ingest_token_file: Option<PathBuf>,
    /// PEM certificate (chain) of the ingest listener: serve it over TLS.
    #[arg(long, value_name = "PATH", requires = "ingest_tls_key")]
    pub ingest_tls_cert: Option<PathBuf>,
    /// PEM private key for --ingest-tls-cert.
    #[arg(long, value_name = "PATH", requires = "ingest_tls_cert")]
    pub ingest_tls_key: Option<PathBuf>,
    /// PEM CA bundle: the ingest listener requires a client certificate signed by
    /// it (mTLS; the certificate's common name is the caller). Needs --ingest-tls-cert.
    #[arg(long, value_name = "PATH", requires = "ingest_tls_cert")]
    pub ingest_client_ca: Option<PathBuf>,
    /// Per-caller KV events (and ReportStats calls) per second on the ingest
    /// listener; a second's worth may come at once. 0 = no limit.
    #[arg(long, value_name = "N", default_value_t = IngestLimits::DEFAULT_EVENTS_PER_SEC)]
    pub ingest_max_events_per_sec: u32,
    /// Per-caller index entries (block hashes stored or removed, prefixes) per
    /// second on the ingest listener. 0 = no limit.
    #[arg(long, value_name = "N", default_value_t = IngestLimits::DEFAULT_ENTRIES_PER_SEC)]
    pub ingest_max_entries_per_sec: u32,
    /// How long in-flight ext_proc streams and gRPC calls may run on after
    /// SIGTERM/SIGINT before they are cut (Go-style duration: 10s, 500ms, 1m).
    #[arg(long, value_name = "DURATION", default_value = "10s",
          value_parser = parse_drain_timeout)]
    pub drain_timeout: Duration,
    /// Address of the admin HTTP server: /healthz /readyz /metrics /snapshot /policy.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:9090")]
    pub admin_addr: SocketAddr,
    /// What a request without a hint gets. override-host: no routing header, Envoy's
    /// override_host cluster round-robins. original-dst: always exactly one ip:port
    /// (a serving replica of the scope), or a 503 when the scope has none.
    #[arg(long, value_name = "MODE", default_value_t = DestinationMode::OverrideHost,
          value_parser = PossibleValuesParser::new(["override-host", "original-dst"])
              .try_map(|s| s.parse::<DestinationMode>()))]
    pub destination_mode: DestinationMode,
    /// Cap on index entries across all tenants; the cap sweep evicts down to it.
    #[arg(long, value_name = "N", default_value_t = IndexConfig::default().max_entries)]
    pub index_max_entries: u64,
    /// Whether `x-inferencecache-debug: 1` echoes the decision on the response.
    #[arg(long, value_name = "WHEN", value_enum, default_value_t = DebugHeaders::Allowed)]
    pub debug_headers: DebugHeaders,
    /// Name of the routing header written toward Envoy (the dynamic metadata key in
    /// `envoy.lb` stays `x-gateway-destination-endpoint`).
    #[arg(long, value_name = "NAME", default_value = DEFAULT_DESTINATION_HEADER)]
    pub destination_header: String,
    /// When a routed request stops counting in the load rule's in-flight signal.
    /// prefill-end: when its engine's KV events store its last block, so Envoy
    /// skips the response headers (a round trip on every response; a request
    /// whose blocks are all cached ends at once); only for a request with a
    /// chain to a replica whose events and metrics (or ReportStats) are live,
    /// others as response-headers. response-headers: at its response headers,
    /// always.
    #[arg(long, value_name = "WHEN", value_enum, default_value_t = InflightRelease::PrefillEnd)]
    pub inflight_release: InflightRelease,
    /// How often the policy path is checked for changes, in milliseconds.
    #[arg(long, value_name = "MS", default_value_t = 1000)]
    pub policy_poll_ms: u64,
    /// Body mode: the largest request body read for its prompt; a larger one is
    /// served without a hint (reason body_too_large).
    #[arg(long, value_name = "BYTES", default_value_t = body::DEFAULT_MAX_BODY_BYTES)]
    pub max_body_bytes: usize,
    /// Body mode: how often the tokenizer directories (CacheBackend
    /// spec.tokenizer.path) are checked for changed files, in milliseconds.
    #[arg(long, value_name = "MS", default_value_t = 5000)]
    pub tokenizer_poll_ms: u64,
    /// Fleet sync: the NATS server(s) (`nats://host:4222`, comma-separated)
    /// through which the sidecars of one fleet share their routes as they
    /// happen. Absent: this sidecar routes on its own view.
    #[arg(long, value_name = "URL")]
    pub fleet_nats: Option<String>,
    /// This sidecar's id in its fleet (letters, digits, '-', '_'); defaults to
    /// $POD_NAME, then the host name.
    #[arg(long, value_name = "ID", requires = "fleet_nats")]
    pub fleet_id: Option<String>,
    /// The fleet's name: prefixes every subject, so two fleets can share one NATS.
    #[arg(long, value_name = "NAME", default_value = fleet::DEFAULT_NAME)]
    pub fleet_name: String,
    /// NATS credentials file (user JWT and NKey seed) for --fleet-nats.
    #[arg(long, value_name = "PATH", requires = "fleet_nats")]
    pub fleet_nats_creds: Option<PathBuf>,
    /// File holding the NATS token for --fleet-nats.
    #[arg(long, value_name = "PATH", requires = "fleet_nats")]
    pub fleet_nats_token_file: Option<PathBuf>,
    /// PEM CA bundle the NATS server's certificate must be signed by (TLS
    /// required then).
    #[arg(long, value_name = "PATH", requires = "fleet_nats")]
    pub fleet_nats_tls_ca: Option<PathBuf>,
    /// With --fleet-nats: how engine KV events reach the sidecars. `stream`: one
    /// sidecar per engine relays them through the fleet's JetStream stream,
    /// every sidecar applies the stream, and a new sidecar starts from the
    /// fleet's index snapshot. `direct`: each sidecar follows every engine
    /// itself, as one alone does.
    #[arg(long, value_name = "MODE", default_value = "stream", value_parser = ["stream", "direct"])]
    pub fleet_kv_events: String,
    /// With --fleet-kv-events stream: how often one sidecar writes the fleet's
    /// index snapshot that new sidecars start from (Go-style duration).
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = parse_snapshot_interval)]
    pub fleet_snapshot_interval: Duration,
}

/// Runs the server until a shutdown signal, then drains.
pub async fn run(args: ServeArgs) -> anyhow::Result<()> {
    run_until(args, shutdown_signal()).await
}

/// Runs the server until `stop` resolves, then drains (see the module docs).
pub async fn run_until(
    args: ServeArgs,
    stop: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    if args.config.is_none() && !args.kubernetes {
        bail!("--config PATH (a policy file or directory) or --kubernetes is required");
    }
    let header = args.destination_header.to_ascii_lowercase();
    if header.is_empty()
        || !header
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-')
    {
        bail!(
            "--destination-header {:?} is not a header name",
            args.destination_header
        );
    }

    let now = Timestamp::now();
    let status = Arc::new(SourceStatus::new());
    let index = IndexConfig {
        max_entries: args.index_max_entries,
    };
    // Each CacheBackend's spec.metrics, beside the snapshot (the core has no field for it).
    let scrape_specs = Arc::new(engine_metrics::Specs::default());
    // Each CacheBackend's spec.tokenizer (body mode), beside the snapshot too.
    let tokenizers = Arc::new(TokenizerStore::default());
    let (router, source_name, policy_source, lease) = match &args.config {
        Some(config_path) if args.kubernetes => {
            // Validate the file up front, as in file mode; then feed its objects
            // to the cluster watcher, which resolves both and installs.
            let loaded = policy_file::load(config_path).map_err(|e| {
                anyhow::anyhow!("{}: policy not loaded:\n{e}", config_path.display())
            })?;
            let (file_tx, file_rx) = tokio::sync::watch::channel(Arc::new(loaded.objects));
            let router = Arc::new(Router::new(index, PolicySnapshot::empty(), now));
            let KubernetesTasks { mut tasks, resign } = start_kubernetes(
                &args,
                router.clone(),
                status.clone(),
                file_rx,
                scrape_specs.clone(),
                tokenizers.clone(),
            )
            .await?;
            tasks.push(tokio::spawn(
                policy_file::watch_loaded(
                    config_path.clone(),
                    Duration::from_millis(args.policy_poll_ms.max(10)),
                    move |l: policy_file::Loaded| {
                        file_tx.send_replace(Arc::new(l.objects));
                    },
                    status.clone(),
                )
                .instrument(tracing::info_span!("policy_file", path = %config_path.display())),
            ));
            let name = format!("kubernetes + {}", config_path.display());
            (router, name, tasks, Some(resign))
        }
        Some(config_path) => {
            // The first load must succeed: there is no last good policy to fall back to.
            let loaded = policy_file::load(config_path).map_err(|e| {
                anyhow::anyhow!("{}: policy not loaded:\n{e}", config_path.display())
            })?;
            status.record_success(loaded.snapshot.revision().clone(), now);
            scrape_specs.set(loaded.objects.each_backend());
            tokenizers.set(loaded.objects.each_backend());
            let router = Arc::new(Router::new(index, loaded.snapshot, now));
            let watcher = {
                let (router, recorder, specs, tokenizers) = (
                    router.clone(),
                    status.clone(),
                    scrape_specs.clone(),
                    tokenizers.clone(),
                );
                tokio::spawn(
                    policy_file::watch_loaded(
                        config_path.clone(),
                        Duration::from_millis(args.policy_poll_ms.max(10)),
                        move |l: policy_file::Loaded| {
                            let (now, revision) = (Timestamp::now(), l.snapshot.revision().clone());
                            specs.set(l.objects.each_backend());
                            tokenizers.set(l.objects.each_backend());
                            router.install(l.snapshot, now);
                            recorder.record_success(revision, now);
                        },
                        status.clone(),
                    )
                    .instrument(tracing::info_span!("policy_file", path = %config_path.display())),
                )
            };
            (
                router,
                config_path.display().to_string(),
                vec![watcher],
                None,
            )
        }
        None => {
            // Not ready (/readyz) until the first snapshot from the cluster.
            let router = Arc::new(Router::new(index, PolicySnapshot::empty(), now));
            // No file objects: the sender goes at once, and the watcher stops
            // listening for them.
            let (_, file_rx) = tokio::sync::watch::channel(Arc::default());
            let KubernetesTasks { tasks, resign } = start_kubernetes(
                &args,
                router.clone(),
                status.clone(),
                file_rx,
                scrape_specs.clone(),
                tokenizers.clone(),
            )
            .await?;
            (router, "kubernetes".to_string(), tasks, Some(resign))
        }
    };
    let mut metrics = Metrics::new(router.clone(), status.clone());
    metrics.register_collector(Box::new(body::store::CacheCollector(tokenizers.clone())));
    let metrics = Arc::new(metrics);

    // Everything that reads files is checked before anything listens.
    let tokens = args
        .ingest_token_file
        .as_deref()
        .map(IngestTokens::load)
        .transpose()?;
    let tls = ingest_tls(&args)?;
    let grpc_tls = grpc_tls(&args)?;
    let grpc_tls_on = grpc_tls.is_some();
    if tokens.is_none() && args.ingest_client_ca.is_none() && !args.ingest_addr.ip().is_loopback() {
        tracing::warn!(ingest = %args.ingest_addr,
            "the ingest listener has neither --ingest-token-file nor --ingest-client-ca: \
             anyone who reaches it can write the index");
    }
    // Fleet sync checks its flags and files here too, then connects in the
    // background: NATS down at start is not an error.
    let fleet_sync = match fleet_config(&args) {
        Some(config) => Some(fleet::start(&config, router.clone(), metrics.fleet().clone()).await?),
        None => None,
    };
    let guard = Arc::new(IngestGuard::new(
        tokens,
        IngestLimits {
            events_per_sec: args.ingest_max_events_per_sec,
            entries_per_sec: args.ingest_max_entries_per_sec,
        },
        metrics.clone(),
    ));

    let grpc_listener = TcpListener::bind(args.grpc_addr)
        .await
        .with_context(|| format!("binding --grpc-addr {}", args.grpc_addr))?;
    let ingest_listener = TcpListener::bind(args.ingest_addr)
        .await
        .with_context(|| format!("binding --ingest-addr {}", args.ingest_addr))?;
    let admin_listener = TcpListener::bind(args.admin_addr)
        .await
        .with_context(|| format!("binding --admin-addr {}", args.admin_addr))?;

    // Engine KV event subscribers follow the declared replicas of whichever
    // snapshot is installed, from the file or from the cluster.
    let subscribers = Arc::new(Subscribers::with_relay(
        router.clone(),
        metrics.kv_events().clone(),
        fleet_sync.as_ref().and_then(|f| f.kv_relay()),
    ));
    let follower = tokio::spawn(
        follow_snapshots(router.clone(), subscribers.clone())
            .instrument(tracing::info_span!("kv_event_supervisor")),
    );
    let maintenance =
        tokio::spawn(maintain(router.clone()).instrument(tracing::info_span!("index_maintenance")));
    // Engine /metrics scrapers follow the same snapshots (and spec.metrics).
    let scrapers = Scrapers::new(
        router.clone(),
        metrics.engine_metrics().clone(),
        scrape_specs,
    );
    let scrape_follower = tokio::spawn(
        engine_metrics::supervisor::follow(router.clone(), Arc::new(scrapers))
            .instrument(tracing::info_span!("engine_scrape_supervisor")),
    );

    // Body mode: the tokenizers load (and reload) in the background; until the
    // first load a body request falls back (reason no_tokenizer, "still loading").
    let tokenizer_follower = tokio::spawn(
        tokenizers
            .clone()
            .follow(Duration::from_millis(args.tokenizer_poll_ms.max(100)))
            .instrument(tracing::info_span!("tokenizers")),
    );
    // The ext_proc stream reads a body only when Envoy sends it (a body mode in
    // its processing_mode) and this router wants it (no chain header, OpenAI path).
    let body_router: Arc<dyn crate::adapters::ext_proc::body::BodyRouter> = Arc::new(
        BodyMode::new(router.clone(), tokenizers.clone(), args.max_body_bytes),
    );

    let drain = Drain::new();
    let ext_proc = ExtProc::new(
        router.clone(),
        metrics.clone(),
        ExtProcConfig {
            destination_mode: args.destination_mode,
            debug_headers_allowed: args.debug_headers == DebugHeaders::Allowed,
            destination_header: header,
            inflight_release: args.inflight_release,
            ..ExtProcConfig::default()
        },
    )
    .with_drain(drain.clone())
    .with_body_router(body_router)
    .into_server();
    let lookup_api = CacheApi::lookup_only(router.clone(), metrics.clone()).into_server();
    let ingest_api = CacheApi::ingest_only(router.clone(), metrics.clone(), guard).into_server();
    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_serving::<CacheServer>().await;
    health.set_serving::<ExtProcServer>().await;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(FILE_DESCRIPTOR_SET)
        .build_v1()
        .context("building gRPC reflection")?;

    tracing::info!(grpc = %args.grpc_addr, ingest = %args.ingest_addr, admin = %args.admin_addr,
        grpc_tls = grpc_tls_on, ingest_tls = tls.is_some(), ingest_mtls = args.ingest_client_ca.is_some(),
        ingest_tokens = args.ingest_token_file.is_some(),
        mode = %args.destination_mode, policy = %source_name, "serving");

    let drained = |d: &Drain| {
        let d = d.clone();
        async move { d.started().await }
    };
    let mut grpc_builder = tonic::transport::Server::builder();
    if let Some(tls) = grpc_tls {
        grpc_builder = grpc_builder
            .tls_config(tls)
            .context("--grpc-tls-cert/--grpc-tls-key/--grpc-tls-self-signed")?;
    }
    let mut grpc: JoinHandle<Result<(), tonic::transport::Error>> = tokio::spawn(
        grpc_builder
            // Under a burst Envoy resets ext_proc streams it gave up on (message
            // timeout) before we accepted them; hyper's default of 20 such resets
            // answers GOAWAY ENHANCE_YOUR_CALM and drops every stream on the
            // connection. Envoy is a trusted peer here: allow many.
            .http2_max_pending_accept_reset_streams(Some(10_000))
            .add_service(health_service.clone())
            .add_service(reflection)
            .add_service(lookup_api)
            .add_service(ext_proc)
            .serve_with_incoming_shutdown(no_delay(grpc_listener), drained(&drain))
            .instrument(tracing::info_span!("grpc_server", addr = %args.grpc_addr)),
    );
    let mut ingest_builder = tonic::transport::Server::builder();
    if let Some(tls) = tls {
        ingest_builder = ingest_builder
            .tls_config(tls)
            .context("--ingest-tls-cert/--ingest-tls-key/--ingest-client-ca")?;
    }
    let mut ingest: JoinHandle<Result<(), tonic::transport::Error>> = tokio::spawn(
        ingest_builder
            .add_service(health_service)
            .add_service(ingest_api)
            .serve_with_incoming_shutdown(no_delay(ingest_listener), drained(&drain))
            .instrument(tracing::info_span!("ingest_server", addr = %args.ingest_addr)),
    );
    // The admin server outlives the drain, so /readyz shows it.
    let admin_stop = Drain::new();
    let mut admin: JoinHandle<std::io::Result<()>> = tokio::spawn(
        axum::serve(
            admin_listener,
            admin::routes(AdminState {
                router,
                metrics,
                source: status,
                source_name,
                drain: drain.clone(),
                tokenizers,
            }),
        )
        .with_graceful_shutdown(drained(&admin_stop))
        .into_future()
        .instrument(tracing::info_span!("admin_server", addr = %args.admin_addr)),
    );

    let background = || {
        follower.abort();
        scrape_follower.abort();
        tokenizer_follower.abort();
        maintenance.abort();
        for task in &policy_source {
            task.abort();
        }
    };
    let early = tokio::select! {
        () = stop => None,
        r = &mut grpc => Some(ended("the gRPC server (--grpc-addr)", r.map(|r| r.map_err(anyhow::Error::from)))),
        r = &mut ingest => Some(ended("the ingest server (--ingest-addr)", r.map(|r| r.map_err(anyhow::Error::from)))),
        r = &mut admin => Some(ended("the admin server (--admin-addr)", r.map(|r| r.map_err(anyhow::Error::from)))),
    };
    if let Some(e) = early {
        drain.start();
        background();
        if let Some(f) = &fleet_sync {
            f.abort();
        }
        for t in [&grpc, &ingest] {
            t.abort();
        }
        admin.abort();
        return Err(e);
    }

    // Drain.
    tracing::info!(ext_proc_streams = drain.in_flight(), timeout = ?args.drain_timeout,
        "draining: not ready, refusing new streams");
    drain.start();
    // A replica on its way out writes no more status and hands the Lease over
    // now, not when it expires.
    if let Some(lease) = lease {
        lease.resign(Duration::from_secs(2)).await;
    }
    health.set_not_serving::<CacheServer>().await;
    health.set_not_serving::<ExtProcServer>().await;
    follower.abort(); // no subscriber starts from here on
    let deadline = tokio::time::Instant::now() + args.drain_timeout;
    let servers = async {
        let (g, i) = tokio::join!(
            tokio::time::timeout_at(deadline, &mut grpc),
            tokio::time::timeout_at(deadline, &mut ingest)
        );
        (g.is_ok(), i.is_ok())
    };
    let (grpc_done, ingest_done) = tokio::select! {
        done = servers => done,
        () = shutdown_signal() => {
            tracing::warn!("second signal: cutting the drain short");
            (false, false)
        }
    };
    if !(grpc_done && ingest_done) {
        tracing::warn!(
            ext_proc_streams = drain.in_flight(),
            "drain deadline passed (or cut short): closing the remaining streams and calls"
        );
        grpc.abort();
        ingest.abort();
    }
    // Nothing is routed from here on: the peers release this sidecar's routes.
    if let Some(f) = fleet_sync {
        f.leave(Duration::from_secs(2)).await;
    }
    let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
    subscribers
        .close(remaining.max(Duration::from_secs(1)))
        .await;
    background();
    admin_stop.start();
    if tokio::time::timeout(Duration::from_secs(2), &mut admin)
        .await
        .is_err()
    {
        admin.abort();
    }
    tracing::info!("drained; exiting");
    Ok(())
}

type CacheServer = crate::proto::v1::cache_service_server::CacheServiceServer<CacheApi>;
type ExtProcServer = envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer<ExtProc>;

/// A server task that ended before any signal: always an error.
fn ended(what: &str, r: Result<anyhow::Result<()>, tokio::task::JoinError>) -> anyhow::Error {
    match r {
        Ok(Ok(())) => anyhow::anyhow!("{what} stopped unexpectedly"),
        Ok(Err(e)) => e.context(format!("{what} failed")),
        Err(e) => anyhow::anyhow!("{what} task failed: {e}"),
    }
}

/// The fleet sync settings, with `--fleet-nats`.
fn fleet_config(args: &ServeArgs) -> Option<FleetConfig> {
    let url = args.fleet_nats.clone()?;
    Some(FleetConfig {
        access: NatsAccess {
            url,
            creds: args.fleet_nats_creds.clone(),
            token_file: args.fleet_nats_token_file.clone(),
            tls_ca: args.fleet_nats_tls_ca.clone(),
        },
        id: args.fleet_id.clone().unwrap_or_else(fleet::default_id),
        name: args.fleet_name.clone(),
        relay_kv_events: args.fleet_kv_events == "stream",
        snapshot_interval: args.fleet_snapshot_interval,
    })
}

/// `--fleet-snapshot-interval`: a duration of at least one second.
fn parse_snapshot_interval(s: &str) -> Result<Duration, String> {
    let d = crate::core::policy::parse_duration(s)
        .map_err(|_| format!("{s:?} is not a duration (examples: 30s, 1m)"))?;
    if d < Duration::from_secs(1) {
        return Err(format!("{s:?} is under the least interval, 1s"));
    }
    Ok(d)
}

/// `--lease-duration`: a Go-style duration of whole seconds, at least the minimum.
fn parse_lease_duration(s: &str) -> Result<Duration, String> {
    let d = crate::core::policy::parse_duration(s)
        .map_err(|_| format!("{s:?} is not a duration (examples: 15s, 1m)"))?;
    if d < LeaseConfig::MIN_DURATION || d.subsec_nanos() != 0 {
        return Err(format!(
            "{s:?}: the Lease duration is whole seconds, at least {}s",
            LeaseConfig::MIN_DURATION.as_secs()
        ));
    }
    Ok(d)
}

/// `--drain-timeout`: a Go-style duration.
fn parse_drain_timeout(s: &str) -> Result<Duration, String> {
    crate::core::policy::parse_duration(s)
        .map_err(|_| format!("{s:?} is not a duration (examples: 10s, 500ms, 1m)"))
}

/// The ingest listener's TLS, from the PEM files the flags name.
fn ingest_tls(args: &ServeArgs) -> anyhow::Result<Option<ServerTlsConfig>> {
    tls::server_tls(tls::TlsFiles {
        cert_flag: "--ingest-tls-cert",
        key_flag: "--ingest-tls-key",
        cert: args.ingest_tls_cert.as_deref(),
        key: args.ingest_tls_key.as_deref(),
        client_ca: args
            .ingest_client_ca
            .as_deref()
            .map(|p| ("--ingest-client-ca", p)),
        self_signed: false,
    })
}

/// The ext_proc / LookupRoute listener's TLS: files, self-signed, or plaintext.
/// Accepted connections with Nagle's algorithm off. The builder's `tcp_nodelay`
/// does not reach connections from `serve_with_incoming*`; without this, a
/// reply written right after another (FULL_DUPLEX_STREAMED: the headers reply,
/// then the body) waited for Envoy's delayed ACK, 40 ms per request.
fn no_delay(listener: tokio::net::TcpListener) -> tonic::transport::server::TcpIncoming {
    tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true))
}

fn grpc_tls(args: &ServeArgs) -> anyhow::Result<Option<ServerTlsConfig>> {
    tls::server_tls(tls::TlsFiles {
        cert_flag: "--grpc-tls-cert",
        key_flag: "--grpc-tls-key",
        cert: args.grpc_tls_cert.as_deref(),
        key: args.grpc_tls_key.as_deref(),
        client_ca: None,
        self_signed: args.grpc_tls_self_signed,
    })
}

/// Kubernetes mode: the watches install snapshots; the Lease holder writes status.
async fn start_kubernetes(
    args: &ServeArgs,
    router: Arc<Router>,
    status: Arc<SourceStatus>,
    file: tokio::sync::watch::Receiver<Arc<PolicyObjects>>,
    scrape_specs: Arc<engine_metrics::Specs>,
    tokenizers: Arc<TokenizerStore>,
) -> anyhow::Result<KubernetesTasks> {
    let client = kube::Client::try_default()
        .await
        .context("--kubernetes: no in-cluster config or kubeconfig")?;
    let (observed_tx, observed_rx) =
        tokio::sync::watch::channel(Arc::new(kubernetes::watch::Observed::default()));
    let watches = {
        let router = router.clone();
        tokio::spawn(
            kubernetes::watch::run(
                client.clone(),
                kubernetes::watch::DEFAULT_DEBOUNCE,
                move |snapshot| {
                    let now = Timestamp::now();
                    status.record_success(snapshot.revision().clone(), now);
                    router.install(snapshot, now);
                },
                observed_tx,
                file.clone(),
            )
            .instrument(tracing::info_span!("kubernetes_watch")),
        )
    };
    let backends = tokio::spawn(kubernetes::watch::follow_backends(
        observed_rx.clone(),
        file,
        move |backends| {
            scrape_specs.set(backends.iter().copied());
            tokenizers.set(backends.iter().copied());
        },
    ));
    let identity = args
        .lease_identity
        .clone()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| format!("inferencecache-{}", std::process::id()));
    let (leadership, resign) = kubernetes::leader::elect(
        client.clone(),
        LeaseConfig {
            namespace: args.lease_namespace.clone(),
            name: args.lease_name.clone(),
            identity,
            duration: args.lease_duration,
        },
    );
    let publisher = tokio::spawn(
        kubernetes::publish::run(
            kubernetes::publish::Publisher::new(client, router),
            observed_rx,
            leadership,
            kubernetes::publish::DEFAULT_PERIOD,
        )
        .instrument(tracing::info_span!("status_publisher",
            lease_namespace = %args.lease_namespace, lease = %args.lease_name)),
    );
    Ok(KubernetesTasks {
        tasks: vec![watches, publisher, backends],
        resign,
    })
}

/// What Kubernetes mode runs: the tasks, and the Lease to give up on shutdown.
struct KubernetesTasks {
    tasks: Vec<JoinHandle<()>>,
    resign: kubernetes::leader::Resign,
}

/// Re-syncs the engine event subscribers whenever the installed snapshot's
/// revision changes.
async fn follow_snapshots(router: Arc<Router>, subscribers: Arc<Subscribers>) {
    let mut seen: Option<Arc<str>> = None;
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let snapshot = router.snapshot();
        if seen.as_ref() != Some(snapshot.revision()) {
            subscribers.sync(&snapshot);
            seen = Some(snapshot.revision().clone());
        }
    }
}

/// TTL sweep, cap sweep and stale registrations once a second, and the cap sweep
/// as soon as an ingest leaves the index over its cap (woken through a `Notify`,
/// never polled), all off the async workers: a sweep scans every entry of a scope.
async fn maintain(router: Arc<Router>) {
    let over_cap = Arc::new(tokio::sync::Notify::new());
    let wake = over_cap.clone();
    router.on_over_cap(Box::new(move || wake.notify_one()));
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let r = router.clone();
        let work = tokio::select! {
            _ = tick.tick() => tokio::task::spawn_blocking(move || r.maintain(Timestamp::now())),
            () = over_cap.notified() => tokio::task::spawn_blocking(move || r.sweep_cap()),
        };
        if let Err(e) = work.await {
            tracing::error!(error = %e, "index maintenance failed");
        }
    }
}

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
    tracing::info!("shutting down");
}

#[cfg(test)]
mod tests;
