//! `bench-routing --fleet-nats`: the benchmark starts its own nats-server
//! (JetStream on, loopback) and runs every sidecar with `--fleet-nats`, so the
//! sidecars route as one fleet; it also measures what fleet sync costs on the
//! wire per routed request.
//!
//! The nats-server binary: `$INFERENCECACHE_NATS_SERVER`, else the one
//! `e2e/nats/install.sh` unpacks into the cache.

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::bail;

use super::metric;
use crate::http::Http;
use crate::process::{Proc, free_addr, wait_until};

/// The fleet's name in the benchmark.
const FLEET: &str = "bench";

/// The benchmark's nats-server.
pub struct FleetNats {
    proc: Proc,
    url: String,
}

/// Where the nats-server binary is.
pub fn nats_server_binary() -> anyhow::Result<PathBuf> {
    if let Ok(p) = std::env::var("INFERENCECACHE_NATS_SERVER") {
        return Ok(PathBuf::from(p));
    }
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(|| PathBuf::from(".cache"));
    let bin = cache.join("inferencecache/nats-server-2.9.10/usr/sbin/nats-server");
    if !bin.exists() {
        bail!(
            "--fleet-nats needs nats-server: run `bash e2e/nats/install.sh` (or set \
             INFERENCECACHE_NATS_SERVER); not found at {}",
            bin.display()
        );
    }
    Ok(bin)
}

impl FleetNats {
    pub async fn start(out: &Path) -> anyhow::Result<Self> {
        let addr = free_addr()?;
        let store = out.join("nats-store");
        let mut proc = Proc::spawn(
            "nats-server",
            &nats_server_binary()?,
            &[
                "-a".into(),
                addr.ip().to_string(),
                "-p".into(),
                addr.port().to_string(),
                "-js".into(),
                "-sd".into(),
                store.display().to_string(),
            ],
            out.join("nats-server.log"),
        )?;
        wait_until(
            "nats-server",
            &mut proc,
            Duration::from_secs(20),
            || async move { TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() },
        )
        .await?;
        Ok(Self {
            proc,
            url: format!("nats://{addr}"),
        })
    }

    /// The flags of the `i`th sidecar.
    pub fn sidecar_args(&self, i: usize) -> Vec<String> {
        vec![
            "--fleet-nats".into(),
            self.url.clone(),
            "--fleet-id".into(),
            format!("bench-{i}"),
            "--fleet-name".into(),
            FLEET.into(),
        ]
    }

    /// Waits until every sidecar hears all the others.
    pub async fn wait_synced(&mut self, http: &Http, admin_urls: &[String]) -> anyhow::Result<()> {
        let peers = admin_urls.len().saturating_sub(1) as f64;
        for url in admin_urls {
            let url = format!("{url}/metrics");
            wait_until(
                "the fleet's sidecars hearing each other",
                &mut self.proc,
                Duration::from_secs(30),
                || {
                    let (http, url) = (http.clone(), url.clone());
                    async move { metric(&http, &url, "inferencecache_fleet_peers ").await >= peers }
                },
            )
            .await?;
        }
        Ok(())
    }

    pub fn check_running(&mut self) -> anyhow::Result<()> {
        self.proc.check_running()
    }
}

/// What the fleet's sidecars published so far: (messages, bytes).
pub async fn published(http: &Http, admin_urls: &[String]) -> (f64, f64) {
    let mut out = (0.0, 0.0);
    for url in admin_urls {
        let url = format!("{url}/metrics");
        out.0 += metric(http, &url, "inferencecache_fleet_messages_published_total ").await;
        out.1 += metric(http, &url, "inferencecache_fleet_published_bytes_total ").await;
    }
    out
}
