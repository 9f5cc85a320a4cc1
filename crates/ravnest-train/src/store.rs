//! Checkpoint files: the merged model and optimizer state as one safetensors file per
//! checkpoint, a JSON manifest beside it, and a `latest` pointer, each written atomically
//! (temporary file, fsync, rename, fsync of the directory), so a crash at any moment leaves
//! either the previous checkpoint or the new one, never a torn file.
//!
//! Tensor names: the network's own (`fc0.weight`, …), and the optimizer state as
//! `optim.<state>.<name>` plus `optim.step` (AdamW). Metadata records the step, network and
//! optimizer.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use ravnest_core::checkpoint::Manifest;
use ravnest_runtime::checkpoint::Store;
use safetensors::{Dtype, SafeTensors};

use crate::net::Network;
use crate::optim::Optim;

/// Where a run's checkpoints go.
#[derive(Debug, Clone)]
pub struct CheckpointFiles {
    /// Directory.
    pub dir: PathBuf,
    /// The network.
    pub net: Network,
    /// The optimizer (its state's names and length).
    pub optim: Optim,
}

/// A checkpoint could not be read.
#[derive(Debug, thiserror::Error)]
#[error("{path}: {message}")]
pub struct LoadError {
    /// File.
    pub path: String,
    /// What is wrong.
    pub message: String,
}

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

impl CheckpointFiles {
    /// (name, shape, offset, len) of every tensor in the flat vector, in flat order.
    fn entries(&self) -> Vec<(String, Vec<usize>, usize, usize)> {
        let layout = self.net.layout();
        let p = self.net.params();
        let mut out: Vec<_> = layout
            .iter()
            .map(|t| (t.name.clone(), t.shape.clone(), t.offset, t.len()))
            .collect();
        for (k, state) in self.optim.state_names().iter().enumerate() {
            for t in &layout {
                out.push((
                    format!("optim.{state}.{}", t.name),
                    t.shape.clone(),
                    p * (k + 1) + t.offset,
                    t.len(),
                ));
            }
        }
        if self.optim.state_len(p) > self.optim.state_names().len() * p {
            out.push((
                "optim.step".into(),
                vec![1],
                p * (1 + self.optim.state_names().len()),
                1,
            ));
        }
        out
    }

    /// Path of the checkpoint of `step`.
    pub fn path(&self, step: u64) -> PathBuf {
        self.dir.join(format!("step-{step:08}.safetensors"))
    }

    /// Write the checkpoint of `step` (flat model = parameters then optimizer state).
    pub fn write(&self, step: u64, flat: &[f32], manifest_json: &str) -> std::io::Result<PathBuf> {
        std::fs::create_dir_all(&self.dir)?;
        let entries = self.entries();
        let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = entries
            .into_iter()
            .map(|(name, shape, off, len)| {
                let raw = flat[off..off + len]
                    .iter()
                    .flat_map(|x| x.to_le_bytes())
                    .collect();
                (name, shape, raw)
            })
            .collect();
        let views = bytes
            .iter()
            .map(|(n, shape, raw)| {
                safetensors::tensor::TensorView::new(Dtype::F32, shape.clone(), raw)
                    .map(|v| (n.clone(), v))
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(std::io::Error::other)?;
        let meta = HashMap::from([
            ("step".to_string(), step.to_string()),
            ("network".to_string(), format!("{:?}", self.net)),
            (
                "optimizer".to_string(),
                self.optim.kind.as_str().to_string(),
            ),
        ]);
        let file = safetensors::serialize(views, Some(meta)).map_err(std::io::Error::other)?;
        let path = self.path(step);
        write_atomic(&path, &file)?;
        write_atomic(
            &self.dir.join(format!("step-{step:08}.json")),
            manifest_json.as_bytes(),
        )?;
        write_atomic(&self.dir.join("latest"), format!("{step}\n").as_bytes())?;
        Ok(path)
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

    /// Read the checkpoint of `step` back into a flat vector, checking every tensor.
    pub fn load(&self, step: u64) -> Result<Vec<f32>, LoadError> {
        let path = self.path(step);
        let err = |m: String| LoadError {
            path: path.display().to_string(),
            message: m,
        };
        let bytes = std::fs::read(&path).map_err(|e| err(e.to_string()))?;
        let st = SafeTensors::deserialize(&bytes).map_err(|e| err(e.to_string()))?;
        let p = self.net.params();
        let mut flat = vec![0.0f32; p + self.optim.state_len(p)];
        for (name, shape, off, len) in self.entries() {
            let t = st.tensor(&name).map_err(|_| {
                err(format!(
                    "no tensor `{name}` (the checkpoint is of another network or optimizer)"
                ))
            })?;
            if t.dtype() != Dtype::F32 || t.shape() != shape.as_slice() {
                return Err(err(format!(
                    "`{name}` is {:?} {:?}, expected F32 {shape:?}",
                    t.dtype(),
                    t.shape()
                )));
            }
            for (dst, b) in flat[off..off + len]
                .iter_mut()
                .zip(t.data().chunks_exact(4))
            {
                *dst = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        Ok(flat)
    }
}

fn manifest_json(m: &Manifest, file: &Path) -> String {
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
        "file": file.file_name().and_then(|f| f.to_str()),
        "shards": shards,
    })
    .to_string()
}

impl Store for CheckpointFiles {
    fn commit(&self, manifest: &Manifest, shards: &[Vec<f32>]) -> Result<(), String> {
        let flat: Vec<f32> = shards.concat();
        let p = self.net.params();
        if flat.len() != p + self.optim.state_len(p) {
            return Err(format!(
                "the shards hold {} values; the model and optimizer state have {}",
                flat.len(),
                p + self.optim.state_len(p)
            ));
        }
        let path = self.path(manifest.step);
        self.write(manifest.step, &flat, &manifest_json(manifest, &path))
            .map(|_| ())
            .map_err(|e| format!("{}: {e}", path.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ravnest_core::Optimizer;

    #[test]
    fn write_then_load_is_exact_for_every_optimizer() {
        for kind in [Optimizer::Sgd, Optimizer::SgdMomentum, Optimizer::Adamw] {
            let dir =
                std::env::temp_dir().join(format!("ravnest-store-{}-{kind:?}", std::process::id()));
            let files = CheckpointFiles {
                dir: dir.clone(),
                net: Network::Mlp {
                    dims: vec![3, 4, 2],
                },
                optim: Optim {
                    kind,
                    lr: 0.1,
                    momentum: 0.9,
                    weight_decay: 0.0,
                },
            };
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

    #[test]
    fn a_checkpoint_of_another_network_is_refused_by_name() {
        let dir = std::env::temp_dir().join(format!("ravnest-store-x-{}", std::process::id()));
        let o = Optim {
            kind: Optimizer::Sgd,
            lr: 0.1,
            momentum: 0.0,
            weight_decay: 0.0,
        };
        let a = CheckpointFiles {
            dir: dir.clone(),
            net: Network::Mlp {
                dims: vec![3, 4, 2],
            },
            optim: o,
        };
        a.write(1, &vec![0.0; a.net.params()], "{}").unwrap();
        let b = CheckpointFiles {
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
}
