//! Corpora that need not fit in memory: token files on disk, read window by window by offset.
//!
//! A language model's dataset is a flat array of tokens, in one file or several (shards): the
//! pre-tokenized `.bin` files nanoGPT's `prepare.py` writes (uint16 or uint32, little-endian,
//! no header), or the cache a text corpus is tokenized into once (a folder of `.txt` files,
//! JSON Lines with a text field, plain or gzipped, or one text file; an end-of-text token
//! between documents). Sample i of a shard is the window of `seq + 1` tokens at `i · seq`: it
//! feeds `seq` tokens and predicts the next one at each place, every token a target once. No
//! window crosses from one shard into the next.
//!
//! Reading is `pread` of one window at a time: a process holds the windows of the batch it
//! computes, never the corpus (a 2 GB shard trains in a few MiB of it).

use std::io::{BufRead, BufWriter, Write};
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use sha2::{Digest, Sha256};

use crate::load_error::DataError;

/// How tokens are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenType {
    /// uint16 (nanoGPT's, for vocabularies up to 65,536).
    U16,
    /// uint32.
    U32,
}

impl TokenType {
    /// Bytes per token.
    pub fn bytes(self) -> usize {
        match self {
            TokenType::U16 => 2,
            TokenType::U32 => 4,
        }
    }

    /// The type a `dataset_dtype` names.
    pub fn parse(name: &str) -> Option<TokenType> {
        match name {
            "uint16" | "u16" => Some(TokenType::U16),
            "uint32" | "u32" => Some(TokenType::U32),
            _ => None,
        }
    }
}

fn err(origin: &Path, message: impl Into<String>) -> DataError {
    DataError {
        origin: origin.display().to_string(),
        message: message.into(),
    }
}

/// Token files, opened: each file's tokens and where its windows start among all.
#[derive(Debug)]
pub struct TokenFiles {
    files: Vec<(PathBuf, std::fs::File, u64)>,
    dtype: TokenType,
    seq: usize,
    /// Windows before each file (and all of them, last).
    starts: Vec<usize>,
}

impl TokenFiles {
    /// Open `paths` (shards in order) of `dtype` tokens, as windows of `seq + 1`.
    pub fn open(paths: &[PathBuf], dtype: TokenType, seq: usize) -> Result<TokenFiles, DataError> {
        let mut files = Vec::new();
        let mut starts = vec![0];
        for p in paths {
            let f = std::fs::File::open(p).map_err(|e| err(p, format!("cannot open: {e}")))?;
            let bytes = f.metadata().map_err(|e| err(p, e.to_string()))?.len();
            if bytes % dtype.bytes() as u64 != 0 {
                return Err(err(
                    p,
                    format!(
                        "{bytes} bytes are not whole {}-byte tokens (is `dataset_dtype` right?)",
                        dtype.bytes()
                    ),
                ));
            }
            let tokens = bytes / dtype.bytes() as u64;
            let windows = (tokens.saturating_sub(1) / seq.max(1) as u64) as usize;
            starts.push(starts.last().copied().unwrap_or(0) + windows);
            files.push((p.clone(), f, tokens));
        }
        Ok(TokenFiles {
            files,
            dtype,
            seq,
            starts,
        })
    }

    /// Windows in all.
    pub fn windows(&self) -> usize {
        self.starts.last().copied().unwrap_or(0)
    }

    /// Window `i` (of all) appended to `out` as f32 token ids.
    fn read(&self, i: usize, out: &mut Vec<f32>) -> Result<(), DataError> {
        let k = self.starts.partition_point(|&s| s <= i).saturating_sub(1);
        let (path, f, _) = &self.files[k];
        let local = (i - self.starts[k]) as u64;
        let b = self.dtype.bytes();
        let mut bytes = vec![0u8; (self.seq + 1) * b];
        f.read_exact_at(&mut bytes, local * self.seq as u64 * b as u64)
            .map_err(|e| err(path, format!("window {i}: {e}")))?;
        match self.dtype {
            TokenType::U16 => out.extend(
                bytes
                    .chunks_exact(2)
                    .map(|c| f32::from(u16::from_le_bytes([c[0], c[1]]))),
            ),
            TokenType::U32 => out.extend(
                bytes
                    .chunks_exact(4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f32),
            ),
        }
        Ok(())
    }

    /// The largest token id of the first `n` windows (a check of the vocabulary).
    fn largest_in(&self, n: usize) -> Result<u32, DataError> {
        let mut buf = Vec::new();
        let mut top = 0u32;
        for i in 0..n.min(self.windows()) {
            buf.clear();
            self.read(i, &mut buf)?;
            top = buf.iter().fold(top, |m, &t| m.max(t as u32));
        }
        Ok(top)
    }
}

/// Some of the windows of token files (a split of them).
#[derive(Debug, Clone)]
pub struct Windows {
    files: Arc<TokenFiles>,
    range: Range<usize>,
}

impl PartialEq for Windows {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.files, &other.files) && self.range == other.range
    }
}

