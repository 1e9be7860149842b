use std::collections::BTreeMap;

use rmpv::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use super::*;
use crate::adapters::kv_events::frames::seq_of;
use crate::core::index::IndexConfig;
use crate::core::scope::ScopeRef;
use crate::core::snapshot::PolicySnapshot;

#[test]
fn endpoints_connect_or_bind() {
    assert_eq!(
        socket_target("tcp://10.0.0.1:5557"),
        (false, "tcp://10.0.0.1:5557".into())
    );
    assert_eq!(
        socket_target("tcp://*:5557"),
        (true, "tcp://0.0.0.0:5557".into())
    );
    assert_eq!(
        socket_target("bind:tcp://127.0.0.1:6000"),
        (true, "tcp://127.0.0.1:6000".into())
    );
    assert_eq!(tcp_target("tcp://10.0.0.1:5557"), Ok("10.0.0.1:5557"));
    assert!(tcp_target("ipc:///tmp/x").is_err());
}

fn frames(v: &[&[u8]]) -> Vec<Bytes> {
    v.iter().map(|f| Bytes::copy_from_slice(f)).collect()
}

#[test]
fn frames_must_be_topic_seq_payload() {
    let ok = frame_of(frames(&[b"kv", &7u64.to_be_bytes(), b"p"])).unwrap();
    assert_eq!((ok.seq, &ok.payload[..]), (7, &b"p"[..]));
    assert!(frame_of(frames(&[b"kv", &[0; 7], b"p"])).is_none());
    assert!(frame_of(frames(&[b"kv", &7u64.to_be_bytes()])).is_none());
    assert!(frame_of(frames(&[b"kv", &7u64.to_be_bytes(), b"p", b"x"])).is_none());
}

#[test]
fn replay_replies_in_both_shapes() {
    let end = u64::MAX.to_be_bytes();
    // vLLM 0.33 / SGLang 0.5.23: ["", topic, seq, payload], end ["", "", MAX, ""].
    let (seq, payload) = replay_reply(&frames(&[b"", b"kv", &9u64.to_be_bytes(), b"p"])).unwrap();
    assert_eq!((seq, &payload[..]), (9, &b"p"[..]));
    assert_eq!(
        replay_reply(&frames(&[b"", b"", &end, b""])).unwrap().0,
        END_OF_REPLAY
    );
    // vLLM 0.11 / SGLang 0.5.3: ["", seq, payload], end ["", MAX, ""].
    let (seq, payload) = replay_reply(&frames(&[b"", &3u64.to_be_bytes(), b"q"])).unwrap();
    assert_eq!((seq, &payload[..]), (3, &b"q"[..]));
    assert_eq!(
        replay_reply(&frames(&[b"", &end, b""])).unwrap().0,
        END_OF_REPLAY
    );
    // Anything else is refused.
    assert!(replay_reply(&frames(&[b"", &3u64.to_be_bytes()])).is_err());
    assert!(replay_reply(&frames(&[b"x", &3u64.to_be_bytes(), b"q"])).is_err());
    assert!(replay_reply(&frames(&[b"", b"kv", &[1, 2], b"q"])).is_err());
    assert!(replay_reply(&frames(&[b"", b"a", b"b", b"c", b"d"])).is_err());
}

/// A batch of one BlockStored (or BlockRemoved) event, vLLM's array generation.
fn batch(stored: &[u64], removed: &[u64]) -> Vec<u8> {
    batch_after(None, stored, removed)
}

/// [`batch`] whose stored run continues `parent`.
fn batch_after(parent: Option<u64>, stored: &[u64], removed: &[u64]) -> Vec<u8> {
    let ints = |xs: &[u64]| Value::Array(xs.iter().map(|&x| Value::from(x)).collect());
    let mut events = Vec::new();
    if !stored.is_empty() {
        let tokens: Vec<u64> = (0..stored.len() as u64 * 4).collect();
        events.push(Value::Array(vec![
            Value::from("BlockStored"),
            ints(stored),
            parent.map_or(Value::Nil, Value::from),
            ints(&tokens),
            Value::from(4),
            Value::Nil,
            Value::from("GPU"),
        ]));
    }
    if !removed.is_empty() {
        events.push(Value::Array(vec![
            Value::from("BlockRemoved"),
            ints(removed),
            Value::from("GPU"),
        ]));
    }
    let v = Value::Array(vec![Value::F64(1.0), Value::Array(events), Value::Nil]);
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &v).unwrap();
    out
}

