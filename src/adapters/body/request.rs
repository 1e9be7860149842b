//! The parts of an OpenAI request body that decide its prompt: `/v1/completions`
//! (`prompt`) and `/v1/chat/completions` (`messages`, `tools`, template options).
//!
//! The body is parsed once, into only these fields (everything else is skipped
//! unread); the body itself is never kept.
//!
//! A completions `prompt` may be a list of prompts (vLLM serves each as its own
//! sequence, on one replica). The request is routed on the **first** prompt: that
//! is the sequence the engine prefills first, and a batch sent by one client
//! usually shares its prefix anyway. The others cannot be routed separately.

use minijinja::Value;
use serde::Deserialize;
use serde_json::value::RawValue;

/// Which OpenAI endpoint a `:path` names (the query string is ignored).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    ChatCompletions,
}

impl Endpoint {
    pub fn from_path(path: &str) -> Option<Self> {
        let path = path.split(['?', '#']).next().unwrap_or("");
        match path.trim_end_matches('/') {
            "/v1/completions" => Some(Self::Completions),
            "/v1/chat/completions" => Some(Self::ChatCompletions),
            _ => None,
        }
    }
}

/// The prompt of a request, before tokenization.
#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    /// A completions prompt as text; `add_special_tokens` defaults to true (vLLM).
    Text {
        text: String,
        add_special_tokens: bool,
    },
    /// A completions prompt already tokenized: used as it is.
    Tokens(Vec<u32>),
    /// A chat request, rendered with the model's chat template.
    Chat(Chat),
}

/// What the chat template sees, as vLLM passes it.
#[derive(Clone, Debug, PartialEq)]
pub struct Chat {
    /// Messages with text content parts joined (vLLM's "string" content format).
    pub messages: Value,
    /// `tools` in vLLM's normalized form, or none.
    pub tools: Option<Value>,
    pub add_generation_prompt: bool,
    pub continue_final_message: bool,
    /// Whether the rendered text is tokenized with special tokens (default false:
    /// the template writes them itself).
    pub add_special_tokens: bool,
    /// `chat_template_kwargs`: extra template variables (e.g. `enable_thinking`).
    pub template_kwargs: Value,
}

/// A parsed request: its model (may be empty) and prompt.
#[derive(Clone, Debug, PartialEq)]
pub struct OpenAiRequest {
    pub model: String,
    pub prompt: Prompt,
    /// vLLM's `cache_salt`: part of every block's identity under `ic-content-v2`.
    pub cache_salt: String,
}

/// Why a body is not a usable request.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    #[error("{0}")]
    Json(String),
    #[error("{0}")]
    NotOpenAi(String),
}

#[derive(Deserialize)]
struct CompletionsBody<'a> {
    #[serde(default)]
    model: String,
    #[serde(default)]
    cache_salt: Option<String>,
    #[serde(borrow)]
    prompt: Option<&'a RawValue>,
    add_special_tokens: Option<bool>,
}

#[derive(Deserialize)]
struct ChatBody {
    #[serde(default)]
    model: String,
    #[serde(default)]
    cache_salt: Option<String>,
    messages: Option<Vec<Value>>,
    tools: Option<Vec<Value>>,
    add_generation_prompt: Option<bool>,
    continue_final_message: Option<bool>,
    add_special_tokens: Option<bool>,
    chat_template_kwargs: Option<Value>,
}

/// Parses `body` as a request to `endpoint`.
pub fn parse(endpoint: Endpoint, body: &[u8]) -> Result<OpenAiRequest, RequestError> {
    let json = |e: serde_json::Error| {
        if e.is_data() {
            RequestError::NotOpenAi(e.to_string())
        } else {
            RequestError::Json(e.to_string())
        }
    };
    match endpoint {
        Endpoint::Completions => {
            let b: CompletionsBody = serde_json::from_slice(body).map_err(json)?;
            let raw = b
                .prompt
                .ok_or_else(|| RequestError::NotOpenAi("prompt is missing".into()))?;
            let prompt = completions_prompt(raw, b.add_special_tokens.unwrap_or(true))?;
            Ok(OpenAiRequest {
                model: b.model,
                prompt,
                cache_salt: b.cache_salt.unwrap_or_default(),
            })
        }
        Endpoint::ChatCompletions => {
            let b: ChatBody = serde_json::from_slice(body).map_err(json)?;
            let messages = b
                .messages
                .ok_or_else(|| RequestError::NotOpenAi("messages is missing".into()))?;
            if messages.is_empty() {
                return Err(RequestError::NotOpenAi("messages is empty".into()));
            }
            let messages = messages
                .into_iter()
                .map(flatten_content)
                .collect::<Result<Vec<_>, _>>()?;
            let template_kwargs = match b.chat_template_kwargs {
                Some(v) if v.kind() == minijinja::value::ValueKind::Map => v,
                Some(v) if v.is_none() => Value::from(()),
                Some(_) => {
                    return Err(RequestError::NotOpenAi(
                        "chat_template_kwargs must be an object".into(),
                    ));
                }
                None => Value::from(()),
            };
            Ok(OpenAiRequest {
                model: b.model,
                prompt: Prompt::Chat(Chat {
                    messages: Value::from(messages),
                    tools: b
                        .tools
                        .filter(|t| !t.is_empty())
                        .map(|t| t.into_iter().map(normalize_tool).collect::<Vec<_>>())
                        .map(Value::from),
                    add_generation_prompt: b.add_generation_prompt.unwrap_or(true),
                    continue_final_message: b.continue_final_message.unwrap_or(false),
                    add_special_tokens: b.add_special_tokens.unwrap_or(false),
                    template_kwargs,
                }),
                cache_salt: b.cache_salt.unwrap_or_default(),
            })
        }
    }
}

