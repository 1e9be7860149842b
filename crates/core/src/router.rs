//! The core's front door: the index plus the current policy snapshot.
//!
//! Adapters hold an `Arc<Router>`. Policy sources call [`Router::install`] with a
//! complete new snapshot; every request reads exactly one snapshot (`ArcSwap`
//! load, no lock), so a reload never tears a decision.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, Weak};

use arc_swap::{ArcSwap, ArcSwapOption};
use parking_lot::Mutex;

use super::chain;
use super::decision::{self, outcome::Decision, request::LookupRequest};
use super::flow::saturation::Pressure;
use super::flow::{FleetShares, RoomWatch};
use super::index::{
    Index, IndexConfig, IndexView, IngestBatch, IngestError, IngestOutcome, StatsReport,
    TenantLimits,
};
use super::load::Inflight;
use super::load::RouteFacts;
use super::load::peer_ledger::{Fact, MAX_SHARED_PENDING, Message, Outcome, Rejection};
use super::peers::{Fleet, RouteWork};
use super::policy::EvictionAlgorithm;
use super::scope::{PROBE_TENANT, ScopeKey, ScopeRef};
use super::snapshot::PolicySnapshot;
use super::time::Timestamp;

/// The index and the policy it is read under.
pub struct Router {
    index: Index,
    snapshot: ArcSwap<PolicySnapshot>,
    /// Serialises installs (declaration sync) and self-tests.
    control: Mutex<()>,
    /// Wakes the embedder's maintenance worker when an ingest leaves the index
    /// over its entry cap, so the cap sweep (a scan of the largest tenant) runs
    /// there instead of on the ingesting thread. Unset: the sweep runs inline.
    over_cap: OnceLock<Box<dyn Fn() + Send + Sync>>,
    /// Round-robin turn among equally loaded replicas of [`Router::fallback_in_fleet`].
    fleet_turn: AtomicUsize,
    /// Fleet sync: the other sidecars' routes, and where this one's go.
    fleet: OnceLock<Fleet>,
    /// Where the peers' routes are charged to their tenants' shares (flow
    /// control's queues; weak: they hold this router).
    fleet_shares: Mutex<Option<Weak<dyn FleetShares>>>,
    /// Told when applied signals may have freed room (flow control's queues;
    /// weak, as above). A lock-free load on every ingest.
    room_watch: ArcSwapOption<Weak<dyn RoomWatch>>,
}

impl Router {
    pub fn new(config: IndexConfig, snapshot: PolicySnapshot, now: Timestamp) -> Self {
        let router = Self {
            index: Index::new(config),
            snapshot: ArcSwap::from_pointee(PolicySnapshot::empty()),
            control: Mutex::new(()),
            over_cap: OnceLock::new(),
            fleet_turn: AtomicUsize::new(0),
            fleet: OnceLock::new(),
            fleet_shares: Mutex::new(None),
            room_watch: ArcSwapOption::empty(),
        };
        router.install(snapshot, now);
        router
    }

    pub fn index(&self) -> &Index {
        &self.index
    }

    /// The snapshot in force.
    pub fn snapshot(&self) -> Arc<PolicySnapshot> {
        self.snapshot.load_full()
    }

    /// Swaps in a new snapshot and makes its declared replicas (CacheBackend
    /// endpoints) the index's: replicas no longer declared lose their entries.
    pub fn install(&self, snapshot: PolicySnapshot, now: Timestamp) {
        let _control = self.control.lock();
        let mut declared: BTreeMap<ScopeKey, Vec<(String, String)>> = BTreeMap::new();
        for backend in snapshot.backends() {
            let replicas = declared.entry(backend.scope.clone()).or_default();
            for r in &backend.replicas {
                if !replicas.iter().any(|(id, _)| *id == r.id) {
                    replicas.push((r.id.clone(), r.address.clone()));
                }
            }
        }
        self.snapshot.store(Arc::new(snapshot));
        for scope in self.index.declared_scopes() {
            if !declared.contains_key(&scope) {
                self.index.declare(scope.as_ref(), &[], now);
            }
        }
        for (scope, replicas) in &declared {
            self.index.declare(scope.as_ref(), replicas, now);
        }
    }

