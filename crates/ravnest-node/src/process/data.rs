//! What a node trains on: the scenario's dataset (a corpus read window by window from disk, a
//! text file, digits, CSV or IDX) and its held-out part.

use std::path::Path;

use ravnest_core::Scenario;
use ravnest_train::corpus::{Encoder, TokenFiles, TokenType, Windows};
use ravnest_train::data::Dataset;

use super::options::RunError;

/// The training and the held-out data: `eval_dataset`, or the end of `dataset`
/// (`eval_fraction`, by default a sixth). A text corpus's tokens are cached in `cache`.
pub fn train_and_test(
    s: &Scenario,
    origin: &str,
    cache: &Path,
) -> Result<(Dataset, Dataset), RunError> {
    let data = load(s, origin, &s.run.dataset, cache)?;
    if let Some(e) = &s.run.eval_dataset {
        let eval = load(s, origin, e, cache)?;
        if eval.features != data.features {
            return Err(RunError::Config(format!(
                "{origin}: eval_dataset `{e}` has samples of {} values, dataset `{}` of {}",
                eval.features, s.run.dataset, data.features
            )));
        }
        return Ok((data, eval));
    }
    Ok(match s.run.eval_fraction {
        Some(f) => data.split_fraction(f),
        None => data.split(),
    })
}

/// The dataset a scenario names, whole (see [`train_and_test`]; `cache`: where a text
/// corpus's tokens go, else the system's temporary folder).
pub fn load_dataset(s: &Scenario, origin: &str, cache: Option<&Path>) -> Result<Dataset, RunError> {
    let tmp = std::env::temp_dir().join("ravnest-cache");
    load(s, origin, &s.run.dataset, cache.unwrap_or(&tmp))
}

/// The samples of the dataset at `spec` for the scenario's network.
fn load(s: &Scenario, origin: &str, spec: &str, cache: &Path) -> Result<Dataset, RunError> {
    let transformer = s.run.model_from.is_some() || s.run.network == "gpt";
    if transformer && spec == "digits" {
        return Err(RunError::Config(format!(
            "{origin}: a language model trains on text: set [run] dataset to a text file, a folder of .txt files, a .jsonl corpus or .bin token shards"
        )));
    }
    if !transformer {
        if s.run.network == "char" {
            if spec == "digits" {
                return Err(RunError::Config(format!(
                    "{origin}: [run] network = \"char\" trains on text: set [run] dataset to a text file's path"
                )));
            }
            return Ok(Dataset::load_text(spec, s.run.context_chars as usize)?);
        }
        return Ok(Dataset::load(spec)?);
    }
    let path = Path::new(spec);
    let (seq, vocab) = match &s.run.model_from {
        Some(m) => (m.decoder.seq, m.decoder.vocab),
        None => {
            let (.., seq, vocab) = gpt_of(s, origin)?;
            (seq as usize, vocab as usize)
        }
    };
    if ravnest_train::corpus::is_token_shards(path) {
        let dtype = s.run.dataset_dtype.as_deref().ok_or_else(|| {
            RunError::Config(format!(
                "{origin}: `{spec}` holds pre-tokenized .bin tokens: name their type with [run] dataset_dtype = \"uint16\" (nanoGPT's) or \"uint32\""
            ))
        })?;
        let dtype = TokenType::parse(dtype).expect("checked by the file's parse");
        let files = TokenFiles::open(&ravnest_train::corpus::shards(path)?, dtype, seq)?;
        return windows(spec, files, vocab);
    }
    let dtype = if vocab <= 1 << 16 {
        TokenType::U16
    } else {
        TokenType::U32
    };
    match &s.run.model_from {
        Some(m) => {
            let tok = ravnest_train::tok::Tok::open(Path::new(&m.dir))?;
            let encode = |t: &str| tok.encode(t);
            let key = format!("tok-{}", tok.hash);
            let enc = Encoder {
                encode: &encode,
                eot: tok.eos,
                key: &key,
                dtype,
            };
            let file = ravnest_train::corpus::tokenized(path, &s.run.dataset_field, &enc, cache)?;
            windows(spec, TokenFiles::open(&[file], dtype, seq)?, vocab)
        }
        None if ravnest_train::corpus::is_documents(path) => {
            // A byte-level GPT: each document's bytes, a newline between documents (the end of
            // text its config names).
            let encode = |t: &str| Ok(t.bytes().map(u32::from).collect());
            let enc = Encoder {
                encode: &encode,
                eot: Some(u32::from(b'\n')),
                key: "bytes",
                dtype,
            };
            let file = ravnest_train::corpus::tokenized(path, &s.run.dataset_field, &enc, cache)?;
            windows(spec, TokenFiles::open(&[file], dtype, seq)?, vocab)
        }
        None => Ok(Dataset::load_bytes(spec, seq)?),
    }
}

/// A corpus's windows as a dataset, or why it is too small.
fn windows(spec: &str, files: TokenFiles, vocab: usize) -> Result<Dataset, RunError> {
    let w = Windows::all(files, vocab)?;
    if w.len() < 12 {
        return Err(RunError::Config(format!(
            "{spec}: {} samples of {} tokens: too few to train and hold some out (at least 12)",
            w.len(),
            w.width()
        )));
    }
    Ok(Dataset::of_windows(spec, w, vocab))
}

/// The GPT's sizes from the scenario's `[model]`: (layers, hidden, heads, seq, vocab).
pub(super) fn gpt_of(s: &Scenario, origin: &str) -> Result<(u32, u64, u64, u64, u64), RunError> {
    let shape = ravnest_core::model::gpt_shape(&s.model).ok_or_else(|| {
        RunError::Config(format!(
            "{origin}: [run] network = \"gpt\" trains a GPT: [model] preset = \"gpt-tiny\" / \"gpt-small\" / \"gpt2-small\", or kind = \"gpt\" without flash attention; model `{}` is not one",
            s.model.name
        ))
    })?;
    if shape.4 < 256 {
        return Err(RunError::Config(format!(
            "{origin}: the GPT reads bytes: its vocabulary needs at least 256 tokens, [model] has {}",
            shape.4
        )));
    }
    Ok(shape)
}
