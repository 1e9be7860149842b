//! The webhook's HTTPS server: rustls (ring, already linked for kube's client)
//! terminates TLS, hyper serves HTTP/1.1 and HTTP/2, axum routes `/validate`.
//! The apiserver only speaks HTTPS to webhooks, so there is no plain-HTTP mode.
//!
//! Each connection's handshake runs on its own task with a deadline, so a slow or
//! silent client cannot hold up the accept loop.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::routing::{get, post};
use axum::{Json, Router};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use kube::core::DynamicObject;
use kube::core::admission::AdmissionReview;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::ServerConfig;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tracing::Instrument;

/// How long a client gets to finish the TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// `inferencecache webhook`: the validating admission webhook.
#[derive(clap::Args, Debug, Clone)]
pub struct WebhookArgs {
    /// Address of the HTTPS server (AdmissionReview v1 on POST /validate).
    #[arg(long, value_name = "ADDR", default_value = "0.0.0.0:8443")]
    pub addr: SocketAddr,
    /// PEM certificate chain, leaf first (e.g. the `tls.crt` of a Secret).
    #[arg(long, value_name = "PATH")]
    pub tls_cert: PathBuf,
    /// PEM private key of the certificate (PKCS#8, PKCS#1 or SEC1).
    #[arg(long, value_name = "PATH")]
    pub tls_key: PathBuf,
}

/// Runs the webhook until a shutdown signal.
pub async fn run(args: WebhookArgs) -> anyhow::Result<()> {
    let tls = tls_config(&args.tls_cert, &args.tls_key)?;
    let listener = TcpListener::bind(args.addr)
        .await
        .with_context(|| format!("binding the webhook address {}", args.addr))?;
    tracing::info!(addr = %args.addr, "admission webhook listening (HTTPS, POST /validate)");
    serve(listener, tls, async {
        let _ = tokio::signal::ctrl_c().await;
    })
    .await
}

/// A rustls server configuration from PEM files; errors name the file.
pub fn tls_config(cert: &Path, key: &Path) -> anyhow::Result<Arc<ServerConfig>> {
    let chain = CertificateDer::pem_file_iter(cert)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .with_context(|| format!("{}: reading the PEM certificate chain", cert.display()))?;
    if chain.is_empty() {
        anyhow::bail!("{}: no certificate in the file", cert.display());
    }
    let key = PrivateKeyDer::from_pem_file(key)
        .with_context(|| format!("{}: reading the PEM private key", key.display()))?;
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .context("TLS protocol versions")?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .context("the certificate and the key do not form a usable pair")?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

fn routes() -> Router {
    Router::new()
        .route("/validate", post(validate))
        .route("/healthz", get(|| async { "ok" }))
}

async fn validate(
    Json(review): Json<AdmissionReview<DynamicObject>>,
) -> Json<AdmissionReview<DynamicObject>> {
    Json(super::review(review))
}

/// Serves the webhook on `listener` until `shutdown` completes.
pub async fn serve(
    listener: TcpListener,
    tls: Arc<ServerConfig>,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    let acceptor = TlsAcceptor::from(tls);
    let app = routes();
    tokio::pin!(shutdown);
    loop {
        let (tcp, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(conn) => conn,
                Err(e) => {
                    // Usually fd exhaustion; back off instead of spinning.
                    tracing::warn!(error = %e, "webhook accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = &mut shutdown => return Ok(()),
        };
        let acceptor = acceptor.clone();
        let service = TowerToHyperService::new(app.clone());
        let span = tracing::debug_span!("webhook_connection", %peer);
        tokio::spawn(
            async move {
                let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await
                {
                    Ok(Ok(tls)) => tls,
                    Ok(Err(e)) => {
                        tracing::debug!(%peer, error = %e, "webhook TLS handshake failed");
                        return;
                    }
                    Err(_) => {
                        tracing::debug!(%peer, "webhook TLS handshake timed out");
                        return;
                    }
                };
                if let Err(e) = auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(tls), service)
                    .await
                {
                    tracing::debug!(%peer, error = %e, "webhook connection ended with an error");
                }
            }
            .instrument(span),
        );
    }
}
