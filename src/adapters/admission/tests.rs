//! The admission rules, allowed and denied: AdmissionReview fixtures on disk
//! (`tests/fixtures/admission/`, shaped like what an apiserver sends), inline
//! reviews for the remaining rules, and one HTTPS round trip on loopback.

use std::path::PathBuf;
use std::sync::Arc;

use kube::core::DynamicObject;
use kube::core::admission::AdmissionReview;
use serde_json::{Value, json};

use super::{problems, review};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/admission")
}

fn answer(review_json: Value) -> (bool, String, String) {
    let parsed: AdmissionReview<DynamicObject> = serde_json::from_value(review_json).unwrap();
    let out = serde_json::to_value(review(parsed)).unwrap();
    let response = &out["response"];
    (
        response["allowed"].as_bool().unwrap(),
        response["status"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
        response["uid"].as_str().unwrap_or_default().to_string(),
    )
}

/// Every fixture: `allow-*` must be allowed, `deny-*` denied with a message
/// naming the field.
#[test]
fn fixtures_are_allowed_or_denied_as_named() {
    let expected_denials = [
        (
            "deny-tenant-create-reserved.json",
            "spec.tenantID: \"inferencecache.io/probe\" is reserved",
        ),
        (
            "deny-tenant-update-introduces-reserved.json",
            "spec.tenantID: \"inferencecache.io/probe\" is reserved",
        ),
        (
            "deny-tenant-create-empty-id.json",
            "spec.tenantID: must be non-empty",
        ),
        (
            "deny-policy-create-require-chain.json",
            "spec.strategy.requireChain: true requires spec.strategy.enableChainMatching",
        ),
        (
            "deny-policy-update-require-chain.json",
            "spec.strategy.requireChain: true requires",
        ),
        (
            "deny-policy-create-floor-pattern.json",
            "spec.routingFloorScore: \"high\" does not match the pattern",
        ),
        (
            "deny-policy-create-minimum.json",
            "spec.minimumMatchedTokens: -1 is below the minimum 0",
        ),
    ];
    let mut seen = 0;
    let mut names: Vec<_> = std::fs::read_dir(fixtures())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".json"))
        .collect();
    names.sort();
    for name in names {
        let text = std::fs::read_to_string(fixtures().join(&name)).unwrap();
        let fixture: Value = serde_json::from_str(&text).unwrap();
        let uid = fixture["request"]["uid"].as_str().unwrap().to_string();
        let (allowed, message, echoed) = answer(fixture);
        assert_eq!(echoed, uid, "{name}: the uid is echoed");
        if name.starts_with("allow-") {
            assert!(allowed, "{name}: denied: {message}");
        } else {
            assert!(!allowed, "{name}: allowed");
            let (_, want) = expected_denials
                .iter()
                .find(|(n, _)| *n == name)
                .unwrap_or_else(|| panic!("{name}: no expected message in the table"));
            assert!(message.contains(want), "{name}: {message}");
            seen += 1;
        }
    }
    assert_eq!(seen, expected_denials.len());
}

fn mk(kind: &str, spec: Value) -> Value {
    json!({"apiVersion": "inferencecache.io/v1alpha1", "kind": kind,
           "metadata": {"name": "x", "namespace": "team-a"}, "spec": spec})
}

fn denied(kind: &str, spec: Value) -> String {
    let p = problems(kind, &mk(kind, spec), None);
    assert!(!p.is_empty(), "{kind} admitted");
    p.join("; ")
}

fn admitted(kind: &str, spec: Value) {
    let p = problems(kind, &mk(kind, spec), None);
    assert!(p.is_empty(), "{kind} denied: {p:?}");
}

