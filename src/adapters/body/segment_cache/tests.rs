use super::*;

fn ids_of(s: &str) -> Result<Vec<u32>, String> {
    Ok(s.bytes().map(u32::from).collect())
}

#[test]
fn a_second_lookup_is_a_hit_with_the_same_ids() {
    let c = SegmentCache::new(1 << 20);
    let a = c.get_or_encode("hello", ids_of).unwrap();
    let b = c
        .get_or_encode("hello", |_| Err::<Vec<u32>, _>("must not encode"))
        .unwrap();
    assert_eq!(a, b);
    let s = c.stats();
    assert_eq!((s.hits, s.misses, s.entries), (1, 1, 1));
    assert_eq!(s.bytes as usize, weight("hello", &a));
}

#[test]
fn the_byte_bound_evicts_the_least_recently_used() {
    let one = weight("aaaa", &[0; 4]);
    let c = SegmentCache::new(one * 4);
    c.get_or_encode("aaaa", ids_of).unwrap();
    c.get_or_encode("bbbb", ids_of).unwrap();
    c.get_or_encode("cccc", ids_of).unwrap();
    c.get_or_encode("dddd", ids_of).unwrap();
    // Touch "aaaa" so "bbbb" is the oldest, then overflow by one entry.
    c.get_or_encode("aaaa", ids_of).unwrap();
    c.get_or_encode("eeee", ids_of).unwrap();
    let s = c.stats();
    assert_eq!(s.entries, 4);
    assert!(s.bytes as usize <= one * 4);
    let misses = s.misses;
    c.get_or_encode("aaaa", ids_of).unwrap();
    assert_eq!(c.stats().misses, misses, "aaaa was kept");
    c.get_or_encode("bbbb", ids_of).unwrap();
    assert_eq!(c.stats().misses, misses + 1, "bbbb was evicted");
}

#[test]
fn a_segment_over_a_quarter_of_the_bound_is_not_kept() {
    let c = SegmentCache::new(400);
    let big = "x".repeat(80);
    c.get_or_encode(&big, ids_of).unwrap();
    assert_eq!(c.stats().entries, 0);
    assert_eq!(c.stats().bytes, 0);
}

#[test]
fn an_encode_error_keeps_nothing() {
    let c = SegmentCache::new(1 << 20);
    let r = c.get_or_encode("x", |_| Err::<Vec<u32>, _>("broken"));
    assert_eq!(r, Err("broken"));
    assert_eq!(c.stats().entries, 0);
}
