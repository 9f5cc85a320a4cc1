//! The candidate layouts each planner considers: ravnest's heuristic set, the exhaustive
//! enumeration, and the equal-split baselines.

use crate::cluster::{ClusterSpec, NodeId};
use crate::cost::Costs;
use crate::layers::LayerRange;
use crate::units::bytes_u64;

use super::batch;
use super::eval::{Candidate, NoFit, Rejected, evaluate, keep_best, search_into};
use super::layers::{self, Bounds};
use super::sync::SyncFreedom;
use super::types::{EXHAUSTIVE_MAX_SPLITS, Plan, PlanError, PlanOptions, PlannerKind};

// ---------------------------------------------------------------------------------------------
// Data-parallel splits.

/// Per-node sample caps for holding the whole model: (usable - state) ÷ activations per sample.
fn dp_caps(costs: &Costs<'_>, workers: &[NodeId]) -> Vec<u64> {
    let all = costs.all();
    let state = costs.state_bytes(all);
    let act = costs.activation_bytes_per_sample(all).max(1);
    let b = u64::from(costs.training.global_batch);
    workers
        .iter()
        .map(|&w| costs.cluster.node(w).memory_bytes.saturating_sub(state) / act)
        .map(|c| c.min(b))
        .collect()
}

/// Whether data-parallel workers accumulate gradients over micro-batches: when the file allows
/// it (`[training] accumulate`, default true) and all the nodes together cannot hold the
/// global batch at once. (Letting memory never cap a share would be
/// faster on some files under the cost model, flaky-3090 and large-1000 among them, and moves
/// their plans: left for a change of its own. The oracle keeps the same rule.)
fn accumulates(costs: &Costs<'_>) -> bool {
    if !costs.training.accumulate {
        return false;
    }
    let all: Vec<NodeId> = costs.cluster.ids().collect();
    dp_caps(costs, &all).iter().sum::<u64>() < u64::from(costs.training.global_batch)
}

/// The heterogeneity-aware split over `workers`: proportional to throughput, capped by memory,
/// then polished to the minimax optimum. Zero shares are dropped (with their nodes).
///
/// When the cluster's nodes together cannot hold the global batch at once, memory stops
/// capping the shares ([`accumulates`]): each worker that holds the model with one sample
/// computes its share in micro-batches it can hold, accumulating their gradients (the
/// evaluation counts them), at the same seconds per sample. One GPU trains a batch of 64 that
/// does not fit it.
fn ravnest_dp(costs: &Costs<'_>, workers: &[NodeId]) -> Option<(Vec<NodeId>, Vec<u64>)> {
    let total = u64::from(costs.training.global_batch);
    let mut caps = dp_caps(costs, workers);
    if accumulates(costs) {
        for c in caps.iter_mut().filter(|c| **c > 0) {
            *c = total;
        }
    }
    let flops: Vec<f64> = workers
        .iter()
        .map(|&w| costs.cluster.node(w).flops)
        .collect();
    let mut b = batch::proportional_split(total, &flops, &caps)?;
    let (t, fixed) = costs.step_costs(workers);
    batch::polish_minimax(&mut b, &t, &fixed, &caps);
    let (w, b): (Vec<NodeId>, Vec<u64>) = workers
        .iter()
        .copied()
        .zip(b)
        .filter(|(_, b)| *b > 0)
        .unzip();
    if w.is_empty() { None } else { Some((w, b)) }
}

// ---------------------------------------------------------------------------------------------
// Pipeline arrangements.

/// Stage-group aggregates for the layer DP: the slowest member's throughput, the smallest
/// memory, and the worst link to the next stage's member of the same replica.
fn stage_cost_fn<'c>(
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

