//! What every node computes the same way: which global samples a share of a step covers, and
//! the digest of a model version that replicas compare after every synchronized step.

use std::ops::Range;

/// FNV-1a, 64 bits: small, stable across platforms and Rust versions (unlike `DefaultHasher`).
#[derive(Debug, Clone, Copy)]
pub struct Fnv(u64);

impl Default for Fnv {
    fn default() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv {
    /// Fold bytes in.
    pub fn bytes(&mut self, b: &[u8]) {
        for x in b {
            self.0 ^= u64::from(*x);
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
    }

    /// Fold a u64 in (little-endian).
    pub fn u64(&mut self, x: u64) {
        self.bytes(&x.to_le_bytes());
    }

    /// The hash.
    pub fn finish(&self) -> u64 {
        self.0
    }
}

/// Global sample indices of `batch` samples at `offset` within step `step` of a global batch
/// of `global_batch`: `step·B + offset ..`. Every node and the single-node reference read the
/// same indices, so a distributed step covers exactly the samples of a single-node step.
pub fn sample_range(step: u64, global_batch: u64, offset: u64, batch: u64) -> Range<u64> {
    let start = step * global_batch + offset;
    start..start + batch
}

/// Digest of a model's exact bits, computed every step on every replica, so it must cost far
/// less than the step: four independent lanes (the CPU overlaps them) of a multiply-rotate mix
/// over pairs of words, folded at the end with the length. Each lane update is a bijection of
/// the word it takes in, so changing any one value always changes that lane.
pub fn digest(model: &[f32]) -> u64 {
    let mut d = Digest::default();
    d.update(model);
    d.finish()
}

/// [`digest`] of values that come in pieces (a model held tensor by tensor): the same result
/// as over their concatenation, without making it.
#[derive(Debug, Clone)]
pub struct Digest {
    lanes: [u64; 4],
    pending: [f32; 8],
    held: usize,
    len: u64,
}

impl Default for Digest {
    fn default() -> Self {
        Digest {
            lanes: [
                0x243F_6A88_85A3_08D3,
                0x1319_8A2E_0370_7344,
                0xA409_3822_299F_31D0,
                0x082E_FA98_EC4E_6C89,
            ],
            pending: [0.0; 8],
            held: 0,
            len: 0,
        }
    }
}

impl Digest {
    fn block(&mut self, c: &[f32]) {
        const K: u64 = 0x9E37_79B9_7F4A_7C15;
        let word = |a: f32, b: f32| u64::from(a.to_bits()) | (u64::from(b.to_bits()) << 32);
        for (i, lane) in self.lanes.iter_mut().enumerate() {
            *lane = (*lane ^ word(c[2 * i], c[2 * i + 1]))
                .wrapping_mul(K)
                .rotate_left(29);
        }
    }

    /// Fold the next values in.
    pub fn update(&mut self, mut values: &[f32]) {
        self.len += values.len() as u64;
        if self.held > 0 {
            let take = (8 - self.held).min(values.len());
            self.pending[self.held..self.held + take].copy_from_slice(&values[..take]);
            self.held += take;
            values = &values[take..];
            if self.held < 8 {
                return;
            }
            let block = self.pending;
            self.block(&block);
            self.held = 0;
        }
        let blocks = values.chunks_exact(8);
        let rest = blocks.remainder();
        for c in blocks {
            self.block(c);
        }
        self.pending[..rest.len()].copy_from_slice(rest);
        self.held = rest.len();
    }

    /// The digest of everything folded in.
    pub fn finish(&self) -> u64 {
        let mut h = Fnv::default();
        for lane in self.lanes {
            h.u64(lane);
        }
        for x in &self.pending[..self.held] {
            h.u64(u64::from(x.to_bits()));
        }
        h.u64(self.len);
        h.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Changing one value's bits, or the length, changes the digest.
        #[test]
        fn one_changed_value_changes_the_digest(
            model in prop::collection::vec(any::<f32>(), 0..40),
            at in any::<usize>(),
            bits in any::<u32>(),
        ) {
            let d = digest(&model);
            prop_assert_eq!(d, digest(&model.clone()));
            if !model.is_empty() {
                let i = at % model.len();
                let mut other = model.clone();
                other[i] = f32::from_bits(bits);
                if other[i].to_bits() != model[i].to_bits() {
                    prop_assert_ne!(d, digest(&other), "changed element {}", i);
                }
            }
            let mut longer = model.clone();
            longer.push(0.0);
            prop_assert_ne!(d, digest(&longer));
        }
    }

    proptest! {
        /// Folding values in pieces gives the digest of their concatenation.
        #[test]
        fn pieces_digest_as_their_concatenation(
            model in prop::collection::vec(any::<f32>(), 0..60),
            cuts in prop::collection::vec(0usize..60, 0..6),
        ) {
            let mut bounds: Vec<usize> = cuts.iter().map(|c| c % (model.len() + 1)).collect();
            bounds.extend([0, model.len()]);
            bounds.sort_unstable();
            let mut d = Digest::default();
            for w in bounds.windows(2) {
                d.update(&model[w[0]..w[1]]);
            }
            prop_assert_eq!(d.finish(), digest(&model));
        }
    }

    #[test]
    fn shares_of_a_step_tile_its_samples() {
        assert_eq!(sample_range(3, 10, 0, 4), 30..34);
        assert_eq!(sample_range(3, 10, 4, 6), 34..40);
    }

    #[test]
    fn signed_zeros_differ() {
        assert_ne!(digest(&[0.0; 9]), digest(&[-0.0; 9]));
    }
}
