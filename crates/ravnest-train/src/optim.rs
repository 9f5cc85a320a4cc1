//! Our own optimizers over the flat model. Their state rides in the same vector as the
//! parameters (`[params | state]`), so it is averaged, checkpointed and handed to a rejoining
//! node exactly like the weights, and every replica applies bit-identical updates.

use ravnest_core::Optimizer;

/// An optimizer with its hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Optim {
    /// Which.
    pub kind: Optimizer,
    /// Learning rate.
    pub lr: f32,
    /// Momentum (SGD) or β1 (AdamW).
    pub momentum: f32,
    /// Decoupled weight decay (AdamW).
    pub weight_decay: f32,
}

const BETA2: f32 = 0.999;
const EPS: f32 = 1e-8;

impl Optim {
    /// State elements for `params` parameters.
    pub fn state_len(&self, params: usize) -> usize {
        match self.kind {
            Optimizer::Sgd => 0,
            Optimizer::SgdMomentum => params,
            // m, v, and the step count.
            Optimizer::Adamw => 2 * params + 1,
        }
    }

    /// Names of the state tensors, each of `params` elements except a trailing scalar step.
    pub fn state_names(&self) -> &'static [&'static str] {
        match self.kind {
            Optimizer::Sgd => &[],
            Optimizer::SgdMomentum => &["momentum"],
            Optimizer::Adamw => &["adam_m", "adam_v"],
        }
    }

    /// One step: `model = [params | state]`, `grad` has `params` elements.
    pub fn step(&self, model: &mut [f32], grad: &[f32]) {
        let p = grad.len();
        let (w, state) = model.split_at_mut(p);
        match self.kind {
            Optimizer::Sgd => {
                for (w, g) in w.iter_mut().zip(grad) {
                    *w -= self.lr * g;
                }
            }
            Optimizer::SgdMomentum => {
                for ((w, v), g) in w.iter_mut().zip(state.iter_mut()).zip(grad) {
                    *v = self.momentum * *v + g;
                    *w -= self.lr * *v;
                }
            }
            Optimizer::Adamw => {
                let (m, rest) = state.split_at_mut(p);
                let (v, t) = rest.split_at_mut(p);
                t[0] += 1.0;
                let b1 = self.momentum;
                let c1 = 1.0 - b1.powf(t[0]);
                let c2 = 1.0 - BETA2.powf(t[0]);
                for i in 0..p {
                    let g = grad[i];
                    m[i] = b1 * m[i] + (1.0 - b1) * g;
                    v[i] = BETA2 * v[i] + (1.0 - BETA2) * g * g;
                    let update = (m[i] / c1) / ((v[i] / c2).sqrt() + EPS);
                    w[i] -= self.lr * (update + self.weight_decay * w[i]);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_optimizer_descends_a_quadratic() {
        for kind in [Optimizer::Sgd, Optimizer::SgdMomentum, Optimizer::Adamw] {
            let o = Optim {
                kind,
                lr: 0.05,
                momentum: 0.9,
                weight_decay: 0.0,
            };
            let mut model = vec![3.0f32, -2.0];
            model.resize(2 + o.state_len(2), 0.0);
            for _ in 0..500 {
                let g = [model[0], model[1]];
                o.step(&mut model, &g);
            }
            assert!(
                model[0].abs() < 0.05 && model[1].abs() < 0.05,
                "{kind:?}: {model:?}"
            );
        }
    }
}