    /// One LookupRoute decision.
    pub fn lookup(&self, req: &LookupRequest<'_>, now: Timestamp) -> Decision {
        // The request as sent is passed on as it is (not copied).
        let keys = Self::identity_keys(req);
        let keyed;
        let req = match keys.as_deref() {
            None => req,
            Some(k) => {
                keyed = LookupRequest {
                    block_hashes: k,
                    ..*req
                };
                &keyed
            }
        };
        decision::decide(&self.index, &self.snapshot.load(), req, now)
    }

    /// The chain as the index holds it when the request names an adapter or salt
    /// under `ic-content-v2` (see `chain::content_v2`); `None`: as sent.
    fn identity_keys(req: &LookupRequest<'_>) -> Option<Vec<u64>> {
        chain::request_keys(
            req.hash_scheme,
            req.block_hashes,
            req.lora_adapter,
            req.cache_salt,
        )
    }

    /// The request of `decision` really goes to its pick (the ext_proc path): count
    /// it in flight there (see [`crate::load`]), wait for its last block so its
    /// prefill backlog goes when the engine stores it (`load/prefills.rs`), and
    /// record its chain as pending for that replica, so siblings arriving during
    /// its prefill land together (`index/pending.rs`). Nothing happens without a
    /// pick or with the load rule off, and a gRPC LookupRoute (a query) never
    /// calls this. The count is held by the returned guard.
    pub fn admit(
        &self,
        decision: &Decision,
        req: &LookupRequest<'_>,
        now: Timestamp,
    ) -> Option<Inflight> {
        self.admit_with(decision, req, now, false)
    }

    /// [`Self::admit`], but the request's count ends with its prefill when the
    /// engine shows both ends: its replica's engine events are live
    /// ([`crate::load::EVENT_FEED_LIVE`]) and its queue report is younger than
    /// `statsMaxAge` (the decode that follows is in it). A request bringing
    /// uncached blocks is then let go by the engine's event storing its last
    /// block (or after [`crate::load::INFLIGHT_AGE_OUT`]); one whose blocks are
    /// all cached at once. Either way it stays in "sent since the last report"
    /// until the engine's next one, [`Inflight::ends_with_prefill`] is true and
    /// the caller need not keep the guard nor wait for the response. Otherwise
    /// (no chain, an engine not live, the prefill table full) as [`Self::admit`].
    pub fn admit_until_prefill_end(
        &self,
        decision: &Decision,
        req: &LookupRequest<'_>,
        now: Timestamp,
    ) -> Option<Inflight> {
        self.admit_with(decision, req, now, true)
    }

