//! `ReaderFirst` model-checked with shuttle: the production algorithm, run on
//! shuttle's lock and atomics (every access a scheduling point), with patience
//! counted in attempts instead of microseconds. Shuttle explores many thread
//! interleavings (random and PCT schedulers) and fails on a deadlock, a panic in
//! any thread, or a run that never ends; the tests add the invariants: writers
//! exclude everyone, a reader never sees a half-written value, every waiting
//! reader is uncounted when it gets in, and everyone finishes.

use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::time::{Duration, Instant};

use shuttle::sync::atomic::{AtomicI32, AtomicU32, Ordering};
use shuttle::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use super::{Patience, Primitives, RawLock, ReaderFirstOn, Turn};

enum Model {}

impl Primitives for Model {
    type Lock<T> = ModelLock<T>;
    type Counter = AtomicU32;
    type Patience = Attempts;
    fn add(counter: &AtomicU32, n: i32) {
        counter.fetch_add(n as u32, Ordering::AcqRel);
    }
    fn load(counter: &AtomicU32) -> u32 {
        counter.load(Ordering::Acquire)
    }
    fn store(counter: &AtomicU32, n: u32) {
        counter.store(n, Ordering::Release);
    }
    fn spin() {
        shuttle::thread::yield_now();
    }
}

/// Gives up after two checks, so both the spin and the queue paths are taken.
struct Attempts(u32);

impl Patience for Attempts {
    fn new(_: Duration, _: Option<Instant>) -> Self {
        Self(2)
    }
    fn exhausted(&mut self) -> bool {
        self.0 = self.0.saturating_sub(1);
        self.0 == 0
    }
}

/// shuttle's lock plus a holder count for `is_locked` (a hint in production too).
struct ModelLock<T> {
    lock: RwLock<T>,
    /// Readers inside, or -1 for a writer.
    state: AtomicI32,
}

struct Read<'a, T> {
    guard: RwLockReadGuard<'a, T>,
    state: &'a AtomicI32,
}

struct Write<'a, T> {
    guard: RwLockWriteGuard<'a, T>,
    state: &'a AtomicI32,
}

impl<T> Deref for Read<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.guard
    }
}

impl<T> Drop for Read<'_, T> {
    fn drop(&mut self) {
        self.state.fetch_sub(1, Ordering::AcqRel);
    }
}

impl<T> Deref for Write<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.guard
    }
}

impl<T> DerefMut for Write<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.guard
    }
}

impl<T> Drop for Write<'_, T> {
    fn drop(&mut self) {
        self.state.store(0, Ordering::Release);
    }
}

impl<T> ModelLock<T> {
    fn reading<'a>(&'a self, guard: RwLockReadGuard<'a, T>) -> Read<'a, T> {
        assert!(
            self.state.fetch_add(1, Ordering::AcqRel) >= 0,
            "read beside a writer"
        );
        Read {
            guard,
            state: &self.state,
        }
    }

    fn writing<'a>(&'a self, guard: RwLockWriteGuard<'a, T>) -> Write<'a, T> {
        let before = self.state.swap(-1, Ordering::AcqRel);
        assert_eq!(before, 0, "write beside another holder");
        Write {
            guard,
            state: &self.state,
        }
    }
}

impl<T> RawLock<T> for ModelLock<T> {
    type Read<'a>
        = Read<'a, T>
    where
        T: 'a;
    type Write<'a>
        = Write<'a, T>
    where
        T: 'a;
    fn new(value: T) -> Self {
        Self {
            lock: RwLock::new(value),
            state: AtomicI32::new(0),
        }
    }
    fn try_read(&self) -> Option<Read<'_, T>> {
        self.lock.try_read().ok().map(|g| self.reading(g))
    }
    fn read(&self) -> Read<'_, T> {
        let g = self.lock.read().expect("no panics while held");
        self.reading(g)
    }
    fn try_read_until(&self, _: Instant) -> Option<Read<'_, T>> {
        // The deadline has passed by the time this is asked.
        self.try_read()
    }
    fn try_write(&self) -> Option<Write<'_, T>> {
        self.lock.try_write().ok().map(|g| self.writing(g))
    }
    fn write(&self) -> Write<'_, T> {
        let g = self.lock.write().expect("no panics while held");
        self.writing(g)
    }
    fn is_locked(&self) -> bool {
        self.state.load(Ordering::Acquire) != 0
    }
}

type Lock = ReaderFirstOn<(u32, u32), Model>;

/// A writer that writes each value in two steps, letting go between batches as
/// `ScopeIndex::write_in_holds` does (as soon as a reader waits, unless it queued).
fn writer(lock: &Lock, batches: u32) {
    let mut done = 0;
    while done < batches {
        let (mut g, turn) = lock.write_in_turn();
        loop {
            g.0 += 1;
            shuttle::thread::yield_now();
            g.1 += 1;
            done += 1;
            if done == batches || (turn == Turn::Opening && lock.readers_waiting()) {
                break;
            }
        }
    }
}

fn reader(lock: &Lock, reads: u32) {
    let mut last = 0;
    for i in 0..reads {
        let seen = if i % 2 == 0 {
            *lock.read()
        } else {
            match lock.try_read_until(Instant::now()) {
                Some(g) => *g,
                None => continue,
            }
        };
        assert_eq!(seen.0, seen.1, "a half-written value was read");
        assert!(seen.0 >= last, "a read went back in time");
        last = seen.0;
    }
}

fn scenario(writers: u32, readers: u32) {
    let lock = Arc::new(Lock::default());
    let mut threads = Vec::new();
    for _ in 0..writers {
        let lock = lock.clone();
        threads.push(shuttle::thread::spawn(move || writer(&lock, 3)));
    }
    for _ in 0..readers {
        let lock = lock.clone();
        threads.push(shuttle::thread::spawn(move || reader(&lock, 4)));
    }
    for t in threads {
        t.join().expect("thread");
    }
    let end = *lock.read();
    assert_eq!(end, (3 * writers, 3 * writers));
    assert!(!lock.readers_waiting(), "a reader left counted as waiting");
}

#[test]
fn one_writer_two_readers_random_schedules() {
    shuttle::check_random(|| scenario(1, 2), 3_000);
}

#[test]
fn two_writers_two_readers_pct_schedules() {
    shuttle::check_pct(|| scenario(2, 2), 3_000, 3);
}

#[test]
fn a_waiting_reader_never_deadlocks_a_writer_that_holds_on() {
    // A writer that queued keeps its turn for the whole batch while a reader waits.
    shuttle::check_pct(
        || {
            let lock = Arc::new(Lock::default());
            let w = {
                let lock = lock.clone();
                shuttle::thread::spawn(move || {
                    let (mut g, _) = lock.write_in_turn();
                    for _ in 0..3 {
                        g.0 += 1;
                        shuttle::thread::yield_now();
                        g.1 += 1;
                    }
                })
            };
            reader(&lock, 3);
            w.join().expect("writer");
            assert_eq!(*lock.read(), (3, 3));
        },
        3_000,
        3,
    );
}
