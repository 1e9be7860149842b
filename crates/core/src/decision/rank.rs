//! The distinguishing-power ranker (docs/decision.md, step 7).
//!
//! For block i of the request chain, h_i is how many serving replicas hold the
//! leading run through block i, and d_i = 1 − h_i / N its distinguishing power.
//! A replica that holds the first m_r blocks scores Σ_{i<m_r} (t_i / 16) × d_i:
//! a prefix every replica holds (a chat template, a shared system prompt) adds
//! nothing, so the floors can catch it.

use smallvec::SmallVec;

/// Tokens per block the score is normalised to.
const SCORE_BLOCK_TOKENS: f64 = 16.0;

/// One ranked replica (by member index of the serving set). `repr(C)`, like
/// [`super::outcome::ScoredSlot`], whose fields sit where these do: turning the
/// rows into the decision's in place then rewrites only the slot.
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C)]
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
    let max_run = runs.iter().copied().max().unwrap_or(0) as usize;
    if max_run == 0 || runs.is_empty() {
        return Ranking::NoMatch;
    }
    let len = max_run + 1;
    // Scratch on the stack for chains of up to 71 blocks (plain arrays: a
    // `SmallVec` this size is copied whole when it is built and moved).
    if lower.is_empty() {
        let ranked = if len <= STACK_BLOCKS {
            let mut ending = [0u32; STACK_BLOCKS];
            let mut lengths = [0u64; STACK_BLOCKS.div_ceil(64)];
            let (ending, lengths) = (&mut ending[..len], &mut lengths[..len.div_ceil(64)]);
            rank_by_run(runs, token_counts, floors, ending, lengths)
        } else {
            let (ending, lengths) = (&mut vec![0; len], &mut vec![0; len.div_ceil(64)]);
            rank_by_run(runs, token_counts, floors, ending, lengths)
        };
        if let Some(ranking) = ranked {
            return ranking;
        }
        // Not reached (see `order_by_run`): every prefix sum, and the sort.
    }
    if len <= STACK_BLOCKS {
        let mut ending = [0u32; STACK_BLOCKS];
        let mut scores = [0.0f64; STACK_BLOCKS];
        let mut tokens = [0u64; STACK_BLOCKS];
        let (ending, scores, tokens) = (&mut ending[..len], &mut scores[..len], &mut tokens[..len]);
        rank_sorted(runs, lower, token_counts, floors, ending, scores, tokens)
    } else {
        let (ending, scores, tokens) = (&mut vec![0; len], &mut vec![0.0; len], &mut vec![0; len]);
        rank_sorted(runs, lower, token_counts, floors, ending, scores, tokens)
    }
}

/// The ranking when a row's score and tokens depend on its run length alone
/// (no lower tiers): sums at the run lengths present, then rows placed by
/// length. `ending` and `lengths` are zeroed scratch of `max_run + 1` entries
/// (and bits). `None`: the placement declined (see [`order_by_run`]).
fn rank_by_run(
    runs: &[u32],
    token_counts: &[u32],
    floors: Floors,
    ending: &mut [u32],
    lengths: &mut [u64],
) -> Option<Ranking> {
    histogram(runs, ending, lengths);
    let mut sums = PerLength::new();
    sums_at_lengths(runs.len(), token_counts, lengths, ending, &mut sums);
    order_by_run(runs, lengths, &sums, ending, floors)
}

/// Every prefix sum, lower tiers' discount, and the sort. `ending`, `scores`
/// and `tokens` are zeroed scratch of `max_run + 1` entries.
fn rank_sorted(
    runs: &[u32],
    lower: &[(usize, u32, f64)],
    token_counts: &[u32],
    floors: Floors,
    ending: &mut [u32],
    scores: &mut [f64],
    tokens: &mut [u64],
) -> Ranking {
    for &m in runs {
        ending[m as usize] += 1;
    }
    prefix_sums(runs.len(), token_counts, ending, scores, tokens);
    sort_rows(runs, lower, scores, tokens, floors)
}

/// Blocks of ranking scratch kept on the stack.
const STACK_BLOCKS: usize = 72;

/// Fills `ending[m]` (how many members' runs are m blocks long) and marks
/// every length m > 0 in `lengths`.
fn histogram(runs: &[u32], ending: &mut [u32], lengths: &mut [u64]) {
    for &m in runs {
        let m = m as usize;
        ending[m] += 1;
        // Run 0 is marked too (one test fewer per member) and unmarked below.
        if ending[m] == 1 {
            lengths[m / 64] |= 1 << (m % 64);
        }
    }
    lengths[0] &= !1;
}

