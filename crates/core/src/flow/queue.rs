//! The held-request queue: priority bands, weighted fair queuing inside a band.
//!
//! Fairness is start-time fair queuing over tokens: a request of `tokens` from a
//! tenant of weight `w` gets the start tag `max(band clock, tenant's last finish)`
//! and the finish tag `start + tokens / w`; the band releases the tenant head with
//! the smallest finish tag and advances its clock to that request's start tag. A
//! backlogged tenant of weight 3 is thus served three times the tokens of one of
//! weight 1, and a tenant idle for a while re-enters at the band clock instead of
//! claiming the service it did not use. Tenants not in `Fairness` mode share one
//! first-come, first-served lane of the band (weight 1, FIFO by arrival).
//!
//! Every request a band serves is charged to its lane, held or not: a request
//! that finds a replica with room while nothing is held, and with fleet sync
//! every request a peer sidecar routes ([`FlowQueue::charge`]), moves its
//! lane's last finish tag as if it had been enqueued and released at once. So
//! a tenant that took more than its share while the queue was empty, or
//! through other sidecars, queues behind the others here. The lead an idle lane
//! holds over the band clock halves every [`FAIRNESS_HALF_LIFE`] (service more
//! than a few seconds old no longer counts), and a lane idle for
//! [`FAIRNESS_MEMORY`] is forgotten; a band lives while it holds requests or
//! remembers a lane.
//!
//! A peer's route that its queue held first also marks the tenant as held
//! at that peer for a short window ([`FlowQueue::charge_peer_release`]):
//! while this queue holds none of that tenant's requests, the mark stands in
//! for its next one, and [`FlowQueue::yields_to_peer`] says when that would
//! come before this queue's head (the adapter then leaves the room to the
//! peer a while).
//!
//! A request removed before its turn (cancel, timeout, eviction) is refunded:
//! its tenant's later requests are retagged as if it had never been enqueued,
//! so a tenant whose requests time out under overload is charged only for what
//! it was served, and keeps its place (its head's start tag does not move up
//! to the band clock). Removal is O(tenant queue).

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::time::Duration;

use crate::policy::FlowControl;
use crate::time::Timestamp;

/// Fixed-point scale of virtual time: tags are tokens × this / weight, so a
/// weight up to this value still advances the clock on a one-token request.
const VIRTUAL_SCALE: u128 = 1 << 20;

/// How fast an idle lane's lead over its band clock fades: halved every second,
/// so fairness weighs about the last second and a half of service.
pub const FAIRNESS_HALF_LIFE: Duration = Duration::from_secs(1);

/// An empty lane untouched this long is forgotten (its lead is below 1/1000 of
/// what it was): the tenant re-enters at the band clock.
pub const FAIRNESS_MEMORY: Duration = Duration::from_secs(10);

/// The fewest releases within the last `maxQueueWait` from which the queue
/// foresees a newcomer's timeout ([`FlowQueue::foresees_timeout`]): fewer is a
/// stall or a trickle, whose pace says too little to shed on (under a 100 ms
/// wait, 8 releases is 80 a second; a transient backlog below capacity
/// releases fewer).
pub const MIN_RELEASES_TO_FORESEE: usize = 8;

/// The most priority bands a queue keeps for charges, counting those holding
/// requests (a held request always gets its band). Charges alone create bands
/// (a band per priority value clients send, and peers' routes), and without
/// anything held nothing else forgets them: at this many, a charge to a new
/// band first forgets the idle lanes (at most every [`PRUNE_INTERVAL`]) and,
/// still at it, is not remembered.
pub const MAX_REMEMBERED_BANDS: usize = 1024;

/// How often a charge at [`MAX_REMEMBERED_BANDS`] may forget idle lanes.
pub const PRUNE_INTERVAL: Duration = Duration::from_millis(100);

/// How long a request a peer sidecar released from its queue marks its tenant
/// as still held there ([`FlowQueue::charge_peer_release`]): a few of a
/// saturated fleet's release intervals.
pub const PEER_BACKLOG_WINDOW: Duration = Duration::from_millis(50);

/// The queue's bounds, from the policy's `spec.flowControl`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueueLimits {
    /// `maxQueuedRequests`: held requests across all bands and tenants.
    pub max_queued: usize,
    /// `maxQueueWait`: a request held this long is shed as `queue-timeout`.
    pub max_wait: Duration,
}

