//! A Hugging Face model folder, read tensor by tensor: `config.json`, `model.safetensors` or
//! the shards a `model.safetensors.index.json` maps, `tokenizer.json` and the files around it.
//! Only the headers are read when the folder is opened; a tensor's bytes are read by offset
//! when a node first needs it, so a pipeline stage reads its own layers and nothing else (a 7B
//! folder is never read whole by every stage). F32, BF16 and F16 tensors are read as f32.
//!
//! Names follow transformers' `save_pretrained`; a GPT-2 folder without the `transformer.`
//! prefix (the original hub checkpoints) and a folder whose LM head is tied to the token
//! embedding (no `lm_head.weight` in the files) are read too.

use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use ravnest_protocol::node::values::ComputeError;

use crate::gpt::Gpt;
use crate::load_error::LoadError;

/// A tensor's element type in the files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dtype {
    F32,
    Bf16,
    F16,
}

impl Dtype {
    fn bytes(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::Bf16 | Dtype::F16 => 2,
        }
    }
}

/// Where a tensor is: (file index, absolute offset, type, shape).
#[derive(Debug, Clone)]
struct Located {
    file: usize,
    at: u64,
    dtype: Dtype,
    shape: Vec<usize>,
}

/// A Hugging Face model folder, opened.
#[derive(Debug)]
pub struct HfFolder {
    /// The folder.
    pub dir: PathBuf,
    files: Vec<(PathBuf, Mutex<Option<std::fs::File>>)>,
    tensors: BTreeMap<String, Located>,
}

fn load_err(path: &Path, message: impl Into<String>) -> LoadError {
    LoadError {
        path: path.display().to_string(),
        message: message.into(),
    }
}

/// The tensors in the header of the safetensors file at `path` (file index `file`).
fn header(path: &Path, file: usize) -> Result<BTreeMap<String, Located>, LoadError> {
    let err = |m: String| load_err(path, m);
    let mut f = std::fs::File::open(path).map_err(|e| {
        err(if e.kind() == std::io::ErrorKind::NotFound {
            "no such file".into()
        } else {
            e.to_string()
        })
    })?;
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
        let dtype = match t.get("dtype").and_then(|d| d.as_str()).unwrap_or("?") {
            "F32" => Some(Dtype::F32),
            "BF16" => Some(Dtype::Bf16),
            "F16" => Some(Dtype::F16),
            _ => None,
        };
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
        let Some(dtype) = dtype else {
            // Buffers of other types (GPT-2's old `attn.bias` masks) are not parameters: a
            // parameter of another type is reported when it is asked for.
            continue;
        };
        let elems: usize = shape.iter().product();
        let ok = off.len() == 2
            && off[1] >= off[0]
            && off[1] - off[0] == (dtype.bytes() * elems) as u64
            && data + off[1] <= file_len;
        if !ok {
            return Err(err(format!(
                "tensor `{name}`: {dtype:?} {shape:?} at {off:?} does not lie inside the file"
            )));
        }
        out.insert(
            name.clone(),
            Located {
                file,
                at: data + off[0],
                dtype,
                shape,
            },
        );
    }
    Ok(out)
}

