//! The transformers' element-wise pieces on the host, one pass each over contiguous values:
//! LayerNorm and RMSNorm, GELU (tanh) and SwiGLU, rotary positions, the causal softmax of
//! attention, their gradients, and the moves between the `(rows·seq, hidden)` layout and
//! attention's `(rows·heads, seq, head)`. The fast paths (`gpt::fast`, `gpt::fast_llama`) pair
//! them with candle's matrix products.
//!
//! With more than one compute thread (rayon's pool, which candle's products use too), the
//! passes that cost most run on all of them, in pieces of whole rows or blocks: each value is
//! computed as on one thread, so the results are the same bits whatever the threads.

use rayon::prelude::*;

/// Values per piece of an element-wise pass split over threads.
const GRAIN: usize = 1 << 14;

/// Whether passes are split over threads (the pool has more than one).
pub(super) fn threaded() -> bool {
    rayon::current_num_threads() > 1
}

/// A piece of a norm's pass: its input rows, and where their output, normalized input and
/// 1/σ go.
type RowPiece<'a> = (((&'a [f32], &'a mut [f32]), &'a mut [f32]), &'a mut [f32]);

/// Rows per piece of a row-wise pass over rows `h` wide.
fn rows_per_piece(h: usize) -> usize {
    (GRAIN / h.max(1)).max(1)
}

/// LayerNorm of each row of `x` (`h` wide): (output, the normalized input x̂, 1/σ per row).
pub fn layer_norm(
    x: &[f32],
    g: &[f32],
    b: &[f32],
    h: usize,
    eps: f32,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    norm_rows(x, h, |row, y, xhat| {
        let mean = row.iter().sum::<f32>() / h as f32;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / h as f32;
        let r = 1.0 / (var + eps).sqrt();
        for ((((v, gi), bi), y), n) in row.iter().zip(g).zip(b).zip(y).zip(xhat) {
            *n = (v - mean) * r;
            *y = *n * gi + bi;
        }
        r
    })
}

/// A norm's pass over the rows of `x` (`h` wide): `row` writes a row's output and normalized
/// input and returns its 1/σ; (outputs, normalized inputs, 1/σ per row). On every thread when
/// there are several, in pieces of whole rows.
fn norm_rows(
    x: &[f32],
    h: usize,
    row: impl Fn(&[f32], &mut [f32], &mut [f32]) -> f32 + Sync,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut y = vec![0.0f32; x.len()];
    let mut xhat = vec![0.0f32; x.len()];
    let mut rstd = vec![0.0f32; x.len() / h];
    let piece = |(((x, y), xhat), rstd): RowPiece<'_>| {
        for (((x, y), xhat), r) in x
            .chunks_exact(h)
            .zip(y.chunks_exact_mut(h))
            .zip(xhat.chunks_exact_mut(h))
            .zip(rstd.iter_mut())
        {
            *r = row(x, y, xhat);
        }
    };
    let k = rows_per_piece(h);
    if threaded() {
        x.par_chunks(k * h)
            .zip(y.par_chunks_mut(k * h))
            .zip(xhat.par_chunks_mut(k * h))
            .zip(rstd.par_chunks_mut(k))
            .for_each(piece);
    } else {
        piece((((x, &mut y), &mut xhat), &mut rstd));
    }
    (y, xhat, rstd)
}

/// LayerNorm's backward: adds the input's gradient to `dx` and accumulates the gain's and the
/// bias's into `dg`, `db`. On several threads, `dx` in pieces of whole rows and the gain's and
/// bias's sums in pieces of whole columns, each column summed over the rows in order: the same
/// bits as on one thread.
pub fn layer_norm_back(
    dy: &[f32],
    xhat: &[f32],
    rstd: &[f32],
    g: &[f32],
    dx: &mut [f32],
    dg: &mut [f32],
    db: &mut [f32],
) {
    let h = g.len();
    if threaded() {
        rows_back(dy, xhat, rstd, h, dx, |dy, xh, r, dx, d| {
            ln_row_back(dy, xh, r, g, dx, d)
        });
        columns(h, dg, Some(db), |c, dg, mut db| {
            for (dy, xh) in dy.chunks_exact(h).zip(xhat.chunks_exact(h)) {
                let (dy, xh) = (&dy[c.clone()], &xh[c.clone()]);
                for i in 0..dg.len() {
                    dg[i] += dy[i] * xh[i];
                }
                if let Some(db) = db.as_deref_mut() {
                    for (b, v) in db.iter_mut().zip(dy) {
                        *b += v;
                    }
                }
            }
        });
        return;
    }
    let mut dxhat = vec![0.0f32; h];
    for (((dy, xh), r), dx) in dy
        .chunks_exact(h)
        .zip(xhat.chunks_exact(h))
        .zip(rstd)
        .zip(dx.chunks_exact_mut(h))
    {
        for i in 0..h {
            dg[i] += dy[i] * xh[i];
            db[i] += dy[i];
        }
        ln_row_back(dy, xh, *r, g, dx, &mut dxhat);
    }
}

