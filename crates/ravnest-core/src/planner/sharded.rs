//! Sharded data-parallel candidates: every worker holds every weight and computes its batch
//! through the whole model; the optimizer state (and the master weights of mixed precision) is
//! cut into contiguous parts of layers, one per worker, each sized by what the worker's
//! memory holds beside the weights, its gradient and one sample's activations. The batch is
//! split by speed, as for data parallel; a worker whose share does not fit at once accumulates
//! it over micro-batches. Gradients are reduce-scattered to the parts' owners and the updated
//! weights all-gathered from them: the same bytes as a ring all-reduce.

use crate::cluster::NodeId;
use crate::cost::Costs;

use super::choice::Best;
use super::eval::{Candidate, evaluate};
use super::layers::Bounds;
use super::sync::SyncFreedom;

/// The layer bounds of `workers`' parts (in their order), each part's bytes of optimizer state
/// within what its worker holds beside the weights, the gradient and one sample's activations,
/// the parts as close to proportional to those room as whole layers allow, none empty. `None`
/// when the room of some worker cannot hold any split's part.
pub(super) fn parts(costs: &Costs<'_>, workers: &[NodeId]) -> Option<Bounds> {
    let n = workers.len();
    let layers = costs.layers();
    if n == 0 || layers < n {
        return None;
    }
    let room: Vec<f64> = workers
        .iter()
        .map(|&w| costs.shard_room(w).map(|r| r as f64))
        .collect::<Option<_>>()?;
    let total_room: f64 = room.iter().sum();
    let all = costs.all();
    let params = costs.params(all) as f64;
    let before = |l: usize| costs.params(crate::layers::LayerRange::from(0..l)) as f64;
    let per_param = costs.shard_memory_bytes(all, 0) as f64
        - costs.shard_memory_bytes(crate::layers::LayerRange::from(0..0), 0) as f64;
    let per_param = per_param / params.max(1.0);
    let mut bounds = vec![0usize];
    let mut cum = 0.0;
    for (k, r) in room.iter().enumerate().take(n - 1) {
        cum += r;
        let target = params * cum / total_room.max(f64::MIN_POSITIVE);
        let lo = bounds[k] + 1;
        let hi = layers - (n - 1 - k);
        let rest: f64 = room[k + 1..].iter().sum();
        // The boundary whose parameters before it come closest to the target, among those
        // that fit this worker's part and leave no more than the later workers hold.
        let start = before(bounds[k]);
        let b = (lo..=hi)
            .filter(|&b| (before(b) - start) * per_param <= *r)
            .filter(|&b| (params - before(b)) * per_param <= rest)
            .min_by(|&a, &b| {
                (before(a) - target)
                    .abs()
                    .total_cmp(&(before(b) - target).abs())
            })?;
        bounds.push(b);
    }
    bounds.push(layers);
    let fits = workers.iter().enumerate().all(|(k, &w)| {
        let part = crate::layers::LayerRange::from(bounds[k]..bounds[k + 1]);
        costs.shard_memory_bytes(part, 1) <= costs.cluster.node(w).memory_bytes
    });
    fits.then_some(bounds)
}

/// A sharded candidate over `workers`: their parts, and the global batch split by speed with
/// each share capped by what its worker holds at once beside its part (uncapped where the
/// file lets workers accumulate). `None` when the parts do not fit or a worker gets no sample.
fn candidate(costs: &Costs<'_>, workers: &[NodeId], note: Option<String>) -> Option<Candidate> {
    if workers.len() < 2 {
        return None;
    }
    let bounds = parts(costs, workers)?;
    let total = u64::from(costs.training.global_batch);
    let act = costs.activation_bytes_per_sample(costs.all()).max(1);
    let caps: Vec<u64> = workers
        .iter()
        .enumerate()
        .map(|(k, &w)| {
            let part = crate::layers::LayerRange::from(bounds[k]..bounds[k + 1]);
            let state = costs.shard_memory_bytes(part, 0);
            let at_once = costs.cluster.node(w).memory_bytes.saturating_sub(state) / act;
            match costs.training.accumulate {
                true if at_once > 0 => total,
                _ => at_once.min(total),
            }
        })
        .collect();
    let b = super::dp::split_by_speed(costs, workers, &caps)?;
    if b.contains(&0) {
        return None;
    }
    Some(Candidate::Shard {
        workers: workers.to_vec(),
        batch: b,
        bounds,
        note,
    })
}

/// Sharded data parallel over every node (in id order), then without the slowest devices one
/// by one while two or more are left (a share too small to pay for its part of the ring). The
/// best is kept in `best`.
pub(super) fn sharded_search(costs: &Costs<'_>, best: &mut Best) {
    let cluster = costs.cluster;
    let mut by_speed: Vec<NodeId> = cluster.ids().collect();
    by_speed.sort_by(|&a, &b| {
        cluster
            .node(b)
            .flops
            .total_cmp(&cluster.node(a).flops)
            .then(a.cmp(&b))
    });
    while by_speed.len() >= 2 {
        let mut workers = by_speed.clone();
        workers.sort_unstable();
        let left = cluster.nodes.len() - workers.len();
        let note =
            (left > 0).then(|| format!("sharded over the {} fastest devices", workers.len()));
        if let Some(c) = candidate(costs, &workers, note)
            && let Ok(p) = evaluate(costs, &c, SyncFreedom::Choose, best.bound())
        {
            best.offer(p);
        }
        by_speed.pop();
    }
}
