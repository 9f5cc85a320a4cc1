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
    let data = load(s, origin, &s.run.dataset, cache).map_err(|e| named(e, origin, "dataset"))?;
    if let Some(e) = &s.run.eval_dataset {
        let eval = load(s, origin, e, cache).map_err(|e| named(e, origin, "eval_dataset"))?;
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

/// A dataset that cannot be read, said with the cluster file's line that names it (a relative
/// path there is read from the file's folder: the message shows the path tried).
fn named(e: RunError, origin: &str, key: &str) -> RunError {
    let RunError::Data(d) = e else { return e };
    let line = std::fs::read_to_string(origin).ok().and_then(|t| {
        t.lines().position(|l| {
            l.trim_start()
                .strip_prefix(key)
                .is_some_and(|r| r.trim_start().starts_with('='))
        })
    });
    let at = line.map_or_else(|| origin.to_string(), |n| format!("{origin}:{}", n + 1));
    RunError::Config(format!(
        "{at}: [run] {key}: {d} (a relative path is read from the cluster file's folder)"
    ))
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

/// What a run of `s` would train on, in words (for `run --dry-run`), without reading a corpus
/// through (a language model's is checked to exist and named by kind; small datasets are
/// loaded): the data, the tokenizer, and the held-out part; or why the run could not read it.
pub fn describe_data(s: &Scenario, origin: &str) -> Result<String, RunError> {
    let transformer = s.run.model_from.is_some() || s.run.network == "gpt";
    let held_out = match (&s.run.eval_dataset, s.run.eval_fraction) {
        (Some(e), _) => format!("held out: `{e}`"),
        (None, Some(f)) => format!("held out: its last {:.1}%", 100.0 * f),
        (None, None) => "held out: its last sixth".into(),
    };
    if !transformer {
        let d = load_dataset(s, origin, None).map_err(|e| named(e, origin, "dataset"))?;
        return Ok(format!(
            "data: `{}`: {} samples of {} values; {held_out}",
            s.run.dataset,
            d.len(),
            d.features
        ));
    }
    let path = Path::new(&s.run.dataset);
    if s.run.dataset == "digits" {
        return Err(RunError::Config(format!(
            "{origin}: a language model trains on text: set [run] dataset to a text file, a folder of .txt files, a .jsonl corpus or .bin token shards"
        )));
    }
    if !path.exists() {
        return Err(named(
            RunError::Data(ravnest_train::data::DataError {
                origin: s.run.dataset.clone(),
                message: "no such file or folder".into(),
            }),
            origin,
            "dataset",
        ));
    }
    let kind = if ravnest_train::corpus::is_token_shards(path) {
        format!(
            "pre-tokenized .bin shards ({})",
            s.run
                .dataset_dtype
                .as_deref()
                .unwrap_or("dataset_dtype missing: the run refuses them")
        )
    } else if path.is_dir() {
        "a folder of text files, each a document".into()
    } else if ravnest_train::corpus::is_documents(path) {
        format!("JSON Lines, field `{}`", s.run.dataset_field)
    } else {
        "one text file".into()
    };
    let tokenizer = match &s.run.model_from {
        Some(m) => {
            ravnest_train::tok::Tok::open(Path::new(&m.dir))?;
            format!("the folder's tokenizer ({}/tokenizer.json)", m.dir)
        }
        None => "bytes (a byte-level GPT)".into(),
    };
    Ok(format!(
        "data: `{}`: {kind}, tokenized by {tokenizer} once into the output folder's cache/; {held_out}",
        s.run.dataset
    ))
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
