//! Writing checkpoints without holding them: a safetensors file written tensor by tensor from
//! wherever the values are (a flat model in memory, or the shards' parts on disk), and the
//! parts of the shards as they arrive.

use std::collections::{BTreeMap, HashMap};
use std::io::{BufWriter, Read, Seek, SeekFrom, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};

use ravnest_core::LayerRange;

use super::Entry;

/// Asked for the flat model's values `offset..offset + len`, appends them to the buffer.
pub(super) type Fill<'a> = dyn FnMut(usize, usize, &mut Vec<f32>) -> std::io::Result<()> + 'a;

/// Where a run of the flat model's values lies: (its flat range, the file, the value at which
/// the range starts in that file).
pub(super) type Piece = (Range<usize>, PathBuf, usize);

/// Write the safetensors file `path` atomically (temporary file, fsync, rename, fsync of the
/// directory) with `entries`, each tensor's values asked of `fill(offset, len, buffer)` in
/// turn: one tensor in memory at a time.
pub(super) fn safetensors_atomic(
    path: &Path,
    entries: &[Entry],
    meta: &HashMap<String, String>,
    fill: &mut Fill<'_>,
) -> std::io::Result<()> {
    let mut header = serde_json::Map::new();
    let mut at = 0usize;
    for (name, shape, _, len) in entries {
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [at, at + 4 * len]}),
        );
        at += 4 * len;
    }
    let meta: BTreeMap<&String, &String> = meta.iter().collect();
    header.insert("__metadata__".into(), serde_json::json!(meta));
    let mut text = serde_json::to_vec(&serde_json::Value::Object(header))?;
    // The data starts on an 8-byte boundary, as the format's own writer pads it.
    while !text.len().is_multiple_of(8) {
        text.push(b' ');
    }
    let dir = path.parent().unwrap_or(Path::new("."));
    let tmp = dir.join(format!(
        ".{}.tmp",
        path.file_name().and_then(|f| f.to_str()).unwrap_or("file")
    ));
    {
        let file = std::fs::File::create(&tmp)?;
        let mut w = BufWriter::with_capacity(1 << 20, file);
        w.write_all(&(text.len() as u64).to_le_bytes())?;
        w.write_all(&text)?;
        let mut buf = Vec::new();
        let mut bytes = Vec::new();
        for (_, _, off, len) in entries {
            buf.clear();
            fill(*off, *len, &mut buf)?;
            if buf.len() != *len {
                return Err(std::io::Error::other(format!(
                    "{} values for a tensor of {len}",
                    buf.len()
                )));
            }
            bytes.clear();
            bytes.extend(buf.iter().flat_map(|x| x.to_le_bytes()));
            w.write_all(&bytes)?;
        }
        let file = w.into_inner().map_err(|e| e.into_error())?;
        file.sync_all()?;
    }
    std::fs::rename(&tmp, path)?;
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// Values `off..off + len` of the flat model from the pieces that hold them (sorted by start;
/// where two hold a value, the first).
pub(super) fn read_pieces(
    pieces: &[Piece],
    off: usize,
    len: usize,
    out: &mut Vec<f32>,
) -> std::io::Result<()> {
    let mut at = off;
    let end = off + len;
    let mut bytes = Vec::new();
    while at < end {
        let Some((r, file, start)) = pieces.iter().find(|p| p.0.start <= at && at < p.0.end) else {
            return Err(std::io::Error::other(format!(
                "no shard holds value {at} of the model"
            )));
        };
        let n = (r.end.min(end)) - at;
        let mut f = std::fs::File::open(file)?;
        f.seek(SeekFrom::Start(4 * (start + at - r.start) as u64))?;
        bytes.resize(4 * n, 0);
        f.read_exact(&mut bytes)?;
        out.extend(
            bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        );
        at += n;
    }
    Ok(())
}

/// The folder the parts of checkpoint `step`'s shards are kept in until it is written.
pub(super) fn parts_dir(dir: &Path, step: u64) -> PathBuf {
    dir.join(".parts").join(format!("step-{step:08}"))
}

/// The file of the shard of `layers` of checkpoint `step`.
pub(super) fn part_file(dir: &Path, step: u64, layers: LayerRange) -> PathBuf {
    parts_dir(dir, step).join(format!("layers-{}-{}.f32", layers.start, layers.end))
}

/// Append `values` at `offset` of the shard file (offset 0 starts it afresh).
pub(super) fn put_part(file: &Path, offset: u64, values: &[f32]) -> std::io::Result<()> {
    if let Some(d) = file.parent() {
        std::fs::create_dir_all(d)?;
    }
    let mut f = if offset == 0 {
        std::fs::File::create(file)?
    } else {
        std::fs::OpenOptions::new().append(true).open(file)?
    };
    if f.metadata()?.len() != 4 * offset {
        return Err(std::io::Error::other(format!(
            "a part at value {offset} of a shard file of {} values",
            f.metadata()?.len() / 4
        )));
    }
    let bytes: Vec<u8> = values.iter().flat_map(|x| x.to_le_bytes()).collect();
    f.write_all(&bytes)
}
