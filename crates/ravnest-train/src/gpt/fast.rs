//! The GPT's forward and backward written out layer by layer on the CPU, without candle's
//! autograd: candle's matrix products (the `gemm` crate) do the heavy lifting, every other
//! operation is one pass over contiguous values ([`super::ops`]), and what the backward needs
//! is kept from the forward instead of rebuilt.
//!
//! Why by hand (as the MLP's step, [`crate::mlp`]): candle's autograd makes every operation a
//! graph node, builds the causal mask again for every block on every pass, and accumulates
//! each node's gradient into zeros made for it, so a backward allocated several times the
//! model's gradient at once; and a stage's backward ran the forward again. Here a block's
//! backward allocates its own activations' gradients and its parameters' once.
//!
//! Checked against the autograd path (the reference: [`super::Gpt::stage_backward_with`]) in
//! the tests below, forward and gradients, for every kind of stage.

use rayon::prelude::*;

use super::fast_llama::LlamaSaved;
use super::gemm::{self, Mat};
use super::host::{Layer, Weights, values};
use super::ops;
use super::{Gpt, StageInput};

type Result<T> = candle_core::Result<T>;

/// What a block's forward keeps for its backward.
struct BlockSaved {
    xhat1: Vec<f32>,
    rstd1: Vec<f32>,
    n1: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    att: Vec<f32>,
    y: Vec<f32>,
    xhat2: Vec<f32>,
    rstd2: Vec<f32>,
    n2: Vec<f32>,
    f: Vec<f32>,
    th: Vec<f32>,
    u: Vec<f32>,
}

/// What the head's forward keeps: the final norm's pieces and the probabilities.
pub(super) struct HeadSaved {
    xhat: Vec<f32>,
    rstd: Vec<f32>,
    n: Vec<f32>,
    probs: Vec<f32>,
    targets: Vec<u32>,
}

enum Saved {
    Embed(Vec<u32>),
    Block(Box<BlockSaved>),
    Llama(Box<LlamaSaved>),
    Head(HeadSaved),
}

impl Gpt {
    fn embed_forward(&self, p: &Layer, ids: &[u32]) -> Result<Vec<f32>> {
        let h = self.hidden;
        let mut x = vec![0.0f32; ids.len() * h];
        if self.is_llama() {
            values(&p[0], |wte| {
                for (&id, row) in ids.iter().zip(x.chunks_exact_mut(h)) {
                    row.copy_from_slice(&wte[id as usize * h..][..h]);
                }
            })?;
            return Ok(x);
        }
        values(&p[0], |wte| {
            values(&p[1], |wpe| {
                for (n, (&id, row)) in ids.iter().zip(x.chunks_exact_mut(h)).enumerate() {
                    let (a, b) = (id as usize * h, (n % self.seq) * h);
                    for ((o, t), s) in row.iter_mut().zip(&wte[a..a + h]).zip(&wpe[b..b + h]) {
                        *o = t + s;
                    }
                }
            })
        })??;
        Ok(x)
    }

    fn block_forward(
        &self,
        p: &Layer,
        x: Vec<f32>,
        rows: usize,
        save: bool,
    ) -> Result<(Vec<f32>, Option<BlockSaved>)> {
        let (s, h, a) = (self.seq, self.hidden, self.heads);
        let d = h / a;
        let n = rows * s;
        let eps = self.arch.norm_eps as f32;
        let inner = self.arch.intermediate;
        let w = Weights::of(p)?;
        let (n1, xhat1, rstd1) = ops::layer_norm(&x, w.get(0)?, w.get(1)?, h, eps);
        let qkv = self.matmul(Mat::new(&n1, n, h), w.mat(2)?)?;
        let [q, k, v] = ops::split_heads(&qkv, w.get(3)?, s, a, d);
        drop(qkv);
        // One (seq, head) matrix per row and head.
        let (heads, sd, ss) = (rows * a, s * d, s * s);
        let mut att = gemm::bmm(
            heads,
            (Mat::new(&q, s, d), sd),
            (Mat::new(&k, s, d).t(), sd),
        )?;
        ops::causal_softmax(&mut att, s, 1.0 / (d as f32).sqrt());
        let yh = gemm::bmm(heads, (Mat::new(&att, s, s), ss), (Mat::new(&v, s, d), sd))?;
        let mut y = vec![0.0f32; n * h];
        ops::merge_heads(&yh, s, a, d, &mut y, h, 0);
        drop(yh);
        let mut x2 = self.matmul(Mat::new(&y, n, h), w.mat(4)?)?;
        ops::add_bias(&mut x2, w.get(5)?);
        ops::add_into(&mut x2, &x);
        drop(x);
        let (n2, xhat2, rstd2) = ops::layer_norm(&x2, w.get(6)?, w.get(7)?, h, eps);
        let mut f = self.matmul(Mat::new(&n2, n, h), w.mat(8)?)?;
        ops::add_bias(&mut f, w.get(9)?);
        let (u, th) = ops::gelu(&f);
        let mut out = self.matmul(Mat::new(&u, n, inner), w.mat(10)?)?;
        ops::add_bias(&mut out, w.get(11)?);
        ops::add_into(&mut out, &x2);
        let saved = save.then_some(BlockSaved {
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
            f,
            th,
            u,
        });
        Ok((out, saved))
    }

