//! The exhaustive oracle: every data-parallel subset and every arrangement of nodes into
//! stages and replicas, with every layer split.

use crate::cluster::NodeId;
use crate::cost::Costs;

use super::choice::Best;
use super::dp::ravnest_dp;
use super::eval::{Candidate, search_into};
use super::layers;
use super::pipes::search_grid;
use super::sync::SyncFreedom;
use super::types::{EXHAUSTIVE_MAX_SPLITS, LayoutClass, PlanOptions};

/// The largest stage count to try: none (1) when pipelines are not allowed.
pub(super) fn max_stages(n: usize, costs: &Costs<'_>, opts: PlanOptions) -> usize {
    if opts.allow_pipeline {
        n.min(costs.layers())
    } else {
        1
    }
}

/// The exhaustive oracle for `best`'s class: every data-parallel subset of one node
/// ([`LayoutClass::OneWorker`]) or of two or more (minimax split), or every arrangement of S x
/// R distinct nodes (R = 1, or R ≥ 2) with every layer split (the DP split above the budget),
/// the best kept in `best`. A grid is skipped when even perfect balance over its nodes cannot
/// beat the best so far (exact: that bound is below every plan over those nodes).
pub(super) fn exhaustive_search(costs: &Costs<'_>, opts: PlanOptions, best: &mut Best) {
    let cluster = costs.cluster;
    let n = cluster.nodes.len();
    let ids: Vec<NodeId> = cluster.ids().collect();
    let class = best.class();
    if class == LayoutClass::Sharded {
        // One candidate per worker set, as ravnest searches them: the oracle is exact over
        // data parallel and pipelines, and compares the same sharded plans.
        if opts.allow_pipeline {
            super::sharded::sharded_search(costs, best);
        }
        return;
    }
    if !class.is_pipeline() {
        // Every subset of the class's size, with the minimax split.
        for mask in 1u32..(1 << n) {
            if (mask.count_ones() >= 2) != (class == LayoutClass::DataParallel) {
                continue;
            }
            let workers: Vec<NodeId> = ids
                .iter()
                .copied()
                .filter(|i| mask & (1 << i.0) != 0)
                .collect();
            if let Some((w, b)) = ravnest_dp(costs, &workers) {
                let c = Candidate::Data {
                    workers: w,
                    batch: b,
                    note: None,
                };
                search_into(costs, &[(c, SyncFreedom::Choose)], best);
            }
        }
        return;
    }
    // Every arrangement of S x R distinct nodes (replicas unordered: the first replica's stage-0
    // node id increases with the replica index), every layer split up to the budget.
    let replicas = |s: usize| match class {
        LayoutClass::OnePipeline => 1..=1,
        _ => 2..=n / s,
    };
    for s in 2..=max_stages(n, costs, opts) {
        let all_splits = layers::count_splits(costs.layers(), s) <= EXHAUSTIVE_MAX_SPLITS;
        for r in replicas(s) {
            let mut slots = vec![NodeId(0); s * r];
            let mut used = vec![false; n];
            arrange(0, &mut slots, &mut used, &ids, s, r, &mut |slots| {
                let grid: Vec<Vec<NodeId>> = slots.chunks(s).map(<[NodeId]>::to_vec).collect();
                search_grid(costs, grid, all_splits, best);
            });
        }
    }
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
