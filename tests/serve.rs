//! The `inferencecache serve` binary end to end: the ingest listener (tokens,
//! per-caller limits, mTLS, the lookup port refusing ingest) and the graceful
//! drain on SIGTERM (readiness flips, new ext_proc streams are refused, an open
//! stream completes, the process exits 0; a stream that never ends is cut at
//! `--drain-timeout`).

use std::net::{SocketAddr, TcpListener as StdListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpHeaders, ProcessingRequest, processing_request, processing_response,
};
use inferencecache::proto::v1 as pb;
use inferencecache::proto::v1::cache_service_client::CacheServiceClient;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_stream::wrappers::ReceiverStream;
use tonic::Code;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

const BIN: &str = env!("CARGO_BIN_EXE_inferencecache");
const TOKEN: &str = "s3cret-token-for-engine-a";

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

fn free_addr() -> SocketAddr {
    StdListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

struct Sidecar {
    child: Child,
    grpc: SocketAddr,
    ingest: SocketAddr,
    admin: SocketAddr,
    dir: PathBuf,
}

impl Drop for Sidecar {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "inferencecache-serve-{name}-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

impl Sidecar {
    async fn start(name: &str, extra: &[&str]) -> Self {
        let dir = scratch(name);
        let (grpc, ingest, admin) = (free_addr(), free_addr(), free_addr());
        let log = std::fs::File::create(dir.join("sidecar.log")).unwrap();
        let child = Command::new(BIN)
            .arg("serve")
            .arg("--config")
            .arg(repo("examples/standalone/policy.yaml"))
            .args(["--grpc-addr", &grpc.to_string()])
            .args(["--ingest-addr", &ingest.to_string()])
            .args(["--admin-addr", &admin.to_string()])
            .args(extra)
            .env("RUST_LOG", "inferencecache=info")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        let mut s = Self {
            child,
            grpc,
            ingest,
            admin,
            dir,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = s.child.try_wait().unwrap() {
                panic!("sidecar exited early with {status}: {}", s.log());
            }
            if matches!(s.get("/readyz").await, Ok((200, _))) {
                return s;
            }
            assert!(Instant::now() < deadline, "never ready: {}", s.log());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("sidecar.log")).unwrap_or_default()
    }

    /// A plain HTTP/1.0 GET on the admin port: (status, body).
    async fn get(&self, path: &str) -> std::io::Result<(u16, String)> {
        let mut tcp = tokio::net::TcpStream::connect(self.admin).await?;
        tcp.write_all(format!("GET {path} HTTP/1.0\r\nhost: x\r\n\r\n").as_bytes())
            .await?;
        let mut buf = String::new();
        tcp.read_to_string(&mut buf).await?;
        let status = buf
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let body = buf.split("\r\n\r\n").nth(1).unwrap_or("").to_string();
        Ok((status, body))
    }

    fn sigterm(&self) {
        let ok = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(ok.success());
    }

    async fn wait_exit(&mut self, within: Duration) -> ExitStatus {
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "still running after {within:?}: {}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn lookup_client(&self) -> CacheServiceClient<Channel> {
        CacheServiceClient::connect(format!("http://{}", self.grpc))
            .await
            .unwrap()
    }

    async fn ingest_client(&self) -> CacheServiceClient<Channel> {
        CacheServiceClient::connect(format!("http://{}", self.ingest))
            .await
            .unwrap()
    }
}

fn headers_msg() -> ProcessingRequest {
    let h = |k: &str, v: &str| HeaderValue {
        key: k.into(),
        value: String::new(),
        raw_value: v.as_bytes().to_vec(),
    };
    ProcessingRequest {
        request: Some(processing_request::Request::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap {
                headers: vec![
                    h(":path", "/v1/completions"),
                    h("x-inferencecache-tenant", "demo"),
                    h("x-inferencecache-model", "demo-model"),
                    h("x-inferencecache-hash-scheme", "ic-content-v1"),
                    h("x-inferencecache-block-hashes", "1a2b3c4d5e6f7a8b"),
                    h("x-inferencecache-block-token-counts", "16"),
                ],
            }),
            ..Default::default()
        })),
        ..Default::default()
    }
}

