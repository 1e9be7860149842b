//! The replicas of one scope: who they are, where they are routed to, and whether
//! they are in servingByScope right now.
//!
//! The table is immutable and swapped whole (copy on write) when a replica joins,
//! leaves or changes endpoint, which is rare. A lookup loads it once, lock-free,
//! and its rows borrow ids and endpoints from it without copying strings. Values
//! that change on every event (lastEventAt, prefixCount, registration time, stats)
//! live in [`ReplicaLive`] atomics shared by every version of the table, and its
//! load signals in a [`ReplicaLoad`] beside them.

use std::hash::BuildHasher;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use hashbrown::HashMap;
use parking_lot::Mutex;
use smallvec::SmallVec;

use super::event::ReplicaStats;
use crate::load::{LoadCell, ReplicaLoad};
use crate::time::Timestamp;

/// Stable, process-independent hash of a replica id for rendezvous hashing: two
/// sidecars (or one after a restart) must pin a prompt to the same replica.
pub fn replica_id_hash(id: &str) -> u64 {
    foldhash::fast::FixedState::with_seed(0x5eed_a551_7e11_0001).hash_one(id)
}

/// Per-replica values written on the event path.
#[derive(Debug, Default)]
pub(crate) struct ReplicaLive {
    /// Last registration (event or stats with an endpoint), ns; 0 = never.
    pub registered_at: AtomicU64,
    /// Last event of any kind, ns; 0 = never.
    pub last_event_at: AtomicU64,
    /// Entries of the scope this replica holds.
    pub prefix_count: AtomicU64,
    pub stats: Mutex<Option<(ReplicaStats, Timestamp)>>,
    /// The load signals the decision reads and each routed request's
    /// [`Inflight`](crate::load::Inflight) counts against.
    pub load: ReplicaLoad,
}

impl LoadCell for ReplicaLive {
    fn load(&self) -> &ReplicaLoad {
        &self.load
    }
}

impl ReplicaLive {
    pub fn add_prefixes(&self, n: u64) {
        if n > 0 {
            self.prefix_count.fetch_add(n, Ordering::Relaxed);
        }
    }

    pub fn sub_prefixes(&self, n: u64) {
        if n > 0 {
            let _ = self
                .prefix_count
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |c| {
                    Some(c.saturating_sub(n))
                });
        }
    }

    pub fn prefix_count(&self) -> u64 {
        self.prefix_count.load(Ordering::Relaxed)
    }

    pub fn last_event_at(&self) -> u64 {
        self.last_event_at.load(Ordering::Relaxed)
    }

    /// Reported waiting + running requests, for the ORIGINAL_DST fallback.
    pub fn reported_load(&self) -> u64 {
        self.stats
            .lock()
            .map(|(s, _)| u64::from(s.waiting_requests) + u64::from(s.running_requests))
            .unwrap_or(0)
    }
}

/// One replica of a scope.
#[derive(Clone, Debug)]
pub(crate) struct ReplicaSlot {
    pub id: Arc<str>,
    pub id_hash: u64,
    /// Address from configuration (static endpoint or discovered pod).
    pub declared: Option<Arc<str>>,
    /// Address from its own IngestEvents/ReportStats.
    pub registered: Option<Arc<str>>,
    pub live: Arc<ReplicaLive>,
}

impl ReplicaSlot {
    pub fn new(id: &str) -> Self {
        Self {
            id: Arc::from(id),
            id_hash: replica_id_hash(id),
            declared: None,
            registered: None,
            live: Arc::new(ReplicaLive::default()),
        }
    }

    /// In servingByScope: declared, or registered and not stale.
    pub fn is_serving(&self, now: u64, ttl: u64) -> bool {
        self.declared.is_some()
            || (self.registered.is_some()
                && now.saturating_sub(self.live.registered_at.load(Ordering::Relaxed)) <= ttl)
    }

    /// Where requests for this replica go; declarations win over registrations.
    pub fn endpoint(&self) -> Option<&Arc<str>> {
        self.declared.as_ref().or(self.registered.as_ref())
    }
}

