//! Checkpoint files, as the ecosystem expects them: per checkpoint, the model's weights in one
//! safetensors file (`step-N.safetensors`, the network's own tensor names, JSON metadata),
//! the optimizer state in its own file beside it (`step-N.optim.safetensors`), a JSON manifest
//! (`step-N.json`) and a `latest` pointer. Each is written atomically (temporary file, fsync,
//! rename, fsync of the directory), and `latest` last, so a crash at any moment leaves either
//! the previous checkpoint or the new one, never a torn one. (A crash between two of a step's
//! files can leave the weights of that step without its manifest: a checkpoint is one with a
//! manifest, and readers verify it before they take it.)
//!
//! The weights file loads with `safetensors.torch.load_file` straight into the equivalent
//! `torch.nn` module (`load_state_dict(strict=True)`); its metadata (`__metadata__`) holds
//! `format` (`pt`), `step`, `model` (the network's configuration as JSON), `optimizer`,
//! `learning_rate`, `seed` and `dataset`. The optimizer file holds `<state>.<name>` per tensor
//! (`momentum.fc0.weight`, AdamW's `adam_m.` and `adam_v.`) and `step` (AdamW's step count, and
//! a scheduled optimizer's).

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};

use ravnest_core::LayerRange;
use ravnest_core::checkpoint::Manifest;
use ravnest_runtime::checkpoint::{Store, StoreError};
use safetensors::{Dtype, SafeTensors};

use crate::gpt::Gpt;
use crate::net::Network;
use crate::optim::Optim;

pub mod compare;
pub mod reader;
mod verify;
mod write;
pub use reader::CheckpointReader;

/// Where a run's checkpoints go.
#[derive(Debug, Clone)]
pub struct CheckpointFiles {
    /// Directory.
    pub dir: PathBuf,
    /// The network.
    pub net: Network,
    /// The optimizer (its state's names and length).
    pub optim: Optim,
    /// What else the weights file's metadata records (seed, dataset, ...).
    pub meta: BTreeMap<String, String>,
    /// The term of the coordinator whose checkpoint actor writes here (0: the first; a
    /// successor's is one more). The folder remembers the newest term that wrote to it (the
    /// `term` file); a write of an older term is refused, so a stale coordinator (cut off or
    /// frozen while another node took over) cannot overwrite its successor's checkpoints.
    pub term: u32,
    /// The Hugging Face folder the model came from (`[model] from`): its config, tokenizer
    /// and generation config are written with every checkpoint, so that the checkpoint
    /// folder loads as the same model with the same tokenizer.
    pub hf_source: Option<PathBuf>,
}

pub use crate::load_error::LoadError;

/// Write `bytes` to `path` atomically.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let tmp = dir.join(format!(
        ".{}.tmp",
        path.file_name().and_then(|f| f.to_str()).unwrap_or("file")
    ));
    {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path)?;
    // Make the rename itself durable.
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// (name, shape, offset, len) of a tensor in the flat vector.
type Entry = (String, Vec<usize>, usize, usize);

/// Read `entries` from the safetensors file at `path` into `flat`, checking every tensor.
fn read_into(
    path: &Path,
    entries: &[Entry],
    flat: &mut [f32],
    what: &str,
) -> Result<(), LoadError> {
    let err = |m: String| LoadError {
        path: path.display().to_string(),
        message: m,
    };
    let bytes = std::fs::read(path).map_err(|e| err(e.to_string()))?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| err(e.to_string()))?;
    copy_tensors(&st, entries, flat)
        .map_err(|m| err(m.replace("{of}", &format!("the checkpoint is of another {what}"))))
}

