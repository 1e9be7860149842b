//! One replica's engine KV event stream: a ZMQ SUB socket, sequence tracking,
//! replay of missed batches, and the hand-off to the index.
//!
//! ```text
//!  reader task: SUB recv [topic, seq, payload] ──bounded queue (ordered)──▶
//!  apply task:  seq check ─ gap ─▶ replay (DEALER) or clear
//!                         ─ went back ─▶ clear (engine restart)
//!               decode ─▶ translate ─▶ Router::ingest
//! ```
//!
//! A full queue makes the reader wait; the engine's PUB then drops at its
//! high-water mark, which shows here as a gap and is repaired by replay. The index
//! is never left knowingly wrong: anything that cannot be repaired clears the
//! replica. Dropping the [`Subscriber`] stops both tasks.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use super::decode::{self, EngineEvent};
use super::frames;
use super::metrics::KvEventMetrics;
use super::translate::{ReplicaChains, Skipped};
use crate::core::Router;
use crate::core::index::{IndexEvent, IngestBatch};
use crate::core::scope::ScopeKey;
use crate::core::time::Timestamp;

/// The replay socket's end-of-replay sequence number.
const END_OF_REPLAY: u64 = u64::MAX;

/// Everything one subscriber needs; any change means a new subscriber.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct SubscriberConfig {
    pub scope: ScopeKey,
    pub replica_id: String,
    /// `host:port` of the replica (refreshes its registration on every batch).
    pub address: String,
    /// `tcp://host:port` to connect to; `bind:tcp://…` or a `*`/`0.0.0.0` host to
    /// bind (engines that connect).
    pub endpoint: String,
    pub replay_endpoint: Option<String>,
    /// ZMQ topic prefix; empty takes everything.
    pub topic: String,
    pub queue_capacity: usize,
    pub replay_timeout: Duration,
    pub max_mappings: usize,
}

/// A running subscriber; dropping it stops it.
#[derive(Debug)]
pub struct Subscriber {
    tasks: [JoinHandle<()>; 2],
    metrics: Arc<KvEventMetrics>,
}

impl Drop for Subscriber {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
        self.metrics.subscriber_stopped();
    }
}

/// One received message, before decoding.
struct Frame {
    seq: u64,
    payload: Bytes,
}

impl Subscriber {
    /// Starts the reader and apply tasks (needs a Tokio runtime).
    pub fn spawn(
        config: SubscriberConfig,
        router: Arc<Router>,
        metrics: Arc<KvEventMetrics>,
    ) -> Self {
        let (tx, rx) = mpsc::channel(config.queue_capacity.max(1));
        metrics.subscriber_started();
        let reader = tokio::spawn(read_loop(config.clone(), tx, metrics.clone()));
        let apply = tokio::spawn(apply_loop(config, rx, router, metrics.clone()));
        Self {
            tasks: [reader, apply],
            metrics,
        }
    }
}

/// `(bind?, zmq endpoint)` of a configured endpoint.
fn socket_target(endpoint: &str) -> (bool, String) {
    if let Some(rest) = endpoint.strip_prefix("bind:") {
        return (true, rest.replace("://*:", "://0.0.0.0:"));
    }
    if endpoint.contains("://*:") || endpoint.contains("://0.0.0.0:") {
        return (true, endpoint.replace("://*:", "://0.0.0.0:"));
    }
    (false, endpoint.to_string())
}

async fn open_sub(config: &SubscriberConfig) -> zeromq::ZmqResult<SubSocket> {
    let mut socket = SubSocket::new();
    let (bind, target) = socket_target(&config.endpoint);
    if bind {
        socket.bind(&target).await?;
    } else {
        socket.connect(&target).await?;
    }
    socket.subscribe(&config.topic).await?;
    Ok(socket)
}

