//! Reading the routing headers (docs/reference.md, "Envoy ext_proc"), and the names of the headers the
//! sidecar writes.
//!
//! Pure parsing, no Envoy types: [`RoutingHeaders::parse`] takes `(name, value)`
//! pairs and never fails as a whole. A malformed routing header is kept as a
//! [`MalformedHeader`] so the service can answer NO_HINT and still echo *why* on the
//! debug headers; the debug flag itself is read independently of everything else.

use std::fmt;

use crate::adapters::MAX_CHAIN_BLOCKS;
use crate::core::chain::content_v2::MAX_IDENTITY_LEN;

pub const TENANT: &str = "x-inferencecache-tenant";
pub const MODEL: &str = "x-inferencecache-model";
pub const HASH_SCHEME: &str = "x-inferencecache-hash-scheme";
pub const BLOCK_HASHES: &str = "x-inferencecache-block-hashes";
pub const BLOCK_TOKEN_COUNTS: &str = "x-inferencecache-block-token-counts";
pub const PREFIX_HASH: &str = "x-inferencecache-prefix-hash";
pub const PREFIX_TOKENS: &str = "x-inferencecache-prefix-tokens";
pub const DEBUG: &str = "x-inferencecache-debug";
/// The request's LoRA adapter and cache salt: under `ic-content-v2`
/// they key the chain, so the request matches only blocks stored under the same.
pub const LORA_ADAPTER: &str = "x-inferencecache-lora-adapter";
pub const CACHE_SALT: &str = "x-inferencecache-cache-salt";
/// The request's priority under flow control: a decimal integer, higher first
/// (default 0; anything else counts as 0). Removed from the upstream request.
pub const PRIORITY: &str = "x-inferencecache-priority";

/// Decision headers written toward the upstream (and the client when debugging).
/// A client-supplied copy of any of them is always removed or overwritten.
pub const REASON: &str = "x-inferencecache-reason";
pub const REPLICA: &str = "x-inferencecache-replica";
pub const SCORE: &str = "x-inferencecache-score";
pub const MATCHED_TOKENS: &str = "x-inferencecache-matched-tokens";
/// Set when the load rule moved the pick: the replica the cache preferred (§12).
pub const SPILLED_FROM: &str = "x-inferencecache-spilled-from";
/// With it, the load rule's check that moved the pick: `requests`, `share` or `prefill`.
pub const SPILLED_BY: &str = "x-inferencecache-spilled-by";
/// Why a request got no hint when its headers were malformed (debug only).
pub const DETAIL: &str = "x-inferencecache-detail";
/// The policy revision that decided (debug only).
pub const POLICY_REVISION: &str = "x-inferencecache-policy-revision";
/// On a 429 from flow control: why the request was shed (`queue-full`,
/// `queue-timeout` or `priority`).
pub const SHED: &str = "x-inferencecache-shed";
/// How long flow control held the request, whole milliseconds.
pub const QUEUED_MS: &str = "x-inferencecache-queued-ms";

/// The default name of the routing header (Gateway API Inference Extension's).
pub const DEFAULT_DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";

/// Why the routing headers could not be used. The message names the header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MalformedHeader {
    /// A routing header appears more than once.
    Repeated(&'static str),
    /// A value is not valid UTF-8.
    NotText(&'static str),
    /// A chain item is not a lowercase hex u64 without `0x`.
    BadHash { index: usize, item: String },
    /// A token count item is not a decimal u32.
    BadCount {
        header: &'static str,
        index: usize,
        item: String,
    },
    /// The chain is longer than [`MAX_CHAIN_BLOCKS`].
    TooLong { blocks: usize },
    /// The two chain headers disagree in length.
    Unequal { hashes: usize, counts: usize },
    /// An adapter name or salt over [`MAX_IDENTITY_LEN`] bytes.
    TooLongValue { header: &'static str, bytes: usize },
}

impl fmt::Display for MalformedHeader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Repeated(h) => write!(f, "{h} appears more than once"),
            Self::NotText(h) => write!(f, "{h} is not valid text"),
            Self::BadHash { index, item } => write!(
                f,
                "{BLOCK_HASHES} item {index} {item:?} is not a lowercase hex u64 without 0x"
            ),
            Self::BadCount {
                header,
                index,
                item,
            } => write!(f, "{header} item {index} {item:?} is not a decimal u32"),
            Self::TooLong { blocks } => write!(
                f,
                "{BLOCK_HASHES} has {blocks} blocks; at most {MAX_CHAIN_BLOCKS} are accepted"
            ),
            Self::Unequal { hashes, counts } => write!(
                f,
                "{BLOCK_HASHES} has {hashes} items but {BLOCK_TOKEN_COUNTS} has {counts}"
            ),
            Self::TooLongValue { header, bytes } => write!(
                f,
                "{header} has {bytes} bytes; at most {MAX_IDENTITY_LEN} are accepted"
            ),
        }
    }
}

