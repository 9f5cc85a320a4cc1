//! The decoder-only transformers `ravnest run` trains, in candle, split into the layers the
//! planner sees: `embed` (the token embedding, and GPT-2's positions), `block0 … block{n-1}`,
//! and `head` (the final norm and the LM head). Two families, one description
//! ([`ravnest_core::decoder::Decoder`]):
//!
//! - GPT-2: pre-LayerNorm causal self-attention, then an MLP with tanh GELU; learned positions.
//!   ravnest's own byte-level GPTs are GPT-2s with a vocabulary of 256.
//! - Llama (Llama 2 / 3.x, Qwen2, Mistral): RMSNorm, rotary positions (with Llama 3's
//!   scaling), grouped-query attention (q/k/v biases for Qwen2), a SwiGLU MLP.
//!
//! Parameters use Hugging Face's names and layouts (GPT-2's `Conv1D` is `[in, out]`, Llama's
//! `nn.Linear` `[out, in]`), laid out layer by layer in the flat model, so that a pipeline
//! stage's parameters are one contiguous slice ([`Gpt::layer_ranges`]) and a checkpoint loads
//! with `AutoModelForCausalLM`. The LM head is a tensor of its own (a pipeline keeps it on
//! another stage than the embedding): a folder that ties them starts both from the same
//! values.
//!
//! Three ways through the same layers: the hand-written CPU pass that trains ([`fast`],
//! [`fast_llama`]); candle's autograd over composed operations, which trains on a GPU and is
//! the CPU pass's reference in tests; and, for a forward alone (evaluation, generation, a
//! stage's forward), candle-nn's fused `rms_norm`, `rope` and `softmax_last_dim`, which have
//! CUDA kernels ([`blocks`]).

use std::ops::{Deref, Range};

use candle_core::{D, DType, Device, Tensor, Var};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use ravnest_core::decoder::Decoder;

mod blocks;
mod fast;
mod fast_llama;
mod gemm;
mod hf;
mod host;
pub mod ops;
#[cfg(test)]
mod tests;

pub use hf::{decode_bytes, from_hf_config, from_model_json, hf_config, model_json};

/// LayerNorm's epsilon in ravnest's own GPTs (GPT-2's `layer_norm_epsilon`).
pub const LN_EPS: f64 = 1e-5;

/// The shape of a transformer ravnest trains: a [`Decoder`] (read through `Deref`: `g.layers`,
/// `g.arch.kv_heads`) with its tensors and passes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gpt(pub Decoder, pub Numerics);

/// How the CPU's fast path computes ([`Gpt`]'s second field; `[training] precision`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Numerics {
    /// Everything in fp32.
    #[default]
    Fp32,
    /// bf16 mixed precision, emulated on a CPU without bf16 units: every matrix product's
    /// factors (weights and activations) and its result are rounded to bf16, its sums are
    /// f32 (as a GPU's bf16 matmul: `torch.autocast`'s numerics); norms, softmax, the loss, the
    /// residual stream, the gradients' sums and the optimizer stay fp32 (the master weights).
    Bf16,
}

impl Deref for Gpt {
    type Target = Decoder;
    fn deref(&self) -> &Decoder {
        &self.0
    }
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

/// A tensor's initialization (GPT-2's; Llama's is normal 0.02 for every matrix).
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

/// Where each tensor of a Llama block sits among its layer's tensors.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LlamaIdx {
    pub ln1: usize,
    pub q: (usize, Option<usize>),
    pub k: (usize, Option<usize>),
    pub v: (usize, Option<usize>),
    pub o: (usize, Option<usize>),
    pub ln2: usize,
    pub gate: (usize, Option<usize>),
    pub up: (usize, Option<usize>),
    pub down: (usize, Option<usize>),
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
    /// ravnest's own GPT-2 of these sizes ([`Decoder::gpt2`]).
    pub const fn gpt2(layers: usize, hidden: usize, heads: usize, seq: usize, vocab: usize) -> Gpt {
        Gpt(
            Decoder::gpt2(layers, hidden, heads, seq, vocab),
            Numerics::Fp32,
        )
    }

    /// A Llama of these sizes ([`Decoder::llama`]).
    pub const fn llama(
        layers: usize,
        hidden: usize,
        heads: usize,
        kv_heads: usize,
        intermediate: usize,
        seq: usize,
        vocab: usize,
    ) -> Gpt {
        Gpt(
            Decoder::llama(layers, hidden, heads, kv_heads, intermediate, seq, vocab),
            Numerics::Fp32,
        )
    }

    /// A decoder's GPT, in fp32.
    pub fn of(d: Decoder) -> Gpt {
        Gpt(d, Numerics::Fp32)
    }

