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
mod tests;
