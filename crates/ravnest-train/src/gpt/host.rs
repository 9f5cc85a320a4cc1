//! What the hand-written CPU passes share: reading a contiguous f32 tensor's values in place
//! (one call, or a layer's tensors for a pass), matrix products (rounded under bf16).

use candle_core::Tensor;

use super::gemm::{self, Mat};

type Result<T> = candle_core::Result<T>;

/// `x`'s values (a contiguous f32 tensor on the CPU), read in place.
pub(super) fn values<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    match (&*storage, layout.contiguous_offsets()) {
        (candle_core::Storage::Cpu(cpu), Some((a, b))) => Ok(f(&cpu.as_slice::<f32>()?[a..b])),
        _ => candle_core::bail!("the fast path reads contiguous f32 tensors on the CPU"),
    }
}

impl super::Gpt {
    /// `a · b`. Under [`Numerics::Bf16`](super::Numerics::Bf16) both factors and the product
    /// are rounded to bf16, and the sums are f32, as a GPU's bf16 matrix product computes.
    pub(super) fn matmul(&self, a: Mat, b: Mat) -> Result<Vec<f32>> {
        match self.1 {
            super::Numerics::Fp32 => gemm::mm(a, b),
            super::Numerics::Bf16 => {
                let (ra, rb) = (rounded(a.values()), rounded(b.values()));
                let mut out = gemm::mm(a.over(&ra), b.over(&rb))?;
                out.iter_mut().for_each(|x| *x = round_bf16(*x));
                Ok(out)
            }
        }
    }

    /// `dst += a · b`, the product as [`matmul`](super::Gpt::matmul) computes it.
    pub(super) fn matmul_add(&self, dst: &mut [f32], a: Mat, b: Mat) -> Result<()> {
        match self.1 {
            super::Numerics::Fp32 => gemm::mm_add(dst, a, b),
            super::Numerics::Bf16 => {
                let p = self.matmul(a, b)?;
                if p.len() != dst.len() {
                    candle_core::bail!("{} values for a product of {}", dst.len(), p.len());
                }
                dst.iter_mut().zip(&p).for_each(|(d, x)| *d += x);
                Ok(())
            }
        }
    }
}

fn rounded(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| round_bf16(x)).collect()
}

/// A layer's parameters' values, read in place for as long as this lives (each tensor's
/// storage held for reading, as [`values`] holds it for one call).
pub(super) struct Weights<'a>(Vec<(candle_core::StorageRef<'a>, usize, usize, Vec<usize>)>);

impl<'a> Weights<'a> {
    /// The tensors of `p`: contiguous f32 on the CPU, or an error.
    pub(super) fn of(p: &'a Layer) -> Result<Self> {
        p.iter()
            .map(|t| {
                let (storage, layout) = t.storage_and_layout();
                match (&*storage, layout.contiguous_offsets()) {
                    (candle_core::Storage::Cpu(candle_core::CpuStorage::F32(_)), Some((a, b))) => {
                        Ok((storage, a, b, t.dims().to_vec()))
                    }
                    _ => {
                        candle_core::bail!("the fast path reads contiguous f32 tensors on the CPU")
                    }
                }
            })
            .collect::<Result<_>>()
            .map(Weights)
    }

    /// Tensor `i`'s values.
    pub(super) fn get(&self, i: usize) -> Result<&[f32]> {
        match self.0.get(i) {
            Some((s, a, b, _)) => match &**s {
                candle_core::Storage::Cpu(cpu) => Ok(&cpu.as_slice::<f32>()?[*a..*b]),
                _ => candle_core::bail!("the fast path reads tensors on the CPU"),
            },
            None => candle_core::bail!("the layer has no tensor {i}"),
        }
    }

    /// Tensor `i`, a matrix.
    pub(super) fn mat(&self, i: usize) -> Result<Mat<'_>> {
        let v = self.get(i)?;
        match self.0[i].3[..] {
            [rows, cols] => Ok(Mat::new(v, rows, cols)),
            ref dims => candle_core::bail!("tensor {i} of the layer is {dims:?}, not a matrix"),
        }
    }
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
