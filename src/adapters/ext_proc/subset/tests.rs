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
