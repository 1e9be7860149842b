use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use super::*;
use crate::events::END_OF_REPLAY;
use inferencecache::adapters::kv_events::decode::{EngineEvent, decode_batch};
use inferencecache_core::chain::{Scheme, compute_chain};

/// Fast costs: 1 µs per prefill token, 1 µs per decode token.
fn mk_config() -> EngineConfig {
    EngineConfig {
        id: "sim-a".into(),
        block_size: 4,
        capacity_blocks: 64,
        prefill_us_per_token: 1.0,
        decode_us_per_token: 1.0,
        ..EngineConfig::default()
    }
}

struct Http {
    client: Client<HttpConnector, Full<Bytes>>,
    base: String,
}

struct Reply {
    status: StatusCode,
    replica: Option<String>,
    json: Value,
}

impl Http {
    fn new(engine: &EngineHandle) -> Self {
        Self {
            client: Client::builder(TokioExecutor::new()).build_http(),
            base: format!("http://{}", engine.http_addr),
        }
    }

    async fn send(&self, method: &str, path: &str, body: &str) -> Reply {
        let req = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.to_string())))
            .unwrap();
        let resp = self.client.request(req).await.unwrap();
        let status = resp.status();
        let replica = resp
            .headers()
            .get(REPLICA_HEADER)
            .map(|v| v.to_str().unwrap().to_string());
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        let json = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes).unwrap()
        };
        Reply {
            status,
            replica,
            json,
        }
    }

    async fn complete(&self, prompt: &[u32], max_tokens: u32) -> Reply {
        let body =
            json!({"model": "m", "prompt": prompt, "max_tokens": max_tokens, "stream": false});
        self.send("POST", "/v1/completions", &body.to_string())
            .await
    }

    async fn cached_prefix(&self, prompt: &[u32]) -> Value {
        let r = self
            .send(
                "POST",
                "/v1/cached_prefix",
                &json!({ "prompt": prompt }).to_string(),
            )
            .await;
        assert_eq!(r.status, StatusCode::OK);
        r.json
    }

    async fn stats(&self) -> Value {
        let r = self.send("GET", "/stats", "").await;
        assert_eq!(r.status, StatusCode::OK);
        r.json
    }
}

fn tokens(from: u32, n: u32) -> Vec<u32> {
    (from..from + n).collect()
}

