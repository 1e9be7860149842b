//! The peers' indexes, each called as its own router calls it.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};

use dynamo_kv_router::protocols::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
    KvCacheStoredBlockData, compute_seq_hash_for_block,
};
use dynamo_kv_router::{
    ConcurrentRadixTreeCompressed, LocalBlockHash, PositionalIndexer, RouterEvent, SyncIndexer,
    ThreadPoolIndexer,
};
use kv_index::{ChainBlockMap, ContentHash, SequenceHash, ShardedChainIndex, StoredBlock};

use crate::{Index, Query, REPLICAS, Seq, Truth, best};

/// Runs a future to completion on this thread (Dynamo's flush is async; its
/// oneshot needs no runtime, only a waker).
fn block_on<F: Future>(f: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut f = std::pin::pin!(f);
    loop {
        if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::park();
    }
}

/// Dynamo's router default: `ThreadPoolIndexer<ConcurrentRadixTreeCompressed>`,
/// one event thread; events are enqueued to it, lookups run inline.
/// `Dynamo<PositionalIndexer>` is its other shipped thread-safe index behind the
/// same thread pool.
pub struct Dynamo<T: SyncIndexer = ConcurrentRadixTreeCompressed> {
    index: ThreadPoolIndexer<T>,
    event_id: AtomicU64,
    /// Block hashes as Dynamo chains them itself (its positional index checks a
    /// stored block's hash against the rolling hash of the request's local hashes).
    own_chain: bool,
}

impl Dynamo {
    pub fn new() -> Self {
        Self::with(ConcurrentRadixTreeCompressed::new(), false)
    }
}

impl Dynamo<PositionalIndexer> {
    /// Jump size 32, the reference figures' configuration.
    pub fn positional() -> Self {
        Self::with(PositionalIndexer::new(32), true)
    }
}

impl<T: SyncIndexer> Dynamo<T> {
    fn with(backend: T, own_chain: bool) -> Self {
        Self {
            index: ThreadPoolIndexer::new(backend, 1, 16),
            event_id: AtomicU64::new(0),
            own_chain,
        }
    }

    /// The sequence's block hashes as the engine would publish them to this index.
    fn chain(&self, seq: &Seq) -> Vec<u64> {
        if self.own_chain {
            let local: Vec<LocalBlockHash> =
                seq.content.iter().map(|&c| LocalBlockHash(c)).collect();
            compute_seq_hash_for_block(&local)
        } else {
            seq.chain.clone()
        }
    }

    fn send(&self, replica: usize, data: KvCacheEventData) {
        let event = KvCacheEvent {
            event_id: self.event_id.fetch_add(1, Ordering::Relaxed),
            data,
            dp_rank: 0,
        };
        self.index
            .enqueue_event(RouterEvent::new(replica as u64, event))
            .expect("Dynamo's event thread is running");
    }

    /// `KvIndexerInterface::find_matches` runs exactly this inline on the caller's
    /// thread (the request's local hashes by value, no early exit).
    fn scores(&self, q: &Query) -> (u32, u32) {
        let sequence: Vec<LocalBlockHash> =
            q.seq.content.iter().map(|&c| LocalBlockHash(c)).collect();
        let scores = self.index.backend().find_matches(&sequence, false);
        best(
            scores
                .scores
                .iter()
                .map(|(w, &s)| (w.worker_id as usize, s)),
        )
    }
}

impl<T: SyncIndexer> Index for Dynamo<T> {
    fn store(&self, seq: &Seq, replica: usize) {
        let blocks = self
            .chain(seq)
            .iter()
            .zip(&seq.content)
            .map(|(&h, &c)| KvCacheStoredBlockData {
                block_hash: ExternalSequenceBlockHash(h),
                tokens_hash: LocalBlockHash(c),
                mm_extra_info: None,
            })
            .collect();
        self.send(
            replica,
            KvCacheEventData::Stored(KvCacheStoreData {
                parent_hash: None,
                start_position: None,
                blocks,
            }),
        );
    }

