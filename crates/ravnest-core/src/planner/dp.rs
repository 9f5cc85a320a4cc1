//! Data-parallel candidates: the per-node sample caps, gradient accumulation, the minimax
//! split over a set of workers, and ravnest's worker sets (every subset on a small cluster,
//! tiers of link and device speed).

use crate::cluster::NodeId;
use crate::cost::Costs;

use super::batch;
use super::choice::Best;
use super::eval::{Candidate, evaluate};
use super::sync::SyncFreedom;
use super::types::LayoutClass;

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
pub(super) fn ravnest_dp(costs: &Costs<'_>, workers: &[NodeId]) -> Option<(Vec<NodeId>, Vec<u64>)> {
    let total = u64::from(costs.training.global_batch);
    let mut caps = dp_caps(costs, workers);
    if accumulates(costs) {
        for c in caps.iter_mut().filter(|c| **c > 0) {
            *c = total;
        }
    }
    let b = split_by_speed(costs, workers, &caps)?;
    let (w, b): (Vec<NodeId>, Vec<u64>) = workers
        .iter()
        .copied()
        .zip(b)
        .filter(|(_, b)| *b > 0)
        .unzip();
    if w.is_empty() { None } else { Some((w, b)) }
}

/// The global batch over `workers`, each share within its cap: proportional to throughput,
/// then polished to the minimax optimum. `None` when the caps cannot hold it.
pub(super) fn split_by_speed(
    costs: &Costs<'_>,
    workers: &[NodeId],
    caps: &[u64],
) -> Option<Vec<u64>> {
    let total = u64::from(costs.training.global_batch);
    let flops: Vec<f64> = workers
        .iter()
        .map(|&w| costs.cluster.node(w).flops)
        .collect();
    let mut b = batch::proportional_split(total, &flops, caps)?;
    let (t, fixed) = costs.step_costs(workers);
    batch::polish_minimax(&mut b, &t, &fixed, caps);
    Some(b)
}

/// Up to this many nodes that hold the model, every subset of them is tried as the
/// data-parallel workers.
pub(super) const DP_SUBSETS_MAX_NODES: usize = 10;

/// Data parallel of `best`'s class over the nodes that can hold the model: for
/// [`LayoutClass::OneWorker`], each of them alone; for [`LayoutClass::DataParallel`] (two or
/// more workers), every subset of them on a small cluster, and tiers that leave out the slowest
/// links or devices. The best is kept in `best`.
pub(super) fn data_parallel_tiers(costs: &Costs<'_>, best: &mut Best) {
    let cluster = costs.cluster;
    let all = costs.all();
    let fit: Vec<NodeId> = cluster
        .ids()
        .filter(|&i| costs.memory_bytes(all, 1) <= cluster.node(i).memory_bytes)
        .collect();
    match best.class() {
        LayoutClass::OneWorker => return one_worker(costs, &fit, best),
        LayoutClass::DataParallel if fit.len() >= 2 => {}
        _ => return,
    }
    // On a small cluster, every subset of the nodes that hold the model (2^n minimax splits,
    // microseconds each): a fast device on a slow link can cost more than it brings.
    if fit.len() <= DP_SUBSETS_MAX_NODES {
        for mask in 1u32..(1 << fit.len()) - 1 {
            let workers: Vec<NodeId> = fit
                .iter()
                .enumerate()
                .filter(|(i, _)| mask & (1 << i) != 0)
                .map(|(_, &id)| id)
                .collect();
            if workers.len() < 2 {
                continue;
            }
            let left: Vec<&str> = fit
                .iter()
                .filter(|i| !workers.contains(i))
                .map(|&i| cluster.node(i).name.as_str())
                .collect();
            offer_workers(costs, &workers, Some(left_out_note(&left)), best);
        }
    }
    // Tiers of access bandwidth (leave out the slowest links) and of throughput (leave out
    // the slowest devices: a share too small to pay for the ring's extra hops).
    type Key = fn(&crate::cluster::NodeSpec) -> f64;
    let by: [(Key, &str); 2] = [
        (|n| n.link.bandwidth_gbps, "links below {} Gbit/s"),
        (|n| n.flops / 1e12, "devices below {} TFLOP/s"),
    ];
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
            if workers.len() < 2 {
                continue;
            }
            let note = (t > 0).then(|| {
                format!(
                    "left out the {} node(s) with {}: their share does not pay for the slower ring",
                    fit.len() - workers.len(),
                    what.replace("{}", &format!("{tier:.1}"))
                )
            });
            offer_workers(costs, &workers, note, best);
        }
    }
}

/// The minimax split over `workers`, evaluated and offered to `best`.
fn offer_workers(costs: &Costs<'_>, workers: &[NodeId], note: Option<String>, best: &mut Best) {
    let Some((w, b)) = ravnest_dp(costs, workers) else {
        return;
    };
    let c = Candidate::Data {
        workers: w,
        batch: b,
        note,
    };
    if let Ok(p) = evaluate(costs, &c, SyncFreedom::Choose, best.bound()) {
        best.offer(p);
    }
}

/// Each node of `fit` (those that hold the model) training alone, the least objective first,
/// until no other one can beat `best`. A lone worker's step is its compute (no sync, no wait
/// for a slower one), so its objective is known before it is evaluated: on a cluster of
/// thousands of identical cards one evaluation is enough.
fn one_worker(costs: &Costs<'_>, fit: &[NodeId], best: &mut Best) {
    let samples = f64::from(costs.training.global_batch);
    let checkpoint = super::recovery::checkpoint_bytes(costs);
    // Alone, a node holds the whole batch at once, or accumulates when the cluster could not.
    let accumulate = accumulates(costs);
    let caps = dp_caps(costs, fit);
    let mut order: Vec<(f64, NodeId)> = fit
        .iter()
        .zip(caps)
        .filter(|&(_, cap)| accumulate || cap >= u64::from(costs.training.global_batch))
        .map(|(&w, _)| {
            let step = costs.compute_s(w, costs.all(), samples);
            let link = costs.cluster.node(w).link.bandwidth_gbps;
            let r = super::recovery::price(costs, 1, 1, link, checkpoint, step);
            (step + r.charged_s(), w)
        })
        .collect();
    order.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    for (objective, w) in order {
        if objective >= best.bound() {
            break;
        }
        let left: Vec<&str> = fit
            .iter()
            .filter(|&&i| i != w)
            .map(|&i| costs.cluster.node(i).name.as_str())
            .collect();
        let note = (!left.is_empty()).then(|| left_out_note(&left));
        offer_workers(costs, &[w], note, best);
    }
}

/// Why nodes that hold the model are left out of a data-parallel plan (`left`: their names).
fn left_out_note(left: &[&str]) -> String {
    let who = match left.len() {
        n if n <= DP_SUBSETS_MAX_NODES => left.join(", "),
        n => format!("{} and {} more", left[..3].join(", "), n - 3),
    };
    format!("left out {who}: their share does not pay for what they add to the all-reduce")
}
