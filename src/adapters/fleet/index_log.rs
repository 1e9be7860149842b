//! The fleet's index as its KV event stream built it, in a form that can be
//! written out: per engine, which blocks it holds (with each block's parent,
//! references and token count), its lower-tier blocks and exact prefixes, and
//! its relay fence, as of a stream sequence.
//!
//! The index itself keeps blocks in shards laid out for lookups and cannot
//! list its chains parent first; this log can, so a snapshot is a list of
//! ordinary stored events that rebuild the same chains through the ordinary
//! ingest path in a new sidecar. It follows the engines' own events only:
//! entries the index drops on its own (TTL, quota, the entry cap) stay here
//! until the engine removes them, and a sidecar loading the snapshot applies
//! its own limits again. It costs about 40 bytes per block held, beside the
//! index's own.

use hashbrown::{HashMap, HashSet};

use super::kv_wire::{EngineId, EngineState, IndexSnapshot, split_events};
use crate::core::index::{IndexEvent, Tier};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Block {
    parent: Option<u64>,
    refs: u32,
    /// As the engine gave it; 0: not given (a full block).
    tokens: u32,
}

#[derive(Debug, Default)]
struct EngineLog {
    endpoint: String,
    fence: u64,
    blocks: HashMap<u64, Block>,
    tiers: HashMap<(u32, u64), u32>,
    prefixes: HashMap<String, u32>,
}

/// Why a batch is not applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fenced {
    /// It comes from a relay whose lease a newer relay of the engine holds.
    Stale,
}

/// See the module documentation.
#[derive(Debug, Default)]
pub struct IndexLog {
    engines: HashMap<EngineId, EngineLog>,
    /// The last subject token checked, and the engine it names: a stream
    /// carries runs of one engine's batches, so most checks skip the hash.
    named: Option<(String, EngineId)>,
    /// The last stream message applied.
    stream_seq: u64,
}

fn tier_key(tier: Tier) -> u32 {
    match tier {
        Tier::Cpu => 1,
        Tier::Disk => 2,
    }
}

fn tier_of(key: u32) -> Tier {
    if key == 1 { Tier::Cpu } else { Tier::Disk }
}

fn release<K: std::hash::Hash + Eq>(map: &mut HashMap<K, u32>, key: K) {
    // The count goes down; at zero the key goes.
    if let hashbrown::hash_map::Entry::Occupied(mut e) = map.entry(key) {
        *e.get_mut() -= 1;
        if *e.get() == 0 {
            e.remove();
        }
    }
}

impl EngineLog {
    fn apply(&mut self, events: &[IndexEvent]) {
        for event in events {
            match event {
                IndexEvent::Stored {
                    parent,
                    hashes,
                    token_counts,
                } => {
                    let mut parent = *parent;
                    for (i, &h) in hashes.iter().enumerate() {
                        let tokens = token_counts.get(i).copied().unwrap_or(0);
                        let b = self.blocks.entry(h).or_insert(Block {
                            parent,
                            refs: 0,
                            tokens,
                        });
                        b.refs = b.refs.saturating_add(1);
                        b.parent = parent;
                        b.tokens = tokens;
                        parent = Some(h);
                    }
                }
                IndexEvent::Removed { hashes } => {
                    for h in hashes {
                        if let hashbrown::hash_map::Entry::Occupied(mut e) = self.blocks.entry(*h) {
                            e.get_mut().refs -= 1;
                            if e.get().refs == 0 {
                                e.remove();
                            }
                        }
                    }
                }
                IndexEvent::Cleared => {
                    self.blocks.clear();
                    self.tiers.clear();
                    self.prefixes.clear();
                }
                IndexEvent::PrefixStored {
                    prefix_hash,
                    token_count,
                } => {
                    self.prefixes.insert(prefix_hash.clone(), *token_count);
                }
                IndexEvent::TierStored { tier, hashes } => {
                    for h in hashes {
                        let refs = self.tiers.entry((tier_key(*tier), *h)).or_insert(0);
                        *refs = refs.saturating_add(1);
                    }
                }
                IndexEvent::TierRemoved { tier, hashes } => {
                    for h in hashes {
                        release(&mut self.tiers, (tier_key(*tier), *h));
                    }
                }
            }
        }
    }

