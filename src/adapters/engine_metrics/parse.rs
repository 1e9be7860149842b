//! The Prometheus text exposition format, strictly, for the few gauges the load
//! rule reads.
//!
//! A small line parser rather than a crate: the only maintained Rust parser of
//! the text format (`prometheus-parse`, last released 2023) builds a full sample
//! tree with owned strings and chrono timestamps and pulls regex, chrono and
//! itertools; here every line is checked for syntax (so an HTML error page or a
//! truncated body is refused, not half-read) but only three metric names are
//! kept, with no allocation per line.
//!
//! Counts (waiting, running) are summed over label sets: a data-parallel engine
//! prints one series per rank (`engine="0"`, `engine="1"`). KV usage is the
//! highest rank's. A missing metric, NaN, infinity or a negative value fails the
//! whole scrape, which then changes nothing. The prefix-cache hit rate (vLLM:
//! hits / queries counters; SGLang: `sglang:cache_hit_rate`) is optional, and so
//! is the count of requests that reached their first token (the TTFT
//! histogram's `_count`, summed over ranks), which shows the share bound what
//! other sidecars sent there.

use thiserror::Error;

use super::EngineKind;

/// What one scrape says about its engine.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EngineSample {
    pub waiting: u32,
    pub running: u32,
    /// 0..1
    pub kv_usage: f64,
    /// Prefix-cache hit rate, 0..1, when the engine prints it (optional: a bad
    /// or missing value is left out, never fails the scrape).
    pub hit_rate: Option<f64>,
    /// Requests that reached their first token since the engine started, when
    /// it prints its TTFT histogram (optional, like `hit_rate`).
    pub first_tokens: Option<u64>,
}

/// Why a scrape's text was refused.
#[derive(Clone, Debug, PartialEq, Error)]
pub enum ParseError {
    #[error("line {line}: {reason}")]
    Syntax { line: usize, reason: &'static str },
    #[error("line {line}: {metric} is {value}, not a finite non-negative number")]
    BadValue {
        line: usize,
        metric: &'static str,
        value: f64,
    },
    #[error("metric {0} missing")]
    Missing(&'static str),
}

/// The metric names of one engine.
struct Names {
    waiting: &'static str,
    running: &'static str,
    /// Current name first, then older spellings.
    usage: &'static [&'static str],
    /// Cumulative prefix-cache (hits, queries) counters, whose ratio is the hit rate.
    hit_counters: Option<(&'static str, &'static str)>,
    /// A hit-rate gauge, when there are no counters.
    hit_gauge: &'static str,
    /// The TTFT histogram's sample count.
    first_tokens: &'static str,
}

const VLLM: Names = Names {
    waiting: "vllm:num_requests_waiting",
    running: "vllm:num_requests_running",
    // vLLM before 0.10 printed gpu_cache_usage_perc.
    usage: &["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"],
    hit_counters: Some((
        "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total",
    )),
    hit_gauge: "vllm:gpu_prefix_cache_hit_rate",
    first_tokens: "vllm:time_to_first_token_seconds_count",
};

const SGLANG: Names = Names {
    waiting: "sglang:num_queue_reqs",
    running: "sglang:num_running_reqs",
    usage: &["sglang:token_usage"],
    hit_counters: None,
    hit_gauge: "sglang:cache_hit_rate",
    first_tokens: "sglang:time_to_first_token_seconds_count",
};

/// Parses one `/metrics` body for `engine`.
pub fn parse(text: &str, engine: EngineKind) -> Result<EngineSample, ParseError> {
    let names = match engine {
        EngineKind::Vllm => &VLLM,
        EngineKind::Sglang => &SGLANG,
    };
    let mut waiting: Option<f64> = None;
    let mut running: Option<f64> = None;
    // Best usage per spelling, so the current name wins when both are printed.
    let mut usage: [Option<f64>; 2] = [None, None];
    let mut optional = Optional::default();
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        let l = raw.trim_matches(|c: char| c == ' ' || c == '\t' || c == '\r');
        if l.is_empty() || l.starts_with('#') {
            continue;
        }
        let (name, value) = sample(l).map_err(|reason| ParseError::Syntax { line, reason })?;
        let slot = if name == names.waiting {
            Some((names.waiting, &mut waiting, true))
        } else if name == names.running {
            Some((names.running, &mut running, true))
        } else {
            names
                .usage
                .iter()
                .position(|u| *u == name)
                .map(|k| (names.usage[k], &mut usage[k], false))
        };
        let Some((metric, acc, sum)) = slot else {
            optional.add(names, name, value);
            continue;
        };
        let value = number(value).ok_or(ParseError::Syntax {
            line,
            reason: "value is not a number",
        })?;
        if !value.is_finite() || value < 0.0 {
            return Err(ParseError::BadValue {
                line,
                metric,
                value,
            });
        }
        *acc = Some(match *acc {
            Some(v) if sum => v + value,
            Some(v) => v.max(value),
            None => value,
        });
    }
    let count = |v: Option<f64>, name| {
        v.map(|v| v.round().min(f64::from(u32::MAX)) as u32)
            .ok_or(ParseError::Missing(name))
    };
    let kv_usage = usage
        .iter()
        .flatten()
        .next()
        .copied()
        .ok_or(ParseError::Missing(names.usage[0]))?;
    let hit_rate = if optional.queries > 0.0 {
        Some((optional.hits / optional.queries).min(1.0))
    } else {
        optional.hit_gauge.map(|g| g.min(1.0))
    };
    Ok(EngineSample {
        waiting: count(waiting, names.waiting)?,
        running: count(running, names.running)?,
        kv_usage: kv_usage.min(1.0),
        hit_rate,
        first_tokens: optional
            .first_tokens
            .map(|v| v.round().min(u64::MAX as f64) as u64),
    })
}

