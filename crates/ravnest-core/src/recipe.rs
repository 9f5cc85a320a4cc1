//! The training recipe's pure parts: the learning rate at each step (`[run] lr_schedule`),
//! which tensors weight decay applies to, and global gradient-norm clipping (`[run]
//! max_grad_norm`), with the pieces of a norm that no one node holds whole ([`NormPieces`]).
//!
//! The schedules are transformers' (`optimization.py`), as `LambdaLR` multiplies the base
//! learning rate at each step, so that a run configured as a Hugging Face `Trainer` one trains
//! with the same rates: the rate of optimizer step `t` (0-based, the steps done before it) is
//! `lr · factor(t)`.
//! - `constant`: linear warm-up from 0, then 1 (`get_constant_schedule_with_warmup`);
//! - `linear`: warm-up, then a straight line to `min_lr` at the last step
//!   (`get_linear_schedule_with_warmup`, which ends at 0: `min_lr` 0);
//! - `cosine`: warm-up, then half a cosine down to `min_lr`
//!   (`get_cosine_with_min_lr_schedule_with_warmup`);
//! - `wsd`: warm-up, a stable phase at `lr`, then half a cosine over the last `decay_steps`
//!   down to `min_lr` (`get_wsd_schedule`, linear warm-up and cosine decay: its defaults).

use serde::{Deserialize, Serialize};

/// Which schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum ScheduleKind {
    /// Warm-up, then constant.
    #[default]
    Constant,
    /// Warm-up, then linear decay.
    Linear,
    /// Warm-up, then cosine decay.
    Cosine,
    /// Warm-up, stable, decay (cosine).
    Wsd,
}

impl ScheduleKind {
    /// Its name in files.
    pub fn as_str(self) -> &'static str {
        match self {
            ScheduleKind::Constant => "constant",
            ScheduleKind::Linear => "linear",
            ScheduleKind::Cosine => "cosine",
            ScheduleKind::Wsd => "wsd",
        }
    }
}

/// The learning rate over a run.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Schedule {
    /// The shape.
    pub kind: ScheduleKind,
    /// Steps of linear warm-up from 0 (0: none).
    pub warmup_steps: u64,
    /// The run's steps (where linear and cosine reach `min_ratio`).
    pub total_steps: u64,
    /// The lowest rate, as a fraction of the base rate (`min_lr / lr`).
    pub min_ratio: f64,
    /// `wsd`: steps of the decay at the end.
    pub decay_steps: u64,
}

impl Schedule {
    /// A constant rate, no warm-up.
    pub const CONSTANT: Schedule = Schedule {
        kind: ScheduleKind::Constant,
        warmup_steps: 0,
        total_steps: 0,
        min_ratio: 0.0,
        decay_steps: 0,
    };

    /// Whether the rate never changes (what a run without `lr_schedule` does).
    pub fn is_constant(&self) -> bool {
        self.kind == ScheduleKind::Constant && self.warmup_steps == 0
    }

    /// The factor of the base rate at optimizer step `t` (the steps done before it).
    pub fn factor(&self, t: u64) -> f64 {
        let (w, n, r) = (self.warmup_steps, self.total_steps, self.min_ratio);
        let cosine = |progress: f64| 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
        match self.kind {
            ScheduleKind::Wsd => {
                if t < w {
                    let progress = t as f64 / w.max(1) as f64;
                    return (progress * (1.0 - r) + r).max(0.0);
                }
                let stable = n.saturating_sub(w).saturating_sub(self.decay_steps);
                if t < w + stable {
                    return 1.0;
                }
                if t < w + stable + self.decay_steps {
                    let progress = (t - w - stable) as f64 / self.decay_steps.max(1) as f64;
                    return (cosine(progress) * (1.0 - r) + r).max(0.0);
                }
                r
            }
            _ if t < w => t as f64 / w.max(1) as f64,
            ScheduleKind::Constant => 1.0,
            ScheduleKind::Linear => {
                let left = n.saturating_sub(t) as f64 / n.saturating_sub(w).max(1) as f64;
                (left * (1.0 - r) + r).max(0.0)
            }
            ScheduleKind::Cosine => {
                let progress = (t - w) as f64 / n.saturating_sub(w).max(1) as f64;
                (cosine(progress) * (1.0 - r) + r).max(0.0)
            }
        }
    }
}

