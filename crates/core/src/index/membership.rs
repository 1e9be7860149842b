//! Replica membership: which replicas a scope declares, and dropping one with
//! all of its entries.

use super::Index;
use super::scope::ScopeIndex;
use super::tenant::{TenantIndex, TenantWriter};
use super::view::Counters;
use crate::scope::ScopeRef;
use crate::time::Timestamp;

impl Index {
    /// Makes `declared` (id, address) the configured replicas of a scope. Replicas
    /// that are no longer declared lose their entries and leave the index.
    pub fn declare(&self, scope: ScopeRef<'_>, declared: &[(String, String)], now: Timestamp) {
        if !scope.is_well_formed() {
            return;
        }
        let now = now.as_nanos();
        let tenant = if declared.is_empty() {
            match self.tenant(scope.tenant) {
                Some(t) => t,
                None => return,
            }
        } else {
            self.tenant_or_create(scope.tenant)
        };
        let s = if declared.is_empty() {
            match tenant.find_scope(scope.model, scope.hash_scheme) {
                Some(s) => s,
                None => return,
            }
        } else {
            self.scope_or_create(&tenant, scope)
        };
        let mut writer = tenant.writer.lock();
        for slot in s.set_declared(declared, now) {
            self.drop_replica(&tenant, &mut writer, &s, slot, now);
        }
    }

    /// Scopes that have at least one declared replica.
    pub fn declared_scopes(&self) -> Vec<crate::scope::ScopeKey> {
        let mut out = Vec::new();
        for t in self.tenants.load().values() {
            for s in t.scopes.load().iter() {
                if s.table().iter().any(|(_, r)| r.declared.is_some()) {
                    out.push(s.key.clone());
                }
            }
        }
        out
    }

    pub(super) fn drop_replica(
        &self,
        tenant: &TenantIndex,
        writer: &mut TenantWriter,
        scope: &ScopeIndex,
        slot: u32,
        now: u64,
    ) {
        let table = scope.table();
        if let Some(r) = table.get(slot) {
            let removed = scope.clear_replica(slot, &r.live);
            Counters::add(&self.counters.dropped_cleared, removed);
            self.sub_entries(tenant, removed);
        }
        scope.remove_slot(slot, now);
        writer.victims.invalidate();
    }

    /// Removes one replica (all its entries) from a scope, e.g. a ZMQ publisher
    /// that went away for good.
    pub fn remove_replica(&self, scope: ScopeRef<'_>, replica_id: &str, now: Timestamp) -> bool {
        let Some(tenant) = self.tenant(scope.tenant) else {
            return false;
        };
        let Some(s) = tenant.find_scope(scope.model, scope.hash_scheme) else {
            return false;
        };
        let mut writer = tenant.writer.lock();
        let Some(slot) = s.table().slot_of(replica_id) else {
            return false;
        };
        self.drop_replica(&tenant, &mut writer, &s, slot, now.as_nanos());
        true
    }
}
