//! Leader election on a `coordination.k8s.io/v1` Lease: every replica routes,
//! but only the Lease holder writes status, so N sidecars do not fight over the
//! same status fields.
//!
//! ```text
//!  every renew period (leader) / poll period (others):
//!    GET Lease ─ free, ours, or unchanged for its whole duration? ─▶ PUT (resourceVersion)
//!       └─ written: leading until  start of this attempt + duration − margin
//!  publisher: Leadership::until() before each status write
//!  shutdown:  Resign::resign() ─▶ stop leading at once, clear holderIdentity
//! ```
//!
//! Leadership is a local deadline, never a flag someone must remember to clear:
//! it ends at the start of the last successful renewal + the Lease duration − a
//! margin, whether or not the apiserver can be reached to hear about it. Another
//! replica takes the Lease only after it saw the same Lease record unchanged for
//! the whole duration (measured on its own clock from when it first saw that
//! record, so clock skew between replicas does not matter), so a replica cut off
//! from the apiserver has stopped writing at least `margin` before anyone else
//! starts. Every write is a PUT with the resourceVersion it read: two replicas
//! racing for a free Lease cannot both win.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::PostParams;
use kube::{Api, Client};
use tokio::sync::watch as latest;
use tokio::time::Instant;
use tracing::Instrument;

/// Which Lease to hold, as whom, and for how long.
#[derive(Clone, Debug)]
pub struct LeaseConfig {
    pub namespace: String,
    pub name: String,
    /// This replica's identity in the Lease (the pod name).
    pub identity: String,
    /// How long a Lease lasts without renewal (`leaseDurationSeconds`, whole seconds).
    pub duration: Duration,
}

impl LeaseConfig {
    pub const DEFAULT_NAME: &str = "inferencecache-status";
    pub const DEFAULT_DURATION: Duration = Duration::from_secs(15);
    /// The shortest Lease accepted: the margin and periods below need whole seconds.
    pub const MIN_DURATION: Duration = Duration::from_secs(3);

    /// How long before the Lease would expire the holder stops acting as leader:
    /// a fifth of the duration (3 s of 15 s), at least one second.
    pub fn margin(&self) -> Duration {
        (self.duration / 5).max(Duration::from_secs(1))
    }

    /// How often the holder renews: a fifth of the duration, so a leader keeps
    /// its Lease through three failed renewals before its local deadline.
    pub fn renew_every(&self) -> Duration {
        (self.duration / 5).max(Duration::from_millis(500))
    }

    /// How often a replica that does not lead looks at the Lease: a released
    /// Lease is taken within this period.
    pub fn poll_every(&self) -> Duration {
        self.renew_every().min(Duration::from_secs(1))
    }

    fn duration_seconds(&self) -> i32 {
        i32::try_from(self.duration.as_secs().max(1)).unwrap_or(i32::MAX)
    }
}

/// Until when this replica may act as the Lease holder. Cloned into every task
/// that writes on the leader's behalf.
#[derive(Clone, Debug)]
pub struct Leadership(latest::Receiver<Option<Instant>>);

impl Leadership {
    /// The local deadline of the current leadership, if it has not passed.
    pub fn until(&self) -> Option<Instant> {
        self.0.borrow().filter(|d| Instant::now() < *d)
    }

    /// Whether this replica leads now.
    pub fn leads(&self) -> bool {
        self.until().is_some()
    }

    /// Resolves when the deadline is set or cleared (a renewal counts); `Err`
    /// once the election is gone.
    pub async fn changed(&mut self) -> Result<(), latest::error::RecvError> {
        self.0.changed().await
    }

    /// A leadership driven by hand (tests, and callers without a cluster).
    pub fn manual() -> (latest::Sender<Option<Instant>>, Self) {
        let (tx, rx) = latest::channel(None);
        (tx, Self(rx))
    }
}

