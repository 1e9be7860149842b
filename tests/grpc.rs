//! CacheService through a real tonic client over loopback, on the two listeners
//! `serve` runs: LookupRoute with health and reflection on the
//! lookup (ext_proc) port, IngestEvents and ReportStats on the ingest listener.
//! Every RPC, good and bad input, and each port refusing the other's RPCs.

use std::net::SocketAddr;
use std::sync::Arc;

use inferencecache::adapters::grpc::CacheApi;
use inferencecache::adapters::ingest::IngestGuard;
use inferencecache::adapters::metrics::Metrics;
use inferencecache::adapters::policy_file::SourceStatus;
use inferencecache::core::Router;
use inferencecache::core::index::IndexConfig;
use inferencecache::core::policy::ResolvedPolicy;
use inferencecache::core::scope::ScopeKey;
use inferencecache::core::snapshot::{BackendDecl, DeclaredReplica, PolicySnapshot};
use inferencecache::core::time::Timestamp;
use inferencecache::proto::v1 as pb;
use inferencecache::proto::v1::cache_service_client::CacheServiceClient;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::Code;
use tonic::transport::Channel;

fn mk_snapshot() -> PolicySnapshot {
    mk_snapshot_with(ResolvedPolicy::default())
}

fn mk_snapshot_with(policy: ResolvedPolicy) -> PolicySnapshot {
    let replicas = ["r1", "r2", "r3"]
        .iter()
        .enumerate()
        .map(|(i, id)| DeclaredReplica {
            id: (*id).into(),
            address: format!("127.0.0.1:{}", 8001 + i),
            kv_events_endpoint: None,
            kv_replay_endpoint: None,
            data_parallel_size: 1,
        })
        .collect();
    let backend = BackendDecl {
        namespace: "team-a".into(),
        name: "llama".into(),
        scope: ScopeKey {
            tenant: "acme".into(),
            model: "llama".into(),
            hash_scheme: "vllm".into(),
        },
        engine: "vLLM".into(),
        block_size: 16,
        kv_events_topic: String::new(),
        lora_adapters: Vec::new(),
        replicas,
    };
    PolicySnapshot::new(policy, vec![], vec![backend])
}

/// Clients of the two listeners, and the lookup port's address.
struct Servers {
    lookup: CacheServiceClient<Channel>,
    ingest: CacheServiceClient<Channel>,
    lookup_addr: SocketAddr,
}

async fn mk_server() -> Servers {
    mk_server_with(mk_snapshot()).await
}

async fn mk_server_with(snapshot: PolicySnapshot) -> Servers {
    let router = Arc::new(Router::new(
        IndexConfig::default(),
        snapshot,
        Timestamp::now(),
    ));
    let metrics = Arc::new(Metrics::new(router.clone(), Arc::new(SourceStatus::new())));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let lookup_addr = listener.local_addr().unwrap();
    let (_reporter, health) = tonic_health::server::health_reporter();
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(health)
            .add_service(reflection)
            .add_service(CacheApi::lookup_only(router.clone(), metrics.clone()).into_server())
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );
    let ingest_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let ingest_addr = ingest_listener.local_addr().unwrap();
    let guard = Arc::new(IngestGuard::open(metrics.clone()));
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(CacheApi::ingest_only(router, metrics, guard).into_server())
            .serve_with_incoming(TcpListenerStream::new(ingest_listener)),
    );
    let lookup = CacheServiceClient::connect(format!("http://{lookup_addr}"))
        .await
        .unwrap();
    let ingest = CacheServiceClient::connect(format!("http://{ingest_addr}"))
        .await
        .unwrap();
    Servers {
        lookup,
        ingest,
        lookup_addr,
    }
}

fn scope_req(chain: &[u64]) -> pb::LookupRouteRequest {
    pb::LookupRouteRequest {
        tenant_id: "acme".into(),
        model_id: "llama".into(),
        hash_scheme: "vllm".into(),
        block_hashes: chain.to_vec(),
        block_token_counts: vec![16; chain.len()],
        ..Default::default()
    }
}

fn stored(chain: &[u64]) -> pb::KvEvent {
    pb::KvEvent {
        event: Some(pb::kv_event::Event::Stored(pb::BlocksStored {
            parent_block_hash: None,
            block_hashes: chain.to_vec(),
            block_token_counts: vec![],
        })),
    }
}