    fn admit_with(
        &self,
        decision: &Decision,
        req: &LookupRequest<'_>,
        now: Timestamp,
        until_prefill_end: bool,
    ) -> Option<Inflight> {
        let requested = if req.block_token_counts.is_empty() {
            u64::from(req.prefix_token_count)
        } else {
            req.block_token_counts.iter().map(|&t| u64::from(t)).sum()
        };
        let mut inflight = decision.admit_at(requested, now)?;
        let chained =
            !req.block_hashes.is_empty() && req.block_hashes.len() == req.block_token_counts.len();
        // The policy only for a chain: pending entries and backlogs need one.
        let snapshot = chained.then(|| self.snapshot.load());
        let ttl = snapshot.as_ref().map_or(0, |s| {
            s.tenant(req.tenant_id)
                .policy
                .load_balancing
                .pending_ttl_nanos()
        });
        // The identity keys, computed here when the peers get the pending
        // chain too (see `apply_peer`), and then not again below.
        let mut keys = (ttl > 0 && self.fleet.get().is_some()).then(|| Self::identity_keys(req));
        if let (Some(fleet), Some(replica)) = (self.fleet.get(), decision.pick_replica_id()) {
            let scope = ScopeRef::new(req.tenant_id, req.model_id, req.hash_scheme);
            let pending = keys.as_ref().map_or_else(Vec::new, |k| {
                let chain = k.as_deref().unwrap_or(req.block_hashes);
                chain[..chain.len().min(MAX_SHARED_PENDING)].to_vec()
            });
            let work = RouteWork {
                uncached_tokens: inflight.uncached_tokens(),
                // As flow control costs it here (at least 1; 0 on the wire
                // means a publisher that does not say).
                prompt_tokens: crate::flow::prompt_tokens(
                    req.block_token_counts,
                    req.prefix_token_count,
                ),
                priority: req.priority,
                held: req.held,
            };
            inflight.share(fleet.share(scope, &replica, work, pending));
        }
        let Some(snapshot) = snapshot else {
            return Some(inflight);
        };
        let balancing = &snapshot.tenant(req.tenant_id).policy.load_balancing;
        let last_event_at = decision.pick_last_event_at();
        // Every block cached: its prefill (a partial last block at most) is over
        // within an engine step, and what follows is in the engine's next report.
        if until_prefill_end
            && inflight.prefill().is_none()
            && inflight.engine_is_live(now, last_event_at, balancing.stats_max_age_nanos())
        {
            inflight.end_prefill_now();
        }
        // A scope lookup (and the identity keys) only when there is something to
        // record: a backlog to let go early, or pending entries.
        if ttl == 0 && inflight.prefill().is_none() {
            return Some(inflight);
        }
        let scope = ScopeRef::new(req.tenant_id, req.model_id, req.hash_scheme);
        if let (Some(s), Some(slot)) = (self.index.scope(scope), decision.pick_slot()) {
            let keys = keys.take().unwrap_or_else(|| Self::identity_keys(req));
            let chain = keys.as_deref().unwrap_or(req.block_hashes);
            if let Some(&last) = chain.last() {
                // Handed over before the ticket is shared: an event storing
                // `last` right after `track` finds it carrying the request.
                let handed = until_prefill_end
                    && inflight.engine_is_live(now, last_event_at, balancing.stats_max_age_nanos())
                    && inflight.hand_to_prefill();
                let tracked = inflight
                    .prefill()
                    .is_some_and(|p| s.prefills.track(slot, last, p));
                if handed && !tracked {
                    inflight.take_back();
                }
            }
            if ttl > 0 {
                s.pending.record(slot, chain, now.as_nanos(), ttl);
            }
        }
        Some(inflight)
    }

    /// Fleet sync: this sidecar is `me` in its fleet; every request it admits
    /// is published through `facts` (routed, prefill ended, released), and the
    /// peers' facts given to [`Self::apply_peer`] count in the load signals next
    /// to its own. Set once; `false` if already set.
    pub fn join_fleet(&self, me: &str, facts: Arc<dyn RouteFacts>) -> bool {
        self.fleet.set(Fleet::new(me, facts)).is_ok()
    }

    /// One peer's routing fact, received at `now` (see
    /// [`crate::load::peer_ledger`]). `None` outside a fleet.
    pub fn apply_peer(&self, msg: Message, now: Timestamp) -> Option<Outcome> {
        let fleet = self.fleet.get()?;
        // A peer's pending chain is recorded as this sidecar records its own,
        // under this sidecar's pendingTTL for the tenant (0: none kept).
        let pending = match &msg.fact {
            Fact::Routed {
                scope,
                replica,
                pending,
                ..
            } if !pending.is_empty() => Some((scope.clone(), replica.clone(), pending.clone())),
            _ => None,
        };
        let shares = self.fleet_shares.lock().as_ref().and_then(Weak::upgrade);
        let served = match (&shares, &msg.fact) {
            (
                Some(_),
                Fact::Routed {
                    scope,
                    prompt_tokens,
                    priority,
                    held,
                    ..
                },
            ) if *prompt_tokens > 0 => Some((scope.clone(), *priority, *prompt_tokens, *held)),
            _ => None,
        };
        let outcome = fleet.apply(&self.index, msg, now);
        let applied = matches!(outcome, Outcome::Applied | Outcome::AppliedAfterGap);
        // A route the ledger had no room for (the peer's in-flight bound) was
        // still served: it counts in the tenant's share all the same.
        let served_anyway = matches!(outcome, Outcome::Rejected(Rejection::Full));
        if let (Some(shares), Some((scope, priority, tokens, held))) = (shares, served)
            && (applied || served_anyway)
        {
            shares.peer_served(scope.as_ref(), priority, tokens, held, now);
        }
        if let (Some((scope, replica, chain)), true) = (pending, applied) {
            let ttl = self
                .snapshot
                .load()
                .tenant(&scope.tenant)
                .policy
                .load_balancing
                .pending_ttl_nanos();
            if let (true, Some(s)) = (ttl > 0, self.index.scope(scope.as_ref())) {
                let table = s.table();
                if let Some(slot) = table.slot_of(&replica) {
                    s.pending.record(slot, &chain, now.as_nanos(), ttl);
                }
            }
        }
        if applied {
            // A peer's prefill end or its engine's report frees room here too.
            self.signals_changed();
        }
        Some(outcome)
    }