/// One row of LayerNorm's backward: adds the input's gradient to `dx` (`d`: scratch, a row
/// wide).
fn ln_row_back(dy: &[f32], xh: &[f32], r: f32, g: &[f32], dx: &mut [f32], d: &mut [f32]) {
    let h = g.len();
    let (mut m1, mut m2) = (0.0f32, 0.0f32);
    for i in 0..h {
        let v = dy[i] * g[i];
        d[i] = v;
        m1 += v;
        m2 += v * xh[i];
    }
    let (m1, m2) = (m1 / h as f32, m2 / h as f32);
    for i in 0..h {
        dx[i] += r * (d[i] - m1 - xh[i] * m2);
    }
}

/// A norm's backward over the rows, on every thread in pieces of whole rows: `row` adds a
/// row's input gradient to its `dx` (with a scratch row).
fn rows_back(
    dy: &[f32],
    xhat: &[f32],
    rstd: &[f32],
    h: usize,
    dx: &mut [f32],
    row: impl Fn(&[f32], &[f32], f32, &mut [f32], &mut [f32]) + Sync,
) {
    let k = rows_per_piece(h);
    dx.par_chunks_mut(k * h)
        .zip(dy.par_chunks(k * h))
        .zip(xhat.par_chunks(k * h))
        .zip(rstd.par_chunks(k))
        .for_each(|(((dx, dy), xh), r)| {
            let mut d = vec![0.0f32; h];
            for (((dx, dy), xh), r) in dx
                .chunks_exact_mut(h)
                .zip(dy.chunks_exact(h))
                .zip(xh.chunks_exact(h))
                .zip(r)
            {
                row(dy, xh, *r, dx, &mut d);
            }
        });
}

/// Columns per piece of a pass split by columns: about one piece per thread, whole cache
/// lines.
fn cols_per_piece(w: usize) -> usize {
    (w / rayon::current_num_threads().max(1))
        .next_multiple_of(16)
        .max(16)
}

/// A sum over rows split by columns, on every thread: `piece` gets its columns' range and
/// their parts of `a` (and of `b`), and sums into them over the rows in order, so each column
/// is summed as on one thread.
fn columns(
    w: usize,
    a: &mut [f32],
    b: Option<&mut [f32]>,
    piece: impl Fn(std::ops::Range<usize>, &mut [f32], Option<&mut [f32]>) + Sync,
) {
    let c = cols_per_piece(w);
    match b {
        Some(b) => a
            .par_chunks_mut(c)
            .zip(b.par_chunks_mut(c))
            .enumerate()
            .for_each(|(j, (a, b))| piece(j * c..j * c + a.len(), a, Some(b))),
        None => a
            .par_chunks_mut(c)
            .enumerate()
            .for_each(|(j, a)| piece(j * c..j * c + a.len(), a, None)),
    }
}

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const GELU_C: f32 = 0.044_715;

/// tanh by a rational approximation (the one Eigen uses for floats): within a few ulp of
/// `f32::tanh` over all of f32, several times faster than the library call, which the GELU of
/// every hidden unit pays twice a step.
pub fn tanh(x: f32) -> f32 {
    let x = x.clamp(-7.905_311, 7.905_311);
    if x.abs() < 0.0004 {
        return x;
    }
    let x2 = x * x;
    let p = x2 * -2.760_768_5e-16 + 2.000_188e-13;
    let p = x2 * p + -8.604_672e-11;
    let p = x2 * p + 5.122_297_1e-8;
    let p = x2 * p + 1.485_722_4e-5;
    let p = x2 * p + 6.372_619_3e-4;
    let p = x2 * p + 4.893_524_6e-3;
    let p = x * p;
    let q = x2 * 1.198_258_4e-6 + 1.185_347_1e-4;
    let q = x2 * q + 2.268_434_6e-3;
    let q = x2 * q + 4.893_525e-3;
    p / q
}

