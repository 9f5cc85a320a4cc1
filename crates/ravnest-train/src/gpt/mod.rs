//! A GPT-2-style decoder in candle, split into the layers the planner sees: `embed` (token and
//! position embeddings), `block0 … block{n-1}` (pre-LayerNorm causal self-attention, then an
//! MLP with GELU), and `head` (the final LayerNorm and the LM head). Tokens are bytes
//! (vocabulary 256 by default).
//!
//! Parameters use Hugging Face's GPT-2 names and layouts (`transformer.h.0.attn.c_attn.weight`
//! is `[in, out]`, GPT-2's `Conv1D`), laid out layer by layer in the flat model, so that a
//! pipeline stage's parameters are one contiguous slice ([`Gpt::layer_ranges`]) and a merged
//! checkpoint loads as `GPT2LMHeadModel` (the LM head is not tied to the token embedding: a
//! pipeline keeps them on different stages).
//!
//! A stage's forward runs its layers on the previous stage's hidden states (or the tokens);
//! its backward runs the forward again under candle's autograd (the stage keeps only its input
//! and output between the two, as activation recomputation does) and returns the parameters'
//! gradient and the input's gradient.

use std::ops::Range;

use candle_core::{D, DType, Device, Tensor, Var};

mod fast;
pub mod ops;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// LayerNorm's epsilon (GPT-2's `layer_norm_epsilon`).
pub const LN_EPS: f64 = 1e-5;

/// The shape of a GPT.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gpt {
    /// Transformer blocks.
    pub layers: usize,
    /// Hidden width (`n_embd`).
    pub hidden: usize,
    /// Attention heads.
    pub heads: usize,
    /// Tokens per sample (`n_positions`).
    pub seq: usize,
    /// Vocabulary (256: bytes).
    pub vocab: usize,
}

/// One tensor: Hugging Face name, shape, initialization.
#[derive(Debug, Clone, PartialEq)]
pub struct GptParam {
    /// Name (`transformer.h.0.ln_1.weight`).
    pub name: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// How it starts.
    pub init: Init,
}

/// A tensor's initialization (GPT-2's).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// Normal with this standard deviation.
    Normal(f32),
    /// All zeros.
    Zeros,
    /// All ones.
    Ones,
}

