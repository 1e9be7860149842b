use super::*;
use crate::core::scope::ScopeRef;

fn routed() -> Message {
    Message {
        peer: "sidecar-a".into(),
        epoch: 17,
        seq: 42,
        fact: Fact::Routed {
            route: 9,
            scope: ScopeRef::new("acme", "llama", "vllm-sha256-cbor").to_owned(),
            replica: "10.0.0.7:8000".into(),
            uncached_tokens: 1536,
        },
    }
}

#[test]
fn every_fact_round_trips() {
    let facts = [
        routed().fact,
        Fact::PrefillEnded { route: 9 },
        Fact::Released { route: u64::MAX },
        Fact::Heartbeat,
        Fact::Leave,
    ];
    for fact in facts {
        let msg = Message { fact, ..routed() };
        assert_eq!(decode(&encode(&msg)), Ok(msg));
    }
}

#[test]
fn a_routed_fact_is_small() {
    assert!(encode(&routed()).len() < 200, "{}", encode(&routed()).len());
}

#[test]
fn oversized_messages_are_refused_before_parsing() {
    let mut bytes = encode(&routed());
    bytes.resize(MAX_MESSAGE_BYTES + 1, b' ');
    assert_eq!(decode(&bytes), Err(Refusal::Oversized));
}

#[test]
fn another_version_is_foreign_not_garbage() {
    let bytes = br#"{"v":2,"peer":"a","whatever":[1,2]}"#;
    assert_eq!(decode(bytes), Err(Refusal::ForeignVersion));
}

#[test]
fn garbage_is_malformed() {
    let cases: [&[u8]; 10] = [
        b"",
        b"\xff\xfe",
        b"null",
        br#"{"v":1}"#,
        br#"{"v":1,"peer":"a","epoch":1,"seq":1,"fact":{"t":"exploded"}}"#,
        br#"{"v":1,"peer":"a","epoch":-1,"seq":1,"fact":{"t":"heartbeat"}}"#,
        br#"{"v":1,"peer":"","epoch":1,"seq":1,"fact":{"t":"heartbeat"}}"#,
        br#"{"v":1,"peer":"a","epoch":1,"seq":1,"fact":{"t":"routed","route":1,"scope":["t","m","s"],"replica":"","uncached_tokens":0}}"#,
        br#"{"v":1,"peer":"a","epoch":1,"seq":1,"fact":{"t":"routed","route":1,"scope":["t","","s"],"replica":"r","uncached_tokens":0}}"#,
        br#"{"v":1,"peer":"a","epoch":1,"seq":1,"fact":{"t":"routed","route":1,"scope":["t","m"],"replica":"r","uncached_tokens":0}}"#,
    ];
    for bytes in cases {
        assert_eq!(
            decode(bytes),
            Err(Refusal::Malformed),
            "{:?}",
            String::from_utf8_lossy(bytes)
        );
    }
    let long = "r".repeat(MAX_ID_BYTES + 1);
    let msg = Message {
        peer: long,
        ..routed()
    };
    assert_eq!(decode(&encode(&msg)), Err(Refusal::Malformed));
}

#[test]
fn refusal_labels_are_distinct() {
    let labels = [
        Refusal::Oversized,
        Refusal::ForeignVersion,
        Refusal::Malformed,
    ]
    .map(Refusal::as_str);
    let set: std::collections::HashSet<_> = labels.iter().collect();
    assert_eq!(set.len(), labels.len());
}
