use super::*;
use crate::policy::EvictionAlgorithm;

fn ns(name: &str, tenant: Option<&str>, policy: ResolvedPolicy) -> NamespacePolicy {
    NamespacePolicy {
        namespace: name.into(),
        tenant_id: tenant.map(Into::into),
        policy_name: Some("p".into()),
        policy: Arc::new(policy),
        max_index_entries: Some(10),
        fair_weight: None,
    }
}

#[test]
fn tenant_resolves_through_its_namespace() {
    let lfu = ResolvedPolicy {
        eviction: EvictionAlgorithm::Lfu,
        ..ResolvedPolicy::default()
    };
    let snap = PolicySnapshot::new(
        ResolvedPolicy::default(),
        vec![ns("team-a", Some("acme"), lfu.clone())],
        vec![],
    );
    let view = snap.tenant("acme");
    assert_eq!(view.namespace, Some("team-a"));
    assert_eq!(**view.policy, lfu);
    assert_eq!(view.max_index_entries, Some(10));
}

#[test]
fn unknown_tenant_gets_server_defaults() {
    let snap = PolicySnapshot::new(ResolvedPolicy::default(), vec![], vec![]);
    let view = snap.tenant("nobody");
    assert_eq!(view.namespace, None);
    assert_eq!(**view.policy, ResolvedPolicy::default());
    assert_eq!(view.max_index_entries, None);
}

#[test]
fn revision_is_stable_and_content_addressed() {
    let a = PolicySnapshot::new(ResolvedPolicy::default(), vec![], vec![]);
    let b = PolicySnapshot::new(ResolvedPolicy::default(), vec![], vec![]);
    assert_eq!(a.revision(), b.revision());
    let c = PolicySnapshot::new(
        ResolvedPolicy::default(),
        vec![ns("x", Some("t"), ResolvedPolicy::default())],
        vec![],
    );
    assert_ne!(a.revision(), c.revision());
}

#[test]
fn probe_tenant_has_open_floors() {
    let snap = PolicySnapshot::empty();
    let view = snap.tenant(PROBE_TENANT);
    assert_eq!(view.policy.minimum_matched_tokens, 0);
    assert_eq!(view.policy.routing_floor_score.value(), 0.0);
}