/// What a stage's forward starts from.
#[derive(Debug, Clone, Copy)]
pub enum StageInput<'a> {
    /// The samples' tokens (the first stage): `rows` rows of `seq + 1` tokens (the last is
    /// only a target).
    Tokens(&'a [f32]),
    /// The previous stage's hidden states, `rows · seq · hidden` values.
    Hidden(&'a [f32]),
}

/// The seeded initial values of `p`, tensor `index` of the model: a ChaCha stream of its own.
fn init_tensor(p: &GptParam, seed: u64, index: usize) -> Vec<f32> {
    let n: usize = p.shape.iter().product();
    match p.init {
        Init::Normal(std) => {
            let stream = (index as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            let mut rng = ChaCha8Rng::seed_from_u64(seed ^ stream);
            (0..n).map(|_| std * normal(&mut rng)).collect()
        }
        Init::Zeros => vec![0.0; n],
        Init::Ones => vec![1.0; n],
    }
}

fn normal(rng: &mut ChaCha8Rng) -> f32 {
    // Box-Muller: two uniforms to one standard normal.
    let u1: f32 = rng.random_range(f32::EPSILON..1.0);
    let u2: f32 = rng.random_range(0.0..1.0);
    (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
}

impl Gpt {
    /// Planner layers: embed, the blocks, head.
    pub fn planner_layers(&self) -> usize {
        self.layers + 2
    }

    /// The tensors of planner layer `l`, in their order in the flat model.
    pub fn layer_params(&self, l: usize) -> Vec<GptParam> {
        let (h, v, s) = (self.hidden, self.vocab, self.seq);
        let p = |name: String, shape: Vec<usize>, init| GptParam { name, shape, init };
        let w = Init::Normal(0.02);
        if l == 0 {
            return vec![
                p("transformer.wte.weight".into(), vec![v, h], w),
                p(
                    "transformer.wpe.weight".into(),
                    vec![s, h],
                    Init::Normal(0.01),
                ),
            ];
        }
        if l == self.layers + 1 {
            return vec![
                p("transformer.ln_f.weight".into(), vec![h], Init::Ones),
                p("transformer.ln_f.bias".into(), vec![h], Init::Zeros),
                p("lm_head.weight".into(), vec![v, h], w),
            ];
        }
        let b = format!("transformer.h.{}.", l - 1);
        // GPT-2 scales the projections into the residual stream by 1/√(2·layers).
        let proj = Init::Normal(0.02 / (2.0 * self.layers as f32).sqrt());
        vec![
            p(format!("{b}ln_1.weight"), vec![h], Init::Ones),
            p(format!("{b}ln_1.bias"), vec![h], Init::Zeros),
            p(format!("{b}attn.c_attn.weight"), vec![h, 3 * h], w),
            p(format!("{b}attn.c_attn.bias"), vec![3 * h], Init::Zeros),
            p(format!("{b}attn.c_proj.weight"), vec![h, h], proj),
            p(format!("{b}attn.c_proj.bias"), vec![h], Init::Zeros),
            p(format!("{b}ln_2.weight"), vec![h], Init::Ones),
            p(format!("{b}ln_2.bias"), vec![h], Init::Zeros),
            p(format!("{b}mlp.c_fc.weight"), vec![h, 4 * h], w),
            p(format!("{b}mlp.c_fc.bias"), vec![4 * h], Init::Zeros),
            p(format!("{b}mlp.c_proj.weight"), vec![4 * h, h], proj),
            p(format!("{b}mlp.c_proj.bias"), vec![h], Init::Zeros),
        ]
    }

    /// Every tensor, layer by layer.
    pub fn params_in_order(&self) -> Vec<GptParam> {
        (0..self.planner_layers())
            .flat_map(|l| self.layer_params(l))
            .collect()
    }

    /// Where each planner layer's parameters sit in the flat model.
    pub fn layer_ranges(&self) -> Vec<Range<usize>> {
        let mut at = 0;
        (0..self.planner_layers())
            .map(|l| {
                let n: usize = self
                    .layer_params(l)
                    .iter()
                    .map(|p| p.shape.iter().product::<usize>())
                    .sum();
                at += n;
                at - n..at
            })
            .collect()
    }

    /// Parameters.
    pub fn params(&self) -> usize {
        self.layer_ranges().last().map_or(0, |r| r.end)
    }

    /// Seeded initial weights (GPT-2's scheme), tensor by tensor ([`Gpt::init_tensor`]).
    pub fn init(&self, seed: u64) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.params());
        for (i, p) in self.params_in_order().iter().enumerate() {
            out.extend(init_tensor(p, seed, i));
        }
        out
    }

    /// The seeded initial values of tensor `index` (in [`Gpt::params_in_order`]) alone: each
    /// tensor draws from its own stream, so a stage makes its layers without the others.
    pub fn init_tensor(&self, seed: u64, index: usize) -> Vec<f32> {
        self.params_in_order()
            .get(index)
            .map_or_else(Vec::new, |p| init_tensor(p, seed, index))
    }

    /// The stage's tensors from its parameter slice `params` (layers `layers`), as autograd
    /// variables when `vars`.
    fn stage_tensors(
        &self,
        layers: Range<usize>,
        params: &[f32],
        dev: &Device,
    ) -> candle_core::Result<Vec<Vec<Var>>> {
        let expect: usize = self.layer_ranges()[layers.clone()]
            .iter()
            .map(|r| r.len())
            .sum();
        if params.len() != expect {
            candle_core::bail!(
                "layers {}..{} have {expect} parameters, got {}",
                layers.start,
                layers.end,
                params.len()
            );
        }
        let mut at = 0;
        layers
            .map(|l| {
                self.layer_params(l)
                    .iter()
                    .map(|p| {
                        let n: usize = p.shape.iter().product();
                        let t = Tensor::from_slice(&params[at..at + n], p.shape.as_slice(), dev)?;
                        at += n;
                        Var::from_tensor(&t)
                    })
                    .collect()
            })
            .collect()
    }

    /// LayerNorm over the last axis.
    fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
        let mean = x.mean_keepdim(D::Minus1)?;
        let xc = x.broadcast_sub(&mean)?;
        let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
        xc.broadcast_div(&(var + LN_EPS)?.sqrt()?)?
            .broadcast_mul(w)?
            .broadcast_add(b)
    }

    /// `x` (rows, in) times a `Conv1D` weight (in, out) plus its bias.
    fn conv1d(x: &Tensor, w: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
        x.matmul(w)?.broadcast_add(b)
    }

    /// One block on hidden states `x` of shape (rows·seq, hidden).
    fn block(&self, x: &Tensor, p: &[Var], rows: usize) -> candle_core::Result<Tensor> {
        let (s, h, a) = (self.seq, self.hidden, self.heads);
        let d = h / a;
        let t = |i: usize| p[i].as_tensor();
        let n1 = Self::layer_norm(x, t(0), t(1))?;
        let qkv = Self::conv1d(&n1, t(2), t(3))?;
        let heads = |k: usize| -> candle_core::Result<Tensor> {
            qkv.narrow(1, k * h, h)?
                .reshape((rows, s, a, d))?
                .transpose(1, 2)?
                .contiguous()
        };
        let (q, k, v) = (heads(0)?, heads(1)?, heads(2)?);
        let scores = (q.matmul(&k.t()?.contiguous()?)? / (d as f64).sqrt())?;
        let mask: Vec<f32> = (0..s * s)
            .map(|i| if i % s > i / s { -1e9 } else { 0.0 })
            .collect();
        let mask = Tensor::from_vec(mask, (s, s), x.device())?;
        let scores = scores.broadcast_add(&mask)?;
        // Softmax: the row maximum is a constant shift (no gradient needed through it).
        let max = scores.detach().max_keepdim(D::Minus1)?;
        let e = scores.broadcast_sub(&max)?.exp()?;
        let att = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
        let y = att
            .matmul(&v)?
            .transpose(1, 2)?
            .contiguous()?
            .reshape((rows * s, h))?;
        let x = (x + Self::conv1d(&y, t(4), t(5))?)?;
        let n2 = Self::layer_norm(&x, t(6), t(7))?;
        let m = Self::conv1d(&n2, t(8), t(9))?.gelu()?;
        x + Self::conv1d(&m, t(10), t(11))?
    }

    /// Tokens (rows of `seq + 1` values) to (inputs, targets), `seq` of each per row.
    fn split_tokens(&self, tokens: &[f32], dev: &Device) -> candle_core::Result<(Tensor, Tensor)> {
        let w = self.seq + 1;
        if tokens.is_empty() || !tokens.len().is_multiple_of(w) {
            candle_core::bail!("{} tokens are not rows of {w}", tokens.len());
        }
        let ids = |skip: usize| -> Vec<u32> {
            tokens
                .chunks_exact(w)
                .flat_map(|r| r[skip..skip + self.seq].iter().map(|&t| t as u32))
                .collect()
        };
        let (x, y) = (ids(0), ids(1));
        if let Some(bad) = x.iter().chain(&y).find(|&&t| t as usize >= self.vocab) {
            candle_core::bail!("token {bad} is outside the vocabulary of {}", self.vocab);
        }
        let n = x.len();
        Ok((Tensor::from_vec(x, n, dev)?, Tensor::from_vec(y, n, dev)?))
    }

    /// Layers `layers` forward: hidden states (rows·seq, hidden), or, through the head, the
    /// logits (rows·seq, vocab).
    fn run_layers(
        &self,
        layers: Range<usize>,
        p: &[Vec<Var>],
        x: Tensor,
        rows: usize,
    ) -> candle_core::Result<Tensor> {
        let mut x = x;
        for (i, l) in layers.enumerate() {
            let t = |k: usize| p[i][k].as_tensor();
            x = if l == 0 {
                // x holds token ids here.
                let pos: Vec<u32> = (0..rows * self.seq)
                    .map(|k| (k % self.seq) as u32)
                    .collect();
                let pos = Tensor::from_vec(pos, rows * self.seq, x.device())?;
                (t(0).index_select(&x, 0)? + t(1).index_select(&pos, 0)?)?
            } else if l == self.layers + 1 {
                Self::layer_norm(&x, t(0), t(1))?.matmul(&t(2).t()?)?
            } else {
                self.block(&x, &p[i], rows)?
            };
        }
        Ok(x)
    }

    /// Σ over rows of each row's mean cross-entropy (nats per token) of `logits` against
    /// `targets`.
    fn loss_sum(&self, logits: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
        let logp = candle_nn::ops::log_softmax(logits, D::Minus1)?;
        let picked = logp.gather(&targets.unsqueeze(1)?, 1)?;
        picked.sum_all()?.neg()? / self.seq as f64
    }

    fn rows_of(&self, layers: &Range<usize>, input: StageInput<'_>) -> candle_core::Result<usize> {
        let (len, per) = match input {
            StageInput::Tokens(t) => (t.len(), self.seq + 1),
            StageInput::Hidden(hd) => (hd.len(), self.seq * self.hidden),
        };
        let first = matches!(input, StageInput::Tokens(_));
        if first != (layers.start == 0) || len == 0 || !len.is_multiple_of(per) {
            candle_core::bail!(
                "layers {}..{} got {len} input values ({} input)",
                layers.start,
                layers.end,
                if first { "token" } else { "hidden-state" }
            );
        }
        Ok(len / per)
    }

    /// The stage's forward on `dev`: (the output as the next stage takes it, the graph's
    /// output tensor, the input variable when the input is hidden states). On the last stage
    /// the output is the loss sum (one value), `tokens` give its targets.
    #[allow(clippy::type_complexity)]
    fn stage_graph(
        &self,
        dev: &Device,
        layers: Range<usize>,
        p: &[Vec<Var>],
        input: StageInput<'_>,
        tokens: Option<&[f32]>,
    ) -> candle_core::Result<(Tensor, Option<Var>)> {
        let rows = self.rows_of(&layers, input)?;
        let (x, var) = match input {
            StageInput::Tokens(t) => (self.split_tokens(t, dev)?.0, None),
            StageInput::Hidden(hd) => {
                let v = Var::from_tensor(&Tensor::from_slice(
                    hd,
                    (rows * self.seq, self.hidden),
                    dev,
                )?)?;
                (v.as_tensor().clone(), Some(v))
            }
        };
        let last = layers.end == self.planner_layers();
        let out = self.run_layers(layers, p, x, rows)?;
        if !last {
            return Ok((out, var));
        }
        let tokens = tokens
            .or(match input {
                StageInput::Tokens(t) => Some(t),
                StageInput::Hidden(_) => None,
            })
            .ok_or_else(|| candle_core::Error::Msg("the last stage needs the targets".into()))?;
        let (_, targets) = self.split_tokens(tokens, dev)?;
        if targets.dim(0)? != rows * self.seq {
            candle_core::bail!(
                "{} targets for {rows} rows of hidden states",
                targets.dim(0)?
            );
        }
        Ok((self.loss_sum(&out, &targets)?, var))
    }

    /// Forward of layers `layers` (parameters `params`, that slice of the flat model) from
    /// `input`: the hidden states for the next stage, or on the last stage the loss sum over
    /// the rows (one value; `tokens`, the samples, give the targets).
    pub fn stage_forward(
        &self,
        dev: &Device,
        layers: Range<usize>,
        params: &[f32],
        input: StageInput<'_>,
        tokens: Option<&[f32]>,
    ) -> candle_core::Result<Vec<f32>> {
        let p = self.stage_tensors(layers.clone(), params, dev)?;
        self.stage_forward_with(dev, layers, &p, input, tokens)
    }

    /// [`Gpt::stage_forward`] with the layers' parameters as they are held (`p[i]`: layer
    /// `layers.start + i`'s tensors in [`Gpt::layer_params`] order).
    pub fn stage_forward_with(
        &self,
        dev: &Device,
        layers: Range<usize>,
        p: &[Vec<Var>],
        input: StageInput<'_>,
        tokens: Option<&[f32]>,
    ) -> candle_core::Result<Vec<f32>> {
        let (out, _) = self.stage_graph(dev, layers, p, input, tokens)?;
        out.flatten_all()?.to_dtype(DType::F32)?.to_vec1()
    }

    /// Backward of layers `layers`: runs the forward again under autograd and returns (the
    /// gradient of the parameters, summed over the rows, in the slice's order; the gradient of
    /// the input hidden states, empty on the first stage). `grad_out` is the gradient of the
    /// stage's output (`None` on the last stage: the loss sum is differentiated).
    pub fn stage_backward(
        &self,
        dev: &Device,
        layers: Range<usize>,
        params: &[f32],
        input: StageInput<'_>,
        tokens: Option<&[f32]>,
        grad_out: Option<&[f32]>,
    ) -> candle_core::Result<(Vec<f32>, Vec<f32>, f64)> {
        let p = self.stage_tensors(layers.clone(), params, dev)?;
        let (grads, grad_in, loss) =
            self.stage_backward_with(dev, layers, &p, input, tokens, grad_out)?;
        let mut flat = Vec::with_capacity(params.len());
        for g in grads {
            flat.extend(g.flatten_all()?.to_vec1::<f32>()?);
        }
        Ok((flat, grad_in, loss))
    }

    /// [`Gpt::stage_backward`] with the layers' parameters as they are held: the gradient of
    /// each of `p`'s tensors (in order, where they are), the gradient of the input, the loss.
    pub fn stage_backward_with(
        &self,
        dev: &Device,
        layers: Range<usize>,
        p: &[Vec<Var>],
        input: StageInput<'_>,
        tokens: Option<&[f32]>,
        grad_out: Option<&[f32]>,
    ) -> candle_core::Result<(Vec<Tensor>, Vec<f32>, f64)> {
        let (out, var) = self.stage_graph(dev, layers, p, input, tokens)?;
        let (objective, loss) = match grad_out {
            None => {
                let l = f64::from(out.to_dtype(DType::F32)?.to_scalar::<f32>()?);
                (out, l)
            }
            Some(g) => {
                if g.len() != out.elem_count() {
                    candle_core::bail!(
                        "an output gradient of {} values for {} outputs",
                        g.len(),
                        out.elem_count()
                    );
                }
                let g = Tensor::from_slice(g, out.shape(), dev)?;
                ((out * g)?.sum_all()?, f64::NAN)
            }
        };
        let mut grads = objective.backward()?;
        let mut each = Vec::with_capacity(p.iter().map(Vec::len).sum());
        for v in p.iter().flatten() {
            each.push(match grads.remove(v.as_tensor()) {
                Some(g) => g,
                None => v.as_tensor().zeros_like()?,
            });
        }
        let grad_in = match &var {
            Some(v) => match grads.get(v.as_tensor()) {
                Some(g) => g.flatten_all()?.to_vec1::<f32>()?,
                None => vec![0.0; v.elem_count()],
            },
            None => Vec::new(),
        };
        Ok((each, grad_in, loss))
    }

    /// The whole model: (Σ over rows of the mean loss per token, its gradient) for `tokens`.
    pub fn loss_and_grad_sum(
        &self,
        dev: &Device,
        model: &[f32],
        tokens: &[f32],
    ) -> candle_core::Result<(f64, Vec<f32>)> {
        let all = 0..self.planner_layers();
        let (g, _, loss) = self.stage_backward(
            dev,
            all,
            &model[..self.params()],
            StageInput::Tokens(tokens),
            None,
            None,
        )?;
        Ok((loss, g))
    }

    /// Logits (rows·seq, vocab) for `rows` rows of `seq` token ids (no targets).
    pub fn logits(
        &self,
        dev: &Device,
        model: &[f32],
        ids: &[u32],
        rows: usize,
    ) -> candle_core::Result<Tensor> {
        let p = self.weights(dev, model)?;
        self.logits_with(dev, &p, ids, rows)
    }

    /// The whole model's weights (`model`'s parameters) as tensors on `dev`, made once for an
    /// evaluation or a generation (the outputs are detached: each pass's graph goes with it).
    pub fn weights(&self, dev: &Device, model: &[f32]) -> candle_core::Result<Vec<Vec<Var>>> {
        let params = model.get(..self.params()).ok_or_else(|| {
            candle_core::Error::Msg(format!(
                "{} values for {} parameters",
                model.len(),
                self.params()
            ))
        })?;
        self.stage_tensors(0..self.planner_layers(), params, dev)
    }

    /// [`Gpt::logits`] with the weights made once ([`Gpt::weights`]).
    pub fn logits_with(
        &self,
        dev: &Device,
        p: &[Vec<Var>],
        ids: &[u32],
        rows: usize,
    ) -> candle_core::Result<Tensor> {
        let x = Tensor::from_slice(ids, rows * self.seq, dev)?;
        Ok(self
            .run_layers(0..self.planner_layers(), p, x, rows)?
            .detach())
    }

    /// (mean loss per token in nats, next-token accuracy) over `tokens` (rows of `seq + 1`),
    /// in chunks of `chunk` rows.
    pub fn evaluate(
        &self,
        dev: &Device,
        model: &[f32],
        tokens: &[f32],
        chunk: usize,
    ) -> candle_core::Result<(f64, f64)> {
        let w = self.seq + 1;
        let rows = tokens.len() / w;
        let (mut loss, mut right) = (0.0, 0usize);
        let p = self.weights(dev, model)?;
        for part in tokens.chunks(chunk.max(1) * w) {
            let (x, y) = self.split_tokens(part, dev)?;
            let n = part.len() / w;
            let logits = self
                .run_layers(0..self.planner_layers(), &p, x, n)?
                .detach();
            loss += f64::from(self.loss_sum(&logits, &y)?.to_scalar::<f32>()?);
            let pred = logits.argmax(D::Minus1)?.to_vec1::<u32>()?;
            right += pred
                .iter()
                .zip(y.to_vec1::<u32>()?)
                .filter(|(a, b)| **a == *b)
                .count();
        }
        let rows = rows.max(1);
        Ok((loss / rows as f64, right as f64 / (rows * self.seq) as f64))
    }

    /// `prompt` and its continuation by `n` byte tokens ([`Gpt::generate`] on this process's
    /// device), as text ([`decode_bytes`]).
    pub fn complete_text(
        &self,
        model: &[f32],
        prompt: &str,
        n: usize,
        temperature: f64,
        seed: u64,
    ) -> candle_core::Result<String> {
        let ids: Vec<u32> = prompt.bytes().map(u32::from).collect();
        if let Some(b) = ids.iter().find(|&&t| t as usize >= self.vocab) {
            candle_core::bail!(
                "the prompt's byte {b} is outside the model's vocabulary of {}",
                self.vocab
            );
        }
        let more = self.generate(&crate::device::current(), model, &ids, n, temperature, seed)?;
        let mut all = ids;
        all.extend(more);
        Ok(decode_bytes(&all))
    }

    /// Continue `prompt` (token ids) by `n` tokens, each sampled from the softmax of the logits
    /// at `temperature` (greedy at 0), seeded.
    pub fn generate(
        &self,
        dev: &Device,
        model: &[f32],
        prompt: &[u32],
        n: usize,
        temperature: f64,
        seed: u64,
    ) -> candle_core::Result<Vec<u32>> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let p = self.weights(dev, model)?;
        let mut ids: Vec<u32> = prompt.to_vec();
        if ids.is_empty() {
            ids.push(b'\n' as u32);
        }
        let start = ids.len();
        for _ in 0..n {
            // The last `seq` tokens, padded on the right by repeating the last one (causal
            // attention: later positions do not change earlier ones); the position of the last
            // real token is read.
            let tail = &ids[ids.len().saturating_sub(self.seq)..];
            let at = tail.len() - 1;
            let mut window = tail.to_vec();
            window.resize(self.seq, *tail.last().unwrap_or(&0));
            let logits = self.logits_with(dev, &p, &window, 1)?;
            let row: Vec<f32> = logits.get(at)?.to_vec1()?;
            ids.push(sample(&row, temperature, &mut rng));
        }
        Ok(ids.split_off(start))
    }
}

