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
mod tests {
    use super::*;
    use envoy_types::pb::google::protobuf::{ListValue, Struct, Value};

    fn text(s: &str) -> Value {
        Value {
            kind: Some(Kind::StringValue(s.into())),
        }
    }

    fn metadata(value: Value) -> Metadata {
        let inner = Struct {
            fields: [(SUBSET_KEY.to_string(), value)].into(),
        };
        Metadata {
            filter_metadata: [(SUBSET_NAMESPACE.to_string(), inner)].into(),
            ..Metadata::default()
        }
    }

    #[test]
    fn a_list_of_endpoints_is_read_in_order() {
        let m = metadata(Value {
            kind: Some(Kind::ListValue(ListValue {
                values: vec![
                    text("10.0.0.1:8000"),
                    text(" 10.0.0.2:8000 "),
                    Value::default(),
                ],
            })),
        });
        assert_eq!(
            subset_hint(Some(&m)),
            Some(vec!["10.0.0.1:8000".into(), "10.0.0.2:8000".into()])
        );
    }

    #[test]
    fn a_comma_separated_string_is_accepted() {
        let m = metadata(text("10.0.0.1:8000,10.0.0.3:8000"));
        assert_eq!(subset_hint(Some(&m)).map(|v| v.len()), Some(2));
    }

    #[test]
    fn absent_key_is_no_subset_but_an_empty_list_is_an_empty_subset() {
        assert_eq!(subset_hint(None), None);
        assert_eq!(subset_hint(Some(&Metadata::default())), None);
        let empty = metadata(Value {
            kind: Some(Kind::ListValue(ListValue { values: vec![] })),
        });
        assert_eq!(subset_hint(Some(&empty)), Some(vec![]));
    }
}