    /// The head: (Σ over rows of the mean loss per token, what its backward needs).
    fn head_forward(&self, p: &Layer, x: &[f32], targets: Vec<u32>) -> Result<(f64, HeadSaved)> {
        let (h, vocab) = (self.hidden, self.vocab);
        let n = x.len() / h;
        let eps = self.arch.norm_eps as f32;
        let w = Weights::of(p)?;
        let (nv, xhat, rstd) = if self.is_llama() {
            ops::rms_norm(x, w.get(0)?, h, eps)
        } else {
            ops::layer_norm(x, w.get(0)?, w.get(1)?, h, eps)
        };
        let mut probs = self.matmul(Mat::new(&nv, n, h), w.mat(p.len() - 1)?.t())?;
        // Each row's softmax in place, and its log-likelihood of the target; the loss sums
        // them in row order (on several threads, rows in parallel: the same bits).
        let softmax = |(row, &t): (&mut [f32], &u32)| {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let target = row[t as usize] - max;
            let mut sum = 0.0f32;
            for v in row.iter_mut() {
                *v = (*v - max).exp();
                sum += *v;
            }
            let inv = 1.0 / sum;
            for v in row.iter_mut() {
                *v *= inv;
            }
            f64::from(target - sum.ln())
        };
        let ll: Vec<f64> = if ops::threaded() {
            probs
                .par_chunks_mut(vocab)
                .zip(&targets)
                .map(softmax)
                .collect()
        } else {
            probs
                .chunks_exact_mut(vocab)
                .zip(&targets)
                .map(softmax)
                .collect()
        };
        let loss = ll.iter().fold(0.0f64, |loss, l| loss - l);
        let saved = HeadSaved {
            xhat,
            rstd,
            n: nv,
            probs,
            targets,
        };
        Ok((loss / self.seq as f64, saved))
    }

