//! Text through a model's tokenizer, once: the token ids of a text file are cached in the
//! run's output folder (`cache/<file>.<tokenizer hash>.<text hash>.tokens`, little-endian
//! u32), so that every node process of a machine, a `--resume` and the next run read them
//! instead of tokenizing again. A cache of another tokenizer or another text has another name.

use std::path::Path;

use sha2::{Digest, Sha256};

use crate::data::DataError;
use crate::tok::Tok;

fn err(origin: &Path, message: impl Into<String>) -> DataError {
    DataError {
        origin: origin.display().to_string(),
        message: message.into(),
    }
}

/// The text of `path` (`.gz` decompressed) as one document.
fn read_text(path: &Path) -> Result<String, DataError> {
    let bytes = std::fs::read(path).map_err(|e| {
        err(
            path,
            format!("cannot read the text: {e} (`dataset` is a text file's path)"),
        )
    })?;
    let bytes = if path.extension().is_some_and(|e| e == "gz") {
        let mut out = Vec::new();
        std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&bytes[..]), &mut out)
            .map_err(|e| err(path, format!("not gzip: {e}")))?;
        out
    } else {
        bytes
    };
    String::from_utf8(bytes).map_err(|e| {
        err(
            path,
            format!("not UTF-8 text (byte {})", e.utf8_error().valid_up_to()),
        )
    })
}

/// The token ids of the text file `path` through `tok`, read from the cache in `cache` when
/// it holds them, else tokenized and written there (atomically).
pub fn cached(tok: &Tok, path: &Path, cache: Option<&Path>) -> Result<Vec<u32>, DataError> {
    let text = read_text(path)?;
    let text_hash: String = Sha256::digest(text.as_bytes())
        .iter()
        .take(8)
        .map(|b| format!("{b:02x}"))
        .collect();
    let stem = path
        .file_name()
        .map_or("text".into(), |n| n.to_string_lossy().into_owned());
    let file = cache.map(|c| c.join(format!("{stem}.{}.{text_hash}.tokens", tok.hash)));
    if let Some(ids) = file.as_deref().and_then(read_cache) {
        return Ok(ids);
    }
    let ids = tok.encode(&text).map_err(|e| err(path, e))?;
    if let Some(f) = &file {
        // A cache that cannot be written costs the next run the tokenizing only.
        let _ = write_cache(f, &ids);
    }
    Ok(ids)
}

/// The ids a cache file holds: its count (u64), then the ids; `None` for a file that is not
/// whole.
fn read_cache(f: &Path) -> Option<Vec<u32>> {
    let bytes = std::fs::read(f).ok()?;
    let (n, rest) = bytes.split_first_chunk::<8>()?;
    let n = u64::from_le_bytes(*n) as usize;
    (rest.len() == 4 * n).then(|| {
        rest.chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    })
}

/// Write a cache file under a name of this process's, then rename it into place: processes
/// of one machine that tokenize at once never read each other's half-written file.
fn write_cache(f: &Path, ids: &[u32]) -> std::io::Result<()> {
    std::fs::create_dir_all(f.parent().unwrap_or(Path::new(".")))?;
    let mut bytes = Vec::with_capacity(8 + 4 * ids.len());
    bytes.extend((ids.len() as u64).to_le_bytes());
    bytes.extend(ids.iter().flat_map(|t| t.to_le_bytes()));
    let tmp = f.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, &bytes)?;
    std::fs::rename(&tmp, f)
}
