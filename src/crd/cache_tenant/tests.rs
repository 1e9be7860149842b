use super::*;

fn mk(tenant_id: &str) -> CacheTenant {
    CacheTenant::new(
        "t",
        CacheTenantSpec {
            tenant_id: tenant_id.into(),
            quota: None,
            isolation_mode: None,
            weight: 1,
            crypto: None,
        },
    )
}

#[test]
fn cel_requires_a_non_empty_tenant_id() {
    assert!(mk("acme").validate_cel().is_ok());
    let errs = mk("").validate_cel().unwrap_err();
    assert!(errs.to_string().contains("non-empty"), "{errs}");
}

#[test]
fn cel_rejects_the_probe_tenant_on_create_but_ratchets_on_update() {
    let probe = mk(crate::core::scope::PROBE_TENANT);
    let errs = probe.validate_cel().unwrap_err();
    assert!(errs.to_string().contains("reserved"), "{errs}");
    // Introducing the value on UPDATE is rejected too.
    assert!(probe.validate_cel_update(&mk("acme")).is_err());
}