#[tokio::test]
async fn a_repeated_prompt_reports_cached_tokens() {
    let engine = spawn(mk_config()).await.unwrap();
    let http = Http::new(&engine);
    let prompt = tokens(1, 10); // two full blocks of 4, then 2 tokens
    let first = http.complete(&prompt, 3).await;
    assert_eq!(first.status, StatusCode::OK);
    assert_eq!(first.replica.as_deref(), Some("sim-a"));
    let j = &first.json;
    assert_eq!(j["object"], "text_completion");
    assert_eq!(j["model"], "m");
    assert_eq!(j["choices"][0]["finish_reason"], "length");
    assert_eq!(j["usage"]["prompt_tokens"], 10);
    assert_eq!(j["usage"]["completion_tokens"], 3);
    assert_eq!(j["usage"]["total_tokens"], 13);
    assert_eq!(j["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(j["sim"]["replica"], "sim-a");
    assert!((j["sim"]["prefill_ms"].as_f64().unwrap() - 0.010).abs() < 1e-9);
    assert!((j["sim"]["decode_ms"].as_f64().unwrap() - 0.003).abs() < 1e-9);
    let ttft = j["sim"]["queue_ms"].as_f64().unwrap() + j["sim"]["prefill_ms"].as_f64().unwrap();
    assert!((j["sim"]["ttft_ms"].as_f64().unwrap() - ttft).abs() < 1e-9);

    assert_eq!(http.cached_prefix(&prompt).await["cached_tokens"], 8);
    let second = http.complete(&prompt, 3).await;
    assert_eq!(
        second.json["usage"]["prompt_tokens_details"]["cached_tokens"],
        8
    );
    assert!((second.json["sim"]["prefill_ms"].as_f64().unwrap() - 0.002).abs() < 1e-9);
    assert_ne!(first.json["id"], second.json["id"]);
    // Another prompt sharing block 0 only.
    let mut other = tokens(1, 4);
    other.extend(tokens(500, 6));
    assert_eq!(http.cached_prefix(&other).await["cached_tokens"], 4);

    let stats = http.stats().await;
    assert_eq!(
        stats,
        json!({"replica": "sim-a", "served": 2, "queued": 0, "running": 0,
               "peak_queued": 0, "clock_resets": 0, "max_lag_ms": 0.0,
               "cached_blocks": 2, "capacity_blocks": 64})
    );
    assert_eq!(http.send("GET", "/health", "").await.status, StatusCode::OK);
    engine.shutdown().await;
}

#[tokio::test]
async fn bad_requests_get_a_clear_400_and_change_nothing() {
    let engine = spawn(mk_config()).await.unwrap();
    let http = Http::new(&engine);
    let cases = [
        ("{\"prompt\": [1, 2", "invalid request body"),
        ("{\"prompt\": \"hello\"}", "prompt is text"),
        ("{\"model\": \"m\"}", "prompt is missing"),
        ("{\"prompt\": null}", "prompt is missing"),
        ("{\"prompt\": []}", "prompt is empty"),
        ("{\"prompt\": [1, -2]}", "prompt[1] is not a token id"),
        (
            "{\"prompt\": [1, 4294967296]}",
            "prompt[1] is not a token id",
        ),
        ("{\"prompt\": [[1, 2]]}", "prompt[0] is not a token id"),
        ("{\"prompt\": 7}", "prompt must be an array"),
        (
            "{\"prompt\": [1], \"max_tokens\": \"x\"}",
            "invalid request body",
        ),
        ("[1, 2, 3]", "invalid request body"),
    ];
    for (body, want) in cases {
        let r = http.send("POST", "/v1/completions", body).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{body}");
        assert_eq!(r.replica.as_deref(), Some("sim-a"));
        let msg = r.json["error"]["message"].as_str().unwrap();
        assert!(msg.contains(want), "{body}: {msg}");
        assert_eq!(r.json["error"]["code"], 400);
        assert_eq!(r.json["error"]["type"], "BadRequestError");
        // The oracle reads only the prompt.
        let oracle = http.send("POST", "/v1/cached_prefix", body).await;
        let want = if body.contains("max_tokens") {
            StatusCode::OK
        } else {
            StatusCode::BAD_REQUEST
        };
        assert_eq!(oracle.status, want, "{body}");
    }
    let stats = http.stats().await;
    assert_eq!(stats["served"], 0);
    assert_eq!(stats["cached_blocks"], 0);
    engine.shutdown().await;
}

#[tokio::test]
async fn a_busy_engine_queues_requests_for_its_slots() {
    let engine = spawn(EngineConfig {
        max_running: 1,
        decode_us_per_token: 50_000.0, // 50 ms per output token
        ..mk_config()
    })
    .await
    .unwrap();
    let http = Arc::new(Http::new(&engine));
    let tasks: Vec<_> = (0..3u32)
        .map(|i| {
            let http = http.clone();
            tokio::spawn(async move { http.complete(&tokens(100 * i, 8), 2).await })
        })
        .collect();
    let mut replies = Vec::new();
    for t in tasks {
        let r = t.await.unwrap();
        assert_eq!(r.status, StatusCode::OK);
        replies.push(r.json["sim"].clone());
    }
    let f = |v: &Value, k: &str| v[k].as_f64().unwrap();
    replies.sort_by(|a, b| f(a, "queue_ms").total_cmp(&f(b, "queue_ms")));
    let service = |v: &Value| f(v, "prefill_ms") + f(v, "decode_ms");
    assert!((service(&replies[0]) - 100.008).abs() < 1e-6);
    // The three arrive within a few milliseconds of each other (allow 20): each
    // waits for the whole service of the ones before it.
    assert!(f(&replies[0], "queue_ms") < 20.0, "{replies:?}");
    for w in replies.windows(2) {
        assert!(
            f(&w[1], "queue_ms") >= f(&w[0], "queue_ms") + service(&w[0]) - 20.0,
            "{w:?}"
        );
    }
    let stats = http.stats().await;
    assert_eq!(stats["peak_queued"], 2);
    assert_eq!(stats["served"], 3);
    assert_eq!(
        (stats["queued"].clone(), stats["running"].clone()),
        (json!(0), json!(0))
    );
    // A reset starts the counters again.
    assert_eq!(
        http.send("POST", "/reset_prefix_cache", "").await.status,
        StatusCode::OK
    );
    let stats = http.stats().await;
    assert_eq!(
        (stats["peak_queued"].clone(), stats["served"].clone()),
        (json!(0), json!(0))
    );
    engine.shutdown().await;
}

#[tokio::test]
async fn the_oracle_sees_queued_and_running_requests() {
    let engine = spawn(EngineConfig {
        max_running: 1,
        decode_us_per_token: 100_000.0,
        ..mk_config()
    })
    .await
    .unwrap();
    let http = Arc::new(Http::new(&engine));
    let mut tasks = Vec::new();
    for i in 0..2u32 {
        let http = http.clone();
        tasks.push(tokio::spawn(async move {
            http.complete(&tokens(10 * i, 4), 2).await
        }));
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    let seen = http.cached_prefix(&[1, 2, 3]).await;
    assert_eq!(
        (&seen["cached_tokens"], &seen["queued"], &seen["running"]),
        (&json!(0), &json!(1), &json!(1)),
        "{seen}"
    );
    // Waiting for the slot: one more request ahead (its prefill + 2 × 100 ms decode).
    assert!(
        seen["predicted_ttft_ms"].as_f64().unwrap() > 150.0,
        "{seen}"
    );
    for t in tasks {
        assert_eq!(t.await.unwrap().status, StatusCode::OK);
    }
    engine.shutdown().await;
}

/// Receives one message or fails after 5 s.
async fn recv_frames(socket: &mut impl SocketRecv) -> Vec<Bytes> {
    tokio::time::timeout(Duration::from_secs(5), socket.recv())
        .await
        .expect("a message within 5 s")
        .unwrap()
        .into_vec()
}

fn seq_of(frame: &[u8]) -> u64 {
    u64::from_be_bytes(frame.try_into().unwrap())
}

/// Subscribes to the engine's events; resets the cache (an AllBlocksCleared
/// batch each time) until one arrives, then drains the rest of those. Returns the
/// seq of the next batch.
async fn subscribe(engine: &EngineHandle, http: &Http) -> (SubSocket, u64) {
    let mut sub = SubSocket::new();
    sub.connect(&engine.events_endpoint).await.unwrap();
    sub.subscribe("kv@sim-a").await.unwrap();
    let mut resets = 0;
    loop {
        assert_eq!(
            http.send("POST", "/reset_prefix_cache", "").await.status,
            StatusCode::OK
        );
        resets += 1;
        if let Ok(Ok(_)) = tokio::time::timeout(Duration::from_millis(50), sub.recv()).await {
            break;
        }
    }
    loop {
        match tokio::time::timeout(Duration::from_millis(100), sub.recv()).await {
            Ok(Ok(m)) => assert!(seq_of(&m.into_vec()[1]) < resets),
            _ => return (sub, resets),
        }
    }
}

/// The next batch's seq and events.
async fn next_batch(sub: &mut SubSocket) -> (u64, Vec<EngineEvent>) {
    let f = recv_frames(sub).await;
    assert_eq!(f.len(), 3);
    assert_eq!(&f[0][..], b"kv@sim-a");
    (seq_of(&f[1]), decode_batch(&f[2]).unwrap().events)
}

fn stored(hashes: &[u64], parent: Option<u64>, token_ids: &[u32]) -> EngineEvent {
    EngineEvent::BlockStored {
        block_hashes: hashes.to_vec(),
        parent_block_hash: parent,
        token_ids: token_ids.to_vec(),
        block_size: 4,
        medium: Some("GPU".into()),
        identity: None,
    }
}

fn removed(hashes: &[u64]) -> EngineEvent {
    EngineEvent::BlockRemoved {
        block_hashes: hashes.to_vec(),
        medium: Some("GPU".into()),
    }
}

#[tokio::test]
async fn kv_events_round_trip_over_zmq_with_replay() {
    for format in [EventFormat::Map, EventFormat::Array] {
        let engine = spawn(EngineConfig {
            capacity_blocks: 4,
            topic: "kv@sim-a".into(),
            hash_seed: "7".into(),
            event_format: format,
            ..mk_config()
        })
        .await
        .unwrap();
        let http = Http::new(&engine);
        let (mut sub, first) = subscribe(&engine, &http).await;
        let chain = |t: &[u32]| compute_chain(Scheme::VllmSha256Cbor, t, 4, Some("7")).unwrap();

        // A: three blocks from block 0.
        let a = tokens(1, 13);
        let ha = chain(&a);
        assert_eq!(http.complete(&a, 1).await.status, StatusCode::OK);
        let (seq, events) = next_batch(&mut sub).await;
        assert_eq!(seq, first);
        assert_eq!(events, [stored(&ha, None, &a[..12])]);

        // A extended by one block: only the new block, after A's last.
        let mut a2 = a[..12].to_vec();
        a2.extend(tokens(900, 5));
        let ha2 = chain(&a2);
        assert_eq!(ha2[..3], ha[..]);
        let r = http.complete(&a2, 1).await;
        assert_eq!(
            r.json["usage"]["prompt_tokens_details"]["cached_tokens"],
            12
        );
        let (seq, events) = next_batch(&mut sub).await;
        assert_eq!(seq, first + 1);
        assert_eq!(events, [stored(&ha2[3..], Some(ha[2]), &a2[12..16])]);

        // B: two blocks; the cache is full, so A's two tail blocks go first.
        let b = tokens(5000, 8);
        let hb = chain(&b);
        http.complete(&b, 1).await;
        let (seq, events) = next_batch(&mut sub).await;
        assert_eq!(seq, first + 2);
        assert_eq!(events, [removed(&[ha2[3], ha2[2]]), stored(&hb, None, &b)]);

        // A repeat of B touches only cached blocks: no batch.
        http.complete(&b, 1).await;
        // Reset: everything cleared.
        assert_eq!(
            http.send("POST", "/reset_prefix_cache", "").await.status,
            StatusCode::OK
        );
        let (seq, events) = next_batch(&mut sub).await;
        assert_eq!(
            (seq, events),
            (first + 3, vec![EngineEvent::AllBlocksCleared])
        );
        assert_eq!(http.stats().await["cached_blocks"], 0);
        assert_eq!(http.cached_prefix(&b).await["cached_tokens"], 0);

        // Replay from A's batch: the three data batches, the clear, the end marker.
        let mut dealer = DealerSocket::new();
        dealer.connect(&engine.replay_endpoint).await.unwrap();
        let ask = ZmqMessage::try_from(vec![
            Bytes::new(),
            Bytes::copy_from_slice(&first.to_be_bytes()),
        ])
        .unwrap();
        dealer.send(ask).await.unwrap();
        let mut replayed = Vec::new();
        loop {
            let f = recv_frames(&mut dealer).await;
            assert_eq!(f.len(), 3);
            assert!(f[0].is_empty());
            let seq = seq_of(&f[1]);
            if seq == END_OF_REPLAY {
                assert!(f[2].is_empty());
                break;
            }
            replayed.push((seq, decode_batch(&f[2]).unwrap().events));
        }
        let seqs: Vec<u64> = replayed.iter().map(|(s, _)| *s).collect();
        assert_eq!(seqs, [first, first + 1, first + 2, first + 3], "{format:?}");
        assert_eq!(replayed[0].1, [stored(&ha, None, &a[..12])]);
        assert_eq!(replayed[3].1, [EngineEvent::AllBlocksCleared]);
        engine.shutdown().await;
    }
}

#[tokio::test]
async fn events_follow_admission_order_not_prefill_order() {
    // A long prompt admitted first finishes prefill after a short one admitted
    // second, which evicts the long one's blocks: the long one's store must still
    // be published before the short one's removal.
    let engine = spawn(EngineConfig {
        capacity_blocks: 4,
        max_running: 2,
        prefill_us_per_token: 10_000.0, // 10 ms per uncached token
        topic: "kv@sim-a".into(),
        ..mk_config()
    })
    .await
    .unwrap();
    let http = Arc::new(Http::new(&engine));
    let (mut sub, first) = subscribe(&engine, &http).await;
    let long = tokens(1, 16); // 4 blocks, 160 ms prefill
    let short = tokens(700, 5); // 1 block, 50 ms prefill, evicts one of long's
    let h = http.clone();
    let l = long.clone();
    let long_task = tokio::spawn(async move { h.complete(&l, 1).await });
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(http.complete(&short, 1).await.status, StatusCode::OK);
    assert_eq!(long_task.await.unwrap().status, StatusCode::OK);
    let (s1, e1) = next_batch(&mut sub).await;
    let (s2, e2) = next_batch(&mut sub).await;
    assert_eq!((s1, s2), (first, first + 1));
    assert!(
        matches!(&e1[..], [EngineEvent::BlockStored { block_hashes, .. }] if block_hashes.len() == 4)
    );
    assert!(matches!(
        &e2[..],
        [
            EngineEvent::BlockRemoved { .. },
            EngineEvent::BlockStored { .. }
        ]
    ));
    engine.shutdown().await;
}

#[tokio::test]
async fn bad_configs_are_refused() {
    let cases = [
        (
            EngineConfig {
                max_running: 0,
                ..mk_config()
            },
            "max_running",
        ),
        (
            EngineConfig {
                block_size: 0,
                ..mk_config()
            },
            "block size",
        ),
        (
            EngineConfig {
                id: String::new(),
                ..mk_config()
            },
            "replica id",
        ),
        (
            EngineConfig {
                id: "a\nb".into(),
                ..mk_config()
            },
            "replica id",
        ),
        (
            EngineConfig {
                prefill_us_per_token: -1.0,
                ..mk_config()
            },
            "prefill_us_per_token",
        ),
        (
            EngineConfig {
                decode_us_per_token: f64::NAN,
                ..mk_config()
            },
            "decode_us_per_token",
        ),
        (
            EngineConfig {
                events_endpoint: "udp://x".into(),
                ..mk_config()
            },
            "udp://x",
        ),
    ];
    for (config, want) in cases {
        let err = spawn(config).await.unwrap_err();
        assert!(format!("{err:#}").contains(want), "{err:#}");
    }
}

#[test]
fn requests_parse_with_defaults_and_ignore_unknown_fields() {
    let r = parse_completion(br#"{"prompt":[5,6],"temperature":0.2,"extra":{"a":1}}"#).unwrap();
    assert_eq!(
        r,
        Completion {
            model: String::new(),
            prompt: vec![5, 6],
            max_tokens: DEFAULT_MAX_TOKENS,
            stream: false,
            chat: false,
        }
    );
    assert!(
        parse_completion(br#"{"prompt":[1],"stream":true}"#)
            .unwrap()
            .stream
    );
    assert_eq!(
        parse_prompt(br#"{"prompt":[4294967295]}"#).unwrap(),
        (vec![u32::MAX], DEFAULT_MAX_TOKENS)
    );
    assert_eq!(
        parse_prompt(br#"{"prompt":[1],"max_tokens":7}"#).unwrap(),
        (vec![1], 7)
    );
}

// ---- The continuous-batching model ----

/// A small step budget so a few prompts fill many steps: 64 tokens per step,
/// step = 2 ms + 50 µs per prefill token + 100 µs per decoding sequence.
fn mk_batched() -> EngineConfig {
    EngineConfig {
        id: "sim-b".into(),
        block_size: 4,
        capacity_blocks: 4096,
        max_running: 256,
        batch: Some(BatchCosts {
            max_num_batched_tokens: 64,
            step_base_us: 2000.0,
            prefill_us_per_token: 50.0,
            decode_us_per_seq: 100.0,
        }),
        model_name: "m".into(),
        ..EngineConfig::default()
    }
}

fn sim(r: &Reply, k: &str) -> f64 {
    r.json["sim"][k]
        .as_f64()
        .unwrap_or_else(|| panic!("no sim.{k} in {}", r.json))
}

impl Http {
    async fn text(&self, path: &str) -> (StatusCode, Option<String>, String) {
        let req = Request::builder()
            .method("GET")
            .uri(format!("{}{path}", self.base))
            .body(Full::new(Bytes::new()))
            .unwrap();
        let resp = self.client.request(req).await.unwrap();
        let status = resp.status();
        let ctype = resp
            .headers()
            .get("content-type")
            .map(|v| v.to_str().unwrap().to_string());
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        (status, ctype, String::from_utf8(bytes.to_vec()).unwrap())
    }
}

#[test]
fn step_time_grows_with_prefill_tokens_and_decoding_sequences() {
    let c = BatchCosts::DEFAULT;
    assert_eq!(c.step(0, 1), Duration::from_micros(5100));
    // A full 2048-token prefill step: 5 ms + 61.44 ms.
    assert_eq!(c.step(2048, 0), Duration::from_micros(66_440));
    assert!(c.step(1024, 64) > c.step(1024, 0));
    // The prediction grows with the work queued ahead and with the batch.
    assert!(c.predict_ttft_us(4096, 100, 0) > c.predict_ttft_us(0, 100, 0));
    assert!(c.predict_ttft_us(0, 100, 32) > c.predict_ttft_us(0, 100, 0));
    assert!(c.predict_ttft_us(0, 2000, 0) > c.predict_ttft_us(0, 16, 0));
}

#[tokio::test]
async fn a_burst_of_prefills_slows_a_running_requests_decode() {
    // Alone: 20 output tokens, 19 decode steps of 2.1 ms after the prefill step.
    let engine = spawn(mk_batched()).await.unwrap();
    let http = Arc::new(Http::new(&engine));
    let alone = http.complete(&tokens(1, 8), 20).await;
    assert_eq!(alone.status, StatusCode::OK);
    let decode_alone = sim(&alone, "decode_ms");
    assert!((35.0..60.0).contains(&decode_alone), "{decode_alone}");

    // Again (other tokens), with four 256-token prompts arriving while it decodes:
    // their chunks fill every step's budget, so each of its decode steps takes
    // 2 ms + 63 × 50 µs + 0.1 ms instead of 2.1 ms.
    let h = http.clone();
    let running = tokio::spawn(async move { h.complete(&tokens(10_000, 8), 20).await });
    tokio::time::sleep(Duration::from_millis(5)).await;
    let burst: Vec<_> = (0..4u32)
        .map(|i| {
            let h = http.clone();
            tokio::spawn(async move { h.complete(&tokens(20_000 + 1000 * i, 256), 2).await })
        })
        .collect();
    let slowed = running.await.unwrap();
    assert_eq!(slowed.status, StatusCode::OK);
    let decode_slowed = sim(&slowed, "decode_ms");
    assert!(
        decode_slowed > 1.8 * decode_alone,
        "decode alone {decode_alone} ms, during the burst {decode_slowed} ms"
    );
    for b in burst {
        assert_eq!(b.await.unwrap().status, StatusCode::OK);
    }
    engine.shutdown().await;
}

#[tokio::test]
async fn ttft_grows_with_queue_depth_and_the_engine_reports_it() {
    let engine = spawn(mk_batched()).await.unwrap();
    let http = Arc::new(Http::new(&engine));
    let idle = http.cached_prefix(&tokens(90_000, 128)).await;
    // Six 128-token prompts at once: each needs two full steps of prefill, taken
    // first come first served, so the k-th waits for the 2(k−1) steps before it.
    let tasks: Vec<_> = (0..6u32)
        .map(|i| {
            let h = http.clone();
            tokio::spawn(async move { h.complete(&tokens(1000 * (i + 1), 128), 4).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(8)).await;
    // Mid-burst: waiting requests show on /metrics and in the oracle's prediction.
    let (status, ctype, text) = http.text("/metrics").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        ctype.as_deref(),
        Some("text/plain; version=0.0.4; charset=utf-8")
    );
    let gauge = |name: &str| -> f64 {
        let prefix = format!("{name}{{engine=\"0\",model_name=\"m\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .unwrap_or_else(|| panic!("{name} missing:\n{text}"))
            .parse()
            .unwrap()
    };
    assert!(gauge("vllm:num_requests_waiting") >= 1.0, "{text}");
    assert!(gauge("vllm:num_requests_running") >= 1.0, "{text}");
    let usage = gauge("vllm:kv_cache_usage_perc");
    assert!(usage > 0.0 && usage <= 1.0, "{text}");
    let busy = http.cached_prefix(&tokens(90_000, 128)).await;
    assert!(
        busy["pending_prefill_tokens"].as_u64().unwrap() > 128,
        "{busy}"
    );
    // The load-aware oracle tells its requests on the wire from those queued here.
    assert_eq!(idle["received"], 0, "{idle}");
    assert_eq!(busy["received"], 6, "{busy}");
    assert!(
        busy["predicted_ttft_ms"].as_f64().unwrap()
            > 2.0 * idle["predicted_ttft_ms"].as_f64().unwrap(),
        "idle {idle}, busy {busy}"
    );

    let mut ttfts = Vec::new();
    let mut replies = Vec::new();
    for t in tasks {
        let r = t.await.unwrap();
        assert_eq!(r.status, StatusCode::OK);
        let ttft = sim(&r, "ttft_ms");
        assert!((ttft - sim(&r, "queue_ms") - sim(&r, "prefill_ms")).abs() < 1e-6);
        ttfts.push(ttft);
        replies.push(r.json["sim"].clone());
    }
    ttfts.sort_by(f64::total_cmp);
    // Alone: two steps of 5.2 ms. Sixth in line: about twelve.
    assert!((9.0..20.0).contains(&ttfts[0]), "{ttfts:?} {replies:?}");
    assert!(ttfts[5] > 3.0 * ttfts[0], "{ttfts:?} {replies:?}");
    assert!(ttfts.windows(2).all(|w| w[1] > w[0]), "{ttfts:?}");
    let (_, _, text) = http.text("/metrics").await;
    assert!(
        text.contains("vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 0.0\n"),
        "{text}"
    );
    assert!(
        text.contains("vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.0\n"),
        "{text}"
    );
    // Every one of the six reached its first token (what other sidecars read).
    assert!(
        text.contains(
            "vllm:time_to_first_token_seconds_count{engine=\"0\",model_name=\"m\"} 6.0\n"
        ),
        "{text}"
    );
    engine.shutdown().await;
}

#[tokio::test]
async fn cached_tokens_skip_the_prefill_cost() {
    let engine = spawn(mk_batched()).await.unwrap();
    let http = Http::new(&engine);
    let prompt = tokens(5, 512);
    let cold = http.complete(&prompt, 2).await;
    let warm = http.complete(&prompt, 2).await;
    assert_eq!(
        cold.json["usage"]["prompt_tokens_details"]["cached_tokens"],
        0
    );
    // Every whole block but the last token's: 508 of 512.
    assert_eq!(
        warm.json["usage"]["prompt_tokens_details"]["cached_tokens"],
        508
    );
    // Cold: 8 full steps of 5.2 ms; warm: one step for the 4 uncached tokens.
    let (c, w) = (sim(&cold, "ttft_ms"), sim(&warm, "ttft_ms"));
    assert!(c > 35.0, "{c}");
    assert!(w < c / 4.0, "cold {c} ms, warm {w} ms");
    engine.shutdown().await;
}

#[test]
fn the_metrics_text_is_vllms() {
    let text = vllm_metrics_text("Qwen/Qwen2.5-7B-Instruct", 3, 0, 0.25, (42, 1.5));
    assert_eq!(
        text,
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n\
         # TYPE vllm:num_requests_running gauge\n\
         vllm:num_requests_running{engine=\"0\",model_name=\"Qwen/Qwen2.5-7B-Instruct\"} 3.0\n\
         # HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n\
         # TYPE vllm:num_requests_waiting gauge\n\
         vllm:num_requests_waiting{engine=\"0\",model_name=\"Qwen/Qwen2.5-7B-Instruct\"} 0.0\n\
         # HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n\
         # TYPE vllm:kv_cache_usage_perc gauge\n\
         vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"Qwen/Qwen2.5-7B-Instruct\"} 0.25\n\
         # HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.\n\
         # TYPE vllm:time_to_first_token_seconds histogram\n\
         vllm:time_to_first_token_seconds_sum{engine=\"0\",model_name=\"Qwen/Qwen2.5-7B-Instruct\"} 1.5\n\
         vllm:time_to_first_token_seconds_bucket{engine=\"0\",model_name=\"Qwen/Qwen2.5-7B-Instruct\",le=\"+Inf\"} 42.0\n\
         vllm:time_to_first_token_seconds_count{engine=\"0\",model_name=\"Qwen/Qwen2.5-7B-Instruct\"} 42.0\n"
    );
    // A label value is escaped as the exposition format requires.
    assert!(vllm_metrics_text("a\"b", 0, 0, 0.0, (0, 0.0)).contains("model_name=\"a\\\"b\"}"));
}

#[tokio::test]
async fn the_simple_model_serves_metrics_too() {
    let engine = spawn(mk_config()).await.unwrap();
    let http = Http::new(&engine);
    let (status, _, text) = http.text("/metrics").await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        text.contains("vllm:num_requests_running{engine=\"0\",model_name=\"sim-model\"} 0.0\n"),
        "{text}"
    );
    engine.shutdown().await;
}

/// Word-level tokenizer files: `<s>` 0 (added to completions text), `w0`.. as 10..,
/// and a chat template that writes `<s>` itself.
fn word_tokenizer(dir: &std::path::Path) {
    let mut vocab = serde_json::Map::new();
    vocab.insert("<s>".into(), 0.into());
    vocab.insert("<unk>".into(), 1.into());
    for i in 0..64 {
        vocab.insert(format!("w{i}"), (10 + i).into());
    }
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [{"id": 0, "content": "<s>", "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true}],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [0], "tokens": ["<s>"]}}},
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
    });
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    std::fs::write(
        dir.join("tokenizer_config.json"),
        json!({"bos_token": "<s>",
               "chat_template": "{{ bos_token }}{% for m in messages %}{{ m.content }} {% endfor %}"})
        .to_string(),
    )
    .unwrap();
}

#[tokio::test]
async fn with_a_tokenizer_text_and_chat_prompts_are_tokenized_like_body_mode() {
    let dir = std::env::temp_dir().join(format!("ic-sim-tok-{}", std::process::id()));
    word_tokenizer(&dir);
    let engine = spawn(EngineConfig {
        tokenizer: Some(dir.clone()),
        ..mk_config()
    })
    .await
    .unwrap();
    let http = Http::new(&engine);
    // "<s> w0..w6": 8 tokens, two blocks of 4.
    let text = (0..7)
        .map(|i| format!("w{i}"))
        .collect::<Vec<_>>()
        .join(" ");
    let r = http
        .send(
            "POST",
            "/v1/completions",
            &json!({"model": "m", "prompt": text, "max_tokens": 1}).to_string(),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.json);
    assert_eq!(r.json["usage"]["prompt_tokens"], 8);
    assert_eq!(r.json["object"], "text_completion");
    assert_eq!(r.json["choices"][0]["text"], "");
    // The chat rendering is the same ids ("<s>" from the template, no second BOS),
    // so it hits the cache; as in vLLM the last prompt token is always computed,
    // so of two full cached blocks only the first counts as a hit.
    let chat =
        json!({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": text}]});
    let r = http
        .send("POST", "/v1/chat/completions", &chat.to_string())
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.json);
    assert_eq!(r.json["usage"]["prompt_tokens"], 8);
    assert_eq!(r.json["usage"]["prompt_tokens_details"]["cached_tokens"], 4);
    // Answered in the chat shape OpenAI clients parse.
    assert_eq!(r.json["object"], "chat.completion");
    assert_eq!(r.json["model"], "m");
    assert_eq!(r.json["choices"][0]["message"]["role"], "assistant");
    assert_eq!(r.json["choices"][0]["finish_reason"], "length");
    assert!(
        r.json["id"]
            .as_str()
            .is_some_and(|id| id.starts_with("chatcmpl-"))
    );
    assert!(r.json["created"].as_u64().is_some_and(|t| t > 0));
    // The cache holds the ids the product computes: a request of exactly these
    // ids gets the same hit (the lookup, too, leaves the last token to compute),
    // and one that differs in block 0 gets none.
    assert_eq!(
        http.cached_prefix(&[0, 10, 11, 12, 13, 14, 15, 16]).await["cached_tokens"],
        4
    );
    assert_eq!(
        http.cached_prefix(&[1, 10, 11, 12, 13, 14, 15, 16]).await["cached_tokens"],
        0
    );
    engine.shutdown().await;

    // Without a tokenizer: text is refused with a pointer to the flag.
    let plain = spawn(mk_config()).await.unwrap();
    let http = Http::new(&plain);
    let r = http
        .send(
            "POST",
            "/v1/completions",
            &json!({"model": "m", "prompt": "w1"}).to_string(),
        )
        .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    let r = http
        .send("POST", "/v1/chat/completions", &chat.to_string())
        .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    plain.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// When a completion's response headers arrive, and when its body does.
async fn timed_completion(
    http: &Http,
    prompt: &[u32],
    max_tokens: u32,
    stream: bool,
) -> (f64, f64, Value) {
    let body = json!({"model": "m", "prompt": prompt, "max_tokens": max_tokens, "stream": stream});
    let req = Request::builder()
        .method("POST")
        .uri(format!("{}/v1/completions", http.base))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let sent = std::time::Instant::now();
    let resp = http.client.request(req).await.unwrap();
    let headers_ms = sent.elapsed().as_secs_f64() * 1e3;
    assert_eq!(resp.status(), StatusCode::OK);
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    let body_ms = sent.elapsed().as_secs_f64() * 1e3;
    (headers_ms, body_ms, serde_json::from_slice(&bytes).unwrap())
}

#[tokio::test]
async fn a_streamed_completion_answers_its_headers_with_the_first_token() {
    // The simple model too, with costs large enough to time over loopback.
    let simple = EngineConfig {
        prefill_us_per_token: 200.0,
        decode_us_per_token: 2000.0,
        ..mk_config()
    };
    for config in [mk_batched(), simple] {
        let engine = spawn(config).await.unwrap();
        let http = Http::new(&engine);
        // 40 output tokens: the decode is far longer than the prefill.
        let (headers, body, json) = timed_completion(&http, &tokens(5000, 16), 40, true).await;
        let ttft = json["sim"]["ttft_ms"].as_f64().unwrap();
        let decode = json["sim"]["decode_ms"].as_f64().unwrap();
        assert!(decode > 2.0 * ttft, "{json}");
        assert!(
            headers >= ttft * 0.9,
            "headers at {headers} ms, first token at {ttft} ms"
        );
        assert!(
            headers < ttft + decode / 2.0,
            "headers at {headers} ms: not with the first token ({ttft} ms)"
        );
        assert!(
            body >= ttft + decode * 0.9,
            "body at {body} ms, done at {} ms",
            ttft + decode
        );
        // Not streamed: the headers come with the whole completion.
        let (headers, _, json) = timed_completion(&http, &tokens(6000, 16), 40, false).await;
        let done =
            json["sim"]["ttft_ms"].as_f64().unwrap() + json["sim"]["decode_ms"].as_f64().unwrap();
        assert!(
            headers >= done * 0.9,
            "headers at {headers} ms, done at {done} ms"
        );
        engine.shutdown().await;
    }
}