    /// Fleet sync: the peers' routes are charged to their tenants in `shares`
    /// from now on (replacing whatever was set before), so flow control's
    /// tenant shares count what the whole fleet served.
    pub fn share_fleet_service(&self, shares: Weak<dyn FleetShares>) {
        *self.fleet_shares.lock() = Some(shares);
    }

    /// `watch` is told after every applied event batch, queue report and peer
    /// fact from now on (replacing whatever was set before): the moments a
    /// prefill can end and a saturated replica gain room.
    pub fn watch_room(&self, watch: Weak<dyn RoomWatch>) {
        self.room_watch.store(Some(Arc::new(watch)));
    }

    fn signals_changed(&self) {
        if let Some(watch) = self.room_watch.load().as_ref().and_then(|w| w.upgrade()) {
            watch.signals_changed();
        }
    }

    /// Drops the peers silent past the heartbeat timeout; returns how many.
    pub fn expire_peers(&self, now: Timestamp) -> usize {
        self.fleet.get().map_or(0, |f| f.expire(&self.index, now))
    }

    /// Drops every peer's routes (the fleet view is lost: they would only go
    /// stale); peers are relearned from their next messages.
    pub fn forget_peers(&self) {
        if let Some(f) = self.fleet.get() {
            f.forget(&self.index);
        }
    }

    /// Peers currently known (0 outside a fleet).
    pub fn fleet_peers(&self) -> usize {
        self.fleet.get().map_or(0, Fleet::peers)
    }

    fn limits(snapshot: &PolicySnapshot, tenant: &str) -> TenantLimits {
        let view = snapshot.tenant(tenant);
        TenantLimits {
            ttl_nanos: view.policy.ttl_nanos(),
            eviction: view.policy.eviction,
            max_entries: view.max_index_entries,
        }
    }

    /// IngestEvents. The probe tenant is reserved for [`Router::self_test`].
    pub fn ingest(
        &self,
        batch: &IngestBatch<'_>,
        now: Timestamp,
    ) -> Result<IngestOutcome, IngestError> {
        if batch.scope.tenant == PROBE_TENANT {
            return Err(IngestError::ReservedTenant(PROBE_TENANT.to_string()));
        }
        let snapshot = self.snapshot.load();
        let outcome =
            self.index
                .ingest(batch, &Self::limits(&snapshot, batch.scope.tenant), now)?;
        if self.index.over_cap() {
            match self.over_cap.get() {
                Some(wake) => wake(),
                None => self.sweep_cap(),
            }
        }
        self.signals_changed();
        Ok(outcome)
    }

    /// Moves the cap sweep off the ingest path: `wake` is called (cheaply, from
    /// the ingesting thread) whenever an ingest leaves the index over its cap, and
    /// the embedder runs [`Router::sweep_cap`] on its maintenance worker. Quota
    /// stays enforced inside ingest. Set once.
    pub fn on_over_cap(&self, wake: Box<dyn Fn() + Send + Sync>) -> bool {
        self.over_cap.set(wake).is_ok()
    }

    /// Evicts down to the entry cap, each tenant in its own eviction order.
    pub fn sweep_cap(&self) {
        if self.index.over_cap() {
            let snapshot = self.snapshot.load();
            self.index
                .sweep_cap(&|t| snapshot.tenant(t).policy.eviction);
        }
    }