/// The forms of a completions `prompt` (the OpenAI API's four).
#[derive(Deserialize)]
#[serde(untagged)]
enum PromptForm {
    Text(String),
    Tokens(Vec<u32>),
    Texts(Vec<String>),
    TokenLists(Vec<Vec<u32>>),
}

fn completions_prompt(raw: &RawValue, add_special_tokens: bool) -> Result<Prompt, RequestError> {
    let form: PromptForm = serde_json::from_str(raw.get()).map_err(|_| {
        RequestError::NotOpenAi(
            "prompt must be a string, an array of token ids, or a list of either".into(),
        )
    })?;
    let empty = || RequestError::NotOpenAi("prompt is empty".into());
    Ok(match form {
        PromptForm::Text(text) => Prompt::Text {
            text,
            add_special_tokens,
        },
        PromptForm::Tokens(ids) if ids.is_empty() => return Err(empty()),
        PromptForm::Tokens(ids) => Prompt::Tokens(ids),
        PromptForm::Texts(texts) => Prompt::Text {
            text: texts.into_iter().next().ok_or_else(empty)?,
            add_special_tokens,
        },
        PromptForm::TokenLists(lists) => Prompt::Tokens(
            lists
                .into_iter()
                .next()
                .filter(|l| !l.is_empty())
                .ok_or_else(empty)?,
        ),
    })
}

/// A message whose `content` is a list of parts gets its text parts joined with
/// newlines, as vLLM does for templates that expect a string; a message without a
/// role is not a chat message.
fn flatten_content(message: Value) -> Result<Value, RequestError> {
    if message.kind() != minijinja::value::ValueKind::Map {
        return Err(RequestError::NotOpenAi("a message is not an object".into()));
    }
    let role = message.get_attr("role").unwrap_or_default();
    if role.as_str().is_none() {
        return Err(RequestError::NotOpenAi("a message has no role".into()));
    }
    let content = message.get_attr("content").unwrap_or_default();
    if content.kind() != minijinja::value::ValueKind::Seq {
        return Ok(message);
    }
    let mut texts = Vec::new();
    for part in content.try_iter().into_iter().flatten() {
        let kind = part.get_attr("type").unwrap_or_default();
        if kind.as_str() == Some("text") {
            let text = part.get_attr("text").unwrap_or_default();
            texts.push(text.as_str().unwrap_or("").to_string());
        } else {
            return Err(RequestError::NotOpenAi(format!(
                "content part of type {kind} is not text (only text prompts are routed)"
            )));
        }
    }
    let mut out: indexmap_like::Map = indexmap_like::Map::new();
    for key in message.try_iter().into_iter().flatten() {
        let v = if key.as_str() == Some("content") {
            Value::from(texts.join("\n"))
        } else {
            message.get_item(&key).unwrap_or_default()
        };
        out.push((key, v));
    }
    Ok(Value::from_iter(out))
}

/// vLLM hands the template `tool.model_dump()`: `{"type", "function": {"name",
/// "description", "parameters"}}` in that order, absent fields as null. A tool
/// that is not of that shape is passed as the client sent it.
fn normalize_tool(tool: Value) -> Value {
    let function = tool.get_attr("function").unwrap_or_default();
    if function.kind() != minijinja::value::ValueKind::Map {
        return tool;
    }
    let field = |v: &Value, k: &str| v.get_attr(k).ok().filter(|v| !v.is_undefined());
    let f: indexmap_like::Map = vec![
        (
            Value::from("name"),
            field(&function, "name").unwrap_or(Value::from(())),
        ),
        (
            Value::from("description"),
            field(&function, "description").unwrap_or(Value::from(())),
        ),
        (
            Value::from("parameters"),
            field(&function, "parameters").unwrap_or(Value::from(())),
        ),
    ];
    Value::from_iter([
        (
            Value::from("type"),
            field(&tool, "type").unwrap_or(Value::from("function")),
        ),
        (Value::from("function"), Value::from_iter(f)),
    ])
}

/// Ordered key/value pairs (minijinja's maps keep insertion order with
/// `preserve_order`).
mod indexmap_like {
    pub type Map = Vec<(minijinja::Value, minijinja::Value)>;
}