    /// Events that rebuild this engine from nothing: its chains parent first
    /// (each run stored after the block it extends), then second and further
    /// references, lower tiers and prefixes.
    fn events(&self) -> Vec<IndexEvent> {
        let mut out = Vec::new();
        let mut emitted: HashSet<u64> = HashSet::with_capacity(self.blocks.len());
        let mut path = Vec::new();
        for (&leaf, _) in &self.blocks {
            if emitted.contains(&leaf) {
                continue;
            }
            // Climb to the highest ancestor not yet written (bounded: a
            // forged cycle of parents ends the climb where it closes).
            path.clear();
            let mut cur = leaf;
            loop {
                path.push(cur);
                emitted.insert(cur);
                match self.blocks.get(&cur).and_then(|b| b.parent) {
                    Some(p) if self.blocks.contains_key(&p) && !emitted.contains(&p) => cur = p,
                    _ => break,
                }
            }
            path.reverse();
            self.push_run(&path, &mut out);
        }
        for (&h, b) in &self.blocks {
            for _ in 1..b.refs {
                out.push(IndexEvent::Stored {
                    parent: b.parent,
                    hashes: vec![h],
                    token_counts: if b.tokens > 0 { vec![b.tokens] } else { vec![] },
                });
            }
        }
        let mut tiers: Vec<(u32, Vec<u64>)> = Vec::new();
        for (&(tier, h), &refs) in &self.tiers {
            let at = match tiers.iter().position(|(t, _)| *t == tier) {
                Some(at) => at,
                None => {
                    tiers.push((tier, Vec::new()));
                    tiers.len() - 1
                }
            };
            tiers[at].1.extend(std::iter::repeat_n(h, refs as usize));
        }
        for (tier, hashes) in tiers {
            out.push(IndexEvent::TierStored {
                tier: tier_of(tier),
                hashes,
            });
        }
        for (prefix, &tokens) in &self.prefixes {
            out.push(IndexEvent::PrefixStored {
                prefix_hash: prefix.clone(),
                token_count: tokens,
            });
        }
        out
    }

    /// One chain stretch as stored events, cut where blocks with and without
    /// token counts meet (a stored event gives counts for all or none).
    fn push_run(&self, run: &[u64], out: &mut Vec<IndexEvent>) {
        let tokens = |h: &u64| self.blocks.get(h).map_or(0, |b| b.tokens);
        let mut start = 0;
        while start < run.len() {
            let counted = tokens(&run[start]) > 0;
            let len = run[start..]
                .iter()
                .take_while(|h| (tokens(h) > 0) == counted)
                .count();
            let piece = &run[start..start + len];
            out.push(IndexEvent::Stored {
                parent: self.blocks.get(&piece[0]).and_then(|b| b.parent),
                hashes: piece.to_vec(),
                token_counts: if counted {
                    piece.iter().map(tokens).collect()
                } else {
                    Vec::new()
                },
            });
            start += len;
        }
    }
}

impl IndexLog {
    fn engine_mut(&mut self, engine: &EngineId) -> &mut EngineLog {
        // Cloned on an engine's first batch only.
        self.engines.entry_ref(engine).or_default()
    }

    /// Whether `token` (a subject's) is `engine`'s token.
    pub fn names(&mut self, token: &str, engine: &EngineId) -> bool {
        if let Some((t, e)) = &self.named
            && t == token
            && e == engine
        {
            return true;
        }
        if engine.token() != token {
            return false;
        }
        self.named = Some((token.to_string(), engine.clone()));
        true
    }

    /// Checks a batch's fence against the newest one applied for its engine,
    /// and moves that to the batch's.
    pub fn admit(&mut self, engine: &EngineId, fence: u64) -> Result<(), Fenced> {
        let log = self.engine_mut(engine);
        if fence < log.fence {
            return Err(Fenced::Stale);
        }
        log.fence = fence;
        Ok(())
    }

