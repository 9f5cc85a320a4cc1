//! A checkpoint's values checked against the digests its manifest holds (the digests the
//! replicas agreed on when it was written), before a run starts from it: a file changed or
//! damaged on disk after it was written is refused by name, never trained on.

use std::path::Path;

use ravnest_core::LayerRange;
use ravnest_protocol::digest::Digest;

use super::reader::CheckpointReader;
use super::{CheckpointFiles, LoadError};

fn error(path: &Path, message: String) -> LoadError {
    LoadError {
        path: path.display().to_string(),
        message,
    }
}

impl CheckpointFiles {
    /// The manifest of the checkpoint of `step`.
    pub fn manifest_path(&self, step: u64) -> std::path::PathBuf {
        self.dir.join(format!("step-{step:08}.json"))
    }

    /// Check every shard of the checkpoint of `step`: its values, read from the files one
    /// tensor at a time in the order the shard was written, must give the digest its manifest
    /// holds.
    pub fn verify(&self, step: u64) -> Result<(), LoadError> {
        let manifest = self.manifest_path(step);
        let text =
            std::fs::read_to_string(&manifest).map_err(|e| error(&manifest, e.to_string()))?;
        let v: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| error(&manifest, format!("not a manifest: {e}")))?;
        let shards = v["shards"]
            .as_array()
            .filter(|s| !s.is_empty())
            .ok_or_else(|| {
                error(
                    &manifest,
                    "no shards: nothing to check the files against".into(),
                )
            })?;
        let reader = CheckpointReader::open(self, step)?;
        let mut entries = self.weight_entries();
        entries.extend(self.optim_entries());
        for s in shards {
            let (Some(a), Some(b), Some(want)) = (
                s["layers"][0].as_u64(),
                s["layers"][1].as_u64(),
                s["digest"]
                    .as_str()
                    .and_then(|d| u64::from_str_radix(d, 16).ok()),
            ) else {
                return Err(error(
                    &manifest,
                    format!("a shard without layers or digest: {s}"),
                ));
            };
            let layers = LayerRange {
                start: a as u32,
                end: b as u32,
            };
            let mut d = Digest::default();
            for r in crate::layout::layer_slots(&self.net, &self.optim, layers) {
                for (name, _, off, len) in &entries {
                    let (lo, hi) = (r.start.max(*off), r.end.min(off + len));
                    if lo >= hi {
                        continue;
                    }
                    let t = reader
                        .tensor(name, *len)
                        .map_err(|e| error(&self.path(step), e.to_string()))?;
                    d.update(&t[lo - off..hi - off]);
                }
            }
            let got = d.finish();
            if got != want {
                return Err(error(
                    &self.path(step),
                    format!(
                        "layers {a}..{b} are not what was written (digest {got:016x}; {} says {want:016x}): the file was changed or damaged since",
                        manifest.display()
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The steps of the checkpoints in the folder (those with a manifest), newest first.
    pub fn steps(&self) -> Vec<u64> {
        let mut out: Vec<u64> = std::fs::read_dir(&self.dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                name.strip_prefix("step-")?
                    .strip_suffix(".json")?
                    .parse()
                    .ok()
            })
            .collect();
        out.sort_unstable_by(|a, b| b.cmp(a));
        out
    }

    /// The newest checkpoint that verifies, no newer than the one `latest` names, with what
    /// was refused on the way (each a line naming the file and the fault); `Ok(None)` where
    /// there is no `latest`; an error where none verifies (the newest one's fault).
    pub fn newest_intact(&self) -> Result<Option<(u64, Vec<String>)>, LoadError> {
        let Some(latest) = self.latest()? else {
            return Ok(None);
        };
        let mut refused = Vec::new();
        let mut first = None;
        let mut candidates = vec![latest];
        candidates.extend(self.steps().into_iter().filter(|s| *s < latest));
        for step in candidates {
            match self.verify(step) {
                Ok(()) => return Ok(Some((step, refused))),
                Err(e) => {
                    refused.push(format!("the checkpoint of step {step} is refused: {e}"));
                    first.get_or_insert(e);
                }
            }
        }
        Err(first.expect("latest was a candidate"))
    }
}
