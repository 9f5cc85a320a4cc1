//! The file as written: the serde structures of the TOML tables, each value with its place in
//! the file, and the names that some fields accept. A leaf: no checks here, those are in the
//! resolution of each table.

use serde::Deserialize;
use toml::Spanned;

use crate::cluster::{Redundancy, SyncPreference};
use crate::model::{Optimizer, Precision};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FileToml {
    pub(super) cluster: Option<ClusterToml>,
    pub(super) links: Option<LinksToml>,
    #[serde(default)]
    pub(super) node: Vec<Spanned<NodeToml>>,
    pub(super) model: Option<Spanned<ModelToml>>,
    pub(super) training: Option<TrainingToml>,
    pub(super) run: Option<RunToml>,
    pub(super) sim: Option<SimToml>,
    #[serde(default)]
    pub(super) fault: Vec<Spanned<FaultToml>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ClusterToml {
    pub(super) name: Option<String>,
    pub(super) secret: Option<String>,
    pub(super) coordinator: Option<Spanned<String>>,
    pub(super) transport: Option<Spanned<String>>,
    pub(super) relays: Option<Vec<Spanned<String>>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct LinksToml {
    pub(super) bandwidth_gbps: Option<Spanned<f64>>,
    pub(super) latency_ms: Option<Spanned<f64>>,
    #[serde(default)]
    pub(super) pair: Vec<Spanned<PairToml>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct PairToml {
    pub(super) between: Spanned<Vec<Spanned<String>>>,
    pub(super) bandwidth_gbps: Option<Spanned<f64>>,
    pub(super) latency_ms: Option<Spanned<f64>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct NodeToml {
    pub(super) name: Spanned<String>,
    pub(super) device: Spanned<String>,
    pub(super) count: Option<Spanned<u32>>,
    pub(super) memory_gib: Option<Spanned<f64>>,
    pub(super) tflops: Option<Spanned<f64>>,
    pub(super) bandwidth_gbps: Option<Spanned<f64>>,
    pub(super) latency_ms: Option<Spanned<f64>>,
    pub(super) address: Option<Spanned<String>>,
    pub(super) listen: Option<Spanned<String>>,
    pub(super) emulate_slowdown: Option<Spanned<f64>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ModelToml {
    pub(super) preset: Option<Spanned<String>>,
    pub(super) kind: Option<Spanned<String>>,
    pub(super) name: Option<String>,
    // a Hugging Face folder
    pub(super) from: Option<Spanned<String>>,
    pub(super) init: Option<Spanned<String>>,
    // gpt
    pub(super) layers: Option<Spanned<u32>>,
    pub(super) hidden: Option<Spanned<u64>>,
    pub(super) heads: Option<Spanned<u64>>,
    pub(super) seq_len: Option<Spanned<u64>>,
    pub(super) vocab: Option<Spanned<u64>>,
    pub(super) flash_attention: Option<bool>,
    // mlp
    pub(super) dims: Option<Spanned<Vec<u64>>>,
    // custom
    #[serde(default)]
    pub(super) layer: Vec<Spanned<LayerToml>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct LayerToml {
    pub(super) name: String,
    pub(super) params: Spanned<u64>,
    pub(super) fwd_flops_per_sample: Spanned<f64>,
    pub(super) activation_elems_per_sample: Spanned<u64>,
    pub(super) output_elems_per_sample: Spanned<u64>,
    pub(super) repeat: Option<Spanned<u32>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct TrainingToml {
    pub(super) global_batch: Option<Spanned<u32>>,
    pub(super) micro_batch: Option<Spanned<u32>>,
    pub(super) optimizer: Option<Optimizer>,
    pub(super) precision: Option<Precision>,
    pub(super) sync: Option<SyncPreference>,
    pub(super) local_sgd_threshold: Option<Spanned<f64>>,
    pub(super) accumulate: Option<bool>,
    pub(super) memory_reserve_gib: Option<Spanned<f64>>,
    pub(super) node_mtbf_h: Option<Spanned<f64>>,
    pub(super) redundancy: Option<Redundancy>,
    pub(super) layout: Option<crate::cluster::LayoutChoice>,
    pub(super) outer_optimizer: Option<crate::cluster::OuterOptimizer>,
    pub(super) outer_lr: Option<Spanned<f64>>,
    pub(super) outer_momentum: Option<Spanned<f64>>,
    pub(super) outer_precision: Option<Spanned<crate::cluster::OuterPrecision>>,
    pub(super) local_steps: Option<Spanned<u32>>,
    pub(super) outer_overlap: Option<bool>,
    pub(super) outer_delay: Option<Spanned<u32>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RunToml {
    pub(super) steps: Option<Spanned<u64>>,
    pub(super) learning_rate: Option<Spanned<f64>>,
    pub(super) momentum: Option<Spanned<f64>>,
    pub(super) weight_decay: Option<Spanned<f64>>,
    pub(super) seed: Option<u64>,
    pub(super) dataset: Option<String>,
    pub(super) network: Option<Spanned<String>>,
    pub(super) context_chars: Option<Spanned<u64>>,
    pub(super) char_hidden: Option<Spanned<u64>>,
    pub(super) checkpoint_every_steps: Option<u64>,
    pub(super) target_accuracy: Option<Spanned<f64>>,
    pub(super) target_bits_per_byte: Option<Spanned<f64>>,
    pub(super) heartbeat_ms: Option<Spanned<u64>>,
    pub(super) heartbeat_timeout_ms: Option<Spanned<u64>>,
    pub(super) min_nodes: Option<Spanned<u64>>,
    pub(super) register_timeout_s: Option<Spanned<u64>>,
    pub(super) lr_schedule: Option<crate::recipe::ScheduleKind>,
    pub(super) warmup_steps: Option<Spanned<u64>>,
    pub(super) min_lr: Option<Spanned<f64>>,
    pub(super) decay_steps: Option<Spanned<u64>>,
    pub(super) dataset_field: Option<String>,
    pub(super) dataset_dtype: Option<Spanned<String>>,
    pub(super) eval_dataset: Option<String>,
    pub(super) eval_fraction: Option<Spanned<f64>>,
    pub(super) eval_every_steps: Option<Spanned<u64>>,
    pub(super) max_grad_norm: Option<Spanned<f64>>,
}

pub(super) const NETWORKS: &[&str] = &["mlp", "cnn", "char", "gpt"];

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct SimToml {
    pub(super) seed: Option<u64>,
    pub(super) steps: Option<Spanned<u64>>,
    pub(super) checkpoint_every_steps: Option<u64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FaultToml {
    pub(super) kind: Spanned<String>,
    pub(super) node: Option<Spanned<String>>,
    pub(super) between: Option<Spanned<Vec<Spanned<String>>>>,
    pub(super) groups: Option<Spanned<Vec<Vec<Spanned<String>>>>>,
    pub(super) at_s: Option<Spanned<f64>>,
    pub(super) from_s: Option<Spanned<f64>>,
    pub(super) to_s: Option<Spanned<f64>>,
    pub(super) factor: Option<Spanned<f64>>,
    pub(super) bandwidth_gbps: Option<Spanned<f64>>,
    pub(super) latency_ms: Option<Spanned<f64>>,
}

pub(super) const FAULT_KINDS: &[&str] =
    &["crash", "restart", "slowdown", "link", "reset", "partition"];
pub(super) const MODEL_KINDS: &[&str] = &["gpt", "mlp", "custom"];
