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
mod tests {
    use super::*;

    fn stored(n: usize) -> IndexEvent {
        IndexEvent::Stored {
            parent: None,
            hashes: (0..n as u64).collect(),
            token_counts: Vec::new(),
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_heavy_batch_in_place_is_applied_on_a_multi_thread_runtime() {
        use crate::core::index::IndexConfig;
        use crate::core::scope::ScopeRef;
        use crate::core::snapshot::PolicySnapshot;
        let router = Router::new(
            IndexConfig::default(),
            PolicySnapshot::empty(),
            Timestamp::now(),
        );
        let events = [stored(INLINE_BLOCKS + 1)];
        let batch = IngestBatch {
            scope: ScopeRef::new("t", "m", "s"),
            replica_id: "r",
            endpoint: "10.0.0.1:8000",
            events: &events,
        };
        let outcome = apply_in_place(&router, &batch).expect("applied");
        assert_eq!(outcome.applied, 1);
        assert_eq!(router.index().total_entries(), INLINE_BLOCKS as u64 + 1);
    }

    #[test]
    fn clears_and_big_batches_leave_the_async_workers() {
        assert!(!is_heavy(&[]));
        assert!(!is_heavy(&[stored(INLINE_BLOCKS)]));
        assert!(is_heavy(&[stored(INLINE_BLOCKS), stored(1)]));
        assert!(is_heavy(&[stored(1), IndexEvent::Cleared]));
        assert!(!is_heavy(&[IndexEvent::Removed {
            hashes: vec![1, 2, 3]
        }]));
    }
}
