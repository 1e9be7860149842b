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
fn exact_prefix_is_one_block() {
    let r = rows(rank_prefix(&[2], 4, 32, OPEN));
    assert_eq!(r[0].member, 2);
    assert_eq!(r[0].matched_blocks, 1);
    assert_eq!(r[0].matched_tokens, 32);
    assert!((r[0].score - 2.0 * 0.75).abs() < 1e-12);
}

/// Step 7 of the decision (docs/decision.md) written out per replica and per block, in the order
/// the ranker sums: h_i counted, d_i = 1 − h_i × (1/N), score Σ (t_i/16)·d_i.
fn reference(runs: &[u32], counts: &[u32]) -> Vec<Row> {
    let n = runs.len();
    let inv_n = 1.0 / n as f64;
    let mut rows: Vec<Row> = (0..n)
        .filter(|&r| runs[r] > 0)
        .map(|r| {
            let (mut score, mut tokens) = (0.0f64, 0u64);
            for i in 0..runs[r] as usize {
                let h = runs.iter().filter(|&&m| m as usize > i).count();
                let d = 1.0 - h as f64 * inv_n;
                let t = counts.get(i).copied().unwrap_or(0);
                score += (f64::from(t) / SCORE_BLOCK_TOKENS) * d;
                tokens += u64::from(t);
            }
            Row {
                member: r,
                score,
                matched_tokens: clamp_u32(tokens),
                matched_blocks: runs[r],
            }
        })
        .collect();
    rows.sort_by(|a, b| {
        b.score
            .total_cmp(&a.score)
            .then_with(|| b.matched_tokens.cmp(&a.matched_tokens))
    });
    rows
}

proptest::proptest! {
    /// Bit for bit the reference's scores and order, on chains shorter and
    /// longer than the stack scratch, with zero-token blocks and with runs
    /// longer than the request's counts.
    #[test]
    fn ranking_equals_the_formula_summed_per_block(
        runs in proptest::collection::vec(0u32..100, 1..40),
        counts in proptest::collection::vec(0u32..40, 0..110),
    ) {
        let got = rank_chain(&runs, &counts, OPEN);
        if runs.iter().all(|&m| m == 0) {
            proptest::prop_assert_eq!(got, Ranking::NoMatch);
        } else {
            let want = reference(&runs, &counts);
            let got = rows(got);
            proptest::prop_assert_eq!(got.len(), want.len());
            for (g, w) in got.iter().zip(&want) {
                proptest::prop_assert_eq!(g.score.to_bits(), w.score.to_bits());
                proptest::prop_assert_eq!((g.member, g.matched_tokens, g.matched_blocks),
                    (w.member, w.matched_tokens, w.matched_blocks));
            }
        }
    }
}

/// The sums at the run lengths alone are the full prefix sums' there, bit for
/// bit, and exactly the lengths present are marked.
fn sums_at_lengths_match(
    runs: &[u32],
    counts: &[u32],
) -> Result<(), proptest::test_runner::TestCaseError> {
    let len = *runs.iter().max().unwrap_or(&0) as usize + 1;
    let mut ending = vec![0u32; len];
    let mut lengths = vec![0u64; len.div_ceil(64)];
    histogram(runs, &mut ending, &mut lengths);
    let (mut scores, mut tokens) = (vec![0.0; len], vec![0u64; len]);
    prefix_sums(runs.len(), counts, &ending, &mut scores, &mut tokens);
    let mut sums = PerLength::new();
    sums_at_lengths(runs.len(), counts, &lengths, &ending, &mut sums);
    let (mut at_scores, mut at_tokens) = (vec![0.0; len], vec![0u64; len]);
    for (m, sum) in (1..len).filter(|&m| ending[m] > 0).zip(&sums) {
        (at_scores[m], at_tokens[m]) = (sum.score, sum.tokens);
    }
    proptest::prop_assert_eq!(sums.len(), (1..len).filter(|&m| ending[m] > 0).count());
    for &m in runs.iter().filter(|&&m| m > 0) {
        let m = m as usize;
        proptest::prop_assert!(lengths[m / 64] & (1 << (m % 64)) != 0);
        proptest::prop_assert_eq!(at_scores[m].to_bits(), scores[m].to_bits(), "m = {}", m);
        proptest::prop_assert_eq!(at_tokens[m], tokens[m]);
    }
    let marked: u32 = lengths.iter().map(|w| w.count_ones()).sum();
    let distinct: std::collections::BTreeSet<_> = runs.iter().filter(|&&m| m > 0).collect();
    proptest::prop_assert_eq!(marked as usize, distinct.len());
    Ok(())
}

