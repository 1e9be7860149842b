//! The store's lock: a read-write lock where lookups go first.
//!
//! Lookups hold the read lock for about a microsecond; writers hold the write
//! lock for a few blocks at a time. A plain read-write lock lets a writer queue
//! while lookups are inside: from then on new lookups are shut out until the
//! writer has had its turn, and a writer that parked meanwhile costs the last
//! lookup out a futex wake-up. Here a writer never queues while it can help it:
//! it takes the lock only when nobody holds it and no lookup is waiting for it,
//! and while holding it, it lets go as soon as a lookup starts waiting
//! ([`ReaderFirst::readers_waiting`]). So a lookup waits at most for the block a
//! writer is in the middle of. A writer that found no opening for [`MAX_YIELD`]
//! queues like on a plain lock and then keeps its turn for a whole batch, so a
//! storm of lookups delays writers but never starves them.
//!
//! A writer waiting for an opening spins; it never calls `sched_yield`. On a
//! busy core a yield hands the CPU to whatever else is runnable there for the
//! rest of a scheduler slice: measured 3.8–3.9 ms per yield in the `kv_events`
//! bench (the lookup loop on the same core), far past `MAX_YIELD`, and the
//! cause of that bench's millisecond publish → visible p99.
//!
//! The algorithm is written once over [`Primitives`] (a read-write lock, a
//! counter and a notion of patience): production runs it on parking_lot and the
//! clock; `lock/model.rs` runs the very same code on shuttle's model-checked
//! primitives, where patience is counted in attempts.

use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The lookup budget ran out before the lock could be taken for reading.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Timeout;

/// Reads that found the lock write-held, and the nanoseconds they waited for
/// it, process-wide. Counted on the slow path only, so a free lock costs
/// nothing more; the index bench prints them beside its rows, to tell lock
/// waits apart from the other ways a concurrent writer slows a lookup.
static CONTENDED_READS: AtomicU64 = AtomicU64::new(0);
static CONTENDED_READ_NANOS: AtomicU64 = AtomicU64::new(0);

/// (reads that waited, nanoseconds waited) since the process started.
pub fn contended_reads() -> (u64, u64) {
    (
        CONTENDED_READS.load(Ordering::Relaxed),
        CONTENDED_READ_NANOS.load(Ordering::Relaxed),
    )
}

fn count_wait(since: Instant) {
    CONTENDED_READS.fetch_add(1, Ordering::Relaxed);
    let nanos = u64::try_from(since.elapsed().as_nanos()).unwrap_or(u64::MAX);
    CONTENDED_READ_NANOS.fetch_add(nanos, Ordering::Relaxed);
}

/// The longest a writer waits for an opening before it queues for the lock.
const MAX_YIELD: Duration = Duration::from_micros(50);

/// The longest a reader spins before it blocks (and may be parked).
const MAX_SPIN: Duration = Duration::from_micros(20);

/// How a writer got the lock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Turn {
    /// Nobody held it and no lookup waited.
    Opening,
    /// After [`MAX_YIELD`] without an opening, like on a plain lock.
    Queued,
}

/// What the algorithm needs underneath.
pub(crate) trait Primitives {
    type Lock<T>: RawLock<T>;
    type Counter: Default;
    type Patience: Patience;
    fn add(counter: &Self::Counter, n: i32);
    fn load(counter: &Self::Counter) -> u32;
    #[cfg(test)]
    fn store(counter: &Self::Counter, n: u32);
    /// One turn of a spin loop.
    fn spin();
}

/// A read-write lock as the algorithm uses it.
pub(crate) trait RawLock<T> {
    type Read<'a>: Deref<Target = T>
    where
        Self: 'a;
    type Write<'a>: DerefMut<Target = T>
    where
        Self: 'a;
    fn new(value: T) -> Self;
    fn try_read(&self) -> Option<Self::Read<'_>>;
    fn read(&self) -> Self::Read<'_>;
    fn try_read_until(&self, deadline: Instant) -> Option<Self::Read<'_>>;
    fn try_write(&self) -> Option<Self::Write<'_>>;
    fn write(&self) -> Self::Write<'_>;
    fn is_locked(&self) -> bool;
}

/// How long to keep trying before falling back to blocking.
pub(crate) trait Patience {
    fn new(limit: Duration, deadline: Option<Instant>) -> Self;
    /// Checked every few attempts.
    fn exhausted(&mut self) -> bool;
}

/// parking_lot and the monotonic clock.
#[derive(Debug)]
pub(crate) enum Native {}

impl Primitives for Native {
    type Lock<T> = parking_lot::RwLock<T>;
    type Counter = AtomicU32;
    type Patience = Clock;
    fn add(counter: &AtomicU32, n: i32) {
        counter.fetch_add(n as u32, Ordering::AcqRel);
    }
    fn load(counter: &AtomicU32) -> u32 {
        counter.load(Ordering::Acquire)
    }
    #[cfg(test)]
    fn store(counter: &AtomicU32, n: u32) {
        counter.store(n, Ordering::Release);
    }
    fn spin() {
        std::hint::spin_loop();
    }
}

