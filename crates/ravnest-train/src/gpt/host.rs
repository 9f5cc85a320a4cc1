//! What the hand-written CPU passes share: reading a contiguous f32 tensor's values in place,
//! making one from host values, matrix products, and adding a product into a gradient buffer.

use candle_core::{Device, Tensor};

type Result<T> = candle_core::Result<T>;

/// `x`'s values (a contiguous f32 tensor on the CPU), read in place.
pub(super) fn values<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    match (&*storage, layout.contiguous_offsets()) {
        (candle_core::Storage::Cpu(cpu), Some((a, b))) => Ok(f(&cpu.as_slice::<f32>()?[a..b])),
        _ => candle_core::bail!("the fast path reads contiguous f32 tensors on the CPU"),
    }
}

pub(super) fn tensor(v: Vec<f32>, shape: (usize, usize)) -> Result<Tensor> {
    Tensor::from_vec(v, shape, &Device::Cpu)
}

pub(super) fn to_vec(t: &Tensor) -> Result<Vec<f32>> {
    values(t, <[f32]>::to_vec)
}

impl super::Gpt {
    /// `a · b` (a matrix product; `b` may be a transposed view). Under
    /// [`Numerics::Bf16`](super::Numerics::Bf16) both factors and the product are rounded to
    /// bf16, and the sums are f32, as a GPU's bf16 matrix product computes.
    pub(super) fn mm(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        match self.1 {
            super::Numerics::Fp32 => a.matmul(b),
            super::Numerics::Bf16 => bf16(&bf16(a)?.matmul(&bf16(b)?)?),
        }
    }
}

/// `t`'s values rounded to bf16 (to the nearest, ties to even), kept as f32: one pass over
/// a contiguous tensor or a transposed one (a weight's view), else through candle's casts.
pub(super) fn bf16(t: &Tensor) -> Result<Tensor> {
    let round = |t: &Tensor| {
        let v = values(t, |v| {
            v.iter().map(|&x| round_bf16(x)).collect::<Vec<f32>>()
        })?;
        Tensor::from_vec(v, t.shape(), &Device::Cpu)
    };
    if t.is_contiguous() {
        return round(t);
    }
    if t.rank() == 2 && t.t()?.is_contiguous() {
        return round(&t.t()?)?.t();
    }
    t.to_dtype(candle_core::DType::BF16)?
        .to_dtype(candle_core::DType::F32)
}

/// `x` rounded to the nearest bf16 (ties to even), as f32; NaN stays NaN, infinities stay.
pub(super) fn round_bf16(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    let b = x.to_bits();
    let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) & 0xffff_0000;
    f32::from_bits(rounded)
}

/// The parameters of one layer as the fast path reads them (its tensors in
/// [`Gpt::layer_params`](super::Gpt::layer_params) order, contiguous on the CPU).
pub(super) type Layer = [Tensor];

/// Add the values of `t` into `acc`.
pub(super) fn add_into(acc: &mut [f32], t: &Tensor) -> Result<()> {
    values(t, |v| {
        for (a, x) in acc.iter_mut().zip(v) {
            *a += x;
        }
    })
}
