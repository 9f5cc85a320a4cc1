//! A checkpoint read tensor by tensor: the headers of its weights and optimizer files, and
//! each tensor's bytes read from disk when a node first needs it. A resumed run's nodes start
//! from it without any of them holding the whole model: each makes its own layers from it, and
//! the coordinator's host serves the others' layers from it the same way.

use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use ravnest_protocol::node::values::ComputeError;

use super::{CheckpointFiles, LoadError};

/// Where a tensor's bytes are: (file index, absolute offset, elements).
type At = (usize, u64, usize);

/// A tensor in one file's header: (shape, absolute offset, elements).
type Located = (Vec<usize>, u64, usize);

/// One checkpoint, read tensor by tensor.
#[derive(Debug)]
pub struct CheckpointReader {
    /// The step it is of.
    pub step: u64,
    files: Vec<(PathBuf, Mutex<Option<std::fs::File>>)>,
    tensors: BTreeMap<String, At>,
    /// AdamW's step count (0 without one).
    pub step_count: f32,
}

/// The header of the safetensors file at `path`: each F32 tensor's (shape, absolute offset,
/// elements); anything else is an error naming it.
fn header(path: &Path) -> Result<BTreeMap<String, Located>, LoadError> {
    let err = |m: String| LoadError {
        path: path.display().to_string(),
        message: m,
    };
    let mut f = std::fs::File::open(path).map_err(|e| err(e.to_string()))?;
    let file_len = f.metadata().map_err(|e| err(e.to_string()))?.len();
    let mut n = [0u8; 8];
    f.read_exact(&mut n)
        .map_err(|_| err("not a safetensors file (shorter than its header)".into()))?;
    let n = u64::from_le_bytes(n);
    if n > 100 << 20 || 8 + n > file_len {
        return Err(err(format!(
            "not a safetensors file (a header of {n} bytes)"
        )));
    }
    let mut text = vec![0u8; n as usize];
    f.read_exact(&mut text).map_err(|e| err(e.to_string()))?;
    let v: serde_json::Value = serde_json::from_slice(&text)
        .map_err(|e| err(format!("not a safetensors file (header: {e})")))?;
    let obj = v
        .as_object()
        .ok_or_else(|| err("not a safetensors file (its header is not an object)".into()))?;
    let data = 8 + n;
    let mut out = BTreeMap::new();
    for (name, t) in obj {
        if name == "__metadata__" {
            continue;
        }
        let dtype = t.get("dtype").and_then(|d| d.as_str()).unwrap_or("?");
        let shape: Vec<usize> = t
            .get("shape")
            .and_then(|s| s.as_array())
            .map(|a| {
                a.iter()
                    .filter_map(|x| x.as_u64())
                    .map(|x| x as usize)
                    .collect()
            })
            .unwrap_or_default();
        let off: Vec<u64> = t
            .get("data_offsets")
            .and_then(|s| s.as_array())
            .map(|a| a.iter().filter_map(|x| x.as_u64()).collect())
            .unwrap_or_default();
        let elems: usize = shape.iter().product();
        let ok = dtype == "F32"
            && off.len() == 2
            && off[1] >= off[0]
            && off[1] - off[0] == 4 * elems as u64
            && data + off[1] <= file_len;
        if !ok {
            return Err(err(format!(
                "tensor `{name}`: {dtype} {shape:?} at {off:?} is not an F32 tensor inside the file"
            )));
        }
        out.insert(name.clone(), (shape, data + off[0], elems));
    }
    Ok(out)
}

impl CheckpointReader {
    /// Open the checkpoint of `step` in `files`: both headers are read and every tensor the
    /// network and its optimizer need is checked by name, type and shape now, so a wrong or
    /// torn checkpoint is refused before training starts.
    pub fn open(files: &CheckpointFiles, step: u64) -> Result<CheckpointReader, LoadError> {
        let mut paths = vec![files.path(step)];
        let names = files.optim.state_names();
        let layout = files.net.layout();
        let has_step = files.optim.state_len(1) > names.len();
        if !names.is_empty() || has_step {
            paths.push(files.optim_path(step));
        }
        let mut tensors = BTreeMap::new();
        let mut shapes = BTreeMap::new();
        for (k, p) in paths.iter().enumerate() {
            for (name, (shape, at, elems)) in header(p)? {
                shapes.insert(name.clone(), (k, shape));
                tensors.insert(name, (k, at, elems));
            }
        }
        let shown: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
        let want = |name: String, shape: &[usize], k: usize| -> Result<(), LoadError> {
            let path = shown[k].clone();
            match shapes.get(&name) {
                Some((_, s)) if s.as_slice() == shape => Ok(()),
                Some((_, s)) => Err(LoadError {
                    path,
                    message: format!(
                        "`{name}` is {s:?}, expected {shape:?} (the checkpoint is of another network)"
                    ),
                }),
                None => Err(LoadError {
                    path,
                    message: format!(
                        "no tensor `{name}` (the checkpoint is of another network or optimizer)"
                    ),
                }),
            }
        };
        for t in &layout {
            want(t.name.clone(), &t.shape, 0)?;
            for s in names {
                want(format!("{s}.{}", t.name), &t.shape, 1)?;
            }
        }
        let files: Vec<(PathBuf, Mutex<Option<std::fs::File>>)> =
            paths.into_iter().map(|p| (p, Mutex::new(None))).collect();
        let mut r = CheckpointReader {
            step,
            files,
            tensors,
            step_count: 0.0,
        };
        if has_step {
            want("step".into(), &[1], 1)?;
            let t = r.read("step", 1).map_err(|e| LoadError {
                path: r.files[1].0.display().to_string(),
                message: e.to_string(),
            })?;
            r.step_count = t[0];
        }
        Ok(r)
    }

    fn read(&self, name: &str, len: usize) -> Result<Vec<f32>, ComputeError> {
        let &(k, at, elems) = self.tensors.get(name).ok_or_else(|| {
            ComputeError::Shape(format!(
                "the checkpoint of step {} has no `{name}`",
                self.step
            ))
        })?;
        if elems != len {
            return Err(ComputeError::Shape(format!(
                "`{name}` has {elems} values in the checkpoint, {len} in the model"
            )));
        }
        let (path, file) = &self.files[k];
        let io = |e: std::io::Error| ComputeError::Backend(format!("{}: {e}", path.display()));
        let mut f = file.lock().unwrap();
        if f.is_none() {
            *f = Some(std::fs::File::open(path).map_err(io)?);
        }
        let f = f.as_mut().expect("just opened");
        f.seek(SeekFrom::Start(at)).map_err(io)?;
        let mut bytes = vec![0u8; 4 * len];
        f.read_exact(&mut bytes).map_err(io)?;
        Ok(bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
    }

    /// The values of tensor `name` (`len` of them), read from disk.
    pub fn tensor(&self, name: &str, len: usize) -> Result<Vec<f32>, ComputeError> {
        self.read(name, len)
    }
}
