//! A small, exact stand-in model for the simulator: a `DIM`-vector w fitted to sample vectors
//! x_s by least squares (per-sample loss ½‖w − x_s‖², gradient w − x_s). Its gradients travel
//! through the real ring all-reduce code, so the simulation checks correctness, not only timing:
//! after K distributed steps the model must equal [`reference_model`], K single-node steps on
//! the whole global batch.

use std::ops::Range;

use crate::trace::Fnv;

/// Length of the toy model vector.
pub const DIM: usize = 16;
/// Learning rate of the toy SGD.
pub const LR: f32 = 0.5;

fn mix(mut z: u64) -> u64 {
    // SplitMix64 finalizer: a fixed, portable function of the index.
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Element `j` of sample `s`, in [-1, 1].
pub fn sample(s: u64, j: usize) -> f32 {
    (mix(s.wrapping_mul(DIM as u64) + j as u64) % 2001) as f32 / 1000.0 - 1.0
}

/// Σ over global sample indices `samples` of (w − x_s).
pub fn gradient_sum(samples: Range<u64>, model: &[f32]) -> Vec<f32> {
    let mut g = vec![0.0f32; model.len()];
    for s in samples {
        for (j, gj) in g.iter_mut().enumerate() {
            *gj += model[j] - sample(s, j);
        }
    }
    g
}

/// The initial model.
pub fn initial_model() -> Vec<f32> {
    vec![0.0; DIM]
}

/// One SGD step with an already-averaged gradient.
pub fn apply(model: &mut [f32], mean_gradient: &[f32]) {
    for (w, g) in model.iter_mut().zip(mean_gradient) {
        *w -= LR * g;
    }
}

/// Global sample indices of step `step`: `step·B .. (step+1)·B` (a fixed data order).
pub fn step_samples(step: u64, global_batch: u64, offset: u64, batch: u64) -> Range<u64> {
    let start = step * global_batch + offset;
    start..start + batch
}

/// The model after `steps` single-node steps on the whole global batch.
pub fn reference_model(steps: u64, global_batch: u64) -> Vec<f32> {
    let mut w = initial_model();
    for k in 0..steps {
        let g: Vec<f32> = gradient_sum(step_samples(k, global_batch, 0, global_batch), &w)
            .into_iter()
            .map(|x| x / global_batch as f32)
            .collect();
        apply(&mut w, &g);
    }
    w
}

/// Digest of a model's exact bits, computed every step on every replica, so it must cost far
/// less than the step: four independent lanes (the CPU overlaps them) of a multiply-rotate mix
/// over pairs of words, folded at the end with the length. Each lane update is a bijection of
/// the word it takes in, so changing any one value always changes that lane.
pub fn digest(model: &[f32]) -> u64 {
    const K: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut lanes: [u64; 4] = [
        0x243F_6A88_85A3_08D3,
        0x1319_8A2E_0370_7344,
        0xA409_3822_299F_31D0,
        0x082E_FA98_EC4E_6C89,
    ];
    let word = |a: f32, b: f32| u64::from(a.to_bits()) | (u64::from(b.to_bits()) << 32);
    let blocks = model.chunks_exact(8);
    let rest = blocks.remainder();
    for c in blocks {
        for (i, lane) in lanes.iter_mut().enumerate() {
            *lane = (*lane ^ word(c[2 * i], c[2 * i + 1]))
                .wrapping_mul(K)
                .rotate_left(29);
        }
    }
    let mut h = Fnv::default();
    for lane in lanes {
        h.u64(lane);
    }
    for x in rest {
        h.u64(u64::from(x.to_bits()));
    }
    h.u64(model.len() as u64);
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::digest;
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

    #[test]
    fn signed_zeros_differ() {
        assert_ne!(digest(&[0.0; 9]), digest(&[-0.0; 9]));
    }
}