#[test]
fn policy_minimums_types_enums_and_unknown_fields() {
    admitted("CachePolicy", json!({}));
    admitted(
        "CachePolicy",
        json!({"routingFloorScore": "0", "minimumMatchedTokens": 0, "lookupTimeoutMs": 0,
               "strategy": {"requireChain": true, "enableChainMatching": true}}),
    );
    let m = denied("CachePolicy", json!({"minimumPrefixTokens": -1}));
    assert!(
        m.contains("spec.minimumPrefixTokens: -1 is below the minimum 0"),
        "{m}"
    );
    let m = denied("CachePolicy", json!({"lookupTimeoutMs": -3}));
    assert!(m.contains("spec.lookupTimeoutMs"), "{m}");
    let m = denied("CachePolicy", json!({"routingFloorScore": "-0.5"}));
    assert!(m.contains("spec.routingFloorScore"), "{m}");
    let m = denied("CachePolicy", json!({"routingFloorScore": "1e3"}));
    assert!(m.contains("spec.routingFloorScore"), "{m}");
    let m = denied("CachePolicy", json!({"evictionTTL": "ten minutes"}));
    assert!(m.contains("spec.evictionTTL"), "{m}");
    let m = denied("CachePolicy", json!({"eviction": "FIFO"}));
    assert!(m.contains("spec.eviction: \"FIFO\" is not one of"), "{m}");
    // An absent isolationMode is fine; the refusal lists the modes, never "null".
    admitted(
        "CacheTenant",
        json!({"tenantID": "acme", "isolationMode": "Fairness"}),
    );
    let m = denied(
        "CacheTenant",
        json!({"tenantID": "acme", "isolationMode": "Strict"}),
    );
    assert!(
        m.contains(r#"spec.isolationMode: "Strict" is not one of ["Fairness"]"#),
        "{m}"
    );
    let m = denied("CachePolicy", json!({"affinityRouting": true}));
    assert!(
        m.contains("spec.affinityRouting: must be of type string"),
        "{m}"
    );
    let m = denied("CachePolicy", json!({"strategy": {"requireChian": true}}));
    assert!(
        m.contains("spec.strategy.requireChian: unknown field"),
        "{m}"
    );
}

#[test]
fn tenant_quota_minimum_and_reserved_id() {
    admitted(
        "CacheTenant",
        json!({"tenantID": "acme", "quota": {"maxIndexEntries": 0}}),
    );
    let m = denied(
        "CacheTenant",
        json!({"tenantID": "acme", "quota": {"maxIndexEntries": -1}}),
    );
    assert!(m.contains("spec.quota.maxIndexEntries: -1 is below"), "{m}");
    let m = denied("CacheTenant", json!({}));
    assert!(
        m.contains("spec.tenantID: required field is missing"),
        "{m}"
    );
    let m = denied(
        "CacheTenant",
        json!({"tenantID": "inferencecache.io/probe"}),
    );
    assert!(m.contains("reserved"), "{m}");
    // The reserved-id finding is not repeated by the CEL safety net.
    assert!(!m.contains("(CEL)"), "{m}");
}

#[test]
fn reserved_id_on_update_only_when_introduced() {
    let tenant = |id: &str, quota: i64| {
        mk(
            "CacheTenant",
            json!({"tenantID": id, "quota": {"maxIndexEntries": quota}}),
        )
    };
    let probe = "inferencecache.io/probe";
    // Unchanged older object, unrelated edit: admitted.
    assert!(problems("CacheTenant", &tenant(probe, 2), Some(&tenant(probe, 1))).is_empty());
    // Introduced by the update: denied.
    let p = problems("CacheTenant", &tenant(probe, 1), Some(&tenant("acme", 1)));
    assert!(p.iter().any(|m| m.contains("reserved")), "{p:?}");
    // An older object does not excuse other new problems.
    let p = problems("CacheTenant", &tenant(probe, -1), Some(&tenant(probe, 1)));
    assert!(p.iter().any(|m| m.contains("maxIndexEntries")), "{p:?}");
    // Other rules are not ratcheted: a bad strategy is refused on UPDATE too.
    let bad = mk(
        "CachePolicy",
        json!({"strategy": {"requireChain": true, "enableChainMatching": false}}),
    );
    assert!(!problems("CachePolicy", &bad, Some(&bad)).is_empty());
}

#[test]
fn backend_required_strings_and_bounds() {
    let ok = json!({"engine": "vLLM", "modelID": "m", "hashScheme": "vllm-sha256-cbor",
                    "endpoints": [{"id": "r1", "address": "10.0.0.1:8000"}]});
    admitted("CacheBackend", ok);
    let m = denied(
        "CacheBackend",
        json!({"engine": "vLLM", "modelID": "", "hashScheme": ""}),
    );
    assert!(m.contains("spec.modelID: must be non-empty"), "{m}");
    assert!(m.contains("spec.hashScheme: must be non-empty"), "{m}");
    let m = denied(
        "CacheBackend",
        json!({"engine": "vLLM", "modelID": "m", "hashScheme": "h",
               "endpoints": [{"id": "", "address": ""}]}),
    );
    assert!(m.contains("spec.endpoints[0].id: must be non-empty"), "{m}");
    assert!(
        m.contains("spec.endpoints[0].address: must be non-empty"),
        "{m}"
    );
    let m = denied(
        "CacheBackend",
        json!({"engine": "TGI", "modelID": "m", "hashScheme": "h", "blockSize": 0}),
    );
    assert!(m.contains("spec.engine"), "{m}");
    assert!(
        m.contains("spec.blockSize: 0 is below the minimum 1"),
        "{m}"
    );
}

#[test]
fn backend_data_parallel_sizes_and_ports() {
    admitted(
        "CacheBackend",
        json!({"engine": "vLLM", "modelID": "m", "hashScheme": "h", "dataParallelSize": 2,
               "kvEvents": {"port": 5557, "replayPort": 5558},
               "endpoints": [{"id": "r1", "address": "10.0.0.1:8000",
                              "kvReplayEndpoint": "tcp://10.0.0.1:6000"}]}),
    );
    // Out of the schema's range: the structural check names the field.
    let m = denied(
        "CacheBackend",
        json!({"engine": "vLLM", "modelID": "m", "hashScheme": "h", "dataParallelSize": 0}),
    );
    assert!(m.contains("spec.dataParallelSize"), "{m}");
    let m = denied(
        "CacheBackend",
        json!({"engine": "vLLM", "modelID": "m", "hashScheme": "h",
               "endpoints": [{"id": "r1", "address": "h:1", "dataParallelSize": 2,
                              "kvEventsEndpoint": "tcp://h:65535"},
                             {"id": "r2", "address": "h:2", "kvReplayEndpoint": "h:6000"}]}),
    );
    assert!(
        m.contains("spec.endpoints[0].kvEventsEndpoint: \"tcp://h:65535\": rank 1 would use port 65536, above 65535"),
        "{m}"
    );
    assert!(
        m.contains("spec.endpoints[1].kvReplayEndpoint: \"h:6000\" is not tcp://host:port"),
        "{m}"
    );
}

#[test]
fn template_required_strings_and_slot_type() {
    admitted(
        "PromptTemplate",
        json!({"body": "{{a}}", "slots": [{"name": "a", "type": "Stable"}]}),
    );
    let m = denied(
        "PromptTemplate",
        json!({"body": "", "slots": [{"name": "", "type": "Mutable"}]}),
    );
    assert!(m.contains("spec.body: must be non-empty"), "{m}");
    assert!(m.contains("spec.slots[0].name: must be non-empty"), "{m}");
    let m = denied(
        "PromptTemplate",
        json!({"body": "b", "slots": [{"name": "a", "type": "Sometimes"}]}),
    );
    assert!(m.contains("spec.slots[0].type"), "{m}");
    let m = denied("PromptTemplate", json!({"slots": []}));
    assert!(m.contains("spec.body: required field is missing"), "{m}");
}

#[test]
fn topology_pools_name_declared_accelerators() {
    admitted(
        "PDTopology",
        json!({"acceleratorTypes": [{"name": "h100"}],
               "prefillPools": [{"name": "p", "acceleratorType": "h100", "replicas": 0}],
               "decodePools": [{"name": "d"}]}),
    );
    let m = denied(
        "PDTopology",
        json!({"acceleratorTypes": [{"name": "h100"}],
               "decodePools": [{"name": "d", "acceleratorType": "mi300"}]}),
    );
    assert!(
        m.contains("spec.decodePools[0].acceleratorType: \"mi300\" is not a declared"),
        "{m}"
    );
    let m = denied(
        "PDTopology",
        json!({"prefillPools": [{"name": "", "acceleratorType": "h100", "replicas": -1}]}),
    );
    assert!(
        m.contains("spec.prefillPools[0].replicas: -1 is below"),
        "{m}"
    );
    let m = denied(
        "PDTopology",
        json!({"acceleratorTypes": [{"name": ""}], "prefillPools": [{"name": ""}]}),
    );
    assert!(
        m.contains("spec.acceleratorTypes[0].name: must be non-empty"),
        "{m}"
    );
    assert!(
        m.contains("spec.prefillPools[0].name: must be non-empty"),
        "{m}"
    );
}

fn raw_review(op: &str, group: &str, kind: &str, object: Value) -> Value {
    json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": "abc", "kind": {"group": group, "version": "v1alpha1", "kind": kind},
        "resource": {"group": group, "version": "v1alpha1", "resource": "things"},
        "name": "x", "namespace": "team-a", "operation": op,
        "userInfo": {}, "object": object, "oldObject": null}})
}

