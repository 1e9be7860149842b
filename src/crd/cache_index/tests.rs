use super::*;
use serde_json::json;

#[test]
fn spec_may_be_omitted_null_or_empty() {
    for obj in [
        json!({"apiVersion": "inferencecache.io/v1alpha1", "kind": "CacheIndex", "metadata": {"name": "cluster"}}),
        json!({"apiVersion": "inferencecache.io/v1alpha1", "kind": "CacheIndex", "metadata": {"name": "cluster"}, "spec": {}}),
        json!({"apiVersion": "inferencecache.io/v1alpha1", "kind": "CacheIndex", "metadata": {"name": "cluster"}, "spec": null}),
    ] {
        let idx: CacheIndex = serde_json::from_value(obj).unwrap();
        assert_eq!(idx.spec, CacheIndexSpec {});
    }
}

#[test]
fn crd_does_not_require_spec_and_is_cluster_scoped() {
    let crd = crd();
    assert_eq!(crd.spec.scope, "Cluster");
    let schema = serde_json::to_value(&crd.spec.versions[0].schema).unwrap();
    let root = &schema["openAPIV3Schema"];
    let required = root["required"].as_array().cloned().unwrap_or_default();
    assert!(!required.contains(&json!("spec")), "{root}");
    assert_eq!(root["properties"]["spec"]["default"], json!({}));
}

#[test]
fn memory_used_is_always_serialized() {
    let t = IndexTenant {
        tenant: "acme".into(),
        ..IndexTenant::default()
    };
    let v = serde_json::to_value(&t).unwrap();
    assert_eq!(v["memoryUsed"], json!(0));
    assert!(v.get("indexEntries").is_none());
    assert!(v.get("hitRate").is_none());
    let t = IndexTenant {
        index_entries: Some(0),
        hit_rate: Some("0".into()),
        ..t
    };
    let v = serde_json::to_value(&t).unwrap();
    assert_eq!(v["indexEntries"], json!(0));
    assert_eq!(v["hitRate"], json!("0"));
}
