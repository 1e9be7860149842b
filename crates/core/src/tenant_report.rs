//! What `/snapshot` and the CacheIndex status both say of each tenant, computed
//! once so the two can never disagree.

use std::collections::BTreeMap;

use crate::index::IndexView;
use crate::scope::PROBE_TENANT;
use crate::snapshot::PolicySnapshot;

/// One tenant's row.
#[derive(Clone, Debug, PartialEq)]
pub struct TenantReport<'a> {
    pub tenant: &'a str,
    /// The namespace whose policy names this tenant, if one does.
    pub namespace: Option<&'a str>,
    pub index_entries: u64,
    /// The mean over its replicas that reported stats; `None` until one has.
    pub hit_rate: Option<f64>,
}

/// Every tenant the policy declares (0 entries when it holds nothing) and every
/// tenant the index holds, sorted by id; the self-test's probe tenant never.
pub fn tenant_reports<'a>(
    view: &'a IndexView,
    policy: &'a PolicySnapshot,
) -> Vec<TenantReport<'a>> {
    let mut hit_rates: BTreeMap<&str, (f64, u32)> = BTreeMap::new();
    for r in &view.replicas {
        if let Some((stats, _)) = &r.stats {
            let e = hit_rates.entry(r.tenant.as_str()).or_default();
            e.0 += stats.hit_rate;
            e.1 += 1;
        }
    }
    let mut entries: BTreeMap<&str, u64> = policy
        .namespaces()
        .filter_map(|ns| ns.tenant_id.as_deref())
        .map(|t| (t, 0))
        .collect();
    for t in &view.tenants {
        entries.insert(t.tenant.as_str(), t.index_entries);
    }
    entries
        .into_iter()
        .filter(|(t, _)| *t != PROBE_TENANT)
        .map(|(tenant, index_entries)| TenantReport {
            tenant,
            namespace: policy.namespace_of(tenant),
            index_entries,
            hit_rate: hit_rates.get(tenant).map(|(sum, n)| sum / f64::from(*n)),
        })
        .collect()
}
