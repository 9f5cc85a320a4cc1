//! Matrix products on host values, straight into the `gemm` crate (the kernels candle's CPU
//! products run on), for the hand-written passes.
//!
//! Why not candle's `matmul` (measured, `ravnest bench gpt`, perf): around each product candle
//! zeroes a fresh output on the calling thread, the pass then copied it out of the tensor, and
//! a weight's gradient was a product of its own added into the gradient buffer afterwards; a
//! batch of attention's small products (one per row and head) ran one after another, each split
//! over every thread, so the threads met once per head. Here a product writes into memory it
//! owns without zeroing it first, a weight's gradient is summed into its buffer by the product
//! itself (`dst += a · b`), and a batch of small products runs one product per thread.
//!
//! The one `unsafe` of the crate is the call into `gemm`, whose bounds are checked here first:
//! every operand's last element is inside its slice and the output is exactly `m · n` values.

#![allow(unsafe_code)]

use std::mem::MaybeUninit;

use gemm::Parallelism;
use rayon::prelude::*;

type Result<T> = candle_core::Result<T>;

/// A matrix over host values: element (i, j) is `v[i · rs + j · cs]`.
#[derive(Clone, Copy, Debug)]
pub(super) struct Mat<'a> {
    v: &'a [f32],
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
}

impl<'a> Mat<'a> {
    /// `v` read as a row-major `rows × cols` matrix.
    pub(super) fn new(v: &'a [f32], rows: usize, cols: usize) -> Self {
        Mat {
            v,
            rows,
            cols,
            rs: cols,
            cs: 1,
        }
    }

    /// The transpose (a view: nothing moves).
    pub(super) fn t(self) -> Self {
        Mat {
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
            ..self
        }
    }

    /// The same view over other values laid out alike (bf16's rounded copy).
    pub(super) fn over(self, v: &'a [f32]) -> Self {
        Mat { v, ..self }
    }

    pub(super) fn values(&self) -> &'a [f32] {
        self.v
    }

    /// Whether every element the view names is inside its values.
    fn fits(&self) -> bool {
        self.rows == 0
            || self.cols == 0
            || (self.rows - 1) * self.rs + (self.cols - 1) * self.cs < self.v.len()
    }
}

/// Compute threads (rayon's pool, which every pass of a step shares).
fn threads() -> usize {
    rayon::current_num_threads().max(1)
}

fn check(a: &Mat, b: &Mat) -> Result<()> {
    if a.cols != b.rows {
        candle_core::bail!(
            "a product of {}×{} by {}×{}",
            a.rows,
            a.cols,
            b.rows,
            b.cols
        );
    }
    if !a.fits() || !b.fits() {
        candle_core::bail!("a matrix view reaches past its values");
    }
    Ok(())
}

/// `dst = a · b` (`add`: `dst += a · b`) into the `a.rows × b.cols` row-major values at `dst`.
///
/// # Safety
/// `dst` is valid for writes of `a.rows · b.cols` values (and reads when `add`), and `a` and `b`
/// passed [`check`].
unsafe fn product(dst: *mut f32, a: &Mat, b: &Mat, add: bool, par: Parallelism) {
    // SAFETY: the caller's promise: `dst` holds m·n values, every operand element is in bounds.
    unsafe {
        gemm::gemm(
            a.rows,
            b.cols,
            a.cols,
            dst,
            1,
            b.cols as isize,
            add,
            a.v.as_ptr(),
            a.cs as isize,
            a.rs as isize,
            b.v.as_ptr(),
            b.cs as isize,
            b.rs as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            par,
        )
    }
}

fn parallelism() -> Parallelism {
    match threads() {
        1 => Parallelism::None,
        n => Parallelism::Rayon(n),
    }
}

/// `a · b`, row-major, on every compute thread.
pub(super) fn mm(a: Mat, b: Mat) -> Result<Vec<f32>> {
    check(&a, &b)?;
    let len = a.rows * b.cols;
    let mut out: Vec<f32> = Vec::with_capacity(len);
    // SAFETY: the capacity is m·n values; gemm writes every one of them without reading
    // (`add` false: its `alpha` is zero, and with k = 0 it writes zeros), so all are set.
    unsafe {
        product(out.as_mut_ptr(), &a, &b, false, parallelism());
        out.set_len(len);
    }
    Ok(out)
}

/// `dst += a · b` (`dst`: `a.rows × b.cols`, row-major): a weight's gradient summed into its
/// buffer by the product.
pub(super) fn mm_add(dst: &mut [f32], a: Mat, b: Mat) -> Result<()> {
    check(&a, &b)?;
    if dst.len() != a.rows * b.cols {
        candle_core::bail!("{} values for a {}×{} product", dst.len(), a.rows, b.cols);
    }
    // SAFETY: `dst` is m·n initialized values, read and written.
    unsafe { product(dst.as_mut_ptr(), &a, &b, true, parallelism()) };
    Ok(())
}