impl QueueLimits {
    /// The `retry-after` a shed request is told, in whole seconds: one queue wait,
    /// at least one second.
    pub fn retry_after_secs(&self) -> u64 {
        self.max_wait.as_secs_f64().ceil().max(1.0) as u64
    }
}

/// Why a request was shed (`x-inferencecache-shed`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ShedReason {
    /// The queue was full and the newcomer had the lowest priority.
    QueueFull,
    /// Held for `maxQueueWait` without a replica freeing.
    QueueTimeout,
    /// On arrival, at least as many requests are ahead of it as the queue
    /// released in the last `maxQueueWait`: shed at once rather than after
    /// holding it that long. Told to the client as `queue-timeout` (its wait
    /// would run out).
    ExpectedTimeout,
    /// Evicted from a full queue by a higher-priority newcomer.
    Priority,
}

impl ShedReason {
    /// The header value (`x-inferencecache-shed`).
    pub fn as_str(self) -> &'static str {
        match self {
            ShedReason::QueueFull => "queue-full",
            ShedReason::QueueTimeout | ShedReason::ExpectedTimeout => "queue-timeout",
            ShedReason::Priority => "priority",
        }
    }

    /// The metric label: as the header, but a timeout foreseen on arrival is
    /// told apart from one that happened.
    pub fn label(self) -> &'static str {
        match self {
            ShedReason::ExpectedTimeout => "expected-timeout",
            other => other.as_str(),
        }
    }
}

/// A held request's handle: the adapter keeps it to cancel or to match a release.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Ticket(u64);

/// What [`FlowQueue::enqueue`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admission {
    /// Held under this ticket.
    Held(Ticket),
    /// Held, and to make room this earlier request was evicted (shed as
    /// [`ShedReason::Priority`]).
    HeldEvicting { held: Ticket, evicted: Ticket },
    /// Not held: shed at once as [`ShedReason::QueueFull`].
    Shed,
    /// Not held: shed at once as [`ShedReason::ExpectedTimeout`]; nothing was
    /// evicted for it.
    ShedExpectedTimeout {
        /// The held requests that would have left before it.
        ahead: usize,
        /// The requests the queue released in the last `maxQueueWait`.
        released: usize,
    },
}

/// A request leaving the queue for a replica.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Held {
    pub ticket: Ticket,
    pub priority: i64,
    /// How long it was held.
    pub waited: Duration,
}

#[derive(Debug)]
struct Entry {
    ticket: Ticket,
    enqueued_at: Timestamp,
    finish: u128,
    start: u128,
    /// It started where its lane's service ended (the lane held requests and
    /// was not behind the band clock), not at the clock: removing an earlier
    /// request moves it up.
    chained: bool,
}

#[derive(Debug, Default)]
struct Lane {
    entries: VecDeque<Entry>,
    last_finish: u128,
    /// When a charge last moved `last_finish` or a release last emptied the
    /// lane (a refund leaves it as it was): an empty lane's lead over the band
    /// clock fades from then.
    touched: Timestamp,
    /// Until when a peer sidecar holds requests of this tenant (it released
    /// one from its queue within [`PEER_BACKLOG_WINDOW`]), and that request's
    /// cost: the lane's next request there, as this queue sees it.
    peer_backlog_until: Timestamp,
    peer_cost: u128,
}

impl Lane {
    /// The start tag of the lane's next request: its last finish, or the band
    /// clock when that is later. An empty lane's lead over the clock fades by
    /// half every [`FAIRNESS_HALF_LIFE`] since it was touched; a backlogged
    /// lane's does not (its requests follow one another).
    fn next_start(&self, clock: u128, now: Timestamp) -> u128 {
        if self.last_finish <= clock {
            return clock;
        }
        if !self.entries.is_empty() {
            return self.last_finish;
        }
        let lead = self.last_finish - clock;
        let halvings = now.since(self.touched).as_secs_f64() / FAIRNESS_HALF_LIFE.as_secs_f64();
        // Rounding through f64 shortens a fading lead by at most one part in 2^52.
        clock + (lead as f64 * 0.5f64.powf(halvings)) as u128
    }