/// GELU (the tanh form GPT-2 uses) of each value: (output, the tanh inside it, kept for the
/// backward).
pub fn gelu(f: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let mut u = vec![0.0f32; f.len()];
    let mut t = vec![0.0f32; f.len()];
    let piece = |((f, u), t): ((&[f32], &mut [f32]), &mut [f32])| {
        for ((&x, u), t) in f.iter().zip(u).zip(t) {
            let th = tanh(SQRT_2_OVER_PI * (x + GELU_C * x * x * x));
            *t = th;
            *u = 0.5 * x * (1.0 + th);
        }
    };
    if threaded() {
        f.par_chunks(GRAIN)
            .zip(u.par_chunks_mut(GRAIN))
            .zip(t.par_chunks_mut(GRAIN))
            .for_each(piece);
    } else {
        piece(((f, &mut u), &mut t));
    }
    (u, t)
}

/// GELU's backward in place: `du` becomes the gradient of its input `f` (`t`: the tanh the
/// forward kept).
pub fn gelu_back(du: &mut [f32], f: &[f32], t: &[f32]) {
    let piece = |((du, f), t): ((&mut [f32], &[f32]), &[f32])| {
        for ((d, &x), &th) in du.iter_mut().zip(f).zip(t) {
            let inner = SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_C * x * x);
            *d *= 0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * inner;
        }
    };
    if threaded() {
        du.par_chunks_mut(GRAIN)
            .zip(f.par_chunks(GRAIN))
            .zip(t.par_chunks(GRAIN))
            .for_each(piece);
    } else {
        piece(((du, f), t));
    }
}

/// `(rows·seq, 3·hidden)` values plus the bias, as q, k and v, each `(rows·heads, seq, head)`.
/// On several threads, a row (a sequence) per piece: moves, the same bits on any.
pub fn split_heads(qkv: &[f32], bias: &[f32], seq: usize, heads: usize, d: usize) -> [Vec<f32>; 3] {
    let h = heads * d;
    let n = qkv.len() / (3 * h);
    let mut out = [
        vec![0.0f32; n * h],
        vec![0.0f32; n * h],
        vec![0.0f32; n * h],
    ];
    // One sequence: its (seq, 3·hidden) values into its (heads, seq, head) block of each.
    let row = |src: &[f32], q: &mut [f32], k: &mut [f32], v: &mut [f32]| {
        for t in 0..seq {
            let src = &src[t * 3 * h..][..3 * h];
            for (i, o) in [&mut *q, &mut *k, &mut *v].into_iter().enumerate() {
                for a in 0..heads {
                    let at = (a * seq + t) * d;
                    let from = i * h + a * d;
                    for e in 0..d {
                        o[at + e] = src[from + e] + bias[from + e];
                    }
                }
            }
        }
    };
    let [q, k, v] = &mut out;
    if threaded() {
        qkv.par_chunks(seq * 3 * h)
            .zip(q.par_chunks_mut(seq * h))
            .zip(k.par_chunks_mut(seq * h))
            .zip(v.par_chunks_mut(seq * h))
            .for_each(|(((src, q), k), v)| row(src, q, k, v));
    } else {
        for (((src, q), k), v) in qkv
            .chunks_exact(seq * 3 * h)
            .zip(q.chunks_exact_mut(seq * h))
            .zip(k.chunks_exact_mut(seq * h))
            .zip(v.chunks_exact_mut(seq * h))
        {
            row(src, q, k, v);
        }
    }
    out
}