    /// The same model computing in `n`.
    pub fn computing(self, n: Numerics) -> Gpt {
        Gpt(self.0, n)
    }

    /// Planner layers: embed, the blocks, head.
    pub fn planner_layers(&self) -> usize {
        self.layers + 2
    }

    /// The tensors of one Llama block, by their names inside it, in order.
    fn llama_block(&self) -> Vec<(String, Vec<usize>, Init)> {
        let (h, i) = (self.hidden, self.arch.intermediate);
        let (q, kv) = self.qkv_widths();
        let a = &self.arch;
        let w = Init::Normal(0.02);
        let mut out = vec![("input_layernorm.weight".into(), vec![h], Init::Ones)];
        let mut linear = |name: &str, o: usize, inp: usize, bias: bool| {
            out.push((format!("{name}.weight"), vec![o, inp], w));
            if bias {
                out.push((format!("{name}.bias"), vec![o], Init::Zeros));
            }
        };
        linear("self_attn.q_proj", q, h, a.qkv_bias);
        linear("self_attn.k_proj", kv, h, a.qkv_bias);
        linear("self_attn.v_proj", kv, h, a.qkv_bias);
        linear("self_attn.o_proj", h, q, a.out_bias);
        out.push((
            "post_attention_layernorm.weight".into(),
            vec![h],
            Init::Ones,
        ));
        let mut linear = |name: &str, o: usize, inp: usize| {
            out.push((format!("{name}.weight"), vec![o, inp], w));
            if a.mlp_bias {
                out.push((format!("{name}.bias"), vec![o], Init::Zeros));
            }
        };
        linear("mlp.gate_proj", i, h);
        linear("mlp.up_proj", i, h);
        linear("mlp.down_proj", h, i);
        out
    }

    /// Where each of a Llama block's tensors sits ([`Gpt::llama_block`]'s order).
    pub(crate) fn llama_idx(&self) -> LlamaIdx {
        let names: Vec<String> = self.llama_block().into_iter().map(|t| t.0).collect();
        let at = |n: &str| names.iter().position(|x| x == n);
        let lin = |n: &str| {
            (
                at(&format!("{n}.weight")).expect("every linear has a weight"),
                at(&format!("{n}.bias")),
            )
        };
        LlamaIdx {
            ln1: at("input_layernorm.weight").expect("listed"),
            q: lin("self_attn.q_proj"),
            k: lin("self_attn.k_proj"),
            v: lin("self_attn.v_proj"),
            o: lin("self_attn.o_proj"),
            ln2: at("post_attention_layernorm.weight").expect("listed"),
            gate: lin("mlp.gate_proj"),
            up: lin("mlp.up_proj"),
            down: lin("mlp.down_proj"),
        }
    }