    /// Charges a request of `cost` starting now; its (start, finish) tags.
    fn charge(&mut self, clock: u128, cost: u128, now: Timestamp) -> (u128, u128) {
        let start = self.next_start(clock, now);
        let finish = start + cost.max(1);
        self.last_finish = finish;
        self.touched = now;
        (start, finish)
    }

    /// Takes `ticket` out of the lane and retags the later requests as if it had
    /// never been enqueued: every later request chained after it (the lane's
    /// service, its own and any [charged](FlowQueue::charge) meanwhile, ran on
    /// from it) moves up by its cost, and so does the lane's last finish; from
    /// the first request that started at the band clock on, the tags stay.
    fn refund(&mut self, ticket: Ticket) {
        let Some(i) = self.entries.iter().position(|e| e.ticket == ticket) else {
            return;
        };
        let Some(removed) = self.entries.remove(i) else {
            return;
        };
        let cost = removed.finish - removed.start;
        let mut all_moved = true;
        for e in self.entries.iter_mut().skip(i) {
            if !e.chained {
                all_moved = false;
                break;
            }
            // A chained request starts at or after the removed one's finish.
            e.start = e.start.saturating_sub(cost);
            e.finish = e.finish.saturating_sub(cost);
        }
        if all_moved {
            self.last_finish = self.last_finish.saturating_sub(cost);
        }
    }
}

#[derive(Debug, Default)]
struct Band {
    /// Keyed by tenant under fairness; the FIFO lane is keyed by `None`.
    lanes: HashMap<Option<String>, Lane>,
    clock: u128,
    len: usize,
}

impl Request<'_> {
    /// The lane the request joins: its tenant's under fairness, else the FIFO lane.
    fn lane_key(&self) -> Option<String> {
        self.fair_weight.map(|_| self.tenant.to_owned())
    }

    /// Its cost in virtual time: tokens over weight.
    fn cost(&self) -> u128 {
        let weight = u128::from(self.fair_weight.unwrap_or(1).max(1));
        u128::from(self.tokens.max(1)) * VIRTUAL_SCALE / weight
    }
}

#[derive(Debug)]
struct Location {
    priority: i64,
    lane: Option<String>,
    deadline: Timestamp,
}

/// The held requests of one sidecar.
#[derive(Debug)]
pub struct FlowQueue {
    limits: QueueLimits,
    /// Keyed by `Reverse(priority)`: the first band is the highest.
    bands: BTreeMap<Reverse<i64>, Band>,
    where_: HashMap<Ticket, Location>,
    deadlines: BTreeSet<(Timestamp, Ticket)>,
    next_ticket: u64,
    /// When the latest releases happened, oldest first: at most
    /// `maxQueuedRequests` + 1 of them (more than can ever be ahead of a
    /// newcomer), none older than the longest `maxQueueWait`.
    releases: VecDeque<Timestamp>,
    /// Since when the queue has held requests without a break (`None`: it
    /// holds nothing).
    backlog_since: Option<Timestamp>,
    /// When [`Self::prune`] last ran.
    pruned_at: Timestamp,
}

/// One request asking to be held.
#[derive(Clone, Copy, Debug)]
pub struct Request<'a> {
    pub priority: i64,
    pub tenant: &'a str,
    /// The tenant's `spec.weight` (≥ 1) when its isolation mode is `Fairness`;
    /// `None` puts the request in its band's first-come, first-served lane.
    pub fair_weight: Option<u32>,
    /// The request's prompt tokens: its cost under fair queuing (at least 1).
    pub tokens: u64,
}

impl FlowQueue {
    pub fn new(limits: QueueLimits) -> Self {
        Self {
            limits,
            bands: BTreeMap::new(),
            where_: HashMap::new(),
            deadlines: BTreeSet::new(),
            next_ticket: 0,
            releases: VecDeque::new(),
            backlog_since: None,
            pruned_at: Timestamp(0),
        }
    }

    pub fn limits(&self) -> QueueLimits {
        self.limits
    }

    /// New bounds apply to the next enqueue and expiry; nothing held is shed by
    /// the change itself.
    pub fn set_limits(&mut self, limits: QueueLimits) {
        self.limits = limits;
    }

    pub fn len(&self) -> usize {
        self.where_.len()
    }

