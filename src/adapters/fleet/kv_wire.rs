//! The fleet's KV event stream on the wire: one engine's translated index
//! events per message ([`KvBatch`]), and the index snapshot
//! ([`IndexSnapshot`]) a new sidecar starts from. Protobuf, versioned like the
//! routing facts ([`super::wire`]), refused by the same reasons.
//!
//! ```text
//! KvBatch     { 1: uint32 v; 2: string origin; 3: uint64 epoch; 4: uint64 fence;
//!               5: Engine engine; 6: string endpoint; 7: repeated Event events }
//! Engine      { 1: string tenant; 2: string model; 3: string hash_scheme;
//!               4: string replica; 5: uint32 rank }
//! Event       { oneof { 1: Stored stored; 2: Hashes removed; 3: Empty cleared;
//!                       4: Prefix prefix_stored; 5: TierHashes tier_stored;
//!                       6: TierHashes tier_removed } }
//! Stored      { 1: bool has_parent; 2: uint64 parent; 3: repeated fixed64 hashes;
//!               4: repeated uint32 token_counts }
//! Hashes      { 1: repeated fixed64 hashes }
//! TierHashes  { 1: uint32 tier (1 CPU, 2 disk); 2: repeated fixed64 hashes }
//! Prefix      { 1: string prefix_hash; 2: uint32 token_count }
//! IndexSnapshot { 1: uint32 v; 2: uint64 stream_seq; 3: string writer;
//!                 4: repeated EngineState engines }
//! EngineState { 1: Engine engine; 2: string endpoint; 3: uint64 fence;
//!               4: repeated Event events }
//! ```
//!
//! Block hashes are `fixed64`: they are uniformly random, so a varint would
//! take 10 bytes where fixed takes 8, and decode slower.

use prost::Message as _;
use sha2::{Digest, Sha256};

use super::wire::{MAX_ID_BYTES, Refusal, VERSION, check_id, check_version};
use crate::core::index::{IndexEvent, Tier};
use crate::core::scope::{ScopeKey, ScopeRef};

/// The largest KV batch accepted: the NATS server's default payload limit.
pub const MAX_BATCH_BYTES: usize = 1024 * 1024;
/// Hashes per published batch: a larger batch is cut into several, in order,
/// so that each stays under [`MAX_BATCH_BYTES`] (8 bytes a hash).
pub const MAX_BATCH_HASHES: usize = 65_536;
/// The largest index snapshot accepted (about 50M block entries).
pub const MAX_SNAPSHOT_BYTES: usize = 512 * 1024 * 1024;

/// One engine's event stream: a replica in a scope, and its data-parallel
/// rank (0 without ranks). Each has its own relay lease and fence.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct EngineId {
    pub scope: ScopeKey,
    pub replica: String,
    pub rank: u32,
}

impl From<&EngineId> for EngineId {
    fn from(e: &EngineId) -> Self {
        e.clone()
    }
}

impl EngineId {
    /// Its subject token and lease key: 16 hex digits of a SHA-256 of the
    /// identity (ids may hold characters a subject cannot).
    pub fn token(&self) -> String {
        let mut h = Sha256::new();
        for part in [
            &*self.scope.tenant,
            &*self.scope.model,
            &*self.scope.hash_scheme,
            &self.replica,
        ] {
            h.update(part.as_bytes());
            h.update([0]);
        }
        h.update(self.rank.to_le_bytes());
        h.finalize()[..8]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }
}

/// One engine's events as one relay published them.
#[derive(Clone, Debug, PartialEq)]
pub struct KvBatch {
    /// The publishing sidecar's fleet id, and its process epoch: a sidecar
    /// skips its own messages (it applied them before publishing), not those
    /// of an earlier process under the same id.
    pub origin: String,
    pub epoch: u64,
    /// The relay lease's fence: a message under an older fence than one
    /// already applied for the engine is dropped.
    pub fence: u64,
    pub engine: EngineId,
    pub endpoint: String,
    pub events: Vec<IndexEvent>,
}

