use super::*;

fn held(limit: usize) -> HeldRequest {
    HeldRequest::new(
        "/v1/completions".into(),
        RoutingHeaders::parse(std::iter::empty()),
        None,
        Some("10"),
        limit,
    )
}

#[test]
fn collects_until_the_end_of_stream() {
    let mut h = held(100);
    assert_eq!(h.collect(b"abc".to_vec(), false), Collect::More);
    assert_eq!(h.collect(b"def".to_vec(), true), Collect::Complete);
    assert_eq!(h.body, b"abcdef");
}

#[test]
fn crossing_the_limit_says_so_and_keeps_every_byte() {
    let mut h = held(4);
    assert_eq!(h.collect(b"abc".to_vec(), false), Collect::More);
    assert_eq!(h.collect(b"de".to_vec(), false), Collect::TooLarge);
    assert_eq!(h.body, b"abcde");
    // Exactly at the limit is still a body to decide on.
    let mut h = held(3);
    assert_eq!(h.collect(b"abc".to_vec(), true), Collect::Complete);
}

#[test]
fn a_lying_content_length_reserves_no_more_than_the_limit() {
    let h = HeldRequest::new(
        "/".into(),
        RoutingHeaders::parse(std::iter::empty()),
        None,
        Some("99999999999"),
        1024,
    );
    assert!(h.body.capacity() <= 1024);
}

#[test]
fn chunks_keep_order_and_bytes() {
    let body: Vec<u8> = (0..(2 * CHUNK_BYTES + 7))
        .map(|i| (i % 251) as u8)
        .collect();
    let parts = chunks(body.clone());
    assert_eq!(parts.len(), 3);
    assert!(parts.iter().all(|p| p.len() <= CHUNK_BYTES));
    assert_eq!(parts.concat(), body);
    assert_eq!(chunks(Vec::new()), vec![Vec::<u8>::new()]);
}
