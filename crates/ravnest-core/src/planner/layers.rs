//! Contiguous layer ranges for pipeline stages.
//!
//! [`optimal_split`] is a dynamic program over (stage, layer prefix) that minimizes the slowest
//! stage under every stage's memory limit: O(S·L²) cost evaluations. [`brute_force_split`]
//! enumerates every composition and is the oracle in the property test. The cost function is
//! passed in, so the same code serves the planner and the tests.

/// Boundaries `b` of length S+1 with `b[0] = 0`, `b[S] = L`; stage k holds `b[k]..b[k+1]`.
pub type Bounds = Vec<usize>;

/// A stage's cost for a layer range, or `None` when the range does not fit the stage's memory.
pub trait StageCost {
    /// Seconds for stage `stage` to hold layers `start..end`, or `None` if infeasible.
    fn cost(&self, stage: usize, start: usize, end: usize) -> Option<f64>;
}

impl<F: Fn(usize, usize, usize) -> Option<f64>> StageCost for F {
    fn cost(&self, stage: usize, start: usize, end: usize) -> Option<f64> {
        self(stage, start, end)
    }
}

/// The split of `layers` into `stages` non-empty contiguous ranges minimizing the largest stage
/// cost; ties go to the split found first (earlier boundaries). `None` if no split fits.
pub fn optimal_split(layers: usize, stages: usize, cost: &impl StageCost) -> Option<(f64, Bounds)> {
    if stages == 0 || stages > layers {
        return None;
    }
    const INF: f64 = f64::INFINITY;
    // best[k][l]: min over splits of layers 0..l into k+1 stages of the max stage cost.
    let mut best = vec![vec![INF; layers + 1]; stages];
    let mut from = vec![vec![usize::MAX; layers + 1]; stages];
    for l in 1..=layers - (stages - 1) {
        if let Some(c) = cost.cost(0, 0, l) {
            best[0][l] = c;
            from[0][l] = 0;
        }
    }
    for k in 1..stages {
        // stage k ends at l, starts at j; stages 0..k need j >= k layers, and later stages need
        // layers - l >= stages - 1 - k.
        for l in (k + 1)..=(layers - (stages - 1 - k)) {
            for j in k..l {
                let prev = best[k - 1][j];
                if prev == INF || prev >= best[k][l] {
                    continue;
                }
                if let Some(c) = cost.cost(k, j, l) {
                    let v = prev.max(c);
                    if v < best[k][l] {
                        best[k][l] = v;
                        from[k][l] = j;
                    }
                }
            }
        }
    }
    let total = best[stages - 1][layers];
    if total == INF {
        return None;
    }
    let mut bounds = vec![0; stages + 1];
    bounds[stages] = layers;
    let mut l = layers;
    for k in (0..stages).rev() {
        let j = from[k][l];
        bounds[k] = j;
        l = j;
    }
    Some((total, bounds))
}

/// Every split, for the oracle and for the exhaustive planner on small models.
pub fn all_splits(layers: usize, stages: usize) -> Vec<Bounds> {
    let mut out = Vec::new();
    if stages == 0 || stages > layers {
        return out;
    }
    let mut cur = vec![0];
    fn go(layers: usize, stages: usize, cur: &mut Bounds, out: &mut Vec<Bounds>) {
        let k = cur.len() - 1; // stages placed so far
        let start = *cur.last().unwrap();
        if k == stages - 1 {
            cur.push(layers);
            out.push(cur.clone());
            cur.pop();
            return;
        }
        for end in (start + 1)..=(layers - (stages - 1 - k)) {
            cur.push(end);
            go(layers, stages, cur, out);
            cur.pop();
        }
    }
    go(layers, stages, &mut cur, &mut out);
    out
}

/// Number of splits: C(layers-1, stages-1), saturating.
pub fn count_splits(layers: usize, stages: usize) -> u64 {
    if stages == 0 || stages > layers {
        return 0;
    }
    let (n, k) = ((layers - 1) as u64, (stages - 1) as u64);
    let k = k.min(n - k);
    let mut c: u64 = 1;
    for i in 0..k {
        c = c.saturating_mul(n - i) / (i + 1);
    }
    c
}