/// One engine's state in a snapshot: the events that rebuild it.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineState {
    pub engine: EngineId,
    pub endpoint: String,
    pub fence: u64,
    pub events: Vec<IndexEvent>,
}

/// The fleet's index as of a stream sequence: load it, then read the stream
/// from `stream_seq + 1`.
#[derive(Clone, Debug, PartialEq)]
pub struct IndexSnapshot {
    pub stream_seq: u64,
    pub writer: String,
    pub engines: Vec<EngineState>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct WireBatch {
    #[prost(uint32, tag = "1")]
    v: u32,
    #[prost(string, tag = "2")]
    origin: String,
    #[prost(uint64, tag = "3")]
    epoch: u64,
    #[prost(uint64, tag = "4")]
    fence: u64,
    #[prost(message, optional, tag = "5")]
    engine: Option<WireEngine>,
    #[prost(string, tag = "6")]
    endpoint: String,
    #[prost(message, repeated, tag = "7")]
    events: Vec<WireEvent>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct WireEngine {
    #[prost(string, tag = "1")]
    tenant: String,
    #[prost(string, tag = "2")]
    model: String,
    #[prost(string, tag = "3")]
    hash_scheme: String,
    #[prost(string, tag = "4")]
    replica: String,
    #[prost(uint32, tag = "5")]
    rank: u32,
}

#[derive(Clone, PartialEq, prost::Message)]
struct WireEvent {
    #[prost(oneof = "WireKind", tags = "1, 2, 3, 4, 5, 6")]
    kind: Option<WireKind>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
enum WireKind {
    #[prost(message, tag = "1")]
    Stored(WireStored),
    #[prost(message, tag = "2")]
    Removed(WireHashes),
    #[prost(message, tag = "3")]
    Cleared(WireEmpty),
    #[prost(message, tag = "4")]
    PrefixStored(WirePrefix),
    #[prost(message, tag = "5")]
    TierStored(WireTierHashes),
    #[prost(message, tag = "6")]
    TierRemoved(WireTierHashes),
}

#[derive(Clone, PartialEq, prost::Message)]
struct WireStored {
    #[prost(bool, tag = "1")]
    has_parent: bool,
    #[prost(uint64, tag = "2")]
    parent: u64,
    #[prost(fixed64, repeated, tag = "3")]
    hashes: Vec<u64>,
    #[prost(uint32, repeated, tag = "4")]
    token_counts: Vec<u32>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct WireHashes {
    #[prost(fixed64, repeated, tag = "1")]
    hashes: Vec<u64>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct WireTierHashes {
    #[prost(uint32, tag = "1")]
    tier: u32,
    #[prost(fixed64, repeated, tag = "2")]
    hashes: Vec<u64>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct WirePrefix {
    #[prost(string, tag = "1")]
    prefix_hash: String,
    #[prost(uint32, tag = "2")]
    token_count: u32,
}

#[derive(Clone, PartialEq, prost::Message)]
struct WireEmpty {}

#[derive(Clone, PartialEq, prost::Message)]
struct WireSnapshot {
    #[prost(uint32, tag = "1")]
    v: u32,
    #[prost(uint64, tag = "2")]
    stream_seq: u64,
    #[prost(string, tag = "3")]
    writer: String,
    #[prost(message, repeated, tag = "4")]
    engines: Vec<WireEngineState>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct WireEngineState {
    #[prost(message, optional, tag = "1")]
    engine: Option<WireEngine>,
    #[prost(string, tag = "2")]
    endpoint: String,
    #[prost(uint64, tag = "3")]
    fence: u64,
    #[prost(message, repeated, tag = "4")]
    events: Vec<WireEvent>,
}

fn tier_code(tier: Tier) -> u32 {
    match tier {
        Tier::Cpu => 1,
        Tier::Disk => 2,
    }
}

fn tier_of(code: u32) -> Result<Tier, Refusal> {
    match code {
        1 => Ok(Tier::Cpu),
        2 => Ok(Tier::Disk),
        _ => Err(Refusal::Malformed),
    }
}

fn to_wire_engine(e: &EngineId) -> WireEngine {
    WireEngine {
        tenant: e.scope.tenant.to_string(),
        model: e.scope.model.to_string(),
        hash_scheme: e.scope.hash_scheme.to_string(),
        replica: e.replica.clone(),
        rank: e.rank,
    }
}

fn from_wire_engine(e: Option<WireEngine>) -> Result<EngineId, Refusal> {
    let e = e.ok_or(Refusal::Malformed)?;
    for id in [&e.tenant, &e.model, &e.hash_scheme, &e.replica] {
        check_id(id)?;
    }
    Ok(EngineId {
        scope: ScopeRef::new(&e.tenant, &e.model, &e.hash_scheme).to_owned(),
        replica: e.replica,
        rank: e.rank,
    })
}

fn to_wire_event(e: &IndexEvent) -> WireEvent {
    let kind = match e {
        IndexEvent::Stored {
            parent,
            hashes,
            token_counts,
        } => WireKind::Stored(WireStored {
            has_parent: parent.is_some(),
            parent: parent.unwrap_or(0),
            hashes: hashes.clone(),
            token_counts: token_counts.clone(),
        }),
        IndexEvent::Removed { hashes } => WireKind::Removed(WireHashes {
            hashes: hashes.clone(),
        }),
        IndexEvent::Cleared => WireKind::Cleared(WireEmpty {}),
        IndexEvent::PrefixStored {
            prefix_hash,
            token_count,
        } => WireKind::PrefixStored(WirePrefix {
            prefix_hash: prefix_hash.clone(),
            token_count: *token_count,
        }),
        IndexEvent::TierStored { tier, hashes } => WireKind::TierStored(WireTierHashes {
            tier: tier_code(*tier),
            hashes: hashes.clone(),
        }),
        IndexEvent::TierRemoved { tier, hashes } => WireKind::TierRemoved(WireTierHashes {
            tier: tier_code(*tier),
            hashes: hashes.clone(),
        }),
    };
    WireEvent { kind: Some(kind) }
}

fn from_wire_event(e: WireEvent) -> Result<IndexEvent, Refusal> {
    let event = match e.kind.ok_or(Refusal::Malformed)? {
        WireKind::Stored(s) => IndexEvent::Stored {
            parent: s.has_parent.then_some(s.parent),
            hashes: s.hashes,
            token_counts: s.token_counts,
        },
        WireKind::Removed(r) => IndexEvent::Removed { hashes: r.hashes },
        WireKind::Cleared(WireEmpty {}) => IndexEvent::Cleared,
        WireKind::PrefixStored(p) => {
            check_id(&p.prefix_hash)?;
            IndexEvent::PrefixStored {
                prefix_hash: p.prefix_hash,
                token_count: p.token_count,
            }
        }
        WireKind::TierStored(t) => IndexEvent::TierStored {
            tier: tier_of(t.tier)?,
            hashes: t.hashes,
        },
        WireKind::TierRemoved(t) => IndexEvent::TierRemoved {
            tier: tier_of(t.tier)?,
            hashes: t.hashes,
        },
    };
    // An event the index would reject is refused with its message.
    if event.is_valid() {
        Ok(event)
    } else {
        Err(Refusal::Malformed)
    }
}

/// How many hashes an event carries (what [`split_events`] counts).
fn weight(e: &IndexEvent) -> usize {
    match e {
        IndexEvent::Stored { hashes, .. }
        | IndexEvent::Removed { hashes }
        | IndexEvent::TierStored { hashes, .. }
        | IndexEvent::TierRemoved { hashes, .. } => hashes.len(),
        IndexEvent::Cleared | IndexEvent::PrefixStored { .. } => 1,
    }
}

/// Cuts `events` into consecutive groups of at most [`MAX_BATCH_HASHES`]
/// hashes, cutting a long event into pieces (a stored run's next piece has the
/// previous piece's last block as its parent). Applying the groups in order is
/// applying `events`.
pub fn split_events(events: &[IndexEvent]) -> Vec<Vec<IndexEvent>> {
    let mut out: Vec<Vec<IndexEvent>> = Vec::new();
    let mut current = Vec::new();
    let mut room = MAX_BATCH_HASHES;
    let mut push = |e: IndexEvent, current: &mut Vec<IndexEvent>, room: &mut usize| {
        let w = weight(&e);
        if w > *room && !current.is_empty() {
            out.push(std::mem::take(current));
            *room = MAX_BATCH_HASHES;
        }
        *room = room.saturating_sub(w);
        current.push(e);
    };
    for e in events {
        if weight(e) <= MAX_BATCH_HASHES {
            push(e.clone(), &mut current, &mut room);
            continue;
        }
        match e {
            IndexEvent::Stored {
                parent,
                hashes,
                token_counts,
            } => {
                let mut parent = *parent;
                for (i, piece) in hashes.chunks(MAX_BATCH_HASHES).enumerate() {
                    let counts = if token_counts.is_empty() {
                        Vec::new()
                    } else {
                        let start = i * MAX_BATCH_HASHES;
                        token_counts[start..start + piece.len()].to_vec()
                    };
                    push(
                        IndexEvent::Stored {
                            parent,
                            hashes: piece.to_vec(),
                            token_counts: counts,
                        },
                        &mut current,
                        &mut room,
                    );
                    parent = piece.last().copied();
                }
            }
            IndexEvent::Removed { hashes } => {
                for piece in hashes.chunks(MAX_BATCH_HASHES) {
                    let e = IndexEvent::Removed {
                        hashes: piece.to_vec(),
                    };
                    push(e, &mut current, &mut room);
                }
            }
            IndexEvent::TierStored { tier, hashes } | IndexEvent::TierRemoved { tier, hashes } => {
                let stored = matches!(e, IndexEvent::TierStored { .. });
                for piece in hashes.chunks(MAX_BATCH_HASHES) {
                    let (tier, hashes) = (*tier, piece.to_vec());
                    let e = if stored {
                        IndexEvent::TierStored { tier, hashes }
                    } else {
                        IndexEvent::TierRemoved { tier, hashes }
                    };
                    push(e, &mut current, &mut room);
                }
            }
            IndexEvent::Cleared | IndexEvent::PrefixStored { .. } => {
                push(e.clone(), &mut current, &mut room);
            }
        }
    }
    if !current.is_empty() {
        out.push(current);
    }
    out
}

/// The bytes of `batch` (its events should come from [`split_events`]).
pub fn encode_batch(batch: &KvBatch) -> Vec<u8> {
    WireBatch {
        v: VERSION,
        origin: batch.origin.clone(),
        epoch: batch.epoch,
        fence: batch.fence,
        engine: Some(to_wire_engine(&batch.engine)),
        endpoint: batch.endpoint.clone(),
        events: batch.events.iter().map(to_wire_event).collect(),
    }
    .encode_to_vec()
}

/// The batch in `bytes`, or why it is refused: nothing of a refused batch is
/// applied, not even its valid events.
pub fn decode_batch(bytes: &[u8]) -> Result<KvBatch, Refusal> {
    check_version(bytes, MAX_BATCH_BYTES)?;
    let b = WireBatch::decode(bytes).map_err(|_| Refusal::Malformed)?;
    check_id(&b.origin)?;
    if b.endpoint.len() > MAX_ID_BYTES || b.events.is_empty() {
        return Err(Refusal::Malformed);
    }
    Ok(KvBatch {
        origin: b.origin,
        epoch: b.epoch,
        fence: b.fence,
        engine: from_wire_engine(b.engine)?,
        endpoint: b.endpoint,
        events: b
            .events
            .into_iter()
            .map(from_wire_event)
            .collect::<Result<_, _>>()?,
    })
}

/// The bytes of `snapshot`.
pub fn encode_snapshot(snapshot: &IndexSnapshot) -> Vec<u8> {
    WireSnapshot {
        v: VERSION,
        stream_seq: snapshot.stream_seq,
        writer: snapshot.writer.clone(),
        engines: snapshot
            .engines
            .iter()
            .map(|e| WireEngineState {
                engine: Some(to_wire_engine(&e.engine)),
                endpoint: e.endpoint.clone(),
                fence: e.fence,
                events: e.events.iter().map(to_wire_event).collect(),
            })
            .collect(),
    }
    .encode_to_vec()
}

/// The snapshot in `bytes`, or why it is refused (then none of it is loaded).
pub fn decode_snapshot(bytes: &[u8]) -> Result<IndexSnapshot, Refusal> {
    check_version(bytes, MAX_SNAPSHOT_BYTES)?;
    let s = WireSnapshot::decode(bytes).map_err(|_| Refusal::Malformed)?;
    let engines = s
        .engines
        .into_iter()
        .map(|e| {
            if e.endpoint.len() > MAX_ID_BYTES {
                return Err(Refusal::Malformed);
            }
            Ok(EngineState {
                engine: from_wire_engine(e.engine)?,
                endpoint: e.endpoint,
                fence: e.fence,
                events: e
                    .events
                    .into_iter()
                    .map(from_wire_event)
                    .collect::<Result<_, _>>()?,
            })
        })
        .collect::<Result<_, _>>()?;
    Ok(IndexSnapshot {
        stream_seq: s.stream_seq,
        writer: s.writer,
        engines,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engine(replica: &str, rank: u32) -> EngineId {
        EngineId {
            scope: ScopeRef::new("t", "m", "vllm").to_owned(),
            replica: replica.into(),
            rank,
        }
    }

    fn batch(events: Vec<IndexEvent>) -> KvBatch {
        KvBatch {
            origin: "s1".into(),
            epoch: 7,
            fence: 42,
            engine: engine("r1", 0),
            endpoint: "10.0.0.1:8000".into(),
            events,
        }
    }

    fn every_event() -> Vec<IndexEvent> {
        vec![
            IndexEvent::Cleared,
            IndexEvent::Stored {
                parent: None,
                hashes: vec![1, u64::MAX],
                token_counts: vec![16, 3],
            },
            IndexEvent::Stored {
                parent: Some(0),
                hashes: vec![5],
                token_counts: vec![],
            },
            IndexEvent::Removed { hashes: vec![1] },
            IndexEvent::TierStored {
                tier: Tier::Cpu,
                hashes: vec![9],
            },
            IndexEvent::TierRemoved {
                tier: Tier::Disk,
                hashes: vec![9],
            },
            IndexEvent::PrefixStored {
                prefix_hash: "abc".into(),
                token_count: 12,
            },
        ]
    }

    #[test]
    fn every_event_round_trips() {
        let b = batch(every_event());
        assert_eq!(decode_batch(&encode_batch(&b)), Ok(b.clone()));
        let s = IndexSnapshot {
            stream_seq: 99,
            writer: "s2".into(),
            engines: vec![EngineState {
                engine: b.engine.clone(),
                endpoint: b.endpoint.clone(),
                fence: 3,
                events: every_event(),
            }],
        };
        assert_eq!(decode_snapshot(&encode_snapshot(&s)), Ok(s));
    }

    #[test]
    fn engine_tokens_are_subject_tokens_and_tell_engines_apart() {
        let a = engine("r1", 0).token();
        assert_eq!(a.len(), 16);
        assert!(a.chars().all(|c| c.is_ascii_hexdigit()));
        assert_eq!(a, engine("r1", 0).token());
        assert_ne!(a, engine("r1", 1).token());
        assert_ne!(a, engine("r2", 0).token());
        // The separator keeps ("ab", "c") and ("a", "bc") apart.
        let split = |t: &str, m: &str| EngineId {
            scope: ScopeRef::new(t, m, "s").to_owned(),
            replica: "r".into(),
            rank: 0,
        };
        assert_ne!(split("ab", "c").token(), split("a", "bc").token());
    }

    #[test]
    fn refusals_are_named_and_nothing_is_half_decoded() {
        assert_eq!(
            decode_batch(&vec![0u8; MAX_BATCH_BYTES + 1]),
            Err(Refusal::Oversized)
        );
        assert_eq!(decode_batch(b"garbage\xff"), Err(Refusal::Malformed));
        assert_eq!(decode_batch(&[]), Err(Refusal::Malformed));
        let mut future = WireBatch::decode(&*encode_batch(&batch(every_event()))).expect("ok");
        future.v = VERSION + 1;
        assert_eq!(
            decode_batch(&future.encode_to_vec()),
            Err(Refusal::ForeignVersion)
        );
        // One invalid event refuses the whole batch.
        let mut bad = batch(every_event());
        bad.events.push(IndexEvent::Removed { hashes: vec![] });
        assert_eq!(decode_batch(&encode_batch(&bad)), Err(Refusal::Malformed));
        let mut tier = WireBatch::decode(&*encode_batch(&batch(every_event()))).expect("ok");
        tier.events.push(WireEvent {
            kind: Some(WireKind::TierStored(WireTierHashes {
                tier: 7,
                hashes: vec![1],
            })),
        });
        assert_eq!(decode_batch(&tier.encode_to_vec()), Err(Refusal::Malformed));
        let mut anonymous = batch(every_event());
        anonymous.engine.replica = String::new();
        assert_eq!(
            decode_batch(&encode_batch(&anonymous)),
            Err(Refusal::Malformed)
        );
        let empty = batch(vec![]);
        assert_eq!(decode_batch(&encode_batch(&empty)), Err(Refusal::Malformed));
    }

    #[test]
    fn long_batches_are_cut_in_order_and_stay_under_the_limit() {
        let n = MAX_BATCH_HASHES * 2 + 10;
        let hashes: Vec<u64> = (1..=n as u64).collect();
        let counts: Vec<u32> = (0..n as u32).collect();
        let events = vec![
            IndexEvent::Removed { hashes: vec![7] },
            IndexEvent::Stored {
                parent: Some(99),
                hashes: hashes.clone(),
                token_counts: counts.clone(),
            },
            IndexEvent::Cleared,
        ];
        let groups = split_events(&events);
        assert!(groups.len() >= 3);
        let mut stored = Vec::new();
        let mut stored_counts = Vec::new();
        let mut expected_parent = Some(99);
        for g in &groups {
            assert!(g.iter().map(weight).sum::<usize>() <= MAX_BATCH_HASHES);
            let b = batch(g.clone());
            assert!(encode_batch(&b).len() <= MAX_BATCH_BYTES);
            for e in g {
                if let IndexEvent::Stored {
                    parent,
                    hashes,
                    token_counts,
                } = e
                {
                    assert_eq!(*parent, expected_parent);
                    expected_parent = hashes.last().copied();
                    stored.extend_from_slice(hashes);
                    stored_counts.extend_from_slice(token_counts);
                }
            }
        }
        assert_eq!(stored, hashes);
        assert_eq!(stored_counts, counts);
        assert_eq!(groups[0][0], IndexEvent::Removed { hashes: vec![7] });
        assert_eq!(
            groups.last().and_then(|g| g.last()),
            Some(&IndexEvent::Cleared)
        );
        // Small batches stay whole.
        assert_eq!(split_events(&every_event()), vec![every_event()]);
    }
}
