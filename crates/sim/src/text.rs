//! Workloads as text, for clients that send prompts the way an OpenAI SDK does.
//!
//! The workloads are synthetic token ids (see `workload`). To play them as plain
//! text without changing their shape, each synthetic id becomes one *word*: a
//! vocabulary entry of the model's own tokenizer that decodes to a space and a few
//! lower-case letters and encodes back to exactly that one id. A byte-level BPE
//! pre-tokenizer splits text before every space, so a run of such words tokenizes
//! to one id per word: a prompt keeps its length, and two prompts sharing their
//! first n synthetic ids share their first n real ids. Hit rates and costs stay
//! comparable with the token-id runs; a run with and one without chain headers see
//! identical text.

use std::path::Path;

use anyhow::{Context, bail};
use inferencecache::adapters::body::request::Prompt;
use inferencecache::adapters::body::tokenizer::ModelTokenizer;

/// Fewer single-token words than this and prompts would repeat words so often
/// that the text stops looking like the workload.
const MIN_WORDS: usize = 1000;

/// A model's tokenizer and the words that stand for synthetic token ids.
pub struct TextRendering {
    tokenizer: ModelTokenizer,
    words: Vec<String>,
}

impl TextRendering {
    /// Loads the tokenizer files of `dir` (as CacheBackend `spec.tokenizer.path`)
    /// and picks its single-token words.
    pub fn load(dir: &Path) -> anyhow::Result<Self> {
        let tokenizer =
            ModelTokenizer::load(dir).map_err(|e| anyhow::anyhow!("--tokenizer: {e}"))?;
        let json = dir.join("tokenizer.json");
        let raw = tokenizers::Tokenizer::from_file(&json)
            .map_err(|e| anyhow::anyhow!("{}: {e}", json.display()))?;
        let mut words = Vec::new();
        for id in 0..raw.get_vocab_size(false) as u32 {
            let Ok(word) = raw.decode(&[id], false) else {
                continue;
            };
            let Some(letters) = word.strip_prefix(' ') else {
                continue;
            };
            if !(3..=10).contains(&letters.len())
                || !letters.bytes().all(|b| b.is_ascii_lowercase())
            {
                continue;
            }
            if matches!(raw.encode_fast(word.as_str(), false), Ok(e) if e.get_ids() == [id]) {
                words.push(word);
            }
        }
        if words.len() < MIN_WORDS {
            bail!(
                "{}: only {} vocabulary entries are a space and lower-case letters that encode \
                 back to one token (need {MIN_WORDS}); text workloads need a byte-level BPE \
                 tokenizer such as Llama 3's or Qwen's",
                json.display(),
                words.len()
            );
        }
        Ok(Self { tokenizer, words })
    }

    /// The text standing for `synthetic` token ids.
    pub fn text(&self, synthetic: &[u32]) -> String {
        let mut out = String::with_capacity(synthetic.len() * 8);
        for &t in synthetic {
            out.push_str(&self.words[t as usize % self.words.len()]);
        }
        out
    }

    /// The ids the engine prefills for `text` sent as a completions prompt (the
    /// product's own body-mode tokenization, which equals Hugging Face's).
    pub fn prompt_ids(&self, text: &str) -> anyhow::Result<Vec<u32>> {
        self.tokenizer
            .prompt_ids(&Prompt::Text {
                text: text.to_string(),
                add_special_tokens: true,
            })
            .context("tokenizing a workload prompt")
    }

    pub fn words(&self) -> usize {
        self.words.len()
    }
}
