//! One Envoy for every router under comparison: a listener per router, all in front
//! of the same engines.
//!
//! The inferencecache listener and its cluster are the shipped
//! `envoy/override-host.yaml` (so the benchmark measures the configuration operators
//! run); the others are the same listener without ext_proc, routed to a cluster with
//! Envoy's own round-robin, random or least-request load balancer.

use std::net::SocketAddr;

use anyhow::{Context, bail};
use serde_json::{Value, json};

use super::router::Router;

/// The shipped recommended configuration.
const OVERRIDE_HOST_YAML: &str = include_str!("../../../envoy/override-host.yaml");

/// The response header that names the upstream Envoy picked (for engines that do
/// not say who they are).
pub const UPSTREAM_HEADER: &str = "x-upstream-host";

/// Makes an ext_proc filter (its JSON) send request bodies to the sidecar in
/// `mode`: `FULL_DUPLEX_STREAMED` (with trailers, as a GIE gateway sends it) or
/// `BUFFERED`, the two modes GIE allows.
pub fn send_bodies(ext_proc: &mut Value, mode: &str) {
    let processing = &mut ext_proc["typed_config"]["processing_mode"];
    processing["request_body_mode"] = json!(mode);
    processing["request_trailer_mode"] = json!(if mode == "BUFFERED" { "SKIP" } else { "SEND" });
}

/// Renders the Envoy bootstrap (JSON) with one listener per entry of `listeners`.
/// With `body_mode`, the ext_proc listeners also stream the request body to the
/// sidecar (`FULL_DUPLEX_STREAMED` with trailers, as a GIE gateway sends it), for
/// clients that send no routing headers.
pub fn config(
    listeners: &[(Router, SocketAddr)],
    engines: &[SocketAddr],
    sidecar: SocketAddr,
    admin: SocketAddr,
    body_mode: bool,
) -> anyhow::Result<Value> {
    let mut config: Value =
        serde_saphyr::from_str(OVERRIDE_HOST_YAML).context("parsing envoy/override-host.yaml")?;
    let socket = |a: SocketAddr| json!({ "socket_address": { "address": a.ip().to_string(), "port_value": a.port() } });
    let endpoints = |addrs: &[SocketAddr]| json!([{ "lb_endpoints": addrs.iter().map(|a| json!({ "endpoint": { "address": socket(*a) } })).collect::<Vec<_>>() }]);

    let statics = &mut config["static_resources"];
    let template = statics["listeners"][0].clone();
    let mut out = Vec::new();
    for (router, addr) in listeners {
        let Some(lb) = router.envoy_cluster() else {
            bail!("{} does not run through Envoy", router.name());
        };
        let mut l = template.clone();
        l["name"] = json!(router.name());
        l["address"] = socket(*addr);
        let hcm = &mut l["filter_chains"][0]["filters"][0]["typed_config"];
        hcm["stat_prefix"] = json!(router.name());
        hcm["route_config"]["response_headers_to_add"] = json!([
            { "header": { "key": UPSTREAM_HEADER, "value": "%UPSTREAM_HOST%" } }
        ]);
        let route = &mut hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"];
        if route.is_null() {
            bail!("override-host.yaml: no route");
        }
        route["cluster"] = json!(lb.cluster);
        let Some(filters) = hcm["http_filters"].as_array_mut() else {
            bail!("override-host.yaml: no http_filters");
        };
        if !lb.ext_proc {
            filters.retain(|f| f["name"] != "envoy.filters.http.ext_proc");
        } else if body_mode {
            let Some(ext_proc) = filters
                .iter_mut()
                .find(|f| f["name"] == "envoy.filters.http.ext_proc")
            else {
                bail!("override-host.yaml: no ext_proc filter");
            };
            send_bodies(ext_proc, "FULL_DUPLEX_STREAMED");
        }
        out.push(l);
    }
    statics["listeners"] = Value::Array(out);

    let Some(clusters) = statics["clusters"].as_array_mut() else {
        bail!("override-host.yaml: no clusters");
    };
    let mut plain = None;
    for c in clusters.iter_mut() {
        match c["name"].as_str() {
            Some("replicas") => {
                c["load_assignment"]["endpoints"] = endpoints(engines);
                let mut p = c.clone();
                if let Some(o) = p.as_object_mut() {
                    o.remove("load_balancing_policy");
                }
                plain = Some(p);
            }
            Some("inferencecache_ext_proc") => {
                c["load_assignment"]["endpoints"] = endpoints(&[sidecar]);
            }
            _ => {}
        }
    }
    let Some(plain) = plain else {
        bail!("override-host.yaml: no replicas cluster");
    };
    for (name, policy) in [
        ("round_robin", "ROUND_ROBIN"),
        ("random", "RANDOM"),
        ("least_request", "LEAST_REQUEST"),
    ] {
        let mut c = plain.clone();
        c["name"] = json!(name);
        c["load_assignment"]["cluster_name"] = json!(name);
        c["lb_policy"] = json!(policy);
        clusters.push(c);
    }
    config["admin"] = json!({ "address": socket(admin) });
    Ok(config)
}

#[cfg(test)]
mod tests {
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
}
