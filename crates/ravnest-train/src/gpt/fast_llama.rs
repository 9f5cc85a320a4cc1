//! A Llama block's forward and backward written out on the CPU (the same shape as GPT-2's in
//! [`super::fast`]): candle's matrix products for the projections and attention, one pass over
//! contiguous values for everything else ([`super::ops`]), and what the backward needs kept
//! from the forward.
//!
//! Grouped-query attention without copying keys and values: the query heads that share a
//! key/value head are consecutive (transformers' `repeat_kv`), so the queries of one group are
//! one `(heads / kv_heads · seq, head_dim)` matrix against that group's keys, and the keys' and
//! values' gradients come out of the products already summed over the group.

use candle_core::{Device, Tensor};

use super::host::{Layer, add_into, tensor, to_vec, values};
use super::{Gpt, ops};

type Result<T> = candle_core::Result<T>;

/// What a Llama block's forward keeps for its backward.
pub(super) struct LlamaSaved {
    xhat1: Vec<f32>,
    rstd1: Vec<f32>,
    n1: Tensor,
    /// Queries after rotation, `(rows · kv_heads, rep · seq, d)`.
    q: Tensor,
    /// Keys after rotation and values, `(rows · kv_heads, seq, d)`.
    k: Tensor,
    v: Tensor,
    att: Tensor,
    y: Tensor,
    xhat2: Vec<f32>,
    rstd2: Vec<f32>,
    n2: Tensor,
    gate: Vec<f32>,
    up: Vec<f32>,
    sig: Vec<f32>,
    act: Tensor,
}

impl Gpt {
    /// `x · Wᵀ (+ b)` for the linear `(w, b)` of layer `p`.
    fn proj(&self, p: &Layer, x: &Tensor, (w, b): (usize, Option<usize>)) -> Result<Vec<f32>> {
        let mut y = to_vec(&self.mm(x, &p[w].t()?)?)?;
        if let Some(b) = b {
            values(&p[b], |b| ops::add_bias(&mut y, b))?;
        }
        Ok(y)
    }

    /// One Llama block forward on `rows` samples' hidden states `x` (rows·seq, hidden),
    /// keeping what the backward needs when `save`.
    pub(super) fn llama_block_forward(
        &self,
        p: &Layer,
        x: Vec<f32>,
        rows: usize,
        save: bool,
    ) -> Result<(Vec<f32>, Option<LlamaSaved>)> {
        let ix = self.llama_idx();
        let (s, h, a, kvh, d) = (
            self.seq,
            self.hidden,
            self.heads,
            self.arch.kv_heads,
            self.arch.head_dim,
        );
        let (rep, n, inner) = (a / kvh, rows * s, self.arch.intermediate);
        let eps = self.arch.norm_eps as f32;
        let (n1, xhat1, rstd1) = values(&p[ix.ln1], |g| ops::rms_norm(&x, g, h, eps))?;
        let n1 = tensor(n1, (n, h))?;
        let (cos, sin) = self.rope_host(s);
        let mut q = ops::split_to_heads(&self.proj(p, &n1, ix.q)?, s, a, d);
        ops::rope(&mut q, s, d, &cos, &sin, false);
        let mut k = ops::split_to_heads(&self.proj(p, &n1, ix.k)?, s, kvh, d);
        ops::rope(&mut k, s, d, &cos, &sin, false);
        let v = ops::split_to_heads(&self.proj(p, &n1, ix.v)?, s, kvh, d);
        let q = Tensor::from_vec(q, (rows * kvh, rep * s, d), &Device::Cpu)?;
        let k = Tensor::from_vec(k, (rows * kvh, s, d), &Device::Cpu)?;
        let v = Tensor::from_vec(v, (rows * kvh, s, d), &Device::Cpu)?;
        let mut att = to_vec(&q.matmul(&k.t()?)?)?;
        // Each query head's (seq, seq) block is causal.
        ops::causal_softmax(&mut att, s, 1.0 / (d as f32).sqrt());
        let att = Tensor::from_vec(att, (rows * kvh, rep * s, s), &Device::Cpu)?;
        let yh = att.matmul(&v)?;
        let mut y = vec![0.0f32; n * a * d];
        values(&yh, |yh| ops::merge_heads(yh, s, a, d, &mut y, a * d, 0))?;
        drop(yh);
        let y = tensor(y, (n, a * d))?;
        let mut x2 = self.proj(p, &y, ix.o)?;
        for (o, i) in x2.iter_mut().zip(&x) {
            *o += i;
        }
        drop(x);
        let (n2, xhat2, rstd2) = values(&p[ix.ln2], |g| ops::rms_norm(&x2, g, h, eps))?;
        let n2 = tensor(n2, (n, h))?;
        let gate = self.proj(p, &n2, ix.gate)?;
        let up = self.proj(p, &n2, ix.up)?;
        let (act, sig) = ops::swiglu(&gate, &up);
        let act = tensor(act, (n, inner))?;
        let mut out = self.proj(p, &act, ix.down)?;
        for (o, i) in out.iter_mut().zip(&x2) {
            *o += i;
        }
        let saved = save.then(|| LlamaSaved {
            xhat1,
            rstd1,
            n1,
            q,
            k,
            v,
            att,
            y,
            xhat2,
            rstd2,
            n2,
            gate,
            up,
            sig,
            act,
        });
        Ok((out, saved))
    }

