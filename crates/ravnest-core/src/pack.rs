//! Compressed values on the wire: what an outer (local SGD / DiLoCo) exchange sends in fewer
//! bytes than `f32`.
//!
//! Two formats besides plain `f32`:
//! - `fp16`: IEEE half precision, 2 bytes a value (clamped to ±65504, so a large value never
//!   becomes infinite).
//! - `int8`: blocks of [`BLOCK`] values share one power-of-two scale `2^e` (one signed byte `e`),
//!   and each value is a signed byte `k` in -127..=127: `x ≈ k · 2^e`, with `e` the smallest
//!   exponent for which the block's largest magnitude fits. 1 + 1/256 bytes a value. A shared
//!   exponent (as in the MX formats) rather than a free `f32` scale costs at most one bit of
//!   precision and buys exactness: a value already of the form `k · 2^e` packs without loss.
//!
//! [`canon`] rounds values to what their packed form holds. It is idempotent, and
//! [`unpack`]`(`[`pack`]`(x))` is exactly `canon(x)`. A collective rounds every value it sends
//! with [`canon`] (the owner of a reduced chunk keeps the rounded values too), so the packed
//! wire then carries them without loss, every member ends with the same bits, and the simulated
//! network (which does not serialize) computes exactly what the real one does.

use serde::{Deserialize, Serialize};

/// Values per `int8` block (one shared exponent each).
pub const BLOCK: usize = 256;

/// How values of an exchange travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Packing {
    /// 4 bytes a value, exact.
    #[default]
    Fp32,
    /// 2 bytes a value.
    Fp16,
    /// 1 byte a value plus one exponent byte per [`BLOCK`] values.
    Int8,
}

impl Packing {
    /// Every packing, smallest last.
    pub const ALL: [Packing; 3] = [Packing::Fp32, Packing::Fp16, Packing::Int8];

    /// Its name in files and reports.
    pub fn name(self) -> &'static str {
        match self {
            Packing::Fp32 => "fp32",
            Packing::Fp16 => "fp16",
            Packing::Int8 => "int8",
        }
    }

    /// Bytes that `n` values take packed.
    pub fn bytes(self, n: usize) -> usize {
        match self {
            Packing::Fp32 => 4 * n,
            Packing::Fp16 => 2 * n,
            Packing::Int8 => n + n.div_ceil(BLOCK),
        }
    }

    /// Packed bytes per `f32` byte (1 for `fp32`), for costs of large exchanges.
    pub fn ratio(self) -> f64 {
        match self {
            Packing::Fp32 => 1.0,
            Packing::Fp16 => 0.5,
            Packing::Int8 => (1.0 + 1.0 / BLOCK as f64) / 4.0,
        }
    }

    /// How many values `bytes` packed bytes hold; `None` when no count packs to that length.
    pub fn values_in(self, bytes: usize) -> Option<usize> {
        match self {
            Packing::Fp32 => bytes.is_multiple_of(4).then_some(bytes / 4),
            Packing::Fp16 => bytes.is_multiple_of(2).then_some(bytes / 2),
            Packing::Int8 => {
                let (whole, rest) = (bytes / (BLOCK + 1), bytes % (BLOCK + 1));
                match rest {
                    0 => Some(whole * BLOCK),
                    1 => None,
                    r => Some(whole * BLOCK + r - 1),
                }
            }
        }
    }
}

/// Largest finite `fp16` magnitude.
const FP16_MAX: f32 = 65504.0;

/// A block whose exponent would be below this packs as zeros (below about 1e-28 in
/// magnitude). Rounding keeps a block's exponent, so this cut is idempotent too.
const INT8_MIN_EXPONENT: i32 = -100;

/// The exponent `e` of an `int8` block whose largest magnitude is `max` (finite, above 0):
/// the smallest with `127 · 2^e >= max`.
fn int8_exponent(max: f32) -> i32 {
    let mut e = (f64::from(max) / 127.0).log2().ceil() as i32;
    while 127.0 * 2f64.powi(e) < f64::from(max) {
        e += 1;
    }
    while 127.0 * 2f64.powi(e - 1) >= f64::from(max) {
        e -= 1;
    }
    e
}

/// One block's exponent, or what it packs as when no exponent serves: `Err(0.0)` (all zeros)
/// or `Err(NaN)` (a value that is not finite).
fn block_exponent(block: &[f32]) -> Result<i32, f32> {
    let mut max = 0.0f32;
    for x in block {
        if !x.is_finite() {
            return Err(f32::NAN);
        }
        max = max.max(x.abs());
    }
    if max == 0.0 {
        return Err(0.0);
    }
    let e = int8_exponent(max);
    // Above 127 · 2^120 a block saturates (its values stay finite in f32).
    if e < INT8_MIN_EXPONENT {
        Err(0.0)
    } else {
        Ok(e.min(120))
    }
}

fn int8_code(x: f32, e: i32) -> i8 {
    (f64::from(x) / 2f64.powi(e)).round().clamp(-127.0, 127.0) as i8
}

fn int8_value(k: i8, e: i32) -> f32 {
    (f64::from(k) * 2f64.powi(e)) as f32
}

fn fp16(x: f32) -> half::f16 {
    half::f16::from_f32(if x.is_nan() {
        x
    } else {
        x.clamp(-FP16_MAX, FP16_MAX)
    })
}