fn ingest_req(replica: &str, events: Vec<pb::KvEvent>) -> pb::IngestEventsRequest {
    pb::IngestEventsRequest {
        tenant_id: "acme".into(),
        model_id: "llama".into(),
        hash_scheme: "vllm".into(),
        replica_id: replica.into(),
        endpoint: String::new(),
        events,
    }
}

const CHAIN: [u64; 6] = [11, 12, 13, 14, 15, 16];

#[tokio::test]
async fn ingest_then_lookup_routes_to_the_holder() {
    let Servers {
        lookup: mut client,
        mut ingest,
        ..
    } = mk_server().await;
    let out = ingest
        .ingest_events(ingest_req("r2", vec![stored(&CHAIN)]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!((out.applied, out.rejected), (1, 0));
    let resp = client
        .lookup_route(scope_req(&CHAIN))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(resp.reason_code(), pb::ReasonCode::PrefixMatch);
    assert_eq!(resp.strategy(), pb::Strategy::PrefixMatch);
    assert_eq!(resp.scores[0].replica_id, "r2");
    assert_eq!(resp.scores[0].endpoint, "127.0.0.1:8002");
    assert_eq!(resp.scores[0].matched_tokens, 96);
    assert_eq!(resp.scores[0].matched_blocks, 6);
    assert!(resp.scores[0].score > 0.0);
    assert!(resp.policy_revision.starts_with('r'));
}

#[tokio::test]
async fn lookup_diagnostics_and_malformed_requests_answer_cleanly() {
    let mut client = mk_server().await.lookup;
    let mut unknown = scope_req(&CHAIN);
    unknown.tenant_id = "nobody".into();
    let resp = client.lookup_route(unknown).await.unwrap().into_inner();
    assert_eq!(resp.reason_code(), pb::ReasonCode::UnknownTenant);
    assert!(resp.scores.is_empty());

    // Unequal chain arrays: structurally malformed, NO_HINT, never affinity.
    let mut unequal = scope_req(&CHAIN);
    unequal.block_token_counts.pop();
    let resp = client.lookup_route(unequal).await.unwrap().into_inner();
    assert_eq!(resp.reason_code(), pb::ReasonCode::NoHint);
    assert!(resp.scores.is_empty());

    // Empty keys: NO_HINT.
    for field in 0..3 {
        let mut req = scope_req(&CHAIN);
        match field {
            0 => req.tenant_id.clear(),
            1 => req.model_id.clear(),
            _ => req.hash_scheme.clear(),
        }
        let resp = client.lookup_route(req).await.unwrap().into_inner();
        assert_eq!(resp.reason_code(), pb::ReasonCode::NoHint, "field {field}");
    }

    // A huge chain is refused with a message, not decided.
    let huge: Vec<u64> = (0..70_000).collect();
    let err = client.lookup_route(scope_req(&huge)).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("at most"), "{}", err.message());

    // The server is still fine afterwards.
    let resp = client
        .lookup_route(scope_req(&CHAIN))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(resp.reason_code(), pb::ReasonCode::AffinityHint);
    assert_eq!(resp.scores.len(), 1);
}

#[tokio::test]
async fn ingest_refuses_bad_headers_and_counts_bad_events() {
    let Servers {
        mut lookup,
        ingest: mut client,
        ..
    } = mk_server().await;
    let mut no_replica = ingest_req("", vec![stored(&CHAIN)]);
    let err = client.ingest_events(no_replica.clone()).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("replica_id"), "{}", err.message());

    no_replica.replica_id = "r1".into();
    no_replica.tenant_id.clear();
    let err = client.ingest_events(no_replica).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);

    let mut probe = ingest_req("r1", vec![stored(&CHAIN)]);
    probe.tenant_id = "inferencecache.io/probe".into();
    let err = client.ingest_events(probe).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);

    let unequal = pb::KvEvent {
        event: Some(pb::kv_event::Event::Stored(pb::BlocksStored {
            parent_block_hash: None,
            block_hashes: vec![1, 2, 3],
            block_token_counts: vec![16],
        })),
    };
    let events = vec![
        stored(&CHAIN),
        pb::KvEvent { event: None },
        unequal,
        stored(&vec![7; 70_000]),
    ];
    let out = client
        .ingest_events(ingest_req("r1", events))
        .await
        .unwrap()
        .into_inner();
    assert_eq!((out.applied, out.rejected), (1, 3));
    // Nothing of the rejected events was stored.
    let resp = lookup
        .lookup_route(scope_req(&[1, 2, 3]))
        .await
        .unwrap()
        .into_inner();
    assert_ne!(resp.reason_code(), pb::ReasonCode::PrefixMatch);
}

