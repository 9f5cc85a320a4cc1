//! The cost model: how long a node computes, how much memory it needs, how long a transfer or a
//! collective takes. Every assumption is listed in `docs/cost-model.md`; in short:
//!
//! - compute time = samples × 3 × forward FLOPs ÷ the node's effective FLOP/s (backward = 2x
//!   forward, no recomputation; the optimizer update is not charged: Sailor measures it at 1–3%
//!   of a step);
//! - memory = parameters × state bytes (weights, gradients, optimizer state, fp32 master weights
//!   under mixed precision) + activations retained for backward × samples in flight;
//! - transfer time = latency + bytes ÷ bandwidth;
//! - ring all-reduce = 2(n-1)/n · S ÷ B_slowest + 2(n-1) · latency;
//! - parameter server = 2 · max((n-1) · S ÷ B_server, slowest worker's transfer of S);
//! - data-parallel gradient rounds overlap the backward pass of the slowest worker (DDP-style
//!   buckets): exposed time = max(0, round - backward); pipeline stage rounds and local-SGD
//!   averaging rounds are not overlapped; pipeline activation transfers add to the stage time.

use crate::cluster::{ClusterSpec, Link, NodeId, TrainingSpec};
use crate::layers::LayerRange;
use crate::model::{ModelSpec, state_bytes_per_param};

/// Share of a training step's compute spent in the backward pass (backward = 2x forward).
pub const BACKWARD_SHARE: f64 = 2.0 / 3.0;

/// Prefix sums over a model's layers, for O(1) range costs.
#[derive(Debug, Clone)]
pub struct Costs<'a> {
    /// The cluster.
    pub cluster: &'a ClusterSpec,
    /// The model.
    pub model: &'a ModelSpec,
    /// Training settings.
    pub training: &'a TrainingSpec,
    flops: Vec<f64>,
    params: Vec<u64>,
    acts: Vec<u64>,
    state_per_param: u64,
    elem: u64,
}

impl<'a> Costs<'a> {
    /// Build prefix sums.
    pub fn new(cluster: &'a ClusterSpec, model: &'a ModelSpec, training: &'a TrainingSpec) -> Self {
        let mut flops = vec![0.0];
        let mut params = vec![0];
        let mut acts = vec![0];
        for l in &model.layers {
            flops.push(flops.last().unwrap() + 3.0 * l.fwd_flops_per_sample);
            params.push(params.last().unwrap() + l.params);
            acts.push(acts.last().unwrap() + l.activation_elems_per_sample);
        }
        Costs {
            cluster,
            model,
            training,
            flops,
            params,
            acts,
            state_per_param: state_bytes_per_param(training.precision, training.optimizer),
            elem: training.precision.element_bytes(),
        }
    }

    /// Number of layers.
    pub fn layers(&self) -> usize {
        self.model.layers.len()
    }

    /// All layers.
    pub fn all(&self) -> LayerRange {
        LayerRange::from(0..self.layers())
    }

    /// Training FLOPs for one sample through `layers`.
    pub fn train_flops(&self, layers: LayerRange) -> f64 {
        let r = layers.range();
        self.flops[r.end] - self.flops[r.start]
    }

    /// Parameters in `layers`.
    pub fn params(&self, layers: LayerRange) -> u64 {
        let r = layers.range();
        self.params[r.end] - self.params[r.start]
    }

    /// Persistent state bytes (weights, gradients, optimizer state) for `layers`.
    pub fn state_bytes(&self, layers: LayerRange) -> u64 {
        self.params(layers) * self.state_per_param
    }

    /// Activation bytes retained per sample in flight through `layers`.
    pub fn activation_bytes_per_sample(&self, layers: LayerRange) -> u64 {
        let r = layers.range();
        (self.acts[r.end] - self.acts[r.start]) * self.elem
    }

    /// Gradient bytes to synchronize for `layers`.
    pub fn grad_bytes(&self, layers: LayerRange) -> u64 {
        self.params(layers) * self.elem
    }

