//! Applying a replica's events from async code. A small batch is applied on the
//! calling task (a few µs; a hop to another thread would cost more). A heavy one —
//! many blocks, or a clear, which scans the replica's whole scope — runs on tokio's
//! blocking pool (or, from sync code on a worker, under `block_in_place`), so it
//! never stalls the async workers that serve decisions.

use std::sync::Arc;

use crate::core::Router;
use crate::core::index::{IndexEvent, IngestBatch, IngestError, IngestOutcome};
use crate::core::scope::ScopeKey;
use crate::core::time::Timestamp;

/// Above this many blocks in one batch, apply it off the async workers.
pub const INLINE_BLOCKS: usize = 4_096;

/// Whether a batch is heavy enough to leave the async workers.
pub fn is_heavy(events: &[IndexEvent]) -> bool {
    let mut blocks = 0usize;
    for e in events {
        match e {
            IndexEvent::Cleared => return true,
            IndexEvent::Stored { hashes, .. }
            | IndexEvent::Removed { hashes }
            | IndexEvent::TierStored { hashes, .. }
            | IndexEvent::TierRemoved { hashes, .. } => {
                blocks = blocks.saturating_add(hashes.len());
            }
            IndexEvent::PrefixStored { .. } => blocks = blocks.saturating_add(1),
        }
    }
    blocks > INLINE_BLOCKS
}

/// For sync code on an async worker (the ZMQ subscriber): a heavy batch is
/// applied under `block_in_place`, which hands this worker's other tasks to
/// another thread first; a small one (or any batch on a current-thread runtime,
/// where there is no other thread) is applied directly.
pub fn apply_in_place(
    router: &Router,
    batch: &IngestBatch<'_>,
) -> Result<IngestOutcome, IngestError> {
    let multi_thread = tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
    if multi_thread && is_heavy(batch.events) {
        tokio::task::block_in_place(|| router.ingest(batch, Timestamp::now()))
    } else {
        router.ingest(batch, Timestamp::now())
    }
}

/// Why a batch was not applied.
#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    #[error(transparent)]
    Ingest(#[from] IngestError),
    /// The runtime is shutting down and dropped the blocking task unrun.
    #[error("the server is shutting down")]
    ShuttingDown,
}

/// One replica's owned batch, applied inline or on the blocking pool. A panic
/// while applying propagates as it would inline.
pub async fn apply(
    router: &Arc<Router>,
    scope: ScopeKey,
    replica_id: String,
    endpoint: String,
    events: Vec<IndexEvent>,
) -> Result<IngestOutcome, ApplyError> {
    let heavy = is_heavy(&events);
    let run = move |router: &Router| {
        let batch = IngestBatch {
            scope: scope.as_ref(),
            replica_id: &replica_id,
            endpoint: &endpoint,
            events: &events,
        };
        router.ingest(&batch, Timestamp::now())
    };
    if !heavy {
        return Ok(run(router)?);
    }
    let router = router.clone();
    match tokio::task::spawn_blocking(move || run(&router)).await {
        Ok(result) => Ok(result?),
        Err(e) => match e.try_into_panic() {
            Ok(panic) => std::panic::resume_unwind(panic),
            Err(_) => Err(ApplyError::ShuttingDown),
        },
    }
}

#[cfg(test)]
mod tests;