#[tokio::test]
async fn report_stats_accepts_good_and_refuses_bad_ratios() {
    let mut client = mk_server().await.ingest;
    let mut req = pb::ReportStatsRequest {
        tenant_id: "acme".into(),
        model_id: "llama".into(),
        hash_scheme: "vllm".into(),
        replica_id: "r1".into(),
        endpoint: "127.0.0.1:8001".into(),
        stats: Some(pb::ReplicaStats {
            cache_memory_bytes: 1 << 30,
            hit_rate: 0.5,
            waiting_requests: 2,
            running_requests: 4,
            kv_cache_usage: 0.25,
        }),
    };
    client.report_stats(req.clone()).await.unwrap();

    req.stats.as_mut().unwrap().hit_rate = 1.5;
    let err = client.report_stats(req.clone()).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("hit_rate"));

    req.stats = None;
    let err = client.report_stats(req.clone()).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);

    req.stats = Some(pb::ReplicaStats::default());
    req.replica_id.clear();
    let err = client.report_stats(req).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
}

#[tokio::test]
async fn health_and_reflection_are_served() {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    let addr = mk_server().await.lookup_addr;
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = HealthClient::new(channel.clone());
    let resp = health
        .check(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(resp.status(), ServingStatus::Serving);

    use tonic_reflection::pb::v1::ServerReflectionRequest;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    let mut reflection = ServerReflectionClient::new(channel);
    let req = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut stream = reflection
        .server_reflection_info(tokio_stream::iter([req]))
        .await
        .unwrap()
        .into_inner();
    let msg = stream.message().await.unwrap().unwrap();
    let Some(MessageResponse::ListServicesResponse(list)) = msg.message_response else {
        panic!("unexpected reflection answer");
    };
    let names: Vec<_> = list.service.iter().map(|s| s.name.as_str()).collect();
    assert!(
        names.contains(&"inferencecache.v1.CacheService"),
        "{names:?}"
    );
}

#[tokio::test]
async fn each_port_refuses_the_other_ports_rpcs_and_says_where_to_go() {
    let Servers {
        mut lookup,
        mut ingest,
        ..
    } = mk_server().await;
    let err = lookup
        .ingest_events(ingest_req("r2", vec![stored(&CHAIN)]))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unimplemented);
    assert!(err.message().contains("--ingest-addr"), "{}", err.message());
    let err = lookup
        .report_stats(pb::ReportStatsRequest::default())
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unimplemented);
    assert!(err.message().contains("--ingest-addr"), "{}", err.message());
    // Nothing was ingested through the refused call.
    let resp = lookup
        .lookup_route(scope_req(&CHAIN))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(resp.reason_code(), pb::ReasonCode::AffinityHint);

    let err = ingest.lookup_route(scope_req(&CHAIN)).await.unwrap_err();
    assert_eq!(err.code(), Code::Unimplemented);
    assert!(err.message().contains("--grpc-addr"), "{}", err.message());
}

#[tokio::test]
async fn a_holder_its_engine_reports_swamped_spills_and_the_answer_says_so() {
    let Servers {
        lookup: mut client,
        mut ingest,
        ..
    } = mk_server().await;
    ingest
        .ingest_events(ingest_req("r1", vec![stored(&CHAIN)]))
        .await
        .unwrap();
    let first = client
        .lookup_route(scope_req(&CHAIN))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(first.scores[0].replica_id, "r1");
    assert_eq!(first.spilled_from, "");
    assert_eq!(first.spilled_by, "");
    // The engine says it has 40 requests queued: r1 is far over the bound.
    let stats = pb::ReportStatsRequest {
        tenant_id: "acme".into(),
        model_id: "llama".into(),
        hash_scheme: "vllm".into(),
        replica_id: "r1".into(),
        endpoint: String::new(),
        stats: Some(pb::ReplicaStats {
            waiting_requests: 32,
            running_requests: 8,
            ..Default::default()
        }),
    };
    ingest.report_stats(stats).await.unwrap();
    let moved = client
        .lookup_route(scope_req(&CHAIN))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(moved.reason_code, pb::ReasonCode::PrefixMatch as i32);
    assert_eq!(moved.spilled_from, "r1");
    assert_eq!(moved.spilled_by, "requests");
    assert_ne!(moved.scores[0].replica_id, "r1");
    // LookupRoute is a query: it counted nothing in flight, so asking again
    // gives the same answer.
    let again = client
        .lookup_route(scope_req(&CHAIN))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(again.scores[0].replica_id, moved.scores[0].replica_id);
}

