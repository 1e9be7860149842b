//! One model's tokenizer files → token ids, exactly as the engine computes them.
//!
//! A directory (`spec.tokenizer.path`) holds `tokenizer.json` (Hugging Face
//! `tokenizers`), optionally `tokenizer_config.json` (special tokens and
//! `chat_template`) and optionally `chat_template.jinja` (which takes precedence
//! over the config's template, as in current `transformers`).
//!
//! Special tokens follow vLLM: a completions text prompt is encoded with special
//! tokens (the tokenizer's post-processor adds e.g. BOS); a chat prompt is encoded
//! without them (the template writes BOS itself; `apply_chat_template(tokenize=True)`
//! does the same). The body's `add_special_tokens` overrides either.
//!
//! Pure and synchronous, so the simulated engine and `inferencecache tokenize`
//! use the same code as the sidecar.
//!
//! Encoding goes through a [`SegmentCache`] when that is exact for the files
//! (see [`cache_exactness`]): `tokenizers` splits the input on the added tokens
//! that are matched before normalization (`AddedVocabulary::extract_and_normalize`,
//! step 1) and normalizes, pre-tokenizes and runs the model on each piece between
//! them separately, so the ids of a text are the concatenation of its pieces' ids
//! and the added tokens' ids, followed by the post-processor (BOS). We split with
//! the tokenizer's own `extract_and_normalize` (no normalizer: step 1 only), so
//! the split is the library's, and look each piece up.

use std::path::{Path, PathBuf};

use serde_json::Value as Json;

use super::request::{Chat, Prompt};
use super::segment_cache::{CacheStats, DEFAULT_CACHE_BYTES, SegmentCache};
use super::template::ChatTemplate;

pub const TOKENIZER_JSON: &str = "tokenizer.json";
pub const TOKENIZER_CONFIG: &str = "tokenizer_config.json";
pub const CHAT_TEMPLATE_JINJA: &str = "chat_template.jinja";

/// The special-token names of `tokenizer_config.json` a template may use.
const SPECIAL_TOKENS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// A loaded tokenizer and (when the files have one) chat template.
pub struct ModelTokenizer {
    dir: PathBuf,
    tokenizer: tokenizers::Tokenizer,
    default_template: Option<ChatTemplate>,
    /// A config's named `tool_use` template, used when a request has tools.
    tool_template: Option<ChatTemplate>,
    /// `Ok`: segments are cached; `Err`: why caching would not be exact.
    segments: Result<SegmentCache, String>,
}

impl std::fmt::Debug for ModelTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelTokenizer")
            .field("dir", &self.dir)
            .field("chat_template", &self.default_template.is_some())
            .field(
                "segment_cache",
                &self.segments.as_ref().map(SegmentCache::stats),
            )
            .finish_non_exhaustive()
    }
}

/// Why a prompt has no token ids.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PromptError {
    #[error("{0}")]
    Template(String),
    #[error("tokenizing failed: {0}")]
    Encode(String),
}

impl ModelTokenizer {
    /// Reads and checks the files of `dir`; every problem names the file.
    pub fn load(dir: &Path) -> Result<Self, String> {
        let json_path = dir.join(TOKENIZER_JSON);
        let bytes =
            std::fs::read(&json_path).map_err(|e| format!("{}: {e}", json_path.display()))?;
        let tokenizer = tokenizers::Tokenizer::from_bytes(&bytes)
            .map_err(|e| format!("{}: not a Hugging Face tokenizer: {e}", json_path.display()))?;
        drop(bytes);

        let config_path = dir.join(TOKENIZER_CONFIG);
        let config: Json = match std::fs::read(&config_path) {
            Ok(b) => serde_json::from_slice(&b)
                .map_err(|e| format!("{}: invalid JSON: {e}", config_path.display()))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Json::Null,
            Err(e) => return Err(format!("{}: {e}", config_path.display())),
        };
        let special = special_tokens(&config);

        let jinja_path = dir.join(CHAT_TEMPLATE_JINJA);
        let jinja = match std::fs::read_to_string(&jinja_path) {
            Ok(s) => Some(s),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(format!("{}: {e}", jinja_path.display())),
        };
        let (default_source, tool_source) = match jinja {
            Some(s) => (Some(s), None),
            None => config_templates(&config)
                .map_err(|e| format!("{}: chat_template: {e}", config_path.display()))?,
        };
        let compile = |source: Option<String>, what: &str| {
            source
                .map(|s| ChatTemplate::new(s, special.clone()))
                .transpose()
                .map_err(|e| format!("{}: {what}: {e}", dir.display()))
        };
        let segments = cache_exactness(&tokenizer).map(|()| SegmentCache::new(DEFAULT_CACHE_BYTES));
        Ok(Self {
            dir: dir.to_path_buf(),
            tokenizer,
            default_template: compile(default_source, "chat template")?,
            tool_template: compile(tool_source, "tool_use chat template")?,
            segments,
        })
    }

    /// The segment cache's counts, or why these files are not cached.
    pub fn cache_stats(&self) -> Result<CacheStats, &str> {
        self.segments
            .as_ref()
            .map(SegmentCache::stats)
            .map_err(String::as_str)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn has_chat_template(&self) -> bool {
        self.default_template.is_some()
    }

    /// Token ids of `text` (through the segment cache when it is exact).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, PromptError> {
        match &self.segments {
            Ok(cache) => self.encode_segments(cache, text, add_special_tokens),
            Err(_) => self.encode_uncached(text, add_special_tokens),
        }
    }

