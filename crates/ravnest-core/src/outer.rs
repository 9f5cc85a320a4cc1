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
//! same bits. With lr 1 and μ 0 it is the weighted average of the models. An overlapped
//! round is merged a few inner steps after it: each replica then goes on from the round's
//! values with its own progress since the round carried over ([`carry_onto`]).

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
    if delta.len() != anchor.len()
        || params > delta.len()
        || momentum.is_some_and(|m| m.len() != params)
    {
        return None;
    }
    let (mu, lr) = (outer.momentum, outer.lr);
    let mut m = momentum.map_or_else(|| vec![0.0; params], <[f32]>::to_vec);
    let (dp, ds) = delta.split_at_mut(params);
    let (ap, as_) = anchor.split_at(params);
    for ((d, a), m) in dp.iter_mut().zip(ap).zip(m.iter_mut()) {
        *m = mu * *m + *d;
        *d = a - lr * (*d + mu * *m);
    }
    for (d, a) in ds.iter_mut().zip(as_) {
        *d = a - *d;
    }
    Some(m)
}

/// What a replica goes on from after an overlapped round's outer step is merged, in place
/// in `now` (its values at the merge): the merged parameters with the inner progress since the
/// round (`now − at`, `at` its values when the round started its exchange) carried over onto
/// them, and its own optimizer state (DiLoCo keeps the inner optimizer local). So each inner
/// step counts once: up to the round in the merged values, after it in the carry, which the
/// next round's delta includes. `false` when the lengths do not fit (nothing is changed).
pub fn carry_onto(merged: &[f32], at: &[f32], now: &mut [f32], params: usize) -> bool {
    if merged.len() != now.len() || at.len() != now.len() || params > now.len() {
        return false;
    }
    for ((x, m), a) in now[..params].iter_mut().zip(merged).zip(at) {
        *x = m + (*x - a);
    }
    true
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
            delay: 0,
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

    proptest! {
        /// Merged, a replica keeps its inner progress since the round (each step counted once:
        /// the next round's delta from the merged values includes it) and its own state.
        #[test]
        fn the_carry_keeps_inner_progress_once(
            merged in proptest::collection::vec(-5.0f32..5.0, 6),
            at in proptest::collection::vec(-5.0f32..5.0, 6),
            step in proptest::collection::vec(-1.0f32..1.0, 6),
            params in 0usize..=6,
        ) {
            let mut now: Vec<f32> = at.iter().zip(&step).map(|(a, d)| a + d).collect();
            let before = now.clone();
            prop_assert!(carry_onto(&merged, &at, &mut now, params));
            for i in 0..6 {
                let want = if i < params { merged[i] + (before[i] - at[i]) } else { before[i] };
                prop_assert!((now[i] - want).abs() < 1e-5, "value {i}: {} vs {want}", now[i]);
            }
            let mut same = at.clone();
            prop_assert!(carry_onto(&merged, &at, &mut same, params));
            prop_assert_eq!(&same[..params], &merged[..params]);
            prop_assert!(!carry_onto(&merged[..5], &at, &mut now, params));
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
        assert!(step(&o, &anchor, &mut [0.0; 3], 2, Some(&[0.0])).is_none());
    }
}
