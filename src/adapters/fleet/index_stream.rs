//! The fleet's KV event stream, read by every sidecar, and the index snapshots
//! a new sidecar starts from.
//!
//! ```text
//!  setup:  stream <fleet>-kv (subjects <fleet>.kv.*, kept KV_STREAM_MAX_AGE),
//!          lease bucket <fleet>-leases, object store <fleet>-index
//!  start:  object <fleet>-index/snapshot ─▶ index + log;  then read the stream
//!          from the snapshot's sequence + 1 (from its start without one)
//!  follow: <fleet>.kv.<token> ─▶ receive (subject, wire, fence) ─▶ index + log
//!  every --fleet-snapshot-interval, on the one sidecar holding the writer key:
//!          log ─▶ snapshot ─▶ object store
//! ```
//!
//! A batch is checked before anything changes: the subject must name an engine
//! token of this fleet, the bytes must decode ([`kv_wire::decode_batch`]), the
//! engine they claim must be the one the subject names, and its fence must not
//! be older than one already applied for that engine. A sidecar's own batches
//! (same id and process epoch) were applied when they were published and are
//! only recorded in the log. NATS down: the stream is read again from where
//! the log stands once it is back (the ordered consumer recreates itself).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::Context;
use async_nats::jetstream::{self, consumer, kv, object_store, stream};
use futures::StreamExt;
use tokio::io::AsyncReadExt;
use tokio::sync::Mutex;

use super::index_log::IndexLog;
use super::kv_wire::{self, IndexSnapshot};
use super::relay::{LEASE_TTL, Shared};
use super::subjects::Subjects;
use crate::adapters::apply::apply_in_place;
use crate::core::Router;
use crate::core::index::IngestBatch;

/// How long the stream keeps a batch: far longer than the snapshot interval,
/// so that a sidecar starting from the newest snapshot finds every batch after it.
pub const KV_STREAM_MAX_AGE: Duration = Duration::from_secs(15 * 60);
/// `--fleet-snapshot-interval` when not given.
pub const DEFAULT_SNAPSHOT_INTERVAL: Duration = Duration::from_secs(30);
/// The snapshot's object name.
const SNAPSHOT_OBJECT: &str = "snapshot";
/// The lease key of the snapshot writer.
const WRITER_KEY: &str = "snapshot-writer";

/// What became of one stream message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Received {
    /// Applied to the index and the log.
    Applied,
    /// This sidecar's own batch: already applied, recorded in the log.
    Own,
    /// Dropped for this reason (a metric label).
    Dropped(&'static str),
}

/// Checks one stream message and applies it (see the module documentation).
pub fn receive(
    router: &Router,
    log: &mut IndexLog,
    shared_id: (&str, u64),
    subjects: &Subjects,
    subject: &str,
    payload: &[u8],
) -> Received {
    let Some(token) = subjects.engine_of(subject) else {
        return Received::Dropped("engine_mismatch");
    };
    let batch = match kv_wire::decode_batch(payload) {
        Ok(b) => b,
        Err(refusal) => return Received::Dropped(refusal.as_str()),
    };
    if !log.names(token, &batch.engine) {
        return Received::Dropped("engine_mismatch");
    }
    if log.admit(&batch.engine, batch.fence).is_err() {
        return Received::Dropped("fenced");
    }
    let own = batch.origin == shared_id.0 && batch.epoch == shared_id.1;
    if !own {
        let ingest = IngestBatch {
            scope: batch.engine.scope.as_ref(),
            replica_id: &batch.engine.replica,
            endpoint: &batch.endpoint,
            events: &batch.events,
        };
        if apply_in_place(router, &ingest).is_err() {
            return Received::Dropped("rejected");
        }
    }
    log.apply(&batch.engine, &batch.endpoint, &batch.events);
    if own {
        Received::Own
    } else {
        Received::Applied
    }
}

/// Loads `snapshot` into the index and the log; returns the blocks loaded.
pub fn load(router: &Router, log: &mut IndexLog, snapshot: &IndexSnapshot) -> usize {
    for e in &snapshot.engines {
        for events in kv_wire::split_events(&e.events) {
            let batch = IngestBatch {
                scope: e.engine.scope.as_ref(),
                replica_id: &e.engine.replica,
                endpoint: &e.endpoint,
                events: &events,
            };
            if let Err(why) = router.ingest(&batch, crate::core::time::Timestamp::now()) {
                tracing::warn!(replica = %e.engine.replica, error = %why, "snapshot engine refused");
                break;
            }
        }
    }
    log.load(snapshot);
    log.blocks()
}