fn pipe_candidates(
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
fn pipe_candidate(costs: &Costs<'_>, grid: Vec<Vec<NodeId>>, bounds: Bounds) -> Candidate {
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
/// DP split and the two equal splits), keeping the fastest in `best`; skipped when even
/// perfect balance over its nodes cannot beat `best` (an exact bound).
pub(super) fn search_grid(
    costs: &Costs<'_>,
    grid: Vec<Vec<NodeId>>,
    all_splits: bool,
    best: &mut Option<Plan>,
) {
    if let Some(b) = best.as_ref()
        && super::eval::perfect_balance_s(costs, &grid) >= b.step.step_s
    {
        return;
    }
    let mut cands = Vec::new();
    pipe_candidates(costs, grid, all_splits, &mut cands);
    search_into(costs, &cands, best);
}

/// Orders of nodes to deal into pipeline grids.
fn node_orders(cluster: &ClusterSpec) -> Vec<Vec<NodeId>> {
    let ids: Vec<NodeId> = cluster.ids().collect();
    let mut by_mem = ids.clone();
    by_mem.sort_by(|&a, &b| {
        let (na, nb) = (cluster.node(a), cluster.node(b));
        nb.memory_bytes
            .cmp(&na.memory_bytes)
            .then(nb.flops.total_cmp(&na.flops))
            .then(a.cmp(&b))
    });
    let mut by_speed = ids.clone();
    by_speed.sort_by(|&a, &b| {
        let (na, nb) = (cluster.node(a), cluster.node(b));
        nb.flops
            .total_cmp(&na.flops)
            .then(nb.memory_bytes.cmp(&na.memory_bytes))
            .then(a.cmp(&b))
    });
    vec![by_mem, by_speed]
}

/// ravnest's candidate layouts, the fastest kept: data parallel over tiers of the nodes that
/// hold the model, then (when allowed) pipelines of every stage count.
pub(super) fn ravnest_search(costs: &Costs<'_>, opts: PlanOptions) -> Option<Plan> {
    let cluster = costs.cluster;
    let mut best: Option<Plan> = None;
    data_parallel_tiers(costs, &mut best);
    if !opts.allow_pipeline {
        return best;
    }
    // Pipelines: S stages, R replicas. Grids are dealt from nodes sorted by memory (stage 0
    // holds the most in-flight activations) or by speed, the rank-order grid the baselines use,
    // and need-matched grids: stages ranked by their memory need under the baseline splits, the
    // largest-memory nodes given to the neediest stages. R runs
    // from N/S down by halving (dropping the smallest / slowest nodes of each order); when N/S
    // does not fit, a binary search finds the largest R that does. A candidate that cannot beat
    // the best so far even with perfect balance is not evaluated.
    let n = cluster.nodes.len();
    let orders = node_orders(cluster);
    let rank: Vec<NodeId> = cluster.ids().collect();
    let params: Vec<u64> = costs.model.layers.iter().map(|x| x.params).collect();
    if exact_pipe_applies(costs) {
        exact_single_pipeline(costs, &mut best);
    }
    for s in 2..=n.min(costs.layers()) {
        let dealer = Dealer {
            s,
            orders: &orders,
            rank: &rank,
            need_orders: need_orders(costs, &params, s),
        };
        pipelines_of(costs, &dealer, n / s, &mut best);
        if n <= SMALL_CLUSTER && !exact_pipe_applies(costs) {
            ordered_pipelines(costs, &orders, s, &mut best);
        }
        if s == 2 && n <= COLUMNS_MAX_NODES {
            two_stage_columns(costs, &mut best);
        }
    }
    best
}

/// Up to this many nodes that hold the model, every subset of them is tried as the
/// data-parallel workers.
const DP_SUBSETS_MAX_NODES: usize = 10;

/// Up to this many nodes, ravnest tries every replica count and every stage order of its
/// single-replica pipelines (the search stays in milliseconds).
const SMALL_CLUSTER: usize = 16;
/// The longest single pipeline whose stage orders are all tried (6! = 720 orders).
const MAX_ORDERED_STAGES: usize = 6;
/// When C(n, s) · s! is at most this, every ordered choice of `s` of the `n` nodes is tried.
const MAX_ORDERED_GRIDS: usize = 2000;

/// Single-replica pipelines of `s` stages over the `s` fastest nodes and over the `s` with the
/// most memory, in every stage order: the order decides which links carry the activations and
/// which node holds the first stage's in-flight micro-batches. Nodes past the `s` chosen are
/// left out, so a slow CPU does not become a stage of a GPU pipeline.
fn ordered_pipelines(costs: &Costs<'_>, orders: &[Vec<NodeId>], s: usize, best: &mut Option<Plan>) {
    if s > MAX_ORDERED_STAGES {
        return;
    }
    // Each order's first `s`, and the same with its last member swapped for each node left
    // out (a node as fast but on a better link, or with the memory a stage needs).
    let mut pools: Vec<Vec<NodeId>> = Vec::new();
    let n = orders[0].len();
    let factorial: usize = (1..=s).product();
    if layers::count_splits(n + 1, s + 1) as usize * factorial <= MAX_ORDERED_GRIDS {
        // Few enough: every set of `s` nodes (C(n, s) of them), in every order.
        let mut ids: Vec<NodeId> = orders[0].clone();
        ids.sort();
        subsets(&ids, s, 0, &mut Vec::new(), &mut pools);
    }
    for order in orders {
        for swap in s - 1..order.len() {
            let mut pool = order[..s - 1].to_vec();
            pool.push(order[swap]);
            pool.sort();
            if !pools.contains(&pool) {
                pools.push(pool);
            }
        }
    }
    for pool in pools {
        let mut perm = pool.clone();
        let mut each = |row: &[NodeId]| search_grid(costs, vec![row.to_vec()], false, best);
        permutations(&mut perm, 0, &mut each);
    }
}

// ---------------------------------------------------------------------------------------------
// Exact single pipelines.

/// Up to this many nodes, the single-replica pipeline is searched exactly (every subset of
/// nodes, every stage order, every layer split).
const EXACT_PIPE_MAX_NODES: usize = 8;
/// The exact search's work limit: subsets × first nodes × layers × (nodes × layers) steps
/// (about 12 million at 8 nodes and 26 layers: tens of milliseconds).
const EXACT_PIPE_MAX_WORK: usize = 64_000_000;

/// Whether ravnest's search finds a plan whenever any plan fits: it tries every data-parallel
/// subset, and (when pipelines are allowed) the exact single pipeline. Any pipeline that fits
/// has a replica that fits alone (a stage's memory does not depend on the replica count), so
/// then "fits nowhere" needs no exhaustive search to be true.
pub(super) fn covers_every_fit(costs: &Costs<'_>, opts: PlanOptions) -> bool {
    costs.cluster.nodes.len() <= DP_SUBSETS_MAX_NODES
        && (!opts.allow_pipeline || exact_pipe_applies(costs))
}

/// Whether [`exact_single_pipeline`] searches `costs`' cluster and model.
fn exact_pipe_applies(costs: &Costs<'_>) -> bool {
    let n = costs.cluster.nodes.len();
    let l = costs.layers();
    n <= EXACT_PIPE_MAX_NODES && (1usize << n) * n * n * l * l <= EXACT_PIPE_MAX_WORK
}

/// The fastest single-replica pipeline of 2 or more stages, over every subset of the nodes in
/// every order with every layer split, kept in `best` when faster.
///
/// A single replica's step is (micro-batches + S - 1) × its slowest stage, where a stage's
/// time is its compute plus the round trip of its boundary activations to the next stage, and
/// a stage k of S holds S - k micro-batches in flight. Built from the last stage backwards,
/// the in-flight count is the position from the end, so one dynamic program covers every S:
/// f(set, v, a) = the least slowest-stage time of a pipeline suffix over the nodes in `set`
/// whose first stage is node `v` from layer `a` to the end of its stage. Prepending node `w`
/// with layers a'..a costs compute(w, a'..a) + 2 · transfer(w → v, boundary a). A suffix that
/// starts at layer 0 is a whole pipeline of |set| stages. Exact under the cost model (the
/// evaluation of the winner computes the same times), so it is the oracle's answer for one
/// replica.
pub(super) fn exact_single_pipeline(costs: &Costs<'_>, best: &mut Option<Plan>) {
    let n = costs.cluster.nodes.len();
    let l = costs.layers();
    if n < 2 || l < 2 {
        return;
    }
    let id = |i: usize| NodeId(i as u32);
    let m = u64::from(costs.training.micro_batch);
    let k_mb = u64::from(costs.training.global_batch).div_ceil(m) as f64;
    // No stage slower than this can beat `best` (the step is at least k_mb × slowest stage).
    let limit = best
        .as_ref()
        .map_or(f64::INFINITY, |b| b.step.step_s / k_mb);
    let links: Vec<Vec<crate::cluster::Link>> = (0..n)
        .map(|a| (0..n).map(|b| costs.link(id(a), id(b))).collect())
        .collect();
    let boundary: Vec<f64> = (0..=l)
        .map(|b| {
            if b == 0 || b == l {
                0.0
            } else {
                (costs.boundary_bytes_per_sample(b) * m) as f64
            }
        })
        .collect();
    let at = |mask: usize, v: usize, a: usize| (mask * n + v) * (l + 1) + a;
    let mut f = vec![f64::INFINITY; (1 << n) * n * (l + 1)];
    // The next stage's (node, first layer) of each suffix, to rebuild the winner.
    let mut next = vec![(usize::MAX, 0usize); f.len()];
    // Last stages: node v holds layers a..l with one micro-batch in flight.
    for v in 0..n {
        let mem = costs.cluster.node(id(v)).memory_bytes;
        for a in (1..l).rev() {
            let range = LayerRange::from(a..l);
            if costs.memory_bytes(range, m) > mem {
                break;
            }
            let t = costs.compute_s(id(v), range, m as f64);
            if t >= limit {
                break;
            }
            f[at(1 << v, v, a)] = t;
        }
    }
    for mask in 1usize..(1 << n) {
        let depth = mask.count_ones() as u64 + 1; // the prepended stage's position from the end
        for v in (0..n).filter(|v| mask & (1 << v) != 0) {
            for a in 1..l {
                let fv = f[at(mask, v, a)];
                if !fv.is_finite() {
                    continue;
                }
                for w in (0..n).filter(|w| mask & (1 << w) == 0) {
                    let mem = costs.cluster.node(id(w)).memory_bytes;
                    let p2p = 2.0 * links[w][v].transfer_s(boundary[a]);
                    if p2p >= limit {
                        continue;
                    }
                    let to = mask | (1 << w);
                    for a0 in (0..a).rev() {
                        let range = LayerRange::from(a0..a);
                        if costs.memory_bytes(range, depth * m) > mem {
                            break;
                        }
                        let t = costs.compute_s(id(w), range, m as f64) + p2p;
                        if t >= limit {
                            break;
                        }
                        let i = at(to, w, a0);
                        let val = fv.max(t);
                        if val < f[i] {
                            f[i] = val;
                            next[i] = (v, a);
                        }
                    }
                }
            }
        }
    }
    // The fastest whole pipeline (a suffix from layer 0 over 2 or more nodes).
    let mut win: Option<(f64, usize, usize)> = None;
    for mask in (1usize..(1 << n)).filter(|m| m.count_ones() >= 2) {
        for v in (0..n).filter(|v| mask & (1 << v) != 0) {
            let fv = f[at(mask, v, 0)];
            let step = (k_mb + f64::from(mask.count_ones()) - 1.0) * fv;
            if fv.is_finite() && win.is_none_or(|(s, _, _)| step < s) {
                win = Some((step, mask, v));
            }
        }
    }
    let Some((_, mut mask, mut v)) = win else {
        return;
    };
    let (mut row, mut bounds, mut a) = (Vec::new(), vec![0], 0);
    loop {
        row.push(id(v));
        let (nv, na) = next[at(mask, v, a)];
        if nv == usize::MAX {
            bounds.push(l);
            break;
        }
        bounds.push(na);
        mask &= !(1 << v);
        (v, a) = (nv, na);
    }
    let c = pipe_candidate(costs, vec![row], bounds);
    search_into(costs, &[(c, SyncFreedom::Choose)], best);
}

/// Up to this many nodes, every choice of two-stage pipeline replicas' columns is tried.
const COLUMNS_MAX_NODES: usize = 8;

/// Two-stage pipeline replicas over every choice of which nodes hold the first stage and which
/// the second (R of each, R = 2..n/2), each column sorted by speed and paired fastest with
/// fastest, and fastest with slowest: the replicas can differ, and the best split often puts slow nodes on a small first
/// stage and fast ones on the rest.
fn two_stage_columns(costs: &Costs<'_>, best: &mut Option<Plan>) {
    let mut ids: Vec<NodeId> = costs.cluster.ids().collect();
    ids.sort();
    let speed = |a: &NodeId, b: &NodeId| {
        let (na, nb) = (costs.cluster.node(*a), costs.cluster.node(*b));
        nb.flops.total_cmp(&na.flops).then(a.cmp(b))
    };
    // Every boundary when there are few (the column-wise slowest member the layer DP assumes
    // is not what replicas of different speeds see).
    let every_split = costs.layers() <= 33;
    for r in 2..=ids.len() / 2 {
        let mut firsts = Vec::new();
        subsets(&ids, r, 0, &mut Vec::new(), &mut firsts);
        for first in firsts {
            let rest: Vec<NodeId> = ids.iter().copied().filter(|i| !first.contains(i)).collect();
            let mut seconds = Vec::new();
            subsets(&rest, r, 0, &mut Vec::new(), &mut seconds);
            for second in seconds {
                let (mut a, mut b) = (first.clone(), second);
                a.sort_by(speed);
                b.sort_by(speed);
                if let Some(p) = best.as_ref()
                    && super::eval::perfect_balance_s(costs, &[a.clone(), b.clone()])
                        >= p.step.step_s
                {
                    continue;
                }
                // Every pairing of three or fewer replicas; of more, fastest with fastest and
                // fastest with slowest.
                let mut pairings: Vec<Vec<NodeId>> = Vec::new();
                if r <= 3 {
                    let mut p = b.clone();
                    permutations(&mut p, 0, &mut |x| pairings.push(x.to_vec()));
                } else {
                    pairings.push(b.clone());
                    pairings.push(b.iter().rev().copied().collect());
                }
                for b in pairings {
                    let grid: Vec<Vec<NodeId>> =
                        a.iter().zip(b).map(|(&x, y)| vec![x, y]).collect();
                    search_grid(costs, grid, every_split, best);
                }
            }
        }
    }
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

/// The fewest data-parallel workers a plan keeps when `holders` nodes can hold the whole model:
/// two when there are two, so that a lost worker never takes the only copy of the model with
/// it (what recovery costs: with one worker, its loss loses every step since the last
/// checkpoint, while an idle node holds nothing). The oracle keeps the same rule.
fn min_workers(holders: usize) -> usize {
    holders.min(2)
}

/// Data parallel over the nodes that can hold the model, and over subsets that leave out the
/// slowest links (one candidate per access-bandwidth tier); the fastest is kept in `best`.
fn data_parallel_tiers(costs: &Costs<'_>, best: &mut Option<Plan>) {
    let cluster = costs.cluster;
    let all = costs.all();
    let fit: Vec<NodeId> = cluster
        .ids()
        .filter(|&i| costs.memory_bytes(all, 1) <= cluster.node(i).memory_bytes)
        .collect();
    if fit.is_empty() {
        return;
    }
    // Tiers of access bandwidth (leave out the slowest links) and of throughput (leave out
    // the slowest devices: a share too small to pay for the ring's extra hops).
    type Key = fn(&crate::cluster::NodeSpec) -> f64;
    let by: [(Key, &str); 2] = [
        (|n| n.link.bandwidth_gbps, "links below {} Gbit/s"),
        (|n| n.flops / 1e12, "devices below {} TFLOP/s"),
    ];
    // On a small cluster, every subset of the nodes that hold the model (2^n minimax splits,
    // microseconds each): a fast node alone can beat a ring whose all-reduce costs more than
    // the others' work, and a fast device on a slow link can cost more than it brings.
    if fit.len() <= DP_SUBSETS_MAX_NODES {
        for mask in 1u32..(1 << fit.len()) - 1 {
            let workers: Vec<NodeId> = fit
                .iter()
                .enumerate()
                .filter(|(i, _)| mask & (1 << i) != 0)
                .map(|(_, &id)| id)
                .collect();
            if workers.len() < min_workers(fit.len()) {
                continue;
            }
            let Some((w, b)) = ravnest_dp(costs, &workers) else {
                continue;
            };
            let names: Vec<&str> = fit
                .iter()
                .filter(|i| !workers.contains(i))
                .map(|&i| cluster.node(i).name.as_str())
                .collect();
            let note = Some(format!(
                "left out {}: their share does not pay for what they add to the all-reduce",
                names.join(", ")
            ));
            let c = Candidate::Data {
                workers: w,
                batch: b,
                note,
            };
            let beat = best.as_ref().map_or(f64::INFINITY, |b| b.step.step_s);
            if let Ok(p) = evaluate(costs, &c, SyncFreedom::Choose, beat) {
                keep_best(best, p);
            }
        }
    }
    for (key, what) in by {
        let mut tiers: Vec<f64> = fit.iter().map(|&i| key(cluster.node(i))).collect();
        tiers.sort_by(f64::total_cmp);
        tiers.dedup();
        for (t, &tier) in tiers.iter().enumerate().take(8) {
            let workers: Vec<NodeId> = fit
                .iter()
                .copied()
                .filter(|&i| key(cluster.node(i)) >= tier)
                .collect();
            if workers.len() < min_workers(fit.len()) {
                continue;
            }
            let Some((w, b)) = ravnest_dp(costs, &workers) else {
                continue;
            };
            let note = (t > 0).then(|| {
                format!(
                    "left out the {} node(s) with {}: their share does not pay for the slower ring",
                    fit.len() - workers.len(),
                    what.replace("{}", &format!("{tier:.1}"))
                )
            });
            let c = Candidate::Data {
                workers: w,
                batch: b,
                note,
            };
            let beat = best.as_ref().map_or(f64::INFINITY, |b| b.step.step_s);
            if let Ok(p) = evaluate(costs, &c, SyncFreedom::Choose, beat) {
                keep_best(best, p);
            }
        }
    }
}

/// Stage indices from the neediest (most memory) to the least, under each baseline split of
/// `s` stages (equal parameters, equal layers).
fn need_orders(costs: &Costs<'_>, params: &[u64], s: usize) -> Vec<Vec<usize>> {
    let m = u64::from(costs.training.micro_batch);
    [
        layers::equal_params(params, s),
        layers::equal_layers(costs.layers(), s),
    ]
    .iter()
    .map(|b| {
        let need: Vec<u64> = (0..s)
            .map(|k| costs.memory_bytes(LayerRange::of_stage(b, k), (s - k) as u64 * m))
            .collect();
        let mut neediest: Vec<usize> = (0..s).collect();
        neediest.sort_by_key(|&k| (std::cmp::Reverse(need[k]), k));
        neediest
    })
    .collect()
}

/// The ways ravnest deals nodes into grids of `s` stages: kinds 0 and 1 deal the node orders
/// (by memory, by speed), kind 2 is rank order, and kinds 3.. match the largest-memory nodes
/// to the neediest stages of one baseline split each.
struct Dealer<'a> {
    s: usize,
    orders: &'a [Vec<NodeId>],
    rank: &'a [NodeId],
    need_orders: Vec<Vec<usize>>,
}

impl Dealer<'_> {
    /// How many kinds of grid there are.
    fn kinds(&self) -> usize {
        3 + self.need_orders.len()
    }

    /// The grid of `kind` with `r` replicas: grid[rep][k] = node of stage k in replica rep.
    fn grid(&self, kind: usize, r: usize) -> Vec<Vec<NodeId>> {
        let (s, orders, rank) = (self.s, self.orders, self.rank);
        match kind {
            0 | 1 => (0..r)
                .map(|rep| (0..s).map(|k| orders[kind][k * r + rep]).collect())
                .collect(),
            2 => (0..r)
                .map(|rep| (0..s).map(|k| rank[rep * s + k]).collect())
                .collect(),
            _ => {
                let mut grid = vec![vec![NodeId(0); s]; r];
                for (g, &k) in self.need_orders[kind - 3].iter().enumerate() {
                    for (rep, row) in grid.iter_mut().enumerate() {
                        row[k] = orders[0][g * r + rep];
                    }
                }
                grid
            }
        }
    }
}

/// Search the pipelines of `dealer.s` stages (up to `r_max` replicas), keeping the fastest in
/// `best`.
fn pipelines_of(costs: &Costs<'_>, dealer: &Dealer<'_>, r_max: usize, best: &mut Option<Plan>) {
    let mut seen: Vec<Vec<Vec<NodeId>>> = Vec::new();
    let small = dealer.rank.len() <= SMALL_CLUSTER;
    for kind in 0..dealer.kinds() {
        for r in replica_counts(costs, dealer, kind, r_max) {
            if small && r >= 2 {
                // Pair the replicas' nodes well: the dealt grid, then swaps.
                let mut local = None;
                let grid = dealer.grid(kind, r);
                let mut cands = Vec::new();
                pipe_candidates(costs, grid.clone(), false, &mut cands);
                search_into(costs, &cands, &mut local);
                if let Some(p) = local {
                    let p = polish_grid(costs, grid, p);
                    keep_best(best, p);
                }
            }
            let grid = dealer.grid(kind, r);
            if seen.contains(&grid) {
                continue;
            }
            seen.push(grid.clone());
            search_grid(costs, grid, false, best);
        }
    }
}

/// Improve `plan` (a pipeline over `grid`) by swapping two of its nodes, or one of its nodes for
/// a node it leaves out, while that makes the step faster (a few passes).
fn polish_grid(costs: &Costs<'_>, mut grid: Vec<Vec<NodeId>>, mut plan: Plan) -> Plan {
    let s = grid[0].len();
    let slots: Vec<(usize, usize)> = (0..grid.len())
        .flat_map(|r| (0..s).map(move |k| (r, k)))
        .collect();
    // First improvement, then start over; a bounded number of tries.
    let mut budget = 4 * slots.len() * costs.cluster.nodes.len();
    'restart: while budget > 0 {
        let outside: Vec<NodeId> = costs
            .cluster
            .ids()
            .filter(|i| !grid.iter().flatten().any(|g| g == i))
            .collect();
        for (a, &(ra, ka)) in slots.iter().enumerate() {
            // Swap with a later slot of another replica or stage, or with a node left out.
            let moves = slots[a + 1..]
                .iter()
                .map(|&(rb, kb)| (Some((rb, kb)), grid[rb][kb]))
                .chain(outside.iter().map(|&o| (None, o)));
            for (slot, other) in moves {
                if budget == 0 {
                    break 'restart;
                }
                budget -= 1;
                let mut g = grid.clone();
                if let Some((rb, kb)) = slot {
                    g[rb][kb] = g[ra][ka];
                }
                g[ra][ka] = other;
                if super::eval::perfect_balance_s(costs, &g) >= plan.step.step_s {
                    continue;
                }
                let mut cands = Vec::new();
                pipe_candidates(costs, g.clone(), false, &mut cands);
                let mut local = Some(plan.clone());
                search_into(costs, &cands, &mut local);
                let p = local.expect("kept");
                if p.step.step_s < plan.step.step_s {
                    plan = p;
                    grid = g;
                    continue 'restart;
                }
            }
        }
        break;
    }
    plan
}

