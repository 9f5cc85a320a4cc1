//! The layers as candle graphs on any device: composed operations that candle's autograd
//! differentiates (training on a GPU; the reference of the hand-written CPU pass), or, for a
//! forward alone, candle-nn's fused `rms_norm`, `rope` and `softmax_last_dim` (CUDA kernels on
//! a GPU). Each follows transformers' modeling file of its family: `modeling_gpt2.py`,
//! `modeling_llama.py` (Qwen2's and Mistral's blocks are Llama's, with q/k/v biases for Qwen2).

use candle_core::{D, Tensor};

use super::Gpt;

type Result<T> = candle_core::Result<T>;

/// LayerNorm over the last axis.
fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> Result<Tensor> {
    let mean = x.mean_keepdim(D::Minus1)?;
    let xc = x.broadcast_sub(&mean)?;
    let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
    xc.broadcast_div(&(var + eps)?.sqrt()?)?
        .broadcast_mul(w)?
        .broadcast_add(b)
}

/// RMSNorm over the last axis (`x / √(mean(x²) + ε) · w`).
fn rms_norm(x: &Tensor, w: &Tensor, eps: f64, fused: bool) -> Result<Tensor> {
    if fused {
        return candle_nn::ops::rms_norm(&x.contiguous()?, w, eps as f32);
    }
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    x.broadcast_div(&(ms + eps)?.sqrt()?)?.broadcast_mul(w)
}

/// `x · wᵀ (+ b)`: an `nn.Linear` (`w` is `[out, in]`).
fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let y = x.matmul(&w.t()?)?;
    match b {
        Some(b) => y.broadcast_add(b),
        None => Ok(y),
    }
}

/// The causal mask: 0 on and below the diagonal, a large negative number above.
fn causal_mask(s: usize, dev: &candle_core::Device) -> Result<Tensor> {
    let mask: Vec<f32> = (0..s * s)
        .map(|i| if i % s > i / s { -1e9 } else { 0.0 })
        .collect();
    Tensor::from_vec(mask, (s, s), dev)
}

/// Softmax over the last axis of `scores` (already masked).
fn softmax(scores: &Tensor, fused: bool) -> Result<Tensor> {
    if fused {
        return candle_nn::ops::softmax_last_dim(&scores.contiguous()?);
    }
    // The row maximum is a constant shift (no gradient needed through it).
    let max = scores.detach().max_keepdim(D::Minus1)?;
    let e = scores.broadcast_sub(&max)?.exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
}

