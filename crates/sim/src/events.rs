//! The simulated engine's KV events, published exactly as vLLM publishes them
//! (docs/operations.md, "Engine KV event streams"): msgpack batches on a ZMQ PUB socket and a
//! ROUTER socket that replays the last batches.
//!
//! ```text
//!  engine (under its cache lock) ──ticket()──▶ Ticket
//!  engine (prefill done) ──Ticket::publish(events)──▶ Sequencer (releases in ticket order)
//!      ──unbounded channel──▶ publisher task: encode, seq, buffer, PUB [topic, seq, payload]
//!  DEALER [b"", start] ──▶ replay task (ROUTER) ──▶ [b"", seq, payload]… [b"", u64::MAX, b""]
//! ```
//!
//! Why tickets: requests finish prefill in a different order than they were
//! admitted, but the cache changed in admission order. A request that evicts a
//! block another request just stored must not have its removal published first,
//! or a subscriber would end up holding a block the engine dropped. So every
//! cache change takes a ticket under the engine's lock, and batches leave in
//! ticket order, each once its own prefill is done and every earlier one has
//! left. Publishing never blocks a request: the channel is unbounded and the
//! PUB socket drops for slow subscribers (they repair gaps with replay).

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use parking_lot::Mutex;
use rmpv::Value;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use super::cache::StoredRun;

/// Batches kept for replay (vLLM's default buffer).
pub const REPLAY_BUFFER: usize = 10_000;
/// The replay socket's end-of-replay sequence number.
pub const END_OF_REPLAY: u64 = u64::MAX;
/// The storage medium the simulated engine reports (vLLM's main pool).
const MEDIUM: &str = "GPU";

/// How events are laid out in a batch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum EventFormat {
    /// Maps tagged by `"type"` (vLLM since mid-2026).
    #[default]
    Map,
    /// Arrays with the tag first (older vLLM).
    Array,
}

/// One KV cache event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvEvent {
    Stored(StoredRun),
    Removed(Vec<u64>),
    Cleared,
}

/// The events of one admission: the removals first (the engine evicts before it
/// fills the new blocks), then the stored run.
pub fn admission_events(removed: Vec<u64>, stored: Option<StoredRun>) -> Vec<KvEvent> {
    let mut events = Vec::with_capacity(2);
    if !removed.is_empty() {
        events.push(KvEvent::Removed(removed));
    }
    if let Some(run) = stored {
        events.push(KvEvent::Stored(run));
    }
    events
}

/// The msgpack payload of one batch: `[ts, events, data_parallel_rank: nil]`.
pub fn encode_batch(ts: f64, events: &[KvEvent], format: EventFormat) -> Vec<u8> {
    let batch = Value::Array(vec![
        Value::F64(ts),
        Value::Array(events.iter().map(|e| event_value(e, format)).collect()),
        Value::Nil,
    ]);
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &batch).expect("writing msgpack to a Vec cannot fail");
    out
}

fn hashes(hs: &[u64]) -> Value {
    Value::Array(hs.iter().map(|&h| Value::from(h)).collect())
}

fn event_value(event: &KvEvent, format: EventFormat) -> Value {
    // (key, value) in vLLM's field order; the array form is the values alone.
    let (tag, fields): (&str, Vec<(&str, Value)>) = match event {
        KvEvent::Stored(run) => (
            "BlockStored",
            vec![
                ("block_hashes", hashes(&run.block_hashes)),
                (
                    "parent_block_hash",
                    run.parent.map_or(Value::Nil, Value::from),
                ),
                (
                    "token_ids",
                    Value::Array(run.token_ids.iter().map(|&t| Value::from(t)).collect()),
                ),
                ("block_size", Value::from(run.block_size)),
                ("lora_id", Value::Nil),
                ("medium", Value::from(MEDIUM)),
                ("lora_name", Value::Nil),
            ],
        ),
        KvEvent::Removed(hs) => (
            "BlockRemoved",
            vec![
                ("block_hashes", hashes(hs)),
                ("medium", Value::from(MEDIUM)),
            ],
        ),
        KvEvent::Cleared => ("AllBlocksCleared", Vec::new()),
    };
    match format {
        EventFormat::Map => Value::Map(
            std::iter::once(("type", Value::from(tag)))
                .chain(fields)
                .map(|(k, v)| (Value::from(k), v))
                .collect(),
        ),
        EventFormat::Array => Value::Array(
            std::iter::once(Value::from(tag))
                .chain(fields.into_iter().map(|(_, v)| v))
                .collect(),
        ),
    }
}

