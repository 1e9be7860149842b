//! One replica's engine KV event stream: a ZMQ SUB connection, sequence tracking,
//! warm start and replay of missed batches, and the hand-off to the index.
//!
//! ```text
//!  reader task: SUB (ZMTP, size-limited) [topic, seq, payload] ──bounded queue──▶
//!  apply task:  warm start: replay from seq 0 (live batches wait in the queue),
//!                 then drop queued live batches with a seq the replay covered
//!               seq check ─ gap ─▶ replay (DEALER), else mark the replica stale
//!                         ─ went back ─▶ clear (engine restart)
//!               decode ─▶ translate ─▶ Router::ingest
//! ```
//!
//! **Warm start.** When the subscriber first connects (a new sidecar, a restart, a
//! new replica) it asks the engine's replay socket for everything still buffered
//! (from seq 0) while live batches queue up, applies it, then drops the queued live
//! batches the replay already covered. If the buffer reaches back to seq 0 the
//! replay is the replica's whole history: the replica is cleared first and rebuilt
//! exactly. If it does not (the engine published more than its buffer holds) or the
//! replay fails, what the index already holds for the replica is kept.
//!
//! **Staleness.** A gap that replay cannot fill (after a few retries) no longer
//! clears the replica: its entries are kept and it is marked *possibly stale*
//! (metric `kv_events_stale_replicas`, `kvEventsStale` in `/snapshot`), and a full
//! resync (replay from 0) is retried with backoff. A possible miss beats a certain
//! cold replica: the kept entries are right except for what the lost batches
//! changed, while clearing throws all of them away. The mark goes when the replica
//! is exact again (a resync reaching seq 0, an engine restart, `AllBlocksCleared`)
//! or one eviction TTL after the loss (every entry a lost removal left behind has
//! expired by then).
//!
//! **Data-parallel ranks.** An engine with data-parallel ranks runs one
//! subscriber per rank (`crd/data_parallel.rs` says where each publishes), all feeding the one
//! replica, each with its own seq, warm start, replay, staleness and restart
//! detection. The index counts references per (replica, block), so two ranks
//! storing the same block hold it twice, and one rank's removal leaves the
//! other's. What the index cannot do is drop one rank's references only, so when
//! a replica has several ranks each subscriber keeps the own-chain hashes its rank
//! holds (with counts): a removal of a block the rank does not hold is dropped
//! (it would release a sibling's reference), and the rank's clears (its
//! `AllBlocksCleared`, its restart, its exact warm start) become removals of
//! exactly those blocks. The replica keeps the other ranks' blocks.
//!
//! **In a fleet** ([`super::relay`]) every batch is offered to the engine's
//! relay before it is applied: applied (and published) when this sidecar holds
//! the engine's lease or NATS is unreachable, left to the fleet's stream
//! otherwise. Becoming the relay starts a resync (a replay from seq 0), so the
//! stream gets what the previous relay did not publish.
//!
//! [`Subscriber::close`] stops it cleanly (the reader closes its socket, the apply
//! task finishes what is queued); dropping the [`Subscriber`] aborts both tasks.
//! Both run in a `kv_events` span carrying tenant, model, hash scheme, replica and
//! endpoint.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, mpsc, watch};
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;
use tracing::Instrument;

use super::decode::{self, EngineEvent};
use super::frames::{self, replay_reply};
use super::metrics::{KvEventMetrics, StaleKey};
use super::relay::{EngineRelay, Relay};
use super::translate::{ReplicaChains, Skipped};
use super::zmtp::{Connection, Limits, SocketType, ZmtpError};
use crate::adapters::apply::apply_in_place;
use crate::core::Router;
use crate::core::index::{IndexEvent, IngestBatch, Tier};
use crate::core::scope::ScopeKey;
use crate::core::time::Timestamp;