    /// The tensors of planner layer `l`, in their order in the flat model.
    pub fn layer_params(&self, l: usize) -> Vec<GptParam> {
        let p = |name: String, shape: Vec<usize>, init| GptParam { name, shape, init };
        if self.is_llama() {
            let (h, v) = (self.hidden, self.vocab);
            let w = Init::Normal(0.02);
            if l == 0 {
                return vec![p("model.embed_tokens.weight".into(), vec![v, h], w)];
            }
            if l == self.layers + 1 {
                return vec![
                    p("model.norm.weight".into(), vec![h], Init::Ones),
                    p("lm_head.weight".into(), vec![v, h], w),
                ];
            }
            return self
                .llama_block()
                .into_iter()
                .map(|(n, shape, init)| p(format!("model.layers.{}.{n}", l - 1), shape, init))
                .collect();
        }
        let (h, v, i) = (self.hidden, self.vocab, self.arch.intermediate);
        let w = Init::Normal(0.02);
        if l == 0 {
            return vec![
                p("transformer.wte.weight".into(), vec![v, h], w),
                p(
                    "transformer.wpe.weight".into(),
                    vec![self.arch.positions, h],
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
            p(format!("{b}mlp.c_fc.weight"), vec![h, i], w),
            p(format!("{b}mlp.c_fc.bias"), vec![i], Init::Zeros),
            p(format!("{b}mlp.c_proj.weight"), vec![i, h], proj),
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
    /// variables.
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
    /// logits (rows·seq, vocab). `fused`: a forward alone, through candle-nn's fused kernels
    /// (no gradient flows through them).
    fn run_layers(
        &self,
        layers: Range<usize>,
        p: &[Vec<Var>],
        x: Tensor,
        rows: usize,
        fused: bool,
    ) -> candle_core::Result<Tensor> {
        let mut x = x;
        for (i, l) in layers.enumerate() {
            let t: Vec<&Tensor> = p[i].iter().map(Var::as_tensor).collect();
            x = if l == 0 {
                self.embed_graph(&t, &x, rows)?
            } else if l == self.layers + 1 {
                self.head_graph(&t, &x, fused)?
            } else if self.is_llama() {
                self.llama_graph(&x, &t, rows, fused)?
            } else {
                self.gpt2_graph(&x, &t, rows)?
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

    /// The stage's forward on `dev`: (the graph's output tensor, the input variable when the
    /// input is hidden states). On the last stage the output is the loss sum (one value),
    /// `tokens` give its targets.
    fn stage_graph(
        &self,
        dev: &Device,
        layers: Range<usize>,
        p: &[Vec<Var>],
        input: StageInput<'_>,
        tokens: Option<&[f32]>,
        fused: bool,
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
        let out = self.run_layers(layers, p, x, rows, fused)?;
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
    /// `layers.start + i`'s tensors in [`Gpt::layer_params`] order), through the fused
    /// kernels.
    pub fn stage_forward_with(
        &self,
        dev: &Device,
        layers: Range<usize>,
        p: &[Vec<Var>],
        input: StageInput<'_>,
        tokens: Option<&[f32]>,
    ) -> candle_core::Result<Vec<f32>> {
        let (out, _) = self.stage_graph(dev, layers, p, input, tokens, true)?;
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
        let (out, var) = self.stage_graph(dev, layers, p, input, tokens, false)?;
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
        let seq = ids.len() / rows.max(1);
        let x = Tensor::from_slice(ids, rows * seq, dev)?;
        // A shorter window than the training sample (a generation's prompt) runs as a model
        // of that length: causal attention makes each position's logits the same.
        let g = Gpt(Decoder { seq, ..self.0 }, self.1);
        Ok(g.run_layers(0..self.planner_layers(), p, x, rows, true)?
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
        let p = self.weights(dev, model)?;
        self.evaluate_with(dev, &p, tokens, chunk)
    }

    /// [`Gpt::evaluate`] with the weights made once.
    pub fn evaluate_with(
        &self,
        dev: &Device,
        p: &[Vec<Var>],
        tokens: &[f32],
        chunk: usize,
    ) -> candle_core::Result<(f64, f64)> {
        let w = self.seq + 1;
        let rows = tokens.len() / w;
        let (mut loss, mut right) = (0.0, 0usize);
        for part in tokens.chunks(chunk.max(1) * w) {
            let (x, y) = self.split_tokens(part, dev)?;
            let n = part.len() / w;
            let logits = self
                .run_layers(0..self.planner_layers(), p, x, n, true)?
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
        let sampling = Sampling {
            temperature,
            top_k: 0,
            seed,
        };
        let more = self.generate(&crate::device::current(), model, &ids, n, sampling)?;
        let mut all = ids;
        all.extend(more);
        Ok(decode_bytes(&all))
    }

    /// Continue `prompt` (token ids) by `n` tokens, each sampled as `sampling` says.
    pub fn generate(
        &self,
        dev: &Device,
        model: &[f32],
        prompt: &[u32],
        n: usize,
        sampling: Sampling,
    ) -> candle_core::Result<Vec<u32>> {
        self.generate_until(dev, model, prompt, n, sampling, None)
    }

    /// [`Gpt::generate`], stopping early after the token `stop` (an end of text).
    pub fn generate_until(
        &self,
        dev: &Device,
        model: &[f32],
        prompt: &[u32],
        n: usize,
        sampling: Sampling,
        stop: Option<u32>,
    ) -> candle_core::Result<Vec<u32>> {
        let mut rng = ChaCha8Rng::seed_from_u64(sampling.seed);
        let p = self.weights(dev, model)?;
        let mut ids: Vec<u32> = prompt.to_vec();
        if ids.is_empty() {
            ids.push(if self.vocab > 10 { 10 } else { 0 });
        }
        if let Some(bad) = ids.iter().find(|&&t| t as usize >= self.vocab) {
            candle_core::bail!("token {bad} is outside the vocabulary of {}", self.vocab);
        }
        let start = ids.len();
        for _ in 0..n {
            // The last `seq` tokens (the context a sample had in training).
            let tail = &ids[ids.len().saturating_sub(self.seq)..];
            let logits = self.logits_with(dev, &p, tail, 1)?;
            let row: Vec<f32> = logits.get(tail.len() - 1)?.to_vec1()?;
            let next = hf::sample(&row, sampling, &mut rng);
            ids.push(next);
            if Some(next) == stop {
                break;
            }
        }
        Ok(ids.split_off(start))
    }
}

/// How [`Gpt::generate`] picks each token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// Softmax temperature (0: always the most likely token).
    pub temperature: f64,
    /// Sample among the `top_k` most likely tokens only (0: all of them).
    pub top_k: usize,
    /// The sampler's seed.
    pub seed: u64,
}
