//! The resolved cluster: nodes with their memory and throughput, links between them, and the
//! training settings. Built from a `cluster.toml` by [`crate::config`], or directly in tests.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::model::{Optimizer, Precision};

/// A node's index in [`ClusterSpec::nodes`]. Stable for one cluster description.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct NodeId(pub u32);

impl NodeId {
    /// As an index into `nodes`.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// A link's figures.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Link {
    /// Bandwidth in Gbit/s (10⁹ bits per second).
    pub bandwidth_gbps: f64,
    /// One-way latency in milliseconds.
    pub latency_ms: f64,
}

impl Link {
    /// Seconds to move `bytes` over this link: latency + bytes / bandwidth.
    pub fn transfer_s(&self, bytes: f64) -> f64 {
        self.latency_ms / 1e3 + bytes * 8.0 / (self.bandwidth_gbps * 1e9)
    }

    /// Bytes per second.
    pub fn bytes_per_s(&self) -> f64 {
        self.bandwidth_gbps * 1e9 / 8.0
    }
}

/// One node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeSpec {
    /// Unique name.
    pub name: String,
    /// Catalog id of its device.
    pub device: String,
    /// Usable memory in bytes (after the framework reserve).
    pub memory_bytes: u64,
    /// Effective training throughput in FLOP/s for the run's precision.
    pub flops: f64,
    /// Seconds each step's compute costs this node whatever its batch (copying the model into
    /// tensors, kernel launches, allocations): measured by `ravnest run`, where small shares
    /// would otherwise look faster than they are; 0 for catalog devices.
    #[serde(default)]
    pub step_overhead_s: f64,
    /// The relative standard deviation of its step compute (a measured profile's; 0: steady).
    /// A data-parallel step waits for the slowest worker, so noise costs time.
    #[serde(default)]
    pub compute_spread: f64,
    /// This node's access link (pair figures are the min bandwidth / max latency of both ends).
    pub link: Link,
    /// Address for `ravnest run` (`host:port`), if given.
    pub address: Option<String>,
    /// Where this node binds, when that differs from the `address` peers dial (behind NAT, a
    /// proxy or a port forward; `0.0.0.0:PORT` on a cloud machine). Default: `address`.
    pub listen: Option<String>,
}

/// How gradients are synchronized; `Auto` lets the planner choose.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum SyncPreference {
    /// Planner chooses from the compute / communication ratio.
    #[default]
    Auto,
    /// Ring all-reduce.
    Ring,
    /// Parameter server.
    ParamServer,
    /// Local SGD (H local steps, then averaging).
    LocalSgd,
}

/// Training settings that shape the plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainingSpec {
    /// Samples per optimizer step, across the whole cluster.
    pub global_batch: u32,
    /// Micro-batch size for pipeline schedules.
    pub micro_batch: u32,
    /// Optimizer (decides state bytes per parameter).
    pub optimizer: Optimizer,
    /// Precision.
    pub precision: Precision,
    /// Gradient sync preference.
    pub sync: SyncPreference,
    /// Local SGD is chosen (under `Auto`) when communication exceeds this multiple of compute.
    pub local_sgd_threshold: f64,
    /// Data-parallel workers may accumulate gradients over micro-batches when the nodes together
    /// cannot hold the global batch at once (`false`: every batch is computed at once).
    #[serde(default = "yes")]
    pub accumulate: bool,
    /// Mean time between failures of one node, hours (`[training] node_mtbf_h`): the rate at
    /// which the planner expects to lose each node it uses, to price recovery.
    #[serde(default = "default_mtbf_h")]
    pub node_mtbf_h: f64,
    /// Whether a plan keeps two working copies of every layer for recovery's sake
    /// (`[training] redundancy`).
    #[serde(default)]
    pub redundancy: Redundancy,
    /// The steps between checkpoints a restore goes back over: the `[run]` table's
    /// `checkpoint_every_steps` (what a real run writes; its run's steps when that is 0, only
    /// the final checkpoint). A restore redoes half of it on average.
    #[serde(default = "default_checkpoint_every")]
    pub checkpoint_every_steps: u64,
    /// The kinds of layout the planner may choose from (`[training] layout`).
    #[serde(default)]
    pub layout: LayoutChoice,
    /// What a local-SGD round does with the replicas' models (`[training] outer_*`).
    #[serde(default)]
    pub outer: OuterSpec,
}

/// The outer step of local SGD: what each averaging round does with the replicas' progress
/// since the last one (DiLoCo: an outer optimizer on the averaged delta).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct OuterSpec {
    /// Plain averaging, or Nesterov momentum on the averaged delta (`outer_optimizer`).
    pub optimizer: OuterOptimizer,
    /// Outer learning rate (`outer_lr`; DiLoCo: 0.7). Ignored by plain averaging.
    pub lr: f64,
    /// Outer momentum (`outer_momentum`; DiLoCo: 0.9). Ignored by plain averaging.
    pub momentum: f64,
    /// What the round's values travel as (`outer_precision`).
    pub precision: OuterPrecision,
    /// Local steps per round, when the file pins them (`local_steps`); else the planner
    /// chooses them from the measured link.
    pub local_steps: Option<u32>,
    /// Each round's exchange overlapped with the inner steps after it, its outer step merged
    /// a few steps later (`outer_overlap`).
    #[serde(default)]
    pub overlap: bool,
    /// Steps between an overlapped round and the merge of its outer step, when the file pins
    /// them (`outer_delay`); else the planner's, from the measured link.
    #[serde(default)]
    pub delay: Option<u32>,
}

impl Default for OuterSpec {
    fn default() -> Self {
        OuterSpec {
            optimizer: OuterOptimizer::Average,
            lr: 0.7,
            momentum: 0.9,
            precision: OuterPrecision::Auto,
            local_steps: None,
            overlap: false,
            delay: None,
        }
    }
}