/// The inverse move: `(rows·heads, seq, head)` parts to `(rows·seq, heads·head)`, added into
/// `out` at column `col` of its `width` columns (attention's output, or the gradients of q, k
/// and v into the gradient of the fused projection). On several threads, a sequence per piece.
pub fn merge_heads(
    x: &[f32],
    seq: usize,
    heads: usize,
    d: usize,
    out: &mut [f32],
    width: usize,
    col: usize,
) {
    let row = |x: &[f32], out: &mut [f32]| {
        for a in 0..heads {
            for t in 0..seq {
                let src = &x[(a * seq + t) * d..][..d];
                out[t * width + col + a * d..][..d].copy_from_slice(src);
            }
        }
    };
    let part = heads * seq * d;
    if threaded() {
        x.par_chunks(part)
            .zip(out.par_chunks_mut(seq * width))
            .for_each(|(x, out)| row(x, out));
    } else {
        for (x, out) in x.chunks_exact(part).zip(out.chunks_exact_mut(seq * width)) {
            row(x, out);
        }
    }
}

/// The causal softmax of attention scores in place: each row `i` of each `seq × seq` block
/// scaled by `scale`, positions after `i` masked out (probability 0).
pub fn causal_softmax(s: &mut [f32], seq: usize, scale: f32) {
    if threaded() {
        s.par_chunks_mut(seq * seq)
            .for_each(|block| causal_softmax_block(block, seq, scale));
    } else {
        for block in s.chunks_exact_mut(seq * seq) {
            causal_softmax_block(block, seq, scale);
        }
    }
}

/// [`causal_softmax`] of one `seq × seq` block.
fn causal_softmax_block(block: &mut [f32], seq: usize, scale: f32) {
    for (i, row) in block.chunks_exact_mut(seq).enumerate() {
        let (live, masked) = row.split_at_mut(i + 1);
        let mut max = f32::NEG_INFINITY;
        for v in live.iter_mut() {
            *v *= scale;
            max = max.max(*v);
        }
        let mut sum = 0.0f32;
        for v in live.iter_mut() {
            *v = (*v - max).exp();
            sum += *v;
        }
        let inv = 1.0 / sum;
        for v in live.iter_mut() {
            *v *= inv;
        }
        masked.fill(0.0);
    }
}

/// The causal softmax's backward in place: `datt` (the gradient of the probabilities `att`)
/// becomes the gradient of the unscaled scores.
pub fn causal_softmax_back(datt: &mut [f32], att: &[f32], seq: usize, scale: f32) {
    if threaded() {
        datt.par_chunks_mut(seq * seq)
            .zip(att.par_chunks(seq * seq))
            .for_each(|(d, a)| causal_softmax_back_block(d, a, seq, scale));
    } else {
        for (d, a) in datt
            .chunks_exact_mut(seq * seq)
            .zip(att.chunks_exact(seq * seq))
        {
            causal_softmax_back_block(d, a, seq, scale);
        }
    }
}

/// [`causal_softmax_back`] of one `seq × seq` block.
fn causal_softmax_back_block(dblock: &mut [f32], ablock: &[f32], seq: usize, scale: f32) {
    for (i, (d, a)) in dblock
        .chunks_exact_mut(seq)
        .zip(ablock.chunks_exact(seq))
        .enumerate()
    {
        let dot: f32 = d[..=i].iter().zip(&a[..=i]).map(|(x, y)| x * y).sum();
        for j in 0..=i {
            d[j] = scale * a[j] * (d[j] - dot);
        }
        d[i + 1..].fill(0.0);
    }
}

/// RMSNorm of each row of `x` (`h` wide): (output, the normalized input x̂ = x / rms, 1/rms
/// per row), as transformers' `LlamaRMSNorm`.
pub fn rms_norm(x: &[f32], g: &[f32], h: usize, eps: f32) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    norm_rows(x, h, |row, y, xhat| {
        let ms = row.iter().map(|v| v * v).sum::<f32>() / h as f32;
        let r = 1.0 / (ms + eps).sqrt();
        for (((v, gi), y), n) in row.iter().zip(g).zip(y).zip(xhat) {
            *n = v * r;
            *y = *n * gi;
        }
        r
    })
}

