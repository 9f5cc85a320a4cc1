//! Our own optimizers over the flat model. Their state rides in the same vector as the
//! parameters (`[params | state]`), so it is averaged, checkpointed and handed to a rejoining
//! node exactly like the weights, and every replica applies bit-identical updates.

use std::ops::Range;

use ravnest_core::Optimizer;
use ravnest_core::recipe::Schedule;

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
    /// The learning rate's schedule: `lr` times its factor at each step ([`Optim::at`]).
    pub schedule: Schedule,
}

const BETA2: f32 = 0.999;
const EPS: f32 = 1e-8;

impl Optim {
    /// State elements for `params` parameters: the state tensors, and the step count where
    /// the update needs it (AdamW's bias correction, a scheduled learning rate).
    pub fn state_len(&self, params: usize) -> usize {
        match self.kind {
            Optimizer::Sgd => usize::from(self.counts_steps()),
            Optimizer::SgdMomentum => params + usize::from(self.counts_steps()),
            // m, v, and the step count.
            Optimizer::Adamw => 2 * params + 1,
        }
    }

    /// Whether the state ends with the step count: AdamW's, or any optimizer's under a
    /// schedule (every replica, a resumed run and a joiner then apply the same rate).
    fn counts_steps(&self) -> bool {
        self.kind == Optimizer::Adamw || !self.schedule.is_constant()
    }