    /// ReportStats.
    pub fn report_stats(
        &self,
        report: &StatsReport<'_>,
        now: Timestamp,
    ) -> Result<(), IngestError> {
        if report.scope.tenant == PROBE_TENANT {
            return Err(IngestError::ReservedTenant(PROBE_TENANT.to_string()));
        }
        self.index.report_stats(report, now)?;
        self.signals_changed();
        Ok(())
    }

    /// A serving replica for ORIGINAL_DST without a hint: least loaded, then
    /// round-robin. `None` when the scope has no serving replica.
    pub fn fallback_endpoint(
        &self,
        scope: ScopeRef<'_>,
        candidates: &[String],
        now: Timestamp,
    ) -> Option<Arc<str>> {
        let s = self.index.scope(scope)?;
        let ttl = self.snapshot.load().tenant(scope.tenant).policy.ttl_nanos();
        let serving = s.serving(now.as_nanos(), ttl, candidates);
        s.least_loaded(&serving)
    }

    /// ORIGINAL_DST's last resort for a request whose scope is unknown (a body
    /// mode request whose body gave none: invalid JSON, over the size limit, an
    /// unknown model): the least loaded serving replica of the scopes serving
    /// `model`, or of the whole fleet when none does (or `model` is empty), among
    /// the `subset` endpoints when the gateway gave one; ties go round-robin.
    /// Failing open beats a 503 for a request the engines can serve. `None` when
    /// not one replica qualifies.
    pub fn fallback_in_fleet(
        &self,
        model: &str,
        subset: Option<&[&str]>,
        now: Timestamp,
    ) -> Option<Arc<str>> {
        let snapshot = self.snapshot.load();
        let fleet = self.index.fleet_scopes();
        let serving_model = fleet
            .iter()
            .any(|s| !model.is_empty() && &*s.key.model == model);
        let mut options: Vec<(u64, Arc<str>)> = Vec::new();
        for s in &fleet {
            if serving_model && &*s.key.model != model {
                continue;
            }
            let ttl = snapshot.tenant(&s.key.tenant).policy.ttl_nanos();
            let serving = s.serving(now.as_nanos(), ttl, &[]);
            options.extend(
                s.serving_endpoints(&serving)
                    .into_iter()
                    .filter(|(_, e)| subset.is_none_or(|addrs| addrs.contains(&&**e))),
            );
        }
        // One endpoint may serve several scopes: count it once, at its highest load.
        options.sort_unstable_by(|a, b| a.1.cmp(&b.1).then(b.0.cmp(&a.0)));
        options.dedup_by(|a, b| a.1 == b.1);
        let min = options.iter().map(|(load, _)| *load).min()?;
        let tied: Vec<&Arc<str>> = options
            .iter()
            .filter(|(load, _)| *load == min)
            .map(|(_, e)| e)
            .collect();
        let turn = self.fleet_turn.fetch_add(1, Ordering::Relaxed);
        Some(tied[turn % tied.len()].clone())
    }