/// RMSNorm's backward: adds the input's gradient to `dx` and accumulates the gain's into `dg`
/// (on several threads as [`layer_norm_back`]: the same bits as on one).
pub fn rms_norm_back(
    dy: &[f32],
    xhat: &[f32],
    rstd: &[f32],
    g: &[f32],
    dx: &mut [f32],
    dg: &mut [f32],
) {
    let h = g.len();
    if threaded() {
        rows_back(dy, xhat, rstd, h, dx, |dy, xh, r, dx, d| {
            rms_row_back(dy, xh, r, g, dx, d)
        });
        columns(h, dg, None, |c, dg, _| {
            for (dy, xh) in dy.chunks_exact(h).zip(xhat.chunks_exact(h)) {
                let (dy, xh) = (&dy[c.clone()], &xh[c.clone()]);
                for i in 0..dg.len() {
                    dg[i] += dy[i] * xh[i];
                }
            }
        });
        return;
    }
    let mut d = vec![0.0f32; h];
    for (((dy, xh), r), dx) in dy
        .chunks_exact(h)
        .zip(xhat.chunks_exact(h))
        .zip(rstd)
        .zip(dx.chunks_exact_mut(h))
    {
        for i in 0..h {
            dg[i] += dy[i] * xh[i];
        }
        rms_row_back(dy, xh, *r, g, dx, &mut d);
    }
}

/// One row of RMSNorm's backward: adds the input's gradient to `dx` (`d`: scratch).
fn rms_row_back(dy: &[f32], xh: &[f32], r: f32, g: &[f32], dx: &mut [f32], d: &mut [f32]) {
    let h = g.len();
    let mut m = 0.0f32;
    for i in 0..h {
        d[i] = dy[i] * g[i];
        m += d[i] * xh[i];
    }
    let m = m / h as f32;
    for i in 0..h {
        dx[i] += r * (d[i] - xh[i] * m);
    }
}

/// SwiGLU: `silu(gate) · up` for each value: (output, the sigmoid of the gate, kept for the
/// backward).
pub fn swiglu(gate: &[f32], up: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let sigmoid = |x: &f32| 1.0 / (1.0 + (-x).exp());
    let act = |((g, s), u): ((&f32, &f32), &f32)| g * s * u;
    if !threaded() {
        let sig: Vec<f32> = gate.iter().map(sigmoid).collect();
        let a = gate.iter().zip(&sig).zip(up).map(act).collect();
        return (a, sig);
    }
    let sig: Vec<f32> = gate.par_iter().with_min_len(GRAIN).map(sigmoid).collect();
    let a = gate
        .par_iter()
        .zip(&sig)
        .zip(up)
        .with_min_len(GRAIN)
        .map(act)
        .collect();
    (a, sig)
}

/// SwiGLU's backward: the gradients of (gate, up) from the output's `d`.
pub fn swiglu_back(d: &[f32], gate: &[f32], up: &[f32], sig: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let of_up = |((d, g), s): ((&f32, &f32), &f32)| d * g * s;
    let of_gate =
        |(((d, g), s), u): (((&f32, &f32), &f32), &f32)| d * u * s * (1.0 + g * (1.0 - s));
    if !threaded() {
        let dup = d.iter().zip(gate).zip(sig).map(of_up).collect();
        let dgate = d.iter().zip(gate).zip(sig).zip(up).map(of_gate).collect();
        return (dgate, dup);
    }
    let dup = d
        .par_iter()
        .zip(gate)
        .zip(sig)
        .with_min_len(GRAIN)
        .map(of_up)
        .collect();
    let dgate = d
        .par_iter()
        .zip(gate)
        .zip(sig)
        .zip(up)
        .with_min_len(GRAIN)
        .map(of_gate)
        .collect();
    (dgate, dup)
}

/// `(rows·seq, heads·d)` values as `(rows·heads, seq, d)`: the inverse of [`merge_heads`]
/// (on several threads, a sequence per piece).
pub fn split_to_heads(x: &[f32], seq: usize, heads: usize, d: usize) -> Vec<f32> {
    let w = heads * d;
    let mut out = vec![0.0f32; x.len()];
    let row = |x: &[f32], out: &mut [f32]| {
        for t in 0..seq {
            let src = &x[t * w..][..w];
            for a in 0..heads {
                out[(a * seq + t) * d..][..d].copy_from_slice(&src[a * d..][..d]);
            }
        }
    };
    if threaded() {
        x.par_chunks(seq * w)
            .zip(out.par_chunks_mut(seq * w))
            .for_each(|(x, out)| row(x, out));
    } else {
        for (x, out) in x.chunks_exact(seq * w).zip(out.chunks_exact_mut(seq * w)) {
            row(x, out);
        }
    }
    out
}