/// The prefix sums `scores[i]`, `tokens[i]` of holding the first i blocks, for
/// every i (the tiered ranking subtracts per block). `ending` is the histogram.
fn prefix_sums(
    n: usize,
    token_counts: &[u32],
    ending: &[u32],
    scores: &mut [f64],
    tokens: &mut [u64],
) {
    // One pass over the blocks; d changes only where a run ends. Zipped slices
    // keep the loop free of per-item checks.
    let inv_n = 1.0 / n as f64;
    let mut holding = n as u32 - ending[0];
    let mut d = 1.0 - f64::from(holding) * inv_n;
    let (mut score, mut sum) = (0.0f64, 0u64);
    let counted = token_counts.len().min(ending.len() - 1);
    for (((s, k), &ended), &t) in scores[1..]
        .iter_mut()
        .zip(tokens[1..].iter_mut())
        .zip(&ending[1..])
        .zip(&token_counts[..counted])
    {
        score += (f64::from(t) / SCORE_BLOCK_TOKENS) * d;
        sum += u64::from(t);
        (*s, *k) = (score, sum);
        if ended != 0 {
            holding -= ended;
            d = 1.0 - f64::from(holding) * inv_n;
        }
    }
    // Blocks past the request's counts (a malformed request) add nothing.
    scores[counted + 1..].fill(score);
    tokens[counted + 1..].fill(sum);
}

/// The score and the tokens of holding the first m blocks, for one run
/// length m.
#[derive(Clone, Copy, Debug)]
struct Sum {
    score: f64,
    tokens: u64,
}

/// Run lengths a ranking keeps inline (most rankings have a few).
type PerLength<T> = SmallVec<[T; 16]>;

/// [`prefix_sums`] at the run lengths in `lengths` only, shortest first (filled
/// in place: returned, the inline vector would be copied), which
/// is all the placement reads: the same additions in the same order (so the
/// same bits), but block by block only between two lengths, where d stays the
/// same, with no store and no test per block, and no scratch per block.
fn sums_at_lengths(
    n: usize,
    token_counts: &[u32],
    lengths: &[u64],
    ending: &[u32],
    sums: &mut PerLength<Sum>,
) {
    let inv_n = 1.0 / n as f64;
    let mut holding = n as u32 - ending[0];
    let mut d = 1.0 - f64::from(holding) * inv_n;
    let (mut score, mut sum) = (0.0f64, 0u64);
    let mut summed = 0usize;
    let (uniform, first) = uniform_prefix(token_counts);
    for (w, &word) in lengths.iter().enumerate() {
        let mut bits = word;
        while bits != 0 {
            let m = w * 64 + bits.trailing_zeros() as usize;
            bits &= bits - 1;
            // Blocks past the request's counts (a malformed request) add nothing.
            let to = m.min(token_counts.len());
            // Where every block has the first's count, each adds the same
            // product: computed once, added block by block as before.
            let same = to.min(uniform).max(summed);
            if same > summed {
                let each = (f64::from(first) / SCORE_BLOCK_TOKENS) * d;
                for _ in summed..same {
                    score += each;
                }
                sum += u64::from(first) * (same - summed) as u64;
                summed = same;
            }
            for &t in token_counts.get(summed..to).unwrap_or_default() {
                score += (f64::from(t) / SCORE_BLOCK_TOKENS) * d;
                sum += u64::from(t);
            }
            summed = summed.max(to);
            sums.push(Sum { score, tokens: sum });
            holding -= ending[m];
            d = 1.0 - f64::from(holding) * inv_n;
        }
    }
}

/// How many leading blocks have the first block's token count, and that count:
/// all of them or all but the last (a request's last block is often partial),
/// else only the first. One pass without an early exit, which vectorises.
fn uniform_prefix(token_counts: &[u32]) -> (usize, u32) {
    let Some((&first, rest)) = token_counts.split_first() else {
        return (0, 0);
    };
    let body = &rest[..rest.len().saturating_sub(1)];
    if body.iter().fold(0, |acc, &t| acc | (t ^ first)) != 0 {
        return (1, first);
    }
    match rest.last() {
        Some(&last) if last != first => (token_counts.len() - 1, first),
        _ => (token_counts.len(), first),
    }
}

/// Whether `a` ranks after `b`: score desc, then matched tokens desc.
fn ranks_after(a: (f64, u32), b: (f64, u32)) -> bool {
    b.0.total_cmp(&a.0).then_with(|| b.1.cmp(&a.1)).is_gt()
}