/// The lookup fields carried by a request's headers. Absent headers are empty.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RoutingFields {
    pub tenant: String,
    pub model: String,
    pub hash_scheme: String,
    pub prefix_hash: String,
    pub prefix_tokens: u32,
    pub block_hashes: Vec<u64>,
    pub block_token_counts: Vec<u32>,
    /// Empty: no adapter / no salt.
    pub lora_adapter: String,
    pub cache_salt: String,
}

/// Everything the sidecar reads from one request's headers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RoutingHeaders {
    /// The client asked for the decision on the response (`x-inferencecache-debug: 1`).
    pub debug: bool,
    /// The scope keys are kept even when a chain header is malformed, so that
    /// ORIGINAL_DST mode can still pick a serving replica of the scope.
    pub fields: RoutingFields,
    pub malformed: Option<MalformedHeader>,
    /// `x-inferencecache-priority` (0 when absent or not a decimal integer).
    pub priority: i64,
}

impl RoutingHeaders {
    /// Reads the routing headers. Names compare case-insensitively; values are
    /// trimmed of surrounding whitespace. Values are read in place: only the
    /// scope keys and the parsed chain are allocated.
    pub fn parse<'a, I>(headers: I) -> Self
    where
        I: IntoIterator<Item = (&'a str, &'a [u8])>,
    {
        let mut raw = RawHeaders::default();
        let mut malformed = None;
        for (name, value) in headers {
            if let Err(e) = raw.take(name, value) {
                malformed.get_or_insert(e);
            }
        }
        let debug = raw.debug.is_some_and(|v| v == "1");
        let priority = raw.priority.and_then(|v| v.parse().ok()).unwrap_or(0);
        for (header, v) in [
            (LORA_ADAPTER, raw.lora_adapter),
            (CACHE_SALT, raw.cache_salt),
        ] {
            let bytes = v.map_or(0, str::len);
            if bytes > MAX_IDENTITY_LEN {
                malformed.get_or_insert(MalformedHeader::TooLongValue { header, bytes });
            }
        }
        // The scope keys are owned (a held request outlives its message); they
        // are kept even when the chain is malformed.
        let mut fields = RoutingFields {
            tenant: raw.tenant.unwrap_or_default().to_owned(),
            model: raw.model.unwrap_or_default().to_owned(),
            hash_scheme: raw.hash_scheme.unwrap_or_default().to_owned(),
            ..RoutingFields::default()
        };
        if malformed.is_none() {
            // Nothing of a half-read chain may reach the decision: on an error
            // the chain fields stay empty.
            match RoutingFields::parse_numbers(
                raw.block_hashes,
                raw.block_token_counts,
                raw.prefix_tokens,
            ) {
                Ok((block_hashes, block_token_counts, prefix_tokens)) => {
                    fields.block_hashes = block_hashes;
                    fields.block_token_counts = block_token_counts;
                    fields.prefix_tokens = prefix_tokens;
                    fields.prefix_hash = raw.prefix_hash.unwrap_or_default().to_owned();
                    fields.lora_adapter = raw.lora_adapter.unwrap_or_default().to_owned();
                    fields.cache_salt = raw.cache_salt.unwrap_or_default().to_owned();
                }
                Err(e) => malformed = Some(e),
            }
        }
        Self {
            debug,
            fields,
            malformed,
            priority,
        }
    }
}

impl RoutingHeaders {
    /// Chain arrays of unequal length are not a parse error: the core decides
    /// what they mean under the tenant's policy (dropped when chain matching is
    /// off, "no valid chain" under requireChain, otherwise NO_HINT). This names
    /// the mismatch for the debug echo.
    pub fn chain_mismatch(&self) -> Option<MalformedHeader> {
        let (hashes, counts) = (
            self.fields.block_hashes.len(),
            self.fields.block_token_counts.len(),
        );
        (hashes != counts).then_some(MalformedHeader::Unequal { hashes, counts })
    }
}

impl RoutingFields {
    /// The chain, its token counts and the exact prefix token count.
    fn parse_numbers(
        hashes: Option<&str>,
        counts: Option<&str>,
        prefix_tokens: Option<&str>,
    ) -> Result<(Vec<u64>, Vec<u32>, u32), MalformedHeader> {
        let hashes = parse_list(hashes.unwrap_or(""), |index, item| {
            parse_hex_u64(item).ok_or_else(|| MalformedHeader::BadHash {
                index,
                item: clip(item),
            })
        })?;
        let counts = parse_list(counts.unwrap_or(""), |index, item| {
            parse_decimal_u32(item).ok_or_else(|| MalformedHeader::BadCount {
                header: BLOCK_TOKEN_COUNTS,
                index,
                item: clip(item),
            })
        })?;
        let mut tokens = 0;
        if let Some(v) = prefix_tokens.filter(|v| !v.is_empty()) {
            tokens = parse_decimal_u32(v).ok_or_else(|| MalformedHeader::BadCount {
                header: PREFIX_TOKENS,
                index: 0,
                item: clip(v),
            })?;
        }
        Ok((hashes, counts, tokens))
    }
}

