//! The networks `ravnest run` trains, in candle: an MLP, a small CNN, and a character model.
//!
//! A model is one flat `Vec<f32>`: its tensors in sorted name order (the order every node, the
//! ring all-reduce and the checkpoint files agree on). A forward/backward pass wraps slices of
//! it as candle `Var`s, and flattens the gradients back in the same order.

use std::ops::Range;

use candle_core::{D, DType, Device, Tensor, Var};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use ravnest_core::ModelSpec;
use ravnest_core::model::LayerSpec;

/// Which network.
#[derive(Debug, Clone, PartialEq)]
pub enum Network {
    /// Fully connected layers with ReLU between them: `dims[0]` inputs, `dims.last()` classes.
    Mlp {
        /// Layer widths.
        dims: Vec<usize>,
    },
    /// conv 3x3 (8 channels) → ReLU → conv 3x3 (16) → ReLU → max-pool 2 → linear.
    Cnn {
        /// Image side (square, one channel).
        side: usize,
        /// Classes.
        classes: usize,
    },
    /// Next-character model: each of the last `context` characters embedded (`embed` wide),
    /// concatenated → linear to `hidden` → tanh → linear to `vocab` logits.
    Char {
        /// Characters of context.
        context: usize,
        /// Distinct characters.
        vocab: usize,
        /// Embedding width.
        embed: usize,
        /// Hidden width.
        hidden: usize,
    },
    /// A GPT-2-style decoder over byte tokens ([`crate::gpt`]); a sample is `seq + 1` tokens.
    /// Its tensors are laid out layer by layer (not by name): a pipeline stage's parameters
    /// are one slice.
    Gpt(crate::gpt::Gpt),
}

/// Gradient buckets are merged up to at least this many values (256 KiB): smaller ones would
/// cost more in per-collective overhead than their overlap saves. The cost model's figure
/// ([`ravnest_core::cost::BUCKET_MIN_PARAMS`]), so that it plans with the buckets we make.
pub const BUCKET_MIN_PARAMS: usize = ravnest_core::cost::BUCKET_MIN_PARAMS as usize;

/// Embedding width of the character model.
pub const CHAR_EMBED: usize = 24;

/// A name's sort key where runs of digits compare as numbers: `fc2.bias` < `fc10.bias`.
fn natural_key(name: &str) -> Vec<(String, u64)> {
    let mut out = Vec::new();
    let mut text = String::new();
    let mut digits = String::new();
    for c in name.chars() {
        if c.is_ascii_digit() {
            digits.push(c);
        } else {
            if !digits.is_empty() {
                out.push((
                    std::mem::take(&mut text),
                    digits.parse().unwrap_or(u64::MAX),
                ));
                digits.clear();
            }
            text.push(c);
        }
    }
    out.push((text, digits.parse().unwrap_or(0)));
    out
}

/// One tensor of the flat model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Param {
    /// Name (e.g. `fc0.weight`).
    pub name: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// Offset in the flat model.
    pub offset: usize,
    /// Fan-in for initialization.
    fan_in: usize,
}

