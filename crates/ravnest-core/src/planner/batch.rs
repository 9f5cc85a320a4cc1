//! Splitting a global batch into integer per-node shares.
//!
//! [`proportional_split`] is the heterogeneity-aware split: shares proportional to throughput,
//! capped by memory, the excess redistributed (water-filling), rounded by largest remainder so
//! the shares sum exactly to the batch. [`polish_minimax`] then moves single samples off the
//! slowest node while that strictly shortens it; at its fixed point no other integer split has a
//! shorter slowest node (proof in the function's comment). [`equal_split`] is what DDP does.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

/// The continuous water-filled shares: x_i = min(cap_i, λ·w_i) with Σ x_i = total.
/// Returns `None` when the caps cannot hold `total`.
pub fn water_fill(total: u64, weights: &[f64], caps: &[u64]) -> Option<Vec<f64>> {
    assert_eq!(weights.len(), caps.len());
    if caps.iter().sum::<u64>() < total {
        return None;
    }
    let mut x = vec![0.0; weights.len()];
    let mut fixed = vec![false; weights.len()];
    let mut remaining = total as f64;
    loop {
        let w_sum: f64 = (0..weights.len())
            .filter(|&i| !fixed[i])
            .map(|i| weights[i])
            .sum();
        if w_sum <= 0.0 {
            break;
        }
        let mut capped_any = false;
        for i in 0..weights.len() {
            if !fixed[i] && remaining * weights[i] / w_sum >= caps[i] as f64 {
                fixed[i] = true;
                x[i] = caps[i] as f64;
                remaining -= caps[i] as f64;
                capped_any = true;
            }
        }
        if !capped_any {
            for i in 0..weights.len() {
                if !fixed[i] {
                    x[i] = remaining * weights[i] / w_sum;
                }
            }
            break;
        }
    }
    Some(x)
}

/// Integer shares proportional to `weights`, each ≤ its cap, summing to `total`; `None` when
/// the caps cannot hold `total`. Every share is within one sample of its water-filled value.
pub fn proportional_split(total: u64, weights: &[f64], caps: &[u64]) -> Option<Vec<u64>> {
    let x = water_fill(total, weights, caps)?;
    let mut b: Vec<u64> = x.iter().map(|v| v.floor() as u64).collect();
    let mut left = total - b.iter().sum::<u64>();
    // Largest remainder first; ties by index so the result is deterministic.
    let mut order: Vec<usize> = (0..x.len()).collect();
    order.sort_by(|&i, &j| {
        let (fi, fj) = (x[i] - x[i].floor(), x[j] - x[j].floor());
        fj.partial_cmp(&fi)
            .unwrap_or(Ordering::Equal)
            .then(i.cmp(&j))
    });
    for &i in order.iter().cycle().take(order.len() * 2) {
        if left == 0 {
            break;
        }
        if b[i] < caps[i] {
            b[i] += 1;
            left -= 1;
        }
    }
    debug_assert_eq!(
        left, 0,
        "water-filled shares leave at most n samples to round"
    );
    Some(b)
}