    pub fn is_empty(&self) -> bool {
        self.where_.is_empty()
    }

    /// Held requests per priority band, highest band first (the depth metric).
    pub fn depth_by_band(&self) -> Vec<(i64, usize)> {
        self.bands
            .iter()
            .filter(|(_, b)| b.len > 0)
            .map(|(p, b)| (p.0, b.len))
            .collect()
    }

    /// Nothing held and no lane remembered: the queue can be dropped.
    pub fn is_forgotten(&self) -> bool {
        self.bands.is_empty()
    }

    /// Charges a request served without being held here (a replica had room
    /// and nothing was queued, or a peer sidecar routed it) to its lane, as if
    /// enqueued and released at once; requests of the lane held now keep their
    /// tags, its next one starts after the charge. The band clock does not
    /// move: it follows what the queue releases.
    pub fn charge(&mut self, req: Request<'_>, now: Timestamp) {
        self.charge_lane(&req, now);
    }

    /// [`Self::charge`] for a request a peer sidecar released from its own
    /// queue: its tenant, when in `Fairness` mode, is taken to hold more there
    /// for [`PEER_BACKLOG_WINDOW`] (the peer said this one was held, not how
    /// many more are). While this queue holds none of that tenant's
    /// requests in the band, it stands in as a lane whose next request costs
    /// the same: when its turn comes first, [`Self::yields_to_peer`] says so,
    /// and the adapter leaves a replica's room to the peer a while, so the
    /// fleet's queues together serve their tenants by weight instead of each
    /// serving whatever it alone holds.
    pub fn charge_peer_release(&mut self, req: Request<'_>, now: Timestamp) {
        let cost = req.cost();
        let fair = req.fair_weight.is_some();
        if let Some(lane) = self.charge_lane(&req, now)
            && fair
        {
            lane.peer_backlog_until = now.plus(PEER_BACKLOG_WINDOW);
            lane.peer_cost = cost;
        }
    }

    fn charge_lane(&mut self, req: &Request<'_>, now: Timestamp) -> Option<&mut Lane> {
        let key = Reverse(req.priority);
        if !self.bands.contains_key(&key) && self.bands.len() >= MAX_REMEMBERED_BANDS {
            if now.since(self.pruned_at) >= PRUNE_INTERVAL {
                self.prune(now);
            }
            if self.bands.len() >= MAX_REMEMBERED_BANDS {
                return None;
            }
        }
        let band = self.bands.entry(key).or_default();
        let lane = band.lanes.entry(req.lane_key()).or_default();
        lane.charge(band.clock, req.cost(), now);
        Some(lane)
    }

    /// Forgets the empty lanes untouched for [`FAIRNESS_MEMORY`], and the bands
    /// left with neither requests nor lanes.
    pub fn prune(&mut self, now: Timestamp) {
        self.pruned_at = now;
        self.bands.retain(|_, band| {
            band.lanes.retain(|_, lane| {
                !lane.entries.is_empty() || now.since(lane.touched) < FAIRNESS_MEMORY
            });
            band.len > 0 || !band.lanes.is_empty()
        });
    }

    /// The highest band holding a request.
    fn top_band(&self) -> Option<(i64, &Band)> {
        self.bands
            .iter()
            .find(|(_, b)| b.len > 0)
            .map(|(p, b)| (p.0, b))
    }

    /// Whether the ticket is still held.
    pub fn contains(&self, ticket: Ticket) -> bool {
        self.where_.contains_key(&ticket)
    }

    /// The earliest moment a held request times out, for the adapter's timer.
    pub fn next_deadline(&self) -> Option<Timestamp> {
        self.deadlines.first().map(|(t, _)| *t)
    }