/// The replay shapes engines send.
#[derive(Clone, Copy, Debug)]
enum Shape {
    /// vLLM 0.33, SGLang 0.5.23.
    Current,
    /// vLLM 0.11, SGLang 0.5.3.
    Older,
}

fn reply(ident: &Bytes, shape: Shape, topic: &[u8], seq: u64, payload: &[u8]) -> ZmqMessage {
    let seq = Bytes::copy_from_slice(&seq.to_be_bytes());
    let mut v = vec![ident.clone(), Bytes::new()];
    if let Shape::Current = shape {
        v.push(Bytes::copy_from_slice(topic));
    }
    v.push(seq);
    v.push(Bytes::copy_from_slice(payload));
    ZmqMessage::try_from(v).unwrap()
}

/// An engine: PUB + replay ROUTER (zeromq 0.7, as the simulated engine uses),
/// replying in `shape`. With `hold_reply`, that batch joins the buffer when a
/// replay request comes and the reply waits 200 ms (the test publishes it live
/// meanwhile). With `drop_tail` set, the next reply loses its last batch and its
/// end marker, as a ROUTER at its high-water mark drops them, and goes quiet.
struct Engine {
    publisher: PubSocket,
    endpoint: String,
    replay_endpoint: String,
    buffer: Arc<parking_lot::Mutex<BTreeMap<u64, Vec<u8>>>>,
    requests: Arc<std::sync::atomic::AtomicU32>,
    drop_tail: Arc<std::sync::atomic::AtomicBool>,
    seq: u64,
}