#[derive(PartialEq)]
struct Key(f64, usize);
impl Eq for Key {}
impl PartialOrd for Key {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Key {
    fn cmp(&self, o: &Self) -> Ordering {
        self.0.total_cmp(&o.0).then(o.1.cmp(&self.1))
    }
}

/// Node i's step time with `b` samples: its fixed cost plus b·t_i, or nothing when it has no
/// samples (it does not compute).
fn time_of(b: u64, t: f64, fixed: f64) -> f64 {
    if b == 0 { 0.0 } else { fixed + b as f64 * t }
}

/// Move single samples from a slowest node i to the node j where one more sample costs least,
/// while f_j(b_j+1) < f_i(b_i), where f_i(b) = `fixed[i]` + b·t_i (0 for b = 0). At the fixed
/// point the split minimizes max f_i(b_i) over all integer splits within the caps: if some split
/// b' had a smaller max T' < T, every slowest i has b'_i < b_i, so some j has b'_j ≥ b_j + 1 and
/// then f_j(b'_j) ≥ f_j(b_j+1) ≥ T (each f_j is nondecreasing). Each move strictly lowers the
/// sorted time vector, so it terminates.
pub fn polish_minimax(b: &mut [u64], secs_per_sample: &[f64], fixed: &[f64], caps: &[u64]) {
    let n = b.len();
    if n < 2 {
        return;
    }
    let f = |i: usize, b: u64| time_of(b, secs_per_sample[i], fixed[i]);
    // Max-heap of current times; min-heap (via Reverse) of next-sample times.
    let mut cur: BinaryHeap<Key> = (0..n).map(|i| Key(f(i, b[i]), i)).collect();
    let mut next: BinaryHeap<std::cmp::Reverse<Key>> = (0..n)
        .filter(|&i| b[i] < caps[i])
        .map(|i| std::cmp::Reverse(Key(f(i, b[i] + 1), i)))
        .collect();
    loop {
        // Drop stale entries.
        let Some(Key(t_max, i)) = cur.peek().map(|k| Key(k.0, k.1)) else {
            return;
        };
        if t_max != f(i, b[i]) {
            cur.pop();
            continue;
        }
        let j = loop {
            match next.peek() {
                None => return,
                Some(std::cmp::Reverse(Key(t, j))) => {
                    let j = *j;
                    if b[j] >= caps[j] || *t != f(j, b[j] + 1) {
                        next.pop();
                        continue;
                    }
                    break j;
                }
            }
        };
        let t_next = f(j, b[j] + 1);
        if i == j || t_next >= t_max || b[i] == 0 {
            return;
        }
        cur.pop();
        b[i] -= 1;
        b[j] += 1;
        cur.push(Key(f(i, b[i]), i));
        cur.push(Key(f(j, b[j]), j));
        next.push(std::cmp::Reverse(Key(f(i, b[i] + 1), i)));
        if b[j] < caps[j] {
            next.push(std::cmp::Reverse(Key(f(j, b[j] + 1), j)));
        }
    }
}

/// Equal shares: `total / n` each, the first `total % n` one more (what DDP and DeepSpeed do).
pub fn equal_split(total: u64, n: usize) -> Vec<u64> {
    let (q, r) = (total / n as u64, total % n as u64);
    (0..n as u64).map(|i| q + u64::from(i < r)).collect()
}

/// Assign `count` unit jobs to machines where machine i finishes at (k_i + offset)·t_i, one at a
/// time to the machine that would finish earliest: optimal for the makespan of unit jobs on
/// uniform machines. Used for micro-batches across pipeline replicas (offset = S - 1 fill/drain).
pub fn greedy_units(count: u64, secs_per_unit: &[f64], offset: f64) -> Vec<u64> {
    let n = secs_per_unit.len();
    assert!(n > 0, "at least one machine");
    // The optimal assignment takes the `count` smallest finishing times (j + offset)·t_i over
    // all machines i and j = 1, 2, ... Every time below the continuous solution T of
    // Σ max(0, T/t_i - offset) = count is among them, so start from those (found by bisection)
    // and add the last few units one by one.
    let units_below = |t: f64, s: f64| {
        if s > 0.0 {
            (t / s - offset).floor().max(0.0) as u64
        } else {
            0
        }
    };
    let t_min = secs_per_unit.iter().copied().fold(f64::INFINITY, f64::min);
    let (mut lo, mut hi) = (0.0f64, (count as f64 + offset + 1.0) * t_min);
    // 64 halvings take any f64 interval down to adjacent values.
    for _ in 0..64 {
        let mid = 0.5 * (lo + hi);
        if secs_per_unit
            .iter()
            .map(|&s| units_below(mid, s))
            .sum::<u64>()
            <= count
        {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let mut k: Vec<u64> = secs_per_unit.iter().map(|&s| units_below(lo, s)).collect();
    let placed: u64 = k.iter().sum();
    let mut heap: BinaryHeap<std::cmp::Reverse<Key>> = secs_per_unit
        .iter()
        .enumerate()
        .map(|(i, t)| std::cmp::Reverse(Key((k[i] as f64 + 1.0 + offset) * t, i)))
        .collect();
    for _ in placed..count {
        let std::cmp::Reverse(Key(_, i)) = heap.pop().expect("at least one machine");
        k[i] += 1;
        heap.push(std::cmp::Reverse(Key(
            (k[i] as f64 + 1.0 + offset) * secs_per_unit[i],
            i,
        )));
    }
    k
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn max_time(b: &[u64], t: &[f64], fixed: &[f64]) -> f64 {
        (0..b.len())
            .map(|i| time_of(b[i], t[i], fixed[i]))
            .fold(0.0, f64::max)
    }

    /// Oracle: every split of `total` into n capped parts (small instances only).
    fn brute_minimax(total: u64, t: &[f64], fixed: &[f64], caps: &[u64]) -> Option<f64> {
        #[allow(clippy::too_many_arguments)]
        fn go(
            i: usize,
            left: u64,
            t: &[f64],
            fixed: &[f64],
            caps: &[u64],
            cur: f64,
            best: &mut Option<f64>,
        ) {
            if i == t.len() {
                if left == 0 && best.is_none_or(|b| cur < b) {
                    *best = Some(cur);
                }
                return;
            }
            for b in 0..=left.min(caps[i]) {
                let c = cur.max(time_of(b, t[i], fixed[i]));
                go(i + 1, left - b, t, fixed, caps, c, best);
            }
        }
        let mut best = None;
        go(0, total, t, fixed, caps, 0.0, &mut best);
        best
    }

    proptest! {
        #[test]
        fn proportional_split_sums_caps_and_stays_within_one_sample(
            total in 0u64..5000,
            nodes in prop::collection::vec((0.1f64..100.0, 0u64..3000), 1..12),
        ) {
            let w: Vec<f64> = nodes.iter().map(|n| n.0).collect();
            let caps: Vec<u64> = nodes.iter().map(|n| n.1).collect();
            match proportional_split(total, &w, &caps) {
                None => prop_assert!(caps.iter().sum::<u64>() < total),
                Some(b) => {
                    prop_assert_eq!(b.iter().sum::<u64>(), total);
                    let x = water_fill(total, &w, &caps).unwrap();
                    for i in 0..b.len() {
                        prop_assert!(b[i] <= caps[i]);
                        prop_assert!((b[i] as f64 - x[i]).abs() < 1.0 + 1e-9, "node {i}: {} vs {}", b[i], x[i]);
                    }
                    // Uncapped nodes get shares proportional to weight: x_i / w_i is one constant.
                    let ratios: Vec<f64> = (0..b.len()).filter(|&i| x[i] < caps[i] as f64).map(|i| x[i] / w[i]).collect();
                    for r in &ratios { prop_assert!((r - ratios[0]).abs() <= 1e-6 * ratios[0].max(1.0)); }
                }
            }
        }

        #[test]
        fn polish_reaches_the_brute_force_minimax(
            total in 0u64..24,
            nodes in prop::collection::vec((1u32..20, 0u64..16, 0u32..40), 1..5),
            with_fixed in any::<bool>(),
        ) {
            let t: Vec<f64> = nodes.iter().map(|n| f64::from(n.0) / 7.0).collect();
            let fixed: Vec<f64> = nodes.iter().map(|n| if with_fixed { f64::from(n.2) / 9.0 } else { 0.0 }).collect();
            let caps: Vec<u64> = nodes.iter().map(|n| n.1).collect();
            let w: Vec<f64> = t.iter().map(|t| 1.0 / t).collect();
            let oracle = brute_minimax(total, &t, &fixed, &caps);
            match proportional_split(total, &w, &caps) {
                None => prop_assert!(oracle.is_none()),
                Some(mut b) => {
                    polish_minimax(&mut b, &t, &fixed, &caps);
                    prop_assert_eq!(b.iter().sum::<u64>(), total);
                    for i in 0..b.len() { prop_assert!(b[i] <= caps[i]); }
                    let got = max_time(&b, &t, &fixed);
                    prop_assert!((got - oracle.unwrap()).abs() < 1e-9, "got {got}, oracle {:?}", oracle);
                }
            }
        }

        #[test]
        fn greedy_units_is_optimal_for_pipelines(
            count in 0u64..14,
            t in prop::collection::vec(1u32..9, 1..4),
            offset in 0u32..3,
        ) {
            let t: Vec<f64> = t.iter().map(|&x| f64::from(x)).collect();
            let k = greedy_units(count, &t, f64::from(offset));
            prop_assert_eq!(k.iter().sum::<u64>(), count);
            let span = |k: &[u64]| k.iter().zip(&t).filter(|(k, _)| **k > 0)
                .map(|(&k, &t)| (k as f64 + f64::from(offset)) * t).fold(0.0, f64::max);
            // brute force over all assignments
            let n = t.len();
            let mut best = f64::INFINITY;
            let mut stack = vec![(0usize, count, vec![])];
            while let Some((i, left, acc)) = stack.pop() {
                if i == n - 1 {
                    let mut a: Vec<u64> = acc.clone(); a.push(left);
                    best = best.min(span(&a));
                    continue;
                }
                for x in 0..=left { let mut a = acc.clone(); a.push(x); stack.push((i + 1, left - x, a)); }
            }
            prop_assert!((span(&k) - best).abs() < 1e-9, "{:?} {} vs {}", k, span(&k), best);
        }
    }

    #[test]
    fn equal_split_matches_ddp() {
        assert_eq!(equal_split(10, 4), vec![3, 3, 2, 2]);
        assert_eq!(equal_split(2, 3), vec![1, 1, 0]);
    }

    #[test]
    fn caps_push_the_excess_to_others() {
        // A fast node capped at 10 passes its excess on, in proportion, to the others.
        let b = proportional_split(100, &[10.0, 1.0, 1.0], &[10, 1000, 1000]).unwrap();
        assert_eq!(b, vec![10, 45, 45]);
    }
}