/// All replicas of a scope, by slot. Slots are what index entries store.
#[derive(Clone, Debug, Default)]
pub struct ReplicaTable {
    slots: Vec<Option<ReplicaSlot>>,
    by_id: HashMap<Arc<str>, u32>,
    /// Freed slots and when they were freed (ns). A slot is reused only after a
    /// delay, so a lookup that loaded an older table can never attribute a new
    /// replica's entries to the old one.
    free: Vec<(u32, u64)>,
    /// Slots in replica-id order: serving sets list members in this order, so
    /// ranked rows tie-break on replica id without comparing strings.
    by_rank: Vec<u32>,
    /// servingByScope without a candidate subset while every registered replica
    /// is fresh, so lookups need not rebuild it. Set by [`ReplicaTable::seal`],
    /// cleared by every mutation.
    everyone: Option<Everyone>,
}

/// The replicas that can serve (declared or registered), and the registered-only
/// ones among them: those serve only while their registration is fresh.
#[derive(Clone, Debug)]
struct Everyone {
    members: Members,
    /// The members' id hashes, in member order (the affinity pick's input).
    id_hashes: Vec<u64>,
    registered_only: Vec<Arc<ReplicaLive>>,
    /// A lower bound of the registered-only members' registration times.
    oldest: OldestRegistration,
}

impl Everyone {
    /// Every member serves at `now`: declared ones always, the others while fresh.
    ///
    /// That is the oldest registration being fresh. Registration times only grow
    /// (`fetch_max`), so the oldest one seen stays a lower bound: while it is
    /// fresh, so is everyone, and the lookup reads one atomic instead of every
    /// registered replica's (32 loads and compares on the peer workload).
    fn all_serving(&self, now: u64, ttl: u64) -> bool {
        if now.saturating_sub(self.oldest.0.load(Ordering::Acquire)) <= ttl {
            return true;
        }
        let oldest = self
            .registered_only
            .iter()
            .map(|l| l.registered_at.load(Ordering::Relaxed))
            .min()
            .unwrap_or(u64::MAX);
        self.oldest.0.fetch_max(oldest, Ordering::Release);
        now.saturating_sub(oldest) <= ttl
    }
}

/// [`Everyone::all_serving`]'s cached lower bound (0: none yet). Release and
/// Acquire order it after the registration loads it came from, so a lookup that
/// reads it never trusts a newer time than it could read itself.
#[derive(Debug, Default)]
struct OldestRegistration(AtomicU64);

impl Clone for OldestRegistration {
    fn clone(&self) -> Self {
        Self(AtomicU64::new(self.0.load(Ordering::Relaxed)))
    }
}

impl ReplicaTable {
    /// How long a freed slot stays unused.
    const REUSE_DELAY_NS: u64 = 60 * 1_000_000_000;

    pub(crate) fn slot_of(&self, id: &str) -> Option<u32> {
        self.by_id.get(id).copied()
    }

    pub(crate) fn get(&self, slot: u32) -> Option<&ReplicaSlot> {
        self.slots.get(slot as usize).and_then(Option::as_ref)
    }

    pub(crate) fn get_mut(&mut self, slot: u32) -> Option<&mut ReplicaSlot> {
        self.everyone = None;
        self.slots.get_mut(slot as usize).and_then(Option::as_mut)
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (u32, &ReplicaSlot)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.as_ref().map(|s| (i as u32, s)))
    }

    pub(crate) fn len(&self) -> usize {
        self.by_id.len()
    }

    pub(crate) fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// Precomputes the unnarrowed serving set; call before publishing a new
    /// version.
    pub(crate) fn seal(&mut self) {
        let mut everyone = Everyone {
            members: Members::for_table(self),
            id_hashes: Vec::new(),
            registered_only: Vec::new(),
            oldest: OldestRegistration::default(),
        };
        for &slot in &self.by_rank {
            let Some(r) = self.get(slot) else { continue };
            if r.declared.is_some() {
                everyone.members.push(slot);
                everyone.id_hashes.push(r.id_hash);
            } else if r.registered.is_some() {
                everyone.members.push(slot);
                everyone.id_hashes.push(r.id_hash);
                everyone.registered_only.push(r.live.clone());
            }
        }
        self.everyone = Some(everyone);
    }

    fn rerank(&mut self) {
        self.everyone = None;
        let mut order: Vec<(Arc<str>, u32)> =
            self.by_id.iter().map(|(id, &s)| (id.clone(), s)).collect();
        order.sort();
        self.by_rank = order.into_iter().map(|(_, slot)| slot).collect();
    }

    pub(crate) fn insert(&mut self, replica: ReplicaSlot, now: u64) -> u32 {
        let reusable = self
            .free
            .iter()
            .position(|&(_, at)| now.saturating_sub(at) >= Self::REUSE_DELAY_NS);
        let slot = match reusable {
            Some(pos) => {
                let (slot, _) = self.free.swap_remove(pos);
                self.slots[slot as usize] = Some(replica.clone());
                slot
            }
            None => {
                self.slots.push(Some(replica.clone()));
                (self.slots.len() - 1) as u32
            }
        };
        self.by_id.insert(replica.id, slot);
        self.rerank();
        slot
    }

    pub(crate) fn remove(&mut self, slot: u32, now: u64) -> Option<ReplicaSlot> {
        let removed = self.slots.get_mut(slot as usize).and_then(Option::take)?;
        self.by_id.remove(&removed.id);
        self.free.push((slot, now));
        self.rerank();
        Some(removed)
    }
}

