//! The gateway's endpoint subset (GIE endpoint-picker protocol): filter metadata
//! `envoy.lb.subset_hint` / `x-gateway-destination-endpoint-subset`, a list of
//! `ip:port`. When the key is present the pick must be one of them; a present but
//! empty list leaves nothing eligible (the protocol's 503).

use envoy_types::pb::envoy::config::core::v3::Metadata;
use envoy_types::pb::google::protobuf::value::Kind;

pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";

/// The subset, when the gateway sent the key. A list of strings is the protocol's
/// form; a single comma-separated string is accepted too. Items that are not
/// text are ignored (they can name no endpoint).
pub fn subset_hint(metadata: Option<&Metadata>) -> Option<Vec<String>> {
    let value = metadata?
        .filter_metadata
        .get(SUBSET_NAMESPACE)?
        .fields
        .get(SUBSET_KEY)?;
    let mut out = Vec::new();
    let mut push = |s: &str| {
        out.extend(
            s.split(',')
                .map(str::trim)
                .filter(|p| !p.is_empty())
                .map(String::from),
        )
    };
    match value.kind.as_ref() {
        Some(Kind::ListValue(list)) => {
            for v in &list.values {
                if let Some(Kind::StringValue(s)) = &v.kind {
                    push(s);
                }
            }
        }
        Some(Kind::StringValue(s)) => push(s),
        _ => {}
    }
    Some(out)
}

#[cfg(test)]
mod tests;
