//! Who may write the index over gRPC, and how fast: the ingest listener's guard.
//!
//! `IngestEvents` and `ReportStats` are served on their own listener
//! (`serve --ingest-addr`). Every call there passes [`IngestGuard::admit`]:
//!
//! ```text
//!  call ─▶ caller identity ─▶ bearer token check (--ingest-token-file) ─▶ token buckets
//!          token name,         missing/wrong: UNAUTHENTICATED             (events/s, entries/s
//!          else client cert CN,                                           per caller): over →
//!          else peer IP                                                   RESOURCE_EXHAUSTED
//! ```
//!
//! Tokens are compared as SHA-256 digests in constant time, against every
//! configured token (no early exit), so neither the content nor the length of a
//! token leaks through timing. Callers are metric labels: their number is capped
//! ([`MAX_CALLER_LABELS`]; later ones are counted as `_other`).

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use parking_lot::Mutex;
use sha2::{Digest, Sha256};
use tonic::{Request, Status};

use crate::adapters::metrics::Metrics;
use crate::proto::v1 as pb;

/// Distinct caller labels the metrics keep; further callers share `_other`.
pub const MAX_CALLER_LABELS: usize = 256;
/// Callers whose buckets are tracked; idle (refilled) ones are forgotten first.
const MAX_TRACKED_CALLERS: usize = 4096;

/// Bearer tokens, each with the caller name it stands for.
#[derive(Clone)]
pub struct IngestTokens {
    tokens: Vec<(String, [u8; 32])>,
}

impl std::fmt::Debug for IngestTokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.tokens.iter().map(|(n, _)| n.as_str()).collect();
        f.debug_struct("IngestTokens")
            .field("callers", &names)
            .finish()
    }
}

impl IngestTokens {
    /// Parses a token file: one token per line, `NAME:TOKEN` or a bare `TOKEN`
    /// (caller `line-N`); blank lines and `#` comments are skipped. Names are
    /// letters, digits, `-`, `_` and `.`; tokens are printable ASCII without spaces.
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut tokens: Vec<(String, [u8; 32])> = Vec::new();
        for (i, raw) in text.lines().enumerate() {
            let n = i + 1;
            let line = raw.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let (name, token) = match line.split_once(':') {
                Some((name, token)) => (name.trim().to_string(), token.trim()),
                None => (format!("line-{n}"), line),
            };
            if name.is_empty()
                || !name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
            {
                return Err(format!(
                    "line {n}: caller name {name:?} may only hold letters, digits, '-', '_' and '.'"
                ));
            }
            if token.len() < 16 {
                return Err(format!(
                    "line {n}: the token of {name:?} is {} characters; use at least 16",
                    token.len()
                ));
            }
            if !token.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(format!(
                    "line {n}: the token of {name:?} must be printable ASCII without spaces"
                ));
            }
            if tokens.iter().any(|(other, _)| *other == name) {
                return Err(format!("line {n}: caller name {name:?} is used twice"));
            }
            tokens.push((name, digest(token.as_bytes())));
        }
        if tokens.is_empty() {
            return Err("no token in the file".into());
        }
        Ok(Self { tokens })
    }

    /// Reads and parses `--ingest-token-file`.
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading --ingest-token-file {}", path.display()))?;
        Self::parse(&text)
            .map_err(|e| anyhow::anyhow!("--ingest-token-file {}: {e}", path.display()))
    }

    /// The caller a presented token stands for. Every configured token is
    /// compared, in constant time each.
    pub fn identify(&self, presented: &[u8]) -> Option<&str> {
        let want = digest(presented);
        let mut found = None;
        for (name, have) in &self.tokens {
            if constant_time_eq(&want, have) && found.is_none() {
                found = Some(name.as_str());
            }
        }
        found
    }
}

fn digest(b: &[u8]) -> [u8; 32] {
    Sha256::digest(b).into()
}

fn constant_time_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

/// Per-caller rates; 0 turns a limit off.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IngestLimits {
    /// KV events (and ReportStats calls) per second per caller.
    pub events_per_sec: u32,
    /// Index entries named per second per caller: block hashes in BlocksStored and
    /// BlocksRemoved, one per PrefixStored.
    pub entries_per_sec: u32,
}

impl IngestLimits {
    pub const DEFAULT_EVENTS_PER_SEC: u32 = 20_000;
    pub const DEFAULT_ENTRIES_PER_SEC: u32 = 1_000_000;

    pub const UNLIMITED: Self = Self {
        events_per_sec: 0,
        entries_per_sec: 0,
    };
}

impl Default for IngestLimits {
    fn default() -> Self {
        Self {
            events_per_sec: Self::DEFAULT_EVENTS_PER_SEC,
            entries_per_sec: Self::DEFAULT_ENTRIES_PER_SEC,
        }
    }
}

