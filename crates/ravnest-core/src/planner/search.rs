//! ravnest's candidate layouts: data parallel over worker sets, then pipelines dealt from
//! node orders in several ways, single pipelines in every stage order on small clusters, the
//! exact single pipeline, and two-stage columns.

use crate::cluster::{ClusterSpec, NodeId};
use crate::cost::Costs;
use crate::layers::LayerRange;

use super::choice::Best;
use super::dp::data_parallel_tiers;
use super::eval::search_into;
use super::exact::{exact_pipe_applies, exact_single_pipeline};
use super::layers;
use super::pipes::{permutations, pipe_candidates, search_grid, stage_cost_fn, subsets};
use super::types::{LayoutClass, Plan, PlanOptions};

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

/// ravnest's candidate layouts of `best`'s class, the best kept in `best`: data parallel over
/// tiers of the nodes that hold the model, or (when allowed) pipelines of every stage count,
/// single (one replica) or replicated.
pub(super) fn ravnest_search(costs: &Costs<'_>, opts: PlanOptions, best: &mut Best) {
    let class = best.class();
    if class.splits_layers() && !opts.allow_pipeline {
        return;
    }
    if class == LayoutClass::Sharded {
        return super::sharded::sharded_search(costs, best);
    }
    if !class.is_pipeline() {
        data_parallel_tiers(costs, best);
        return;
    }
    // Pipelines: S stages, R replicas. Grids are dealt from nodes sorted by memory (stage 0
    // holds the most in-flight activations) or by speed, the rank-order grid the baselines use,
    // and need-matched grids: stages ranked by their memory need under the baseline splits, the
    // largest-memory nodes given to the neediest stages. R runs
    // from N/S down by halving (dropping the smallest / slowest nodes of each order); when N/S
    // does not fit, a binary search finds the largest R that does. A candidate that cannot beat
    // the best so far even with perfect balance is not evaluated.
    let cluster = costs.cluster;
    let n = cluster.nodes.len();
    let orders = node_orders(cluster);
    let rank: Vec<NodeId> = cluster.ids().collect();
    let params: Vec<u64> = costs.model.layers.iter().map(|x| x.params).collect();
    let single = class == LayoutClass::OnePipeline;
    if single && exact_pipe_applies(costs) {
        exact_single_pipeline(costs, best);
    }
    for s in 2..=n.min(costs.layers()) {
        let dealer = Dealer {
            s,
            orders: &orders,
            rank: &rank,
            need_orders: need_orders(costs, &params, s),
        };
        pipelines_of(costs, &dealer, n / s, best);
        if single && n <= SMALL_CLUSTER && !exact_pipe_applies(costs) {
            ordered_pipelines(costs, &orders, s, best);
        }
        if !single && s == 2 && n <= COLUMNS_MAX_NODES {
            two_stage_columns(costs, best);
        }
    }
}

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
fn ordered_pipelines(costs: &Costs<'_>, orders: &[Vec<NodeId>], s: usize, best: &mut Best) {
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

/// Up to this many nodes, every choice of two-stage pipeline replicas' columns is tried.
const COLUMNS_MAX_NODES: usize = 8;

/// Two-stage pipeline replicas over every choice of which nodes hold the first stage and which
/// the second (R of each, R = 2..n/2), each column sorted by speed and paired fastest with
/// fastest, and fastest with slowest: the replicas can differ, and the best split often puts slow nodes on a small first
/// stage and fast ones on the rest.
fn two_stage_columns(costs: &Costs<'_>, best: &mut Best) {
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
                if super::eval::perfect_balance_s(costs, &[a.clone(), b.clone()]) >= best.bound() {
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

    /// The grid of `kind` with `r` replicas: `grid[rep][k]` = node of stage k in replica rep.
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

/// Search the pipelines of `dealer.s` stages (up to `r_max` replicas; one, or two and more,
/// by `best`'s class), keeping the best in `best`.
fn pipelines_of(costs: &Costs<'_>, dealer: &Dealer<'_>, r_max: usize, best: &mut Best) {
    let mut seen: Vec<Vec<Vec<NodeId>>> = Vec::new();
    let small = dealer.rank.len() <= SMALL_CLUSTER;
    let replicated = best.class() == LayoutClass::Pipelines;
    for kind in 0..dealer.kinds() {
        for r in replica_counts(costs, dealer, kind, r_max) {
            if (r >= 2) != replicated {
                continue;
            }
            if small && r >= 2 {
                // Pair the replicas' nodes well: the dealt grid, then swaps.
                let mut local = Best::new(best.class());
                let grid = dealer.grid(kind, r);
                let mut cands = Vec::new();
                pipe_candidates(costs, grid.clone(), false, &mut cands);
                search_into(costs, &cands, &mut local);
                if let Some(p) = local.into_plan() {
                    best.offer(polish_grid(costs, grid, p));
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
/// a node it leaves out, while that lowers its objective within its class (a few passes).
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
                if super::eval::perfect_balance_s(costs, &g) >= plan.objective_s() {
                    continue;
                }
                let mut cands = Vec::new();
                pipe_candidates(costs, g.clone(), false, &mut cands);
                let mut local = Best::new(LayoutClass::of(&plan.layout));
                local.offer(plan.clone());
                search_into(costs, &cands, &mut local);
                let p = local.into_plan().expect("kept");
                if p.objective_s() < plan.objective_s() {
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