/// The optional series: (hits, queries) sums, the hit gauge's highest rank, and
/// the first-token count's sum.
#[derive(Default)]
struct Optional {
    hits: f64,
    queries: f64,
    hit_gauge: Option<f64>,
    first_tokens: Option<f64>,
}

impl Optional {
    /// Accumulates one sample if it is an optional series; bad values are
    /// skipped.
    fn add(&mut self, names: &Names, name: &str, value: &str) {
        let counter = names.hit_counters.filter(|(h, q)| name == *h || name == *q);
        let wanted = name == names.hit_gauge || name == names.first_tokens || counter.is_some();
        if !wanted {
            return;
        }
        let Some(v) = number(value).filter(|v| v.is_finite() && *v >= 0.0) else {
            return;
        };
        match counter {
            Some((h, _)) if name == h => self.hits += v,
            Some(_) => self.queries += v,
            None if name == names.first_tokens => {
                self.first_tokens = Some(self.first_tokens.unwrap_or(0.0) + v);
            }
            None => self.hit_gauge = Some(self.hit_gauge.map_or(v, |g| g.max(v))),
        }
    }
}

/// One sample line: `name{labels} value [timestamp]` → (name, value text). The
/// value is only checked for its characters here; the few kept metrics parse it.
fn sample(l: &str) -> Result<(&str, &str), &'static str> {
    let name_end = l
        .bytes()
        .position(|c| !(c.is_ascii_alphanumeric() || c == b'_' || c == b':'))
        .unwrap_or(l.len());
    let name = &l[..name_end];
    if name.is_empty() || name.as_bytes()[0].is_ascii_digit() {
        return Err("not a metric name");
    }
    let mut rest = &l[name_end..];
    if rest.starts_with('{') {
        rest = labels(rest)?;
    }
    if !rest.starts_with([' ', '\t']) {
        return Err("no value after the metric name");
    }
    let mut fields = rest.split_ascii_whitespace();
    let value = fields.next().ok_or("no value")?;
    if !numeric(value) {
        return Err("value is not a number");
    }
    if let Some(ts) = fields.next() {
        // Text format: integer milliseconds; OpenMetrics: decimal seconds.
        if !numeric(ts) || ts.starts_with(['N', 'I', '+']) {
            return Err("timestamp is not a number");
        }
    }
    if fields.next().is_some() {
        return Err("trailing text after the timestamp");
    }
    Ok((name, value))
}

/// Whether `s` can be a sample value: float characters with a digit, or the
/// text format's `NaN`, `+Inf`, `-Inf`.
fn numeric(s: &str) -> bool {
    matches!(s, "NaN" | "+Inf" | "-Inf" | "Inf")
        || (s.bytes().any(|c| c.is_ascii_digit())
            && s.bytes()
                .all(|c| c.is_ascii_digit() || matches!(c, b'.' | b'-' | b'+' | b'e' | b'E')))
}

/// Skips a `{name="value",...}` block; returns what follows it.
fn labels(s: &str) -> Result<&str, &'static str> {
    let b = s.as_bytes();
    let mut i = 1; // past '{'
    loop {
        while i < b.len() && (b[i] == b' ' || b[i] == b'\t') {
            i += 1;
        }
        match b.get(i) {
            Some(b'}') => return Ok(&s[i + 1..]),
            Some(c) if c.is_ascii_alphabetic() || *c == b'_' => {}
            _ => return Err("bad label name"),
        }
        while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
            i += 1;
        }
        if b.get(i) != Some(&b'=') || b.get(i + 1) != Some(&b'"') {
            return Err("label without =\"value\"");
        }
        i += 2;
        loop {
            match b.get(i) {
                None => return Err("unterminated label value"),
                Some(b'\\') => i += 2,
                Some(b'"') => break,
                Some(_) => i += 1,
            }
        }
        i += 1; // past the closing quote
        match b.get(i) {
            Some(b',') => i += 1,
            Some(b'}') => return Ok(&s[i + 1..]),
            _ => return Err("expected , or } after a label"),
        }
    }
}

/// A sample value already passed by [`numeric`].
fn number(s: &str) -> Option<f64> {
    match s {
        "NaN" => Some(f64::NAN),
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        _ => s.parse().ok(),
    }
}
