//! Engine KV events enter the fleet once: for each engine (one replica's
//! data-parallel rank in one scope), the sidecar holding its lease publishes
//! what its ZMQ subscriber translated; every other sidecar's subscriber keeps
//! following the engine (so it can take over at once) but leaves the batches
//! to the stream.
//!
//! ```text
//!  lease bucket <fleet>-leases, key = engine token:
//!    create (absent) ──▶ holder, fence = the revision created
//!    holder: update every LEASE_RENEW (CAS on the revision) ── fails ──▶ standby
//!    standby: create every LEASE_RETRY; a dead holder's key ages out (LEASE_TTL)
//!  offer(batch): NATS down, or no lease to be had ─▶ apply locally (the fallback)
//!                holder    ─▶ apply locally and publish on <fleet>.kv.<token>
//!                otherwise ─▶ leave it to the stream
//! ```
//!
//! **Fencing.** Every published batch carries its relay's fence: the lease
//! revision at which it was created. Revisions only grow, so a later holder's
//! fence is higher, and consumers drop a batch whose fence is below the
//! newest they applied for its engine: two relays of one engine (an old holder
//! that has not yet noticed its lease is gone) never both apply.
//!
//! **Takeover.** A new holder asks its subscriber to replay the engine's
//! buffer: when that reaches back to the engine's first batch the engine is
//! rebuilt exactly for the whole fleet; otherwise what the previous relay did
//! not publish is missing until the engine stores or removes those blocks
//! again (as after a ZMQ gap, see `kv_events/subscriber.rs`).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_nats::Client;
use async_nats::connection::State;
use async_nats::jetstream::kv;
use bytes::Bytes;
use tokio::sync::{Notify, OnceCell, mpsc};
use tokio::task::JoinHandle;

use super::kv_wire::{self, EngineId, KvBatch};
use super::metrics::FleetMetrics;
use super::subjects::Subjects;
use crate::adapters::kv_events::relay::{EngineRelay, Relay};
use crate::core::index::IngestBatch;
use crate::core::scope::ScopeKey;

/// A lease not renewed for this long is gone (the bucket's max age).
pub const LEASE_TTL: Duration = Duration::from_secs(5);
/// How often a holder renews its lease.
pub const LEASE_RENEW: Duration = Duration::from_millis(1500);
/// How often a standby tries to take an engine's lease.
pub const LEASE_RETRY: Duration = Duration::from_secs(1);
/// Batches waiting to be published, over every engine.
pub const QUEUE_CAPACITY: usize = 8192;

/// The lease state of one engine: a fence, or one of these.
/// Not decided yet (a lease request is on its way): leave batches to the stream.
const UNKNOWN: u64 = 0;
/// Another sidecar holds the lease.
const STANDBY: u64 = u64::MAX;
/// No lease can be had (NATS without JetStream, the bucket refused, an
/// error): follow the engine directly, as when NATS is down.
const OFFLINE: u64 = u64::MAX - 1;

/// What every engine's relay shares.
pub(super) struct Shared {
    pub me: String,
    pub epoch: u64,
    pub subjects: Subjects,
    pub client: Client,
    /// The lease bucket, once the stream's setup made it.
    pub leases: OnceCell<kv::Store>,
    pub metrics: Arc<FleetMetrics>,
    queue: mpsc::Sender<(String, Bytes)>,
}

impl Shared {
    fn connected(&self) -> bool {
        self.client.connection_state() == State::Connected
    }
}

/// The fleet's [`Relay`]: see the module documentation.
#[derive(Clone)]
pub struct KvRelay {
    shared: Arc<Shared>,
}

impl KvRelay {
    /// The relay and its publishing task.
    pub(super) fn start(
        me: &str,
        epoch: u64,
        subjects: Subjects,
        client: Client,
        metrics: Arc<FleetMetrics>,
    ) -> (Self, JoinHandle<()>) {
        let (queue, mut rx) = mpsc::channel::<(String, Bytes)>(QUEUE_CAPACITY);
        let shared = Arc::new(Shared {
            me: me.to_string(),
            epoch,
            subjects,
            client: client.clone(),
            leases: OnceCell::new(),
            metrics: metrics.clone(),
            queue,
        });
        let task = tokio::spawn(async move {
            while let Some((subject, payload)) = rx.recv().await {
                let bytes = payload.len() + subject.len();
                // The stream captures the subject: a plain publish is stored
                // without a round trip per batch.
                match client.publish(subject, payload).await {
                    Ok(()) => metrics.kv_published(bytes),
                    Err(_) => metrics.kv_dropped("publish_error"),
                }
            }
        });
        (Self { shared }, task)
    }

    pub(super) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }
}

