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