/// Whether weight decay applies to a tensor of this shape: to matrices and embeddings, not to
/// biases and norm gains (the one-dimensional tensors), as Hugging Face's `Trainer` groups
/// them.
pub fn decays(shape: &[usize]) -> bool {
    shape.len() >= 2
}

/// The factor global gradient-norm clipping multiplies a gradient by, given the sum of its
/// squared values: `max / (norm + 1e-6)` when the norm exceeds `max`, else 1 (as
/// `torch.nn.utils.clip_grad_norm_`, whose factor is that clamped to 1).
pub fn clip_factor(sum_sq: f64, max: f32) -> f32 {
    let norm = sum_sq.max(0.0).sqrt();
    let f = f64::from(max) / (norm + 1e-6);
    f.min(1.0) as f32
}

/// Σ x² over `values`, in f64 (one part's piece of a global norm).
pub fn sum_sq(values: &[f32]) -> f64 {
    values.iter().map(|&x| f64::from(x) * f64::from(x)).sum()
}

/// Multiply `values` by `f` in place (a clipping factor; 1 leaves them as they are).
pub fn scale(values: &mut [f32], f: f32) {
    if f != 1.0 {
        values.iter_mut().for_each(|x| *x *= f);
    }
}

/// Clip the gradient made of `parts` (together one vector) to global norm `max`, in place; the
/// norm before clipping.
pub fn clip_global(parts: &mut [&mut [f32]], max: f32) -> f64 {
    let sq: f64 = parts.iter().map(|p| sum_sq(p)).sum();
    let f = clip_factor(sq, max);
    for p in parts.iter_mut() {
        scale(p, f);
    }
    sq.sqrt()
}

/// The pieces of steps' global gradient norms, when no node holds a whole gradient (a
/// pipeline's stages, a sharded run's owners): Σ x² of each part, by (epoch, step). The total
/// is the pieces summed in part order, so that every node that has them all computes the same
/// bits, and clips by the same factor.
#[derive(Debug, Default, Clone)]
pub struct NormPieces {
    got: std::collections::BTreeMap<(u64, u64), std::collections::BTreeMap<u32, f64>>,
}

impl NormPieces {
    /// Steps kept at once (pieces of more are refused: a peer that sends garbage).
    pub const MAX_STEPS: usize = 1024;

    /// Record part `part`'s piece of step (`epoch`, `step`); false when it was known already
    /// (a piece is not passed on twice) or the book is full.
    pub fn add(&mut self, epoch: u64, step: u64, part: u32, sq: f64) -> bool {
        if !self.got.contains_key(&(epoch, step)) && self.got.len() >= Self::MAX_STEPS {
            return false;
        }
        let pieces = self.got.entry((epoch, step)).or_default();
        if pieces.contains_key(&part) {
            return false;
        }
        pieces.insert(part, sq);
        true
    }

    /// Σ of parts `0..parts` of step (`epoch`, `step`) once all of them are in.
    pub fn total(&self, epoch: u64, step: u64, parts: u32) -> Option<f64> {
        let pieces = self.got.get(&(epoch, step))?;
        (0..parts).map(|p| pieces.get(&p).copied()).sum()
    }

