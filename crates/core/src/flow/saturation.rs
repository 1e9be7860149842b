//! When is the fleet above capacity: the predicate that turns flow control on.
//!
//! A replica is saturated when any of three bounds is reached:
//!
//! - **prefill backlog**: the uncached prompt tokens this fleet sent it whose
//!   prefill has not ended (as its live KV events show) reach
//!   `max_backlog_tokens`. This is the bound that
//!   engages first under load: it measures queued *work*, so a few long prompts
//!   count as much as many short ones, and it is known the moment a request is
//!   routed, not a scrape later;
//! - **waiting requests**: the engine's own waiting count plus what this fleet
//!   sent it since that report and still prefilling reaches `max_waiting`
//!   (traffic from outside the fleet shows only here). A request whose prefill
//!   ended (the engine's event stored its last block) is decoding, not waiting:
//!   it leaves the count at once, so held requests go as fast as the engine
//!   takes them, not in a burst after each report;
//! - **KV cache**: nearly full (`kv_usage_limit`) while anything waits there (a
//!   full cache with nothing waiting is a warm cache, not a busy one).
//!
//! Flow control holds a request only when every eligible replica is saturated:
//! one replica with room means the decision sends it there as always.

/// The load of one eligible replica, as the adapter reads it from the core's
/// load signals.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Pressure {
    /// The engine's last reported waiting count (0 when it never reported).
    pub engine_waiting: u64,
    /// Requests this fleet routed there since that report whose prefill has not
    /// ended (0 when the engine does not report: requests in flight may be
    /// decoding).
    pub sent_since_report: u64,
    /// The engine's KV cache usage 0..1, when reported.
    pub kv_usage: Option<f64>,
    /// Uncached prompt tokens the fleet routed there whose prefill has not ended
    /// (0 unless the replica's KV events are live, which show a prefill end).
    pub backlog_tokens: u64,
}

/// The saturation thresholds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Thresholds {
    pub max_waiting: u64,
    pub kv_usage_limit: f64,
    /// The prefill backlog bound, tokens; 0 leaves it out.
    pub max_backlog_tokens: u64,
}

impl Thresholds {
    /// The defaults with the policy's prefill backlog bound
    /// (`spec.flowControl.maxPrefillBacklogTokens`).
    pub fn with_backlog(self, max_backlog_tokens: u64) -> Self {
        Self {
            max_backlog_tokens,
            ..self
        }
    }
}

impl Default for Thresholds {
    fn default() -> Self {
        Self {
            max_waiting: 8,
            kv_usage_limit: 0.95,
            max_backlog_tokens: crate::policy::FlowControl::DEFAULT_MAX_BACKLOG_TOKENS,
        }
    }
}

impl Pressure {
    pub fn waiting(&self) -> u64 {
        self.engine_waiting.saturating_add(self.sent_since_report)
    }

    pub fn is_saturated(&self, t: &Thresholds) -> bool {
        let waiting = self.waiting();
        waiting >= t.max_waiting
            || (t.max_backlog_tokens > 0 && self.backlog_tokens >= t.max_backlog_tokens)
            || (waiting > 0 && self.kv_usage.is_some_and(|u| u >= t.kv_usage_limit))
    }
}

/// Every eligible replica is saturated. An empty set is not saturation: with no
/// eligible replica there is nothing to wait for, and the caller's own "no
/// replica" answer applies.
pub fn all_saturated<I>(replicas: I, t: &Thresholds) -> bool
where
    I: IntoIterator<Item = Pressure>,
{
    let mut any = false;
    for p in replicas {
        if !p.is_saturated(t) {
            return false;
        }
        any = true;
    }
    any
}

#[cfg(test)]
mod tests;
