//! The MLP's training step written out layer by layer, without candle's autograd.
//!
//! Why by hand: backward then produces each layer's gradient as soon as it is known (the last
//! layer first), so the runtime reduces it while the earlier layers' backward still runs (as
//! PyTorch DDP's buckets do); and the step does only the work it needs. candle's matmul (the
//! `gemm` crate) does the heavy lifting; the bias, ReLU, softmax and their gradients are single
//! passes over contiguous slices instead of a graph of broadcast operations. Profiled on the
//! 64-512-512-10 MLP at batch 384 (single thread): candle's autograd step spent a third of its
//! time outside matrix products (reductions over the batch axis, broadcasts, masks).
//!
//! The gradient is checked against candle's autograd ([`crate::net::Network::loss_and_grad_sum`])
//! and against finite differences in the tests below.

use std::ops::Range;

use candle_core::{Device, Storage, Tensor};
use ravnest_core::LayerRange;

/// Where layer `i`'s parameters sit in the flat model (sorted names: `fc{i}.bias` first).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerSlots {
    /// `fc{i}.bias`: `dims[i + 1]` values.
    pub bias: Range<usize>,
    /// `fc{i}.weight`: `dims[i + 1] x dims[i]`, row-major.
    pub weight: Range<usize>,
    /// Index of `fc{i}.bias` among the network's tensors.
    pub bias_at: usize,
    /// Index of `fc{i}.weight` among the network's tensors.
    pub weight_at: usize,
}

/// Buckets of consecutive layers, each layer's gradient a contiguous range of the flat
/// gradient (`layers`, in order): from the last layer down, each merged with the layers below
/// it until it holds at least `min_params` values (a small last layer rides with the one
/// before it). In the order backward finishes them. The MLP's and the decoder's alike.
pub fn layer_buckets(
    layers: &[Range<usize>],
    min_params: usize,
) -> Vec<(LayerRange, Range<usize>)> {
    let mut out = Vec::new();
    let mut hi = layers.len();
    while hi > 0 {
        let mut lo = hi - 1;
        let size = |lo: usize| layers[hi - 1].end - layers[lo].start;
        while lo > 0 && size(lo) < min_params {
            lo -= 1;
        }
        out.push((
            LayerRange::from(lo..hi),
            layers[lo].start..layers[hi - 1].end,
        ));
        hi = lo;
    }
    out
}

/// The MLP's buckets ([`layer_buckets`] over its layers' slots).
pub fn buckets(slots: &[LayerSlots], min_params: usize) -> Vec<(LayerRange, Range<usize>)> {
    let layers: Vec<Range<usize>> = slots.iter().map(|s| s.bias.start..s.weight.end).collect();
    layer_buckets(&layers, min_params)
}

/// An MLP as its hand-written step sees it.
#[derive(Debug, Clone, Copy)]
pub struct Shape<'a> {
    /// Layer widths.
    pub dims: &'a [usize],
    /// Where each layer's parameters sit.
    pub slots: &'a [LayerSlots],
    /// The gradient's buckets ([`buckets`]).
    pub buckets: &'a [(LayerRange, Range<usize>)],
}

/// Run `f` on a contiguous f32 CPU tensor's values, without copying them.
fn with_values<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> candle_core::Result<R> {
    let (storage, layout) = t.storage_and_layout();
    match (&*storage, layout.contiguous_offsets()) {
        (Storage::Cpu(cpu), Some((a, b))) => Ok(f(&cpu.as_slice::<f32>()?[a..b])),
        _ => Err(candle_core::Error::Msg(
            "expected a contiguous f32 tensor on the CPU".into(),
        )),
    }
}

/// Softmax cross-entropy of `logits` (rows of `k` classes) against the labels `y`: (Σ −log p(y),
/// its gradient by the logits, p − onehot(y)).
fn softmax_cross_entropy(logits: &[f32], k: usize, y: &[u32]) -> (f64, Vec<f32>) {
    let mut loss = 0.0f64;
    let mut g = Vec::with_capacity(logits.len());
    for (row, &label) in logits.chunks_exact(k).zip(y) {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f32 = row.iter().map(|v| (v - max).exp()).sum();
        let log_sum = max + sum.ln();
        loss -= f64::from(row[label as usize] - log_sum);
        for (j, v) in row.iter().enumerate() {
            let p = (v - log_sum).exp();
            g.push(if j == label as usize { p - 1.0 } else { p });
        }
    }
    (loss, g)
}

