use super::*;
use serde_json::json;

fn mk(spec: serde_json::Value) -> PDTopology {
    crate::crd::mk_object(spec)
}

#[test]
fn pools_must_name_declared_accelerators() {
    let ok = mk(json!({
        "acceleratorTypes": [{"name": "h100", "vendor": "nvidia"}],
        "prefillPools": [{"name": "p", "acceleratorType": "h100", "replicas": 2}],
        "decodePools": [{"name": "d"}],
    }));
    assert!(ok.validate_cel().is_ok(), "{:?}", ok.validate_cel());
    let bad = mk(json!({
        "acceleratorTypes": [{"name": "h100"}],
        "decodePools": [{"name": "d", "acceleratorType": "mi300"}],
    }));
    let text = bad.validate_cel().unwrap_err().to_string();
    assert!(text.contains("decodePools[].acceleratorType"), "{text}");
    let undeclared = mk(json!({"prefillPools": [{"name": "p", "acceleratorType": "h100"}]}));
    assert!(undeclared.validate_cel().is_err());
}

#[test]
fn empty_topology_is_valid() {
    assert!(mk(json!({})).validate_cel().is_ok());
}