    fn remove(&self, seq: &Seq, from: usize, replica: usize, reversed: bool) {
        let mut block_hashes: Vec<_> = self.chain(seq)[from..]
            .iter()
            .map(|&h| ExternalSequenceBlockHash(h))
            .collect();
        if reversed {
            block_hashes.reverse();
        }
        self.send(
            replica,
            KvCacheEventData::Removed(KvCacheRemoveData { block_hashes }),
        );
    }

    fn settle(&self) {
        block_on(self.index.flush_and_wait()).expect("Dynamo's event thread flushed");
    }

    fn decide(&self, q: &Query) -> u64 {
        let (top, set) = self.scores(q);
        u64::from(top) << 32 | u64::from(set.trailing_zeros())
    }

    fn check(&self, q: &Query, truth: &Truth<'_>) -> bool {
        self.scores(q) == truth.expected(q)
    }
}

/// SMG's gateway index: `ShardedChainIndex`, one lane map per worker. The gateway
/// calls `find_matches`; the lean configuration sizes the shard for 256 workers
/// and reads scores with `score_into`.
pub struct Smg {
    index: ShardedChainIndex,
    workers: Vec<u32>,
    /// replica of a worker id.
    replica_of: Vec<usize>,
    maps: Vec<Mutex<ChainBlockMap>>,
    lean: bool,
}

impl Smg {
    pub fn new(slots: usize, lean: bool) -> Self {
        let index = ShardedChainIndex::new(1, slots);
        let workers: Vec<u32> = (0..REPLICAS)
            .map(|r| {
                index
                    .intern_worker(&format!("replica-{r}"))
                    .expect("a worker slot")
            })
            .collect();
        let mut replica_of = vec![usize::MAX; 1 + *workers.iter().max().unwrap_or(&0) as usize];
        for (r, &w) in workers.iter().enumerate() {
            replica_of[w as usize] = r;
        }
        Self {
            index,
            workers,
            replica_of,
            maps: (0..REPLICAS)
                .map(|_| Mutex::new(ChainBlockMap::new()))
                .collect(),
            lean,
        }
    }

    fn scores(&self, q: &Query) -> (u32, u32) {
        if self.lean {
            let mut scores = [0u32; REPLICAS];
            self.index.score_into(
                &q.seq.content,
                |&c| c,
                false,
                |w, s| {
                    scores[self.replica_of[w as usize]] = s;
                },
            );
            best(scores.into_iter().enumerate())
        } else {
            let hashes: Vec<ContentHash> = q.seq.content.iter().map(|&c| ContentHash(c)).collect();
            let scores = self.index.find_matches(&hashes, false);
            best(
                scores
                    .scores
                    .iter()
                    .map(|(&w, &s)| (self.replica_of[w as usize], s)),
            )
        }
    }
}

impl Index for Smg {
    fn store(&self, seq: &Seq, replica: usize) {
        let blocks: Vec<StoredBlock> = seq
            .chain
            .iter()
            .zip(&seq.content)
            .map(|(&h, &c)| StoredBlock {
                seq_hash: SequenceHash(h),
                content_hash: ContentHash(c),
            })
            .collect();
        let mut map = self.maps[replica].lock().expect("lane map");
        self.index
            .apply_stored(self.workers[replica], &blocks, None, &mut map)
            .expect("a stored event from position 0 applies");
    }

    fn remove(&self, seq: &Seq, from: usize, replica: usize, reversed: bool) {
        let mut hashes: Vec<SequenceHash> =
            seq.chain[from..].iter().map(|&h| SequenceHash(h)).collect();
        if reversed {
            hashes.reverse();
        }
        let mut map = self.maps[replica].lock().expect("lane map");
        self.index
            .apply_removed(self.workers[replica], &hashes, &mut map);
    }

    fn decide(&self, q: &Query) -> u64 {
        let (top, set) = self.scores(q);
        u64::from(top) << 32 | u64::from(set.trailing_zeros())
    }

    fn check(&self, q: &Query, truth: &Truth<'_>) -> bool {
        self.scores(q) == truth.expected(q)
    }
}