impl Param {
    /// Elements.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

const C1: usize = 8;
const C2: usize = 16;

/// [`crate::mlp::layer_buckets`] of layers of `sizes` parameters each, laid out one after
/// another: the buckets' ranges in the flat gradient.
fn layer_buckets(sizes: &[usize], min: usize) -> Vec<Range<usize>> {
    let layers: Vec<Range<usize>> = sizes
        .iter()
        .scan(0, |at, n| {
            *at += n;
            Some(*at - n..*at)
        })
        .collect();
    crate::mlp::layer_buckets(&layers, min)
        .into_iter()
        .map(|b| b.1)
        .collect()
}

impl Network {
    /// The network's tensors, sorted by name, with offsets.
    pub fn layout(&self) -> Vec<Param> {
        if let Network::Gpt(g) = self {
            let mut offset = 0;
            return g
                .params_in_order()
                .into_iter()
                .map(|p| {
                    let fan_in = p.shape[0];
                    let param = Param {
                        name: p.name,
                        shape: p.shape,
                        offset,
                        fan_in,
                    };
                    offset += param.len();
                    param
                })
                .collect();
        }
        let mut raw: Vec<(String, Vec<usize>, usize)> = match self {
            Network::Mlp { dims } => dims
                .windows(2)
                .enumerate()
                .flat_map(|(i, w)| {
                    [
                        (format!("fc{i}.weight"), vec![w[1], w[0]], w[0]),
                        (format!("fc{i}.bias"), vec![w[1]], w[0]),
                    ]
                })
                .collect(),
            Network::Cnn { side, classes } => {
                let flat = C2 * (side / 2) * (side / 2);
                vec![
                    ("conv1.weight".into(), vec![C1, 1, 3, 3], 9),
                    ("conv1.bias".into(), vec![C1], 9),
                    ("conv2.weight".into(), vec![C2, C1, 3, 3], 9 * C1),
                    ("conv2.bias".into(), vec![C2], 9 * C1),
                    ("fc.weight".into(), vec![*classes, flat], flat),
                    ("fc.bias".into(), vec![*classes], flat),
                ]
            }
            Network::Char {
                context,
                vocab,
                embed,
                hidden,
            } => {
                let wide = context * embed;
                vec![
                    // Fan-in 3: embeddings start in ±0.58, not ±1, so tanh does not saturate.
                    ("emb.weight".into(), vec![*vocab, *embed], 3),
                    ("fc0.weight".into(), vec![*hidden, wide], wide),
                    ("fc0.bias".into(), vec![*hidden], wide),
                    ("fc1.weight".into(), vec![*vocab, *hidden], *hidden),
                    ("fc1.bias".into(), vec![*vocab], *hidden),
                ]
            }
            Network::Gpt(_) => Vec::new(),
        };
        // Natural order (`fc2` before `fc10`): each layer's tensors are adjacent and layers
        // come in order, which gradient buckets (ranges of whole layers) rely on.
        raw.sort_by_key(|a| natural_key(&a.0));
        let mut offset = 0;
        raw.into_iter()
            .map(|(name, shape, fan_in)| {
                let p = Param {
                    name,
                    shape,
                    offset,
                    fan_in,
                };
                offset += p.len();
                p
            })
            .collect()
    }

    /// Where each layer's parameters sit, for an MLP (empty for other networks).
    pub fn mlp_slots(&self) -> Vec<crate::mlp::LayerSlots> {
        let Network::Mlp { dims } = self else {
            return Vec::new();
        };
        let layout = self.layout();
        let find = |name: String| {
            layout
                .iter()
                .find(|p| p.name == name)
                .map_or(0..0, |p| p.offset..p.offset + p.len())
        };
        let at = |name: String| layout.iter().position(|p| p.name == name).unwrap_or(0);
        (0..dims.len() - 1)
            .map(|i| crate::mlp::LayerSlots {
                bias: find(format!("fc{i}.bias")),
                weight: find(format!("fc{i}.weight")),
                bias_at: at(format!("fc{i}.bias")),
                weight_at: at(format!("fc{i}.weight")),
            })
            .collect()
    }

    /// The gradient's buckets in the order backward finishes them: an MLP's layers, last first
    /// (small layers merged up to [`BUCKET_MIN_PARAMS`]); other networks' whole gradient.
    pub fn grad_buckets(&self) -> Vec<Range<usize>> {
        match self {
            Network::Mlp { .. } => crate::mlp::buckets(&self.mlp_slots(), BUCKET_MIN_PARAMS)
                .into_iter()
                .map(|b| b.1)
                .collect(),
            Network::Gpt(g) => {
                let sizes: Vec<usize> = (0..g.planner_layers())
                    .map(|l| {
                        g.layer_params(l)
                            .iter()
                            .map(|p| p.shape.iter().product::<usize>())
                            .sum()
                    })
                    .collect();
                if sizes.iter().sum::<usize>() != self.params() {
                    return std::iter::once(0..self.params()).collect();
                }
                layer_buckets(&sizes, BUCKET_MIN_PARAMS)
            }
            _ => std::iter::once(0..self.params()).collect(),
        }
    }

    /// Σ over the batch of the cross-entropy loss; its gradient goes to `sink` bucket by bucket
    /// (see [`Network::grad_buckets`]), each as soon as backward has it.
    pub fn loss_and_grad_buckets(
        &self,
        model: &[f32],
        x: &[f32],
        y: &[u32],
        sink: &mut dyn FnMut(usize, Vec<f32>),
    ) -> candle_core::Result<f64> {
        self.loss_and_grad_buckets_into(model, x, y, sink, &mut |n| vec![0.0; n])
    }