/// The replica counts to try for grids of `kind`: `r_max` halved down to 1, and, when `r_max`
/// does not fit, the largest count that does (binary search).
fn replica_counts(costs: &Costs<'_>, dealer: &Dealer<'_>, kind: usize, r_max: usize) -> Vec<usize> {
    let s = dealer.s;
    // Halving R keeps only the larger / faster part of each order.
    let mut rs = vec![r_max];
    if dealer.rank.len() <= SMALL_CLUSTER {
        // Every replica count: a few, and the best often leaves some nodes out.
        rs = (1..=r_max).rev().collect();
    }
    while *rs.last().unwrap() > 1 {
        rs.push(rs.last().unwrap() / 2);
    }
    // Memory feasibility only (the layer DP under each stage group's smallest memory):
    // cheap, so the binary search does not evaluate whole plans.
    let fits = |r: usize| {
        layers::optimal_split(
            costs.layers(),
            s,
            &stage_cost_fn(costs, &dealer.grid(kind, r)),
        )
        .is_some()
    };
    if r_max >= 2 && !fits(r_max) {
        let (mut lo, mut hi, mut found) = (1, r_max - 1, None);
        while lo <= hi {
            let mid = (lo + hi) / 2;
            if fits(mid) {
                found = Some(mid);
                lo = mid + 1;
            } else {
                hi = mid - 1;
            }
        }
        rs.extend(found);
    }
    rs
}

