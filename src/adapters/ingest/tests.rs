use std::time::Duration;

use tokio_rustls::rustls::pki_types::CertificateDer;
use tokio_rustls::rustls::pki_types::pem::PemObject;

use super::*;
use crate::adapters::policy_file::SourceStatus;
use crate::core::Router;
use crate::core::index::IndexConfig;
use crate::core::snapshot::PolicySnapshot;
use crate::core::time::Timestamp;

fn metrics() -> Arc<Metrics> {
    let router = Arc::new(Router::new(
        IndexConfig::default(),
        PolicySnapshot::empty(),
        Timestamp::now(),
    ));
    Arc::new(Metrics::new(router, Arc::new(SourceStatus::new())))
}

const TOKEN_A: &str = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";

#[test]
fn token_files_name_callers_and_refuse_bad_lines() {
    let t = IngestTokens::parse(&format!(
        "# engines\nengine-a:{TOKEN_A}\n\n  bbbbbbbbbbbbbbbbbbbb  \n"
    ))
    .unwrap();
    assert_eq!(t.identify(TOKEN_A.as_bytes()), Some("engine-a"));
    assert_eq!(t.identify(b"bbbbbbbbbbbbbbbbbbbb"), Some("line-4"));
    assert_eq!(t.identify(b"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"), None);
    assert_eq!(t.identify(b""), None);
    // The Debug form never shows a token.
    assert!(!format!("{t:?}").contains(TOKEN_A));

    for (text, want) in [
        ("", "no token"),
        ("# only a comment\n", "no token"),
        ("a:short", "at least 16"),
        ("bad name:aaaaaaaaaaaaaaaaaaaa", "caller name"),
        (":aaaaaaaaaaaaaaaaaaaa", "caller name"),
        (
            "a:aaaaaaaaaaaaaaaaaaaa\na:bbbbbbbbbbbbbbbbbbbbbb",
            "used twice",
        ),
        ("a:aaaaaaaaaa\u{e9}aaaaaaaaaa", "printable ASCII"),
    ] {
        let e = IngestTokens::parse(text).unwrap_err();
        assert!(e.contains(want), "{text:?}: {e}");
    }
}

fn req_with(auth: Option<&str>) -> Request<()> {
    let mut r = Request::new(());
    if let Some(v) = auth {
        r.metadata_mut().insert("authorization", v.parse().unwrap());
    }
    r
}

#[test]
fn tokens_gate_the_call_with_unauthenticated() {
    let m = metrics();
    let guard = IngestGuard::new(
        Some(IngestTokens::parse(&format!("engine-a:{TOKEN_A}")).unwrap()),
        IngestLimits::UNLIMITED,
        m.clone(),
    );
    let cost = Cost {
        events: 1,
        entries: 1,
    };
    let ok = guard
        .admit(
            "IngestEvents",
            &req_with(Some(&format!("Bearer {TOKEN_A}"))),
            cost,
        )
        .unwrap();
    assert_eq!(ok, "token:engine-a");
    for auth in [
        None,
        Some("Bearer nope-nope-nope-nope"),
        Some(TOKEN_A),
        Some("Basic x"),
    ] {
        let e = guard
            .admit("IngestEvents", &req_with(auth), cost)
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated, "{auth:?}");
        assert!(
            e.message().contains("oken") || e.message().contains("Bearer"),
            "{}",
            e.message()
        );
    }
    let text = m.encode().unwrap();
    assert!(
        text.contains(
            r#"inferencecache_ingest_caller_calls_total{caller="unknown",rpc="IngestEvents",outcome="unauthenticated"} 4"#
        ),
        "{text}"
    );
    assert!(
        text.contains(r#"inferencecache_ingest_caller_events_total{caller="token:engine-a"} 1"#),
        "{text}"
    );
}

