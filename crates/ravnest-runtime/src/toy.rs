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

/// Digest of a model's exact bits.
pub fn digest(model: &[f32]) -> u64 {
    let mut h = Fnv::default();
    for x in model {
        h.u64(u64::from(x.to_bits()));
    }
    h.finish()
}
