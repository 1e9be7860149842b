//! Flow control on the ext_proc path: a request whose every eligible replica is
//! saturated is held, in the order of the core's [`FlowQueue`], until a replica
//! frees, its wait runs out (429 `queue-timeout`) or a full queue sheds it (429
//! `queue-full` / `priority`). One whose wait would run out (at least as many
//! held ahead of it as the queue released in the last `maxQueueWait`) is shed
//! on arrival (429 `queue-timeout`).
//!
//! ```text
//!  stream ──FlowGate::admit──▶ Pass (below saturation: the queue is not touched)
//!                          ├─▶ Shed (429 at once)
//!                          └─▶ Pending ──(awaited beside the inbound stream)──▶ Released → decide now
//!                                 ▲                                          └▶ Shed (timeout, evicted)
//!       pump task: on a wake-up (enqueue, a request leaving a replica, a released
//!       request decided) or a tick while anything is held: expire, then release
//!       the queue's head while one of its replicas has room
//! ```
//!
//! One queue per model: the tenants of a model share its replicas, so they
//! share its queue (priority first, then each `Fairness` tenant's weight). A
//! queue's head is released only when its own scope has a replica below
//! saturation, and releases go one at a time: the next waits until the one
//! released has been decided and counted in flight where it went, so a freed
//! replica is not handed a burst. The decision runs at release (late binding):
//! the request goes to the cache-aware pick of that moment.
//!
//! With fleet sync, a head that could go may wait up to [`PEER_YIELD_GRACE`]
//! when a peer holds a tenant owed the room first
//! ([`FlowQueue::yields_to_peer`]).
//!
//! A held request whose stream ends (the client went away) leaves the queue when
//! its [`Pending`] drops. Limits come from the policy of the request's tenant:
//! its `maxQueueWait` sets its own deadline, its `maxQueuedRequests` bounds the
//! model's queue when it arrives.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::sync::{Notify, oneshot};

use crate::adapters::metrics::flow::FlowMetrics;
use crate::core::Router;
use crate::core::flow::saturation::{Thresholds, all_saturated};
use crate::core::flow::{
    Admission, FleetShares, FlowQueue, QueueLimits, Request, RoomWatch, ShedReason, Ticket,
};
use crate::core::policy::FlowControl;
use crate::core::scope::ScopeRef;
use crate::core::time::Timestamp;

use super::headers::RoutingFields;

/// How often held requests are re-checked when nothing wakes the pump (engine
/// stats arriving, another sidecar's requests finishing).
pub const TICK: Duration = Duration::from_millis(10);

/// The longest a queue leaves a replica's room unused for a fleet peer that
/// holds a tenant owed service first ([`FlowQueue::yields_to_peer`]): a
/// peer's pump re-checks at least every [`TICK`], so a peer that still holds
/// such a request is expected to have released it by then. Past it the room
/// is taken here: two sidecars that each leave room to the other's tenant
/// lose at most this much per room.
pub const PEER_YIELD_GRACE: Duration = TICK;

/// What Envoy is asked to wait for a held request beyond its `maxQueueWait`
/// (`override_message_timeout`): the release's decision and a loaded event loop.
pub const MESSAGE_TIMEOUT_MARGIN: Duration = Duration::from_secs(1);

/// The gate's answer for one request.
pub enum Gate {
    /// Decide now: flow control is off for the tenant, or a replica has room.
    Pass,
    /// Answer 429 now.
    Shed(Shed),
    /// Held: await [`Pending::outcome`].
    Held(Pending),
}

/// Why and for how long a shed request is told to go away.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shed {
    pub reason: ShedReason,
    pub retry_after_secs: u64,
    /// How long it was held first (zero when shed on arrival).
    pub waited: Duration,
}

/// What became of a held request.
pub enum Outcome {
    /// A replica freed: decide now, then drop the [`Transit`].
    Released {
        waited: Duration,
        transit: Transit,
    },
    Shed(Shed),
}

/// A released request not yet decided: its queue releases nothing more until
/// this drops (after the decision counted it in flight, or with its stream).
pub struct Transit {
    count: Arc<AtomicUsize>,
    wake: Arc<Notify>,
}

impl Drop for Transit {
    fn drop(&mut self) {
        self.count.fetch_sub(1, Ordering::AcqRel);
        self.wake.notify_one();
    }
}

/// A held request's place in its queue; dropping it before the outcome leaves
/// the queue.
pub struct Pending {
    rx: oneshot::Receiver<Outcome>,
    ticket: Ticket,
    model: String,
    gate: Arc<FlowGate>,
    /// `maxQueueWait` + [`MESSAGE_TIMEOUT_MARGIN`]: what Envoy is asked to wait.
    pub message_timeout: Duration,
    done: bool,
}

