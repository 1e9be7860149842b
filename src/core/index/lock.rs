//! The store's lock: a read-write lock where lookups go first.
//!
//! Lookups hold the read lock for about a microsecond; writers hold the write
//! lock for one small batch at a time. With a plain writer-preferring lock, a
//! writer streaming events re-takes the lock right after releasing it, and a
//! lookup that arrived meanwhile parks and pays a futex wake-up (tens of µs).
//! Here a writer about to take the lock first lets any waiting lookup in, for at
//! most [`MAX_YIELD`], so a lookup waits at most for one write batch, while a
//! storm of lookups can only delay a writer, never starve it.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{RwLock, RwLockReadGuard, RwLockWriteGuard};

/// The longest a writer defers to waiting readers before each batch.
const MAX_YIELD: Duration = Duration::from_micros(50);

/// The longest a reader spins before it blocks (and may be parked).
const MAX_SPIN: Duration = Duration::from_micros(20);

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

    pub fn write(&self) -> RwLockWriteGuard<'_, T> {
        if self.waiting.load(Ordering::Acquire) > 0 {
            let start = Instant::now();
            let mut spins = 0u32;
            while self.waiting.load(Ordering::Acquire) > 0 && start.elapsed() < MAX_YIELD {
                spins += 1;
                if spins.is_multiple_of(64) {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
            }
        }
        self.lock.write()
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
