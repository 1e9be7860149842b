use super::*;

/// A cache of `capacity` blocks of 4 tokens, seed "0".
fn mk_cache(capacity: usize) -> PrefixCache {
    PrefixCache::new(capacity, 4, "0").unwrap()
}

/// `blocks` full blocks of 4 tokens, distinct per `prompt`.
fn mk_prompt(prompt: u32, blocks: u32) -> Vec<u32> {
    (0..blocks * 4).map(|i| prompt * 1000 + i).collect()
}

fn chain_of(cache: &PrefixCache, tokens: &[u32]) -> Vec<u64> {
    cache.chain(tokens).collect()
}

#[test]
fn stored_hashes_are_vllm_sha256_cbor_values() {
    let mut cache = PrefixCache::new(8, 16, "0").unwrap();
    let mut tokens: Vec<u32> = (1..=16).collect();
    tokens.extend([100, 1000, 70000, 128_000]);
    tokens.extend(200..212);
    let a = cache.admit(&tokens);
    assert_eq!(a.cached_tokens, 0);
    assert!(a.removed.is_empty());
    let run = a.stored.unwrap();
    assert_eq!(
        run.block_hashes,
        [3_236_607_068_019_569_386, 1_206_300_911_754_328_078]
    );
    assert_eq!(run.parent, None);
    assert_eq!(run.token_ids, tokens);
    assert_eq!(run.block_size, 16);
    // Another seed is another chain.
    let other = PrefixCache::new(8, 16, "1").unwrap();
    assert_ne!(chain_of(&other, &tokens), run.block_hashes);
}

#[test]
fn hits_count_whole_leading_blocks_and_leave_one_token_to_compute() {
    let mut cache = mk_cache(16);
    let p = mk_prompt(1, 3); // 12 tokens, 3 blocks
    assert_eq!(cache.admit(&p).cached_tokens, 0);
    // Ends on a block boundary with every block cached: the last block is computed.
    assert_eq!(cache.lookup(&p), 8);
    assert_eq!(cache.admit(&p).cached_tokens, 8);
    // One more token: all three blocks count.
    let mut longer = p.clone();
    longer.push(7);
    assert_eq!(cache.lookup(&longer), 12);
    // A partial block never counts and a prompt of one block hits nothing.
    assert_eq!(cache.lookup(&p[..6]), 4);
    assert_eq!(cache.lookup(&p[..4]), 0);
    assert_eq!(cache.lookup(&[]), 0);
    // A divergence in block 1 stops the run there.
    let mut diverged = p.clone();
    diverged[5] = 99_999;
    diverged.push(1);
    assert_eq!(cache.lookup(&diverged), 4);
    // The second admission of the same prompt stores nothing new.
    let again = cache.admit(&p);
    assert_eq!((again.stored, again.removed.len()), (None, 0));
}

#[test]
fn partial_blocks_are_not_stored() {
    let mut cache = mk_cache(16);
    let mut p = mk_prompt(1, 2);
    p.extend([1, 2, 3]);
    let run = cache.admit(&p).stored.unwrap();
    assert_eq!(run.block_hashes.len(), 2);
    assert_eq!(run.token_ids, p[..8]);
    assert_eq!(cache.len(), 2);
    assert_eq!(cache.admit(&p[..3]).stored, None);
}

#[test]
fn lookup_has_no_side_effects() {
    let mut cache = mk_cache(4);
    cache.admit(&mk_prompt(1, 2));
    cache.admit(&mk_prompt(2, 2));
    let before: Vec<u64> = cache.recency().collect();
    assert_eq!(cache.lookup(&mk_prompt(1, 3)), 8);
    assert_eq!(cache.recency().collect::<Vec<_>>(), before);
    assert_eq!(cache.len(), 4);
}

#[test]
fn recency_puts_heads_before_tails_and_evicts_tails_first() {
    let mut cache = mk_cache(5);
    let a = mk_prompt(1, 3);
    let b = mk_prompt(2, 3);
    let ha = chain_of(&cache, &a);
    let hb = chain_of(&cache, &b);
    cache.admit(&a);
    assert_eq!(cache.recency().collect::<Vec<_>>(), ha);
    // B needs 3 blocks, 2 are free: A's tail goes, not its head.
    let adm = cache.admit(&b);
    assert_eq!(adm.removed, [ha[2]]);
    assert_eq!(
        cache.recency().collect::<Vec<_>>(),
        [hb[0], hb[1], hb[2], ha[0], ha[1]]
    );
    // A again: its two cached blocks are touched (and protected), its third block
    // is stored after them, and B's tail is evicted.
    let adm = cache.admit(&a);
    assert_eq!(adm.cached_tokens, 8);
    assert_eq!(adm.removed, [hb[2]]);
    let run = adm.stored.unwrap();
    assert_eq!((run.block_hashes, run.parent), (vec![ha[2]], Some(ha[1])));
    assert_eq!(run.token_ids, a[8..]);
    assert_eq!(
        cache.recency().collect::<Vec<_>>(),
        [ha[0], ha[1], ha[2], hb[0], hb[1]]
    );
    // A shared head stays warm: prompts that share block 0 keep it at the front.
    let c: Vec<u32> = a[..4].iter().copied().chain(900..908).collect();
    let hc = chain_of(&cache, &c);
    let adm = cache.admit(&c);
    assert_eq!(adm.removed, [hb[1], hb[0]]);
    assert_eq!(
        cache.recency().collect::<Vec<_>>(),
        [ha[0], hc[1], hc[2], ha[1], ha[2]]
    );
}