#[test]
fn delete_foreign_kinds_and_malformed_reviews() {
    let bad = mk("CacheTenant", json!({"tenantID": ""}));
    let (allowed, ..) = answer(raw_review(
        "DELETE",
        "inferencecache.io",
        "CacheTenant",
        Value::Null,
    ));
    assert!(allowed, "DELETE is not validated");
    let (allowed, ..) = answer(raw_review(
        "CREATE",
        "example.com",
        "CacheTenant",
        bad.clone(),
    ));
    assert!(allowed, "kinds of other groups pass untouched");
    let (allowed, message, _) = answer(raw_review(
        "CREATE",
        "inferencecache.io",
        "CacheTenant",
        bad,
    ));
    assert!(!allowed);
    assert!(
        message.starts_with("CacheTenant x: spec.tenantID"),
        "{message}"
    );
    let (allowed, message, _) = answer(raw_review(
        "CREATE",
        "inferencecache.io",
        "CacheTenant",
        Value::Null,
    ));
    assert!(!allowed);
    assert!(message.contains("no object"), "{message}");
    let (allowed, message, _) = answer(json!({"apiVersion": "admission.k8s.io/v1",
                                               "kind": "AdmissionReview"}));
    assert!(!allowed);
    assert!(message.contains("no request"), "{message}");
}

