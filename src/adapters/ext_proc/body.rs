//! The seam between the ext_proc stream (which collects an OpenAI request body) and
//! body mode (which turns that body into routing fields: tokenizer, chat template,
//! own content chain). The stream owns the protocol; the implementor owns the prompt.

use super::headers::RoutingFields;

/// Why a body gave no chain. The request is still served (fail-open): the
/// decision falls back as if no chain had been sent, and `reason()` is echoed
/// on the debug headers.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BodyMiss {
    #[error("body over the {limit}-byte limit")]
    TooLarge { limit: usize },
    #[error("body is not valid JSON: {0}")]
    InvalidJson(String),
    #[error("body is not an OpenAI completions or chat request: {0}")]
    NotOpenAi(String),
    #[error("no backend serves model {0:?}")]
    UnknownModel(String),
    #[error("tenant is ambiguous for model {0:?}")]
    AmbiguousTenant(String),
    #[error("tokenizer unavailable for backend {backend}: {detail}")]
    NoTokenizer { backend: String, detail: String },
    #[error("chat template failed: {0}")]
    Template(String),
}

impl BodyMiss {
    /// A short stable code for metrics labels and the debug header.
    pub fn reason(&self) -> &'static str {
        match self {
            BodyMiss::TooLarge { .. } => "body_too_large",
            BodyMiss::InvalidJson(_) => "invalid_json",
            BodyMiss::NotOpenAi(_) => "not_openai",
            BodyMiss::UnknownModel(_) => "unknown_model",
            BodyMiss::AmbiguousTenant(_) => "ambiguous_tenant",
            BodyMiss::NoTokenizer { .. } => "no_tokenizer",
            BodyMiss::Template(_) => "template_error",
        }
    }
}

/// Turns a complete request body into routing fields.
pub trait BodyRouter: Send + Sync + 'static {
    /// Whether a request with this `:path` and these header fields should have its
    /// body read at all (e.g. `/v1/completions` or `/v1/chat/completions`, no chain
    /// header, body mode configured for some backend).
    fn wants_body(&self, path: &str, headers: &RoutingFields) -> bool;

    /// The largest body it will read; the stream stops buffering past it.
    fn max_body_bytes(&self) -> usize;

    /// `headers` are the fields the request headers carried (tenant and model may be
    /// empty); the answer is complete fields for the decision (tenant, model, the
    /// backend's own content scheme and chain), or why not.
    fn route(
        &self,
        path: &str,
        headers: &RoutingFields,
        body: &[u8],
    ) -> Result<RoutingFields, BodyMiss>;
}