impl Windows {
    /// Every window of `files`, each token below `vocab` (the first windows are checked).
    pub fn all(files: TokenFiles, vocab: usize) -> Result<Windows, DataError> {
        let top = files.largest_in(64)?;
        if top as usize >= vocab {
            let p = files.files.first().map_or(PathBuf::new(), |f| f.0.clone());
            return Err(err(
                &p,
                format!("token {top} is outside the model's vocabulary of {vocab}"),
            ));
        }
        let n = files.windows();
        Ok(Windows {
            files: Arc::new(files),
            range: 0..n,
        })
    }

    /// Windows.
    pub fn len(&self) -> usize {
        self.range.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.range.is_empty()
    }

    /// Values per window (`seq + 1`).
    pub fn width(&self) -> usize {
        self.files.seq + 1
    }

    /// Window `i` of these appended to `out`.
    pub fn read(&self, i: usize, out: &mut Vec<f32>) -> Result<(), DataError> {
        self.files.read(self.range.start + i, out)
    }

    /// These windows cut at `at`: (the first `at`, the rest).
    pub fn split_at(&self, at: usize) -> (Windows, Windows) {
        let mid = self.range.start + at.min(self.len());
        (
            Windows {
                files: self.files.clone(),
                range: self.range.start..mid,
            },
            Windows {
                files: self.files.clone(),
                range: mid..self.range.end,
            },
        )
    }
}

/// How a text corpus becomes tokens.
pub struct Encoder<'a> {
    /// A document's tokens.
    pub encode: &'a dyn Fn(&str) -> Result<Vec<u32>, String>,
    /// The end-of-text token put after every document.
    pub eot: Option<u32>,
    /// Names the tokenizer in the cache's key.
    pub key: &'a str,
    /// How the cache stores tokens: uint16 where the vocabulary fits (half the disk).
    pub dtype: TokenType,
}

impl std::fmt::Debug for Encoder<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Encoder").field("key", &self.key).finish()
    }
}

/// The text files of a folder, recursively, in sorted order (`.txt`, `.md`, and their `.gz`).
fn text_files(dir: &Path) -> Result<Vec<PathBuf>, DataError> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let entries = std::fs::read_dir(&d).map_err(|e| err(&d, e.to_string()))?;
        for e in entries {
            let p = e.map_err(|e| err(&d, e.to_string()))?.path();
            if p.is_dir() {
                stack.push(p);
            } else if is_text(&p) {
                out.push(p);
            }
        }
    }
    out.sort();
    if out.is_empty() {
        return Err(err(
            dir,
            "holds no .txt files (a text corpus folder is read recursively)",
        ));
    }
    Ok(out)
}

fn is_text(p: &Path) -> bool {
    let name = p
        .file_name()
        .map(|n| n.to_string_lossy().to_lowercase())
        .unwrap_or_default();
    [".txt", ".md", ".txt.gz", ".md.gz"]
        .iter()
        .any(|e| name.ends_with(e))
}

fn is_jsonl(p: &Path) -> bool {
    let name = p.to_string_lossy().to_lowercase();
    name.ends_with(".jsonl") || name.ends_with(".jsonl.gz") || name.ends_with(".ndjson")
}

/// A reader of `p`, decompressed when its name ends in `.gz`.
fn reader(p: &Path) -> Result<Box<dyn BufRead>, DataError> {
    let f = std::fs::File::open(p).map_err(|e| err(p, format!("cannot read the dataset: {e}")))?;
    Ok(if p.extension().is_some_and(|e| e == "gz") {
        Box::new(std::io::BufReader::new(flate2::read::GzDecoder::new(f)))
    } else {
        Box::new(std::io::BufReader::new(f))
    })
}

/// Each document of the corpus at `path` handed to `f` in order: every line's `field` of a
/// JSON Lines file, each text file of a folder, or one text file whole.
fn documents(
    path: &Path,
    field: &str,
    f: &mut dyn FnMut(&str) -> Result<(), DataError>,
) -> Result<(), DataError> {
    if path.is_dir() {
        for p in text_files(path)? {
            let mut text = String::new();
            std::io::Read::read_to_string(&mut reader(&p)?, &mut text)
                .map_err(|e| err(&p, format!("not UTF-8 text: {e}")))?;
            f(&text)?;
        }
        return Ok(());
    }
    if is_jsonl(path) {
        for (k, line) in reader(path)?.lines().enumerate() {
            let line = line.map_err(|e| err(path, format!("line {}: {e}", k + 1)))?;
            if line.trim().is_empty() {
                continue;
            }
            let v: serde_json::Value = serde_json::from_str(&line)
                .map_err(|e| err(path, format!("line {}: not JSON: {e}", k + 1)))?;
            let text = v.get(field).and_then(|t| t.as_str()).ok_or_else(|| {
                err(
                    path,
                    format!(
                        "line {}: no string field `{field}` (set [run] dataset_field)",
                        k + 1
                    ),
                )
            })?;
            f(text)?;
        }
        return Ok(());
    }
    let mut text = String::new();
    std::io::Read::read_to_string(&mut reader(path)?, &mut text)
        .map_err(|e| err(path, format!("not UTF-8 text: {e}")))?;
    f(&text)
}

