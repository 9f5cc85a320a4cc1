//! What a plan is: the planner kinds, the layout and roles, each node's plan, the predicted
//! step, and the errors. A leaf of the planner: its parts (`eval`, `search`) and `plan`
//! itself share these types without importing one another.

use std::fmt;

use serde::Serialize;

use super::layers::Bounds;
use super::sync::SyncPlan;
use crate::cluster::NodeId;
use crate::layers::LayerRange;
use crate::units::gib;

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
pub const EXHAUSTIVE_MAX_NODES: usize = 8;
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
        "model `{model}` fits nowhere: one replica needs {} (weights, gradients and {optimizer} state {} + activations of one sample {}); the largest node `{largest}` has {} usable, {}",
        gib(*.state_gib + *.act_gib), gib(*.state_gib), gib(*.act_gib), gib(*.largest_gib),
        match .data_parallel_only {
            false => format!("and no pipeline over the {nodes} nodes ({} together) fits either, nor sharded data parallel (each worker holds every weight and gradient with one sample's activations, {}, beside its part of the {optimizer} state)", gib(*.total_gib), gib(*.sharded_gib)),
            true => "and the file allows data parallel only (`layout = \"data-parallel\"`): a pipeline or sharded plan may fit under `layout = \"auto\"`".to_string(),
        }
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
        /// Node with the most memory.
        largest: String,
        /// Its usable memory, GiB.
        largest_gib: f64,
        /// Node count.
        nodes: u32,
        /// All nodes' usable memory, GiB.
        total_gib: f64,
        /// What every sharded data-parallel worker needs before its part of the optimizer
        /// state, GiB.
        sharded_gib: f64,
        /// The file allows data-parallel plans only (no pipeline or sharding was tried).
        data_parallel_only: bool,
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
    /// Sharded data parallel: every worker computes its batch through the whole model and
    /// holds every weight, but each holds (and updates) the optimizer state of its own part
    /// of the layers, sized by its memory; gradients are reduce-scattered to the parts'
    /// owners and the updated weights all-gathered from them.
    Sharded {
        /// Workers.
        workers: usize,
        /// Layer boundaries of the parts (workers + 1 entries): the k-th part is
        /// `bounds[k]..bounds[k+1]`, each owned by one worker (its [`NodePlan::layers`]).
        bounds: Bounds,
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
    pub layers: Option<LayerRange>,
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
    /// Seconds of the slowest compute path (replica or worker), the wait for the slowest of
    /// noisy workers (`noise_s`) included.
    pub compute_s: f64,
    /// Of `compute_s`: what the workers' measured noise adds (see
    /// [`crate::cost::wait_for_slowest`]); 0 without a measured profile.
    pub noise_s: f64,
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
    /// What losing one of its working nodes costs this plan, priced per step.
    pub recovery: Recovery,
    /// The best plan of each other kind of layout the planner compared (ravnest and
    /// exhaustive), with why it was not chosen: what the choice traded.
    pub alternatives: Vec<Alternative>,
    /// The kinds of layout searched without a plan within
    /// [`ALTERNATIVES_WITHIN`](super::choice::ALTERNATIVES_WITHIN) times the objective of
    /// another kind's best (searched no further; none may fit at all).
    pub not_within: Vec<LayoutClass>,
}

impl Plan {
    /// What the planner minimizes: the step time, plus the expected recovery per step unless
    /// `redundancy = "never"`.
    pub fn objective_s(&self) -> f64 {
        self.step.step_s + self.recovery.charged_s()
    }
}

/// How a plan recovers from losing one of its working nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum RecoveryKind {
    /// Another working node holds every layer the lost one held: the survivors are re-planned
    /// and go on from the step in flight.
    Replan,
    /// Some layer it held has no other working copy: the latest checkpoint is restored and the
    /// steps since are trained again.
    Restore,
}

/// The recovery term of a plan (see `planner::recovery`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Recovery {
    /// Re-plan from a surviving copy, or restore from the checkpoint.
    pub kind: RecoveryKind,
    /// Working copies of every layer (data-parallel workers, or pipeline replicas).
    pub copies: usize,
    /// Working nodes, each of which may be lost.
    pub nodes: usize,
    /// Seconds one loss costs: noticing it, the steps redone and, for a restore, reading the
    /// checkpoint.
    pub per_loss_s: f64,
    /// Of `per_loss_s`: the steps redone (the step in flight; for a restore, half a checkpoint
    /// interval on average).
    pub redo_s: f64,
    /// Of `per_loss_s`: reading the checkpoint back (restore only).
    pub read_s: f64,
    /// Expected seconds per step: nodes × step ÷ MTBF × `per_loss_s`.
    pub per_step_s: f64,
    /// Whether the objective charges it (`redundancy` `auto` or `always`; not `never`).
    pub charged: bool,
}

impl Recovery {
    /// What the objective charges per step.
    pub fn charged_s(&self) -> f64 {
        if self.charged { self.per_step_s } else { 0.0 }
    }
}

/// The kinds of layout the planner searches, each for its own best plan, before it chooses
/// between them by the objective ([`Plan::objective_s`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum LayoutClass {
    /// Data parallel over two or more workers: every one holds a copy of the model.
    DataParallel,
    /// Data parallel on one worker: the only copy.
    OneWorker,
    /// Two or more pipeline replicas: every stage has a copy in another replica.
    Pipelines,
    /// One pipeline replica: every stage is the only copy of its layers.
    OnePipeline,
    /// Sharded data parallel: each part of the optimizer state has one copy.
    Sharded,
}

