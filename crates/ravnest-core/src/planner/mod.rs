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

pub mod batch;
mod eval;
pub mod layers;
mod search;
pub mod sync;

use std::fmt;
use std::ops::Range;

use serde::Serialize;

use crate::cluster::{ClusterSpec, NodeId, TrainingSpec};
use crate::cost::Costs;
use crate::device::GIB;
use crate::model::ModelSpec;
use eval::search;
use layers::Bounds;
use search::{baseline, exhaustive_candidates, ravnest_search};
use sync::SyncPlan;

/// Which planner.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PlannerKind {
    /// Heterogeneity-aware.
    Ravnest,
    /// Equal split.
    Uniform,
    /// Equal parameter counts per stage.
    ParamCount,
    /// Brute-force optimum (small clusters).
    Exhaustive,
}

impl PlannerKind {
    /// All planners, in report order.
    pub const ALL: [PlannerKind; 4] = [
        PlannerKind::Ravnest,
        PlannerKind::Uniform,
        PlannerKind::ParamCount,
        PlannerKind::Exhaustive,
    ];

    /// Name used on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            PlannerKind::Ravnest => "ravnest",
            PlannerKind::Uniform => "uniform",
            PlannerKind::ParamCount => "param-count",
            PlannerKind::Exhaustive => "exhaustive",
        }
    }

    /// Parse a command-line name.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.as_str() == s)
    }
}

impl fmt::Display for PlannerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The largest cluster the exhaustive planner accepts.
pub const EXHAUSTIVE_MAX_NODES: usize = 6;
/// Above this many layer splits per arrangement, `exhaustive` uses the DP split.
pub const EXHAUSTIVE_MAX_SPLITS: u64 = 500;

/// Why no plan could be made.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlanError {
    /// No nodes.
    #[error("the cluster has no nodes")]
    EmptyCluster,
    /// No layers.
    #[error("model `{0}` has no layers")]
    EmptyModel(String),
    /// Nothing fits.
    #[error(
        "model `{model}` fits nowhere: one replica needs {need_gib:.1} GiB (weights, gradients and {optimizer} state {state_gib:.1} GiB + activations of one sample {act_gib:.2} GiB); the largest node `{largest}` has {largest_gib:.1} GiB usable, and no pipeline over the {nodes} nodes ({total_gib:.1} GiB together) fits either"
    )]
    ModelFitsNowhere {
        /// Model name.
        model: String,
        /// Optimizer name.
        optimizer: String,
        /// State of the whole model, GiB.
        state_gib: f64,
        /// Activations of one sample through the whole model, GiB.
        act_gib: f64,
        /// Total for one replica with one sample, GiB.
        need_gib: f64,
        /// Node with the most memory.
        largest: String,
        /// Its usable memory, GiB.
        largest_gib: f64,
        /// Node count.
        nodes: usize,
        /// All nodes' usable memory, GiB.
        total_gib: f64,
    },
    /// The equal split does not fit (uniform / param-count only).
    #[error("{planner}: no equal split fits this cluster's memory ({detail})")]
    NoEqualSplit {
        /// Planner.
        planner: PlannerKind,
        /// What failed.
        detail: String,
    },
    /// Exhaustive search on a large cluster.
    #[error(
        "the exhaustive planner searches every arrangement and is limited to {limit} nodes; this cluster has {nodes}"
    )]
    TooLargeForExhaustive {
        /// Nodes in the cluster.
        nodes: usize,
        /// The limit.
        limit: usize,
    },
}

/// The overall shape of a plan.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum Layout {
    /// Every worker holds the whole model.
    DataParallel {
        /// Workers.
        workers: usize,
    },
    /// Pipeline replicas of `stages` stages each, data-parallel with each other.
    Pipeline {
        /// Stages per replica.
        stages: usize,
        /// Replicas.
        replicas: usize,
        /// Layer boundaries (S+1 entries): stage k holds `bounds[k]..bounds[k+1]`.
        bounds: Bounds,
        /// Micro-batch size.
        micro_batch: u32,
    },
}

/// A node's part in a plan.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum Role {
    /// Data-parallel worker.
    Worker,
    /// Pipeline stage `stage` of replica `replica`.
    Stage {
        /// Replica index.
        replica: usize,
        /// Stage index.
        stage: usize,
    },
    /// Not used, and why.
    Idle {
        /// Reason.
        reason: String,
    },
}