    /// Bytes a stage ending just before `boundary` sends forward per sample (and receives back as
    /// gradients).
    pub fn boundary_bytes_per_sample(&self, boundary: usize) -> u64 {
        self.model.layers[boundary - 1].output_elems_per_sample * self.elem
    }

    /// Seconds for `node` to run forward+backward over `layers` for `samples` samples: the
    /// samples' FLOPs at the node's speed, plus its fixed per-step cost (its share for a layer
    /// range) when it computes anything at all.
    pub fn compute_s(&self, node: NodeId, layers: LayerRange, samples: f64) -> f64 {
        let n = self.cluster.node(node);
        let flops = self.train_flops(layers);
        let fixed = if samples > 0.0 && n.step_overhead_s > 0.0 {
            n.step_overhead_s * flops / self.train_flops(self.all()).max(f64::MIN_POSITIVE)
        } else {
            0.0
        };
        samples * flops / n.flops + fixed
    }

    /// Seconds per sample (the whole model) and fixed seconds per step of each of `nodes`: what
    /// a batch split balances.
    pub fn step_costs(&self, nodes: &[NodeId]) -> (Vec<f64>, Vec<f64>) {
        let per_sample = self.train_flops(self.all());
        nodes
            .iter()
            .map(|&w| {
                let n = self.cluster.node(w);
                (per_sample / n.flops, n.step_overhead_s.max(0.0))
            })
            .unzip()
    }

    /// Memory `layers` need with `in_flight` samples of activations.
    pub fn memory_bytes(&self, layers: LayerRange, in_flight: u64) -> u64 {
        self.state_bytes(layers) + self.activation_bytes_per_sample(layers) * in_flight
    }

    /// The link between two nodes.
    pub fn link(&self, a: NodeId, b: NodeId) -> Link {
        self.cluster.link(a, b)
    }
}

/// Ring all-reduce time over a ring whose slowest link is `bottleneck` and whose worst latency
/// is `latency_ms`: 2(n-1)/n · bytes ÷ B + 2(n-1) · latency.
pub fn ring_allreduce_s(n: usize, bytes: f64, bottleneck_gbps: f64, latency_ms: f64) -> f64 {
    if n <= 1 {
        return 0.0;
    }
    let n_f = n as f64;
    2.0 * (n_f - 1.0) / n_f * bytes * 8.0 / (bottleneck_gbps * 1e9)
        + 2.0 * (n_f - 1.0) * latency_ms / 1e3
}

/// Parameter-server time: every worker pushes `bytes` and pulls `bytes`; the server's access link
/// carries (n-1) of each direction (the server is a worker too).
pub fn param_server_s(cluster: &ClusterSpec, server: NodeId, group: &[NodeId], bytes: f64) -> f64 {
    if group.len() <= 1 {
        return 0.0;
    }
    let server_link = cluster.node(server).link;
    let through_server = (group.len() - 1) as f64 * bytes / server_link.bytes_per_s();
    let slowest_worker = group
        .iter()
        .filter(|&&w| w != server)
        .map(|&w| cluster.link(server, w).transfer_s(bytes))
        .fold(0.0, f64::max);
    2.0 * through_server.max(slowest_worker)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_formula_matches_nccl_busbw_definition() {
        // 4 nodes, 1 GB over 8 Gbit/s (1 GB/s), no latency: 2·3/4 · 1 s = 1.5 s.
        let t = ring_allreduce_s(4, 1e9, 8.0, 0.0);
        assert!((t - 1.5).abs() < 1e-12);
        assert_eq!(ring_allreduce_s(1, 1e9, 8.0, 5.0), 0.0);
        // latency term: 2(n-1) hops.
        let t = ring_allreduce_s(3, 0.0, 8.0, 10.0);
        assert!((t - 0.04).abs() < 1e-12);
    }

    #[test]
    fn a_64_mib_gradient_over_100_mbit_takes_about_5_4_s() {
        let l = Link {
            bandwidth_gbps: 0.1,
            latency_ms: 0.0,
        };
        let t = l.transfer_s(64.0 * 1024.0 * 1024.0);
        assert!((t - 5.37).abs() < 0.01, "{t}");
    }
}