impl HfFolder {
    /// Open the folder `dir`: its weights' headers (one `model.safetensors`, or the shards its
    /// index names).
    pub fn open(dir: &Path) -> Result<HfFolder, LoadError> {
        if !dir.is_dir() {
            return Err(load_err(
                dir,
                "no such folder (a Hugging Face model folder: config.json, model.safetensors, tokenizer.json)",
            ));
        }
        let index = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let names: Vec<String> = if index.is_file() {
            let text =
                std::fs::read_to_string(&index).map_err(|e| load_err(&index, e.to_string()))?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| load_err(&index, format!("not JSON: {e}")))?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| load_err(&index, "has no `weight_map`"))?;
            let mut files: Vec<String> = map
                .values()
                .filter_map(|f| f.as_str().map(str::to_string))
                .collect();
            files.sort();
            files.dedup();
            if let Some(bad) = files.iter().find(|f| f.contains('/') || f.contains("..")) {
                return Err(load_err(
                    &index,
                    format!("names a file outside the folder: `{bad}`"),
                ));
            }
            files
        } else if single.is_file() {
            vec!["model.safetensors".into()]
        } else {
            let bin = dir.join("pytorch_model.bin").is_file();
            return Err(load_err(
                dir,
                if bin {
                    "holds pytorch_model.bin only: ravnest reads safetensors weights (save the model again with `save_pretrained(dir, safe_serialization=True)`)"
                } else {
                    "has no model.safetensors and no model.safetensors.index.json"
                },
            ));
        };
        let mut tensors = BTreeMap::new();
        let mut files = Vec::new();
        for (k, name) in names.iter().enumerate() {
            let path = dir.join(name);
            tensors.extend(header(&path, k)?);
            files.push((path, Mutex::new(None)));
        }
        Ok(HfFolder {
            dir: dir.to_path_buf(),
            files,
            tensors,
        })
    }

    /// The name `want` has in the files: itself, without GPT-2's `transformer.` prefix, or,
    /// for a tied LM head, the token embedding's.
    fn resolve(&self, want: &str) -> Option<&str> {
        let has = |n: &str| self.tensors.get_key_value(n).map(|(k, _)| k.as_str());
        has(want)
            .or_else(|| want.strip_prefix("transformer.").and_then(has))
            .or_else(|| match want {
                "lm_head.weight" => has("model.embed_tokens.weight")
                    .or_else(|| has("transformer.wte.weight"))
                    .or_else(|| has("wte.weight")),
                _ => None,
            })
    }

    /// Check that every tensor of `g` is in the files with its shape: a folder of another
    /// model is refused before training starts, naming the file and the tensor.
    pub fn check(&self, g: &Gpt) -> Result<(), LoadError> {
        for p in g.params_in_order() {
            let Some(name) = self.resolve(&p.name) else {
                return Err(load_err(
                    &self.dir,
                    format!(
                        "no tensor `{}` in {} (the weights are of another model than its config.json says)",
                        p.name,
                        self.file_names()
                    ),
                ));
            };
            let t = &self.tensors[name];
            if t.shape != p.shape {
                return Err(load_err(
                    &self.files[t.file].0,
                    format!(
                        "`{name}` is {:?}, but config.json makes it {:?}",
                        t.shape, p.shape
                    ),
                ));
            }
        }
        Ok(())
    }

    fn file_names(&self) -> String {
        self.files
            .iter()
            .map(|f| {
                f.0.file_name()
                    .map_or(String::new(), |n| n.to_string_lossy().into_owned())
            })
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The values of tensor `name` (`len` of them) as f32, read from its file.
    pub fn tensor(&self, name: &str, len: usize) -> Result<Vec<f32>, ComputeError> {
        let key = self.resolve(name).ok_or_else(|| {
            ComputeError::Shape(format!(
                "{}: no tensor `{name}` in {}",
                self.dir.display(),
                self.file_names()
            ))
        })?;
        let t = &self.tensors[key];
        let elems: usize = t.shape.iter().product();
        let (path, file) = &self.files[t.file];
        if elems != len {
            return Err(ComputeError::Shape(format!(
                "{}: `{key}` has {elems} values, the model {len}",
                path.display()
            )));
        }
        let io = |e: std::io::Error| ComputeError::Backend(format!("{}: {e}", path.display()));
        let mut f = file.lock().unwrap();
        if f.is_none() {
            *f = Some(std::fs::File::open(path).map_err(io)?);
        }
        let f = f.as_mut().expect("just opened");
        f.seek(SeekFrom::Start(t.at)).map_err(io)?;
        // Read into the values' own buffer (f32), or half-size bytes widened once (bf16, f16):
        // a tensor is never in memory twice at full size.
        let mut out = vec![0.0f32; len];
        match t.dtype {
            Dtype::F32 => {
                f.read_exact(bytemuck::cast_slice_mut(&mut out))
                    .map_err(io)?;
                if cfg!(target_endian = "big") {
                    for v in &mut out {
                        *v = f32::from_bits(v.to_bits().swap_bytes());
                    }
                }
            }
            Dtype::Bf16 | Dtype::F16 => {
                let mut bytes = vec![0u8; 2 * len];
                f.read_exact(&mut bytes).map_err(io)?;
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = match t.dtype {
                        Dtype::Bf16 => half::bf16::from_le_bytes([b[0], b[1]]).to_f32(),
                        _ => half::f16::from_le_bytes([b[0], b[1]]).to_f32(),
                    };
                }
            }
        }
        Ok(out)
    }

    /// Every parameter of `g`, in the flat model's order.
    pub fn read_all(&self, g: &Gpt) -> Result<Vec<f32>, LoadError> {
        self.check(g)?;
        let mut flat = Vec::with_capacity(g.params());
        for p in g.params_in_order() {
            let n = p.shape.iter().product();
            flat.extend(
                self.tensor(&p.name, n)
                    .map_err(|e| load_err(&self.dir, e.to_string()))?,
            );
        }
        Ok(flat)
    }
}