/// An ext_proc stream open on the server, with nothing sent yet.
async fn open_stream(
    addr: SocketAddr,
) -> Result<
    (
        tokio::sync::mpsc::Sender<ProcessingRequest>,
        tonic::Streaming<envoy_types::pb::envoy::service::ext_proc::v3::ProcessingResponse>,
    ),
    String,
> {
    let mut client = ExternalProcessorClient::connect(format!("http://{addr}"))
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let replies = client
        .process(ReceiverStream::new(rx))
        .await
        .map_err(|s| format!("{:?}: {}", s.code(), s.message()))?
        .into_inner();
    Ok((tx, replies))
}

fn ingest_req() -> pb::IngestEventsRequest {
    pb::IngestEventsRequest {
        tenant_id: "demo".into(),
        model_id: "demo-model".into(),
        hash_scheme: "ic-content-v1".into(),
        replica_id: "replica-a".into(),
        endpoint: String::new(),
        events: vec![pb::KvEvent {
            event: Some(pb::kv_event::Event::Stored(pb::BlocksStored {
                parent_block_hash: None,
                block_hashes: vec![1, 2, 3, 4],
                block_token_counts: vec![],
            })),
        }],
    }
}

fn with_token(token: &str) -> tonic::Request<pb::IngestEventsRequest> {
    let mut r = tonic::Request::new(ingest_req());
    r.metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse().unwrap());
    r
}