impl Pending {
    /// Waits for the release or the shed. A gate gone (shutdown) lets the
    /// request through as if released.
    pub async fn outcome(&mut self) -> Option<Outcome> {
        let out = (&mut self.rx).await.ok();
        self.done = true;
        out
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if !self.done {
            self.gate.cancel(&self.model, self.ticket);
        }
    }
}

struct Waiter {
    tx: oneshot::Sender<Outcome>,
    tenant: String,
    hash_scheme: String,
    candidates: Vec<String>,
    retry_after_secs: u64,
    enqueued_at: Timestamp,
}

struct ModelQueue {
    queue: FlowQueue,
    waiters: HashMap<Ticket, Waiter>,
    /// Released and not yet decided (0 or 1).
    in_transit: Arc<AtomicUsize>,
    /// Since when a replica's room is left to a peer ([`PEER_YIELD_GRACE`]).
    yielding_since: Option<Timestamp>,
}

/// The held requests of one sidecar.
pub struct FlowGate {
    router: Arc<Router>,
    metrics: Arc<FlowMetrics>,
    thresholds: Thresholds,
    queues: parking_lot::Mutex<HashMap<String, ModelQueue>>,
    /// Requests held now, read without the lock by [`FlowGate::nudge`].
    held: AtomicUsize,
    wake: Arc<Notify>,
    pump: std::sync::OnceLock<()>,
}

impl FlowGate {
    pub fn new(router: Arc<Router>, metrics: Arc<FlowMetrics>, thresholds: Thresholds) -> Self {
        Self {
            router,
            metrics,
            thresholds,
            queues: parking_lot::Mutex::new(HashMap::new()),
            held: AtomicUsize::new(0),
            wake: Arc::new(Notify::new()),
            pump: std::sync::OnceLock::new(),
        }
    }

