//! The exact single-replica pipeline: a dynamic program over (nodes used, first node, first
//! layer) that covers every subset of the nodes, every stage order and every layer split.

use crate::cluster::NodeId;
use crate::cost::Costs;
use crate::layers::LayerRange;

use super::choice::Best;
use super::dp::DP_SUBSETS_MAX_NODES;
use super::eval::search_into;
use super::pipes::pipe_candidate;
use super::recovery;
use super::sync::SyncFreedom;
use super::types::PlanOptions;

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
pub(super) fn exact_pipe_applies(costs: &Costs<'_>) -> bool {
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
///
/// The winner is the pipeline with the least objective (its step plus the recovery term of a
/// single copy over its nodes, see `planner::recovery`), which the suffixes' step times give
/// exactly; it is kept in `best` (of class `OnePipeline`).
pub(super) fn exact_single_pipeline(costs: &Costs<'_>, best: &mut Best) {
    let n = costs.cluster.nodes.len();
    let l = costs.layers();
    if n < 2 || l < 2 {
        return;
    }
    let id = |i: usize| NodeId(i as u32);
    let m = u64::from(costs.training.micro_batch);
    let k_mb = u64::from(costs.training.global_batch).div_ceil(m) as f64;
    // No stage slower than this can beat `best` (the objective is at least the step, and the
    // step at least k_mb × the slowest stage).
    let limit = best.bound() / k_mb;
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
    let Some((mut mask, mut v)) = winner(costs, k_mb, &|mask, v| f[at(mask, v, 0)]) else {
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

/// The whole pipeline (a suffix from layer 0 over 2 or more nodes: `mask` and its first node)
/// with the least objective, from `slowest(mask, v)`, the least slowest-stage time of each.
fn winner(
    costs: &Costs<'_>,
    k_mb: f64,
    slowest: &dyn Fn(usize, usize) -> f64,
) -> Option<(usize, usize)> {
    let n = costs.cluster.nodes.len();
    let checkpoint = recovery::checkpoint_bytes(costs);
    let mut win: Option<(f64, usize, usize)> = None;
    for mask in (1usize..(1 << n)).filter(|m| m.count_ones() >= 2) {
        let nodes = mask.count_ones() as usize;
        let link = (0..n)
            .filter(|v| mask & (1 << v) != 0)
            .map(|v| costs.cluster.nodes[v].link.bandwidth_gbps)
            .fold(f64::INFINITY, f64::min);
        for v in (0..n).filter(|v| mask & (1 << v) != 0) {
            let fv = slowest(mask, v);
            if !fv.is_finite() {
                continue;
            }
            let step = (k_mb + nodes as f64 - 1.0) * fv;
            let objective =
                step + recovery::price(costs, 1, nodes, link, checkpoint, step).charged_s();
            if win.is_none_or(|(o, _, _)| objective < o) {
                win = Some((objective, mask, v));
            }
        }
    }
    win.map(|(_, mask, v)| (mask, v))
}