    /// Forget the pieces of steps before (`epoch`, `step`) and of epochs before `epoch`.
    pub fn forget_before(&mut self, epoch: u64, step: u64) {
        self.got = self.got.split_off(&(epoch, step));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(kind: ScheduleKind, w: u64, n: u64, r: f64, d: u64) -> Schedule {
        Schedule {
            kind,
            warmup_steps: w,
            total_steps: n,
            min_ratio: r,
            decay_steps: d,
        }
    }

    #[test]
    fn transformers_lambdas_at_their_corners() {
        // Warm-up: 0 at step 0, 1/w after.
        let c = s(ScheduleKind::Cosine, 10, 110, 0.1, 0);
        assert_eq!(c.factor(0), 0.0);
        assert_eq!(c.factor(5), 0.5);
        assert_eq!(c.factor(10), 1.0);
        // Half-way through the decay: the middle of 1 and min.
        assert!((c.factor(60) - 0.55).abs() < 1e-12);
        assert!((c.factor(110) - 0.1).abs() < 1e-12);
        let l = s(ScheduleKind::Linear, 0, 100, 0.0, 0);
        assert_eq!(l.factor(0), 1.0);
        assert_eq!(l.factor(75), 0.25);
        assert_eq!(l.factor(100), 0.0);
        let k = s(ScheduleKind::Constant, 4, 100, 0.0, 0);
        assert_eq!((k.factor(2), k.factor(4), k.factor(99)), (0.5, 1.0, 1.0));
        // wsd: 10 up, 70 flat, 20 down (cosine), min 0.
        let w = s(ScheduleKind::Wsd, 10, 100, 0.0, 20);
        assert_eq!(w.factor(10), 1.0);
        assert_eq!(w.factor(79), 1.0);
        assert!((w.factor(90) - 0.5).abs() < 1e-12);
        assert_eq!(w.factor(100), 0.0);
        assert!(Schedule::CONSTANT.is_constant());
        assert!(decays(&[3, 4]) && !decays(&[4]));
    }

    /// The total is there once every part is, whatever their order, and is the same bits for
    /// every order; a piece known already is refused; older steps are forgotten.
    #[test]
    fn norm_pieces_sum_in_part_order() {
        use proptest::prelude::*;
        proptest!(ProptestConfig::with_cases(256), |(sq in proptest::collection::vec(0.0f64..1e3, 1..9), seed in any::<u64>())| {
            let n = sq.len() as u32;
            let mut order: Vec<u32> = (0..n).collect();
            let mut x = seed | 1;
            for i in (1..order.len()).rev() {
                x ^= x << 13; x ^= x >> 7; x ^= x << 17;
                order.swap(i, (x % (i as u64 + 1)) as usize);
            }
            let mut book = NormPieces::default();
            prop_assert!(book.add(0, 3, 0, 1.0));
            for (k, &p) in order.iter().enumerate() {
                prop_assert_eq!(book.total(1, 5, n), None);
                prop_assert!(book.add(1, 5, p, sq[p as usize]));
                prop_assert!(!book.add(1, 5, p, 7.0));
                prop_assert_eq!(book.total(1, 5, n).is_some(), k + 1 == order.len());
            }
            let want: f64 = sq.iter().sum();
            prop_assert_eq!(book.total(1, 5, n).map(f64::to_bits), Some(want.to_bits()));
            book.forget_before(1, 5);
            prop_assert_eq!(book.total(0, 3, 1), None);
            prop_assert!(book.total(1, 5, n).is_some());
        });
    }

    /// Clipped, a gradient's norm is at most `max` (a hair under it), its direction is kept,
    /// and one under `max` is untouched; however it is cut into parts.
    #[test]
    fn clipping_bounds_the_norm_and_keeps_the_direction() {
        use proptest::prelude::*;
        proptest!(ProptestConfig::with_cases(256), |(g in proptest::collection::vec(-50.0f32..50.0, 1..200), max in 0.01f32..20.0, cut in 0usize..200)| {
            let norm = |v: &[f32]| v.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>().sqrt();
            let mut c = g.clone();
            let (a, b) = c.split_at_mut(cut.min(g.len()));
            let before = clip_global(&mut [a, b], max);
            let (n0, n1) = (norm(&g), norm(&c));
            prop_assert!((before - n0).abs() <= 1e-9 * n0.max(1.0));
            if n0 <= f64::from(max) {
                prop_assert_eq!(&c, &g);
            } else {
                prop_assert!(n1 <= f64::from(max) * (1.0 + 1e-5), "{n1} > {max}");
                prop_assert!((n1 - f64::from(max)).abs() <= 1e-3 * f64::from(max) + 1e-5, "{n1} vs {max}");
                let dot: f64 = g.iter().zip(&c).map(|(&x, &y)| f64::from(x) * f64::from(y)).sum();
                prop_assert!((dot / (n0 * n1) - 1.0).abs() < 1e-5);
            }
        });
    }
}
