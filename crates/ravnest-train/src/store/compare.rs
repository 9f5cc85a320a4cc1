//! Comparing two checkpoints' models, tensor by tensor (the chaos suite's and the NAT test's
//! judge: a run's final model against a single-node run of the same steps).

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;

/// A safetensors file's float tensors (name -> values), optimizer state left out.
pub fn float_tensors(path: &Path) -> Result<BTreeMap<String, Vec<f32>>, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let bad = |what: &str| format!("{}: {what}", path.display());
    let head: [u8; 8] = bytes
        .get(..8)
        .and_then(|h| h.try_into().ok())
        .ok_or_else(|| bad("shorter than a safetensors header"))?;
    let n = u64::from_le_bytes(head) as usize;
    let header: Value = bytes
        .get(8..8usize.saturating_add(n))
        .and_then(|h| serde_json::from_slice(h).ok())
        .ok_or_else(|| bad("a cut or unreadable header"))?;
    let data = &bytes[8 + n..];
    let mut out = BTreeMap::new();
    let tensors = header
        .as_object()
        .ok_or_else(|| bad("header is not an object"))?;
    for (k, v) in tensors {
        if k == "__metadata__" || k.starts_with("optim") {
            continue;
        }
        let at = |i: usize| v["data_offsets"][i].as_u64().unwrap_or(0) as usize;
        let raw = data
            .get(at(0)..at(1))
            .ok_or_else(|| bad("a tensor outside the file"))?;
        out.insert(
            k.clone(),
            raw.chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
                .collect(),
        );
    }
    Ok(out)
}

/// The largest relative difference between two models, tensor by tensor:
/// |a - b| / |b| (Euclidean norms).
pub fn worst_difference(a: &BTreeMap<String, Vec<f32>>, b: &BTreeMap<String, Vec<f32>>) -> f64 {
    if a.keys().ne(b.keys()) {
        return f64::INFINITY;
    }
    let mut worst = 0f64;
    for (k, x) in a {
        let y = &b[k];
        if x.len() != y.len() {
            return f64::INFINITY;
        }
        let (mut d, mut n) = (0f64, 0f64);
        for (p, q) in x.iter().zip(y) {
            d += (*p as f64 - *q as f64).powi(2);
            n += (*q as f64).powi(2);
        }
        let r = d.sqrt() / n.sqrt().max(1e-12);
        worst = if r.is_nan() {
            f64::INFINITY
        } else {
            worst.max(r)
        };
    }
    worst
}
