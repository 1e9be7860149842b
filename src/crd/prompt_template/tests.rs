use super::*;
use serde_json::json;

fn mk(spec: serde_json::Value) -> PromptTemplate {
    crate::crd::mk_object(spec)
}

#[test]
fn cel_requires_body_and_slot_names() {
    let ok = mk(json!({"body": "{{system}} {{q}}",
                           "slots": [{"name": "system", "type": "Stable"}]}));
    assert!(ok.validate_cel().is_ok());
    assert!(!ok.spec.slots[0].required);
    let text = mk(json!({"body": "", "slots": [{"name": "", "type": "Mutable"}]}))
        .validate_cel()
        .unwrap_err()
        .to_string();
    assert!(text.contains("body must be non-empty"), "{text}");
    assert!(text.contains("name must be non-empty"), "{text}");
}

#[test]
fn slot_type_is_required_and_closed() {
    let r: Result<PromptTemplate, _> = serde_json::from_value(json!({
        "apiVersion": "inferencecache.io/v1alpha1", "kind": "PromptTemplate",
        "metadata": {"name": "t"}, "spec": {"body": "x", "slots": [{"name": "a", "type": "Other"}]},
    }));
    assert!(r.is_err());
}