    fn block_backward(
        &self,
        p: &Layer,
        sv: BlockSaved,
        dout: Vec<f32>,
        acc: &mut [&mut [f32]],
    ) -> Result<Vec<f32>> {
        let (s, h, a) = (self.seq, self.hidden, self.heads);
        let d = h / a;
        let n = dout.len() / h;
        let rows = n / s;
        let inner = self.arch.intermediate;
        let w = Weights::of(p)?;
        ops::sum_rows(&dout, acc[11]);
        // MLP out: u · W + b.
        let dout_m = Mat::new(&dout, n, h);
        self.matmul_add(acc[10], Mat::new(&sv.u, n, inner).t(), dout_m)?;
        let mut df = self.matmul(dout_m, w.mat(10)?.t())?;
        drop(sv.u);
        ops::gelu_back(&mut df, &sv.f, &sv.th);
        ops::sum_rows(&df, acc[9]);
        let df_m = Mat::new(&df, n, inner);
        self.matmul_add(acc[8], Mat::new(&sv.n2, n, h).t(), df_m)?;
        let dn2 = self.matmul(df_m, w.mat(8)?.t())?;
        drop(df);
        // The residual: dx2 = dout + LayerNorm 2's backward.
        let mut dx2 = dout;
        let (dg2, db2) = pair(acc, 6, 7);
        ops::layer_norm_back(&dn2, &sv.xhat2, &sv.rstd2, w.get(6)?, &mut dx2, dg2, db2);
        drop(dn2);
        // Attention's projection.
        ops::sum_rows(&dx2, acc[5]);
        let dx2_m = Mat::new(&dx2, n, h);
        self.matmul_add(acc[4], Mat::new(&sv.y, n, h).t(), dx2_m)?;
        let dy = self.matmul(dx2_m, w.mat(4)?.t())?;
        // Attention: back to heads, the inverse of merge_heads.
        let dyh = ops::split_to_heads(&dy, s, a, d);
        drop(dy);
        let (heads, sd, ss) = (rows * a, s * d, s * s);
        let dyh_m = (Mat::new(&dyh, s, d), sd);
        let mut datt = gemm::bmm(heads, dyh_m, (Mat::new(&sv.v, s, d).t(), sd))?;
        let dv = gemm::bmm(heads, (Mat::new(&sv.att, s, s).t(), ss), dyh_m)?;
        drop(dyh);
        ops::causal_softmax_back(&mut datt, &sv.att, s, 1.0 / (d as f32).sqrt());
        let dscores = Mat::new(&datt, s, s);
        let dq = gemm::bmm(heads, (dscores, ss), (Mat::new(&sv.k, s, d), sd))?;
        let dk = gemm::bmm(heads, (dscores.t(), ss), (Mat::new(&sv.q, s, d), sd))?;
        drop(datt);
        let mut dqkv = vec![0.0f32; n * 3 * h];
        for (i, part) in [&dq, &dk, &dv].into_iter().enumerate() {
            ops::merge_heads(part, s, a, d, &mut dqkv, 3 * h, i * h);
        }
        drop((dq, dk, dv));
        ops::sum_rows(&dqkv, acc[3]);
        let dqkv_m = Mat::new(&dqkv, n, 3 * h);
        self.matmul_add(acc[2], Mat::new(&sv.n1, n, h).t(), dqkv_m)?;
        let dn1 = self.matmul(dqkv_m, w.mat(2)?.t())?;
        drop(dqkv);
        // The residual: dx = dx2 + LayerNorm 1's backward.
        let mut dx = dx2;
        let (dg1, db1) = pair(acc, 0, 1);
        ops::layer_norm_back(&dn1, &sv.xhat1, &sv.rstd1, w.get(0)?, &mut dx, dg1, db1);
        Ok(dx)
    }

    fn head_backward(&self, p: &Layer, sv: HeadSaved, acc: &mut [&mut [f32]]) -> Result<Vec<f32>> {
        let (h, vocab) = (self.hidden, self.vocab);
        let n = sv.targets.len();
        // d(loss)/d(logits) = (p − onehot(target)) / seq.
        let scale = 1.0 / self.seq as f32;
        let mut dl = sv.probs;
        let grad = |(row, &t): (&mut [f32], &u32)| {
            row[t as usize] -= 1.0;
            for v in row.iter_mut() {
                *v *= scale;
            }
        };
        if ops::threaded() {
            dl.par_chunks_mut(vocab).zip(&sv.targets).for_each(grad);
        } else {
            dl.chunks_exact_mut(vocab).zip(&sv.targets).for_each(grad);
        }
        let w = Weights::of(p)?;
        let head = p.len() - 1;
        let dl_m = Mat::new(&dl, n, vocab);
        self.matmul_add(acc[head], dl_m.t(), Mat::new(&sv.n, n, h))?;
        let dn = self.matmul(dl_m, w.mat(head)?)?;
        drop(dl);
        let mut dx = vec![0.0f32; n * h];
        if self.is_llama() {
            ops::rms_norm_back(&dn, &sv.xhat, &sv.rstd, w.get(0)?, &mut dx, acc[0]);
            return Ok(dx);
        }
        let (dg, db) = pair(acc, 0, 1);
        ops::layer_norm_back(&dn, &sv.xhat, &sv.rstd, w.get(0)?, &mut dx, dg, db);
        Ok(dx)
    }