impl Engine {
    async fn start(shape: Shape, hold_reply: Option<(u64, Vec<u8>)>) -> Self {
        Self::start_on(shape, hold_reply, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
            .await
            .unwrap()
    }

    /// An engine on the given endpoints; `Err` when one is taken.
    async fn start_on(
        shape: Shape,
        hold_reply: Option<(u64, Vec<u8>)>,
        events_at: &str,
        replay_at: &str,
    ) -> Result<Self, zeromq::ZmqError> {
        let mut publisher = PubSocket::new();
        let endpoint = publisher.bind(events_at).await?.to_string();
        let mut router = RouterSocket::new();
        let replay_endpoint = router.bind(replay_at).await?.to_string();
        let buffer: Arc<parking_lot::Mutex<BTreeMap<u64, Vec<u8>>>> = Arc::default();
        let requests = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let drop_tail = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (buf, reqs, cut) = (buffer.clone(), requests.clone(), drop_tail.clone());
        tokio::spawn(async move {
            while let Ok(msg) = router.recv().await {
                let frames = msg.into_vec();
                let ident = frames[0].clone();
                let from = seq_of(&frames[2]).unwrap();
                reqs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                if let Some(live) = &hold_reply {
                    // A live batch published while the replay is being answered.
                    buf.lock().insert(live.0, live.1.clone());
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                let mut batches: Vec<(u64, Vec<u8>)> = buf
                    .lock()
                    .range(from..)
                    .map(|(s, p)| (*s, p.clone()))
                    .collect();
                let quiet = cut.swap(false, std::sync::atomic::Ordering::SeqCst);
                if quiet {
                    batches.pop();
                }
                for (seq, payload) in batches {
                    router
                        .send(reply(&ident, shape, b"kv", seq, &payload))
                        .await
                        .unwrap();
                }
                if quiet {
                    continue;
                }
                router
                    .send(reply(&ident, shape, b"", u64::MAX, b""))
                    .await
                    .unwrap();
            }
        });
        Ok(Self {
            publisher,
            endpoint,
            replay_endpoint,
            buffer,
            requests,
            drop_tail,
            seq: 0,
        })
    }

    /// Buffers a batch without delivering it (sent before anyone listened).
    fn buffered(&mut self, payload: Vec<u8>) {
        self.buffer.lock().insert(self.seq, payload);
        self.seq += 1;
    }

    async fn publish(&mut self, payload: Vec<u8>) {
        self.buffer.lock().insert(self.seq, payload.clone());
        self.publish_at(self.seq, payload).await;
        self.seq += 1;
    }

    async fn publish_at(&mut self, seq: u64, payload: Vec<u8>) {
        let msg = ZmqMessage::try_from(vec![
            Bytes::from_static(b"kv"),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            Bytes::from(payload),
        ])
        .unwrap();
        self.publisher.send(msg).await.unwrap();
    }
}

fn router() -> Arc<Router> {
    Arc::new(Router::new(
        IndexConfig::default(),
        PolicySnapshot::empty(),
        Timestamp::now(),
    ))
}

fn config(endpoint: &str, replay: Option<&str>) -> SubscriberConfig {
    SubscriberConfig {
        scope: ScopeRef::new("t", "m", "engine-raw").to_owned(),
        replica_id: "r0".into(),
        address: "10.0.0.1:8000".into(),
        endpoint: endpoint.into(),
        replay_endpoint: replay.map(str::to_string),
        topic: "kv".into(),
        queue_capacity: 64,
        replay_timeout: Duration::from_secs(2),
        max_mappings: 1 << 20,
        rank: 0,
        ranks: 1,
    }
}

fn entries(router: &Router) -> u64 {
    router
        .view(Timestamp::now())
        .replicas
        .iter()
        .filter(|r| r.replica_id == "r0")
        .map(|r| r.prefix_count)
        .sum()
}

async fn wait_for(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !check() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Warm start in both replay shapes: batches buffered before the subscriber
/// existed are applied, a live batch that arrived during the replay is not
/// applied twice (its removal would otherwise leave a reference behind), and the
/// live stream continues without a gap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warm_start_applies_the_buffer_then_follows_live_without_double_applying() {
    for shape in [Shape::Current, Shape::Older] {
        // Seq 3 is published live while the engine is answering the replay.
        let live3 = batch(&[30, 31], &[]);
        let mut engine = Engine::start(shape, Some((3, live3.clone()))).await;
        engine.buffered(batch(&[1, 2], &[]));
        engine.buffered(batch(&[10, 11, 12], &[]));
        engine.buffered(batch(&[20], &[2]));
        engine.seq = 4;
        let router = router();
        let metrics = Arc::new(KvEventMetrics::default());
        let _sub = Subscriber::spawn(
            config(&engine.endpoint, Some(&engine.replay_endpoint)),
            router.clone(),
            metrics.clone(),
        );
        // The replay request arrives once the subscription is up; publish seq 3
        // live then (the engine holds its reply meanwhile).
        wait_for("the replay request", || {
            engine.requests.load(std::sync::atomic::Ordering::SeqCst) == 1
        })
        .await;
        engine.publish_at(3, live3.clone()).await;
        wait_for("the warm start", || entries(&router) == 7).await;
        // Seq 4 removes seq 3's blocks: gone only if seq 3 was applied once.
        engine.publish(batch(&[], &[30, 31])).await;
        // (Had seq 3 been applied twice, its blocks would keep a reference: 7.)
        wait_for("seq 4's removals: 1, 10, 11, 12, 20 left", || {
            entries(&router) == 5
        })
        .await;
        assert_eq!(
            metrics.batches(),
            5,
            "{shape:?}: seq 0..=4, each decoded once"
        );
        assert_eq!(metrics.gaps(), 0, "{shape:?}");
        assert_eq!(engine.requests.load(std::sync::atomic::Ordering::SeqCst), 1);
    }
}

/// A warm-start reply that loses its tail and its end marker (a ROUTER at its
/// high-water mark) and goes quiet is asked again from where it stopped: no later
/// frame would reveal that hole, and no live batch may come to fill it as a gap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_start_reply_that_goes_quiet_is_asked_again_from_where_it_stopped() {
    for shape in [Shape::Current, Shape::Older] {
        let mut engine = Engine::start(shape, None).await;
        engine.buffered(batch(&[1, 2], &[]));
        engine.buffered(batch(&[10, 11], &[]));
        engine.buffered(batch(&[20, 21, 22], &[]));
        engine
            .drop_tail
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let router = router();
        let metrics = Arc::new(KvEventMetrics::default());
        let config = SubscriberConfig {
            replay_timeout: Duration::from_millis(300),
            ..config(&engine.endpoint, Some(&engine.replay_endpoint))
        };
        let _sub = Subscriber::spawn(config, router.clone(), metrics.clone());
        wait_for("the whole buffer, its lost tail included", || {
            entries(&router) == 7
        })
        .await;
        assert_eq!(
            engine.requests.load(std::sync::atomic::Ordering::SeqCst),
            2,
            "{shape:?}: asked again once, from seq 2"
        );
        assert_eq!(metrics.batches(), 3, "{shape:?}: each batch applied once");
        assert_eq!(metrics.gaps(), 0, "{shape:?}");
    }
}

/// A replay that cannot be had keeps the replica's entries and marks it stale;
/// an engine restart (seq back to 0) makes it exact again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_replay_keeps_entries_and_marks_the_replica_stale() {
    let mut engine = Engine::start(Shape::Current, None).await;
    let router = router();
    let metrics = Arc::new(KvEventMetrics::default());
    let _sub = Subscriber::spawn(
        config(&engine.endpoint, Some(&engine.replay_endpoint)),
        router.clone(),
        metrics.clone(),
    );
    wait_for("the warm start", || {
        engine.requests.load(std::sync::atomic::Ordering::SeqCst) >= 1
    })
    .await;
    // PUB drops until the subscription is in: publish until one lands.
    while metrics.batches() == 0 {
        engine.publish(batch(&[1, 2, 3], &[])).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    wait_for("the first batch", || entries(&router) == 3).await;
    // Seq n is lost and gone from the engine's buffer.
    let gaps = metrics.gaps();
    let lost = engine.seq;
    engine.seq += 1;
    engine.publish(batch(&[4], &[])).await;
    assert!(!engine.buffer.lock().contains_key(&lost));
    wait_for("the failed replay", || entries(&router) == 4).await;
    let key = stale_key(&config("", None));
    assert!(metrics.is_stale(&key.0, &key.1, &key.2, &key.3));
    assert_eq!(metrics.gaps(), gaps + 1);
    // The engine restarts: seq 0 again, exact again.
    engine.seq = 0;
    engine.buffer.lock().clear();
    engine.publish(batch(&[7], &[])).await;
    wait_for("the restart", || entries(&router) == 1).await;
    assert!(!metrics.is_stale(&key.0, &key.1, &key.2, &key.3));
}

/// A peer that completes the ZMTP handshake and announces a 1 TiB frame: the
/// connection is dropped and counted, and the next connection is followed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_frame_drops_the_connection_and_is_counted() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        for round in 0.. {
            let Ok((mut s, _)) = listener.accept().await else {
                return;
            };
            // Greeting (ZMTP 3.0, NULL), READY as a PUB, written by hand.
            let mut g = [0u8; 64];
            g[0] = 0xff;
            g[9] = 0x7f;
            g[10] = 3;
            g[12..16].copy_from_slice(b"NULL");
            s.write_all(&g).await.unwrap();
            let mut theirs = [0u8; 64];
            s.read_exact(&mut theirs).await.unwrap();
            let ready = b"\x05READY\x0bSocket-Type\x00\x00\x00\x03PUB";
            s.write_all(&[0x04, ready.len() as u8]).await.unwrap();
            s.write_all(ready).await.unwrap();
            if round == 0 {
                // A long frame header announcing 1 TiB, then nothing.
                let mut h = vec![0x02];
                h.extend_from_slice(&(1u64 << 40).to_be_bytes());
                s.write_all(&h).await.unwrap();
                let mut sink = Vec::new();
                let _ = s.read_to_end(&mut sink).await; // until they hang up
            } else {
                // A well-behaved batch: [kv, seq 0, payload].
                let payload = batch(&[5, 6], &[]);
                let mut m = vec![0x01, 2, b'k', b'v', 0x01, 8];
                m.extend_from_slice(&0u64.to_be_bytes());
                m.push(0x02);
                m.extend_from_slice(&(payload.len() as u64).to_be_bytes());
                m.extend_from_slice(&payload);
                // Their READY and subscription may still be in flight; a PUB
                // would wait for the subscription, so read a little first.
                tokio::time::sleep(Duration::from_millis(100)).await;
                s.write_all(&m).await.unwrap();
                let mut sink = Vec::new();
                let _ = s.read_to_end(&mut sink).await;
            }
        }
    });
    let router = router();
    let metrics = Arc::new(KvEventMetrics::default());
    let _sub = Subscriber::spawn(
        config(&format!("tcp://{addr}"), None),
        router.clone(),
        metrics.clone(),
    );
    wait_for("the oversized frame to be counted", || {
        metrics.oversized() == 1
    })
    .await;
    wait_for("the next connection's batch", || entries(&router) == 2).await;
}