/// Member slots in replica-id order, and the same slots as a bitset.
#[derive(Clone, Debug)]
pub(crate) struct Members {
    pub slots: SmallVec<[u32; 32]>,
    pub bits: SmallVec<[u64; 2]>,
}

impl Members {
    fn for_table(table: &ReplicaTable) -> Self {
        Self {
            slots: SmallVec::new(),
            bits: SmallVec::from_elem(0, table.capacity().div_ceil(64).max(1)),
        }
    }

    fn push(&mut self, slot: u32) {
        self.slots.push(slot);
        self.bits[slot as usize / 64] |= 1 << (slot % 64);
    }
}

/// servingByScope of one scope at one instant, narrowed by the request's
/// candidate subset. Members are indexed 0..len in replica-id order.
pub(crate) struct ServingSet {
    pub table: Arc<ReplicaTable>,
    /// `None`: the table's precomputed set of everyone.
    own: Option<Members>,
}

impl ServingSet {
    pub fn new(table: Arc<ReplicaTable>, now: u64, ttl: u64, candidates: &[String]) -> Self {
        if candidates.is_empty()
            && table
                .everyone
                .as_ref()
                .is_some_and(|e| e.all_serving(now, ttl))
        {
            return Self { table, own: None };
        }
        let mut members = Members::for_table(&table);
        let mut allowed: SmallVec<[u32; 16]> = SmallVec::new();
        if !candidates.is_empty() {
            allowed.extend(candidates.iter().filter_map(|c| table.slot_of(c)));
        }
        for &slot in &table.by_rank {
            let wanted = candidates.is_empty() || allowed.contains(&slot);
            if wanted && table.get(slot).is_some_and(|r| r.is_serving(now, ttl)) {
                members.push(slot);
            }
        }
        Self {
            table,
            own: Some(members),
        }
    }

    fn set(&self) -> Option<&Members> {
        match &self.own {
            Some(own) => Some(own),
            None => self.table.everyone.as_ref().map(|e| &e.members),
        }
    }

    /// The member slots, in replica-id order.
    pub fn members(&self) -> &[u32] {
        self.set().map_or(&[], |m| &m.slots)
    }

    /// The members as a bitset over slots.
    pub fn slot_bits(&self) -> &[u64] {
        self.set().map_or(&[], |m| &m.bits)
    }

    pub fn len(&self) -> usize {
        self.members().len()
    }

    pub fn is_empty(&self) -> bool {
        self.members().is_empty()
    }

    /// The member index of a slot, if that replica is serving (and a candidate).
    pub fn member_of(&self, slot: u32) -> Option<usize> {
        let serving = self
            .slot_bits()
            .get(slot as usize / 64)
            .is_some_and(|w| w & (1 << (slot % 64)) != 0);
        serving
            .then(|| self.members().iter().position(|&s| s == slot))
            .flatten()
    }

    pub fn replica(&self, member: usize) -> Option<&ReplicaSlot> {
        self.members().get(member).and_then(|&s| self.table.get(s))
    }

    /// The members' id hashes in member order, when the table has them at hand
    /// (the unnarrowed set); else `None`, and [`Self::replicas`] has them.
    pub fn id_hashes(&self) -> Option<&[u64]> {
        match &self.own {
            Some(_) => None,
            None => self.table.everyone.as_ref().map(|e| &e.id_hashes[..]),
        }
    }

    /// The members' replicas in member order: [`Self::replica`] of every
    /// member, with the member list looked up once instead of per member.
    pub fn replicas(&self) -> impl Iterator<Item = &ReplicaSlot> {
        self.members().iter().filter_map(|&s| self.table.get(s))
    }
}

#[cfg(test)]
mod tests;