#[test]
fn buckets_refuse_over_the_rate_and_refill_with_time() {
    let m = metrics();
    let guard = IngestGuard::new(
        None,
        IngestLimits {
            events_per_sec: 10,
            entries_per_sec: 100,
        },
        m.clone(),
    );
    let t0 = Instant::now();
    let ev = |n| Cost {
        events: n,
        entries: 0,
    };
    guard.charge("ip:a", ev(6), t0).unwrap();
    guard.charge("ip:a", ev(4), t0).unwrap();
    let (limit, e) = guard.charge("ip:a", ev(1), t0).unwrap_err();
    assert_eq!(limit, "events");
    assert_eq!(e.code(), tonic::Code::ResourceExhausted);
    assert!(
        e.message().contains("ip:a") && e.message().contains("10 events/s"),
        "{}",
        e.message()
    );
    // Another caller has its own bucket.
    guard.charge("ip:b", ev(10), t0).unwrap();
    // Half a second refills half the bucket.
    let t1 = t0 + Duration::from_millis(500);
    guard.charge("ip:a", ev(5), t1).unwrap();
    assert!(guard.charge("ip:a", ev(1), t1).is_err());
    // A refusal takes nothing: entries stay available after an events refusal.
    let both = Cost {
        events: 1,
        entries: 100,
    };
    assert_eq!(guard.charge("ip:a", both, t1).unwrap_err().0, "events");
    guard
        .charge(
            "ip:a",
            Cost {
                events: 0,
                entries: 100,
            },
            t1,
        )
        .unwrap();
    // One call larger than a second's worth can never pass: the message says to split.
    let (limit, e) = guard
        .charge(
            "ip:c",
            Cost {
                events: 1,
                entries: 101,
            },
            t0,
        )
        .unwrap_err();
    assert_eq!(limit, "entries");
    assert!(e.message().contains("split"), "{}", e.message());

    // Through admit: refusals are counted per caller and limit.
    let r = Request::new(());
    guard.admit("ReportStats", &r, ev(10)).unwrap();
    assert!(guard.admit("ReportStats", &r, ev(1)).is_err());
    let text = m.encode().unwrap();
    assert!(
        text.contains(r#"inferencecache_ingest_limited_total{caller="unknown",limit="events"} 1"#),
        "{text}"
    );
}

#[test]
fn unlimited_guards_track_nobody() {
    let guard = IngestGuard::open(metrics());
    for _ in 0..100 {
        guard
            .charge(
                "ip:a",
                Cost {
                    events: 1 << 40,
                    entries: 1 << 40,
                },
                Instant::now(),
            )
            .unwrap();
    }
    assert!(guard.callers.lock().is_empty());
}

#[test]
fn costs_count_events_and_entries() {
    use pb::kv_event::Event;
    let ev = |e| pb::KvEvent { event: Some(e) };
    let req = pb::IngestEventsRequest {
        events: vec![
            ev(Event::Stored(pb::BlocksStored {
                parent_block_hash: None,
                block_hashes: vec![1, 2, 3],
                block_token_counts: vec![],
            })),
            ev(Event::Removed(pb::BlocksRemoved {
                block_hashes: vec![1],
            })),
            ev(Event::Cleared(pb::AllBlocksCleared {})),
            ev(Event::PrefixStored(pb::PrefixStored {
                prefix_hash: "p".into(),
                token_count: 4,
            })),
            pb::KvEvent { event: None },
        ],
        ..Default::default()
    };
    assert_eq!(
        Cost::of_ingest(&req),
        Cost {
            events: 5,
            entries: 5
        }
    );
}

#[test]
fn common_names_come_from_the_subject_not_the_issuer() {
    let pem = include_bytes!("../../../tests/fixtures/tls/client.pem");
    let der = CertificateDer::from_pem_slice(pem).unwrap();
    assert_eq!(common_name(der.as_ref()).as_deref(), Some("engine-a"));
    let server = include_bytes!("../../../tests/fixtures/tls/server.pem");
    let der = CertificateDer::from_pem_slice(server).unwrap();
    // "inferencecache ingest": the space is not label-safe.
    assert_eq!(
        common_name(der.as_ref()).as_deref(),
        Some("inferencecache_ingest")
    );
    // Garbage and truncations never panic.
    assert_eq!(common_name(b""), None);
    assert_eq!(common_name(&[0x30, 0x82, 0xff]), None);
    for n in 0..der.as_ref().len() {
        let _ = common_name(&der.as_ref()[..n]);
    }
}