#[tokio::test]
async fn close_ends_both_tasks_cleanly_even_while_reconnecting() {
    use crate::core::index::IndexConfig;
    use crate::core::snapshot::PolicySnapshot;
    let router = Arc::new(Router::new(
        IndexConfig::default(),
        PolicySnapshot::empty(),
        Timestamp::now(),
    ));
    let metrics = Arc::new(KvEventMetrics::default());
    let config = SubscriberConfig {
        scope: ScopeKey {
            tenant: "acme".into(),
            model: "llama".into(),
            hash_scheme: "vllm".into(),
        },
        replica_id: "r1".into(),
        address: "127.0.0.1:8001".into(),
        // Nothing listens there: the reader sits in its reconnect backoff.
        endpoint: "tcp://127.0.0.1:1".into(),
        replay_endpoint: None,
        topic: String::new(),
        queue_capacity: 4,
        replay_timeout: Duration::from_secs(1),
        max_mappings: 16,
        rank: 0,
        ranks: 1,
    };
    let sub = Subscriber::spawn(config, router, metrics);
    tokio::time::sleep(Duration::from_millis(120)).await;
    let started = tokio::time::Instant::now();
    assert!(
        sub.close(Duration::from_secs(2)).await,
        "both tasks end on their own"
    );
    assert!(started.elapsed() < Duration::from_secs(1));
}