impl Relay for KvRelay {
    fn join(&self, scope: &ScopeKey, replica: &str, rank: u32) -> Box<dyn EngineRelay> {
        let engine = EngineId {
            scope: scope.clone(),
            replica: replica.to_string(),
            rank,
        };
        let token = engine.token();
        let lease = Arc::new(Lease {
            subject: self.shared.subjects.kv_of(&token),
            token,
            engine,
            state: AtomicU64::new(UNKNOWN),
            revision: AtomicU64::new(0),
            took_over: Arc::new(Notify::new()),
        });
        let task = tokio::spawn(hold(self.shared.clone(), lease.clone()));
        Box::new(EngineLease {
            shared: self.shared.clone(),
            lease,
            task,
        })
    }
}

struct Lease {
    engine: EngineId,
    token: String,
    subject: String,
    state: AtomicU64,
    /// The lease key's revision after the holder's last write (0: not held).
    revision: AtomicU64,
    took_over: Arc<Notify>,
}

struct EngineLease {
    shared: Arc<Shared>,
    lease: Arc<Lease>,
    task: JoinHandle<()>,
}

impl Drop for EngineLease {
    fn drop(&mut self) {
        self.task.abort();
        let revision = self.lease.revision.swap(0, Ordering::AcqRel);
        if revision != 0 {
            self.shared.metrics.kv_relays(-1);
        }
        if revision != 0
            && let (Some(store), Ok(rt)) = (
                self.shared.leases.get().cloned(),
                tokio::runtime::Handle::try_current(),
            )
        {
            // Handed back at once, so a peer takes the engine over without
            // waiting for the lease to age out; only if it is still ours.
            let token = self.lease.token.clone();
            rt.spawn(async move {
                let _ = store.delete_expect_revision(token, Some(revision)).await;
            });
        }
    }
}

impl EngineRelay for EngineLease {
    fn offer(&self, batch: &IngestBatch<'_>) -> bool {
        let shared = &self.shared;
        if !shared.connected() {
            // The fallback: every sidecar follows its engines itself.
            return true;
        }
        let fence = self.lease.state.load(Ordering::Acquire);
        if fence == OFFLINE {
            return true;
        }
        if fence == UNKNOWN || fence == STANDBY {
            return false;
        }
        for events in kv_wire::split_events(batch.events) {
            let bytes = kv_wire::encode_batch(&KvBatch {
                origin: shared.me.clone(),
                epoch: shared.epoch,
                fence,
                engine: self.lease.engine.clone(),
                endpoint: batch.endpoint.to_string(),
                events,
            });
            if shared
                .queue
                .try_send((self.lease.subject.clone(), Bytes::from(bytes)))
                .is_err()
            {
                shared.metrics.kv_dropped("queue_full");
            }
        }
        true
    }

    fn took_over(&self) -> Arc<Notify> {
        self.lease.took_over.clone()
    }
}

/// Takes and keeps one engine's lease while NATS is up.
async fn hold(shared: Arc<Shared>, lease: Arc<Lease>) {
    let mut held: Option<u64> = None;
    let me = Bytes::from(shared.me.clone());
    loop {
        let store = match shared.leases.get() {
            Some(s) if shared.connected() => s.clone(),
            _ => {
                if held.take().is_some() {
                    shared.metrics.kv_relays(-1);
                    lease.revision.store(0, Ordering::Release);
                }
                lease.state.store(OFFLINE, Ordering::Release);
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        match held {
            None => match store.create(&lease.token, me.clone()).await {
                Ok(revision) => {
                    held = Some(revision);
                    lease.revision.store(revision, Ordering::Release);
                    lease.state.store(revision, Ordering::Release);
                    shared.metrics.kv_relays(1);
                    shared.metrics.kv_takeover();
                    tracing::info!(replica = %lease.engine.replica, rank = lease.engine.rank,
                        scope = %lease.engine.scope, fence = revision, "relaying the engine's KV events to the fleet");
                    lease.took_over.notify_one();
                }
                Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => {
                    lease.state.store(STANDBY, Ordering::Release);
                }
                Err(e) => {
                    tracing::debug!(error = %e, "lease not taken: following the engine directly");
                    lease.state.store(OFFLINE, Ordering::Release);
                }
            },
            Some(revision) => match store.update(&lease.token, me.clone(), revision).await {
                Ok(next) => {
                    held = Some(next);
                    lease.revision.store(next, Ordering::Release);
                }
                Err(e) => {
                    tracing::warn!(replica = %lease.engine.replica, error = %e,
                        "lost the engine's relay lease");
                    held = None;
                    lease.revision.store(0, Ordering::Release);
                    lease.state.store(STANDBY, Ordering::Release);
                    shared.metrics.kv_relays(-1);
                }
            },
        }
        let wait = if held.is_some() {
            LEASE_RENEW
        } else {
            LEASE_RETRY
        };
        tokio::time::sleep(wait).await;
    }
}