/// The routing headers as text, before the numbers are read: borrowed from the
/// message, so a chain of many thousand blocks is read once, straight into the
/// numbers the core borrows, and never copied as text.
#[derive(Default)]
struct RawHeaders<'a> {
    tenant: Option<&'a str>,
    model: Option<&'a str>,
    hash_scheme: Option<&'a str>,
    block_hashes: Option<&'a str>,
    block_token_counts: Option<&'a str>,
    prefix_hash: Option<&'a str>,
    prefix_tokens: Option<&'a str>,
    lora_adapter: Option<&'a str>,
    cache_salt: Option<&'a str>,
    debug: Option<&'a str>,
    priority: Option<&'a str>,
}

/// What every header this module reads starts with; a request's other headers
/// are passed over on this prefix alone.
const READ_PREFIX: &str = "x-inferencecache-";

impl<'a> RawHeaders<'a> {
    fn take(&mut self, name: &str, value: &'a [u8]) -> Result<(), MalformedHeader> {
        let Some((header, slot)) = self.slot(name) else {
            return Ok(());
        };
        if slot.is_some() {
            return Err(MalformedHeader::Repeated(header));
        }
        let text = std::str::from_utf8(value).map_err(|_| MalformedHeader::NotText(header))?;
        *slot = Some(text.trim());
        Ok(())
    }

    /// The slot of a header this module reads, matched without allocating:
    /// Envoy hands ext_proc lowercase names, which match exactly; any other
    /// spelling is compared ignoring ASCII case, like HTTP.
    fn slot(&mut self, name: &str) -> Option<(&'static str, &mut Option<&'a str>)> {
        let prefix = name.as_bytes().get(..READ_PREFIX.len())?;
        if !prefix.eq_ignore_ascii_case(READ_PREFIX.as_bytes()) {
            return None;
        }
        let slot = match name {
            TENANT => (TENANT, &mut self.tenant),
            MODEL => (MODEL, &mut self.model),
            HASH_SCHEME => (HASH_SCHEME, &mut self.hash_scheme),
            BLOCK_HASHES => (BLOCK_HASHES, &mut self.block_hashes),
            BLOCK_TOKEN_COUNTS => (BLOCK_TOKEN_COUNTS, &mut self.block_token_counts),
            PREFIX_HASH => (PREFIX_HASH, &mut self.prefix_hash),
            PREFIX_TOKENS => (PREFIX_TOKENS, &mut self.prefix_tokens),
            LORA_ADAPTER => (LORA_ADAPTER, &mut self.lora_adapter),
            CACHE_SALT => (CACHE_SALT, &mut self.cache_salt),
            DEBUG => (DEBUG, &mut self.debug),
            PRIORITY => (PRIORITY, &mut self.priority),
            _ => {
                let lower = [
                    TENANT,
                    MODEL,
                    HASH_SCHEME,
                    BLOCK_HASHES,
                    BLOCK_TOKEN_COUNTS,
                    PREFIX_HASH,
                    PREFIX_TOKENS,
                    LORA_ADAPTER,
                    CACHE_SALT,
                    DEBUG,
                    PRIORITY,
                ]
                .into_iter()
                .find(|h| h.eq_ignore_ascii_case(name))?;
                return self.slot(lower);
            }
        };
        Some(slot)
    }
}

/// Splits a comma-separated list (optional whitespace around items); an empty
/// value is an empty list, an empty item is malformed.
fn parse_list<T>(
    value: &str,
    mut item: impl FnMut(usize, &str) -> Result<T, MalformedHeader>,
) -> Result<Vec<T>, MalformedHeader> {
    if value.is_empty() {
        return Ok(Vec::new());
    }
    // Count first so an oversized chain is refused before anything is allocated.
    let blocks = value.bytes().filter(|&b| b == b',').count() + 1;
    if blocks > MAX_CHAIN_BLOCKS {
        return Err(MalformedHeader::TooLong { blocks });
    }
    let mut out = Vec::with_capacity(blocks);
    for (i, part) in value.split(',').enumerate() {
        out.push(item(i, part.trim())?);
    }
    Ok(out)
}

/// 1 to 16 lowercase hex digits, no prefix, no sign.
fn parse_hex_u64(s: &str) -> Option<u64> {
    let ok = (1..=16).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    if ok {
        u64::from_str_radix(s, 16).ok()
    } else {
        None
    }
}

/// Plain ASCII digits (no sign, no spaces) that fit a u32.
fn parse_decimal_u32(s: &str) -> Option<u32> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

/// Bounds what a malformed item echoes back on a debug header.
fn clip(item: &str) -> String {
    item.chars().take(32).collect()
}

/// Formats a chain the way the headers carry it (for clients and tests).
pub fn format_chain(hashes: &[u64]) -> String {
    let parts: Vec<String> = hashes.iter().map(|h| format!("{h:x}")).collect();
    parts.join(",")
}

#[cfg(test)]
mod tests;
