//! A transformer's descriptions on disk: Hugging Face's `config.json` and the `model` metadata
//! ravnest's checkpoints carry; the byte tokens of ravnest's own GPTs as text; how a
//! generation picks its tokens.

use rand::Rng;
use rand_chacha::ChaCha8Rng;
use ravnest_core::decoder::Decoder;

use super::{Gpt, Sampling};

/// Tokens as text: each below 256 is a byte, the bytes decoded as UTF-8 with invalid sequences
/// (and tokens past the bytes) as U+FFFD.
pub fn decode_bytes(tokens: &[u32]) -> String {
    let mut bytes = Vec::with_capacity(tokens.len());
    for &t in tokens {
        match u8::try_from(t) {
            Ok(b) => bytes.push(b),
            Err(_) => bytes.extend("\u{fffd}".as_bytes()),
        }
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

/// A token from `logits` as `s` says: the most likely one at temperature 0, else drawn from
/// the softmax at that temperature over the `top_k` most likely (all with 0).
pub(super) fn sample(logits: &[f32], s: Sampling, rng: &mut ChaCha8Rng) -> u32 {
    let best = logits
        .iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map_or(0, |(i, _)| i);
    if s.temperature <= 0.0 {
        return best as u32;
    }
    let mut order: Vec<usize> = (0..logits.len()).collect();
    if s.top_k > 0 && s.top_k < logits.len() {
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        order.truncate(s.top_k);
    }
    let max = logits[best];
    let w: Vec<f64> = order
        .iter()
        .map(|&i| (f64::from(logits[i] - max) / s.temperature).exp())
        .collect();
    let mut r = rng.random_range(0.0..w.iter().sum::<f64>());
    for (&i, x) in order.iter().zip(&w) {
        if r < *x {
            return i as u32;
        }
        r -= x;
    }
    best as u32
}

/// Hugging Face's `config.json` for `g` as ravnest writes it (its LM head untied).
pub fn hf_config(g: &Gpt) -> serde_json::Value {
    g.0.hf_config()
}

/// The [`Gpt`] a Hugging Face `config.json` describes (a sample as long as its context, at
/// most 1024 tokens), if it is one ravnest trains. Says what does not fit otherwise.
pub fn from_hf_config(c: &serde_json::Value) -> Result<Gpt, String> {
    Decoder::from_hf_config(c, None).map(Gpt::of)
}

/// The `model` metadata of a checkpoint of `g`: its sizes, and the whole Hugging Face config
/// (a Llama's rotary settings and biases are in it).
pub fn model_json(g: &Gpt) -> serde_json::Value {
    serde_json::json!({
        "kind": "gpt", "layers": g.layers, "hidden": g.hidden, "heads": g.heads,
        "seq": g.seq, "vocab": g.vocab, "config": g.0.hf_config(),
    })
}

/// The [`Gpt`] of a checkpoint's `model` metadata ([`model_json`]; one without `config`, of
/// an earlier ravnest, is a byte-level GPT-2).
pub fn from_model_json(m: &serde_json::Value) -> Result<Gpt, String> {
    match m.get("kind").and_then(|k| k.as_str()) {
        Some("gpt") => {}
        Some(k) => {
            return Err(format!(
                "is the checkpoint of a `{k}` network, not of a GPT (a run with `[run] network = \"gpt\"` writes one)"
            ));
        }
        None => return Err("its model metadata names no `kind`".into()),
    }
    let size = |k: &str| -> Result<usize, String> {
        m.get(k)
            .and_then(|v| v.as_u64())
            .map(|n| n as usize)
            .ok_or_else(|| format!("its GPT metadata has no `{k}`"))
    };
    let g = match m.get("config") {
        Some(c) => Gpt(
            Decoder::from_hf_config(c, Some(size("seq")?))?,
            super::Numerics::Fp32,
        ),
        None => Gpt::gpt2(
            size("layers")?,
            size("hidden")?,
            size("heads")?,
            size("seq")?,
            size("vocab")?,
        ),
    };
    g.check()?;
    Ok(g)
}
