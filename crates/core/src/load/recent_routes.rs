//! How many requests this sidecar routed to a replica lately: a count that halves
//! every [`HALF_LIFE`], read by the load rule's share bound
//! (`decision/bounded_load.rs`).
//!
//! The in-flight count sees only the requests of the last few milliseconds, so a
//! hot prefix can keep coming back to its holders in bursts that each fit the
//! bound, and over a minute one replica serves twice its share. A decayed count
//! remembers those bursts. Each sidecar counts what it routed itself at once,
//! and what other sidecars routed there when a scrape of the engine shows it
//! (`fleet_routes.rs`): the bound's gate and slack are absolute numbers, so
//! two sidecars each balancing only their own half would let a replica take
//! more than one sidecar balancing the whole.
//!
//! One atomic word per replica, so the decision reads no lock: the time of the
//! last update (milliseconds, low 32 bits, wrapping) and the count (in 1/1024ths,
//! saturating at about four million).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The count's half-life: long enough to remember the bursts of a hot prefix,
/// short enough to follow a fleet whose traffic mix changes within a minute.
pub const HALF_LIFE: Duration = Duration::from_secs(10);

const UNIT: f64 = 1024.0;
/// An update stamped at most this far ahead of a reader's clock (threads read
/// the clock in a different order than they update) counts as no time passed;
/// further means the stamp wrapped (~49 days) and the count is long gone.
const SKEW_MS: u32 = 60_000;

/// A replica's recently routed requests.
#[derive(Debug, Default)]
pub struct RecentRoutes(AtomicU64);

impl RecentRoutes {
    /// Counts one routed request at `now_ns`.
    pub fn note(&self, now_ns: u64) {
        self.note_many(1, now_ns);
    }

    /// Counts `n` requests at `now_ns` (other sidecars' requests, seen in a
    /// scrape of the engine: `fleet_routes.rs`).
    pub fn note_many(&self, n: u64, now_ns: u64) {
        let now = millis(now_ns);
        let _ = self
            .0
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |packed| {
                let (at, _) = unpack(packed);
                let stamp = if ahead(at, now) { at } else { now };
                Some(pack(stamp, decayed(packed, now) + n as f64))
            });
    }

    /// Forgets every request counted so far.
    pub fn reset(&self) {
        self.0.store(0, Ordering::Relaxed);
    }

    /// The decayed count at `now_ns`.
    pub fn at(&self, now_ns: u64) -> f64 {
        decayed(self.0.load(Ordering::Relaxed), millis(now_ns))
    }
}

fn millis(ns: u64) -> u32 {
    // Wrapping by design: only differences of stamps are used.
    (ns / 1_000_000) as u32
}

fn unpack(packed: u64) -> (u32, f64) {
    ((packed >> 32) as u32, (packed & 0xffff_ffff) as f64 / UNIT)
}

fn pack(at: u32, count: f64) -> u64 {
    let units = (count * UNIT).clamp(0.0, f64::from(u32::MAX)) as u64;
    (u64::from(at) << 32) | units
}

/// `at` is (slightly) later than `now`.
fn ahead(at: u32, now: u32) -> bool {
    let back = now.wrapping_sub(at);
    back != 0 && back > u32::MAX - SKEW_MS
}

fn decayed(packed: u64, now: u32) -> f64 {
    let (at, count) = unpack(packed);
    if count == 0.0 || ahead(at, now) {
        return count;
    }
    let elapsed = f64::from(now.wrapping_sub(at));
    count * (-elapsed / HALF_LIFE.as_millis() as f64).exp2()
}

#[cfg(test)]
mod tests;
