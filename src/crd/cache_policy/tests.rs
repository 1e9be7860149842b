use super::*;
use serde_json::json;

fn mk(spec: serde_json::Value) -> CachePolicy {
    crate::crd::mk_object(spec)
}

#[test]
fn empty_spec_gets_the_schema_defaults() {
    let p = mk(json!({}));
    assert_eq!(p.spec, CachePolicySpec::default());
    assert_eq!(p.spec.eviction_ttl, "10m");
    assert_eq!(p.spec.minimum_matched_tokens, 64);
    assert_eq!(p.spec.routing_floor_score, "0.1");
    assert!(p.spec.strategy.enable_chain_matching);
    assert!(!p.spec.strategy.require_chain);
    assert!(p.spec.strategy.enable_tenant_hot);
    assert_eq!(p.spec.affinity_routing, AffinityRouting::Enabled);
    assert!(p.validate_cel().is_ok());
}

#[test]
fn partial_strategy_keeps_the_other_defaults() {
    let p = mk(json!({"strategy": {"enableTenantHot": false}}));
    assert!(p.spec.strategy.enable_chain_matching);
    assert!(!p.spec.strategy.enable_tenant_hot);
}

#[test]
fn cel_rejects_require_chain_without_chain_matching() {
    let p = mk(json!({"strategy": {"requireChain": true, "enableChainMatching": false}}));
    let errs = p.validate_cel().unwrap_err();
    assert!(errs.to_string().contains("requireChain"), "{errs}");
    let ok = mk(json!({"strategy": {"requireChain": true}}));
    assert!(ok.validate_cel().is_ok());
}

#[test]
fn strategy_fragment_validates_on_its_own() {
    let bad = json!({"requireChain": true, "enableChainMatching": false, "enableTenantHot": true});
    assert!(PolicyStrategy::validate_cel(&bad, None).is_err());
    let good =
        json!({"requireChain": false, "enableChainMatching": false, "enableTenantHot": true});
    assert!(PolicyStrategy::validate_cel(&good, None).is_ok());
}

#[test]
fn enums_use_the_documented_spelling() {
    let p = mk(json!({"eviction": "LFU", "affinityRouting": "Disabled"}));
    assert_eq!(p.spec.eviction, Eviction::Lfu);
    assert_eq!(p.spec.affinity_routing, AffinityRouting::Disabled);
    let bad: Result<CachePolicy, _> = serde_json::from_value(json!({
        "apiVersion": "inferencecache.io/v1alpha1", "kind": "CachePolicy",
        "metadata": {"name": "p"}, "spec": {"eviction": "FIFO"},
    }));
    assert!(bad.is_err());
}