impl<T> RawLock<T> for parking_lot::RwLock<T> {
    type Read<'a>
        = parking_lot::RwLockReadGuard<'a, T>
    where
        T: 'a;
    type Write<'a>
        = parking_lot::RwLockWriteGuard<'a, T>
    where
        T: 'a;
    fn new(value: T) -> Self {
        parking_lot::RwLock::new(value)
    }
    fn try_read(&self) -> Option<Self::Read<'_>> {
        parking_lot::RwLock::try_read(self)
    }
    fn read(&self) -> Self::Read<'_> {
        parking_lot::RwLock::read(self)
    }
    fn try_read_until(&self, deadline: Instant) -> Option<Self::Read<'_>> {
        parking_lot::RwLock::try_read_until(self, deadline)
    }
    fn try_write(&self) -> Option<Self::Write<'_>> {
        parking_lot::RwLock::try_write(self)
    }
    fn write(&self) -> Self::Write<'_> {
        parking_lot::RwLock::write(self)
    }
    fn is_locked(&self) -> bool {
        parking_lot::RwLock::is_locked(self)
    }
}

/// Patience measured on the clock.
pub(crate) struct Clock {
    until: Instant,
}

impl Patience for Clock {
    fn new(limit: Duration, deadline: Option<Instant>) -> Self {
        let until = Instant::now() + limit;
        Self {
            until: deadline.map_or(until, |d| d.min(until)),
        }
    }
    fn exhausted(&mut self) -> bool {
        Instant::now() >= self.until
    }
}

/// The lock the index uses.
pub(crate) type ReaderFirst<T> = ReaderFirstOn<T, Native>;

pub(crate) struct ReaderFirstOn<T, P: Primitives> {
    lock: P::Lock<T>,
    /// Readers between asking for the lock and getting it.
    waiting: P::Counter,
}

impl<T: Default, P: Primitives> Default for ReaderFirstOn<T, P> {
    fn default() -> Self {
        Self {
            lock: P::Lock::new(T::default()),
            waiting: P::Counter::default(),
        }
    }
}

impl<T, P: Primitives> std::fmt::Debug for ReaderFirstOn<T, P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReaderFirst")
            .field("waiting", &P::load(&self.waiting))
            .finish_non_exhaustive()
    }
}

type ReadOf<'a, T, P> = <<P as Primitives>::Lock<T> as RawLock<T>>::Read<'a>;
type WriteOf<'a, T, P> = <<P as Primitives>::Lock<T> as RawLock<T>>::Write<'a>;

impl<T, P: Primitives> ReaderFirstOn<T, P> {
    pub fn read(&self) -> ReadOf<'_, T, P> {
        if let Some(guard) = self.lock.try_read() {
            return guard;
        }
        let since = Instant::now();
        P::add(&self.waiting, 1);
        let guard = match self.spin_read(P::Patience::new(MAX_SPIN, None)) {
            Some(guard) => guard,
            None => self.lock.read(),
        };
        P::add(&self.waiting, -1);
        count_wait(since);
        guard
    }

    /// A read lock, or `None` once `deadline` has passed.
    pub fn try_read_until(&self, deadline: Instant) -> Option<ReadOf<'_, T, P>> {
        if let Some(guard) = self.lock.try_read() {
            return Some(guard);
        }
        let since = Instant::now();
        P::add(&self.waiting, 1);
        let guard = self
            .spin_read(P::Patience::new(MAX_SPIN, Some(deadline)))
            .or_else(|| self.lock.try_read_until(deadline));
        P::add(&self.waiting, -1);
        count_wait(since);
        guard
    }

    /// Spins for the lock until patience runs out: a writer releases it within
    /// one batch, far sooner than a parked thread would be woken.
    fn spin_read(&self, mut patience: P::Patience) -> Option<ReadOf<'_, T, P>> {
        let mut spins = 0u32;
        loop {
            if let Some(guard) = self.lock.try_read() {
                return Some(guard);
            }
            spins += 1;
            if spins.is_multiple_of(32) && patience.exhausted() {
                return None;
            }
            P::spin();
        }
    }

    /// The write lock, taken in an opening between lookups (see the module docs).
    pub fn write(&self) -> WriteOf<'_, T, P> {
        self.write_in_turn().0
    }

    /// The write lock, and whether it came in an opening or by queuing. A writer
    /// that had to queue has waited long enough: it should finish its batch
    /// rather than let go for the lookups that queued behind it.
    pub fn write_in_turn(&self) -> (WriteOf<'_, T, P>, Turn) {
        if let Some(guard) = self.try_write_in_opening() {
            return (guard, Turn::Opening);
        }
        let mut patience = P::Patience::new(MAX_YIELD, None);
        let mut spins = 0u32;
        loop {
            if let Some(guard) = self.try_write_in_opening() {
                return (guard, Turn::Opening);
            }
            spins += 1;
            if spins.is_multiple_of(64) && patience.exhausted() {
                return (self.lock.write(), Turn::Queued);
            }
            P::spin();
        }
    }

    /// The write lock if nobody holds it and no lookup waits for it. Never
    /// queues: a failed attempt leaves the lock as it found it, so lookups
    /// keep getting in. The checks are plain loads, so polling does not take
    /// the lock's cache line away from the readers holding it.
    fn try_write_in_opening(&self) -> Option<WriteOf<'_, T, P>> {
        if P::load(&self.waiting) > 0 || self.lock.is_locked() {
            return None;
        }
        self.lock.try_write()
    }

    /// Whether a lookup is waiting for the lock: a writer holding it should let
    /// go at its next step.
    pub fn readers_waiting(&self) -> bool {
        P::load(&self.waiting) > 0
    }

    /// Test hook: pretends `n` lookups are waiting.
    #[cfg(test)]
    pub fn set_waiting(&self, n: u32) {
        P::store(&self.waiting, n);
    }
}

#[cfg(test)]
mod model;

#[cfg(test)]
mod tests;
