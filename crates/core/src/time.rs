//! Wall-clock timestamps as the core sees them.
//!
//! The core never reads the clock for policy time (TTL, lastSeen): callers pass
//! `now`, so tests can step time. Nanoseconds since the UNIX epoch in a `u64` last
//! until the year 2554 and let the index hand out strictly increasing stamps.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Nanoseconds since the UNIX epoch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timestamp(pub u64);

impl Timestamp {
    /// The system clock, for adapters. The core itself never calls this.
    pub fn now() -> Self {
        let d = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or(Duration::ZERO);
        Self(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
    }

    pub fn from_secs(secs: u64) -> Self {
        Self(secs.saturating_mul(1_000_000_000))
    }

    pub fn from_millis(ms: u64) -> Self {
        Self(ms.saturating_mul(1_000_000))
    }

    pub fn as_nanos(self) -> u64 {
        self.0
    }

    /// Time elapsed from `earlier` to `self`; zero when `earlier` is later.
    pub fn since(self, earlier: Timestamp) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }

    pub fn plus(self, d: Duration) -> Self {
        Self(
            self.0
                .saturating_add(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)),
        )
    }

    /// RFC 3339 with millisecond precision, UTC, for `/snapshot` and status.
    pub fn to_rfc3339(self) -> String {
        let secs = i64::try_from(self.0 / 1_000_000_000).unwrap_or(i64::MAX);
        let nanos = i32::try_from(self.0 % 1_000_000_000).unwrap_or(0);
        match jiff::Timestamp::new(secs, nanos) {
            Ok(ts) => format!("{ts:.3}"),
            Err(_) => String::from("1970-01-01T00:00:00Z"),
        }
    }
}

#[cfg(test)]
mod tests;