    fn embed_backward(&self, ids: &[u32], dx: &[f32], acc: &mut [&mut [f32]]) {
        let h = self.hidden;
        if self.is_llama() {
            for (&id, row) in ids.iter().zip(dx.chunks_exact(h)) {
                for (o, v) in acc[0][id as usize * h..][..h].iter_mut().zip(row) {
                    *o += v;
                }
            }
            return;
        }
        let (dwte, dwpe) = pair(acc, 0, 1);
        for (k, (&id, row)) in ids.iter().zip(dx.chunks_exact(h)).enumerate() {
            for (o, v) in dwte[id as usize * h..][..h].iter_mut().zip(row) {
                *o += v;
            }
            for (o, v) in dwpe[(k % self.seq) * h..][..h].iter_mut().zip(row) {
                *o += v;
            }
        }
    }

    /// The tokens' inputs and targets, checked.
    fn ids(&self, tokens: &[f32]) -> Result<(Vec<u32>, Vec<u32>)> {
        let w = self.seq + 1;
        if tokens.is_empty() || !tokens.len().is_multiple_of(w) {
            candle_core::bail!("{} tokens are not rows of {w}", tokens.len());
        }
        let pick = |skip: usize| -> Vec<u32> {
            tokens
                .chunks_exact(w)
                .flat_map(|r| r[skip..skip + self.seq].iter().map(|&t| t as u32))
                .collect()
        };
        let (x, y) = (pick(0), pick(1));
        if let Some(bad) = x.iter().chain(&y).find(|&&t| t as usize >= self.vocab) {
            candle_core::bail!("token {bad} is outside the vocabulary of {}", self.vocab);
        }
        Ok((x, y))
    }

    /// Layers `layers` forward on the CPU by hand, keeping what the backward needs when
    /// `save`: (the output: hidden states, or on the last stage the loss sum as one value;
    /// what was kept, first layer first).
    fn fast_run(
        &self,
        layers: std::ops::Range<usize>,
        p: &[&Layer],
        input: StageInput<'_>,
        tokens: Option<&[f32]>,
        save: bool,
    ) -> Result<(Vec<f32>, Vec<Saved>)> {
        let rows = self.rows_of(&layers, input)?;
        let mut kept = Vec::new();
        let mut x = match input {
            StageInput::Hidden(h) => h.to_vec(),
            StageInput::Tokens(_) => Vec::new(),
        };
        for (i, l) in layers.enumerate() {
            if l == 0 {
                let StageInput::Tokens(t) = input else {
                    candle_core::bail!("the embedding takes tokens");
                };
                let (ids, _) = self.ids(t)?;
                x = self.embed_forward(p[i], &ids)?;
                if save {
                    kept.push(Saved::Embed(ids));
                }
            } else if l == self.layers + 1 {
                let t = tokens
                    .or(match input {
                        StageInput::Tokens(t) => Some(t),
                        StageInput::Hidden(_) => None,
                    })
                    .ok_or_else(|| {
                        candle_core::Error::Msg("the last stage needs the targets".into())
                    })?;
                let (_, targets) = self.ids(t)?;
                if targets.len() != rows * self.seq {
                    candle_core::bail!(
                        "{} targets for {rows} rows of hidden states",
                        targets.len()
                    );
                }
                let (loss, sv) = self.head_forward(p[i], &x, targets)?;
                if save {
                    kept.push(Saved::Head(sv));
                }
                x = vec![loss as f32];
            } else if self.is_llama() {
                let (out, sv) = self.llama_block_forward(p[i], x, rows, save)?;
                x = out;
                if let Some(sv) = sv {
                    kept.push(Saved::Llama(Box::new(sv)));
                }
            } else {
                let (out, sv) = self.block_forward(p[i], x, rows, save)?;
                x = out;
                if let Some(sv) = sv {
                    kept.push(Saved::Block(Box::new(sv)));
                }
            }
        }
        Ok((x, kept))
    }

    /// [`Gpt::stage_forward_with`] by hand on the CPU (`p[i]`: layer `layers.start + i`'s
    /// tensors).
    pub fn fast_forward(
        &self,
        layers: std::ops::Range<usize>,
        p: &[&Layer],
        input: StageInput<'_>,
        tokens: Option<&[f32]>,
    ) -> Result<Vec<f32>> {
        Ok(self.fast_run(layers, p, input, tokens, false)?.0)
    }