/// Where and how to publish.
#[derive(Clone, Debug)]
pub struct PublisherConfig {
    /// `tcp://host:port` the PUB socket binds (port 0: any; `*` means all interfaces).
    pub events_endpoint: String,
    /// `tcp://host:port` the replay ROUTER socket binds.
    pub replay_endpoint: String,
    pub topic: String,
    pub format: EventFormat,
}

/// A bound publisher; dropping it (or [`EventPublisher::stop`]) closes its sockets.
#[derive(Debug)]
pub struct EventPublisher {
    sequencer: Arc<Sequencer>,
    events_endpoint: String,
    replay_endpoint: String,
    tasks: [JoinHandle<()>; 2],
}

impl EventPublisher {
    /// Binds both sockets and starts the publisher and replay tasks.
    pub async fn bind(config: PublisherConfig) -> anyhow::Result<Self> {
        let mut publisher = PubSocket::new();
        let events_endpoint = publisher
            .bind(&bind_target(&config.events_endpoint))
            .await
            .map_err(|e| anyhow::anyhow!("KV events socket {}: {e}", config.events_endpoint))?
            .to_string();
        let mut replay = RouterSocket::new();
        let replay_endpoint = replay
            .bind(&bind_target(&config.replay_endpoint))
            .await
            .map_err(|e| anyhow::anyhow!("KV replay socket {}: {e}", config.replay_endpoint))?
            .to_string();
        let buffer = Arc::new(Mutex::new(VecDeque::with_capacity(REPLAY_BUFFER)));
        let (tx, rx) = mpsc::unbounded_channel();
        let publish = tokio::spawn(publish_loop(
            publisher,
            rx,
            buffer.clone(),
            Bytes::from(config.topic.into_bytes()),
            config.format,
        ));
        let replay = tokio::spawn(replay_loop(replay, buffer));
        Ok(Self {
            sequencer: Arc::new(Sequencer {
                order: Mutex::new(Order::default()),
                tx,
            }),
            events_endpoint,
            replay_endpoint,
            tasks: [publish, replay],
        })
    }

    /// The PUB socket's resolved endpoint (`tcp://ip:port`).
    pub fn events_endpoint(&self) -> &str {
        &self.events_endpoint
    }

    /// The replay socket's resolved endpoint.
    pub fn replay_endpoint(&self) -> &str {
        &self.replay_endpoint
    }

    /// A place in the publishing order. Take it in the same critical section as
    /// the cache change it will describe.
    pub fn ticket(&self) -> Ticket {
        let mut order = self.sequencer.order.lock();
        let number = order.issued;
        order.issued += 1;
        Ticket {
            number,
            sequencer: Some(self.sequencer.clone()),
        }
    }

