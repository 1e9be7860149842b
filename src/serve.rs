//! `inferencecache serve`: wires the policy source (a file, or the Kubernetes
//! watches and the status writer), the router, the gRPC side
//! (ext_proc + CacheService + health + reflection, one port) and the admin HTTP
//! side together, and runs them until SIGINT/SIGTERM.
//!
//! ```text
//!  policy_file::watch ─┐
//!  kubernetes::watch ──┴install──▶ Router ◀── ExtProc, CacheApi (tonic, --grpc-addr)
//!                                    ▲  ◀── admin routes (axum, --admin-addr)
//!             maintain task (1 s) ───┘
//! ```

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::builder::{PossibleValuesParser, TypedValueParser};
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;

use crate::adapters::admin::{self, AdminState};
use crate::adapters::engine_metrics::{self, supervisor::Scrapers};
use crate::adapters::ext_proc::headers::DEFAULT_DESTINATION_HEADER;
use crate::adapters::ext_proc::{DestinationMode, ExtProc, ExtProcConfig};
use crate::adapters::grpc::CacheApi;
use crate::adapters::kubernetes::{self, leader::LeaseConfig};
use crate::adapters::kv_events::supervisor::Subscribers;
use crate::adapters::metrics::Metrics;
use crate::adapters::policy_file::{self, SourceStatus};
use crate::core::Router;
use crate::core::index::IndexConfig;
use crate::core::snapshot::PolicySnapshot;
use crate::core::time::Timestamp;
use crate::proto::v1::FILE_DESCRIPTOR_SET;

/// Whether clients may ask for the decision on their response headers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DebugHeaders {
    Allowed,
    Disabled,
}

/// `inferencecache serve` flags (contract §11).
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
    /// Address of the gRPC server: Envoy ext_proc, inferencecache.v1.CacheService,
    /// gRPC health and reflection, all on one port.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:50051")]
    pub grpc_addr: SocketAddr,
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
    /// How often the policy path is checked for changes, in milliseconds.
    #[arg(long, value_name = "MS", default_value_t = 1000)]
    pub policy_poll_ms: u64,
}

/// Runs the server until a shutdown signal.
pub async fn run(args: ServeArgs) -> anyhow::Result<()> {
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
    let (router, source_name, policy_source) = match &args.config {
        Some(config_path) if args.kubernetes => {
            // Validate the file up front, as in file mode; then feed its objects
            // to the cluster watcher, which resolves both and installs.
            let loaded = policy_file::load(config_path).map_err(|e| {
                anyhow::anyhow!("{}: policy not loaded:\n{e}", config_path.display())
            })?;
            let (file_tx, file_rx) = tokio::sync::watch::channel(Arc::new(loaded.objects));
            let router = Arc::new(Router::new(index, PolicySnapshot::empty(), now));
            let mut tasks = start_kubernetes(
                &args,
                router.clone(),
                status.clone(),
                file_rx,
                scrape_specs.clone(),
            )
            .await?;
            tasks.push(tokio::spawn(policy_file::watch_loaded(
                config_path.clone(),
                Duration::from_millis(args.policy_poll_ms.max(10)),
                move |l: policy_file::Loaded| {
                    file_tx.send_replace(Arc::new(l.objects));
                },
                status.clone(),
            )));
            let name = format!("kubernetes + {}", config_path.display());
            (router, name, tasks)
        }
        Some(config_path) => {
            // The first load must succeed: there is no last good policy to fall back to.
            let loaded = policy_file::load(config_path).map_err(|e| {
                anyhow::anyhow!("{}: policy not loaded:\n{e}", config_path.display())
            })?;
            status.record_success(loaded.snapshot.revision().clone(), now);
            scrape_specs.set(&loaded.objects.backends);
            let router = Arc::new(Router::new(index, loaded.snapshot, now));
            let watcher = {
                let (router, recorder, specs) =
                    (router.clone(), status.clone(), scrape_specs.clone());
                tokio::spawn(policy_file::watch_loaded(
                    config_path.clone(),
                    Duration::from_millis(args.policy_poll_ms.max(10)),
                    move |l: policy_file::Loaded| {
                        let (now, revision) = (Timestamp::now(), l.snapshot.revision().clone());
                        specs.set(&l.objects.backends);
                        router.install(l.snapshot, now);
                        recorder.record_success(revision, now);
                    },
                    status.clone(),
                ))
            };
            (router, config_path.display().to_string(), vec![watcher])
        }
        None => {
            // Not ready (/readyz) until the first snapshot from the cluster.
            let router = Arc::new(Router::new(index, PolicySnapshot::empty(), now));
            // No file objects: the sender goes at once, and the watcher stops
            // listening for them.
            let (_, file_rx) = tokio::sync::watch::channel(Arc::default());
            let tasks = start_kubernetes(
                &args,
                router.clone(),
                status.clone(),
                file_rx,
                scrape_specs.clone(),
            )
            .await?;
            (router, "kubernetes".to_string(), tasks)
        }
    };
    let metrics = Arc::new(Metrics::new(router.clone(), status.clone()));

    let grpc_listener = TcpListener::bind(args.grpc_addr)
        .await
        .with_context(|| format!("binding --grpc-addr {}", args.grpc_addr))?;
    let admin_listener = TcpListener::bind(args.admin_addr)
        .await
        .with_context(|| format!("binding --admin-addr {}", args.admin_addr))?;

    // Engine KV event subscribers follow the declared replicas of whichever
    // snapshot is installed, from the file or from the cluster.
    let subscribers = Arc::new(Subscribers::new(
        router.clone(),
        metrics.kv_events().clone(),
    ));
    let follower = tokio::spawn(follow_snapshots(router.clone(), subscribers));
    // Engine /metrics scrapers follow the same snapshots (and spec.metrics).
    let scrapers = Scrapers::new(
        router.clone(),
        metrics.engine_metrics().clone(),
        scrape_specs,
    );
    let scrape_follower = tokio::spawn(engine_metrics::supervisor::follow(
        router.clone(),
        Arc::new(scrapers),
    ));
    let maintenance = tokio::spawn(maintain(router.clone()));

    let ext_proc = ExtProc::new(
        router.clone(),
        metrics.clone(),
        ExtProcConfig {
            destination_mode: args.destination_mode,
            debug_headers_allowed: args.debug_headers == DebugHeaders::Allowed,
            destination_header: header,
        },
    )
    .into_server();
    let cache_api = CacheApi::new(router.clone(), metrics.clone()).into_server();
    let (health, health_service) = tonic_health::server::health_reporter();
    health
        .set_serving::<crate::proto::v1::cache_service_server::CacheServiceServer<CacheApi>>()
        .await;
    health
        .set_serving::<envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer<ExtProc>>()
        .await;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(FILE_DESCRIPTOR_SET)
        .build_v1()
        .context("building gRPC reflection")?;

    tracing::info!(grpc = %args.grpc_addr, admin = %args.admin_addr,
        mode = %args.destination_mode, policy = %source_name, "serving");

    let grpc = tonic::transport::Server::builder()
        .tcp_nodelay(true)
        .add_service(health_service)
        .add_service(reflection)
        .add_service(cache_api)
        .add_service(ext_proc)
        .serve_with_incoming_shutdown(TcpListenerStream::new(grpc_listener), shutdown_signal());
    let admin = axum::serve(
        admin_listener,
        admin::routes(AdminState {
            router,
            metrics,
            source: status,
            source_name,
        }),
    )
    .with_graceful_shutdown(shutdown_signal());

    let (grpc, admin) = tokio::join!(grpc, admin);
    for task in policy_source {
        task.abort();
    }
    maintenance.abort();
    follower.abort();
    scrape_follower.abort();
    grpc.context("gRPC server")?;
    admin.context("admin server")?;
    Ok(())
}