#[test]
fn tls_files_that_do_not_exist_or_do_not_match_are_named() {
    let dir = fixtures().join("tls");
    let err = super::tls_config(&dir.join("missing.pem"), &dir.join("key.pem")).unwrap_err();
    assert!(format!("{err:#}").contains("missing.pem"), "{err:#}");
    let err = super::tls_config(&dir.join("ca.pem"), &dir.join("key.pem")).unwrap_err();
    assert!(
        format!("{err:#}").contains("do not form a usable pair"),
        "{err:#}"
    );
}

/// The real thing: HTTPS on loopback with the checked-in test certificate, a
/// client that trusts only the test CA, one denied and one allowed review.
#[tokio::test]
async fn https_round_trip_on_loopback() {
    use http_body_util::{BodyExt, Full};
    use hyper_util::rt::TokioIo;
    use tokio_rustls::TlsConnector;
    use tokio_rustls::rustls::pki_types::pem::PemObject;
    use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName};
    use tokio_rustls::rustls::{ClientConfig, RootCertStore};

    let dir = fixtures().join("tls");
    let tls = super::tls_config(&dir.join("cert.pem"), &dir.join("key.pem")).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(super::serve(listener, tls, async {
        let _ = stopped.await;
    }));

    let mut roots = RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_file(dir.join("ca.pem")).unwrap())
        .unwrap();
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let client = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = TlsConnector::from(Arc::new(client));

    for (file, want_allowed) in [
        ("deny-tenant-create-reserved.json", false),
        ("allow-tenant-create.json", true),
    ] {
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let name = ServerName::try_from("localhost").unwrap();
        let stream = connector.connect(name, tcp).await.unwrap();
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .unwrap();
        tokio::spawn(conn);
        let body = std::fs::read(fixtures().join(file)).unwrap();
        let request = http::Request::post("/validate")
            .header("host", "localhost")
            .header("content-type", "application/json")
            .body(Full::new(bytes_of(body)))
            .unwrap();
        let response = sender.send_request(request).await.unwrap();
        assert_eq!(response.status(), 200, "{file}");
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        let out: Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(out["kind"], "AdmissionReview");
        assert_eq!(out["apiVersion"], "admission.k8s.io/v1");
        assert_eq!(out["response"]["allowed"], want_allowed, "{file}: {out}");
    }
    stop.send(()).unwrap();
    server.await.unwrap().unwrap();
}

fn bytes_of(v: Vec<u8>) -> axum::body::Bytes {
    axum::body::Bytes::from(v)
}

#[test]
fn policy_load_tuning_is_checked() {
    admitted(
        "CachePolicy",
        json!({"loadAwareness": "Disabled", "loadBalancing": {"factor": "2", "slack": 0, "statsMaxAge": "1s"}}),
    );
    let m = denied("CachePolicy", json!({"loadBalancing": {"factor": "0.9"}}));
    assert!(m.contains("loadBalancing.factor"), "{m}");
    let m = denied("CachePolicy", json!({"loadAwareness": "Maybe"}));
    assert!(m.contains("loadAwareness"), "{m}");
}

#[test]
fn policy_tier_weights_are_decimals_in_0_1() {
    admitted(
        "CachePolicy",
        json!({"tierWeights": {"cpu": "0.75", "disk": "0"}}),
    );
    let m = denied("CachePolicy", json!({"tierWeights": {"cpu": "1.5"}}));
    assert!(
        m.contains("spec.tierWeights.cpu: 1.5 is outside 0..1 (GPU is 1)"),
        "{m}"
    );
    // Not a decimal: the schema's pattern names the field.
    let m = denied("CachePolicy", json!({"tierWeights": {"disk": "-1"}}));
    assert!(m.contains("tierWeights.disk"), "{m}");
}