    /// Requests held now.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::Acquire)
    }

    /// A replica may have room (a response began, a stream ended, an engine's
    /// signals changed): held requests may go. Free when nothing is held.
    pub fn nudge(&self) {
        if self.held() > 0 {
            self.wake.notify_one();
        }
    }

    /// Whether the tenant's policy enables flow control (one snapshot read):
    /// the caller's cheap check before it gathers what [`Self::admit`] needs.
    pub fn applies_to(&self, tenant: &str) -> bool {
        self.router
            .snapshot()
            .tenant(tenant)
            .policy
            .flow_control
            .enabled
    }

    /// Flow control's say on a well-formed request about to be decided.
    /// `candidates`: the gateway's subset as replica ids (empty: all).
    pub fn admit(
        self: &Arc<Self>,
        fields: &RoutingFields,
        priority: i64,
        candidates: &[String],
        now: Timestamp,
    ) -> Gate {
        let snapshot = self.router.snapshot();
        let tenant = snapshot.tenant(&fields.tenant);
        let fc = tenant.policy.flow_control;
        let scope = ScopeRef::new(&fields.tenant, &fields.model, &fields.hash_scheme);
        if !fc.enabled || !scope.is_well_formed() {
            return Gate::Pass;
        }
        let limits = limits_of(&fc);
        let request = Request {
            priority,
            tenant: &fields.tenant,
            fair_weight: tenant.fair_weight,
            tokens: request_tokens(fields),
        };
        let mut queues = self.queues.lock();
        let queued_before = queues
            .get(&fields.model)
            .is_some_and(|q| !q.queue.is_empty());
        // Nothing held for the model and a replica with room: the decision runs
        // exactly as without flow control, and the request is charged to its
        // tenant's lane (what it is served counts when the queue fills again).
        let pass = if queued_before {
            false
        } else {
            let pressures = self.router.pressures(scope, candidates, now);
            if pressures.is_empty() {
                // No declared replica serves the scope: the decision answers,
                // and the queues keep no state for names no backend declares.
                return Gate::Pass;
            }
            !all_saturated(
                pressures,
                &self.thresholds.with_backlog(fc.max_backlog_tokens),
            )
        };
        let Some(mq) = queue_for(&mut queues, &fields.model, limits, now) else {
            return Gate::Pass;
        };
        if pass {
            mq.queue.charge(request, now);
            return Gate::Pass;
        }
        mq.queue.set_limits(limits);
        let admission = mq.queue.enqueue(request, now);
        let retry_after_secs = limits.retry_after_secs();
        let ticket = match admission {
            Admission::Shed | Admission::ShedExpectedTimeout { .. } => {
                drop(queues);
                let reason = match admission {
                    Admission::Shed => ShedReason::QueueFull,
                    _ => ShedReason::ExpectedTimeout,
                };
                self.metrics.record_shed(reason);
                return Gate::Shed(Shed {
                    reason,
                    retry_after_secs,
                    waited: Duration::ZERO,
                });
            }
            Admission::Held(t) => t,
            Admission::HeldEvicting { held, evicted } => {
                if let Some(w) = mq.waiters.remove(&evicted) {
                    self.shed_waiter(w, ShedReason::Priority, now);
                }
                held
            }
        };
        let (tx, rx) = oneshot::channel();
        mq.waiters.insert(
            ticket,
            Waiter {
                tx,
                tenant: fields.tenant.clone(),
                hash_scheme: fields.hash_scheme.clone(),
                candidates: candidates.to_vec(),
                retry_after_secs,
                enqueued_at: now,
            },
        );
        self.recount(&queues);
        drop(queues);
        self.metrics.record_held();
        self.start_pump();
        self.wake.notify_one();
        Gate::Held(Pending {
            rx,
            ticket,
            model: fields.model.clone(),
            gate: self.clone(),
            message_timeout: limits.max_wait + MESSAGE_TIMEOUT_MARGIN,
            done: false,
        })
    }

    /// A held request's stream ended: it leaves its queue.
    fn cancel(&self, model: &str, ticket: Ticket) {
        let mut queues = self.queues.lock();
        if let Some(mq) = queues.get_mut(model) {
            mq.queue.cancel(ticket);
            mq.waiters.remove(&ticket);
        }
        self.recount(&queues);
    }

    /// Expires and releases what is due; the pump's next wait (`None`: nothing
    /// held, wait for a wake-up only).
    pub fn pump_once(&self, now: Timestamp) -> Option<Duration> {
        let snapshot = self.router.snapshot();
        let mut queues = self.queues.lock();
        for (model, mq) in queues.iter_mut() {
            for t in mq.queue.expire(now) {
                if let Some(w) = mq.waiters.remove(&t) {
                    self.shed_waiter(w, ShedReason::QueueTimeout, now);
                }
            }
            while mq.in_transit.load(Ordering::Acquire) == 0 {
                let Some(head) = mq.queue.peek() else {
                    mq.yielding_since = None;
                    break;
                };
                let Some(w) = mq.waiters.get(&head) else {
                    // No one waits on it any more: drop it and look again.
                    mq.queue.cancel(head);
                    continue;
                };
                let scope = ScopeRef::new(&w.tenant, model, &w.hash_scheme);
                let backlog = snapshot
                    .tenant(&w.tenant)
                    .policy
                    .flow_control
                    .max_backlog_tokens;
                if all_saturated(
                    self.router.pressures(scope, &w.candidates, now),
                    &self.thresholds.with_backlog(backlog),
                ) {
                    // No room: nothing to leave to a peer either.
                    mq.yielding_since = None;
                    break;
                }
                if mq.queue.yields_to_peer(now) {
                    // A peer's tenant is owed this room: leave it to the peer
                    // for the grace, then take it.
                    if mq.yielding_since.is_none() {
                        self.metrics.record_peer_yield();
                        mq.yielding_since = Some(now);
                    }
                    // A clock stepped back ends the grace rather than stretch it.
                    if let Some(since) = mq.yielding_since
                        && since <= now
                        && now.since(since) < PEER_YIELD_GRACE
                    {
                        break;
                    }
                }
                mq.yielding_since = None;
                let Some(released) = mq.queue.release(now) else {
                    break;
                };
                let Some(w) = mq.waiters.remove(&released.ticket) else {
                    continue;
                };
                mq.in_transit.fetch_add(1, Ordering::AcqRel);
                let transit = Transit {
                    count: mq.in_transit.clone(),
                    wake: self.wake.clone(),
                };
                let sent = w.tx.send(Outcome::Released {
                    waited: released.waited,
                    transit,
                });
                match sent {
                    Ok(()) => self.metrics.record_released(released.waited),
                    // Its stream is gone: the Transit drops here, the next goes.
                    Err(lost) => drop(lost),
                }
            }
        }
        forget_idle(&mut queues, now);
        self.recount(&queues);
        let next_deadline = queues
            .values()
            .flat_map(|mq| {
                let grace_ends = mq.yielding_since.map(|s| s.plus(PEER_YIELD_GRACE));
                [mq.queue.next_deadline(), grace_ends]
            })
            .flatten()
            .min();
        let any_held = queues.values().any(|mq| !mq.queue.is_empty());
        drop(queues);
        any_held.then(|| {
            next_deadline
                .map(|d| d.since(now).min(TICK))
                .unwrap_or(TICK)
                .max(Duration::from_millis(1))
        })
    }

    fn shed_waiter(&self, w: Waiter, reason: ShedReason, now: Timestamp) {
        self.metrics.record_shed(reason);
        let _ = w.tx.send(Outcome::Shed(Shed {
            reason,
            retry_after_secs: w.retry_after_secs,
            waited: now.since(w.enqueued_at),
        }));
    }

    /// Refreshes the held count and the depth metric (under the lock).
    fn recount(&self, queues: &HashMap<String, ModelQueue>) {
        let total: usize = queues.values().map(|mq| mq.queue.len()).sum();
        self.held.store(total, Ordering::Release);
        self.metrics
            .set_depth(queues.values().flat_map(|mq| mq.queue.depth_by_band()));
    }

    /// Starts the pump task on the current runtime, once. Outside a runtime
    /// (synchronous tests) nothing starts: the owner calls [`Self::pump_once`].
    fn start_pump(self: &Arc<Self>) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        self.pump.get_or_init(|| {
            let weak = Arc::downgrade(self);
            let wake = self.wake.clone();
            runtime.spawn(pump(weak, wake));
        });
    }
}