/// A rank's view of its events: stores are counted, removals of blocks it does
/// not hold are dropped, a clear becomes the removal of what it holds.
#[test]
fn a_rank_touches_only_its_own_references() {
    let mut rank = RankBlocks::default();
    let stored = |h: &[u64]| IndexEvent::Stored {
        parent: None,
        hashes: h.to_vec(),
        token_counts: vec![],
    };
    let removed = |h: &[u64]| IndexEvent::Removed { hashes: h.to_vec() };
    let mut events = vec![stored(&[1, 1, 2]), removed(&[1, 3]), removed(&[4])];
    rank.scope(&mut events);
    assert_eq!(events, vec![stored(&[1, 1, 2]), removed(&[1])]);
    let mut events = vec![IndexEvent::Cleared, stored(&[5])];
    rank.scope(&mut events);
    let IndexEvent::Removed { hashes } = &mut events[0] else {
        panic!("{events:?}")
    };
    hashes.sort_unstable();
    assert_eq!(events, vec![removed(&[1, 2]), stored(&[5])]);
    // Nothing held: a clear (a warm start, a restart) sends nothing.
    let mut events = vec![removed(&[5]), IndexEvent::Cleared];
    rank.scope(&mut events);
    assert_eq!(events, vec![removed(&[5])]);
    // Lower tiers are the rank's too: its clear removes them there.
    let cpu = |stored: bool, h: &[u64]| match stored {
        true => IndexEvent::TierStored {
            tier: Tier::Cpu,
            hashes: h.to_vec(),
        },
        false => IndexEvent::TierRemoved {
            tier: Tier::Cpu,
            hashes: h.to_vec(),
        },
    };
    let mut events = vec![cpu(true, &[8]), cpu(false, &[9]), IndexEvent::Cleared];
    rank.scope(&mut events);
    assert_eq!(events, vec![cpu(true, &[8]), cpu(false, &[8])]);
}

/// `["AllBlocksCleared"]` alone, vLLM's array generation.
fn cleared_batch() -> Vec<u8> {
    let events = Value::Array(vec![Value::Array(vec![Value::from("AllBlocksCleared")])]);
    let v = Value::Array(vec![Value::F64(1.0), events, Value::from(1)]);
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &v).unwrap();
    out
}

/// Two engines as data-parallel ranks 0 and 1 of one pod: rank 1's sockets on
/// the ports right above rank 0's.
async fn rank_pair() -> (Engine, Engine) {
    loop {
        let rank0 = Engine::start(Shape::Current, None).await;
        let up = |e: &str| crate::crd::data_parallel::rank_endpoint(e, 1).unwrap();
        let rank1 = Engine::start_on(
            Shape::Current,
            None,
            &up(&rank0.endpoint),
            &up(&rank0.replay_endpoint),
        )
        .await;
        if let Ok(rank1) = rank1 {
            return (rank0, rank1);
        }
    }
}