/// Round `values` in place to what `packing` carries of them (blocks counted from the slice's
/// start). Idempotent.
pub fn canon(packing: Packing, values: &mut [f32]) {
    match packing {
        Packing::Fp32 => {}
        Packing::Fp16 => {
            for x in values.iter_mut() {
                *x = fp16(*x).to_f32();
            }
        }
        Packing::Int8 => {
            for block in values.chunks_mut(BLOCK) {
                match block_exponent(block) {
                    Ok(e) => {
                        for x in block.iter_mut() {
                            *x = int8_value(int8_code(*x, e), e);
                        }
                    }
                    Err(fill) => block.fill(fill),
                }
            }
        }
    }
}

/// The packed bytes of `values` ([`Packing::bytes`] of them).
pub fn pack(packing: Packing, values: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(packing.bytes(values.len()));
    match packing {
        Packing::Fp32 => {
            for x in values {
                out.extend_from_slice(&x.to_le_bytes());
            }
        }
        Packing::Fp16 => {
            for x in values {
                out.extend_from_slice(&fp16(*x).to_le_bytes());
            }
        }
        Packing::Int8 => {
            for block in values.chunks(BLOCK) {
                match block_exponent(block) {
                    Ok(e) => {
                        out.push(e as i8 as u8);
                        out.extend(block.iter().map(|x| int8_code(*x, e) as u8));
                    }
                    // i8::MIN marks a block that is not finite; zeros pack at any exponent.
                    Err(fill) => {
                        out.push(if fill.is_nan() { i8::MIN as u8 } else { 0 });
                        out.extend(std::iter::repeat_n(0u8, block.len()));
                    }
                }
            }
        }
    }
    out
}

/// Why packed bytes were refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PackError {
    /// No number of values packs to this many bytes.
    #[error("{bytes} bytes are not a whole number of {packing} values")]
    Length {
        /// The packing.
        packing: &'static str,
        /// The length.
        bytes: usize,
    },
}

/// The values `bytes` hold (what [`pack`] made).
pub fn unpack(packing: Packing, bytes: &[u8]) -> Result<Vec<f32>, PackError> {
    let n = packing.values_in(bytes.len()).ok_or(PackError::Length {
        packing: packing.name(),
        bytes: bytes.len(),
    })?;
    let mut out = Vec::with_capacity(n);
    match packing {
        Packing::Fp32 => out.extend(
            bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        ),
        Packing::Fp16 => out.extend(
            bytes
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()),
        ),
        Packing::Int8 => {
            for block in bytes.chunks(BLOCK + 1) {
                let e = block[0] as i8;
                if e == i8::MIN {
                    out.extend(std::iter::repeat_n(f32::NAN, block.len() - 1));
                } else {
                    out.extend(
                        block[1..]
                            .iter()
                            .map(|k| int8_value(*k as i8, i32::from(e))),
                    );
                }
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn same_bits(a: &[f32], b: &[f32]) -> bool {
        a.len() == b.len()
            && a.iter()
                .zip(b)
                .all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()))
    }

    fn values() -> impl Strategy<Value = Vec<f32>> {
        let one = prop_oneof![
            8 => -1.0f32..1.0,
            2 => -1e6f32..1e6,
            1 => -1e-20f32..1e-20,
            1 => Just(0.0f32),
            1 => any::<f32>(),
        ];
        proptest::collection::vec(one, 0..700)
    }

    proptest! {
        #[test]
        fn unpacking_gives_the_canonical_values_and_canon_is_idempotent(
            x in values(),
            which in 0usize..3,
        ) {
            let p = Packing::ALL[which];
            let mut c = x.clone();
            canon(p, &mut c);
            let bytes = pack(p, &x);
            prop_assert_eq!(bytes.len(), p.bytes(x.len()));
            prop_assert_eq!(p.values_in(bytes.len()), Some(x.len()));
            let back = unpack(p, &bytes).unwrap();
            prop_assert!(same_bits(&back, &c), "unpack(pack(x)) != canon(x)");
            let mut again = c.clone();
            canon(p, &mut again);
            prop_assert!(same_bits(&again, &c), "canon is not idempotent");
            prop_assert!(same_bits(&unpack(p, &pack(p, &c)).unwrap(), &c), "lossy on canon values");
        }

        #[test]
        fn rounding_error_is_bounded(x in proptest::collection::vec(-100.0f32..100.0, 1..600)) {
            let mut h = x.clone();
            canon(Packing::Fp16, &mut h);
            for (a, b) in x.iter().zip(&h) {
                prop_assert!((a - b).abs() <= a.abs() * 1e-3 + 1e-7, "{a} -> {b}");
            }
            let mut q = x.clone();
            canon(Packing::Int8, &mut q);
            for (block, qb) in x.chunks(BLOCK).zip(q.chunks(BLOCK)) {
                let max = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                for (a, b) in block.iter().zip(qb) {
                    // Half a step of 2^e, and 2^e < 2 · max / 127.
                    prop_assert!((a - b).abs() <= max / 127.0 + 1e-28, "{a} -> {b} (max {max})");
                }
            }
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
            for p in Packing::ALL {
                let _ = unpack(p, &bytes);
            }
        }
    }

    #[test]
    fn sizes_and_names() {
        assert_eq!(Packing::Int8.bytes(256), 257);
        assert_eq!(Packing::Int8.bytes(257), 259);
        assert_eq!(Packing::Int8.values_in(259), Some(257));
        assert_eq!(Packing::Int8.values_in(258), None);
        assert_eq!(Packing::Fp16.values_in(3), None);
        assert_eq!(Packing::Int8.name(), "int8");
        let mut big = vec![1e6f32, -1e9, f32::NAN];
        canon(Packing::Fp16, &mut big);
        assert_eq!(&big[..2], &[65504.0, -65504.0]);
        assert!(big[2].is_nan());
    }
}
