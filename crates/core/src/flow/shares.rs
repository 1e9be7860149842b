//! Tenant shares of what a model's replicas served lately: weighted max-min
//! fairness for `Fairness` tenants under overload.
//!
//! Fair queuing orders what is held, but it cannot give a tenant more than it
//! has in the queue: releases come in bursts (a batch of prefills ends, every
//! replica frees at once) and a burst that empties the queue, or a request that
//! finds a replica with room and is not held at all, is served in arrival order.
//! Two tenants flooding at the same rate would then share the replicas about
//! equally whatever their weights.
//!
//! So the service itself is counted: the prompt tokens each tenant had sent to
//! the model's replicas over the last [`WINDOW`]. A tenant whose service per
//! unit of weight is more than [`SLACK`] above that of another tenant that was
//! shed within the window (so it wanted more than it got) is over its share: its
//! newcomer is shed at once. Tenants that all get what they ask, or that are
//! alone, are never held back here; between tenants that are all shed, service
//! per weight evens out, so they share by their weights.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use crate::time::Timestamp;

/// How far back service and sheds are counted.
pub const WINDOW: Duration = Duration::from_secs(1);

/// How far (per cent) a tenant's service per weight may run above a shed
/// tenant's before its newcomers are shed: room for the burst in progress.
pub const SLACK_PERCENT: u128 = 10;

#[derive(Debug, Default)]
struct Tenant {
    weight: u32,
    /// (when, tokens) of each request sent, oldest first, within [`WINDOW`].
    served: VecDeque<(Timestamp, u64)>,
    served_tokens: u64,
    last_shed: Option<Timestamp>,
}

impl Tenant {
    fn prune(&mut self, now: Timestamp) {
        while let Some(&(at, tokens)) = self.served.front() {
            if now.since(at) <= WINDOW {
                break;
            }
            self.served.pop_front();
            self.served_tokens = self.served_tokens.saturating_sub(tokens);
        }
    }

    fn shed_lately(&self, now: Timestamp) -> bool {
        self.last_shed.is_some_and(|at| now.since(at) <= WINDOW)
    }

    fn is_idle(&self, now: Timestamp) -> bool {
        self.served.is_empty() && !self.shed_lately(now)
    }
}

/// The `Fairness` tenants of one model and what each was served lately.
#[derive(Debug, Default)]
pub struct Shares {
    tenants: HashMap<String, Tenant>,
}

impl Shares {
    pub fn new() -> Self {
        Self::default()
    }

    fn tenant(&mut self, tenant: &str, weight: u32) -> &mut Tenant {
        let t = self.tenants.entry(tenant.to_owned()).or_default();
        t.weight = weight.max(1);
        t
    }

    /// A request of `tokens` prompt tokens went to a replica (passed or released).
    pub fn served(&mut self, tenant: &str, weight: u32, tokens: u64, now: Timestamp) {
        let t = self.tenant(tenant, weight);
        t.prune(now);
        t.served.push_back((now, tokens));
        t.served_tokens = t.served_tokens.saturating_add(tokens);
    }

    /// A request of the tenant was shed (any reason): it wants more than it gets.
    pub fn shed(&mut self, tenant: &str, weight: u32, now: Timestamp) {
        self.tenant(tenant, weight).last_shed = Some(now);
    }

    /// Whether the tenant is over its share: its service per weight exceeds, by
    /// more than [`SLACK_PERCENT`], that of another tenant shed within the
    /// window. (Service before the newcomer: two tenants cannot both be over
    /// each other's, so some tenant always goes.)
    pub fn over_share(&mut self, tenant: &str, weight: u32, now: Timestamp) -> bool {
        let weight = u128::from(weight.max(1));
        let own = match self.tenants.get_mut(tenant) {
            Some(t) => {
                t.prune(now);
                t.served_tokens
            }
            None => 0,
        };
        let own = u128::from(own);
        self.tenants.iter_mut().any(|(name, other)| {
            if name == tenant || !other.shed_lately(now) {
                return false;
            }
            other.prune(now);
            let theirs = u128::from(other.served_tokens);
            // own / weight > (1 + slack) × theirs / their weight, without dividing.
            own * u128::from(other.weight.max(1)) * 100 > theirs * weight * (100 + SLACK_PERCENT)
        })
    }

    /// Forgets tenants with nothing served or shed within the window; true when
    /// none is left.
    pub fn forget_idle(&mut self, now: Timestamp) -> bool {
        self.tenants.retain(|_, t| {
            t.prune(now);
            !t.is_idle(now)
        });
        self.tenants.is_empty()
    }
}

#[cfg(test)]
mod tests;
