//! Pipeline candidates over a grid of nodes (`grid[r][k]` = the node of stage k in replica r):
//! the stage cost the layer DP minimizes, the splits tried, the micro-batches dealt to the
//! replicas, and the search of one grid; with the subsets and permutations the searches
//! enumerate.

use crate::cluster::NodeId;
use crate::cost::Costs;
use crate::layers::LayerRange;

use super::batch;
use super::choice::Best;
use super::eval::{Candidate, search_into};
use super::layers::{self, Bounds};
use super::sync::SyncFreedom;

/// Stage-group aggregates for the layer DP: the slowest member's throughput, the smallest
/// memory, and the worst link to the next stage's member of the same replica.
pub(super) fn stage_cost_fn<'c>(
    costs: &'c Costs<'c>,
    grid: &'c [Vec<NodeId>],
) -> impl Fn(usize, usize, usize) -> Option<f64> + 'c {
    let stages = grid[0].len();
    let m = u64::from(costs.training.micro_batch);
    let agg: Vec<(f64, u64, f64, f64)> = (0..stages)
        .map(|k| {
            let flops = grid
                .iter()
                .map(|r| costs.cluster.node(r[k]).flops)
                .fold(f64::INFINITY, f64::min);
            let mem = grid
                .iter()
                .map(|r| costs.cluster.node(r[k]).memory_bytes)
                .min()
                .unwrap();
            let (bw, lat) = if k + 1 < stages {
                grid.iter()
                    .map(|r| costs.link(r[k], r[k + 1]))
                    .fold((f64::INFINITY, 0.0f64), |(b, l), x| {
                        (b.min(x.bandwidth_gbps), l.max(x.latency_ms))
                    })
            } else {
                (f64::INFINITY, 0.0)
            };
            (flops, mem, bw, lat)
        })
        .collect();
    move |k: usize, a: usize, b: usize| {
        let (flops, mem, bw, lat) = agg[k];
        let range = LayerRange::from(a..b);
        if costs.memory_bytes(range, (stages - k) as u64 * m) > mem {
            return None;
        }
        let compute = m as f64 * costs.train_flops(range) / flops;
        let p2p = if k + 1 < stages {
            let bytes = (costs.boundary_bytes_per_sample(b) * m) as f64;
            2.0 * (lat / 1e3 + bytes * 8.0 / (bw * 1e9))
        } else {
            0.0
        };
        Some(compute + p2p)
    }
}

/// Splits that weigh each stage's gradient all-reduce across the replicas, not only its
/// compute: a replicated pipeline's step is (micro-batches + S - 1) × its slowest stage plus its
/// slowest stage group's all-reduce (after the pipeline drains), and a stage with many layers
/// on fast devices balances compute but makes its group's all-reduce the step's longest. Two
/// kinds of split, each the layer DP's minimax under a changed stage cost:
/// - the stage's share of the step: compute + transfers + its all-reduce ÷ (micro-batches +
///   S - 1);
/// - compute + transfers with every stage's all-reduce capped, the caps a ladder below the
///   compute-only split's slowest all-reduce.
///
/// The all-reduce is estimated as a flat ring over the stage's column (its slowest access link,
/// its worst latency); each split is then evaluated exactly, with the sync the plan would choose.
fn sync_aware_splits(costs: &Costs<'_>, grid: &[Vec<NodeId>]) -> Vec<Bounds> {
    let (r, stages, l) = (grid.len(), grid[0].len(), costs.layers());
    let m = u64::from(costs.training.micro_batch);
    let micro = u64::from(costs.training.global_batch)
        .div_ceil(m)
        .div_ceil(r as u64);
    let slots = (micro + stages as u64 - 1) as f64;
    let column: Vec<(f64, f64)> = (0..stages)
        .map(|k| {
            grid.iter()
                .map(|row| costs.cluster.node(row[k]).link)
                .fold((f64::INFINITY, 0.0f64), |(b, lat), x| {
                    (b.min(x.bandwidth_gbps), lat.max(x.latency_ms))
                })
        })
        .collect();
    let sync = |k: usize, a: usize, b: usize| {
        let bytes = costs.grad_bytes(LayerRange::from(a..b)) as f64;
        crate::cost::ring_allreduce_s(r, bytes, column[k].0, column[k].1)
    };
    let f = stage_cost_fn(costs, grid);
    let mut out = Vec::new();
    let shared = |k: usize, a: usize, b: usize| f(k, a, b).map(|t| t + sync(k, a, b) / slots);
    if let Some((_, b)) = layers::optimal_split(l, stages, &shared) {
        out.push(b);
    }
    let Some((_, base)) = layers::optimal_split(l, stages, &f) else {
        return out;
    };
    let top = (0..stages)
        .map(|k| sync(k, base[k], base[k + 1]))
        .fold(0.0, f64::max);
    for share in [0.85, 0.7, 0.55, 0.4, 0.3] {
        let cap = top * share;
        let capped = |k: usize, a: usize, b: usize| {
            if sync(k, a, b) > cap {
                None
            } else {
                f(k, a, b)
            }
        };
        if let Some((_, b)) = layers::optimal_split(l, stages, &capped) {
            out.push(b);
        }
    }
    out
}