/// The replay socket's end-of-replay sequence number.
const END_OF_REPLAY: u64 = u64::MAX;
/// Attempts to replay one gap before the replica is marked stale.
const GAP_ATTEMPTS: u32 = 3;
/// A warm start may take this many replay timeouts (10,000 buffered batches).
const WARM_START_TIMEOUTS: u32 = 30;
/// First and longest wait between resyncs of a stale replica.
const RESYNC_FIRST: Duration = Duration::from_secs(1);
const RESYNC_MAX: Duration = Duration::from_secs(60);
/// Engines connected at once to a bound (`bind:`) endpoint.
const MAX_BOUND_PEERS: usize = 16;
/// A ZMTP handshake longer than this is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

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
    /// How long a replay may stay silent (and a gap replay may take).
    pub replay_timeout: Duration,
    pub max_mappings: usize,
    /// This stream's data-parallel rank, and how many ranks feed the replica
    /// (1: the replica is this stream alone, and its clears clear the replica).
    pub rank: u32,
    pub ranks: u32,
}

/// A running subscriber; dropping it stops it.
#[derive(Debug)]
pub struct Subscriber {
    tasks: [JoinHandle<()>; 2],
    stop: watch::Sender<bool>,
    metrics: Arc<KvEventMetrics>,
    stale_key: StaleKey,
}

impl Drop for Subscriber {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
        self.metrics.set_stale(&self.stale_key, false);
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
        Self::spawn_relayed(config, router, metrics, None)
    }

    /// [`Self::spawn`], offering every batch to `relay` first (see
    /// [`super::relay`]).
    pub fn spawn_relayed(
        config: SubscriberConfig,
        router: Arc<Router>,
        metrics: Arc<KvEventMetrics>,
        relay: Option<&dyn Relay>,
    ) -> Self {
        let relay = relay.map(|r| r.join(&config.scope, &config.replica_id, config.rank));
        let (tx, rx) = mpsc::channel(config.queue_capacity.max(1));
        let (connected_tx, connected_rx) = watch::channel(false);
        metrics.subscriber_started();
        let stale_key = stale_key(&config);
        let span = tracing::info_span!("kv_events",
            tenant = %config.scope.tenant, model = %config.scope.model,
            hash_scheme = %config.scope.hash_scheme, replica = %config.replica_id,
            rank = config.rank, endpoint = %config.endpoint);
        let (stop, mut stopped) = watch::channel(false);
        let read = read_loop(config.clone(), tx, Arc::new(connected_tx), metrics.clone());
        let reader = tokio::spawn(
            async move {
                tokio::select! {
                    () = read => {}
                    // Dropping the read loop closes the socket and the queue's sender.
                    _ = stopped.wait_for(|s| *s) => {}
                }
            }
            .instrument(span.clone()),
        );
        let apply = tokio::spawn(
            apply_loop(config, rx, connected_rx, router, metrics.clone(), relay).instrument(span),
        );
        Self {
            tasks: [reader, apply],
            stop,
            metrics,
            stale_key,
        }
    }

    /// Stops cleanly: the socket is closed, the batches already queued are
    /// applied, and both tasks have ended, or `timeout` passed (then they are
    /// aborted). Returns whether both ended on their own.
    pub async fn close(mut self, timeout: Duration) -> bool {
        self.stop.send_replace(true);
        let deadline = tokio::time::Instant::now() + timeout;
        let mut clean = true;
        for task in &mut self.tasks {
            clean &= matches!(tokio::time::timeout_at(deadline, task).await, Ok(Ok(())));
        }
        clean
    }
}