/// [`sort_rows`]'s answer without building and sorting rows in member order,
/// when a row's score and tokens depend on its run length alone (no lower
/// tiers): walking the lengths longest first gives the keys best first (the
/// prefix sums never decrease; `None` if they do, and the caller sorts), equal
/// keys form one group, and each member's row is written straight into its
/// group's next place, so equal keys keep member (replica-id) order, which is
/// what the stable sort gives. Overwrites `ending[m]` with m's group (past
/// the groups for no row: m = 0 or below the token floor).
///
/// `sums` are [`sums_at_lengths`]'s, one per length in `lengths`, shortest first.
fn order_by_run(
    runs: &[u32],
    lengths: &[u64],
    sums: &[Sum],
    ending: &mut [u32],
    floors: Floors,
) -> Option<Ranking> {
    const BELOW: u32 = u32::MAX;
    ending[0] = BELOW;
    let mut groups: PerLength<Group> = PerLength::new();
    let mut total = 0u32;
    let mut previous: Option<(f64, u32)> = None;
    let mut at = sums.len();
    for (w, &word) in lengths.iter().enumerate().rev() {
        let mut bits = word;
        while bits != 0 {
            let top = 63 - bits.leading_zeros() as usize;
            bits &= !(1 << top);
            let m = w * 64 + top;
            at = at.checked_sub(1)?;
            let count = ending[m];
            let sum = sums.get(at)?;
            let key = (sum.score, clamp_u32(sum.tokens));
            if key.1 < floors.minimum_matched_tokens {
                ending[m] = BELOW;
                continue;
            }
            match previous {
                Some(p) if p.0.total_cmp(&key.0).is_eq() && p.1 == key.1 => {}
                Some(p) if ranks_after(p, key) => return None,
                _ => {
                    groups.push(Group {
                        next: total,
                        matched_tokens: key.1,
                        score: key.0,
                    });
                    previous = Some(key);
                }
            }
            ending[m] = (groups.len() - 1) as u32;
            total += count;
        }
    }
    // The best row's score is the first group's: a ranking under the score
    // floor needs no rows (a prefix every replica holds scores 0).
    let best = groups.first().map_or(f64::NEG_INFINITY, |g| g.score);
    if total == 0 || best < floors.routing_floor_score {
        return Some(Ranking::BelowFloor);
    }
    Some(Ranking::Prefix(place(
        runs,
        ending,
        &mut groups,
        total as usize,
    )))
}

/// The rows, each member's its group's at the group's next place. A group
/// index past the groups (`BELOW`) is no row, so one lookup both finds the
/// group and skips the rowless.
fn place(runs: &[u32], ending: &[u32], groups: &mut [Group], total: usize) -> Vec<Row> {
    let empty = Row {
        member: 0,
        score: 0.0,
        matched_tokens: 0,
        matched_blocks: 0,
    };
    let mut rows = vec![empty; total];
    for (member, &m) in runs.iter().enumerate() {
        let Some(group) = ending
            .get(m as usize)
            .and_then(|&g| groups.get_mut(g as usize))
        else {
            continue;
        };
        if let Some(row) = rows.get_mut(group.next as usize) {
            *row = Row {
                member,
                score: group.score,
                matched_tokens: group.matched_tokens,
                matched_blocks: m,
            };
        }
        group.next += 1;
    }
    rows
}

/// A group of equal keys: its next free row and the key.
#[derive(Clone, Copy, Debug)]
struct Group {
    next: u32,
    matched_tokens: u32,
    score: f64,
}

/// Rows in member order, lower tiers' discount applied, then [`finish`].
fn sort_rows(
    runs: &[u32],
    lower: &[(usize, u32, f64)],
    scores: &[f64],
    tokens: &[u64],
    floors: Floors,
) -> Ranking {
    let n = runs.len();
    // Sized for every member up front: a filtered `collect` would grow (and
    // reallocate) the vector row by row.
    let mut rows: Vec<Row> = Vec::with_capacity(n);
    for (member, &m) in runs.iter().enumerate() {
        if m == 0 {
            continue;
        }
        rows.push(Row {
            member,
            score: scores[m as usize],
            matched_tokens: clamp_u32(tokens[m as usize]),
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
                && b + 1 < scores.len()
            {
                r.score -= (1.0 - weight) * (scores[b + 1] - scores[b]);
            }
        }
    }
    finish(&mut rows, floors)
}

/// Ranks the exact-prefix path: every holder matched one block of
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
mod tests;