    /// [`Network::loss_and_grad_buckets`], taking each bucket's buffer from `zeroed` (a
    /// zero-filled vector of the length asked for).
    pub fn loss_and_grad_buckets_into(
        &self,
        model: &[f32],
        x: &[f32],
        y: &[u32],
        sink: &mut dyn FnMut(usize, Vec<f32>),
        zeroed: &mut dyn FnMut(usize) -> Vec<f32>,
    ) -> candle_core::Result<f64> {
        let dev = crate::device::current();
        let vars: Vec<Var> = self
            .tensors(model, &dev)?
            .into_iter()
            .map(|t| Var::from_tensor(&t))
            .collect::<candle_core::Result<_>>()?;
        self.loss_and_grad_buckets_held(&dev, &vars, x, y, sink, zeroed)
    }

    /// [`Network::loss_and_grad_buckets_into`] with the parameters as they are held (`vars[i]`:
    /// tensor i of [`Network::layout`], on `dev`): nothing is copied to compute.
    pub fn loss_and_grad_buckets_held(
        &self,
        dev: &Device,
        vars: &[Var],
        x: &[f32],
        y: &[u32],
        sink: &mut dyn FnMut(usize, Vec<f32>),
        zeroed: &mut dyn FnMut(usize) -> Vec<f32>,
    ) -> candle_core::Result<f64> {
        match self {
            // The hand-written backward reads values on the CPU; on a GPU, candle's autograd.
            Network::Mlp { dims } if dev.is_cpu() => {
                let slots = self.mlp_slots();
                let buckets = crate::mlp::buckets(&slots, BUCKET_MIN_PARAMS);
                let shape = crate::mlp::Shape {
                    dims,
                    slots: &slots,
                    buckets: &buckets,
                };
                // Detached: the hand-written step builds no autograd graph.
                let params: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().detach()).collect();
                crate::mlp::loss_and_grad(&shape, &params, x, y, sink, zeroed)
            }
            _ => {
                let (loss, grads) = self.loss_and_grads(dev, vars, x, y)?;
                let layout = self.layout();
                for (k, r) in self.grad_buckets().into_iter().enumerate() {
                    let mut buf = zeroed(r.len());
                    for (p, g) in layout.iter().zip(&grads) {
                        if p.offset >= r.start && p.offset + p.len() <= r.end {
                            let at = p.offset - r.start;
                            buf[at..at + p.len()]
                                .copy_from_slice(&g.flatten_all()?.to_vec1::<f32>()?);
                        }
                    }
                    sink(k, buf);
                }
                Ok(loss)
            }
        }
    }

    /// Parameters.
    pub fn params(&self) -> usize {
        self.layout().iter().map(Param::len).sum()
    }

    /// Inputs per sample.
    pub fn inputs(&self) -> usize {
        match self {
            Network::Mlp { dims } => dims[0],
            Network::Cnn { side, .. } => side * side,
            Network::Char { context, .. } => *context,
            Network::Gpt(g) => g.seq + 1,
        }
    }

    /// One layer of a cost-model description.
    fn layer(name: &str, params: u64, flops: u64, act: u64, out: u64) -> LayerSpec {
        LayerSpec {
            name: name.into(),
            params,
            fwd_flops_per_sample: flops as f64,
            activation_elems_per_sample: act,
            output_elems_per_sample: out,
        }
    }

    /// The cost-model description of this network (what the planner plans with).
    pub fn model_spec(&self) -> ModelSpec {
        match self {
            Network::Gpt(g) => g.spec("gpt"),
            Network::Mlp { dims } => {
                let d: Vec<u64> = dims.iter().map(|&x| x as u64).collect();
                ravnest_core::model::mlp_spec("mlp", &d)
            }
            Network::Cnn { side, classes } => {
                let hw = (side * side) as u64;
                let flat = (C2 * (side / 2) * (side / 2)) as u64;
                let (c1, c2, k) = (C1 as u64, C2 as u64, *classes as u64);
                ModelSpec {
                    name: "cnn".into(),
                    layers: vec![
                        Self::layer("conv1", 9 * c1 + c1, 2 * 9 * c1 * hw, hw + c1 * hw, c1 * hw),
                        Self::layer(
                            "conv2",
                            9 * c1 * c2 + c2,
                            2 * 9 * c1 * c2 * hw,
                            c1 * hw + c2 * hw,
                            flat,
                        ),
                        Self::layer("fc", flat * k + k, 2 * flat * k, flat + k, k),
                    ],
                }
            }
            Network::Char {
                context,
                vocab,
                embed,
                hidden,
            } => {
                let (c, v, e, h) = (
                    *context as u64,
                    *vocab as u64,
                    *embed as u64,
                    *hidden as u64,
                );
                ModelSpec {
                    name: "char".into(),
                    layers: vec![
                        Self::layer("emb", v * e, c * e, c + c * e, c * e),
                        Self::layer("fc0", c * e * h + h, 2 * c * e * h, c * e + h, h),
                        Self::layer("fc1", h * v + v, 2 * h * v, h + v, v),
                    ],
                }
            }
        }
    }