    /// [`Gpt::stage_backward_with`] by hand on the CPU: the forward, keeping what the backward
    /// needs, then the backward, each parameter's gradient *added* into `acc` (one slice per
    /// tensor of the layers, in order: a stage sums its micro-batches there, a data-parallel
    /// step writes its gradient bucket in place). Returns (the input's gradient, empty on the
    /// first stage; the loss sum, NaN unless the last stage).
    pub fn fast_backward(
        &self,
        layers: std::ops::Range<usize>,
        p: &[&Layer],
        input: StageInput<'_>,
        tokens: Option<&[f32]>,
        grad_out: Option<&[f32]>,
        acc: &mut [&mut [f32]],
    ) -> Result<(Vec<f32>, f64)> {
        self.fast_backward_each(layers, p, input, tokens, grad_out, acc, &mut |_, _| {})
    }

    /// [`Gpt::fast_backward`], calling `done(l, grads)` as soon as layer `l`'s gradients are
    /// complete (the layers from the last down), with that layer's slices of `acc`: a
    /// data-parallel step hands them to the all-reduce while the layers below compute.
    #[allow(clippy::too_many_arguments)]
    pub fn fast_backward_each(
        &self,
        layers: std::ops::Range<usize>,
        p: &[&Layer],
        input: StageInput<'_>,
        tokens: Option<&[f32]>,
        grad_out: Option<&[f32]>,
        acc: &mut [&mut [f32]],
        done: &mut dyn FnMut(usize, &[&mut [f32]]),
    ) -> Result<(Vec<f32>, f64)> {
        let first_layer = layers.start;
        let last = layers.end == self.planner_layers();
        let want: usize = p.iter().map(|l| l.len()).sum();
        if acc.len() != want {
            candle_core::bail!("{} gradient buffers for {want} tensors", acc.len());
        }
        let (out, kept) = self.fast_run(layers.clone(), p, input, tokens, true)?;
        crate::phases::forward_done();
        let (loss, mut dx) = match grad_out {
            None if last => (f64::from(out[0]), Vec::new()),
            None => candle_core::bail!("a stage before the last needs its output's gradient"),
            Some(g) if g.len() == out.len() && !last => (f64::NAN, g.to_vec()),
            Some(g) => candle_core::bail!(
                "an output gradient of {} values for {} outputs",
                g.len(),
                out.len()
            ),
        };
        drop(out);
        // Each layer's buffers: the layers' tensors in order.
        let mut ends: Vec<usize> = p
            .iter()
            .scan(0, |at, l| {
                *at += l.len();
                Some(*at)
            })
            .collect();
        let mut rest: &mut [&mut [f32]] = acc;
        for (i, sv) in kept.into_iter().enumerate().rev() {
            let start = ends[i] - p[i].len();
            let (head, mine) = rest.split_at_mut(start);
            rest = head;
            ends.truncate(i);
            match sv {
                Saved::Head(sv) => dx = self.head_backward(p[i], sv, mine)?,
                Saved::Block(sv) => {
                    dx = self.block_backward(p[i], *sv, std::mem::take(&mut dx), mine)?
                }
                Saved::Llama(sv) => {
                    dx = self.llama_block_backward(p[i], *sv, std::mem::take(&mut dx), mine)?
                }
                Saved::Embed(ids) => {
                    self.embed_backward(&ids, &dx, mine);
                    dx = Vec::new();
                }
            }
            done(first_layer + i, mine);
        }
        Ok((dx, loss))
    }
}

