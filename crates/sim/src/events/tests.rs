use std::collections::HashSet;
use std::time::Duration;

use proptest::prelude::*;
use zeromq::{DealerSocket, SubSocket};

use super::*;
use crate::cache::PrefixCache;
use inferencecache::adapters::kv_events::decode::{EngineEvent, decode_batch};

fn mk_run() -> StoredRun {
    StoredRun {
        block_hashes: vec![7, u64::MAX],
        parent: Some(3),
        token_ids: (0..8).collect(),
        block_size: 4,
    }
}

fn value_of(payload: &[u8]) -> Value {
    let mut rd = payload;
    rmpv::decode::read_value(&mut rd).unwrap()
}

fn s(x: &str) -> Value {
    Value::from(x)
}

fn ints(xs: &[u64]) -> Value {
    Value::Array(xs.iter().map(|&x| Value::from(x)).collect())
}

fn map(items: Vec<(&str, Value)>) -> Value {
    Value::Map(items.into_iter().map(|(k, v)| (s(k), v)).collect())
}

fn all_events() -> Vec<KvEvent> {
    vec![
        KvEvent::Stored(mk_run()),
        KvEvent::Removed(vec![7]),
        KvEvent::Cleared,
    ]
}

#[test]
fn map_form_is_vllms_current_layout() {
    let payload = encode_batch(1.25, &all_events(), EventFormat::Map);
    let want = Value::Array(vec![
        Value::F64(1.25),
        Value::Array(vec![
            map(vec![
                ("type", s("BlockStored")),
                ("block_hashes", ints(&[7, u64::MAX])),
                ("parent_block_hash", Value::from(3)),
                ("token_ids", ints(&[0, 1, 2, 3, 4, 5, 6, 7])),
                ("block_size", Value::from(4)),
                ("lora_id", Value::Nil),
                ("medium", s("GPU")),
                ("lora_name", Value::Nil),
            ]),
            map(vec![
                ("type", s("BlockRemoved")),
                ("block_hashes", ints(&[7])),
                ("medium", s("GPU")),
            ]),
            map(vec![("type", s("AllBlocksCleared"))]),
        ]),
        Value::Nil,
    ]);
    assert_eq!(value_of(&payload), want);
}

#[test]
fn array_form_is_vllms_older_layout() {
    let mut run = mk_run();
    run.parent = None;
    let events = [
        KvEvent::Stored(run),
        KvEvent::Removed(vec![7]),
        KvEvent::Cleared,
    ];
    let payload = encode_batch(2.0, &events, EventFormat::Array);
    let want = Value::Array(vec![
        Value::F64(2.0),
        Value::Array(vec![
            Value::Array(vec![
                s("BlockStored"),
                ints(&[7, u64::MAX]),
                Value::Nil,
                ints(&[0, 1, 2, 3, 4, 5, 6, 7]),
                Value::from(4),
                Value::Nil,
                s("GPU"),
                Value::Nil,
            ]),
            Value::Array(vec![s("BlockRemoved"), ints(&[7]), s("GPU")]),
            Value::Array(vec![s("AllBlocksCleared")]),
        ]),
        Value::Nil,
    ]);
    assert_eq!(value_of(&payload), want);
}

#[test]
fn both_forms_decode_to_the_same_events() {
    let want = vec![
        EngineEvent::BlockStored {
            block_hashes: vec![7, u64::MAX],
            parent_block_hash: Some(3),
            token_ids: (0..8).collect(),
            block_size: 4,
            medium: Some("GPU".into()),
            identity: None,
        },
        EngineEvent::BlockRemoved {
            block_hashes: vec![7],
            medium: Some("GPU".into()),
        },
        EngineEvent::AllBlocksCleared,
    ];
    for format in [EventFormat::Map, EventFormat::Array] {
        let batch = decode_batch(&encode_batch(3.5, &all_events(), format)).unwrap();
        assert_eq!((batch.ts, batch.data_parallel_rank), (3.5, None));
        assert_eq!(batch.events, want, "{format:?}");
        assert_eq!(batch.skipped, 0);
    }
}