/// Σ over the batch of the cross-entropy loss of an MLP (ReLU between layers), handing the
/// gradient sum to `sink` bucket by bucket: `sink(k, values)` for bucket k of `buckets`
/// (from [`buckets`]), in order. `x` holds `y.len()` rows of `dims[0]` values; `params[i]` is
/// the network's tensor i, as it is held on the CPU (read in place).
pub fn loss_and_grad(
    shape: &Shape<'_>,
    params: &[Tensor],
    x: &[f32],
    y: &[u32],
    sink: &mut dyn FnMut(usize, Vec<f32>),
    zeroed: &mut dyn FnMut(usize) -> Vec<f32>,
) -> candle_core::Result<f64> {
    let Shape {
        dims,
        slots,
        buckets,
    } = *shape;
    let dev = Device::Cpu;
    let b = y.len();
    let n = dims.len() - 1;
    let weights: Vec<Tensor> = (0..n)
        .map(|i| params[slots[i].weight_at].reshape((dims[i + 1], dims[i])))
        .collect::<candle_core::Result<_>>()?;
    // Forward, keeping each layer's input (ReLU output) for backward.
    let mut acts = vec![Tensor::from_slice(x, (b, dims[0]), &dev)?];
    for i in 0..n {
        let z = acts[i].matmul(&weights[i].t()?)?;
        let relu = i + 1 < n;
        let h = with_values(&params[slots[i].bias_at], |bias| {
            with_values(&z, |z| {
                let mut h = Vec::with_capacity(z.len());
                for row in z.chunks_exact(dims[i + 1]) {
                    for (v, bj) in row.iter().zip(bias) {
                        let s = v + bj;
                        h.push(if relu { s.max(0.0) } else { s });
                    }
                }
                h
            })
        })??;
        acts.push(Tensor::from_vec(h, (b, dims[i + 1]), &dev)?);
    }
    // Softmax cross-entropy: loss = Σ −log p[y]; its gradient by the logits is p − onehot(y).
    let k = dims[n];
    let (loss, g) = with_values(&acts[n], |logits| softmax_cross_entropy(logits, k, y))?;
    crate::phases::forward_done();
    let mut g = Tensor::from_vec(g, (b, k), &dev)?;
    // Backward, last layer first; a bucket goes out as soon as its lowest layer is done.
    let mut bucket = buckets.len();
    let mut buf: Vec<f32> = Vec::new();
    for i in (0..n).rev() {
        let Some(kb) = buckets.iter().position(|b| b.0.range().contains(&i)) else {
            continue;
        };
        let (layers, range) = &buckets[kb];
        if kb != bucket {
            bucket = kb;
            buf = zeroed(range.len());
        }
        let dw = g.t()?.matmul(&acts[i])?;
        with_values(&dw, |d| {
            buf[slots[i].weight.start - range.start..slots[i].weight.end - range.start]
                .copy_from_slice(d);
        })?;
        with_values(&g, |g| {
            let db = &mut buf[slots[i].bias.start - range.start..slots[i].bias.end - range.start];
            for row in g.chunks_exact(dims[i + 1]) {
                for (a, v) in db.iter_mut().zip(row) {
                    *a += v;
                }
            }
        })?;
        // The bucket is complete when its lowest layer's weights and bias are: it goes out
        // before the gradient flows on through that layer's weights (a product as large as
        // its weights' own), so its ring runs beside that product.
        if i == layers.range().start {
            sink(kb, std::mem::take(&mut buf));
        }
        if i > 0 {
            // Through the weights, then ReLU's gradient: zero where the layer's output was.
            let gh = g.matmul(&weights[i])?;
            let masked = with_values(&gh, |gh| {
                with_values(&acts[i], |h| {
                    gh.iter()
                        .zip(h)
                        .map(|(g, h)| if *h > 0.0 { *g } else { 0.0 })
                        .collect::<Vec<f32>>()
                })
            })??;
            g = Tensor::from_vec(masked, (b, dims[i]), &dev)?;
        }
    }
    Ok(loss)
}
