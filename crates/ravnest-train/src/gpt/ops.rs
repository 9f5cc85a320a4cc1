//! The transformers' element-wise pieces on the host, one pass each over contiguous values:
//! LayerNorm and RMSNorm, GELU (tanh) and SwiGLU, rotary positions, the causal softmax of
//! attention, their gradients, and the moves between the `(rows·seq, hidden)` layout and
//! attention's `(rows·heads, seq, head)`. The fast paths (`gpt::fast`, `gpt::fast_llama`) pair
//! them with candle's matrix products.

/// LayerNorm of each row of `x` (`h` wide): (output, the normalized input x̂, 1/σ per row).
pub fn layer_norm(
    x: &[f32],
    g: &[f32],
    b: &[f32],
    h: usize,
    eps: f32,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let rows = x.len() / h;
    let mut y = Vec::with_capacity(x.len());
    let mut xhat = Vec::with_capacity(x.len());
    let mut rstd = Vec::with_capacity(rows);
    for row in x.chunks_exact(h) {
        let mean = row.iter().sum::<f32>() / h as f32;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / h as f32;
        let r = 1.0 / (var + eps).sqrt();
        rstd.push(r);
        for ((v, gi), bi) in row.iter().zip(g).zip(b) {
            let n = (v - mean) * r;
            xhat.push(n);
            y.push(n * gi + bi);
        }
    }
    (y, xhat, rstd)
}

/// LayerNorm's backward: adds the input's gradient to `dx` and accumulates the gain's and the
/// bias's into `dg`, `db`.
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
    let mut dxhat = vec![0.0f32; h];
    for (((dy, xh), r), dx) in dy
        .chunks_exact(h)
        .zip(xhat.chunks_exact(h))
        .zip(rstd)
        .zip(dx.chunks_exact_mut(h))
    {
        let (mut m1, mut m2) = (0.0f32, 0.0f32);
        for i in 0..h {
            dg[i] += dy[i] * xh[i];
            db[i] += dy[i];
            let d = dy[i] * g[i];
            dxhat[i] = d;
            m1 += d;
            m2 += d * xh[i];
        }
        let (m1, m2) = (m1 / h as f32, m2 / h as f32);
        for i in 0..h {
            dx[i] += r * (dxhat[i] - m1 - xh[i] * m2);
        }
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
    let mut u = Vec::with_capacity(f.len());
    let mut t = Vec::with_capacity(f.len());
    for &x in f {
        let th = tanh(SQRT_2_OVER_PI * (x + GELU_C * x * x * x));
        t.push(th);
        u.push(0.5 * x * (1.0 + th));
    }
    (u, t)
}

/// GELU's backward in place: `du` becomes the gradient of its input `f` (`t`: the tanh the
/// forward kept).
pub fn gelu_back(du: &mut [f32], f: &[f32], t: &[f32]) {
    for ((d, &x), &th) in du.iter_mut().zip(f).zip(t) {
        let inner = SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_C * x * x);
        *d *= 0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * inner;
    }
}

/// `(rows·seq, 3·hidden)` values plus the bias, as q, k and v, each `(rows·heads, seq, head)`.
pub fn split_heads(qkv: &[f32], bias: &[f32], seq: usize, heads: usize, d: usize) -> [Vec<f32>; 3] {
    let h = heads * d;
    let n = qkv.len() / (3 * h);
    let rows = n / seq;
    let mut out = [
        vec![0.0f32; n * h],
        vec![0.0f32; n * h],
        vec![0.0f32; n * h],
    ];
    for r in 0..rows {
        for t in 0..seq {
            let src = &qkv[(r * seq + t) * 3 * h..(r * seq + t + 1) * 3 * h];
            for (k, o) in out.iter_mut().enumerate() {
                for a in 0..heads {
                    let at = ((r * heads + a) * seq + t) * d;
                    let from = k * h + a * d;
                    for e in 0..d {
                        o[at + e] = src[from + e] + bias[from + e];
                    }
                }
            }
        }
    }
    out
}

/// The inverse move: `(rows·heads, seq, head)` parts to `(rows·seq, heads·head)`, added into
/// `out` at column `col` of its `width` columns (attention's output, or the gradients of q, k
/// and v into the gradient of the fused projection).
pub fn merge_heads(
    x: &[f32],
    seq: usize,
    heads: usize,
    d: usize,
    out: &mut [f32],
    width: usize,
    col: usize,
) {
    let rows = x.len() / (heads * seq * d);
    for r in 0..rows {
        for a in 0..heads {
            for t in 0..seq {
                let src = &x[((r * heads + a) * seq + t) * d..][..d];
                let dst = &mut out[(r * seq + t) * width + col + a * d..][..d];
                dst.copy_from_slice(src);
            }
        }
    }
}

