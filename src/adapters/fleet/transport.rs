//! The NATS connection of fleet sync: options from the flags (credentials
//! file, token file, CA bundle), a connection that never blocks the start
//! (NATS down at start is retried in the background, as any later outage), and
//! the connection's state reported to the metrics and the router.
//!
//! Losing the connection drops every peer's routes at once ([`Router::forget_peers`]):
//! messages may be missing from then on, so the peers' counts would only go
//! stale; the sidecar routes on its own view until peers are heard again.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use async_nats::{Client, ConnectOptions, Event};

use super::metrics::FleetMetrics;
use crate::core::Router;

/// The longest wait between two reconnection attempts: NATS back means the
/// fleet view back within about this long.
pub const MAX_RECONNECT_DELAY: Duration = Duration::from_secs(2);

/// How to reach the fleet's NATS.
#[derive(Clone, Debug, Default)]
pub struct NatsAccess {
    /// `nats://host:port` (or `tls://`), several comma-separated.
    pub url: String,
    /// A NATS credentials file (user JWT and NKey seed).
    pub creds: Option<PathBuf>,
    /// A file holding the NATS token (surrounding whitespace ignored).
    pub token_file: Option<PathBuf>,
    /// A PEM CA bundle: the server's certificate must be signed by it; TLS is
    /// then required.
    pub tls_ca: Option<PathBuf>,
}

/// The connect options for `access`; a credentials or token file that cannot
/// be read, or an empty token, is a configuration error.
pub async fn options(access: &NatsAccess, client_name: &str) -> anyhow::Result<ConnectOptions> {
    let mut options = match &access.creds {
        Some(path) => ConnectOptions::with_credentials_file(path)
            .await
            .with_context(|| format!("--fleet-nats-creds {}", path.display()))?,
        None => ConnectOptions::new(),
    };
    if let Some(path) = &access.token_file {
        options = options.token(read_token(path)?);
    }
    if let Some(ca) = &access.tls_ca {
        if !ca.is_file() {
            anyhow::bail!("--fleet-nats-tls-ca {}: not a readable file", ca.display());
        }
        options = options.add_root_certificates(ca.clone()).require_tls(true);
    }
    Ok(options
        .name(client_name)
        // Own messages are not echoed back.
        .no_echo()
        .retry_on_initial_connect()
        .max_reconnects(None)
        .connection_timeout(Duration::from_secs(2))
        .ping_interval(Duration::from_secs(5))
        .reconnect_delay_callback(|attempts| {
            (Duration::from_millis(100) * u32::try_from(attempts).unwrap_or(u32::MAX))
                .min(MAX_RECONNECT_DELAY)
        }))
}

/// `--fleet-nats-token-file`: the token, trimmed; empty is an error.
pub fn read_token(path: &Path) -> anyhow::Result<String> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("--fleet-nats-token-file {}", path.display()))?;
    let token = text.trim();
    if token.is_empty() {
        anyhow::bail!("--fleet-nats-token-file {}: empty", path.display());
    }
    Ok(token.to_string())
}

/// Connects in the background: returns at once, NATS reachable or not.
pub async fn connect(
    access: &NatsAccess,
    client_name: &str,
    router: Arc<Router>,
    metrics: Arc<FleetMetrics>,
) -> anyhow::Result<Client> {
    let options = options(access, client_name).await?;
    let on_event = move |event: Event| {
        let (router, metrics) = (router.clone(), metrics.clone());
        async move {
            match event {
                Event::Connected => {
                    tracing::info!("fleet NATS connected: routing on the fleet's view");
                    metrics.set_connected(true);
                }
                Event::Disconnected | Event::Closed => {
                    tracing::warn!(
                        "fleet NATS disconnected: routing on this sidecar's own view until it is back"
                    );
                    metrics.set_connected(false);
                    router.forget_peers();
                    metrics.set_peers(0);
                }
                other => tracing::warn!(event = %other, "fleet NATS"),
            }
        }
    };
    options
        .event_callback(on_event)
        .connect(access.url.as_str())
        .await
        .with_context(|| format!("--fleet-nats {}", access.url))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(name: &str, text: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("ic-fleet-transport-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join(name);
        std::fs::write(&path, text).expect("write");
        path
    }

    #[test]
    fn a_token_file_is_trimmed_and_must_not_be_empty() {
        assert_eq!(
            read_token(&temp("token", "  s3cret\n")).expect("read"),
            "s3cret"
        );
        let empty = read_token(&temp("empty", " \n")).expect_err("empty");
        assert!(empty.to_string().contains("empty"), "{empty}");
        let missing = read_token(Path::new("/nonexistent/token")).expect_err("missing");
        assert!(
            format!("{missing:#}").contains("--fleet-nats-token-file"),
            "{missing:#}"
        );
    }

    #[tokio::test]
    async fn unreadable_credentials_or_ca_are_configuration_errors() {
        let creds = NatsAccess {
            url: "nats://127.0.0.1:1".into(),
            creds: Some("/nonexistent/user.creds".into()),
            ..NatsAccess::default()
        };
        let Err(e) = options(&creds, "t").await else {
            panic!("missing creds accepted")
        };
        assert!(format!("{e:#}").contains("--fleet-nats-creds"), "{e:#}");
        let garbage = NatsAccess {
            creds: Some(temp("garbage.creds", "not a creds file")),
            ..creds.clone()
        };
        assert!(options(&garbage, "t").await.is_err());
        let ca = NatsAccess {
            url: "nats://127.0.0.1:1".into(),
            tls_ca: Some("/nonexistent/ca.pem".into()),
            ..NatsAccess::default()
        };
        let Err(e) = options(&ca, "t").await else {
            panic!("missing CA accepted")
        };
        assert!(format!("{e:#}").contains("--fleet-nats-tls-ca"), "{e:#}");
    }

    #[tokio::test]
    async fn an_unreachable_nats_does_not_block_the_start() {
        let router = Arc::new(Router::new(
            crate::core::index::IndexConfig::default(),
            crate::core::snapshot::PolicySnapshot::empty(),
            crate::core::time::Timestamp::now(),
        ));
        let metrics = Arc::new(FleetMetrics::default());
        // Port 1 on loopback: nothing listens there.
        let access = NatsAccess {
            url: "nats://127.0.0.1:1".into(),
            ..NatsAccess::default()
        };
        let client = tokio::time::timeout(
            Duration::from_secs(5),
            connect(&access, "t", router, metrics.clone()),
        )
        .await
        .expect("returns at once")
        .expect("a client that keeps trying");
        assert!(!metrics.is_connected());
        assert_ne!(
            client.connection_state(),
            async_nats::connection::State::Connected
        );
    }
}
