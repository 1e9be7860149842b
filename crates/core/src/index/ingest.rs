//! Applying a replica's events: stores (with the per-tenant quota), removals,
//! clears, and the engine statistics a replica reports.

use super::Index;
use super::entry::tier_slot;
use super::event::{IndexEvent, IngestBatch, IngestError, IngestOutcome, StatsReport};
use super::replica::ReplicaLive;
use super::scope::{self, ScopeIndex};
use super::store::EntryKey;
use super::tenant::{TenantIndex, TenantLimits, TenantWriter};
use super::view::Counters;
use crate::time::Timestamp;

/// Where one batch's stores go: the replica's slot in its scope, under its
/// tenant's limits, at the batch's time.
#[derive(Clone, Copy)]
struct Target<'a> {
    tenant: &'a TenantIndex,
    scope: &'a ScopeIndex,
    slot: u32,
    live: &'a ReplicaLive,
    limits: &'a TenantLimits,
    now: u64,
}

impl Index {
    /// Applies one replica's events in order (IngestEvents, engine subscribers).
    pub fn ingest(
        &self,
        batch: &IngestBatch<'_>,
        limits: &TenantLimits,
        now: Timestamp,
    ) -> Result<IngestOutcome, IngestError> {
        if !batch.scope.is_well_formed() {
            return Err(IngestError::MalformedScope);
        }
        if batch.replica_id.is_empty() {
            return Err(IngestError::MissingReplica);
        }
        let now = now.as_nanos();
        let tenant = self.tenant_or_create(batch.scope.tenant);
        let scope = self.scope_or_create(&tenant, batch.scope);
        let mut outcome = IngestOutcome::default();
        let mut writer = tenant.writer.lock();
        let (slot, live) =
            scope.resolve_replica(batch.replica_id, batch.endpoint, now, scope::Touch::Event);
        let target = Target {
            tenant: &tenant,
            scope: &scope,
            slot,
            live: &live,
            limits,
            now,
        };
        for event in batch.events {
            if !event.is_valid() {
                outcome.rejected += 1;
                continue;
            }
            outcome.applied += 1;
            match event {
                IndexEvent::Stored { parent, hashes, .. } => {
                    Counters::add(&self.counters.stored_blocks, hashes.len() as u64);
                    scope.pending.confirm(slot, hashes);
                    let ended = scope.prefills.stored(slot, hashes);
                    Counters::add(&self.counters.inflight_ended_by_event, ended);
                    self.store_blocks(&target, &mut writer, *parent, hashes);
                }
                IndexEvent::Removed { hashes } => {
                    Counters::add(&self.counters.removed_blocks, hashes.len() as u64);
                    let removed = scope.remove_blocks(slot, &live, hashes);
                    self.sub_entries(&tenant, removed);
                }
                IndexEvent::TierStored { tier, hashes } => {
                    // A lower tier's copy is a holder of its own (`entry.rs`);
                    // it neither confirms pending chains nor counts in prefixCount.
                    scope.note_lower_tier();
                    let tier_live = ReplicaLive::default();
                    let at = Target {
                        slot: tier_slot(slot, *tier),
                        live: &tier_live,
                        ..target
                    };
                    self.store_blocks(&at, &mut writer, None, hashes);
                }
                IndexEvent::TierRemoved { tier, hashes } => {
                    let removed = scope.remove_blocks(
                        tier_slot(slot, *tier),
                        &ReplicaLive::default(),
                        hashes,
                    );
                    self.sub_entries(&tenant, removed);
                }
                IndexEvent::Cleared => {
                    let removed = scope.clear_replica(slot, &live);
                    Counters::add(&self.counters.dropped_cleared, removed);
                    self.sub_entries(&tenant, removed);
                }
                IndexEvent::PrefixStored {
                    prefix_hash,
                    token_count,
                } => {
                    let key = EntryKey::Prefix(prefix_hash.as_str().into());
                    self.store_keys(
                        &target,
                        &mut writer,
                        None,
                        std::slice::from_ref(&key),
                        *token_count,
                    );
                }
            }
        }
        drop(writer);
        Counters::add(&self.counters.rejected_events, u64::from(outcome.rejected));
        Ok(outcome)
    }

