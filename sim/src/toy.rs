//! A small, exact stand-in model for the simulator: a `DIM`-vector w fitted to sample vectors
//! x_s by least squares (per-sample loss ½‖w − x_s‖², gradient w − x_s). Its gradients travel
//! through the real ring all-reduce code, so the simulation checks correctness, not only timing:
//! after K distributed steps the model must equal [`reference_model`], K single-node steps on
//! the whole global batch.
//!
//! Pipelines need layers: [`Toy::Chain`] is `L` layers of `DIM` parameters each, with
//! h₀ = x_s, h_{l+1} = A·h_l + w_l and loss ½‖h_L − y_s‖². A stage runs its layers' forward on
//! the activations it receives and sends the gradient of its input back, so activations and
//! gradients really travel between stages, and the result is checked against single-node
//! training of the same chain.

use std::ops::Range;

use ravnest_core::LayerRange;

/// Length of the toy model vector.
pub const DIM: usize = 16;
/// Learning rate of the toy SGD. Small, so that an error in any step survives to the end of
/// a run: each step keeps about 95% of an earlier deviation (at 0.5 a wrong step was forgotten
/// within twenty steps, and the final-model checker could not see it).
pub const LR: f32 = 0.05;

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

use ravnest_protocol::digest::sample_range as step_samples;

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

/// Which stand-in model a simulated run trains.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Toy {
    /// One `DIM` vector (data-parallel runs): the model is not split by layer.
    Flat,
    /// `layers` layers of `DIM` parameters (pipeline runs).
    Chain {
        /// Layer count (the model's).
        layers: usize,
    },
}

/// The chain's activation decay per layer (A).
pub const CHAIN_A: f32 = 0.5;

/// Element `j` of sample `s`'s target y_s: a per-element offset the model must learn, plus
/// noise from a different stream than its input.
pub fn target(s: u64, j: usize) -> f32 {
    1.0 + j as f32 / DIM as f32 + 0.25 * sample(s ^ (1 << 62), j)
}

impl Toy {
    /// The initial model.
    pub fn initial_model(self) -> Vec<f32> {
        match self {
            Toy::Flat => initial_model(),
            Toy::Chain { layers } => vec![0.0; layers * DIM],
        }
    }

    /// Where `layers`' parameters sit in the model vector (the flat model is one slice).
    pub fn param_range(self, layers: LayerRange) -> Range<usize> {
        match self {
            Toy::Flat => 0..DIM,
            Toy::Chain { .. } => {
                let r = layers.range();
                r.start * DIM..r.end * DIM
            }
        }
    }

    /// Σ over `samples` of the per-sample gradient of the whole model.
    pub fn gradient_sum(self, samples: Range<u64>, model: &[f32]) -> Vec<f32> {
        match self {
            Toy::Flat => gradient_sum(samples, model),
            Toy::Chain { layers } => {
                let all = LayerRange::from(0..layers);
                let out = chain_forward(samples.clone(), all, model, None);
                chain_backward(samples, all, &out, None).0
            }
        }
    }

    /// The model after `steps` single-node steps on the whole global batch.
    pub fn reference_model(self, steps: u64, global_batch: u64) -> Vec<f32> {
        let mut w = self.initial_model();
        for k in 0..steps {
            let g: Vec<f32> = self
                .gradient_sum(step_samples(k, global_batch, 0, global_batch), &w)
                .into_iter()
                .map(|x| x / global_batch as f32)
                .collect();
            apply(&mut w, &g);
        }
        w
    }
}

/// The chain's forward through `layers` (whose parameters are `params`, `DIM` per layer) for
/// each sample of `samples`: from `input` (the previous stage's output, `DIM` per sample), or
/// from the samples themselves on the first stage. Returns `DIM` values per sample.
pub fn chain_forward(
    samples: Range<u64>,
    layers: LayerRange,
    params: &[f32],
    input: Option<&[f32]>,
) -> Vec<f32> {
    let n = (samples.end - samples.start) as usize;
    let mut h: Vec<f32> = match input {
        Some(x) => x.to_vec(),
        None => samples
            .clone()
            .flat_map(|s| (0..DIM).map(move |j| sample(s, j)))
            .collect(),
    };
    h.resize(n * DIM, 0.0);
    for l in 0..layers.len() {
        let w = &params[l * DIM..(l + 1) * DIM];
        for hs in h.chunks_exact_mut(DIM) {
            for (x, wj) in hs.iter_mut().zip(w) {
                *x = CHAIN_A * *x + wj;
            }
        }
    }
    h
}