/// A token bucket holding up to one second of its rate.
#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
}

impl Bucket {
    fn full(rate: u32) -> Self {
        Self {
            tokens: f64::from(rate),
        }
    }

    fn refill(&mut self, rate: u32, elapsed_secs: f64) {
        let cap = f64::from(rate);
        self.tokens = (self.tokens + elapsed_secs * cap).min(cap);
    }
}

#[derive(Debug)]
struct CallerState {
    events: Bucket,
    entries: Bucket,
    at: Instant,
}

/// What one call asks to write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cost {
    pub events: u64,
    pub entries: u64,
}

impl Cost {
    pub fn of_ingest(req: &pb::IngestEventsRequest) -> Self {
        use pb::kv_event::Event;
        let entries = req
            .events
            .iter()
            .map(|e| match &e.event {
                Some(Event::Stored(s)) => s.block_hashes.len() as u64,
                Some(Event::Removed(r)) => r.block_hashes.len() as u64,
                Some(Event::PrefixStored(_)) => 1,
                Some(Event::Cleared(_)) | None => 0,
            })
            .sum();
        Self {
            events: req.events.len() as u64,
            entries,
        }
    }

    pub const STATS: Self = Self {
        events: 1,
        entries: 0,
    };
}

/// Authentication and per-caller limits of the ingest listener.
pub struct IngestGuard {
    tokens: Option<IngestTokens>,
    limits: IngestLimits,
    callers: Mutex<HashMap<String, CallerState>>,
    metrics: Arc<Metrics>,
}

impl std::fmt::Debug for IngestGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IngestGuard")
            .field("tokens", &self.tokens)
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

impl IngestGuard {
    pub fn new(tokens: Option<IngestTokens>, limits: IngestLimits, metrics: Arc<Metrics>) -> Self {
        Self {
            tokens,
            limits,
            callers: Mutex::new(HashMap::new()),
            metrics,
        }
    }

    /// No token and no limit (tests, in-process embedding).
    pub fn open(metrics: Arc<Metrics>) -> Self {
        Self::new(None, IngestLimits::UNLIMITED, metrics)
    }

    /// Authenticates a call and charges its cost to the caller; returns the caller.
    pub fn admit<T>(
        &self,
        rpc: &'static str,
        req: &Request<T>,
        cost: Cost,
    ) -> Result<String, Status> {
        let caller = match self.authenticate(req) {
            Ok(c) => c,
            Err((who, status)) => {
                self.metrics
                    .record_ingest_caller(&who, rpc, "unauthenticated");
                return Err(status);
            }
        };
        if let Err((limit, status)) = self.charge(&caller, cost, Instant::now()) {
            self.metrics.record_ingest_caller(&caller, rpc, "limited");
            self.metrics.record_ingest_limited(&caller, limit);
            return Err(status);
        }
        self.metrics
            .record_ingest_admitted(&caller, cost.events, cost.entries);
        Ok(caller)
    }

    /// The caller's identity: its token's name, else its client certificate's
    /// common name, else its IP address. Err carries who to blame in metrics.
    fn authenticate<T>(&self, req: &Request<T>) -> Result<String, (String, Status)> {
        let transport = transport_identity(req);
        let Some(tokens) = &self.tokens else {
            return Ok(transport);
        };
        let Some(value) = req.metadata().get("authorization") else {
            return Err((
                transport,
                Status::unauthenticated(
                    "the ingest listener needs `authorization: Bearer <token>` metadata \
                     (a token from the server's --ingest-token-file)",
                ),
            ));
        };
        let bytes = value.as_bytes();
        let token = bytes
            .strip_prefix(b"Bearer ")
            .or_else(|| bytes.strip_prefix(b"bearer "));
        let Some(token) = token else {
            return Err((
                transport,
                Status::unauthenticated("the authorization metadata must be `Bearer <token>`"),
            ));
        };
        match tokens.identify(token.trim_ascii()) {
            Some(name) => Ok(format!("token:{name}")),
            None => Err((
                transport,
                Status::unauthenticated(
                    "the bearer token is not one of the server's --ingest-token-file tokens",
                ),
            )),
        }
    }

