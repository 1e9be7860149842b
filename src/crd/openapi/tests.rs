use super::*;
use crate::crd::cache_backend::CacheBackend;
use crate::crd::cache_policy::CachePolicy;
use crate::crd::prompt_template::PromptTemplate;
use kube::CustomResourceExt;
use serde_json::json;

fn check<K: CustomResourceExt>(object: Value) -> Vec<String> {
    let schema = schema_of(&K::crd()).unwrap();
    validate(&schema, &object)
        .iter()
        .map(ToString::to_string)
        .collect()
}

fn policy(spec: Value) -> Value {
    json!({"apiVersion": "inferencecache.io/v1alpha1", "kind": "CachePolicy",
               "metadata": {"name": "p"}, "spec": spec})
}

#[test]
fn a_value_schema_beside_preserved_fields_prunes_nested_contents() {
    // The apiserver's pruning: `additionalProperties: true` is the empty
    // schema, which keeps scalars and drops the fields of nested objects.
    let schema = json!({"type": "object", "properties": {"c": {
            "type": "object", "additionalProperties": true,
            "x-kubernetes-preserve-unknown-fields": true}}});
    let v = validate(
        &schema,
        &json!({"c": {"mode": "x", "nested": {"keyRef": "k"}}}),
    );
    let text: Vec<String> = v.iter().map(ToString::to_string).collect();
    assert_eq!(text, vec!["c.nested.keyRef: unknown field"], "{text:?}");
    let kept = json!({"type": "object", "properties": {"c": {
            "type": "object", "x-kubernetes-preserve-unknown-fields": true}}});
    assert!(validate(&kept, &json!({"c": {"nested": {"keyRef": "k"}}})).is_empty());
}

#[test]
fn tenant_crypto_keeps_nested_objects_whole() {
    use crate::crd::cache_tenant::CacheTenant;
    let v = check::<CacheTenant>(json!({
        "apiVersion": "inferencecache.io/v1alpha1", "kind": "CacheTenant",
        "metadata": {"name": "t"},
        "spec": {"tenantID": "acme", "crypto": {"nested": {"keyRef": {"name": "k"}}}},
    }));
    assert!(v.is_empty(), "{v:?}");
}

#[test]
fn a_valid_policy_has_no_violations() {
    let v = check::<CachePolicy>(policy(json!({
        "eviction": "LFU", "evictionTTL": "1h30m", "routingFloorScore": "0.25",
        "minimumMatchedTokens": 0, "strategy": {"requireChain": true},
    })));
    assert!(v.is_empty(), "{v:?}");
}

#[test]
fn pattern_minimum_enum_type_and_unknown_fields_are_named() {
    let v = check::<CachePolicy>(policy(json!({
        "eviction": "FIFO", "routingFloorScore": "-1", "minimumPrefixTokens": -5,
        "lookupTimeoutMs": "soon", "strategy": {"requireChian": true},
    })));
    let text = v.join("\n");
    assert!(
        text.contains("spec.eviction: \"FIFO\" is not one of"),
        "{text}"
    );
    assert!(
        text.contains("spec.routingFloorScore: \"-1\" does not match"),
        "{text}"
    );
    assert!(
        text.contains("spec.minimumPrefixTokens: -5 is below the minimum 0"),
        "{text}"
    );
    assert!(
        text.contains("spec.lookupTimeoutMs: must be of type integer"),
        "{text}"
    );
    assert!(
        text.contains("spec.strategy.requireChian: unknown field"),
        "{text}"
    );
    assert_eq!(v.len(), 5, "{text}");
}

#[test]
fn required_fields_and_list_items_are_checked() {
    let v = check::<CacheBackend>(json!({
        "apiVersion": "inferencecache.io/v1alpha1", "kind": "CacheBackend",
        "metadata": {"name": "b"},
        "spec": {"engine": "vLLM", "modelID": "m", "targetPort": 70000},
    }));
    let text = v.join("\n");
    assert!(
        text.contains("spec.hashScheme: required field is missing"),
        "{text}"
    );
    assert!(
        text.contains("spec.targetPort: 70000 is above the maximum"),
        "{text}"
    );
    let v = check::<PromptTemplate>(json!({
        "apiVersion": "inferencecache.io/v1alpha1", "kind": "PromptTemplate",
        "metadata": {"name": "t"},
        "spec": {"body": "x", "slots": [{"name": "a", "type": "Sometimes"}]},
    }));
    assert!(v.join("\n").contains("spec.slots[0].type"), "{v:?}");
}