    /// Stops publishing and closes both sockets.
    pub fn stop(&self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl Drop for EventPublisher {
    fn drop(&mut self) {
        self.stop();
    }
}

/// One cache change's place in the publishing order. Dropping it unpublished
/// releases its place with no events, so later batches are never held up.
#[derive(Debug)]
pub struct Ticket {
    number: u64,
    sequencer: Option<Arc<Sequencer>>,
}

impl Ticket {
    /// Publishes `events` as one batch once every earlier ticket is released (an
    /// empty batch sends nothing). Never blocks.
    pub fn publish(mut self, events: Vec<KvEvent>) {
        if let Some(s) = self.sequencer.take() {
            s.release(self.number, events);
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if let Some(s) = self.sequencer.take() {
            s.release(self.number, Vec::new());
        }
    }
}

/// Releases batches in ticket order.
#[derive(Debug)]
struct Sequencer {
    order: Mutex<Order>,
    tx: mpsc::UnboundedSender<Vec<KvEvent>>,
}

#[derive(Debug, Default)]
struct Order {
    issued: u64,
    next: u64,
    waiting: BTreeMap<u64, Vec<KvEvent>>,
}

impl Sequencer {
    fn release(&self, number: u64, events: Vec<KvEvent>) {
        // Sending under the lock keeps the channel in ticket order.
        let mut order = self.order.lock();
        order.waiting.insert(number, events);
        loop {
            let next = order.next;
            let Some(events) = order.waiting.remove(&next) else {
                break;
            };
            order.next += 1;
            // Empty batches are not published (no seq is used), and a closed
            // channel means the publisher was stopped.
            if !events.is_empty() {
                let _ = self.tx.send(events);
            }
        }
    }
}

/// The zeromq crate binds IP addresses only: `*` becomes all interfaces.
fn bind_target(endpoint: &str) -> String {
    endpoint.replace("://*:", "://0.0.0.0:")
}

type ReplayBuffer = Arc<Mutex<VecDeque<(u64, Bytes)>>>;

async fn publish_loop(
    mut socket: PubSocket,
    mut rx: mpsc::UnboundedReceiver<Vec<KvEvent>>,
    buffer: ReplayBuffer,
    topic: Bytes,
    format: EventFormat,
) {
    let mut seq: u64 = 0;
    while let Some(events) = rx.recv().await {
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let payload = Bytes::from(encode_batch(ts, &events, format));
        {
            // Buffered before it is sent, so a subscriber that sees the gap can
            // already replay it.
            let mut buf = buffer.lock();
            if buf.len() == REPLAY_BUFFER {
                buf.pop_front();
            }
            buf.push_back((seq, payload.clone()));
        }
        let frames = vec![
            topic.clone(),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            payload,
        ];
        match ZmqMessage::try_from(frames) {
            Ok(msg) => {
                if let Err(e) = socket.send(msg).await {
                    tracing::warn!(seq, error = %e, "KV event batch not sent");
                }
            }
            Err(e) => tracing::warn!(seq, error = %e, "KV event message not built"),
        }
        seq += 1;
    }
}

/// Answers `[identity, b"", start_seq]` with every buffered batch from
/// `start_seq` on, then the end marker.
async fn replay_loop(mut socket: RouterSocket, buffer: ReplayBuffer) {
    loop {
        let msg = match socket.recv().await {
            Ok(m) => m,
            Err(e) => {
                tracing::debug!(error = %e, "KV replay socket receive failed");
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                continue;
            }
        };
        let frames = msg.into_vec();
        // The ROUTER prepends the peer's identity: [identity, b"", start_seq].
        let [identity, .., start] = frames.as_slice() else {
            continue;
        };
        let Ok(start) = <[u8; 8]>::try_from(&start[..]).map(u64::from_be_bytes) else {
            tracing::debug!("KV replay request without an 8-byte start seq; ignored");
            continue;
        };
        let batches: Vec<(u64, Bytes)> = buffer
            .lock()
            .iter()
            .filter(|(seq, _)| *seq >= start)
            .cloned()
            .collect();
        let end = (END_OF_REPLAY, Bytes::new());
        for (seq, payload) in batches.into_iter().chain(std::iter::once(end)) {
            let reply = vec![
                identity.clone(),
                Bytes::new(),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                payload,
            ];
            let sent = match ZmqMessage::try_from(reply) {
                Ok(m) => socket.send(m).await.map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            if let Err(e) = sent {
                tracing::debug!(seq, error = %e, "KV replay reply not sent");
                break;
            }
        }
    }
}

#[cfg(test)]
mod tests;
