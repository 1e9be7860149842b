//! A Hugging Face chat template, rendered the way `transformers` renders it
//! (`apply_chat_template`): Jinja with `trim_blocks` and `lstrip_blocks`, loop
//! controls, Python string/list/dict methods (minijinja-contrib's pycompat), and
//! the globals and filters transformers adds: `raise_exception`, `strftime_now`
//! and a `tojson` that writes what Python's `json.dumps` writes.

use std::fmt::Write as _;

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Value, context};

use super::request::Chat;

const NAME: &str = "chat_template";

/// A compiled chat template plus the special tokens it may refer to.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// `bos_token`, `eos_token`, … as the tokenizer config names them.
    special_tokens: Vec<(String, String)>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles `source`; a syntax error is reported at load time, not per request.
    pub fn new(source: String, special_tokens: Vec<(String, String)>) -> Result<Self, String> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(NAME, source)
            .map_err(|e| format!("chat template does not compile: {e:#}"))?;
        Ok(Self {
            env,
            special_tokens,
        })
    }

    /// The prompt text of `chat`.
    pub fn render(&self, chat: &Chat) -> Result<String, String> {
        let template = self.env.get_template(NAME).map_err(|e| e.to_string())?;
        let special = Value::from_iter(
            self.special_tokens
                .iter()
                .map(|(k, v)| (k.clone(), Value::from(v.clone()))),
        );
        let base = context! {
            messages => chat.messages.clone(),
            tools => chat.tools.clone().unwrap_or(Value::from(())),
            add_generation_prompt => chat.add_generation_prompt && !chat.continue_final_message,
        };
        // Request kwargs override the special tokens; the request's own fields win.
        let ctx = if chat.template_kwargs.kind() == ValueKind::Map {
            context! { ..base, ..chat.template_kwargs.clone(), ..special }
        } else {
            context! { ..base, ..special }
        };
        let rendered = template.render(ctx).map_err(|e| render_error(&e))?;
        if chat.continue_final_message {
            return continue_final(rendered, &chat.messages);
        }
        Ok(rendered)
    }
}

fn render_error(e: &Error) -> String {
    match e.kind() {
        ErrorKind::InvalidOperation
            if e.detail()
                .is_some_and(|d| d.starts_with("raise_exception: ")) =>
        {
            e.detail().unwrap_or_default().to_string()
        }
        _ => format!("{e:#}"),
    }
}

/// transformers' `continue_final_message`: cut the rendering right after the final
/// message's content, so the model continues it.
fn continue_final(rendered: String, messages: &Value) -> Result<String, String> {
    let last = messages
        .len()
        .and_then(|n| n.checked_sub(1))
        .and_then(|i| messages.get_item_by_index(i).ok())
        .unwrap_or_default();
    let content = last.get_attr("content").unwrap_or_default();
    let Some(content) = content.as_str() else {
        return Err("continue_final_message needs a final message with text content".into());
    };
    let Some(at) = rendered.rfind(content.trim()) else {
        return Err(
            "continue_final_message: the final message is not in the rendered prompt".into(),
        );
    };
    let left = content.trim_start();
    let end = if rendered[at..].starts_with(left) {
        at + left.len()
    } else {
        at + content.trim().len()
    };
    let mut rendered = rendered;
    rendered.truncate(end);
    Ok(rendered)
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(
        ErrorKind::InvalidOperation,
        format!("raise_exception: {message}"),
    ))
}

/// transformers' `strftime_now(format)`: the local time, formatted (Llama 3 puts
/// today's date into its system header).
fn strftime_now(format: String) -> Value {
    Value::from(jiff::Zoned::now().strftime(&format).to_string())
}