/// The chain's backward through `layers` given their `output` (from [`chain_forward`]) and the
/// gradient of that output (`None` on the last stage: the loss's gradient h_L − y_s). Returns
/// (Σ over samples of the gradient of the layers' parameters, the gradient of the input).
pub fn chain_backward(
    samples: Range<u64>,
    layers: LayerRange,
    output: &[f32],
    grad_out: Option<&[f32]>,
) -> (Vec<f32>, Vec<f32>) {
    let mut delta: Vec<f32> = match grad_out {
        Some(g) => g.to_vec(),
        None => samples
            .clone()
            .zip(output.chunks_exact(DIM))
            .flat_map(|(s, h)| (0..DIM).map(move |j| h[j] - target(s, j)))
            .collect(),
    };
    let mut grad = vec![0.0f32; layers.len() * DIM];
    for l in (0..layers.len()).rev() {
        let g = &mut grad[l * DIM..(l + 1) * DIM];
        for d in delta.chunks_exact_mut(DIM) {
            for (gj, dj) in g.iter_mut().zip(d.iter_mut()) {
                *gj += *dj;
                *dj *= CHAIN_A;
            }
        }
    }
    (grad, delta)
}

#[cfg(test)]
mod tests {
    /// The chain's gradient equals a central finite difference of its loss, and a pipeline of
    /// stages (forward through each, backward in reverse) gives the whole chain's gradient.
    #[test]
    fn chain_gradients_match_finite_differences_and_stages_compose() {
        use super::*;
        let layers = 5;
        let model: Vec<f32> = (0..layers * DIM)
            .map(|i| ((i * 37 % 11) as f32 - 5.0) / 10.0)
            .collect();
        let samples = 3..7;
        let loss = |m: &[f32]| -> f64 {
            let out = chain_forward(samples.clone(), LayerRange::from(0..layers), m, None);
            samples
                .clone()
                .zip(out.chunks_exact(DIM))
                .map(|(s, h)| {
                    (0..DIM)
                        .map(|j| 0.5 * f64::from(h[j] - target(s, j)).powi(2))
                        .sum::<f64>()
                })
                .sum()
        };
        let g = Toy::Chain { layers }.gradient_sum(samples.clone(), &model);
        for i in (0..model.len()).step_by(7) {
            let (mut up, mut down) = (model.clone(), model.clone());
            up[i] += 1e-2;
            down[i] -= 1e-2;
            let fd = (loss(&up) - loss(&down)) / 2e-2;
            assert!(
                (fd - f64::from(g[i])).abs() < 1e-3,
                "param {i}: {fd} vs {}",
                g[i]
            );
        }
        // Two stages: layers 0..2 and 2..5.
        let (first, second) = (LayerRange::new(0, 2), LayerRange::new(2, 5));
        let a = chain_forward(samples.clone(), first, &model[..2 * DIM], None);
        let b = chain_forward(samples.clone(), second, &model[2 * DIM..], Some(&a));
        let (gb, din) = chain_backward(samples.clone(), second, &b, None);
        let (ga, _) = chain_backward(samples.clone(), first, &a, Some(&din));
        let staged: Vec<f32> = ga.into_iter().chain(gb).collect();
        for (x, y) in staged.iter().zip(&g) {
            assert!((x - y).abs() < 1e-6);
        }
        // Training the chain lowers its loss.
        let trained = Toy::Chain { layers }.reference_model(20, 8);
        let first = Toy::Chain { layers }.initial_model();
        let l = |m: &[f32]| {
            let out = chain_forward(0..64, LayerRange::from(0..layers), m, None);
            (0..64u64)
                .zip(out.chunks_exact(DIM))
                .map(|(s, h)| (0..DIM).map(|j| (h[j] - target(s, j)).powi(2)).sum::<f32>())
                .sum::<f32>()
        };
        assert!(
            l(&trained) < 0.8 * l(&first),
            "{} vs {}",
            l(&trained),
            l(&first)
        );
    }
}