/// The largest stage count to try: none (1) when pipelines are not allowed.
fn max_stages(n: usize, costs: &Costs<'_>, opts: PlanOptions) -> usize {
    if opts.allow_pipeline {
        n.min(costs.layers())
    } else {
        1
    }
}

/// The exhaustive oracle: every data-parallel subset (minimax split), and every arrangement of
/// S x R distinct nodes with every layer split (the DP split above the budget), the fastest
/// kept. A grid is skipped when even perfect balance over its nodes cannot beat the best so
/// far (exact: that bound is below every plan over those nodes).
pub(super) fn exhaustive_search(costs: &Costs<'_>, opts: PlanOptions) -> Option<Plan> {
    let cluster = costs.cluster;
    let n = cluster.nodes.len();
    let ids: Vec<NodeId> = cluster.ids().collect();
    let mut best: Option<Plan> = None;
    // Every non-empty subset for data parallel, with the minimax split.
    for mask in 1u32..(1 << n) {
        let workers: Vec<NodeId> = ids
            .iter()
            .copied()
            .filter(|i| mask & (1 << i.0) != 0)
            .collect();
        let holders = ids
            .iter()
            .filter(|&&i| costs.memory_bytes(costs.all(), 1) <= cluster.node(i).memory_bytes)
            .count();
        if workers.len() < min_workers(holders) {
            continue;
        }
        if let Some((w, b)) = ravnest_dp(costs, &workers) {
            let c = Candidate::Data {
                workers: w,
                batch: b,
                note: None,
            };
            search_into(costs, &[(c, SyncFreedom::Choose)], &mut best);
        }
    }
    // Every arrangement of S x R distinct nodes (replicas unordered: the first replica's stage-0
    // node id increases with the replica index), every layer split up to the budget.
    for s in 2..=max_stages(n, costs, opts) {
        let all_splits = layers::count_splits(costs.layers(), s) <= EXHAUSTIVE_MAX_SPLITS;
        for r in 1..=n / s {
            let mut slots = vec![NodeId(0); s * r];
            let mut used = vec![false; n];
            arrange(0, &mut slots, &mut used, &ids, s, r, &mut |slots| {
                let grid: Vec<Vec<NodeId>> = slots.chunks(s).map(<[NodeId]>::to_vec).collect();
                search_grid(costs, grid, all_splits, &mut best);
            });
        }
    }
    best
}

