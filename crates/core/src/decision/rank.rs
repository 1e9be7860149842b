//! The distinguishing-power ranker (contract §4 step 7).
//!
//! For block i of the request chain, h_i is how many serving replicas hold the
//! leading run through block i, and d_i = 1 − h_i / N its distinguishing power.
//! A replica that holds the first m_r blocks scores Σ_{i<m_r} (t_i / 16) × d_i:
//! a prefix every replica holds (a chat template, a shared system prompt) adds
//! nothing, so the floors can catch it.

use smallvec::SmallVec;

/// Tokens per block the score is normalised to.
const SCORE_BLOCK_TOKENS: f64 = 16.0;

/// One ranked replica (by member index of the serving set).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Row {
    pub member: usize,
    pub score: f64,
    pub matched_tokens: u32,
    pub matched_blocks: u32,
}

/// What the ranker concluded.
#[derive(Debug, PartialEq)]
pub(crate) enum Ranking {
    /// No serving replica matched even one block: the TENANT_HOT branch.
    NoMatch,
    /// Matches existed but the floors downgraded them: StrategyNone.
    BelowFloor,
    /// PREFIX_MATCH, best first.
    Prefix(Vec<Row>),
}

/// The floors of one policy.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Floors {
    pub minimum_matched_tokens: u32,
    pub routing_floor_score: f64,
}

fn clamp_u32(v: u64) -> u32 {
    u32::try_from(v).unwrap_or(u32::MAX)
}

/// Ranks the chain path. `runs[member]` is m_r (members in replica-id order);
/// `token_counts` the request's.
pub(crate) fn rank_chain(runs: &[u32], token_counts: &[u32], floors: Floors) -> Ranking {
    rank_chain_tiered(runs, &[], token_counts, floors)
}

/// [`rank_chain`] with memory tiers: `lower` lists (member, block, weight) for
/// the blocks of a member's run it holds only in a slower tier; such a block adds
/// `weight` × its GPU share to the score (`h_i` counts every holder, whatever
/// the tier). Matched tokens count the blocks whole: they are cached. With no
/// lower blocks this is `rank_chain` exactly.
pub(crate) fn rank_chain_tiered(
    runs: &[u32],
    lower: &[(usize, u32, f64)],
    token_counts: &[u32],
    floors: Floors,
) -> Ranking {
    let n = runs.len();
    let max_run = runs.iter().copied().max().unwrap_or(0) as usize;
    if max_run == 0 || n == 0 {
        return Ranking::NoMatch;
    }
    // holders_through[i] = h_i, from a histogram of run lengths.
    let mut ending = zeros(max_run + 1);
    for &m in runs {
        ending[m as usize] += 1;
    }
    // Prefix sums over the blocks: (score, tokens) of holding the first i blocks.
    // Built by `extend`, which writes each element once (no zero fill first).
    let inv_n = 1.0 / n as f64;
    let mut holding = n as u32 - ending[0];
    let mut sum = (0.0f64, 0u64);
    let mut prefix: SmallVec<[(f64, u64); 72]> = SmallVec::with_capacity(max_run + 1);
    prefix.push(sum);
    prefix.extend(ending[1..].iter().enumerate().map(|(i, &ended)| {
        let t = token_counts.get(i).copied().unwrap_or(0);
        let d = 1.0 - f64::from(holding) * inv_n;
        sum.0 += (f64::from(t) / SCORE_BLOCK_TOKENS) * d;
        sum.1 += u64::from(t);
        holding -= ended;
        sum
    }));
    // Sized for every member up front: a filtered `collect` would grow (and
    // reallocate) the vector row by row.
    let mut rows: Vec<Row> = Vec::with_capacity(n);
    for (member, &m) in runs.iter().enumerate() {
        if m == 0 {
            continue;
        }
        let (score, tokens) = prefix[m as usize];
        rows.push(Row {
            member,
            score,
            matched_tokens: clamp_u32(tokens),
            matched_blocks: m,
        });
    }
    if !lower.is_empty() {
        let mut row_of = vec![usize::MAX; n];
        for (at, r) in rows.iter().enumerate() {
            row_of[r.member] = at;
        }
        for &(member, block, weight) in lower {
            let (b, at) = (block as usize, row_of.get(member).copied());
            if let Some(r) = at.and_then(|at| rows.get_mut(at))
                && b + 1 < prefix.len()
            {
                r.score -= (1.0 - weight) * (prefix[b + 1].0 - prefix[b].0);
            }
        }
    }
    finish(&mut rows, floors)
}

/// `len` zeroed counters, on the stack for chains of up to 71 blocks. A memset,
/// where `SmallVec::from_elem` writes element by element.
fn zeros(len: usize) -> SmallVec<[u32; 72]> {
    if len <= 72 {
        SmallVec::from_buf_and_len([0; 72], len)
    } else {
        SmallVec::from_vec(vec![0; len])
    }
}

/// Ranks the legacy exact-prefix path: every holder matched one block of
/// `tokens` tokens.
pub(crate) fn rank_prefix(holders: &[u16], serving: usize, tokens: u32, floors: Floors) -> Ranking {
    if holders.is_empty() || serving == 0 {
        return Ranking::NoMatch;
    }
    let d = 1.0 - holders.len() as f64 / serving as f64;
    let score = (f64::from(tokens) / SCORE_BLOCK_TOKENS) * d;
    let mut rows: Vec<Row> = holders
        .iter()
        .map(|&m| Row {
            member: usize::from(m),
            score,
            matched_tokens: tokens,
            matched_blocks: 1,
        })
        .collect();
    finish(&mut rows, floors)
}