/// Ends the election: stops leading at once, then clears the Lease's holder so
/// another replica takes over on its next poll instead of after the duration.
pub struct Resign {
    stop: latest::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Resign {
    /// Resigns, waiting at most `within` for the Lease release to be written.
    pub async fn resign(self, within: Duration) {
        self.stop.send_replace(true);
        let mut task = self.task;
        if tokio::time::timeout(within, &mut task).await.is_err() {
            tracing::warn!("the Lease release did not finish in time; it expires on its own");
            task.abort();
        }
    }
}

/// Starts the election. The returned [`Leadership`] starts with no deadline.
pub fn elect(client: Client, config: LeaseConfig) -> (Leadership, Resign) {
    let api: Api<Lease> = Api::namespaced(client, &config.namespace);
    let (tx, rx) = latest::channel(None);
    let (stop, mut stopped) = latest::channel(false);
    let span = tracing::info_span!("lease", namespace = %config.namespace,
        lease = %config.name, identity = %config.identity);
    let task = tokio::spawn(
        async move {
            // A dropped `Resign` means nobody will ask: run until aborted.
            let resigned = async move {
                if stopped.wait_for(|s| *s).await.is_err() {
                    std::future::pending::<()>().await;
                }
            };
            tokio::pin!(resigned);
            let mut elector = Elector::new(api, config);
            let mut leading = false;
            loop {
                let attempt = elector.config.poll_every().max(elector.config.margin());
                tokio::select! {
                    biased;
                    () = &mut resigned => break,
                    step = tokio::time::timeout(attempt, elector.step()) => match step {
                        Ok(Ok(())) => {}
                        Ok(Err(e)) => tracing::warn!(error = %e, "Lease not read or written"),
                        Err(_) => tracing::warn!("the apiserver did not answer the Lease request in time"),
                    },
                }
                share(&tx, elector.deadline);
                let now_leading = elector.leads_now();
                if leading && !now_leading && elector.deadline.is_some() {
                    tracing::warn!("no Lease renewal in time: leadership ended locally");
                    elector.deadline = None;
                } else if now_leading != leading {
                    tracing::info!(leader = now_leading, "leadership changed");
                }
                leading = now_leading;
                let pause = if leading {
                    elector.config.renew_every()
                } else {
                    elector.config.poll_every()
                };
                // Wake at the local deadline too, to say leadership ended there.
                let next = Instant::now() + pause;
                let wake = elector.deadline.filter(|_| leading).map_or(next, |d| d.min(next));
                tokio::select! {
                    biased;
                    () = &mut resigned => break,
                    () = tokio::time::sleep_until(wake) => {}
                }
                if leading && !elector.leads_now() {
                    tracing::warn!("no Lease renewal in time: leadership ended locally");
                    elector.deadline = None;
                    share(&tx, None);
                    leading = false;
                }
            }
            // Resigning: stop acting as leader before anything else.
            elector.deadline = None;
            share(&tx, None);
            match elector.release().await {
                Ok(true) => tracing::info!("Lease released"),
                Ok(false) => {}
                Err(e) => tracing::warn!(error = %e, "Lease not released; it expires on its own"),
            }
        }
        .instrument(span),
    );
    (Leadership(rx), Resign { stop, task })
}

/// Stores the deadline; wakes [`Leadership::changed`] only when leading starts or
/// stops, not on every renewal.
fn share(tx: &latest::Sender<Option<Instant>>, deadline: Option<Instant>) {
    let now = Instant::now();
    tx.send_if_modified(|d| {
        let was = d.is_some_and(|d| now < d);
        *d = deadline;
        was != deadline.is_some_and(|d| now < d)
    });
}

/// A Lease record as first seen: another holder's Lease expires only after it
/// stayed unchanged for its duration from this instant.
#[derive(Clone, Debug)]
struct Seen {
    resource_version: String,
    at: Instant,
}

/// One replica's side of the election.
struct Elector {
    api: Api<Lease>,
    config: LeaseConfig,
    seen: Option<Seen>,
    deadline: Option<Instant>,
}

impl Elector {
    fn new(api: Api<Lease>, config: LeaseConfig) -> Self {
        Self {
            api,
            config,
            seen: None,
            deadline: None,
        }
    }

