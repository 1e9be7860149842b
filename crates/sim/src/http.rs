//! The benchmark's HTTP/1.1 client: pooled connections to Envoy, the engines and
//! the sidecar's admin server.

use std::time::Duration;

use anyhow::{Context, bail};
use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

/// A response read to the end.
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn json(&self) -> anyhow::Result<Value> {
        serde_json::from_slice(&self.body).context("response body is not JSON")
    }
}

#[derive(Clone)]
pub struct Http {
    client: Client<HttpConnector, Full<Bytes>>,
}

impl Default for Http {
    fn default() -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .build(connector);
        Self { client }
    }
}

impl Http {
    pub async fn get(&self, url: &str) -> anyhow::Result<Reply> {
        self.send(Request::get(url).body(Full::default())?).await
    }

    pub async fn post_json(
        &self,
        url: &str,
        headers: &[(&str, String)],
        body: &Value,
    ) -> anyhow::Result<Reply> {
        let mut req = Request::post(url).header("content-type", "application/json");
        for (k, v) in headers {
            req = req.header(*k, v);
        }
        self.send(req.body(Full::new(Bytes::from(serde_json::to_vec(body)?)))?)
            .await
    }

    async fn send(&self, req: Request<Full<Bytes>>) -> anyhow::Result<Reply> {
        let uri = req.uri().clone();
        let resp = self
            .client
            .request(req)
            .await
            .with_context(|| format!("HTTP request to {uri}"))?;
        let (parts, body) = resp.into_parts();
        let body = body
            .collect()
            .await
            .with_context(|| format!("reading the response of {uri}"))?
            .to_bytes();
        Ok(Reply {
            status: parts.status,
            headers: parts.headers,
            body,
        })
    }

    /// GET that must answer 200; the body as JSON.
    pub async fn get_json(&self, url: &str) -> anyhow::Result<Value> {
        let reply = self.get(url).await?;
        if reply.status != StatusCode::OK {
            bail!("GET {url}: {}", reply.status);
        }
        reply.json()
    }
}
