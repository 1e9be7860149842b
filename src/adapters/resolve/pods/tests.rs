use serde_json::json;

use super::*;
use crate::crd::cache_backend::CacheBackend;

pub(crate) fn pod(ns: &str, name: &str, app: &str, ip: Option<&str>, ready: bool) -> Pod {
    let mut status = json!({"conditions": [
        {"type": "Ready", "status": if ready { "True" } else { "False" }}
    ]});
    if let Some(ip) = ip {
        status["podIP"] = json!(ip);
    }
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "labels": {"app": app}},
        "spec": {"containers": []}, "status": status,
    }))
    .unwrap()
}

fn spec(extra: serde_json::Value) -> CacheBackendSpec {
    let mut spec = json!({"engine": "vLLM", "modelID": "m", "hashScheme": "s",
                              "selector": {"matchLabels": {"app": "llama"}}});
    for (k, v) in extra.as_object().unwrap() {
        spec[k] = v.clone();
    }
    let b: CacheBackend = serde_json::from_value(json!({
        "apiVersion": "inferencecache.io/v1alpha1", "kind": "CacheBackend",
        "metadata": {"name": "b", "namespace": "ns"}, "spec": spec,
    }))
    .unwrap();
    b.spec
}

fn run(spec: &CacheBackendSpec, pods: &[Pod]) -> Result<Vec<DeclaredReplica>, DiscoveryError> {
    discovered("ns", spec.selector.as_ref().unwrap(), spec, pods)
}

#[test]
fn ready_matching_pods_in_the_namespace_are_replicas() {
    let s = spec(json!({"targetPort": 8000, "kvEvents": {"port": 5557, "replayPort": 5558}}));
    let pods = [
        pod("ns", "b-1", "llama", Some("10.0.0.2"), true),
        pod("ns", "a-0", "llama", Some("10.0.0.1"), true),
        pod("ns", "not-ready", "llama", Some("10.0.0.3"), false),
        pod("ns", "no-ip", "llama", None, true),
        pod("ns", "other-app", "mistral", Some("10.0.0.4"), true),
        pod("elsewhere", "same-label", "llama", Some("10.0.0.5"), true),
    ];
    let r = run(&s, &pods).unwrap();
    let ids: Vec<&str> = r.iter().map(|r| r.id.as_str()).collect();
    assert_eq!(ids, ["a-0", "b-1"]);
    assert_eq!(r[0].address, "10.0.0.1:8000");
    assert_eq!(
        r[0].kv_events_endpoint.as_deref(),
        Some("tcp://10.0.0.1:5557")
    );
    assert_eq!(
        r[0].kv_replay_endpoint.as_deref(),
        Some("tcp://10.0.0.1:5558")
    );
}

#[test]
fn terminating_pods_are_not_replicas() {
    let s = spec(json!({"targetPort": 8000}));
    let mut p = pod("ns", "a", "llama", Some("10.0.0.1"), true);
    p.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
        jiff::Timestamp::from_second(1_700_000_000).unwrap(),
    ));
    assert!(run(&s, &[p]).unwrap().is_empty());
}

#[test]
fn ipv6_pods_get_brackets_and_no_kv_ports_means_no_event_endpoint() {
    let s = spec(json!({"targetPort": 8000}));
    let r = run(&s, &[pod("ns", "a", "llama", Some("fd00::1"), true)]).unwrap();
    assert_eq!(r[0].address, "[fd00::1]:8000");
    assert_eq!(r[0].kv_events_endpoint, None);
    assert_eq!(r[0].kv_replay_endpoint, None);
}

#[test]
fn a_selector_without_target_port_is_an_error() {
    let s = spec(json!({}));
    let e = run(&s, &[]).unwrap_err();
    assert_eq!(e.field, "spec.targetPort");
}

#[test]
fn a_bad_selector_operator_is_an_error() {
    let s = spec(json!({"targetPort": 1, "selector": {"matchExpressions": [
            {"key": "app", "operator": "Near", "values": ["x"]}]}}));
    let e = run(&s, &[]).unwrap_err();
    assert_eq!(e.field, "spec.selector");
}