    /// Whether a request arriving now would time out held, as `(ahead,
    /// released)`: at least as many requests would leave the queue before it
    /// (every higher band, and in its own band those whose finish tag is not
    /// after the one it would get) as the queue released in the last
    /// `maxQueueWait`, so its own turn would need more releases than a whole
    /// wait brought. Foreseen only from a pace the queue
    /// has shown: it has held requests for at least the last `maxQueueWait`
    /// without a break, and released at least [`MIN_RELEASES_TO_FORESEE`] in
    /// it. A stall foresees nothing (its newcomers are held and time out as
    /// before), so shedding on arrival never outlasts the pace it was based on.
    ///
    /// Requests ahead that leave early (cancelled, timed out) make it
    /// pessimistic; later arrivals that overtake it (a higher band, a tenant
    /// under its share) optimistic. Under sustained overload the queue settles
    /// where what it holds is what it releases within `maxQueueWait`.
    pub fn foresees_timeout(&self, req: &Request<'_>, now: Timestamp) -> Option<(usize, usize)> {
        let since = self.backlog_since?;
        let window = self.limits.max_wait;
        if now.since(since) < window {
            return None;
        }
        let released = self
            .releases
            .iter()
            .rev()
            .take_while(|&&t| now.since(t) <= window)
            .count();
        if released < MIN_RELEASES_TO_FORESEE {
            return None;
        }
        let ahead = self.ahead_of(req, now);
        (ahead >= released).then_some((ahead, released))
    }

    /// The held requests [`Self::release`] would hand out before `req` if it
    /// were enqueued now and nothing else arrived.
    fn ahead_of(&self, req: &Request<'_>, now: Timestamp) -> usize {
        let mut ahead = 0;
        for (&Reverse(priority), band) in &self.bands {
            if priority > req.priority {
                ahead += band.len;
                continue;
            }
            if priority == req.priority {
                let start = band
                    .lanes
                    .get(&req.lane_key())
                    .map_or(band.clock, |l| l.next_start(band.clock, now));
                let finish = start + req.cost().max(1);
                // Ties go to the earlier ticket: every held one.
                ahead += band
                    .lanes
                    .values()
                    .flat_map(|l| l.entries.iter())
                    .filter(|e| e.finish <= finish)
                    .count();
            }
            break;
        }
        ahead
    }

    /// Holds a request, or sheds it or a lower-priority one when full; sheds
    /// it at once when the queue [foresees](Self::foresees_timeout) its timeout.
    pub fn enqueue(&mut self, req: Request<'_>, now: Timestamp) -> Admission {
        if let Some((ahead, released)) = self.foresees_timeout(&req, now) {
            return Admission::ShedExpectedTimeout { ahead, released };
        }
        let mut evicted = None;
        if self.where_.len() >= self.limits.max_queued {
            let lowest = self
                .bands
                .iter()
                .rev()
                .find(|(_, b)| b.len > 0)
                .map(|(p, _)| p.0);
            match lowest {
                Some(low) if low < req.priority => {
                    evicted = self.evict_newest_of(low);
                    if evicted.is_none() {
                        return Admission::Shed;
                    }
                }
                _ => return Admission::Shed,
            }
        }
        let ticket = Ticket(self.next_ticket);
        self.next_ticket += 1;
        let band = self.bands.entry(Reverse(req.priority)).or_default();
        let lane_key = req.lane_key();
        let lane = band.lanes.entry(lane_key.clone()).or_default();
        let ran_on_from = (!lane.entries.is_empty()).then_some(lane.last_finish);
        let (start, finish) = lane.charge(band.clock, req.cost(), now);
        lane.entries.push_back(Entry {
            ticket,
            enqueued_at: now,
            finish,
            start,
            chained: ran_on_from == Some(start),
        });
        band.len += 1;
        self.backlog_since.get_or_insert(now);
        let deadline = now.plus(self.limits.max_wait);
        self.deadlines.insert((deadline, ticket));
        self.where_.insert(
            ticket,
            Location {
                priority: req.priority,
                lane: lane_key,
                deadline,
            },
        );
        match evicted {
            Some(evicted) => Admission::HeldEvicting {
                held: ticket,
                evicted,
            },
            None => Admission::Held(ticket),
        }
    }

    /// The ticket [`Self::release`] would hand out next, left in the queue: the
    /// adapter checks the head's replicas have room before releasing it.
    pub fn peek(&self) -> Option<Ticket> {
        let (_, band) = self.top_band()?;
        band.lanes
            .values()
            .filter_map(|lane| lane.entries.front().map(|e| (e.finish, e.ticket)))
            .min()
            .map(|(_, ticket)| ticket)
    }

