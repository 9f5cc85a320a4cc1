//! Planners: pure, deterministic functions from (cluster, model, training) to a [`Plan`].
//!
//! - `ravnest`: batch shares proportional to throughput and capped by memory, pipeline stages
//!   split by dynamic programming when the model does not fit a node or when that is faster,
//!   ring order by link speed, and ring / parameter server / local SGD chosen from the
//!   compute-to-communication ratio. It evaluates a small set of candidate layouts with the cost
//!   model and keeps the fastest.
//! - `uniform`: equal batches and equal layer counts, ring in rank order (DDP, DeepSpeed).
//! - `param-count`: like `uniform`, but stages hold equal parameter counts (Ravnest's Python
//!   prototype).
//! - `exhaustive`: every node subset and arrangement, every layer split (DP above a budget):
//!   the optimum under the cost model for small clusters, used as the oracle.

mod baseline;
pub mod batch;
pub mod choice;
mod dp;
mod eval;
mod exact;
pub mod layers;
mod oracle;
mod pipes;
pub mod random;
pub mod recovery;
mod search;
mod sharded;
pub mod sync;
mod types;

use crate::cluster::{ClusterSpec, TrainingSpec};
use crate::config::Scenario;
use crate::cost::Costs;
use crate::device::GIB;
use crate::model::ModelSpec;
use baseline::baseline;
use choice::{Best, Found, choose, search_classes};
use exact::covers_every_fit;
use oracle::exhaustive_search;
use search::ravnest_search;
pub use types::*;

/// Up to this many nodes, ravnest searches every arrangement before it says a model fits
/// nowhere, unless its own search already covers every plan that fits
/// ([`exact::covers_every_fit`]): only for models with so many layers that the exact
/// single-pipeline search is skipped.
const FALLBACK_MAX_NODES: usize = 8;

/// Make a plan.
pub fn plan(
    kind: PlannerKind,
    cluster: &ClusterSpec,
    model: &ModelSpec,
    training: &TrainingSpec,
) -> Result<Plan, PlanError> {
    plan_with(kind, cluster, model, training, PlanOptions::default())
}

/// The plan `ravnest plan`, `ravnest sim` and `ravnest run` make for a scenario: one policy,
/// [`policy`], with pipelines allowed when the network `run` trains runs in stages
/// ([`Scenario::runs_stages`]).
pub fn plan_scenario(kind: PlannerKind, s: &Scenario) -> Result<Plan, PlanError> {
    policy(kind, &s.cluster, &s.model, &s.training, s.runs_stages())
}

/// The one planning policy (the coordinator calls it with its backend's `runs_stages`): every
/// kind of layout the runtime can execute (data parallel; pipelines when it runs stages) is
/// searched for its best plan, and the one with the least objective is chosen: the predicted
/// step plus the priced recovery term, the expected seconds per step that losing nodes costs
/// (a lost data-parallel worker or pipeline replica is re-planned from a surviving copy; a
/// lost only copy of some layers is restored from the latest checkpoint and the steps since
/// are trained again). `[training] redundancy` decides how the second copy is weighed (see
/// [`crate::cluster::Redundancy`]); the plan lists the other kinds as its alternatives.
pub fn policy(
    kind: PlannerKind,
    cluster: &ClusterSpec,
    model: &ModelSpec,
    training: &TrainingSpec,
    runs_stages: bool,
) -> Result<Plan, PlanError> {
    let opts = PlanOptions {
        allow_pipeline: runs_stages,
    };
    plan_with(kind, cluster, model, training, opts)
}

/// [`plan`] with restrictions. When nothing fits at the file's micro-batch, or only sharded
/// data parallel does, ravnest (and the oracle, which covers the same space) tries every
/// halving of it down to 1 for a pipeline and keeps the fastest plan:
/// a pipeline stage holds its in-flight micro-batches' activations, so a smaller micro-batch
/// fits where the file's does not (the plan says so in a note, and the runtime runs the
/// plan's micro-batch). Sharded data parallel does not run micro-batches of the file's size
/// (a worker accumulates over what it holds), so only the file's is tried for it.
pub fn plan_with(
    kind: PlannerKind,
    cluster: &ClusterSpec,
    model: &ModelSpec,
    training: &TrainingSpec,
    opts: PlanOptions,
) -> Result<Plan, PlanError> {
    let first = plan_at(kind, cluster, model, training, opts);
    let sharded = |p: &Plan| matches!(p.layout, Layout::Sharded { .. });
    let only_sharded = first.as_ref().is_ok_and(sharded);
    if !matches!(kind, PlannerKind::Ravnest | PlannerKind::Exhaustive)
        || !(only_sharded || matches!(first, Err(PlanError::ModelFitsNowhere { .. })))
    {
        return first;
    }
    let what = match only_sharded {
        true => "only sharded data parallel fits",
        false => "nothing fits",
    };
    let mut smaller = training.clone();
    let mut best: Option<Plan> = None;
    while smaller.micro_batch > 1 {
        smaller.micro_batch /= 2;
        if let Ok(mut p) = plan_at(kind, cluster, model, &smaller, opts)
            && !sharded(&p)
            && best
                .as_ref()
                .or(first.as_ref().ok())
                .is_none_or(|b| p.objective_s() < b.objective_s())
        {
            p.notes.push(format!(
                "micro-batch {} instead of the file's {}: {what} at {} (the fastest of \
                 every halving that fits)",
                smaller.micro_batch, training.micro_batch, training.micro_batch
            ));
            best = Some(p);
        }
    }
    best.map_or(first, Ok)
}

