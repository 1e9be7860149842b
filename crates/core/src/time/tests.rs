use super::*;

#[test]
fn rfc3339_is_utc_with_millis() {
    let ts = Timestamp::from_millis(1_700_000_000_123);
    assert_eq!(ts.to_rfc3339(), "2023-11-14T22:13:20.123Z");
}

#[test]
fn since_saturates() {
    let a = Timestamp::from_secs(10);
    let b = Timestamp::from_secs(12);
    assert_eq!(b.since(a), Duration::from_secs(2));
    assert_eq!(a.since(b), Duration::ZERO);
}