#[test]
fn admission_events_remove_before_they_store() {
    assert_eq!(admission_events(vec![], None), vec![]);
    assert_eq!(
        admission_events(vec![1, 2], Some(mk_run())),
        vec![KvEvent::Removed(vec![1, 2]), KvEvent::Stored(mk_run())]
    );
    assert_eq!(
        admission_events(vec![], Some(mk_run())),
        vec![KvEvent::Stored(mk_run())]
    );
}

/// Applies decoded events to a set of held blocks, asserting the stream is exact:
/// a block is stored only when absent (after its parent) and removed only when held.
fn fold(held: &mut HashSet<u64>, events: Vec<EngineEvent>) {
    for e in events {
        match e {
            EngineEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                ..
            } => {
                assert_eq!(token_ids.len(), block_hashes.len() * block_size as usize);
                if let Some(p) = parent_block_hash {
                    assert!(held.contains(&p), "parent {p} not held");
                }
                for h in block_hashes {
                    assert!(held.insert(h), "{h} stored twice");
                }
            }
            EngineEvent::BlockRemoved { block_hashes, .. } => {
                for h in block_hashes {
                    assert!(held.remove(&h), "{h} removed but not held");
                }
            }
            EngineEvent::AllBlocksCleared => held.clear(),
        }
    }
}

/// Prompts: one of 4 shared 3-block system prompts (or none), then 0..6 blocks
/// from a small alphabet (so suffixes repeat too), then a partial block.
fn prompts() -> impl Strategy<Value = Vec<Vec<u32>>> {
    let prompt = (0..5u32, prop::collection::vec(0..3u32, 0..24), 0..4usize).prop_map(
        |(group, suffix, partial)| {
            let mut tokens: Vec<u32> = if group < 4 {
                (0..12).map(|i| group * 100 + i).collect()
            } else {
                Vec::new()
            };
            tokens.extend(suffix);
            tokens.extend(std::iter::repeat_n(9, partial));
            tokens
        },
    );
    prop::collection::vec(prompt, 1..60)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Events emitted for a sequence of admissions (under capacity pressure),
    /// encoded, decoded by the router's own decoder and folded, equal the cache.
    #[test]
    fn emitted_events_match_the_cache(
        prompts in prompts(),
        capacity in 0..14usize,
        array in any::<bool>(),
        clear_at in 0..80usize,
    ) {
        let format = if array { EventFormat::Array } else { EventFormat::Map };
        let mut cache = PrefixCache::new(capacity, 4, "0").unwrap();
        let mut held = HashSet::new();
        for (step, p) in prompts.iter().enumerate() {
            let events = if step == clear_at {
                cache.clear();
                vec![KvEvent::Cleared]
            } else {
                let a = cache.admit(p);
                prop_assert!(cache.len() <= capacity);
                admission_events(a.removed, a.stored)
            };
            let batch = decode_batch(&encode_batch(0.0, &events, format)).unwrap();
            fold(&mut held, batch.events);
            let cached: HashSet<u64> = cache.recency().collect();
            prop_assert_eq!(&held, &cached, "step {}", step);
            prop_assert_eq!(cache.len(), cached.len());
        }
    }
}

#[test]
fn batches_leave_in_ticket_order() {
    let (tx, mut rx) = mpsc::unbounded_channel();
    let sequencer = Arc::new(Sequencer {
        order: Mutex::new(Order::default()),
        tx,
    });
    let ticket = |n| Ticket {
        number: n,
        sequencer: Some(sequencer.clone()),
    };
    sequencer.order.lock().issued = 4;
    let (t0, t1, t2, t3) = (ticket(0), ticket(1), ticket(2), ticket(3));
    t2.publish(vec![KvEvent::Removed(vec![2])]);
    t1.publish(vec![KvEvent::Removed(vec![1])]);
    assert!(rx.try_recv().is_err(), "held until ticket 0 is released");
    // An unpublished ticket releases its place when dropped; an empty batch
    // sends nothing.
    drop(t0);
    assert_eq!(rx.try_recv().unwrap(), vec![KvEvent::Removed(vec![1])]);
    assert_eq!(rx.try_recv().unwrap(), vec![KvEvent::Removed(vec![2])]);
    t3.publish(vec![]);
    assert!(rx.try_recv().is_err());
    assert_eq!(sequencer.order.lock().next, 4);
    assert!(sequencer.order.lock().waiting.is_empty());
}