    /// Records an admitted batch, the stream message `stream_seq`.
    pub fn apply(&mut self, engine: &EngineId, endpoint: &str, events: &[IndexEvent]) {
        let log = self.engine_mut(engine);
        if !endpoint.is_empty() {
            log.endpoint.clear();
            log.endpoint.push_str(endpoint);
        }
        log.apply(events);
    }

    /// The stream message the log is at.
    pub fn stream_seq(&self) -> u64 {
        self.stream_seq
    }

    pub fn set_stream_seq(&mut self, seq: u64) {
        self.stream_seq = seq;
    }

    /// Blocks held, over every engine (second references not counted).
    pub fn blocks(&self) -> usize {
        self.engines.values().map(|e| e.blocks.len()).sum()
    }

    /// The log written out.
    pub fn snapshot(&self, writer: &str) -> IndexSnapshot {
        let mut engines: Vec<EngineState> = self
            .engines
            .iter()
            .map(|(engine, log)| EngineState {
                engine: engine.clone(),
                endpoint: log.endpoint.clone(),
                fence: log.fence,
                events: log.events(),
            })
            .collect();
        engines.sort_by(|a, b| {
            (&a.engine.scope, &a.engine.replica, a.engine.rank).cmp(&(
                &b.engine.scope,
                &b.engine.replica,
                b.engine.rank,
            ))
        });
        IndexSnapshot {
            stream_seq: self.stream_seq,
            writer: writer.to_string(),
            engines,
        }
    }

