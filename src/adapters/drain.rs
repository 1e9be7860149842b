//! Graceful drain: one flag that every serving part reads.
//!
//! ```text
//!  SIGTERM/SIGINT ──▶ Drain::start ──▶ /readyz 503 ("draining": true), gRPC health NOT_SERVING
//!                                  ──▶ ExtProc refuses new streams (UNAVAILABLE)
//!                                  ──▶ tonic stops accepting, GOAWAY; in-flight streams
//!                                      finish until --drain-timeout, then the process exits
//! ```
//!
//! [`Drain::stream`] hands out a guard per in-flight ext_proc stream, so the
//! serve loop can say how many streams a deadline cut.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::watch;

/// A cheap, cloneable handle on the process's drain state.
#[derive(Clone, Debug)]
pub struct Drain {
    started: Arc<watch::Sender<bool>>,
    in_flight: Arc<AtomicUsize>,
}

impl Default for Drain {
    fn default() -> Self {
        Self::new()
    }
}

impl Drain {
    pub fn new() -> Self {
        Self {
            started: Arc::new(watch::channel(false).0),
            in_flight: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// Starts the drain (idempotent).
    pub fn start(&self) {
        self.started.send_replace(true);
    }

    pub fn is_draining(&self) -> bool {
        *self.started.borrow()
    }

    /// Resolves once the drain has started (at once if it already has).
    pub async fn started(&self) {
        let mut rx = self.started.subscribe();
        // The sender lives as long as `self`, so this only ends on `true`.
        let _ = rx.wait_for(|draining| *draining).await;
    }

    /// Counts one in-flight stream until the guard is dropped.
    pub fn stream(&self) -> StreamGuard {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        StreamGuard {
            in_flight: self.in_flight.clone(),
        }
    }

    /// Streams open right now.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }
}

/// One in-flight stream; see [`Drain::stream`].
#[derive(Debug)]
pub struct StreamGuard {
    in_flight: Arc<AtomicUsize>,
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests;
