//! Golden-ish checks on the generated CRDs: every default, minimum, enum, pattern,
//! map-list key and CEL rule the policy rules require is in the schema the
//! apiserver will enforce.

use serde_json::{Value, json};

use super::all;

/// The openAPIV3Schema of the CRD named `plural`.
fn schema(plural: &str) -> Value {
    let crd = all()
        .into_iter()
        .find(|c| c.spec.names.plural == plural)
        .unwrap();
    assert_eq!(crd.spec.group, super::GROUP);
    assert_eq!(crd.spec.versions.len(), 1);
    assert_eq!(crd.spec.versions[0].name, super::VERSION);
    serde_json::to_value(crd.spec.versions[0].schema.as_ref().unwrap())
        .unwrap()
        .get("openAPIV3Schema")
        .cloned()
        .unwrap()
}

/// Follows a dotted path of property names (`[]` steps into array items).
fn at<'a>(schema: &'a Value, path: &str) -> &'a Value {
    let mut node = schema;
    for step in path.split('.') {
        node = if step == "[]" {
            &node["items"]
        } else {
            &node["properties"][step]
        };
        assert!(!node.is_null(), "no schema at {path} (step {step})");
    }
    node
}

fn rules(node: &Value) -> Vec<String> {
    node["x-kubernetes-validations"]
        .as_array()
        .map(|v| {
            v.iter()
                .map(|r| r["rule"].as_str().unwrap().to_string())
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn cache_policy_schema_carries_defaults_minimums_enums_pattern_and_cel() {
    let s = schema("cachepolicies");
    let spec = |p: &str| at(&s, &format!("spec.{p}")).clone();
    assert_eq!(spec("eviction")["default"], json!("LRU"));
    assert_eq!(spec("eviction")["enum"], json!(["LRU", "LFU"]));
    assert_eq!(spec("evictionTTL")["default"], json!("10m"));
    assert!(spec("evictionTTL")["pattern"].is_string());
    assert_eq!(spec("minimumPrefixTokens")["default"], json!(0));
    assert_eq!(spec("minimumPrefixTokens")["minimum"], json!(0.0));
    assert_eq!(spec("minimumMatchedTokens")["default"], json!(64));
    assert_eq!(spec("minimumMatchedTokens")["minimum"], json!(0.0));
    assert_eq!(spec("routingFloorScore")["default"], json!("0.1"));
    assert_eq!(
        spec("routingFloorScore")["pattern"],
        json!(r"^[0-9]+(\.[0-9]+)?$")
    );
    assert_eq!(spec("lookupTimeoutMs")["default"], json!(0));
    assert_eq!(spec("lookupTimeoutMs")["minimum"], json!(0.0));
    assert_eq!(spec("affinityRouting")["default"], json!("Enabled"));
    assert_eq!(
        spec("affinityRouting")["enum"],
        json!(["Enabled", "Disabled"])
    );
    assert_eq!(
        spec("strategy")["default"],
        json!({"enableChainMatching": true, "requireChain": false, "enableTenantHot": true})
    );
    assert_eq!(spec("strategy.enableChainMatching")["default"], json!(true));
    assert_eq!(spec("strategy.requireChain")["default"], json!(false));
    assert_eq!(spec("strategy.enableTenantHot")["default"], json!(true));
    assert_eq!(
        rules(&spec("strategy")),
        vec!["!self.requireChain || self.enableChainMatching"]
    );
    assert_eq!(
        at(&s, "status.conditions")["x-kubernetes-list-map-keys"],
        json!(["type"])
    );
}

#[test]
fn cache_tenant_schema_requires_a_real_tenant_id() {
    let s = schema("cachetenants");
    assert_eq!(at(&s, "spec")["required"], json!(["tenantID"]));
    assert_eq!(
        rules(at(&s, "spec.tenantID")),
        vec!["self != ''", "self != 'inferencecache.io/probe'"]
    );
    assert_eq!(at(&s, "spec.quota.maxIndexEntries")["minimum"], json!(0.0));
    // The modes only: a `null` member would be listed to users as a supported value.
    assert_eq!(at(&s, "spec.isolationMode")["enum"], json!(["Fairness"]));
    assert_eq!(
        at(&s, "spec.crypto")["x-kubernetes-preserve-unknown-fields"],
        json!(true)
    );
    assert!(at(&s, "status.indexEntries").is_object());
}

#[test]
fn cache_backend_schema_matches_contract_section_9() {
    let s = schema("cachebackends");
    assert_eq!(
        at(&s, "spec")["required"],
        json!(["engine", "hashScheme", "modelID"])
    );
    assert_eq!(at(&s, "spec.engine")["enum"], json!(["vLLM", "SGLang"]));
    assert_eq!(rules(at(&s, "spec.modelID")), vec!["self != ''"]);
    assert_eq!(rules(at(&s, "spec.hashScheme")), vec!["self != ''"]);
    assert_eq!(at(&s, "spec.blockSize")["default"], json!(16));
    assert_eq!(at(&s, "spec.targetPort")["maximum"], json!(65535.0));
    assert!(at(&s, "spec.selector.matchLabels").is_object());
    assert!(at(&s, "spec.kvEvents.replayPort").is_object());
    assert_eq!(at(&s, "spec.kvEvents.topic")["default"], json!(""));
    let endpoints = at(&s, "spec.endpoints");
    assert_eq!(endpoints["x-kubernetes-list-type"], json!("map"));
    assert_eq!(endpoints["x-kubernetes-list-map-keys"], json!(["id"]));
    assert_eq!(rules(at(&s, "spec.endpoints.[].id")), vec!["self != ''"]);
    assert!(at(&s, "spec.endpoints.[].kvEventsEndpoint").is_object());
    let replicas = at(&s, "status.indexParticipation.replicas");
    assert_eq!(replicas["x-kubernetes-list-map-keys"], json!(["id"]));
    for f in ["id", "prefixCount", "lastEventAt", "hitRate"] {
        at(&s, &format!("status.indexParticipation.replicas.[].{f}"));
    }
}

#[test]
fn prompt_template_and_pd_topology_schemas() {
    let s = schema("prompttemplates");
    assert_eq!(rules(at(&s, "spec.body")), vec!["self != ''"]);
    assert_eq!(
        at(&s, "spec.slots")["x-kubernetes-list-map-keys"],
        json!(["name"])
    );
    assert_eq!(
        at(&s, "spec.slots.[].type")["enum"],
        json!(["Stable", "Mutable"])
    );
    assert_eq!(at(&s, "spec.slots.[]")["required"], json!(["name", "type"]));
    assert!(at(&s, "status.templateRevision").is_object());

    let s = schema("pdtopologies");
    let spec_rules = rules(at(&s, "spec"));
    assert_eq!(spec_rules.len(), 2);
    assert!(
        spec_rules
            .iter()
            .all(|r| r.contains("acceleratorTypes.exists"))
    );
    for list in ["prefillPools", "decodePools", "acceleratorTypes"] {
        assert_eq!(
            at(&s, &format!("spec.{list}"))["x-kubernetes-list-map-keys"],
            json!(["name"])
        );
        assert_eq!(
            rules(at(&s, &format!("spec.{list}.[].name"))),
            vec!["self != ''"]
        );
    }
    assert_eq!(
        at(&s, "spec.prefillPools.[].replicas")["minimum"],
        json!(0.0)
    );
}

#[test]
fn cache_index_is_cluster_scoped_and_status_only() {
    let s = schema("cacheindexes");
    assert_eq!(at(&s, "spec")["default"], json!({}));
    assert!(
        at(&s, "spec")["properties"]
            .as_object()
            .is_none_or(|p| p.is_empty())
    );
    assert_eq!(
        at(&s, "status.replicas")["x-kubernetes-list-map-keys"],
        json!(["id"])
    );
    assert_eq!(
        at(&s, "status.tenants")["x-kubernetes-list-map-keys"],
        json!(["tenant"])
    );
    for f in ["id", "tenant", "hitRate", "cacheMemoryBytes"] {
        at(&s, &format!("status.replicas.[].{f}"));
    }
    for f in ["tenant", "indexEntries", "hitRate", "memoryUsed"] {
        at(&s, &format!("status.tenants.[].{f}"));
    }
}

#[test]
fn every_crd_has_a_short_name_category_and_status_subresource() {
    let crds = all();
    let shorts: Vec<_> = crds
        .iter()
        .map(|c| {
            c.spec
                .names
                .short_names
                .clone()
                .unwrap_or_default()
                .join(",")
        })
        .collect();
    assert_eq!(
        shorts,
        ["cpol", "ctenant", "cbackend", "ptpl", "pdtopo", "cindex"]
    );
    for crd in &crds {
        assert_eq!(
            crd.spec.names.categories.as_deref(),
            Some(&["inferencecache".to_string()][..])
        );
        let v = &crd.spec.versions[0];
        assert!(
            v.subresources
                .as_ref()
                .and_then(|s| s.status.as_ref())
                .is_some()
        );
    }
}

#[test]
fn render_yaml_is_one_document_per_crd_and_parses_back() {
    let text = super::render_yaml().unwrap();
    assert_eq!(text.matches("---\n").count(), 6);
    let docs: Vec<Value> = serde_saphyr::from_multiple(&text).unwrap();
    assert_eq!(docs.len(), 6);
    assert!(docs.iter().all(|d| d["kind"] == "CustomResourceDefinition"));
    assert_eq!(
        docs[5]["metadata"]["name"],
        "cacheindexes.inferencecache.io"
    );
}
