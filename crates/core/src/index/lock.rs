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

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{RwLock, RwLockReadGuard, RwLockWriteGuard};

/// The lookup budget ran out before the lock could be taken for reading.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Timeout;

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

#[derive(Debug, Default)]
pub(crate) struct ReaderFirst<T> {
    lock: RwLock<T>,
    /// Readers between asking for the lock and getting it.
    waiting: AtomicU32,
}

impl<T> ReaderFirst<T> {
    pub fn read(&self) -> RwLockReadGuard<'_, T> {
        if let Some(guard) = self.lock.try_read() {
            return guard;
        }
        self.waiting.fetch_add(1, Ordering::AcqRel);
        let guard = match self.spin_read(Instant::now() + MAX_SPIN) {
            Some(guard) => guard,
            None => self.lock.read(),
        };
        self.waiting.fetch_sub(1, Ordering::AcqRel);
        guard
    }

    /// A read lock, or `None` once `deadline` has passed.
    pub fn try_read_until(&self, deadline: Instant) -> Option<RwLockReadGuard<'_, T>> {
        if let Some(guard) = self.lock.try_read() {
            return Some(guard);
        }
        self.waiting.fetch_add(1, Ordering::AcqRel);
        let guard = self
            .spin_read(deadline.min(Instant::now() + MAX_SPIN))
            .or_else(|| self.lock.try_read_until(deadline));
        self.waiting.fetch_sub(1, Ordering::AcqRel);
        guard
    }

    /// Spins for the lock until `until`: a writer releases it within one batch,
    /// far sooner than a parked thread would be woken.
    fn spin_read(&self, until: Instant) -> Option<RwLockReadGuard<'_, T>> {
        let mut spins = 0u32;
        loop {
            if let Some(guard) = self.lock.try_read() {
                return Some(guard);
            }
            spins += 1;
            if spins.is_multiple_of(32) && Instant::now() >= until {
                return None;
            }
            std::hint::spin_loop();
        }
    }

    /// The write lock, taken in an opening between lookups (see the module docs).
    pub fn write(&self) -> RwLockWriteGuard<'_, T> {
        self.write_in_turn().0
    }

    /// The write lock, and whether it came in an opening or by queuing. A writer
    /// that had to queue has waited long enough: it should finish its batch
    /// rather than let go for the lookups that queued behind it.
    pub fn write_in_turn(&self) -> (RwLockWriteGuard<'_, T>, Turn) {
        if let Some(guard) = self.try_write_in_opening() {
            return (guard, Turn::Opening);
        }
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            if let Some(guard) = self.try_write_in_opening() {
                return (guard, Turn::Opening);
            }
            spins += 1;
            if spins.is_multiple_of(64) {
                if start.elapsed() >= MAX_YIELD {
                    return (self.lock.write(), Turn::Queued);
                }
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }

    /// The write lock if nobody holds it and no lookup waits for it. Never
    /// queues: a failed attempt leaves the lock as it found it, so lookups
    /// keep getting in. The checks are plain loads, so polling does not take
    /// the lock's cache line away from the readers holding it.
    fn try_write_in_opening(&self) -> Option<RwLockWriteGuard<'_, T>> {
        if self.waiting.load(Ordering::Acquire) > 0 || self.lock.is_locked() {
            return None;
        }
        self.lock.try_write()
    }

    /// Whether a lookup is waiting for the lock: a writer holding it should let
    /// go at its next step.
    pub fn readers_waiting(&self) -> bool {
        self.waiting.load(Ordering::Relaxed) > 0
    }

    /// Test hook: pretends `n` lookups are waiting.
    #[cfg(test)]
    pub fn set_waiting(&self, n: u32) {
        self.waiting.store(n, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_writer_never_starves_behind_waiting_readers() {
        let lock = Arc::new(ReaderFirst::<u32>::default());
        // A reader that asked and never got in (simulated) delays a writer at most
        // MAX_YIELD.
        lock.waiting.fetch_add(1, Ordering::AcqRel);
        let start = Instant::now();
        *lock.write() += 1;
        assert!(start.elapsed() < Duration::from_secs(1));
        assert_eq!(*lock.read(), 1);
    }

    #[test]
    fn a_writer_takes_the_lock_only_in_an_opening() {
        let lock = ReaderFirst::<u32>::default();
        // Free: taken at once.
        assert!(lock.try_write_in_opening().is_some());
        assert_eq!(lock.write_in_turn().1, Turn::Opening);
        // A lookup inside: the writer does not queue, so more lookups get in.
        let inside = lock.read();
        assert!(lock.try_write_in_opening().is_none());
        assert!(lock.lock.try_read().is_some());
        drop(inside);
        // A lookup waiting: the writer leaves the opening to it, and a holder
        // is told to let go.
        lock.waiting.fetch_add(1, Ordering::AcqRel);
        assert!(lock.readers_waiting());
        assert!(lock.try_write_in_opening().is_none());
        lock.waiting.fetch_sub(1, Ordering::AcqRel);
        assert!(!lock.readers_waiting());
        assert!(lock.try_write_in_opening().is_some());
    }

    #[test]
    fn a_writer_queues_after_waiting_for_an_opening_too_long() {
        let lock = Arc::new(ReaderFirst::<u32>::default());
        let held = lock.lock.read();
        let writer = {
            let lock = lock.clone();
            std::thread::spawn(move || {
                let (mut guard, turn) = lock.write_in_turn();
                *guard += 1;
                turn
            })
        };
        // Once the writer has queued, new readers are held back until it is done.
        let start = Instant::now();
        while lock.lock.try_read().is_some() {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "writer never queued"
            );
            std::thread::sleep(Duration::from_micros(50));
        }
        drop(held);
        assert_eq!(writer.join().expect("writer"), Turn::Queued);
        assert_eq!(*lock.read(), 1);
    }

    #[test]
    fn readers_and_writers_make_progress_together() {
        let lock = Arc::new(ReaderFirst::<u64>::default());
        let writer = {
            let lock = lock.clone();
            std::thread::spawn(move || {
                for _ in 0..10_000 {
                    *lock.write() += 1;
                }
            })
        };
        let mut last = 0;
        for _ in 0..10_000 {
            let v = *lock.read();
            assert!(v >= last, "a read went back in time");
            last = v;
        }
        writer.join().expect("writer");
        assert_eq!(*lock.read(), 10_000);
        assert_eq!(lock.waiting.load(Ordering::Acquire), 0);
    }
}