    /// One Llama block backward: the input's gradient from the output's (`dout`), each
    /// parameter's gradient added into its buffer in `acc`.
    pub(super) fn llama_block_backward(
        &self,
        p: &Layer,
        sv: LlamaSaved,
        dout: Vec<f32>,
        acc: &mut [&mut [f32]],
    ) -> Result<Vec<f32>> {
        let ix = self.llama_idx();
        let (s, h, a, kvh, d) = (
            self.seq,
            self.hidden,
            self.heads,
            self.arch.kv_heads,
            self.arch.head_dim,
        );
        let n = dout.len() / h;
        let (rows, rep, inner) = (n / s, a / kvh, self.arch.intermediate);
        // The gradient of a linear's input, weight and bias from its output's `dy`: the
        // weight's and bias's added into `acc`, the input's returned.
        let linear_back = |acc: &mut [&mut [f32]],
                           dy: &[f32],
                           width: usize,
                           input: &Tensor,
                           (w, b): (usize, Option<usize>)|
         -> Result<Tensor> {
            if let Some(b) = b {
                ops::sum_rows(dy, acc[b]);
            }
            let dy = tensor(dy.to_vec(), (n, width))?;
            add_into(acc[w], &self.mm(&dy.t()?, input)?)?;
            self.mm(&dy, &p[w])
        };
        // The MLP: out = x2 + down(silu(gate) · up).
        let dact = to_vec(&linear_back(acc, &dout, h, &sv.act, ix.down)?)?;
        drop(sv.act);
        let (dgate, dup) = ops::swiglu_back(&dact, &sv.gate, &sv.up, &sv.sig);
        drop(dact);
        let dn2 = (linear_back(acc, &dgate, inner, &sv.n2, ix.gate)?
            + linear_back(acc, &dup, inner, &sv.n2, ix.up)?)?;
        let dn2 = to_vec(&dn2)?;
        let mut dx2 = dout;
        values(&p[ix.ln2], |g| {
            ops::rms_norm_back(&dn2, &sv.xhat2, &sv.rstd2, g, &mut dx2, acc[ix.ln2])
        })?;
        drop(dn2);
        // Attention: x2 = x + o(y).
        let dy = to_vec(&linear_back(acc, &dx2, h, &sv.y, ix.o)?)?;
        let dyh = ops::split_to_heads(&dy, s, a, d);
        drop(dy);
        let dyh = Tensor::from_vec(dyh, (rows * kvh, rep * s, d), &Device::Cpu)?;
        let mut datt = to_vec(&dyh.matmul(&sv.v.t()?)?)?;
        let dv = sv.att.t()?.matmul(&dyh)?;
        drop(dyh);
        values(&sv.att, |att| {
            ops::causal_softmax_back(&mut datt, att, s, 1.0 / (d as f32).sqrt())
        })?;
        let dscores = Tensor::from_vec(datt, (rows * kvh, rep * s, s), &Device::Cpu)?;
        let mut dq = to_vec(&dscores.matmul(&sv.k)?)?;
        let mut dk = to_vec(&dscores.t()?.matmul(&sv.q)?)?;
        drop(dscores);
        let (cos, sin) = self.rope_host(s);
        ops::rope(&mut dq, s, d, &cos, &sin, true);
        ops::rope(&mut dk, s, d, &cos, &sin, true);
        let (qw, kvw) = self.qkv_widths();
        let merged = |x: &[f32], heads: usize, width: usize| {
            let mut out = vec![0.0f32; n * width];
            ops::merge_heads(x, s, heads, d, &mut out, width, 0);
            out
        };
        let dq = merged(&dq, a, qw);
        let dk = merged(&dk, kvh, kvw);
        let dv = values(&dv, |dv| merged(dv, kvh, kvw))?;
        let dn1 = ((linear_back(acc, &dq, qw, &sv.n1, ix.q)?
            + linear_back(acc, &dk, kvw, &sv.n1, ix.k)?)?
            + linear_back(acc, &dv, kvw, &sv.n1, ix.v)?)?;
        let dn1 = to_vec(&dn1)?;
        let mut dx = dx2;
        values(&p[ix.ln1], |g| {
            ops::rms_norm_back(&dn1, &sv.xhat1, &sv.rstd1, g, &mut dx, acc[ix.ln1])
        })?;
        Ok(dx)
    }
}
