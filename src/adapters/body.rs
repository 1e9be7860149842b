//! Body mode: an OpenAI request body → the routing fields of its prompt, for a
//! request that carries no chain header.
//!
//! ```text
//!  body ─request::parse─▶ model, Prompt ─backend of (tenant, model)─▶ ModelTokenizer
//!       (TokenizerStore)  ─template + tokenizer─▶ token ids ─ic-content-v1─▶ chain
//! ```
//!
//! The chain is the backend's own content chain (`ic-content-v1` or
//! `ic-content-v2`, the backend's block size): the one the index builds from the
//! engines' `token_ids`, so it matches whatever hash settings the engine runs
//! with. Only backends with one of those two `hashScheme`s can be routed this way.
//! Under `ic-content-v2` the block identity comes from the body too: a `model`
//! naming one of the backend's `loraAdapters` is that adapter, and `cache_salt`
//! is the salt, as vLLM hashes them.
//!
//! Every failure is a [`BodyMiss`]: the request is served without a hint.

pub mod request;
pub mod segment_cache;
pub mod store;
pub mod template;
pub mod tokenizer;

use std::sync::Arc;

use crate::adapters::MAX_CHAIN_BLOCKS;
use crate::adapters::ext_proc::body::{BodyMiss, BodyRouter};
use crate::adapters::ext_proc::headers::RoutingFields;
use crate::core::Router;
use crate::core::chain::{self, IC_CONTENT_V1, IC_CONTENT_V2, Scheme};
use crate::core::snapshot::{BackendDecl, PolicySnapshot};

use request::{Endpoint, RequestError};
use store::{TokenizerState, TokenizerStore};
use tokenizer::PromptError;

/// The default `--max-body-bytes`: 4 MiB, about a million tokens of text.
pub const DEFAULT_MAX_BODY_BYTES: usize = 4 << 20;

/// The [`BodyRouter`] of the sidecar: reads the installed policy snapshot (which
/// backend serves a model, for which tenant, with which block size) and the
/// tokenizer store.
pub struct BodyMode {
    router: Arc<Router>,
    tokenizers: Arc<TokenizerStore>,
    max_body_bytes: usize,
}

impl BodyMode {
    pub fn new(
        router: Arc<Router>,
        tokenizers: Arc<TokenizerStore>,
        max_body_bytes: usize,
    ) -> Self {
        Self {
            router,
            tokenizers,
            max_body_bytes,
        }
    }

