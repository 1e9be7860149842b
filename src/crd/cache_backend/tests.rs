use super::*;
use serde_json::json;

fn mk(spec: serde_json::Value) -> CacheBackend {
    crate::crd::mk_object(spec)
}

#[test]
fn minimal_backend_defaults_block_size() {
    let b = mk(json!({"engine": "SGLang", "modelID": "m", "hashScheme": "s"}));
    assert_eq!(b.spec.block_size, 16);
    assert_eq!(b.spec.engine, Engine::Sglang);
    assert!(b.spec.endpoints.is_empty());
    assert!(b.validate_cel().is_ok());
}

#[test]
fn cel_requires_model_scheme_and_endpoint_keys() {
    let b = mk(json!({"engine": "vLLM", "modelID": "", "hashScheme": ""}));
    let text = b.validate_cel().unwrap_err().to_string();
    assert!(text.contains("modelID must be non-empty"), "{text}");
    assert!(text.contains("hashScheme must be non-empty"), "{text}");
    let b = mk(json!({"engine": "vLLM", "modelID": "m", "hashScheme": "s",
                          "endpoints": [{"id": "", "address": "127.0.0.1:1"}]}));
    let text = b.validate_cel().unwrap_err().to_string();
    assert!(text.contains("id must be non-empty"), "{text}");
}

#[test]
fn hash_scheme_is_required() {
    let r: Result<CacheBackend, _> = serde_json::from_value(json!({
        "apiVersion": "inferencecache.io/v1alpha1", "kind": "CacheBackend",
        "metadata": {"name": "b"}, "spec": {"engine": "vLLM", "modelID": "m"},
    }));
    assert!(r.unwrap_err().to_string().contains("hashScheme"));
}