    /// Initial weights from a seeded ChaCha RNG: uniform in ±1/√fan_in (PyTorch's default for
    /// linear and conv layers), drawn tensor by tensor in name order.
    pub fn init(&self, seed: u64) -> Vec<f32> {
        if let Network::Gpt(g) = self {
            return g.init(seed);
        }
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut out = Vec::with_capacity(self.params());
        for p in self.layout() {
            let bound = 1.0 / (p.fan_in as f32).sqrt();
            out.extend((0..p.len()).map(|_| rng.random_range(-bound..bound)));
        }
        out
    }

    fn forward(&self, vars: &[Tensor], x: &Tensor) -> candle_core::Result<Tensor> {
        let get = |name: &str| -> &Tensor {
            let layout = self.layout();
            let i = layout
                .iter()
                .position(|p| p.name == name)
                .expect("known name");
            &vars[i]
        };
        match self {
            Network::Mlp { dims } => {
                let mut h = x.clone();
                let n = dims.len() - 1;
                for i in 0..n {
                    let w = get(&format!("fc{i}.weight"));
                    let b = get(&format!("fc{i}.bias"));
                    h = h.matmul(&w.t()?)?.broadcast_add(b)?;
                    if i + 1 < n {
                        h = h.relu()?;
                    }
                }
                Ok(h)
            }
            Network::Cnn { side, .. } => {
                let b = x.dim(0)?;
                let h = x.reshape((b, 1, *side, *side))?;
                let h = h
                    .conv2d(get("conv1.weight"), 1, 1, 1, 1)?
                    .broadcast_add(&get("conv1.bias").reshape((1, C1, 1, 1))?)?
                    .relu()?;
                let h = h
                    .conv2d(get("conv2.weight"), 1, 1, 1, 1)?
                    .broadcast_add(&get("conv2.bias").reshape((1, C2, 1, 1))?)?
                    .relu()?
                    .max_pool2d(2)?
                    .flatten_from(1)?;
                h.matmul(&get("fc.weight").t()?)?
                    .broadcast_add(get("fc.bias"))
            }
            Network::Gpt(_) => candle_core::bail!("the GPT runs through crate::gpt"),
            Network::Char { context, embed, .. } => {
                let b = x.dim(0)?;
                // Inputs are class numbers stored as f32 (exact below 2^24).
                let ids = x.to_dtype(DType::U32)?.flatten_all()?;
                let h = get("emb.weight")
                    .index_select(&ids, 0)?
                    .reshape((b, context * embed))?;
                let h = h
                    .matmul(&get("fc0.weight").t()?)?
                    .broadcast_add(get("fc0.bias"))?
                    .tanh()?;
                h.matmul(&get("fc1.weight").t()?)?
                    .broadcast_add(get("fc1.bias"))
            }
        }
    }

    fn tensors(&self, model: &[f32], dev: &Device) -> candle_core::Result<Vec<Tensor>> {
        self.layout()
            .iter()
            .map(|p| {
                Tensor::from_slice(
                    &model[p.offset..p.offset + p.len()],
                    p.shape.as_slice(),
                    dev,
                )
            })
            .collect()
    }

    /// Σ over the batch of the cross-entropy loss, and its gradient (flat, layout order).
    /// `x` holds `y.len()` rows of [`Network::inputs`] values.
    pub fn loss_and_grad_sum(
        &self,
        model: &[f32],
        x: &[f32],
        y: &[u32],
    ) -> candle_core::Result<(f64, Vec<f32>)> {
        self.loss_and_grad_sum_on(&crate::device::current(), model, x, y)
    }