/// The stream, the lease bucket and the snapshot store, made if absent.
async fn setup(
    js: &jetstream::Context,
    subjects: &Subjects,
) -> anyhow::Result<(stream::Stream, kv::Store, object_store::ObjectStore)> {
    let stream = js
        .get_or_create_stream(stream::Config {
            name: subjects.kv_stream(),
            subjects: vec![subjects.all_kv()],
            max_age: KV_STREAM_MAX_AGE,
            ..Default::default()
        })
        .await
        .context("the KV event stream")?;
    // The bucket's stream made by hand, as the NATS KV conventions lay it out:
    // the client's own create_key_value first asks for the account's info,
    // whose reply from servers before 2.10 it cannot read.
    let bucket = subjects.lease_bucket();
    js.get_or_create_stream(stream::Config {
        name: format!("KV_{bucket}"),
        subjects: vec![format!("$KV.{bucket}.>")],
        max_messages_per_subject: 1,
        max_age: LEASE_TTL,
        allow_rollup: true,
        deny_delete: true,
        allow_direct: true,
        discard: stream::DiscardPolicy::New,
        ..Default::default()
    })
    .await
    .context("the relay lease bucket")?;
    let leases = js
        .get_key_value(bucket)
        .await
        .context("the relay lease bucket")?;
    let objects = match js.get_object_store(subjects.snapshot_bucket()).await {
        Ok(store) => store,
        Err(_) => js
            .create_object_store(object_store::Config {
                bucket: subjects.snapshot_bucket(),
                ..Default::default()
            })
            .await
            .context("the index snapshot store")?,
    };
    Ok((stream, leases, objects))
}

/// The newest snapshot, if one was written.
async fn read_snapshot(
    objects: &object_store::ObjectStore,
) -> anyhow::Result<Option<IndexSnapshot>> {
    let mut object = match objects.get(SNAPSHOT_OBJECT).await {
        Ok(o) => o,
        Err(e) if e.kind() == object_store::GetErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).context("reading the index snapshot"),
    };
    let mut bytes = Vec::new();
    object
        .read_to_end(&mut bytes)
        .await
        .context("reading the index snapshot")?;
    let snapshot = kv_wire::decode_snapshot(&bytes)
        .map_err(|r| anyhow::anyhow!("the index snapshot is refused: {r}"))?;
    Ok(Some(snapshot))
}