fn arrange(
    pos: usize,
    slots: &mut Vec<NodeId>,
    used: &mut Vec<bool>,
    ids: &[NodeId],
    s: usize,
    r: usize,
    f: &mut dyn FnMut(&[NodeId]),
) {
    if pos == s * r {
        f(slots);
        return;
    }
    for &id in ids {
        if used[id.index()] {
            continue;
        }
        // Canonical replica order: stage-0 nodes increase with the replica index.
        if pos.is_multiple_of(s) && pos >= s && id <= slots[pos - s] {
            continue;
        }
        used[id.index()] = true;
        slots[pos] = id;
        arrange(pos + 1, slots, used, ids, s, r, f);
        used[id.index()] = false;
    }
}

// ---------------------------------------------------------------------------------------------
// Baselines.

pub(super) fn baseline(
    costs: &Costs<'_>,
    kind: PlannerKind,
    opts: PlanOptions,
) -> Result<Plan, PlanError> {
    let cluster = costs.cluster;
    let n = cluster.nodes.len();
    let ids: Vec<NodeId> = cluster.ids().collect();
    let b_total = u64::from(costs.training.global_batch);
    let dp = Candidate::Data {
        workers: ids.clone(),
        batch: batch::equal_split(b_total, n),
        note: None,
    };
    let dp_err = match evaluate(costs, &dp, SyncFreedom::Baseline, f64::INFINITY) {
        Ok(mut p) => {
            p.planner = kind;
            return Ok(p);
        }
        Err(Rejected::NotFaster) => unreachable!("no bound was given"),
        Err(Rejected::NoFit(NoFit(id, need, have))) => format!(
            "equal batches of {} need {} on `{}`, which has {}",
            b_total.div_ceil(n as u64),
            bytes_u64(need),
            cluster.node(id).name,
            bytes_u64(have)
        ),
    };
    let params: Vec<u64> = costs.model.layers.iter().map(|x| x.params).collect();
    let m = u64::from(costs.training.micro_batch);
    for s in 2..=max_stages(n, costs, opts) {
        let r = n / s;
        let grid: Vec<Vec<NodeId>> = (0..r)
            .map(|rep| (0..s).map(|k| ids[rep * s + k]).collect())
            .collect();
        let bounds = match kind {
            PlannerKind::ParamCount => layers::equal_params(&params, s),
            _ => layers::equal_layers(costs.layers(), s),
        };
        let samples = batch::equal_split(b_total, r);
        let micro: Vec<u64> = samples.iter().map(|b| b.div_ceil(m)).collect();
        let c = Candidate::Pipe {
            grid,
            bounds,
            micro,
            samples,
            note: None,
        };
        if let Ok(mut p) = evaluate(costs, &c, SyncFreedom::Baseline, f64::INFINITY) {
            p.planner = kind;
            return Ok(p);
        }
    }
    Err(PlanError::NoEqualSplit {
        planner: kind,
        detail: format!("{dp_err}; no pipeline of equal stages fits either"),
    })
}