/// Publishes harmless batches until the subscriber has one (PUB drops until the
/// subscription is in).
async fn until_subscribed(engine: &mut Engine, metrics: &KvEventMetrics) {
    wait_for("the warm start", || {
        engine.requests.load(std::sync::atomic::Ordering::SeqCst) >= 1
    })
    .await;
    while metrics.batches() == 0 {
        engine.publish(batch(&[], &[999])).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A replica with two data-parallel ranks: the supervisor follows port + r and
/// replay port + r; both ranks' blocks form the replica; rank 1's removals, its
/// `AllBlocksCleared` and its restart touch only rank 1's blocks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_ranks_feed_one_replica_and_clear_only_their_own_blocks() {
    use crate::adapters::kv_events::supervisor::Subscribers;
    use crate::core::snapshot::{BackendDecl, DeclaredReplica};
    let (mut rank0, mut rank1) = rank_pair().await;
    let scope = ScopeRef::new("t", "m", "engine-raw").to_owned();
    let snapshot = PolicySnapshot::new(
        Default::default(),
        Vec::new(),
        vec![BackendDecl {
            namespace: "ns".into(),
            name: "b".into(),
            scope: scope.clone(),
            engine: "vLLM".into(),
            block_size: 4,
            kv_events_topic: "kv".into(),
            lora_adapters: Vec::new(),
            replicas: vec![DeclaredReplica {
                id: "r0".into(),
                address: "10.0.0.1:8000".into(),
                kv_events_endpoint: Some(rank0.endpoint.clone()),
                kv_replay_endpoint: Some(rank0.replay_endpoint.clone()),
                data_parallel_size: 2,
            }],
        }],
    );
    let wanted = Subscribers::wanted(&snapshot);
    let follows: Vec<(u32, u32, &str, Option<&str>)> = wanted
        .iter()
        .map(|c| {
            (
                c.rank,
                c.ranks,
                c.endpoint.as_str(),
                c.replay_endpoint.as_deref(),
            )
        })
        .collect();
    assert_eq!(
        follows,
        [
            (
                0,
                2,
                rank0.endpoint.as_str(),
                Some(rank0.replay_endpoint.as_str())
            ),
            (
                1,
                2,
                rank1.endpoint.as_str(),
                Some(rank1.replay_endpoint.as_str())
            ),
        ]
    );
    let router = router();
    let (m0, m1) = (
        Arc::new(KvEventMetrics::default()),
        Arc::new(KvEventMetrics::default()),
    );
    let mut configs = wanted.into_iter();
    let _s0 = Subscriber::spawn(configs.next().unwrap(), router.clone(), m0.clone());
    let _s1 = Subscriber::spawn(configs.next().unwrap(), router.clone(), m1.clone());
    until_subscribed(&mut rank0, &m0).await;
    until_subscribed(&mut rank1, &m1).await;

    // Rank 1 continues the same chain after block 2 (it holds 1 and 2 too, but
    // stored them before we listened).
    rank0.publish(batch(&[1, 2, 3], &[])).await;
    rank1.publish(batch_after(Some(2), &[3, 4], &[])).await;
    wait_for("both ranks' blocks", || entries(&router) == 4).await;
    // Rank 1 drops block 3 (rank 0 still holds it) and names block 1, which it
    // never held: neither may release rank 0's reference.
    rank1.publish(batch(&[], &[3, 1])).await;
    rank1.publish(batch(&[5], &[])).await;
    wait_for("rank 1's removal and store", || entries(&router) == 5).await;
    // Rank 1 clears its cache: its 4 and 5 go, rank 0's 1, 2, 3 stay.
    rank1.publish(cleared_batch()).await;
    wait_for("rank 1's AllBlocksCleared", || entries(&router) == 3).await;
    rank1.publish(batch(&[6], &[])).await;
    wait_for("rank 1's next block", || entries(&router) == 4).await;
    // Rank 1 restarts (seq back to 0): its 6 goes, its new 7 and 8 come.
    rank1.seq = 0;
    rank1.buffer.lock().clear();
    rank1.publish(batch(&[7, 8], &[])).await;
    wait_for("rank 1's restart", || entries(&router) == 5).await;
    // Rank 0 followed along untouched: its stream saw no gap and no restart.
    assert_eq!(m0.gaps(), 0);
    assert_eq!(m1.gaps(), 0);
    rank0.publish(batch(&[], &[1, 2, 3])).await;
    wait_for("rank 0's removals: only rank 1's 7 and 8 left", || {
        entries(&router) == 2
    })
    .await;
}