/// The best split by enumeration (the oracle).
pub fn brute_force_split(
    layers: usize,
    stages: usize,
    cost: &impl StageCost,
) -> Option<(f64, Bounds)> {
    let mut best: Option<(f64, Bounds)> = None;
    for b in all_splits(layers, stages) {
        let mut worst = 0.0f64;
        let mut ok = true;
        for k in 0..stages {
            match cost.cost(k, b[k], b[k + 1]) {
                Some(c) => worst = worst.max(c),
                None => {
                    ok = false;
                    break;
                }
            }
        }
        if ok && best.as_ref().is_none_or(|(v, _)| worst < *v) {
            best = Some((worst, b));
        }
    }
    best
}

/// Equal layer counts (the first `L % S` stages get one more): the `uniform` baseline.
pub fn equal_layers(layers: usize, stages: usize) -> Bounds {
    let mut b = vec![0];
    let (q, r) = (layers / stages, layers % stages);
    for k in 0..stages {
        b.push(b[k] + q + usize::from(k < r));
    }
    b
}

/// Boundaries that put about equal parameter counts in each stage (the `param-count` baseline,
/// as Ravnest's Python prototype splits): stage k ends at the first layer where the running sum
/// reaches (k+1)/S of the total, keeping every stage non-empty.
pub fn equal_params(params: &[u64], stages: usize) -> Bounds {
    let layers = params.len();
    let total: u64 = params.iter().sum();
    let mut b = vec![0];
    let mut acc = 0u64;
    let mut l = 0;
    for k in 0..stages - 1 {
        let target = total as f64 * (k + 1) as f64 / stages as f64;
        // At least one layer for this stage, and leave one for each later stage.
        let max_end = layers - (stages - 1 - k);
        loop {
            acc += params[l];
            l += 1;
            if acc as f64 >= target || l >= max_end {
                break;
            }
        }
        b.push(l);
    }
    b.push(layers);
    b
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The DP equals brute force on random instances: random per-layer work, per-stage speed
        /// and memory limits (so some splits are infeasible).
        #[test]
        fn dp_equals_exhaustive_optimum(
            work in prop::collection::vec(1u32..50, 1..10),
            mem in prop::collection::vec(1u32..60, 1..10),
            speed in prop::collection::vec(1u32..5, 1..6),
            stages in 1usize..6,
        ) {
            let layers = work.len();
            let stages = stages.min(speed.len());
            let cost = |k: usize, a: usize, b: usize| {
                let m: u32 = mem[a.min(mem.len()-1)..b.min(mem.len())].iter().sum();
                if m > 80 { return None; }
                Some(f64::from(work[a..b].iter().sum::<u32>()) / f64::from(speed[k]))
            };
            let dp = optimal_split(layers, stages, &cost);
            let bf = brute_force_split(layers, stages, &cost);
            match (&dp, &bf) {
                (None, None) => {}
                (Some((a, bounds)), Some((b, _))) => {
                    prop_assert!((a - b).abs() < 1e-9, "dp {a} vs brute {b}");
                    // the DP's bounds achieve its value
                    let mut worst = 0.0f64;
                    for k in 0..stages { worst = worst.max(cost(k, bounds[k], bounds[k+1]).unwrap()); }
                    prop_assert!((worst - a).abs() < 1e-9);
                }
                _ => prop_assert!(false, "dp {:?} vs brute {:?}", dp, bf),
            }
        }

        #[test]
        fn baseline_bounds_are_valid(params in prop::collection::vec(0u64..1000, 1..30), stages in 1usize..8) {
            let l = params.len();
            let stages = stages.min(l);
            for b in [equal_layers(l, stages), equal_params(&params, stages)] {
                prop_assert_eq!(b.len(), stages + 1);
                prop_assert_eq!(b[0], 0);
                prop_assert_eq!(b[stages], l);
                for k in 0..stages { prop_assert!(b[k] < b[k+1]); }
            }
        }
    }

    #[test]
    fn split_counts() {
        assert_eq!(count_splits(5, 2), 4);
        assert_eq!(all_splits(5, 2).len(), 4);
        assert_eq!(count_splits(26, 4), 2300);
        assert_eq!(all_splits(6, 3).len() as u64, count_splits(6, 3));
        assert_eq!(equal_layers(7, 3), vec![0, 3, 5, 7]);
        assert_eq!(equal_params(&[10, 10, 10, 10], 2), vec![0, 2, 4]);
    }
}