    /// [`BodyRouter::route`] against an explicit snapshot (tests, benches).
    pub fn route_in(
        &self,
        snapshot: &PolicySnapshot,
        path: &str,
        headers: &RoutingFields,
        body: &[u8],
    ) -> Result<RoutingFields, BodyMiss> {
        if body.len() > self.max_body_bytes {
            return Err(BodyMiss::TooLarge {
                limit: self.max_body_bytes,
            });
        }
        let endpoint = Endpoint::from_path(path)
            .ok_or_else(|| BodyMiss::NotOpenAi(format!("{path} is not an OpenAI endpoint")))?;
        let req = request::parse(endpoint, body).map_err(|e| match e {
            RequestError::Json(e) => BodyMiss::InvalidJson(e),
            RequestError::NotOpenAi(e) => BodyMiss::NotOpenAi(e),
        })?;
        let model = if headers.model.is_empty() {
            req.model.as_str()
        } else {
            headers.model.as_str()
        };
        if model.is_empty() {
            return Err(BodyMiss::NotOpenAi(
                "no model (neither x-inferencecache-model nor the body's model)".into(),
            ));
        }
        let (backend, adapter) = backend_for(snapshot, &headers.tenant, model)?;
        let id = format!("{}/{}", backend.namespace, backend.name);
        let scheme = match &*backend.scope.hash_scheme {
            IC_CONTENT_V1 => Scheme::ContentV1,
            IC_CONTENT_V2 => Scheme::ContentV2,
            other => {
                return Err(BodyMiss::NoTokenizer {
                    backend: id,
                    detail: format!(
                        "body mode needs hashScheme {IC_CONTENT_V1} or {IC_CONTENT_V2}, the backend has {other}"
                    ),
                });
            }
        };
        let tokenizer = match self.tokenizers.get(&backend.namespace, &backend.name) {
            TokenizerState::Ready(t) => t,
            TokenizerState::NotConfigured => {
                return Err(BodyMiss::NoTokenizer {
                    backend: id,
                    detail: "no spec.tokenizer.path".into(),
                });
            }
            TokenizerState::Loading => {
                return Err(BodyMiss::NoTokenizer {
                    backend: id,
                    detail: "still loading".into(),
                });
            }
            TokenizerState::Broken(detail) => {
                return Err(BodyMiss::NoTokenizer {
                    backend: id,
                    detail,
                });
            }
        };
        let ids = tokenizer.prompt_ids(&req.prompt).map_err(|e| match e {
            PromptError::Template(e) => BodyMiss::Template(e),
            PromptError::Encode(detail) => BodyMiss::NoTokenizer {
                backend: id.clone(),
                detail,
            },
        })?;
        let block_size = backend.block_size;
        let usable = ids.len().min(MAX_CHAIN_BLOCKS * block_size as usize);
        let block_hashes =
            chain::compute_chain(scheme, &ids[..usable], block_size, None).map_err(|e| {
                BodyMiss::NoTokenizer {
                    backend: id,
                    detail: e.to_string(),
                }
            })?;
        // The identity headers win; else the body's: its model when that names an
        // adapter of the backend (also under a base-model header), its cache_salt.
        let lora_adapter = if !headers.lora_adapter.is_empty() {
            headers.lora_adapter.as_str()
        } else if let Some(a) = adapter {
            a
        } else if backend.lora_adapters.contains(&req.model) {
            req.model.as_str()
        } else {
            ""
        };
        let cache_salt = if headers.cache_salt.is_empty() {
            req.cache_salt.as_str()
        } else {
            headers.cache_salt.as_str()
        };
        // ic-content-v1 hashes token ids only: an adapter or salt would change
        // nothing there, so they are carried under ic-content-v2 alone.
        let identity = |v: &str| {
            if scheme == Scheme::ContentV2 {
                v.to_string()
            } else {
                String::new()
            }
        };
        Ok(RoutingFields {
            tenant: backend.scope.tenant.to_string(),
            model: backend.scope.model.to_string(),
            hash_scheme: scheme.name().to_string(),
            prefix_hash: String::new(),
            prefix_tokens: 0,
            block_token_counts: vec![block_size; block_hashes.len()],
            block_hashes,
            lora_adapter: identity(lora_adapter),
            cache_salt: identity(cache_salt),
        })
    }
}

impl BodyRouter for BodyMode {
    fn wants_body(&self, path: &str, headers: &RoutingFields) -> bool {
        Endpoint::from_path(path).is_some()
            && headers.block_hashes.is_empty()
            && headers.prefix_hash.is_empty()
            && self.tokenizers.any_configured()
    }

    fn max_body_bytes(&self) -> usize {
        self.max_body_bytes
    }

    fn route(
        &self,
        path: &str,
        headers: &RoutingFields,
        body: &[u8],
    ) -> Result<RoutingFields, BodyMiss> {
        self.route_in(&self.router.snapshot(), path, headers, body)
    }
}

/// The backend serving `model` (its `modelID`, or one of its `loraAdapters`,
/// then also returned) for `tenant` (from the header), or, without a tenant, for
/// the one tenant whose namespace has a backend serving it. Among several
/// backends of one (tenant, model), a content-chain one first (`ic-content-v1`,
/// then `ic-content-v2`), then declaration order.
fn backend_for<'a>(
    snapshot: &'a PolicySnapshot,
    tenant: &str,
    model: &'a str,
) -> Result<(&'a BackendDecl, Option<&'a str>), BodyMiss> {
    let serving = || {
        snapshot
            .backends()
            .iter()
            .filter(|b| &*b.scope.model == model || b.lora_adapters.iter().any(|a| a == model))
    };
    let tenant = if tenant.is_empty() {
        let mut tenants: Vec<&str> = serving().map(|b| &*b.scope.tenant).collect();
        tenants.sort_unstable();
        tenants.dedup();
        match tenants.as_slice() {
            [] => return Err(BodyMiss::UnknownModel(model.to_string())),
            [one] => *one,
            _ => return Err(BodyMiss::AmbiguousTenant(model.to_string())),
        }
    } else {
        tenant
    };
    let mut candidates: Vec<&BackendDecl> =
        serving().filter(|b| &*b.scope.tenant == tenant).collect();
    candidates.sort_by_key(|b| match &*b.scope.hash_scheme {
        IC_CONTENT_V1 => 0,
        IC_CONTENT_V2 => 1,
        _ => 2,
    });
    let backend = candidates
        .into_iter()
        .next()
        .ok_or_else(|| BodyMiss::UnknownModel(model.to_string()))?;
    let adapter = (&*backend.scope.model != model).then_some(model);
    Ok((backend, adapter))
}

#[cfg(test)]
mod tests;
