//! A LookupRoute request as the core sees it, borrowed from the adapter's buffers.

/// The request fields of LookupRoute (docs/reference.md, "gRPC API"), borrowed so the hot path copies nothing.
#[derive(Clone, Copy, Debug, Default)]
pub struct LookupRequest<'a> {
    pub tenant_id: &'a str,
    pub model_id: &'a str,
    pub hash_scheme: &'a str,
    /// Exact-prefix key; empty means absent.
    pub prefix_hash: &'a str,
    pub prefix_token_count: u32,
    /// The chain, block 0 first.
    pub block_hashes: &'a [u64],
    /// Parallel to `block_hashes`.
    pub block_token_counts: &'a [u32],
    /// Optional subset of replica ids to pick among; unknown ids are ignored.
    pub candidate_replicas: &'a [String],
    /// The request's LoRA adapter and cache salt; empty means none. Under
    /// `ic-content-v2` they key the chain ([`crate::chain::request_keys`]), so the
    /// request never matches blocks stored under another identity.
    pub lora_adapter: &'a str,
    pub cache_salt: &'a str,
    /// Its flow-control priority (`x-inferencecache-priority`, 0 when absent).
    /// The decision ignores it; an admitted route carries it to the fleet's
    /// peers, whose flow control charges the tenant in that priority.
    pub priority: i64,
    /// Flow control held the request before this decision (it was released
    /// from a queue). The decision ignores it; an admitted route tells the
    /// peers, whose queues then leave room for the tenant's next request.
    pub held: bool,
}

/// The chain after step 1, and what steps 2–4 need to know about it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Chain<'a> {
    pub hashes: &'a [u64],
    pub token_counts: &'a [u32],
}

impl<'a> Chain<'a> {
    /// Step 1: with chain matching off, the chain is dropped (not malformed).
    pub fn from_request(req: &LookupRequest<'a>, chain_matching: bool) -> Self {
        if chain_matching {
            Self {
                hashes: req.block_hashes,
                token_counts: req.block_token_counts,
            }
        } else {
            Self {
                hashes: &[],
                token_counts: &[],
            }
        }
    }

    /// Non-empty and parallel: what `requireChain` asks for.
    pub fn is_valid(&self) -> bool {
        !self.hashes.is_empty() && self.hashes.len() == self.token_counts.len()
    }

    /// Both arrays balanced (possibly both empty).
    pub fn is_balanced(&self) -> bool {
        self.hashes.len() == self.token_counts.len()
    }

    pub fn is_present(&self) -> bool {
        !self.hashes.is_empty()
    }

    /// Sum of the block token counts, saturating.
    pub fn token_total(&self) -> u64 {
        self.token_counts.iter().map(|&t| u64::from(t)).sum()
    }
}