/// Micro-batches per replica: optimal makespan of (k_r + S - 1) · bottleneck_r.
fn replica_micro(costs: &Costs<'_>, grid: &[Vec<NodeId>], bounds: &Bounds) -> Vec<u64> {
    let stages = bounds.len() - 1;
    let m = u64::from(costs.training.micro_batch);
    let total = u64::from(costs.training.global_batch).div_ceil(m);
    let bottleneck: Vec<f64> = grid
        .iter()
        .map(|row| {
            (0..stages)
                .map(|k| {
                    let range = LayerRange::of_stage(bounds, k);
                    let c = costs.compute_s(row[k], range, m as f64);
                    let p = if k + 1 < stages {
                        2.0 * costs
                            .link(row[k], row[k + 1])
                            .transfer_s((costs.boundary_bytes_per_sample(bounds[k + 1]) * m) as f64)
                    } else {
                        0.0
                    };
                    c + p
                })
                .fold(0.0, f64::max)
        })
        .collect();
    batch::greedy_units(total, &bottleneck, (stages - 1) as f64)
}

/// Samples per replica from whole micro-batches: the last replica with work takes the partial
/// micro-batch so that the shares sum to the global batch.
fn samples_from_micro(micro: &[u64], costs: &Costs<'_>) -> Vec<u64> {
    let m = u64::from(costs.training.micro_batch);
    let mut samples: Vec<u64> = micro.iter().map(|&k| k * m).collect();
    let excess = samples.iter().sum::<u64>() - u64::from(costs.training.global_batch);
    if let Some(last) = samples.iter_mut().rev().find(|s| **s > 0) {
        *last -= excess;
    }
    samples
}

pub(super) fn pipe_candidates(
    costs: &Costs<'_>,
    grid: Vec<Vec<NodeId>>,
    all_splits: bool,
    out: &mut Vec<(Candidate, SyncFreedom)>,
) {
    let stages = grid[0].len();
    let l = costs.layers();
    let mut bounds_set: Vec<Bounds> = Vec::new();
    if all_splits {
        bounds_set = layers::all_splits(l, stages);
    } else {
        let f = stage_cost_fn(costs, &grid);
        if let Some((_, b)) = layers::optimal_split(l, stages, &f) {
            bounds_set.push(b);
        }
        let params: Vec<u64> = costs.model.layers.iter().map(|x| x.params).collect();
        let mut more = vec![
            layers::equal_layers(l, stages),
            layers::equal_params(&params, stages),
        ];
        if grid.len() >= 2 {
            more.extend(sync_aware_splits(costs, &grid));
        }
        for b in more {
            if !bounds_set.contains(&b) {
                bounds_set.push(b);
            }
        }
    }
    for bounds in bounds_set {
        out.push((
            pipe_candidate(costs, grid.clone(), bounds),
            SyncFreedom::Choose,
        ));
    }
}

/// The pipeline over `grid` split at `bounds`, its micro-batches dealt to the replicas.
pub(super) fn pipe_candidate(
    costs: &Costs<'_>,
    grid: Vec<Vec<NodeId>>,
    bounds: Bounds,
) -> Candidate {
    let micro = replica_micro(costs, &grid, &bounds);
    let samples = samples_from_micro(&micro, costs);
    Candidate::Pipe {
        grid,
        bounds,
        micro,
        samples,
        note: None,
    }
}

/// Search the pipelines over `grid` (its layer splits: every one with `all_splits`, else the
/// DP split and the two equal splits), keeping the best in `best`; skipped when even perfect
/// balance over its nodes cannot beat `best` (an exact bound).
pub(super) fn search_grid(
    costs: &Costs<'_>,
    grid: Vec<Vec<NodeId>>,
    all_splits: bool,
    best: &mut Best,
) {
    if super::eval::perfect_balance_s(costs, &grid) >= best.bound() {
        return;
    }
    let mut cands = Vec::new();
    pipe_candidates(costs, grid, all_splits, &mut cands);
    search_into(costs, &cands, best);
}

/// Every `k`-subset of `ids[from..]` after `cur`, in lexicographic order, into `out`.
pub(super) fn subsets(
    ids: &[NodeId],
    k: usize,
    from: usize,
    cur: &mut Vec<NodeId>,
    out: &mut Vec<Vec<NodeId>>,
) {
    if cur.len() == k {
        out.push(cur.clone());
        return;
    }
    for i in from..ids.len() {
        cur.push(ids[i]);
        subsets(ids, k, i + 1, cur, out);
        cur.pop();
    }
}

/// Call `f` with every permutation of `xs[k..]` (after `xs[..k]`), in a fixed order.
pub(super) fn permutations(xs: &mut [NodeId], k: usize, f: &mut dyn FnMut(&[NodeId])) {
    if k == xs.len() {
        f(xs);
        return;
    }
    for i in k..xs.len() {
        xs.swap(k, i);
        permutations(xs, k + 1, f);
        xs.swap(k, i);
    }
}