#[test]
fn backend_inference_pool_ref_is_the_only_replica_source() {
    admitted(
        "CacheBackend",
        json!({"engine": "vLLM", "modelID": "m", "hashScheme": "h",
               "inferencePoolRef": {"name": "llama"}, "kvEvents": {"port": 5557}}),
    );
    for (extra, field) in [
        (
            json!({"selector": {"matchLabels": {"app": "x"}}}),
            "spec.selector",
        ),
        (json!({"targetPort": 8000}), "spec.targetPort"),
        (
            json!({"endpoints": [{"id": "r1", "address": "10.0.0.1:8000"}]}),
            "spec.endpoints",
        ),
    ] {
        let mut spec = json!({"engine": "vLLM", "modelID": "m", "hashScheme": "h",
                              "inferencePoolRef": {"name": "llama"}});
        for (k, v) in extra.as_object().unwrap() {
            spec[k] = v.clone();
        }
        let m = denied("CacheBackend", spec);
        assert!(
            m.contains("spec.inferencePoolRef: excludes ") && m.contains(field),
            "{m}"
        );
        assert!(m.contains("exactly one of spec.selector"), "{m}");
        // The webhook's own message, not the CEL net's.
        assert!(!m.contains("(CEL)"), "{m}");
    }
    let m = denied(
        "CacheBackend",
        json!({"engine": "vLLM", "modelID": "m", "hashScheme": "h",
               "inferencePoolRef": {"name": ""}}),
    );
    assert!(
        m.contains("spec.inferencePoolRef.name: must be non-empty"),
        "{m}"
    );
    let m = denied(
        "CacheBackend",
        json!({"engine": "vLLM", "modelID": "m", "hashScheme": "h",
               "inferencePoolRef": {"name": "llama", "namespace": "other"}}),
    );
    assert!(
        m.contains("spec.inferencePoolRef.namespace: unknown field"),
        "{m}"
    );
}

/// The CRD's CEL rule says the same as the webhook (for clusters that run
/// without the webhook).
#[test]
fn backend_cel_refuses_a_pool_ref_next_to_a_selector() {
    let b: crate::crd::cache_backend::CacheBackend =
        crate::crd::mk_object(json!({"engine": "vLLM", "modelID": "m", "hashScheme": "h",
               "inferencePoolRef": {"name": "llama"},
               "selector": {"matchLabels": {"app": "x"}}}));
    let e = b.validate_cel().unwrap_err().to_string();
    assert!(e.contains("inferencePoolRef excludes selector"), "{e}");
    let b: crate::crd::cache_backend::CacheBackend =
        crate::crd::mk_object(json!({"engine": "vLLM", "modelID": "m", "hashScheme": "h",
               "inferencePoolRef": {"name": "llama"}, "endpoints": []}));
    assert!(b.validate_cel().is_ok());
}

#[test]
fn policy_flow_control_wait_is_a_positive_duration_and_the_bound_at_least_one() {
    admitted(
        "CachePolicy",
        json!({"flowControl": {"enabled": true, "maxQueueWait": "500ms", "maxQueuedRequests": 1}}),
    );
    let m = denied(
        "CachePolicy",
        json!({"flowControl": {"maxQueueWait": "0s"}}),
    );
    assert!(
        m.contains("spec.flowControl.maxQueueWait: must be positive"),
        "{m}"
    );
    // Not a duration: the schema's pattern names the field.
    let m = denied(
        "CachePolicy",
        json!({"flowControl": {"maxQueueWait": "soon"}}),
    );
    assert!(m.contains("flowControl.maxQueueWait"), "{m}");
    let m = denied(
        "CachePolicy",
        json!({"flowControl": {"maxQueuedRequests": 0}}),
    );
    assert!(m.contains("flowControl.maxQueuedRequests"), "{m}");
    admitted(
        "CachePolicy",
        json!({"flowControl": {"maxPrefillBacklogTokens": 0}}),
    );
    let m = denied(
        "CachePolicy",
        json!({"flowControl": {"maxPrefillBacklogTokens": -1}}),
    );
    assert!(m.contains("flowControl.maxPrefillBacklogTokens"), "{m}");
}

#[test]
fn tenant_weight_is_at_least_one() {
    admitted("CacheTenant", json!({"tenantID": "acme", "weight": 3}));
    let m = denied("CacheTenant", json!({"tenantID": "acme", "weight": 0}));
    assert!(m.contains("spec.weight"), "{m}");
}