/// What one node does in a step, and what the cost model predicts for it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NodePlan {
    /// Node id.
    pub id: NodeId,
    /// Node name.
    pub name: String,
    /// Device id.
    pub device: String,
    /// Role.
    pub role: Role,
    /// Samples this node processes per step (for a stage: its replica's samples).
    pub batch: u64,
    /// Micro-batches per step (pipeline), else 1 when batch > 0.
    pub micro_batches: u64,
    /// Layers held.
    pub layers: Option<Range<usize>>,
    /// Weight of this node's gradient in the sum: its samples ÷ the global batch.
    pub grad_weight: f64,
    /// Predicted peak memory, bytes.
    pub memory_bytes: u64,
    /// Usable memory, bytes.
    pub memory_limit_bytes: u64,
    /// Predicted seconds computing per step.
    pub compute_s: f64,
    /// Predicted seconds communicating per step (pipeline transfers + amortized sync).
    pub comm_s: f64,
    /// Predicted seconds waiting per step.
    pub idle_s: f64,
}

/// The prediction for one step.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepPrediction {
    /// Seconds per optimizer step.
    pub step_s: f64,
    /// Seconds of the slowest compute path (replica or worker).
    pub compute_s: f64,
    /// Seconds of synchronization charged per step.
    pub sync_s: f64,
    /// Samples per second.
    pub samples_per_s: f64,
}

/// A plan.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Plan {
    /// Planner that made it.
    pub planner: PlannerKind,
    /// Model name.
    pub model: String,
    /// Global batch.
    pub global_batch: u64,
    /// Shape.
    pub layout: Layout,
    /// One entry per cluster node, in id order.
    pub nodes: Vec<NodePlan>,
    /// Gradient synchronization.
    pub sync: SyncPlan,
    /// Prediction.
    pub step: StepPrediction,
    /// Decisions worth telling the user, in order.
    pub notes: Vec<String>,
}

/// Make a plan.
pub fn plan(
    kind: PlannerKind,
    cluster: &ClusterSpec,
    model: &ModelSpec,
    training: &TrainingSpec,
) -> Result<Plan, PlanError> {
    plan_with(kind, cluster, model, training, PlanOptions::default())
}

/// Restrictions on the layouts a planner may choose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanOptions {
    /// Whether pipeline layouts are allowed (the coordinator asks for data parallel first, and
    /// for a pipeline only when none fits and its compute backend runs stages).
    pub allow_pipeline: bool,
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions {
            allow_pipeline: true,
        }
    }
}

/// [`plan`] with restrictions.
pub fn plan_with(
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
        PlannerKind::Ravnest => ravnest_search(&costs, opts).or_else(|| {
            // The candidate layouts are heuristics; on a small cluster, make sure "fits nowhere"
            // is true before saying it.
            (cluster.nodes.len() <= EXHAUSTIVE_MAX_NODES)
                .then(|| search(&costs, &exhaustive_candidates(&costs, opts)))
                .flatten()
                .map(|mut p| {
                    p.notes.push(
                        "no standard layout fit; found by searching every arrangement".into(),
                    );
                    p
                })
        }),
        PlannerKind::Uniform | PlannerKind::ParamCount => return baseline(&costs, kind, opts),
        PlannerKind::Exhaustive => {
            if cluster.nodes.len() > EXHAUSTIVE_MAX_NODES {
                return Err(PlanError::TooLargeForExhaustive {
                    nodes: cluster.nodes.len(),
                    limit: EXHAUSTIVE_MAX_NODES,
                });
            }
            search(&costs, &exhaustive_candidates(&costs, opts))
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

fn fits_nowhere(costs: &Costs<'_>) -> PlanError {
    let all = costs.all();
    let largest = costs
        .cluster
        .ids()
        .max_by_key(|&i| (costs.cluster.node(i).memory_bytes, std::cmp::Reverse(i)))
        .unwrap();
    let state = costs.state_bytes(&all) as f64 / GIB;
    let act = costs.activation_bytes_per_sample(&all) as f64 / GIB;
    PlanError::ModelFitsNowhere {
        model: costs.model.name.clone(),
        optimizer: costs.training.optimizer.as_str().into(),
        state_gib: state,
        act_gib: act,
        need_gib: state + act,
        largest: costs.cluster.node(largest).name.clone(),
        largest_gib: costs.cluster.node(largest).memory_bytes as f64 / GIB,
        nodes: costs.cluster.nodes.len(),
        total_gib: costs
            .cluster
            .nodes
            .iter()
            .map(|n| n.memory_bytes as f64)
            .sum::<f64>()
            / GIB,
    }
}

#[cfg(test)]
mod tests;