/// Two of the buffers at once (`i < j`).
fn pair<'a>(acc: &'a mut [&mut [f32]], i: usize, j: usize) -> (&'a mut [f32], &'a mut [f32]) {
    let (a, b) = acc.split_at_mut(j);
    (&mut *a[i], &mut *b[0])
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Var;
    use candle_core::{Device, Tensor};
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn gpt() -> Gpt {
        Gpt::gpt2(2, 16, 4, 6, 20)
    }

    fn tokens(g: &Gpt, rows: usize) -> Vec<f32> {
        let mut rng = ChaCha8Rng::seed_from_u64(4);
        (0..rows * (g.seq + 1))
            .map(|_| rng.random_range(0..g.vocab) as f32)
            .collect()
    }

    /// The model's tensors by layer: as variables (the autograd reference) and as tensors.
    fn params(g: &Gpt) -> Vec<Vec<Var>> {
        let flat = g.init(2);
        // Biases and LayerNorm gains away from 0 and 1, so their gradients are exercised.
        let mut rng = ChaCha8Rng::seed_from_u64(8);
        let mut at = 0;
        (0..g.planner_layers())
            .map(|l| {
                g.layer_params(l)
                    .iter()
                    .map(|p| {
                        let n: usize = p.shape.iter().product();
                        let v: Vec<f32> = flat[at..at + n]
                            .iter()
                            .map(|x| x + rng.random_range(-0.05f32..0.05))
                            .collect();
                        at += n;
                        Var::from_vec(v, p.shape.as_slice(), &Device::Cpu).unwrap()
                    })
                    .collect()
            })
            .collect()
    }

    fn close(a: &[f32], b: &[f32], what: &str) {
        assert_eq!(a.len(), b.len(), "{what}");
        let scale = b.iter().map(|x| x.abs()).fold(0.0f32, f32::max).max(1e-6);
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!(
                (x - y).abs() <= 2e-5 * scale + 1e-6,
                "{what}[{i}]: {x} vs {y} (scale {scale})"
            );
        }
    }

    /// Every kind of stage (the whole model, the first, a middle and the last), forward and
    /// backward, against candle's autograd of the same layers.
    #[test]
    fn the_hand_written_pass_equals_autograd() {
        check(gpt());
    }

    /// A Llama with grouped-query attention (4 heads over 2 key/value heads), Llama 3's
    /// rotary scaling, and an MLP of its own width.
    fn llama() -> Gpt {
        let mut g = Gpt::llama(2, 16, 4, 2, 24, 6, 20);
        g.0.arch.rope_theta = 500.0;
        g.0.arch.rope = ravnest_core::decoder::Rope::Llama3 {
            factor: 4.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8.0,
        };
        g
    }

    #[test]
    fn the_hand_written_llama_pass_equals_autograd_and_the_fused_kernels() {
        check(llama());
    }

    /// Qwen2's q/k/v biases, and every bias Llama's options add (o_proj, the MLP's).
    #[test]
    fn biases_of_every_kind_are_trained() {
        let mut g = llama();
        g.0.arch.class = ravnest_core::decoder::HfClass::Qwen2;
        g.0.arch.qkv_bias = true;
        check(g);
        g.0.arch.out_bias = true;
        g.0.arch.mlp_bias = true;
        g.0.arch.kv_heads = 1;
        check(g);
    }

    /// Under bf16 the pass computes what fp32 does to bf16's precision (the loss within
    /// 1e-2, each gradient within a few percent of its largest value), and not the same
    /// (the rounding is real), for GPT-2's blocks and Llama's.
    #[test]
    fn bf16_rounds_every_product_and_stays_close() {
        for g in [gpt(), llama()] {
            let p = params(&g);
            let toks = tokens(&g, 3);
            let ts: Vec<Vec<Tensor>> = p
                .iter()
                .map(|l| l.iter().map(|v| v.as_tensor().detach()).collect())
                .collect();
            let refs: Vec<&Layer> = ts.iter().map(Vec::as_slice).collect();
            let pass = |g: Gpt| {
                let mut bufs: Vec<Vec<f32>> = refs
                    .iter()
                    .flat_map(|l| l.iter().map(|t| vec![0.0; t.elem_count()]))
                    .collect();
                let mut acc: Vec<&mut [f32]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
                let all = 0..g.planner_layers();
                let (_, loss) = g
                    .fast_backward(all, &refs, StageInput::Tokens(&toks), None, None, &mut acc)
                    .unwrap();
                (loss, bufs)
            };
            let (l32, g32) = pass(g);
            let (l16, g16) = pass(g.computing(super::super::Numerics::Bf16));
            assert!((l16 - l32).abs() < 1e-2 * l32.abs(), "loss {l16} vs {l32}");
            assert!(l16 != l32, "bf16 rounded nothing");
            for (k, (a, b)) in g16.iter().zip(&g32).enumerate() {
                let scale = b.iter().map(|x| x.abs()).fold(0.0f32, f32::max).max(1e-6);
                let worst = a
                    .iter()
                    .zip(b)
                    .map(|(x, y)| (x - y).abs())
                    .fold(0.0, f32::max);
                assert!(
                    worst <= 0.05 * scale,
                    "tensor {k}: off by {worst} of {scale}"
                );
            }
            // A product's result is a bf16 value.
            let g16 = g.computing(super::super::Numerics::Bf16);
            let (r, c) = ts[1][2].dims2().unwrap();
            let v = values(&ts[1][2], |w| {
                g16.matmul(Mat::new(w, r, c), Mat::new(w, r, c).t())
            })
            .unwrap()
            .unwrap();
            assert!(v.iter().all(|&x| x.to_bits() & 0xffff == 0), "{v:?}");
        }
    }

    /// The one-pass rounding is bf16's own (half's, to the nearest, ties to even), over
    /// every kind of f32: normal, subnormal, the largest, infinities.
    #[test]
    fn rounding_to_bf16_is_halfs() {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let special = [
            0.0f32,
            -0.0,
            1.0,
            f32::MAX,
            f32::MIN_POSITIVE,
            1e-40,
            f32::INFINITY,
        ];
        let random = (0..100_000).map(|_| f32::from_bits(rng.random::<u32>()));
        for x in special.into_iter().chain(random).filter(|x| !x.is_nan()) {
            let want = half::bf16::from_f32(x).to_f32();
            assert_eq!(
                super::super::host::round_bf16(x).to_bits(),
                want.to_bits(),
                "{x:e}"
            );
        }
    }

    fn check(g: Gpt) {
        let dev = Device::Cpu;
        let p = params(&g);
        let toks = tokens(&g, 3);
        let hidden: Vec<f32> = (0..3 * g.seq * g.hidden)
            .map(|i| ((i * 7 % 13) as f32 - 6.0) / 6.0)
            .collect();
        let dout: Vec<f32> = (0..3 * g.seq * g.hidden)
            .map(|i| ((i * 5 % 11) as f32 - 5.0) / 50.0)
            .collect();
        let all = g.planner_layers();
        for (layers, from_tokens, last) in [
            (0..all, true, true),
            (0..2, true, false),
            (1..3, false, false),
            (2..all, false, true),
        ] {
            let input = if from_tokens {
                StageInput::Tokens(&toks)
            } else {
                StageInput::Hidden(&hidden)
            };
            let vars = &p[layers.clone()];
            let ts: Vec<Vec<Tensor>> = vars
                .iter()
                .map(|l| l.iter().map(|v| v.as_tensor().detach()).collect())
                .collect();
            let refs: Vec<&Layer> = ts.iter().map(Vec::as_slice).collect();
            let want = g
                .stage_forward_with(&dev, layers.clone(), vars, input, Some(&toks))
                .unwrap();
            let got = g
                .fast_forward(layers.clone(), &refs, input, Some(&toks))
                .unwrap();
            close(&got, &want, &format!("forward of {layers:?}"));
            let grad_out = (!last).then_some(dout.as_slice());
            let (wg, win, wl) = g
                .stage_backward_with(&dev, layers.clone(), vars, input, Some(&toks), grad_out)
                .unwrap();
            // Added into what the buffers held: twice, from 0.5.
            let mut bufs: Vec<Vec<f32>> = wg.iter().map(|t| vec![0.5; t.elem_count()]).collect();
            let (mut gin, mut gl) = (Vec::new(), 0.0);
            for _ in 0..2 {
                let mut acc: Vec<&mut [f32]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
                (gin, gl) = g
                    .fast_backward(
                        layers.clone(),
                        &refs,
                        input,
                        Some(&toks),
                        grad_out,
                        &mut acc,
                    )
                    .unwrap();
            }
            for (k, (a, b)) in bufs.iter().zip(&wg).enumerate() {
                let want: Vec<f32> = b
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
                    .iter()
                    .map(|x| 0.5 + 2.0 * x)
                    .collect();
                close(a, &want, &format!("gradient {k} of {layers:?}"));
            }
            close(&gin, &win, &format!("input gradient of {layers:?}"));
            if last {
                assert!((gl - wl).abs() < 1e-4 * wl.abs(), "{gl} vs {wl}");
            }
        }
    }
}
