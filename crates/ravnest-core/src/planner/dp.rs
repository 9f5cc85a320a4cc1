//! Data-parallel candidates: the per-node sample caps, gradient accumulation, the minimax
//! split over a set of workers, and ravnest's worker sets (every subset on a small cluster,
//! tiers of link and device speed).

use crate::cluster::NodeId;
use crate::cost::Costs;

use super::batch;
use super::eval::{Candidate, evaluate, keep_best};
use super::sync::SyncFreedom;
use super::types::Plan;

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



/// Up to this many nodes that hold the model, every subset of them is tried as the
/// data-parallel workers.
pub(super) const DP_SUBSETS_MAX_NODES: usize = 10;

/// The fewest data-parallel workers a plan keeps when `holders` nodes can hold the whole model:
/// two when there are two, so that a lost worker never takes the only copy of the model with
/// it (what recovery costs: with one worker, its loss loses every step since the last
/// checkpoint, while an idle node holds nothing). The oracle keeps the same rule.
pub(super) fn min_workers(holders: usize) -> usize {
    holders.min(2)
}

/// Data parallel over the nodes that can hold the model, and over subsets that leave out the
/// slowest links (one candidate per access-bandwidth tier); the fastest is kept in `best`.
pub(super) fn data_parallel_tiers(costs: &Costs<'_>, best: &mut Option<Plan>) {
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