/// Runs [`FlowGate::pump_once`] on every wake-up, and every [`TICK`] while
/// anything is held; ends with the gate.
async fn pump(gate: Weak<FlowGate>, wake: Arc<Notify>) {
    loop {
        let next = match gate.upgrade() {
            Some(g) => g.pump_once(Timestamp::now()),
            None => return,
        };
        match next {
            Some(wait) => {
                tokio::select! {
                    _ = wake.notified() => {}
                    _ = tokio::time::sleep(wait) => {}
                }
            }
            None => wake.notified().await,
        }
    }
}

/// A prefill's end (an engine's KV events, its queue report, a peer's fact)
/// may free room: the pump looks at once instead of at its next [`TICK`].
impl RoomWatch for FlowGate {
    fn signals_changed(&self) {
        self.nudge();
    }
}

/// Fleet sync: a peer's route is charged to its tenant's lane in the model's
/// queue, as a request this sidecar passed straight to a replica is, so a tenant
/// the peers serve waits behind the others here too. A route the peer released
/// from its queue also marks the tenant as held there: this queue leaves a
/// replica's room to it when its turn would come first (while it does, the
/// pump is woken, as the charge may have moved the turn). Nothing for a tenant
/// whose policy has flow control off (its requests never queue), nor for a
/// scope this sidecar does not know (no state for names it never serves).
impl FleetShares for FlowGate {
    fn peer_served(
        &self,
        scope: ScopeRef<'_>,
        priority: i64,
        prompt_tokens: u64,
        held: bool,
        now: Timestamp,
    ) {
        let snapshot = self.router.snapshot();
        let tenant = snapshot.tenant(scope.tenant);
        let fc = tenant.policy.flow_control;
        if !fc.enabled || !scope.is_well_formed() || self.router.index().scope(scope).is_none() {
            return;
        }
        let request = Request {
            priority,
            tenant: scope.tenant,
            fair_weight: tenant.fair_weight,
            tokens: prompt_tokens.max(1),
        };
        let mut queues = self.queues.lock();
        let Some(mq) = queue_for(&mut queues, scope.model, limits_of(&fc), now) else {
            return;
        };
        if held {
            mq.queue.charge_peer_release(request, now);
        } else {
            mq.queue.charge(request, now);
        }
        let yielding = mq.yielding_since.is_some();
        drop(queues);
        if yielding {
            self.wake.notify_one();
        }
    }
}

/// The model's queue, made when it has none (after dropping the idle ones, so
/// names seen once do not accumulate).
fn queue_for<'q>(
    queues: &'q mut HashMap<String, ModelQueue>,
    model: &str,
    limits: QueueLimits,
    now: Timestamp,
) -> Option<&'q mut ModelQueue> {
    if !queues.contains_key(model) {
        forget_idle(queues, now);
        queues.insert(
            model.to_owned(),
            ModelQueue {
                queue: FlowQueue::new(limits),
                waiters: HashMap::new(),
                in_transit: Arc::new(AtomicUsize::new(0)),
                yielding_since: None,
            },
        );
    }
    queues.get_mut(model)
}

/// The queue bounds a tenant's policy sets.
fn limits_of(fc: &FlowControl) -> QueueLimits {
    QueueLimits {
        max_queued: usize::try_from(fc.max_queued).unwrap_or(usize::MAX),
        max_wait: fc.max_queue_wait,
    }
}

/// Drops the queues with nothing held, nothing in transit and no tenant's
/// service remembered.
fn forget_idle(queues: &mut HashMap<String, ModelQueue>, now: Timestamp) {
    queues.retain(|_, mq| {
        mq.queue.prune(now);
        !mq.queue.is_forgotten() || mq.in_transit.load(Ordering::Acquire) > 0
    });
}

/// A request's cost under fair queuing: its prompt tokens as its headers (or
/// body) give them, at least 1.
fn request_tokens(fields: &RoutingFields) -> u64 {
    crate::core::flow::prompt_tokens(&fields.block_token_counts, fields.prefix_tokens)
}

#[cfg(test)]
mod tests;
