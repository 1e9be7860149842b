use serde_json::json;

use super::*;

fn spec(v: serde_json::Value) -> CacheBackendSpec {
    serde_json::from_value(v).unwrap()
}

#[test]
fn rank_r_moves_the_port_by_r() {
    assert_eq!(
        rank_endpoint("tcp://10.0.0.7:5557", 0).unwrap(),
        "tcp://10.0.0.7:5557"
    );
    assert_eq!(
        rank_endpoint("tcp://10.0.0.7:5557", 3).unwrap(),
        "tcp://10.0.0.7:5560"
    );
    assert_eq!(
        rank_endpoint("tcp://[fd00::7]:5557", 1).unwrap(),
        "tcp://[fd00::7]:5558"
    );
    assert_eq!(
        rank_endpoint("bind:tcp://*:6000", 2).unwrap(),
        "bind:tcp://*:6002"
    );
    let e = rank_endpoint("tcp://h:65535", 1).unwrap_err();
    assert!(e.contains("port 65536, above 65535"), "{e}");
    assert!(rank_endpoint("ipc:///tmp/kv", 1).is_err());
    assert!(rank_endpoint("tcp://h:port", 1).is_err());
}

#[test]
fn endpoint_size_overrides_the_backend_size() {
    let s = spec(json!({"engine": "vLLM", "modelID": "m", "hashScheme": "h",
            "dataParallelSize": 2,
            "endpoints": [{"id": "a", "address": "h:1", "dataParallelSize": 4},
                          {"id": "b", "address": "h:2"}]}));
    assert_eq!(declared_size(&s, Some(0)), 4);
    assert_eq!(declared_size(&s, Some(1)), 2);
    assert_eq!(declared_size(&s, None), 2);
    assert!(backend_errors(&s).is_empty());
}

#[test]
fn bad_sizes_and_overflowing_ports_are_named() {
    let s = spec(json!({"engine": "vLLM", "modelID": "m", "hashScheme": "h",
            "dataParallelSize": 0}));
    let e = backend_errors(&s);
    assert_eq!(e[0].0, "spec.dataParallelSize");
    assert!(
        e[0].1.contains("0 is not a data-parallel size (1-256)"),
        "{e:?}"
    );

    let s = spec(json!({"engine": "vLLM", "modelID": "m", "hashScheme": "h",
            "kvEvents": {"port": 65530, "replayPort": 5558},
            "endpoints": [{"id": "a", "address": "h:1", "dataParallelSize": 8},
                          {"id": "b", "address": "h:2", "dataParallelSize": 300,
                           "kvEventsEndpoint": "tcp://h:1"},
                          {"id": "c", "address": "h:3", "dataParallelSize": 2,
                           "kvEventsEndpoint": "tcp://h:65535",
                           "kvReplayEndpoint": "tcp://h:6000"},
                          {"id": "d", "address": "h:4", "kvReplayEndpoint": "h:6000"}]}));
    let e = backend_errors(&s);
    let fields: Vec<&str> = e.iter().map(|(f, _)| f.as_str()).collect();
    assert_eq!(
        fields,
        [
            "spec.kvEvents.port",
            "spec.endpoints[1].dataParallelSize",
            "spec.endpoints[2].kvEventsEndpoint",
            "spec.endpoints[3].kvReplayEndpoint",
        ],
        "{e:?}"
    );
    assert!(e[0].1.contains("reaches port 65537"), "{e:?}");
    assert!(e[2].1.contains("rank 1 would use port 65536"), "{e:?}");
    assert!(e[3].1.contains("is not tcp://host:port"), "{e:?}");
}