    /// The load pressure of every serving replica of `scope` (narrowed to
    /// `candidates` when not empty), for flow control's saturation predicate
    /// ([`crate::flow::saturation::all_saturated`]). The engine's report counts
    /// while younger than the tenant's `statsMaxAge`, plus what this sidecar sent
    /// since and is still prefilling; without a fresh report the waiting bound
    /// has nothing to read (in-flight requests do not stand in: a request whose
    /// prefill end is unseen may be decoding). The prefill backlog is the
    /// fleet's: this sidecar's routes still prefilling and, with fleet sync, its
    /// peers'; it counts only where the engine's KV events are live
    /// ([`crate::load::EVENT_FEED_LIVE`]), because elsewhere a prefill is taken
    /// to end at the response headers, which a non-streaming response sends at
    /// the end of its generation. What this sidecar sent and the backlog count
    /// every scope registered at the replica's address (other tenants' requests
    /// wait in the same engine queue). Empty when the scope is unknown or
    /// serves nothing.
    pub fn pressures(
        &self,
        scope: ScopeRef<'_>,
        candidates: &[String],
        now: Timestamp,
    ) -> Vec<Pressure> {
        let Some(s) = self.index.scope(scope) else {
            return Vec::new();
        };
        let policy = self.snapshot.load().tenant(scope.tenant).policy.clone();
        let (now_ns, max_age) = (now.as_nanos(), policy.load_balancing.stats_max_age_nanos());
        let serving = s.serving(now_ns, policy.ttl_nanos(), candidates);
        // An engine serves every scope registered at its address: the work this
        // fleet queued there is the sum over those scopes, whoever's tenant it is.
        // One pass over the other scopes' replicas (O(scopes × replicas)).
        let mut elsewhere: HashMap<Arc<str>, OtherScopes> = HashMap::new();
        for other in self.index.fleet_scopes() {
            if Arc::ptr_eq(&other, &s) {
                continue;
            }
            other.for_each_endpoint(|endpoint, live| {
                let l = &live.load;
                let e = elsewhere.entry(endpoint.clone()).or_default();
                e.since_report += l.prefilling_since_report();
                e.backlog_tokens += l.inflight_tokens();
            });
        }
        (0..serving.len())
            .filter_map(|m| serving.replica(m))
            .map(|r| {
                let load = &r.live.load;
                let fresh = load.report_is_fresh(now_ns, max_age);
                let kv_usage = if fresh {
                    r.live
                        .stats
                        .lock()
                        .as_ref()
                        .map(|(st, _)| st.kv_cache_usage)
                } else {
                    None
                };
                let other = r
                    .endpoint()
                    .and_then(|e| elsewhere.get(e))
                    .copied()
                    .unwrap_or_default();
                let events_live = crate::load::event_feed_is_live(r.live.last_event_at(), now_ns);
                Pressure {
                    engine_waiting: load.engine_waiting(now_ns, max_age),
                    sent_since_report: if fresh {
                        load.prefilling_since_report() + other.since_report
                    } else {
                        0
                    },
                    kv_usage,
                    backlog_tokens: if events_live {
                        load.inflight_tokens() + other.backlog_tokens
                    } else {
                        0
                    },
                }
            })
            .collect()
    }

    /// The replica ids of `scope` at these `ip:port` endpoints (unknown ones are
    /// left out): turns a gateway's endpoint subset into `candidate_replicas`.
    pub fn replicas_at(&self, scope: ScopeRef<'_>, addresses: &[&str]) -> Vec<String> {
        self.index
            .scope(scope)
            .map_or_else(Vec::new, |s| s.replicas_at(addresses))
    }

    /// Periodic upkeep: TTL sweep, quota trims, idle replicas, cap sweep.
    pub fn maintain(&self, now: Timestamp) {
        let snapshot = self.snapshot.load();
        self.index.sweep(&|t| Self::limits(&snapshot, t), now);
        if self.index.over_cap() {
            self.index
                .sweep_cap(&|t| snapshot.tenant(t).policy.eviction);
        }
        // A replica that appeared since the peers' last change gets their load.
        if let Some(f) = self.fleet.get() {
            f.rewrite(&self.index);
        }
    }

    /// `/snapshot`'s view of the index.
    pub fn view(&self, now: Timestamp) -> IndexView {
        let snapshot = self.snapshot.load();
        self.index
            .view(now, &|t| snapshot.tenant(t).policy.ttl_nanos())
    }

    /// Each tenant's eviction algorithm, for callers that sweep by hand.
    pub fn eviction_of(&self, tenant: &str) -> EvictionAlgorithm {
        self.snapshot.load().tenant(tenant).policy.eviction
    }

    /// The `/readyz` functional self-test (see `selftest.rs`).
    pub fn self_test(&self, now: Timestamp) -> Result<(), String> {
        let _control = self.control.lock();
        super::selftest::run(&self.index, &self.snapshot.load(), now)
    }
}

/// What the other scopes registered at one address hold there: their routes
/// since the engine's report, in flight, and their prefill backlog.
#[derive(Clone, Copy, Debug, Default)]
struct OtherScopes {
    since_report: u64,
    backlog_tokens: u64,
}