    /// This optimizer as it updates a tensor of `shape` at step `t` (the steps done before):
    /// the learning rate scheduled, and no weight decay on biases and norm gains
    /// ([`ravnest_core::recipe::decays`]).
    pub fn at(&self, t: f32, shape: &[usize]) -> Optim {
        Optim {
            lr: (f64::from(self.lr) * self.schedule.factor(t as u64)) as f32,
            weight_decay: if ravnest_core::recipe::decays(shape) {
                self.weight_decay
            } else {
                0.0
            },
            schedule: Schedule::CONSTANT,
            ..*self
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
        self.step_range(model, p, 0..p, grad);
        self.end_step(model, p);
    }

    /// The update of parameters `range` (of `params`) and their state, from their gradient
    /// `grad` (`range.len()` values). A step is applied range by range (each gradient bucket
    /// as its all-reduce finishes), then [`Optim::end_step`] once: the result is the same as
    /// one [`Optim::step`] over the whole vector.
    pub fn step_range(&self, model: &mut [f32], params: usize, range: Range<usize>, grad: &[f32]) {
        debug_assert_eq!(range.len(), grad.len());
        if !self.schedule.is_constant() {
            let t = self
                .step_count_at(params)
                .and_then(|k| model.get(k))
                .copied();
            let at = Optim {
                lr: (f64::from(self.lr) * self.schedule.factor(t.unwrap_or(0.0) as u64)) as f32,
                schedule: Schedule::CONSTANT,
                ..*self
            };
            return at.step_range(model, params, range, grad);
        }
        let (w, state) = model.split_at_mut(params);
        let w = &mut w[range.clone()];
        match self.kind {
            Optimizer::Sgd => {
                for (w, g) in w.iter_mut().zip(grad) {
                    *w -= self.lr * g;
                }
            }
            Optimizer::SgdMomentum => {
                let v = &mut state[range];
                for ((w, v), g) in w.iter_mut().zip(v.iter_mut()).zip(grad) {
                    *v = self.momentum * *v + g;
                    *w -= self.lr * *v;
                }
            }
            Optimizer::Adamw => {
                let (m, rest) = state.split_at_mut(params);
                let (v, t) = rest.split_at_mut(params);
                // The step counter advances in `end_step`: this step is number t + 1.
                let t = t[0] + 1.0;
                let b1 = self.momentum;
                let c1 = 1.0 - b1.powf(t);
                let c2 = 1.0 - BETA2.powf(t);
                let (m, v) = (&mut m[range.clone()], &mut v[range]);
                for i in 0..w.len() {
                    let g = grad[i];
                    m[i] = b1 * m[i] + (1.0 - b1) * g;
                    v[i] = BETA2 * v[i] + (1.0 - BETA2) * g * g;
                    let update = (m[i] / c1) / ((v[i] / c2).sqrt() + EPS);
                    w[i] -= self.lr * (update + self.weight_decay * w[i]);
                }
            }
        }
    }

    /// One tensor's update in one pass, into new buffers: (new parameters, new state) from
    /// the parameters `w`, their state (`state[k]` as [`Optim::state_names`] orders them) and
    /// their gradient `grad` times `scale`; `t` is the step count before this step (AdamW's
    /// bias correction). The same operations in the same order as [`Optim::step_range`], so
    /// the result is bit for bit the same.
    pub fn update(
        &self,
        w: &[f32],
        state: &[&[f32]],
        grad: &[f32],
        scale: f32,
        t: f32,
    ) -> (Vec<f32>, Vec<Vec<f32>>) {
        debug_assert_eq!(w.len(), grad.len());
        // Each output is one pass over zipped slices (no indexing, no pushes), so the loops
        // vectorize; the per-element arithmetic is unchanged.
        let (lr, mu) = (self.lr, self.momentum);
        let g = grad.iter().map(|g| g * scale);
        match self.kind {
            Optimizer::Sgd => {
                let w: Vec<f32> = w.iter().zip(g).map(|(w, g)| w - lr * g).collect();
                (w, Vec::new())
            }
            Optimizer::SgdMomentum => {
                let nv: Vec<f32> = state[0].iter().zip(g).map(|(s, g)| mu * s + g).collect();
                let nw: Vec<f32> = w.iter().zip(&nv).map(|(w, v)| w - lr * v).collect();
                (nw, vec![nv])
            }
            Optimizer::Adamw => {
                let t = t + 1.0;
                let (c1, c2) = (1.0 - mu.powf(t), 1.0 - BETA2.powf(t));
                let wd = self.weight_decay;
                let nm: Vec<f32> = state[0]
                    .iter()
                    .zip(g.clone())
                    .map(|(m, g)| mu * m + (1.0 - mu) * g)
                    .collect();
                let nv: Vec<f32> = state[1]
                    .iter()
                    .zip(g)
                    .map(|(v, g)| BETA2 * v + (1.0 - BETA2) * g * g)
                    .collect();
                let nw: Vec<f32> = w
                    .iter()
                    .zip(nm.iter().zip(&nv))
                    .map(|(w, (mi, vi))| {
                        let update = (mi / c1) / ((vi / c2).sqrt() + EPS);
                        w - lr * (update + wd * w)
                    })
                    .collect();
                (nw, vec![nm, nv])
            }
        }
    }

    /// AdamW's constants for step number `t + 1` (the step count before it is `t`):
    /// (β1, 1 − β1, β2, 1 − β2, bias corrections c1 and c2, ε), each computed once on the host
    /// so that every device applies the same values.
    pub fn adamw_constants(&self, t: f32) -> [f32; 7] {
        let t = t + 1.0;
        let b1 = self.momentum;
        [
            b1,
            1.0 - b1,
            BETA2,
            1.0 - BETA2,
            1.0 - b1.powf(t),
            1.0 - BETA2.powf(t),
            EPS,
        ]
    }

    /// After every range of a step was applied: advance the step counter (AdamW).
    pub fn end_step(&self, model: &mut [f32], params: usize) {
        if let Some(t) = self.step_count_at(params).and_then(|k| model.get_mut(k)) {
            *t += 1.0;
        }
    }

    /// Where the step count sits in `[params | state]`, where the state has one.
    pub fn step_count_at(&self, params: usize) -> Option<usize> {
        self.counts_steps()
            .then(|| params * (1 + self.state_names().len()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Applying a step range by range (in any order of disjoint ranges covering the
        /// parameters), then ending it, is bit-identical to one whole step.
        #[test]
        fn a_step_by_ranges_equals_a_whole_step(
            kind in 0usize..3,
            p in 1usize..20,
            cuts in prop::collection::vec(0usize..20, 0..4),
            reverse in any::<bool>(),
            vals in prop::collection::vec(-3.0f32..3.0, 60),
        ) {
            let kind = [Optimizer::Sgd, Optimizer::SgdMomentum, Optimizer::Adamw][kind];
            let o = Optim { kind, lr: 0.1, momentum: 0.9, weight_decay: 0.01, schedule: ravnest_core::recipe::Schedule::CONSTANT };
            let mut whole: Vec<f32> = vals[..p].to_vec();
            whole.resize(p + o.state_len(p), 0.5);
            let grad: Vec<f32> = vals[20..20 + p].to_vec();
            let mut parts = whole.clone();
            for _ in 0..2 {
                o.step(&mut whole, &grad);
                let mut bounds: Vec<usize> = cuts.iter().map(|c| c % (p + 1)).collect();
                bounds.extend([0, p]);
                bounds.sort_unstable();
                bounds.dedup();
                let mut ranges: Vec<Range<usize>> = bounds.windows(2).map(|w| w[0]..w[1]).collect();
                if reverse { ranges.reverse(); }
                for r in ranges {
                    o.step_range(&mut parts, p, r.clone(), &grad[r]);
                }
                o.end_step(&mut parts, p);
                prop_assert_eq!(&whole, &parts);
            }
        }
    }

    #[test]
    fn every_optimizer_descends_a_quadratic() {
        for kind in [Optimizer::Sgd, Optimizer::SgdMomentum, Optimizer::Adamw] {
            let o = Optim {
                kind,
                lr: 0.05,
                momentum: 0.9,
                weight_decay: 0.0,
                schedule: ravnest_core::recipe::Schedule::CONSTANT,
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