/// Both floors, then the order: score desc, matched tokens desc, replica id asc.
/// Rows arrive in member order, which is replica-id order, so a stable sort on
/// the first two keys settles ties by id.
fn finish(rows: &mut Vec<Row>, floors: Floors) -> Ranking {
    rows.retain(|r| r.matched_tokens >= floors.minimum_matched_tokens);
    if rows.is_empty() {
        return Ranking::BelowFloor;
    }
    sort_stable(rows, |a, b| {
        b.score
            .total_cmp(&a.score)
            .then_with(|| b.matched_tokens.cmp(&a.matched_tokens))
    });
    if rows[0].score < floors.routing_floor_score {
        return Ranking::BelowFloor;
    }
    Ranking::Prefix(std::mem::take(rows))
}

/// A stable sort. Rows come nearly sorted (a few distinct scores, ties in id
/// order), where insertion sort is linear and, for the usual few dozen replicas,
/// several times cheaper than the general sort's setup.
fn sort_stable(rows: &mut [Row], cmp: impl Fn(&Row, &Row) -> std::cmp::Ordering) {
    if rows.len() > 64 {
        rows.sort_by(cmp);
        return;
    }
    for i in 1..rows.len() {
        let mut j = i;
        while j > 0 && cmp(&rows[j - 1], &rows[j]) == std::cmp::Ordering::Greater {
            rows.swap(j - 1, j);
            j -= 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const IDS: [&str; 4] = ["a", "b", "c", "d"];
    const OPEN: Floors = Floors {
        minimum_matched_tokens: 0,
        routing_floor_score: 0.0,
    };

    fn rows(r: Ranking) -> Vec<Row> {
        match r {
            Ranking::Prefix(rows) => rows,
            other => panic!("expected Prefix, got {other:?}"),
        }
    }

    #[test]
    fn score_is_distinguishing_power_weighted() {
        // 4 serving; a holds 3 blocks, b holds 1, c and d none.
        let r = rows(rank_chain(&[3, 1, 0, 0], &[16, 16, 16], OPEN));
        // Block 0: h=2 → d=0.5; blocks 1,2: h=1 → d=0.75.
        assert_eq!(r[0].member, 0);
        assert!((r[0].score - (0.5 + 0.75 + 0.75)).abs() < 1e-12);
        assert_eq!(r[0].matched_tokens, 48);
        assert_eq!(r[0].matched_blocks, 3);
        assert_eq!(r[1].member, 1);
        assert!((r[1].score - 0.5).abs() < 1e-12);
    }

    #[test]
    fn overlap_held_by_all_scores_zero() {
        let r = rows(rank_chain(&[2, 2, 2, 2], &[16, 16], OPEN));
        assert!(r.iter().all(|row| row.score == 0.0));
        // Ties sort by id.
        let order: Vec<_> = r.iter().map(|row| IDS[row.member]).collect();
        assert_eq!(order, ["a", "b", "c", "d"]);
    }

    #[test]
    fn partial_blocks_count_their_tokens() {
        let r = rows(rank_chain(&[2, 0, 0, 0], &[16, 8], OPEN));
        assert_eq!(r[0].matched_tokens, 24);
        assert!((r[0].score - (0.75 + 0.5 * 0.75)).abs() < 1e-12);
    }

    #[test]
    fn no_match_is_distinct_from_below_floor() {
        assert_eq!(rank_chain(&[0, 0], &[16], OPEN), Ranking::NoMatch);
        let floors = Floors {
            minimum_matched_tokens: 64,
            routing_floor_score: 0.0,
        };
        assert_eq!(rank_chain(&[1, 0], &[16], floors), Ranking::BelowFloor);
    }

    #[test]
    fn score_floor_gates_only_the_best_survivor() {
        let floors = Floors {
            minimum_matched_tokens: 0,
            routing_floor_score: 0.6,
        };
        // a scores 2.0, b scores 0.5 (< floor) but stays listed.
        let r = rows(rank_chain(&[3, 1, 0, 0], &[16, 16, 16], floors));
        assert_eq!(r.len(), 2);
    }

    #[test]
    fn legacy_prefix_is_one_block() {
        let r = rows(rank_prefix(&[2], 4, 32, OPEN));
        assert_eq!(r[0].member, 2);
        assert_eq!(r[0].matched_blocks, 1);
        assert_eq!(r[0].matched_tokens, 32);
        assert!((r[0].score - 2.0 * 0.75).abs() < 1e-12);
    }

    #[test]
    fn sort_stable_agrees_with_the_standard_stable_sort() {
        for n in [0usize, 1, 5, 40, 64, 65, 130] {
            let mut rows: Vec<Row> = (0..n)
                .map(|i| Row {
                    member: i,
                    score: ((i * 7919) % 3) as f64,
                    matched_tokens: ((i * 104_729) % 2) as u32,
                    matched_blocks: 1,
                })
                .collect();
            let cmp = |a: &Row, b: &Row| {
                b.score
                    .total_cmp(&a.score)
                    .then_with(|| b.matched_tokens.cmp(&a.matched_tokens))
            };
            let mut expected = rows.clone();
            expected.sort_by(cmp);
            sort_stable(&mut rows, cmp);
            assert_eq!(rows, expected, "n = {n}");
        }
    }
}