#[test]
fn capacity_is_never_exceeded() {
    let mut cache = mk_cache(7);
    for i in 0..200u32 {
        let blocks = 1 + (i * 7919) % 6;
        let group = (i * 31) % 5;
        let mut p = mk_prompt(group, 2);
        p.extend(mk_prompt(100 + i % 13, blocks));
        let adm = cache.admit(&p);
        assert!(cache.len() <= 7, "step {i}: {} blocks", cache.len());
        // Nothing of the admitted prompt was evicted for it.
        let chain = chain_of(&cache, &p);
        assert!(adm.removed.iter().all(|h| !chain.contains(h)));
        assert!(chain.iter().take(7).all(|h| cache.contains(*h)));
    }
    assert_eq!(cache.len(), 7);
}

#[test]
fn a_prompt_longer_than_the_cache_keeps_its_head() {
    let mut cache = mk_cache(3);
    cache.admit(&mk_prompt(9, 2));
    let p = mk_prompt(1, 5);
    let h = chain_of(&cache, &p);
    let adm = cache.admit(&p);
    assert_eq!(adm.removed.len(), 2);
    let run = adm.stored.unwrap();
    assert_eq!(run.block_hashes, h[..3]);
    assert_eq!(run.token_ids, p[..12]);
    assert_eq!(cache.recency().collect::<Vec<_>>(), h[..3]);
    // Again: the head hits, nothing is evicted or stored.
    assert_eq!(cache.lookup(&p), 12);
    let again = cache.admit(&p);
    assert_eq!(again.cached_tokens, 12);
    assert_eq!((again.stored, again.removed.len()), (None, 0));
}

#[test]
fn a_cache_of_zero_blocks_caches_nothing() {
    let mut cache = mk_cache(0);
    let p = mk_prompt(1, 3);
    let adm = cache.admit(&p);
    assert_eq!(
        adm,
        Admission {
            cached_tokens: 0,
            stored: None,
            removed: vec![],
        }
    );
    assert!(cache.is_empty());
    assert_eq!(
        PrefixCache::new(4, 0, "0").unwrap_err(),
        CacheError::ZeroBlockSize
    );
}

#[test]
fn orphaned_blocks_are_unreachable_until_stored_again() {
    let mut cache = mk_cache(6);
    let a = mk_prompt(1, 3);
    let h = chain_of(&cache, &a);
    cache.admit(&a);
    assert!(cache.forget(h[0]));
    // Blocks 1 and 2 are still held but no prompt can reach them.
    assert_eq!(cache.len(), 2);
    assert!(cache.contains(h[1]) && cache.contains(h[2]));
    assert_eq!(cache.lookup(&a), 0);
    let mut longer = a.clone();
    longer.push(1);
    assert_eq!(cache.lookup(&longer), 0);
    // Admitting the prompt again re-stores the whole run; the orphans are removed
    // first so every stored hash has exactly one matching removal.
    let adm = cache.admit(&a);
    assert_eq!(adm.cached_tokens, 0);
    assert_eq!(adm.removed, [h[1], h[2]]);
    let run = adm.stored.unwrap();
    assert_eq!((run.block_hashes, run.parent), (h.clone(), None));
    assert_eq!(cache.lookup(&longer), 12);
    assert_eq!(cache.recency().collect::<Vec<_>>(), h);
}

#[test]
fn orphans_are_evicted_like_any_block() {
    let mut cache = mk_cache(4);
    let a = mk_prompt(1, 3);
    let h = chain_of(&cache, &a);
    cache.admit(&a);
    cache.forget(h[0]);
    let b = mk_prompt(2, 3);
    let adm = cache.admit(&b);
    assert_eq!(adm.removed, [h[2]]);
    assert_eq!(cache.len(), 4);
    assert!(cache.contains(h[1]));
}

#[test]
fn clear_drops_everything() {
    let mut cache = mk_cache(8);
    let p = mk_prompt(1, 3);
    cache.admit(&p);
    cache.clear();
    assert!(cache.is_empty());
    assert_eq!(cache.recency().count(), 0);
    assert_eq!(cache.lookup(&p), 0);
    let adm = cache.admit(&p);
    assert_eq!(adm.stored.unwrap().block_hashes.len(), 3);
    assert!(adm.removed.is_empty());
    assert_eq!(cache.recency().collect::<Vec<_>>(), chain_of(&cache, &p));
}