/// The causal softmax of attention scores in place: each row `i` of each `seq × seq` block
/// scaled by `scale`, positions after `i` masked out (probability 0).
pub fn causal_softmax(s: &mut [f32], seq: usize, scale: f32) {
    for block in s.chunks_exact_mut(seq * seq) {
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
}

/// The causal softmax's backward in place: `datt` (the gradient of the probabilities `att`)
/// becomes the gradient of the unscaled scores.
pub fn causal_softmax_back(datt: &mut [f32], att: &[f32], seq: usize, scale: f32) {
    for (dblock, ablock) in datt
        .chunks_exact_mut(seq * seq)
        .zip(att.chunks_exact(seq * seq))
    {
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
}

/// RMSNorm of each row of `x` (`h` wide): (output, the normalized input x̂ = x / rms, 1/rms
/// per row), as transformers' `LlamaRMSNorm`.
pub fn rms_norm(x: &[f32], g: &[f32], h: usize, eps: f32) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let rows = x.len() / h;
    let mut y = Vec::with_capacity(x.len());
    let mut xhat = Vec::with_capacity(x.len());
    let mut rstd = Vec::with_capacity(rows);
    for row in x.chunks_exact(h) {
        let ms = row.iter().map(|v| v * v).sum::<f32>() / h as f32;
        let r = 1.0 / (ms + eps).sqrt();
        rstd.push(r);
        for (v, gi) in row.iter().zip(g) {
            let n = v * r;
            xhat.push(n);
            y.push(n * gi);
        }
    }
    (y, xhat, rstd)
}

/// RMSNorm's backward: adds the input's gradient to `dx` and accumulates the gain's into `dg`.
pub fn rms_norm_back(
    dy: &[f32],
    xhat: &[f32],
    rstd: &[f32],
    g: &[f32],
    dx: &mut [f32],
    dg: &mut [f32],
) {
    let h = g.len();
    let mut d = vec![0.0f32; h];
    for (((dy, xh), r), dx) in dy
        .chunks_exact(h)
        .zip(xhat.chunks_exact(h))
        .zip(rstd)
        .zip(dx.chunks_exact_mut(h))
    {
        let mut m = 0.0f32;
        for i in 0..h {
            dg[i] += dy[i] * xh[i];
            d[i] = dy[i] * g[i];
            m += d[i] * xh[i];
        }
        let m = m / h as f32;
        for i in 0..h {
            dx[i] += r * (d[i] - xh[i] * m);
        }
    }
}

/// SwiGLU: `silu(gate) · up` for each value: (output, the sigmoid of the gate, kept for the
/// backward).
pub fn swiglu(gate: &[f32], up: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let sig: Vec<f32> = gate.iter().map(|&x| 1.0 / (1.0 + (-x).exp())).collect();
    let act = gate
        .iter()
        .zip(&sig)
        .zip(up)
        .map(|((g, s), u)| g * s * u)
        .collect();
    (act, sig)
}

/// SwiGLU's backward: the gradients of (gate, up) from the output's `d`.
pub fn swiglu_back(d: &[f32], gate: &[f32], up: &[f32], sig: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let dup = d
        .iter()
        .zip(gate.iter().zip(sig))
        .map(|(d, (g, s))| d * g * s)
        .collect();
    let dgate = d
        .iter()
        .zip(gate.iter().zip(sig).zip(up))
        .map(|(d, ((g, s), u))| d * u * s * (1.0 + g * (1.0 - s)))
        .collect();
    (dgate, dup)
}

/// `(rows·seq, heads·d)` values as `(rows·heads, seq, d)`: the inverse of [`merge_heads`].
pub fn split_to_heads(x: &[f32], seq: usize, heads: usize, d: usize) -> Vec<f32> {
    let w = heads * d;
    let rows = x.len() / (seq * w);
    let mut out = vec![0.0f32; x.len()];
    for r in 0..rows {
        for t in 0..seq {
            let src = &x[(r * seq + t) * w..][..w];
            for a in 0..heads {
                out[((r * heads + a) * seq + t) * d..][..d].copy_from_slice(&src[a * d..][..d]);
            }
        }
    }
    out
}

/// Rotary positions in place on `(rows·heads, seq, d)` values (transformers' `x · cos +
/// rotate_half(x) · sin`: element i pairs with i + d/2); `cos`, `sin` are `(seq, d/2)`. With
/// `back`, the inverse rotation: the gradient of the input from the output's.
pub fn rope(x: &mut [f32], seq: usize, d: usize, cos: &[f32], sin: &[f32], back: bool) {
    let half = d / 2;
    for (k, v) in x.chunks_exact_mut(d).enumerate() {
        let t = k % seq;
        let (c, s) = (&cos[t * half..][..half], &sin[t * half..][..half]);
        let (lo, hi) = v.split_at_mut(half);
        for i in 0..half {
            let (a, b) = (lo[i], hi[i]);
            let sn = if back { -s[i] } else { s[i] };
            lo[i] = a * c[i] - b * sn;
            hi[i] = b * c[i] + a * sn;
        }
    }
}

/// Add `bias` to every row of `x`.
pub fn add_bias(x: &mut [f32], bias: &[f32]) {
    for row in x.chunks_exact_mut(bias.len()) {
        for (v, b) in row.iter_mut().zip(bias) {
            *v += b;
        }
    }
}

/// Σ over rows of `x` (`width` wide), added into `out`.
pub fn sum_rows(x: &[f32], out: &mut [f32]) {
    for row in x.chunks_exact(out.len()) {
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
