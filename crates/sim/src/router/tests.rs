use super::*;

#[test]
fn names_round_trip_and_unknown_is_an_error() {
    for r in Router::known() {
        assert_eq!(Router::parse(r.name()).unwrap(), r);
    }
    assert!(
        Router::parse("p2c")
            .unwrap_err()
            .to_string()
            .contains("least-request")
    );
}