    /// Whether the next release is a peer's: in the highest band holding
    /// requests, a tenant that a peer sidecar holds and this queue does not
    /// ([`Self::charge_peer_release`]) would finish its next request before
    /// this queue's head.
    pub fn yields_to_peer(&self, now: Timestamp) -> bool {
        let Some((_, band)) = self.top_band() else {
            return false;
        };
        let Some(head) = band
            .lanes
            .values()
            .filter_map(|lane| lane.entries.front().map(|e| e.finish))
            .min()
        else {
            return false;
        };
        band.lanes.values().any(|lane| {
            lane.entries.is_empty()
                && lane.peer_backlog_until > now
                && lane.next_start(band.clock, now) + lane.peer_cost.max(1) < head
        })
    }

    /// The next request to release to a replica: highest band, then the smallest
    /// finish tag among its lanes' heads (arrival order breaks ties). It does
    /// not consult [`Self::yields_to_peer`]: whether to leave the room to a
    /// peer is the caller's call.
    pub fn release(&mut self, now: Timestamp) -> Option<Held> {
        let (&Reverse(priority), band) = self.bands.iter_mut().find(|(_, b)| b.len > 0)?;
        let (key, _) = band
            .lanes
            .iter()
            .filter_map(|(k, lane)| lane.entries.front().map(|e| (k, (e.finish, e.ticket))))
            .min_by_key(|(_, tag)| *tag)?;
        let key = key.clone();
        let lane = band.lanes.get_mut(&key)?;
        let entry = lane.entries.pop_front()?;
        if lane.entries.is_empty() {
            lane.touched = now;
        }
        band.clock = band.clock.max(entry.start);
        self.forget(entry.ticket, priority);
        self.note_release(now);
        Some(Held {
            ticket: entry.ticket,
            priority,
            waited: now.since(entry.enqueued_at),
        })
    }

    /// Removes a request whose client went away; false when it was not held.
    pub fn cancel(&mut self, ticket: Ticket) -> bool {
        let Some(loc) = self.where_.get(&ticket) else {
            return false;
        };
        let (priority, key) = (loc.priority, loc.lane.clone());
        if let Some(lane) = self
            .bands
            .get_mut(&Reverse(priority))
            .and_then(|b| b.lanes.get_mut(&key))
        {
            lane.refund(ticket);
        }
        self.forget(ticket, priority);
        true
    }

    /// Removes and returns every request held `maxQueueWait` or longer (shed as
    /// [`ShedReason::QueueTimeout`]), oldest first.
    pub fn expire(&mut self, now: Timestamp) -> Vec<Ticket> {
        let due: Vec<Ticket> = self
            .deadlines
            .iter()
            .take_while(|(d, _)| *d <= now)
            .map(|(_, t)| *t)
            .collect();
        for t in &due {
            self.cancel(*t);
        }
        due
    }

    /// The newest entry of the band, removed; `None` when the band is empty.
    fn evict_newest_of(&mut self, priority: i64) -> Option<Ticket> {
        let band = self.bands.get(&Reverse(priority))?;
        let newest = band
            .lanes
            .values()
            .filter_map(|l| l.entries.back().map(|e| e.ticket))
            .max()?;
        self.cancel(newest);
        Some(newest)
    }

    /// Remembers a release for [`Self::foresees_timeout`]: no more than can
    /// matter (more than `maxQueuedRequests` is more than can ever be ahead;
    /// older than the longest `maxQueueWait` is outside every window).
    fn note_release(&mut self, now: Timestamp) {
        self.releases.push_back(now);
        let keep = self.limits.max_queued.saturating_add(1);
        while self.releases.len() > keep
            || self
                .releases
                .front()
                .is_some_and(|&t| now.since(t) > FlowControl::MAX_QUEUE_WAIT)
        {
            self.releases.pop_front();
        }
    }

    /// Drops the bookkeeping of a request already taken out of its lane. An
    /// emptied band keeps its clock and lanes until [`Self::prune`] forgets
    /// them, so a tenant that empties and refills is still charged.
    fn forget(&mut self, ticket: Ticket, priority: i64) {
        if let Some(loc) = self.where_.remove(&ticket) {
            self.deadlines.remove(&(loc.deadline, ticket));
        }
        if self.where_.is_empty() {
            self.backlog_since = None;
        }
        if let Some(band) = self.bands.get_mut(&Reverse(priority)) {
            band.len = band.len.saturating_sub(1);
        }
    }
}

#[cfg(test)]
mod tests;
