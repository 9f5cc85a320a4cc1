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

/// `a · b` (a matrix product; `b` may be a transposed view).
pub(super) fn mm(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    a.matmul(b)
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