/// What names a corpus's files as they are now: their paths, sizes and modification times
/// (not their bytes: a corpus larger than memory is not read twice to be named).
fn corpus_key(path: &Path, field: &str) -> Result<String, DataError> {
    let files = if path.is_dir() {
        text_files(path)?
    } else {
        vec![path.to_path_buf()]
    };
    let mut h = Sha256::new();
    h.update(field.as_bytes());
    for p in files {
        let m = std::fs::metadata(&p).map_err(|e| err(&p, format!("cannot read: {e}")))?;
        let modified = m
            .modified()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos());
        h.update(p.to_string_lossy().as_bytes());
        h.update(m.len().to_le_bytes());
        h.update(modified.to_le_bytes());
    }
    Ok(h.finalize()
        .iter()
        .take(8)
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// The token file of the corpus at `path` through `enc`, tokenized once into `cache` (in `enc.dtype`,
/// streamed: one document in memory at a time) and reused by every later run and every node
/// process of the machine (one tokenizes under a lock file, the others wait for it).
pub fn tokenized(
    path: &Path,
    field: &str,
    enc: &Encoder<'_>,
    cache: &Path,
) -> Result<PathBuf, DataError> {
    let stem = path
        .file_name()
        .map_or("corpus".into(), |n| n.to_string_lossy().into_owned());
    let ext = match enc.dtype {
        TokenType::U16 => "u16",
        TokenType::U32 => "u32",
    };
    let file = cache.join(format!(
        "{stem}.{}.{}.{ext}",
        enc.key,
        corpus_key(path, field)?
    ));
    if file.is_file() {
        return Ok(file);
    }
    std::fs::create_dir_all(cache).map_err(|e| err(cache, format!("cannot create: {e}")))?;
    let lock = file.with_extension("lock");
    match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&lock)
    {
        Ok(_) => {}
        Err(_) => {
            // Another process tokenizes: wait for its file (its lock goes when it is done).
            while lock.exists() && !file.is_file() {
                std::thread::sleep(std::time::Duration::from_millis(200));
            }
            if file.is_file() {
                return Ok(file);
            }
            return tokenized(path, field, enc, cache);
        }
    }
    let result = write_tokens(path, field, enc, &file);
    let _ = std::fs::remove_file(&lock);
    result.map(|()| file)
}

fn write_tokens(path: &Path, field: &str, enc: &Encoder<'_>, file: &Path) -> Result<(), DataError> {
    let tmp = file.with_extension(format!("tmp{}", std::process::id()));
    let out = std::fs::File::create(&tmp).map_err(|e| err(&tmp, e.to_string()))?;
    let mut w = BufWriter::new(out);
    let io = |e: std::io::Error| err(file, format!("cannot write the tokens: {e}"));
    documents(path, field, &mut |text| {
        let ids = (enc.encode)(text).map_err(|e| err(path, e))?;
        for &t in ids.iter().chain(enc.eot.iter()) {
            match enc.dtype {
                TokenType::U16 => {
                    let t = u16::try_from(t).map_err(|_| {
                        err(path, format!("token {t} does not fit the uint16 cache"))
                    })?;
                    w.write_all(&t.to_le_bytes()).map_err(io)?
                }
                TokenType::U32 => w.write_all(&t.to_le_bytes()).map_err(io)?,
            }
        }
        Ok(())
    })?;
    w.flush().map_err(io)?;
    drop(w);
    std::fs::rename(&tmp, file).map_err(io)
}

/// The `.bin` shards `path` names: the file, or a folder's `.bin` files in sorted order.
pub fn shards(path: &Path) -> Result<Vec<PathBuf>, DataError> {
    if !path.is_dir() {
        return Ok(vec![path.to_path_buf()]);
    }
    let mut out: Vec<PathBuf> = std::fs::read_dir(path)
        .map_err(|e| err(path, e.to_string()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "bin"))
        .collect();
    out.sort();
    if out.is_empty() {
        return Err(err(path, "holds no .bin token shards"));
    }
    Ok(out)
}

/// Whether `path` is a corpus of pre-tokenized `.bin` shards.
pub fn is_token_shards(path: &Path) -> bool {
    if path.is_dir() {
        return std::fs::read_dir(path).is_ok_and(|mut d| {
            d.any(|e| e.is_ok_and(|e| e.path().extension().is_some_and(|x| x == "bin")))
        });
    }
    path.extension().is_some_and(|e| e == "bin")
}

/// Whether `path` is a corpus of documents (a folder of text files, or JSON Lines), as
/// opposed to one text file.
pub fn is_documents(path: &Path) -> bool {
    path.is_dir() || is_jsonl(path)
}