    /// Replaces the log with `snapshot`'s contents.
    pub fn load(&mut self, snapshot: &IndexSnapshot) {
        self.engines.clear();
        for e in &snapshot.engines {
            let log = self.engines.entry(e.engine.clone()).or_default();
            log.fence = e.fence;
            log.endpoint.clone_from(&e.endpoint);
            for group in split_events(&e.events) {
                log.apply(&group);
            }
        }
        self.stream_seq = snapshot.stream_seq;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::scope::ScopeRef;

    fn engine(replica: &str) -> EngineId {
        EngineId {
            scope: ScopeRef::new("t", "m", "s").to_owned(),
            replica: replica.into(),
            rank: 0,
        }
    }

    fn stored(parent: Option<u64>, hashes: &[u64]) -> IndexEvent {
        IndexEvent::Stored {
            parent,
            hashes: hashes.to_vec(),
            token_counts: vec![],
        }
    }

    /// The state `events` leave, compared through a log rebuilt from them.
    /// One engine's blocks and tier references, sorted.
    type EngineState = (EngineId, Vec<(u64, Block)>, Vec<((u32, u64), u32)>);

    fn state(log: &IndexLog) -> Vec<EngineState> {
        let mut out: Vec<_> = log
            .engines
            .iter()
            .map(|(e, l)| {
                let mut b: Vec<_> = l.blocks.iter().map(|(h, b)| (*h, *b)).collect();
                b.sort_by_key(|x| x.0);
                let mut t: Vec<_> = l.tiers.iter().map(|(k, v)| (*k, *v)).collect();
                t.sort();
                (e.clone(), b, t)
            })
            .collect();
        out.sort_by(|a, b| a.0.replica.cmp(&b.0.replica));
        out
    }

    #[test]
    fn stores_and_removals_count_references() {
        let mut log = IndexLog::default();
        let e = engine("r1");
        log.apply(
            &e,
            "a:1",
            &[stored(None, &[1, 2, 3]), stored(Some(1), &[2])],
        );
        assert_eq!(log.blocks(), 3);
        log.apply(
            &e,
            "",
            &[IndexEvent::Removed {
                hashes: vec![2, 3, 99],
            }],
        );
        // Block 2 had two references; 3 had one; 99 was never held.
        assert_eq!(log.blocks(), 2);
        log.apply(&e, "", &[IndexEvent::Removed { hashes: vec![2] }]);
        assert_eq!(log.blocks(), 1);
        log.apply(&e, "", &[IndexEvent::Cleared]);
        assert_eq!(log.blocks(), 0);
        assert_eq!(log.engines[&e].endpoint, "a:1");
    }

    #[test]
    fn an_older_fence_is_refused_and_an_equal_or_newer_one_admitted() {
        let mut log = IndexLog::default();
        let e = engine("r1");
        assert_eq!(log.admit(&e, 5), Ok(()));
        assert_eq!(log.admit(&e, 5), Ok(()));
        assert_eq!(log.admit(&e, 4), Err(Fenced::Stale));
        assert_eq!(log.admit(&e, 9), Ok(()));
        assert_eq!(log.admit(&e, 5), Err(Fenced::Stale));
        // Fences are per engine.
        assert_eq!(log.admit(&engine("r2"), 1), Ok(()));
    }

    #[test]
    fn a_snapshot_writes_chains_parent_first_and_rebuilds_the_same_state() {
        let mut log = IndexLog::default();
        let (a, b) = (engine("a"), engine("b"));
        log.apply(
            &a,
            "a:1",
            &[
                // A tree: 1-2-3 and 1-2-4, then 5-6 with token counts.
                stored(None, &[1, 2, 3]),
                stored(Some(2), &[4]),
                IndexEvent::Stored {
                    parent: None,
                    hashes: vec![5, 6],
                    token_counts: vec![16, 7],
                },
                stored(Some(6), &[8]),
                stored(None, &[1]),
                IndexEvent::TierStored {
                    tier: Tier::Cpu,
                    hashes: vec![3, 3],
                },
                IndexEvent::PrefixStored {
                    prefix_hash: "p".into(),
                    token_count: 4,
                },
            ],
        );
        log.apply(
            &b,
            "b:1",
            &[
                stored(None, &[10, 11]),
                IndexEvent::Removed { hashes: vec![10] },
            ],
        );
        log.admit(&a, 3).expect("fence");
        log.set_stream_seq(77);
        let snap = log.snapshot("w");
        assert_eq!(snap.stream_seq, 77);
        // Every stored run comes after the block it extends.
        for e in &snap.engines {
            let mut seen = HashSet::new();
            for ev in &e.events {
                if let IndexEvent::Stored {
                    parent,
                    hashes,
                    token_counts,
                } = ev
                {
                    if let Some(p) = parent
                        && e.engine.replica == "a"
                        && [1, 2, 5, 6].contains(p)
                    {
                        assert!(seen.contains(p), "{p} after its child");
                    }
                    assert!(token_counts.is_empty() || token_counts.len() == hashes.len());
                    seen.extend(hashes.iter().copied());
                }
            }
        }
        let mut rebuilt = IndexLog::default();
        rebuilt.load(&snap);
        assert_eq!(state(&rebuilt), state(&log));
        assert_eq!(rebuilt.engines[&a].fence, 3);
        assert_eq!(rebuilt.engines[&a].prefixes["p"], 4);
        assert_eq!(rebuilt.stream_seq(), 77);
        // Applying the snapshot's events to an empty log gives the same too:
        // what a new sidecar's index receives.
        let mut replayed = IndexLog::default();
        for e in &snap.engines {
            replayed.apply(&e.engine, &e.endpoint, &e.events);
        }
        assert_eq!(state(&replayed), state(&log));
    }

    #[test]
    fn a_subject_token_names_its_engine_only_even_when_remembered() {
        let mut log = IndexLog::default();
        let (a, b) = (engine("a"), engine("b"));
        let ta = a.token();
        assert!(log.names(&ta, &a));
        assert!(log.names(&ta, &a), "remembered");
        assert!(!log.names(&ta, &b), "another engine under a's token");
        assert!(!log.names("00ff00ff00ff00ff", &a));
        assert!(log.names(&b.token(), &b));
    }

    #[test]
    fn a_forged_parent_cycle_ends_the_climb() {
        let mut log = IndexLog::default();
        let e = engine("r");
        log.apply(&e, "", &[stored(Some(2), &[1]), stored(Some(1), &[2])]);
        let snap = log.snapshot("w");
        let mut rebuilt = IndexLog::default();
        rebuilt.load(&snap);
        assert_eq!(rebuilt.blocks(), 2);
    }
}