    fn store_blocks(
        &self,
        at: &Target<'_>,
        writer: &mut TenantWriter,
        parent: Option<u64>,
        hashes: &[u64],
    ) {
        let Target {
            tenant,
            scope,
            slot,
            live,
            limits,
            now,
        } = *at;
        let fits = limits
            .max_entries
            .is_none_or(|q| tenant.entries().saturating_add(hashes.len() as u64) <= q);
        if fits {
            let n = hashes.len();
            let base = writer.reserve(now, n);
            let created =
                scope.insert_blocks(slot, live, parent, hashes, |i| base + (n - 1 - i) as u64);
            if created > 0 {
                writer.victims.note_insert();
            }
            self.add_entries(tenant, created);
            return;
        }
        let keys: Vec<EntryKey> = hashes.iter().map(|&h| EntryKey::Block(h)).collect();
        self.store_keys(at, writer, parent, &keys, 0);
    }

    /// The slow path near quota: one key at a time, evicting the tenant's own next
    /// victim before each new entry, so the quota is never exceeded.
    fn store_keys(
        &self,
        at: &Target<'_>,
        writer: &mut TenantWriter,
        parent: Option<u64>,
        keys: &[EntryKey],
        token_count: u32,
    ) {
        let Target {
            tenant,
            scope,
            slot,
            live,
            limits,
            now,
        } = *at;
        let n = keys.len();
        let base = writer.reserve(now, n);
        // Tail first: at equal time the tail is the oldest, so a tenant at quota
        // evicts the tail of its own chain before the blocks it extends.
        for (i, key) in keys.iter().enumerate().rev() {
            let stamp = base + (n - 1 - i) as u64;
            if let Some(quota) = limits.max_entries
                && !scope.contains(key)
            {
                if quota == 0 {
                    Counters::add(&self.counters.refused_quota, 1);
                    continue;
                }
                let mut refused = false;
                while tenant.entries() >= quota {
                    if !self.evict_one(
                        tenant,
                        writer,
                        limits.eviction,
                        1,
                        &self.counters.evicted_quota,
                    ) {
                        refused = true;
                        break;
                    }
                }
                if refused {
                    Counters::add(&self.counters.refused_quota, 1);
                    continue;
                }
            }
            // The chain's previous block (the parent for block 0) lets a block
            // join its predecessor's run.
            let prev = match i {
                0 => parent,
                _ => match &keys[i - 1] {
                    EntryKey::Block(h) => Some(*h),
                    EntryKey::Prefix(_) => None,
                },
            };
            if scope.insert_one(slot, live, key, prev, token_count, stamp) {
                writer.victims.note_insert();
                self.add_entries(tenant, 1);
            }
        }
    }

    /// Records ReportStats (and registers the replica when an endpoint is given).
    pub fn report_stats(
        &self,
        report: &StatsReport<'_>,
        now: Timestamp,
    ) -> Result<(), IngestError> {
        if !report.scope.is_well_formed() {
            return Err(IngestError::MalformedScope);
        }
        if report.replica_id.is_empty() {
            return Err(IngestError::MissingReplica);
        }
        let tenant = self.tenant_or_create(report.scope.tenant);
        let scope = self.scope_or_create(&tenant, report.scope);
        let _writer = tenant.writer.lock();
        let (_, live) = scope.resolve_replica(
            report.replica_id,
            report.endpoint,
            now.as_nanos(),
            scope::Touch::Stats,
        );
        *live.stats.lock() = Some((report.stats, now));
        live.load.set_engine_queue(
            u64::from(report.stats.waiting_requests),
            u64::from(report.stats.running_requests),
            now.as_nanos(),
        );
        if let Some(total) = report.stats.first_tokens_total {
            live.load.note_first_tokens(total, now.as_nanos());
        }
        Ok(())
    }
}