/// The outer optimizer of local SGD.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum OuterOptimizer {
    /// The replicas' models are averaged (weighted by batch share).
    #[default]
    Average,
    /// DiLoCo: the averaged delta from the last round's model is an outer gradient, applied
    /// with Nesterov momentum.
    Nesterov,
}

/// What an outer round's values travel as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum OuterPrecision {
    /// The planner's choice: `int8` deltas under Nesterov, exact `fp32` for plain averaging.
    #[default]
    Auto,
    /// 4 bytes a value.
    Fp32,
    /// 2 bytes a value.
    Fp16,
    /// 1 byte a value, a shared exponent per 256.
    Int8,
}

/// Which kinds of layout a plan may have (`[training] layout`): the planner's choice by the
/// objective, or one kind the user asks for (to compare kinds side by side, or to keep one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum LayoutChoice {
    /// Every kind the runtime runs; the least objective wins.
    #[default]
    Auto,
    /// Data parallel only (one worker or more), every worker holding the whole model.
    DataParallel,
    /// Pipelines only (one replica or more).
    Pipeline,
    /// Sharded data parallel only.
    Sharded,
}

impl LayoutChoice {
    /// The name in the file.
    pub fn as_str(self) -> &'static str {
        match self {
            LayoutChoice::Auto => "auto",
            LayoutChoice::DataParallel => "data-parallel",
            LayoutChoice::Pipeline => "pipeline",
            LayoutChoice::Sharded => "sharded",
        }
    }
}

fn yes() -> bool {
    true
}

/// Default [`TrainingSpec::node_mtbf_h`]: 1,000 hours per node (docs/cost-model.md says why).
pub const DEFAULT_NODE_MTBF_H: f64 = 1000.0;

fn default_mtbf_h() -> f64 {
    DEFAULT_NODE_MTBF_H
}

fn default_checkpoint_every() -> u64 {
    100
}

/// Whether a plan keeps a second working copy of every layer so that a lost node never takes
/// the only one (`[training] redundancy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum Redundancy {
    /// Priced: the planner minimizes step time plus the expected cost of recovering from lost
    /// nodes, so a second copy is kept only when it costs less per step than the restores it
    /// saves.
    #[default]
    Auto,
    /// The most redundant layout that fits, the rule before priced recovery: data parallel
    /// over two or more workers (every survivor of a loss, or of a cut-off group of nodes,
    /// holds the whole model), else two or more pipeline replicas, else one copy; within
    /// that, the least step time plus expected recovery.
    Always,
    /// Never for recovery's sake: the fastest plan by step time alone (its recovery cost is
    /// still reported).
    Never,
}

impl Redundancy {
    /// The name in the file.
    pub fn as_str(self) -> &'static str {
        match self {
            Redundancy::Auto => "auto",
            Redundancy::Always => "always",
            Redundancy::Never => "never",
        }
    }
}

impl Default for TrainingSpec {
    fn default() -> Self {
        TrainingSpec {
            global_batch: 256,
            micro_batch: 8,
            optimizer: Optimizer::Adamw,
            precision: Precision::Fp32,
            sync: SyncPreference::Auto,
            local_sgd_threshold: 3.0,
            accumulate: true,
            node_mtbf_h: DEFAULT_NODE_MTBF_H,
            redundancy: Redundancy::Auto,
            checkpoint_every_steps: default_checkpoint_every(),
            layout: LayoutChoice::Auto,
            outer: OuterSpec::default(),
        }
    }
}

/// The cluster as the planner sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClusterSpec {
    /// Name for reports.
    pub name: String,
    /// Nodes; `NodeId(i)` is `nodes[i]`.
    pub nodes: Vec<NodeSpec>,
    /// Per-pair overrides, keyed by (smaller id, larger id).
    pub pair_links: BTreeMap<(NodeId, NodeId), Link>,
}

impl ClusterSpec {
    /// The link between two distinct nodes.
    pub fn link(&self, a: NodeId, b: NodeId) -> Link {
        let key = if a <= b { (a, b) } else { (b, a) };
        if let Some(l) = self.pair_links.get(&key) {
            return *l;
        }
        let (la, lb) = (self.nodes[a.index()].link, self.nodes[b.index()].link);
        Link {
            bandwidth_gbps: la.bandwidth_gbps.min(lb.bandwidth_gbps),
            latency_ms: la.latency_ms.max(lb.latency_ms),
        }
    }

    /// All node ids in order.
    pub fn ids(&self) -> impl Iterator<Item = NodeId> + '_ {
        (0..self.nodes.len() as u32).map(NodeId)
    }

    /// The node for an id.
    pub fn node(&self, id: NodeId) -> &NodeSpec {
        &self.nodes[id.index()]
    }

    /// The sub-cluster of `ids` (in that order): node k of the result is `ids[k]` here, and
    /// pair links between kept nodes are kept.
    pub fn subset(&self, ids: &[NodeId]) -> ClusterSpec {
        let pos: BTreeMap<NodeId, NodeId> = ids
            .iter()
            .enumerate()
            .map(|(k, &i)| (i, NodeId(k as u32)))
            .collect();
        ClusterSpec {
            name: self.name.clone(),
            nodes: ids.iter().map(|&i| self.node(i).clone()).collect(),
            pair_links: self
                .pair_links
                .iter()
                .filter_map(|(&(a, b), l)| {
                    let (a, b) = (*pos.get(&a)?, *pos.get(&b)?);
                    Some(((a.min(b), a.max(b)), *l))
                })
                .collect(),
        }
    }

    /// Whether any per-pair override exists (then ring order matters beyond access links).
    pub fn has_pair_links(&self) -> bool {
        !self.pair_links.is_empty()
    }
}