    /// [`Network::loss_and_grad_sum`] computed on `dev`.
    pub fn loss_and_grad_sum_on(
        &self,
        dev: &Device,
        model: &[f32],
        x: &[f32],
        y: &[u32],
    ) -> candle_core::Result<(f64, Vec<f32>)> {
        if let Network::Gpt(g) = self {
            return g.loss_and_grad_sum(dev, model, x);
        }
        let vars: Vec<Var> = self
            .tensors(model, dev)?
            .into_iter()
            .map(|t| Var::from_tensor(&t))
            .collect::<candle_core::Result<_>>()?;
        let (loss, grads) = self.loss_and_grads(dev, &vars, x, y)?;
        let mut out = Vec::with_capacity(model.len());
        for g in grads {
            out.extend(g.flatten_all()?.to_vec1::<f32>()?);
        }
        Ok((loss, out))
    }

    /// Σ over the batch of the cross-entropy loss, and its gradient per tensor, through
    /// candle's autograd with the parameters as they are held (`vars[i]`: tensor i of
    /// [`Network::layout`]). Not for the GPT ([`crate::gpt`]).
    pub fn loss_and_grads(
        &self,
        dev: &Device,
        vars: &[Var],
        x: &[f32],
        y: &[u32],
    ) -> candle_core::Result<(f64, Vec<Tensor>)> {
        let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let xb = Tensor::from_slice(x, (y.len(), self.inputs()), dev)?;
        let yb = Tensor::from_slice(y, y.len(), dev)?;
        let logp = candle_nn::ops::log_softmax(&self.forward(&ts, &xb)?, D::Minus1)?;
        let loss = logp.gather(&yb.unsqueeze(1)?, 1)?.sum_all()?.neg()?;
        let mut grads = loss.backward()?;
        let each = vars
            .iter()
            .map(|v| match grads.remove(v.as_tensor()) {
                Some(g) => Ok(g),
                None => v.as_tensor().zeros_like(),
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok((
            f64::from(loss.to_dtype(DType::F32)?.to_scalar::<f32>()?),
            each,
        ))
    }

    /// For the character model: extend `prompt` (class numbers, at least `context` long) by
    /// `n` characters, each the most likely next one (greedy). Other networks: empty.
    pub fn continue_text(
        &self,
        model: &[f32],
        prompt: &[u32],
        n: usize,
    ) -> candle_core::Result<Vec<u32>> {
        let Network::Char { context, .. } = self else {
            return Ok(Vec::new());
        };
        if prompt.len() < *context {
            return Ok(Vec::new());
        }
        let dev = crate::device::current();
        let ts = self.tensors(model, &dev)?;
        let mut ids = prompt.to_vec();
        for _ in 0..n {
            let window: Vec<f32> = ids[ids.len() - context..]
                .iter()
                .map(|&k| k as f32)
                .collect();
            let xb = Tensor::from_slice(&window, (1, *context), &dev)?;
            let next = self
                .forward(&ts, &xb)?
                .argmax(D::Minus1)?
                .to_vec1::<u32>()?;
            ids.push(next[0]);
        }
        Ok(ids.split_off(prompt.len()))
    }

    /// The network's configuration as checkpoint metadata records it: `kind` and its sizes
    /// (enough to build the equivalent `torch.nn` module; see `docs/checkpoints.md`).
    pub fn config_json(&self) -> serde_json::Value {
        match self {
            Network::Mlp { dims } => serde_json::json!({"kind": "mlp", "dims": dims}),
            Network::Cnn { side, classes } => serde_json::json!({
                "kind": "cnn", "side": side, "classes": classes, "channels": [C1, C2],
            }),
            Network::Char {
                context,
                vocab,
                embed,
                hidden,
            } => serde_json::json!({
                "kind": "char", "context": context, "vocab": vocab, "embed": embed, "hidden": hidden,
            }),
            Network::Gpt(g) => crate::gpt::model_json(g),
        }
    }

    /// The network's outputs (logits, row-major) for `rows` inputs.
    pub fn logits(&self, model: &[f32], x: &[f32], rows: usize) -> candle_core::Result<Vec<f32>> {
        self.logits_on(&crate::device::current(), model, x, rows)
    }

    /// [`Network::logits`] computed on `dev`.
    pub fn logits_on(
        &self,
        dev: &Device,
        model: &[f32],
        x: &[f32],
        rows: usize,
    ) -> candle_core::Result<Vec<f32>> {
        if let Network::Gpt(g) = self {
            // The tokens of each row but its last (a target only).
            let ids: Vec<u32> = x
                .chunks_exact(g.seq + 1)
                .flat_map(|r| r[..g.seq].iter().map(|&t| t as u32))
                .collect();
            return g.logits(dev, model, &ids, rows)?.flatten_all()?.to_vec1();
        }
        let dev = dev.clone();
        let ts = self.tensors(model, &dev)?;
        let xb = Tensor::from_slice(x, (rows, self.inputs()), &dev)?;
        self.forward(&ts, &xb)?.flatten_all()?.to_vec1::<f32>()
    }

    /// Fraction of rows classified correctly.
    pub fn accuracy(&self, model: &[f32], x: &[f32], y: &[u32]) -> candle_core::Result<f64> {
        if y.is_empty() {
            return Ok(0.0);
        }
        let dev = crate::device::current();
        if let Network::Gpt(g) = self {
            // Next-token accuracy over every position.
            return Ok(g.evaluate(&dev, model, x, 16)?.1);
        }
        let ts = self.tensors(model, &dev)?;
        let xb = Tensor::from_slice(x, (y.len(), self.inputs()), &dev)?;
        let pred = self
            .forward(&ts, &xb)?
            .argmax(D::Minus1)?
            .to_vec1::<u32>()?;
        let right = pred.iter().zip(y).filter(|(a, b)| a == b).count();
        Ok(right as f64 / y.len() as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The character model's gradient agrees with central differences, embeddings included.
    #[test]
    fn char_gradient_matches_finite_differences() {
        let net = Network::Char {
            context: 3,
            vocab: 5,
            embed: 2,
            hidden: 4,
        };
        let w = net.init(5);
        let x = [0.0f32, 4.0, 2.0, 1.0, 1.0, 3.0];
        let y = [3u32, 0];
        let (_, g) = net.loss_and_grad_sum(&w, &x, &y).unwrap();
        // Every coordinate, the embedding rows included.
        for k in 0..w.len() {
            let h = 1e-2f32;
            let mut wp = w.clone();
            wp[k] += h;
            let mut wm = w.clone();
            wm[k] -= h;
            let lp = net.loss_and_grad_sum(&wp, &x, &y).unwrap().0;
            let lm = net.loss_and_grad_sum(&wm, &x, &y).unwrap().0;
            let fd = ((lp - lm) / (2.0 * f64::from(h))) as f32;
            assert!(
                (fd - g[k]).abs() < 2e-2 * (1.0 + fd.abs()),
                "coord {k}: {fd} vs {}",
                g[k]
            );
        }
    }

    /// The analytic gradient agrees with central differences on a few coordinates.
    #[test]
    fn gradient_matches_finite_differences() {
        for net in [
            Network::Mlp {
                dims: vec![4, 5, 3],
            },
            Network::Cnn {
                side: 4,
                classes: 3,
            },
        ] {
            let w = net.init(3);
            let x: Vec<f32> = (0..8)
                .flat_map(|i| (0..net.inputs()).map(move |j| ((i * 7 + j * 3) % 11) as f32 / 11.0))
                .collect();
            let y = [0u32, 2];
            let (_, g) = net
                .loss_and_grad_sum(&w, &x[..2 * net.inputs()], &y)
                .unwrap();
            for k in [0, w.len() / 3, w.len() / 2, w.len() - 1] {
                let h = 1e-2f32;
                let mut wp = w.clone();
                wp[k] += h;
                let mut wm = w.clone();
                wm[k] -= h;
                let lp = net
                    .loss_and_grad_sum(&wp, &x[..2 * net.inputs()], &y)
                    .unwrap()
                    .0;
                let lm = net
                    .loss_and_grad_sum(&wm, &x[..2 * net.inputs()], &y)
                    .unwrap()
                    .0;
                let fd = ((lp - lm) / (2.0 * f64::from(h))) as f32;
                assert!(
                    (fd - g[k]).abs() < 2e-2 * (1.0 + fd.abs()),
                    "{net:?} coord {k}: {fd} vs {}",
                    g[k]
                );
            }
        }
    }

    /// Twelve layers: `fc10` and `fc11` come after `fc9`, so each layer's tensors are adjacent
    /// and the hand-written step's buckets tile the model.
    #[test]
    fn deep_mlps_keep_layers_in_order() {
        let dims: Vec<usize> = [6, 7, 5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 3].to_vec();
        let net = Network::Mlp { dims: dims.clone() };
        let names: Vec<String> = net.layout().iter().map(|p| p.name.clone()).collect();
        let want: Vec<String> = (0..12)
            .flat_map(|i| [format!("fc{i}.bias"), format!("fc{i}.weight")])
            .collect();
        assert_eq!(names, want);
        let w = net.init(4);
        let x: Vec<f32> = (0..2 * dims[0]).map(|i| i as f32 / 9.0).collect();
        let y = [1u32, 2];
        let (_, want) = net.loss_and_grad_sum(&w, &x, &y).unwrap();
        let buckets = net.grad_buckets();
        let mut got = vec![f32::NAN; w.len()];
        net.loss_and_grad_buckets(&w, &x, &y, &mut |k, v| {
            got[buckets[k].clone()].copy_from_slice(&v)
        })
        .unwrap();
        for (a, b) in got.iter().zip(&want) {
            assert!((a - b).abs() < 1e-4 * b.abs().max(1.0), "{a} vs {b}");
        }
    }

    /// A decoder's gradient comes layer by layer from the head down (the embedding alone
    /// holds more than the minimum): the buckets cover it once, top down, on layer bounds.
    #[test]
    fn a_gpts_buckets_are_its_layers_from_the_head_down() {
        let g = crate::gpt::Gpt::gpt2(6, 384, 6, 128, 256);
        let net = Network::Gpt(g);
        let b = net.grad_buckets();
        assert_eq!(b.len(), g.planner_layers(), "{b:?}");
        let mut end = net.params();
        for (r, l) in b.iter().zip((0..g.planner_layers()).rev()) {
            assert_eq!(r.end, end);
            let n: usize = g
                .layer_params(l)
                .iter()
                .map(|p| p.shape.iter().product::<usize>())
                .sum();
            assert_eq!(r.len(), n, "layer {l}");
            end = r.start;
        }
        assert_eq!(end, 0);
        // Small layers ride with the ones below them.
        assert_eq!(layer_buckets(&[5, 10, 3, 2], 6), [5..20, 0..5]);
        let one = layer_buckets(&[5], 6);
        assert_eq!((one.len(), one.first()), (1, Some(&(0..5))));
    }

    /// The cost model and the simulator assume the buckets [`ravnest_core::cost::grad_buckets`]
    /// describes: an MLP's per layer (merged up to a minimum size), any other model's whole
    /// gradient at once (a decoder's comes per layer on the CPU: the model charges it as
    /// exposed, an upper bound). This backend must make exactly those for the MLP and CNN.
    #[test]
    fn grad_buckets_are_the_ones_the_cost_model_plans_with() {
        let nets = [
            Network::Mlp {
                dims: vec![64, 512, 512, 10],
            },
            Network::Mlp {
                dims: vec![16, 256, 64],
            },
            Network::Mlp {
                dims: vec![64, 300, 300, 300, 10],
            },
            Network::Cnn {
                side: 8,
                classes: 10,
            },
        ];
        for net in nets {
            let planned: Vec<usize> = ravnest_core::cost::grad_buckets(&net.model_spec())
                .iter()
                .map(|b| (b.bytes_share * net.params() as f64).round() as usize)
                .collect();
            let made: Vec<usize> = net.grad_buckets().iter().map(|r| r.len()).collect();
            assert_eq!(planned, made, "{net:?}");
            // Made from the top down, covering the gradient once.
            let mut end = net.params();
            for r in net.grad_buckets() {
                assert_eq!(r.end, end, "{net:?}");
                end = r.start;
            }
            assert_eq!(end, 0);
        }
    }

    #[test]
    fn layout_is_sorted_and_dense() {
        let l = Network::Mlp {
            dims: vec![64, 128, 64, 10],
        }
        .layout();
        let names: Vec<&str> = l.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "fc0.bias",
                "fc0.weight",
                "fc1.bias",
                "fc1.weight",
                "fc2.bias",
                "fc2.weight"
            ]
        );
        assert_eq!(
            l.last().map(|p| p.offset + p.len()),
            Some(64 * 128 + 128 + 128 * 64 + 64 + 64 * 10 + 10)
        );
    }

    #[test]
    fn init_is_seeded() {
        let n = Network::Mlp {
            dims: vec![3, 4, 2],
        };
        assert_eq!(n.init(1), n.init(1));
        assert_ne!(n.init(1), n.init(2));
    }
}