    /// One look at the Lease: take or renew it when allowed. The deadline is
    /// set from the attempt's start only when the write succeeded, cleared when
    /// another replica holds the Lease, and left alone on errors (it lapses).
    async fn step(&mut self) -> Result<(), kube::Error> {
        let started = Instant::now();
        let Some(lease) = self.api.get_opt(&self.config.name).await? else {
            let lease = self.record(None, None);
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(_) => {
                    self.lead(started);
                    Ok(())
                }
                Err(kube::Error::Api(e)) if e.code == 409 => {
                    self.deadline = None;
                    Ok(())
                }
                Err(e) => Err(e),
            };
        };
        let version = lease.metadata.resource_version.clone().unwrap_or_default();
        if self
            .seen
            .as_ref()
            .is_none_or(|s| s.resource_version != version)
        {
            self.seen = Some(Seen {
                resource_version: version.clone(),
                at: started,
            });
        }
        let spec = lease.spec.clone().unwrap_or_default();
        let holder = spec.holder_identity.clone().filter(|h| !h.is_empty());
        let mine = holder.as_deref() == Some(self.config.identity.as_str());
        let their_duration = spec
            .lease_duration_seconds
            .and_then(|s| u64::try_from(s).ok())
            .map_or(self.config.duration, Duration::from_secs);
        let expired = self
            .seen
            .as_ref()
            .is_some_and(|s| started >= s.at + their_duration);
        if !(mine || holder.is_none() || expired) {
            self.deadline = None;
            return Ok(());
        }
        let mut next = self.record(Some(&spec), Some(version));
        next.metadata = ObjectMeta {
            name: Some(self.config.name.clone()),
            namespace: Some(self.config.namespace.clone()),
            ..lease.metadata
        };
        if mine {
            // A renewal keeps the acquisition and the transition count.
            if let Some(s) = next.spec.as_mut() {
                s.acquire_time = spec.acquire_time.clone();
                s.lease_transitions = spec.lease_transitions;
            }
        }
        match self
            .api
            .replace(&self.config.name, &PostParams::default(), &next)
            .await
        {
            Ok(written) => {
                self.seen = written.metadata.resource_version.map(|v| Seen {
                    resource_version: v,
                    at: started,
                });
                self.lead(started);
                Ok(())
            }
            // Another replica wrote first: it holds the Lease.
            Err(kube::Error::Api(e)) if e.code == 409 => {
                self.deadline = None;
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    fn leads_now(&self) -> bool {
        self.deadline.is_some_and(|d| Instant::now() < d)
    }

    fn lead(&mut self, started: Instant) {
        self.deadline = Some(started + self.config.duration - self.config.margin());
    }

    /// The Lease as this replica writes it when taking it.
    fn record(&self, previous: Option<&LeaseSpec>, resource_version: Option<String>) -> Lease {
        let now = MicroTime(jiff::Timestamp::now());
        let transitions = previous.and_then(|p| p.lease_transitions).unwrap_or(-1) + 1;
        Lease {
            metadata: ObjectMeta {
                name: Some(self.config.name.clone()),
                namespace: Some(self.config.namespace.clone()),
                resource_version,
                ..ObjectMeta::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(self.config.identity.clone()),
                lease_duration_seconds: Some(self.config.duration_seconds()),
                acquire_time: Some(now.clone()),
                renew_time: Some(now),
                lease_transitions: Some(transitions.max(0)),
                ..previous.cloned().unwrap_or_default()
            }),
        }
    }

    /// Clears the holder if it is still this replica; whether it was.
    async fn release(&mut self) -> Result<bool, kube::Error> {
        let Some(mut lease) = self.api.get_opt(&self.config.name).await? else {
            return Ok(false);
        };
        let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
        if spec.holder_identity.as_deref() != Some(self.config.identity.as_str()) {
            return Ok(false);
        }
        spec.holder_identity = None;
        spec.acquire_time = None;
        spec.renew_time = None;
        self.api
            .replace(&self.config.name, &PostParams::default(), &lease)
            .await
            .map(|_| true)
    }
}

#[cfg(test)]
mod tests;