/// `lora_adapter` / `cache_salt` select the blocks stored under the
/// same identity (ic-content-v2; IngestEvents carries the index keys, as
/// `chain::own_chain` computes them), and an oversized one is refused.
#[tokio::test]
async fn lookup_identity_fields_select_the_blocks_of_that_identity() {
    use inferencecache::core::chain::{self, BlockIdentity, IC_CONTENT_V2, Scheme};
    let Servers {
        lookup: mut client,
        mut ingest,
        ..
    } = mk_server().await;
    let tokens: Vec<u32> = (0..96).collect();
    let holders = [("r1", "", ""), ("r2", "sql", ""), ("r3", "", "tenant-7")];
    for (replica, lora, salt) in holders {
        let keys = chain::own_chain(
            Scheme::ContentV2,
            16,
            &tokens,
            &BlockIdentity {
                lora,
                salt,
                mm: &[],
            },
        )
        .unwrap();
        let mut req = ingest_req(replica, vec![stored(&keys)]);
        req.hash_scheme = IC_CONTENT_V2.into();
        req.endpoint = format!("10.0.0.{}:8000", &replica[1..]);
        let out = ingest.ingest_events(req).await.unwrap().into_inner();
        assert_eq!((out.applied, out.rejected), (1, 0));
    }
    let chain = chain::compute_chain(Scheme::ContentV2, &tokens, 16, None).unwrap();
    let ask = |lora: &str, salt: &str| {
        let mut req = scope_req(&chain);
        req.hash_scheme = IC_CONTENT_V2.into();
        req.lora_adapter = lora.into();
        req.cache_salt = salt.into();
        req
    };
    for (lora, salt, holder) in holders.map(|(r, l, s)| (l, s, r)) {
        let resp = client
            .lookup_route(ask(lora, salt))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            resp.reason_code(),
            pb::ReasonCode::PrefixMatch,
            "{lora:?}/{salt:?}"
        );
        assert_eq!(
            resp.scores.len(),
            1,
            "only {holder} holds it: {:?}",
            resp.scores
        );
        assert_eq!(resp.scores[0].replica_id, holder);
        assert_eq!(resp.scores[0].matched_tokens, 96);
    }
    let resp = client
        .lookup_route(ask("sql", "tenant-7"))
        .await
        .unwrap()
        .into_inner();
    assert_ne!(resp.reason_code(), pb::ReasonCode::PrefixMatch);

    let long = "x".repeat(chain::content_v2::MAX_IDENTITY_LEN + 1);
    let err = client.lookup_route(ask("", &long)).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("cache_salt"), "{}", err.message());
}

/// Flow control holds ext_proc requests only: with it on and every replica's
/// engine reporting a full queue, LookupRoute still answers at once, with the
/// decision of that moment.
#[tokio::test]
async fn lookup_is_never_held_by_flow_control() {
    let policy = ResolvedPolicy {
        flow_control: inferencecache::core::policy::FlowControl {
            enabled: true,
            max_queue_wait: std::time::Duration::from_secs(20),
            max_queued: 1,
            ..Default::default()
        },
        ..ResolvedPolicy::default()
    };
    let Servers {
        lookup: mut client,
        mut ingest,
        ..
    } = mk_server_with(mk_snapshot_with(policy)).await;
    ingest
        .ingest_events(ingest_req("r1", vec![stored(&CHAIN)]))
        .await
        .unwrap();
    for replica in ["r1", "r2", "r3"] {
        let stats = pb::ReportStatsRequest {
            tenant_id: "acme".into(),
            model_id: "llama".into(),
            hash_scheme: "vllm".into(),
            replica_id: replica.into(),
            endpoint: String::new(),
            stats: Some(pb::ReplicaStats {
                waiting_requests: 50,
                ..Default::default()
            }),
        };
        ingest.report_stats(stats).await.unwrap();
    }
    for _ in 0..3 {
        let answer = tokio::time::timeout(
            std::time::Duration::from_secs(5),
            client.lookup_route(scope_req(&CHAIN)),
        )
        .await
        .expect("answered, not held")
        .unwrap()
        .into_inner();
        assert_eq!(answer.reason_code, pb::ReasonCode::PrefixMatch as i32);
        assert_eq!(answer.scores[0].replica_id, "r1");
    }
}