#[tokio::test]
async fn sigterm_flips_readiness_refuses_new_streams_and_lets_an_open_one_finish() {
    let mut s = Sidecar::start("drain", &["--drain-timeout", "20s"]).await;
    let (tx, mut replies) = open_stream(s.grpc).await.unwrap();
    let (code, body) = s.get("/readyz").await.unwrap();
    assert_eq!(code, 200, "{body}");
    assert!(body.contains(r#""draining":false"#), "{body}");

    s.sigterm();
    // Readiness goes false at once while the open stream holds the drain.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let (code, body) = s.get("/readyz").await.unwrap();
        if code == 503 {
            assert!(body.contains(r#""draining":true"#), "{body}");
            break;
        }
        assert!(Instant::now() < deadline, "readyz never went false: {body}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A new stream is refused: the listener is closed (or the call is UNAVAILABLE).
    match open_stream(s.grpc).await {
        Err(e) => assert!(
            e.starts_with("connect") || e.contains("Unavailable"),
            "unexpected refusal: {e}"
        ),
        Ok(_) => panic!("a new ext_proc stream was accepted while draining"),
    }
    assert!(s.child.try_wait().unwrap().is_none(), "exited mid-stream");

    // The open stream still gets its decision, and ends cleanly.
    tx.send(headers_msg()).await.unwrap();
    let reply = tokio::time::timeout(Duration::from_secs(5), replies.message())
        .await
        .expect("a reply while draining")
        .expect("no stream error")
        .expect("a message");
    assert!(
        matches!(
            reply.response,
            Some(processing_response::Response::RequestHeaders(_))
        ),
        "{reply:?}"
    );
    drop(tx);
    let end = tokio::time::timeout(Duration::from_secs(5), replies.message())
        .await
        .expect("the stream ends");
    assert!(matches!(end, Ok(None)), "{end:?}");
    drop(replies);

    let status = s.wait_exit(Duration::from_secs(10)).await;
    assert!(status.success(), "{status}: {}", s.log());
    let log = s.log();
    assert!(log.contains("draining"), "{log}");
    assert!(log.contains("KV event subscribers closed"), "{log}");
    assert!(!log.contains("drain deadline passed"), "{log}");
}

#[tokio::test]
async fn the_drain_deadline_cuts_a_stream_that_never_ends() {
    let mut s = Sidecar::start("deadline", &["--drain-timeout", "1s"]).await;
    let (_tx, mut replies) = open_stream(s.grpc).await.unwrap();
    let started = Instant::now();
    s.sigterm();
    let status = s.wait_exit(Duration::from_secs(8)).await;
    assert!(status.success(), "{status}: {}", s.log());
    assert!(
        started.elapsed() >= Duration::from_millis(900),
        "exited before the deadline"
    );
    assert!(s.log().contains("drain deadline passed"), "{}", s.log());
    // The client sees its stream end or fail, not hang.
    let r = tokio::time::timeout(Duration::from_secs(5), replies.message()).await;
    assert!(matches!(r, Ok(Err(_)) | Ok(Ok(None))), "{r:?}");
}

#[tokio::test]
async fn ingest_needs_its_listener_its_token_and_stays_within_limits() {
    let dir = scratch("tokens-file");
    let tokens = dir.join("tokens");
    std::fs::write(&tokens, format!("# test\nengine-a:{TOKEN}\n")).unwrap();
    let s = Sidecar::start(
        "tokens",
        &[
            "--ingest-token-file",
            tokens.to_str().unwrap(),
            "--ingest-max-events-per-sec",
            "3",
        ],
    )
    .await;

    // The lookup port refuses ingest, whatever the token.
    let err = s
        .lookup_client()
        .await
        .ingest_events(with_token(TOKEN))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unimplemented);
    assert!(err.message().contains("--ingest-addr"), "{}", err.message());

    let mut ingest = s.ingest_client().await;
    let err = ingest.ingest_events(ingest_req()).await.unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated, "{}", err.message());
    let err = ingest
        .ingest_events(with_token("not-the-token-at-all"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated, "{}", err.message());

    // Three events a second: three calls pass, the fourth is refused.
    for i in 0..3 {
        let out = ingest
            .ingest_events(with_token(TOKEN))
            .await
            .unwrap_or_else(|e| panic!("call {i}: {e}"))
            .into_inner();
        assert_eq!(out.applied, 1);
    }
    let err = ingest.ingest_events(with_token(TOKEN)).await.unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted);
    assert!(
        err.message().contains("token:engine-a") && err.message().contains("3 events/s"),
        "{}",
        err.message()
    );
    // The bucket refills.
    tokio::time::sleep(Duration::from_millis(700)).await;
    ingest.ingest_events(with_token(TOKEN)).await.unwrap();

    // LookupRoute stays on the lookup port, and sees what was ingested.
    let err = ingest
        .lookup_route(pb::LookupRouteRequest::default())
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unimplemented);

    let (_, metrics) = s.get("/metrics").await.unwrap();
    for line in [
        r#"inferencecache_ingest_caller_calls_total{caller="ip:127.0.0.1",rpc="IngestEvents",outcome="unauthenticated"} 2"#,
        r#"inferencecache_ingest_caller_calls_total{caller="token:engine-a",rpc="IngestEvents",outcome="ok"} 4"#,
        r#"inferencecache_ingest_caller_calls_total{caller="token:engine-a",rpc="IngestEvents",outcome="limited"} 1"#,
        r#"inferencecache_ingest_limited_total{caller="token:engine-a",limit="events"} 1"#,
        r#"inferencecache_ingest_caller_entries_total{caller="token:engine-a"} 16"#,
        r#"inferencecache_ingest_calls_total{rpc="IngestEvents",outcome="wrong_listener"} 1"#,
    ] {
        assert!(metrics.contains(line), "missing {line}\n{metrics}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(repo(&format!("tests/fixtures/tls/{name}"))).unwrap()
}

async fn tls_client(
    addr: SocketAddr,
    client_cert: Option<(&str, &str)>,
) -> Result<CacheServiceClient<Channel>, String> {
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(fixture("ca.pem")))
        .domain_name("localhost");
    if let Some((cert, key)) = client_cert {
        tls = tls.identity(Identity::from_pem(fixture(cert), fixture(key)));
    }
    let channel = Channel::from_shared(format!("https://{addr}"))
        .unwrap()
        .tls_config(tls)
        .map_err(|e| e.to_string())?
        .connect()
        .await
        .map_err(|e| e.to_string())?;
    Ok(CacheServiceClient::new(channel))
}

#[tokio::test]
async fn mtls_admits_certified_callers_only_and_names_them() {
    let f = |n: &str| {
        repo(&format!("tests/fixtures/tls/{n}"))
            .display()
            .to_string()
    };
    let (cert, key, ca) = (f("server.pem"), f("server.key"), f("ca.pem"));
    let s = Sidecar::start(
        "mtls",
        &[
            "--ingest-tls-cert",
            &cert,
            "--ingest-tls-key",
            &key,
            "--ingest-client-ca",
            &ca,
        ],
    )
    .await;
    let mut good = tls_client(s.ingest, Some(("client.pem", "client.key")))
        .await
        .unwrap();
    let out = good.ingest_events(ingest_req()).await.unwrap().into_inner();
    assert_eq!(out.applied, 1);

    // No client certificate, one from another CA, or plaintext: no call gets through.
    for who in [None, Some(("rogue-client.pem", "rogue-client.key"))] {
        let refused = match tls_client(s.ingest, who).await {
            Err(_) => true,
            Ok(mut c) => c.ingest_events(ingest_req()).await.is_err(),
        };
        assert!(refused, "{who:?} got through");
    }
    let plain = match CacheServiceClient::connect(format!("http://{}", s.ingest)).await {
        Err(_) => true,
        Ok(mut c) => c.ingest_events(ingest_req()).await.is_err(),
    };
    assert!(plain, "plaintext got through");

    let (_, metrics) = s.get("/metrics").await.unwrap();
    let line = r#"inferencecache_ingest_caller_calls_total{caller="cert:engine-a",rpc="IngestEvents",outcome="ok"} 1"#;
    assert!(metrics.contains(line), "missing {line}\n{metrics}");
}

#[test]
fn bad_ingest_flags_are_clear_errors() {
    let dir = scratch("flags");
    let short = dir.join("short");
    std::fs::write(&short, "engine-a:short\n").unwrap();
    let policy = repo("examples/standalone/policy.yaml");
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            vec!["--ingest-token-file".into(), "/nonexistent/tokens".into()],
            "--ingest-token-file",
        ),
        (
            vec!["--ingest-token-file".into(), short.display().to_string()],
            "at least 16",
        ),
        (
            vec!["--ingest-client-ca".into(), "/x/ca.pem".into()],
            "--ingest-tls-cert",
        ),
        (
            vec!["--ingest-tls-cert".into(), "/x/cert.pem".into()],
            "--ingest-tls-key",
        ),
        (
            vec!["--drain-timeout".into(), "soon".into()],
            "not a duration",
        ),
    ];
    for (extra, want) in cases {
        let out = Command::new(BIN)
            .arg("serve")
            .arg("--config")
            .arg(&policy)
            .args(["--grpc-addr", &free_addr().to_string()])
            .args(["--ingest-addr", &free_addr().to_string()])
            .args(["--admin-addr", &free_addr().to_string()])
            .args(&extra)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{extra:?} was accepted");
        assert!(stderr.contains(want), "{extra:?}: {stderr}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// The cap sweep runs on the maintenance worker, woken by the ingest that went
/// over the cap, well before the once-a-second tick would come round.
#[tokio::test]
async fn an_ingest_over_the_cap_wakes_the_cap_sweep() {
    let s = Sidecar::start("cap", &["--index-max-entries", "3"]).await;
    let entries = || async {
        let (_, body) = s.get("/snapshot").await.unwrap();
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        v["totalEntries"].as_u64().unwrap()
    };
    let mut ingest = s.ingest_client().await;
    let out = ingest
        .ingest_events(ingest_req())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(out.applied, 1);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let n = entries().await;
        if n == 3 {
            break;
        }
        assert!(
            n == 4 && Instant::now() < deadline,
            "{n} entries: {}",
            s.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