/// [`plan_with`] at the file's micro-batch.
fn plan_at(
    kind: PlannerKind,
    cluster: &ClusterSpec,
    model: &ModelSpec,
    training: &TrainingSpec,
    opts: PlanOptions,
) -> Result<Plan, PlanError> {
    if cluster.nodes.is_empty() {
        return Err(PlanError::EmptyCluster);
    }
    if model.layers.is_empty() {
        return Err(PlanError::EmptyModel(model.name.clone()));
    }
    let costs = Costs::new(cluster, model, training);
    let best = match kind {
        PlannerKind::Ravnest => {
            let found = by_class(opts, training, |b| ravnest_search(&costs, opts, b));
            if found.iter().any(Found::has_plan) {
                choose(found, training.redundancy)
            } else if cluster.nodes.len() <= FALLBACK_MAX_NODES && !covers_every_fit(&costs, opts) {
                // The candidate layouts are heuristics; on a small cluster, make sure "fits
                // nowhere" is true before saying it.
                let found = by_class(opts, training, |b| exhaustive_search(&costs, opts, b));
                choose(found, training.redundancy).map(|mut p| {
                    p.notes.push(
                        "no standard layout fit; found by searching every arrangement".into(),
                    );
                    p
                })
            } else {
                None
            }
        }
        PlannerKind::Uniform | PlannerKind::ParamCount => return baseline(&costs, kind, opts),
        PlannerKind::Exhaustive => {
            if cluster.nodes.len() > EXHAUSTIVE_MAX_NODES {
                return Err(PlanError::TooLargeForExhaustive {
                    nodes: cluster.nodes.len(),
                    limit: EXHAUSTIVE_MAX_NODES,
                });
            }
            let found = by_class(opts, training, |b| exhaustive_search(&costs, opts, b));
            choose(found, training.redundancy)
        }
    };
    match best {
        Some(mut p) => {
            p.planner = kind;
            Ok(p)
        }
        None => Err(fits_nowhere(&costs)),
    }
}

/// The best plan `search` finds of each kind of layout `opts` allows
/// ([`choice::search_classes`]).
fn by_class(
    opts: PlanOptions,
    training: &TrainingSpec,
    search: impl FnMut(&mut Best),
) -> Vec<Found> {
    let classes = LayoutClass::ALL
        .into_iter()
        .filter(|c| opts.allow_pipeline || !c.splits_layers())
        .filter(|c| c.allowed_by(training.layout));
    search_classes(classes, training.redundancy, search)
}

fn fits_nowhere(costs: &Costs<'_>) -> PlanError {
    let all = costs.all();
    let largest = costs
        .cluster
        .ids()
        .max_by_key(|&i| (costs.cluster.node(i).memory_bytes, std::cmp::Reverse(i)))
        .unwrap();
    let state = costs.state_bytes(all) as f64 / GIB;
    let act = costs.activation_bytes_per_sample(all) as f64 / GIB;
    PlanError::ModelFitsNowhere {
        model: costs.model.name.clone(),
        optimizer: costs.training.optimizer.as_str().into(),
        state_gib: state,
        act_gib: act,
        largest: costs.cluster.node(largest).name.clone(),
        largest_gib: costs.cluster.node(largest).memory_bytes as f64 / GIB,
        nodes: costs.cluster.nodes.len() as u32,
        total_gib: costs
            .cluster
            .nodes
            .iter()
            .map(|n| n.memory_bytes as f64)
            .sum::<f64>()
            / GIB,
        sharded_gib: costs.shard_memory_bytes(crate::layers::LayerRange::from(0..0), 1) as f64
            / GIB,
        data_parallel_only: costs.training.layout == crate::cluster::LayoutChoice::DataParallel,
    }
}

#[cfg(test)]
mod tests;