async fn mk_publisher(format: EventFormat) -> EventPublisher {
    EventPublisher::bind(PublisherConfig {
        events_endpoint: "tcp://127.0.0.1:0".into(),
        replay_endpoint: "tcp://127.0.0.1:0".into(),
        topic: "kv".into(),
        format,
    })
    .await
    .unwrap()
}

/// Receives one message or fails after 5 s.
async fn recv_frames(socket: &mut impl SocketRecv) -> Vec<Bytes> {
    tokio::time::timeout(Duration::from_secs(5), socket.recv())
        .await
        .expect("a message within 5 s")
        .unwrap()
        .into_vec()
}

/// PUB drops until the subscription has arrived: publishes probe batches until
/// one comes through; returns the seq the next batch will carry.
async fn await_subscription(publisher: &EventPublisher, sub: &mut SubSocket) -> u64 {
    // Only probes have been published, so their count is the next seq.
    let mut probes = 0;
    loop {
        publisher.ticket().publish(vec![KvEvent::Cleared]);
        probes += 1;
        if let Ok(Ok(_)) = tokio::time::timeout(Duration::from_millis(50), sub.recv()).await {
            return probes;
        }
    }
}

fn removed(h: u64) -> Vec<EngineEvent> {
    vec![EngineEvent::BlockRemoved {
        block_hashes: vec![h],
        medium: Some("GPU".into()),
    }]
}

#[tokio::test]
async fn publishes_topic_seq_payload_and_replays_from_a_seq() {
    let publisher = mk_publisher(EventFormat::Array).await;
    assert!(publisher.events_endpoint().starts_with("tcp://127.0.0.1:"));
    assert!(!publisher.events_endpoint().ends_with(":0"));
    let mut sub = SubSocket::new();
    sub.connect(publisher.events_endpoint()).await.unwrap();
    sub.subscribe("kv").await.unwrap();
    let first = await_subscription(&publisher, &mut sub).await;
    // Probes may still be in flight: skip to the first batch after them.
    for i in 0..3u64 {
        publisher
            .ticket()
            .publish(vec![KvEvent::Removed(vec![first + i])]);
    }
    let mut seen = Vec::new();
    while seen.len() < 3 {
        let f = recv_frames(&mut sub).await;
        assert_eq!(f.len(), 3);
        assert_eq!(&f[0][..], b"kv");
        let seq = u64::from_be_bytes(f[1][..].try_into().unwrap());
        let batch = decode_batch(&f[2]).unwrap();
        if seq < first {
            continue;
        }
        assert!(batch.ts > 1.0e9, "wall clock seconds");
        assert_eq!(batch.events, removed(seq));
        seen.push(seq);
    }
    assert_eq!(seen, [first, first + 1, first + 2]);

    let mut dealer = DealerSocket::new();
    dealer.connect(publisher.replay_endpoint()).await.unwrap();
    let from = first + 1;
    let ask = ZmqMessage::try_from(vec![
        Bytes::new(),
        Bytes::copy_from_slice(&from.to_be_bytes()),
    ])
    .unwrap();
    dealer.send(ask).await.unwrap();
    let mut seqs = Vec::new();
    loop {
        let f = recv_frames(&mut dealer).await;
        assert_eq!(f.len(), 3);
        assert!(f[0].is_empty());
        let seq = u64::from_be_bytes(f[1][..].try_into().unwrap());
        if seq == END_OF_REPLAY {
            assert!(f[2].is_empty());
            break;
        }
        assert_eq!(decode_batch(&f[2]).unwrap().events, removed(seq));
        seqs.push(seq);
    }
    assert_eq!(seqs, [first + 1, first + 2]);
    publisher.stop();
}

#[tokio::test]
async fn bind_errors_name_the_endpoint() {
    let err = EventPublisher::bind(PublisherConfig {
        events_endpoint: "tcp://127.0.0.1:0".into(),
        replay_endpoint: "not-an-endpoint".into(),
        topic: String::new(),
        format: EventFormat::Map,
    })
    .await
    .unwrap_err();
    assert!(err.to_string().contains("not-an-endpoint"), "{err}");
    assert_eq!(bind_target("tcp://*:5557"), "tcp://0.0.0.0:5557");
}