/// Rotary positions in place on `(rows·heads, seq, d)` values (transformers' `x · cos +
/// rotate_half(x) · sin`: element i pairs with i + d/2); `cos`, `sin` are `(seq, d/2)`. With
/// `back`, the inverse rotation: the gradient of the input from the output's.
pub fn rope(x: &mut [f32], seq: usize, d: usize, cos: &[f32], sin: &[f32], back: bool) {
    let half = d / 2;
    // One (row, head)'s sequence: position t is its t-th vector.
    let block = |x: &mut [f32]| {
        for (t, v) in x.chunks_exact_mut(d).enumerate() {
            let (c, s) = (&cos[t * half..][..half], &sin[t * half..][..half]);
            let (lo, hi) = v.split_at_mut(half);
            for i in 0..half {
                let (a, b) = (lo[i], hi[i]);
                let sn = if back { -s[i] } else { s[i] };
                lo[i] = a * c[i] - b * sn;
                hi[i] = b * c[i] + a * sn;
            }
        }
    };
    if threaded() {
        x.par_chunks_mut(seq * d).for_each(block);
    } else {
        x.chunks_exact_mut(seq * d).for_each(block);
    }
}

/// `x += y`, value by value (a residual); on every thread, in pieces, when there are several.
pub fn add_into(x: &mut [f32], y: &[f32]) {
    let add = |(x, y): (&mut [f32], &[f32])| {
        for (a, b) in x.iter_mut().zip(y) {
            *a += b;
        }
    };
    if threaded() && x.len() >= 2 * GRAIN {
        x.par_chunks_mut(GRAIN)
            .zip(y.par_chunks(GRAIN))
            .for_each(add);
    } else {
        add((x, y));
    }
}

/// Add `bias` to every row of `x` (on several threads, in pieces of whole rows).
pub fn add_bias(x: &mut [f32], bias: &[f32]) {
    let add = |x: &mut [f32]| {
        for row in x.chunks_exact_mut(bias.len()) {
            for (v, b) in row.iter_mut().zip(bias) {
                *v += b;
            }
        }
    };
    if threaded() {
        x.par_chunks_mut(rows_per_piece(bias.len()) * bias.len())
            .for_each(add);
    } else {
        add(x);
    }
}

/// Σ over rows of `x` (`width` wide), added into `out`. On several threads in pieces of whole
/// columns, each summed over the rows in order: the same bits as on one.
pub fn sum_rows(x: &[f32], out: &mut [f32]) {
    let w = out.len();
    if threaded() && x.len() >= GRAIN {
        columns(w, out, None, |c, out, _| {
            for row in x.chunks_exact(w) {
                for (o, v) in out.iter_mut().zip(&row[c.clone()]) {
                    *o += v;
                }
            }
        });
        return;
    }
    for row in x.chunks_exact(w) {
        for (o, v) in out.iter_mut().zip(row) {
            *o += v;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tanh_is_within_a_few_ulp_of_the_library() {
        let mut worst = 0.0f32;
        for i in -200_000..=200_000 {
            let x = i as f32 * 1e-4;
            let (a, b) = (tanh(x), x.tanh());
            worst = worst.max((a - b).abs() / b.abs().max(1e-30).max(f32::EPSILON));
        }
        assert!(worst < 8.0 * f32::EPSILON, "relative error {worst}");
        assert_eq!(tanh(100.0), 1.0f32.min(tanh(7.905_311)));
    }

    #[test]
    fn heads_split_and_merge_back() {
        let (seq, heads, d) = (3, 2, 2);
        let h = heads * d;
        let qkv: Vec<f32> = (0..2 * seq * 3 * h).map(|i| i as f32).collect();
        let [q, k, v] = split_heads(&qkv, &vec![0.0; 3 * h], seq, heads, d);
        let mut back = vec![0.0; qkv.len()];
        for (i, x) in [q, k, v].iter().enumerate() {
            merge_heads(x, seq, heads, d, &mut back, 3 * h, i * h);
        }
        assert_eq!(back, qkv);
    }
}
