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
pub mod layers;
pub mod sync;

use std::fmt;
use std::ops::Range;

use serde::Serialize;

use crate::cluster::{ClusterSpec, NodeId, TrainingSpec};
use crate::cost::Costs;
use crate::device::GIB;
use crate::model::ModelSpec;
use layers::Bounds;
use sync::{SyncFreedom, SyncPlan, choose_sync};

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
    if cluster.nodes.is_empty() {
        return Err(PlanError::EmptyCluster);
    }
    if model.layers.is_empty() {
        return Err(PlanError::EmptyModel(model.name.clone()));
    }
    let costs = Costs::new(cluster, model, training);
    let best = match kind {
        PlannerKind::Ravnest => search(&costs, &ravnest_candidates(&costs)).or_else(|| {
            // The candidate layouts are heuristics; on a small cluster, make sure "fits nowhere"
            // is true before saying it.
            (cluster.nodes.len() <= EXHAUSTIVE_MAX_NODES)
                .then(|| search(&costs, &exhaustive_candidates(&costs)))
                .flatten()
                .map(|mut p| {
                    p.notes.push(
                        "no standard layout fit; found by searching every arrangement".into(),
                    );
                    p
                })
        }),
        PlannerKind::Uniform | PlannerKind::ParamCount => return baseline(&costs, kind),
        PlannerKind::Exhaustive => {
            if cluster.nodes.len() > EXHAUSTIVE_MAX_NODES {
                return Err(PlanError::TooLargeForExhaustive {
                    nodes: cluster.nodes.len(),
                    limit: EXHAUSTIVE_MAX_NODES,
                });
            }
            search(&costs, &exhaustive_candidates(&costs))
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

// ---------------------------------------------------------------------------------------------
// Candidate layouts and their evaluation.

/// A concrete layout to evaluate.
#[derive(Debug, Clone)]
enum Candidate {
    /// Workers with their batch shares (same order).
    Data {
        workers: Vec<NodeId>,
        batch: Vec<u64>,
        note: Option<String>,
    },
    /// grid[r][k] = node of stage k in replica r; micro-batches and samples per replica.
    Pipe {
        grid: Vec<Vec<NodeId>>,
        bounds: Bounds,
        micro: Vec<u64>,
        samples: Vec<u64>,
        note: Option<String>,
    },
}

fn search(costs: &Costs<'_>, candidates: &[(Candidate, SyncFreedom)]) -> Option<Plan> {
    let mut best: Option<Plan> = None;
    for (c, freedom) in candidates {
        if let Ok(p) = evaluate(costs, c, *freedom)
            && best.as_ref().is_none_or(|b| p.step.step_s < b.step.step_s)
        {
            best = Some(p);
        }
    }
    best
}

/// Memory does not fit: (node, need, have).
#[derive(Debug)]
struct NoFit(NodeId, u64, u64);

fn idle_reason(costs: &Costs<'_>, layout: &Layout, id: NodeId) -> String {
    let node = costs.cluster.node(id);
    let all = costs.all();
    match layout {
        Layout::DataParallel { .. } => {
            let need = costs.memory_bytes(&all, 1);
            if need > node.memory_bytes {
                format!(
                    "the whole model needs {:.1} GiB with one sample, {:.1} GiB usable",
                    need as f64 / GIB,
                    node.memory_bytes as f64 / GIB
                )
            } else {
                "left out: its share or its link would slow the step".into()
            }
        }
        Layout::Pipeline { stages, .. } => {
            format!("no complete replica of {stages} stages left for it")
        }
    }
}

fn evaluate(costs: &Costs<'_>, c: &Candidate, freedom: SyncFreedom) -> Result<Plan, NoFit> {
    let cluster = costs.cluster;
    let b_total = u64::from(costs.training.global_batch);
    let all = costs.all();
    let mut nodes: Vec<Option<NodePlan>> = vec![None; cluster.nodes.len()];
    let (layout, sync, compute_max, notes);
    match c {
        Candidate::Data {
            workers,
            batch,
            note,
        } => {
            let state = costs.state_bytes(&all);
            let act = costs.activation_bytes_per_sample(&all);
            let mut cmax: f64 = 0.0;
            for (&w, &b) in workers.iter().zip(batch) {
                let node = cluster.node(w);
                let mem = state + act * b;
                if mem > node.memory_bytes {
                    return Err(NoFit(w, mem, node.memory_bytes));
                }
                let compute = costs.compute_s(w, &all, b as f64);
                cmax = cmax.max(compute);
                nodes[w.index()] = Some(NodePlan {
                    id: w,
                    name: node.name.clone(),
                    device: node.device.clone(),
                    role: Role::Worker,
                    batch: b,
                    micro_batches: u64::from(b > 0),
                    layers: Some(all.clone()),
                    grad_weight: b as f64 / b_total as f64,
                    memory_bytes: mem,
                    memory_limit_bytes: node.memory_bytes,
                    compute_s: compute,
                    comm_s: 0.0,
                    idle_s: 0.0,
                });
            }
            sync = choose_sync(
                costs,
                &[(workers.clone(), costs.grad_bytes(&all))],
                cmax,
                freedom,
            );
            layout = Layout::DataParallel {
                workers: workers.len(),
            };
            compute_max = cmax;
            notes = note.iter().cloned().collect::<Vec<_>>();
        }
        Candidate::Pipe {
            grid,
            bounds,
            micro,
            samples,
            note,
        } => {
            let stages = bounds.len() - 1;
            let m = u64::from(costs.training.micro_batch);
            let mut cmax: f64 = 0.0;
            let mut per_node_p2p = vec![0.0; cluster.nodes.len()];
            for (r, row) in grid.iter().enumerate() {
                let k_mb = micro[r];
                let mut bottleneck: f64 = 0.0;
                let mut stage_t = Vec::with_capacity(stages);
                for k in 0..stages {
                    let id = row[k];
                    let node = cluster.node(id);
                    let range = bounds[k]..bounds[k + 1];
                    let in_flight = (stages - k) as u64 * m;
                    let mem = costs.memory_bytes(&range, in_flight);
                    if mem > node.memory_bytes {
                        return Err(NoFit(id, mem, node.memory_bytes));
                    }
                    let compute = costs.compute_s(id, &range, m as f64);
                    let p2p = if k + 1 < stages {
                        let bytes = (costs.boundary_bytes_per_sample(bounds[k + 1]) * m) as f64;
                        2.0 * costs.link(id, row[k + 1]).transfer_s(bytes)
                    } else {
                        0.0
                    };
                    stage_t.push((compute, p2p));
                    bottleneck = bottleneck.max(compute + p2p);
                    nodes[id.index()] = Some(NodePlan {
                        id,
                        name: node.name.clone(),
                        device: node.device.clone(),
                        role: Role::Stage {
                            replica: r,
                            stage: k,
                        },
                        batch: samples[r],
                        micro_batches: k_mb,
                        layers: Some(range),
                        grad_weight: samples[r] as f64 / b_total as f64,
                        memory_bytes: mem,
                        memory_limit_bytes: node.memory_bytes,
                        compute_s: compute * k_mb as f64,
                        comm_s: 0.0,
                        idle_s: 0.0,
                    });
                    per_node_p2p[id.index()] = p2p * k_mb as f64;
                }
                let replica_s = if k_mb > 0 {
                    (k_mb + stages as u64 - 1) as f64 * bottleneck
                } else {
                    0.0
                };
                cmax = cmax.max(replica_s);
            }
            for (i, n) in nodes.iter_mut().enumerate() {
                if let Some(n) = n {
                    n.comm_s = per_node_p2p[i];
                }
            }
            let groups: Vec<(Vec<NodeId>, u64)> = (0..stages)
                .map(|k| {
                    (
                        grid.iter().map(|row| row[k]).collect(),
                        costs.grad_bytes(&(bounds[k]..bounds[k + 1])),
                    )
                })
                .collect();
            sync = choose_sync(costs, &groups, cmax, freedom);
            layout = Layout::Pipeline {
                stages,
                replicas: grid.len(),
                bounds: bounds.clone(),
                micro_batch: costs.training.micro_batch,
            };
            compute_max = cmax;
            notes = note.iter().cloned().collect::<Vec<_>>();
        }
    }
    let step_s = compute_max + sync.per_step_s;
    let nodes: Vec<NodePlan> = cluster
        .ids()
        .map(|id| match nodes[id.index()].take() {
            Some(mut n) => {
                n.comm_s += sync.per_step_s;
                n.idle_s = (step_s - n.compute_s - n.comm_s).max(0.0);
                n
            }
            None => {
                let node = cluster.node(id);
                NodePlan {
                    id,
                    name: node.name.clone(),
                    device: node.device.clone(),
                    role: Role::Idle {
                        reason: idle_reason(costs, &layout, id),
                    },
                    batch: 0,
                    micro_batches: 0,
                    layers: None,
                    grad_weight: 0.0,
                    memory_bytes: 0,
                    memory_limit_bytes: node.memory_bytes,
                    compute_s: 0.0,
                    comm_s: 0.0,
                    idle_s: step_s,
                }
            }
        })
        .collect();
    Ok(Plan {
        planner: PlannerKind::Ravnest,
        model: costs.model.name.clone(),
        global_batch: b_total,
        layout,
        nodes,
        step: StepPrediction {
            step_s,
            compute_s: compute_max,
            sync_s: sync.per_step_s,
            samples_per_s: if step_s > 0.0 {
                b_total as f64 / step_s
            } else {
                0.0
            },
        },
        sync,
        notes,
    })
}

// ---------------------------------------------------------------------------------------------
// Data-parallel splits.

/// Per-node sample caps for holding the whole model: (usable - state) ÷ activations per sample.
fn dp_caps(costs: &Costs<'_>, workers: &[NodeId]) -> Vec<u64> {
    let all = costs.all();
    let state = costs.state_bytes(&all);
    let act = costs.activation_bytes_per_sample(&all).max(1);
    let b = u64::from(costs.training.global_batch);
    workers
        .iter()
        .map(|&w| costs.cluster.node(w).memory_bytes.saturating_sub(state) / act)
        .map(|c| c.min(b))
        .collect()
}

/// The heterogeneity-aware split over `workers`: proportional to throughput, capped by memory,
/// then polished to the minimax optimum. Zero shares are dropped (with their nodes).
fn ravnest_dp(costs: &Costs<'_>, workers: &[NodeId]) -> Option<(Vec<NodeId>, Vec<u64>)> {
    let all = costs.all();
    let caps = dp_caps(costs, workers);
    let flops: Vec<f64> = workers
        .iter()
        .map(|&w| costs.cluster.node(w).flops)
        .collect();
    let mut b = batch::proportional_split(u64::from(costs.training.global_batch), &flops, &caps)?;
    let t: Vec<f64> = workers
        .iter()
        .map(|&w| costs.compute_s(w, &all, 1.0))
        .collect();
    batch::polish_minimax(&mut b, &t, &caps);
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
        let range = a..b;
        if costs.memory_bytes(&range, (stages - k) as u64 * m) > mem {
            return None;
        }
        let compute = m as f64 * costs.train_flops(&range) / flops;
        let p2p = if k + 1 < stages {
            let bytes = (costs.boundary_bytes_per_sample(b) * m) as f64;
            2.0 * (lat / 1e3 + bytes * 8.0 / (bw * 1e9))
        } else {
            0.0
        };
        Some(compute + p2p)
    }
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
                    let range = bounds[k]..bounds[k + 1];
                    let c = costs.compute_s(row[k], &range, m as f64);
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
        for b in [
            layers::equal_layers(l, stages),
            layers::equal_params(&params, stages),
        ] {
            if !bounds_set.contains(&b) {
                bounds_set.push(b);
            }
        }
    }
    for bounds in bounds_set {
        let micro = replica_micro(costs, &grid, &bounds);
        let samples = samples_from_micro(&micro, costs);
        out.push((
            Candidate::Pipe {
                grid: grid.clone(),
                bounds,
                micro,
                samples,
                note: None,
            },
            SyncFreedom::Choose,
        ));
    }
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

fn ravnest_candidates(costs: &Costs<'_>) -> Vec<(Candidate, SyncFreedom)> {
    let cluster = costs.cluster;
    let mut out = Vec::new();
    let all = costs.all();
    // Data parallel over the nodes that can hold the model, and over subsets that leave out the
    // slowest links (one candidate per access-bandwidth tier).
    let fit: Vec<NodeId> = cluster
        .ids()
        .filter(|&i| costs.memory_bytes(&all, 1) <= cluster.node(i).memory_bytes)
        .collect();
    if !fit.is_empty() {
        let mut tiers: Vec<f64> = fit
            .iter()
            .map(|&i| cluster.node(i).link.bandwidth_gbps)
            .collect();
        tiers.sort_by(f64::total_cmp);
        tiers.dedup();
        for (t, &tier) in tiers.iter().enumerate().take(8) {
            let workers: Vec<NodeId> = fit
                .iter()
                .copied()
                .filter(|&i| cluster.node(i).link.bandwidth_gbps >= tier)
                .collect();
            if let Some((w, b)) = ravnest_dp(costs, &workers) {
                let note = (t > 0).then(|| {
                    format!("left out the {} node(s) with links below {tier} Gbit/s: their share does not pay for the slower ring", fit.len() - workers.len())
                });
                out.push((
                    Candidate::Data {
                        workers: w,
                        batch: b,
                        note,
                    },
                    SyncFreedom::Choose,
                ));
            }
        }
    }
    // Pipelines: S stages, R replicas. Grids dealt from nodes sorted by memory (stage 0 holds
    // the most in-flight activations) or by speed, the rank-order grid the baselines use, and
    // need-matched grids: stages ranked by their memory need under the baseline splits, the
    // largest-memory nodes given to the neediest stages.
    let n = cluster.nodes.len();
    let orders = node_orders(cluster);
    let rank: Vec<NodeId> = cluster.ids().collect();
    let params: Vec<u64> = costs.model.layers.iter().map(|x| x.params).collect();
    let m = u64::from(costs.training.micro_batch);
    for s in 2..=n.min(costs.layers()) {
        // Fewer replicas leave out the smallest / slowest nodes: R = N/S, halved down to 1.
        let mut replicas = vec![n / s];
        while *replicas.last().unwrap() > 1 {
            replicas.push(replicas.last().unwrap() / 2);
        }
        for &r in &replicas {
            let mut grids: Vec<Vec<Vec<NodeId>>> = Vec::new();
            let mut add = |g: Vec<Vec<NodeId>>| {
                if !grids.contains(&g) {
                    grids.push(g);
                }
            };
            for order in &orders {
                add((0..r)
                    .map(|rep| (0..s).map(|k| order[k * r + rep]).collect())
                    .collect());
            }
            add((0..r)
                .map(|rep| (0..s).map(|k| rank[rep * s + k]).collect())
                .collect());
            for b in [
                layers::equal_params(&params, s),
                layers::equal_layers(costs.layers(), s),
            ] {
                let need: Vec<u64> = (0..s)
                    .map(|k| costs.memory_bytes(&(b[k]..b[k + 1]), (s - k) as u64 * m))
                    .collect();
                let mut neediest: Vec<usize> = (0..s).collect();
                neediest.sort_by_key(|&k| (std::cmp::Reverse(need[k]), k));
                let mut grid = vec![vec![NodeId(0); s]; r];
                for (g, &k) in neediest.iter().enumerate() {
                    for (rep, row) in grid.iter_mut().enumerate() {
                        row[k] = orders[0][g * r + rep];
                    }
                }
                add(grid);
            }
            for grid in grids {
                pipe_candidates(costs, grid, false, &mut out);
            }
        }
    }
    out
}

fn exhaustive_candidates(costs: &Costs<'_>) -> Vec<(Candidate, SyncFreedom)> {
    let cluster = costs.cluster;
    let n = cluster.nodes.len();
    let ids: Vec<NodeId> = cluster.ids().collect();
    let mut out = Vec::new();
    // Every non-empty subset for data parallel, with the minimax split.
    for mask in 1u32..(1 << n) {
        let workers: Vec<NodeId> = ids
            .iter()
            .copied()
            .filter(|i| mask & (1 << i.0) != 0)
            .collect();
        if let Some((w, b)) = ravnest_dp(costs, &workers) {
            out.push((
                Candidate::Data {
                    workers: w,
                    batch: b,
                    note: None,
                },
                SyncFreedom::Choose,
            ));
        }
    }
    // Every arrangement of S x R distinct nodes (replicas unordered: the first replica's stage-0
    // node id increases with the replica index), every layer split up to the budget.
    for s in 2..=n.min(costs.layers()) {
        let all_splits = layers::count_splits(costs.layers(), s) <= EXHAUSTIVE_MAX_SPLITS;
        for r in 1..=n / s {
            let mut slots = vec![NodeId(0); s * r];
            let mut used = vec![false; n];
            arrange(0, &mut slots, &mut used, &ids, s, r, &mut |slots| {
                let grid: Vec<Vec<NodeId>> = slots.chunks(s).map(<[NodeId]>::to_vec).collect();
                pipe_candidates(costs, grid, all_splits, &mut out);
            });
        }
    }
    out
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
        if pos % s == 0 && pos >= s && id <= slots[pos - s] {
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

fn baseline(costs: &Costs<'_>, kind: PlannerKind) -> Result<Plan, PlanError> {
    let cluster = costs.cluster;
    let n = cluster.nodes.len();
    let ids: Vec<NodeId> = cluster.ids().collect();
    let b_total = u64::from(costs.training.global_batch);
    let dp = Candidate::Data {
        workers: ids.clone(),
        batch: batch::equal_split(b_total, n),
        note: None,
    };
    let dp_err = match evaluate(costs, &dp, SyncFreedom::Baseline) {
        Ok(mut p) => {
            p.planner = kind;
            return Ok(p);
        }
        Err(NoFit(id, need, have)) => format!(
            "equal batches of {} need {:.1} GiB on `{}`, which has {:.1} GiB",
            b_total.div_ceil(n as u64),
            need as f64 / GIB,
            cluster.node(id).name,
            have as f64 / GIB
        ),
    };
    let params: Vec<u64> = costs.model.layers.iter().map(|x| x.params).collect();
    let m = u64::from(costs.training.micro_batch);
    for s in 2..=n.min(costs.layers()) {
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
        if let Ok(mut p) = evaluate(costs, &c, SyncFreedom::Baseline) {
            p.planner = kind;
            return Ok(p);
        }
    }
    Err(PlanError::NoEqualSplit {
        planner: kind,
        detail: format!("{dp_err}; no pipeline of equal stages fits either"),
    })
}

#[cfg(test)]
mod tests;