/// Copy `entries` out of `st` into `flat`, checking each tensor's type and shape. The message
/// of a missing tensor has `{of}` where the caller says why it may be missing.
fn copy_tensors(st: &SafeTensors<'_>, entries: &[Entry], flat: &mut [f32]) -> Result<(), String> {
    for (name, shape, off, len) in entries {
        let t = st
            .tensor(name)
            .map_err(|_| format!("no tensor `{name}` ({{of}})"))?;
        if t.dtype() != Dtype::F32 || t.shape() != shape.as_slice() {
            return Err(format!(
                "`{name}` is {:?} {:?}, expected F32 {shape:?}",
                t.dtype(),
                t.shape()
            ));
        }
        for (dst, b) in flat[*off..off + len]
            .iter_mut()
            .zip(t.data().chunks_exact(4))
        {
            *dst = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
    }
    Ok(())
}

/// A GPT's weights and shape from `path`: a checkpoints folder (its `model.safetensors`, else
/// the weights of the step `latest` names; a run's output folder with a `checkpoints/` in it
/// will do) or one weights file (`step-N.safetensors`, `model.safetensors`). The shape comes
/// from the file's own `model` metadata (`{"kind": "gpt", …}`) or, in a file without it (one
/// `transformers` saved), from the Hugging Face `config.json` beside it. Every tensor is
/// checked by name, type and shape; the optimizer state is not read.
pub fn load_gpt(path: &Path) -> Result<(Gpt, Vec<f32>), LoadError> {
    let err = |p: &Path, m: String| LoadError {
        path: p.display().to_string(),
        message: m,
    };
    let io = |p: &Path, e: std::io::Error| {
        err(
            p,
            if e.kind() == std::io::ErrorKind::NotFound {
                "no such file or folder".into()
            } else {
                e.to_string()
            },
        )
    };
    let info = std::fs::metadata(path).map_err(|e| io(path, e))?;
    if info.is_dir()
        && path.join("config.json").is_file()
        && (path.join("model.safetensors").is_file()
            || path.join("model.safetensors.index.json").is_file())
    {
        return load_folder(path, None);
    }
    let weights = if info.is_dir() {
        gpt_weights_in(path)?
    } else {
        path.to_path_buf()
    };
    let bytes = std::fs::read(&weights).map_err(|e| io(&weights, e))?;
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| err(&weights, format!("not a safetensors file ({e})")))?;
    let model_meta = SafeTensors::read_metadata(&bytes)
        .ok()
        .and_then(|(_, m)| m.metadata().as_ref().and_then(|m| m.get("model").cloned()));
    let config = weights
        .parent()
        .unwrap_or(Path::new("."))
        .join("config.json");
    let (g, source) = match model_meta {
        Some(m) => {
            let v: serde_json::Value = serde_json::from_str(&m)
                .map_err(|e| err(&weights, format!("its `model` metadata is not JSON: {e}")))?;
            (
                crate::gpt::from_model_json(&v).map_err(|m| err(&weights, m))?,
                "its `model` metadata".to_string(),
            )
        }
        None if config.is_file() => {
            let text = std::fs::read_to_string(&config).map_err(|e| io(&config, e))?;
            let v: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| err(&config, format!("not JSON: {e}")))?;
            (
                crate::gpt::from_hf_config(&v).map_err(|m| err(&config, m))?,
                config.display().to_string(),
            )
        }
        None => {
            return Err(err(
                &weights,
                "no `model` metadata and no config.json beside it: not a ravnest GPT checkpoint"
                    .into(),
            ));
        }
    };
    let net = Network::Gpt(g);
    let entries: Vec<Entry> = net
        .layout()
        .iter()
        .map(|t| (t.name.clone(), t.shape.clone(), t.offset, t.len()))
        .collect();
    let mut flat = vec![0.0f32; net.params()];
    copy_tensors(&st, &entries, &mut flat).map_err(|m| {
        let shape = format!(
            "a GPT of {} layers, hidden {}, {} heads, {} positions and a vocabulary of {}",
            g.layers, g.hidden, g.heads, g.seq, g.vocab
        );
        let m = if m.contains("{of}") {
            m.replace("{of}", &format!("{shape}, as {source} says, has it"))
        } else {
            format!("{m} ({source} says {shape})")
        };
        err(&weights, m)
    })?;
    Ok((g, flat))
}

/// A Hugging Face model folder's transformer (as its `config.json` describes it, samples of
/// `seq` tokens, by default its context up to 1024) and its weights: the folder of a model
/// `transformers` saved, or a ravnest checkpoint folder (which is one). Sharded and bf16 or
/// f16 weights are read too.
pub fn load_folder(dir: &Path, seq: Option<usize>) -> Result<(Gpt, Vec<f32>), LoadError> {
    let config = crate::folder::config_json(dir)?;
    let g = ravnest_core::decoder::Decoder::from_hf_config(&config, seq)
        .map(Gpt::of)
        .map_err(|m| LoadError {
            path: dir.join("config.json").display().to_string(),
            message: m,
        })?;
    let weights = crate::folder::HfFolder::open(dir)?.read_all(&g)?;
    Ok((g, weights))
}

