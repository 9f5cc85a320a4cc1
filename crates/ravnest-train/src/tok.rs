//! A model folder's tokenizer (`tokenizer.json`, through Hugging Face's `tokenizers` crate):
//! text to token ids and back, the end-of-text token packed between documents, and a hash of
//! the tokenizer that keys the token caches.

use std::path::Path;

use sha2::{Digest, Sha256};

use crate::load_error::LoadError;

/// A folder's tokenizer.
pub struct Tok {
    inner: tokenizers::Tokenizer,
    /// The end-of-text token: the config's `eos_token_id`, else the tokenizer's `<|endoftext|>`,
    /// `</s>` or `<|end_of_text|>`.
    pub eos: Option<u32>,
    /// The first 16 hex digits of the SHA-256 of `tokenizer.json`.
    pub hash: String,
}

impl std::fmt::Debug for Tok {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tok")
            .field("eos", &self.eos)
            .field("hash", &self.hash)
            .field("vocab", &self.inner.get_vocab_size(true))
            .finish()
    }
}

impl Tok {
    /// The tokenizer of the model folder `dir`.
    pub fn open(dir: &Path) -> Result<Tok, LoadError> {
        let path = dir.join("tokenizer.json");
        let err = |m: String| LoadError {
            path: path.display().to_string(),
            message: m,
        };
        let bytes = std::fs::read(&path).map_err(|e| {
            err(if e.kind() == std::io::ErrorKind::NotFound {
                "no such file: the model folder needs its tokenizer.json (a folder `save_pretrained` wrote for both the model and its tokenizer has one)".into()
            } else {
                e.to_string()
            })
        })?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes)
            .map_err(|e| err(format!("not a tokenizer `tokenizers` reads: {e}")))?;
        let digest = Sha256::digest(&bytes);
        let hash: String = digest.iter().take(8).map(|b| format!("{b:02x}")).collect();
        let config_eos = std::fs::read_to_string(dir.join("config.json"))
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .and_then(|c| match c.get("eos_token_id") {
                Some(serde_json::Value::Array(a)) => a.first().and_then(|v| v.as_u64()),
                Some(v) => v.as_u64(),
                None => None,
            })
            .map(|v| v as u32);
        let named = ["<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>"]
            .iter()
            .find_map(|t| inner.token_to_id(t));
        Ok(Tok {
            inner,
            eos: config_eos.or(named),
            hash,
        })
    }

    /// The ids of `text` as one document, no special tokens added.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        self.inner
            .encode(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| e.to_string())
    }

    /// The text of `ids` (special tokens kept).
    pub fn decode(&self, ids: &[u32]) -> Result<String, String> {
        self.inner.decode(ids, false).map_err(|e| e.to_string())
    }

    /// Tokens in the vocabulary, added ones included.
    pub fn vocab(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}