/// Receives messages forever, reconnecting with backoff.
async fn read_loop(
    config: SubscriberConfig,
    tx: mpsc::Sender<Frame>,
    metrics: Arc<KvEventMetrics>,
) {
    let mut backoff = Duration::from_millis(50);
    loop {
        let mut socket = match open_sub(&config).await {
            Ok(s) => {
                metrics.connect(true);
                backoff = Duration::from_millis(50);
                s
            }
            Err(e) => {
                metrics.connect(false);
                tracing::debug!(replica = %config.replica_id, endpoint = %config.endpoint,
                    error = %e, "KV event socket not up; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
                continue;
            }
        };
        loop {
            match socket.recv().await {
                Ok(msg) => match frame_of(msg) {
                    Some(frame) => {
                        if tx.send(frame).await.is_err() {
                            return; // the apply task is gone: we are stopping
                        }
                    }
                    None => metrics.decode_error("frame"),
                },
                Err(e) => {
                    tracing::debug!(replica = %config.replica_id, error = %e,
                        "KV event socket failed; reconnecting");
                    break;
                }
            }
        }
        drop(socket);
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}

/// `[topic, seq (8 bytes BE), payload]`; anything else is malformed.
fn frame_of(msg: ZmqMessage) -> Option<Frame> {
    let (seq, payload) = frames::published(msg.into_vec())?;
    Some(Frame { seq, payload })
}

/// The per-replica state of the apply task.
struct Applier {
    config: SubscriberConfig,
    router: Arc<Router>,
    metrics: Arc<KvEventMetrics>,
    chains: ReplicaChains,
    last_seq: Option<u64>,
    out: Vec<IndexEvent>,
}

async fn apply_loop(
    config: SubscriberConfig,
    mut rx: mpsc::Receiver<Frame>,
    router: Arc<Router>,
    metrics: Arc<KvEventMetrics>,
) {
    let chains = ReplicaChains::new(&config.scope.hash_scheme, config.max_mappings);
    let mut applier = Applier {
        config,
        router,
        metrics,
        chains,
        last_seq: None,
        out: Vec::new(),
    };
    // Whatever this replica held came from an earlier stream we can no longer
    // follow (removals would not translate): start from empty.
    applier.clear("start");
    while let Some(frame) = rx.recv().await {
        applier.on_frame(frame).await;
    }
}

impl Applier {
    async fn on_frame(&mut self, frame: Frame) {
        match self.last_seq {
            Some(last) if frame.seq <= last => {
                // seq starts at 0 per engine process: it went back, the engine restarted.
                self.clear("restart");
            }
            Some(last) if frame.seq > last + 1 => {
                self.metrics.gap();
                match replay(&self.config, last + 1, frame.seq).await {
                    Ok(batches) => {
                        self.metrics.replay(true);
                        for b in batches {
                            self.apply(&b.payload);
                        }
                    }
                    Err(why) => {
                        self.metrics.replay(false);
                        tracing::warn!(replica = %self.config.replica_id, from = last + 1,
                            to = frame.seq, why, "KV event replay failed; clearing the replica");
                        self.clear("replay_failed");
                    }
                }
            }
            _ => {}
        }
        self.apply(&frame.payload);
        self.last_seq = Some(frame.seq);
    }

    /// Drops everything the index holds for this replica.
    fn clear(&mut self, cause: &'static str) {
        self.chains.reset();
        self.metrics.reset(cause);
        self.ingest(&[IndexEvent::Cleared]);
    }

    fn apply(&mut self, payload: &[u8]) {
        let batch = match decode::decode_batch(payload) {
            Ok(b) => b,
            Err(e) => {
                self.metrics.decode_error("payload");
                tracing::debug!(replica = %self.config.replica_id, error = %e, "KV event batch not decoded");
                return;
            }
        };
        self.metrics.batch();
        let engine_clears = batch
            .events
            .iter()
            .filter(|e| matches!(e, EngineEvent::AllBlocksCleared))
            .count();
        for _ in 0..engine_clears {
            self.metrics.reset("engine");
        }
        let mut out = std::mem::take(&mut self.out);
        out.clear();
        let Skipped { events, overflowed } = self.chains.translate(&batch.events, &mut out);
        if overflowed {
            self.metrics.reset("overflow");
        }
        self.metrics
            .events("skipped", u64::from(events) + u64::from(batch.skipped));
        self.ingest(&out);
        self.out = out;
        if batch.ts > 0.0 {
            let now = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            self.metrics.lag(now - batch.ts);
        }
    }

    fn ingest(&self, events: &[IndexEvent]) {
        if events.is_empty() {
            return;
        }
        let batch = IngestBatch {
            scope: self.config.scope.as_ref(),
            replica_id: &self.config.replica_id,
            endpoint: &self.config.address,
            events,
        };
        match self.router.ingest(&batch, Timestamp::now()) {
            Ok(o) => {
                self.metrics.events("applied", u64::from(o.applied));
                self.metrics.events("rejected", u64::from(o.rejected));
            }
            Err(e) => {
                self.metrics.events("rejected", events.len() as u64);
                tracing::warn!(replica = %self.config.replica_id, error = %e, "KV events refused");
            }
        }
    }
}

/// The batches `from..until` from the engine's replay socket, in order, or why not.
async fn replay(config: &SubscriberConfig, from: u64, until: u64) -> Result<Vec<Frame>, String> {
    let Some(endpoint) = config.replay_endpoint.as_deref() else {
        return Err("no replay endpoint".into());
    };
    let work = async {
        let mut socket = DealerSocket::new();
        socket.connect(endpoint).await.map_err(|e| e.to_string())?;
        let request = ZmqMessage::try_from(vec![
            Bytes::new(),
            Bytes::copy_from_slice(&from.to_be_bytes()),
        ])
        .map_err(|e| e.to_string())?;
        socket.send(request).await.map_err(|e| e.to_string())?;
        let mut got = Vec::new();
        loop {
            let msg = socket.recv().await.map_err(|e| e.to_string())?;
            let (seq, payload) = frames::replay_reply(&msg.into_vec())?;
            if seq == END_OF_REPLAY {
                break;
            }
            if (from..until).contains(&seq) {
                got.push(Frame { seq, payload });
            }
        }
        Ok::<_, String>(got)
    };
    let got = tokio::time::timeout(config.replay_timeout, work)
        .await
        .map_err(|_| "replay timed out".to_string())??;
    // Complete and in order, or useless.
    let complete =
        got.len() as u64 == until - from && got.iter().zip(from..).all(|(f, want)| f.seq == want);
    if complete {
        Ok(got)
    } else {
        Err(format!(
            "replay returned {} of the {} missing batches",
            got.len(),
            until - from
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    }

    #[test]
    fn frames_must_be_topic_seq_payload() {
        let msg = |v: Vec<&[u8]>| {
            ZmqMessage::try_from(
                v.into_iter()
                    .map(Bytes::copy_from_slice)
                    .collect::<Vec<_>>(),
            )
            .unwrap()
        };
        let ok = frame_of(msg(vec![b"kv", &7u64.to_be_bytes(), b"p"])).unwrap();
        assert_eq!((ok.seq, &ok.payload[..]), (7, &b"p"[..]));
        assert!(frame_of(msg(vec![b"kv", &[0; 7], b"p"])).is_none());
        assert!(frame_of(msg(vec![b"kv", &7u64.to_be_bytes()])).is_none());
        assert!(frame_of(msg(vec![b"kv", &7u64.to_be_bytes(), b"p", b"x"])).is_none());
    }
}