fn stale_key(config: &SubscriberConfig) -> StaleKey {
    (
        config.scope.tenant.to_string(),
        config.scope.model.to_string(),
        config.scope.hash_scheme.to_string(),
        config.replica_id.clone(),
        config.rank,
    )
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

/// `host:port` of a `tcp://host:port` endpoint (the only transport engines use
/// across hosts).
fn tcp_target(endpoint: &str) -> Result<&str, String> {
    endpoint
        .strip_prefix("tcp://")
        .filter(|rest| !rest.is_empty())
        .ok_or_else(|| format!("{endpoint}: only tcp:// endpoints are supported"))
}

/// Counts a connection we dropped, by why.
fn note_dropped(metrics: &KvEventMetrics, e: &ZmtpError) {
    match e {
        ZmtpError::Oversized { .. } => metrics.dropped_connection("oversized"),
        ZmtpError::Protocol(_) | ZmtpError::TooManyFrames(_) => {
            metrics.dropped_connection("protocol")
        }
        ZmtpError::HandshakeTimeout => metrics.dropped_connection("handshake"),
        ZmtpError::Io(_) => {}
    }
}

/// Receives messages forever, reconnecting (or re-binding) with backoff.
async fn read_loop(
    config: SubscriberConfig,
    tx: mpsc::Sender<Frame>,
    connected: Arc<watch::Sender<bool>>,
    metrics: Arc<KvEventMetrics>,
) {
    let (bind, endpoint) = socket_target(&config.endpoint);
    let target = match tcp_target(&endpoint) {
        Ok(t) => t.to_string(),
        Err(why) => {
            metrics.connect(false);
            tracing::error!(replica = %config.replica_id, why, "KV event endpoint unusable");
            return;
        }
    };
    if bind {
        bind_loop(&config, &target, tx, connected, metrics).await;
    } else {
        connect_loop(&config, &target, tx, connected, metrics).await;
    }
}

async fn connect_loop(
    config: &SubscriberConfig,
    target: &str,
    tx: mpsc::Sender<Frame>,
    connected: Arc<watch::Sender<bool>>,
    metrics: Arc<KvEventMetrics>,
) {
    let mut backoff = Duration::from_millis(50);
    loop {
        let result = match TcpStream::connect(target).await {
            Ok(stream) => follow(stream, &config.topic, &tx, &connected, &metrics)
                .await
                .map(|()| backoff = Duration::from_millis(50)),
            Err(e) => {
                metrics.connect(false);
                Err(ZmtpError::Io(e))
            }
        };
        match result {
            Ok(()) if tx.is_closed() => return, // the apply task is gone: we are stopping
            Ok(()) => {}
            Err(e) => {
                note_dropped(&metrics, &e);
                tracing::debug!(replica = %config.replica_id, endpoint = %config.endpoint,
                    error = %e, "KV event connection failed; reconnecting");
            }
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}

/// Engines that connect to us: accept (a bounded number of) peers, each followed
/// by its own task; all feed the one queue.
async fn bind_loop(
    config: &SubscriberConfig,
    target: &str,
    tx: mpsc::Sender<Frame>,
    connected: Arc<watch::Sender<bool>>,
    metrics: Arc<KvEventMetrics>,
) {
    let mut backoff = Duration::from_millis(50);
    let listener = loop {
        match TcpListener::bind(target).await {
            Ok(l) => break l,
            Err(e) => {
                metrics.connect(false);
                tracing::warn!(replica = %config.replica_id, endpoint = %config.endpoint,
                    error = %e, "KV event endpoint cannot be bound; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
    };
    let mut peers = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, peer)) = accepted else { continue };
                if peers.len() >= MAX_BOUND_PEERS {
                    tracing::warn!(replica = %config.replica_id, %peer,
                        "too many engines connected to a KV event endpoint; refused");
                    continue;
                }
                let (tx, connected, metrics) = (tx.clone(), connected.clone(), metrics.clone());
                let topic = config.topic.clone();
                let replica = config.replica_id.clone();
                peers.spawn(async move {
                    if let Err(e) = follow(stream, &topic, &tx, &connected, &metrics).await {
                        note_dropped(&metrics, &e);
                        log_peer_error(&replica, peer, &e);
                    }
                });
            }
            Some(_) = peers.join_next(), if !peers.is_empty() => {}
        }
        if tx.is_closed() {
            return;
        }
    }
}

fn log_peer_error(replica: &str, peer: SocketAddr, e: &ZmtpError) {
    tracing::debug!(replica, %peer, error = %e, "KV event peer dropped");
}

/// One connection: handshake as SUB, subscribe, forward messages. `Ok` when the
/// queue is closed (stopping) or the peer closed cleanly.
async fn follow(
    stream: TcpStream,
    topic: &str,
    tx: &mpsc::Sender<Frame>,
    connected: &watch::Sender<bool>,
    metrics: &KvEventMetrics,
) -> Result<(), ZmtpError> {
    let mut conn = Connection::handshake(
        stream,
        SocketType::Sub,
        Limits::default(),
        HANDSHAKE_TIMEOUT,
    )
    .await?;
    conn.subscribe(topic.as_bytes()).await?;
    metrics.connect(true);
    connected.send_replace(true);
    loop {
        let msg = match conn.recv().await {
            Ok(m) => m,
            Err(ZmtpError::Io(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                return Ok(());
            }
            Err(e) => return Err(e),
        };
        match frame_of(msg) {
            Some(frame) => {
                if tx.send(frame).await.is_err() {
                    return Ok(());
                }
            }
            None => metrics.decode_error("frame"),
        }
    }
}

/// `[topic, seq (8 bytes BE), payload]`; anything else is malformed.
fn frame_of(msg: Vec<Bytes>) -> Option<Frame> {
    frames::published(msg).map(|(seq, payload)| Frame { seq, payload })
}

/// Asks `endpoint` (the engine's replay ROUTER) for every batch from `from` and
/// hands each to `each` in the order received, until the end marker or `each`
/// returns false. `idle` bounds every wait, `total` the whole replay.
async fn replay_stream(
    endpoint: &str,
    from: u64,
    idle: Duration,
    total: Duration,
    metrics: &KvEventMetrics,
    each: &mut (dyn FnMut(Frame) -> bool + Send),
) -> Result<(), String> {
    let target = tcp_target(endpoint)?;
    let work = async {
        let stream = tokio::time::timeout(idle, TcpStream::connect(target))
            .await
            .map_err(|_| "connecting timed out".to_string())?
            .map_err(|e| e.to_string())?;
        let on_err = |e: ZmtpError| {
            note_dropped(metrics, &e);
            e.to_string()
        };
        let mut conn = Connection::handshake(stream, SocketType::Dealer, Limits::default(), idle)
            .await
            .map_err(on_err)?;
        conn.send(&[&b""[..], &from.to_be_bytes()[..]])
            .await
            .map_err(on_err)?;
        loop {
            let msg = tokio::time::timeout(idle, conn.recv())
                .await
                .map_err(|_| "the replay went quiet".to_string())?
                .map_err(on_err)?;
            let (seq, payload) = replay_reply(&msg)?;
            if seq == END_OF_REPLAY {
                return Ok(());
            }
            if !each(Frame { seq, payload }) {
                return Ok(());
            }
        }
    };
    tokio::time::timeout(total, work)
        .await
        .map_err(|_| "the replay timed out".to_string())?
}

/// The per-replica state of the apply task.
struct Applier {
    config: SubscriberConfig,
    router: Arc<Router>,
    metrics: Arc<KvEventMetrics>,
    chains: ReplicaChains,
    /// The seq the next live batch should carry (`None` before the first batch
    /// when no warm start told us).
    next_seq: Option<u64>,
    out: Vec<IndexEvent>,
    stale_key: StaleKey,
    /// Possibly stale since, and until when at the latest (one eviction TTL).
    stale: Option<(Instant, Instant)>,
    /// Right after a warm start: live batches with a seq below `next_seq` were
    /// queued while the replay ran, which applied them already. Ends with the
    /// first live batch at or past `next_seq`.
    overlap: bool,
    /// The next resync of a stale replica, and the wait after that one.
    resync: Option<(Instant, Duration)>,
    /// With several ranks: the blocks this rank holds (see the module docs).
    rank_blocks: Option<RankBlocks>,
    /// In a fleet: the engine's relay (see [`super::relay`]).
    relay: Option<Box<dyn EngineRelay>>,
}

/// The own-chain blocks one data-parallel rank holds, per tier (`None` = GPU),
/// with how many times it stored each (engines do not deduplicate).
#[derive(Debug, Default)]
struct RankBlocks {
    held: HashMap<(u64, Option<Tier>), u32, foldhash::fast::RandomState>,
}

impl RankBlocks {
    fn add(&mut self, hashes: &[u64], tier: Option<Tier>) {
        for h in hashes {
            *self.held.entry((*h, tier)).or_default() += 1;
        }
    }

    /// Keeps the removals of blocks this rank holds in `tier`; false if none is left.
    fn take(&mut self, hashes: &mut Vec<u64>, tier: Option<Tier>) -> bool {
        hashes.retain(|h| match self.held.get_mut(&(*h, tier)) {
            Some(n) => {
                *n -= 1;
                if *n == 0 {
                    self.held.remove(&(*h, tier));
                }
                true
            }
            None => false,
        });
        !hashes.is_empty()
    }

    /// Rewrites `events` so they touch only this rank's references: removals of
    /// blocks it does not hold are dropped, a clear removes what it holds (in
    /// every tier).
    fn scope(&mut self, events: &mut Vec<IndexEvent>) {
        let mut i = 0;
        while i < events.len() {
            let keep = match &mut events[i] {
                IndexEvent::Stored { hashes, .. } => {
                    self.add(hashes, None);
                    true
                }
                IndexEvent::TierStored { tier, hashes } => {
                    self.add(hashes, Some(*tier));
                    true
                }
                IndexEvent::Removed { hashes } => self.take(hashes, None),
                IndexEvent::TierRemoved { tier, hashes } => {
                    let tier = *tier;
                    self.take(hashes, Some(tier))
                }
                IndexEvent::Cleared => {
                    let mut by_tier: Vec<(Option<Tier>, Vec<u64>)> = Vec::new();
                    for ((h, tier), n) in self.held.drain() {
                        let at = match by_tier.iter().position(|(t, _)| *t == tier) {
                            Some(at) => at,
                            None => {
                                by_tier.push((tier, Vec::new()));
                                by_tier.len() - 1
                            }
                        };
                        by_tier[at].1.extend(std::iter::repeat_n(h, n as usize));
                    }
                    let removals = by_tier.into_iter().map(|(tier, hashes)| match tier {
                        None => IndexEvent::Removed { hashes },
                        Some(tier) => IndexEvent::TierRemoved { tier, hashes },
                    });
                    let removals: Vec<IndexEvent> = removals.collect();
                    let n = removals.len();
                    events.splice(i..=i, removals);
                    i += n;
                    continue;
                }
                IndexEvent::PrefixStored { .. } => true,
            };
            if keep {
                i += 1;
            } else {
                events.remove(i);
            }
        }
    }
}

async fn apply_loop(
    config: SubscriberConfig,
    mut rx: mpsc::Receiver<Frame>,
    mut connected: watch::Receiver<bool>,
    router: Arc<Router>,
    metrics: Arc<KvEventMetrics>,
    relay: Option<Box<dyn EngineRelay>>,
) {
    let took_over = relay.as_ref().map(|r| r.took_over());
    let chains = ReplicaChains::new(&config.scope.hash_scheme, config.max_mappings);
    let stale_key = stale_key(&config);
    let mut applier = Applier {
        config,
        router,
        metrics,
        chains,
        next_seq: None,
        out: Vec::new(),
        stale_key,
        stale: None,
        overlap: false,
        resync: None,
        rank_blocks: None,
        relay,
    };
    if applier.config.ranks > 1 {
        applier.rank_blocks = Some(RankBlocks::default());
    }
    // Subscribed first (live batches queue up meanwhile), then the replay.
    if connected.wait_for(|c| *c).await.is_err() {
        return;
    }
    applier.warm_start().await;
    loop {
        let resync_at = applier.resync.map(|(at, _)| at);
        tokio::select! {
            frame = rx.recv() => match frame {
                Some(frame) => applier.on_frame(frame).await,
                None => return,
            },
            () = sleep_until_opt(resync_at), if resync_at.is_some() => {
                applier.warm_start().await;
            }
            () = notified_opt(took_over.as_deref()) => {
                // The stream lacks what the previous relay did not publish.
                applier.warm_start().await;
            }
        }
    }
}

async fn notified_opt(notify: Option<&Notify>) {
    match notify {
        Some(n) => n.notified().await,
        None => std::future::pending().await,
    }
}

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// How a warm start went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Warm {
    /// The replay began at seq 0 (or the buffer was empty): the replica was rebuilt.
    Exact,
    /// The buffer began later; what it held was applied over what we had.
    Partial,
    /// Nothing usable came back.
    Failed,
}

impl Applier {
    async fn on_frame(&mut self, frame: Frame) {
        if self.overlap {
            if self.next_seq.is_some_and(|next| frame.seq < next) {
                // Queued while the warm-start replay ran, which applied it already.
                self.metrics.duplicate();
                return;
            }
            self.overlap = false;
        }
        self.heal_by_ttl();
        match self.next_seq {
            Some(next) if frame.seq < next => {
                // seq starts at 0 per engine process: it went back, the engine restarted.
                self.clear("restart");
            }
            Some(next) if frame.seq > next => self.fill_gap(next, frame.seq).await,
            _ => {}
        }
        self.apply(&frame.payload);
        self.next_seq = frame.seq.checked_add(1);
    }

    /// Replays from seq 0 and applies it (see the module docs).
    async fn warm_start(&mut self) {
        let Some(endpoint) = self.config.replay_endpoint.clone() else {
            // Nothing to replay from: keep what the index holds and follow live.
            self.resync = None;
            return;
        };
        let resyncing = self.next_seq.is_some();
        let had_entries = resyncing || self.replica_entries() > 0;
        let idle = self.config.replay_timeout;
        let total = idle * WARM_START_TIMEOUTS;
        let metrics = self.metrics.clone();
        let mut first: Option<u64> = None;
        let mut last: Option<u64> = None;
        let mut outcome = Warm::Exact;
        let mut result = Ok(());
        // A reply with a hole (the engine's ROUTER drops at its high-water mark
        // when it answers faster than we apply) is asked again from the hole, as
        // long as each round makes progress. So is a reply that goes quiet (or
        // breaks) after progress: the ROUTER may have dropped its tail and its end
        // marker, a hole that no later frame reveals.
        for _round in 0..GAP_ATTEMPTS * 10 {
            let progress_from = last;
            let mut hole = false;
            let from = last.map_or(0, |l| l + 1);
            result = replay_stream(&endpoint, from, idle, total, &metrics, &mut |f: Frame| {
                match last {
                    None => {
                        first = Some(f.seq);
                        if f.seq == 0 {
                            self.clear("warm_start");
                        } else if resyncing {
                            // Re-applying what we already applied would count it twice.
                            outcome = Warm::Failed;
                            return false;
                        } else {
                            outcome = Warm::Partial;
                        }
                    }
                    Some(l) if f.seq <= l => return true,
                    Some(l) if f.seq != l + 1 => {
                        hole = true;
                        return false;
                    }
                    Some(_) => {}
                }
                self.apply(&f.payload);
                last = Some(f.seq);
                true
            })
            .await;
            let cut = hole || result.is_err();
            if !cut || outcome == Warm::Failed || last == progress_from {
                break;
            }
        }
        let outcome = match (&result, first) {
            // An empty buffer: the engine published nothing since it started.
            (Ok(()), None) => {
                self.clear("warm_start");
                Warm::Exact
            }
            (Ok(()), Some(_)) => outcome,
            // Failed after applying from seq 0: exact up to `last`; a later gap
            // replays the rest.
            (Err(_), Some(0)) => Warm::Exact,
            (Err(_), _) if last.is_some() => Warm::Partial,
            (Err(_), _) => Warm::Failed,
        };
        if let Err(why) = &result {
            tracing::warn!(replica = %self.config.replica_id, why, ?outcome,
                "KV event warm-start replay failed");
        }
        self.metrics.warm_start(match outcome {
            Warm::Exact => "exact",
            Warm::Partial => "partial",
            Warm::Failed => "failed",
        });
        if outcome != Warm::Failed {
            match last {
                Some(l) => self.next_seq = l.checked_add(1),
                // Nothing buffered: the engine's next batch is its first.
                None if outcome == Warm::Exact => self.next_seq = Some(0),
                None => {}
            }
            self.overlap = true;
        }
        match outcome {
            Warm::Exact => {
                self.set_stale(false);
                self.resync = None;
            }
            Warm::Partial => {
                if had_entries {
                    self.set_stale(true);
                }
                self.resync = None;
            }
            Warm::Failed => {
                if had_entries {
                    self.set_stale(true);
                }
                // Retry while stale, or while the replay socket could not be had.
                if result.is_err() || self.stale.is_some() {
                    let wait = self.resync.map_or(RESYNC_FIRST, |(_, w)| w);
                    self.resync = Some((Instant::now() + wait, (wait * 2).min(RESYNC_MAX)));
                } else {
                    self.resync = None;
                }
            }
        }
    }

    /// Replays the missing batches `from..until` (retrying a few times), or marks
    /// the replica stale and keeps what it holds.
    async fn fill_gap(&mut self, from: u64, until: u64) {
        self.metrics.gap();
        let mut next = from;
        let mut why = String::from("no replay endpoint");
        if let Some(endpoint) = self.config.replay_endpoint.clone() {
            let metrics = self.metrics.clone();
            let timeout = self.config.replay_timeout;
            for attempt in 0..GAP_ATTEMPTS {
                if attempt > 0 {
                    tokio::time::sleep(Duration::from_millis(100 * 3u64.pow(attempt - 1))).await;
                }
                let mut hole = false;
                let result = replay_stream(
                    &endpoint,
                    next,
                    timeout,
                    timeout,
                    &metrics,
                    &mut |f: Frame| {
                        if f.seq < next {
                            return true;
                        }
                        if f.seq != next {
                            hole = true; // the buffer no longer holds `next`
                            return false;
                        }
                        self.apply(&f.payload);
                        next += 1;
                        next < until
                    },
                )
                .await;
                if next == until {
                    self.metrics.replay(true);
                    return;
                }
                why = match result {
                    Err(e) => e,
                    Ok(()) => format!("the buffer no longer holds batch {next}"),
                };
                if hole || result_was_complete(&why) {
                    break; // asking again returns the same
                }
            }
        }
        self.metrics.replay(false);
        tracing::warn!(replica = %self.config.replica_id, from = next, until, why,
            "KV event replay failed; keeping the replica's entries, marked possibly stale");
        if self.replica_entries() > 0 {
            self.set_stale(true);
        }
        if self.resync.is_none() && self.stale.is_some() {
            self.resync = Some((Instant::now() + RESYNC_FIRST, RESYNC_FIRST * 2));
        }
    }

    /// Marks or unmarks the replica as possibly stale.
    fn set_stale(&mut self, stale: bool) {
        if stale {
            let now = Instant::now();
            let ttl = self
                .router
                .snapshot()
                .tenant(&self.config.scope.tenant)
                .policy
                .eviction_ttl;
            let until = now
                .checked_add(ttl)
                .unwrap_or(now + Duration::from_secs(365 * 86_400));
            // A later loss restarts the clock.
            self.stale = Some((self.stale.map_or(now, |(since, _)| since), until));
        } else {
            self.stale = None;
            self.resync = None;
        }
        self.metrics.set_stale(&self.stale_key, stale);
    }

    /// One eviction TTL after the last loss, every entry a lost removal left
    /// behind has expired: the replica is no longer stale.
    fn heal_by_ttl(&mut self) {
        if self.stale.is_some_and(|(_, until)| Instant::now() >= until) {
            self.set_stale(false);
        }
    }

    /// Entries the index holds for this replica (for one of several ranks: the
    /// blocks this rank holds).
    fn replica_entries(&self) -> u64 {
        if let Some(r) = &self.rank_blocks {
            return r.held.len() as u64;
        }
        let s = &self.config.scope;
        self.router
            .view(Timestamp::now())
            .replicas
            .iter()
            .filter(|r| {
                r.replica_id == self.config.replica_id
                    && r.tenant == *s.tenant
                    && r.model == *s.model
                    && r.hash_scheme == *s.hash_scheme
            })
            .map(|r| r.prefix_count)
            .sum()
    }

    /// Drops everything the index holds for this replica (or this rank): it is
    /// exact (empty) again.
    fn clear(&mut self, cause: &'static str) {
        self.chains.reset();
        self.metrics.reset(cause);
        self.ingest(&mut vec![IndexEvent::Cleared]);
        if self.stale.is_some() {
            self.set_stale(false);
        }
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
        self.metrics.events("too_long", u64::from(batch.too_long));
        self.ingest(&mut out);
        self.out = out;
        if (engine_clears > 0 || overflowed) && self.stale.is_some() {
            // Everything before the clear no longer matters.
            self.set_stale(false);
        }
        if batch.ts > 0.0 {
            let now = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            self.metrics.lag(now - batch.ts);
        }
    }

    fn ingest(&mut self, events: &mut Vec<IndexEvent>) {
        if let Some(rank) = &mut self.rank_blocks {
            rank.scope(events);
        }
        if events.is_empty() {
            return;
        }
        let batch = IngestBatch {
            scope: self.config.scope.as_ref(),
            replica_id: &self.config.replica_id,
            endpoint: &self.config.address,
            events,
        };
        if let Some(relay) = &self.relay
            && !relay.offer(&batch)
        {
            // Another sidecar relays this engine: the batch comes back through
            // the fleet's stream.
            return;
        }
        match apply_in_place(&self.router, &batch) {
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

/// A replay error that another attempt would only repeat (the peer answered, but
/// not with what we can use).
fn result_was_complete(why: &str) -> bool {
    why.starts_with("a replay reply")
}

#[cfg(test)]
mod tests;