/// Kubernetes mode: the watches install snapshots; the Lease holder writes status.
async fn start_kubernetes(
    args: &ServeArgs,
    router: Arc<Router>,
    status: Arc<SourceStatus>,
    file: tokio::sync::watch::Receiver<Arc<policy_file::FileObjects>>,
    scrape_specs: Arc<engine_metrics::Specs>,
) -> anyhow::Result<Vec<tokio::task::JoinHandle<()>>> {
    let client = kube::Client::try_default()
        .await
        .context("--kubernetes: no in-cluster config or kubeconfig")?;
    let (observed_tx, observed_rx) =
        tokio::sync::watch::channel(Arc::new(kubernetes::watch::Observed::default()));
    let watches = {
        let router = router.clone();
        tokio::spawn(kubernetes::watch::run(
            client.clone(),
            kubernetes::watch::DEFAULT_DEBOUNCE,
            move |snapshot| {
                let now = Timestamp::now();
                status.record_success(snapshot.revision().clone(), now);
                router.install(snapshot, now);
            },
            observed_tx,
            file.clone(),
        ))
    };
    let specs = tokio::spawn(engine_metrics::supervisor::follow_cluster(
        scrape_specs,
        observed_rx.clone(),
        file,
    ));
    let identity = args
        .lease_identity
        .clone()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| format!("inferencecache-{}", std::process::id()));
    let leader = kubernetes::leader::elect(
        client.clone(),
        LeaseConfig {
            namespace: args.lease_namespace.clone(),
            name: args.lease_name.clone(),
            identity,
            duration: LeaseConfig::DEFAULT_DURATION,
            grace: LeaseConfig::DEFAULT_GRACE,
        },
    );
    let publisher = tokio::spawn(kubernetes::publish::run(
        kubernetes::publish::Publisher::new(client, router),
        observed_rx,
        leader,
        kubernetes::publish::DEFAULT_PERIOD,
    ));
    Ok(vec![watches, publisher, specs])
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

/// TTL sweep, cap sweep and stale registrations, once a second, off the async
/// workers (a sweep scans every entry of a scope).
async fn maintain(router: Arc<Router>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let r = router.clone();
        if let Err(e) = tokio::task::spawn_blocking(move || r.maintain(Timestamp::now())).await {
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
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }

    #[test]
    fn kubernetes_mode_needs_no_config_and_accepts_one() {
        let cli = Cli::try_parse_from(["x", "--kubernetes", "--lease-name", "l"]).unwrap();
        assert!(cli.serve.kubernetes && cli.serve.config.is_none());
        assert_eq!(cli.serve.lease_name, "l");
        // Contract §11: the CRDs "instead of / as well as" a file.
        let both = Cli::try_parse_from(["x", "--kubernetes", "--config", "p.yaml"]).unwrap();
        assert!(both.serve.kubernetes && both.serve.config.is_some());
    }

    #[tokio::test]
    async fn neither_source_is_a_clear_error() {
        let cli = Cli::try_parse_from(["x"]).unwrap();
        let e = run(cli.serve).await.unwrap_err().to_string();
        assert!(e.contains("--config") && e.contains("--kubernetes"), "{e}");
    }
}