    /// Token ids of `text` straight from the tokenizer (what [`encode`](Self::encode)
    /// must equal; tests and benches compare the two).
    pub fn encode_uncached(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, PromptError> {
        self.tokenizer
            .encode_fast(text, add_special_tokens)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| PromptError::Encode(e.to_string()))
    }

    /// The library's split on added tokens, each piece between them from the
    /// cache, then the post-processor on the whole.
    fn encode_segments(
        &self,
        cache: &SegmentCache,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, PromptError> {
        use tokenizers::{NormalizerWrapper, OffsetReferential, OffsetType};
        let encode_err = |e: tokenizers::Error| PromptError::Encode(e.to_string());
        let split = self
            .tokenizer
            .get_added_vocabulary()
            .extract_and_normalize::<NormalizerWrapper>(None, text);
        let mut ids = Vec::new();
        for (piece, _, tokens) in split.get_splits(OffsetReferential::Original, OffsetType::None) {
            match tokens {
                Some(added) => ids.extend(added.iter().map(|t| t.id)),
                None if piece.is_empty() => {}
                None => ids.extend_from_slice(&cache.get_or_encode(piece, |p| {
                    self.tokenizer
                        .encode_fast(p, false)
                        .map(|e| e.get_ids().to_vec())
                        .map_err(encode_err)
                })?),
            }
        }
        if !add_special_tokens {
            return Ok(ids);
        }
        // The post-processor reads ids only (offsets are not asked for): e.g.
        // TemplateProcessing puts BOS first, ByteLevel leaves ids alone.
        let tokens = ids
            .into_iter()
            .map(|id| tokenizers::Token::new(id, String::new(), (0, 0)))
            .collect();
        self.tokenizer
            .post_process(tokenizers::Encoding::from_tokens(tokens, 0), None, true)
            .map(|e| e.get_ids().to_vec())
            .map_err(encode_err)
    }

    /// The rendered chat prompt (text).
    pub fn render_chat(&self, chat: &Chat) -> Result<String, PromptError> {
        let template = match (&self.tool_template, &chat.tools) {
            (Some(t), Some(_)) => t,
            _ => self.default_template.as_ref().ok_or_else(|| {
                PromptError::Template(format!(
                    "{} has no chat template ({TOKENIZER_CONFIG} chat_template or {CHAT_TEMPLATE_JINJA})",
                    self.dir.display()
                ))
            })?,
        };
        template.render(chat).map_err(PromptError::Template)
    }

    /// The token ids the engine prefills for `prompt`.
    pub fn prompt_ids(&self, prompt: &Prompt) -> Result<Vec<u32>, PromptError> {
        match prompt {
            Prompt::Text {
                text,
                add_special_tokens,
            } => self.encode(text, *add_special_tokens),
            Prompt::Tokens(ids) => Ok(ids.clone()),
            Prompt::Chat(chat) => {
                let text = self.render_chat(chat)?;
                self.encode(&text, chat.add_special_tokens)
            }
        }
    }
}

/// Whether the segment cache gives exactly the tokenizer's ids, and if not why.
/// The split on added tokens is the library's own; what could still differ is a
/// piece tokenized alone versus inside the whole text:
/// - an added token matched after normalization (`normalized: true`) or only as
///   a whole word (`single_word`): its match depends on the text around a piece;
/// - a Metaspace pre-tokenizer with `prepend_scheme: first`, which looks at the
///   piece's position in the whole text;
/// - BPE dropout (random), truncation or padding (whole-sequence steps).
pub fn cache_exactness(tokenizer: &tokenizers::Tokenizer) -> Result<(), String> {
    if let Some(t) = tokenizer
        .get_added_tokens_decoder()
        .values()
        .find(|t| t.normalized || t.single_word)
    {
        return Err(format!(
            "added token {:?} is normalized or single_word",
            t.content
        ));
    }
    let pre = serde_json::to_string(&tokenizer.get_pre_tokenizer()).unwrap_or_default();
    if pre.contains(r#""prepend_scheme":"first""#) {
        return Err("Metaspace pre-tokenizer with prepend_scheme first".into());
    }
    if let tokenizers::ModelWrapper::BPE(bpe) = tokenizer.get_model()
        && bpe.dropout.is_some()
    {
        return Err("BPE dropout".into());
    }
    if tokenizer.get_truncation().is_some() || tokenizer.get_padding().is_some() {
        return Err("truncation or padding configured".into());
    }
    Ok(())
}

/// `bos_token` etc. from the config: a string, or an AddedToken `{"content": …}`.
fn special_tokens(config: &Json) -> Vec<(String, String)> {
    SPECIAL_TOKENS
        .iter()
        .filter_map(|name| {
            let v = config.get(*name)?;
            let content = v.as_str().or_else(|| v.get("content")?.as_str())?;
            Some((name.to_string(), content.to_string()))
        })
        .collect()
}

/// `chat_template` is a string or a list of `{"name", "template"}`; returns the
/// default and the `tool_use` template.
fn config_templates(config: &Json) -> Result<(Option<String>, Option<String>), String> {
    match config.get("chat_template") {
        None | Some(Json::Null) => Ok((None, None)),
        Some(Json::String(s)) => Ok((Some(s.clone()), None)),
        Some(Json::Array(items)) => {
            let named = |name: &str| {
                items.iter().find_map(|t| {
                    (t.get("name")?.as_str()? == name)
                        .then(|| t.get("template")?.as_str().map(str::to_string))
                        .flatten()
                })
            };
            let default = named("default");
            if default.is_none() {
                return Err("a list of templates without one named \"default\"".into());
            }
            Ok((default, named("tool_use")))
        }
        Some(_) => Err("must be a string or a list of {name, template}".into()),
    }
}
