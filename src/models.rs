//! `ravnest eval` and `ravnest generate`: a transformer from a Hugging Face folder or a
//! ravnest checkpoint (which is one), with the folder's tokenizer where it has one (ravnest's
//! own byte-level GPTs read bytes).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use ravnest_train::gpt::{Gpt, Sampling};
use ravnest_train::tok::Tok;

use crate::emit;

/// `ravnest eval`'s arguments.
#[derive(clap::Args, Debug)]
pub struct EvalCmd {
    /// A Hugging Face model folder, or a ravnest checkpoints folder.
    #[arg(value_name = "DIR")]
    pub dir: PathBuf,
    /// The text to evaluate on (UTF-8; `.gz` is decompressed), tokenized as one document with
    /// no special tokens added.
    #[arg(long, value_name = "FILE")]
    pub data: PathBuf,
    /// Tokens a window feeds (default: the model's context, at most 1024).
    #[arg(long, value_name = "N")]
    pub seq: Option<usize>,
    /// Print `{"loss": ..., "tokens": ...}` instead of a sentence.
    #[arg(long)]
    pub json: bool,
}

/// `ravnest generate`'s arguments.
#[derive(clap::Args, Debug)]
pub struct GenerateCmd {
    /// A transformer's folder: a Hugging Face model folder, a ravnest checkpoints folder, or
    /// one of ravnest's weights files (`step-N.safetensors`).
    #[arg(value_name = "CHECKPOINT")]
    pub checkpoint: PathBuf,
    /// The text to continue.
    #[arg(long)]
    pub prompt: String,
    /// Tokens to sample after the prompt.
    #[arg(long, default_value_t = 200)]
    pub tokens: usize,
    /// Sampling temperature: lower is more predictable, 0 always takes the likeliest token.
    #[arg(long, default_value_t = 0.8, allow_negative_numbers = true)]
    pub temperature: f64,
    /// Sample among the K likeliest tokens only (0: all).
    #[arg(long, value_name = "K", default_value_t = 0)]
    pub top_k: usize,
    /// Seed of the sampling (default: from the clock); the same seed gives the same text.
    #[arg(long)]
    pub seed: Option<u64>,
}

/// The model in `path` and its weights, samples of `seq` tokens (default: its context, at
/// most 1024).
fn load(path: &Path, seq: Option<usize>) -> Result<(Gpt, Vec<f32>)> {
    let is_folder = path.join("config.json").is_file();
    let (g, w) = if is_folder {
        ravnest_train::store::load_folder(path, seq)
    } else {
        ravnest_train::store::load_gpt(path)
    }
    .context("cannot load the model")?;
    Ok(match seq {
        Some(n) if !is_folder => (
            Gpt(ravnest_core::decoder::Decoder { seq: n, ..g.0 }, g.1),
            w,
        ),
        _ => (g, w),
    })
}

/// The folder's tokenizer, where the model has one (`None`: byte tokens).
fn tokenizer(path: &Path) -> Result<Option<Tok>> {
    if path.is_dir() && path.join("tokenizer.json").is_file() {
        return Ok(Some(Tok::open(path)?));
    }
    Ok(None)
}

/// `ravnest eval`: the mean next-token cross-entropy over FILE's windows.
pub fn eval_command(cmd: EvalCmd) -> Result<()> {
    let EvalCmd {
        dir,
        data,
        seq,
        json,
    } = cmd;
    if seq == Some(0) {
        bail!("--seq 0: a window feeds at least one token");
    }
    let (g, weights) = load(&dir, seq)?;
    let text = std::fs::read(&data).with_context(|| format!("cannot read `{}`", data.display()))?;
    let text = if data.extension().is_some_and(|e| e == "gz") {
        let mut out = Vec::new();
        std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&text[..]), &mut out)
            .with_context(|| format!("`{}` is not gzip", data.display()))?;
        out
    } else {
        text
    };
    let ids: Vec<u32> = match tokenizer(&dir)? {
        Some(tok) => {
            let text = String::from_utf8(text)
                .with_context(|| format!("`{}` is not UTF-8 text", data.display()))?;
            tok.encode(&text)
                .map_err(|e| anyhow::anyhow!("{}: {e}", data.display()))?
        }
        None => text.iter().map(|&b| u32::from(b)).collect(),
    };
    let n = g.seq;
    let windows = ids.len().saturating_sub(1) / n;
    if windows == 0 {
        bail!(
            "`{}` is {} tokens: fewer than one window of {} (--seq {n} and the next token)",
            data.display(),
            ids.len(),
            n + 1
        );
    }
    let mut rows = Vec::with_capacity(windows * (n + 1));
    for i in 0..windows {
        rows.extend(ids[i * n..i * n + n + 1].iter().map(|&t| t as f32));
    }
    let dev = ravnest_train::device::current();
    let (loss, _) = g
        .evaluate(&dev, &weights, &rows, 8)
        .with_context(|| format!("cannot evaluate `{}`", dir.display()))?;
    let tokens = windows * n;
    if json {
        emit(&format!(
            "{}\n",
            serde_json::json!({"loss": loss, "tokens": tokens, "windows": windows, "seq": n})
        ));
    } else {
        emit(&format!(
            "{}: {loss:.6} nats per token (perplexity {:.3}) over {tokens} tokens of {} ({windows} windows of {n})\n",
            dir.display(),
            loss.exp(),
            data.display()
        ));
    }
    Ok(())
}

/// `ravnest generate`: load the model, sample, print.
pub fn generate_command(cmd: GenerateCmd) -> Result<()> {
    let GenerateCmd {
        checkpoint,
        prompt,
        tokens,
        temperature,
        top_k,
        seed,
    } = cmd;
    if !(temperature.is_finite() && temperature >= 0.0) {
        bail!("--temperature {temperature}: a temperature is 0 or more");
    }
    let seed = seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    });
    let (gpt, weights) = load(&checkpoint, None)?;
    let sampling = Sampling {
        temperature,
        top_k,
        seed,
    };
    let failed = || format!("cannot generate from `{}`", checkpoint.display());
    let text = match tokenizer(&checkpoint)? {
        Some(tok) => {
            let ids = tok
                .encode(&prompt)
                .map_err(|e| anyhow::anyhow!("the prompt: {e}"))?;
            let dev = ravnest_train::device::current();
            let more = gpt
                .generate_until(&dev, &weights, &ids, tokens, sampling, tok.eos)
                .with_context(failed)?;
            let mut all = ids;
            all.extend(more);
            tok.decode(&all)
                .map_err(|e| anyhow::anyhow!("cannot decode the tokens: {e}"))?
        }
        None => gpt
            .complete_text(&weights, &prompt, tokens, temperature, seed)
            .with_context(failed)?,
    };
    emit(&format!("{text}\n"));
    Ok(())
}
