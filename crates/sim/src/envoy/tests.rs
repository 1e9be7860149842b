use super::*;

fn addr(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

#[test]
fn a_listener_per_router_with_its_own_balancer() {
    let listeners = [
        (Router::RoundRobin, addr(1)),
        (Router::LeastRequest, addr(2)),
        (Router::InferenceCache, addr(3)),
    ];
    let c = config(&listeners, &[addr(10), addr(11)], addr(20), addr(30), false).unwrap();
    let ls = c["static_resources"]["listeners"].as_array().unwrap();
    assert_eq!(ls.len(), 3);
    let hcm = |i: usize| &ls[i]["filter_chains"][0]["filters"][0]["typed_config"];
    let has_ext_proc = |i: usize| {
        hcm(i)["http_filters"]
            .as_array()
            .unwrap()
            .iter()
            .any(|f| f["name"] == "envoy.filters.http.ext_proc")
    };
    let cluster = |i: usize| {
        hcm(i)["route_config"]["virtual_hosts"][0]["routes"][0]["route"]["cluster"].clone()
    };
    assert!(!has_ext_proc(0) && !has_ext_proc(1) && has_ext_proc(2));
    assert_eq!(cluster(0), "round_robin");
    assert_eq!(cluster(1), "least_request");
    assert_eq!(cluster(2), "replicas");

    let clusters = c["static_resources"]["clusters"].as_array().unwrap();
    let by_name = |n: &str| clusters.iter().find(|c| c["name"] == n).unwrap();
    assert_eq!(by_name("least_request")["lb_policy"], "LEAST_REQUEST");
    assert!(by_name("least_request")["load_balancing_policy"].is_null());
    assert!(by_name("replicas")["load_balancing_policy"].is_object());
    let port = |n: &str| {
        by_name(n)["load_assignment"]["endpoints"][0]["lb_endpoints"][1]["endpoint"]["address"]
                ["socket_address"]["port_value"]
                .clone()
    };
    assert_eq!(port("replicas"), 11);
    assert_eq!(port("random"), 11);
    assert_eq!(c["admin"]["address"]["socket_address"]["port_value"], 30);
}

#[test]
fn body_mode_streams_the_request_body_to_the_sidecar_only() {
    let listeners = [
        (Router::RoundRobin, addr(1)),
        (Router::InferenceCache, addr(3)),
    ];
    let mode = |body_mode: bool| {
        let c = config(&listeners, &[addr(10)], addr(20), addr(30), body_mode).unwrap();
        let l = &c["static_resources"]["listeners"][1];
        assert_eq!(l["name"], "inferencecache");
        let filters = l["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]
            .as_array()
            .unwrap()
            .clone();
        let ext_proc = filters
            .iter()
            .find(|f| f["name"] == "envoy.filters.http.ext_proc")
            .unwrap();
        ext_proc["typed_config"]["processing_mode"].clone()
    };
    let headers_only = mode(false);
    assert_eq!(headers_only["request_body_mode"], "NONE");
    assert_eq!(headers_only["request_trailer_mode"], "SKIP");
    let body = mode(true);
    assert_eq!(body["request_body_mode"], "FULL_DUPLEX_STREAMED");
    assert_eq!(body["request_trailer_mode"], "SEND");
    // Everything else is the shipped configuration's.
    assert_eq!(
        body["request_header_mode"],
        headers_only["request_header_mode"]
    );
    assert_eq!(body["response_body_mode"], "NONE");
}

#[test]
fn the_oracle_has_no_listener() {
    let err = config(
        &[(Router::Oracle, addr(1))],
        &[addr(10)],
        addr(20),
        addr(30),
        false,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("oracle"), "{err}");
}
