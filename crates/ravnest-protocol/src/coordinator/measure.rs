//! A node's measured speed, smoothed so that noise is not mistaken for drift: the median of its
//! last few per-step figures. On a shared machine one step in five can take twice as long (the
//! scheduler, another process); the median ignores such outliers, yet follows a real change
//! (a node that turns 3x slower) within half a window.

use std::collections::VecDeque;

/// The last `window` figures of one node.
#[derive(Debug, Clone, PartialEq)]
pub struct SpeedEstimate {
    window: usize,
    recent: VecDeque<f64>,
}

impl SpeedEstimate {
    /// An estimate that starts from `first` (the figure the plan used), over `window` figures.
    pub fn new(first: f64, window: usize) -> Self {
        let mut recent = VecDeque::with_capacity(window.max(1));
        recent.push_back(first);
        SpeedEstimate {
            window: window.max(1),
            recent,
        }
    }

    /// Add one step's figure.
    pub fn add(&mut self, x: f64) {
        if !x.is_finite() {
            return;
        }
        if self.recent.len() == self.window {
            self.recent.pop_front();
        }
        self.recent.push_back(x);
    }

    /// The spread of the figures' logarithms (1.4826 x their median absolute deviation: the
    /// standard deviation for normal noise, robust to outliers), for figures that are ratios.
    pub fn log_spread(&self) -> f64 {
        let logs: Vec<f64> = self.recent.iter().map(|x| x.max(1e-12).ln()).collect();
        let m = median(logs.clone());
        1.4826 * median(logs.iter().map(|x| (x - m).abs()).collect())
    }

    /// How many figures are kept.
    pub fn len(&self) -> usize {
        self.recent.len()
    }

    /// Whether none is (never: an estimate starts from a figure).
    pub fn is_empty(&self) -> bool {
        self.recent.is_empty()
    }

    /// The largest figure kept.
    pub fn max(&self) -> f64 {
        self.recent
            .iter()
            .copied()
            .fold(f64::NEG_INFINITY, f64::max)
    }

    /// The median of the figures kept.
    pub fn get(&self) -> f64 {
        median(self.recent.iter().copied().collect())
    }
}

/// The ring's measured time per step: per step, the least communication a worker of the ring
/// exposed (the worker that finished computing last waits only for the ring itself), and their
/// mean over the steps kept (a run's profile measures its ring the same way).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RingTime {
    /// Ring size and seconds, per step measured.
    steps: VecDeque<(usize, f64)>,
}

impl RingTime {
    /// Steps kept.
    const KEEP: usize = 64;

    /// One step of a ring of `waits.len()` workers, each with the seconds it waited for the
    /// ring after its compute.
    pub fn add(&mut self, waits: &[f64]) {
        let least = waits.iter().copied().fold(f64::INFINITY, f64::min);
        if waits.len() < 2 || !least.is_finite() {
            return;
        }
        if self.steps.len() == Self::KEEP {
            self.steps.pop_front();
        }
        self.steps.push_back((waits.len(), least));
    }

    /// Forget every step (the ring changed).
    pub fn clear(&mut self) {
        self.steps.clear();
    }

    /// (ring size, mean seconds) once at least `min_steps` steps of one ring size are kept.
    pub fn get(&self, min_steps: usize) -> Option<(usize, f64)> {
        let n = self.steps.back()?.0;
        let same: Vec<f64> = self
            .steps
            .iter()
            .filter(|s| s.0 == n)
            .map(|s| s.1)
            .collect();
        (same.len() >= min_steps.max(1)).then(|| (n, same.iter().sum::<f64>() / same.len() as f64))
    }
}

/// The median (0 for none).
pub(super) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match n {
        0 => 0.0,
        _ if n % 2 == 1 => v[n / 2],
        _ => 0.5 * (v[n / 2 - 1] + v[n / 2]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_ring_takes_the_least_wait_of_its_workers() {
        let mut r = RingTime::default();
        r.add(&[0.004, 0.001]);
        assert_eq!(r.get(2), None, "one step is not enough");
        r.add(&[0.003, 0.005]);
        r.add(&[0.002]);
        assert_eq!(r.get(2), Some((2, 0.002)), "a lone worker is no ring");
        r.add(&[0.001, 0.001, 0.001]);
        assert_eq!(r.get(2), None, "another ring size starts over");
        r.clear();
        assert_eq!(r.get(1), None);
    }

    proptest! {
        /// One outlier in a steady stream moves the estimate by nothing; a lasting change is
        /// followed within half a window.
        #[test]
        fn ignores_outliers_and_follows_a_change(
            base in 0.1f64..10.0,
            factor in 2.0f64..5.0,
            window in 3usize..12,
            at in 0usize..12,
        ) {
            let mut e = SpeedEstimate::new(base, window);
            for k in 0..window + 3 {
                e.add(if k == at { base * 50.0 } else { base });
            }
            prop_assert_eq!(e.get(), base);
            for _ in 0..window / 2 + 1 {
                e.add(base * factor);
            }
            prop_assert!((e.get() - base * factor).abs() < 1e-9 * base, "{} vs {}", e.get(), base * factor);
        }
    }
}