/// Sets up, warm-starts from the newest snapshot, then follows the stream
/// forever (see the module documentation).
pub(super) async fn run(
    shared: Arc<Shared>,
    router: Arc<Router>,
    log: Arc<Mutex<IndexLog>>,
    snapshot_interval: Duration,
) {
    let js = jetstream::new(shared.client.clone());
    let (stream, leases, objects) = loop {
        match setup(&js, &shared.subjects).await {
            Ok(s) => break s,
            Err(e) => {
                tracing::warn!(error = format!("{e:#}"), "fleet KV stream not set up yet");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    };
    let _ = shared.leases.set(leases.clone());
    shared.metrics.set_kv_stream_ready();
    match read_snapshot(&objects).await {
        Ok(Some(snapshot)) => {
            let started = Instant::now();
            let (router, log2) = (router.clone(), log.clone());
            let loaded = tokio::task::spawn_blocking(move || {
                let mut log = log2.blocking_lock();
                load(&router, &mut log, &snapshot)
            })
            .await
            .unwrap_or(0);
            shared.metrics.snapshot_loaded(loaded, started.elapsed());
            tracing::info!(
                blocks = loaded,
                seconds = started.elapsed().as_secs_f64(),
                "fleet index loaded from the newest snapshot"
            );
        }
        Ok(None) => {
            tracing::info!("no fleet index snapshot yet: reading the KV stream from its start")
        }
        Err(e) => {
            shared.metrics.kv_dropped("malformed");
            tracing::warn!(
                error = format!("{e:#}"),
                "fleet index snapshot not loaded: reading the KV stream from its start"
            );
        }
    }
    // Both run for good, in this task (stopping it stops both); a failed write
    // is logged and tried again at the next tick.
    let writer = write_snapshots(
        shared.clone(),
        leases,
        objects,
        log.clone(),
        snapshot_interval,
    );
    let follower = async {
        loop {
            if let Err(e) = follow(&shared, &stream, &router, &log).await {
                tracing::debug!(error = format!("{e:#}"), "fleet KV stream interrupted");
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    };
    tokio::join!(writer, follower);
}

/// Reads the stream from where the log stands, until it fails.
async fn follow(
    shared: &Shared,
    stream: &stream::Stream,
    router: &Router,
    log: &Mutex<IndexLog>,
) -> anyhow::Result<()> {
    let mut expected = log.lock().await.stream_seq() + 1;
    let consumer = stream
        .create_consumer(consumer::pull::OrderedConfig {
            filter_subject: shared.subjects.all_kv(),
            deliver_policy: consumer::DeliverPolicy::ByStartSequence {
                start_sequence: expected,
            },
            ..Default::default()
        })
        .await
        .context("creating the KV stream consumer")?;
    let mut messages = consumer.messages().await.context("reading the KV stream")?;
    // A consumer does not outlive its server's restart: a reconnection makes a
    // new one, from where the log stands.
    let stats = shared.client.statistics();
    let connects = stats.connects.load(Ordering::Relaxed);
    let mut check = tokio::time::interval(Duration::from_millis(250));
    loop {
        let message = tokio::select! {
            m = messages.next() => match m {
                Some(m) => m,
                None => return Ok(()),
            },
            _ = check.tick() => {
                if stats.connects.load(Ordering::Relaxed) != connects {
                    return Ok(());
                }
                continue;
            }
        };
        let message = message.context("reading the KV stream")?;
        let seq = message
            .info()
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .stream_sequence;
        if seq > expected {
            // Aged out of the stream before this sidecar read them.
            shared.metrics.kv_gap();
        }
        expected = seq + 1;
        let mut log = log.lock().await;
        let outcome = receive(
            router,
            &mut log,
            (&shared.me, shared.epoch),
            &shared.subjects,
            message.subject.as_str(),
            &message.payload,
        );
        log.set_stream_seq(seq);
        drop(log);
        match outcome {
            Received::Applied | Received::Own => shared.metrics.kv_applied(),
            Received::Dropped(reason) => shared.metrics.kv_dropped(reason),
        }
    }
}

/// Every `interval`, the sidecar holding the writer key writes the log.
async fn write_snapshots(
    shared: Arc<Shared>,
    leases: kv::Store,
    objects: object_store::ObjectStore,
    log: Arc<Mutex<IndexLog>>,
    interval: Duration,
) {
    let mut written_at = 0;
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        if !is_writer(&leases, &shared.me).await {
            continue;
        }
        let (me, log2) = (shared.me.clone(), log.clone());
        let Ok((seq, blocks, bytes)) = tokio::task::spawn_blocking(move || {
            let log = log2.blocking_lock();
            let seq = log.stream_seq();
            let snapshot = log.snapshot(&me);
            let blocks = log.blocks();
            drop(log);
            (seq, blocks, kv_wire::encode_snapshot(&snapshot))
        })
        .await
        else {
            continue;
        };
        if seq == 0 || seq == written_at {
            continue;
        }
        match objects.put(SNAPSHOT_OBJECT, &mut bytes.as_slice()).await {
            Ok(_) => {
                written_at = seq;
                shared.metrics.snapshot_written(bytes.len());
                tracing::debug!(
                    blocks,
                    bytes = bytes.len(),
                    stream_seq = seq,
                    "fleet index snapshot written"
                );
            }
            Err(e) => tracing::warn!(error = %e, "fleet index snapshot not written"),
        }
    }
}

/// Takes or keeps the writer key (it ages out with the leases when its holder
/// stops writing).
async fn is_writer(leases: &kv::Store, me: &str) -> bool {
    match leases.entry(WRITER_KEY).await {
        Ok(Some(entry)) if entry.operation == kv::Operation::Put => {
            entry.value == me.as_bytes()
                && leases
                    .update(WRITER_KEY, me.to_string().into(), entry.revision)
                    .await
                    .is_ok()
        }
        Ok(_) => leases
            .create(WRITER_KEY, me.to_string().into())
            .await
            .is_ok(),
        Err(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::adapters::fleet::kv_wire::{EngineId, KvBatch};
    use crate::core::index::{IndexConfig, IndexEvent};
    use crate::core::scope::ScopeRef;
    use crate::core::snapshot::PolicySnapshot;
    use crate::core::time::Timestamp;

    const ME: (&str, u64) = ("s2", 9);

    fn router() -> Router {
        Router::new(
            IndexConfig::default(),
            PolicySnapshot::empty(),
            Timestamp::now(),
        )
    }

    fn engine(tenant: &str) -> EngineId {
        EngineId {
            scope: ScopeRef::new(tenant, "m", "s").to_owned(),
            replica: "r1".into(),
            rank: 0,
        }
    }

    fn batch(origin: (&str, u64), fence: u64, hashes: &[u64]) -> KvBatch {
        KvBatch {
            origin: origin.0.into(),
            epoch: origin.1,
            fence,
            engine: engine("t"),
            endpoint: "10.0.0.1:8000".into(),
            events: vec![IndexEvent::Stored {
                parent: None,
                hashes: hashes.to_vec(),
                token_counts: vec![],
            }],
        }
    }

    fn send(router: &Router, log: &mut IndexLog, b: &KvBatch) -> Received {
        let subjects = Subjects::new("f");
        let subject = subjects.kv_of(&b.engine.token());
        receive(
            router,
            log,
            ME,
            &subjects,
            &subject,
            &kv_wire::encode_batch(b),
        )
    }

    #[test]
    fn a_peers_batch_is_applied_and_logged() {
        let (r, mut log) = (router(), IndexLog::default());
        assert_eq!(
            send(&r, &mut log, &batch(("s1", 1), 5, &[1, 2, 3])),
            Received::Applied
        );
        assert_eq!(r.index().total_entries(), 3);
        assert_eq!(log.blocks(), 3);
    }

    #[test]
    fn an_own_batch_is_logged_but_not_applied_twice() {
        let (r, mut log) = (router(), IndexLog::default());
        assert_eq!(send(&r, &mut log, &batch(ME, 5, &[1, 2])), Received::Own);
        assert_eq!(
            r.index().total_entries(),
            0,
            "applied when it was published"
        );
        assert_eq!(log.blocks(), 2);
        // The same id under another process epoch is an earlier process's: applied.
        assert_eq!(
            send(&r, &mut log, &batch((ME.0, 8), 5, &[7])),
            Received::Applied
        );
        assert_eq!(r.index().total_entries(), 1);
    }

    #[test]
    fn an_older_fence_is_dropped_and_changes_nothing() {
        let (r, mut log) = (router(), IndexLog::default());
        assert_eq!(
            send(&r, &mut log, &batch(("s1", 1), 7, &[1])),
            Received::Applied
        );
        assert_eq!(
            send(&r, &mut log, &batch(("s3", 1), 6, &[2, 3])),
            Received::Dropped("fenced")
        );
        assert_eq!(r.index().total_entries(), 1);
        assert_eq!(log.blocks(), 1);
        assert_eq!(
            send(&r, &mut log, &batch(("s3", 1), 8, &[2])),
            Received::Applied
        );
    }

    #[test]
    fn a_subject_naming_another_engine_or_bad_bytes_change_nothing() {
        let (r, mut log) = (router(), IndexLog::default());
        let subjects = Subjects::new("f");
        let b = batch(("s1", 1), 1, &[1]);
        let bytes = kv_wire::encode_batch(&b);
        let other = subjects.kv_of(&engine("u").token());
        for (subject, payload, why) in [
            (other.as_str(), bytes.as_slice(), "engine_mismatch"),
            ("f.routes.s1", bytes.as_slice(), "engine_mismatch"),
            (
                subjects.kv_of(&b.engine.token()).as_str(),
                b"\xff\x01".as_slice(),
                "malformed",
            ),
        ] {
            assert_eq!(
                receive(&r, &mut log, ME, &subjects, subject, payload),
                Received::Dropped(why)
            );
        }
        assert_eq!(r.index().total_entries(), 0);
        assert_eq!(log.blocks(), 0);
    }

    #[test]
    fn a_batch_the_index_refuses_is_not_logged() {
        let (r, mut log) = (router(), IndexLog::default());
        let mut b = batch(("s1", 1), 1, &[1]);
        b.engine = engine(crate::core::scope::PROBE_TENANT);
        assert_eq!(send(&r, &mut log, &b), Received::Dropped("rejected"));
        assert_eq!(log.blocks(), 0);
    }

    #[test]
    fn a_snapshot_loads_into_a_new_sidecar_and_routes() {
        let (r, mut log) = (router(), IndexLog::default());
        send(&r, &mut log, &batch(("s1", 1), 1, &[1, 2, 3]));
        log.set_stream_seq(41);
        let snapshot = kv_wire::decode_snapshot(&kv_wire::encode_snapshot(&log.snapshot("s1")))
            .expect("decodes");
        let (fresh, mut fresh_log) = (router(), IndexLog::default());
        assert_eq!(load(&fresh, &mut fresh_log, &snapshot), 3);
        assert_eq!(fresh.index().total_entries(), 3);
        assert_eq!(fresh_log.stream_seq(), 41);
        // The fence came along: an older relay's batch is still refused.
        let mut stale = batch(("s9", 1), 0, &[9]);
        stale.fence = 0;
        assert_eq!(
            send(&fresh, &mut fresh_log, &stale),
            Received::Dropped("fenced")
        );
    }
}
