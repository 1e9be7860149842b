//! A CacheBackend's data-parallel ranks: where rank r of an engine publishes and
//! replays, and the validation of the sizes and ports that follow from it (the
//! policy-file loader, the resolver and the admission webhook share it).
//!
//! vLLM's and SGLang's `ZmqEventPublisher` offset the configured endpoint's port
//! by the data-parallel rank (`offset_endpoint_port`): with `tcp://*:5557` and
//! replay `tcp://*:5558`, rank 1 publishes on 5557 + 1 and replays on 5558 + 1.
//! (Their ipc/inproc suffixes do not cross hosts; only tcp is supported here.)
//! A pod with several ranks stays one replica for routing; each rank's stream is
//! followed by its own subscriber (see `adapters/kv_events/subscriber.rs` for how
//! their blocks share the replica).

use crate::crd::cache_backend::CacheBackendSpec;

/// The most ranks one engine may declare (the CRD's bound).
pub const MAX_DATA_PARALLEL_SIZE: i32 = 256;

/// `endpoint` with its port moved up by `rank`: `tcp://host:P` → `tcp://host:P+r`
/// (also under a `bind:` prefix). Rank 0 is the endpoint itself.
pub fn rank_endpoint(endpoint: &str, rank: u32) -> Result<String, String> {
    if rank == 0 {
        return Ok(endpoint.to_string());
    }
    let (head, port) = split(endpoint)?;
    let moved = u32::from(port) + rank;
    if moved > u32::from(u16::MAX) {
        return Err(format!(
            "{endpoint:?}: rank {rank} would use port {moved}, above 65535"
        ));
    }
    Ok(format!("{head}:{moved}"))
}

/// `(everything before the port, port)` of a `tcp://host:port` endpoint.
fn split(endpoint: &str) -> Result<(&str, u16), String> {
    let (head, port) = endpoint
        .rsplit_once(':')
        .filter(|(head, _)| head.contains("tcp://") && !head.ends_with("tcp:"))
        .ok_or_else(|| format!("{endpoint:?} is not tcp://host:port"))?;
    let port = port
        .parse()
        .ok()
        .filter(|p| *p > 0)
        .ok_or_else(|| format!("{endpoint:?} is not tcp://host:port"))?;
    Ok((head, port))
}

/// The data-parallel size of a static endpoint (`endpoints[i]`) or of the
/// discovered pods (`None`), before validation.
pub fn declared_size(spec: &CacheBackendSpec, endpoint: Option<usize>) -> i32 {
    endpoint
        .and_then(|i| spec.endpoints.get(i))
        .and_then(|e| e.data_parallel_size)
        .or(spec.data_parallel_size)
        .unwrap_or(1)
}

/// Every problem with the backend's data-parallel settings, as (field, message):
/// sizes out of range, and ports that the last rank would push past 65535.
pub fn backend_errors(spec: &CacheBackendSpec) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let size_ok = |field: String, size: Option<i32>, out: &mut Vec<(String, String)>| match size {
        Some(s) if !(1..=MAX_DATA_PARALLEL_SIZE).contains(&s) => {
            out.push((
                field,
                format!("{s} is not a data-parallel size (1-{MAX_DATA_PARALLEL_SIZE})"),
            ));
            false
        }
        _ => true,
    };
    if !size_ok(
        "spec.dataParallelSize".into(),
        spec.data_parallel_size,
        &mut out,
    ) {
        return out;
    }
    let last_rank = |size: i32| u32::try_from(size - 1).unwrap_or(0);
    let pods_size = declared_size(spec, None);
    if let Some(k) = &spec.kv_events {
        for (field, port) in [
            ("spec.kvEvents.port", k.port),
            ("spec.kvEvents.replayPort", k.replay_port),
        ] {
            let Some(p) = port.filter(|p| (1..=65535).contains(p)) else {
                continue;
            };
            let top = i64::from(p) + i64::from(pods_size) - 1;
            let largest = spec
                .endpoints
                .iter()
                .enumerate()
                .map(|(i, _)| declared_size(spec, Some(i)))
                .filter(|s| (1..=MAX_DATA_PARALLEL_SIZE).contains(s))
                .map(|s| i64::from(p) + i64::from(s) - 1)
                .fold(top, i64::max);
            if largest > 65535 {
                out.push((
                    field.to_string(),
                    format!(
                        "{p} + data-parallel ranks reaches port {largest}, above 65535 \
                         (rank r uses port + r)"
                    ),
                ));
            }
        }
    }
    for (i, ep) in spec.endpoints.iter().enumerate() {
        let at = |f: &str| format!("spec.endpoints[{i}].{f}");
        if !size_ok(at("dataParallelSize"), ep.data_parallel_size, &mut out) {
            continue;
        }
        let size = declared_size(spec, Some(i));
        // The replay endpoint is new: it must be tcp://host:port even without DP.
        if let Some(e) = ep.kv_replay_endpoint.as_deref()
            && let Err(why) = split(e)
        {
            out.push((at("kvReplayEndpoint"), why));
            continue;
        }
        if size > 1 {
            for (field, endpoint) in [
                ("kvEventsEndpoint", &ep.kv_events_endpoint),
                ("kvReplayEndpoint", &ep.kv_replay_endpoint),
            ] {
                if let Some(Err(why)) = endpoint
                    .as_deref()
                    .map(|e| rank_endpoint(e, last_rank(size)))
                {
                    out.push((at(field), why));
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests;