/// `count` products `a_i · b_i`, each operand's `i`-th matrix `stride` values after the one
/// before (`a`, `b`: the first matrices' views), outputs one after another; one product per
/// thread when there are several.
pub(super) fn bmm(count: usize, a: (Mat, usize), b: (Mat, usize)) -> Result<Vec<f32>> {
    let ((a, sa), (b, sb)) = (a, b);
    fn item<'a>(m: Mat<'a>, stride: usize, i: usize) -> Result<Mat<'a>> {
        let v =
            m.v.get(i * stride..)
                .ok_or_else(|| candle_core::Error::Msg("a batch reaches past its values".into()))?;
        Ok(m.over(v))
    }
    if count > 0 {
        check(&item(a, sa, count - 1)?, &item(b, sb, count - 1)?)?;
    }
    check(&a, &b)?;
    let each = a.rows * b.cols;
    let len = count * each;
    let mut out: Vec<f32> = Vec::with_capacity(len);
    let one = |(i, dst): (usize, &mut [MaybeUninit<f32>])| {
        // Strides are non-negative, so the first and the last items in bounds put every
        // item between them in bounds.
        let (ai, bi) = (a.over(&a.v[i * sa..]), b.over(&b.v[i * sb..]));
        // SAFETY: `dst` is this item's m·n values of the output's capacity, written whole
        // and not read; `ai` and `bi` are in bounds (checked above).
        unsafe { product(dst.as_mut_ptr().cast(), &ai, &bi, false, Parallelism::None) };
    };
    if each > 0 {
        let spare = &mut out.spare_capacity_mut()[..len];
        if threads() > 1 {
            spare.par_chunks_mut(each).enumerate().for_each(one);
        } else {
            spare.chunks_mut(each).enumerate().for_each(one);
        }
    }
    // SAFETY: every item's m·n values were written above (none when `each` is 0).
    unsafe { out.set_len(len) };
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The plain triple loop.
    fn naive(a: &Mat, b: &Mat) -> Vec<f32> {
        let mut out = vec![0.0f32; a.rows * b.cols];
        for i in 0..a.rows {
            for j in 0..b.cols {
                out[i * b.cols + j] = (0..a.cols)
                    .map(|k| a.v[i * a.rs + k * a.cs] * b.v[k * b.rs + j * b.cs])
                    .sum();
            }
        }
        out
    }

    fn values(n: usize, seed: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 7 + seed * 13) % 17) as f32 / 8.0 - 1.0)
            .collect()
    }

    fn close(x: &[f32], y: &[f32]) {
        assert_eq!(x.len(), y.len());
        for (i, (p, q)) in x.iter().zip(y).enumerate() {
            assert!((p - q).abs() <= 1e-4 * (1.0 + q.abs()), "[{i}] {p} vs {q}");
        }
    }

    /// Every layout the passes use (plain, either factor transposed, both), with and without
    /// adding into the output, and batches, against the triple loop; on one thread and two.
    #[test]
    fn products_equal_the_triple_loop_in_every_layout() {
        for threads in [1, 2] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(|| {
                let (m, k, n) = (37, 29, 45);
                let (av, bv) = (values(m * k, 1), values(k * n, 2));
                for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                    let a = if ta {
                        Mat::new(&av, k, m).t()
                    } else {
                        Mat::new(&av, m, k)
                    };
                    let b = if tb {
                        Mat::new(&bv, n, k).t()
                    } else {
                        Mat::new(&bv, k, n)
                    };
                    let want = naive(&a, &b);
                    close(&mm(a, b).unwrap(), &want);
                    let mut acc = vec![1.0f32; m * n];
                    mm_add(&mut acc, a, b).unwrap();
                    let plus: Vec<f32> = want.iter().map(|x| x + 1.0).collect();
                    close(&acc, &plus);
                }
                let count = 5;
                let (av, bv) = (values(count * m * k, 3), values(count * k * n, 4));
                let got = bmm(
                    count,
                    (Mat::new(&av, m, k), m * k),
                    (Mat::new(&bv, n, k).t(), k * n),
                )
                .unwrap();
                for i in 0..count {
                    let want = naive(
                        &Mat::new(&av[i * m * k..], m, k),
                        &Mat::new(&bv[i * k * n..], n, k).t(),
                    );
                    close(&got[i * m * n..][..m * n], &want);
                }
            });
        }
    }

    /// Shapes that do not agree, and views past their values, are errors, not reads out of
    /// bounds.
    #[test]
    fn a_product_that_does_not_fit_is_an_error() {
        let v = values(12, 0);
        assert!(mm(Mat::new(&v, 3, 4), Mat::new(&v, 3, 4)).is_err());
        assert!(mm(Mat::new(&v, 4, 4), Mat::new(&v, 4, 3)).is_err());
        assert!(mm_add(&mut [0.0; 5], Mat::new(&v, 3, 4), Mat::new(&v, 4, 3)).is_err());
        assert!(bmm(2, (Mat::new(&v, 2, 3), 6), (Mat::new(&v, 3, 2), 7)).is_err());
        assert!(bmm(3, (Mat::new(&v, 2, 3), 6), (Mat::new(&v, 3, 2), 0)).is_err());
    }
}
