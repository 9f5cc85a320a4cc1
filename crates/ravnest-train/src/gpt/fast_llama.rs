//! A Llama block's forward and backward written out on the CPU (the same shape as GPT-2's in
//! [`super::fast`]): candle's matrix products for the projections and attention, one pass over
//! contiguous values for everything else ([`super::ops`]), and what the backward needs kept
//! from the forward.
//!
//! Grouped-query attention without copying keys and values: the query heads that share a
//! key/value head are consecutive (transformers' `repeat_kv`), so the queries of one group are
//! one `(heads / kv_heads · seq, head_dim)` matrix against that group's keys, and the keys' and
//! values' gradients come out of the products already summed over the group.

use super::gemm::{self, Mat};
use super::host::{Layer, Weights};
use super::{Gpt, ops};

type Result<T> = candle_core::Result<T>;

/// What a Llama block's forward keeps for its backward.
pub(super) struct LlamaSaved {
    xhat1: Vec<f32>,
    rstd1: Vec<f32>,
    n1: Vec<f32>,
    /// Queries after rotation, `(rows · kv_heads, rep · seq, d)`.
    q: Vec<f32>,
    /// Keys after rotation and values, `(rows · kv_heads, seq, d)`.
    k: Vec<f32>,
    v: Vec<f32>,
    att: Vec<f32>,
    y: Vec<f32>,
    xhat2: Vec<f32>,
    rstd2: Vec<f32>,
    n2: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    sig: Vec<f32>,
    act: Vec<f32>,
}

