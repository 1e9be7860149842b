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
fn a_read_that_waits_is_counted_with_its_wait() {
    let lock = Arc::new(ReaderFirst::<u32>::default());
    let (before, _) = contended_reads();
    let held = lock.lock.write();
    let reader = {
        let lock = lock.clone();
        std::thread::spawn(move || *lock.read())
    };
    // Let the reader find the lock taken before it is let go.
    let start = Instant::now();
    while !lock.readers_waiting() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "reader never waited"
        );
        std::thread::yield_now();
    }
    std::thread::sleep(Duration::from_millis(2));
    drop(held);
    assert_eq!(reader.join().expect("reader"), 0);
    let (after, nanos) = contended_reads();
    assert!(after > before);
    assert!(nanos >= 2_000_000, "the wait was not counted: {nanos} ns");
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