/// The weights file of the checkpoints folder `dir` (see [`load_gpt`]).
fn gpt_weights_in(dir: &Path) -> Result<PathBuf, LoadError> {
    let model = dir.join("model.safetensors");
    if model.is_file() {
        return Ok(model);
    }
    let latest = dir.join("latest");
    if latest.is_file() {
        let text = std::fs::read_to_string(&latest).map_err(|e| LoadError {
            path: latest.display().to_string(),
            message: e.to_string(),
        })?;
        let step: u64 = text.trim().parse().map_err(|_| LoadError {
            path: latest.display().to_string(),
            message: format!("`{}` is not a step number", text.trim()),
        })?;
        return Ok(dir.join(format!("step-{step:08}.safetensors")));
    }
    let sub = dir.join("checkpoints");
    if sub.is_dir() {
        return gpt_weights_in(&sub);
    }
    Err(LoadError {
        path: dir.display().to_string(),
        message: "holds no checkpoint (no model.safetensors, no `latest`, no checkpoints/)".into(),
    })
}

/// A run may not write its checkpoints where it was asked to.
#[derive(Debug, thiserror::Error)]
pub enum GuardError {
    /// The folder holds an earlier run's checkpoints, and the run neither resumes nor
    /// overwrites them.
    #[error(
        "`{}` already holds the checkpoints of an earlier run{}; this run would write over them\n  \
         help: continue that run with --resume, write elsewhere with --out DIR, or replace them with --overwrite",
        dir.display(),
        latest.map(|s| format!(" (latest: step {s})")).unwrap_or_default()
    )]
    Held {
        /// The folder.
        dir: PathBuf,
        /// Its latest step, if it says.
        latest: Option<u64>,
    },
    /// `--overwrite` could not remove them.
    #[error("--overwrite: cannot remove `{}`: {source}", dir.display())]
    Remove {
        /// The folder.
        dir: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// A run is about to write checkpoints into `dir`: never over another run's by accident. With
/// `resume` they are the starting point; with `overwrite` they are deleted first (returns
/// whether anything was). Otherwise a folder that holds checkpoints is an error that says
/// what to do.
pub fn guard(dir: &Path, resume: bool, overwrite: bool) -> Result<bool, GuardError> {
    let held = match std::fs::read_dir(dir) {
        Err(_) => return Ok(false),
        Ok(rd) => rd
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .any(|n| n == "latest" || n.ends_with(".safetensors")),
    };
    if !held || resume {
        return Ok(false);
    }
    if overwrite {
        std::fs::remove_dir_all(dir).map_err(|source| GuardError::Remove {
            dir: dir.to_path_buf(),
            source,
        })?;
        return Ok(true);
    }
    let latest = std::fs::read_to_string(dir.join("latest"))
        .ok()
        .and_then(|s| s.trim().parse().ok());
    Err(GuardError::Held {
        dir: dir.to_path_buf(),
        latest,
    })
}

impl CheckpointFiles {
    /// The weights' tensors, in flat order.
    fn weight_entries(&self) -> Vec<Entry> {
        self.net
            .layout()
            .iter()
            .map(|t| (t.name.clone(), t.shape.clone(), t.offset, t.len()))
            .collect()
    }

    /// The optimizer state's tensors, in flat order (empty for plain SGD).
    fn optim_entries(&self) -> Vec<Entry> {
        let layout = self.net.layout();
        let p = self.net.params();
        let mut out = Vec::new();
        for (k, state) in self.optim.state_names().iter().enumerate() {
            for t in &layout {
                out.push((
                    format!("{state}.{}", t.name),
                    t.shape.clone(),
                    p * (k + 1) + t.offset,
                    t.len(),
                ));
            }
        }
        if self.optim.state_len(p) > self.optim.state_names().len() * p {
            out.push((
                "step".into(),
                vec![1],
                p * (1 + self.optim.state_names().len()),
                1,
            ));
        }
        out
    }

    /// Path of the weights of `step`.
    pub fn path(&self, step: u64) -> PathBuf {
        self.dir.join(format!("step-{step:08}.safetensors"))
    }

    /// Path of the optimizer state of `step`.
    pub fn optim_path(&self, step: u64) -> PathBuf {
        self.dir.join(format!("step-{step:08}.optim.safetensors"))
    }

    /// Write the checkpoint of `step` (flat model = parameters then optimizer state).
    pub fn write(&self, step: u64, flat: &[f32], manifest_json: &str) -> std::io::Result<PathBuf> {
        let mut fill = |off: usize, len: usize, out: &mut Vec<f32>| -> std::io::Result<()> {
            let v = flat
                .get(off..off + len)
                .ok_or_else(|| std::io::Error::other("a flat model too short for the network"))?;
            out.extend_from_slice(v);
            Ok(())
        };
        self.write_from(step, &mut fill, manifest_json)
    }

    /// Write the checkpoint of `step`, each tensor's flat values asked of `fill(offset, len,
    /// buffer)` in turn (one tensor in memory at a time).
    /// The newest coordinator term that wrote to this folder (its `term` file; 0 without one).
    pub fn folder_term(&self) -> u32 {
        std::fs::read_to_string(self.dir.join("term"))
            .ok()
            .and_then(|t| t.trim().parse().ok())
            .unwrap_or(0)
    }

    /// Before a write: refuse it if a newer term wrote here; record this term if it is newer.
    fn claim_folder(&self) -> Result<(), StoreError> {
        let folder = self.folder_term();
        if folder > self.term {
            return Err(StoreError::Superseded {
                folder,
                ours: self.term,
            });
        }
        if self.term > folder || !self.dir.join("term").exists() {
            let path = self.dir.join("term");
            std::fs::create_dir_all(&self.dir)
                .and_then(|()| write_atomic(&path, format!("{}\n", self.term).as_bytes()))
                .map_err(|source| StoreError::Write { path, source })?;
        }
        Ok(())
    }

    fn write_from(
        &self,
        step: u64,
        fill: &mut write::Fill<'_>,
        manifest_json: &str,
    ) -> std::io::Result<PathBuf> {
        std::fs::create_dir_all(&self.dir)?;
        let optim = self.optim_entries();
        if !optim.is_empty() {
            let meta = HashMap::from([
                ("step".to_string(), step.to_string()),
                (
                    "optimizer".to_string(),
                    self.optim.kind.as_str().to_string(),
                ),
            ]);
            write::safetensors_atomic(&self.optim_path(step), &optim, &meta, fill)?;
        }
        let mut meta: HashMap<String, String> = self.meta.clone().into_iter().collect();
        meta.insert("format".into(), "pt".into());
        meta.insert("step".into(), step.to_string());
        meta.insert("model".into(), self.net.config_json().to_string());
        meta.insert("optimizer".into(), self.optim.kind.as_str().to_string());
        meta.insert("learning_rate".into(), self.optim.lr.to_string());
        meta.insert("term".into(), self.term.to_string());
        let path = self.path(step);
        write::safetensors_atomic(&path, &self.weight_entries(), &meta, fill)?;
        write_atomic(&self.manifest_path(step), manifest_json.as_bytes())?;
        if let Network::Gpt(g) = &self.net {
            self.hugging_face_folder(g, &path)?;
        }
        write_atomic(&self.dir.join("latest"), format!("{step}\n").as_bytes())?;
        Ok(path)
    }

    /// Make the checkpoint folder a Hugging Face model folder for the transformer: its
    /// `config.json` (the source folder's own, its LM head untied, for a model from a folder),
    /// the source's tokenizer and generation config, and `model.safetensors`, a hard link to
    /// the newest weights file (`weights`; a copy where links are refused), replaced
    /// atomically. `AutoModelForCausalLM.from_pretrained(folder)` loads it as the class it
    /// came from.
    fn hugging_face_folder(&self, g: &crate::gpt::Gpt, weights: &Path) -> std::io::Result<()> {
        let config = match &self.hf_source {
            Some(src) => {
                let original = crate::folder::config_json(src)
                    .map_err(|e| std::io::Error::other(e.to_string()))?;
                g.0.patch_hf_config(&original)
            }
            None => crate::gpt::hf_config(g),
        };
        let config = serde_json::to_string_pretty(&config)?;
        write_atomic(&self.dir.join("config.json"), config.as_bytes())?;
        if let Some(src) = &self.hf_source {
            for name in crate::folder::COMPANION_FILES {
                let from = src.join(name);
                if from.is_file() {
                    write_atomic(&self.dir.join(name), &std::fs::read(&from)?)?;
                }
            }
        }
        let tmp = self.dir.join(".model.safetensors.tmp");
        let _ = std::fs::remove_file(&tmp);
        if std::fs::hard_link(weights, &tmp).is_err() {
            std::fs::copy(weights, &tmp)?;
        }
        std::fs::rename(&tmp, self.dir.join("model.safetensors"))
    }

    /// The step the `latest` pointer names, if any.
    pub fn latest(&self) -> Result<Option<u64>, LoadError> {
        let p = self.dir.join("latest");
        match std::fs::read_to_string(&p) {
            Err(_) => Ok(None),
            Ok(s) => s.trim().parse().map(Some).map_err(|_| LoadError {
                path: p.display().to_string(),
                message: format!("`{}` is not a step number", s.trim()),
            }),
        }
    }

    /// The weights of the checkpoint of `step` alone (what an evaluation needs), checked.
    pub fn load_weights(&self, step: u64) -> Result<Vec<f32>, LoadError> {
        let mut flat = vec![0.0f32; self.net.params()];
        read_into(
            &self.path(step),
            &self.weight_entries(),
            &mut flat,
            "network",
        )?;
        Ok(flat)
    }

    /// Read the checkpoint of `step` back into a flat vector (weights, then the optimizer
    /// state from its file), checking every tensor.
    pub fn load(&self, step: u64) -> Result<Vec<f32>, LoadError> {
        let p = self.net.params();
        let mut flat = self.load_weights(step)?;
        flat.resize(p + self.optim.state_len(p), 0.0);
        let optim = self.optim_entries();
        if !optim.is_empty() {
            read_into(&self.optim_path(step), &optim, &mut flat, "optimizer")?;
        }
        Ok(flat)
    }
}

/// A testing seam (the chaos suite's full disk): `RAVNEST_FAIL_CHECKPOINT=STEP` makes the
/// write of the checkpoint of STEP fail as a full disk does.
const FAIL_CHECKPOINT_ENV: &str = "RAVNEST_FAIL_CHECKPOINT";

fn injected_failure(step: u64) -> Option<std::io::Error> {
    let at: u64 = std::env::var(FAIL_CHECKPOINT_ENV).ok()?.parse().ok()?;
    (at == step).then(|| {
        std::io::Error::new(
            std::io::ErrorKind::StorageFull,
            format!("no space left on device (injected by {FAIL_CHECKPOINT_ENV})"),
        )
    })
}

fn manifest_json(m: &Manifest, file: &Path, term: u32) -> String {
    let shards: Vec<serde_json::Value> = m
        .shards
        .iter()
        .map(|s| {
            serde_json::json!({
                "node": s.node.0,
                "layers": [s.layers.start, s.layers.end],
                "digest": format!("{:016x}", s.digest),
                "bytes": s.bytes,
            })
        })
        .collect();
    serde_json::json!({
        "step": m.step,
        "term": term,
        "file": file.file_name().and_then(|f| f.to_str()),
        "shards": shards,
    })
    .to_string()
}

impl Store for CheckpointFiles {
    /// The newest checkpoint whose values match its manifest's digests (a damaged one is
    /// passed over for the one before it).
    fn superseded(&self) -> Option<u32> {
        Some(self.folder_term()).filter(|f| *f > self.term)
    }

    fn latest(&self) -> Option<(u64, Vec<f32>)> {
        let (step, _) = self.newest_intact().ok()??;
        self.load(step).ok().map(|m| (step, m))
    }

    fn put(
        &self,
        step: u64,
        layers: LayerRange,
        offset: u64,
        values: &[f32],
    ) -> Result<(), StoreError> {
        let file = write::part_file(&self.dir, step, layers);
        write::put_part(&file, offset, values)
            .map_err(|source| StoreError::Write { path: file, source })
    }

    fn forget(&self, step: u64, layers: Option<LayerRange>) {
        let _ = match layers {
            Some(l) => std::fs::remove_file(write::part_file(&self.dir, step, l)),
            None => std::fs::remove_dir_all(write::parts_dir(&self.dir, step)),
        };
    }

    /// Merge the shards' parts on disk into the checkpoint's files, tensor by tensor: each
    /// shard holds its layers' slots (parameters, then their optimizer state, then AdamW's
    /// step count, which every stage's shard carries).
    fn commit(&self, manifest: &Manifest) -> Result<(), StoreError> {
        if let Some(e) = injected_failure(manifest.step) {
            return Err(StoreError::Write {
                path: self.path(manifest.step),
                source: e,
            });
        }
        let p = self.net.params();
        let want = p + self.optim.state_len(p);
        let mut pieces: Vec<write::Piece> = Vec::new();
        let mut got = 0;
        for meta in &manifest.shards {
            let file = write::part_file(&self.dir, manifest.step, meta.layers);
            let held = std::fs::metadata(&file).map_or(0, |m| m.len() as usize / 4);
            let slots = crate::layout::layer_slots(&self.net, &self.optim, meta.layers);
            let mut at = 0;
            for r in slots {
                at += r.len();
                pieces.push((r.clone(), file.clone(), at - r.len()));
            }
            got += held;
            if held != at {
                return Err(StoreError::Size { got, want });
            }
        }
        pieces.sort_by_key(|x| x.0.start);
        // Every value of the model in some shard.
        let mut end = 0;
        for x in &pieces {
            if x.0.start > end {
                break;
            }
            end = end.max(x.0.end);
        }
        if end != want {
            return Err(StoreError::Size { got, want });
        }
        let path = self.path(manifest.step);
        self.claim_folder()?;
        let mut fill =
            |off: usize, len: usize, out: &mut Vec<f32>| write::read_pieces(&pieces, off, len, out);
        let written = self
            .write_from(
                manifest.step,
                &mut fill,
                &manifest_json(manifest, &path, self.term),
            )
            .map(|_| ())
            .map_err(|source| StoreError::Write { path, source });
        // This round's parts, and any older round's, are done with.
        if let Ok(rd) = std::fs::read_dir(self.dir.join(".parts")) {
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                let step: Option<u64> = name.strip_prefix("step-").and_then(|s| s.parse().ok());
                if step.is_some_and(|s| s <= manifest.step) {
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
        written
    }
}

impl CheckpointFiles {
    /// Remove the parts of checkpoint rounds that never completed (the run is over, or was
    /// stopped: no round will complete them); the checkpoints themselves stay.
    pub fn clear_parts(&self) {
        let _ = std::fs::remove_dir_all(self.dir.join(".parts"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ravnest_core::Optimizer;

    /// Checkpoint files in `dir` for `net` trained with `kind` (lr 0.1, momentum 0.9).
    fn files_at(dir: &Path, net: Network, kind: Optimizer) -> CheckpointFiles {
        CheckpointFiles {
            hf_source: None,
            term: 0,
            dir: dir.to_path_buf(),
            net,
            optim: Optim {
                kind,
                lr: 0.1,
                momentum: 0.9,
                weight_decay: 0.0,
                schedule: ravnest_core::recipe::Schedule::CONSTANT,
            },
            meta: BTreeMap::new(),
        }
    }

    #[test]
    fn write_then_load_is_exact_for_every_optimizer() {
        for kind in [Optimizer::Sgd, Optimizer::SgdMomentum, Optimizer::Adamw] {
            let dir =
                std::env::temp_dir().join(format!("ravnest-store-{}-{kind:?}", std::process::id()));
            let files = files_at(
                &dir,
                Network::Mlp {
                    dims: vec![3, 4, 2],
                },
                kind,
            );
            let p = files.net.params();
            let flat: Vec<f32> = (0..p + files.optim.state_len(p))
                .map(|i| i as f32 * 0.5 - 3.0)
                .collect();
            files.write(7, &flat, "{}").unwrap();
            assert_eq!(files.latest().unwrap(), Some(7));
            assert_eq!(files.load(7).unwrap(), flat);
            assert!(
                !std::fs::read_dir(&dir).unwrap().any(|e| e
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .ends_with(".tmp"))
            );
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }

    /// A checkpoint whose bytes changed after it was written is refused by name and the one
    /// before it is taken; where none is intact, the newest one's fault is the error.
    #[test]
    fn a_damaged_checkpoint_is_refused_for_the_one_before() {
        let dir = std::env::temp_dir().join(format!("ravnest-store-dmg-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let files = files_at(
            &dir,
            Network::Mlp {
                dims: vec![3, 4, 2],
            },
            Optimizer::Adamw,
        );
        let p = files.net.params();
        let layers = files.net.model_spec().layers.len() as u32;
        for step in [5u64, 7] {
            let flat: Vec<f32> = (0..p + files.optim.state_len(p))
                .map(|i| (i as u64 * step) as f32 * 0.01)
                .collect();
            // Two shards, as two stages write them, each with the digest of its slots.
            let shards: Vec<String> = [(0, 1), (1, layers)]
                .iter()
                .map(|&(a, b)| {
                    let slots = crate::layout::layer_slots(
                        &files.net,
                        &files.optim,
                        LayerRange { start: a, end: b },
                    );
                    let values = ravnest_runtime::seams::gather(&flat, &slots).unwrap();
                    let d = ravnest_protocol::digest::digest(&values);
                    format!(
                        "{{\"node\":0,\"layers\":[{a},{b}],\"digest\":\"{d:016x}\",\"bytes\":0}}"
                    )
                })
                .collect();
            let manifest = format!("{{\"step\":{step},\"shards\":[{}]}}", shards.join(","));
            files.write(step, &flat, &manifest).unwrap();
        }
        assert_eq!(files.newest_intact().unwrap(), Some((7, vec![])));
        // One value of step 7's optimizer state changes on disk (the file's last bytes).
        let optim = files.optim_path(7);
        let mut bytes = std::fs::read(&optim).unwrap();
        let n = bytes.len();
        bytes[n - 6] ^= 0x40;
        std::fs::write(&optim, &bytes).unwrap();
        let (step, refused) = files.newest_intact().unwrap().unwrap();
        assert_eq!(step, 5);
        assert_eq!(refused.len(), 1);
        assert!(
            refused[0].contains("step 7")
                && refused[0].contains(&files.path(7).display().to_string())
                && refused[0].contains("changed or damaged"),
            "{refused:?}"
        );
        assert_eq!(Store::latest(&files).unwrap().0, 5);
        // A weight of step 5 too: nothing intact is left, and that is an error, not a start
        // from scratch.
        let weights = files.path(5);
        let mut bytes = std::fs::read(&weights).unwrap();
        let n = bytes.len();
        bytes[n - 2] ^= 0x01;
        std::fs::write(&weights, &bytes).unwrap();
        let e = files.newest_intact().unwrap_err().to_string();
        assert!(
            e.contains("layers") && e.contains("step-00000007.json"),
            "{e}"
        );
        assert!(Store::latest(&files).is_none());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A stale coordinator's checkpoint actor (an older term) cannot write into a folder its
    /// successor (a newer term) wrote to; the successor's checkpoint stays, and records its term.
    #[test]
    fn a_write_of_an_older_term_is_refused_and_the_newer_one_stays() {
        use ravnest_core::checkpoint::ShardMeta;
        let dir = std::env::temp_dir().join(format!("ravnest-store-t-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let net = Network::Mlp {
            dims: vec![3, 4, 2],
        };
        let old = files_at(&dir, net, Optimizer::Sgd);
        let new = CheckpointFiles {
            term: 1,
            ..old.clone()
        };
        let n = old.net.params() + old.optim.state_len(old.net.params());
        let layers = LayerRange::new(0, 2);
        let commit = |f: &CheckpointFiles, step: u64, x: f32| {
            f.put(step, layers, 0, &vec![x; n]).unwrap();
            let shards = vec![ShardMeta {
                node: ravnest_core::NodeId(0),
                layers,
                digest: 0,
                bytes: 4 * n as u64,
            }];
            f.commit(&Manifest { step, shards })
        };
        commit(&old, 10, 1.0).unwrap();
        commit(&new, 20, 2.0).unwrap();
        assert_eq!(new.folder_term(), 1);
        let e = commit(&old, 30, 3.0).unwrap_err().to_string();
        assert!(e.contains("term 1") && e.contains("(0) is older"), "{e}");
        assert!(!old.path(30).exists(), "the stale write left a file");
        assert_eq!(new.load(20).unwrap()[0], 2.0);
        let manifest = std::fs::read_to_string(new.manifest_path(20)).unwrap();
        assert!(manifest.contains("\"term\":1"), "{manifest}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_checkpoint_of_another_network_is_refused_by_name() {
        let dir = std::env::temp_dir().join(format!("ravnest-store-x-{}", std::process::id()));
        let o = Optim {
            kind: Optimizer::Sgd,
            lr: 0.1,
            momentum: 0.0,
            weight_decay: 0.0,
            schedule: ravnest_core::recipe::Schedule::CONSTANT,
        };
        let a = CheckpointFiles {
            hf_source: None,
            term: 0,
            dir: dir.clone(),
            net: Network::Mlp {
                dims: vec![3, 4, 2],
            },
            optim: o,
            meta: BTreeMap::new(),
        };
        a.write(1, &vec![0.0; a.net.params()], "{}").unwrap();
        let b = CheckpointFiles {
            term: 0,
            net: Network::Mlp {
                dims: vec![3, 5, 2],
            },
            ..a.clone()
        };
        let e = b.load(1).unwrap_err().to_string();
        assert!(
            e.contains("fc0.bias") && e.contains("expected F32 [5]"),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
    #[test]
    fn a_gpt_loads_from_its_folder_a_step_file_or_the_run_folder() {
        let g = Gpt::gpt2(1, 8, 2, 4, 16);
        let run = std::env::temp_dir().join(format!("ravnest-store-gpt-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&run);
        let dir = run.join("checkpoints");
        let files = files_at(&dir, Network::Gpt(g), Optimizer::Adamw);
        let p = files.net.params();
        let flat: Vec<f32> = (0..p + files.optim.state_len(p))
            .map(|i| (i % 13) as f32 * 0.25 - 1.0)
            .collect();
        files.write(1, &vec![0.0; flat.len()], "{}").unwrap();
        files.write(2, &flat, "{}").unwrap();
        let want = (g, flat[..p].to_vec());
        assert_eq!(load_gpt(&dir).unwrap(), want);
        assert_eq!(load_gpt(&run).unwrap(), want);
        assert_eq!(load_gpt(&files.path(2)).unwrap(), want);
        assert_eq!(load_gpt(&files.path(1)).unwrap().1, vec![0.0; p]);
        // Without model.safetensors: the step `latest` names.
        std::fs::remove_file(dir.join("model.safetensors")).unwrap();
        assert_eq!(load_gpt(&dir).unwrap(), want);

        // A file without metadata takes its shape from config.json; a tensor it lacks is named.
        let layout = files.net.layout();
        let entries: Vec<Entry> = layout
            .iter()
            .filter(|t| t.name != "lm_head.weight")
            .map(|t| (t.name.clone(), t.shape.clone(), t.offset, t.len()))
            .collect();
        let bare = dir.join("bare.safetensors");
        let mut fill = |off: usize, len: usize, out: &mut Vec<f32>| -> std::io::Result<()> {
            out.extend_from_slice(&flat[off..off + len]);
            Ok(())
        };
        write::safetensors_atomic(&bare, &entries, &HashMap::new(), &mut fill).unwrap();
        let e = load_gpt(&bare).unwrap_err().to_string();
        assert!(
            e.starts_with(&bare.display().to_string())
                && e.contains("no tensor `lm_head.weight` (a GPT of 1 layers, hidden 8")
                && e.contains("config.json says, has it"),
            "{e}"
        );
        std::fs::remove_file(dir.join("config.json")).unwrap();
        let e = load_gpt(&bare).unwrap_err().to_string();
        assert!(e.contains("no `model` metadata and no config.json"), "{e}");

        let e = load_gpt(&run.join("nothing")).unwrap_err().to_string();
        assert!(e.ends_with("nothing: no such file or folder"), "{e}");
        std::fs::write(dir.join("latest"), "x\n").unwrap();
        let e = load_gpt(&dir).unwrap_err().to_string();
        assert!(e.contains("latest: `x` is not a step number"), "{e}");
        std::fs::remove_dir_all(&run).unwrap();
    }
}