/// Tokens as text: each below 256 is a byte, the bytes decoded as UTF-8 with invalid sequences
/// (and tokens past the bytes) as U+FFFD.
pub fn decode_bytes(tokens: &[u32]) -> String {
    let mut bytes = Vec::with_capacity(tokens.len());
    for &t in tokens {
        match u8::try_from(t) {
            Ok(b) => bytes.push(b),
            Err(_) => bytes.extend("\u{fffd}".as_bytes()),
        }
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

/// A token from `logits` at `temperature` (the most likely one at 0).
fn sample(logits: &[f32], temperature: f64, rng: &mut ChaCha8Rng) -> u32 {
    let best = logits
        .iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map_or(0, |(i, _)| i);
    if temperature <= 0.0 {
        return best as u32;
    }
    let max = logits[best];
    let w: Vec<f64> = logits
        .iter()
        .map(|&l| ((f64::from(l - max)) / temperature).exp())
        .collect();
    let mut r = rng.random_range(0.0..w.iter().sum::<f64>());
    for (i, x) in w.iter().enumerate() {
        if r < *x {
            return i as u32;
        }
        r -= x;
    }
    best as u32
}

/// Hugging Face's `config.json` for a [`Gpt`] (`GPT2LMHeadModel`, untied LM head).
pub fn hf_config(g: &Gpt) -> serde_json::Value {
    serde_json::json!({
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": g.vocab,
        "n_positions": g.seq,
        "n_ctx": g.seq,
        "n_embd": g.hidden,
        "n_layer": g.layers,
        "n_head": g.heads,
        "n_inner": 4 * g.hidden,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": LN_EPS,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "initializer_range": 0.02,
        "scale_attn_weights": true,
        "tie_word_embeddings": false,
        "bos_token_id": 10,
        "eos_token_id": 10,
        "torch_dtype": "float32",
    })
}

/// The [`Gpt`] a Hugging Face `config.json` describes, if it is one ravnest runs: a
/// `gpt2` model with `gelu_new`, LayerNorm epsilon [`LN_EPS`] and an MLP 4 times as wide as
/// the hidden states (what [`hf_config`] writes). Says what does not fit otherwise.
pub fn from_hf_config(c: &serde_json::Value) -> Result<Gpt, String> {
    const NEEDED: &str = "n_layer, n_embd, n_head, n_positions and vocab_size";
    if !c.is_object() {
        return Err("is not a JSON object".into());
    }
    if let Some(t) = c.get("model_type").and_then(|v| v.as_str())
        && t != "gpt2"
    {
        return Err(format!(
            "model_type `{t}` is not a GPT-2 (`gpt2`), the only kind ravnest's GPT loads"
        ));
    }
    let size = |k: &str| -> Result<usize, String> {
        c.get(k)
            .and_then(|v| v.as_u64())
            .map(|n| n as usize)
            .ok_or_else(|| format!("has no `{k}` (a GPT-2 config has {NEEDED})"))
    };
    let g = Gpt {
        layers: size("n_layer")?,
        hidden: size("n_embd")?,
        heads: size("n_head")?,
        seq: size("n_positions")?,
        vocab: size("vocab_size")?,
    };
    let act = c
        .get("activation_function")
        .and_then(|v| v.as_str())
        .unwrap_or("gelu_new");
    if act != "gelu_new" {
        return Err(format!(
            "activation_function `{act}`: ravnest's GPT uses `gelu_new` (tanh GELU)"
        ));
    }
    if let Some(eps) = c.get("layer_norm_epsilon").and_then(|v| v.as_f64())
        && (eps - LN_EPS).abs() > 1e-12
    {
        return Err(format!(
            "layer_norm_epsilon {eps}: ravnest's GPT uses {LN_EPS}"
        ));
    }
    if let Some(inner) = c.get("n_inner").and_then(|v| v.as_u64())
        && inner as usize != 4 * g.hidden
    {
        return Err(format!(
            "n_inner {inner}: ravnest's GPT's MLP is 4 · n_embd = {} wide",
            4 * g.hidden
        ));
    }
    for k in ["scale_attn_by_inverse_layer_idx", "add_cross_attention"] {
        if c.get(k).and_then(|v| v.as_bool()) == Some(true) {
            return Err(format!("`{k}` is true: ravnest's GPT has no such option"));
        }
    }
    g.check()?;
    Ok(g)
}

/// The [`Gpt`] of a checkpoint's `model` metadata (`{"kind": "gpt", "layers": …}`, as
/// `Network::config_json` writes it).
pub fn from_model_json(m: &serde_json::Value) -> Result<Gpt, String> {
    match m.get("kind").and_then(|k| k.as_str()) {
        Some("gpt") => {}
        Some(k) => {
            return Err(format!(
                "is the checkpoint of a `{k}` network, not of a GPT (a run with `[run] network = \"gpt\"` writes one)"
            ));
        }
        None => return Err("its model metadata names no `kind`".into()),
    }
    let size = |k: &str| -> Result<usize, String> {
        m.get(k)
            .and_then(|v| v.as_u64())
            .map(|n| n as usize)
            .ok_or_else(|| format!("its GPT metadata has no `{k}`"))
    };
    let g = Gpt {
        layers: size("layers")?,
        hidden: size("hidden")?,
        heads: size("heads")?,
        seq: size("seq")?,
        vocab: size("vocab")?,
    };
    g.check()?;
    Ok(g)
}

impl Gpt {
    /// Whether the shape can run: at least one of everything, the heads dividing the width.
    pub fn check(&self) -> Result<(), String> {
        if self.layers == 0
            || self.hidden == 0
            || self.heads == 0
            || self.seq == 0
            || self.vocab == 0
        {
            return Err(format!("a GPT needs at least one of each: {self:?}"));
        }
        if !self.hidden.is_multiple_of(self.heads) {
            return Err(format!(
                "{} heads do not divide the hidden width {}",
                self.heads, self.hidden
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> Gpt {
        Gpt {
            layers: 2,
            hidden: 16,
            heads: 2,
            seq: 6,
            vocab: 20,
        }
    }

    fn tokens(g: &Gpt, rows: usize, seed: u64) -> Vec<f32> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        (0..rows * (g.seq + 1))
            .map(|_| rng.random_range(0..g.vocab) as f32)
            .collect()
    }

    #[test]
    fn parameter_counts_match_the_planners_gpt_layers() {
        let g = Gpt {
            layers: 3,
            hidden: 32,
            heads: 4,
            seq: 8,
            vocab: 256,
        };
        let spec = ravnest_core::model::gpt_spec("g", 3, 32, 4, 8, 256, false);
        let ranges = g.layer_ranges();
        assert_eq!(ranges.len(), spec.layers.len());
        for (r, l) in ranges.iter().zip(&spec.layers) {
            assert_eq!(r.len() as u64, l.params, "{}", l.name);
        }
    }

    #[test]
    fn stages_chained_equal_the_whole_model_forward_and_backward() {
        let g = tiny();
        let dev = Device::Cpu;
        let model = g.init(3);
        let toks = tokens(&g, 3, 1);
        let (loss, grad) = g.loss_and_grad_sum(&dev, &model, &toks).unwrap();
        let r = g.layer_ranges();
        // Stages [0, 2) and [2, 4).
        let (a, b) = (r[0].start..r[1].end, r[2].start..r[3].end);
        let h = g
            .stage_forward(
                &dev,
                0..2,
                &model[a.clone()],
                StageInput::Tokens(&toks),
                None,
            )
            .unwrap();
        let out = g
            .stage_forward(
                &dev,
                2..4,
                &model[b.clone()],
                StageInput::Hidden(&h),
                Some(&toks),
            )
            .unwrap();
        assert!((f64::from(out[0]) - loss).abs() < 1e-4 * loss.abs().max(1.0));
        let (gb, gin, _) = g
            .stage_backward(
                &dev,
                2..4,
                &model[b.clone()],
                StageInput::Hidden(&h),
                Some(&toks),
                None,
            )
            .unwrap();
        let (ga, none, _) = g
            .stage_backward(
                &dev,
                0..2,
                &model[a.clone()],
                StageInput::Tokens(&toks),
                None,
                Some(&gin),
            )
            .unwrap();
        assert!(none.is_empty());
        for (x, y) in ga.iter().chain(&gb).zip(&grad) {
            assert!((x - y).abs() < 1e-5, "{x} vs {y}");
        }
    }

    #[test]
    fn the_gradient_matches_finite_differences() {
        let g = tiny();
        let dev = Device::Cpu;
        let model = g.init(5);
        let toks = tokens(&g, 2, 2);
        let (_, grad) = g.loss_and_grad_sum(&dev, &model, &toks).unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(9);
        for _ in 0..12 {
            let i = rng.random_range(0..model.len());
            let eps = 1e-2f32;
            let at = |d: f32| {
                let mut m = model.clone();
                m[i] += d;
                g.loss_and_grad_sum(&dev, &m, &toks).unwrap().0
            };
            let fd = (at(eps) - at(-eps)) / (2.0 * f64::from(eps));
            let tol = 2e-3 + 0.05 * fd.abs();
            assert!(
                (fd - f64::from(grad[i])).abs() < tol,
                "parameter {i}: finite difference {fd}, gradient {}",
                grad[i]
            );
        }
    }

    #[test]
    fn a_few_steps_of_sgd_lower_the_loss_and_generation_is_seeded() {
        let g = tiny();
        let dev = Device::Cpu;
        let mut model = g.init(1);
        // A repeating pattern is learnable.
        let toks: Vec<f32> = (0..4 * (g.seq + 1)).map(|i| (i % 5) as f32).collect();
        let first = g.loss_and_grad_sum(&dev, &model, &toks).unwrap().0;
        for _ in 0..60 {
            let (_, grad) = g.loss_and_grad_sum(&dev, &model, &toks).unwrap();
            for (w, d) in model.iter_mut().zip(&grad) {
                *w -= 0.1 * d;
            }
        }
        let last = g.loss_and_grad_sum(&dev, &model, &toks).unwrap().0;
        assert!(last < 0.5 * first, "{first} -> {last}");
        let a = g.generate(&dev, &model, &[0, 1, 2], 8, 1.0, 7).unwrap();
        let b = g.generate(&dev, &model, &[0, 1, 2], 8, 1.0, 7).unwrap();
        assert_eq!(a, b);
        assert!(a.iter().all(|&t| (t as usize) < g.vocab));
    }
    #[test]
    fn the_hugging_face_config_and_the_metadata_give_the_shape_back() {
        let g = tiny();
        assert_eq!(from_hf_config(&hf_config(&g)), Ok(g));
        let meta = crate::net::Network::Gpt(g).config_json();
        assert_eq!(from_model_json(&meta), Ok(g));
        let mut c = hf_config(&g);
        c["activation_function"] = "gelu".into();
        assert!(from_hf_config(&c).unwrap_err().contains("gelu_new"));
        let mut c = hf_config(&g);
        c["n_head"] = 3.into();
        assert!(
            from_hf_config(&c)
                .unwrap_err()
                .contains("3 heads do not divide")
        );
        let mlp = serde_json::json!({"kind": "mlp", "dims": [2, 3]});
        assert!(
            from_model_json(&mlp)
                .unwrap_err()
                .contains("`mlp` network, not of a GPT")
        );
        assert_eq!(
            decode_bytes(&[104, 105, 300, 0xe2, 0x82, 0xac]),
            "hi\u{fffd}€"
        );
    }
}
