//! The subscriber's checks, through a real router (no NATS: the checks are
//! plain functions of subject, bytes and router).

use super::subscriber::{Received, receive};
use super::*;
use crate::core::index::IndexConfig;
use crate::core::load::peer_ledger::{Fact, Message};
use crate::core::scope::ScopeRef;
use crate::core::snapshot::PolicySnapshot;
use crate::core::time::Timestamp;

fn router() -> Router {
    Router::new(
        IndexConfig::default(),
        PolicySnapshot::empty(),
        Timestamp::now(),
    )
}

fn msg(peer: &str, epoch: u64, seq: u64, fact: Fact) -> Vec<u8> {
    wire::encode(&Message {
        peer: peer.into(),
        epoch,
        seq,
        fact,
    })
}

fn routed(route: u64) -> Fact {
    Fact::Routed {
        route,
        scope: ScopeRef::new("acme", "llama", "vllm").to_owned(),
        replica: "r1".into(),
        uncached_tokens: 10,
        prompt_tokens: 0,
        priority: 0,
        held: false,
        pending: Vec::new(),
    }
}

#[derive(Debug)]
struct Nowhere;
impl crate::core::load::RouteFacts for Nowhere {
    fn publish(&self, _: Fact) {}
}

#[test]
fn every_check_refuses_before_anything_changes() {
    let r = router();
    assert!(r.join_fleet("me", Arc::new(Nowhere)));
    let s = Subjects::new("ic");
    let now = Timestamp::now();
    let rx = |subject: &str, bytes: &[u8]| receive(&r, &s, "me", subject, bytes, now);

    assert_eq!(
        rx("ic.routes.me", &msg("me", 1, 1, routed(1))),
        Received::Own
    );
    assert_eq!(
        rx("other.routes.a", &msg("a", 1, 1, routed(1))),
        Received::Dropped("peer_mismatch")
    );
    // Published on b's subject, claiming to be a.
    assert_eq!(
        rx("ic.routes.b", &msg("a", 1, 1, routed(1))),
        Received::Dropped("peer_mismatch")
    );
    assert_eq!(
        rx("ic.routes.a", b"garbage"),
        Received::Dropped("malformed")
    );
    assert_eq!(
        rx("ic.routes.a", br#"{"v":9,"peer":"a"}"#),
        Received::Dropped("foreign_version")
    );
    assert_eq!(
        rx("ic.routes.a", &vec![b' '; wire::MAX_MESSAGE_BYTES + 1]),
        Received::Dropped("oversized")
    );
    assert_eq!(r.fleet_peers(), 0, "nothing refused reached the ledger");

    assert_eq!(
        rx("ic.routes.a", &msg("a", 5, 1, routed(1))),
        Received::Applied
    );
    assert_eq!(
        rx("ic.routes.a", &msg("a", 4, 9, routed(2))),
        Received::Dropped("stale_epoch")
    );
    assert_eq!(
        rx("ic.routes.a", &msg("a", 5, 1, routed(3))),
        Received::Dropped("stale_seq")
    );
    assert_eq!(
        rx("ic.routes.a", &msg("a", 5, 3, Fact::Heartbeat)),
        Received::AppliedAfterGap
    );
    assert_eq!(r.fleet_peers(), 1);
}

#[test]
fn outside_a_fleet_nothing_is_applied() {
    let r = router();
    let s = Subjects::new("ic");
    assert_eq!(
        receive(
            &r,
            &s,
            "me",
            "ic.routes.a",
            &msg("a", 1, 1, Fact::Heartbeat),
            Timestamp::now()
        ),
        Received::Dropped("own")
    );
}

#[tokio::test]
async fn a_bad_id_or_name_is_refused_at_start() {
    let config = FleetConfig {
        access: NatsAccess {
            url: "nats://127.0.0.1:1".into(),
            ..NatsAccess::default()
        },
        id: "pod.1".into(),
        name: DEFAULT_NAME.into(),
        relay_kv_events: false,
        snapshot_interval: std::time::Duration::from_secs(30),
    };
    let m = Arc::new(FleetMetrics::default());
    let e = start(&config, Arc::new(router()), m.clone())
        .await
        .err()
        .expect("a dot in the id");
    assert!(format!("{e:#}").contains("--fleet-id"), "{e:#}");
    let e = start(
        &FleetConfig {
            id: "pod-1".into(),
            name: "a*".into(),
            ..config
        },
        Arc::new(router()),
        m,
    )
    .await
    .err()
    .expect("a wildcard in the name");
    assert!(format!("{e:#}").contains("--fleet-name"), "{e:#}");
}

#[test]
fn the_default_id_is_a_subject_token() {
    assert_eq!(subjects::check_token(&default_id()), Ok(()));
}