impl Gpt {
    /// The rotary tables of positions `0..s` on the host: (cos, sin), each `(s, head_dim / 2)`.
    pub(super) fn rope_host(&self, s: usize) -> (Vec<f32>, Vec<f32>) {
        let f = self.inv_freq();
        let half = f.len();
        let mut cos = Vec::with_capacity(s * half);
        let mut sin = Vec::with_capacity(s * half);
        for t in 0..s {
            for &fi in &f {
                // transformers computes the angles in float32: so do we.
                let angle = (t as f32) * (fi as f32);
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        (cos, sin)
    }

    /// [`Gpt::rope_host`] as tensors on `dev`.
    fn rope_tables(&self, s: usize, dev: &candle_core::Device) -> Result<(Tensor, Tensor)> {
        let (cos, sin) = self.rope_host(s);
        let half = self.arch.head_dim / 2;
        Ok((
            Tensor::from_vec(cos, (s, half), dev)?,
            Tensor::from_vec(sin, (s, half), dev)?,
        ))
    }

    /// The embedding: token rows (and GPT-2's positions) for ids `x`.
    pub(super) fn embed_graph(&self, t: &[&Tensor], x: &Tensor, rows: usize) -> Result<Tensor> {
        let tok = t[0].index_select(x, 0)?;
        if self.is_llama() {
            return Ok(tok);
        }
        let seq = x.dim(0)? / rows.max(1);
        let pos: Vec<u32> = (0..rows * seq).map(|k| (k % seq) as u32).collect();
        let pos = Tensor::from_vec(pos, rows * seq, x.device())?;
        tok + t[1].index_select(&pos, 0)?
    }

    /// The head: the final norm and the LM head, logits (rows·seq, vocab).
    pub(super) fn head_graph(&self, t: &[&Tensor], x: &Tensor, fused: bool) -> Result<Tensor> {
        let eps = self.arch.norm_eps;
        if self.is_llama() {
            return rms_norm(x, t[0], eps, fused)?.matmul(&t[1].t()?);
        }
        layer_norm(x, t[0], t[1], eps)?.matmul(&t[2].t()?)
    }

    /// One GPT-2 block on hidden states `x` of shape (rows·seq, hidden).
    pub(super) fn gpt2_graph(&self, x: &Tensor, t: &[&Tensor], rows: usize) -> Result<Tensor> {
        let (h, a) = (self.hidden, self.heads);
        let s = x.dim(0)? / rows.max(1);
        let d = h / a;
        let eps = self.arch.norm_eps;
        let conv1d = |x: &Tensor, w: &Tensor, b: &Tensor| x.matmul(w)?.broadcast_add(b);
        let n1 = layer_norm(x, t[0], t[1], eps)?;
        let qkv = conv1d(&n1, t[2], t[3])?;
        let heads = |k: usize| -> Result<Tensor> {
            qkv.narrow(1, k * h, h)?
                .reshape((rows, s, a, d))?
                .transpose(1, 2)?
                .contiguous()
        };
        let (q, k, v) = (heads(0)?, heads(1)?, heads(2)?);
        let scores = (q.matmul(&k.t()?.contiguous()?)? / (d as f64).sqrt())?;
        let scores = scores.broadcast_add(&causal_mask(s, x.device())?)?;
        let att = softmax(&scores, false)?;
        let y = att
            .matmul(&v)?
            .transpose(1, 2)?
            .contiguous()?
            .reshape((rows * s, h))?;
        let x = (x + conv1d(&y, t[4], t[5])?)?;
        let n2 = layer_norm(&x, t[6], t[7], eps)?;
        let m = conv1d(&n2, t[8], t[9])?.gelu()?;
        x + conv1d(&m, t[10], t[11])?
    }

    /// Rotary positions on `x` of shape (rows, heads, seq, head_dim): transformers'
    /// `x · cos + rotate_half(x) · sin`, with the halves of each head rotated as pairs.
    fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor, fused: bool) -> Result<Tensor> {
        if fused {
            return candle_nn::rotary_emb::rope(&x.contiguous()?, cos, sin);
        }
        let d = x.dim(D::Minus1)?;
        let (x1, x2) = (
            x.narrow(D::Minus1, 0, d / 2)?,
            x.narrow(D::Minus1, d / 2, d / 2)?,
        );
        let cos2 = Tensor::cat(&[cos, cos], D::Minus1)?;
        let sin2 = Tensor::cat(&[sin, sin], D::Minus1)?;
        let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
        x.broadcast_mul(&cos2)? + rotated.broadcast_mul(&sin2)?
    }

    /// One Llama block on hidden states `x` of shape (rows·seq, hidden).
    pub(super) fn llama_graph(
        &self,
        x: &Tensor,
        t: &[&Tensor],
        rows: usize,
        fused: bool,
    ) -> Result<Tensor> {
        let ix = self.llama_idx();
        let (a, kvh, d) = (self.heads, self.arch.kv_heads, self.arch.head_dim);
        let s = x.dim(0)? / rows.max(1);
        let eps = self.arch.norm_eps;
        let lin = |x: &Tensor, (w, b): (usize, Option<usize>)| linear(x, t[w], b.map(|b| t[b]));
        let n1 = rms_norm(x, t[ix.ln1], eps, fused)?;
        let (cos, sin) = self.rope_tables(s, x.device())?;
        let heads = |y: Tensor, n: usize| -> Result<Tensor> {
            y.reshape((rows, s, n, d))?.transpose(1, 2)?.contiguous()
        };
        let q = Self::rope(&heads(lin(&n1, ix.q)?, a)?, &cos, &sin, fused)?;
        let k = Self::rope(&heads(lin(&n1, ix.k)?, kvh)?, &cos, &sin, fused)?;
        let v = heads(lin(&n1, ix.v)?, kvh)?;
        // Grouped-query attention: each key/value head serves heads / kv_heads query heads in
        // a row (transformers' repeat_kv).
        let rep = a / kvh;
        let repeat = |t: Tensor| -> Result<Tensor> {
            if rep == 1 {
                return Ok(t);
            }
            t.unsqueeze(2)?
                .broadcast_as((rows, kvh, rep, s, d))?
                .reshape((rows, a, s, d))
        };
        let (k, v) = (repeat(k)?, repeat(v)?);
        let scores = (q.matmul(&k.t()?.contiguous()?)? * (1.0 / (d as f64).sqrt()))?;
        let scores = scores.broadcast_add(&causal_mask(s, x.device())?)?;
        let att = softmax(&scores, fused)?;
        let y = att
            .matmul(&v.contiguous()?)?
            .transpose(1, 2)?
            .contiguous()?
            .reshape((rows * s, a * d))?;
        let x = (x + lin(&y, ix.o)?)?;
        let n2 = rms_norm(&x, t[ix.ln2], eps, fused)?;
        let gate = lin(&n2, ix.gate)?;
        let m = (gate.silu()? * lin(&n2, ix.up)?)?;
        x + lin(&m, ix.down)?
    }
}