proptest::proptest! {
    /// The counting placement answers (never falls back on real prefix
    /// sums) and equals sorting the rows, floors included.
    #[test]
    fn placing_by_run_length_equals_sorting_the_rows(
        runs in proptest::collection::vec(0u32..20, 1..70),
        counts in proptest::collection::vec(0u32..20, 20),
        minimum_matched_tokens in 0u32..200,
        routing_floor_score in 0.0f64..4.0,
    ) {
        let floors = Floors { minimum_matched_tokens, routing_floor_score };
        let len = *runs.iter().max().unwrap_or(&0) as usize + 1;
        let mut ending = vec![0u32; len];
        let mut lengths = vec![0u64; len.div_ceil(64)];
        let (mut scores, mut tokens) = (vec![0.0; len], vec![0u64; len]);
        histogram(&runs, &mut ending, &mut lengths);
        prefix_sums(runs.len(), &counts, &ending, &mut scores, &mut tokens);
        let sorted = sort_rows(&runs, &[], &scores, &tokens, floors);
        let mut sums = PerLength::new();
        sums_at_lengths(runs.len(), &counts, &lengths, &ending, &mut sums);
        let placed = order_by_run(&runs, &lengths, &sums, &mut ending, floors);
        proptest::prop_assert_eq!(placed, Some(sorted));
    }

    /// The sums at the run lengths alone are the full prefix sums' there,
    /// bit for bit, runs past the request's counts and past 64 blocks included.
    #[test]
    fn sums_at_the_lengths_equal_the_prefix_sums(
        runs in proptest::collection::vec(0u32..140, 1..40),
        counts in proptest::collection::vec(0u32..40, 0..150),
    ) {
        sums_at_lengths_match(&runs, &counts)?;
    }

    /// The same where every block has one count, or all but the last (the
    /// sums' shortcut for those blocks), and against the formula per block.
    #[test]
    fn sums_over_uniform_counts_equal_the_prefix_sums(
        runs in proptest::collection::vec(0u32..100, 1..40),
        count in 0u32..40,
        blocks in 0usize..110,
        last in proptest::option::of(0u32..40),
    ) {
        let mut counts = vec![count; blocks];
        if let Some(last) = last {
            counts.push(last);
        }
        sums_at_lengths_match(&runs, &counts)?;
        if runs.iter().any(|&m| m > 0) {
            let want = reference(&runs, &counts);
            let got = rows(rank_chain(&runs, &counts, OPEN));
            proptest::prop_assert_eq!(got.len(), want.len());
            for (g, w) in got.iter().zip(&want) {
                proptest::prop_assert_eq!(g.score.to_bits(), w.score.to_bits());
                proptest::prop_assert_eq!((g.member, g.matched_tokens), (w.member, w.matched_tokens));
            }
        }
    }
}

#[test]
fn placing_by_run_length_falls_back_when_a_shorter_run_scores_more() {
    // Not reachable from prefix sums (they never decrease), but the placement
    // must not guess: the caller sorts instead.
    let mut ending = vec![0, 1, 1];
    let sums = [
        Sum {
            score: 2.0,
            tokens: 16,
        },
        Sum {
            score: 1.0,
            tokens: 32,
        },
    ];
    let placed = order_by_run(&[1, 2], &[0b110], &sums, &mut ending, OPEN);
    assert_eq!(placed, None);
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
