use kube::Resource;
use serde_json::json;

use super::*;

#[test]
fn reads_gie_v1_pools_and_ignores_what_it_does_not_model() {
    let pool: InferencePool = serde_json::from_value(json!({
        "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
        "metadata": {"name": "llama", "namespace": "team-a"},
        "spec": {
            "selector": {"matchLabels": {"app": "vllm-llama"}},
            "targetPorts": [{"number": 8000}, {"number": 8001}],
            "appProtocol": "http",
            "endpointPickerRef": {"name": "inferencecache", "port": {"number": 50051},
                                  "failureMode": "SomeFutureMode", "group": ""},
            "somethingNew": true,
        },
        "status": {"parents": [{"parentRef": {"name": "gw"}, "conditions": []}]},
    }))
    .unwrap();
    assert_eq!(pool.spec.selector.match_labels["app"], "vllm-llama");
    let ports: Vec<i32> = pool.spec.target_ports.iter().map(|p| p.number).collect();
    assert_eq!(ports, [8000, 8001]);
    let picker = pool.spec.endpoint_picker_ref.unwrap();
    assert_eq!(picker.name, "inferencecache");
    assert_eq!(picker.port, Some(PoolPort { number: 50051 }));
    assert_eq!(picker.failure_mode.as_deref(), Some("SomeFutureMode"));
}

#[test]
fn api_coordinates_are_gies() {
    assert_eq!(
        InferencePool::api_version(&()),
        "inference.networking.k8s.io/v1"
    );
    assert_eq!(InferencePool::plural(&()), "inferencepools");
    assert_eq!(InferencePool::group(&()), GROUP);
}