impl LayoutClass {
    /// Every class, in the order ties are broken (data parallel first, two copies first).
    pub const ALL: [LayoutClass; 5] = [
        LayoutClass::DataParallel,
        LayoutClass::OneWorker,
        LayoutClass::Pipelines,
        LayoutClass::OnePipeline,
        LayoutClass::Sharded,
    ];

    /// The class of a plan's layout.
    pub fn of(layout: &Layout) -> LayoutClass {
        match layout {
            Layout::DataParallel { workers } if *workers >= 2 => LayoutClass::DataParallel,
            Layout::DataParallel { .. } => LayoutClass::OneWorker,
            Layout::Pipeline { replicas, .. } if *replicas >= 2 => LayoutClass::Pipelines,
            Layout::Pipeline { .. } => LayoutClass::OnePipeline,
            Layout::Sharded { .. } => LayoutClass::Sharded,
        }
    }

    /// Whether `[training] layout = choice` lets a plan be of this class.
    pub fn allowed_by(self, choice: crate::cluster::LayoutChoice) -> bool {
        use crate::cluster::LayoutChoice as C;
        match choice {
            C::Auto => true,
            C::DataParallel => matches!(self, LayoutClass::DataParallel | LayoutClass::OneWorker),
            C::Pipeline => self.is_pipeline(),
            C::Sharded => self == LayoutClass::Sharded,
        }
    }

    /// Whether its plans split the model by layer (pipelines, and sharded data parallel's
    /// parts): only for a network the runtime runs in stages.
    pub fn splits_layers(self) -> bool {
        self.is_pipeline() || self == LayoutClass::Sharded
    }

    /// Whether its plans are pipelines.
    pub fn is_pipeline(self) -> bool {
        matches!(self, LayoutClass::Pipelines | LayoutClass::OnePipeline)
    }

    /// Whether its plans keep two or more working copies of every layer.
    pub fn redundant(self) -> bool {
        matches!(self, LayoutClass::DataParallel | LayoutClass::Pipelines)
    }

    /// In a few words, for reports.
    pub fn as_str(self) -> &'static str {
        match self {
            LayoutClass::DataParallel => "data parallel",
            LayoutClass::OneWorker => "one worker",
            LayoutClass::Pipelines => "pipeline replicas",
            LayoutClass::OnePipeline => "one pipeline",
            LayoutClass::Sharded => "sharded data parallel",
        }
    }
}

/// The best plan of a kind of layout the planner did not choose, and why.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Alternative {
    /// Its kind.
    pub class: LayoutClass,
    /// Its shape.
    pub layout: Layout,
    /// Its step time.
    pub step: StepPrediction,
    /// Its recovery term.
    pub recovery: Recovery,
    /// Why it was not chosen.
    pub why: String,
}

impl Alternative {
    /// The objective of the plan it stands for ([`Plan::objective_s`]).
    pub fn objective_s(&self) -> f64 {
        self.step.step_s + self.recovery.charged_s()
    }
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

/// One line naming a split, the same for a [`Plan`] and for the split a coordinator announces,
/// so that `plan`, `sim` and `run` can be compared: every node with work, by name, with its
/// samples per step and, for a pipeline stage, its layers (`gpu-a 12`, `gpu-b 0..6 32`).
pub fn split_line<'a>(
    work: impl IntoIterator<Item = (&'a str, u64, Option<LayerRange>)>,
) -> String {
    let mut parts: Vec<(&str, u64, Option<LayerRange>)> = work.into_iter().collect();
    parts.sort_by(|a, b| {
        let start = |x: &Option<LayerRange>| x.map_or(0, |l| l.start);
        (start(&a.2), a.0).cmp(&(start(&b.2), b.0))
    });
    let kind = if parts.iter().any(|p| p.2.is_some()) {
        "pipeline"
    } else {
        "data parallel"
    };
    if parts.len() > SPLIT_NAMED {
        // Too many to name: alike ones (the same layers and batch) counted.
        let mut groups: Vec<((Option<LayerRange>, u64), usize)> = Vec::new();
        for (_, batch, layers) in &parts {
            match groups.iter_mut().find(|g| g.0 == (*layers, *batch)) {
                Some(g) => g.1 += 1,
                None => groups.push(((*layers, *batch), 1)),
            }
        }
        let items: Vec<String> = groups
            .iter()
            .map(|((layers, batch), n)| match layers {
                Some(l) => format!("{l} {batch} x{n}"),
                None => format!("{batch} x{n}"),
            })
            .collect();
        return format!("{kind}: {} nodes: {}", parts.len(), items.join(", "));
    }
    let items: Vec<String> = parts
        .iter()
        .map(|(name, batch, layers)| match layers {
            Some(l) => format!("{name} {l} {batch}"),
            None => format!("{name} {batch}"),
        })
        .collect();
    format!("{kind}: {}", items.join(", "))
}

/// Nodes a split line names one by one; more are counted by kind.
pub const SPLIT_NAMED: usize = 12;

impl Plan {
    /// This plan's [`split_line`].
    pub fn split_line(&self) -> String {
        split_line(self.nodes.iter().filter_map(|n| match n.role {
            Role::Idle { .. } => None,
            Role::Worker => Some((n.name.as_str(), n.batch, None)),
            Role::Stage { .. } => Some((n.name.as_str(), n.batch, n.layers)),
        }))
    }
}
