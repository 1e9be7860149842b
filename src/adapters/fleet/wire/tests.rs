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
            prompt_tokens: 1600,
            priority: -3,
            held: true,
            pending: Vec::new(),
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
fn facts_are_small() {
    // A start's epoch is its time in nanoseconds: the widest varint it takes.
    let msg = |fact| Message {
        epoch: 1_800_000_000_000_000_000,
        seq: 1_000_000,
        fact,
        ..routed()
    };
    let routed = encode(&msg(routed().fact)).len();
    let ended = encode(&msg(Fact::PrefillEnded { route: 1 << 40 })).len();
    assert!(routed <= 100, "routed: {routed} bytes");
    assert!(ended <= 45, "prefill ended: {ended} bytes");
}

#[test]
fn oversized_messages_are_refused_before_parsing() {
    let mut bytes = encode(&routed());
    bytes.resize(MAX_MESSAGE_BYTES + 1, b' ');
    assert_eq!(decode(&bytes), Err(Refusal::Oversized));
}

#[test]
fn a_pending_chain_travels_and_a_longer_one_is_refused() {
    let longest = (0..MAX_SHARED_PENDING as u64)
        .map(|i| i * 0x9e37_79b9)
        .collect::<Vec<_>>();
    let mut msg = routed();
    if let Fact::Routed { pending, .. } = &mut msg.fact {
        pending.clone_from(&longest);
    }
    // The longest chain and the longest ids fit under the limit.
    let long_id = "x".repeat(MAX_ID_BYTES);
    if let Fact::Routed { replica, .. } = &mut msg.fact {
        replica.clone_from(&long_id);
    }
    let msg = Message {
        peer: long_id.clone(),
        ..msg
    };
    let bytes = encode(&msg);
    assert!(bytes.len() <= MAX_MESSAGE_BYTES, "{} bytes", bytes.len());
    assert_eq!(decode(&bytes), Ok(msg.clone()));
    let mut wire = routed_wire("t", "m", "s", "r");
    if let Some(WireFact::Routed(r)) = &mut wire {
        r.pending = (0..=MAX_SHARED_PENDING as u64).collect();
    }
    assert_eq!(
        decode(&envelope(wire).encode_to_vec()),
        Err(Refusal::Malformed)
    );
}

fn envelope(fact: Option<WireFact>) -> Envelope {
    Envelope {
        v: VERSION,
        peer: "a".into(),
        epoch: 1,
        seq: 1,
        fact,
    }
}

fn routed_wire(tenant: &str, model: &str, scheme: &str, replica: &str) -> Option<WireFact> {
    Some(WireFact::Routed(Routed {
        route: 1,
        tenant: tenant.into(),
        model: model.into(),
        hash_scheme: scheme.into(),
        replica: replica.into(),
        uncached_tokens: 0,
        pending: Vec::new(),
        prompt_tokens: 0,
        priority: 0,
        held: false,
    }))
}

#[test]
fn another_version_is_foreign_not_garbage() {
    // A later version whose field 2 is no longer a string, and which adds a field.
    let mut later = VersionOnly { v: VERSION + 1 }.encode_to_vec();
    later.extend([0x10, 0x07, 0xfa, 0x01, 0x02, b'h', b'i']);
    assert_eq!(decode(&later), Err(Refusal::ForeignVersion));
    // The JSON format of version 1.
    let json = br#"{"v":1,"peer":"a","epoch":1,"seq":1,"fact":{"t":"heartbeat"}}"#;
    assert_eq!(decode(json), Err(Refusal::ForeignVersion));
}

#[test]
fn fields_a_later_version_adds_are_skipped() {
    let mut bytes = encode(&routed());
    bytes.extend([0xfa, 0x01, 0x02, b'h', b'i']); // field 31, a string
    assert_eq!(decode(&bytes), Ok(routed()));
}

#[test]
fn garbage_is_malformed() {
    let cases: Vec<Vec<u8>> = vec![
        b"".to_vec(),
        b"\xff\xfe".to_vec(),
        b"\x00\xffnot protobuf".to_vec(),
        // A version and nothing else; a fact cut short.
        VersionOnly { v: VERSION }.encode_to_vec(),
        envelope(None).encode_to_vec(),
        {
            let mut b = encode(&routed());
            b.truncate(b.len() - 3);
            b
        },
        // Field 2 (peer) as a varint, not a string.
        vec![0x08, VERSION as u8, 0x10, 0x01],
        Envelope {
            peer: String::new(),
            ..envelope(Some(WireFact::Heartbeat(Empty {})))
        }
        .encode_to_vec(),
        envelope(routed_wire("t", "m", "s", "")).encode_to_vec(),
        envelope(routed_wire("t", "", "s", "r")).encode_to_vec(),
        envelope(routed_wire("", "m", "s", "r")).encode_to_vec(),
        envelope(routed_wire("t", "m", "", "r")).encode_to_vec(),
    ];
    for bytes in cases {
        assert_eq!(decode(&bytes), Err(Refusal::Malformed), "{bytes:?}");
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