/// Python's `json.dumps(value, ensure_ascii=False, indent=…, separators=…,
/// sort_keys=…)`, which is what transformers' `tojson` is.
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => Some(match v.as_str() {
            Some(s) => s.to_string(),
            None => " ".repeat(v.as_usize().unwrap_or(0)),
        }),
    };
    let (item_sep, key_sep) = match separators {
        Some(s) if !s.is_none() => {
            let a = s.get_item_by_index(0)?;
            let b = s.get_item_by_index(1)?;
            (
                a.as_str().unwrap_or(",").to_string(),
                b.as_str().unwrap_or(":").to_string(),
            )
        }
        _ if indent.is_some() => (",".to_string(), ": ".to_string()),
        _ => (", ".to_string(), ": ".to_string()),
    };
    let style = JsonStyle {
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.unwrap_or(false),
    };
    let mut out = String::new();
    style.write(&mut out, &value, 0)?;
    Ok(Value::from(out))
}

struct JsonStyle {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

impl JsonStyle {
    fn newline(&self, out: &mut String, depth: usize) {
        if let Some(ind) = &self.indent {
            out.push('\n');
            for _ in 0..depth {
                out.push_str(ind);
            }
        }
    }

    fn write(&self, out: &mut String, v: &Value, depth: usize) -> Result<(), Error> {
        match v.kind() {
            ValueKind::Undefined | ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
            ValueKind::Number => write_number(out, v),
            ValueKind::String => write_string(out, v.as_str().unwrap_or("")),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = v.try_iter()?.collect();
                self.write_items(out, depth, '[', ']', items.len(), |out, i, d| {
                    self.write(out, &items[i], d)
                })?;
            }
            ValueKind::Map => {
                let mut keys: Vec<Value> = v.try_iter()?.collect();
                if self.sort_keys {
                    keys.sort();
                }
                self.write_items(out, depth, '{', '}', keys.len(), |out, i, d| {
                    let key = &keys[i];
                    match key.as_str() {
                        Some(s) => write_string(out, s),
                        None => write_string(out, &key.to_string()),
                    }
                    out.push_str(&self.key_sep);
                    self.write(out, &v.get_item(key)?, d)
                })?;
            }
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson: cannot serialize a {} value", v.kind()),
                ));
            }
        }
        Ok(())
    }

    fn write_items(
        &self,
        out: &mut String,
        depth: usize,
        open: char,
        close: char,
        n: usize,
        mut item: impl FnMut(&mut String, usize, usize) -> Result<(), Error>,
    ) -> Result<(), Error> {
        out.push(open);
        if n == 0 {
            out.push(close);
            return Ok(());
        }
        for i in 0..n {
            if i > 0 {
                out.push_str(&self.item_sep);
            }
            self.newline(out, depth + 1);
            item(out, i, depth + 1)?;
        }
        self.newline(out, depth);
        out.push(close);
        Ok(())
    }
}

/// Python `repr` of ints and floats (`1`, `1.5`, `1.0`, `1e+20`).
fn write_number(out: &mut String, v: &Value) {
    if v.is_integer() {
        let _ = write!(out, "{v}");
        return;
    }
    let f = f64::try_from(v.clone()).unwrap_or(f64::NAN);
    if !f.is_finite() {
        out.push_str(if f.is_nan() {
            "NaN"
        } else if f > 0.0 {
            "Infinity"
        } else {
            "-Infinity"
        });
    } else if f != 0.0 && !(1e-4..1e16).contains(&f.abs()) {
        // Python switches to exponent form outside [1e-4, 1e16): 1e+20, 1.5e-05.
        let s = format!("{f:e}");
        let (mantissa, exp) = s.split_once('e').unwrap_or((&s, "0"));
        let exp: i32 = exp.parse().unwrap_or(0);
        let _ = write!(
            out,
            "{mantissa}e{}{:02}",
            if exp < 0 { '-' } else { '+' },
            exp.abs()
        );
    } else if f.fract() == 0.0 {
        let _ = write!(out, "{f:.1}");
    } else {
        let _ = write!(out, "{f}");
    }
}

/// A JSON string as `json.dumps(..., ensure_ascii=False)` writes it.
fn write_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests;
