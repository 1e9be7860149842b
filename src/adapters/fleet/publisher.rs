//! Publishes this sidecar's routing facts to its fleet.
//!
//! The routing path hands each fact to [`Publisher::publish`], which only tries
//! a bounded queue: when it is full the fact is dropped and counted, never
//! waited for. A task numbers the facts (the run's epoch, a sequence growing by
//! one) and publishes them on this sidecar's subject; with nothing else to say
//! it publishes a heartbeat every [`HEARTBEAT_INTERVAL`].
//!
//! Invariant: a fact that was dropped (queue full, NATS disconnected, publish
//! error) leaves a gap in the sequence, so every peer drops this sidecar's
//! routes and counts again from the next message: a lost release can never be
//! counted for good. The NATS client coalesces the messages queued while it
//! writes, so a burst goes out in few writes.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_nats::Client;
use async_nats::connection::State;
use tokio::sync::{mpsc, oneshot};

use super::metrics::FleetMetrics;
use super::wire;
use crate::core::load::RouteFacts;
use crate::core::load::peer_ledger::{Fact, HEARTBEAT_INTERVAL, Message};

/// Facts queued for the publishing task at most.
pub const QUEUE: usize = 8192;
/// Facts published per wake-up at most before the heartbeat timer is checked.
const BATCH: usize = 512;

/// The routing path's end of the queue.
#[derive(Debug)]
pub struct Publisher {
    tx: mpsc::Sender<Fact>,
    /// A fact was dropped before it was numbered: the next one skips a number.
    lost: Arc<AtomicBool>,
    metrics: Arc<FleetMetrics>,
}

impl RouteFacts for Publisher {
    fn publish(&self, fact: Fact) {
        if self.tx.try_send(fact).is_err() {
            self.lost.store(true, Ordering::Relaxed);
            self.metrics.dropped("queue_full");
        }
    }
}

/// The publishing task's end.
pub struct Outbox {
    rx: mpsc::Receiver<Fact>,
    lost: Arc<AtomicBool>,
    metrics: Arc<FleetMetrics>,
    peer: String,
    subject: String,
    epoch: u64,
    seq: u64,
}

/// Asks the publishing task to publish Leave and stop.
pub struct Leave(oneshot::Sender<()>);

impl Leave {
    pub fn send(self) {
        let _ = self.0.send(());
    }
}

/// A queue for the sidecar `peer` publishing on `subject`, numbered from a new
/// epoch (the wall clock in ns: a restarted sidecar's epoch is newer).
pub fn queue(peer: &str, subject: String, metrics: Arc<FleetMetrics>) -> (Publisher, Outbox) {
    let (tx, rx) = mpsc::channel(QUEUE);
    let lost = Arc::new(AtomicBool::new(false));
    let epoch = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(1, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
    (
        Publisher {
            tx,
            lost: lost.clone(),
            metrics: metrics.clone(),
        },
        Outbox {
            rx,
            lost,
            metrics,
            peer: peer.to_string(),
            subject,
            epoch,
            seq: 0,
        },
    )
}

impl Outbox {
    /// Publishes until [`Leave`] (then publishes Leave, flushes within
    /// `flush_timeout` and returns) or until every [`Publisher`] is gone.
    pub fn run(
        mut self,
        client: Client,
        flush_timeout: Duration,
    ) -> (Leave, tokio::task::JoinHandle<()>) {
        let (leave_tx, mut leave_rx) = oneshot::channel();
        let task = tokio::spawn(async move {
            let mut ticker = tokio::time::interval(HEARTBEAT_INTERVAL);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut last = tokio::time::Instant::now();
            loop {
                tokio::select! {
                    biased;
                    _ = &mut leave_rx => {
                        // What was routed before the leave goes first: the
                        // leave releases it all anyway.
                        self.send(&client, Fact::Leave).await;
                        let _ = tokio::time::timeout(flush_timeout, client.flush()).await;
                        return;
                    }
                    fact = self.rx.recv() => {
                        let Some(fact) = fact else { return };
                        self.send(&client, fact).await;
                        for _ in 1..BATCH {
                            match self.rx.try_recv() {
                                Ok(fact) => self.send(&client, fact).await,
                                Err(_) => break,
                            }
                        }
                        last = tokio::time::Instant::now();
                    }
                    _ = ticker.tick() => {
                        if last.elapsed() >= HEARTBEAT_INTERVAL
                            && client.connection_state() == State::Connected
                        {
                            self.send(&client, Fact::Heartbeat).await;
                            last = tokio::time::Instant::now();
                        }
                    }
                }
            }
        });
        (Leave(leave_tx), task)
    }

    async fn send(&mut self, client: &Client, fact: Fact) {
        if client.connection_state() != State::Connected {
            self.lost.store(true, Ordering::Relaxed);
            self.metrics.dropped("disconnected");
            return;
        }
        let msg = self.number(fact);
        let bytes = wire::encode(&msg);
        let size = bytes.len() + self.subject.len();
        match client.publish(self.subject.clone(), bytes.into()).await {
            Ok(()) => self.metrics.published(size),
            Err(e) => {
                tracing::debug!(error = %e, "fleet publish failed");
                self.lost.store(true, Ordering::Relaxed);
                self.metrics.dropped("publish_error");
            }
        }
    }

    /// The next message: one sequence number past the last, two after a drop.
    fn number(&mut self, fact: Fact) -> Message {
        if self.lost.swap(false, Ordering::Relaxed) {
            self.seq += 1;
        }
        self.seq += 1;
        Message {
            peer: self.peer.clone(),
            epoch: self.epoch,
            seq: self.seq,
            fact,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_queue_drops_without_waiting_and_leaves_a_gap() {
        let metrics = Arc::new(FleetMetrics::default());
        let (publisher, mut outbox) = queue("a", "f.routes.a".into(), metrics);
        for _ in 0..QUEUE {
            publisher.publish(Fact::Heartbeat);
        }
        assert!(!publisher.lost.load(Ordering::Relaxed));
        // Full: returns at once, dropped.
        publisher.publish(Fact::Released { route: 1 });
        assert!(publisher.lost.load(Ordering::Relaxed));
        let fact = outbox.rx.try_recv().expect("queued");
        let first = outbox.number(fact);
        assert_eq!(first.seq, 2, "the drop skipped a number");
        let second = outbox.number(Fact::Heartbeat);
        assert_eq!(second.seq, 3);
        assert_eq!(second.epoch, first.epoch);
        assert_eq!(second.peer, "a");
    }

    #[test]
    fn a_new_queue_is_a_newer_epoch() {
        let m = Arc::new(FleetMetrics::default());
        let (_, a) = queue("a", "s".into(), m.clone());
        std::thread::sleep(Duration::from_millis(2));
        let (_, b) = queue("a", "s".into(), m);
        assert!(b.epoch > a.epoch);
    }
}
