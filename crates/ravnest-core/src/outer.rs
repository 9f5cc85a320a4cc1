//! The outer step of a local-SGD round (DiLoCo), as plain arithmetic over exported values:
//! what each replica contributes, and what the group's sum makes of the round's anchor.
//!
//! Values are a node's export of what it holds (parameters first, `params` of them, then
//! their optimizer state). With `a` the anchor (the round's start, the same on every replica),
//! `x_i` replica i's values and `w_i` its batch share (Σ w_i = 1), each contributes
//! `w_i · (a − x_i)`; the group sums them to `Δ = a − Σ w_i x_i`. Then
//! - momentum: `m ← μ · m + Δ` (parameters only),
//! - parameters: `a − lr · (Δ + μ · m)` (Nesterov),
//! - optimizer state: `a − Δ`, the weighted average.
//!
//! Every replica computes this from the same anchor, sum and momentum, so all end with the
//! same bits. With lr 1 and μ 0 it is the weighted average of the models.

use crate::planner::sync::Outer;

/// Replica values `local` become its contribution `share · (anchor − local)`, in place.
/// `false` when the lengths differ (nothing is changed).
pub fn contribution(local: &mut [f32], anchor: &[f32], share: f32) -> bool {
    if local.len() != anchor.len() {
        return false;
    }
    for (x, a) in local.iter_mut().zip(anchor) {
        *x = share * (a - *x);
    }
    true
}

/// The round's result from the group's sum `delta` (in place: it becomes the new values) and
/// the momentum of the round before (`None`: zeros); returns the new momentum (`params`
/// values). `None` when the lengths do not fit (nothing is changed).
pub fn step(
    outer: &Outer,
    anchor: &[f32],
    delta: &mut [f32],
    params: usize,
    momentum: Option<&[f32]>,
) -> Option<Vec<f32>> {
    step_onto(outer, anchor, anchor, delta, params, momentum)
}

/// [`step`] with the outer step applied to `base`'s parameters instead of the round's anchor
/// (an overlapped round applies one round late, onto the anchor of the round after it); the
/// optimizer state is still the round's average, `anchor − Δ`.
pub fn step_onto(
    outer: &Outer,
    base: &[f32],
    anchor: &[f32],
    delta: &mut [f32],
    params: usize,
    momentum: Option<&[f32]>,
) -> Option<Vec<f32>> {
    if delta.len() != anchor.len()
        || base.len() != anchor.len()
        || params > delta.len()
        || momentum.is_some_and(|m| m.len() != params)
    {
        return None;
    }
    let (mu, lr) = (outer.momentum, outer.lr);
    let mut m = momentum.map_or_else(|| vec![0.0; params], <[f32]>::to_vec);
    let (dp, ds) = delta.split_at_mut(params);
    let (bp, as_) = (&base[..params], &anchor[params..]);
    for ((d, a), m) in dp.iter_mut().zip(bp).zip(m.iter_mut()) {
        *m = mu * *m + *d;
        *d = a - lr * (*d + mu * *m);
    }
    for (d, a) in ds.iter_mut().zip(as_) {
        *d = a - *d;
    }
    Some(m)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pack::Packing;
    use proptest::prelude::*;

    fn nesterov(lr: f32, momentum: f32) -> Outer {
        Outer {
            lr,
            momentum,
            packing: Packing::Fp32,
            overlap: false,
        }
    }

    proptest! {
        /// lr 1, momentum 0: the weighted average of the replicas.
        #[test]
        fn plain_outer_step_is_the_weighted_average(
            reps in proptest::collection::vec(proptest::collection::vec(-5.0f32..5.0, 6), 1..5),
            anchor in proptest::collection::vec(-5.0f32..5.0, 6),
            params in 0usize..=6,
        ) {
            let n = reps.len();
            let share = 1.0 / n as f32;
            let mut sum = vec![0.0f32; 6];
            for r in &reps {
                let mut c = r.clone();
                prop_assert!(contribution(&mut c, &anchor, share));
                for (s, x) in sum.iter_mut().zip(&c) {
                    *s += x;
                }
            }
            prop_assert!(step(&nesterov(1.0, 0.0), &anchor, &mut sum, params, None).is_some());
            for (i, v) in sum.iter().enumerate() {
                let avg = reps.iter().map(|r| r[i]).sum::<f32>() / n as f32;
                prop_assert!((v - avg).abs() < 1e-4, "value {i}: {v} vs {avg}");
            }
        }
    }

    /// Two rounds by hand: the Nesterov recurrence and the momentum it carries.
    #[test]
    fn nesterov_matches_the_recurrence() {
        let o = nesterov(0.7, 0.9);
        let anchor = [1.0f32, 2.0, 10.0];
        let mut delta = [0.5f32, -1.0, 4.0];
        let m = step(&o, &anchor, &mut delta, 2, None).unwrap();
        assert_eq!(m, vec![0.5, -1.0]);
        // p = a − lr (Δ + μ m) with m = Δ: 1 − 0.7 · 0.95, 2 + 0.7 · 1.9; the state is a − Δ.
        assert!((delta[0] - (1.0 - 0.7 * 0.95)).abs() < 1e-6);
        assert!((delta[1] - (2.0 + 0.7 * 1.9)).abs() < 1e-6);
        assert_eq!(delta[2], 6.0);
        let mut again = [0.5f32, -1.0, 0.0];
        let m2 = step(&o, &anchor, &mut again, 2, Some(&m)).unwrap();
        assert!((m2[0] - 0.95).abs() < 1e-6 && (m2[1] + 1.9).abs() < 1e-6);
        assert!(step(&o, &anchor, &mut [0.0; 2], 2, None).is_none());
        // Onto another base: its parameters move, the state is still the round's average.
        let mut d = [0.5f32, -1.0, 4.0];
        step_onto(&o, &[0.0, 0.0, 99.0], &anchor, &mut d, 2, None).unwrap();
        assert!((d[0] + 0.7 * 0.95).abs() < 1e-6 && (d[1] - 0.7 * 1.9).abs() < 1e-6);
        assert_eq!(d[2], 6.0);
        assert!(step(&o, &anchor, &mut [0.0; 3], 2, Some(&[0.0])).is_none());
    }
}