impl Gpt {
    /// `x · Wᵀ (+ b)` for the linear `(w, b)` of a layer's weights `p`.
    fn proj(&self, p: &Weights, x: Mat, (w, b): (usize, Option<usize>)) -> Result<Vec<f32>> {
        let mut y = self.matmul(x, p.mat(w)?.t())?;
        if let Some(b) = b {
            ops::add_bias(&mut y, p.get(b)?);
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
        let w = Weights::of(p)?;
        let (n1, xhat1, rstd1) = ops::rms_norm(&x, w.get(ix.ln1)?, h, eps);
        let n1_m = Mat::new(&n1, n, h);
        let (cos, sin) = self.rope_host(s);
        let mut q = ops::split_to_heads(&self.proj(&w, n1_m, ix.q)?, s, a, d);
        ops::rope(&mut q, s, d, &cos, &sin, false);
        let mut k = ops::split_to_heads(&self.proj(&w, n1_m, ix.k)?, s, kvh, d);
        ops::rope(&mut k, s, d, &cos, &sin, false);
        let v = ops::split_to_heads(&self.proj(&w, n1_m, ix.v)?, s, kvh, d);
        // One product per row and key/value head: its `rep` query heads against its keys.
        let (groups, qd, sd, qs) = (rows * kvh, rep * s * d, s * d, rep * s * s);
        let mut att = gemm::bmm(
            groups,
            (Mat::new(&q, rep * s, d), qd),
            (Mat::new(&k, s, d).t(), sd),
        )?;
        // Each query head's (seq, seq) block is causal.
        ops::causal_softmax(&mut att, s, 1.0 / (d as f32).sqrt());
        let yh = gemm::bmm(
            groups,
            (Mat::new(&att, rep * s, s), qs),
            (Mat::new(&v, s, d), sd),
        )?;
        let mut y = vec![0.0f32; n * a * d];
        ops::merge_heads(&yh, s, a, d, &mut y, a * d, 0);
        drop(yh);
        let mut x2 = self.proj(&w, Mat::new(&y, n, a * d), ix.o)?;
        ops::add_into(&mut x2, &x);
        drop(x);
        let (n2, xhat2, rstd2) = ops::rms_norm(&x2, w.get(ix.ln2)?, h, eps);
        let n2_m = Mat::new(&n2, n, h);
        let gate = self.proj(&w, n2_m, ix.gate)?;
        let up = self.proj(&w, n2_m, ix.up)?;
        let (act, sig) = ops::swiglu(&gate, &up);
        let mut out = self.proj(&w, Mat::new(&act, n, inner), ix.down)?;
        ops::add_into(&mut out, &x2);
        let saved = save.then_some(LlamaSaved {
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
        let w = Weights::of(p)?;
        // The gradient of a linear's input, weight and bias from its output's `dy`: the
        // weight's and bias's added into `acc`, the input's into `dx` (set when empty).
        let linear_back = |acc: &mut [&mut [f32]],
                           dy: &[f32],
                           width: usize,
                           input: Mat,
                           (wi, b): (usize, Option<usize>),
                           dx: &mut Vec<f32>|
         -> Result<()> {
            if let Some(b) = b {
                ops::sum_rows(dy, acc[b]);
            }
            let dy = Mat::new(dy, n, width);
            self.matmul_add(acc[wi], dy.t(), input)?;
            match dx.is_empty() {
                true => *dx = self.matmul(dy, w.mat(wi)?)?,
                false => self.matmul_add(dx, dy, w.mat(wi)?)?,
            }
            Ok(())
        };
        // The MLP: out = x2 + down(silu(gate) · up).
        let mut dact = Vec::new();
        linear_back(
            acc,
            &dout,
            h,
            Mat::new(&sv.act, n, inner),
            ix.down,
            &mut dact,
        )?;
        drop(sv.act);
        let (dgate, dup) = ops::swiglu_back(&dact, &sv.gate, &sv.up, &sv.sig);
        drop(dact);
        let n2 = Mat::new(&sv.n2, n, h);
        let mut dn2 = Vec::new();
        linear_back(acc, &dgate, inner, n2, ix.gate, &mut dn2)?;
        linear_back(acc, &dup, inner, n2, ix.up, &mut dn2)?;
        let mut dx2 = dout;
        ops::rms_norm_back(
            &dn2,
            &sv.xhat2,
            &sv.rstd2,
            w.get(ix.ln2)?,
            &mut dx2,
            acc[ix.ln2],
        );
        drop(dn2);
        // Attention: x2 = x + o(y).
        let mut dy = Vec::new();
        linear_back(acc, &dx2, h, Mat::new(&sv.y, n, a * d), ix.o, &mut dy)?;
        let dyh = ops::split_to_heads(&dy, s, a, d);
        drop(dy);
        let (groups, qd, sd, qs) = (rows * kvh, rep * s * d, s * d, rep * s * s);
        let dyh_m = (Mat::new(&dyh, rep * s, d), qd);
        let mut datt = gemm::bmm(groups, dyh_m, (Mat::new(&sv.v, s, d).t(), sd))?;
        let dv = gemm::bmm(groups, (Mat::new(&sv.att, rep * s, s).t(), qs), dyh_m)?;
        drop(dyh);
        ops::causal_softmax_back(&mut datt, &sv.att, s, 1.0 / (d as f32).sqrt());
        let dscores = Mat::new(&datt, rep * s, s);
        let mut dq = gemm::bmm(groups, (dscores, qs), (Mat::new(&sv.k, s, d), sd))?;
        let mut dk = gemm::bmm(groups, (dscores.t(), qs), (Mat::new(&sv.q, rep * s, d), qd))?;
        drop(datt);
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
        let dv = merged(&dv, kvh, kvw);
        let n1 = Mat::new(&sv.n1, n, h);
        let mut dn1 = Vec::new();
        linear_back(acc, &dq, qw, n1, ix.q, &mut dn1)?;
        linear_back(acc, &dk, kvw, n1, ix.k, &mut dn1)?;
        linear_back(acc, &dv, kvw, n1, ix.v, &mut dn1)?;
        let mut dx = dx2;
        ops::rms_norm_back(
            &dn1,
            &sv.xhat1,
            &sv.rstd1,
            w.get(ix.ln1)?,
            &mut dx,
            acc[ix.ln1],
        );
        Ok(dx)
    }
}