/// The folder's `config.json`, parsed.
pub fn config_json(dir: &Path) -> Result<serde_json::Value, LoadError> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| {
        load_err(
            &path,
            if e.kind() == std::io::ErrorKind::NotFound {
                "no such file (a Hugging Face model folder has a config.json)".to_string()
            } else {
                e.to_string()
            },
        )
    })?;
    serde_json::from_str(&text).map_err(|e| load_err(&path, format!("not JSON: {e}")))
}

/// The files a model folder carries beside its weights that a checkpoint copies: the
/// tokenizer's and the generation config.
pub const COMPANION_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
];

/// A reader of `[model] from` for [`ravnest_core::parse_with`]: folders relative to `base`
/// (the cluster file's own folder), their `config.json` read.
pub fn model_reader(base: PathBuf) -> impl Fn(&str) -> Result<(String, String), String> {
    move |from: &str| {
        let dir = if Path::new(from).is_absolute() {
            PathBuf::from(from)
        } else {
            base.join(from)
        };
        let shown = dir.display().to_string();
        if !dir.is_dir() {
            return Err(format!(
                "the model folder `{shown}` does not exist (a relative `from` is read from the cluster file's folder; get one with `huggingface-cli download ORG/MODEL --local-dir DIR`)"
            ));
        }
        let config = dir.join("config.json");
        let text = std::fs::read_to_string(&config)
            .map_err(|e| format!("cannot read {}: {e}", config.display()))?;
        Ok((shown, text))
    }
}

/// Parse a cluster file (`origin`: its path, which relative `[model] from` folders are read
/// against), reading the `config.json` of a model from a folder.
pub fn parse_scenario(
    text: &str,
    origin: &str,
) -> Result<ravnest_core::Scenario, ravnest_core::ConfigError> {
    let base = Path::new(origin)
        .parent()
        .map_or_else(|| PathBuf::from("."), Path::to_path_buf);
    let read = model_reader(base.clone());
    let mut s = ravnest_core::parse_with(text, origin, &read)?;
    // Data paths are the file's too: a cluster file works from any working directory.
    s.run.dataset = relative_to(&base, &s.run.dataset);
    s.run.eval_dataset = s.run.eval_dataset.as_deref().map(|d| relative_to(&base, d));
    Ok(s)
}

/// `spec` (a dataset: a path, or "digits", the embedded one) read from the folder `base` when
/// it is a relative path.
pub fn relative_to(base: &Path, spec: &str) -> String {
    if spec == "digits" || Path::new(spec).is_absolute() || base.as_os_str().is_empty() {
        return spec.to_string();
    }
    base.join(spec).display().to_string()
}