    /// Takes `cost` from the caller's buckets, or refuses without taking anything.
    fn charge(&self, caller: &str, cost: Cost, now: Instant) -> Result<(), (&'static str, Status)> {
        let IngestLimits {
            events_per_sec,
            entries_per_sec,
        } = self.limits;
        if events_per_sec == 0 && entries_per_sec == 0 {
            return Ok(());
        }
        let mut callers = self.callers.lock();
        if callers.len() >= MAX_TRACKED_CALLERS && !callers.contains_key(caller) {
            // Forget callers idle for a second or more: their buckets are full again.
            callers.retain(|_, s| now.duration_since(s.at).as_secs_f64() < 1.0);
        }
        let state = callers
            .entry(caller.to_string())
            .or_insert_with(|| CallerState {
                events: Bucket::full(events_per_sec),
                entries: Bucket::full(entries_per_sec),
                at: now,
            });
        let elapsed = now.duration_since(state.at).as_secs_f64();
        state.events.refill(events_per_sec, elapsed);
        state.entries.refill(entries_per_sec, elapsed);
        state.at = now;
        for (limit, rate, bucket, want, flag) in [
            (
                "events",
                events_per_sec,
                &state.events,
                cost.events,
                "--ingest-max-events-per-sec",
            ),
            (
                "entries",
                entries_per_sec,
                &state.entries,
                cost.entries,
                "--ingest-max-entries-per-sec",
            ),
        ] {
            if rate == 0 {
                continue;
            }
            let want_f = want as f64;
            if want > u64::from(rate) {
                return Err((
                    limit,
                    Status::resource_exhausted(format!(
                        "this call carries {want} {limit}, more than caller {caller}'s limit of \
                         {rate} {limit}/s ({flag}); split it into smaller calls"
                    )),
                ));
            }
            if want_f > bucket.tokens {
                return Err((
                    limit,
                    Status::resource_exhausted(format!(
                        "caller {caller} is over its limit of {rate} {limit}/s ({flag}); \
                         retry later"
                    )),
                ));
            }
        }
        if events_per_sec > 0 {
            state.events.tokens -= cost.events as f64;
        }
        if entries_per_sec > 0 {
            state.entries.tokens -= cost.entries as f64;
        }
        Ok(())
    }
}

/// `cert:<common name>` of a verified client certificate, else `ip:<peer ip>`.
fn transport_identity<T>(req: &Request<T>) -> String {
    if let Some(certs) = req.peer_certs()
        && let Some(leaf) = certs.first()
    {
        return match common_name(leaf.as_ref()) {
            Some(cn) => format!("cert:{cn}"),
            None => {
                let d = digest(leaf.as_ref());
                let hex: String = d[..8].iter().map(|b| format!("{b:02x}")).collect();
                format!("cert:sha256:{hex}")
            }
        };
    }
    match req.remote_addr() {
        Some(addr) => format!("ip:{}", addr.ip()),
        None => "unknown".to_string(),
    }
}

/// One DER TLV: (tag, content, rest).
fn tlv(b: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, b) = b.split_first()?;
    let (&first, mut b) = b.split_first()?;
    let len = if first < 0x80 {
        usize::from(first)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 || b.len() < n {
            return None;
        }
        let (len_bytes, rest) = b.split_at(n);
        b = rest;
        len_bytes
            .iter()
            .fold(0usize, |acc, &x| (acc << 8) | usize::from(x))
    };
    if b.len() < len {
        return None;
    }
    let (content, rest) = b.split_at(len);
    Some((tag, content, rest))
}

/// The subject common name (OID 2.5.4.3) of a DER X.509 certificate, as a
/// metric-safe label (at most 64 characters of `[A-Za-z0-9._@-]`, others `_`).
pub fn common_name(der: &[u8]) -> Option<String> {
    const SEQ: u8 = 0x30;
    let (SEQ, cert, _) = tlv(der)? else {
        return None;
    };
    let (SEQ, tbs, _) = tlv(cert)? else {
        return None;
    };
    let mut rest = tbs;
    let (tag, _, after) = tlv(rest)?;
    if tag == 0xa0 {
        rest = after; // explicit version
    }
    // serial, signature algorithm, issuer, validity
    for _ in 0..4 {
        rest = tlv(rest)?.2;
    }
    let (SEQ, mut rdns, _) = tlv(rest)? else {
        return None;
    };
    while !rdns.is_empty() {
        let (0x31, mut set, next) = tlv(rdns)? else {
            return None;
        };
        rdns = next;
        while !set.is_empty() {
            let (SEQ, atv, next) = tlv(set)? else {
                return None;
            };
            set = next;
            let (0x06, oid, value) = tlv(atv)? else {
                return None;
            };
            if oid == [0x55, 0x04, 0x03] {
                let (_, v, _) = tlv(value)?;
                let cn: String = String::from_utf8_lossy(v)
                    .chars()
                    .take(64)
                    .map(|c| {
                        if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '@' | '-') {
                            c
                        } else {
                            '_'
                        }
                    })
                    .collect();
                return (!cn.is_empty()).then_some(cn);
            }
        }
    }
    None
}

#[cfg(test)]
mod tests;
