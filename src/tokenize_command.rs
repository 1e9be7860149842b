//! `inferencecache tokenize`: an OpenAI request body → the token ids body mode
//! routes on, with the same code as the sidecar (template, tokenizer, special
//! tokens). Prints JSON: `{"ids": [...], "text": "..."}` (`text` is the rendered
//! chat prompt, or the completions text).

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, bail};

use crate::adapters::body::request::{self, Endpoint, Prompt};
use crate::adapters::body::tokenizer::ModelTokenizer;

/// `inferencecache tokenize` flags.
#[derive(Clone, Debug, clap::Args)]
pub struct TokenizeArgs {
    /// Directory with tokenizer.json (and optionally tokenizer_config.json or
    /// chat_template.jinja), as in CacheBackend spec.tokenizer.path.
    #[arg(long, value_name = "DIR")]
    pub tokenizer: PathBuf,
    /// The request body (JSON); `-` reads stdin.
    #[arg(long, value_name = "FILE")]
    pub body: PathBuf,
    /// The request path: /v1/completions or /v1/chat/completions.
    #[arg(long, value_name = "PATH", default_value = "/v1/chat/completions")]
    pub path: String,
}

pub fn run(args: &TokenizeArgs, mut output: impl Write) -> anyhow::Result<()> {
    let Some(endpoint) = Endpoint::from_path(&args.path) else {
        bail!(
            "--path {:?} is not /v1/completions or /v1/chat/completions",
            args.path
        );
    };
    let body = if args.body.as_os_str() == "-" {
        let mut b = Vec::new();
        std::io::Read::read_to_end(&mut std::io::stdin().lock(), &mut b)
            .context("reading stdin")?;
        b
    } else {
        std::fs::read(&args.body).with_context(|| format!("reading {}", args.body.display()))?
    };
    let tokenizer = ModelTokenizer::load(&args.tokenizer).map_err(anyhow::Error::msg)?;
    let req = request::parse(endpoint, &body)?;
    let text = match &req.prompt {
        Prompt::Chat(chat) => Some(tokenizer.render_chat(chat)?),
        Prompt::Text { text, .. } => Some(text.clone()),
        Prompt::Tokens(_) => None,
    };
    let ids = tokenizer.prompt_ids(&req.prompt)?;
    serde_json::to_writer(&mut output, &serde_json::json!({"ids": ids, "text": text}))?;
    writeln!(output)?;
    Ok(())
}
